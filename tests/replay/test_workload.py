"""Workloads: load transforms keep the burst structure of a real trace, sources stream, telemetry converts back."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pyarrow as pa
import pytest

from replay.errors import ReplayError
from replay.traces import WORKLOAD_SCHEMA, read_trace
from replay.workload import (
    TableWorkload,
    TiledWorkload,
    block_bootstrap,
    burstiness,
    peak_to_mean,
    poisson_workload,
    scale_rate,
    sliding_peak_to_mean,
    superpose,
    tile,
    trim,
    workload_from_requests,
)
from tests.replay.conftest import make_workload


@pytest.fixture(scope="module")
def azure(shared):
    return read_trace("azure-conv", shared)


def _stats(table: pa.Table) -> np.ndarray:
    b = burstiness(table["arrival_ns"].to_numpy())
    return np.array([b.interarrival_cv, b.peak_to_mean_1s, b.peak_to_mean_10s])


def _within(transformed: np.ndarray, original: np.ndarray, tolerance: float) -> bool:
    return bool(np.all(np.abs(transformed / original - 1) <= tolerance))


def test_tiled_copies_keep_cv_and_peak_to_mean_per_1s_and_10s(azure):
    """The benchmark's transform: copies back to back on a 10 s grid (same rate, longer trace)."""
    original = _stats(azure)
    tiled = tile(azure, 5)
    assert tiled.num_rows == 5 * azure.num_rows
    assert _within(_stats(tiled), original, 0.10)
    # measured: CV +2.7% (the gap between copies), peaks within 0.3%
    assert _within(_stats(tiled)[1:], original[1:], 0.01)


def test_superposed_shifted_copies_rescaled_to_the_original_rate_keep_the_burst_statistics(azure):
    original = _stats(azure)
    doubled = superpose(azure, 2, shift_ns=60 * 10**9)  # rate x 2

    def span(t):
        return int(t["arrival_ns"].to_numpy()[-1] - t["arrival_ns"].to_numpy()[0])

    assert doubled.num_rows == 2 * azure.num_rows
    assert doubled.num_rows / span(doubled) == pytest.approx(2 * azure.num_rows / span(azure), rel=0.05)
    rescaled = scale_rate(doubled, 0.5)
    assert _within(_stats(rescaled), original, 0.10)  # measured: CV +6.3%, peak/mean 1 s +8.1%, 10 s +0.5%


