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
    with pytest.raises(ReplayError, match="experiments.csv: no column 'gpu'"):
        read_experiments(folder)
    (folder / "experiments.csv").write_text(header + "\n" + first + "\n")
    (folder / "stages.csv").write_text("id,stage_index,e2e_mean_ms\n17,first,1.0\n")
    with pytest.raises(ReplayError, match="stages.csv line 2: stage_index 'first' is not a whole number"):
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


# ---------------------------------------------------------------------------------------------- a folder of one's own

HEADER = ("id", "model", "gpu", "tp", "precision", "max_num_seqs", "max_num_batched_tokens", "total_kv_blocks",
          "cpu_kv_blocks", "profile", "has_measurements", "e2e_mean_ms", "ttft_mean_ms", "derived_mean_output_tokens")
ROW = {"id": "63", "model": "llama-3-8b", "gpu": "H100", "tp": "1", "precision": "FP16", "max_num_seqs": "128",
       "max_num_batched_tokens": "2048", "total_kv_blocks": "20000", "cpu_kv_blocks": "0", "profile": "tiny",
       "has_measurements": "yes", "e2e_mean_ms": "5000", "ttft_mean_ms": "60", "derived_mean_output_tokens": "247"}
TWO_STAGES = ("load: {stages: [{rate: 1, duration: 10}, {rate: 2, duration: 10}]}\n"
              "data: {type: shared_prefix, num_unique_system_prompts: 2, num_users_per_system_prompt: 2, "
              "system_prompt_len: 100, question_len: 400, output_len: 247}\n")


def _folder(tmp_path, *rows, stages=None):
    """A fidelity folder: experiments.csv of ``rows`` (ROW's columns; a list: the cells as given), a two-stage
    workload ``tiny`` and, given, stages.csv."""
    import csv

    folder = tmp_path / "fidelity"
    (folder / "workloads").mkdir(parents=True, exist_ok=True)
    (folder / "workloads" / "tiny.yaml").write_text(TWO_STAGES)
    with (folder / "experiments.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        writer.writerows(r if isinstance(r, list) else [r.get(c, "") for c in HEADER] for r in rows or (ROW,))
    if stages is not None:
        (folder / "stages.csv").write_bytes(stages if isinstance(stages, bytes) else stages.encode())
    return folder


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("tp", "abc", "tp 'abc' is not a whole number"),  # was 'row 63: unreadable (invalid literal for int()...)'
        ("tp", "1.5", "tp '1.5' is not a whole number"),
        ("max_num_seqs", "abc", "max_num_seqs 'abc' is not a whole number"),
        ("total_kv_blocks", "abc", "total_kv_blocks 'abc' is not a whole number"),
        ("cpu_kv_blocks", "1.5", "cpu_kv_blocks '1.5' is not a whole number"),
        ("e2e_mean_ms", "abc", "e2e_mean_ms 'abc' is not a number"),
        ("derived_mean_output_tokens", "many", "derived_mean_output_tokens 'many' is not a number"),
        ("tp", "", "the tp column is empty"),
        ("gpu", "", "the gpu column is empty"),  # was "unknown accelerator 'x1'", a name nobody wrote
        ("gpu", "TPU9", "gpu 'TPU9' is not an accelerator the replay knows"),
        ("model", " ", "the model column is empty"),
        ("precision", "INT3", "precision 'INT3' is not one the replay models"),  # was replayed as FP16
        ("precision", "", "the precision column is empty"),
        ("has_measurements", "maybe", "has_measurements 'maybe' is not yes or no"),  # was skipped as a no
        ("e2e_mean_ms", "", None),  # with ttft_mean_ms also emptied below: a measured run without a latency
    ],
)
def test_a_cell_the_replay_reads_is_checked_and_named_with_the_file_and_the_run(tmp_path, column, value, message):
    from replay.errors import ReplayError

    row = {**ROW, column: value}
    if message is None:
        row["ttft_mean_ms"] = ""
        message = "has_measurements is yes, but no _ms column has a latency"  # was an internal error in the report
    folder = _folder(tmp_path, row)
    with pytest.raises(ReplayError, match=re.escape(f"{folder / 'experiments.csv'} row 63: {message}")) as err:
        read_experiments(folder)
    assert err.value.hint and "Traceback" not in str(err.value)


def test_the_known_labels_and_precisions_are_read(tmp_path):
    from replay.fidelity import PRECISIONS

    assert PRECISIONS == ("FP16", "FP8")
    folder = _folder(tmp_path, {**ROW, "precision": "fp8", "gpu": "a100-80g"}, {**ROW, "id": "64", "gpu": "L40S"})
    first, second = read_experiments(folder)
    assert (first.precision, first.accelerator, second.accelerator) == ("FP8", "a100-80g", "l40s")
    # a folder without stages.csv is fine (it is optional), so is a run without a row there
    assert first.recorded_stages == () and first.recorded_s == {"e2e_mean": 5.0, "ttft_mean": 0.06}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "experiments.csv is empty"),  # all three were 'unknown experiment(s) 63' with an empty list of runs
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "experiments.csv is not a CSV file: not UTF-8 text (byte 0)"),
        (",".join(HEADER).encode() + b"\n", "experiments.csv has a header but no rows"),
        (",".join(HEADER).encode() + b"\n" + ",".join(ROW[c] if c != "has_measurements" else "no" for c in HEADER).encode(),
         "experiments.csv records no measured run (no row has has_measurements yes)"),
        (b"id,model,gpu,tp,max_num_seqs,max_num_batched_tokens,profile\n63,m,H100,1,1,1,tiny\n",
         "experiments.csv: no column of the metrics (e2e_mean_ms"),
        (b"id,id,model,gpu,tp,max_num_seqs,max_num_batched_tokens,profile,e2e_mean_ms\n",
         "experiments.csv: the header gives column 'id' twice"),
    ],
)
def test_an_experiments_table_without_runs_says_so_naming_the_file(tmp_path, content, message):
    from replay.errors import ReplayError

    folder = _folder(tmp_path)
    (folder / "experiments.csv").write_bytes(content)
    with pytest.raises(ReplayError, match=re.escape(f"{folder / message}")) as err:
        read_experiments(folder)
    assert err.value.hint


