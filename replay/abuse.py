"""Tenant labelling with authenticated classes, and the abuse a multi-tenant policy must withstand.

Policy studies need to know who sent each request and what that tenant is entitled to. A trace
records neither, so ``assign_tenants`` draws a tenant for every request (seeded, by share, with the
same hash draws a ``Scenario`` uses) and ``stamp_classes`` writes the class each request's tenant
is entitled to (``Tenancy``), overwriting whatever the request claimed: classes are set by the
gateway from authenticated configuration, never by the client. ``scenario_for`` and
``metric_classes`` turn the same tenancy into the replay's scenario (deadlines on
``request_arrived``) and the metrics' objectives, so one definition drives the workload, the
policy and the judgement.

Abuse, each a table of extra requests (``WORKLOAD_SCHEMA``) from one tenant, merged into a
workload with ``inject`` (arrival order kept; Poisson arrivals, seeded):

- ``long_prompt_flood``: many long prompts (prefill-heavy work that crowds out everyone's TTFT);
- ``max_output_requests``: requests that generate the longest output allowed (KV that grows for
  minutes: what a length predictor must not be fooled by);
- ``branch_expansion``: requests that ask for many parallel samples (n), multiplying KV and decode
  work per admission;
- ``cancel_churn``: clients that submit, cancel after a moment and resubmit at once, over and over
  (work that is started and thrown away; a cancelled request must free its resources at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from replay.errors import ReplayError
from replay.metrics import ClassObjectives
from replay.policies.tenancy import ClassConfig, Tenancy, TenantBook, TenantConfig
from replay.scenario import Scenario, ServiceClassSpec, TenantSpec, uniform
from replay.traces import WORKLOAD_SCHEMA

NS = 1_000_000_000
_TENANT_STREAM = 1  # the Scenario's tenant draw stream (replay.scenario)


def assign_tenants(workload: pa.Table, tenants: Sequence[TenantSpec], seed: int) -> pa.Table:
    """Every request gets a tenant drawn by share (seeded by position, as ``Scenario`` draws them)."""
    if not tenants or sum(t.share for t in tenants) <= 0:
        raise ReplayError("assign_tenants needs tenants whose shares add up to more than 0")
    n = workload.num_rows
    cumulative = np.cumsum([t.share for t in tenants], dtype=np.float64)
    cumulative /= cumulative[-1]
    u = uniform(seed, _TENANT_STREAM, np.arange(n, dtype=np.uint64))
    idx = np.minimum(np.searchsorted(cumulative, u, side="right"), len(tenants) - 1)
    names = np.asarray([t.name for t in tenants], dtype=object)[idx]
    i = workload.schema.get_field_index("tenant")
    return workload.set_column(i, workload.schema.field(i), pa.array(names.tolist(), pa.string()))


def stamp_classes(workload: pa.Table, tenancy: Tenancy) -> pa.Table:
    """Every request's class becomes the one its tenant is entitled to (any claimed class is overwritten)."""
    book = TenantBook(tenancy)
    tenants = workload["tenant"].to_pylist()
    classes = [book.class_of_tenant(t).name for t in tenants]
    i = workload.schema.get_field_index("service_class")
    return workload.set_column(i, workload.schema.field(i), pa.array(classes, pa.string()))


def scenario_for(tenancy: Tenancy, name: str = "tenancy") -> Scenario:
    """The scenario that carries the tenancy's objectives onto ``request_arrived`` (deadlines); it
    assigns nothing, since tenants and classes are already stamped."""
    return Scenario(
        name=name,
        service_classes=tuple(
            ServiceClassSpec(name=c.name, share=1.0, ttft_objective_s=c.ttft_objective_s,
                             itl_objective_s=c.itl_objective_s, e2e_objective_s=c.e2e_objective_s)
            for c in tenancy.classes
        ),
    )


def metric_classes(tenancy: Tenancy) -> tuple[ClassObjectives, ...]:
    """The tenancy's classes as the metrics' objectives (``MetricsConfig.classes``)."""
    return tuple(
        ClassObjectives(name=c.name, ttft_s=c.ttft_objective_s, itl_s=c.itl_objective_s, e2e_s=c.e2e_objective_s,
                        max_queue_s=c.max_queue_s)
        for c in tenancy.classes
    )