def test_rate_scaling_is_exact_and_keeps_the_shape(azure):
    fast = scale_rate(azure, 2)
    a, b = azure["arrival_ns"].to_numpy(), fast["arrival_ns"].to_numpy()
    assert b[0] == a[0] and np.all(np.diff(b) >= 0)
    assert np.all(np.abs((b - b[0]) * 2 - (a - a[0])) <= 1)  # every offset halved (to the nanosecond)
    # the same windows in the scaled trace's time: statistics identical
    assert peak_to_mean(b, 0.5) == pytest.approx(peak_to_mean(a, 1.0))
    back = scale_rate(fast, Fraction(1, 2))["arrival_ns"].to_numpy()
    assert np.all(np.abs(back - a) <= 2)
    assert _within(_stats(scale_rate(fast, 0.5)), _stats(azure), 1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_block_bootstrap_keeps_cv_and_the_phase_free_peak(azure, seed):
    """Fixed-grid peaks move with where the grid falls (the original by 12% for a 0.75 s shift), so a
    bootstrap, whose first window starts off the original grid, is compared on the sliding-window peak."""
    a = azure["arrival_ns"].to_numpy()
    # the grid-phase effect: one extra arrival 0.75 s before the first moves every 1 s bin edge
    moved = peak_to_mean(np.concatenate(([a[0] - 750_000_000], a)), 1.0)
    assert moved / peak_to_mean(a, 1.0) - 1 > 0.10
    boot = block_bootstrap(azure, 60 * 10**9, 58, seed)
    b = boot["arrival_ns"].to_numpy()
    assert np.all(np.diff(b) >= 0) and len(set(boot["request_id"].to_pylist())) == boot.num_rows
    assert abs(burstiness(b).interarrival_cv / burstiness(a).interarrival_cv - 1) <= 0.10
    assert abs(sliding_peak_to_mean(b, 1.0) / sliding_peak_to_mean(a, 1.0) - 1) <= 0.10
    assert block_bootstrap(azure, 60 * 10**9, 58, seed).equals(boot)  # seeded


def test_transforms_never_reorder_what_they_copy(azure):
    part = azure.slice(0, 500)
    merged = superpose(part, 3, shift_ns=7 * 10**9)
    ids = merged["request_id"].to_pylist()
    for copy in range(3):
        mine = [i for i in ids if i.endswith(f"#{copy}")]
        assert mine == [f"{r}#{copy}" for r in part["request_id"].to_pylist()]
    assert np.all(np.diff(merged["arrival_ns"].to_numpy()) >= 0)
    start = part["arrival_ns"][100].as_py()
    cut = trim(part, start, start + 30 * 10**9)
    assert cut["request_id"][0].as_py() == part["request_id"][100].as_py()
    assert cut["arrival_ns"].to_numpy().max() < start + 30 * 10**9


def test_copies_and_windows_beyond_what_memory_holds_are_refused_before_any_is_built(azure):
    part = azure.slice(0, 500)  # 500 requests over about 6 minutes
    with pytest.raises(ReplayError, match="200,000 superposed copies make about 100,000,000 requests") as err:
        superpose(part, 200_000, shift_ns=0)
    assert "--requests N tiles" in (err.value.hint or "")
    with pytest.raises(ReplayError, match="bootstrapped windows make about"):
        block_bootstrap(part, 60 * 10**9, 2_000_000, seed=0)


def test_a_bootstrap_over_a_span_of_decades_is_sparse_or_refused(azure):
    """One arrival 20 years after the rest (a clock gone wrong) is 10.5M windows of 60 s: drawing them took
    24 GB before it was killed; a span of 300,000 windows is drawn in a blink, its empty windows skipped."""
    part = azure.slice(0, 200)
    last = part["arrival_ns"].to_numpy()[0] + 20 * 365 * 86_400 * 10**9
    far = part.set_column(1, part.schema.field("arrival_ns"),
                          pa.array([*part["arrival_ns"].to_numpy()[:-1], last], pa.int64()))
    with pytest.raises(ReplayError, match="windows of 60 s to draw from or to draw: at most 10,000,000") as err:
        block_bootstrap(far, 60 * 10**9, 100, seed=0)
    assert "a clock gone wrong" in err.value.hint
    # 20 years of hours, all empty but the first (the 199 other requests): seed 0 draws it twice in 175,200 draws
    boot = block_bootstrap(far, 3_600 * 10**9, 175_200, seed=0)
    assert boot.num_rows == 2 * 199 and boot.schema == part.schema
    assert block_bootstrap(far, 3_600 * 10**9, 175_200, seed=1).num_rows == 0  # drawn not once: nothing, not an error


def test_tiled_workload_streams_the_same_requests(azure):
    part = azure.slice(0, 300)
    stream = TiledWorkload(part, 4, num_requests=1000)
    table = pa.Table.from_batches(list(stream.batches()))
    assert table.num_rows == 1000 and table.schema == WORKLOAD_SCHEMA
    assert table.slice(0, 1000).equals(tile(part, 4).slice(0, 1000))
    assert stream.fingerprint() == TiledWorkload(part, 4, num_requests=1000).fingerprint()
    assert stream.fingerprint() != TiledWorkload(part, 4, num_requests=999).fingerprint()
    assert TableWorkload(part).fingerprint() == TableWorkload(part.slice(0)).fingerprint()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"num_prompt_tokens": [-5, 5, 5]}, "num_prompt_tokens must be at least 0: row 0 has -5"),
        ({"num_output_tokens": [3, -1, 3]}, "num_output_tokens must be at least 0: row 1 has -1"),
        ({"num_branches": [1, 1, 0]}, "num_branches must be at least 1: row 2 has 0"),
        ({"prefix_block_ids": [[1], [], []], "prefix_block_size_tokens": [0, None, None]},
         "prefix_block_size_tokens must be at least 1: row 0 has 0"),
        ({"request_id": ["a", "b", "a"]}, "request ids are not unique: 'a' is there more than once"),
        # a cancel before the arrival was ignored: the request completed as if never cancelled
        ({"cancel_after_ns": [None, -5, 10]}, "cancel_after_ns must be at least 0: row 1 has -5"),
    ],
)
def test_a_workload_with_impossible_rows_is_refused_naming_the_row(columns, message):
    base = {"num_prompt_tokens": [5, 5, 5], "num_output_tokens": [3, 3, 3], **columns}
    with pytest.raises(ReplayError, match=message):
        TableWorkload(make_workload([0, 10, 20], base.pop("num_prompt_tokens"), base.pop("num_output_tokens"), **base))
    TableWorkload(make_workload([0, 10, 20], [0, 5, 5], [0, 3, 3]))  # empty prompts and outputs are real (BurstGPT)


def test_a_negative_arrival_is_refused_naming_the_row():
    """One -5 ns beside epoch times spanned 54 years: the replay took 3 GB in per-second metrics before."""
    with pytest.raises(ReplayError, match="arrival_ns must be at least 0: row 0 has -5"):
        TableWorkload(make_workload([-5, 10, 20], [5, 5, 5], [3, 3, 3]))


