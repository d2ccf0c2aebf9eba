"""Repeated ids: an event id reused with other content, a request listed twice in one step.

An exact repeat of an event (a producer retry, at-least-once delivery) is harmless and stays valid: consumers
keep one copy. Another event under an id already given is a conflict (``duplicate_event_id``), and a step that
lists one request twice among its members is refused (``duplicate_item``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.decode import Decoder
from pipelines.ingest import refuse_conflicting_ids
from schemas.arrow import events_to_table
from schemas.columnar import WIRE_SCHEMA, check_table
from schemas.duplicates import EventIdLedger, conflicting_rows
from schemas.events import StepExecuted
from schemas.json_schema import events_json_schema
from schemas.validate import DUPLICATE_EVENT_ID, DUPLICATE_ITEM, InvalidEventsError, iter_event_tables, iter_file, validate_record

ARRIVED = {
    "event_id": "e1", "schema_version": "1.2", "event_type": "request_arrived", "ts_ns": 1_700_000_000_000_000_000,
    "engine_id": "eng", "request_id": "r1", "num_prompt_tokens": 12,
}
STEP = {
    "event_id": "s1", "schema_version": "1.2", "event_type": "step_executed", "ts_ns": 20, "engine_id": "eng",
    "step_index": 0, "start_ns": 10, "end_ns": 20, "num_prefill_tokens": 3, "num_decode_seqs": 1,
    "request_ids": ["r1", "r2", "r1"], "request_num_tokens": [1, 2, 3], "num_kv_blocks_used": 1, "num_kv_blocks_free": 1,
}


def _arrival(i: int, **changes) -> dict:
    return {**ARRIVED, "event_id": f"e{i}", "request_id": f"r{i}", **changes}


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _parquet(path, records) -> None:
    pq.write_table(events_to_table([validate_record(r).event for r in records]), path)


def _invalid(path) -> list[tuple[int, str, str, str]]:
    return [(r.number, e.reason, e.path, e.message) for r in iter_file(path) for e in r.errors]


# -------------------------------------------------------------------------------------------- event ids


@pytest.mark.parametrize(("write", "unit"), [(_jsonl, "line"), (_parquet, "row")])
def test_an_event_id_reused_with_other_content_is_refused_naming_the_id_and_the_first_record(tmp_path, write, unit):
    path = tmp_path / ("events.jsonl" if unit == "line" else "events.parquet")
    write(path, [_arrival(1), _arrival(2), _arrival(1, num_prompt_tokens=99)])
    ((number, reason, field, message),) = _invalid(path)
    assert (number, reason, field) == (3, DUPLICATE_EVENT_ID, "$.event_id")
    assert "'e1'" in message and f"{unit} 1" in message
    assert [r.event is not None for r in iter_file(path)] == [True, True, False]  # the first one stands


def test_an_exact_repeat_stays_valid_however_it_is_written(tmp_path):
    """A retry is the same event: key order, an omitted default and an unknown field (never stored) don't differ."""
    path = tmp_path / "events.jsonl"
    reordered = dict(reversed(list(_arrival(1).items())))
    _jsonl(path, [_arrival(1), reordered, _arrival(1, num_branches=1), _arrival(1, prompt="not stored")])
    assert _invalid(path) == []
    assert len([r for r in iter_file(path) if r.event is not None]) == 4  # consumers keep one copy


def test_only_valid_events_claim_an_id(tmp_path):
    """An invalid record under an id is a dead letter of its own: the valid event after it is not a conflict."""
    path = tmp_path / "events.jsonl"
    _jsonl(path, [_arrival(1, num_prompt_tokens="12"), _arrival(1)])
    assert [(n, reason) for n, reason, _, _ in _invalid(path)] == [(1, "wrong_type")]


def test_a_conflict_thousands_of_records_apart_is_found(tmp_path):
    """The file is checked in chunks against every id seen before, not within one chunk only."""
    records = [_arrival(i) for i in range(10_000)]
    records[9_500] = _arrival(3, ts_ns=5)
    records[9_600] = _arrival(7)  # an exact repeat, far away: harmless
    path = tmp_path / "events.jsonl"
    _jsonl(path, records)
    ((number, reason, _, message),) = _invalid(path)
    assert (number, reason) == (9_501, DUPLICATE_EVENT_ID) and "'e3'" in message and "line 4" in message


def test_the_validate_command_reports_the_conflict_and_exits_1(tmp_path):
    path = tmp_path / "events.jsonl"
    _jsonl(path, [_arrival(1), _arrival(1), _arrival(1, tenant="t9")])
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{path}:3: $.event_id: duplicate event id: event id 'e1' already names the event of line 1" in proc.stdout
    assert "3 records: 2 valid, 1 invalid" in proc.stdout and "invalid, duplicate event id: 1" in proc.stdout


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_importing_a_file_with_a_conflict_is_refused_and_an_exact_repeat_is_not(tmp_path, suffix):
    """``iter_event_tables`` (lake import, sanitize, derive): the columnar Parquet path checks across batches too."""
    write = _jsonl if suffix == "jsonl" else _parquet
    path = tmp_path / f"events.{suffix}"
    records = [_arrival(i) for i in range(300)]
    write(path, [*records, records[5]])
    assert sum(t.num_rows for t in iter_event_tables(path, batch_rows=64)) == 301
    write(path, [*records, _arrival(5, engine_id="other")])
    with pytest.raises(InvalidEventsError, match=r"events\.\w+:301: \$\.event_id: duplicate event id: event id 'e5'") as caught:
        list(iter_event_tables(path, batch_rows=64))
    assert caught.value.result.errors[0].reason == DUPLICATE_EVENT_ID


