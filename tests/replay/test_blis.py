"""BLIS (inference-sim) trace v2: import, export, and a round trip unchanged in every modelled field."""

from __future__ import annotations

import pyarrow as pa
import pytest
import yaml

from pipelines.tables import derive_requests
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
from replay.traces import WORKLOAD_SCHEMA
from servelens.errors import ServelensError

# Built from inference-sim's public trace v2 description (sim/workload/tracev2.go: TraceHeader,
# TraceRecord, the column order of ExportTraceV2, statuses ok/error/timeout/incomplete, integer
# microseconds; sim/workload/slo.go: goodput_slo_targets). Values are invented.
HEADER = """\
trace_version: 3
time_unit: us
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
"""


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
    header, rows = to_blis(blis_events(trace), header=trace.header)  # no carry: only what servelens models
    original = trace_rows(trace).to_pylist()
    for before, after in zip(original, rows.to_pylist(), strict=True):
        for name in MODELLED_COLUMNS:
            if name in ("prefix_group", "prefix_length", "input_tokens"):  # below: shared blocks, not names
                continue
            assert after[name] == before[name], (before["request_id"], name)
        # a prefix is modelled as its full shared blocks (vLLM caches no partial block): the prompt
        # stays whole, and a sub-block remainder moves from prefix_length to input_tokens
        total = int(before["prefix_length"]) + int(before["input_tokens"])
        assert int(after["prefix_length"]) + int(after["input_tokens"]) == total
        full = int(before["prefix_length"]) // 16 * 16 if before["prefix_group"] else 0
        assert int(after["prefix_length"]) == full
    groups = [r["prefix_group"] for r in rows.to_pylist()]
    assert groups[0] == groups[1] != groups[3] and groups[2] == groups[4] == ""
    assert header_dict(header) == yaml.safe_load(HEADER)
    for name in ("client_id", "send_time_us", "num_chunks", "finish_reason", "x_request_id"):
        assert name in UNMODELLED_COLUMNS


def test_round_trip_with_the_carried_columns_reproduces_the_files_exactly(trace_files, tmp_path):
    trace = read_blis(*trace_files)
    header, rows = to_blis(blis_events(trace), header=trace.header, carry=trace.carry)
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
    header, rows = to_blis(events, header=BlisHeader(mode="replayed"))
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
    header, rows = to_blis(pq.read_table(recorded.events_path), header=BlisHeader(mode="real"))
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
