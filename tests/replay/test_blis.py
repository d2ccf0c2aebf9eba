"""BLIS (inference-sim) trace v2: import, export, and a round trip unchanged in every modelled field."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml

from replay.blis import (
    MODELLED_COLUMNS,
    UNMODELLED_COLUMNS,
    BlisHeader,
    blis_events,
    blis_workload,
    parse_header,
    read_blis,
    to_blis,
    trace_rows,
    write_blis,
)
from replay.derive import derive_requests
from replay.traces import WORKLOAD_SCHEMA
from schemas.arrow import events_to_table
from schemas.events import FirstToken, RequestArrived, RequestFinished
from servelens.errors import ServelensError

# Built from inference-sim's public trace v2 description (sim/workload/tracev2.go: TraceHeader,
# TraceRecord, the column order of ExportTraceV2, statuses ok/error/timeout/incomplete, integer
# microseconds; sim/workload/slo.go: goodput_slo_targets). Values are invented.
HEADER = """\
trace_version: 3
time_unit: microseconds
created_at: "2026-11-01T10:00:00Z"
mode: real
warm_up_requests: 0
server:
  type: vllm
  model: meta-llama/Llama-3.1-8B-Instruct
  tensor_parallel: 1
  max_num_seqs: 256
  block_size: 16
network:
  measured_rtt_ms: 0.8
goodput_slo_targets:
  critical:
    ttft_ms: 500
    e2e_ms: 30000
  batch:
    e2e_ms: 120000
"""
CSV = """\
request_id,client_id,tenant_id,slo_class,vllm_priority,session_id,round_index,prefix_group,prefix_length,streaming,input_tokens,output_tokens,text_tokens,image_tokens,audio_tokens,video_tokens,reason_ratio,model,deadline_us,slo_target_us,server_input_tokens,arrival_time_us,send_time_us,first_chunk_time_us,last_chunk_time_us,num_chunks,status,error_message,finish_reason,x_request_id,adapter
0,chat-a,tenant-1,critical,0,s-1,0,sys-a,64,true,100,20,164,0,0,0,0,meta-llama/Llama-3.1-8B-Instruct,30000000,500000,164,1000000,1000210,1180000,1560000,20,ok,,stop,7f3e0c9a-1,
1,chat-a,tenant-1,critical,0,s-1,1,sys-a,64,true,250,1,314,0,0,0,0,meta-llama/Llama-3.1-8B-Instruct,0,500000,314,1200000,1200190,1400000,1400000,1,ok,,length,7f3e0c9a-2,
2,batch-b,tenant-2,batch,3,,0,,0,false,800,64,800,0,0,0,0.25,meta-llama/Llama-3.1-8B-Instruct,0,0,800,1300000,1300300,0,0,0,timeout,"deadline exceeded, after 2 s",,7f3e0c9a-3,sql-lora
3,batch-b,tenant-2,batch,3,,0,sys-b,20,false,12,5,32,0,0,0,0,meta-llama/Llama-3.1-8B-Instruct,0,0,32,1350000,1350150,1500000,1900000,2,error,"upstream reset
by peer",abort,7f3e0c9a-4,
4,chat-c,tenant-3,critical,0,,0,,0,true,40,30,40,0,0,0,0,meta-llama/Llama-3.1-8B-Instruct,0,500000,0,1400000,1400100,1450000,1700000,7,incomplete,,,7f3e0c9a-5,
"""  # noqa: E501 (a BLIS trace, one request per line)


def export(events: pa.Table, **options):
    """``to_blis`` with the events' request table derived, as the CLI does."""
    return to_blis(events, derive_requests(events), **options)


@pytest.fixture
def trace_files(tmp_path):
    (tmp_path / "trace.yaml").write_text(HEADER)
    (tmp_path / "trace.csv").write_text(CSV)
    return tmp_path / "trace.yaml", tmp_path / "trace.csv"


