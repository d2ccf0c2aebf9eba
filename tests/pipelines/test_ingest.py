"""The ingest consumer against a real broker: exactly once through crashes, rebalances and resets."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines.broker import LocalBroker, ensure_topics, free_port
from pipelines.config import IngestConfig, LakeConfig
from pipelines.emitter import Emitter
from pipelines.ingest import IngestConsumer, read_statuses
from pipelines.kafka_config import KafkaConfig
from pipelines.lake import DEAD_LETTERS, EVENTS, Lake
from pipelines.retries import RecentIds
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from schemas.events import RequestArrived
from schemas.wire import encode_event
from tests.pipelines.conftest import NUM_TEST_PARTITIONS, consume, sample_events

KEYRING = KeyRing("test", {"test": bytes(range(32))})
KEY_ENV = {"SERVELENS_PSEUDONYM_KEY": "test:" + base64.b64encode(bytes(range(32))).decode()}
FAST = IngestConfig(session_timeout_ms=2_000, heartbeat_interval_ms=500, flush_interval_s=0.3, status_interval_s=0.5)


def consumer(bootstrap: str, topic: str, root: Path, name: str = "c1", lake: LakeConfig | None = None, **ingest) -> IngestConsumer:
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic=topic, num_partitions=NUM_TEST_PARTITIONS,
                        dead_letter_topic=f"{topic}.dead")
    config = dataclasses.replace(FAST, **{"group_id": f"ingest-{topic}", **ingest})  # a group per test's topic
    lake = dataclasses.replace(lake or LakeConfig(), root=str(root))
    return IngestConsumer(kafka, config, lake, PrivacyConfig(), KEYRING, consumer_name=name)


def produce(bootstrap: str, topic: str, items) -> int:
    """Send (key, value) pairs with a plain producer; return how many (all acknowledged)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=256_000, compression_type="zstd",
                             retries=10, max_in_flight_requests_per_connection=1)
    failures = []
    count = 0
    for key, value in items:
        producer.send(topic, key=key, value=value).add_errback(failures.append)
        count += 1
    producer.flush(60)
    producer.close()
    assert not failures, f"{len(failures)} sends failed: {failures[:3]}"
    return count


def run_until(ingest: IngestConsumer, root: Path, expected: int, timeout_s: float = 60.0) -> threading.Thread:
    """Run ``ingest`` on a thread and stop it once the lake holds ``expected`` rows (or at the timeout)."""
    thread = threading.Thread(target=ingest.run)

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _stored(root) < expected:
            time.sleep(0.1)
        ingest.stop()

    thread.start()
    threading.Thread(target=watch, daemon=True).start()
    return thread


def arrivals(start: int, n: int) -> list[tuple[bytes, bytes]]:
    return [
        (f"r{i}".encode(), encode_event(RequestArrived(event_id=f"e{i}", ts_ns=1_764_000_000_000_000_000 + i,
                                                       engine_id="eng", request_id=f"r{i}", num_prompt_tokens=i % 4096)))
        for i in range(start, start + n)
    ]


def pseudonyms(event_ids) -> list[str]:
    return KEYRING.pseudonyms("ev", list(event_ids), hex_chars=32)


def lake_counts(root: Path) -> tuple[int, int]:
    (total, distinct) = Lake(root).connect().execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone()
    return total, distinct


def _stored(root: Path) -> int:
    return lake_counts(root)[0] if Lake(root).table(EVENTS) is not None else 0


def lake_ids(root: Path) -> list[str]:
    return [r[0] for r in Lake(root).connect().execute("SELECT event_id FROM events").fetchall()]


# ------------------------------------------------------------------------------------------ basics


def test_events_from_the_emitter_sdk_land_sanitized_exactly_once(broker, topic, tmp_path):
    events = sample_events(40)
    with Emitter(broker.bootstrap, topic) as emitter:
        for event in events:
            assert emitter.emit(event)
        assert emitter.flush(10)
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake").run(idle_exit_s=1.5)
    assert stats.events_written == len(events) and stats.dead_letters == 0
    assert sorted(lake_ids(tmp_path / "lake")) == sorted(pseudonyms(e.event_id for e in events))
    con = Lake(tmp_path / "lake").connect()
    tenants = {r[0] for r in con.execute("SELECT DISTINCT tenant FROM events WHERE tenant IS NOT NULL").fetchall()}
    assert tenants and all(t.startswith("tn_") for t in tenants)  # sanitized: no raw tenant ids
    (num_requests,) = con.execute("SELECT count(*) FROM requests").fetchone()
    assert num_requests == 40
    outcomes = dict(con.execute("SELECT outcome, count(*) FROM requests GROUP BY 1").fetchall())
    assert outcomes == {"completed": 32, "cancelled": 8}


