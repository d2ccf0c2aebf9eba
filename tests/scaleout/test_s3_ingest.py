"""Two ingest processes commit concurrently to one lake on an S3-compatible server, exactly once
through SIGKILL; the lake's maintenance and queries work there; credentials never show.

The server is moto's (a real HTTP server process, ``tests.scaleout.s3server``); the processes are
``servelens ingest`` on separate consumer instances of one group, as on two machines. Delta's
commit coordination on S3 is the conditional write (``If-None-Match: *`` on the next log entry).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from benchmarks.servers import SECRET_KEY
from pipelines.lake import EVENTS, Lake
from tests.pipelines.conftest import NUM_TEST_PARTITIONS
from tests.pipelines.test_ingest import KEY_ENV, arrivals, produce, pseudonyms

TOTAL = 30_000
WRITERS = ("ingest-a", "ingest-b")


def _env(object_store, broker, topic: str, root: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SERVELENS_"))}
    return {**env, **KEY_ENV, **object_store.env(), **extra,
            "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap, "SERVELENS_KAFKA__TOPIC": topic,
            "SERVELENS_KAFKA__NUM_PARTITIONS": str(NUM_TEST_PARTITIONS), "SERVELENS_LAKE__ROOT": root,
            "SERVELENS_INGEST__SESSION_TIMEOUT_MS": "2000", "SERVELENS_INGEST__HEARTBEAT_INTERVAL_MS": "500",
            "SERVELENS_INGEST__FLUSH_INTERVAL_S": "0.3", "SERVELENS_INGEST__FLUSH_MAX_EVENTS": "4000"}


def _counts(root: str) -> tuple[int, int]:
    lake = Lake(root)
    if lake.table(EVENTS) is None:
        return 0, 0
    return lake.connect().execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone()


def _start(env: dict[str, str], name: str, log, idle_exit_s: int = 4) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "servelens", "ingest", "--name", name,
                             "--idle-exit-s", str(idle_exit_s)], env=env, stdout=log, stderr=subprocess.STDOUT)


def _paced(bootstrap: str, topic: str, chunk: int = 2_000, pause_s: float = 0.6) -> None:
    """The events in chunks over about ten seconds, so that the kills find records still to read
    and the restarted processes find more."""
    for start in range(0, TOTAL, chunk):
        produce(bootstrap, topic, arrivals(start, chunk))
        time.sleep(pause_s)


@pytest.fixture(scope="module")
def s3_lake(store_env, broker, tmp_path_factory):
    """30,000 events ingested into ``s3://<bucket>/lake`` by two processes, each killed with
    SIGKILL at a random moment while both were committing, and restarted."""
    from pipelines.broker import ensure_topics

    topic = f"scaleout-{os.getpid()}-{int(time.time())}"
    ensure_topics(broker.bootstrap, {topic: NUM_TEST_PARTITIONS})
    root = f"s3://{store_env.bucket()}/lake"
    env = _env(store_env, broker, topic, root)
    logs = tmp_path_factory.mktemp("ingest-logs")
    producer = threading.Thread(target=_paced, args=(broker.bootstrap, topic))
    producer.start()
    rng, kills = random.Random(25), []
    # The first processes wait long when idle, so that none can exit on its own before its kill on a
    # slow machine (CI's 2 cores once saw one exit 0 first); the restarted ones exit 4 s after the end.
    procs = {name: _start(env, name, (logs / f"{name}-0.log").open("wb"), idle_exit_s=300) for name in WRITERS}
    for round_ in (1,):
        stored = _counts(root)[0]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _counts(root)[0] <= stored:  # both are consuming, committing
            time.sleep(0.3)
        for name in rng.sample(WRITERS, 2):
            time.sleep(rng.uniform(0.0, 0.8))
            procs[name].send_signal(signal.SIGKILL)
            assert procs[name].wait() == -signal.SIGKILL
            total, distinct = _counts(root)
            assert total == distinct, "a row stored twice right after a kill"
            kills.append(total)
            procs[name] = _start(env, name, (logs / f"{name}-{round_}.log").open("wb"))
    producer.join()
    for name, proc in procs.items():
        assert proc.wait(timeout=240) == 0, (logs / f"{name}-1.log").read_text()[-3000:]
    return root, env, logs, kills


def test_two_processes_commit_concurrently_to_s3_exactly_once_through_sigkill(s3_lake):
    root, _, logs, kills = s3_lake
    assert _counts(root) == (TOTAL, TOTAL)
    ids = [r[0] for r in Lake(root).connect().execute("SELECT event_id FROM events").fetchall()]
    assert set(ids) == set(pseudonyms(f"e{i}" for i in range(TOTAL)))
    assert kills[-1] > 0  # the processes were killed while the lake filled
    history = Lake(root).table(EVENTS).history()
    writers = Counter(h.get("servelens.writer") for h in history if h.get("operation") == "WRITE")
    assert writers[WRITERS[0]] > 0 and writers[WRITERS[1]] > 0, writers  # both wrote to the same table
    text = "".join(p.read_text(errors="replace") for p in logs.iterdir())
    assert SECRET_KEY not in text  # nothing an ingest process logged shows the secret


def _servelens(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelens", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def _data_objects(object_store, bucket: str) -> set[str]:
    """The URIs of the events table's Parquet objects in the store (not its Delta log), as ``Lake.files`` names them."""
    return {f"s3://{bucket}/{k}" for k in object_store.keys(bucket) if k.startswith(f"lake/{EVENTS}/") and "/_delta_log/" not in k}


