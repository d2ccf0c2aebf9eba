"""The local broker: a real Tansu process that Kafka clients (Python and C) talk to, stopped and restarted."""

from __future__ import annotations

import os
import time

import pytest
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient

from pipelines.broker import BrokerError, LocalBroker, answers_kafka, ensure_topics, free_port, tansu_binary
from pipelines.kafka_config import BrokerUnreachableError
from schemas.validate import validate_record
from schemas.wire import decode_json, encode_event
from tests.pipelines.conftest import consume, sample_events


def test_session_broker_answers_kafka(broker):
    assert broker.running and broker.bootstrap == f"127.0.0.1:{broker.port}"
    assert answers_kafka(broker.host, broker.port)
    assert os.access(tansu_binary(), os.X_OK)


def test_ensure_topics_creates_only_the_missing_ones(broker):
    first, second = f"t.first.{free_port()}", f"t.second.{free_port()}"
    assert ensure_topics(broker.bootstrap, {first: 8}) == (first,)
    assert ensure_topics(broker.bootstrap, {first: 8, second: 2}) == (second,)
    assert ensure_topics(broker.bootstrap, {first: 8, second: 2}) == ()
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    try:
        assert consumer.partitions_for_topic(first) == set(range(8))
        assert consumer.partitions_for_topic(second) == {0, 1}
    finally:
        consumer.close()


def test_stop_is_prompt_and_restart_gives_an_empty_broker_on_the_same_port():
    with LocalBroker() as local:
        port = local.port
        ensure_topics(local.bootstrap, {"kept.nowhere": 2})
        admin = KafkaAdminClient(bootstrap_servers=local.bootstrap)  # a connected client
        try:
            started = time.monotonic()
            assert local.stop() == 0  # SIGINT: clean exit, without waiting for clients to leave
            assert time.monotonic() - started < 2.0
            assert not local.running and not answers_kafka(local.host, port)
            local.start()
            assert local.port == port and local.num_starts == 2 and answers_kafka(local.host, port)
            assert "kept.nowhere" not in admin.list_topics()  # memory storage: the restart is empty
        finally:
            admin.close()
    assert not local.running
    assert local.stop() is None  # idempotent


def test_a_port_in_use_is_a_clear_error(broker):
    with pytest.raises(BrokerError, match="in use") as caught:
        LocalBroker(port=broker.port).start()
    assert caught.value.hint


def test_ensure_topics_without_a_broker_is_a_clear_error():
    bootstrap = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BrokerUnreachableError, match=bootstrap) as caught:
        ensure_topics(bootstrap, {"x": 1}, timeout_s=0.5)
    assert time.monotonic() - started < 3.0
    assert "servelens broker" in caught.value.hint


def test_kcat_produces_and_kafka_python_consumes(broker, topic, kcat):
    """A C client (librdkafka via kcat) writes keyed, zstd-compressed events; kafka-python reads them."""
    events = sample_events(num_requests=5)
    lines = b"".join(e.request_id.encode() + b"\t" + encode_event(e) + b"\n" for e in events if e.request_id)
    sent = [e for e in events if e.request_id]
    kcat("-b", broker.bootstrap, "-t", topic, "-P", "-K", "\t", "-z", "zstd", stdin=lines)
    records = consume(broker.bootstrap, topic, len(sent))
    got = []
    for record in records:
        value, reason, _ = decode_json(record.value)
        assert reason is None
        result = validate_record(value)
        assert result.errors == () and record.key == result.event.request_id.encode()
        got.append(result.event)
    assert sorted(got, key=lambda e: e.event_id) == sorted(sent, key=lambda e: e.event_id)