def test_events_produced_by_kcat_a_c_client_are_ingested(broker, topic, tmp_path, kcat):
    events = sample_events(10)
    lines = b"".join((e.request_id or e.instance_id).encode() + b"\t" + encode_event(e) + b"\n" for e in events)
    kcat("-b", broker.bootstrap, "-t", topic, "-P", "-K", "\t", stdin=lines)
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake").run(idle_exit_s=1.5)
    assert stats.events_written == len(events)
    assert sorted(lake_ids(tmp_path / "lake")) == sorted(pseudonyms(e.event_id for e in events))


def test_a_poison_message_goes_to_dead_letters_and_the_batch_goes_on(broker, topic, tmp_path):
    items = arrivals(0, 500)
    poison = [
        (b"r-bad1", b'{"event_type": "request_arrived", "ts_ns": "yesterday"'),
        (b"r-bad2", b"\xff\xfe not utf-8"),
        (b"r-bad3", json.dumps({**json.loads(items[0][1]), "schema_version": "2.0", "event_id": "x2"}).encode()),
        (b"r-bad4", json.dumps({**json.loads(items[0][1]), "event_id": "x3", "user_agent": "a" * 3_000}).encode()),
        (b"r-bad5", json.dumps({**json.loads(items[0][1]), "event_id": "x4", "ts_ns": 4_000_000_000_000_000_000}).encode()),
        (b"r-bad6", json.dumps({**json.loads(items[0][1]), "event_id": "x5", "email": "jane@example.com"}).encode()),
    ]
    produce(broker.bootstrap, topic, items[:250] + poison + items[250:])
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake", max_message_bytes=2_000).run(idle_exit_s=1.5)
    assert stats.events_written == 501 and stats.dead_letters == 5
    con = Lake(tmp_path / "lake").connect()
    reasons = sorted(r[0] for r in con.execute("SELECT reason FROM dead_letters").fetchall())
    assert reasons == ["clock_skew", "invalid_json", "not_utf8", "oversized", "unsupported_major_version"]
    keys = [r[0] for r in con.execute("SELECT key FROM dead_letters").fetchall()]
    assert all(k.startswith("rq_") for k in keys)  # keys pseudonymized like request ids
    for path in Lake(tmp_path / "lake").files(DEAD_LETTERS) + Lake(tmp_path / "lake").files(EVENTS):
        data = Path(path).read_bytes()
        assert b"yesterday" not in data and b"jane@example.com" not in data and b"r-bad" not in data


DEEP = b'{"event_type":"request_arrived","schema_version":"1.1","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("guard", ["on", "off"])
def test_a_message_nested_100000_deep_is_a_dead_letter_and_the_200_events_around_it_land_once(broker, topic, tmp_path,
                                                                                               caplog, guard):
    """The issue #22 poison: 200 KB nested 100,000 deep (under the 1 MiB limit), through the real broker.
    Guard on (the default): refused by the byte scan as too_deep. Guard off: it segfaults pyarrow in the
    transform worker; the batch is bisected, the message stored as parser_crash naming SIGSEGV and its
    offset, the rest once. Either way the dead letter also goes to the dead-letter topic."""
    items = arrivals(0, 200)
    produce(broker.bootstrap, topic, items[:100] + [(b"r-deep", DEEP)] + items[100:])
    depth = {"on": {}, "off": {"max_json_depth": 0}}[guard]
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake", **depth).run(idle_exit_s=1.5)
    assert (stats.events_written, stats.dead_letters) == (200, 1)
    assert lake_counts(tmp_path / "lake") == (200, 200)
    assert set(lake_ids(tmp_path / "lake")) == set(pseudonyms(f"e{i}" for i in range(200)))
    con = Lake(tmp_path / "lake").connect()
    ((reason, event_type, size),) = con.execute("SELECT reason, event_type, size_bytes FROM dead_letters").fetchall()
    assert (reason, event_type, size) == ({"on": "too_deep", "off": "parser_crash"}[guard], "request_arrived", len(DEEP))
    published = consume(broker.bootstrap, f"{topic}.dead", 1)
    assert json.loads(published[0].value)["reason"] == reason and published[0].key.startswith(b"rq_")
    if guard == "off":
        logged = " ".join(r.getMessage() for r in caplog.records if r.name == "servelens.ingest")
        assert "killed by SIGSEGV" in logged and "offset" in logged and "memory" not in logged


