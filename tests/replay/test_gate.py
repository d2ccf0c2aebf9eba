"""The gate end to end: known answers on synthetic request tables and on real replays, the model
error hook, the command's exit codes and its reports."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.compare import default_block_windows
from replay.gate import (
    FAIL,
    INCONCLUSIVE,
    MAX_CALIBRATION_ERROR,
    PASS,
    GateConfig,
    ModelError,
    Run,
    calibration_errors,
    compare_runs,
    config_yaml,
    decide,
    default_config,
    load_config,
)
from replay.judge import MODEL_ERROR, NOT_ENOUGH_DATA, failed_names
from replay.metrics import ClassObjectives
from tests.replay.gate_data import synthetic_requests

#: The defaults on 10 s windows: a synthetic run of 4,000 requests at 10/s holds 40 windows.
GATE = dataclasses.replace(default_config(), window_s=10.0)
MINUTE_NS = 60 * 1_000_000_000


def _run(label: str, **kw) -> Run:
    return Run(label, synthetic_requests(**kw), None, label, None, None)


def _by(verdict, metric: str, group: str = ""):
    (found,) = [m for m in verdict.metrics if m.metric == metric and m.group == group]
    return found


def test_identical_runs_pass():
    verdict = compare_runs(_run("b", seed=1), _run("c", seed=1), GATE)
    assert verdict.status == PASS and verdict.exit_code == 0 and verdict.score == 100
    assert all(c.status == PASS for c in verdict.conditions) and {c.group for c in verdict.conditions} == {"batch", "interactive"}


def test_a_thirty_percent_worse_ttft_in_one_class_fails_and_names_it():
    verdict = compare_runs(_run("b", seed=1), _run("c", seed=1, ttft_factor={"interactive": 1.3}), GATE)
    assert verdict.status == FAIL and verdict.exit_code == 1
    failed = _by(verdict, "ttft_p99_s", "interactive")
    assert failed.status == FAIL and failed.critical
    assert any(r.startswith("critical failure: ttft_p99_s (interactive)") for r in verdict.reasons)
    assert _by(verdict, "ttft_p99_s", "batch").status == PASS  # the other class is untouched
    assert failed_names(verdict)[0].startswith("ttft_")


def test_a_slower_decode_fails_the_run_on_itl_and_a_live_canary_rolls_back():
    """ITL was once a metric whose critical failure could not fail a run (+100% was 'inconclusive')."""
    verdict = compare_runs(_run("b", seed=4), _run("c", seed=4, itl_factor={"interactive": 2.0, "batch": 2.0}), GATE)
    itl = _by(verdict, "itl_p99_p99_s")
    assert itl.critical and itl.effect == pytest.approx(1.0, abs=0.03)
    assert verdict.status == FAIL and failed_names(verdict)[0].startswith(("itl_p99_p99_s", "tpot_p50_s"))
    assert decide(verdict, "policy=fcfs@v12").action == "rollback"


def test_winning_goodput_by_rejecting_a_fifth_of_requests_is_not_a_pass():
    """The baseline admits everything and misses TTFT for many; the candidate rejects 20% and meets
    TTFT for the rest: more goodput, but the rejections are judged and fail the run."""
    config = dataclasses.replace(GATE, classes=(ClassObjectives(name="default", ttft_s=0.3),), conditions=())
    baseline = _run("b", seed=2, ttft_median_s=0.3, classes=("default",))
    candidate = _run("c", seed=2, ttft_median_s=0.1, reject_share=0.2, classes=("default",))
    verdict = compare_runs(baseline, candidate, config)
    goodput = _by(verdict, "goodput_rps")
    assert goodput.difference.candidate > goodput.difference.baseline and goodput.status == PASS
    assert verdict.status == FAIL
    assert _by(verdict, "rejected_share").status == FAIL
    assert any(r.startswith("critical failure: rejected_share") for r in verdict.reasons)


def test_too_few_requests_or_windows_is_not_enough_data_with_the_time_it_would_take():
    tiny = compare_runs(_run("b", num_requests=10), _run("c", num_requests=10, seed=3), GATE)
    assert tiny.status == INCONCLUSIVE and tiny.exit_code == 2
    assert _by(tiny, "goodput_rps").undecided == NOT_ENOUGH_DATA
    # 400 s of traffic on the default 60 s windows: 7 windows, 30 needed
    short = compare_runs(_run("b", seed=1), _run("c", seed=1), default_config())
    assert short.status == INCONCLUSIVE and short.wait_minutes == 23
    assert "7 of 7 windows hold 5+ of its requests on each side; 30 needed" in _by(short, "ttft_p99_s").reason


def test_runs_without_requests_are_undecided_and_reported_not_a_crash(tmp_path):
    """Two empty request tables once crashed the comparison (a maximum over no tenants)."""
    from replay.gate import headline
    from replay.report import write_reports

    empty = synthetic_requests(num_requests=10).slice(0, 0)
    base, cand = Run("b", empty, None, "b", None, None), Run("c", empty, None, "c", None, None)
    verdict = compare_runs(base, cand, GATE)
    assert verdict.status == INCONCLUSIVE and verdict.wait_minutes is None and verdict.score is None
    assert headline(verdict) == "INCONCLUSIVE: replay more traffic (no estimate of how much)"
    assert json.loads(write_reports(verdict, base, cand, tmp_path)["json"].read_text())["status"] == INCONCLUSIVE


def test_a_baseline_without_data_for_a_class_is_undecided_with_that_reason():
    baseline = Run("b", synthetic_requests(classes=("batch",)), None, "b", None, None)
    candidate = Run("c", synthetic_requests(classes=("batch", "interactive")), None, "c", None, None)
    verdict = compare_runs(baseline, candidate, GATE)
    interactive = _by(verdict, "ttft_p99_s", "interactive")
    assert interactive.status == INCONCLUSIVE and "0 baseline" in interactive.reason
    assert verdict.status != PASS


def test_the_replay_models_known_error_turns_a_narrow_pass_undecided_and_never_applies_to_live_pools():
    base, cand = _run("b", seed=5), _run("c", seed=5, itl_factor={"interactive": 1.06, "batch": 1.06})
    plain = compare_runs(base, cand, GATE)
    assert _by(plain, "tpot_p50_s").status == PASS and plain.status == PASS
    config = dataclasses.replace(GATE, model_error=(ModelError(metric="itl_mean", error=0.2),))
    held = compare_runs(base, cand, config)
    tpot = _by(held, "tpot_p50_s")
    assert tpot.status == INCONCLUSIVE and tpot.undecided == MODEL_ERROR and tpot.critical_possible
    assert "replay model's known error on it (itl_mean 20.0%)" in tpot.reason
    assert held.status == INCONCLUSIVE and "replay model error applied to passes: itl_mean 20.0%" in held.notes
    assert _by(held, "ttft_p99_s").model_error is None  # itl_mean bounds ITL metrics only
    live = compare_runs(dataclasses.replace(base, measured=True), dataclasses.replace(cand, measured=True), config)
    assert live.status == PASS and "model_error not applied: live pools are measured, not modelled" in live.notes


# ------------------------------------------------------------------ real replays, through the command


def _gate(*args, env=None):
    return subprocess.run([sys.executable, "-m", "servelens", "gate", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def azure_31_minutes():
    """The Azure conversation trace's first 31 minutes (31 one-minute windows of the gate)."""
    from replay.traces import read_trace
    from replay.workload import trim
    from servelens.config import load_config as servelens_config
    from servelens.config import shared_dir

    trace = read_trace("azure-conv", shared_dir(servelens_config()))
    t0 = int(trace["arrival_ns"][0].as_py())
    return trim(trace, t0, t0 + 31 * MINUTE_NS)


