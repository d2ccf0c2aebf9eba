"""The block bootstrap: stated coverage on autocorrelated data; resampling and rank tests behave."""

from __future__ import annotations

import numpy as np
import pytest

from replay.compare import block_counts, compare_stats, default_block_windows, evaluator, rank_tests, window_stats
from replay.metrics import MetricsConfig, Requests

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
        counts = block_counts(windows, 1000, block, rng)
        lo, hi = compare_stats("rejected_share", "", sb, sc, counts, 0.90, metric, None, -(-windows // block)).absolute_ci
        covered += lo <= 0.05 <= hi
    assert 0.85 <= covered / trials <= 0.95, covered / trials


def test_block_counts_resample_every_window_count_once_on_average():
    counts = block_counts(50, 4000, 5, np.random.default_rng(1))
    assert counts.shape == (4000, 50) and np.all(counts.sum(1) == 50)
    assert counts.mean() == pytest.approx(1.0) and np.allclose(counts.mean(0), 1.0, atol=0.1)


def test_rank_tests_see_a_shift_and_a_change_in_spread():
    rng = np.random.default_rng(3)
    base = rng.lognormal(0, 0.3, 5_000)
    shifted = rank_tests(base, base * 1.2, rng)
    assert shifted.mann_whitney_p < 1e-6 and shifted.hodges_lehmann_s > 0
    wider = rank_tests(base, np.exp(rng.normal(0, 0.9, 5_000)), rng)
    assert wider.brown_forsythe_p < 1e-6
    same = rank_tests(base, base.copy(), rng)
    assert same.mann_whitney_p > 0.5 and abs(same.hodges_lehmann_s) < 0.03  # HL is estimated on subsamples
