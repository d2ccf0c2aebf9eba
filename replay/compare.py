"""Baseline against candidate: per-metric differences with block-bootstrap confidence intervals.

Requests close in time share a queue, so they are not independent: resampling them one by one
would make every interval far too narrow. Both runs are therefore cut into the same time windows
(``MetricsConfig.window_s``, on a common origin: the same workload replayed twice, or two pools
over the same period), each window reduced to sufficient statistics (counts, sums, maxima, latency
histograms with 1% bins), and whole runs of consecutive windows are resampled together: a circular
moving-block bootstrap, the same blocks for both runs (paired). A metric is recomputed from each
resample's statistics (a latency quantile as the Harrell-Davis estimate on the pooled histogram,
smooth in the resampled counts); its interval is the percentile interval of the paired difference, centred on
the estimate and widened by t(k-1)/z for the k blocks per resample (few blocks mean few
independent pieces of evidence; ``tests/replay/test_compare.py`` checks the stated coverage on
autocorrelated data).

For latency distributions the Mann-Whitney U test and the Hodges-Lehmann shift (the median of all
pairwise differences) are shown too, as Kayenta does, with the Brown-Forsythe test for a change in
spread; they treat requests as independent, so they describe, and the bootstrap decides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from replay.metrics import HIST_EDGES_S, MetricsConfig, Requests, Steps

_DISTRIBUTIONS = {"ttft": "ttft_s", "itl_p99": "itl_p99_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}


@dataclass
class WindowStats:
    """Per-window sufficient statistics of one group of requests (a run, or one class of it)."""

    window_s: float
    n: np.ndarray
    sums: dict[str, np.ndarray]  # additive per-window figures
    hists: dict[str, np.ndarray]  # distribution name -> [windows, filled bins] counts
    hist_bins: dict[str, np.ndarray]  # distribution name -> the HIST_EDGES_S bin of each column of hists
    maxima: dict[str, np.ndarray]  # per-window maxima (-inf where empty)
    tenant_service: np.ndarray  # [windows, tenants] delivered service / weight
    num_instances: int
    has_steps: bool  # engine steps were given (cost and idle share need them)
    resampled: dict = field(default_factory=dict)  # distribution -> (counts, resampled histograms), the last


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
    hists, hist_bins = _histograms(r, rows, w, num_windows)
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
                   np.where(backlogged, service, -np.inf).max(1, initial=-np.inf)
                   - np.where(backlogged, service, np.inf).min(1, initial=np.inf), -np.inf)  # no tenant at all: none
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
        hist_bins=hist_bins,
        maxima={"queue_s": qmax, "service_gap": gap},
        tenant_service=service,
        num_instances=max(steps.num_instances, 1) if steps is not None else 1,
        has_steps=steps is not None and len(steps.start_s) > 0,
    )


def _histograms(r: Requests, rows: np.ndarray, w: np.ndarray, num_windows: int,
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per distribution, [windows, bins] counts over only the bins some request fills (a few hundred
    columns instead of ~1,850: empty bins move no cumulative count, so every quantile is the same),
    and the HIST_EDGES_S bin of each column."""
    hists, hist_bins = {}, {}
    for name, column in _DISTRIBUTIONS.items():
        values = getattr(r, column)[rows]
        ok = ~np.isnan(values)
        filled, col = np.unique(np.clip(np.searchsorted(HIST_EDGES_S, values[ok]), 0, len(HIST_EDGES_S)),
                                return_inverse=True)
        hist = np.zeros((num_windows, len(filled)))
        np.add.at(hist, (w[ok], col), 1)
        hists[name], hist_bins[name] = hist, filled
    return hists, hist_bins


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


_EDGES = np.append(HIST_EDGES_S, HIST_EDGES_S[-1])  # the upper edge of each bin (the last one open)


#: The incomplete beta function is evaluated only on the columns where some row's share of requests
#: lies within this many standard deviations of the quantile's rank (plus as many ranks): the
#: Harrell-Davis weight left outside is below 1e-12 at every sample size, a p99's skewed Beta law
#: over a few dozen requests included.
_HD_BAND_SD = 12.0


