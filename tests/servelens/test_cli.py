"""The command line, run as users run it: a real process, clean errors, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq

from schemas.records import WorkloadRequest
from schemas.arrow import arrow_schema


def servelens(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelens", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_demo_prints_the_summary_of_the_azure_conversation_trace(tmp_path):
    proc = servelens("demo", "--out", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr
    assert "azure-conv: Azure LLM inference 2023" in proc.stdout
    assert "19,366 requests over 3,501.7 s (5.53 req/s), 0 failed" in proc.stdout
    assert "prompt p50 1,020 / p99 4,142; output p50 129 / p99 601" in proc.stdout
    assert "19,366 rows in" in proc.stdout and "every one valid" in proc.stdout
    assert "[4/4]" in proc.stderr  # progress goes to stderr, the summary to stdout
    requests = pq.read_table(tmp_path / "demo" / "requests.parquet")
    assert requests.num_rows == 19_366


def test_trace_convert_and_requests_derive_chain(tmp_path):
    workload = tmp_path / "w.parquet"
    assert servelens("trace", "convert", "mooncake", "--out", str(workload)).returncode == 0
    assert pq.read_schema(workload).equals(arrow_schema(WorkloadRequest), check_metadata=False)
    events = tmp_path / "e.jsonl"
    proc = servelens("trace", "convert", "burstgpt-3", "--to", "events", "--out", str(events))
    assert proc.returncode == 0 and "wrote 400 events" in proc.stdout
    proc = servelens("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"))
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(tmp_path / "r.parquet").num_rows == 400


def test_derive_refuses_invalid_events_and_points_to_validate(tmp_path):
    events = tmp_path / "bad.jsonl"
    events.write_text('{"event_type": "request_arrived"}\n')
    proc = servelens("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"))
    assert proc.returncode == 2
    assert f"error: {events}:1: $.schema_version: missing field" in proc.stderr
    assert "servelens events validate" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_shared_data_is_a_clean_error(tmp_path):
    proc = servelens("demo", "--out", str(tmp_path), env={"SERVELENS_SHARED_DIR": str(tmp_path / "nope")})
    assert proc.returncode == 2
    assert "error: shared data not found" in proc.stderr and "hint: set SERVELENS_SHARED_DIR" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_and_unwritable_output_are_clean_errors(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[nope]\n")
    proc = servelens("--config", str(cfg), "trace", "list")
    assert proc.returncode == 2 and "unknown config key nope" in proc.stderr and "Traceback" not in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = servelens("trace", "convert", "mooncake", "--out", str(blocker / "sub" / "w.parquet"))
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_every_command_has_an_example_in_its_help():
    for args in (["events", "validate"], ["events", "schema"], ["trace", "list"], ["trace", "convert"],
                 ["trace", "stats"], ["requests", "derive"], ["demo"]):
        proc = servelens(*args, "--help")
        assert proc.returncode == 0 and "Example:" in proc.stdout, args


def test_schema_command_prints_both_views():
    assert '"oneOf"' in servelens("events", "schema").stdout
    assert "ts_ns: int64 not null" in servelens("events", "schema", "--format", "arrow").stdout
