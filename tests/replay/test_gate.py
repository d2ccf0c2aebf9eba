"""The gate: known answers, configuration errors, live canaries, and the command's exit codes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from replay.gate import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    GateConfig,
    Run,
    compare_runs,
    config_yaml,
    decide,
    default_config,
    load_config,
)
from replay.metrics import ClassObjectives
from servelens.errors import ConfigError
from tests.replay.gate_data import synthetic_requests


def _run(label: str, **kw) -> Run:
    return Run(label, synthetic_requests(**kw), None, label, None, None)


def _by(verdict, metric: str, group: str = ""):
    (found,) = [m for m in verdict.metrics if m.metric == metric and m.group == group]
    return found


def test_identical_runs_pass():
    verdict = compare_runs(_run("b", seed=1), _run("c", seed=1), default_config())
    assert verdict.status == PASS and verdict.exit_code == 0 and verdict.score == 100


def test_a_thirty_percent_worse_p99_ttft_in_one_class_fails_and_names_it():
    verdict = compare_runs(_run("b", seed=1), _run("c", seed=1, ttft_factor={"interactive": 1.3}), default_config())
    assert verdict.status == FAIL and verdict.exit_code == 1
    failed = _by(verdict, "ttft_p99_s", "interactive")
    assert failed.status == FAIL and failed.critical
    assert any("ttft_p99_s (interactive)" in r and "critical failure" in r for r in verdict.reasons)
    assert _by(verdict, "ttft_p99_s", "batch").status == PASS  # the other class is untouched


def test_winning_goodput_by_rejecting_a_fifth_of_requests_is_not_a_pass():
    """The baseline admits everything and misses TTFT for many; the candidate rejects 20% and meets
    TTFT for the rest: more goodput, but the rejections are judged and fail the run."""
    config = dataclasses.replace(default_config(), classes=(ClassObjectives(name="default", ttft_s=0.3),))
    baseline = _run("b", seed=2, ttft_median_s=0.3, classes=("default",))
    candidate = _run("c", seed=2, ttft_median_s=0.1, reject_share=0.2, classes=("default",))
    verdict = compare_runs(baseline, candidate, config)
    goodput = _by(verdict, "goodput_rps")
    assert goodput.difference.candidate > goodput.difference.baseline and goodput.status == PASS
    assert verdict.status == FAIL
    assert _by(verdict, "rejected_share").status == FAIL
    assert any(r.startswith("critical failure: rejected_share") for r in verdict.reasons)


def test_ten_requests_are_inconclusive():
    verdict = compare_runs(_run("b", num_requests=10), _run("c", num_requests=10, seed=3), default_config())
    assert verdict.status == INCONCLUSIVE and verdict.exit_code == 2
    assert "too little data" in _by(verdict, "goodput_rps").reason


def test_a_baseline_without_data_for_a_metric_is_inconclusive_with_that_reason():
    baseline = Run("b", synthetic_requests(classes=("batch",)), None, "b", None, None)
    candidate = Run("c", synthetic_requests(classes=("batch", "interactive")), None, "c", None, None)
    verdict = compare_runs(baseline, candidate, default_config())
    interactive = _by(verdict, "ttft_p99_s", "interactive")
    assert interactive.status == INCONCLUSIVE and "baseline 0" in interactive.reason
    assert verdict.status != PASS


def test_the_configuration_round_trips_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "gate.yaml"
    path.write_text(config_yaml(default_config()))
    assert load_config(path) == default_config()
    path.write_text("metrics:\n  - {name: p99_latency, bad: increase, allowed: 0.1, critical: 0.2}\n")
    with pytest.raises(ConfigError, match="unknown metric 'p99_latency'") as err:
        load_config(path)
    assert "ttft_p99_s" in err.value.hint
    path.write_text("metrics:\n  - {name: ttft_p99_s, bad: up, allowed: 0.1, critical: 0.2}\n")
    with pytest.raises(ConfigError, match="bad must be 'increase' or 'decrease'"):
        load_config(path)
    path.write_text("metrics:\n  - {name: ttft_p99_s, bad: increase, allowed: 0.3, critical: 0.2}\n")
    with pytest.raises(ConfigError, match="allowed"):
        load_config(path)
    path.write_text("windows_s: 60\n")
    with pytest.raises(ConfigError, match="unknown config key windows_s"):
        load_config(path)
    path.write_text("score: {pass: 80, marginal: 60}\n")
    assert load_config(path).score.pass_ == 80


def test_a_failed_live_canary_rolls_back_to_the_named_configuration():
    failing = compare_runs(_run("b", seed=1), _run("c", seed=1, ttft_factor={"interactive": 1.5}), default_config())
    decision = decide(failing, "policy=fcfs@v12")
    assert decision.action == "rollback" and decision.restore == "policy=fcfs@v12"
    assert decide(compare_runs(_run("b"), _run("c"), default_config()), None).action == "promote"
    watching = decide(compare_runs(_run("b", num_requests=10), _run("c", num_requests=10), default_config()), None)
    assert watching.action == "continue"
    never = dataclasses.replace(failing, config=dataclasses.replace(failing.config, rollback_on="never"))
    assert decide(never, "x").action == "continue"


def test_live_pools_are_read_from_the_lake(tmp_path):
    """Two pools over the same period, from sanitized events in the lake."""
    from pipelines.lake import EVENTS, Lake, OffsetRange
    from privacy.keys import KeyRing
    from privacy.sanitize import Sanitizer
    from replay.gate import lake_pools
    from schemas.arrow import events_to_table
    from schemas.events import FirstToken, RequestArrived, RequestFinished

    events = []
    for i in range(300):
        pool = "canary" if i % 2 else "baseline"
        env = {"engine_id": f"eng-{pool}", "request_id": f"r{i}", "pool": pool, "service_class": "interactive"}
        t = 1_764_000_000_000_000_000 + i * 100_000_000
        ttft = 200_000_000 if pool == "baseline" else 600_000_000  # the canary is 3x slower to first token
        events += [RequestArrived(event_id=f"a{i}", ts_ns=t, num_prompt_tokens=10, **env),
                   FirstToken(event_id=f"f{i}", ts_ns=t + ttft, **env),
                   RequestFinished(event_id=f"z{i}", ts_ns=t + ttft, outcome="completed", num_output_tokens=1, **env)]
    clean = Sanitizer(KeyRing("k", {"k": bytes(32)})).sanitize(events_to_table(events))
    Lake(tmp_path / "lake").commit(EVENTS, clean, [OffsetRange("t", 0, 0, 0, 1)], {("t", 0, 0): None})
    base, cand = lake_pools(str(tmp_path / "lake"), "baseline", "canary", None, None)
    assert base.requests.num_rows == cand.requests.num_rows == 150
    verdict = compare_runs(base, cand, dataclasses.replace(default_config(), window_s=5.0, min_points=20))
    assert _by(verdict, "ttft_p99_s").status == FAIL and verdict.status == FAIL


def _gate(*args, env=None):
    return subprocess.run([sys.executable, "-m", "servelens", "gate", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_the_gate_command_exits_0_1_2_and_3_and_writes_its_reports(tmp_path):
    paths = {}
    for name, kw in {"base": {"seed": 1}, "same": {"seed": 1}, "worse": {"seed": 1, "ttft_factor": {"interactive": 1.3}},
                     "tiny": {"num_requests": 10}}.items():
        paths[name] = tmp_path / f"{name}.parquet"
        pq.write_table(synthetic_requests(**kw), paths[name])
    passed = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["same"]), "--out", str(tmp_path / "pass"))
    assert passed.returncode == 0 and "gate: PASS" in passed.stdout, passed.stderr
    failed = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["worse"]), "--out", str(tmp_path / "fail"))
    assert failed.returncode == 1 and "ttft_p99_s (interactive)" in failed.stdout
    report = json.loads((tmp_path / "fail" / "gate.json").read_text())
    assert report["status"] == "fail" and any(m["metric"] == "ttft_p99_s" and m["status"] == "fail" for m in report["metrics"])
    assert "| ttft\\_p99\\_s | interactive |" in (tmp_path / "fail" / "gate.md").read_text()
    unsure = _gate("--baseline", str(paths["tiny"]), "--candidate", str(paths["tiny"]), "--out", str(tmp_path / "unsure"))
    assert unsure.returncode == 2 and "gate: INCONCLUSIVE" in unsure.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("metrics: [{name: nope, bad: increase, allowed: 0, critical: 1}]\n")
    error = _gate("--baseline", str(paths["base"]), "--candidate", str(paths["same"]), "--config", str(bad))
    assert error.returncode == 3 and "unknown metric 'nope'" in error.stderr and "Traceback" not in error.stderr
    usage = _gate("--no-such-option")
    assert usage.returncode == 3
    written = tmp_path / "default.yaml"
    assert _gate("--write-default-config", str(written)).returncode == 0
    assert load_config(written) == default_config() and isinstance(load_config(written), GateConfig)


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

    from pipelines.tables import derive_requests

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
    config = GateConfig(window_s=0.25, min_points=20, resamples=200, metrics=tuple(specs))
    verdict = compare_runs(load_run(agg.events_path.parent, "baseline"), load_run(dis.events_path.parent, "candidate"),
                           config)
    pre, osc = _by(verdict, "preemptions_per_request"), _by(verdict, "oscillating_share")
    assert pre.status == PASS and pre.difference.baseline == pre.difference.candidate == 0, pre.reason
    assert osc.status == PASS, osc.reason
    # the moves are there to see: 4 in 5 requests moved once (the one-token ones end where they began)
    mig = _by(verdict, "migrations_per_request")
    assert mig.difference.baseline == 0 and mig.difference.candidate == pytest.approx(0.8)
    assert mig.status == FAIL  # judged like any metric when a configuration lists it
