"""Validation of untrusted records: every error reported with its line, field path, type and expectation."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.arrow import events_to_table
from schemas.events import RequestArrived, StepExecuted
from schemas.validate import (
    BAD_VERSION,
    INCONSISTENT,
    MISSING_FIELD,
    NOT_ALLOWED,
    OUT_OF_RANGE,
    UNKNOWN_EVENT_TYPE,
    UNSUPPORTED_MAJOR,
    WRONG_TYPE,
    ValidationSummary,
    iter_file,
    validate_record,
)
from schemas.wire import INVALID_JSON, NOT_UTF8, OVERSIZED

ARRIVED = {
    "event_id": "e1",
    "schema_version": "1.0",
    "event_type": "request_arrived",
    "ts_ns": 1_700_000_000_000_000_000,
    "engine_id": "eng",
    "request_id": "r1",
    "num_prompt_tokens": 12,
}


def _line(**changes) -> str:
    record = {**ARRIVED, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def _reasons(record) -> list[tuple[str, str]]:
    return [(e.reason, e.path) for e in validate_record(record).errors]


def test_a_valid_record_becomes_its_typed_event():
    result = validate_record(dict(ARRIVED))
    assert result.errors == ()
    assert result.event == RequestArrived(  # a 1.0 record stays valid under every later 1.x contract
        event_id="e1", schema_version="1.0", ts_ns=ARRIVED["ts_ns"], engine_id="eng", request_id="r1",
        num_prompt_tokens=12,
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"num_prompt_tokens": "12"}, [(WRONG_TYPE, "$.num_prompt_tokens")]),
        ({"num_prompt_tokens": True}, [(WRONG_TYPE, "$.num_prompt_tokens")]),
        ({"num_prompt_tokens": 1.5}, [(WRONG_TYPE, "$.num_prompt_tokens")]),
        ({"num_prompt_tokens": -1}, [(OUT_OF_RANGE, "$.num_prompt_tokens")]),
        ({"ts_ns": 2**63}, [(OUT_OF_RANGE, "$.ts_ns")]),
        ({"num_prompt_tokens": None}, [(WRONG_TYPE, "$.num_prompt_tokens")]),
        ({"request_id": ...}, [(MISSING_FIELD, "$.request_id")]),
        ({"event_type": "request_teleported"}, [(UNKNOWN_EVENT_TYPE, "$.event_type")]),
        ({"event_type": ...}, [(MISSING_FIELD, "$.event_type")]),
        ({"schema_version": "2.0"}, [(UNSUPPORTED_MAJOR, "$.schema_version")]),
        ({"schema_version": "one"}, [(BAD_VERSION, "$.schema_version")]),
        ({"schema_version": ...}, [(MISSING_FIELD, "$.schema_version")]),
        ({"prefix_block_ids": [1, "x", 3]}, [(WRONG_TYPE, "$.prefix_block_ids[1]")]),
        ({"num_branches": 0}, [(OUT_OF_RANGE, "$.num_branches")]),
        ({"ts_ns": "soon", "engine_id": 5}, [(WRONG_TYPE, "$.ts_ns"), (WRONG_TYPE, "$.engine_id")]),
    ],
)
def test_each_problem_is_named_with_its_field_path(changes, expected):
    record = {k: v for k, v in {**ARRIVED, **changes}.items() if v is not ...}
    assert _reasons(record) == expected


def test_error_says_what_type_it_got_and_what_was_expected():
    (error,) = validate_record({**ARRIVED, "num_prompt_tokens": "12"}).errors
    assert error.value_type == "string"
    assert error.expected == "an integer"
    assert error.render() == "$.num_prompt_tokens: wrong type: wrong type (got string, expected an integer)"


def test_enum_values_are_checked():
    record = {**ARRIVED, "event_type": "request_finished", "outcome": "exploded", "num_output_tokens": 3}
    (error,) = validate_record(record).errors
    assert (error.reason, error.path) == (NOT_ALLOWED, "$.outcome")
    assert "'completed'" in error.expected


def test_step_consistency_is_checked_beyond_types():
    step = {
        **ARRIVED, "event_type": "step_executed", "step_index": 1, "start_ns": 10, "end_ns": 5,
        "num_prefill_tokens": 0, "num_decode_seqs": 1, "request_ids": ["a", "b"], "request_num_tokens": [1],
        "num_kv_blocks_used": 1, "num_kv_blocks_free": 1,
    }
    assert [e.reason for e in validate_record(step).errors] == [INCONSISTENT, INCONSISTENT]


def test_unknown_fields_of_a_newer_minor_version_are_ignored_and_reported():
    result = validate_record({**ARRIVED, "schema_version": "1.7", "prompt_text": "hello", "new_hint": None})
    assert result.event is not None
    assert result.ignored_fields == ("prompt_text",)


def test_a_record_that_is_not_an_object_is_rejected():
    assert _reasons([1, 2]) == [("not_an_object", "$")]


def test_validate_cli_reports_every_bad_line_with_its_number(tmp_path):
    lines = [
        _line(),                                      # 1 valid
        _line(num_prompt_tokens="many"),              # 2 wrong type
        _line(request_id=...),                        # 3 missing field
        _line(event_type="request_teleported"),       # 4 unknown event type
        '{"event_id": "e5", "oops"',                  # 5 not JSON
        _line(schema_version="2.3"),                  # 6 unknown major version
        _line(event_id="e7", ts_ns=5),                # 7 valid
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert f"{path}:2: $.num_prompt_tokens: wrong type: wrong type (got string, expected an integer)" in out
    assert f"{path}:3: $.request_id: missing field" in out
    assert f"{path}:4: $.event_type: unknown event type" in out
    assert f"{path}:5: $: invalid json" in out
    assert f"{path}:6: $.schema_version: unsupported major version" in out
    assert f"{path}:1:" not in out and f"{path}:7:" not in out
    assert "7 records: 2 valid, 5 invalid" in out
    for reason in ("wrong type", "missing field", "unknown event type", "invalid json", "unsupported major version"):
        assert f"invalid, {reason}: 1" in out
    assert "Traceback" not in proc.stderr


def test_validate_cli_exits_zero_on_a_valid_file(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(_line() + "\n" + _line(event_id="e2") + "\n")
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 records: 2 valid, 0 invalid" in proc.stdout


def test_non_utf8_and_nan_are_errors_not_values(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": "\xff"}\n' + _line(num_prompt_tokens=12).replace(": 12", ": NaN").encode() + b"\n")
    reasons = [r.errors[0].reason for r in iter_file(path)]
    assert reasons == [NOT_UTF8, INVALID_JSON]


def test_parquet_files_are_validated_row_by_row(tmp_path):
    good = RequestArrived(event_id="a", ts_ns=1, engine_id="e", request_id="r", num_prompt_tokens=1)
    step = StepExecuted(
        event_id="s", ts_ns=2, engine_id="e", step_index=0, start_ns=1, end_ns=2, num_prefill_tokens=1,
        num_decode_seqs=0, request_ids=["r"], request_num_tokens=[1], num_kv_blocks_used=1, num_kv_blocks_free=0,
    )
    table = events_to_table([good, step])
    # a foreign producer's file: same columns, but one row with an unknown event type
    bad = table.slice(0, 1).set_column(2, "event_type", pa.array(["nope"])).cast(table.schema)
    path = tmp_path / "events.parquet"
    pq.write_table(pa.concat_tables([table, bad]), path)
    summary = ValidationSummary()
    numbers = []
    for result in iter_file(path, batch_rows=2):
        summary.add(result)
        if result.errors:
            numbers.append(result.number)
    assert (summary.num_valid, summary.num_invalid, numbers) == (2, 1, [3])
    assert summary.by_event_type == {"request_arrived": 1, "step_executed": 1}


def test_a_large_file_is_streamed_not_loaded(tmp_path):
    """iter_file is a generator over lines: it yields the first result before reading the rest."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as fh:
        for i in range(50_000):
            fh.write(_line(event_id=f"e{i}") + "\n")
    results = iter_file(path)
    first = next(results)
    assert first.number == 1 and first.event is not None
    assert sum(1 for _ in results) == 49_999