def test_the_header_and_rows_are_read_typed(trace_files):
    trace = read_blis(*trace_files)
    assert trace.header.mode == "real" and trace.header.block_tokens == 16
    assert dict(trace.header.goodput_slo_targets)["critical"].ttft_ms == 500
    assert trace.records["arrival_time_us"].to_pylist()[:2] == [1_000_000, 1_200_000]
    assert trace.records.num_rows == 5


def test_import_as_a_workload(trace_files):
    w = blis_workload(read_blis(*trace_files))
    assert w.schema == WORKLOAD_SCHEMA
    rows = w.to_pylist()
    assert [r["num_prompt_tokens"] for r in rows] == [164, 314, 800, 32, 40]  # prefix_length + input_tokens
    assert rows[0]["arrival_ns"] == 1_000_000_000
    assert rows[0]["prefix_block_ids"] == rows[1]["prefix_block_ids"] and len(rows[0]["prefix_block_ids"]) == 4
    assert rows[3]["prefix_block_ids"] == [rows[3]["prefix_block_ids"][0]]  # 20 tokens: one full block of 16
    assert rows[2]["prefix_block_ids"] is None and rows[2]["adapter"] == "sql-lora" and rows[2]["session_id"] is None
    assert [r["tenant"] for r in rows][:3] == ["tenant-1", "tenant-1", "tenant-2"]
    assert [r["service_class"] for r in rows][:3] == ["critical", "critical", "batch"]


def test_an_observed_trace_becomes_a_request_table_with_its_timings(trace_files):
    requests = {r["request_id"]: r for r in derive_requests(blis_events(read_blis(*trace_files))).to_pylist()}
    r0 = requests["0"]
    assert r0["ttft_s"] == pytest.approx(0.18) and r0["e2e_s"] == pytest.approx(0.56)
    assert r0["num_output_tokens"] == 20 and r0["outcome"] == "completed" and r0["itl_from_chunks"]
    assert requests["2"]["outcome"] == "timed_out" and requests["2"]["ttft_s"] is None
    assert requests["3"]["outcome"] == "error"
    assert requests["4"]["outcome"] is None  # incomplete: in flight


def test_round_trip_is_unchanged_in_every_modelled_field(trace_files, tmp_path):
    trace = read_blis(*trace_files)
    # no carry: only what servelens models; on the trace's own time origin (the default is the first arrival)
    exported = export(blis_events(trace), header=trace.header, origin_ns=0)
    header, rows = exported.header, exported.rows
    original = trace_rows(trace).to_pylist()
    for before, after in zip(original, rows.to_pylist(), strict=True):
        for name in MODELLED_COLUMNS:
            if name in ("prefix_group", "prefix_length", "input_tokens"):  # below: shared blocks, not names
                continue
            assert after[name] == before[name], (before["request_id"], name)
        # a prefix is modelled as its full shared blocks (vLLM caches no partial block): the prompt
        # stays whole, and a sub-block remainder moves from prefix_length to input_tokens. sys-b
        # (row 3) has one request: a group of one shares nothing, so it exports as no group
        total = int(before["prefix_length"]) + int(before["input_tokens"])
        assert int(after["prefix_length"]) + int(after["input_tokens"]) == total
        full = int(before["prefix_length"]) // 16 * 16 if before["prefix_group"] == "sys-a" else 0
        assert int(after["prefix_length"]) == full
    groups = [r["prefix_group"] for r in rows.to_pylist()]
    assert groups[0] == groups[1] != "" and groups[2] == groups[3] == groups[4] == ""
    assert header_dict(header) == yaml.safe_load(HEADER)
    for name in ("client_id", "send_time_us", "num_chunks", "finish_reason", "x_request_id"):
        assert name in UNMODELLED_COLUMNS


