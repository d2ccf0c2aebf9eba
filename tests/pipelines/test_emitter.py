"""The emitter SDK against a real broker: what an engine emits is what a consumer reads, in order per
request; emit() never blocks; every event is accounted for, through full buffers and broker restarts."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import defaultdict

import pytest
from hypothesis import given

from pipelines.broker import LocalBroker, free_port
from pipelines.emitter import Emitter, EmitterStats, event_key
from pipelines.kafka_config import BrokerUnreachableError, KafkaConfig
from schemas.arrow import events_to_table
from schemas.validate import validate_record
from schemas.wire import decode_json, encode_event
from servelens.errors import ConfigError
from tests.pipelines.conftest import NUM_TEST_PARTITIONS, consume, sample_events
from tests.strategies import any_event


def _decoded(record):
    value, reason, message = decode_json(record.value)
    assert reason is None, message
    result = validate_record(value)
    assert result.errors == (), [e.render() for e in result.errors]
    return result.event


def _settled(stats: EmitterStats) -> bool:
    return stats.num_emitted == stats.num_sent + stats.num_failed and stats.num_pending == 0


def test_emitted_events_are_consumed_back_valid_and_equal(broker, topic):
    events = sample_events(num_requests=6)
    with Emitter(broker.bootstrap, topic, linger_ms=5) as emitter:
        assert all(emitter.emit(e) for e in events)
        assert emitter.flush(timeout_s=10)
        stats = emitter.stats()
    assert stats == EmitterStats(len(events), len(events), 0, 0, 0, None)
    records = consume(broker.bootstrap, topic, len(events))
    by_id = {e.event_id: e for e in events}
    for record in records:
        event = _decoded(record)
        assert event == by_id[event.event_id]
        assert record.value == encode_event(event)  # the wire form, byte for byte
        assert record.key == event_key(event)
    assert {_decoded(r).event_id for r in records} == set(by_id)
    # engine-level events are keyed by their instance, so one instance's steps share a partition too
    steps = [r for r in records if _decoded(r).event_type == "step_executed"]
    assert {r.key for r in steps} == {b"inst-0"} and len({r.partition for r in steps}) == 1


def test_each_requests_events_stay_in_one_partition_in_emit_order(broker, topic):
    events = sample_events(num_requests=40, num_deliveries=20)
    with Emitter(broker.bootstrap, topic, linger_ms=2, batch_bytes=4096) as emitter:  # many small batches
        for e in events:
            emitter.emit(e)
        assert emitter.flush(timeout_s=15)
    records = consume(broker.bootstrap, topic, len(events))
    emit_rank = {e.event_id: i for i, e in enumerate(events)}
    per_request = defaultdict(list)
    for record in records:  # sorted by (partition, offset)
        per_request[record.key].append(record)
    assert len(per_request) == 40 + 1  # 40 requests and the instance's engine-level events
    for key, group in per_request.items():
        assert len({r.partition for r in group}) == 1, key
        ranks = [emit_rank[_decoded(r).event_id] for r in group]
        assert ranks == sorted(ranks), key
    assert len({r.partition for r in records}) > 1  # the requests did spread over partitions


def test_emit_table_sends_the_same_wire_records(broker, topic):
    events = sample_events(num_requests=4)
    with Emitter(broker.bootstrap, topic) as emitter:
        assert emitter.emit_table(events_to_table(events)) == len(events)
        assert emitter.flush(timeout_s=10)
    records = consume(broker.bootstrap, topic, len(events))
    assert sorted((r.key, r.value) for r in records) == sorted((event_key(e), encode_event(e)) for e in events)


def test_a_full_buffer_drops_and_counts_and_emit_never_blocks():
    emitter = Emitter(f"127.0.0.1:{free_port()}", "nowhere", max_buffered_events=100)  # never started: no drain
    events = sample_events(num_requests=1)
    worst_s, accepted = 0.0, []
    started = time.perf_counter()
    for i in range(10_000):
        t0 = time.perf_counter()
        accepted.append(emitter.emit(events[i % len(events)]))
        worst_s = max(worst_s, time.perf_counter() - t0)
    total_s = time.perf_counter() - started
    assert accepted.count(True) == 100 and accepted[:100] == [True] * 100 and not any(accepted[100:])
    assert total_s < 0.5 and worst_s < 0.05, (total_s, worst_s)
    stats = emitter.stats()
    assert (stats.num_emitted, stats.num_dropped, stats.num_pending) == (100, 9_900, 100)
    final = emitter.close(timeout_s=0)  # never delivered: counted as failed, not lost
    assert (final.num_failed, final.num_pending, final.num_dropped) == (100, 0, 9_900)
    assert "still buffered at close" in final.last_error
    assert emitter.emit(events[0]) is False and emitter.stats().num_dropped == 9_901  # closed: refused, counted


def test_an_unreachable_broker_at_start_up_is_a_clear_bounded_error():
    bootstrap = f"127.0.0.1:{free_port()}"
    emitter = Emitter(bootstrap, "servelens.events.v1", connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(BrokerUnreachableError) as caught:
        emitter.start()
    assert time.monotonic() - started < 4.0
    message = str(caught.value)
    assert bootstrap in message and "within 1 s" in message and "servelens broker" in caught.value.hint
    assert not [t for t in threading.enumerate() if t.name.startswith("servelens-emitter")]


def _wait_for_log(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"no log record with {text!r} within {timeout_s} s"
        time.sleep(0.005)


def test_emitter_recovers_when_the_broker_restarts_on_the_same_port(caplog):
    """Events emitted while the broker is down are delivered once it is back on the same port.

    Tansu's memory storage comes back empty, so ``LocalBroker(topics=...)`` creates the topic again
    within milliseconds of the restart. A producer that reached the empty broker first would get
    Tansu's non-retriable errors (see ``pipelines.broker``), so the broker restarts only once the
    producer has found it gone (a refused connection), and a first reconnection pause of 1 s keeps
    the producer away until the topic exists, as an operator would set for a restarting broker.
    """
    caplog.set_level(logging.ERROR, logger="kafka")
    topic = "servelens.events.v1"
    events = sample_events(num_requests=9)
    first, during, after = events[:30], events[30:60], events[60:]
    with LocalBroker(topics={topic: NUM_TEST_PARTITIONS}) as local:
        emitter = Emitter(local.bootstrap, topic, linger_ms=5, delivery_timeout_ms=20_000, reconnect_backoff_ms=1_000)
        with emitter:
            for e in first:
                emitter.emit(e)
            assert emitter.flush(timeout_s=10) and emitter.stats().num_sent == len(first)
            local.stop()
            started = time.perf_counter()
            assert all(emitter.emit(e) for e in during)  # the broker is down: still instant
            assert time.perf_counter() - started < 0.1
            _wait_for_log(caplog, "ECONNREFUSED")
            local.start()
            assert emitter.flush(timeout_s=15)
            assert emitter.stats().num_sent == len(first) + len(during)
            for e in after:
                emitter.emit(e)
            assert emitter.flush(timeout_s=10)
            stats = emitter.stats()
        assert stats == EmitterStats(len(events), len(events), 0, 0, 0, None)
        records = consume(local.bootstrap, topic, len(during) + len(after))  # the first ones died with the broker
    assert {_decoded(r).event_id for r in records} == {e.event_id for e in during + after}


def test_events_undeliverable_within_the_delivery_timeout_are_counted_failed():
    with LocalBroker(topics={"t": 2}) as local:
        emitter = Emitter(local.bootstrap, "t", linger_ms=5, delivery_timeout_ms=1_000).start()
        local.stop()
        events = sample_events(num_requests=2)
        for e in events:
            emitter.emit(e)
        assert emitter.flush(timeout_s=10)
        stats = emitter.close(timeout_s=2)
    assert (stats.num_emitted, stats.num_sent, stats.num_failed) == (len(events), 0, len(events))
    assert _settled(stats) and "Timeout" in stats.last_error


def test_close_with_the_broker_down_counts_what_is_left_as_failed_within_its_timeout():
    with LocalBroker(topics={"t": 2}) as local:
        emitter = Emitter(local.bootstrap, "t", delivery_timeout_ms=60_000).start()
        local.stop()
        events = sample_events(num_requests=2)
        for e in events:
            emitter.emit(e)
        started = time.monotonic()
        stats = emitter.close(timeout_s=0.5)
        assert time.monotonic() - started < 2.0
    assert (stats.num_emitted, stats.num_sent, stats.num_failed) == (len(events), 0, len(events))
    assert _settled(stats) and stats.last_error
    assert not [t for t in threading.enumerate() if t.name.startswith("servelens-emitter")]
    assert emitter.close() == stats  # idempotent


def test_from_config_and_bad_settings(broker, topic):
    config = KafkaConfig(bootstrap_servers=broker.bootstrap, topic=topic, compression="gzip", linger_ms=1)
    events = sample_events(num_requests=1)
    with Emitter.from_config(config) as emitter:
        for e in events:
            emitter.emit(e)
        assert emitter.flush(timeout_s=10)
    assert [_decoded(r) for r in consume(broker.bootstrap, topic, len(events))]
    with pytest.raises(ConfigError, match="compression") as caught:
        Emitter(broker.bootstrap, topic, compression="brotli")
    assert "zstd" in caught.value.hint
    with pytest.raises(ConfigError, match="max_buffered_events"):
        Emitter(broker.bootstrap, topic, max_buffered_events=0)


def test_kafka_config_fields_all_have_help_text():
    for field in dataclasses.fields(KafkaConfig):
        assert len(field.metadata.get("doc", "").split()) >= 4, field.name
    assert KafkaConfig().topic == "servelens.events.v1" and KafkaConfig().compression == "zstd"


def test_kcat_reads_what_the_emitter_wrote(broker, topic, kcat):
    """A C client (librdkafka) decodes the emitter's zstd batches, keys and values intact."""
    events = sample_events(num_requests=5)
    with Emitter(broker.bootstrap, topic, compression="zstd") as emitter:
        for e in events:
            emitter.emit(e)
        assert emitter.flush(timeout_s=10)
    out = kcat("-b", broker.bootstrap, "-t", topic, "-C", "-o", "beginning", "-e", "-q", "-J")
    messages = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(messages) == len(events)
    assert sorted((m["key"], m["payload"]) for m in messages) == sorted(
        (event_key(e).decode(), encode_event(e).decode()) for e in events
    )