def test_a_worker_killed_by_a_signal_mid_batch_loses_and_duplicates_nothing(broker, topic, tmp_path, caplog):
    """SIGKILL to the transform worker right after a batch is handed to it (and another queued behind):
    both are transformed again by a fresh worker and every event is stored exactly once."""
    produce(broker.bootstrap, topic, arrivals(0, 4_000))
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake", **PIPELINED)
    submit, killed = ingest.transform.submit, []

    def submit_then_kill(*args):
        future = submit(*args)
        if not killed:
            killed.append(ingest.transform.pid)
            os.kill(killed[0], signal.SIGKILL)
        return future

    ingest.transform.submit = submit_then_kill
    stats = ingest.run(idle_exit_s=2.0)
    assert killed and ingest.transform.num_restarts >= 1
    assert (stats.events_written, stats.dead_letters) == (4_000, 0)
    assert lake_counts(tmp_path / "lake") == (4_000, 4_000)
    assert set(lake_ids(tmp_path / "lake")) == set(pseudonyms(f"e{i}" for i in range(4_000)))
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "servelens.ingest")
    assert "killed by SIGKILL" in logged and "memory" not in logged


def test_producer_retries_and_replays_after_a_restart_are_stored_once(broker, topic, tmp_path):
    items = arrivals(0, 300)
    produce(broker.bootstrap, topic, items + items[:50])  # a retried batch: same event ids, new offsets
    first = consumer(broker.bootstrap, topic, tmp_path / "lake").run(idle_exit_s=1.5)
    assert first.duplicates_dropped == 50 and lake_counts(tmp_path / "lake") == (300, 300)
    produce(broker.bootstrap, topic, items[100:150])  # retried again, after the consumer restarted
    second = consumer(broker.bootstrap, topic, tmp_path / "lake").run(idle_exit_s=1.5)
    # it read every partition again from before its mark (the stored 350 records warm the
    # de-duplication, stored nothing), then the 50 new ones
    assert second.records_read == 400 and second.duplicates_dropped == 50
    assert lake_counts(tmp_path / "lake") == (300, 300)


def _one_then_200_in_another_partition(bootstrap: str, topic: str):
    """Event e0 sent to partition 0, then 200 others to partition 1; the open producer and e0's (key, value)."""
    from kafka import KafkaProducer

    original = arrivals(0, 1)[0]
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(topic, key=original[0], value=original[1], partition=0)
    for key, value in arrivals(1_000, 200):
        producer.send(topic, key=key, value=value, partition=1)
    producer.flush(30)
    return producer, original


def test_a_retry_after_a_restart_is_dropped_however_far_other_partitions_ran_ahead(broker, topic, tmp_path):
    """The restarted consumer remembers each partition's last records, not the lake's newest events:
    here 200 newer events of another partition would push the original out of any lake-wide window."""
    producer, original = _one_then_200_in_another_partition(broker.bootstrap, topic)
    first = consumer(broker.bootstrap, topic, tmp_path / "lake", dedup_window_events=100).run(idle_exit_s=1.5)
    assert first.events_written == 201
    producer.send(topic, key=original[0], value=original[1], partition=0)  # the producer's retry
    producer.flush(30)
    producer.close()
    second = consumer(broker.bootstrap, topic, tmp_path / "lake", name="c2", dedup_window_events=100).run(idle_exit_s=1.5)
    assert second.duplicates_dropped == 1 and second.events_written == 0
    assert lake_counts(tmp_path / "lake") == (201, 201)


