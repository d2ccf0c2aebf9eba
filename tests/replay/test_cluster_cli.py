"""`servelens replay` with cluster options, run as users run it: a real process, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq


def servelens(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelens", *args], capture_output=True, text=True, env=dict(os.environ))


def test_replay_with_cluster_options_routes_scales_and_reports(tmp_path):
    out = tmp_path / "cluster"
    proc = servelens("replay", "--workload", "azure-conv", "--requests", "400", "--instances", "3",
                     "--router", "least-outstanding-tokens", "--scale", "2:+1", "--startup-s", "1",
                     "--weight-load-s", "2", "--cache-warm-s", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "on 4 instances (least-outstanding-tokens)" in proc.stdout and "ready at 6.0 s" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cluster"]["router"]["name"] == "least-outstanding-tokens"
    assert manifest["cluster"]["scaling"] == [{"at_s": 2.0, "delta": 1, "instance": None}]
    events = pq.read_table(out / "events.parquet", columns=["event_type", "decision", "state"]).to_pylist()
    assert sum(e["decision"] == "route" for e in events) == 400
    assert sum(e["event_type"] == "instance_state" for e in events) == 3 * 2 + 3  # ready, stopped; the added one starting too


def test_cluster_options_fail_cleanly(tmp_path):
    bad_config = tmp_path / "router.yaml"
    bad_config.write_text("shedding: {sheddable_classes: [batch], queue_limit: 3}\n")
    for args, message in (
        (["--router", "least-load", "--router-config", str(bad_config)], "unknown config key shedding.queue_limit"),
        (["--instances", "2", "--router", "nope"], "unknown router 'nope'"),
        (["--scale", "5:2"], "is not AT_S:+N or AT_S:-N"),
        (["--instances", "0"], "Invalid value for '--instances': 0 is not in the range 1<=x<=10000."),
        (["--instances", "1", "--scale", "5:-1"], "leaves 0 instances"),
        # each of these was an internal OverflowError, a replay that never ended, or taken as given
        (["--instances", "2", "--fail", "1e20:1"], "instance failure: the time must be between 0 and 1e+09 s"),
        (["--scale", "nan:+1"], "scale step: the time must be between 0"),
        (["--instances", "2", "--scale", "600:+100000"], "could hold 100,002 instances"),
        (["--instances", "2", "--failure-rate-per-hour", "nan"], "'nan' is not a finite number"),
        (["--gpu-memory-utilization", "inf"], "'inf' is not a finite number"),
    ):
        proc = servelens("replay", "--workload", "azure-conv", "--requests", "50", *args, "--out", str(tmp_path / "x"))
        assert proc.returncode == 3 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_replay_with_disaggregated_pools_and_a_failure(tmp_path):
    out = tmp_path / "disagg"
    proc = servelens("replay", "--workload", "azure-conv", "--requests", "300", "--instances", "2", "--decode-instances", "2",
                     "--kv-transfer-gbps", "25", "--fail", "30:3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "KV transfers" in proc.stdout and "1 instance failures" in proc.stdout and "(decode)" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cluster"]["disaggregation"]["kv_transfer_bandwidth_bytes_per_s"] == 25e9
    assert manifest["cluster"]["faults"]["failures"] == [{"at_s": 30.0, "instance": 3}]
    events = pq.read_table(out / "events.parquet", columns=["event_type", "mode", "request_id"]).to_pylist()
    assert sum(e["event_type"] == "request_finished" for e in events) == 300
    assert any(e["mode"] == "migrate" for e in events)
    proc = servelens("replay", "--workload", "azure-conv", "--requests", "50", "--fail", "5", "--out", str(tmp_path / "x"))
    assert proc.returncode == 3 and "is not AT_S:INDEX" in proc.stderr and "Traceback" not in proc.stderr


def test_replay_with_an_autoscaler_scales_as_it_runs(tmp_path):
    out = tmp_path / "autoscaled"
    config = tmp_path / "autoscaler.yaml"
    config.write_text("target_requests_per_s: 2\nmax_instances: 3\nscale_down_delay_s: 0\n")
    proc = servelens("replay", "--workload", "azure-conv", "--requests", "400", "--instances", "1",
                     "--autoscaler", "request-rate", "--autoscaler-config", str(config), "--autoscale-interval-s", "2",
                     "--autoscale-window-s", "4", "--startup-s", "1", "--weight-load-s", "1", "--cache-warm-s", "1",
                     "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())["cluster"]["autoscaler"]
    assert (manifest["name"], manifest["interval_s"], manifest["window_s"]) == ("request-rate", 2.0, 4.0)
    assert manifest["config"]["target_requests_per_s"] == 2.0 and manifest["config"]["max_instances"] == 3
    decisions = manifest["decisions"]
    assert [d["at_s"] for d in decisions[:3]] == [2.0, 4.0, 6.0]
    assert max(d["num_instances_wanted"] for d in decisions) == 3  # up to 4 wanted at 8 req/s, clamped
    events = pq.read_table(out / "events.parquet", columns=["event_type", "scale_action"]).to_pylist()
    assert any(e["event_type"] == "instance_state" and e["scale_action"] == "scale_up" for e in events)
    assert "on 1 instances" not in proc.stdout and "ready at 0.0 s" in proc.stdout


def test_autoscaler_options_fail_cleanly(tmp_path):
    bad_config = tmp_path / "autoscaler.yaml"
    bad_config.write_text("target_rps: 3\n")
    for args, message in (
        (["--autoscaler", "nope"], "unknown autoscaler 'nope'"),
        (["--autoscale-interval-s", "5"], "need --autoscaler"),
        (["--autoscaler", "request-rate", "--autoscaler-config", str(bad_config)], "unknown config key target_rps"),
        (["--autoscaler", "request-rate", "--autoscale-window-s", "0"], "'--autoscale-window-s': 0.0 is not in the range 0.1<=x"),
        (["--instances", "1", "--decode-instances", "1", "--autoscaler", "workload-aware"], "not supported yet"),
    ):
        proc = servelens("replay", "--workload", "azure-conv", "--requests", "50", *args, "--out", str(tmp_path / "x"))
        assert proc.returncode == 3 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_cluster_options_out_of_range_are_refused_by_their_flag(tmp_path):
    """Each was refused naming a library field (scaling delays must be non-negative, InstanceFailure(...)), taken
    silently (a failure of an instance never there), or an internal OverflowError."""
    from click.testing import CliRunner

    from servelens.cli import cli

    for args, code, message in (
        (["--fail", "10:99"], 3, "--fail 10:99 names instance 99, but the cluster holds at most 1 instance"),
        (["--fail", "10:-1"], 3, "--fail 10:-1: the instance index must be 0 or more"),
        (["--startup-s", "-1"], 2, "'--startup-s': -1.0 is not in the range 0<=x<=1000000000.0"),
        (["--startup-s", "1e308", "--scale", "1:+1"], 2, "'--startup-s': 1e+308 is not in the range"),
        (["--weight-load-gbps", "0"], 2, "'--weight-load-gbps': 0.0 is not in the range x>=0.001"),
        (["--weight-load-gbps", "1e-300", "--scale", "1:+1"], 2, "'--weight-load-gbps': 1e-300 is not in the range"),
        (["--kv-transfer-gbps", "0"], 2, "'--kv-transfer-gbps': 0.0 is not in the range x>=0.001"),
        (["--kv-transfer-latency-s", "-1"], 2, "'--kv-transfer-latency-s': -1.0 is not in the range"),
        (["--failure-rate-per-hour", "-1"], 2, "'--failure-rate-per-hour': -1.0 is not in the range 0<=x<=10000"),
        (["--autoscale-interval-s", "0"], 2, "'--autoscale-interval-s': 0.0 is not in the range 0.1<=x"),
        (["--autoscale-window-s", "-1"], 2, "'--autoscale-window-s': -1.0 is not in the range 0.1<=x"),
    ):
        done = CliRunner().invoke(cli, ["replay", "--workload", "azure-conv", "--requests", "20", *args,
                                        "--out", str(tmp_path / "x")])
        assert done.exit_code == code and message in done.output, (args, done.output)
        assert "internal error" not in done.output and "Traceback" not in done.output
        assert code == 2 or "hint: --fail AT_S:INDEX" in done.output
