"""Trace converters: real bundled traces read exactly, in their own order, with nothing invented."""

from __future__ import annotations

import csv
import json
import re
from datetime import UTC, datetime

import pytest

from replay.traces import BUNDLED_TRACES, WORKLOAD_SCHEMA, read_trace
from replay.workload import arrival_events, burstiness
from schemas.arrow import table_to_events
from schemas.validate import validate_record
from schemas.wire import iter_table_json
from servelens.errors import ServelensError


def _azure_ns(stamp: str) -> int:
    """Independent parse of '2023-11-16 18:15:46.6805900' (UTC) to epoch ns, with integer arithmetic."""
    base, _, frac = stamp.partition(".")
    seconds = int(datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp())
    return seconds * 10**9 + int(frac.ljust(9, "0"))


def test_azure_conversation_trace_is_read_exactly_and_in_order(shared):
    w = read_trace("azure-conv", shared)
    assert w.schema == WORKLOAD_SCHEMA
    assert w.num_rows == 19_366
    with open(shared / BUNDLED_TRACES["azure-conv"].relative_path) as fh:
        rows = list(csv.DictReader(fh))
    assert w["arrival_ns"].to_pylist() == [_azure_ns(r["TIMESTAMP"]) for r in rows]
    assert w["num_prompt_tokens"].to_pylist() == [int(r["ContextTokens"]) for r in rows]
    assert w["num_output_tokens"].to_pylist() == [int(r["GeneratedTokens"]) for r in rows]
    assert w["arrival_ns"][0].as_py() == 1_700_158_546_680_590_000  # 2023-11-16T18:15:46.6805900Z, by hand
    assert w["request_id"][0].as_py() == "azure-conv-000000"
    # nothing the trace lacks is invented
    for name in ("tenant", "service_class", "model", "adapter", "session_id", "prefix_block_ids", "cancel_after_ns"):
        assert w[name].null_count == w.num_rows, name


def test_azure_burstiness_matches_the_published_figures(shared):
    """../shared/traces/README.md: inter-arrival CV 1.09, peak/mean per 1 s = 2.9."""
    b = burstiness(read_trace("azure-conv", shared)["arrival_ns"].to_numpy())
    assert round(b.interarrival_cv, 2) == 1.09
    assert round(b.peak_to_mean_1s, 1) == 2.9


def test_mooncake_keeps_prefix_blocks_and_millisecond_offsets(shared):
    w = read_trace("mooncake", shared)
    assert w.num_rows == 3_993
    with open(shared / BUNDLED_TRACES["mooncake"].relative_path) as fh:
        rows = [json.loads(line) for line in fh]
    assert w["arrival_ns"].to_pylist() == [r["timestamp"] * 1_000_000 for r in rows]
    assert w["prefix_block_ids"].to_pylist() == [r["hash_ids"] for r in rows]
    assert w["num_prompt_tokens"].to_pylist() == [r["input_length"] for r in rows]
    assert set(w["prefix_block_size_tokens"].to_pylist()) == {512}


@pytest.mark.parametrize(("name", "num_failed", "num_no_session"), [("burstgpt-1", 17, 400), ("burstgpt-3", 1, 6)])
def test_burstgpt_flags_failed_rows_and_keeps_models_and_sessions(shared, name, num_failed, num_no_session):
    w = read_trace(name, shared)
    with open(shared / BUNDLED_TRACES[name].relative_path) as fh:
        rows = list(csv.DictReader(fh))
    assert w.num_rows == len(rows) == 400
    assert w["arrival_ns"].to_pylist() == [int(float(r["Timestamp"])) * 10**9 for r in rows]  # whole seconds here
    assert w["model"].to_pylist() == [r["Model"] for r in rows]
    assert w["failed"].to_pylist() == [r["Response tokens"] == "0" for r in rows]
    assert sum(w["failed"].to_pylist()) == num_failed
    assert w["session_id"].null_count == num_no_session


def test_fractional_seconds_are_converted_exactly(tmp_path):
    path = tmp_path / "frac.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0.1,ChatGPT,1,1,2,API log\n19440110.123456789,GPT-4,5,0,5,API log\n"
    )
    w = read_trace(str(path))
    assert w["arrival_ns"].to_pylist() == [100_000_000, 19_440_110_123_456_789]
    assert w["request_id"].to_pylist() == ["frac-000000", "frac-000001"]


def test_unknown_format_and_missing_columns_are_clear_errors(tmp_path):
    odd = tmp_path / "odd.csv"
    odd.write_text("when,what\n1,2\n")
    with pytest.raises(ServelensError, match="unknown trace format") as err:
        read_trace(str(odd))
    assert "azure-conv" in err.value.hint
    partial = tmp_path / "partial.csv"
    partial.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,3\n")
    with pytest.raises(ServelensError, match="missing column"):
        read_trace(str(partial))
    with pytest.raises(ServelensError, match="neither a bundled trace nor a file"):
        read_trace("no-such-trace")


def test_a_cell_that_is_not_its_columns_type_and_an_empty_trace_are_clear_errors(tmp_path):
    header = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    for cell, message in (("abc", "Failed to parse string: 'abc'"), ("99999999999999999999", "truncated")):
        bad = tmp_path / "burstgpt.csv"
        bad.write_text(header + f"5,ChatGPT,{cell},18,490,Conversation log\n")
        with pytest.raises(ServelensError, match=f"not a readable burstgpt trace: .*{message}"):
            read_trace(str(bad))
    empty = tmp_path / "azure.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ServelensError, match="the trace holds no requests"):
        read_trace(str(empty))


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("azure.csv", AZURE_HEADER + "2023-11-16 18:15:46,5,4\n2023-11-16 18:15:47,-374,44\n",
         "data row 2 (request azure-000001) has a negative prompt length: num_prompt_tokens -374"),
        ("burstgpt.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                         "5,ChatGPT,472,-18,490,Conversation log\n",
         "data row 1 (request burstgpt-000000) has a negative output length: num_output_tokens -18"),
        ("mooncake.jsonl", '{"timestamp": -5, "input_length": 10, "output_length": 6, "hash_ids": [0]}\n',
         "data row 1 (request mooncake-000000) has a negative arrival time (before 1970"),
        ("azure.csv", AZURE_HEADER + ",3,44\n", "data row 1 has no arrival time"),
        ("azure.csv", AZURE_HEADER + "2023-11-16 18:15:46,5,4\n2023-11-16 18:15:47,3,\n", "data row 2 has no output length"),
        ("mooncake.jsonl", '{"timestamp": 5, "input_length": null, "output_length": 6}\n', "data row 1 has no prompt length"),
    ],
)
def test_a_negative_or_empty_count_or_time_is_named_by_its_row(tmp_path, name, text, message):
    """These were written as workloads the replay refuses, or were internal errors (a null in a required column)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ServelensError, match=re.escape(message)) as err:
        read_trace(str(path))
    assert str(path) in err.value.message and err.value.hint


def test_arrival_events_are_valid_and_one_per_request(shared):
    w = read_trace("burstgpt-3", shared)
    events = arrival_events(w, engine_id="trace:burstgpt-3")
    assert events.num_rows == w.num_rows
    typed = table_to_events(events)
    assert [e.request_id for e in typed] == w["request_id"].to_pylist()
    assert [e.ts_ns for e in typed] == w["arrival_ns"].to_pylist()
    assert all(e.model in ("ChatGPT", "GPT-4") for e in typed)
    for doc in iter_table_json(events):
        assert validate_record(json.loads(doc)).errors == ()
