"""Replay runs (the load-factor rule, cached metrics equal to the gate's) and gate reports."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from dashboard import runs
from replay.derive import derive_requests
from replay.gate import STEP_COLUMNS, load_config
from replay.metrics import run_metrics


@pytest.mark.parametrize(("manifest", "factor"), [
    ({"workload": {"name": "azure-conv", "load_factor": 1.5}}, 1.5),
    ({"workload": {"name": "azure-conv@2x", "load_factor": 3}}, 3.0),  # the field wins over the name
    ({"workload": {"name": "azure-conv@2x"}}, 2.0),
    ({"workload": {"name": "azure-conv@1.5x"}}, 1.5),
    ({"workload": {"name": "traces/my@0.5x"}}, 0.5),
    ({"workload": {"name": "azure-conv"}}, 1.0),
    ({"workload": {"name": "azure-conv@2x.parquet"}}, 1.0),  # only a suffix counts
    ({"workload": {"name": "a@x"}}, 1.0),
    ({"workload": {"name": "azure-conv@2x", "load_factor": -1}}, 2.0),  # nonsense is ignored
    ({"workload": {"name": "azure-conv", "load_factor": True}}, 1.0),
    ({"workload": "not a mapping"}, 1.0),
    ({}, 1.0),
])
def test_load_factor_field_then_name_suffix_then_one(manifest, factor):
    assert runs.load_factor(manifest) == factor


def test_runs_are_listed_from_their_folders_with_what_their_manifests_say(sample, tmp_path):
    listed = runs.list_runs(sample.settings.dashboard.runs_dir)
    assert [r.name for r in listed] == ["fcfs", "fcfs-chunk256", "fcfs@1.5x", "fcfs@2x"]
    by_name = {r.name: r for r in listed}
    assert by_name["fcfs@2x"].load_factor == 2.0 and by_name["fcfs"].load_factor == 1.0
    assert {r.policy for r in listed} == {"fcfs"} and by_name["fcfs"].engine == "llama-3-8b@h100-sxm"
    assert by_name["fcfs"].series == by_name["fcfs@2x"].series != by_name["fcfs-chunk256"].series
    assert by_name["fcfs"].scenario == "dashboard-sample" and by_name["fcfs"].num_requests == 400
    # a run without a manifest is still listed; a folder without events is not a run
    shutil.copytree(by_name["fcfs"].folder, tmp_path / "bare")
    (tmp_path / "bare" / "manifest.json").unlink()
    (tmp_path / "not-a-run").mkdir()
    (bare,) = runs.list_runs(tmp_path)
    assert bare.name == "bare" and bare.policy == "unknown" and bare.manifest_path is None and bare.load_factor == 1.0
    assert runs.list_runs(tmp_path / "missing") == ()


def test_run_metrics_are_the_gates_and_leaving_out_step_membership_changes_nothing(sample, tmp_path):
    run = {r.name: r for r in runs.list_runs(sample.settings.dashboard.runs_dir)}["fcfs@2x"]
    config = load_config(sample.root / "gate.yaml").metrics_config()
    values = runs.run_metric_values(run, tmp_path, config)
    steps = pq.read_table(run.events_path, columns=STEP_COLUMNS, filters=[("event_type", "==", "step_executed")])
    expected = [m for m in run_metrics(derive_requests(run.events_path), steps, config) if m.scope in ("overall", "class")]
    got = values.to_pylist()
    assert len(got) == len(expected)
    for row, m in zip(got, expected):
        assert (row["scope"], row["group"], row["name"], row["num_points"]) == (m.scope, m.group, m.name, m.num_points)
        assert row["value"] == pytest.approx(m.value, rel=1e-12) if m.value is not None else row["value"] is None
    assert runs.metric_value(values, "cost_per_1k_goodput_tokens") is not None
    assert runs.metric_value(values, "attainment", "interactive") is not None
    # cached: the second call reads the file written by the first
    cached = list((tmp_path / "runs").glob("*/metrics-*.parquet"))
    assert len(cached) == 1 and runs.run_metric_values(run, tmp_path, config).equals(values)


def test_the_comparison_table_has_a_row_per_run_and_every_policy_metric(sample, tmp_path):
    listed = runs.list_runs(sample.settings.dashboard.runs_dir)
    config = load_config(sample.root / "gate.yaml").metrics_config()
    values = tuple(runs.run_metric_values(r, tmp_path, config) for r in listed)
    table = runs.comparison_table(listed, values)
    assert table.num_rows == 4 and table["load_factor"].to_pylist() == [1.0, 1.0, 1.5, 2.0]
    assert all(table[name].null_count == 0 for name, _ in runs.POLICY_METRICS if name != "max_backlogged_service_gap")
    attainment = dict(zip(table["run"].to_pylist(), table["attainment"].to_pylist()))
    assert attainment["fcfs@2x"] < attainment["fcfs"]  # more load, fewer objectives met
    per_class = runs.comparison_table(listed, values, "interactive")
    assert per_class["goodput_rps"].to_pylist() != table["goodput_rps"].to_pylist()


def test_the_gate_report_is_read_whole_and_a_broken_one_is_an_error(sample, tmp_path):
    report = runs.read_gate_report(sample.settings.dashboard.gate_dir)
    raw = json.loads((sample.root / "gate" / "gate.json").read_text())
    assert report.status == raw["status"] and report.reasons == tuple(raw["reasons"])
    assert len(report.metrics) == len(raw["metrics"]) and len(report.report_files) == 3
    assert report.baseline_manifest.endswith("fcfs/manifest.json")
    tested = [m for m in report.metrics if m.mann_whitney_p is not None]
    assert tested and all(0 <= m.mann_whitney_p <= 1 for m in tested)
    judged = [m for m in report.metrics if m.effect is not None and m.effect_low is not None]
    assert judged and all(m.effect_low <= m.effect_high for m in judged)
    assert runs.gate_metrics_table(report).num_rows == len(report.metrics)
    assert report.headline == raw["headline"] and report.undecided == tuple(raw["undecided"])
    assert runs.gate_conditions_table(report).num_rows == len(raw["conditions"]) > 0
    by_name = {(m.metric, m.group): m for m in report.metrics}
    for m in raw["metrics"]:
        read = by_name[(m["metric"], m["group"])]
        assert (read.num_windows, read.num_windows_used, read.informative, read.undecided) == (
            m["difference"]["num_windows"], m["num_windows_used"], m["informative"], m["undecided"])
    assert runs.read_gate_report(tmp_path) is None
    (tmp_path / "gate.json").write_text('{"metrics": [1, 2]}')
    with pytest.raises(runs.GateReportError, match="is not a gate report"):
        runs.read_gate_report(tmp_path)
    (tmp_path / "gate.json").write_text('{"status": "<b>odd</b>", "metrics": []}')
    odd = runs.read_gate_report(tmp_path)
    assert odd.status == "unknown" and odd.headline == "UNKNOWN" and odd.conditions == ()  # a report of an older gate


def test_nightly_layouts_are_found_runs_by_day_and_load_reports_newest_first(sample, tmp_path):
    import os

    runs_dir, gate_dir = tmp_path / "replay", tmp_path / "gate"
    for name in ("fcfs", "fcfs@2x"):
        shutil.copytree(sample.root / "runs" / name, runs_dir / "2023-11-16" / name)
    shutil.copytree(sample.root / "runs" / "fcfs", runs_dir / "adhoc")
    listed = runs.list_runs(runs_dir)
    assert [r.name for r in listed] == ["2023-11-16/fcfs", "2023-11-16/fcfs@2x", "adhoc"]
    assert listed[1].load_factor == 2.0 and listed[1].folder == str(runs_dir / "2023-11-16" / "fcfs@2x")
    assert [r.name for r in runs.list_runs(runs_dir / "adhoc")] == ["adhoc"]  # a run folder given directly
    shutil.copytree(sample.root / "gate", gate_dir)  # `servelens gate --out out/gate`
    shutil.copytree(sample.root / "gate", gate_dir / "2023-11-16" / "fcfs-chunk256@1x")  # the nightly comparison
    os.utime(gate_dir / "gate.json", ns=(1, 1))
    refs = runs.list_gate_reports(gate_dir)
    assert [r.name for r in refs] == ["2023-11-16/fcfs-chunk256@1x", ""]
    assert runs.read_gate_report(refs[0].folder).status == runs.read_gate_report(gate_dir).status
    assert runs.list_gate_reports(tmp_path / "none") == ()