def time_scaled(workload: pa.Table, load: float) -> pa.Table:
    """The workload at ``load`` times its recorded rate: inter-arrival gaps divided by ``load``
    (the first arrival stays where it is; lengths, tenants and everything else unchanged)."""
    if not load > 0:
        raise ReplayError(f"time_scaled: load must be positive, not {load}")
    arrivals = workload["arrival_ns"].to_numpy()
    if not len(arrivals):
        return workload
    first = int(arrivals[0])
    scaled = first + np.floor((arrivals - first) / load).astype(np.int64)
    i = workload.schema.get_field_index("arrival_ns")
    return workload.set_column(i, workload.schema.field(i), pa.array(scaled, pa.int64()))


#: The documented two-class scenario of the policy comparison (docs/policies.md): five tenants of
#: equal traffic, three entitled to ``interactive`` (a chat product: TTFT 1 s, every gap 150 ms,
#: no E2E), two to ``batch`` (document jobs: TTFT 10 s, gaps 250 ms, E2E 120 s, sheddable).
TWO_CLASS_TENANCY = Tenancy(
    classes=(
        ClassConfig(name="interactive", priority=0, ttft_objective_s=1.0, itl_objective_s=0.15, max_queue_s=5.0),
        ClassConfig(name="batch", priority=1, ttft_objective_s=10.0, itl_objective_s=0.25, e2e_objective_s=120.0,
                    max_queue_s=60.0, sheddable=True),
    ),
    tenants=(
        TenantConfig(name="chat-a", service_class="interactive"),
        TenantConfig(name="chat-b", service_class="interactive"),
        TenantConfig(name="chat-c", service_class="interactive"),
        TenantConfig(name="docs-a", service_class="batch"),
        TenantConfig(name="docs-b", service_class="batch"),
        TenantConfig(name="flood", service_class="interactive"),
    ),
    default_class="batch",
)
TWO_CLASS_TENANTS = tuple(TenantSpec(name=t, share=1.0) for t in ("chat-a", "chat-b", "chat-c", "docs-a", "docs-b"))


def two_class_workload(workload: pa.Table, seed: int = 0, tenancy: Tenancy = TWO_CLASS_TENANCY) -> pa.Table:
    """The trace labelled for the two-class scenario: tenants drawn by share, classes from the tenancy."""
    return stamp_classes(assign_tenants(workload, TWO_CLASS_TENANTS, seed), tenancy)


# ---------------------------------------------------------------------------------------------- abuse


def _poisson_ns(rate_per_s: float, start_ns: int, duration_s: float, seed: int) -> np.ndarray:
    if not rate_per_s > 0 or not duration_s > 0:
        raise ReplayError("an abuse pattern needs a positive rate and duration")
    rng = np.random.default_rng(seed)
    expected = int(rate_per_s * duration_s * 1.5) + 16
    gaps = rng.exponential(NS / rate_per_s, size=expected)
    arrivals = start_ns + np.floor(np.cumsum(gaps)).astype(np.int64)
    return arrivals[arrivals < start_ns + int(duration_s * NS)]


def _table(prefix: str, arrivals: np.ndarray, tenant: str, num_prompt_tokens: int, num_output_tokens: int, *,
           num_branches: int = 1, cancel_after_ns: Sequence[int | None] | None = None) -> pa.Table:
    n = len(arrivals)
    width = max(5, len(str(n)))
    columns = {
        "request_id": pa.array([f"{prefix}-{i:0{width}d}" for i in range(n)], pa.string()),
        "arrival_ns": pa.array(arrivals, pa.int64()),
        "num_prompt_tokens": pa.array(np.full(n, num_prompt_tokens), pa.int64()),
        "num_output_tokens": pa.array(np.full(n, num_output_tokens), pa.int64()),
        "tenant": pa.array([tenant] * n, pa.string()),
        "num_branches": pa.array(np.full(n, num_branches), pa.int64()),
        "cancel_after_ns": pa.array(list(cancel_after_ns) if cancel_after_ns is not None else [None] * n, pa.int64()),
        "failed": pa.array(np.zeros(n, dtype=bool), pa.bool_()),
    }
    return pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA], schema=WORKLOAD_SCHEMA
    )


