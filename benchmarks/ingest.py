"""Benchmark: raw Kafka consume rate against end-to-end ingest (consume, validate, sanitize, write).

Starts a local broker, produces synthetic lifecycle events (realistic mix of types, tenants, users,
models; ``benchmarks/synthetic.py``) to an 8-partition topic, then, in this one process:

1. reads every record back with a bare kafka-python consumer (``poll(max_records=...)``, no work):
   the raw consume rate;
2. ingests the same topic with ``pipelines.ingest.IngestConsumer`` into a fresh lake (decode,
   validate, sanitize, de-duplicate, commit to Delta/Parquet): the end-to-end rate, counted from
   the first record read (the consumer's start-up, building Presidio in its transform worker, is
   reported apart as ``ingest_start_s``).

One ingest consumer is this process (polling Kafka, de-duplicating, committing) plus its transform
worker process (decoding, validating, sanitizing: ``pipelines.transform``). It samples the resident
memory of the two together every half second during the ingest and reports the peak of the second
and of the last quarter of the run (flat memory: their ratio stays near 1; the first quarter is left
out, as it holds the warm-up before the first commits). CPU seconds per event are reported for the
raw consumer, the ingest process and its worker: unlike the rates they hardly move with the load of
a shared machine (``load_average_1min`` says what it was).

    python benchmarks/ingest.py            # 5,000,000 events
    python benchmarks/ingest.py --quick    # 200,000 events, under a minute

``--object-store`` measures scale-out instead: the lake on moto's S3-compatible server
(``benchmarks/servers.py``), ingested once by one consumer (its own group) and once by two
consumer processes in one group (each its own transform worker, half the partitions each), both
committing to the same Delta tables. Each consumer starts (Presidio, joining) before any of them
reads; the rate counts from the first record any of them read to the last commit any of them made.
A consumer that joins the group after the other has begun reading causes a rebalance (commits and
re-reads): a fixed cost that shows in the quick run and is spread over the full one.

    python benchmarks/ingest.py --object-store            # 2,000,000 events
    python benchmarks/ingest.py --object-store --quick    # 100,000 events (commits of 10,000), under a minute

The quick run is two commit batches (``ingest.flush_max_events`` = 100,000): the consumer's
pipeline (batch N+1 sanitized while N is written) is mostly filling and draining, so its ingest
rate reads low; the full run's is the figure.

Targets: end-to-end >= 50% of the raw consume rate and >= 50,000 events/s for one process.
Two consumers cannot beat one by more than the machine's cores allow: each is two busy processes
(``cpu_count`` and ``load_average_1min`` are in the output). The last line is one JSON object with
the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import iter_chunks  # noqa: E402
from pipelines.broker import LocalBroker  # noqa: E402
from pipelines.config import IngestConfig, LakeConfig  # noqa: E402
from pipelines.ingest import IngestConsumer  # noqa: E402
from pipelines.kafka_config import KafkaConfig  # noqa: E402
from privacy.config import PrivacyConfig  # noqa: E402
from privacy.keys import KeyRing  # noqa: E402
from schemas.wire import iter_table_json  # noqa: E402

TOPIC = "bench.events"
PARTITIONS = 8


def _proc_status(pid: int | str, field: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(*pids: int | str) -> float:
    """Resident memory of these processes together (default: this one), MB."""
    total = 0.0
    for pid in pids or ("self",):
        try:
            total += _proc_status(pid, "VmRSS")
        except FileNotFoundError:  # ended
            pass
    return total


def cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user + system) a process has used, all its threads."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def produce(bootstrap: str, num_events: int) -> int:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512_000, compression_type="zstd",
                             max_in_flight_requests_per_connection=5)
    count = 0
    for table in iter_chunks(num_events, requests_per_chunk=20_000):
        keys = table["request_id"].to_pylist()
        fallback = table["instance_id"].to_pylist()
        for key, alt, value in zip(keys, fallback, iter_table_json(table)):
            producer.send(TOPIC, key=(key or alt).encode(), value=value)
            count += 1
        print(f"\rproduced {count:,}", end="", file=sys.stderr)
    producer.flush(120)
    producer.close()
    print(file=sys.stderr)
    return count


def raw_consume(bootstrap: str, num_events: int) -> tuple[float, float]:
    """(events/s, CPU seconds of this process per event)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                             max_poll_records=10_000, fetch_max_bytes=64 * 1024 * 1024)
    consumer.assign([TopicPartition(TOPIC, p) for p in range(PARTITIONS)])
    consumer.seek_to_beginning()
    seen, started, cpu0 = 0, time.perf_counter(), time.process_time()
    while seen < num_events:
        for records in consumer.poll(timeout_ms=500, max_records=10_000).values():
            seen += len(records)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    consumer.close()
    return seen / elapsed, cpu / seen