def test_poisson_workload_is_seeded_with_the_asked_rate():
    w = poisson_workload(50.0, 20_000, seed=3)
    a = w["arrival_ns"].to_numpy()
    assert poisson_workload(50.0, 20_000, seed=3).equals(w)
    assert (len(a) - 1) / ((a[-1] - a[0]) / 1e9) == pytest.approx(50.0, rel=0.02)
    assert burstiness(a).interarrival_cv == pytest.approx(1.0, abs=0.02)


def test_a_workload_from_telemetry_replays_like_the_original(run):
    original = make_workload([0, 5_000_000, 9_000_000], [100, 200, 300], [4, 6, 8], tenant=["t1", "t2", "t1"],
                             session_id=["s", None, "s"])
    first = run(original)
    again = workload_from_requests(first.requests)
    assert again.schema == WORKLOAD_SCHEMA
    assert again["request_id"].to_pylist() == ["r0", "r1", "r2"]
    assert again["tenant"].to_pylist() == ["t1", "t2", "t1"] and again["session_id"].to_pylist() == ["s", None, "s"]
    assert again["num_output_tokens"].to_pylist() == [4, 6, 8]
    second = run(again)
    cols = ["request_id", "arrival_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "finish_ns", "outcome"]
    assert second.requests.select(cols).equals(first.requests.select(cols))


def test_telemetry_keeps_cancellations_and_failures(run):
    original = make_workload([0, 1_000_000], [100, 100], [50, 3], cancel_after_ns=[25_000_000, None], failed=[False, True])
    rows = run(original).requests
    again = workload_from_requests(rows)
    # r0 was cancelled 25 ms after arrival, having produced some tokens; r1 failed (error outcome)
    assert again["cancel_after_ns"].to_pylist() == [25_000_000, None]
    assert again["failed"].to_pylist() == [False, True]
    assert again["num_output_tokens"].to_pylist()[0] == rows["num_output_tokens"].to_pylist()[0] < 50


def test_unsorted_tables_are_refused():
    with pytest.raises(ReplayError, match="not in arrival order"):
        TableWorkload(make_workload([3, 1], [1, 1], [1, 1]))


def _with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    """The table with one column replaced by ``values`` of any type (as a hand-made Parquet file holds it)."""
    return table.set_column(table.schema.get_field_index(name), name, values)


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("num_prompt_tokens", pa.array([5.0, float("nan"), 7.0]), r"column num_prompt_tokens holds nan on row 1"),
        ("num_prompt_tokens", pa.array([5.0, 6.0, 40160.5]), r"column num_prompt_tokens holds 40160.5 on row 2"),
        ("num_prompt_tokens", pa.array([5, None, 7], pa.int64()), r"column num_prompt_tokens is empty on row 1"),
        ("request_id", pa.nulls(3, pa.string()), r"column request_id is empty on row 0 \(3 rows in all\)"),
        ("arrival_ns", pa.array(["0", "x", "2"]), r"column arrival_ns is string, which does not convert to int64"),
    ],
)
def test_a_fractional_nan_or_empty_cell_is_refused_naming_the_file_column_and_row(name, values, message):
    table = _with_column(make_workload([0, 1, 2], [5, 6, 7], [1, 1, 1]), name, values)
    with pytest.raises(ReplayError, match=r"^w\.parquet: " + message):
        TableWorkload(table, name="w.parquet")


def test_a_whole_float_column_is_taken_as_integers():
    table = _with_column(make_workload([0, 1, 2], [5, 6, 7], [1, 1, 1]), "num_prompt_tokens", pa.array([5.0, 6.0, 7.0]))
    assert TableWorkload(table).table["num_prompt_tokens"].to_pylist() == [5, 6, 7]


def test_an_overlong_label_is_refused_before_the_replay_copies_it():
    from replay.workload import MAX_LABEL_CHARS

    ok = "t" * MAX_LABEL_CHARS
    TableWorkload(make_workload([0, 1], [5, 5], [1, 1], tenant=[ok, ok]))
    with pytest.raises(ReplayError, match=r"w: column tenant on row 1 is 1,000,000 characters long, more than the 256"):
        TableWorkload(make_workload([0, 1], [5, 5], [1, 1], tenant=["a", "x" * 1_000_000]), name="w")
    with pytest.raises(ReplayError, match=r"column service_class on row 0 is 257 characters"):
        TableWorkload(make_workload([0], [5], [1], service_class=["c" * 257]))


def test_an_empty_workload_is_refused():
    with pytest.raises(ReplayError, match=r"^w\.parquet holds no requests"):
        TableWorkload(make_workload([], [], []), name="w.parquet")


def test_a_workload_spanning_more_than_the_longest_span_is_refused():
    from replay.presets import MAX_SPAN_S

    TableWorkload(make_workload([0, int(MAX_SPAN_S * 1e9)], [5, 5], [1, 1]))
    with pytest.raises(ReplayError, match=r"arrivals span 4,611,686,018 s \(rows 0 to 1\), more than the 1e\+09 s"):
        TableWorkload(make_workload([0, 2**62], [5, 5], [1, 1]))