def _quantile(hist: np.ndarray, q: float, bins: np.ndarray | None = None) -> np.ndarray:
    """Quantile (0-1) of histogram rows [R, bins] on the log bins: the Harrell-Davis estimate, a
    weighted mean of the order statistics (each at the upper edge of its 1% bin) with the weights of
    a Beta((n + 1) q, (n + 1)(1 - q)) law over the ranks.

    One order statistic (the edge of the bin the quantile reaches) makes a tail quantile a jump
    between the few requests near it: its bootstrap distribution is lumpy and converges slowly (Hall
    & Martin 1988), which widens a p99's interval by the lattice rather than the evidence. The
    Harrell-Davis estimator (Harrell & Davis 1982) smooths over the neighbouring ranks, as a smoothed
    bootstrap of a quantile does (Hall, DiCiccio & Romano 1989); measured on the gate's A/A pairs, its
    90% intervals still hold the true difference about 90% of the time (docs/gate.md).
    ``bins``: the bin index of each column when ``hist`` holds only some bins (the others empty)."""
    from scipy import special

    cum = np.cumsum(hist, axis=1)
    n = cum[:, -1]
    size = np.maximum(n, 1)[:, None]
    half = _HD_BAND_SD * (np.sqrt(q * (1 - q) / size) + 1 / size)
    # The columns some row's band touches: from the first column above q - half to the first at or
    # above q + half (below it every row's Beta CDF is 0, beyond it 1, to within 1e-12).
    first = int(((cum <= (q - half) * size).sum(axis=1)).min())
    last = min(int((cum < (q + half) * size).sum(axis=1).max()), hist.shape[1] - 1)
    below = np.clip(cum[:, first:last + 1] / size, 0.0, 1.0)  # the share at or below each column's bin
    cdf = special.betainc(q * (size + 1), (1 - q) * (size + 1), below)
    weights = np.diff(cdf, axis=1, prepend=0.0)
    idx = (np.arange(hist.shape[1]) if bins is None else bins)[first:last + 1]
    out = (weights * _EDGES[np.clip(idx, 0, len(_EDGES) - 1)]).sum(axis=1)
    return np.where(n > 0, out, np.nan)


def _resampled_quantiles(s: WindowStats, c: np.ndarray, dist: str, *qs: float) -> list[np.ndarray]:
    """Quantiles of each resample's histogram (over the bins the run fills). The resampled
    histograms are kept for the resampling they came from: p50, p99 and spread share them."""
    if not s.hists[dist].shape[1]:
        return [np.full(len(c), np.nan) for _ in qs]
    kept = s.resampled.get(dist)
    if kept is not None and kept[0] is c:
        summed = kept[1]
    else:
        summed = c @ s.hists[dist]
        if len(c) > 1:  # the resampling, not a whole-run figure
            s.resampled[dist] = (c, summed)  # holding c: its identity stays unique while it is kept
    return [_quantile(summed, q, s.hist_bins[dist]) for q in qs]


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


@functools.lru_cache(maxsize=8)
def _evaluators(price_per_s: float) -> dict[str, Evaluator]:
    def span(s: WindowStats, c: np.ndarray) -> np.ndarray:
        return c.sum(1) * s.window_s

    def rate(key: str) -> Evaluator:
        return lambda s, c: _ratio(c @ s.sums[key], span(s, c))

    def share(key: str, den: str | None = None) -> Evaluator:
        return lambda s, c: _ratio(c @ s.sums[key], c @ (s.n if den is None else s.sums[den]))

    def quantile(dist: str, q: float) -> Evaluator:
        return lambda s, c: _resampled_quantiles(s, c, dist, q)[0]

    def spread(dist: str) -> Evaluator:
        def evaluate(s: WindowStats, c: np.ndarray) -> np.ndarray:
            p50, p99 = _resampled_quantiles(s, c, dist, 0.5, 0.99)
            return p99 - p50
        return evaluate

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
        found[f"{dist}_spread_s"] = spread(dist)
    return found


