"""Benchmark: what the emitter SDK costs an engine, and how fast it delivers to Kafka.

Starts a local Tansu broker, then measures:

* ``emit()`` overhead on the engine's thread: each of ``--num-calls`` calls timed on its own, in a
  tight loop while the emitter's background thread drains and produces (so GIL contention shows in
  the tail); the median, p99, p99.9 and max in nanoseconds, with the timer's own cost reported
  beside them (not subtracted). The buffer is sized so that no call takes the drop path; the drop
  path is timed separately on a full buffer.
* end-to-end produce rate: ``--num-events`` events emitted at once, then ``flush()``; events per
  second from the first ``emit`` to the last broker acknowledgement, checked by reading every
  event back with a plain kafka-python consumer (whose rate is reported too).

    python benchmarks/emit.py            # 1,000,000 timed calls, 200,000 events end to end
    python benchmarks/emit.py --quick    # 200,000 calls, 50,000 events, well under a minute

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.broker import LocalBroker  # noqa: E402
from pipelines.emitter import Emitter  # noqa: E402
from schemas.events import Event, FirstToken, RequestArrived, StepExecuted, TokensDelivered  # noqa: E402

TOPIC = "bench.overhead"  # the timed loop's backlog is abandoned here
E2E_TOPIC = "bench.produce"
NUM_PARTITIONS = 8


def event_pool(num_requests: int = 250) -> list[Event]:
    """A realistic mix of small events (about 4 per request), reused cyclically by the loops."""
    t0 = time.time_ns()
    common = {"engine_id": "bench-engine", "instance_id": "i0", "model": "llama-3-8b", "tenant": "t0"}
    pool: list[Event] = []
    for i in range(num_requests):
        rid, t = f"bench-{i:06d}", t0 + i * 1_000
        pool += [
            RequestArrived(event_id=f"{rid}:a", ts_ns=t, request_id=rid, num_prompt_tokens=512, **common),
            StepExecuted(
                event_id=f"{rid}:s", ts_ns=t + 2, step_index=i, start_ns=t + 1, end_ns=t + 2,
                num_prefill_tokens=512, num_decode_seqs=31, request_ids=[rid], request_num_tokens=[512],
                num_kv_blocks_used=100, num_kv_blocks_free=900, **common,
            ),
            FirstToken(event_id=f"{rid}:f", ts_ns=t + 3, request_id=rid, **common),
            TokensDelivered(event_id=f"{rid}:t", ts_ns=t + 4, request_id=rid, num_tokens=1, **common),
        ]
    return pool


def percentiles_ns(samples: array) -> dict[str, float]:
    values = np.frombuffer(samples, dtype=np.int64)
    p50, p99, p999 = np.percentile(values, [50, 99, 99.9])
    return {"median": float(p50), "p99": float(p99), "p999": float(p999), "max": float(values.max())}


def timer_overhead_ns(num_calls: int) -> float:
    """Median cost of the timing itself (two perf_counter_ns calls around nothing)."""
    clock, samples = time.perf_counter_ns, array("q", bytes(8 * num_calls))
    for i in range(num_calls):
        t0 = clock()
        samples[i] = clock() - t0
    return float(np.median(np.frombuffer(samples, dtype=np.int64)))


def emit_overhead(bootstrap: str, num_calls: int, compression: str, *, strict: bool = False) -> dict[str, float]:
    pool = event_pool()
    emitter = Emitter(bootstrap, TOPIC, compression=compression, max_buffered_events=num_calls + 1, strict=strict).start()
    emit, clock, n_pool = emitter.emit, time.perf_counter_ns, len(pool)
    samples = array("q", bytes(8 * num_calls))
    started = time.perf_counter()
    for i in range(num_calls):
        event = pool[i % n_pool]
        t0 = clock()
        emit(event)
        samples[i] = clock() - t0
    loop_s = time.perf_counter() - started
    stats = emitter.close(timeout_s=0)  # the backlog is not part of this measurement
    figures = {f"emit_ns_{k}": v for k, v in percentiles_ns(samples).items()}
    figures["emit_loop_ns_per_call"] = loop_s / num_calls * 1e9
    figures["emit_num_dropped"] = stats.num_dropped
    if strict:
        return figures

    full = Emitter(bootstrap, TOPIC, max_buffered_events=1)  # never started: every call after the first drops
    full.emit(pool[0])
    num_drops = min(num_calls, 200_000)
    drops = array("q", bytes(8 * num_drops))
    for i in range(num_drops):
        t0 = clock()
        full.emit(pool[i % n_pool])
        drops[i] = clock() - t0
    figures["drop_ns_median"] = percentiles_ns(drops)["median"]
    full.close(timeout_s=0)
    return figures


def produce_rate(bootstrap: str, num_events: int, compression: str) -> dict[str, float]:
    pool = event_pool()
    with Emitter(bootstrap, E2E_TOPIC, compression=compression, max_buffered_events=num_events + 1) as emitter:
        started = time.perf_counter()
        for i in range(num_events):
            emitter.emit(pool[i % len(pool)])
        emitted_s = time.perf_counter() - started
        delivered = emitter.flush(timeout_s=600)
        elapsed_s = time.perf_counter() - started
        stats = emitter.stats()
    if not delivered or stats.num_sent != num_events:
        raise SystemExit(f"not every event was acknowledged: {stats}")
    num_consumed, consume_s = consume_all(bootstrap, num_events)
    if num_consumed != num_events:  # Tansu's ListOffsets is no check: it reports the last batch's base offset
        raise SystemExit(f"{stats.num_sent:,} events acknowledged but {num_consumed:,} consumed back")
    return {
        "produce_events_per_s": num_events / elapsed_s,
        "produce_emit_phase_s": emitted_s,
        "produce_total_s": elapsed_s,
        "consume_events_per_s": num_consumed / consume_s,
    }


def consume_all(bootstrap: str, num_expected: int, timeout_s: float = 120.0) -> tuple[int, float]:
    """Read the end-to-end topic back with a plain kafka-python consumer: (records, seconds)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    consumer.assign([TopicPartition(E2E_TOPIC, p) for p in range(NUM_PARTITIONS)])
    started = time.perf_counter()
    deadline, num_records = started + timeout_s, 0
    while num_records < num_expected and time.perf_counter() < deadline:
        num_records += sum(len(batch) for batch in consumer.poll(timeout_ms=200, max_records=50_000).values())
    elapsed_s = time.perf_counter() - started
    consumer.close()
    return num_records, elapsed_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200,000 calls and 50,000 events (under a minute)")
    parser.add_argument("--num-calls", type=int, help="timed emit() calls (default 1,000,000; quick 200,000)")
    parser.add_argument("--num-events", type=int, help="events produced end to end (default 200,000; quick 50,000)")
    parser.add_argument("--compression", default="zstd", help="producer codec (default zstd)")
    args = parser.parse_args(argv)
    num_calls = args.num_calls or (200_000 if args.quick else 1_000_000)
    num_events = args.num_events or (50_000 if args.quick else 200_000)

    with LocalBroker(topics={TOPIC: NUM_PARTITIONS, E2E_TOPIC: NUM_PARTITIONS}) as broker:
        overhead = emit_overhead(broker.bootstrap, num_calls, args.compression)
        print(f"emit(): median {overhead['emit_ns_median']:.0f} ns, p99 {overhead['emit_ns_p99']:.0f} ns, "
              f"p99.9 {overhead['emit_ns_p999']:.0f} ns, max {overhead['emit_ns_max'] / 1e6:.1f} ms "
              f"over {num_calls:,} calls; drop path {overhead['drop_ns_median']:.0f} ns", flush=True)
        checked = emit_overhead(broker.bootstrap, max(1, num_calls // 5), args.compression, strict=True)
        overhead |= {f"strict_{k}": v for k, v in checked.items()}
        print(f"emit() with strict=True (every event checked as ingest would): median "
              f"{checked['emit_ns_median']:,.0f} ns, p99 {checked['emit_ns_p99']:,.0f} ns", flush=True)
        rate = produce_rate(broker.bootstrap, num_events, args.compression)
        print(f"end to end: {num_events:,} events in {rate['produce_total_s']:.2f} s = "
              f"{rate['produce_events_per_s']:,.0f} events/s ({args.compression}); read back at "
              f"{rate['consume_events_per_s']:,.0f} events/s", flush=True)
    figures = {
        "benchmark": "emit",
        "num_calls": num_calls,
        "num_events": num_events,
        "compression": args.compression,
        "timer_overhead_ns": timer_overhead_ns(200_000),
        **overhead,
        **rate,
        "python": platform.python_version(),
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