def test_a_retry_is_dropped_while_the_consumer_runs_however_far_other_partitions_ran_ahead(broker, topic, tmp_path):
    """One running consumer: partition 0's event, stored, then 200 of partition 1 (in commits of about 25,
    more than its overall window of 100 ids), then partition 0's retry. Its partition's own window still
    holds the original (the 0.01-0.03% stored twice by one consumer of 8 partitions under load).

    The 200 are sent only once e0 is stored: a consumer fetching both partitions at once may read
    partition 1 first, and then e0 would be the newest id of the overall window, not one it forgot."""
    from kafka import KafkaProducer

    original = arrivals(0, 1)[0]
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    producer.send(topic, key=original[0], value=original[1], partition=0)
    producer.flush(30)
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake", dedup_window_events=100, flush_max_events=25,
                      poll_max_records=25)
    thread = threading.Thread(target=ingest.run, kwargs={"idle_exit_s": 4.0})
    thread.start()
    e0 = RecentIds.keys(pseudonyms(["e0"]))
    assert _wait_for(lambda: ingest.recent.overall.seen(e0).any(), 60), "e0 was not stored within 60 s"
    for key, value in arrivals(1_000, 200):
        producer.send(topic, key=key, value=value, partition=1)
    producer.flush(30)
    # ids are remembered just after their batch is stored: wait for the window, not only the lake
    assert _wait_for(lambda: _stored(tmp_path / "lake") >= 201 and not ingest.recent.overall.seen(e0).any(), 60), (
        f"the overall window still holds e0 with {_stored(tmp_path / 'lake')} events stored")
    producer.send(topic, key=original[0], value=original[1], partition=0)  # the producer's retry
    producer.flush(30)
    producer.close()
    thread.join(90)
    assert ingest.stats().duplicates_dropped == 1
    assert lake_counts(tmp_path / "lake") == (201, 201)


def _wait_for(condition, timeout_s: float) -> bool:
    """Poll ``condition`` every 0.1 s until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_records_read_again_below_the_marks_never_move_them_back(broker, topic, tmp_path):
    """After a restart the first small batches hold only records read again (below the marks): the
    marks stay, so a dead letter further on is not stored a second time (the soak caught that)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for n, (key, value) in enumerate(arrivals(0, 100)):
        producer.send(topic, key=key, value=b"{not json" if n == 80 else value, partition=0)
    producer.flush(30)
    producer.close()
    small = {"dedup_window_events": 400, "poll_max_records": 10, "flush_max_events": 10}  # re-read 50, 10 a batch
    first = consumer(broker.bootstrap, topic, tmp_path / "lake", **small).run(idle_exit_s=1.5)
    assert (first.events_written, first.dead_letters) == (99, 1)
    second = consumer(broker.bootstrap, topic, tmp_path / "lake", name="c2", **small).run(idle_exit_s=1.5)
    assert second.records_read == 50 and (second.events_written, second.dead_letters) == (0, 0)
    assert Lake(tmp_path / "lake").high_water_mark(EVENTS, topic, 0, 0) == 100
    assert lake_counts(tmp_path / "lake") == (99, 99)
    assert Lake(tmp_path / "lake").connect().execute("SELECT count(*) FROM dead_letters").fetchone() == (1,)


def _fail_first_events_commit_behind_a_second_batch(ingest: IngestConsumer, error: Exception) -> list[int]:
    """Make the first commit of events wait until the next batch is in the pipeline behind it, then
    fail with ``error``, as a fenced or broken commit would; return the events commits that went
    through (their row counts)."""
    real, submit = ingest.lake.commit, ingest.transform.submit
    done: list[int] = []
    submitted = 0
    failed = False

    def counted(*args):
        nonlocal submitted
        submitted += 1
        return submit(*args)

    def commit(name, rows, ranges, expected, **options):
        nonlocal failed
        if name == EVENTS and not failed:
            deadline = time.monotonic() + 120  # a cap: seconds alone, more beside another test worker
            while submitted < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert submitted >= 2, "the next batch never entered the pipeline"
            failed = True
            raise error
        version = real(name, rows, ranges, expected, **options)
        if name == EVENTS:
            done.append(rows.num_rows)
        return version

    ingest.lake.commit, ingest.transform.submit = commit, counted
    return done


PIPELINED = {"flush_max_events": 1_000, "poll_max_records": 250, "flush_interval_s": 2.0, "commits_in_flight": 2}


