"""Metrics out: any request table (real or replayed) as Prometheus text and OpenTelemetry histograms.

The histograms carry vLLM's metric names and bucket boundaries (``vllm:time_to_first_token_seconds``
...) and those of the OpenTelemetry GenAI semantic conventions (``gen_ai.server.time_to_first_token``
...), so a Grafana dashboard built for a vLLM fleet reads a replay next to production. What each
observation measures is servelens's definition (``docs/metrics.md``), not necessarily vLLM's; the
differences are listed in ``docs/interop.md``.

Every histogram is computed from the request table alone, except ``vllm:inter_token_latency_seconds``,
which needs the per-token gaps and therefore the events (the table keeps only their summary); given
no events it is left out and ``MetricSet.omitted`` says why.

Labels are bounded (``docs/design.md``, Privacy and cardinality): only model, service class and pool may be
labels (a tenant, request, session or instance id never is); each dimension keeps its
``max_label_values`` largest values and folds the rest into ``other``; and a label combination with
fewer than ``min_group_size`` requests folds whole into the all-``other`` series. Folding moves
observations between series and never drops one, so every histogram's counts and sums over all
series equal the request table's exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.request_table import REQUIRED_COLUMNS
from servelens.errors import ServelensError

OTHER = "other"
UNKNOWN = "unknown"

# vLLM v1's bucket boundaries (vllm/v1/metrics/loggers.py), seconds.
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
VLLM_TOKEN_LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
VLLM_REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
# OpenTelemetry GenAI semantic conventions: the ExplicitBucketBoundaries advised per metric, seconds.
OTEL_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
OTEL_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
OTEL_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 token buckets (1, 2, 5, 10, 20, 50, ...) up to ``max_tokens`` (its max_model_len)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_tokens:
                return tuple(float(v) for v in out)
            out.append(value)
        exponent += 1


#: label dimension -> (request-table column, Prometheus label of the vLLM names, OTel attribute)
LABEL_DIMENSIONS: dict[str, tuple[str, str, str]] = {
    "model": ("model", "model_name", "gen_ai.request.model"),
    "service_class": ("service_class", "service_class", "servelens.service_class"),
    "pool": ("pool", "pool", "servelens.pool"),
}
#: Columns that can never become labels (identifiers, and the tenant above all).
FORBIDDEN_LABELS = frozenset({"tenant", "request_id", "session_id", "engine_id", "instance_id", "adapter"})


@dataclass(frozen=True, slots=True)
class HistogramSeries:
    """One label combination of a histogram: per-bucket counts (not cumulative; the last is +Inf)."""

    labels: tuple[tuple[str, str], ...]
    bucket_counts: tuple[int, ...]
    count: int
    sum: float


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram family. ``name`` is the exposition name; ``otel_name`` the OTel instrument, if any."""

    name: str
    help: str
    unit: str
    bounds: tuple[float, ...]
    series: tuple[HistogramSeries, ...]
    otel_name: str | None = None

    @property
    def count(self) -> int:
        return sum(s.count for s in self.series)


@dataclass(frozen=True, slots=True)
class CounterSeries:
    labels: tuple[tuple[str, str], ...]
    value: int


@dataclass(frozen=True, slots=True)
class Counter:
    name: str  # without the _total suffix, which the exposition adds
    help: str
    series: tuple[CounterSeries, ...]


@dataclass(frozen=True, slots=True)
class Gauge:
    name: str
    help: str
    series: tuple[CounterSeries, ...]


@dataclass(frozen=True, slots=True)
class MetricSet:
    """Every exported family, what was folded, and what was left out (and why)."""

    histograms: tuple[Histogram, ...]
    counters: tuple[Counter, ...]
    num_requests: int
    num_folded_requests: int  # requests whose label combination folded into the all-"other" series
    omitted: tuple[str, ...]
    start_ns: int | None  # earliest arrival: the start of the cumulative OTel histograms
    end_ns: int | None  # latest finish or token: their observation time
    gauges: tuple[Gauge, ...] = ()  # states at one instant: only in a series over time


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    help: str
    values: str  # a column of the derived value table
    bounds: tuple[float, ...]
    unit: str = "s"
    family: str = "vllm"  # vllm: model_name/service_class/pool; otel: gen_ai.* attributes + error.type
    otel_name: str | None = None