@dataclass(frozen=True, slots=True)
class MetricInfo:
    """What a metric means (``servelens gate --list-metrics``; ``docs/metrics.md`` defines each)."""

    name: str
    unit: str
    worse: str  # the direction that is worse: 'increase' or 'decrease'
    meaning: str


_DIST_MEANING = {
    "ttft": "time to first token, from arrival (user-facing)",
    "itl_p99": "each request's p99 inter-token gap",
    "tpot": "each request's mean inter-token gap (TPOT: the mean ITL)",
    "e2e": "end-to-end latency, arrival to last token",
    "queue": "queue time, arrival to first batch membership",
}

_INFO: tuple[tuple[str, str, str, str], ...] = (
    ("goodput_rps", "requests/s", "decrease", "requests per second that completed within every objective of their class"),
    ("goodput_tokens_per_s", "tokens/s", "decrease", "output tokens per second of the requests that met every objective"),
    ("throughput_rps", "requests/s", "decrease", "completed requests per second, good or not"),
    ("attainment", "share", "decrease", "share of arrived requests that met every objective (a rejection is a miss)"),
    ("attainment_ttft", "share", "decrease", "share of arrived requests that completed within the TTFT objective"),
    ("attainment_itl", "share", "decrease", "share of arrived requests that completed within the ITL objective"),
    ("attainment_e2e", "share", "decrease", "share of arrived requests that completed within the E2E objective"),
    ("rejected_share", "share", "increase", "share of arrived requests rejected by admission control"),
    ("cancelled_share", "share", "increase", "share of arrived requests the client cancelled"),
    ("timed_out_share", "share", "increase", "share of arrived requests that timed out"),
    ("error_share", "share", "increase", "share of arrived requests that ended in an error"),
    ("past_queue_limit_share", "share", "increase", "starvation: share of requests queued longer than their class's max_queue_s"),
    ("preemptions_per_request", "preemptions/request", "increase", "recompute and swap preemptions per request (moves not counted)"),
    ("wasted_token_share", "share", "increase", "recomputed (lost) tokens over all tokens processed"),
    ("oscillating_share", "share", "increase", "oscillation: share of requests preempted twice or more"),
    ("migrations_per_request", "migrations/request", "increase", "moves to another instance with the KV, per request"),
    ("admission_flaps_per_hour", "switches/hour", "increase", "oscillation of admission: switches between rejecting and not, by 1 s"),
    ("max_queue_s", "s", "increase", "starvation: the longest queue residence of any request"),
    ("max_backlogged_service_gap", "service/weight", "increase", "fairness: largest service gap between tenants backlogged together"),
    ("jain_index", "index", "decrease", "fairness: Jain's index of delivered service over entitlement (1: equal)"),
    ("idle_share", "share", "increase", "share of accelerator time with no step running (needs engine steps)"),
    ("cost_per_1k_goodput_tokens", "currency", "increase", "accelerator cost per 1,000 goodput tokens (needs engine steps)"),
)


def metric_info(name: str) -> MetricInfo:
    """The meaning, unit and worse direction of a metric (KeyError for an unknown one)."""
    for known, unit, worse, meaning in _INFO:
        if known == name:
            return MetricInfo(name, unit, worse, meaning)
    for dist, meaning in _DIST_MEANING.items():
        if name.startswith(dist + "_") and name.endswith("_s"):
            stat = name[len(dist) + 1:-2]
            if stat == "spread":
                return MetricInfo(name, "s", "increase", f"variance: p99 - p50 over requests of {meaning}")
            if stat in ("p50", "p90", "p99"):
                return MetricInfo(name, "s", "increase", f"{stat} over requests of {meaning}")
    raise KeyError(name)


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
class Resampling:
    """The paired block bootstrap of a comparison: which windows each resample holds, and how."""

    counts: np.ndarray  # [resamples, windows]: how often each window appears in each resample
    block_windows: int  # consecutive windows per block
    num_blocks: int  # blocks per resample

    @property
    def num_windows(self) -> int:
        return self.counts.shape[1]

    @property
    def num_resamples(self) -> int:
        return self.counts.shape[0]


