"""Workload tables: their burst statistics and their arrivals as lifecycle events.

A workload (``schemas.records.WorkloadRequest``) is what arrived and how much work it asked for. The
statistics here (rate, token percentiles, inter-arrival CV, peak-to-mean per window) describe the
burst structure that every load transform must keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Burstiness:
    """How bursty a stream of arrivals is."""

    interarrival_cv: float  # std / mean of the gaps between consecutive arrivals (population std)
    peak_to_mean_1s: float  # busiest 1 s window's arrivals / mean arrivals per 1 s window
    peak_to_mean_10s: float  # likewise for 10 s windows


def peak_to_mean(arrival_ns: np.ndarray, window_s: float) -> float:
    """Arrivals in the busiest window over the mean per window, windows tiling the span."""
    if len(arrival_ns) == 0:
        return float("nan")
    window_ns = int(window_s * 1e9)
    offsets = arrival_ns - arrival_ns.min()
    counts = np.bincount(offsets // window_ns)
    return float(counts.max() / counts.mean())


def burstiness(arrival_ns: np.ndarray) -> Burstiness:
    """Burst statistics of arrival times (ns, any order: they are sorted first)."""
    arrivals = np.sort(np.asarray(arrival_ns, dtype=np.int64))
    gaps = np.diff(arrivals).astype(np.float64)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else float("nan")
    return Burstiness(cv, peak_to_mean(arrivals, 1.0), peak_to_mean(arrivals, 10.0))


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """A one-screen description of a workload."""

    num_requests: int
    num_failed: int
    span_s: float
    mean_rate_per_s: float
    prompt_tokens_p50: float
    prompt_tokens_p99: float
    output_tokens_p50: float
    output_tokens_p99: float
    burst: Burstiness


def workload_stats(workload: pa.Table) -> WorkloadStats:
    """Counts, rate, token percentiles and burstiness of a workload table."""
    arrivals = workload["arrival_ns"].to_numpy()
    n = len(arrivals)
    span_s = float(arrivals.max() - arrivals.min()) / 1e9 if n else 0.0
    prompt = workload["num_prompt_tokens"].to_numpy()
    output = workload["num_output_tokens"].to_numpy()
    return WorkloadStats(
        num_requests=n,
        num_failed=int(pc.sum(workload["failed"]).as_py() or 0),
        span_s=span_s,
        mean_rate_per_s=n / span_s if span_s > 0 else float("nan"),
        prompt_tokens_p50=float(np.percentile(prompt, 50)),
        prompt_tokens_p99=float(np.percentile(prompt, 99)),
        output_tokens_p50=float(np.percentile(output, 50)),
        output_tokens_p99=float(np.percentile(output, 99)),
        burst=burstiness(arrivals),
    )


def arrival_events(workload: pa.Table, engine_id: str) -> pa.Table:
    """One ``request_arrived`` event per workload request, columnar (``EVENTS_SCHEMA``).

    A trace records arrivals and token counts, not what the engine did, so arrivals are the only
    events a trace yields on its own; a replay adds the rest.
    """
    n = workload.num_rows
    ids = workload["request_id"]
    columns = {
        "event_id": pc.binary_join_element_wise(ids, pa.scalar(":arrived"), ""),
        "schema_version": pa.array([SCHEMA_VERSION] * n, pa.string()),
        "event_type": pa.array(["request_arrived"] * n, pa.string()),
        "ts_ns": workload["arrival_ns"],
        "engine_id": pa.array([engine_id] * n, pa.string()),
        "request_id": ids,
        "num_prompt_tokens": workload["num_prompt_tokens"],
        "num_branches": workload["num_branches"],
        "prefix_block_ids": workload["prefix_block_ids"],
    }
    for name in ("tenant", "service_class", "model", "adapter", "session_id"):
        columns[name] = workload[name]
    arrays = [
        columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in EVENTS_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)