def ingest(bootstrap: str, num_events: int, root: str) -> dict:
    """Ingest the topic with one IngestConsumer; its rate, memory samples (this process and the
    consumer's transform worker together) and CPU per event of each."""
    consumer = IngestConsumer(
        KafkaConfig(bootstrap_servers=bootstrap, topic=TOPIC, num_partitions=PARTITIONS),
        IngestConfig(session_timeout_ms=2_000, heartbeat_interval_ms=500, status_interval_s=5.0),  # else defaults
        LakeConfig(root=root),
        PrivacyConfig(),
        KeyRing("bench", {"bench": bytes(range(32))}),
        consumer_name="bench",
    )
    started = time.perf_counter()
    consumer.start()
    start_s = time.perf_counter() - started
    worker = consumer.transform.pid
    pids = ("self",) if worker is None else ("self", worker)
    samples: list[float] = []
    done = threading.Event()
    cpu = {"self": cpu_s(), "worker": cpu_s(worker) if worker else 0.0}

    def sample() -> None:
        while not done.wait(0.5):
            samples.append(rss_mb(*pids))

    close = consumer.transform.close

    def close_and_count() -> None:  # the worker's CPU, read before it ends
        if worker:
            cpu["worker"] = cpu_s(worker) - cpu["worker"]
        close()

    consumer.transform.close = close_and_count
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stats = consumer.run(max_records=num_events)  # its rate counts from the first record read
    cpu["self"] = cpu_s() - cpu["self"]
    done.set()
    sampler.join()
    return {"rate": stats.events_per_s, "samples": samples, "stats": stats, "start_s": start_s,
            "cpu_us_per_event": cpu["self"] / num_events * 1e6, "worker_cpu_us_per_event": cpu["worker"] / num_events * 1e6}


def _consumer_process(bootstrap: str, root: str, group: str, name: str, flush_max_events: int, ready, go,
                      results) -> None:
    """One ingest consumer (in a process of its own, as ``servelens ingest``): start, wait for the
    others, drain the topic; its first-read and last-commit wall clock times and its counts."""
    consumer = IngestConsumer(
        KafkaConfig(bootstrap_servers=bootstrap, topic=TOPIC, num_partitions=PARTITIONS),
        IngestConfig(group_id=group, session_timeout_ms=2_000, heartbeat_interval_ms=500, status_interval_s=5.0,
                     flush_max_events=flush_max_events, compact_interval_s=0),
        LakeConfig(root=root), PrivacyConfig(), KeyRing("bench", {"bench": bytes(range(32))}), consumer_name=name,
    )
    consumer.start()
    ready.put(name)
    go.wait()
    stats = consumer.run(idle_exit_s=3.0)
    ended_ns = time.time_ns()  # the rate in the stats counts from the first record read to now
    first_ns = ended_ns - int(stats.events_written / max(stats.events_per_s, 1e-9) * 1e9)
    results.put({"name": name, "first_read_ns": first_ns, "last_commit_ns": stats.last_commit_ns,
                 "events_written": stats.events_written, "commits": stats.commits,
                 "duplicates_dropped": stats.duplicates_dropped})


def object_store_rate(bootstrap: str, root: str, num_consumers: int, flush_max_events: int) -> dict:
    """Drain the topic into the lake at ``root`` with ``num_consumers`` processes of one new group:
    events per second from the first record read to the last commit."""
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    group = f"bench-{num_consumers}-{time.time_ns()}"
    procs = [ctx.Process(target=_consumer_process, args=(bootstrap, root, group, f"bench-{i}", flush_max_events,
                                                         ready, go, results)) for i in range(num_consumers)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=300)
    go.set()
    done = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"an ingest process failed: exit codes {[proc.exitcode for proc in procs]}")
    events = sum(d["events_written"] for d in done)
    elapsed_s = (max(d["last_commit_ns"] for d in done) - min(d["first_read_ns"] for d in done)) / 1e9
    return {"events": events, "elapsed_s": elapsed_s, "events_per_s": events / elapsed_s,
            "commits": sum(d["commits"] for d in done), "per_consumer": sorted(d["events_written"] for d in done),
            "duplicates_dropped": sum(d["duplicates_dropped"] for d in done)}


