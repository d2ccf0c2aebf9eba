"""The block bootstrap: stated coverage on autocorrelated data; resampling and rank tests behave."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special
from scipy.stats import mstats

from replay.compare import (
    Resampling,
    block_counts,
    compare_stats,
    default_block_windows,
    evaluator,
    metric_names,
    rank_tests,
    resampling,
    window_stats,
)
from replay.metrics import HIST_EDGES_S, MetricsConfig, Requests

CONFIG = MetricsConfig(window_s=10.0)


def _autocorrelated_run(rng: np.random.Generator, windows: int, reject_p: float, per_window: int = 40) -> Requests:
    """Requests whose rejection probability drifts by an AR(1) process across windows (phi 0.5)."""
    drift = np.zeros(windows)
    shocks = rng.normal(0, 0.03, windows)
    for w in range(windows):
        drift[w] = (0.5 * drift[w - 1] if w else 0.0) + shocks[w]
    window = np.repeat(np.arange(windows), per_window)
    n = len(window)
    rejected = rng.random(n) < np.clip(reject_p + drift, 0, 1)[window]
    zeros, nans = np.zeros(n), np.full(n, np.nan)
    return Requests(
        arrival_s=window * CONFIG.window_s + rng.uniform(0, CONFIG.window_s, n),
        service_class=np.full(n, "default", dtype=object), tenant=np.full(n, "t", dtype=object),
        class_code=np.zeros(n, dtype=np.int64), class_names=np.array(["default"], dtype=object),
        tenant_code=np.zeros(n, dtype=np.int64), tenant_names=np.array(["t"], dtype=object),
        outcome=np.where(rejected, "rejected", "completed").astype(object),
        ttft_s=nans, itl_p99_s=nans, tpot_s=nans, e2e_s=nans, queue_s=nans, num_prompt_tokens=zeros,
        num_output_tokens=zeros, num_preemptions=zeros, num_migrations=zeros, num_lost_tokens=zeros,
        num_admission_decisions=zeros,
        request_id=np.arange(n).astype(object), good=~rejected, meets_ttft=~rejected, meets_itl=~rejected,
        meets_e2e=~rejected, past_limit=np.zeros(n, bool), rejected=rejected, origin_ns=0,
    )


def test_ninety_percent_intervals_cover_the_true_difference_on_autocorrelated_data():
    """200 trials, fixed seed: baseline rejects 20%, candidate 25%, both drifting as AR(1) across
    120 windows; the 90% interval of the difference must cover the true 0.05 in 85-95% of trials."""
    rng = np.random.default_rng(7)
    windows, trials = 120, 200
    block = default_block_windows(windows)
    metric = evaluator("rejected_share", CONFIG)
    tenants = np.array(["t"], dtype=object)
    covered = 0
    for _ in range(trials):
        base, cand = _autocorrelated_run(rng, windows, 0.20), _autocorrelated_run(rng, windows, 0.25)
        sb = window_stats(base, np.ones(base.size, bool), None, windows, CONFIG, tenants)
        sc = window_stats(cand, np.ones(cand.size, bool), None, windows, CONFIG, tenants)
        boot = Resampling(block_counts(windows, 1000, block, rng), block, -(-windows // block))
        lo, hi = compare_stats("rejected_share", "", sb, sc, boot, 0.90, metric, None).absolute_ci
        covered += lo <= 0.05 <= hi
    assert 0.85 <= covered / trials <= 0.95, covered / trials


def test_block_counts_resample_every_window_count_once_on_average():
    counts = block_counts(50, 4000, 5, np.random.default_rng(1))
    assert counts.shape == (4000, 50) and np.all(counts.sum(1) == 50)
    assert counts.mean() == pytest.approx(1.0) and np.allclose(counts.mean(0), 1.0, atol=0.1)


def test_one_block_as_long_as_the_run_resamples_the_run_itself_every_time():
    """Why the gate refuses a block_windows leaving fewer than 5 blocks: a circular block the length of the
    run is the run shifted, so every resample holds each window once and every interval has zero width."""
    counts = block_counts(30, 200, 30, np.random.default_rng(1))
    assert np.all(counts == 1)
    assert len({tuple(row) for row in block_counts(30, 200, 6, np.random.default_rng(1))}) > 100  # 5 blocks: they differ


def test_rank_tests_see_a_shift_and_a_change_in_spread():
    rng = np.random.default_rng(3)
    base = rng.lognormal(0, 0.3, 5_000)
    shifted = rank_tests(base, base * 1.2, rng)
    assert shifted.mann_whitney_p < 1e-6 and shifted.hodges_lehmann_s > 0
    wider = rank_tests(base, np.exp(rng.normal(0, 0.9, 5_000)), rng)
    assert wider.brown_forsythe_p < 1e-6
    same = rank_tests(base, base.copy(), rng)
    assert same.mann_whitney_p > 0.5 and abs(same.hodges_lehmann_s) < 0.03  # HL is estimated on subsamples


def _latency_run(rng: np.random.Generator, windows: int, per_window: int = 60) -> Requests:
    run = _autocorrelated_run(rng, windows, 0.0, per_window)
    n = run.size
    ttft = rng.lognormal(-1.5, 0.8, n)
    return Requests(**{**run.__dict__, "ttft_s": ttft, "e2e_s": ttft + rng.uniform(1, 20, n),
                       "queue_s": ttft * 0.3, "itl_p99_s": rng.uniform(0.02, 0.2, n), "tpot_s": rng.uniform(0.01, 0.05, n)})


def _harrell_davis_over_every_bin(counts: np.ndarray, q: float) -> float:
    """The Harrell-Davis quantile of a full histogram of HIST_EDGES_S, written out: each bin's upper
    edge weighted by the Beta((n + 1) q, (n + 1)(1 - q)) law's mass over the ranks the bin holds."""
    n = counts.sum()
    cdf = special.betainc(q * (n + 1), (1 - q) * (n + 1), np.cumsum(counts) / n)
    return float(np.diff(cdf, prepend=0.0) @ np.append(HIST_EDGES_S, HIST_EDGES_S[-1]))


