"""Kafka fixtures: one real Tansu broker per test session (no mocks), fresh topics, a plain consumer, kcat."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipelines.broker import LocalBroker, ensure_topics
from schemas.events import (
    AdmissionDecided,
    Event,
    FirstToken,
    InstanceState,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    RequestPreempted,
    StepExecuted,
    TokensDelivered,
)

NUM_TEST_PARTITIONS = 4


def sample_events(num_requests: int = 3, *, num_deliveries: int = 3, t0_ns: int = 1_700_000_000 * 10**9) -> list[Event]:
    """Every event type in the order an engine emits them: per request arrival, admission, a step,
    tokens and finish; one request in three preempted, one in five cancelled; instance states around."""
    common = {"engine_id": "eng-0", "instance_id": "inst-0", "model": "llama-3-8b"}
    state = {"num_kv_blocks_total": 4096, "kv_block_size_tokens": 16, "resident_models": ["llama-3-8b"]}
    events: list[Event] = [
        InstanceState(event_id="is-up", ts_ns=t0_ns, state="ready", resident_adapters=[], **state, **common)
    ]
    for i in range(num_requests):
        rid, t = f"req-{i:04d}", t0_ns + i * 1_000_000
        req = {"request_id": rid, "tenant": f"tenant-{i % 3}", "service_class": "interactive", **common}
        events += [
            RequestArrived(
                event_id=f"{rid}:a", ts_ns=t, num_prompt_tokens=100 + i, max_output_tokens=64,
                prefix_block_ids=[7, 8, i], user_agent="curl/8 ünïcode", **req,
            ),
            AdmissionDecided(
                event_id=f"{rid}:d", ts_ns=t + 10, decision="accept", predicted_output_tokens_low=8,
                predicted_output_tokens_high=64, **req,
            ),
            StepExecuted(
                event_id=f"{rid}:s", ts_ns=t + 200, step_index=i, start_ns=t + 100, end_ns=t + 200,
                num_prefill_tokens=100 + i, num_decode_seqs=0, request_ids=[rid], request_num_tokens=[100 + i],
                num_kv_blocks_used=i, num_kv_blocks_free=4096 - i, **common,
            ),
            FirstToken(event_id=f"{rid}:f", ts_ns=t + 210, first_byte_ns=t + 215, **req),
        ]
        if i % 3 == 1:
            events.append(
                RequestPreempted(
                    event_id=f"{rid}:p", ts_ns=t + 220, mode="recompute", lease_generation=1, num_lost_tokens=101, **req
                )
            )
        events += [
            TokensDelivered(
                event_id=f"{rid}:t{k}", ts_ns=t + 300 + k, num_tokens=1 + k % 2, coalesced=k % 2 == 1, **req
            )
            for k in range(num_deliveries)
        ]
        cancelled = i % 5 == 4
        if cancelled:
            events.append(RequestCancelled(event_id=f"{rid}:c", ts_ns=t + 400, **req))
        outcome = "cancelled" if cancelled else "completed"
        num_output_tokens = 1 + num_deliveries
        events.append(
            RequestFinished(
                event_id=f"{rid}:z", ts_ns=t + 500, outcome=outcome, num_output_tokens=num_output_tokens, **req
            )
        )
    events.append(
        InstanceState(
            event_id="is-drain", ts_ns=t0_ns + num_requests * 1_000_000, state="draining",
            resident_adapters=["lora-a"], scale_action="scale_down", **state, **common,
        )
    )
    return events


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A Tansu broker on a free loopback port for the whole session (memory storage)."""
    with LocalBroker(log_path=tmp_path_factory.mktemp("broker") / "tansu.log") as running:
        yield running


@pytest.fixture
def topic(broker: LocalBroker, request: pytest.FixtureRequest) -> str:
    """A new topic with ``NUM_TEST_PARTITIONS`` partitions, named after the test."""
    name = "test." + re.sub(r"[^a-zA-Z0-9_-]", "-", request.node.name)[:60] + "." + uuid.uuid4().hex[:8]
    assert ensure_topics(broker.bootstrap, {name: NUM_TEST_PARTITIONS}) == (name,)
    return name


def consume(bootstrap: str, topic: str, num_records: int, timeout_s: float = 10.0) -> list:
    """Read ``num_records`` records from every partition of ``topic`` with a plain kafka-python consumer.

    Manual ``assign()`` (no consumer group: Tansu's group join is slow), from the beginning; returns
    the records sorted by (partition, offset). Fails when fewer arrive before the deadline.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        partitions = consumer.partitions_for_topic(topic)
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        consumer.seek_to_beginning()
        records: list = []
        deadline = time.monotonic() + timeout_s
        while len(records) < num_records and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=100, max_records=10_000).values():
                records.extend(batch)
        extra = consumer.poll(timeout_ms=100)  # nothing beyond what was expected
        records.extend(r for batch in extra.values() for r in batch)
    finally:
        consumer.close()
    assert len(records) == num_records, f"consumed {len(records)} records from {topic}, expected {num_records}"
    return sorted(records, key=lambda r: (r.partition, r.offset))


@pytest.fixture(scope="session")
def kcat(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., bytes]:
    """Run Debian's kcat, a C client (librdkafka), for cross-checks: kcat(*args, stdin=...) -> stdout.

    ``make env`` installs kcat. Debian 12's librdkafka 2.0.2 misreads the tagged fields of Tansu's
    ApiVersions v3 response ("Protocol read buffer underflow for ApiVersion v3"), so kcat runs with
    the current librdkafka that the confluent-kafka wheel (a dev dependency) ships, when it is there.
    """
    path = shutil.which("kcat")
    if path is None:
        pytest.fail("kcat is not installed: run 'make env' (it installs Debian's kcat) or 'apt-get install kcat'")
    env = dict(os.environ)
    lib = _wheel_librdkafka()
    if lib is not None:
        lib_dir = tmp_path_factory.mktemp("librdkafka")
        (lib_dir / "librdkafka.so.1").symlink_to(lib)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib_dir), env.get("LD_LIBRARY_PATH")]))

    def run_kcat(*args: str, stdin: bytes | None = None, timeout_s: float = 20.0) -> bytes:
        import subprocess

        done = subprocess.run(
            [path, *args], input=stdin, capture_output=True, env=env, timeout=timeout_s, check=False
        )
        assert done.returncode == 0, f"kcat {' '.join(args)} failed: {done.stderr.decode(errors='replace')[-2000:]}"
        return done.stdout

    return run_kcat


def _wheel_librdkafka() -> Path | None:
    try:
        files = importlib.metadata.files("confluent-kafka") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if re.fullmatch(r"confluent_kafka\.libs/librdkafka[-.\w]*\.so\.1", str(file)):
            return Path(file.locate()).resolve()
    return None