def _replay(workload: pa.Table, engine: str, out, seed: int = 0):
    from replay.config import parse_instance
    from replay.presets import THREE_TENANT_SCENARIO
    from replay.run import run_replay
    from replay.workload import TableWorkload

    run_replay(TableWorkload(workload, name="azure-31min"), scenario=THREE_TENANT_SCENARIO, instance=parse_instance(engine),
               seed=seed, out_dir=out)
    return out


def test_the_same_workload_on_an_a100_fails_on_itl_and_the_report_names_it_first(azure_31_minutes, tmp_path):
    """Baseline llama-3-8b on an H100, candidate on an A100 (slower decode), every other request of
    the trace: the candidate's prefill is slower too, but the report leads with ITL, its most
    certain failure."""
    half = azure_31_minutes.filter(pa.array(np.arange(azure_31_minutes.num_rows) % 2 == 0))
    base = _replay(half, "llama-3-8b@h100-sxm", tmp_path / "h100")
    cand = _replay(half, "llama-3-8b@a100-80g", tmp_path / "a100")
    proc = _gate("--baseline", str(base), "--candidate", str(cand), "--out", str(tmp_path / "gate"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "gate: FAIL: do not ship the candidate"
    assert lines[1].startswith("  - critical failure: itl_p99_p99_s rose +")
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    first = re.fullmatch(r"itl_p99_p99_s \(all, (\w+), (\w+)\)", report["failed"][0])  # classes: most certain first
    assert first and {first[1], first[2]} == {"batch", "interactive"}, report["failed"]
    markdown = (tmp_path / "gate" / "gate.md").read_text().splitlines()
    assert markdown[0] == "## servelens gate: **FAIL: do not ship the candidate**"
    assert markdown[2].startswith(f"- Failed: itl\\_p99\\_p99\\_s (all, {first[1]}, {first[2]})")
    itl = next(m for m in report["metrics"] if m["metric"] == "itl_p99_p99_s" and m["group"] == "")
    assert itl["num_windows_used"] == 31 and itl["difference"]["num_windows"] == 31
    block = default_block_windows(31)
    assert (itl["difference"]["block_windows"], itl["difference"]["num_blocks"]) == (block, -(-31 // block))
    assert itl["difference"]["num_resamples"] == 1000


def test_two_runs_far_out_of_slo_fail_on_the_absolute_conditions(azure_31_minutes, tmp_path):
    """llama-2-70b on two A100s cannot serve the trace: both replays (seeds 0 and 1) meet their SLO
    for well under 1% of requests. Relative to each other they look alike; the conditions fail the
    candidate, and the report says first that the baseline itself is out of SLO."""
    base = _replay(azure_31_minutes, "llama-2-70b@a100-80gx2", tmp_path / "b", seed=0)
    cand = _replay(azure_31_minutes, "llama-2-70b@a100-80gx2", tmp_path / "c", seed=1)
    proc = _gate("--baseline", str(base), "--candidate", str(cand), "--out", str(tmp_path / "gate"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    missed = [c for c in report["conditions"] if c["status"] == FAIL]
    assert {c["group"] for c in missed} == {"batch", "interactive"}
    assert all(c["difference"]["candidate"] < 0.01 and c["baseline_status"] == FAIL for c in missed)
    assert report["notes"][0].startswith("baseline itself out of SLO: attainment (batch)")
    assert any(r.startswith("missed condition: attainment (batch)") for r in report["reasons"])
    markdown = (tmp_path / "gate" / "gate.md").read_text()
    assert markdown.index("baseline itself out of SLO") < markdown.index("### Absolute conditions")


def test_a_one_window_replay_pair_is_inconclusive_for_lack_of_data(azure_31_minutes, tmp_path):
    """The trace's first minute (one window, a few hundred requests): no interval of zero width is
    taken for a decision."""
    from replay.workload import trim

    t0 = int(azure_31_minutes["arrival_ns"][0].as_py())
    first = trim(azure_31_minutes, t0, t0 + MINUTE_NS)
    base = _replay(first, "llama-3-8b@h100-sxm", tmp_path / "b", seed=0)
    cand = _replay(first, "llama-3-8b@h100-sxm", tmp_path / "c", seed=1)
    proc = _gate("--baseline", str(base), "--candidate", str(cand), "--out", str(tmp_path / "gate"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "gate: INCONCLUSIVE: replay 29 more minutes of traffic"
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert report["wait_minutes"] == 29 and report["score"] is None
    judged = [m for m in report["metrics"] if not m["informative"] and m["status"] != "skipped"]
    assert judged and all(m["undecided"] == NOT_ENOUGH_DATA and m["difference"]["num_windows"] == 1 for m in judged)


def test_the_gate_command_exits_0_1_2_and_3_and_writes_its_reports(tmp_path):
    config = tmp_path / "gate.yaml"
    config.write_text(config_yaml(GATE))
    paths = {}
    for name, kw in {"base": {"seed": 1}, "same": {"seed": 1}, "worse": {"seed": 1, "ttft_factor": {"interactive": 1.3}},
                     "tiny": {"num_requests": 10}, "tiny_copy": {"num_requests": 10}}.items():
        paths[name] = tmp_path / f"{name}.parquet"
        pq.write_table(synthetic_requests(**kw), paths[name])
    common = ("--config", str(config))
    passed = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["same"]), "--out", str(tmp_path / "pass"), *common)
    assert passed.returncode == 0 and passed.stdout.startswith("gate: PASS: ready for a canary"), passed.stderr
    failed = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["worse"]), "--out", str(tmp_path / "fail"), *common)
    assert failed.returncode == 1 and "ttft_p99_s (interactive)" in failed.stdout
    report = json.loads((tmp_path / "fail" / "gate.json").read_text())
    assert report["status"] == "fail" and report["headline"] == "FAIL: do not ship the candidate"
    assert any(m["metric"] == "ttft_p99_s" and m["status"] == "fail" for m in report["metrics"])
    assert "| ttft\\_p99\\_s | interactive |" in (tmp_path / "fail" / "gate.md").read_text()
    unsure = _gate("--baseline", str(paths["tiny"]), "--candidate", str(paths["tiny_copy"]), "--out", str(tmp_path / "unsure"),
                   *common)
    assert unsure.returncode == 2 and unsure.stdout.startswith("gate: INCONCLUSIVE: replay ")
    itself = _gate("--baseline", str(paths["tiny"]), "--candidate", str(tmp_path / "." / "tiny.parquet"), *common)
    assert itself.returncode == 3 and "are the same run" in itself.stderr and "Traceback" not in itself.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("metrics: [{name: nope, bad: increase, allowed: 0, critical: 1}]\n")
    error = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["same"]), "--config", str(bad))
    assert error.returncode == 3 and "unknown metric 'nope'" in error.stderr and "Traceback" not in error.stderr
    assert _gate("--no-such-option").returncode == 3
    assert _gate("--model-error", "itl_mean", "--list-metrics").returncode == 3
    written = tmp_path / "default.yaml"
    assert _gate("--write-default-config", str(written)).returncode == 0
    assert load_config(written) == default_config() and isinstance(load_config(written), GateConfig)
    listed = _gate("--list-metrics")
    assert listed.returncode == 0 and "time to first token" in listed.stdout and "10% / 25% relative" in listed.stdout


def test_a_model_error_given_on_the_command_line_holds_a_narrow_pass(tmp_path):
    config = tmp_path / "gate.yaml"
    config.write_text(config_yaml(GATE))
    for name, kw in {"base": {"seed": 5}, "cand": {"seed": 5, "itl_factor": {"interactive": 1.06, "batch": 1.06}}}.items():
        pq.write_table(synthetic_requests(**kw), tmp_path / f"{name}.parquet")
    args = ("--baseline", str(tmp_path / "base.parquet"), "--candidate", str(tmp_path / "cand.parquet"), "--config", str(config))
    assert _gate(*args, "--out", str(tmp_path / "plain")).returncode == 0
    held = _gate(*args, "--out", str(tmp_path / "held"), "--model-error", "itl_mean=0.2")
    assert held.returncode == 2 and "replay model error applied to passes: itl_mean 20.0%" in held.stdout
    report = json.loads((tmp_path / "held" / "gate.json").read_text())
    assert {m["metric"] for m in report["metrics"] if m["undecided"] == MODEL_ERROR} >= {"tpot_p50_s", "itl_p99_p99_s"}


# ------------------------------------------------------------------ moves are not preemptions


def _agg_and_disagg(tmp_path):
    """The same 240 requests on 4 aggregated instances and on 2 prefill + 2 decode instances, with
    room enough that nothing is preempted: every difference in moves is the hand-offs."""
    from replay.cluster import cluster_config, disaggregated_config, run_cluster_replay
    from tests.replay.conftest import make_workload

    ms = 1_000_000
    n = 240
    w = make_workload([i * 10 * ms for i in range(n)], [200 + 41 * (i % 7) for i in range(n)], [1 + 9 * (i % 5) for i in range(n)])
    agg = run_cluster_replay(w, cluster_config(4), out_dir=tmp_path / "agg")
    dis = run_cluster_replay(w, disaggregated_config(2, 2), out_dir=tmp_path / "dis")
    return n, agg, dis


def test_a_disaggregated_run_counts_its_hand_offs_as_migrations_not_preemptions(tmp_path):
    import pyarrow.compute as pc

    from replay.derive import derive_requests

    n, agg, dis = _agg_and_disagg(tmp_path)
    events = pq.read_table(dis.events_path)
    preempted = events.filter(pc.equal(events["event_type"], "request_preempted"))
    modes = preempted["mode"].to_pylist()
    table = derive_requests(dis.events_path)
    moved = sum(1 for i in range(n) if 1 + 9 * (i % 5) > 1)  # a one-token request ends where it began
    assert modes.count("migrate") == dis.num_kv_transfers == moved > 0
    assert pc.sum(table["num_migrations"]).as_py() == modes.count("migrate")
    assert pc.sum(table["num_preemptions"]).as_py() == len(modes) - modes.count("migrate") == 0
    assert pc.max(table["num_migrations"]).as_py() == 1
    plain = derive_requests(agg.events_path)
    assert pc.sum(plain["num_migrations"]).as_py() == 0 and pc.sum(plain["num_preemptions"]).as_py() == 0


def test_the_gate_does_not_fail_preemptions_for_the_hand_offs_of_a_disaggregated_candidate(tmp_path):
    from replay.gate import DEFAULT_METRICS, load_run

    n, agg, dis = _agg_and_disagg(tmp_path)
    judged = {"preemptions_per_request", "oscillating_share", "migrations_per_request"}
    specs = [s for s in DEFAULT_METRICS if s.name in judged]
    specs.append(dataclasses.replace(specs[0], name="migrations_per_request"))
    config = GateConfig(window_s=0.1, min_points=20, min_windows=10, resamples=200, metrics=tuple(specs))
    verdict = compare_runs(load_run(agg.events_path.parent, "baseline"), load_run(dis.events_path.parent, "candidate"),
                           config)
    pre, osc = _by(verdict, "preemptions_per_request"), _by(verdict, "oscillating_share")
    assert pre.status == PASS and pre.difference.baseline == pre.difference.candidate == 0, pre.reason
    assert osc.status == PASS, osc.reason
    # the moves are there to see: 4 in 5 requests moved once (the one-token ones end where they began)
    mig = _by(verdict, "migrations_per_request")
    assert mig.difference.baseline == 0 and mig.difference.candidate == pytest.approx(0.8)
    assert mig.status == FAIL  # judged like any metric when a configuration lists it


def test_the_calibration_named_in_the_manifests_brings_its_held_out_error(tmp_path):
    """Replays made with a calibration carry its held-out errors in their manifests: the gate states the model
    behind the verdict and holds a pass whose margin is within that error (calibration_error, default on)."""
    manifest = tmp_path / "manifest.json"
    record = {"name": "vllm-test", "engine": "vLLM 0.15.1", "fitted_on_accelerators": ["h100-sxm"], "extrapolated": False,
              "held_out_error_pct": {"itl_mean": 20.0, "ttft_mean": 6.0}}
    manifest.write_text(json.dumps({"calibration": record}))
    base = synthetic_requests(seed=5)
    cand = synthetic_requests(seed=5, itl_factor={"interactive": 1.06, "batch": 1.06})
    runs = [Run(label, table, None, label, str(manifest), None) for label, table in (("baseline", base), ("candidate", cand))]
    verdict = compare_runs(*runs, GATE)
    assert verdict.notes[0] == "replay model: calibration vllm-test (vLLM 0.15.1), held-out error itl_mean 20.0%, ttft_mean 6.0%"
    assert verdict.status == INCONCLUSIVE and any(m.undecided == MODEL_ERROR for m in verdict.metrics)
    off = compare_runs(*runs, dataclasses.replace(GATE, calibration_error=False))
    assert off.status == PASS and not any("calibration" in n for n in off.notes)
    assert calibration_errors(*runs)[0] == {"itl_mean": 0.2, "ttft_mean": 0.06}
    manifest.write_text(json.dumps({"calibration": {**record, "engine": "SGLang 0.4", "other_engine": "fitted on SGLang 0.4, "
                                                    "not vLLM: the replay schedules as vLLM v1 does"}}))
    assert compare_runs(*runs, GATE).notes[0] == ("replay model: calibration vllm-test (SGLang 0.4; fitted on SGLang 0.4, "
                                                  "not vLLM: the replay schedules as vLLM v1 does), held-out error "
                                                  "itl_mean 20.0%, ttft_mean 6.0%")


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "it is not valid JSON"),
    ("[1, 2]", "it holds a JSON list, not an object"),
    ('{"calibration": {"name": "c", "held_out_error_pct": {"itl_mean": "5%"}}}', "held_out_error_pct itl_mean is '5%'"),
    ('{"calibration": {"name": "c", "held_out_error_pct": {"itl_mean": NaN}}}', "held_out_error_pct itl_mean is nan"),
    ('{"calibration": {"name": "c", "held_out_error_pct": {"itl_mean": -1}}}', "held_out_error_pct itl_mean is -1"),
    ('{"calibration": {"name": "c", "held_out_error_pct": 5}}', "held_out_error_pct is 5, not a mapping"),
    ('{"calibration": {"held_out_error_pct": {}}}', "KeyError: 'name'"),
    ('{"calibration": {"name": "c"}, "load": "2x"}', "its load is a JSON str, not an object of fields"),
    ('{"calibration": {"name": "c", "held_out_error_pct": {"e2e_mean": 1e308}}}', "held_out_error_pct e2e_mean is 1e+308"),
    ('{"calibration": {"name": ["a"], "held_out_error_pct": {}}}', "calibration name is ['a'], not text"),
])
def test_a_malformed_manifest_is_named_with_what_is_wrong_and_the_way_round_it(tmp_path, text, why):
    """A manifest edited by hand or cut short: an error naming the file and the fault, with the two ways
    on (replay again, or judge the events file without the manifest), never an internal error."""
    from servelens.errors import ServelensError

    manifest = tmp_path / "manifest.json"
    manifest.write_text(text)
    run = Run("candidate", synthetic_requests(seed=5), None, "candidate", str(manifest), None)
    with pytest.raises(ServelensError, match="cannot be read") as err:
        calibration_errors(run)
    assert str(manifest) in err.value.message and why in err.value.message
    assert "events.parquet instead of its folder" in (err.value.hint or "")


