"""The headline figures of one run, as the replay prints them and the policy comparison tabulates them.

``run_figures`` reads a request table (the replay's own, ``replay.request_table``) and, for cost, the
timing of the engine steps (``read_step_timing``: start, end and instance only, so a million-request
run's figures need no batch membership), and returns goodput and attainment per class beside the
rejections, cancellations and degradations that could buy them, latency percentiles (TTFT, each
request's p99 inter-token gap, E2E), preemptions, starvation, the fairness gap, cost and the
prefix-cache hit rate (the engine's hit when it first scheduled each request). The metrics are
``replay.metrics.run_metrics``'s, judged against the given objectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from replay.metrics import MetricsConfig, itl_ratio_of_means, percentile, run_metrics
from schemas.validate import read_parquet_table

#: The step columns run metrics read: busy time per instance (membership is not needed for them).
STEP_TIMING_COLUMNS = ["event_type", "instance_id", "start_ns", "end_ns"]


def read_step_timing(events_path: str | Path) -> pa.Table:
    """A run's engine steps with their timing and instance, and empty membership lists:
    ``replay.metrics.summarize`` reads only busy time and instances from steps."""
    steps = read_parquet_table(events_path, columns=STEP_TIMING_COLUMNS, filters=[("event_type", "==", "step_executed")])
    n = steps.num_rows
    empty_ids = pa.ListArray.from_arrays(pa.array([0] * (n + 1), pa.int32()), pa.array([], pa.string()))
    empty_tokens = pa.ListArray.from_arrays(pa.array([0] * (n + 1), pa.int32()), pa.array([], pa.int64()))
    return steps.append_column("request_ids", empty_ids).append_column("request_num_tokens", empty_tokens)


def busy_steps(busy_s: dict[str, float] | tuple[tuple[str, float], ...]) -> pa.Table:
    """One step row per instance spanning its busy seconds (``ReplaySummary.busy_s``, the manifest's
    ``output.busy_s``): all ``replay.metrics.summarize`` reads of a run's steps, without reading its events."""
    items = sorted(dict(busy_s).items())
    n = len(items)
    empty = pa.array([0] * (n + 1), pa.int32())
    return pa.table({
        "event_type": pa.array(["step_executed"] * n, pa.string()),
        "instance_id": pa.array([k for k, _ in items], pa.string()),
        "start_ns": pa.array([0] * n, pa.int64()),
        "end_ns": pa.array([round(v * 1e9) for _, v in items], pa.int64()),
        "request_ids": pa.ListArray.from_arrays(empty, pa.array([], pa.string())),
        "request_num_tokens": pa.ListArray.from_arrays(empty, pa.array([], pa.int64())),
    })


@dataclass(frozen=True, slots=True)
class RunFigures:
    """A run's headline figures (None: not defined for this run, e.g. no request completed)."""

    num_requests: int
    goodput_rps: float | None
    attainment: float | None
    attainment_by_class: tuple[tuple[str, float | None], ...]
    latency_s: tuple[tuple[str, float | None, float | None, float | None], ...]  # (name, p50, p90, p99)
    rejected: int
    cancelled: int
    degraded: int
    preemptions_per_request: float | None
    max_queue_s: float | None
    fairness_gap: float | None
    accelerator_s_per_1k_goodput_tokens: float | None
    cost_per_1k_goodput_tokens: float | None
    currency: str
    prefix_cached_tokens: int
    prefix_prompt_tokens: int  # prompt tokens of the requests whose cache was looked up
    client_latency_s: tuple[tuple[str, float | None, float | None, float | None], ...] = ()  # where the client is modelled
    #: client-side TTFT mean, E2E mean and ITL mean (a ratio of means), as inference-perf's summaries report them
    client_means_s: tuple[float, float, float] | None = None

    @property
    def rejected_share(self) -> float:
        return self.rejected / self.num_requests if self.num_requests else 0.0

    @property
    def prefix_hit_share(self) -> float | None:
        return self.prefix_cached_tokens / self.prefix_prompt_tokens if self.prefix_prompt_tokens else None

    def latency(self, name: str, q: int) -> float | None:
        """``name`` in ttft, itl_p99, e2e; ``q`` in 50, 90, 99."""
        for n, *values in self.latency_s:
            if n == name:
                return values[(50, 90, 99).index(q)]
        raise KeyError(name)

    def attainment_of(self, service_class: str) -> float | None:
        return dict(self.attainment_by_class).get(service_class)