def object_store_main(num_events: int, flush_max_events: int) -> None:
    """One consumer against two on an s3:// lake (moto's server); the figures as JSON."""
    from benchmarks.servers import S3Server
    from pipelines.lake import EVENTS, Lake

    with LocalBroker(topics={TOPIC: PARTITIONS}) as broker, tempfile.TemporaryDirectory() as tmp:
        store = S3Server.start(Path(tmp) / "moto.log")
        try:
            os.environ.update(store.env())  # the consumer processes inherit the store's endpoint and keys
            produced = produce(broker.bootstrap, num_events)
            runs = {}
            for num_consumers in (1, 2):
                root = f"s3://{store.bucket()}/lake"
                runs[num_consumers] = object_store_rate(broker.bootstrap, root, num_consumers, flush_max_events)
                lake = Lake(root)
                (stored, distinct), = lake.connect().execute(
                    "SELECT count(*), count(DISTINCT event_id) FROM events").fetchall()
                writers = {h.get("servelens.writer") for h in lake.table(EVENTS).history() if h.get("operation") == "WRITE"}
                runs[num_consumers] |= {"stored": stored, "distinct": distinct, "writers": len(writers)}
                print(f"{num_consumers} consumer(s): {runs[num_consumers]['events_per_s']:,.0f} events/s",
                      file=sys.stderr)
        finally:
            store.stop()
    one, two = runs[1], runs[2]
    print(json.dumps({
        "events": produced, "lake": "s3 (moto)", "flush_max_events": flush_max_events, "cpu_count": os.cpu_count(),
        "one_consumer_events_per_s": round(one["events_per_s"]), "two_consumers_events_per_s": round(two["events_per_s"]),
        "two_vs_one": round(two["events_per_s"] / one["events_per_s"], 2),
        "one_consumer_s": round(one["elapsed_s"], 1), "two_consumers_s": round(two["elapsed_s"], 1),
        "two_consumers_split": two["per_consumer"], "commits_one": one["commits"], "commits_two": two["commits"],
        "events_stored_one": one["stored"], "distinct_one": one["distinct"], "events_stored_two": two["stored"],
        "distinct_two": two["distinct"], "duplicates_dropped_one": one["duplicates_dropped"],
        "duplicates_dropped_two": two["duplicates_dropped"], "writers_two": two["writers"],
        # every distinct event once, the same events whether one consumer or two stored them
        "stored_exactly_once": one["stored"] == one["distinct"] == two["stored"] == two["distinct"],
        "load_average_1min": round(os.getloadavg()[0], 2),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200,000 events instead of 5,000,000")
    parser.add_argument("--events", type=int, default=None)
    parser.add_argument("--object-store", action="store_true",
                        help="one consumer against two on an s3:// lake (moto's server): 2,000,000 events")
    args = parser.parse_args()
    if args.object_store:
        object_store_main(args.events or (100_000 if args.quick else 2_000_000), 10_000 if args.quick else 100_000)
        return
    num_events = args.events or (200_000 if args.quick else 5_000_000)
    with LocalBroker(topics={TOPIC: PARTITIONS}) as broker, tempfile.TemporaryDirectory() as tmp:
        produced = produce(broker.bootstrap, num_events)
        raw, raw_cpu = raw_consume(broker.bootstrap, produced)
        print(f"raw consume: {raw:,.0f} events/s", file=sys.stderr)
        result = ingest(broker.bootstrap, produced, f"{tmp}/lake")
        rate, samples, stats = result["rate"], result["samples"], result["stats"]
        print(f"end-to-end ingest: {rate:,.0f} events/s; {stats.line()}", file=sys.stderr)
    quarter = max(1, len(samples) // 4)
    first, last = max(samples[quarter : 2 * quarter] or [rss_mb()]), max(samples[-quarter:] or [rss_mb()])
    print(
        json.dumps(
            {
                "events": produced,
                "raw_consume_events_per_s": round(raw),
                "ingest_events_per_s": round(rate),
                "ingest_vs_raw": round(rate / raw, 2),
                "raw_cpu_us_per_event": round(raw_cpu * 1e6, 2),
                "ingest_cpu_us_per_event": round(result["cpu_us_per_event"], 2),
                "worker_cpu_us_per_event": round(result["worker_cpu_us_per_event"], 2),
                "ingest_start_s": round(result["start_s"], 2),
                "load_average_1min": round(os.getloadavg()[0], 2),
                "peak_rss_mb": round(max(samples or [rss_mb()]), 1),
                "rss_second_quarter_mb": round(first, 1),
                "rss_last_quarter_mb": round(last, 1),
                "rss_last_vs_second_quarter": round(last / first, 2),
                "events_written": stats.events_written,
                "dead_letters": stats.dead_letters,
                "duplicates_dropped": stats.duplicates_dropped,
            }
        )
    )


if __name__ == "__main__":
    main()