def long_prompt_flood(*, tenant: str, start_ns: int, duration_s: float, rate_per_s: float,
                      num_prompt_tokens: int = 8000, num_output_tokens: int = 64, seed: int = 0) -> pa.Table:
    """One tenant floods the instance with long prompts (Poisson at ``rate_per_s`` for ``duration_s``)."""
    return _table(f"flood-{tenant}", _poisson_ns(rate_per_s, start_ns, duration_s, seed), tenant, num_prompt_tokens,
                  num_output_tokens)


def max_output_requests(*, tenant: str, start_ns: int, duration_s: float, rate_per_s: float,
                        num_prompt_tokens: int = 256, num_output_tokens: int = 4096, seed: int = 0) -> pa.Table:
    """One tenant asks for the longest outputs allowed (each request generates ``num_output_tokens``)."""
    return _table(f"maxout-{tenant}", _poisson_ns(rate_per_s, start_ns, duration_s, seed), tenant, num_prompt_tokens,
                  num_output_tokens)


def branch_expansion(*, tenant: str, start_ns: int, duration_s: float, rate_per_s: float, num_branches: int = 16,
                     num_prompt_tokens: int = 512, num_output_tokens: int = 256, seed: int = 0) -> pa.Table:
    """One tenant asks for ``num_branches`` parallel samples per request."""
    if num_branches < 1:
        raise ReplayError("branch_expansion: num_branches must be at least 1")
    return _table(f"branches-{tenant}", _poisson_ns(rate_per_s, start_ns, duration_s, seed), tenant,
                  num_prompt_tokens, num_output_tokens, num_branches=num_branches)


def cancel_churn(*, tenant: str, start_ns: int, duration_s: float, num_clients: int = 8, cancel_after_s: float = 0.2,
                 resubmit_gap_s: float = 0.001, num_prompt_tokens: int = 2000, num_output_tokens: int = 512,
                 seed: int = 0) -> pa.Table:
    """``num_clients`` clients each submit, cancel after ``cancel_after_s`` and resubmit
    ``resubmit_gap_s`` later, over and over for ``duration_s`` (clients start at seeded offsets)."""
    if num_clients < 1 or not cancel_after_s > 0 or resubmit_gap_s < 0:
        raise ReplayError("cancel_churn: num_clients >= 1, cancel_after_s > 0 and resubmit_gap_s >= 0")
    period_ns = int((cancel_after_s + resubmit_gap_s) * NS)
    offsets = np.random.default_rng(seed).integers(0, period_ns, size=num_clients)
    rounds = int(duration_s * NS // period_ns)
    arrivals = np.sort((start_ns + offsets[None, :] + period_ns * np.arange(rounds)[:, None]).ravel())
    cancel = [int(cancel_after_s * NS)] * len(arrivals)
    return _table(f"churn-{tenant}", arrivals, tenant, num_prompt_tokens, num_output_tokens, cancel_after_ns=cancel)


def inject(workload: pa.Table, *extra: pa.Table) -> pa.Table:
    """The workload with extra requests merged in by arrival (the workload's first on ties; order kept)."""
    tables = [workload.select(WORKLOAD_SCHEMA.names).cast(WORKLOAD_SCHEMA)] + [
        t.select(WORKLOAD_SCHEMA.names).cast(WORKLOAD_SCHEMA) for t in extra
    ]
    merged = pa.concat_tables(tables).combine_chunks()
    source = np.concatenate([np.full(t.num_rows, i) for i, t in enumerate(tables)])
    position = np.concatenate([np.arange(t.num_rows) for t in tables])
    order = np.lexsort((position, source, merged["arrival_ns"].to_numpy()))
    out = merged.take(pa.array(order))
    if len(set(out["request_id"].to_pylist())) != out.num_rows:
        raise ReplayError("inject: request ids repeat across the merged tables", "give each abuse pattern its own tenant")
    return out


__all__ = [
    "TWO_CLASS_TENANCY",
    "TWO_CLASS_TENANTS",
    "assign_tenants",
    "branch_expansion",
    "cancel_churn",
    "inject",
    "long_prompt_flood",
    "max_output_requests",
    "metric_classes",
    "scenario_for",
    "stamp_classes",
    "time_scaled",
    "two_class_workload",
]
