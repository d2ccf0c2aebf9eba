"""The command line, run as users run it: a real process, clean errors, no tracebacks."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest

from schemas.arrow import arrow_schema
from schemas.records import WorkloadRequest
from servelens.demo import DEMO_CANDIDATES, DEMO_LOADS
from tests.terminal import sigint_as_in_a_terminal

KEY_ENV = {"SERVELENS_PSEUDONYM_KEY": "test-key:" + base64.b64encode(bytes(range(32))).decode()}


def servelens(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelens", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_the_demo_runs_the_whole_path_serves_the_dashboard_and_stops_on_ctrl_c(tmp_path):
    """The README's first command, short: broker, engine fleet, Kafka, ingest, Dagster, gate, dashboard."""
    key, out = tmp_path / "demo-key.toml", tmp_path / "demo"
    env = {**os.environ, "SERVELENS_PRIVACY__DEMO_KEY_FILE": str(key)}
    args = [sys.executable, "-m", "servelens", "demo", "--out", str(out), "--requests", "1500", "--speedup", "2000"]
    proc = subprocess.Popen([*args, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=sigint_as_in_a_terminal)
    lines = []
    try:
        for line in proc.stdout:  # the summary, then the URL line once the dashboard answers
            lines.append(line)
            if line.startswith("the dashboard serves at "):
                break
        summary = "".join(lines)
        url = summary.split("the dashboard serves at ")[-1].split()[0] if lines else ""
        assert url.startswith("http://127.0.0.1:"), summary + proc.stderr.read()
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops the dashboard too
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert f"generated a local pseudonym key for the demo at {key}" in stderr and "[6/6]" in stderr
    assert key.read_text() not in summary + stderr
    assert "azure-conv: Azure LLM inference 2023" in summary and "1,500 requests over" in summary
    assert "stored once each, 0 dead letters" in summary and "all asset checks passed" in summary
    verdicts = _verdicts(summary)
    assert sorted(v[0] for v in verdicts) == sorted(f"{p}@{load}" for p in DEMO_CANDIDATES for load in DEMO_LOADS)
    assert all(v[1] in ("PASS", "FAIL", "INCONCLUSIVE") for v in verdicts)
    for v in verdicts:
        day = next((out / "out" / "gate").iterdir()).name
        assert (out / "out" / "gate" / day / v[0] / "gate.html").is_file()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)  # nothing is left listening

    # running it again works, from an empty demo folder, with the key kept
    again = subprocess.run([*args, "--candidates", "sarathi", "--loads", "1x", "--no-serve"], capture_output=True,
                           text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr
    assert "generated a local pseudonym key" not in again.stderr
    assert [v[:2] for v in _verdicts(again.stdout)] == \
        [v[:2] for v in verdicts if v[0] == "sarathi@1x"]  # the same verdict: every stage is deterministic


def _verdicts(summary: str) -> list[list[str]]:
    """The verdict lines of a demo summary (its ``verdicts`` block), split into words."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  verdicts"))
    block = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        block.append(line.split())
    return block


def test_ctrl_c_stops_a_large_replay_and_the_process_building_its_outputs(tmp_path):
    # from 5,000 requests the outputs are built in a child process of the replay's (replay.outputs)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "servelens", "replay", "--workload", "azure-conv", "--requests",
                             "400000", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 120
        children: list[str] = []
        while not children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the replay started no process for its outputs"
        time.sleep(2)  # replaying, its outputs being written
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "aborted" in proc.stderr.read() and "Traceback" not in proc.stdout.read()
    for pid in children:  # the child is gone too
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert not list(out.glob("*requests.parquet*")) and not (out / "manifest.json").exists()


def test_trace_convert_and_requests_derive_chain(tmp_path):
    workload = tmp_path / "w.parquet"
    assert servelens("trace", "convert", "mooncake", "--out", str(workload)).returncode == 0
    assert pq.read_schema(workload).equals(arrow_schema(WorkloadRequest), check_metadata=False)
    events = tmp_path / "e.jsonl"
    proc = servelens("trace", "convert", "burstgpt-3", "--to", "events", "--out", str(events))
    assert proc.returncode == 0 and "wrote 400 events" in proc.stdout
    proc = servelens("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"), env=KEY_ENV)
    assert proc.returncode == 0, proc.stderr
    requests = pq.read_table(tmp_path / "r.parquet")
    assert requests.num_rows == 400
    assert all(r.startswith("rq_") for r in requests["request_id"].to_pylist())  # sanitized before storage
    assert "1722ac82" not in str(requests["session_id"].to_pylist())  # BurstGPT session ids pseudonymized


def test_derive_refuses_invalid_events_and_points_to_validate(tmp_path):
    events = tmp_path / "bad.jsonl"
    events.write_text('{"event_type": "request_arrived"}\n')
    proc = servelens("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"), env=KEY_ENV)
    assert proc.returncode == 3
    assert f"error: {events}:1: $.schema_version: missing field" in proc.stderr
    assert "servelens events validate" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_shared_data_is_a_clean_error(tmp_path):
    proc = servelens("demo", "--out", str(tmp_path), env={"SERVELENS_SHARED_DIR": str(tmp_path / "nope")})
    assert proc.returncode == 3
    assert "error: shared data not found" in proc.stderr and "hint: set SERVELENS_SHARED_DIR" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_demo_never_empties_a_folder_that_is_not_a_demo_s(tmp_path):
    from servelens.demo import DEMO_MARKER, _check_demo_folder
    from servelens.errors import ServelensError

    project = tmp_path / "project"  # `servelens demo --out .` from a project root deleted its out/ (every replay)
    (project / "out" / "replay").mkdir(parents=True)
    (project / "out" / "replay" / "events.parquet").write_text("keep")
    proc = servelens("demo", "--out", str(project), "--no-serve")
    assert proc.returncode == 3 and "is not a demo folder" in proc.stderr and "this folder holds out/" in proc.stderr
    assert (project / "out" / "replay" / "events.parquet").read_text() == "keep"
    for folder, files in (("new", ()), ("marked", (DEMO_MARKER,)), ("earlier", ("engine.yaml", "deadline.yaml"))):
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_text("")
        _check_demo_folder(tmp_path / folder)  # a new folder, a demo's, or one an earlier demo wrote: emptied
    _check_demo_folder(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(ServelensError, match="is a file, not a folder"):
        _check_demo_folder(tmp_path / "file")


def test_bad_config_and_unwritable_output_are_clean_errors(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[nope]\n")
    proc = servelens("--config", str(cfg), "trace", "list")
    assert proc.returncode == 3 and "unknown config key nope" in proc.stderr and "Traceback" not in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = servelens("trace", "convert", "mooncake", "--out", str(blocker / "sub" / "w.parquet"))
    assert proc.returncode == 3 and "error:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "command",
    [["replay", "--workload", "{junk}", "--out", "{out}"], ["gate", "--baseline", "{junk}", "--candidate", "{junk}"],
     ["metrics", "export", "{junk}", "--format", "openmetrics", "--out", "{out}/m.txt"],
     ["trace", "to-blis", "{junk}", "--out", "{out}/w.yaml"], ["requests", "derive", "{junk}", "--out", "{out}/r.parquet"]],
)
def test_a_file_that_is_not_parquet_is_named_as_such_by_every_command_that_reads_one(tmp_path, command):
    junk = tmp_path / "cut.parquet"
    junk.write_bytes(b"PAR1" + bytes(100))  # a copy cut short: the magic bytes, no footer
    args = [a.replace("{junk}", str(junk)).replace("{out}", str(tmp_path / "o")) for a in command]
    proc = servelens(*args)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cut.parquet" in proc.stderr and "not a readable" in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("command", [
    ["privacy", "sanitize", "{events}", "--out", "{events}"],  # truncated its input to 4 bytes before
    ["requests", "derive", "{events}", "--out", "{events}"],
    ["metrics", "export", "{events}", "--out", "{events}"],
    ["trace", "to-blis", "{events}", "--out", "{events}"],
    ["trace", "convert", "{events}", "--out", "{events}"],
])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, command):
    events = tmp_path / "e.jsonl"
    assert servelens("trace", "convert", "burstgpt-1", "--to", "events", "--out", str(events)).returncode == 0
    before = events.read_bytes()
    proc = servelens(*[a.replace("{events}", str(events)) for a in command], env=KEY_ENV)
    assert proc.returncode == 3 and "is also an input of this command" in proc.stderr, proc.stderr
    assert events.read_bytes() == before


def test_storing_without_a_pseudonym_key_is_refused_with_a_hint(tmp_path):
    events = tmp_path / "e.jsonl"
    assert servelens("trace", "convert", "burstgpt-1", "--to", "events", "--out", str(events)).returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELENS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "servelens", "requests", "derive", str(events), "--out", str(tmp_path / "r.parquet")],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 3 and "no pseudonym key is configured" in proc.stderr
    assert "servelens privacy keygen" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.parquet").exists()


def test_privacy_keygen_rotate_and_sanitize_with_a_report(tmp_path):
    keys = tmp_path / "keys.toml"
    assert servelens("privacy", "keygen", "--out", str(keys), "--id", "k1").returncode == 0
    again = servelens("privacy", "keygen", "--out", str(keys))
    assert again.returncode == 3 and "already exists" in again.stderr
    rotated = servelens("privacy", "rotate", str(keys), "--id", "k2")
    assert rotated.returncode == 0 and "active pseudonym key is now k2 (2 keys" in rotated.stdout
    events = tmp_path / "e.jsonl"
    events.write_text(
        '{"event_id":"e1","schema_version":"1.0","event_type":"request_arrived","ts_ns":1,"engine_id":"x",'
        '"request_id":"r1","tenant":"acme","num_prompt_tokens":4,"prompt":"call me at 415-555-0132"}\n'
    )
    out = tmp_path / "clean.parquet"
    proc = servelens("privacy", "sanitize", str(events), "--out", str(out), env={"SERVELENS_PRIVACY__KEY_FILE": str(keys)})
    assert proc.returncode == 0, proc.stderr
    table = pq.read_table(out)
    assert table["pseudonym_key_id"].to_pylist() == ["k2"] and table["tenant"][0].as_py().startswith("tn_")
    assert b"415-555" not in out.read_bytes() and b"acme" not in out.read_bytes()
    report = (tmp_path / "clean.parquet.privacy.json").read_text()
    assert '"(unknown field)": 1' in report


def test_every_command_has_an_example_in_its_help():
    for args in (["events", "validate"], ["events", "schema"], ["trace", "list"], ["trace", "convert"],
                 ["trace", "stats"], ["requests", "derive"], ["privacy", "keygen"], ["privacy", "rotate"],
                 ["privacy", "sanitize"], ["broker"], ["ingest"], ["ingest", "status"], ["lake", "compact"],
                 ["lake", "sql"], ["replay"], ["gate"], ["demo"], ["dashboard"]):
        proc = servelens(*args, "--help")
        assert proc.returncode == 0 and "Example:" in proc.stdout, args


def test_schema_command_prints_both_views():
    assert '"oneOf"' in servelens("events", "schema").stdout
    assert "ts_ns: int64 not null" in servelens("events", "schema", "--format", "arrow").stdout


def test_replay_then_gate_from_the_command_line(tmp_path):
    out = tmp_path / "fcfs"
    proc = servelens("replay", "--workload", "mooncake", "--requests", "300", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "replayed 300 requests" in proc.stdout and (out / "events.parquet").is_file() and (out / "manifest.json").is_file()
    same = servelens("gate", "--baseline", str(out), "--candidate", str(out), "--out", str(tmp_path / "gate"))
    assert same.returncode == 3 and "Traceback" not in same.stderr  # a run against itself is refused
    shutil.copytree(out, tmp_path / "copy")
    gate = servelens("gate", "--baseline", str(out), "--candidate", str(tmp_path / "copy"), "--out", str(tmp_path / "gate"))
    # 300 requests are about a minute of traffic: the gate says it cannot know yet, and how long to wait
    assert gate.returncode == 2 and gate.stdout.startswith("gate: INCONCLUSIVE: replay ") and "more minutes" in gate.stdout
    assert "not enough data" in gate.stdout
    bad = servelens("replay", "--workload", "mooncake", "--engine", "gpt-9@tpu", "--out", str(tmp_path / "x"))
    assert bad.returncode == 3 and "unknown" in bad.stderr and "Traceback" not in bad.stderr


def test_dashboard_serves_until_stopped_and_refuses_what_would_fail_inside(tmp_path):
    import signal
    import socket
    import threading
    import urllib.request

    env = {"SERVELENS_LAKE__ROOT": str(tmp_path / "lake"), "SERVELENS_PATHS__OUT_DIR": str(tmp_path / "out")}
    proc = subprocess.Popen([sys.executable, "-m", "servelens", "dashboard", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    try:
        assert lines and lines[0].startswith("servelens dashboard at http://127.0.0.1:"), (lines, proc.poll())
        url = lines[0].split()[3]
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=10) as response:
            assert response.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    try:  # the Streamlit process went with it
        urllib.request.urlopen(f"{url}/_stcore/health", timeout=5)
        raise AssertionError("the dashboard still answers after the command stopped")
    except OSError:
        pass

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = servelens("dashboard", "--port", str(busy.getsockname()[1]), env=env)
    assert taken.returncode == 3 and "cannot listen on 127.0.0.1:" in taken.stderr and "hint:" in taken.stderr
    no_key = servelens("dashboard", "--port", "0", env={**env, "SERVELENS_DASHBOARD__VIEWER_TENANT": "acme",
                                                       "SERVELENS_PRIVACY__KEY_FILE": str(tmp_path / "missing.toml")})
    assert no_key.returncode == 3 and "dashboard.viewer_tenant is set" in no_key.stderr
    assert "servelens privacy keygen" in no_key.stderr
    missing = servelens("dashboard", "--port", "0", env={**env, "SERVELENS_DASHBOARD__GATE_CONFIG_FILE": str(tmp_path / "gate.yaml")})
    assert missing.returncode == 3 and "dashboard.gate_config_file" in missing.stderr
    typo = servelens("dashboard", "--port", "0", env={**env, "SERVELENS_DASHBOARD__PROT": "1"})
    assert typo.returncode == 3 and "unknown config key dashboard.prot" in typo.stderr
    for result in (taken, no_key, missing, typo):
        assert "Traceback" not in result.stderr