def resampling(num_windows: int, resamples: int, block_windows: int, rng: np.random.Generator) -> Resampling:
    """``resamples`` circular moving-block resamples of ``num_windows`` windows (``block_windows``
    0: ``default_block_windows``)."""
    block = min(block_windows or default_block_windows(num_windows), num_windows)
    return Resampling(block_counts(num_windows, resamples, block, rng), block, -(-num_windows // block))


@dataclass(frozen=True, slots=True)
class Difference:
    """A metric in both runs, their paired bootstrap difference, and the evidence behind it."""

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
    baseline_ci: tuple[float, float] | None = None  # each side's own interval (absolute conditions)
    candidate_ci: tuple[float, float] | None = None
    num_windows: int = 0  # windows of the common grid
    block_windows: int = 0  # windows per bootstrap block
    num_blocks: int = 0  # blocks per resample
    num_resamples: int = 0  # resamples with a finite figure on both sides (the interval's)


def _points_per_window(metric: str, s: WindowStats) -> np.ndarray:
    """Requests behind ``metric`` in each window: those with a value for a latency distribution,
    else every request of the group."""
    for dist in _DISTRIBUTIONS:
        if metric.startswith(dist + "_p") or metric.startswith(dist + "_spread"):
            return s.hists[dist].sum(axis=1)
    return s.n


def windows_with(metric: str, base: WindowStats, cand: WindowStats, min_requests: int) -> int:
    """Windows in which both sides hold at least ``min_requests`` requests behind ``metric``."""
    return int(np.count_nonzero((_points_per_window(metric, base) >= min_requests)
                                & (_points_per_window(metric, cand) >= min_requests)))


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


def _own_interval(metric: str, values: np.ndarray, estimate: float | None, confidence: float, num_blocks: int,
                  ) -> tuple[float, float] | None:
    """One run's interval of its own figure, within what the metric can be (every metric is at
    least 0; shares and indices at most 1)."""
    ok = np.isfinite(values)
    if estimate is None or ok.sum() < 10:
        return None
    lo, hi = _interval(values[ok], estimate, confidence, num_blocks)
    top = 1.0 if metric_info(metric).unit in ("share", "index") else np.inf
    return max(lo, 0.0), min(hi, top)


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


def compare_stats(
    metric: str,
    group: str,
    base: WindowStats,
    cand: WindowStats,
    boot: Resampling,
    confidence: float,
    evaluator: Evaluator,
    tests: RankTests | None,
) -> Difference:
    """Point estimates, each side's interval and the paired bootstrap interval of one metric."""
    whole = np.ones((1, len(base.n)))
    b0, c0 = _finite(float(evaluator(base, whole)[0])), _finite(float(evaluator(cand, whole)[0]))
    bs, cs = evaluator(base, boot.counts), evaluator(cand, boot.counts)
    absolute = relative = absolute_ci = relative_ci = None
    ok = np.isfinite(bs) & np.isfinite(cs)
    if b0 is not None and c0 is not None:
        absolute = c0 - b0
        relative = absolute / abs(b0) if b0 != 0 else None
        if ok.sum() >= 10:
            absolute_ci = _interval(cs[ok] - bs[ok], absolute, confidence, boot.num_blocks)
            nonzero = ok & (bs != 0)
            if nonzero.sum() >= 10 and relative is not None:
                relative_ci = _interval((cs[nonzero] - bs[nonzero]) / np.abs(bs[nonzero]), relative, confidence,
                                        boot.num_blocks)
    return Difference(metric, group, b0, c0, int(_points_per_window(metric, base).sum()),
                      int(_points_per_window(metric, cand).sum()), absolute, relative, absolute_ci, relative_ci,
                      confidence, tests, _own_interval(metric, bs, b0, confidence, boot.num_blocks),
                      _own_interval(metric, cs, c0, confidence, boot.num_blocks), boot.num_windows, boot.block_windows,
                      boot.num_blocks, int(ok.sum()))


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
    "MetricInfo",
    "RankTests",
    "Resampling",
    "WindowStats",
    "block_counts",
    "compare_stats",
    "distribution_of",
    "evaluator",
    "metric_info",
    "metric_names",
    "rank_tests",
    "resampling",
    "window_stats",
    "windows_with",
)
