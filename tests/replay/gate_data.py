"""Synthetic request tables with known differences, for the metrics and gate tests.

Arrivals follow a Poisson process; TTFT is lognormal around ``ttft_median_s`` with an AR(1) drift
between 60 s windows (so requests close in time are correlated, as in a real queue); a chosen share
of requests is rejected; a class's TTFT or inter-token gaps can be scaled (``ttft_factor``,
``itl_factor``). The table has the request-table schema, so it goes through the same code
as real or replayed data.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from replay.derive import REQUESTS_SCHEMA

T0 = 1_764_000_000_000_000_000


def synthetic_requests(
    num_requests: int = 4_000,
    *,
    seed: int = 1,
    rate_per_s: float = 10.0,
    ttft_median_s: float = 0.2,
    ttft_factor: dict[str, float] | None = None,
    itl_factor: dict[str, float] | None = None,
    reject_share: float = 0.0,
    classes: tuple[str, ...] = ("interactive", "batch"),
    tenants: int = 8,
    drift_sigma: float = 0.3,
) -> pa.Table:
    rng = np.random.default_rng(seed)
    arrival = T0 + np.cumsum(rng.exponential(1e9 / rate_per_s, num_requests)).astype(np.int64)
    klass = np.asarray(classes, dtype=object)[rng.integers(0, len(classes), num_requests)]
    window = ((arrival - arrival[0]) // 60_000_000_000).astype(int)
    drift = np.zeros(window.max() + 1)
    for w in range(1, len(drift)):  # AR(1) across windows: correlated in time
        drift[w] = 0.7 * drift[w - 1] + rng.normal(0, drift_sigma)
    ttft = ttft_median_s * np.exp(rng.normal(0, 0.5, num_requests) + drift[window])
    for name, factor in (ttft_factor or {}).items():
        ttft[klass == name] *= factor
    out = rng.integers(20, 400, num_requests)
    tpot = rng.uniform(0.02, 0.05, num_requests)
    for name, factor in (itl_factor or {}).items():  # a slower decode: every gap of the class x factor
        tpot[klass == name] *= factor
    rejected = rng.random(num_requests) < reject_share
    first = arrival + (ttft * 1e9).astype(np.int64)
    last = first + (tpot * (out - 1) * 1e9).astype(np.int64)
    n = num_requests
    cols = {
        "request_id": [f"rq_{i:08d}" for i in range(n)],
        "engine_id": ["replay"] * n,
        "tenant": [f"tn_{i % tenants}" for i in range(n)],
        "service_class": klass.tolist(),
        "arrival_ns": arrival,
        "admission_ns": arrival,
        "scheduled_ns": np.where(rejected, 0, arrival + (ttft * 0.5e9).astype(np.int64)),
        "first_token_ns": first,
        "last_token_ns": last,
        "finish_ns": last,
        "outcome": np.where(rejected, "rejected", "completed").tolist(),
        "num_prompt_tokens": rng.integers(50, 2000, n),
        "num_output_tokens": np.where(rejected, 0, out),
        "queue_s": ttft * 0.5,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": (last - arrival) / 1e9,
        "num_itl_gaps": out - 1,
        "itl_p99_s": tpot * 1.5,
    }
    table = {}
    for f in REQUESTS_SCHEMA:
        if f.name in cols:
            values = cols[f.name]
            if f.name in ("scheduled_ns", "first_token_ns", "last_token_ns", "finish_ns", "ttft_s", "tpot_s", "e2e_s",
                          "queue_s", "itl_p99_s"):
                values = [None if r else v for r, v in zip(rejected, np.asarray(values).tolist())]
            table[f.name] = pa.array(values, f.type)
        elif not f.nullable:
            table[f.name] = pa.array([False if f.type == pa.bool_() else 0] * n, f.type)
        else:
            table[f.name] = pa.nulls(n, f.type)
    return pa.Table.from_pydict(table, schema=REQUESTS_SCHEMA)
