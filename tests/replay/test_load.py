"""A run's load against the load its calibration was fitted on (``replay.load``): known answers on step events
written by hand, the same figures from a replay's sink and from its events file, and what the manifest, the
gate report and the command line say about a replay beyond its calibration's fitted runs."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.calibration import Calibration, calibration_from_json, default_calibration, load_calibration, write_calibration
from replay.config import EngineConfig, FrontendConfig, instance_config
from replay.costmodel import RooflineConfig
from replay.gate import Run, calibration_errors
from replay.load import Load, StepLoadMeter, describe_load, load_record, windows_beyond
from replay.run import run_replay
from replay.traces import read_trace
from servelens.errors import ConfigError
from tests.servelens.test_cli import servelens

S = 1_000_000_000


def _steps(rows: list[tuple]) -> pa.Table:
    """step_executed rows (instance, start s, end s, decode seqs, KV used, KV free) among other events."""
    names = ("instance_id", "start_ns", "end_ns", "num_decode_seqs", "num_kv_blocks_used", "num_kv_blocks_free")
    columns = list(zip(*rows))
    table = {n: pa.array([round(v * S) if n.endswith("_ns") else v for v in c], pa.string() if n == "instance_id" else pa.int64())
             for n, c in zip(names, columns)}
    table["event_type"] = pa.array(["step_executed"] * len(rows))
    other = {n: pa.nulls(1, table[n].type) for n in names}
    other["event_type"] = pa.array(["request_arrived"])
    return pa.concat_tables([pa.table(table), pa.table(other)])


def test_each_window_is_weighted_by_busy_time_and_the_busiest_is_the_load():
    """By hand: instance a, minute 0: 1 s at 10 of 100 sequences and 2 s at 40 -> (10 + 80) / 3 = 30%; KV 10 of
    100 blocks, then 50 of 100 -> (0.1 + 1.0) / 3 = 36.7%. Minute 1: 100 of 100, a pool of no blocks (counted
    0). Instance b (a cap of 50): 1 s at 25 -> 50%, KV unrecorded (null: 0)."""
    caps = {"a": 100, "b": 50}
    meter = StepLoadMeter()
    meter(_steps([("a", 0, 1, 10, 10, 90), ("a", 61, 62, 100, 0, 0)]))  # chunk by chunk: minute 0 in two
    meter.add(_steps([("b", 5, 6, 25, None, None), ("a", 1, 3, 40, 50, 50)]))
    windows = meter.windows(caps).to_pylist()
    assert [(w["instance_id"], w["window_start_ns"] // S, w["busy_s"]) for w in windows] == [
        ("a", 0, 3.0), ("b", 0, 1.0), ("a", 60, 1.0)]
    assert [w["batch_share"] for w in windows] == pytest.approx([0.3, 0.5, 1.0])
    assert [w["kv_share"] for w in windows] == pytest.approx([1.1 / 3, 0.0, 0.0])
    assert [w["batch_seqs"] for w in windows] == pytest.approx([30.0, 25.0, 100.0])  # the same, in sequences
    assert meter.load(caps) == Load(pytest.approx(1.0), pytest.approx(1.1 / 3), pytest.approx(100.0))
    assert meter.windows(1)["batch_share"].to_pylist() == pytest.approx([30.0, 25.0, 100.0])  # one cap for all
    table = meter.windows(caps)
    assert windows_beyond(table, Load(0.6, 0.5)) == 1  # minute 1 of a
    assert windows_beyond(table, Load(0.6, 0.3)) == 2  # and a's minute 0 by its KV
    assert windows_beyond(table, Load(0.995, 0.36)) == 0  # within the margin of a point
    record = load_record(table, Load(0.6, 0.5))
    assert record == {"window_s": 60.0, "busy_windows": 3, "batch_share": 1.0, "kv_share": 0.3667, "batch_seqs": 100.0,
                      "fitted": {"batch_share": 0.6, "kv_share": 0.5}, "windows_beyond_fitted": 1}
    line, beyond = describe_load(record)
    assert beyond and line.startswith("load: busiest minute 100% of max_num_seqs decoding (100 sequences), 37% of the KV")
    assert "beyond the calibration's fitted runs (up to 60% and 50%) in 1 of 3 busy minutes" in line
    assert describe_load(load_record(table, None)) == (line.split(";")[0], False)
    assert StepLoadMeter().load(8) == Load(0.0, 0.0)  # no steps: no load
    # a fitted batch in sequences: a window decoding more sequences than any fitted run is beyond it, however
    # small a share of its own cap (by hand: 25 sequences of b's 50 and 30 of a's 100 are within 29 + 1)
    assert windows_beyond(table, Load(1.0, 1.0, 29.0)) == 1  # a's minute 1: 100 sequences
    assert windows_beyond(table, Load(1.0, 1.0, 28.9)) == 2  # and a's minute 0: 30 sequences
    assert describe_load(load_record(table, Load(1.0, 1.0, 29.0)))[0].endswith(
        "beyond the calibration's fitted runs (up to 100%, 29 sequences and 100%) in 1 of 3 busy minutes: an "
        "extrapolation, where errors can be several times the held-out figures (docs/calibration.md)")


def test_a_large_cap_does_not_hide_a_batch_beyond_the_fitted_runs():
    """vllm serve's 1024 seats on an H100: 123 sequences are 12% of the cap, far within the fitted runs' 59% of
    128, but beyond their 75 sequences; a file without the batch in sequences judges by the shares alone."""
    fitted = Load(0.59, 0.44, 75.0)
    assert Load(0.12, 0.08, 123.0).beyond(fitted) and not Load(0.5, 0.2, 76.0).beyond(fitted)
    assert not Load(0.12, 0.08, 123.0).beyond(Load(0.59, 0.44))
    assert Load.of_json(fitted.as_json()) == fitted and Load.of_json({"batch_share": 0.5, "kv_share": 0.1}) == Load(0.5, 0.1)


def test_a_replay_records_its_load_from_its_events_as_a_sink_sees_it(tmp_path, shared):
    """The manifest's load (the event writer's meter) equals what a sink handed the same replay's events
    measures and what its events file gives, added back as recorded events are; a calibration's fitted load
    is recorded beside it, with the minutes beyond."""
    workload = read_trace("azure-conv", shared).slice(0, 1500)
    instance = instance_config("llama-3-8b", "h100-sxm", engine=EngineConfig(max_num_seqs=8))
    fitted = Load(0.25, 0.9)
    cal = Calibration(name="c", engine="vLLM", accelerators=("h100-sxm",), roofline=RooflineConfig(),
                      frontend=FrontendConfig(), fitted_load=fitted)
    meter, recorded = StepLoadMeter(), StepLoadMeter()
    summary = run_replay(workload, instance=instance, out_dir=tmp_path, sink=meter, calibration=cal)
    record = json.loads(summary.manifest_path.read_text())["load"]
    recorded.add(pq.read_table(summary.events_path))  # as recorded events are added
    windows = recorded.windows(8)
    assert meter.windows(8).equals(windows)
    assert record == load_record(windows, fitted)
    assert 0.25 < record["batch_share"] <= 1.0 and 0 < record["windows_beyond_fitted"] <= record["busy_windows"]


def test_a_calibration_keeps_its_fitted_load_and_the_shipped_one_holds_its_fitted_runs(tmp_path):
    cal = Calibration(name="c", engine="vLLM", accelerators=("h100-sxm",), roofline=RooflineConfig(),
                      frontend=FrontendConfig(), fitted_load=Load(0.5, 0.25))
    assert load_calibration(write_calibration(cal, tmp_path / "c.json")) == cal
    older = dataclasses.replace(cal, fitted_load=None)  # a file written before the field: no envelope, no claims
    assert load_calibration(write_calibration(older, tmp_path / "old.json")).fitted_load is None
    doc = cal.as_json()
    doc["fitted_load"] = {"batch_share": "most"}
    with pytest.raises(ConfigError, match="fitted_load.batch_share has value 'most'"):
        calibration_from_json(doc)
    shipped = default_calibration()
    assert shipped is not None and shipped.fitted_load is not None
    assert 0 < shipped.fitted_load.batch_share < 1 and 0 < shipped.fitted_load.kv_share < 1


def test_a_calibration_notes_which_held_out_runs_went_beyond_their_fold_s_fitted_load():
    """By hand: three folds, one held-out run beyond its fold's fitted load (by its KV share) with E2E mean off by
    20%, two within off by 2% and 4%: the note names it and the medians, 20% against 3%."""
    from replay.calibrate import _beyond_note
    from replay.fit import FitResult, HeldOut, Target

    fit = FitResult(RooflineConfig(), (0.0, 0.0, 0.0), (), (), 0)

    def fold(name: str, replayed: float, load: Load) -> HeldOut:
        target = Target(name, (("e2e_mean", 1.0),), instance_config())
        return HeldOut(target, fit, {"e2e_mean": replayed}, load, Load(0.5, 0.4))

    folds = [fold("a", 1.02, Load(0.3, 0.1)), fold("b", 1.2, Load(0.3, 0.45)), fold("c", 0.96, Load(0.5, 0.4))]
    assert [f.beyond_fitted_load for f in folds] == [False, True, False]  # c sits on the envelope: within
    assert _beyond_note(folds) == ["leave-one-out: 1 of 3 held-out runs went beyond their fold's fitted load (b): "
                                   "median absolute E2E mean error 20.0%, against 3.0% for the others"]
    assert _beyond_note(folds[::2]) == ["leave-one-out: none of the 2 held-out runs went beyond its fold's fitted load"]
    assert _beyond_note([]) == []


@pytest.mark.slow
def test_the_shipped_fitted_load_is_its_fitted_runs_busiest_minute():
    """The shipped calibration's fitted load is recomputed as ``calibrate_experiments`` computes it: each fitted
    run replayed with the calibration, the largest busiest-minute shares among them (to the rounding)."""
    from benchmarks.fidelity import _targets
    from replay.fit import replay_target

    cal = default_calibration()
    assert cal is not None and cal.fitted_load is not None
    loads = []
    for target in _targets():
        meter = StepLoadMeter()
        replay_target(target, cal, 0, meter)
        loads.append(meter.load(target.instance_config.engine.max_num_seqs))
        assert not loads[-1].beyond(cal.fitted_load), target.name  # no fitted run is beyond its own envelope
    peak, fitted = Load.peak(loads), cal.fitted_load
    assert (peak.batch_share, peak.kv_share) == pytest.approx((fitted.batch_share, fitted.kv_share), abs=1e-4)
    assert peak.batch_seqs == pytest.approx(fitted.batch_seqs, abs=0.05)


def test_the_gate_and_the_command_line_say_when_a_replay_is_beyond_its_calibration(tmp_path, shared):
    """A replay whose batch sits at its cap (8 sequences) is beyond the shipped calibration's fitted runs: the
    command line warns, and the gate report says so for each side; a light one says nothing of the kind."""
    heavy, light = tmp_path / "heavy", tmp_path / "light"
    env = {"SERVELENS_SHARED_DIR": str(shared)}
    done = servelens("replay", "--workload", "azure-conv", "--requests", "1500", "--max-num-seqs", "8", "--out", str(heavy),
                     env=env)
    assert done.returncode == 0, done.stderr
    assert "warning: load: busiest minute" in done.stderr and "beyond the calibration's fitted runs" in done.stderr
    calm = servelens("replay", "--workload", "azure-conv", "--requests", "1500", "--out", str(light), env=env)
    assert calm.returncode == 0, calm.stderr
    assert "load: busiest minute" in calm.stdout and "beyond" not in calm.stdout + calm.stderr
    runs = [Run(label, pa.table({}), None, str(path), str(path / "manifest.json"), None)
            for label, path in (("baseline", light), ("candidate", heavy))]
    _, lines = calibration_errors(*runs)
    beyond = [line for line in lines if "beyond the calibration's fitted runs" in line]
    assert len(beyond) == 1 and beyond[0].startswith("candidate replay load: busiest minute")
