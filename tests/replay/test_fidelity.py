"""Fidelity experiments as inference-perf ran them: every request generates its max_tokens (ignore_eos), and the
recorded ITL is over the output tokens the client counted by tokenizing the streamed text again."""

from __future__ import annotations

import re

import numpy as np
import pytest

from replay.fidelity import FIDELITY_DIR, experiment_workload, output_count_ratio, read_experiments, stage_errors
from replay.fit import EngineSample, Target


def _experiment(shared, exp_id):
    return next(e for e in read_experiments(shared / FIDELITY_DIR) if e.id == exp_id)


def test_requests_generate_the_spec_length_and_the_client_counts_fewer(shared):
    exp = _experiment(shared, "20260217-155451")  # Llama-2-7B codegen: 195.1 tokens counted, 247 asked for
    workload = experiment_workload(exp, seed=0, max_stage_s=60.0)
    assert set(workload["num_output_tokens"].to_numpy()) == {247}  # codegen.yaml's output_len, every request
    assert output_count_ratio(exp) == pytest.approx(195.1 / 247)  # 0.7899, by hand
    assert Target.of_experiment(exp, shared).output_count_ratio == pytest.approx(195.1 / 247)


def test_the_replay_s_itl_divides_by_the_tokens_the_client_counted():
    sample = EngineSample(ttft_s=np.array([0.1, 0.1]), e2e_s=np.array([2.1, 2.1]), num_output_tokens=np.array([201.0, 201.0]),
                          num_prompt_tokens=np.array([500.0, 500.0]), jitter=np.zeros(2), stage=np.zeros(2, dtype=int),
                          client_side=False, output_count_ratio=0.5)
    figures = sample.metrics((0.0, 0.0, 0.0))
    # 201 generated, 100.5 counted: ITL = (2.1 - 0.1) / (100.5 - 1) = 0.0201005 s (the engine's 2 / 200 = 0.01)
    assert figures["itl_mean"] == pytest.approx(2.0 / 99.5)
    assert figures["e2e_mean"] == pytest.approx(2.1) and figures["ttft_p99"] == pytest.approx(0.1)


def test_stage_errors_compare_each_stage_both_sides_have():
    recorded = ((0, (("ttft_mean", 0.100), ("ttft_p99", 0.200))), (1, (("ttft_mean", 0.050),)))
    errors = stage_errors("x", recorded, {0: {"ttft_mean": 0.110, "ttft_p99": 0.150, "e2e_mean": 3.0}})
    # stage 1 was not replayed; e2e_mean was not recorded: neither is compared
    assert [(i, e.metric) for i, e in errors] == [(0, "ttft_mean"), (0, "ttft_p99")]
    assert errors[0][1].signed_pct == pytest.approx(10.0) and errors[1][1].signed_pct == pytest.approx(-25.0)


def test_a_fidelity_folder_with_a_column_missing_or_a_cell_unreadable_names_it(shared, tmp_path):
    from replay.errors import ReplayError

    source = shared / FIDELITY_DIR
    folder = tmp_path / "fidelity"
    folder.mkdir()
    header, first = (source / "experiments.csv").read_text().splitlines()[:2]
    (folder / "experiments.csv").write_text(header.replace(",gpu,", ",accelerator,") + "\n" + first + "\n")
    with pytest.raises(ReplayError, match="experiments.csv row 17: no column 'gpu'"):
        read_experiments(folder)
    (folder / "experiments.csv").write_text(header + "\n" + first + "\n")
    (folder / "stages.csv").write_text("id,stage_index,e2e_mean_ms\n17,first,1.0\n")
    with pytest.raises(ReplayError, match="stages.csv line 2: unreadable"):
        read_experiments(folder)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("e2e_mean_ms", "nan", "e2e_mean_ms 'nan' is not a measured latency"),  # reported as 'nan%' before
        ("e2e_mean_ms", "-5", "e2e_mean_ms '-5' is not a measured latency"),  # reported as a 92,404% error
        ("ttft_p99_ms", "1e308", "ttft_p99_ms '1e308' is not a measured latency"),
        ("itl_mean_ms", "0", "itl_mean_ms '0' is not a measured latency"),
        ("max_num_seqs", "0", "max_num_seqs must be at least 1, not 0"),  # an EngineConfig field's name before
        ("total_kv_blocks", "-1", "total_kv_blocks must be at least 1, not -1"),
        ("cpu_kv_blocks", "-2", "cpu_kv_blocks must be at least 0, not -2"),
        ("max_num_batched_tokens", "8", "max_num_batched_tokens 8 is below max_num_seqs 128"),  # replayed before
        ("derived_mean_output_tokens", "0", "derived_mean_output_tokens 0.0 is not a mean output length"),
    ],
)
def test_a_recorded_run_with_a_latency_or_a_setting_no_real_run_has_is_named(shared, tmp_path, column, value, message):
    import csv

    from replay.errors import ReplayError

    with (shared / FIDELITY_DIR / "experiments.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    row = next(r for r in rows if r["id"] == "60")
    assert row[column]  # the cell is filled in the real data (so the test changes a real value)
    row[column] = value
    folder = tmp_path / "fidelity"
    folder.mkdir()
    with (folder / "experiments.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(ReplayError, match=f"experiments.csv row 60: {re.escape(message)}") as err:
        read_experiments(folder)
    assert err.value.hint


def test_a_stage_latency_no_real_run_has_is_named_by_its_line(shared, tmp_path):
    from replay.errors import ReplayError

    folder = tmp_path / "fidelity"
    folder.mkdir()
    (folder / "experiments.csv").write_text((shared / FIDELITY_DIR / "experiments.csv").read_text())
    (folder / "stages.csv").write_text("id,stage_index,e2e_mean_ms\n60,0,1.0\n60,1,-3\n")
    with pytest.raises(ReplayError, match=r"stages.csv line 3: e2e_mean_ms '-3' is not a measured latency"):
        read_experiments(folder)