def test_parquet_events_are_read_columnar_and_a_bad_row_is_named(tmp_path):
    from collections import Counter

    from schemas.validate import InvalidEventsError, iter_event_tables

    good = [RequestArrived(event_id=f"e{i}", ts_ns=i, engine_id="e", request_id=f"r{i}", num_prompt_tokens=i) for i in range(5)]
    table = events_to_table(good).append_column("prompt", pa.array(["secret"] * 5))
    path = tmp_path / "events.parquet"
    pq.write_table(table, path)
    ignored = Counter()
    (read,) = list(iter_event_tables(path, ignored_fields=ignored))
    assert read.equals(events_to_table(good)) and ignored == {"prompt": 5}
    broken = events_to_table(good).set_column(3, "ts_ns", pa.array(["soon"] * 5))
    pq.write_table(broken, path)
    with pytest.raises(InvalidEventsError, match=r"events.parquet:1: \$.ts_ns: wrong type"):
        list(iter_event_tables(path))


def test_validate_cli_never_echoes_a_value_or_a_name_that_is_not_the_contracts(tmp_path):
    """Secrets sent as values of enum fields, as an event type or as field names stay out of the output."""
    secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
    lines = [
        _line(**{f"aws_secret_access_key={secret}": 1}),  # valid, with a secret as an unknown field's name
        _line(event_id="e2", outcome=1),                   # valid: a contract name of another event type
        _line(event_id="e3", event_type=secret),
        _line(event_id="e4", schema_version=secret),
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "4 records: 2 valid, 2 invalid" in proc.stdout
    assert "4eC39HqLyjWDarjtT1zdp7dc" not in proc.stdout + proc.stderr
    assert "ignored 1 values of fields that are not contract names" in proc.stdout
    assert "ignored field 'outcome' (of another event type) in 1 records" in proc.stdout


def test_a_corrupt_parquet_file_is_a_clean_error_not_an_internal_one(tmp_path):
    path = tmp_path / "events.parquet"
    pq.write_table(pa.table({"event_id": ["a"] * 1000}), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\x00" * 64  # the footer survives, a column chunk does not
    path.write_bytes(bytes(data[:-200]) + bytes(data[-8:]))  # and the footer is cut short
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "is not a readable Parquet file" in proc.stderr and "internal error" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_overlong_line_is_one_oversized_record_and_the_lines_around_it_still_count(tmp_path):
    """A line past the limit is named by its number and size, read in pieces (never held whole), and
    the next line is still record 3; limits at the edge: exactly the limit is a record, one more is not."""
    good = _line()
    limit = len(good)
    path = tmp_path / "long.jsonl"
    path.write_text(f"{good}\n{'x' * (10 * limit + 3)}\n{good}\n{good} \n{'y' * (limit + 1)}")
    results = list(iter_file(path, max_record_bytes=limit))
    assert [(r.number, r.event is not None) for r in results] == [(1, True), (2, False), (3, True), (4, False), (5, False)]
    assert results[1].errors[0].reason == OVERSIZED and f"{10 * limit + 3:,} bytes" in results[1].errors[0].message
    assert results[3].errors[0].reason == OVERSIZED and results[4].errors[0].reason == OVERSIZED


def test_an_overlong_line_is_skipped_in_pieces_not_held(tmp_path):
    """A 16 MiB line with no newline (the end of a truncated or hostile file), read with a 64 KiB limit:
    Python's allocations stay near the limit, where holding the line would take all 16 MiB."""
    import tracemalloc

    path = tmp_path / "noline.jsonl"
    path.write_bytes(b"{" * (16 << 20))
    tracemalloc.start()
    try:
        results = list(iter_file(path, max_record_bytes=64 << 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.errors[0].reason for r in results] == [OVERSIZED]
    assert peak < 1 << 20, peak


def test_a_device_given_as_parquet_is_named_as_not_a_file(tmp_path):
    """pyarrow answers /dev/null with a bare FileNotFoundError('/dev/null'): the reader says what is wrong."""
    from schemas.validate import UnreadableFileError, read_parquet_table

    with pytest.raises(UnreadableFileError, match="/dev/null is not a regular file"):
        read_parquet_table("/dev/null")
    with pytest.raises(FileNotFoundError):  # a missing file stays the OS's error, for the CLI's own message
        read_parquet_table(tmp_path / "missing.parquet")


def test_a_key_given_twice_is_invalid_json_whichever_value_comes_last(tmp_path):
    # parsers disagree on which of two values wins (Python's and pyarrow's differ), so neither is taken
    path = tmp_path / "twice.jsonl"
    twice = _line().replace('"event_type": "request_arrived"', '"event_type": "bogus", "event_type": "request_arrived"')
    path.write_text(twice + "\n" + _line(event_id="e2") + "\n")
    results = list(iter_file(path))
    assert [r.event is None for r in results] == [True, False]
    assert results[0].errors[0].reason == INVALID_JSON
    assert results[0].errors[0].message == ("not JSON: the key 'event_type' is given more than once in one object "
                                            "(which value holds?)")


def test_a_parquet_file_naming_a_column_twice_is_refused_by_name(tmp_path):
    from schemas.validate import UnreadableFileError

    table = events_to_table([RequestArrived(event_id="a", ts_ns=1, engine_id="e", request_id="r", num_prompt_tokens=1)])
    path = tmp_path / "twice.parquet"
    pq.write_table(table.append_column("tenant", pa.array(["x"])), path)
    with pytest.raises(UnreadableFileError, match=r"names a column more than once: 'tenant' \(2 times\)") as caught:
        list(iter_file(path))
    assert caught.value.hint == "write each column once"
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 3 and "hint: write each column once" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("field", ["event_id", "engine_id", "request_id", "instance_id"])
@pytest.mark.parametrize("value", ["", "   ", "e\x00x", "tab\there", "del\x7f"])
def test_an_id_that_is_blank_or_holds_a_control_character_is_refused_by_both_validators(field, value):
    # consumers de-duplicate on event_id and join on request_id: two events with the id "" would be one
    from pipelines.decode import Decoder

    record = {**ARRIVED, field: value}
    assert _reasons(record) == [(NOT_ALLOWED, f"$.{field}")]
    batch = Decoder().decode([json.dumps(record).encode(), _line(event_id="ok").encode()])
    assert [r.index for r in batch.rejected] == [0] and batch.events["event_id"].to_pylist() == ["ok"]


@pytest.mark.parametrize("value", ["e", " e ", "é", "a b"])
def test_an_id_with_a_visible_character_and_no_control_character_is_accepted(value):
    import jsonschema

    from schemas.json_schema import events_json_schema

    record = {**ARRIVED, "event_id": value, "schema_version": "1.2"}
    assert _reasons(record) == []
    jsonschema.validate(record, events_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**record, "event_id": " "}, events_json_schema())


def test_more_cached_tokens_than_the_prompt_and_a_block_of_no_tokens_are_refused_by_both_validators():
    from pipelines.decode import Decoder

    state = {"event_id": "s1", "schema_version": "1.2", "event_type": "instance_state", "ts_ns": 1, "engine_id": "e",
             "instance_id": "i0", "state": "ready", "num_kv_blocks_total": 10, "kv_block_size_tokens": 0,
             "resident_models": [], "resident_adapters": []}
    cached = {**ARRIVED, "num_prompt_tokens": 10, "num_cached_prefix_tokens": 50}
    assert _reasons(state) == [(OUT_OF_RANGE, "$.kv_block_size_tokens")]
    assert _reasons(cached) == [(INCONSISTENT, "$.num_cached_prefix_tokens")]
    assert _reasons({**cached, "num_cached_prefix_tokens": 10}) == []
    batch = Decoder().decode([json.dumps(r).encode() for r in (state, cached, {**cached, "num_cached_prefix_tokens": 10})])
    assert [r.index for r in batch.rejected] == [0, 1] and batch.events.num_rows == 1
