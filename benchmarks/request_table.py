"""Benchmark: request-table derivation over synthetic lifecycle events.

Generates a Parquet file of synthetic events (arrivals, admissions, shared engine steps, first
tokens, token deliveries, finishes, plus 1% duplicated events as producer retries would leave),
then derives the request table in a fresh process and reports events per second and that process's
peak memory (max RSS).

    python benchmarks/request_table.py            # 10,000,000 events (the README figure)
    python benchmarks/request_table.py --quick    # 1,000,000 events, well under a minute

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.arrow import EVENTS_SCHEMA  # noqa: E402
from schemas.events import SCHEMA_VERSION  # noqa: E402

BATCH = 16  # requests per engine step in the synthetic stream


def _table(n: int, columns: dict[str, pa.Array | list]) -> pa.Table:
    arrays = []
    for field in EVENTS_SCHEMA:
        value = columns.get(field.name)
        arrays.append(pa.nulls(n, field.type) if value is None else pa.array(value, field.type))
    return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)


def _constant(n: int, value) -> pa.Array:
    return pa.repeat(pa.scalar(value), n) if n else pa.array([], type=pa.scalar(value).type)


def synthetic_chunk(rng: np.random.Generator, first: int, num_requests: int, t0_ns: int) -> tuple[pa.Table, int]:
    """Events for requests first..first+num_requests-1; returns (table, next start time)."""
    n = num_requests
    rid = np.char.add("r", np.arange(first, first + n).astype(str))
    arrival = t0_ns + np.cumsum(rng.exponential(0.01e9, n).astype(np.int64))
    admit = arrival + rng.integers(10_000, 1_000_000, n)
    first_tok = admit + rng.integers(5_000_000, 200_000_000, n)
    k = rng.geometric(1 / 6, n)  # deliveries after the first token
    finish_extra = k * 25_000_000
    parts = []

    def envelope(m, kind, ids, ts, suffix):
        return {
            "event_id": np.char.add(ids, suffix),
            "schema_version": _constant(m, SCHEMA_VERSION),
            "event_type": _constant(m, kind),
            "ts_ns": ts,
            "engine_id": _constant(m, "bench"),
            "instance_id": _constant(m, "i0"),
            "request_id": ids,
            "tenant": _constant(m, "t0"),
            "service_class": _constant(m, "interactive"),
        }

    parts.append(_table(n, {**envelope(n, "request_arrived", rid, arrival, ":a"), "num_prompt_tokens": rng.integers(10, 4000, n), "num_branches": _constant(n, 1)}))
    parts.append(_table(n, {**envelope(n, "admission_decided", rid, admit, ":d"), "decision": _constant(n, "accept")}))
    parts.append(_table(n, envelope(n, "first_token", rid, first_tok, ":f")))
    d_rid = np.repeat(rid, k)
    d_idx = np.concatenate([np.arange(x) for x in k]).astype(str)
    d_ts = np.repeat(first_tok, k) + (np.concatenate([np.arange(1, x + 1) for x in k]) * 25_000_000)
    m = len(d_rid)
    parts.append(_table(m, {**envelope(m, "tokens_delivered", d_rid, d_ts, np.char.add(":t", d_idx)), "num_tokens": _constant(m, 1), "coalesced": _constant(m, False)}))
    parts.append(_table(n, {**envelope(n, "request_finished", rid, first_tok + finish_extra, ":z"), "outcome": _constant(n, "completed"), "num_output_tokens": k + 1}))
    # engine steps: each holds BATCH consecutive requests (their prefill)
    s = (n + BATCH - 1) // BATCH
    starts = admit[::BATCH]
    members = [rid[i * BATCH : (i + 1) * BATCH].tolist() for i in range(s)]
    step_ids = np.char.add("s", np.arange(first // BATCH, first // BATCH + s).astype(str))
    parts.append(
        _table(
            s,
            {
                "event_id": step_ids, "schema_version": _constant(s, SCHEMA_VERSION), "event_type": _constant(s, "step_executed"),
                "ts_ns": starts + 5_000_000, "engine_id": _constant(s, "bench"), "instance_id": _constant(s, "i0"),
                "step_index": np.arange(s), "start_ns": starts, "end_ns": starts + 5_000_000,
                "num_prefill_tokens": _constant(s, 2048), "num_decode_seqs": _constant(s, 0),
                "request_ids": members, "request_num_tokens": [[128] * len(x) for x in members],
                "num_kv_blocks_used": _constant(s, 100), "num_kv_blocks_free": _constant(s, 900),
            },
        )
    )
    table = pa.concat_tables(parts)
    dup = table.take(rng.choice(table.num_rows, table.num_rows // 100, replace=False))
    return pa.concat_tables([table, dup]), int(arrival[-1])


def generate(path: Path, num_events: int, seed: int = 7) -> int:
    """Write about num_events synthetic events to path; return the exact count."""
    rng = np.random.default_rng(seed)
    per_request = 1 + 1 + 1 + 6 + 1 + 1 / BATCH  # arrival, admission, first, ~6 deliveries, finish, steps
    num_requests = int(num_events / (per_request * 1.01))
    chunk = 100_000
    written, t0 = 0, 1_700_000_000_000_000_000
    with pq.ParquetWriter(path, EVENTS_SCHEMA, compression="zstd") as writer:
        for first in range(0, num_requests, chunk):
            table, t0 = synthetic_chunk(rng, first, min(chunk, num_requests - first), t0)
            writer.write_table(table, row_group_size=1_000_000)
            written += table.num_rows
    return written


def derive_in_this_process(path: Path, out: Path, memory_limit: str) -> dict:
    from pipelines.tables import connect, write_requests

    con = connect(None if memory_limit == "none" else memory_limit)
    started = time.perf_counter()
    rows = write_requests(path, out, con=con)
    elapsed = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"requests": rows, "seconds": round(elapsed, 3), "peak_rss_mb": round(peak_kb / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000,000 events instead of 10,000,000")
    parser.add_argument("--events", type=int, default=None, help="number of events (overrides --quick)")
    parser.add_argument("--derive", nargs=3, metavar=("EVENTS", "OUT", "LIMIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.derive:
        print(json.dumps(derive_in_this_process(Path(args.derive[0]), Path(args.derive[1]), args.derive[2])))
        return
    num_events = args.events or (1_000_000 if args.quick else 10_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.parquet"
        started = time.perf_counter()
        count = generate(events, num_events)
        print(f"generated {count:,} events in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        runs = {}
        for limit in ("none", "1GB"):  # DuckDB's default (80% of RAM), then capped: it spills to disk
            proc = subprocess.run(
                [sys.executable, __file__, "--derive", str(events), str(Path(tmp) / "requests.parquet"), limit],
                capture_output=True, text=True, check=True,
            )
            runs[limit] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"memory limit {limit}: {runs[limit]}", file=sys.stderr)
    free, capped = runs["none"], runs["1GB"]
    figures = {
        "events": count,
        "requests": free["requests"],
        "seconds": free["seconds"],
        "events_per_s": round(count / free["seconds"]),
        "peak_rss_mb": free["peak_rss_mb"],
        "capped_1gb_seconds": capped["seconds"],
        "capped_1gb_events_per_s": round(count / capped["seconds"]),
        "capped_1gb_peak_rss_mb": capped["peak_rss_mb"],
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