def test_round_trip_with_the_carried_columns_reproduces_the_files_exactly(trace_files, tmp_path):
    trace = read_blis(*trace_files)
    exported = export(blis_events(trace), header=trace.header, carry=trace.carry, origin_ns=0)
    header, rows = exported.header, exported.rows
    write_blis(header, rows, tmp_path / "out.yaml", tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text() == CSV
    assert yaml.safe_load((tmp_path / "out.yaml").read_text()) == yaml.safe_load(HEADER)
    again = read_blis(tmp_path / "out.yaml", tmp_path / "out.csv")
    assert again.records.equals(trace.records)


def test_a_servelens_replay_exports_and_comes_back(tmp_path):
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    workload = make_workload([i * 40_000_000 for i in range(12)], [50 + 10 * i for i in range(12)], [3 + i for i in range(12)],
                             service_class=["interactive"] * 12, tenant=["t-a", "t-b"] * 6)
    summary = run_replay(workload, out_dir=tmp_path / "run")
    import pyarrow.parquet as pq

    events = pq.read_table(summary.events_path)
    exported = export(events, header=BlisHeader(mode="replayed"))
    header, rows = exported.header, exported.rows
    write_blis(header, rows, tmp_path / "r.yaml", tmp_path / "r.csv")
    back = read_blis(tmp_path / "r.yaml", tmp_path / "r.csv")
    assert back.header.mode == "replayed"
    w = blis_workload(back)
    assert w["num_prompt_tokens"].to_pylist() == [50 + 10 * i for i in range(12)]
    assert w["num_output_tokens"].to_pylist() == [3 + i for i in range(12)]
    assert back.records["status"].to_pylist() == ["ok"] * 12
    before = derive_requests(events).to_pylist()
    after = derive_requests(blis_events(back)).to_pylist()
    for a, b in zip(before, after):  # microsecond resolution
        assert abs(a["ttft_s"] - b["ttft_s"]) < 2e-6 and abs(a["e2e_s"] - b["e2e_s"]) < 2e-6


def header_dict(header: BlisHeader) -> dict:
    from replay.blis import header_yaml

    return yaml.safe_load(header_yaml(header))


@pytest.mark.parametrize("unit", ["microseconds", "us"])  # blis run and replay write the first, blis observe the second
def test_both_of_blis_s_names_for_microseconds_are_read(unit, tmp_path):
    assert parse_header(f"trace_version: 3\ntime_unit: {unit}\nmode: replayed\n").time_unit == unit
    (tmp_path / "t.yaml").write_text(HEADER.replace("time_unit: microseconds", f"time_unit: {unit}"))
    (tmp_path / "t.csv").write_text(CSV)
    trace = read_blis(tmp_path / "t.yaml", tmp_path / "t.csv")
    assert blis_workload(trace)["arrival_ns"].to_pylist()[:2] == [1_000_000_000, 1_200_000_000]
    assert BlisHeader().time_unit == "microseconds"  # what servelens writes, as blis run and replay do


@pytest.mark.parametrize(
    ("text", "message"),
    [("trace_version: 2\ntime_unit: ms\nmode: real\n", "time_unit"), ("trace_version: 9\ntime_unit: us\n", "not supported"),
     ("trace_version: 2\ntime_unit: us\ncolour: red\n", "unknown key"), ("- a\n", "mapping")],
)
def test_bad_headers_are_clear_errors(text, message):
    with pytest.raises(ServelensError, match=message):
        parse_header(text)


def test_bad_rows_name_the_row_and_column(tmp_path):
    (tmp_path / "h.yaml").write_text("trace_version: 2\ntime_unit: us\nmode: real\n")
    (tmp_path / "d.csv").write_text(CSV.replace("1000000,1000210", "soon,1000210"))
    with pytest.raises(ServelensError, match="row 1, column arrival_time_us"):
        read_blis(tmp_path / "h.yaml", tmp_path / "d.csv")
    (tmp_path / "d.csv").write_text("request_id,status\n0,ok\n")
    with pytest.raises(ServelensError, match="missing trace v2 column"):
        read_blis(tmp_path / "h.yaml", tmp_path / "d.csv")


def test_the_cli_exports_and_imports_and_trace_readers_know_the_format(trace_files, tmp_path):
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from replay.traces import read_trace
    from servelens.cli import cli

    _, data = trace_files
    assert read_trace(str(data))["num_prompt_tokens"].to_pylist() == [164, 314, 800, 32, 40]
    runner = CliRunner()
    result = runner.invoke(cli, ["trace", "from-blis", str(data), "--out", str(tmp_path / "e.parquet")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["trace", "to-blis", str(tmp_path / "e.parquet"), "--out", str(tmp_path / "x" / "t.csv"),
                                 "--mode", "replayed"])
    assert result.exit_code == 0, result.output
    back = read_blis(tmp_path / "x" / "t.yaml", tmp_path / "x" / "t.csv")
    assert back.header.mode == "replayed" and back.records.num_rows == 5
    assert pq.read_table(tmp_path / "e.parquet").num_rows > 5
    lonely = tmp_path / "lonely.csv"
    lonely.write_text(CSV)
    result = runner.invoke(cli, ["trace", "from-blis", str(lonely), "--out", str(tmp_path / "z.parquet")])
    assert result.exit_code == 3 and "no trace v2 header" in result.output


def test_an_observed_blis_trace_is_replayed_and_judged_by_the_gate(tmp_path):
    """servelens run -> BLIS trace (observed timings) -> baseline; its workload replayed -> candidate."""
    import dataclasses

    import numpy as np
    import pyarrow.parquet as pq

    from replay.gate import compare_runs, default_config, load_run
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    rng = np.random.default_rng(5)
    n = 120
    workload = make_workload(np.cumsum(rng.exponential(0.08e9, n)).astype(np.int64).tolist(), rng.integers(50, 1500, n).tolist(),
                             rng.integers(5, 300, n).tolist(), service_class=["interactive"] * n, tenant=[f"t{i % 6}" for i in range(n)])
    recorded = run_replay(workload, out_dir=tmp_path / "recorded")
    exported = export(pq.read_table(recorded.events_path), header=BlisHeader(mode="real"))
    header, rows = exported.header, exported.rows
    write_blis(header, rows, tmp_path / "t.yaml", tmp_path / "t.csv")
    trace = read_blis(tmp_path / "t.yaml", tmp_path / "t.csv")
    (tmp_path / "observed").mkdir()
    pq.write_table(blis_events(trace), tmp_path / "observed" / "events.parquet")
    run_replay(blis_workload(trace), out_dir=tmp_path / "replayed")
    # ten seconds of traffic: quarter-second windows, so the gate has the 30 windows it needs to decide
    config = dataclasses.replace(default_config(), window_s=0.25, min_window_requests=1)
    verdict = compare_runs(load_run(tmp_path / "observed", "baseline"), load_run(tmp_path / "replayed", "candidate"), config)
    by_name = {(m.metric, m.group): m for m in verdict.metrics}
    for name in ("ttft_p99_s", "e2e_p99_s", "goodput_rps", "attainment"):  # the same workload, the same timings
        assert by_name[(name, "")].status == "pass", by_name[(name, "")].reason
    # a trace's ITL is one chunk per request and it has no schedule: not comparable (docs/interop.md)
    assert by_name[("max_queue_s", "")].status != "pass"


def _lifecycle(rid: str, arrival_ns: int, *, max_output: int | None = None, finish: tuple[str, int] | None = None,
               first_ns: int | None = None, blocks: list[int] | None = None) -> list:
    """Hand-made events of one request: its arrival, optionally a first token and a finish."""
    common = {"engine_id": "e", "request_id": rid}
    events = [RequestArrived(event_id=f"{rid}:a", ts_ns=arrival_ns, num_prompt_tokens=1000, max_output_tokens=max_output,
                             prefix_block_ids=blocks, **common)]
    if first_ns is not None:
        events.append(FirstToken(event_id=f"{rid}:f", ts_ns=first_ns, **common))
    if finish is not None:
        events.append(RequestFinished(event_id=f"{rid}:x", ts_ns=(first_ns or arrival_ns) + 1000, outcome=finish[0],
                                      num_output_tokens=finish[1], **common))
    return events


def test_output_lengths_come_from_what_the_events_record_and_the_unknown_are_counted():
    events = events_to_table([
        *_lifecycle("r0", 0, first_ns=5_000, finish=("completed", 7)),  # produced 7: the length
        *_lifecycle("r1", 10_000, max_output=20, finish=("timed_out", 0)),  # its max_tokens: the intended length
        *_lifecycle("r2", 20_000),  # in flight, no max_tokens: unknown
        *_lifecycle("r3", 30_000, finish=("rejected", 0)),  # rejected, no max_tokens: unknown
        *_lifecycle("r4", 40_000, max_output=9),  # in flight with max_tokens 9
    ])
    exported = export(events)
    assert exported.rows["output_tokens"].to_pylist() == ["7", "20", "0", "0", "9"]
    assert exported.unknown_output_ids == ("2", "3")  # BLIS ids: r0.. are renumbered in arrival order
    (warning,) = exported.warnings
    assert warning.startswith("2 of 5 requests have no recorded output length") and "request_id 2, 3" in warning
    assert exported.comments[0] == f"servelens: warning: {warning}"


def test_a_workload_converted_to_events_keeps_its_output_lengths():
    from replay.workload import arrival_events
    from tests.replay.conftest import make_workload

    workload = make_workload([0, 10**9, 2 * 10**9], [100, 200, 300], [11, 0, 33])
    exported = export(arrival_events(workload, engine_id="trace:w"))
    assert exported.rows["output_tokens"].to_pylist() == ["11", "0", "33"]
    assert exported.warnings == ()


# A Mooncake trace (timestamps ms, 512-token hash ids) with known shared prefixes: r0, r2 and r4 share
# blocks 1, 2, 3; r1 shares 1, 2 with them only (its group would be a group of one); r3 shares nothing.
MOONCAKE = """\
{"timestamp": 5000, "input_length": 1600, "output_length": 7, "hash_ids": [1, 2, 3, 10]}
{"timestamp": 6000, "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 11]}
{"timestamp": 6500, "input_length": 1700, "output_length": 3, "hash_ids": [1, 2, 3, 12]}
{"timestamp": 7000, "input_length": 600, "output_length": 5, "hash_ids": [5, 6]}
{"timestamp": 7500, "input_length": 2100, "output_length": 11, "hash_ids": [1, 2, 3, 13, 14]}
"""


def test_a_mooncake_trace_keeps_its_prefix_groups_block_size_and_output_lengths(tmp_path):
    from replay.traces import MOONCAKE_BLOCK_TOKENS, read_trace
    from replay.workload import arrival_events

    (tmp_path / "mc.jsonl").write_text(MOONCAKE)
    workload = read_trace(str(tmp_path / "mc.jsonl"))
    exported = export(arrival_events(workload, engine_id="trace:mc"), block_tokens=MOONCAKE_BLOCK_TOKENS)
    rows = exported.rows.to_pylist()
    group = rows[0]["prefix_group"]
    assert group and [r["prefix_group"] for r in rows] == [group, "", group, "", group]
    assert [int(r["prefix_length"]) for r in rows] == [1536, 0, 1536, 0, 1536]  # 3 blocks of 512
    assert [int(r["input_tokens"]) for r in rows] == [64, 1100, 164, 600, 564]
    assert exported.header.server.block_size == 512 and exported.warnings == ()
    assert not any("block ids taken as" in note for note in exported.notes)
    write_blis(exported.header, exported.rows, tmp_path / "t.yaml", tmp_path / "t.csv", exported.comments)
    back = blis_workload(read_blis(tmp_path / "t.yaml", tmp_path / "t.csv")).to_pylist()
    assert [r["num_output_tokens"] for r in back] == [7, 9, 3, 5, 11]
    assert [r["num_prompt_tokens"] for r in back] == [1600, 1100, 1700, 600, 2100]
    shared = back[0]["prefix_block_ids"]
    assert len(shared) == 3 and back[2]["prefix_block_ids"] == back[4]["prefix_block_ids"] == shared
    assert back[1]["prefix_block_ids"] is None and back[3]["prefix_block_ids"] is None
    assert [r["prefix_block_size_tokens"] for r in back] == [512, None, 512, None, 512]


def test_a_group_s_prefix_is_cut_to_its_shortest_prompt_and_unsaid_block_sizes_are_noted():
    from replay.workload import arrival_events
    from tests.replay.conftest import make_workload

    # two prompts with the same two ids, the second block partial: 700 and 600 tokens of 512-token blocks
    workload = make_workload([0, 10], [700, 600], [1, 1], prefix_block_ids=[[8, 9], [8, 9]])
    rows = export(arrival_events(workload, engine_id="w"), block_tokens=512).rows.to_pylist()
    assert [(r["prefix_length"], r["input_tokens"]) for r in rows] == [("600", "100"), ("600", "0")]
    unsaid = export(arrival_events(workload, engine_id="w"))  # no block size given, none in the header
    assert unsaid.rows["prefix_length"].to_pylist() == ["32", "32"]  # two ids of vLLM's 16 tokens
    note = unsaid.notes[-1]
    assert note.startswith("prefix block ids taken as 16 tokens each") and unsaid.comments[-1] == f"servelens: {note}"


def test_the_bundled_mooncake_trace_keeps_its_shared_prefixes(shared):
    from replay.traces import read_trace
    from replay.workload import arrival_events

    workload = read_trace("mooncake", shared)
    rows = export(arrival_events(workload, engine_id="trace:mooncake"), block_tokens=512).rows.to_pylist()
    hash_ids = workload["prefix_block_ids"].to_pylist()
    prompts = workload["num_prompt_tokens"].to_pylist()
    members: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        assert int(r["prefix_length"]) + int(r["input_tokens"]) == prompts[i] and int(r["input_tokens"]) >= 0
        if r["prefix_group"]:
            members.setdefault(r["prefix_group"], []).append(i)
    assert len(members) == 565  # was one group of 16-token blocks
    for indices in members.values():
        (length,) = {int(rows[i]["prefix_length"]) for i in indices}  # BLIS gives a group one prefix length
        blocks = -(-length // 512)
        assert len(indices) > 1 and len({tuple(hash_ids[i][:blocks]) for i in indices}) == 1  # shared whole
        assert length == min([blocks * 512] + [prompts[i] for i in indices])


def test_times_start_at_the_first_arrival_and_the_horizon_holds_every_recorded_request(tmp_path):
    t0 = 1_700_000_000 * 10**9  # wall-clock arrivals, as real telemetry has them
    events = events_to_table([
        *_lifecycle("r0", t0 + 2_000_000, first_ns=t0 + 2_500_000, finish=("completed", 1)),
        *_lifecycle("r1", t0 + 3_000_000, first_ns=t0 + 9_000_000, finish=("completed", 1)),  # finished at +9.001 ms
    ])
    exported = export(events)
    rows = exported.rows.to_pylist()
    assert [r["arrival_time_us"] for r in rows] == ["0", "1000"] and [r["send_time_us"] for r in rows] == ["0", "1000"]
    assert [r["first_chunk_time_us"] for r in rows] == ["500", "7000"]
    assert [r["last_chunk_time_us"] for r in rows] == ["500", "7000"]
    assert exported.origin_ns == t0 + 2_000_000
    # blis replay's default horizon is 2 x the last arrival (2,000 us); the last request finished at 7,001 us
    assert exported.default_horizon_us == 2000 and exported.horizon_us == 7002
    assert exported.notes[1].endswith("run it with --horizon 7002")
    early = export(events.filter(pc.equal(events["request_id"], "r0")))  # one request at 0: BLIS's 600 s
    assert early.default_horizon_us == early.horizon_us == 600_000_000 and "without --horizon" in early.notes[1]
    write_blis(exported.header, exported.rows, tmp_path / "t.yaml", tmp_path / "t.csv", exported.comments)
    text = (tmp_path / "t.yaml").read_text()
    assert "# servelens: the recorded requests end after blis replay's default horizon" in text
    assert read_blis(tmp_path / "t.yaml", tmp_path / "t.csv").records["arrival_time_us"].to_pylist() == [0, 1000]


def test_deadlines_and_carried_send_times_move_with_the_origin(trace_files):
    trace = read_blis(*trace_files)  # first arrival 1,000,000 us; row 0's deadline 30,000,000 us
    rows = export(blis_events(trace), header=trace.header, carry=trace.carry).rows.to_pylist()
    assert [r["arrival_time_us"] for r in rows] == ["0", "200000", "300000", "350000", "400000"]
    assert rows[0]["deadline_us"] == "29000000" and rows[0]["slo_target_us"] == "500000"  # relative to arrival
    assert [r["send_time_us"] for r in rows] == ["210", "200190", "300300", "350150", "400100"]  # as carried, moved
    assert rows[0]["first_chunk_time_us"] == "180000" and rows[2]["first_chunk_time_us"] == "0"  # 0: no token


def test_the_cli_exports_events_jsonl_workloads_and_traces_alike(tmp_path):
    from click.testing import CliRunner

    from servelens.cli import cli

    (tmp_path / "mc.jsonl").write_text(MOONCAKE)
    runner = CliRunner()
    result = runner.invoke(cli, ["trace", "convert", str(tmp_path / "mc.jsonl"), "--to", "events", "--out",
                                 str(tmp_path / "e.jsonl")])
    assert result.exit_code == 0, result.output
    runs = {"trace": [str(tmp_path / "mc.jsonl")],  # its block size is the trace's: 512
            "events": [str(tmp_path / "e.jsonl"), "--block-tokens", "512"]}  # events do not record it
    for name, args in runs.items():
        result = runner.invoke(cli, ["trace", "to-blis", *args, "--out", str(tmp_path / name / "t.csv")])
        assert result.exit_code == 0, result.output
        assert result.stderr == "" and "run it without --horizon" in result.stdout
        back = read_blis(tmp_path / name / "t.yaml", tmp_path / name / "t.csv")
        assert back.header.time_unit == "microseconds" and back.header.block_tokens == 512
        assert back.records["arrival_time_us"].to_pylist() == [0, 1_000_000, 1_500_000, 2_000_000, 2_500_000]
        assert back.records["output_tokens"].to_pylist() == [7, 9, 3, 5, 11]
        assert back.records["prefix_length"].to_pylist() == [1536, 0, 1536, 0, 1536]
    assert (tmp_path / "trace" / "t.csv").read_text() == (tmp_path / "events" / "t.csv").read_text()


def test_the_cli_warns_of_unknown_output_lengths_and_refuses_what_it_cannot_read(tmp_path):
    from click.testing import CliRunner

    from schemas.wire import iter_table_json, write_jsonl
    from servelens.cli import cli

    write_jsonl(iter_table_json(events_to_table([*_lifecycle("a", 0), *_lifecycle("b", 10**6)])), tmp_path / "e.jsonl")
    runner = CliRunner()
    result = runner.invoke(cli, ["trace", "to-blis", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "t.csv")])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning: 2 of 2 requests have no recorded output length")
    assert "# servelens: warning: 2 of 2 requests have no recorded output length" in (tmp_path / "t.yaml").read_text()
    (tmp_path / "bad.jsonl").write_text('{"event_type": "request_arrived", "ts_ns": "soon"}\n')
    bad = runner.invoke(cli, ["trace", "to-blis", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "u.csv")])
    assert bad.exit_code == 3 and "bad.jsonl:1:" in bad.stderr and "servelens events validate" in bad.stderr
    (tmp_path / "odd.csv").write_text("when,what\n1,2\n")
    odd = runner.invoke(cli, ["trace", "to-blis", str(tmp_path / "odd.csv"), "--out", str(tmp_path / "v.csv")])
    assert odd.exit_code == 3 and "not one of the inputs a BLIS export reads" in odd.stderr
    for refused in (bad, odd):  # a clean message, not an internal error
        assert refused.stderr.startswith("error: ") and "Traceback" not in refused.output
        assert "internal error" not in refused.output


def test_rounds_are_numbered_within_each_session_in_arrival_order():
    events = events_to_table([RequestArrived(event_id=f"{i}", ts_ns=i * 1000, engine_id="e", request_id=f"r{i}",
                                             num_prompt_tokens=10, max_output_tokens=1, session_id=session)
                              for i, session in enumerate(["a", "b", None, "a", "b", "a"])])
    # BLIS's closed-loop replay refuses a session whose rounds are not 0, 1, 2, ...
    assert export(events).rows["round_index"].to_pylist() == ["0", "0", "0", "1", "1", "2"]


def test_recorded_events_exported_as_real_traffic_have_their_times_rounded_down_to_the_privacy_quantum(tmp_path):
    """A shareable trace keeps order and bursts but not sub-quantum timing (docs/privacy.md, Exported traces):
    a 3 ms TTFT, the size of a prefix-cache hit's saving, is not in it; --mode replayed and 0 keep exact times."""
    from click.testing import CliRunner

    from schemas.wire import iter_table_json, write_jsonl
    from servelens.cli import cli

    ms = 1_000_000
    events = [*_lifecycle("a", 1_250 * ms, first_ns=1_253 * ms, finish=("completed", 5)),
              *_lifecycle("b", 1_420 * ms, first_ns=1_561 * ms, finish=("completed", 5))]
    write_jsonl(iter_table_json(events_to_table(events)), tmp_path / "e.jsonl")
    runner = CliRunner()
    times = {}
    for name, args in {"real": [], "exact": ["--time-quantum-ms", "0"], "replayed": ["--mode", "replayed"],
                       "coarser": ["--time-quantum-ms", "500"]}.items():
        result = runner.invoke(cli, ["trace", "to-blis", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / name / "t.csv"),
                                     *args])
        assert result.exit_code == 0, result.output
        back = read_blis(tmp_path / name / "t.yaml", tmp_path / name / "t.csv").records
        times[name] = (back["arrival_time_us"].to_pylist(), back["first_chunk_time_us"].to_pylist())
        rounded = "every time was rounded down to" in (tmp_path / name / "t.yaml").read_text()
        assert rounded == (name in ("real", "coarser")), name
    # from the first arrival (1,200 ms rounded, 1,250 exact), in microseconds
    assert times["real"] == ([0, 200_000], [0, 300_000])
    assert times["exact"] == times["replayed"] == ([0, 170_000], [3_000, 311_000])
    assert times["coarser"] == ([0, 0], [0, 500_000])  # 1,000 ms is the origin; b's first token at 1,500