def test_a_duplicate_id_and_a_ragged_row_are_refused_by_line(tmp_path):
    from replay.errors import ReplayError

    folder = _folder(tmp_path, ROW, {**ROW, "tp": "2"})
    with pytest.raises(ReplayError, match=re.escape(f"{folder / 'experiments.csv'} line 3: id '63' is given twice "
                                                    "(also line 2)")):
        read_experiments(folder)  # the second row silently replaced the first in the report
    longer = [ROW[c] for c in HEADER] + ["extra"]
    _folder(tmp_path, longer)
    with pytest.raises(ReplayError, match=re.escape("experiments.csv line 2 (id '63'): 15 cells, but the header has 14")):
        read_experiments(folder)
    _folder(tmp_path, [ROW[c] for c in HEADER][:-3])
    with pytest.raises(ReplayError, match=re.escape("experiments.csv line 2 (id '63'): 11 cells, but the header has 14")):
        read_experiments(folder)


METRIC_HEADER = "id,stage_index,e2e_mean_ms,ttft_mean_ms\n"


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (b"", "stages.csv is empty"),  # all of these were read as 'no stages'
        (b"\xff\xfe\x00garbage", "stages.csv is not a CSV file: not UTF-8 text (byte 0)"),
        (METRIC_HEADER, "stages.csv has a header but no rows"),
        ("id,stage_index,stage_rate_rps\n63,0,1\n63,1,2\n", "stages.csv: no column of the metrics (e2e_mean_ms"),
        ("id,e2e_mean_ms\n63,1\n", "stages.csv: no column 'stage_index'"),
        (METRIC_HEADER + "63,0,5000,60\n63,7,5000,60\n",  # was dropped: the replay has no stage 7 to compare
         "stages.csv line 3: stage_index 7 of run 63, whose workload"),
        (METRIC_HEADER + "63,0,5000,60\n63,0,4000,50\n", "stages.csv line 3: run '63' stage_index 0 is given twice"),
        (METRIC_HEADER + "63,-2,5000,60\n", "stages.csv line 2: stage_index -2 is not a stage"),
        (METRIC_HEADER + "63,0,5000\n", "stages.csv line 2 (id '63'): 3 cells, but the header has 4"),
        (METRIC_HEADER + "63,0,5000,abc\n", "stages.csv line 2: ttft_mean_ms 'abc' is not a number"),
    ],
)
def test_a_stages_table_that_is_there_but_broken_is_an_error(tmp_path, stages, message):
    from replay.errors import ReplayError

    folder = _folder(tmp_path, stages=stages)
    with pytest.raises(ReplayError, match=re.escape(f"{folder / message}")) as err:
        read_experiments(folder)
    assert err.value.hint


def test_a_run_s_stages_are_read_when_its_workload_has_them(tmp_path):
    folder = _folder(tmp_path, stages=METRIC_HEADER + "63,-1,5000,60\n63,1,5500,70\n63,0,4500,50\n")
    (exp,) = read_experiments(folder)
    assert exp.recorded_stages == ((0, (("e2e_mean", 4.5), ("ttft_mean", 0.05))),
                                   (1, (("e2e_mean", 5.5), ("ttft_mean", 0.07))))


def test_an_unknown_model_or_a_missing_workload_names_the_run(tmp_path):
    from replay.fidelity import experiment_instance, experiment_spec
    from servelens.errors import ConfigError

    folder = _folder(tmp_path, {**ROW, "model": "gpt-5"})
    (exp,) = read_experiments(folder)
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'experiments.csv'} row 63: unknown model 'gpt-5'")):
        experiment_instance(exp, None)
    (folder / "workloads" / "tiny.yaml").unlink()
    with pytest.raises(ConfigError, match=re.escape(f"row 63 (profile 'tiny'): inference-perf config "
                                                    f"{folder / 'workloads' / 'tiny.yaml'} does not exist")):
        experiment_spec(exp)


def test_a_models_table_in_the_folder_is_the_one_its_runs_are_looked_up_in(shared, tmp_path):
    """A fidelity folder of one's own may bring its own models.csv (before, it was silently ignored)."""
    import csv

    from replay.catalog import MODELS_CSV
    from replay.fidelity import experiment_instance
    from servelens.errors import ConfigError

    with (shared / MODELS_CSV).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    mine = {**next(r for r in rows if r["model"] == "meta-llama/Llama-3.1-8B-Instruct"), "model": "mine/llama-8b"}
    (exp,) = read_experiments(_folder(tmp_path, {**ROW, "model": "mine/llama-8b"}))
    with pytest.raises(ConfigError, match="row 63: unknown model 'mine/llama-8b'"):
        experiment_instance(exp, shared)  # not in the shared table
    with (exp.source.parent / "models.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(mine))
        writer.writeheader()
        writer.writerow(mine)
    instance = experiment_instance(exp, shared)
    assert instance.model.name == "mine/llama-8b" and instance.model.num_kv_heads == 8 and instance.model.num_layers == 32
    (exp.source.parent / "models.csv").write_text("name,num_layers\nx,2\n")
    with pytest.raises(ConfigError, match=re.escape(f"{exp.source.parent / 'models.csv'}: no column 'model'")):
        experiment_instance(exp, shared)
