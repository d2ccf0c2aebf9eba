"""A replay run end to end: manifest, byte-identical outputs, sinks, the request table, bounded memory."""

from __future__ import annotations

import gc
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.derive import derive_requests
from replay.request import Request
from replay.run import ReplayProgress, run_replay
from replay.scenario import Scenario, TenantSpec
from replay.traces import read_trace
from replay.workload import TableWorkload
from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION
from schemas.validate import validate_record
from schemas.wire import iter_table_json

SCENARIO = Scenario(name="tenants", tenants=(TenantSpec(name="a", share=1), TenantSpec(name="b", share=1)), cancel_share=0.1)


@pytest.fixture(scope="module")
def azure_slice(shared):
    return read_trace("azure-conv", shared).slice(0, 600)


def test_same_inputs_and_seed_give_byte_identical_outputs(azure_slice, tmp_path):
    a = run_replay(azure_slice, scenario=SCENARIO, seed=3, out_dir=tmp_path / "a")
    b = run_replay(azure_slice, scenario=SCENARIO, seed=3, out_dir=tmp_path / "b")
    assert (tmp_path / "a/events.parquet").read_bytes() == (tmp_path / "b/events.parquet").read_bytes()
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()
    assert a.output_sha256 == b.output_sha256 == hashlib.sha256((tmp_path / "a/events.parquet").read_bytes()).hexdigest()
    c = run_replay(azure_slice, scenario=SCENARIO, seed=4, out_dir=tmp_path / "c")
    assert c.output_sha256 != a.output_sha256 and c.run_id != a.run_id


def test_the_manifest_records_every_input(azure_slice, tmp_path):
    s = run_replay(azure_slice, scenario=SCENARIO, seed=3, out_dir=tmp_path)
    m = json.loads(s.manifest_path.read_text())
    assert m["workload"] == {"name": "workload", "sha256": TableWorkload(azure_slice).fingerprint(), "num_requests": 600}
    assert m["scenario"]["name"] == "tenants" and m["scenario"]["tenants"][1] == {"name": "b", "share": 1, "weight": 1.0}
    assert m["policy"] == {"name": "fcfs", "config": {"long_prefill_token_threshold": 0}}
    assert m["instance"]["model"]["name"] == "llama-3-8b" and m["instance"]["engine"]["max_num_batched_tokens"] == 2048
    assert m["num_kv_blocks"] == s.num_kv_blocks
    assert m["cost_model"]["name"] == "roofline" and m["cost_model"]["parameters"]["memory_efficiency"] == "0.8"
    assert (m["seed"], m["mode"], m["event_schema_version"]) == (3, "fast", SCHEMA_VERSION)
    assert "calibration" not in m and "frontend" not in m["instance"]  # an uncalibrated replay says nothing of them
    assert m["code_version"]["servelens"] and "git_commit" in m["code_version"]
    assert m["output"]["events_sha256"] == s.output_sha256 and m["output"]["num_events"] == s.num_events
    assert (m["run_id"], m["engine_id"], m["instance_id"]) == (s.run_id, f"replay-{s.run_id}", f"replay-{s.run_id}-i0")


def test_events_go_to_any_sink_in_bounded_chunks_and_match_the_parquet_file(azure_slice, tmp_path):
    chunks: list[pa.Table] = []
    s = run_replay(azure_slice, out_dir=tmp_path, sink=chunks.append, chunk_rows=2_000)
    assert len(chunks) > 5 and all(t.schema == EVENTS_SCHEMA for t in chunks)
    # the writer checks its buffer every 64 steps, so a chunk overshoots by at most that many steps' events
    assert max(t.num_rows for t in chunks) < 2_000 + 64 * 40
    streamed = pa.concat_tables(chunks)
    assert streamed.num_rows == s.num_events
    assert streamed.equals(pq.read_table(tmp_path / "events.parquet"))
    only_sink = run_replay(azure_slice, sink=lambda t: None)
    assert only_sink.events_path is None and only_sink.manifest_path is None and len(only_sink.output_sha256) == 64


def test_every_request_gets_a_complete_row_and_valid_events(azure_slice, tmp_path):
    s = run_replay(azure_slice, out_dir=tmp_path)
    rows = derive_requests(s.events_path).to_pylist()
    assert len(rows) == 600
    for row in rows:
        assert row["outcome"] == "completed" and row["engine_id"] == s.engine_id and row["instance_id"] == s.instance_id
        assert None not in (row["arrival_ns"], row["admission_ns"], row["scheduled_ns"], row["first_token_ns"],
                            row["last_token_ns"], row["finish_ns"], row["ttft_s"], row["e2e_s"])
        assert row["arrival_ns"] <= row["admission_ns"] <= row["scheduled_ns"] < row["first_token_ns"] <= row["last_token_ns"]
    by_id = {r["request_id"]: r for r in rows}
    assert [by_id[r]["num_output_tokens"] for r in azure_slice["request_id"].to_pylist()] == azure_slice["num_output_tokens"].to_pylist()
    events = pq.read_table(s.events_path)
    assert len(set(events["event_id"].to_pylist())) == events.num_rows  # unique ids
    for i, doc in enumerate(iter_table_json(events)):
        if i % 7 == 0:  # a sample of every type
            assert validate_record(json.loads(doc)).errors == (), doc


def test_progress_reports_simulated_against_wall_time(azure_slice):
    seen: list[ReplayProgress] = []
    run_replay(azure_slice, sink=lambda t: None, progress=seen.append, progress_every=100)
    assert len(seen) == 7  # after 100, 200, ... 600 arrivals, and at the end
    assert [p.num_arrived for p in seen] == [100, 200, 300, 400, 500, 600, 600]
    assert seen[-1].num_finished == seen[-1].num_requests == 600
    assert all(a.simulated_ns <= b.simulated_ns and a.wall_s <= b.wall_s for a, b in zip(seen, seen[1:]))


def test_finished_requests_are_released_by_reference_counting(azure_slice):
    """Memory follows the requests in flight: a finished request leaves no reference cycle behind
    (the replay runs with the cyclic collector paused), so none is alive after the run."""
    gc.collect()
    gc.disable()
    try:
        run_replay(azure_slice, sink=lambda t: None, chunk_rows=500)
        alive = [o for o in gc.get_objects() if isinstance(o, Request)]
    finally:
        gc.enable()
    assert alive == []


def test_a_replay_that_fails_into_an_earlier_runs_folder_leaves_that_run_as_it_was(azure_slice, tmp_path):
    # the events and the request table are written under hidden partial names and renamed into place with the
    # manifest: a replay that fails half way (here its progress callback) leaves the earlier run's three files
    # byte for byte, and no partial file
    run_replay(azure_slice, out_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["events.parquet", "manifest.json", "requests.parquet"]

    def fail(progress: ReplayProgress) -> None:
        raise RuntimeError("stopped half way")

    with pytest.raises(RuntimeError, match="stopped half way"):
        run_replay(azure_slice, out_dir=tmp_path, seed=1, progress=fail, progress_every=10)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