def test_resampled_quantiles_over_the_filled_bins_equal_those_over_every_bin():
    """The histograms keep only the bins some request fills, and the incomplete beta function is
    evaluated only near the quantile's rank; each resample's quantile must be the Harrell-Davis
    estimate a full histogram of HIST_EDGES_S gives, every bin weighted."""
    rng = np.random.default_rng(11)
    windows = 12
    for per_window in (60, 5):  # about 720 requests a resample, and about 60: a p99's Beta law is skewed there
        run = _latency_run(rng, windows, per_window)
        stats = window_stats(run, np.ones(run.size, bool), None, windows, CONFIG, np.array(["t"], dtype=object))
        boot = resampling(windows, 50, 0, rng)
        window = np.clip(np.floor(run.arrival_s / CONFIG.window_s).astype(int), 0, windows - 1)
        for metric, q in (("ttft_p99_s", 0.99), ("ttft_p50_s", 0.5)):
            got = evaluator(metric, CONFIG)(stats, boot.counts)
            for r in range(len(boot.counts)):
                weights = boot.counts[r][window]  # each request counted as often as its window was drawn
                full = np.bincount(np.searchsorted(HIST_EDGES_S, run.ttft_s), weights=weights,
                                   minlength=len(HIST_EDGES_S) + 1)
                assert got[r] == pytest.approx(_harrell_davis_over_every_bin(full, q), rel=1e-11)


def test_the_quantile_is_the_harrell_davis_estimate_of_the_requests_to_within_a_bin():
    """Against scipy's own Harrell-Davis estimator on the raw latencies (no histogram): the gate's
    figure, on 1% bins read at their upper edges, lies within one bin above it. On a sample whose p99
    rests on 20 requests it lies between the 1,970th and 1,990th smallest of 2,000, where the single
    order statistic it replaces would be the 1,980th."""
    rng = np.random.default_rng(5)
    windows = 20
    run = _latency_run(rng, windows, per_window=100)
    stats = window_stats(run, np.ones(run.size, bool), None, windows, CONFIG, np.array(["t"], dtype=object))
    whole = np.ones((1, windows))
    ordered = np.sort(run.ttft_s)
    for metric, q in (("ttft_p99_s", 0.99), ("ttft_p50_s", 0.5), ("ttft_p90_s", 0.9)):
        got = float(evaluator(metric, CONFIG)(stats, whole)[0])
        exact = float(mstats.hdquantiles(run.ttft_s, prob=[q])[0])
        assert exact <= got <= exact * 1.0101, metric
    p99 = float(evaluator("ttft_p99_s", CONFIG)(stats, whole)[0])
    assert ordered[1969] < p99 < ordered[1990] * 1.0101
    constant = Requests(**{**run.__dict__, "ttft_s": np.full(run.size, 0.25)})  # every request in one bin
    stats = window_stats(constant, np.ones(run.size, bool), None, windows, CONFIG, np.array(["t"], dtype=object))
    edge = HIST_EDGES_S[np.searchsorted(HIST_EDGES_S, 0.25)]
    boot = resampling(windows, 50, 0, rng)
    assert (evaluator("ttft_p99_s", CONFIG)(stats, boot.counts) == edge).all()  # exactly: no rounding to differ by


def test_a_difference_carries_each_sides_interval_and_the_evidence_behind_it():
    rng = np.random.default_rng(12)
    windows = 40
    base, cand = _latency_run(rng, windows), _latency_run(rng, windows)
    tenants = np.array(["t"], dtype=object)
    sb = window_stats(base, np.ones(base.size, bool), None, windows, CONFIG, tenants)
    sc = window_stats(cand, np.ones(cand.size, bool), None, windows, CONFIG, tenants)
    boot = resampling(windows, 400, 0, rng)
    d = compare_stats("ttft_p50_s", "", sb, sc, boot, 0.9, evaluator("ttft_p50_s", CONFIG), None)
    assert (d.num_windows, d.block_windows, d.num_blocks, d.num_resamples) == (40, boot.block_windows, boot.num_blocks, 400)
    assert d.num_baseline == base.size and d.candidate_ci[0] <= d.candidate <= d.candidate_ci[1]
    assert d.baseline_ci[0] <= d.baseline <= d.baseline_ci[1]
    rare = np.zeros(cand.size, bool)
    rare[:3] = True  # three rejections, all in the first window: the re-centred interval would reach below 0
    cand = Requests(**{**cand.__dict__, "rejected": rare, "outcome": np.where(rare, "rejected", "completed").astype(object)})
    sc = window_stats(cand, np.ones(cand.size, bool), None, windows, CONFIG, tenants)
    share = compare_stats("rejected_share", "", sb, sc, boot, 0.9, evaluator("rejected_share", CONFIG), None)
    assert share.candidate == pytest.approx(3 / cand.size) and share.candidate_ci[0] == 0.0  # a share stays in [0, 1]
    assert set(metric_names(CONFIG)) >= {"ttft_p50_s", "tpot_p50_s", "itl_p99_p99_s"}