def test_lake_compact_and_sql_work_on_s3(s3_lake, object_store):
    root, env, _, _ = s3_lake
    bucket = root.split("/")[2]
    lake = Lake(root)
    live_before = set(lake.files(EVENTS))
    done = _servelens({**env, "SERVELENS_LAKE__COMPACT_MIN_FILES": "2"}, "lake", "compact", "--vacuum-hours", "0")
    assert done.returncode == 0, done.stderr
    live_after = set(Lake(root).files(EVENTS))
    assert len(live_after) < len(live_before)  # merged
    # and the replaced objects deleted (the whole bucket's count is no measure: the merge and the vacuum add
    # log entries, which can outnumber the files merged; a process killed mid-commit may leave a file no log names)
    stored = _data_objects(object_store, bucket)
    assert live_after <= stored and not (live_before - live_after) & stored
    query = _servelens(env, "lake", "sql", "SELECT count(*) AS n, count(DISTINCT request_id) AS r FROM requests")
    assert query.returncode == 0, query.stderr
    assert query.stdout.split()[-2:] == [str(TOTAL), str(TOTAL)]
    assert SECRET_KEY not in done.stdout + done.stderr + query.stdout + query.stderr


def test_credentials_come_from_a_file_as_well_and_their_absence_is_a_clear_error(s3_lake, tmp_path):
    root, env, _, _ = s3_lake
    no_aws = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    options = tmp_path / "s3.toml"
    options.write_text("".join(f'{k} = {json.dumps(v)}\n' for k, v in env.items() if k.startswith("AWS_")))
    from_file = _servelens({**no_aws, "SERVELENS_LAKE__STORAGE_OPTIONS_FILE": str(options)},
                           "lake", "sql", "SELECT count(*) AS n FROM events")
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout.split()[-1] == str(TOTAL)
    missing = _servelens(no_aws, "lake", "sql", "SELECT count(*) FROM events")
    assert missing.returncode == 3
    assert "no credentials are configured" in missing.stderr and "Traceback" not in missing.stderr
    wrong = _servelens({**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret-0000"}, "lake", "sql", "SELECT 1")
    assert "not-the-secret-0000" not in wrong.stdout + wrong.stderr


def test_duckdb_scans_s3_files_on_several_threads_and_reads_the_right_bytes(store_env, object_store):
    """DuckDB reads a Parquet file's row groups on several threads through one handle of the registered
    filesystem; before each thread had its own position (``PositionalReader``) 12 of 30 such scans failed to
    decode or read another part of the file (7 Dec 2026). Eight scans of two files give the exact sums."""
    import duckdb
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines import objectstore

    bucket, options, rows = object_store.bucket(), objectstore.storage_options(), 400_000
    table = pa.table({"a": np.arange(rows), "b": np.random.default_rng(0).integers(0, 2**40, rows)})  # 6 MB a file
    for name in ("f0", "f1"):
        pq.write_table(table, f"{bucket}/{name}.parquet", filesystem=objectstore.arrow_filesystem(options),
                       row_group_size=20_000)
    expected = (2 * (rows * (rows - 1) // 2), 2 * int(table["b"].to_numpy().sum()))
    for _ in range(8):
        con = duckdb.connect()
        con.execute("SET threads = 4")
        objectstore.register(con, options)
        files = ", ".join(f"'s3://{bucket}/{name}.parquet'" for name in ("f0", "f1"))
        assert con.execute(f"SELECT sum(a), sum(b) FROM read_parquet([{files}])").fetchone() == expected
