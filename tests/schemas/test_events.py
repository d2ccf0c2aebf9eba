"""The event records: one definition, three views (dataclass, Arrow, JSON Schema) that agree."""

from __future__ import annotations

import dataclasses
import typing

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given

from schemas.arrow import EVENTS_SCHEMA, arrow_schema, events_to_table, table_to_events
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Event, RequestArrived, StepExecuted
from schemas.json_schema import events_json_schema
from schemas.records import RequestRow, WorkloadRequest
from schemas.types import field_specs
from schemas.validate import validate_record
from schemas.wire import decode_json, encode_event
from tests.strategies import any_event

ARROW_OF = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_()}
JSON_OF = {int: "integer", float: "number", str: "string", bool: "boolean"}
RECORDS = [*EVENT_TYPES.values(), WorkloadRequest, RequestRow]


def _python_type(annotation) -> tuple[type, bool, bool]:
    """(scalar type, is_list, nullable) read straight from the annotation, independently of schemas.types."""
    nullable = type(None) in typing.get_args(annotation)
    inner = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation) if nullable else annotation
    is_list = typing.get_origin(inner) is list
    if is_list:
        (inner,) = typing.get_args(inner)
    if typing.get_origin(inner) is typing.Literal:
        inner = str
    return inner, is_list, nullable


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_arrow_schema_mirrors_dataclass_field_by_field(cls):
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    schema = arrow_schema(cls)
    assert schema.names == [f.name for f in fields]
    for f in fields:
        scalar, is_list, nullable = _python_type(hints[f.name])
        arrow = schema.field(f.name)
        expected = pa.list_(pa.field("item", ARROW_OF[scalar], nullable=False)) if is_list else ARROW_OF[scalar]
        assert arrow.type == expected, f.name
        assert arrow.nullable == nullable, f.name
        assert arrow.metadata[b"doc"], f"{f.name} has no help text"


@pytest.mark.parametrize("cls", list(EVENT_TYPES.values()), ids=lambda c: c.EVENT_TYPE)
def test_json_schema_mirrors_dataclass_field_by_field(cls):
    definition = events_json_schema()["$defs"][cls.EVENT_TYPE]
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    assert list(definition["properties"]) == [f.name for f in fields]
    for f in fields:
        scalar, is_list, nullable = _python_type(hints[f.name])
        prop = definition["properties"][f.name]
        if f.name in ("event_type", "schema_version"):
            continue
        options = prop.get("anyOf", [prop])
        assert ({"type": "null"} in options) == nullable, f.name
        value = options[0]
        if is_list:
            assert value["type"] == "array", f.name
            value = value["items"]
        if typing.get_origin(_strip(hints[f.name])) is typing.Literal:
            assert value["enum"] == list(typing.get_args(_strip(hints[f.name]))), f.name
        else:
            assert value["type"] == JSON_OF[scalar], f.name
        required = f.default is dataclasses.MISSING
        assert (f.name in definition["required"]) == required, f.name
    assert definition["properties"]["event_type"] == {
        "description": definition["properties"]["event_type"]["description"],
        "const": cls.EVENT_TYPE,
    }
    assert {"event_type", "schema_version"} <= set(definition["required"])


def _strip(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(annotation) else annotation


def test_lake_schema_holds_every_field_of_every_event_type():
    for cls in EVENT_TYPES.values():
        own = arrow_schema(cls)
        for f in own:
            lake = EVENTS_SCHEMA.field(f.name)
            assert lake.type == f.type, (cls.EVENT_TYPE, f.name)
    required = {"event_id", "schema_version", "event_type", "ts_ns", "engine_id"}
    assert [s.name for s in field_specs(Event)] == EVENTS_SCHEMA.names[: len(field_specs(Event))]
    for f in EVENTS_SCHEMA:
        assert f.nullable == (f.name not in required), f.name


def test_event_type_is_fixed_by_the_class():
    event = RequestArrived(event_id="e", ts_ns=1, engine_id="x", request_id="r", num_prompt_tokens=3)
    assert event.event_type == "request_arrived"
    assert event.schema_version == SCHEMA_VERSION
    with pytest.raises(TypeError):
        RequestArrived(event_id="e", event_type="first_token", ts_ns=1, engine_id="x", request_id="r", num_prompt_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.ts_ns = 2  # type: ignore[misc]


@given(any_event)
def test_any_valid_event_survives_the_json_round_trip(event):
    value, reason, _ = decode_json(encode_event(event))
    assert reason is None
    result = validate_record(value)
    assert result.errors == ()
    assert result.event == event


@given(any_event)
def test_any_valid_event_is_valid_under_the_generated_json_schema(event):
    value, _, _ = decode_json(encode_event(event))
    jsonschema.validate(value, events_json_schema())


@given(any_event)
def test_any_valid_event_survives_the_arrow_and_parquet_round_trip(event):
    table = events_to_table([event])
    assert table.schema == EVENTS_SCHEMA
    assert table_to_events(table) == [event]
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    assert table_to_events(pq.read_table(pa.BufferReader(sink.getvalue()))) == [event]


def test_step_lists_are_kept_in_order():
    step = StepExecuted(
        event_id="s1", ts_ns=20, engine_id="e", step_index=7, start_ns=10, end_ns=20, num_prefill_tokens=5,
        num_decode_seqs=1, request_ids=["b", "a"], request_num_tokens=[5, 1], num_kv_blocks_used=3, num_kv_blocks_free=9,
    )
    (back,) = table_to_events(events_to_table([step]))
    assert back.request_ids == ["b", "a"] and back.request_num_tokens == [5, 1]