def test_a_header_that_is_not_utf8_is_an_error_naming_the_file(trace_files):
    header, data = trace_files
    header.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ServelensError, match=r"BLIS trace header .*trace\.yaml is not valid YAML: not UTF-8 text"):
        read_blis(header, data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("mode: real", "mode: fake"), r"trace\.yaml: mode 'fake' is not a trace v2 mode"),
        (("warm_up_requests: 0", "warm_up_requests: -5"), r"trace\.yaml: warm_up_requests -5 is not a count"),
        (("warm_up_requests: 0", "warm_up_requests: 99999999"),
         r"trace\.yaml: warm_up_requests 99,999,999 is more than the trace's 5 requests"),
    ],
)
def test_a_header_with_a_bad_mode_or_warm_up_count_is_refused(trace_files, change, message):
    header, data = trace_files
    header.write_text(HEADER.replace(*change))
    with pytest.raises(ServelensError, match=message):
        read_blis(header, data)


def test_a_negative_arrival_or_a_header_only_csv_is_refused_for_events_and_workloads_alike(trace_files):
    header, data = trace_files
    data.write_text(CSV.replace(",164,1000000,1000210,", ",164,-1000000,1000210,"))
    with pytest.raises(ServelensError, match=r"trace\.csv: row 1, column arrival_time_us: -1000000 is negative"):
        blis_events(read_blis(header, data))
    data.write_text(CSV.splitlines()[0] + "\n")
    with pytest.raises(ServelensError, match=r"trace\.csv: the trace holds no requests"):
        read_blis(header, data)