def test_a_held_out_error_of_100_percent_or_more_keeps_the_metric_from_passing(tmp_path):
    """A calibration that misses ITL by 170% cannot vouch for it: the error is capped just below 1 (a model
    error must be a fraction below 1) and no ITL metric passes; the notes keep the recorded 170%."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"calibration": {"name": "poor", "engine": "vLLM", "held_out_error_pct": {"itl_mean": 170.0}}}))
    table = synthetic_requests(seed=5)
    runs = [Run(label, table, None, label, str(manifest), None) for label in ("baseline", "candidate")]
    assert calibration_errors(*runs)[0] == {"itl_mean": MAX_CALIBRATION_ERROR}
    verdict = compare_runs(*runs, GATE)
    assert "itl_mean 170.0%" in verdict.notes[0]
    itl = [m for m in verdict.metrics if m.metric.startswith(("itl", "tpot")) and not m.informative]
    assert itl and all(m.status == INCONCLUSIVE and m.undecided == MODEL_ERROR for m in itl)
    assert verdict.status == INCONCLUSIVE


def test_windows_too_many_for_memory_are_refused_before_the_bootstrap_is_built():
    """10 ms windows over the synthetic runs' span are tens of thousands of windows, each side's histograms
    about 50 kB a window: refused with the way out, not a MemoryError minutes later."""
    from servelens.errors import ServelensError

    runs = [Run(label, synthetic_requests(seed=5), None, label, None, None) for label in ("baseline", "candidate")]
    with pytest.raises(ServelensError, match=r"windows of 0\.01 s.*at most 20,000 windows") as err:
        compare_runs(*runs, dataclasses.replace(GATE, window_s=0.01))
    assert "longer windows (window_s)" in err.value.hint
    assert compare_runs(*runs, GATE).status  # the same runs at 10 s windows are judged


def test_an_input_that_is_no_run_is_named_with_what_to_give(tmp_path, shared):
    from replay.gate import load_run
    from replay.traces import read_trace
    from servelens.errors import ServelensError

    workload = tmp_path / "workload.parquet"  # a workload table: arrivals, no outcomes yet
    pq.write_table(read_trace("azure-conv", shared).slice(0, 5), workload)
    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    for path, message, hint in ((workload, "is neither an events file nor a request table", "servelens replay --workload"),
                                (empty, "is empty", "the events of a run")):
        with pytest.raises(ServelensError, match=message) as err:
            load_run(path, "baseline")
        assert hint in err.value.hint