@given(any_event)
def test_every_event_has_a_key_and_a_wire_form(event):
    expected = next((v for v in (event.request_id, event.instance_id) if v), event.engine_id)
    assert event_key(event) == expected.encode()
    assert validate_record(json.loads(encode_event(event))).event == event


def test_a_strict_emitter_refuses_at_emit_what_ingest_would_dead_letter():
    """The issue's cases: a string count, a negative count, a timestamp 10,000 s ahead; each named at emit()."""
    from pipelines.emitter import InvalidEventError
    from schemas.events import RequestArrived

    now = time.time_ns()
    good = dict(event_id="e1", ts_ns=now, engine_id="engine", request_id="req-1", num_prompt_tokens=12)
    strict, lenient = Emitter("127.0.0.1:1", "t", strict=True), Emitter("127.0.0.1:1", "t")
    for change, words in (({"num_prompt_tokens": "12"}, "$.num_prompt_tokens: wrong type"),
                          ({"num_prompt_tokens": -3}, "$.num_prompt_tokens: out of range"),
                          ({"ts_ns": now + 10_000 * 10**9}, "$.ts_ns: clock skew: 10,000 s ahead")):
        event = RequestArrived(**{**good, **change})
        with pytest.raises(InvalidEventError) as err:
            strict.emit(event)
        assert words in str(err.value) and isinstance(err.value, ValueError)
        assert lenient.emit(event)  # not strict: buffered, as before (ingest dead-letters it)
    assert strict.emit(RequestArrived(**good)) and strict.stats().num_emitted == 1