def _specs(max_tokens: int) -> tuple[_Spec, ...]:
    tokens = token_buckets(max_tokens)
    return (
        _Spec("vllm:time_to_first_token_seconds", "Time to first token, s: first_token - arrival (servelens's user-facing definition).",
              "ttft_s", VLLM_TTFT_BUCKETS_S),
        _Spec("vllm:e2e_request_latency_seconds", "End-to-end request latency, s: last_token - arrival.",
              "e2e_s", VLLM_REQUEST_LATENCY_BUCKETS_S),
        _Spec("vllm:request_queue_time_seconds", "Queue time, s: first batch membership - arrival.",
              "queue_s", VLLM_REQUEST_LATENCY_BUCKETS_S),
        _Spec("vllm:request_prefill_time_seconds", "Prefill time, s: first_token - scheduled.",
              "prefill_s", VLLM_REQUEST_LATENCY_BUCKETS_S),
        _Spec("vllm:request_decode_time_seconds", "Decode time, s: last_token - first_token.", "decode_s", VLLM_REQUEST_LATENCY_BUCKETS_S),
        _Spec("vllm:request_inference_time_seconds", "Inference time, s: last_token - scheduled.",
              "inference_s", VLLM_REQUEST_LATENCY_BUCKETS_S),
        _Spec("vllm:request_time_per_output_token_seconds",
              "Time per output token of each request, s: (last_token - first_token) / (output tokens - 1).",
              "tpot_s", VLLM_TOKEN_LATENCY_BUCKETS_S),
        _Spec("vllm:inter_token_latency_seconds",
              "Inter-token latency, s: each gap between tokens (a chunk of k tokens after a gap g counts k gaps of g/k).",
              "itl", VLLM_TOKEN_LATENCY_BUCKETS_S),
        _Spec("vllm:request_prompt_tokens", "Prompt tokens per request.", "num_prompt_tokens", tokens, unit="{token}"),
        _Spec("vllm:request_generation_tokens", "Output tokens per request.", "num_output_tokens", tokens, unit="{token}"),
        _Spec("gen_ai_server_time_to_first_token_seconds",
              "GenAI server time to first token of successful requests, s (first_token - arrival).",
              "otel_ttft_s", OTEL_TTFT_BUCKETS_S, family="otel", otel_name="gen_ai.server.time_to_first_token"),
        _Spec("gen_ai_server_time_per_output_token_seconds",
              "GenAI server time per output token after the first, of successful requests, s.",
              "otel_tpot_s", OTEL_TPOT_BUCKETS_S, family="otel", otel_name="gen_ai.server.time_per_output_token"),
        _Spec("gen_ai_server_request_duration_seconds",
              "GenAI server request duration, s: last_token - arrival, or finish - arrival for a request that ended without a token.",
              "duration_s", OTEL_DURATION_BUCKETS_S, family="otel", otel_name="gen_ai.server.request.duration"),
    )


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy(zero_copy_only=False)