def test_ingest_sends_a_conflicting_event_to_dead_letters_and_keeps_an_exact_repeat_for_the_retry_filter():
    messages = [json.dumps(r).encode() for r in (_arrival(1), _arrival(2), _arrival(1), _arrival(1, num_prompt_tokens=7))]
    decoded = Decoder().decode(messages)
    assert decoded.rejected == []  # each message alone is a valid event
    clean, kept, rejected = refuse_conflicting_ids(decoded.events, decoded.indices, messages)
    assert kept.tolist() == [0, 1, 2] and clean["event_id"].to_pylist() == ["e1", "e2", "e1"]
    (dead,) = rejected
    assert (dead.index, dead.size_bytes, dead.event_type) == (3, len(messages[3]), "request_arrived")
    assert dead.errors[0].reason == DUPLICATE_EVENT_ID and "'e1'" in dead.errors[0].message


def test_conflicting_rows_compares_whole_events():
    table = events_to_table([validate_record(r).event for r in (_arrival(1), _arrival(1), _arrival(1, pool="canary"))])
    assert conflicting_rows(table) == {2: 0}
    assert conflicting_rows(table.slice(0, 2)) == {}


def test_the_ledger_agrees_with_a_dictionary_across_many_batches():
    rng = random.Random(7)
    ledger, seen, expected, found = EventIdLedger(), {}, [], []
    number = 0
    for _ in range(60):
        size = rng.randrange(0, 300)
        keys = np.array([rng.randrange(2_000) for _ in range(size)], dtype=np.int64)
        digests = np.array([rng.randrange(2) for _ in range(size)], dtype=np.int64)
        numbers = np.arange(number, number + size, dtype=np.int64)
        for k, d, n in zip(keys.tolist(), digests.tolist(), numbers.tolist()):
            first = seen.setdefault(k, (d, n))
            if first[0] != d:
                expected.append((n, first[1]))
        found += [(int(numbers[i]), first) for i, first in ledger.check(keys, digests, numbers)]
        number += size
    assert found == expected and len(ledger) == len(seen)
    assert len(ledger._runs) <= 12  # runs merge as they grow


# ------------------------------------------------------------------------------------- step members


def test_a_step_that_lists_a_request_twice_is_refused_naming_it():
    result = validate_record(dict(STEP))
    assert result.event is None
    ((reason, path, message),) = [(e.reason, e.path, e.message) for e in result.errors]
    assert (reason, path) == (DUPLICATE_ITEM, "$.request_ids[2]")
    assert "'r1'" in message and "request_ids[0]" in message
    assert validate_record({**STEP, "request_ids": ["r1", "r2", "r3"]}).errors == ()


def test_the_columnar_validator_refuses_a_repeated_member_too():
    rows = [STEP, {**STEP, "event_id": "s2", "request_ids": ["r1", "r2", "r3"]},
            {**STEP, "event_id": "s3", "request_ids": ["a", "b", "b"]}, _arrival(1)]
    table = pa.Table.from_pylist([{n: r.get(n) for n in WIRE_SCHEMA.names} for r in rows], schema=WIRE_SCHEMA)
    valid, _, _ = check_table(table, [json.dumps(r).encode() for r in rows])  # the messages: omitted defaults fill
    assert valid.tolist() == [False, True, False, True]


def test_ingest_dead_letters_a_step_with_a_repeated_member_on_either_decoding_path():
    fast = json.dumps(STEP).encode()
    slow = b" " + fast  # not "{...}": the reference path
    decoded = Decoder().decode([fast, slow, json.dumps(_arrival(1)).encode()])
    assert decoded.indices.tolist() == [2]
    assert [(r.index, r.errors[0].reason, r.errors[0].path) for r in decoded.rejected] == [
        (0, DUPLICATE_ITEM, "$.request_ids[2]"), (1, DUPLICATE_ITEM, "$.request_ids[2]")]


def test_the_json_schema_says_a_step_lists_each_request_once():
    schema = events_json_schema()
    assert schema["$defs"]["step_executed"]["properties"]["request_ids"]["uniqueItems"] is True
    jsonschema.validate({**STEP, "request_ids": ["r1", "r2", "r3"]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(STEP, schema)
    (error,) = jsonschema.Draft202012Validator(schema["$defs"]["step_executed"]).iter_errors(STEP)
    assert (error.validator, list(error.path)) == ("uniqueItems", ["request_ids"])


def test_a_step_file_with_a_repeated_member_is_refused_by_the_validate_command(tmp_path):
    path = tmp_path / "steps.parquet"
    table = events_to_table([StepExecuted(**{k: v for k, v in STEP.items() if k != "event_type"})])
    pq.write_table(table, path)  # the dataclass does not check: the file holds what a producer wrote
    proc = subprocess.run([sys.executable, "-m", "servelens", "events", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{path}:1: $.request_ids[2]: duplicate item: 'r1' is listed again (first at request_ids[0])" in proc.stdout
    with pytest.raises(InvalidEventsError, match="duplicate item"):
        list(iter_event_tables(path))


def test_arrivals_are_not_step_members():
    """Only a step's request_ids hold each value once: an arrival's repeated prefix block ids stay valid."""
    assert validate_record(_arrival(1, prefix_block_ids=[4, 4, 4])).errors == ()
