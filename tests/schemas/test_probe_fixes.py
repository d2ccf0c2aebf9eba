"""Defects a hostile-input probe found in the contract's checks, each with its known answer: a schema_version in
digits other than ASCII, counts that overflow the request table's sums, an empty file validated in silence, and
ids the contract refuses looked up as if they could be in the lake. The row validator, the columnar check and the
JSON Schema must agree on each."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import jsonschema
import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipelines.decode import Decoder
from schemas.columnar import WIRE_SCHEMA, check_table
from schemas.events import EVENT_TYPES
from schemas.json_schema import events_json_schema
from schemas.types import MAX_COUNT, field_specs
from schemas.validate import BAD_VERSION, OUT_OF_RANGE, UNSUPPORTED_MAJOR, validate_record
from servelens.cli import cli

KEY = "test-key:" + base64.b64encode(bytes(range(32))).decode()
ENV = {"SERVELENS_PSEUDONYM_KEY": KEY}

ENVELOPE = {"schema_version": "1.2", "ts_ns": 1_765_000_000_000_000_000, "engine_id": "eng-1"}
#: One valid record of each event type, its counts at their largest allowed value where a cross-field rule needs it.
RECORDS = {
    "request_arrived": {"request_id": "r1", "num_prompt_tokens": MAX_COUNT},
    "admission_decided": {"request_id": "r1", "decision": "accept", "predicted_output_tokens_high": MAX_COUNT},
    "step_executed": {"step_index": 0, "start_ns": 1, "end_ns": 2, "num_prefill_tokens": 1, "num_decode_seqs": 1,
                      "request_ids": ["r1"], "request_num_tokens": [1], "num_kv_blocks_used": 1,
                      "num_kv_blocks_free": 1},
    "request_preempted": {"request_id": "r1", "mode": "recompute", "lease_generation": 1},
    "first_token": {"request_id": "r1"},
    "tokens_delivered": {"request_id": "r1", "num_tokens": 1},
    "request_cancelled": {"request_id": "r1"},
    "request_finished": {"request_id": "r1", "outcome": "completed", "num_output_tokens": 1},
    "instance_state": {"instance_id": "i1", "state": "ready", "num_kv_blocks_total": 1, "kv_block_size_tokens": 1,
                       "resident_models": [], "resident_adapters": []},
}
COUNTS = [(etype, spec) for etype, cls in EVENT_TYPES.items() for spec in field_specs(cls) if spec.maximum is not None]
TOKEN_COUNTS = {"num_prompt_tokens", "num_cached_prefix_tokens", "max_output_tokens", "predicted_output_tokens_low",
                "predicted_output_tokens_high", "num_prefill_tokens", "request_num_tokens", "num_lost_tokens",
                "num_tokens", "num_output_tokens", "kv_block_size_tokens"}


def _record(event_type: str, **fields) -> dict:
    return {"event_id": "e1", "event_type": event_type, **ENVELOPE, **RECORDS[event_type], **fields}


def _views(record: dict) -> tuple[bool, bool, bool]:
    """(row validator, columnar check, JSON Schema): whether each accepts ``record``."""
    row = validate_record(record).event is not None
    message = json.dumps(record).encode()
    table = pa.Table.from_pylist([record], schema=WIRE_SCHEMA)
    columnar = bool(check_table(table, [message])[0][0])
    try:
        jsonschema.validate(record, events_json_schema())
        schema = True
    except jsonschema.ValidationError:
        schema = False
    return row, columnar, schema


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {}, catch_exceptions=False)


# -- schema_version: ASCII digits, exactly the JSON Schema's pattern ---------------------------------------------


@pytest.mark.parametrize("version", ["1.²", "١.٢", "¹.2", "01.2", "1.2 ", " 1.2", "1.", ".2", "1.2.3", "1"])
def test_a_version_that_is_not_ascii_major_minor_is_a_bad_schema_version_in_every_view(version):
    result = validate_record(_record("first_token", schema_version=version))  # "¹.2" used to raise in int()
    assert [e.reason for e in result.errors] == [BAD_VERSION]
    assert "ASCII digits" in result.errors[0].message
    assert _views(_record("first_token", schema_version=version)) == (False, False, False)


def test_a_version_with_a_trailing_newline_is_bad_in_both_validators():
    # (the JSON Schema's "$" ends the string in its dialect, ECMA-262; Python's re, which the jsonschema package
    # uses, also lets it match before a final newline, so that view is not asked here)
    record = _record("first_token", schema_version="1.2\n")
    assert [(e.reason, "ASCII digits" in e.message) for e in validate_record(record).errors] == [(BAD_VERSION, True)]
    assert _views(record)[:2] == (False, False)


def test_the_validators_read_exactly_the_versions_the_json_schema_pattern_allows():
    readable = ["1.0", "1.2", "1.10", "1.02", "1.99999999999999999999"]  # any minor: a newer one is read
    assert [_views(_record("first_token", schema_version=v)) for v in readable] == [(True, True, True)] * 5
    assert _views(_record("first_token", schema_version="01.2")) == (False, False, False)  # the row validator took it


def test_another_major_is_unsupported_and_a_long_one_is_shortened():
    assert [e.reason for e in validate_record(_record("first_token", schema_version="2.0")).errors] == [UNSUPPORTED_MAJOR]
    long = validate_record(_record("first_token", schema_version="9" * 5000 + ".1")).errors[0]
    assert long.reason == UNSUPPORTED_MAJOR and "(5,000 digits)" in long.message and len(long.message) < 300


def test_a_superscript_version_is_invalid_on_the_command_line_and_refused_by_derive(tmp_path):
    path = tmp_path / "sup.jsonl"
    path.write_text(json.dumps(_record("request_arrived", schema_version="1.²")) + "\n")
    checked = _run("events", "validate", str(path))
    assert checked.exit_code == 1
    assert f"{path}:1: $.schema_version: bad schema version" in checked.stdout
    assert "1 records: 0 valid, 1 invalid" in checked.stdout
    derived = _run("requests", "derive", str(path), "--out", str(tmp_path / "r.parquet"), env=ENV)
    assert derived.exit_code == 3
    assert f"error: {path}:1: $.schema_version: bad schema version" in derived.stderr
    assert "hint: run `servelens events validate" in derived.stderr and "internal error" not in derived.output


def test_ingest_sends_a_message_with_another_scripts_digits_to_dead_letters():
    messages = [json.dumps(_record("first_token", schema_version=v, event_id=f"e{i}")).encode()
                for i, v in enumerate(["١.٢", "1.²", "¹.2", "01.2", "1.2"])]
    batch = Decoder().decode(messages)
    assert [(r.index, r.errors[0].reason) for r in batch.rejected] == [(i, BAD_VERSION) for i in range(4)]
    assert batch.events["event_id"].to_pylist() == ["e4"]


# -- counts: at most MAX_COUNT, in every view ----------------------------------------------------------------------


def test_every_token_count_has_the_documented_maximum():
    assert MAX_COUNT == 2**31 - 1
    assert TOKEN_COUNTS <= {spec.name for _, spec in COUNTS}
    uncapped = {s.name for cls in EVENT_TYPES.values() for s in field_specs(cls) if s.kind == "int" and s.maximum is None}
    assert uncapped == {"ts_ns", "client_sent_ns", "ttft_deadline_ns", "e2e_deadline_ns", "prefix_block_ids",
                        "step_index", "start_ns", "end_ns", "lease_generation", "first_byte_ns", "last_byte_ns"}


@pytest.mark.parametrize(("event_type", "spec"), COUNTS, ids=[f"{t}.{s.name}" for t, s in COUNTS])
def test_a_count_above_the_maximum_is_out_of_range_in_every_view(event_type, spec):
    def value(n):
        return [n] if spec.is_list else n

    assert _views(_record(event_type, **{spec.name: value(MAX_COUNT)})) == (True, True, True)
    over = _record(event_type, **{spec.name: value(MAX_COUNT + 1)})
    assert _views(over) == (False, False, False)
    (error,) = validate_record(over).errors
    assert (error.reason, error.path) == (OUT_OF_RANGE, f"$.{spec.name}" + ("[0]" if spec.is_list else ""))
    assert f"outside 0..{MAX_COUNT:,}" in error.message and f"from 0 to {MAX_COUNT:,}" in (error.expected or "")


def test_the_json_schema_bounds_every_integer_by_int64_or_the_count_maximum():
    definition = events_json_schema()["$defs"]["step_executed"]["properties"]
    assert definition["ts_ns"]["maximum"] == 2**63 - 1
    assert definition["num_prefill_tokens"]["maximum"] == MAX_COUNT
    assert definition["request_num_tokens"]["items"]["maximum"] == MAX_COUNT


def test_deliveries_of_huge_token_counts_are_invalid_not_an_internal_error_in_derive(tmp_path):
    path = tmp_path / "huge.jsonl"
    records = [_record("request_arrived", num_prompt_tokens=1), _record("first_token", event_id="e2")]
    records += [_record("tokens_delivered", event_id=f"e{i}", num_tokens=2**63 - 1) for i in (3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    checked = _run("events", "validate", str(path))
    assert checked.exit_code == 1 and "invalid, out of range: 2" in checked.stdout
    assert f"{path}:3: $.num_tokens: out of range: 9223372036854775807 is outside 0..2,147,483,647" in checked.stdout
    derived = _run("requests", "derive", str(path), "--out", str(tmp_path / "r.parquet"), env=ENV)
    assert derived.exit_code == 3, derived.output
    assert f"error: {path}:3: $.num_tokens: out of range" in derived.stderr and "hint:" in derived.stderr
    assert "internal error" not in derived.output and "ConversionException" not in derived.output


# -- an empty file: valid, with a warning ---------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_validating_a_file_with_no_records_warns_and_exits_0(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    result = _run("events", "validate", str(path))
    assert result.exit_code == 0
    assert "0 records: 0 valid, 0 invalid" in result.stdout
    assert f"warning: {path} holds no records" in result.stderr
    path.write_text(content + json.dumps(_record("first_token")) + "\n")  # a record: no warning
    result = _run("events", "validate", str(path))
    assert result.exit_code == 0 and "1 records: 1 valid, 0 invalid" in result.stdout and result.stderr == ""


# -- privacy lookup: only ids the contract can hold -------------------------------------------------------------------


@pytest.mark.parametrize(("value", "field"), [("", "request_id"), ("   ", "request_id"), ("r\x01", "request_id"),
                                              ("", "event_id"), ("e\x7f", "event_id")])
def test_lookup_refuses_an_id_the_contract_refuses(value, field):
    result = _run("privacy", "lookup", value, "--field", field, env=ENV)
    assert result.exit_code == 3
    assert f"error: {field} {value!r} is blank or holds a control character" in result.stderr
    assert "hint:" in result.stderr and result.stdout == ""
    assert _run("privacy", "lookup", "id-042", "--field", field, env=ENV).stdout[2] == "_"  # a usable id: answered


def test_lookup_refuses_an_id_that_is_not_unicode():
    done = subprocess.run([sys.executable, "-m", "servelens", "privacy", "lookup", b"r\xff"], capture_output=True,
                          text=True, env={**_base_env(), **ENV})
    assert done.returncode == 3, done.stderr
    assert "holds a lone surrogate" in done.stderr and "hint:" in done.stderr and done.stdout == ""
    assert _run("privacy", "lookup", "", "--field", "tenant", env=ENV).exit_code == 0  # the contract takes any tenant


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SERVELENS_")}
