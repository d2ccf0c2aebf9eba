"""Service-level metrics of any request table, real or replayed, overall, per class and per window.

Inputs are the request table (``schemas.records.RequestRow``, from ``replay.derive``) and,
for cost, the engine steps of the same events. A request is **good** when it completed and met every
objective of its class: TTFT, the request's p99 inter-token gap, E2E (``ClassObjectives``). From
there (definitions in ``docs/metrics.md``):

- SLO goodput: good requests and their output tokens per second of the measured span;
- attainment: good requests over all requests that arrived (a rejection or cancellation counts as
  a miss, so goodput cannot be bought by dropping work), and per objective;
- latency percentiles (TTFT, ITL p99 per request, TPOT, E2E, queue time);
- rejections, cancellations, time-outs and errors as shares of arrivals;
- starvation: the longest queue residence, the p99 queue age, the share past the class's limit;
- preemptions per request, wasted (recomputed) token share, oscillation (requests preempted twice
  or more; moves to another instance with the KV, ``num_migrations``, are not preemptions and are
  counted apart as migrations per request), and flapping of the admission controller (1 s windows that switch between rejecting
  and not rejecting);
- fairness: each tenant's delivered service (input tokens x 1 + output tokens x 2, as VTC counts
  it) over its entitlement weight, Jain's index over tenants, and the largest gap between tenants
  that were backlogged in the same window;
- cost: accelerator-seconds (instances x span), their busy share from the steps, currency per 1k
  goodput tokens, and each tenant's share of the busy time, split by the tokens each request
  processed in each step, so cancelled and abandoned work is charged to whoever reserved it.

Everything is computed with numpy over columns (a million requests take seconds) and returned as
flat ``MetricValue`` records; the per-window sufficient statistics (``WindowStats``) feed the
block bootstrap of ``replay.compare``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.types import doc

if TYPE_CHECKING:
    from privacy.views import TenantScope

NS = 1_000_000_000
#: Log-spaced histogram bins for latency distributions: 1e-4 s to 1e4 s, 1% apart.
HIST_EDGES_S = np.geomspace(1e-4, 1e4, int(np.log(1e8) / np.log(1.01)) + 1)
DEFAULT_CLASS = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassObjectives:
    """A service class's objectives; a request is good when it completes within every one set."""

    name: str = doc("Service class name ('default' applies to requests of any class not listed).")
    ttft_s: float | None = doc("TTFT objective, seconds.", None)
    itl_s: float | None = doc("Objective for each request's p99 inter-token gap, seconds.", None)
    e2e_s: float | None = doc("E2E objective, seconds.", None)
    max_queue_s: float | None = doc("Longest acceptable queue residence (starvation limit), seconds.", None)
    weight: float = doc("Unused by metrics; kept so scenarios and gates can share one class list.", 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostConfig:
    """What accelerator time costs."""

    accelerator_hour_price: float = doc("Price of one accelerator-hour.", 2.5)
    currency: str = doc("Currency of the price.", "USD")
    accelerators_per_instance: int = doc("Accelerators behind each serving instance (its TP degree).", 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantWeight:
    """A tenant's entitlement weight (VTC divides its service by it)."""

    tenant: str = doc("Tenant pseudonym.")
    weight: float = doc("Entitlement weight (default for unlisted tenants: 1).")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    """How a request table is judged."""

    classes: tuple[ClassObjectives, ...] = doc(
        "Objectives per class.",
        (ClassObjectives(name=DEFAULT_CLASS, ttft_s=2.0, itl_s=0.2, e2e_s=60.0, max_queue_s=30.0),),
    )
    window_s: float = doc("Window for over-time figures and the block bootstrap, seconds.", 60.0)
    cost: CostConfig = doc("Accelerator prices.", CostConfig())
    tenant_weights: tuple[TenantWeight, ...] = doc("Entitlement weight per tenant (default 1).", ())

    def weights(self) -> dict[str, float]:
        return {t.tenant: t.weight for t in self.tenant_weights}

    def objectives(self, service_class: str | None) -> ClassObjectives:
        by_name = {c.name: c for c in self.classes}
        return by_name.get(service_class or DEFAULT_CLASS) or by_name.get(DEFAULT_CLASS) or ClassObjectives(name=DEFAULT_CLASS)


@dataclass(frozen=True, slots=True)
class MetricValue:
    """One figure: a metric of a scope (overall, a class, a window, a tenant)."""

    scope: str  # "overall", "class", "window", "tenant"
    group: str  # "" overall, the class name, the window start (s from the run start), the tenant
    name: str
    value: float | None
    num_points: int  # requests (or windows, for rates over time) behind the figure
    unit: str


_OUTCOMES = ("completed", "cancelled", "rejected", "timed_out", "error")


def _np(table: pa.Table, name: str, fill: float = np.nan) -> np.ndarray:
    column = table[name]
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return pc.fill_null(column, fill).to_numpy().astype(np.float64)
    return np.asarray(column.to_pylist(), dtype=object)


@dataclass
class Requests:
    """The request table as numpy columns, with each request's objectives and verdicts."""

    arrival_s: np.ndarray  # seconds from the run's time origin
    service_class: np.ndarray  # object array of class names ('default' for none)
    tenant: np.ndarray  # object array of tenants ('unknown' for none)
    class_code: np.ndarray  # index into class_names
    class_names: np.ndarray  # sorted distinct class names
    tenant_code: np.ndarray  # index into tenant_names
    tenant_names: np.ndarray  # sorted distinct tenants
    outcome: np.ndarray
    ttft_s: np.ndarray
    itl_p99_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    queue_s: np.ndarray
    num_prompt_tokens: np.ndarray
    num_output_tokens: np.ndarray
    num_preemptions: np.ndarray  # recompute and swap preemptions (not moves)
    num_migrations: np.ndarray  # moves to another instance with the KV (request_preempted, mode migrate)
    num_lost_tokens: np.ndarray
    num_admission_decisions: np.ndarray
    request_id: np.ndarray
    good: np.ndarray  # completed and within every objective of its class
    meets_ttft: np.ndarray  # completed within the TTFT objective
    meets_itl: np.ndarray  # completed with its p99 inter-token gap within the ITL objective
    meets_e2e: np.ndarray  # completed within the E2E objective
    past_limit: np.ndarray  # queued longer than its class's max_queue_s
    rejected: np.ndarray
    origin_ns: int

    @property
    def size(self) -> int:
        return len(self.arrival_s)


def categories(column: pa.ChunkedArray | pa.Array, missing: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, sorted names) of a string column, nulls named ``missing``: dictionary encoding in
    Arrow, so a million rows cost milliseconds, not a Python sort of strings."""
    filled = pc.fill_null(column, missing)
    encoded = pc.dictionary_encode(filled.combine_chunks() if isinstance(filled, pa.ChunkedArray) else filled)
    names = np.asarray(encoded.dictionary.to_pylist(), dtype=object)
    order = np.argsort(names) if len(names) else np.zeros(0, dtype=np.int64)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    codes = rank[encoded.indices.to_numpy(zero_copy_only=False)] if len(names) else np.zeros(len(filled), dtype=np.int64)
    return codes, names[order]


def load_requests(table: pa.Table, config: MetricsConfig, origin_ns: int | None = None) -> Requests:
    """Numpy columns of a request table; times relative to ``origin_ns`` (default: first arrival)."""
    table = table.filter(pc.is_valid(table["arrival_ns"])) if table.num_rows else table
    arrival_ns = table["arrival_ns"].to_numpy() if table.num_rows else np.zeros(0, dtype=np.int64)
    origin = int(arrival_ns.min()) if origin_ns is None and len(arrival_ns) else (origin_ns or 0)
    class_code, class_names = categories(table["service_class"], DEFAULT_CLASS)
    tenant_code, tenant_names = categories(table["tenant"], "unknown")
    outcome_code, outcome_names = categories(table["outcome"], "in_flight")
    classes = class_names[class_code]
    outcome = outcome_names[outcome_code]
    ttft, itl, e2e, queue = (_np(table, n) for n in ("ttft_s", "itl_p99_s", "e2e_s", "queue_s"))
    completed = outcome == "completed"
    limits = {name: np.full(len(classes), np.inf) for name in ("ttft_s", "itl_s", "e2e_s", "max_queue_s")}
    for code, name in enumerate(class_names):
        obj = config.objectives(name)
        rows = class_code == code
        for key in limits:
            value = getattr(obj, key)
            limits[key][rows] = np.inf if value is None else value
    with np.errstate(invalid="ignore"):
        meets_ttft = completed & (ttft <= limits["ttft_s"])
        meets_itl = completed & ((itl <= limits["itl_s"]) | np.isnan(itl))  # one token: no gap to judge
        meets_e2e = completed & (e2e <= limits["e2e_s"])
        past_limit = queue > limits["max_queue_s"]
    return Requests(
        arrival_s=(arrival_ns - origin) / NS,
        service_class=classes,
        tenant=tenant_names[tenant_code],
        class_code=class_code,
        class_names=class_names,
        tenant_code=tenant_code,
        tenant_names=tenant_names,
        outcome=outcome,
        ttft_s=ttft,
        itl_p99_s=itl,
        tpot_s=_np(table, "tpot_s"),
        e2e_s=e2e,
        queue_s=queue,
        num_prompt_tokens=_np(table, "num_prompt_tokens", 0),
        num_output_tokens=_np(table, "num_output_tokens", 0),
        num_preemptions=_np(table, "num_preemptions", 0),
        # request tables derived before moves were counted apart have no num_migrations column
        num_migrations=_np(table, "num_migrations", 0) if "num_migrations" in table.column_names
        else np.zeros(table.num_rows),
        num_lost_tokens=_np(table, "num_lost_tokens", 0),
        num_admission_decisions=_np(table, "num_admission_decisions", 0),
        request_id=np.array(table["request_id"].to_pylist(), dtype=object),
        good=meets_ttft & meets_itl & meets_e2e,
        meets_ttft=meets_ttft,
        meets_itl=meets_itl,
        meets_e2e=meets_e2e,
        past_limit=past_limit,
        rejected=outcome == "rejected",
        origin_ns=origin,
    )


@dataclass
class Steps:
    """Engine steps as numpy columns (for busy time and per-request compute attribution)."""

    start_s: np.ndarray
    duration_s: np.ndarray  # the whole event (all its num_steps)
    instance: np.ndarray
    member_ids: pa.Array  # the distinct request ids of the batch members (strings, each once)
    member_request: np.ndarray  # flattened batch membership: index into member_ids ...
    member_step: np.ndarray  # ... the step it belongs to ...
    member_tokens: np.ndarray  # ... and the tokens it processed there

    @property
    def num_instances(self) -> int:
        return len(set(self.instance.tolist())) if len(self.instance) else 0


def load_steps(events: pa.Table, origin_ns: int) -> Steps:
    """The ``step_executed`` events of an events table (``EVENTS_SCHEMA``, or just the step columns)
    as numpy columns."""
    steps = events.filter(pc.equal(events["event_type"], "step_executed"))
    start = pc.fill_null(steps["start_ns"], 0).to_numpy()
    end = pc.fill_null(steps["end_ns"], 0).to_numpy()
    members = steps["request_ids"].combine_chunks() if steps.num_rows else pa.array([], pa.list_(pa.string()))
    tokens = steps["request_num_tokens"].combine_chunks() if steps.num_rows else pa.array([], pa.list_(pa.int64()))
    # a request is a member of many steps: keep each id once and the members as integer codes
    # (``gate.load_run`` reads the ids dictionary-encoded already)
    flat = pc.list_flatten(members) if len(members) else None
    codes = flat if flat is None or pa.types.is_dictionary(flat.type) else pc.dictionary_encode(flat)
    return Steps(
        start_s=(start - origin_ns) / NS,
        duration_s=(end - start) / NS,
        instance=np.array([i or "" for i in steps["instance_id"].to_pylist()], dtype=object),
        member_ids=codes.dictionary if codes is not None else pa.array([], pa.string()),
        member_request=codes.indices.to_numpy().astype(np.int64) if codes is not None else np.zeros(0, np.int64),
        member_step=pc.list_parent_indices(members).to_numpy() if len(members) else np.zeros(0, dtype=np.int64),
        member_tokens=pc.list_flatten(tokens).to_numpy().astype(np.float64) if len(tokens) else np.zeros(0),
    )


def itl_ratio_of_means(ttft_mean_s: float, e2e_mean_s: float, output_tokens_mean: float) -> float:
    """ITL as inference-perf's summaries (and the fidelity data) define it: (mean E2E - mean TTFT) / (mean
    output tokens - 1), the denominator at least 1: a ratio of means, not a mean of per-token gaps."""
    return (e2e_mean_s - ttft_mean_s) / max(output_tokens_mean - 1.0, 1.0)


def percentile(values: np.ndarray, q: float) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else None


def _share(mask: np.ndarray, of: int) -> float | None:
    return float(mask.sum()) / of if of else None


def jain_index(x: np.ndarray) -> float | None:
    """(sum x)^2 / (n sum x^2): 1 when every tenant gets the same normalized service."""
    x = x[np.isfinite(x)]
    if not len(x) or not (x**2).sum():
        return None
    return float(x.sum() ** 2 / (len(x) * (x**2).sum()))


def _served(r: Requests) -> np.ndarray:
    """Delivered service per request: input tokens x 1 + output tokens x 2, for requests that got output."""
    return np.where(r.num_output_tokens > 0, r.num_prompt_tokens + 2 * r.num_output_tokens, 0.0)


def tenant_service(r: Requests, weights: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """(tenants, delivered service / entitlement weight) of the tenants with requests."""
    totals = np.bincount(r.tenant_code, weights=_served(r), minlength=len(r.tenant_names))
    present = np.bincount(r.tenant_code, minlength=len(r.tenant_names)) > 0
    w = np.array([weights.get(t, 1.0) for t in r.tenant_names], dtype=np.float64)
    return r.tenant_names[present], (totals / np.where(w > 0, w, 1.0))[present]


def max_backlogged_gap(r: Requests, weights: dict[str, float], window_s: float) -> float | None:
    """The largest difference in normalized service between two tenants backlogged (with a request
    arriving, hence waiting or running) in the same window, over all windows (VTC's fairness
    measure, per window)."""
    if not r.size:
        return None
    # the windows that hold arrivals, numbered densely: a run's span may be years between two requests
    _, windows = np.unique(np.floor(r.arrival_s / window_s).astype(np.int64), return_inverse=True)
    num_t = len(r.tenant_names)
    cell = windows * num_t + r.tenant_code
    size = (windows.max() + 1) * num_t
    w = np.array([weights.get(t, 1.0) for t in r.tenant_names], dtype=np.float64)
    service = (np.bincount(cell, weights=_served(r), minlength=size).reshape(-1, num_t)) / np.where(w > 0, w, 1.0)
    active = np.bincount(cell, minlength=size).reshape(-1, num_t) > 0
    both = active.sum(1) >= 2
    if not both.any():
        return None
    gaps = np.where(active, service, -np.inf).max(1) - np.where(active, service, np.inf).min(1)
    return float(gaps[both].max())


def flaps(r: Requests) -> int:
    """Times the admission controller switched between rejecting and not rejecting, by 1 s windows."""
    if not r.size:
        return 0
    seconds, second = np.unique(np.floor(r.arrival_s).astype(np.int64), return_inverse=True)
    rejecting = np.zeros(len(seconds), dtype=bool)
    np.logical_or.at(rejecting, second[r.rejected], True)
    # the seconds between two with arrivals reject nothing: one False stands for each such gap (sparse, so a
    # span of years between two requests costs nothing)
    gaps = np.diff(seconds) > 1
    sequence = np.zeros(len(seconds) + int(gaps.sum()), dtype=bool)
    sequence[np.arange(len(seconds)) + np.concatenate([[0], np.cumsum(gaps)])] = rejecting
    return int(np.count_nonzero(sequence[1:] != sequence[:-1]))


def attribution(r: Requests, steps: Steps | None) -> np.ndarray:
    """Busy accelerator-seconds charged to each request: each step's time split by the tokens its
    members processed in it (work later cancelled or recomputed is charged all the same)."""
    charge = np.zeros(r.size)
    if steps is None or not len(steps.member_request):
        return charge
    tokens_per_step = np.bincount(steps.member_step, weights=steps.member_tokens, minlength=len(steps.start_s))
    share = steps.member_tokens / np.where(tokens_per_step[steps.member_step] > 0, tokens_per_step[steps.member_step], 1)
    seconds = share * steps.duration_s[steps.member_step]
    # each distinct member id's row in the request table (-1: a request the table does not hold)
    id_rows = pc.fill_null(pc.index_in(steps.member_ids, value_set=pa.array(r.request_id.tolist(), pa.string())), -1)
    rows = id_rows.to_numpy().astype(np.int64)[steps.member_request]
    known = rows >= 0
    np.add.at(charge, rows[known], seconds[known])
    return charge


def summarize(r: Requests, steps: Steps | None, config: MetricsConfig, *, scope: str = "overall", group: str = "",
              span_s: float | None = None) -> list[MetricValue]:
    """Every metric of one set of requests (a run, a class, a window)."""
    n = r.size
    if span_s is None:
        span_s = float(r.arrival_s.max() - r.arrival_s.min()) if n > 1 else 0.0
        done = r.arrival_s + np.nan_to_num(r.e2e_s, nan=0.0)
        span_s = max(span_s, float(done.max() - r.arrival_s.min()) if n else 0.0)
    completed = r.outcome == "completed"
    weights = config.weights()
    out: list[MetricValue] = []

    def add(name: str, value: float | None, unit: str, points: int = n) -> None:
        out.append(MetricValue(scope, group, name, None if value is None else float(value), points, unit))

    good_tokens = float(r.num_output_tokens[r.good].sum())
    add("num_requests", n, "requests")
    add("goodput_rps", r.good.sum() / span_s if span_s > 0 else None, "requests/s")
    add("goodput_tokens_per_s", good_tokens / span_s if span_s > 0 else None, "tokens/s")
    add("throughput_rps", completed.sum() / span_s if span_s > 0 else None, "requests/s")
    add("attainment", _share(r.good, n), "share")
    for objective, met in (("ttft", r.meets_ttft), ("itl", r.meets_itl), ("e2e", r.meets_e2e)):
        add(f"attainment_{objective}", _share(met, n), "share")
    for name, values in (("ttft", r.ttft_s), ("itl_p99", r.itl_p99_s), ("tpot", r.tpot_s), ("e2e", r.e2e_s), ("queue", r.queue_s)):
        points = int(np.count_nonzero(~np.isnan(values)))
        for q in (50, 90, 99):
            add(f"{name}_p{q}_s", percentile(values, q), "s", points)
    for outcome in ("rejected", "cancelled", "timed_out", "error"):
        add(f"{outcome}_share", _share(r.outcome == outcome, n), "share")
    queue = r.queue_s[~np.isnan(r.queue_s)]
    add("max_queue_s", float(queue.max()) if len(queue) else None, "s", len(queue))
    add("past_queue_limit_share", _share(r.past_limit, n), "share")
    add("preemptions_per_request", float(r.num_preemptions.sum()) / n if n else None, "preemptions/request")
    generated = float(r.num_output_tokens.sum() + r.num_prompt_tokens.sum())
    add("wasted_token_share", float(r.num_lost_tokens.sum()) / generated if generated else None, "share")
    add("oscillating_share", _share(r.num_preemptions >= 2, n), "share")
    add("migrations_per_request", float(r.num_migrations.sum()) / n if n else None, "migrations/request")
    add("admission_flaps_per_hour", flaps(r) / (span_s / 3600) if span_s > 0 else None, "switches/hour")
    tenants, normalized = tenant_service(r, weights)
    add("jain_index", jain_index(normalized), "index", len(tenants))
    add("max_backlogged_service_gap", max_backlogged_gap(r, weights, config.window_s), "service/weight", len(tenants))
    if steps is not None and len(steps.start_s):
        instances = max(steps.num_instances, 1) * config.cost.accelerators_per_instance
        busy = float(steps.duration_s.sum()) * config.cost.accelerators_per_instance
        total = instances * span_s
        add("accelerator_seconds", total, "s")
        add("idle_share", 1 - busy / total if total > 0 else None, "share")
        price = config.cost.accelerator_hour_price / 3600
        add(f"cost_per_1k_goodput_tokens_{config.cost.currency.lower()}",
            total * price / (good_tokens / 1000) if good_tokens else None, config.cost.currency)
    return out


def run_metrics(requests: pa.Table, events: pa.Table | None, config: MetricsConfig) -> list[MetricValue]:
    """Overall, per-class and per-window metrics of a run (per-tenant views go through
    ``tenant_metrics``, which is k-anonymous)."""
    r = load_requests(requests, config)
    steps = load_steps(events, r.origin_ns) if events is not None else None
    out = summarize(r, steps, config)
    for code, name in enumerate(r.class_names):
        rows = r.class_code == code
        out += summarize(_subset(r, rows), None, config, scope="class", group=name)
    return out + window_metrics(r, config)


def window_metrics(r: Requests, config: MetricsConfig) -> list[MetricValue]:
    """Per window of ``config.window_s`` by arrival: requests, goodput (requests and tokens), throughput,
    attainment, TTFT p99 and rejected share (``summarize``'s definitions over each window's requests, with the
    window as the span), one pass over the requests in window order."""
    if not r.size:
        return []
    w = config.window_s
    windows = np.floor(r.arrival_s / w).astype(np.int64)
    order = np.argsort(windows, kind="stable")
    starts = np.flatnonzero(np.r_[True, windows[order][1:] != windows[order][:-1]])
    ends = np.r_[starts[1:], len(order)]
    completed, good_tokens = r.outcome == "completed", np.where(r.good, r.num_output_tokens, 0.0)
    out: list[MetricValue] = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        rows = order[start:end]
        n, group = end - start, f"{windows[rows[0]] * w:g}"
        good = int(r.good[rows].sum())
        ttft = r.ttft_s[rows]
        for name, value, unit, points in (
            ("num_requests", n, "requests", n), ("goodput_rps", good / w, "requests/s", n),
            ("goodput_tokens_per_s", float(good_tokens[rows].sum()) / w, "tokens/s", n),
            ("throughput_rps", int(completed[rows].sum()) / w, "requests/s", n), ("attainment", good / n, "share", n),
            ("ttft_p99_s", percentile(ttft, 99), "s", int(np.count_nonzero(~np.isnan(ttft)))),
            ("rejected_share", int(r.rejected[rows].sum()) / n, "share", n),
        ):
            out.append(MetricValue("window", group, name, None if value is None else float(value), points, unit))
    return out


_CATEGORY_NAMES = ("class_names", "tenant_names")


def _subset(r: Requests, rows: np.ndarray) -> Requests:
    """The requests selected by ``rows`` (codes keep pointing into the same name lists)."""
    return Requests(**{k: v[rows] if isinstance(v, np.ndarray) and k not in _CATEGORY_NAMES else v
                       for k, v in r.__dict__.items()})


def tenant_metrics(
    requests: pa.Table, events: pa.Table | None, config: MetricsConfig, *, k: int = 5, scope: TenantScope | None = None
) -> tuple[pa.Table, int]:
    """Per-tenant service, entitlement and cost, through the k-anonymous helper of ``privacy``.

    Across tenants (no ``scope``), each tenant's row holds service and cost only, never timing
    (per-tenant TTFT or queueing is a side channel), and a tenant with fewer than ``k`` requests is
    suppressed. Within a ``scope`` (the viewer's own tenant) its rows are returned in full.
    Returns (table, number of suppressed cells).
    """
    import duckdb

    from privacy.views import k_anonymous

    r = load_requests(requests, config)
    steps = load_steps(events, r.origin_ns) if events is not None else None
    charge = attribution(r, steps)
    weights = config.weights()
    served = _served(r)
    rows = pa.table(
        {
            "tenant": pa.array(r.tenant.tolist(), pa.string()),
            "request_id": pa.array(r.request_id.tolist(), pa.string()),
            "service": served,
            "weight": np.array([weights.get(t, 1.0) for t in r.tenant.tolist()]),
            "accelerator_seconds": charge * config.cost.accelerators_per_instance,
            "rejected": r.rejected,
            "good": r.good,
            "ttft_s": r.ttft_s,
        }
    )
    con = duckdb.connect()
    con.register("tenant_requests", rows)
    price = config.cost.accelerator_hour_price / 3600
    aggregates = {
        "num_requests": "count(*)",
        "service": "sum(service)",
        "entitlement_weight": "max(weight)",
        "service_per_weight": "sum(service) / max(weight)",
        "accelerator_seconds": "sum(accelerator_seconds)",
        f"cost_{config.cost.currency.lower()}": f"sum(accelerator_seconds) * {price!r}",
        "rejected_share": "avg(rejected::DOUBLE)",
    }
    if scope is not None:
        predicate, params = scope.where("tenant")
        aggregates |= {"attainment": "avg(good::DOUBLE)", "ttft_p99_s": "quantile_cont(ttft_s, 0.99)"}
        result = k_anonymous(con, "tenant_requests", ["tenant"], aggregates, k=1, min_tenants=1, where=predicate, params=params)
    else:
        result = k_anonymous(con, "tenant_requests", ["tenant"], aggregates, k=k, min_tenants=1)
    return result.table, result.num_suppressed


def metrics_table(values: Sequence[MetricValue]) -> pa.Table:
    """Metric values as an Arrow table (for Parquet, DuckDB and the dashboard)."""
    return pa.Table.from_pylist(
        [dict(scope=v.scope, group=v.group, name=v.name, value=v.value, num_points=v.num_points, unit=v.unit) for v in values],
        schema=pa.schema([("scope", pa.string()), ("group", pa.string()), ("name", pa.string()),
                          ("value", pa.float64()), ("num_points", pa.int64()), ("unit", pa.string())]),
    )