def _float(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.array(pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _ns_seconds(table: pa.Table, end: str, start: str) -> np.ndarray:
    """(end - start) / 1e9 from integer nanoseconds, NaN where either is null (as the table derives durations)."""
    return _float(pc.divide(pc.cast(pc.subtract(table[end], table[start]), pa.float64()), 1e9))


def _labels(table: pa.Table, dims: Sequence[str], max_values: int, min_group: int) -> tuple[np.ndarray, list[tuple[str, ...]], int]:
    """Each row's cell (an index into the returned label tuples) after bounding, and the folded row count."""
    n = table.num_rows
    names: list[list[str]] = []  # per dimension: its kept values, then "other"
    codes = np.zeros(n, dtype=np.int64)
    for dim in dims:
        values = pc.fill_null(pc.cast(table[LABEL_DIMENSIONS[dim][0]], pa.string()), UNKNOWN)
        counts = pc.value_counts(values).to_pylist()
        kept = [c["values"] for c in sorted(counts, key=lambda c: (-c["counts"], c["values"]))[:max_values] if c["values"] != OTHER]
        vocabulary = [*kept, OTHER]
        index = pc.index_in(values, value_set=pa.array(kept, pa.string())).to_numpy(zero_copy_only=False)
        code = np.where(np.isnan(index.astype(np.float64)), len(kept), np.nan_to_num(index.astype(np.float64))).astype(np.int64)
        codes = codes * len(vocabulary) + code
        names.append(vocabulary)
    unique, inverse, sizes = np.unique(codes, return_inverse=True, return_counts=True)

    def key(code: int) -> tuple[str, ...]:
        out = []
        for vocabulary in reversed(names):
            code, j = divmod(code, len(vocabulary))
            out.append(vocabulary[j])
        return tuple(reversed(out))

    keys = [key(int(c)) for c in unique]
    folded_key = tuple(OTHER for _ in dims)
    small = np.array([size < min_group and k != folded_key for k, size in zip(keys, sizes)], dtype=bool)
    folded = int(sizes[small].sum()) if len(sizes) else 0
    cells = sorted({k for k, s in zip(keys, small) if not s} | ({folded_key} if small.any() else set()))
    position = {k: j for j, k in enumerate(cells)}
    mapping = np.array([position[folded_key] if s else position[k] for k, s in zip(keys, small)], dtype=np.int64)
    return (mapping[inverse] if n else np.zeros(0, dtype=np.int64)), cells, folded


def _histogram_series(values: np.ndarray, cell: np.ndarray, bounds: tuple[float, ...], num_cells: int,
                      weights: np.ndarray | None = None, sums_ns: np.ndarray | None = None) -> list[tuple[list[int], int, float]]:
    """Per cell: bucket counts, count and sum of the non-NaN values (weights: repeat counts)."""
    present = ~np.isnan(values)
    out = []
    edges = np.asarray(bounds, dtype=np.float64)
    for j in range(num_cells):
        mask = present & (cell == j)
        v = values[mask]
        w = np.ones(len(v), dtype=np.int64) if weights is None else weights[mask]
        slots = np.searchsorted(edges, v, side="left")  # value <= bound: Prometheus "le" and OTel upper bounds
        counts = np.bincount(slots, weights=w, minlength=len(edges) + 1).astype(np.int64).tolist()
        if sums_ns is not None:  # exact: an integer nanosecond sum, divided once
            total = int(sums_ns[mask].sum()) / 1e9
        else:
            total = math.fsum(v.tolist())
        out.append((counts, int(w.sum()), total))
    return out


def token_gaps(events: pa.Table) -> pa.Table:
    """Per token delivery after a request's first: (request_id, gap_ns, num_tokens), read like the
    request table reads them (de-duplicated by event_id, ordered by ts_ns, event_type, event_id)."""
    from replay.derive import connect

    con = connect()
    con.register("events_input", events.select(
        [c for c in ("event_id", "request_id", "event_type", "ts_ns", "num_tokens") if c in events.column_names]))
    return con.sql(
        """
        SELECT request_id, gap_ns, coalesce(num_tokens, 1) AS num_tokens FROM (
            SELECT request_id, num_tokens,
                   ts_ns - lag(ts_ns) OVER (PARTITION BY request_id ORDER BY ts_ns, event_type, event_id) AS gap_ns
            FROM (SELECT DISTINCT ON (event_id) * FROM events_input
                  WHERE event_type IN ('first_token', 'tokens_delivered')))
        WHERE gap_ns IS NOT NULL ORDER BY request_id
        """
    ).to_arrow_table()


def request_metrics(
    requests: pa.Table,
    events: pa.Table | None = None,
    *,
    labels: Sequence[str] = ("model",),
    max_label_values: int = 10,
    min_group_size: int = 5,
    max_model_len: int | None = None,
    operation_name: str = "chat",
    provider_name: str | None = None,
    gaps: pa.Table | None = None,
) -> MetricSet:
    """The histograms and counters of a request table (``schemas.records.RequestRow`` columns).

    ``events`` (the table's events) adds ``vllm:inter_token_latency_seconds``. ``labels`` picks
    label dimensions among ``LABEL_DIMENSIONS``; ``max_model_len`` bounds the token buckets
    (default: the largest token count in the table). ``operation_name`` and ``provider_name`` fill
    the GenAI conventions' ``gen_ai.operation.name`` and ``gen_ai.provider.name`` attributes.
    ``gaps`` is ``token_gaps(events)`` computed once, for callers that export many slices.
    """
    _check_request_table(requests, labels, max_label_values, min_group_size)
    cell, cells, folded = _labels(requests, labels, max_label_values, min_group_size)
    groups = _Cells(cell, cells, labels, operation_name, provider_name)
    outcome = np.array([o or "" for o in requests["outcome"].to_pylist()], dtype=object)
    values = _request_values(requests, outcome == "completed")
    if max_model_len is None:
        largest = np.nanmax(np.concatenate([values["num_prompt_tokens"], values["num_output_tokens"], [1.0]]))
        max_model_len = int(largest)
    omitted = []
    if gaps is None and events is not None:
        gaps = token_gaps(events)
    if gaps is None:
        omitted.append("vllm:inter_token_latency_seconds: needs the events (per-token gaps); the request table keeps only their summary")
    histograms = _histograms(values, outcome, groups, _gap_series(requests, gaps, cell), max_model_len)
    counters = _counters(values, outcome, groups)
    times = [requests[c] for c in ("finish_ns", "last_token_ns") if c in requests.column_names]
    end = max((pc.max(t).as_py() for t in times if pc.max(t).as_py() is not None), default=None)
    return MetricSet(tuple(histograms), tuple(counters), requests.num_rows, folded, tuple(omitted),
                     pc.min(requests["arrival_ns"]).as_py(), end)


@dataclass(frozen=True, slots=True)
class _Cells:
    """A request table's label cells: each request's cell, each cell's label values, and what names them."""

    cell: np.ndarray
    keys: list
    labels: Sequence[str]
    operation: str
    provider: str | None

    def pairs(self, family: str, key: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        return _label_pairs(family, self.labels, key, self.operation, self.provider)


def _check_request_table(requests: pa.Table, labels: Sequence[str], max_label_values: int, min_group_size: int) -> None:
    """Refuse forbidden, unknown or repeated labels, bad limits, and a table without a request table's columns."""
    for dim in labels:
        if dim in FORBIDDEN_LABELS:
            raise ServelensError(f"{dim!r} can never be a metric label (an identifier; the guide's section 6)",
                                 f"choose among {', '.join(LABEL_DIMENSIONS)}")
        if dim not in LABEL_DIMENSIONS:
            raise ServelensError(f"unknown label {dim!r}", f"choose among {', '.join(LABEL_DIMENSIONS)}")
    if len(set(labels)) != len(labels):
        raise ServelensError("a label is named twice")
    if max_label_values < 1 or min_group_size < 1:
        raise ServelensError("max_label_values and min_group_size must be at least 1")
    missing = [c for c in REQUIRED_COLUMNS if c not in requests.column_names]
    missing += [LABEL_DIMENSIONS[d][0] for d in labels if LABEL_DIMENSIONS[d][0] not in requests.column_names]
    if missing:
        raise ServelensError(f"not a request table: columns {', '.join(missing)} are missing",
                             "derive one with `servelens requests derive EVENTS --out requests.parquet`")


def _request_values(requests: pa.Table, success: np.ndarray) -> dict[str, np.ndarray]:
    """Each request's value of every histogram (NaN where it has none)."""
    duration = _float(requests["e2e_s"])
    no_token = np.isnan(duration)
    duration[no_token] = _ns_seconds(requests, "finish_ns", "arrival_ns")[no_token]
    return {
        "ttft_s": _float(requests["ttft_s"]),
        "e2e_s": _float(requests["e2e_s"]),
        "queue_s": _float(requests["queue_s"]),
        "prefill_s": _ns_seconds(requests, "first_token_ns", "scheduled_ns"),
        "decode_s": _ns_seconds(requests, "last_token_ns", "first_token_ns"),
        "inference_s": _ns_seconds(requests, "last_token_ns", "scheduled_ns"),
        "tpot_s": _float(requests["tpot_s"]),
        "num_prompt_tokens": _float(requests["num_prompt_tokens"]),
        "num_output_tokens": _float(requests["num_output_tokens"]),
        "otel_ttft_s": np.where(success, _float(requests["ttft_s"]), np.nan),
        "otel_tpot_s": np.where(success, _float(requests["tpot_s"]), np.nan),
        "duration_s": duration,
    }


def _gap_series(requests: pa.Table, gaps: pa.Table | None, cell: np.ndarray):
    """(gap ns, tokens, cell) of the token gaps of the table's requests; None without gaps."""
    if gaps is None:
        return None
    row = {rid: i for i, rid in enumerate(requests["request_id"].to_pylist())}
    gap_rows = np.array([row.get(r, -1) for r in gaps["request_id"].to_pylist()], dtype=np.int64)
    known = gap_rows >= 0
    gap_ns = _column(gaps, "gap_ns").astype(np.int64)[known]
    weight = _column(gaps, "num_tokens").astype(np.int64)[known]
    return gap_ns, weight, cell[gap_rows[known]]


def _histograms(values: dict[str, np.ndarray], outcome: np.ndarray, groups: _Cells, gap_series,
                max_model_len: int) -> list[Histogram]:
    """Every histogram of the specs (the inter-token latency only with ``gap_series``)."""
    histograms = []
    cell, cells = groups.cell, groups.keys
    for spec in _specs(max_model_len):
        if spec.values == "duration_s":  # error.type splits the duration by outcome
            out = _duration_by_outcome(values["duration_s"], outcome, cell, cells, spec, groups.labels,
                                       groups.operation, groups.provider)
        elif spec.values == "itl" and gap_series is None:
            continue
        else:
            if spec.values == "itl":
                gap_ns, weight, gap_cell = gap_series
                series = _histogram_series(gap_ns / weight / 1e9, gap_cell, spec.bounds, len(cells),
                                           weights=weight, sums_ns=gap_ns)
            else:
                series = _histogram_series(values[spec.values], cell, spec.bounds, len(cells))
            out = [HistogramSeries(groups.pairs(spec.family, key), tuple(counts), count, total)
                   for key, (counts, count, total) in zip(cells, series)]
        histograms.append(Histogram(spec.name, spec.help, spec.unit, spec.bounds, tuple(out), spec.otel_name))
    return histograms


def _counters(values: dict[str, np.ndarray], outcome: np.ndarray, groups: _Cells) -> list[Counter]:
    """The token counters and the requests by outcome, per cell."""
    cell, cells = groups.cell, groups.keys
    prompt = np.nan_to_num(values["num_prompt_tokens"]).astype(np.int64)
    generated = np.nan_to_num(values["num_output_tokens"]).astype(np.int64)
    counters = [
        Counter("vllm:prompt_tokens", "Prompt tokens of the requests.",
                tuple(CounterSeries(groups.pairs("vllm", k), int(prompt[cell == j].sum()))
                      for j, k in enumerate(cells))),
        Counter("vllm:generation_tokens", "Output tokens of the requests.",
                tuple(CounterSeries(groups.pairs("vllm", k), int(generated[cell == j].sum()))
                      for j, k in enumerate(cells))),
    ]
    by_outcome = []
    for j, k in enumerate(cells):
        for name in sorted(set(outcome[cell == j].tolist())):
            pairs = groups.pairs("vllm", k) + (("outcome", name or "in_flight"),)
            by_outcome.append(CounterSeries(pairs, int(((cell == j) & (outcome == name)).sum())))
    counters.append(Counter("servelens:requests", "Requests by outcome (rejections and cancellations are outcomes, not missing data).",
                            tuple(by_outcome)))
    return counters


def _label_pairs(family: str, dims: Sequence[str], key: tuple[str, ...], operation: str,
                 provider: str | None) -> tuple[tuple[str, str], ...]:
    if family == "vllm":
        return tuple((LABEL_DIMENSIONS[d][1], v) for d, v in zip(dims, key))
    pairs = [("gen_ai.operation.name", operation)]
    if provider:
        pairs.append(("gen_ai.provider.name", provider))
    pairs += [(LABEL_DIMENSIONS[d][2], v) for d, v in zip(dims, key)]
    return tuple(pairs)


def _duration_by_outcome(values, outcome, cell, cells, spec: _Spec, dims, operation, provider) -> list[HistogramSeries]:
    out = []
    for name in sorted(set(outcome.tolist())):
        mask = outcome == name
        series = _histogram_series(np.where(mask, values, np.nan), cell, spec.bounds, len(cells))
        for key, (counts, count, total) in zip(cells, series):
            if count == 0:
                continue
            pairs = _label_pairs("otel", dims, key, operation, provider)
            if name != "completed":
                pairs += (("error.type", name or "in_flight"),)
            out.append(HistogramSeries(pairs, tuple(counts), count, total))
    return out


def bound_labels(requests: pa.Table, labels: Sequence[str], max_label_values: int, min_group_size: int) -> tuple[pa.Table, int]:
    """The table with its label columns rewritten to their bounded values (top-K, small groups
    folded into ``other``, null as ``unknown``) and the number of folded requests. Slices of the
    result keep the same label values, whatever rows they hold."""
    cell, cells, folded = _labels(requests, labels, max_label_values, min_group_size)
    for d, dim in enumerate(labels):
        name = LABEL_DIMENSIONS[dim][0]
        values = pa.array([k[d] for k in cells], pa.string()).take(pa.array(cell)) if requests.num_rows else pa.array([], pa.string())
        requests = requests.set_column(requests.schema.get_field_index(name), name, values)
    return requests, folded


def request_metrics_over_time(
    requests: pa.Table,
    events: pa.Table | None = None,
    *,
    interval_s: float = 15.0,
    labels: Sequence[str] = ("model",),
    max_label_values: int = 10,
    min_group_size: int = 5,
    max_model_len: int | None = None,
    **options,
) -> list[tuple[int, MetricSet]]:
    """Cumulative metrics at the end of every ``interval_s`` window, as a scraper would have seen
    them: a request is observed when it finished (else at its last known timestamp), so
    ``rate()`` and ``histogram_quantile()`` work on the series. Labels are bounded once over the
    whole table; the last point equals ``request_metrics`` of the whole table."""
    if interval_s <= 0:
        raise ServelensError("the interval must be positive")
    bounded, _ = bound_labels(requests, labels, max_label_values, min_group_size)
    observed = pc.coalesce(*(bounded[c] for c in ("finish_ns", "last_token_ns", "first_token_ns", "arrival_ns")))
    times = np.array(pc.fill_null(observed, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    if max_model_len is None and bounded.num_rows:
        counts = [bounded[c] for c in ("num_prompt_tokens", "num_output_tokens")]
        max_model_len = max(int(pc.max(c).as_py() or 1) for c in counts)
    gaps = token_gaps(events) if events is not None else None
    step = int(interval_s * 1e9)
    if not bounded.num_rows:
        return []
    first_end = (int(times.min()) // step + 1) * step
    cell, cells, _ = _labels(bounded, labels, 1 << 30, 1)
    far = np.iinfo(np.int64).max
    arrival, scheduled, finish = (np.array(pc.fill_null(bounded[c], far).to_numpy(zero_copy_only=False), dtype=np.int64)
                                  for c in ("arrival_ns", "scheduled_ns", "finish_ns"))
    pairs = [_label_pairs("vllm", labels, key, "", None) for key in cells]
    out = []
    for end in range(first_end, int(times.max()) + step, step):
        rows = bounded.filter(pa.array(times < end))
        metrics = request_metrics(rows, None, labels=labels, max_label_values=1 << 30, min_group_size=1,
                                  max_model_len=max_model_len, gaps=gaps, **options)
        running = (scheduled < end) & (finish >= end)
        waiting = (arrival < end) & (scheduled >= end) & (finish >= end)
        gauges = tuple(
            Gauge(name, text, tuple(CounterSeries(pairs[j], int((mask & (cell == j)).sum())) for j in range(len(cells))))
            for name, text, mask in (
                ("vllm:num_requests_running", "Requests in a batch (first scheduled, not finished).", running),
                ("vllm:num_requests_waiting", "Requests arrived and not yet scheduled (nor finished).", waiting),
            )
        )
        out.append((end, dataclasses.replace(metrics, gauges=gauges)))
    return out


# ------------------------------------------------------------------------------------------ formats


def _prometheus_label(name: str) -> str:
    return name.replace(".", "_")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label_text(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{_prometheus_label(k)}="{_escape(v)}"' for k, v in pairs) + "}"


def to_prometheus(metrics: MetricSet) -> str:
    """The Prometheus text exposition format (version 0.0.4): cumulative ``le`` buckets, _sum, _count."""
    lines: list[str] = []
    for h in metrics.histograms:
        lines += [f"# HELP {h.name} {h.help}", f"# TYPE {h.name} histogram"]
        for s in h.series:
            running = 0
            for bound, n in zip((*h.bounds, math.inf), s.bucket_counts):
                running += n
                lines.append(f"{h.name}_bucket{_label_text((*s.labels, ('le', _number(bound))))} {running}")
            lines.append(f"{h.name}_sum{_label_text(s.labels)} {_number(s.sum)}")
            lines.append(f"{h.name}_count{_label_text(s.labels)} {s.count}")
    for c in metrics.counters:
        lines += [f"# HELP {c.name}_total {c.help}", f"# TYPE {c.name}_total counter"]
        lines += [f"{c.name}_total{_label_text(s.labels)} {s.value}" for s in c.series]
    return "\n".join(lines) + "\n"


def _attributes(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in pairs]


def to_otlp_json(metrics: MetricSet, *, service_name: str = "servelens", scope_version: str = "") -> dict:
    """An OTLP ``ExportMetricsServiceRequest`` in its JSON encoding (cumulative explicit-bucket
    histograms; 64-bit integers as strings, as OTLP/JSON writes them). OTel-named families keep
    their dotted instrument names; the vLLM-named ones keep vLLM's names."""
    start = str(metrics.start_ns or 0)
    end = str(metrics.end_ns or metrics.start_ns or 0)
    out_metrics = []
    for h in metrics.histograms:
        points = [
            {
                "attributes": _attributes(s.labels),
                "startTimeUnixNano": start,
                "timeUnixNano": end,
                "count": str(s.count),
                "sum": s.sum,
                "bucketCounts": [str(n) for n in s.bucket_counts],
                "explicitBounds": list(h.bounds),
            }
            for s in h.series
        ]
        out_metrics.append({
            "name": h.otel_name or h.name,
            "description": h.help,
            "unit": h.unit,
            "histogram": {"dataPoints": points, "aggregationTemporality": 2},  # 2: CUMULATIVE
        })
    for c in metrics.counters:
        points = [{"attributes": _attributes(s.labels), "startTimeUnixNano": start, "timeUnixNano": end,
                   "asInt": str(s.value)} for s in c.series]
        out_metrics.append({"name": c.name, "description": c.help, "unit": "1",
                            "sum": {"dataPoints": points, "aggregationTemporality": 2, "isMonotonic": True}})
    return {
        "resourceMetrics": [{
            "resource": {"attributes": _attributes([("service.name", service_name)])},
            "scopeMetrics": [{"scope": {"name": "servelens.exposition", "version": scope_version}, "metrics": out_metrics}],
        }]
    }


def _timestamp(ns: int) -> str:
    return f"{ns // 10**9}.{ns % 10**9:09d}"


def to_openmetrics(points: Sequence[tuple[int, MetricSet]]) -> str:
    """A time series of cumulative metrics (``request_metrics_over_time``) in the OpenMetrics text
    format with timestamps, ``# EOF``-terminated: what ``promtool tsdb create-blocks-from openmetrics``
    backfills into Prometheus, so a replay's series sit beside production's."""
    lines: list[str] = []
    if not points:
        return "# EOF\n"
    last = points[-1][1]
    for h in last.histograms:
        lines += [f"# TYPE {h.name} histogram", f"# HELP {h.name} {_escape(h.help)}"]
        if h.unit == "s" and h.name.endswith("_seconds"):
            lines.append(f"# UNIT {h.name} seconds")
        for labels in dict.fromkeys(s.labels for _, m in points for hh in m.histograms if hh.name == h.name for s in hh.series):
            for end, m in points:
                series = next((s for hh in m.histograms if hh.name == h.name for s in hh.series if s.labels == labels), None)
                if series is None:
                    continue
                ts = _timestamp(end)
                running = 0
                for bound, n in zip((*h.bounds, math.inf), series.bucket_counts):
                    running += n
                    lines.append(f"{h.name}_bucket{_label_text((*labels, ('le', _number(bound))))} {running} {ts}")
                lines.append(f"{h.name}_count{_label_text(labels)} {series.count} {ts}")
                lines.append(f"{h.name}_sum{_label_text(labels)} {_number(series.sum)} {ts}")
    for c in last.counters:
        lines += [f"# TYPE {c.name} counter", f"# HELP {c.name} {_escape(c.help)}"]
        for labels in dict.fromkeys(s.labels for _, m in points for cc in m.counters if cc.name == c.name for s in cc.series):
            for end, m in points:
                series = next((s for cc in m.counters if cc.name == c.name for s in cc.series if s.labels == labels), None)
                if series is not None:
                    lines.append(f"{c.name}_total{_label_text(labels)} {series.value} {_timestamp(end)}")
    for g in last.gauges:
        lines += [f"# TYPE {g.name} gauge", f"# HELP {g.name} {_escape(g.help)}"]
        for labels in dict.fromkeys(s.labels for _, m in points for gg in m.gauges if gg.name == g.name for s in gg.series):
            for end, m in points:
                series = next((s for gg in m.gauges if gg.name == g.name for s in gg.series if s.labels == labels), None)
                if series is not None:
                    lines.append(f"{g.name}{_label_text(labels)} {series.value} {_timestamp(end)}")
    return "\n".join(lines) + "\n# EOF\n"