def test_a_fenced_commit_stops_the_batch_behind_it_and_both_are_read_again(broker, topic, tmp_path):
    """Batch N is fenced while batch N+1 is in the pipeline: N+1 must store nothing (its marks would
    pass N's records, never stored); both are read again from the lake's marks, each event once."""
    from pipelines.lake import CommitFenced

    produce(broker.bootstrap, topic, arrivals(0, 4_000))
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake", **PIPELINED)
    commits = _fail_first_events_commit_behind_a_second_batch(ingest, CommitFenced("a test's fence"))
    stats = ingest.run(idle_exit_s=2.0)
    assert stats.commits_fenced == 1 and stats.events_written == 4_000
    assert sum(commits) == 4_000  # the commits that went through hold every event once
    assert lake_counts(tmp_path / "lake") == (4_000, 4_000)
    assert set(lake_ids(tmp_path / "lake")) == set(pseudonyms(f"e{i}" for i in range(4_000)))


def test_a_failed_commit_stops_the_batch_behind_it_and_a_restart_stores_both(broker, topic, tmp_path):
    """A commit that fails with an error (a full disk, say) stops the consumer; the batch behind it in
    the pipeline stores nothing, so the restarted consumer finds every event, once."""
    produce(broker.bootstrap, topic, arrivals(0, 4_000))
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake", **PIPELINED)
    commits = _fail_first_events_commit_behind_a_second_batch(ingest, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        ingest.run(idle_exit_s=2.0)
    ingest.close()  # commits nothing more: the pipeline stays latched after an error
    assert commits == [] and _stored(tmp_path / "lake") == 0
    restarted = consumer(broker.bootstrap, topic, tmp_path / "lake", name="c2", **PIPELINED).run(idle_exit_s=2.0)
    assert restarted.events_written == 4_000 and lake_counts(tmp_path / "lake") == (4_000, 4_000)


def test_health_is_reported_and_written_for_the_status_command(broker, topic, tmp_path):
    produce(broker.bootstrap, topic, arrivals(0, 100))
    seen = []
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake").run(idle_exit_s=1.5, on_status=seen.append)
    assert seen and stats.total_lag == 0 and stats.last_commit_ns is not None
    (status,) = read_statuses(str(tmp_path / "lake"))
    assert status["consumer"] == "c1" and status["broker_reachable"]
    env = {**os.environ, **KEY_ENV, "SERVELENS_LAKE__ROOT": str(tmp_path / "lake")}
    out = subprocess.run([sys.executable, "-m", "servelens", "ingest", "status"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "c1: reported" in out.stdout and "100 events in" in out.stdout


def test_stats_asked_from_another_thread_never_call_the_broker(broker, topic, tmp_path):
    """kafka-python's consumer is not thread-safe, and a call to a broker that has just vanished waits out its
    request timeout: a thread asking for the stats (the demo's progress line, a health check) reads the log
    ends the consume loop last fetched, and the loop alone asks the broker."""
    produce(broker.bootstrap, topic, arrivals(0, 200))
    root = tmp_path / "lake"
    ingest = consumer(broker.bootstrap, topic, root).start()
    callers: list[str] = []
    fetch = ingest._consumer.end_offsets

    def end_offsets(*args, **kwargs):  # the real call, noting which thread made it
        callers.append(threading.current_thread().name)
        return fetch(*args, **kwargs)

    ingest._consumer.end_offsets = end_offsets
    loop = threading.Thread(target=ingest.run, kwargs={"idle_exit_s": 1.5}, name="consume-loop")
    loop.start()
    asked = 0
    while loop.is_alive():
        ingest.stats()
        asked += 1
        time.sleep(0.02)
    loop.join()
    assert lake_counts(root) == (200, 200)
    assert asked > 10 and callers and set(callers) == {"consume-loop"}


def test_small_files_of_closed_hours_are_compacted_by_the_consumer(broker, topic, tmp_path):
    root = tmp_path / "lake"
    ingest = consumer(broker.bootstrap, topic, root, lake=LakeConfig(compact_min_files=3), compact_interval_s=0.05,
                      flush_max_events=50)
    thread = run_until(ingest, root, 400)
    for start in range(0, 400, 50):  # several commits, so several small files in one (long closed) hour
        produce(broker.bootstrap, topic, arrivals(start, 50))
        time.sleep(0.4)
    thread.join(60)
    files = Lake(root).num_files_by_partition(EVENTS)
    assert lake_counts(root) == (400, 400)
    assert files and max(files.values()) < 3  # merged by the consumer, rows intact


# ------------------------------------------------------------------------------------------ faults


def test_sigkill_at_random_points_loses_and_duplicates_nothing(broker, topic, tmp_path):
    """200,000 events; the ingest process is killed with SIGKILL at random moments and restarted."""
    total = 200_000
    producer = threading.Thread(target=produce, args=(broker.bootstrap, topic, arrivals(0, total)))
    producer.start()
    env = {
        **os.environ, **KEY_ENV,
        "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap, "SERVELENS_KAFKA__TOPIC": topic,
        "SERVELENS_KAFKA__NUM_PARTITIONS": str(NUM_TEST_PARTITIONS), "SERVELENS_LAKE__ROOT": str(tmp_path / "lake"),
        "SERVELENS_INGEST__SESSION_TIMEOUT_MS": "2000", "SERVELENS_INGEST__HEARTBEAT_INTERVAL_MS": "500",
        "SERVELENS_INGEST__FLUSH_INTERVAL_S": "0.2", "SERVELENS_INGEST__FLUSH_MAX_EVENTS": "20000",
    }
    rng = random.Random(7)
    stored = [0]
    for _ in range(5):
        if stored[-1] == total:
            break  # the processes so far stored everything: a next one would have nothing to commit
        proc = subprocess.Popen([sys.executable, "-m", "servelens", "ingest"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # wait until this process is committing (about 10 s; more beside another test worker), then kill it at random
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and _stored(tmp_path / "lake") <= stored[-1]:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        total_rows, distinct = lake_counts(tmp_path / "lake")
        assert total_rows == distinct  # never a row twice, even right after a kill
        stored.append(total_rows)
    producer.join()
    assert all(b > a for a, b in zip(stored, stored[1:])), stored  # every killed process had been committing
    assert len(stored) >= 4, stored  # and at least three were killed while events were left to commit
    final = subprocess.run([sys.executable, "-m", "servelens", "ingest", "--idle-exit-s", "3"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert lake_counts(tmp_path / "lake") == (total, total)
    assert set(lake_ids(tmp_path / "lake")) == set(pseudonyms(f"e{i}" for i in range(total)))


def test_two_consumers_and_a_rebalance_keep_exactly_once(broker, topic, tmp_path):
    total = 20_000
    produce(broker.bootstrap, topic, arrivals(0, total // 2))
    root = tmp_path / "lake"
    first = consumer(broker.bootstrap, topic, root, "c1")
    t1 = run_until(first, root, total)
    deadline = time.monotonic() + 120  # a cap: seconds alone, more beside another test worker
    while _stored(root) == 0 and time.monotonic() < deadline:  # c1 is committing
        time.sleep(0.05)
    second = consumer(broker.bootstrap, topic, root, "c2")  # joins mid-stream: partitions move
    t2 = run_until(second, root, total)
    deadline = time.monotonic() + 60
    while not second.partitions and time.monotonic() < deadline:  # the rebalance gave c2 its share
        time.sleep(0.05)
    assert second.partitions and len(first.partitions) < NUM_TEST_PARTITIONS
    produce(broker.bootstrap, topic, arrivals(total // 2, total // 2))
    t1.join(90)
    t2.join(90)
    assert lake_counts(root) == (total, total)
    c1, c2 = first.stats(), second.stats()
    assert c1.events_written + c2.events_written == total
    assert c1.events_written > 0 and c2.events_written > 0  # the rebalance really moved partitions


def test_a_broker_that_vanishes_and_returns_empty_is_survived(tmp_path, caplog):
    port = free_port()
    topic = "ev"
    root = tmp_path / "lake"
    broker = LocalBroker(port, topics={topic: NUM_TEST_PARTITIONS}).start()
    produce(broker.bootstrap, topic, arrivals(0, 1_000))
    ingest = consumer(broker.bootstrap, topic, root)
    thread = run_until(ingest, root, 1_500, timeout_s=90)
    deadline = time.monotonic() + 120  # a cap: seconds alone, more beside another test worker
    while _stored(root) < 1_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lake_counts(root) == (1_000, 1_000)
    broker.stop()  # all of its data is gone: memory storage
    deadline = time.monotonic() + 60  # the consumer notices at its next poll (seconds on a loaded machine)
    while ingest.stats().broker_reachable and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ingest.stats().broker_reachable
    broker.start()  # empty again, same port; its topic is re-created
    ensure_topics(broker.bootstrap, {topic: NUM_TEST_PARTITIONS})
    produce(broker.bootstrap, topic, arrivals(1_000, 500))  # offsets restart at 0
    thread.join(120)
    broker.stop()
    assert not thread.is_alive()
    assert lake_counts(root) == (1_500, 1_500)  # nothing lost, nothing doubled
    epoch, _ = Lake(root).epoch(topic, None)  # the latest epoch
    assert epoch == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "servelens.ingest"]
    assert any("is unreachable" in m for m in messages)
    assert any("was re-created" in m and "epoch 1" in m for m in messages)
    assert any("reachable again" in m for m in messages)


@pytest.fixture(autouse=True)
def _no_stray_threads():
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("Thread-") and thread.is_alive() and thread is not threading.current_thread():
            thread.join(5)


def _canary_records() -> list[tuple[bytes, bytes]]:
    """Per event type and canary kind, one event with the canary in every string field the contract
    lets carry text (identifiers, labels, free text, list items) and a secret as a field name."""
    from schemas.events import EVENT_TYPES
    from schemas.types import field_specs
    from tests.privacy.canaries import CANARIES, SECRET_FIELD_NAMES

    items = []
    for t, cls in enumerate(EVENT_TYPES.values()):
        for c, canary in enumerate(CANARIES.values()):
            record = {"schema_version": "1.1", "event_type": cls.EVENT_TYPE}
            for spec in field_specs(cls):
                if spec.name in record:
                    continue
                if spec.enum:
                    record[spec.name] = [spec.enum[0]] if spec.is_list else spec.enum[0]
                elif spec.kind == "string":
                    text = f"failed for {canary} after retry"
                    record[spec.name] = [text, canary] if spec.is_list else text
                elif spec.kind in ("int", "float"):
                    record[spec.name] = [1, 2] if spec.is_list else (1 if spec.kind == "int" else 1.0)
                elif spec.kind == "bool":
                    record[spec.name] = True
            record.update(event_id=f"ev-{t}-{c}-{canary}", ts_ns=1_764_000_000_000_000_000 + t * 100 + c)
            if cls.EVENT_TYPE == "step_executed":
                record.update(start_ns=1, end_ns=2)
            record[SECRET_FIELD_NAMES[c % len(SECRET_FIELD_NAMES)]] = canary
            items.append((canary.encode(), json.dumps(record).encode()))
    return items


def test_canaries_in_every_string_field_and_as_field_names_are_in_no_byte_written(broker, topic, tmp_path, caplog):
    """Issue #22: a canary of each kind (names, addresses, SSNs, cloud secrets, ...) in every string
    field of every event type, and secrets as field names, through the real broker and ingest, then the
    dashboard's derived cache: no byte of the lake (data, Delta log, status), the cache, the logs or the
    privacy report holds any of them (Parquet pages are read decoded, footers' statistics included)."""
    import logging

    import pyarrow.parquet as pq

    from dashboard import data
    from tests.privacy.canaries import leaks

    caplog.set_level(logging.DEBUG, logger="servelens")
    items = _canary_records()
    produce(broker.bootstrap, topic, items)
    ingest = consumer(broker.bootstrap, topic, tmp_path / "lake")
    stats = ingest.run(idle_exit_s=1.5)
    assert stats.events_written + stats.dead_letters == len(items) and stats.events_written >= len(items) - 11
    report = json.dumps(ingest.privacy_report().as_dict())
    data.lake_requests_path(data.lake_snapshot(str(tmp_path / "lake")), tmp_path / "cache")
    found: dict[str, list[str]] = {}
    for path in tmp_path.rglob("*"):
        if not path.is_file():
            continue
        raw = path.read_bytes()
        texts = [raw]
        if path.suffix == ".parquet":
            file = pq.ParquetFile(path)
            texts += [str(file.metadata.to_dict()).encode(), str(file.read().to_pylist()).encode()]
        for text in texts:
            for kind in leaks(text):
                found.setdefault(kind, []).append(str(path.relative_to(tmp_path)))
    logged = " ".join(r.getMessage() for r in caplog.records if r.name.startswith("servelens"))  # ours, not the test producer's
    for kind in leaks((report + logged).encode()):
        found.setdefault(kind, []).append("logs or privacy report")
    assert found == {}, found
    assert json.loads(report)["fields_dropped"] == {"(unknown field)": len(items)}