def run_figures(requests: pa.Table, steps: pa.Table | None, config: MetricsConfig) -> RunFigures:
    """The figures of a request table (and its steps' timing, for cost) under ``config``'s objectives."""
    values = {(v.scope, v.group, v.name): v.value for v in run_metrics(requests, steps, config)}

    def get(name: str, group: str = "", scope: str = "overall") -> float | None:
        return values.get((scope, group, name))

    n = requests.num_rows
    classes = sorted({g for (scope, g, _) in values if scope == "class"})
    currency = config.cost.currency.lower()
    cost = get(f"cost_per_1k_goodput_tokens_{currency}")
    looked_up = requests.filter(pc.is_valid(requests["num_cached_prefix_tokens"])) if n else requests

    def count(column: str, value: str) -> int:
        return int(pc.sum(pc.equal(requests[column], value)).as_py() or 0) if n else 0

    return RunFigures(
        num_requests=n,
        goodput_rps=get("goodput_rps"),
        attainment=get("attainment"),
        attainment_by_class=tuple((c, get("attainment", c, "class")) for c in classes),
        latency_s=tuple((name, get(f"{name}_p50_s"), get(f"{name}_p90_s"), get(f"{name}_p99_s"))
                        for name in ("ttft", "itl_p99", "e2e")),
        rejected=count("outcome", "rejected"),
        cancelled=count("outcome", "cancelled"),
        degraded=count("admission_decision", "degrade"),
        preemptions_per_request=get("preemptions_per_request"),
        max_queue_s=get("max_queue_s"),
        fairness_gap=get("max_backlogged_service_gap"),
        accelerator_s_per_1k_goodput_tokens=None if cost is None else cost / (config.cost.accelerator_hour_price / 3600),
        cost_per_1k_goodput_tokens=cost,
        currency=config.cost.currency,
        prefix_cached_tokens=int(pc.sum(looked_up["num_cached_prefix_tokens"]).as_py() or 0) if looked_up.num_rows else 0,
        prefix_prompt_tokens=int(pc.sum(looked_up["num_prompt_tokens"]).as_py() or 0) if looked_up.num_rows else 0,
        client_latency_s=_client_latency(requests),
        client_means_s=_client_means(requests),
    )


def _client_latency(requests: pa.Table) -> tuple:
    """TTFT and E2E as the client measures them (``ttft_client_s``, ``e2e_client_s``), when the run models it."""
    if not requests.num_rows or requests["ttft_client_s"].null_count == requests.num_rows:
        return ()
    out = []
    for name in ("ttft", "e2e"):
        values = pc.fill_null(requests[f"{name}_client_s"], float("nan")).to_numpy()
        out.append((name, *(percentile(values, q) for q in (50, 90, 99))))
    return tuple(out)


def _client_means(requests: pa.Table) -> tuple[float, float, float] | None:
    """Client-side TTFT and E2E means over the completed requests the client timed, and ITL as inference-perf's
    summaries and the fidelity data define it: (E2E mean - TTFT mean) / (mean output tokens - 1), the
    denominator at least 1. The tokens are those generated; inference-perf counts those of the text it
    received, which can be fewer (``replay.fidelity.output_count_ratio``)."""
    if not requests.num_rows or requests["ttft_client_s"].null_count == requests.num_rows:
        return None
    done = requests.filter(pc.and_(pc.equal(requests["outcome"], "completed"),
                                   pc.and_(pc.is_valid(requests["ttft_client_s"]), pc.is_valid(requests["e2e_client_s"]))))
    if not done.num_rows:
        return None
    ttft, e2e = pc.mean(done["ttft_client_s"]).as_py(), pc.mean(done["e2e_client_s"]).as_py()
    tokens = pc.mean(done["num_output_tokens"]).as_py()
    return ttft, e2e, itl_ratio_of_means(ttft, e2e, tokens)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:,.1f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def format_figures(f: RunFigures, side: str = "engine side") -> list[str]:
    """The figures as the replay prints them, a few lines."""
    by_class = ", ".join(f"{c} {_pct(a)}" for c, a in f.attainment_by_class)
    lines = [
        f"goodput {'n/a' if f.goodput_rps is None else f'{f.goodput_rps:,.2f}'} req/s, attainment {_pct(f.attainment)}"
        + (f" ({by_class})" if by_class else "")
        + f"; rejected {f.rejected:,} ({_pct(f.rejected_share)}), cancelled {f.cancelled:,}, degraded {f.degraded:,}",
    ]
    for name, label in (("ttft", "TTFT"), ("itl_p99", "ITL (each request's p99 gap)"), ("e2e", "E2E")):
        lines.append(f"{label} ({side}) p50 / p90 / p99: " + " / ".join(_ms(f.latency(name, q)) for q in (50, 90, 99)) + " ms")
    lines.append(
        f"preemptions/request {'n/a' if f.preemptions_per_request is None else f'{f.preemptions_per_request:.3f}'}, "
        f"max queue {'n/a' if f.max_queue_s is None else f'{f.max_queue_s:,.1f} s'}, fairness gap "
        f"{'n/a' if f.fairness_gap is None else f'{f.fairness_gap:,.0f}'}, accelerator-s per 1k goodput tokens "
        f"{'n/a' if f.accelerator_s_per_1k_goodput_tokens is None else f'{f.accelerator_s_per_1k_goodput_tokens:.3f}'}"
    )
    for name, *values in f.client_latency_s:
        label = {"ttft": "TTFT", "e2e": "E2E"}[name]
        lines.append(f"{label} (client side: send -> receipt) p50 / p90 / p99: " + " / ".join(map(_ms, values)) + " ms")
    if f.client_means_s is not None:
        ttft, e2e, itl = map(_ms, f.client_means_s)
        lines.append(f"client-side means, as inference-perf reports them: TTFT {ttft} ms, E2E {e2e} ms, ITL {itl} ms "
                     "(ITL: (E2E - TTFT) / (generated tokens - 1), a ratio of means)")
    hit = f.prefix_hit_share
    lines.append("prefix cache: " + ("no prefix blocks in the workload (or caching off)" if hit is None else
                 f"{_pct(hit)} of prompt tokens found cached when first scheduled "
                 f"({f.prefix_cached_tokens:,} of {f.prefix_prompt_tokens:,})"))
    return lines
