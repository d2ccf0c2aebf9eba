"""The gate-power benchmark's figures from trial outcomes of known counts (no replays): the rates per
design and run length, the headline figures the targets are read on, and ``--merge`` of runs made
one design at a time giving what one run of both designs gives."""

from __future__ import annotations

import pytest

from benchmarks.gate_power import EFFECTS, figures_of, merge, render_table

MIN_WINDOWS = 30


def _rows(design: str, windows: int, statuses: list[str], effect_status: str | None = None) -> list[dict]:
    """One row per trial at one length; with ``effect_status``, every injected effect on it too."""
    rows = []
    for trial, status in enumerate(statuses):
        held = ["ttft_p99_s"] if status == "inconclusive" else []
        rows.append({"design": design, "trial": trial, "windows": windows, "effect": "none", "status": status,
                     "held_by": held, "measured": None})
        for effect in EFFECTS if effect_status else ():
            rows.append({"design": design, "trial": trial, "windows": windows, "effect": effect,
                         "status": effect_status, "held_by": [], "measured": 0.5})
    return rows


SEED = _rows("seed", 30, ["pass"] * 4, "fail") + _rows("seed", 45, ["pass"] * 4)
# split: at 30 windows 3 of 4 pass, one held by TTFT p99; every effect fails; at 45, 4 of 4 pass
SPLIT = _rows("split", 30, ["pass", "pass", "inconclusive", "pass"], "fail") + _rows("split", 45, ["pass"] * 4)
LENGTHS = {"seed": (30, 45), "split": (30, 45)}


def _run(rows: list[dict], lengths: dict, seconds: float) -> dict:
    return figures_of(rows, dict.fromkeys(lengths, 4), lengths, MIN_WINDOWS, seconds)


def test_the_figures_count_each_design_and_length_and_read_the_targets_on_the_worst():
    figures = _run(SEED + SPLIT, LENGTHS, 10.0)
    assert figures["aa_pass_rate_by_windows"] == {"seed": {"30": 1.0, "45": 1.0}, "split": {"30": 0.75, "45": 1.0}}
    assert figures["aa_inconclusive_held_by"] == {"seed": {}, "split": {"ttft_p99_s": 1}}
    assert figures["aa_false_fail_rate"] == 0.0
    assert figures["aa_pass_rate_min"] == 0.75  # the split at 30 windows: below 90%
    assert figures["targets_met"]["aa_pass_at_least_90pct"] is False
    assert figures["detection_rate"] == dict.fromkeys(EFFECTS, 1.0)
    assert figures["detection_rate_by_windows"]["itl_x2"] == {"seed": {"30": 1.0, "45": None}, "split": {"30": 1.0, "45": None}}


def test_runs_of_one_design_each_merge_into_the_figures_of_one_run_of_both():
    both = _run(SEED + SPLIT, LENGTHS, 10.0)
    merged = merge([_run(SEED, {"seed": (30, 45)}, 4.0), _run(SPLIT, {"split": (30, 45)}, 6.0)])
    for key, value in both.items():
        if key != "runs":
            assert merged[key] == value, key
    assert merged["runs"] == [{"designs": ["seed"], "seconds": 4.0}, {"designs": ["split"], "seconds": 6.0}]


def test_the_table_has_a_column_per_design_and_length_and_names_what_held_the_runs():
    table = render_table(merge([_run(SEED, {"seed": (30, 45)}, 4.0), _run(SPLIT, {"split": (30,)}, 6.0)]))
    lines = table.splitlines()
    assert lines[0] == "| | seed, 30 windows | seed, 45 windows | split, 30 windows |"
    assert lines[3] == "| A/A: PASS | 100% | 100% | 75.0% |"
    assert "| itl_x2 (critical-size; bad effect read +50.0%): FAIL | 100% | n/a | 100% |" in lines
    assert lines[-1].startswith("seed: 4 trials, 4 s; split: 4 trials, 6 s.")
    assert lines[-1].endswith("seed: none; split: ttft_p99_s (1).")


def test_runs_judged_under_other_evidence_minimums_are_not_merged():
    other = _run(SPLIT, {"split": (30, 45)}, 6.0) | {"min_windows": 20}
    with pytest.raises(SystemExit, match="same engine, trace and min_windows"):
        merge([_run(SEED, {"seed": (30, 45)}, 4.0), other])
