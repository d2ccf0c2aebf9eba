"""Baseline against candidate: per-metric differences with block-bootstrap confidence intervals.

Requests close in time share a queue, so they are not independent: resampling them one by one
would make every interval far too narrow. Both runs are therefore cut into the same time windows
(``MetricsConfig.window_s``, on a common origin: the same workload replayed twice, or two pools
over the same period), each window reduced to sufficient statistics (counts, sums, maxima, latency
histograms with 1% bins), and whole runs of consecutive windows are resampled together: a circular
moving-block bootstrap, the same blocks for both runs (paired). A metric is recomputed from each
resample's statistics; its interval is the percentile interval of the paired difference, centred on
the estimate and widened by t(k-1)/z for the k blocks per resample (few blocks mean few
independent pieces of evidence; ``tests/replay/test_compare.py`` checks the stated coverage on
autocorrelated data).

For latency distributions the Mann-Whitney U test and the Hodges-Lehmann shift (the median of all
pairwise differences) are shown too, as Kayenta does, with the Brown-Forsythe test for a change in
spread; they treat requests as independent, so they describe, and the bootstrap decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from replay.metrics import HIST_EDGES_S, MetricsConfig, Requests, Steps

_DISTRIBUTIONS = {"ttft": "ttft_s", "itl_p99": "itl_p99_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}


@dataclass
class WindowStats:
    """Per-window sufficient statistics of one group of requests (a run, or one class of it)."""

    window_s: float
    n: np.ndarray
    sums: dict[str, np.ndarray]  # additive per-window figures
    hists: dict[str, np.ndarray]  # distribution name -> [windows, bins] counts
    maxima: dict[str, np.ndarray]  # per-window maxima (-inf where empty)
    tenant_service: np.ndarray  # [windows, tenants] delivered service / weight
    num_instances: int
    has_steps: bool  # engine steps were given (cost and idle share need them)


def window_stats(r: Requests, rows: np.ndarray, steps: Steps | None, num_windows: int, config: MetricsConfig,
                 tenants: np.ndarray) -> WindowStats:
    """Sufficient statistics of the requests selected by ``rows``, per window of the common grid
    (``tenants``: the sorted tenant names of both runs, so tenant columns line up)."""
    w = np.clip(np.floor(r.arrival_s[rows] / config.window_s).astype(np.int64), 0, num_windows - 1)

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(w, weights=np.asarray(values, dtype=np.float64), minlength=num_windows)

    sub = {name: getattr(r, name)[rows] for name in (
        "good", "outcome", "num_output_tokens", "num_prompt_tokens", "num_preemptions", "num_migrations", "num_lost_tokens",
        "past_limit", "meets_ttft", "meets_itl", "meets_e2e", "queue_s", "tenant_code", "rejected", "arrival_s")}
    sums = {
        "good": total(sub["good"]),
        "good_tokens": total(np.where(sub["good"], sub["num_output_tokens"], 0)),
        "completed": total(sub["outcome"] == "completed"),
        "meets_ttft": total(sub["meets_ttft"]),
        "meets_itl": total(sub["meets_itl"]),
        "meets_e2e": total(sub["meets_e2e"]),
        "preemptions": total(sub["num_preemptions"]),
        "lost_tokens": total(sub["num_lost_tokens"]),
        "tokens": total(sub["num_output_tokens"] + sub["num_prompt_tokens"]),
        "oscillating": total(sub["num_preemptions"] >= 2),
        "migrations": total(sub["num_migrations"]),
        "past_limit": total(sub["past_limit"]),
        "flaps": _flaps_per_window(sub["arrival_s"], sub["rejected"], config.window_s, num_windows),
    }
    for outcome in ("rejected", "cancelled", "timed_out", "error"):
        sums[outcome] = total(sub["outcome"] == outcome)
    hists = {}
    for name, column in _DISTRIBUTIONS.items():
        values = getattr(r, column)[rows]
        ok = ~np.isnan(values)
        bins = np.clip(np.searchsorted(HIST_EDGES_S, values[ok]), 0, len(HIST_EDGES_S))
        hist = np.zeros((num_windows, len(HIST_EDGES_S) + 1))
        np.add.at(hist, (w[ok], bins), 1)
        hists[name] = hist
    queue = np.where(np.isnan(sub["queue_s"]), -np.inf, sub["queue_s"])
    qmax = np.full(num_windows, -np.inf)
    np.maximum.at(qmax, w, queue)
    served = np.where(sub["num_output_tokens"] > 0, sub["num_prompt_tokens"] + 2 * sub["num_output_tokens"], 0.0)
    weights = config.weights()
    t_index = np.searchsorted(tenants, r.tenant_names)[sub["tenant_code"]]  # this run's codes -> shared columns
    weight_of = np.array([weights.get(t, 1.0) for t in tenants], dtype=np.float64)
    service = np.zeros((num_windows, len(tenants)))
    np.add.at(service, (w, t_index), served / weight_of[t_index])
    backlogged = np.zeros((num_windows, len(tenants)), dtype=bool)
    backlogged[w, t_index] = True
    gap = np.where(backlogged.sum(1) >= 2,
                   np.where(backlogged, service, -np.inf).max(1) - np.where(backlogged, service, np.inf).min(1), -np.inf)
    busy = np.zeros(num_windows)
    if steps is not None and len(steps.start_s):
        sw = np.clip(np.floor(steps.start_s / config.window_s).astype(np.int64), 0, num_windows - 1)
        busy = np.bincount(sw, weights=steps.duration_s, minlength=num_windows)
    sums["busy_s"] = busy * config.cost.accelerators_per_instance
    return WindowStats(
        window_s=config.window_s,
        n=total(np.ones(len(w))),
        sums=sums,
        hists=hists,
        maxima={"queue_s": qmax, "service_gap": gap},
        tenant_service=service,
        num_instances=max(steps.num_instances, 1) if steps is not None else 1,
        has_steps=steps is not None and len(steps.start_s) > 0,
    )


def _flaps_per_window(arrival_s: np.ndarray, rejected: np.ndarray, window_s: float, num_windows: int) -> np.ndarray:
    """Per window: switches between 1 s seconds with and without rejections (controller flapping)."""
    out = np.zeros(num_windows)
    if not len(arrival_s):
        return out
    seconds = np.floor(arrival_s).astype(np.int64)
    span = int(num_windows * window_s) + 1
    rejecting = np.zeros(span, dtype=bool)
    rejecting[np.clip(seconds[rejected], 0, span - 1)] = True
    switches = np.flatnonzero(rejecting[1:] != rejecting[:-1]) + 1
    np.add.at(out, np.clip((switches / window_s).astype(np.int64), 0, num_windows - 1), 1)
    return out


def _quantile(hist: np.ndarray, q: float) -> np.ndarray:
    """Quantile (0-1) of histogram rows [R, bins] on the log bins (upper edge of the bin reached)."""
    cum = np.cumsum(hist, axis=1)
    total = cum[:, -1:]
    idx = (cum < q * total).sum(axis=1)
    edges = np.append(HIST_EDGES_S, HIST_EDGES_S[-1])
    out = edges[np.clip(idx, 0, len(edges) - 1)]
    return np.where(total[:, 0] > 0, out, np.nan)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def _jain(service: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return service.sum(1) ** 2 / (service.shape[1] * (service**2).sum(1))


def _costed(s: WindowStats, values: np.ndarray) -> np.ndarray:
    """Cost figures exist only where engine steps say how many instances ran and how busy."""
    return values if s.has_steps else np.full(values.shape, np.nan)


#: Metric name -> (values of resamples from (stats, counts [R, W])).
Evaluator = Callable[[WindowStats, np.ndarray], np.ndarray]


def _evaluators(price_per_s: float) -> dict[str, Evaluator]:
    def span(s: WindowStats, c: np.ndarray) -> np.ndarray:
        return c.sum(1) * s.window_s

    def rate(key: str) -> Evaluator:
        return lambda s, c: _ratio(c @ s.sums[key], span(s, c))

    def share(key: str, den: str | None = None) -> Evaluator:
        return lambda s, c: _ratio(c @ s.sums[key], c @ (s.n if den is None else s.sums[den]))

    def quantile(dist: str, q: float) -> Evaluator:
        return lambda s, c: _quantile(c @ s.hists[dist], q)

    def maximum(key: str) -> Evaluator:
        return lambda s, c: np.where(c > 0, s.maxima[key], -np.inf).max(1)

    found: dict[str, Evaluator] = {
        "goodput_rps": rate("good"),
        "goodput_tokens_per_s": rate("good_tokens"),
        "throughput_rps": rate("completed"),
        "attainment": share("good"),
        "attainment_ttft": share("meets_ttft"),
        "attainment_itl": share("meets_itl"),
        "attainment_e2e": share("meets_e2e"),
        "rejected_share": share("rejected"),
        "cancelled_share": share("cancelled"),
        "timed_out_share": share("timed_out"),
        "error_share": share("error"),
        "past_queue_limit_share": share("past_limit"),
        "preemptions_per_request": share("preemptions"),
        "wasted_token_share": share("lost_tokens", "tokens"),
        "oscillating_share": share("oscillating"),
        "migrations_per_request": share("migrations"),
        "admission_flaps_per_hour": lambda s, c: _ratio(c @ s.sums["flaps"], span(s, c) / 3600),
        "max_queue_s": maximum("queue_s"),
        "max_backlogged_service_gap": maximum("service_gap"),
        "jain_index": lambda s, c: _jain(c @ s.tenant_service),
        "idle_share": lambda s, c: _costed(s, 1 - _ratio(c @ s.sums["busy_s"], span(s, c) * s.num_instances)),
        "cost_per_1k_goodput_tokens": lambda s, c: _costed(
            s, _ratio(span(s, c) * s.num_instances * price_per_s, (c @ s.sums["good_tokens"]) / 1000)),
    }
    for dist in _DISTRIBUTIONS:
        for q in (50, 90, 99):
            found[f"{dist}_p{q}_s"] = quantile(dist, q / 100)
        found[f"{dist}_spread_s"] = (lambda d: lambda s, c: _quantile(c @ s.hists[d], 0.99) - _quantile(c @ s.hists[d], 0.5))(dist)
    return found


def metric_names(config: MetricsConfig) -> list[str]:
    """Every metric the comparison can judge."""
    return sorted(_evaluators(0.0))


def default_block_windows(num_windows: int) -> int:
    """Windows per bootstrap block: 1.5 n^(1/3), the usual order for the block bootstrap of a mean,
    with a constant that keeps moderate window-to-window correlation inside the blocks."""
    return max(1, min(num_windows, round(1.5 * num_windows ** (1 / 3))))


def block_counts(num_windows: int, resamples: int, block_windows: int, rng: np.random.Generator) -> np.ndarray:
    """How often each window appears in each circular moving-block resample: [resamples, windows]."""
    blocks = -(-num_windows // block_windows)
    starts = rng.integers(0, num_windows, size=(resamples, blocks))
    picked = (starts[:, :, None] + np.arange(block_windows)) % num_windows
    picked = picked.reshape(resamples, -1)[:, :num_windows]
    counts = np.zeros((resamples, num_windows))
    np.add.at(counts, (np.repeat(np.arange(resamples), num_windows), picked.ravel()), 1)
    return counts


@dataclass(frozen=True, slots=True)
class RankTests:
    """Descriptive tests on two latency samples (requests taken as independent)."""

    mann_whitney_u: float
    mann_whitney_p: float
    hodges_lehmann_s: float  # median of candidate - baseline pairwise differences
    brown_forsythe_stat: float
    brown_forsythe_p: float
    num_baseline: int
    num_candidate: int


def rank_tests(baseline: np.ndarray, candidate: np.ndarray, rng: np.random.Generator) -> RankTests | None:
    """Mann-Whitney U, the Hodges-Lehmann shift and Brown-Forsythe, on up to 20,000 values a side."""
    from scipy import stats

    x, y = baseline[~np.isnan(baseline)], candidate[~np.isnan(candidate)]
    if len(x) < 2 or len(y) < 2:
        return None
    xs = rng.choice(x, 20_000, replace=False) if len(x) > 20_000 else x
    ys = rng.choice(y, 20_000, replace=False) if len(y) > 20_000 else y
    mw = stats.mannwhitneyu(ys, xs, alternative="two-sided", method="asymptotic")
    hx = rng.choice(xs, min(len(xs), 1_500), replace=False)
    hy = rng.choice(ys, min(len(ys), 1_500), replace=False)
    hl = float(np.median(hy[:, None] - hx[None, :]))
    if np.ptp(xs) + np.ptp(ys) > 0:  # Brown-Forsythe compares spreads: none on either side, nothing to test
        bf = stats.levene(xs, ys, center="median")
        bf_stat, bf_p = float(bf.statistic), float(bf.pvalue)
    else:
        bf_stat, bf_p = 0.0, 1.0
    return RankTests(float(mw.statistic), float(mw.pvalue), hl, bf_stat, bf_p, len(x), len(y))


@dataclass(frozen=True, slots=True)
class Difference:
    """A metric in both runs and their paired bootstrap difference."""

    metric: str
    group: str  # "" for the whole run, else the class
    baseline: float | None
    candidate: float | None
    num_baseline: int  # requests behind each figure
    num_candidate: int
    absolute: float | None  # candidate - baseline
    relative: float | None  # (candidate - baseline) / |baseline|
    absolute_ci: tuple[float, float] | None
    relative_ci: tuple[float, float] | None
    confidence: float
    rank_tests: RankTests | None


def _points(metric: str, s: WindowStats) -> int:
    for dist in _DISTRIBUTIONS:
        if metric.startswith(dist + "_p") or metric.startswith(dist + "_spread"):
            return int(s.hists[dist].sum())
    return int(s.n.sum())


def _interval(resampled: np.ndarray, estimate: float, confidence: float, num_blocks: int) -> tuple[float, float]:
    """The percentile interval of the resampled differences, re-centred on the estimate and widened
    by t(k - 1) / z for the k blocks a resample is made of: with few independent blocks, plain
    percentile intervals cover less often than they claim (the same correction as Student's t)."""
    from scipy import stats

    alpha = (1 - confidence) / 2
    widen = float(stats.t.ppf(1 - alpha, max(num_blocks - 1, 1)) / stats.norm.ppf(1 - alpha))
    centre = float(np.mean(resampled))
    lo, hi = np.quantile(resampled, alpha), np.quantile(resampled, 1 - alpha)
    return estimate + widen * (float(lo) - centre), estimate + widen * (float(hi) - centre)


def compare_stats(
    metric: str,
    group: str,
    base: WindowStats,
    cand: WindowStats,
    counts: np.ndarray,
    confidence: float,
    evaluator: Evaluator,
    tests: RankTests | None,
    num_blocks: int,
) -> Difference:
    """Point estimates and the paired bootstrap interval of one metric (``counts`` are the
    resamples, each made of ``num_blocks`` blocks)."""
    whole = np.ones((1, len(base.n)))
    b0, c0 = float(evaluator(base, whole)[0]), float(evaluator(cand, whole)[0])
    b0 = None if not np.isfinite(b0) else b0
    c0 = None if not np.isfinite(c0) else c0
    absolute = relative = absolute_ci = relative_ci = None
    if b0 is not None and c0 is not None:
        absolute = c0 - b0
        relative = absolute / abs(b0) if b0 != 0 else None
        bs, cs = evaluator(base, counts), evaluator(cand, counts)
        ok = np.isfinite(bs) & np.isfinite(cs)
        if ok.sum() >= 10:
            absolute_ci = _interval(cs[ok] - bs[ok], absolute, confidence, num_blocks)
            nonzero = ok & (bs != 0)
            if nonzero.sum() >= 10 and relative is not None:
                relative_ci = _interval((cs[nonzero] - bs[nonzero]) / np.abs(bs[nonzero]), relative, confidence, num_blocks)
    return Difference(metric, group, b0, c0, _points(metric, base), _points(metric, cand), absolute, relative,
                      absolute_ci, relative_ci, confidence, tests)


def distribution_of(metric: str) -> str | None:
    """The request column behind a latency metric (for the rank tests), if it is one."""
    for dist, column in _DISTRIBUTIONS.items():
        if metric.startswith(dist + "_p") or metric.startswith(dist + "_spread"):
            return column
    return None


def evaluator(metric: str, config: MetricsConfig) -> Evaluator:
    found = _evaluators(config.cost.accelerator_hour_price / 3600)
    if metric not in found:
        raise KeyError(metric)
    return found[metric]


__all__: Sequence[str] = (
    "Difference",
    "RankTests",
    "WindowStats",
    "block_counts",
    "compare_stats",
    "distribution_of",
    "evaluator",
    "metric_names",
    "rank_tests",
    "window_stats",
)
