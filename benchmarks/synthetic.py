"""Synthetic lifecycle events for benchmarks: realistic shapes, generated columnar and fast.

Each request yields an arrival, an admission, a first token, a geometric number of further
deliveries (mean 6) and a finish; every 16 consecutive requests share one engine step. Tenants
follow a Zipf law over ``num_tenants``, and 1% of events are duplicated as producer retries would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION

BATCH = 16  # requests per engine step in the synthetic stream


def _table(n: int, columns: dict[str, pa.Array | list]) -> pa.Table:
    arrays = []
    for field in EVENTS_SCHEMA:
        value = columns.get(field.name)
        arrays.append(pa.nulls(n, field.type) if value is None else pa.array(value, field.type))
    return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)


def _constant(n: int, value) -> pa.Array:
    return pa.repeat(pa.scalar(value), n) if n else pa.array([], type=pa.scalar(value).type)


NUM_TENANTS = 200
MODELS = np.array(["llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b"])
CLASSES = np.array(["interactive", "batch"])


def synthetic_chunk(rng: np.random.Generator, first: int, num_requests: int, t0_ns: int) -> tuple[pa.Table, int]:
    """Events for requests first..first+num_requests-1; returns (table, next start time)."""
    n = num_requests
    tenant_of = np.char.add("tenant-", (rng.zipf(1.3, n) % NUM_TENANTS).astype(str))
    model_of = MODELS[rng.integers(0, len(MODELS), n)]
    class_of = CLASSES[rng.integers(0, len(CLASSES), n)]
    instance_of = np.char.add("gpu-node-", rng.integers(0, 8, n).astype(str))
    rid = np.char.add("r", np.arange(first, first + n).astype(str))
    arrival = t0_ns + np.cumsum(rng.exponential(0.01e9, n).astype(np.int64))
    admit = arrival + rng.integers(10_000, 1_000_000, n)
    first_tok = admit + rng.integers(5_000_000, 200_000_000, n)
    k = rng.geometric(1 / 6, n)  # deliveries after the first token
    finish_extra = k * 25_000_000
    parts = []

    def envelope(m, kind, ids, ts, suffix, rows=None):
        rows = np.arange(n) if rows is None else rows
        return {
            "event_id": np.char.add(ids, suffix),
            "schema_version": _constant(m, SCHEMA_VERSION),
            "event_type": _constant(m, kind),
            "ts_ns": ts,
            "engine_id": _constant(m, "bench"),
            "instance_id": instance_of[rows],
            "request_id": ids,
            "tenant": tenant_of[rows],
            "service_class": class_of[rows],
            "model": model_of[rows],
        }

    users = np.char.add("user-", rng.integers(0, 50_000, n).astype(str))
    parts.append(
        _table(
            n,
            {
                **envelope(n, "request_arrived", rid, arrival, ":a"),
                "num_prompt_tokens": rng.integers(10, 4000, n),
                "num_branches": _constant(n, 1),
                "user": users,
                "session_id": np.char.add("s-", users),
            },
        )
    )
    parts.append(_table(n, {**envelope(n, "admission_decided", rid, admit, ":d"), "decision": _constant(n, "accept")}))
    parts.append(_table(n, envelope(n, "first_token", rid, first_tok, ":f")))
    d_rows = np.repeat(np.arange(n), k)
    d_rid = rid[d_rows]
    d_idx = np.concatenate([np.arange(x) for x in k]).astype(str)
    d_ts = np.repeat(first_tok, k) + (np.concatenate([np.arange(1, x + 1) for x in k]) * 25_000_000)
    m = len(d_rid)
    parts.append(
        _table(
            m,
            {
                **envelope(m, "tokens_delivered", d_rid, d_ts, np.char.add(":t", d_idx), d_rows),
                "num_tokens": _constant(m, 1),
                "coalesced": _constant(m, False),
            },
        )
    )
    parts.append(
        _table(
            n,
            {
                **envelope(n, "request_finished", rid, first_tok + finish_extra, ":z"),
                "outcome": _constant(n, "completed"),
                "num_output_tokens": k + 1,
            },
        )
    )
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


def iter_chunks(num_events: int, seed: int = 7, requests_per_chunk: int = 100_000) -> Iterator[pa.Table]:
    """About ``num_events`` synthetic events, in tables of ``requests_per_chunk`` requests."""
    rng = np.random.default_rng(seed)
    per_request = 1 + 1 + 1 + 6 + 1 + 1 / BATCH  # arrival, admission, first, ~6 deliveries, finish, steps
    num_requests = max(1, int(num_events / (per_request * 1.01)))
    t0 = 1_700_000_000_000_000_000
    for first in range(0, num_requests, requests_per_chunk):
        table, t0 = synthetic_chunk(rng, first, min(requests_per_chunk, num_requests - first), t0)
        yield table


def generate(path: Path, num_events: int, seed: int = 7) -> int:
    """Write about num_events synthetic events to path; return the exact count."""
    written = 0
    with pq.ParquetWriter(path, EVENTS_SCHEMA, compression="zstd") as writer:
        for table in iter_chunks(num_events, seed):
            writer.write_table(table, row_group_size=1_000_000)
            written += table.num_rows
    return written


