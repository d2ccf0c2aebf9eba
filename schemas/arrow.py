"""Arrow schemas generated from the record dataclasses, and conversions between records and tables.

Each record class maps 1:1 to an Arrow schema (``arrow_schema``). Events of all types share one
lake schema (``EVENTS_SCHEMA``): the envelope plus every payload field, nullable, so one Parquet
dataset and one DuckDB view hold the whole stream. A field name means the same type in every event
type that uses it (checked at import).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Event
from schemas.types import FieldSpec, cached_by_class, field_specs

_ARROW_KIND: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
}


def arrow_type(spec: FieldSpec) -> pa.DataType:
    """The Arrow type of one field (nullability lives on the Arrow field)."""
    base = _ARROW_KIND[spec.kind]
    return pa.list_(pa.field("item", base, nullable=False)) if spec.is_list else base


def arrow_field(spec: FieldSpec, *, nullable: bool | None = None) -> pa.Field:
    metadata = {"doc": spec.doc}
    if spec.enum:
        metadata["enum"] = ",".join(spec.enum)
    return pa.field(
        spec.name,
        arrow_type(spec),
        nullable=spec.nullable if nullable is None else nullable,
        metadata=metadata,
    )


@cached_by_class
def arrow_schema(cls: type) -> pa.Schema:
    """The Arrow schema mirroring one record class field by field."""
    name = getattr(cls, "EVENT_TYPE", "") or getattr(cls, "TABLE", cls.__name__)
    return pa.schema(
        [arrow_field(s) for s in field_specs(cls)],
        metadata={"servelens.record": name, "servelens.schema_version": SCHEMA_VERSION},
    )


def _lake_specs() -> dict[str, FieldSpec]:
    """Envelope fields first, then each event type's payload fields; types must agree by name."""
    specs: dict[str, FieldSpec] = {s.name: s for s in field_specs(Event)}
    for cls in EVENT_TYPES.values():
        for s in field_specs(cls):
            seen = specs.get(s.name)
            if seen is None:
                specs[s.name] = s
            elif (seen.kind, seen.is_list) != (s.kind, s.is_list):
                raise TypeError(f"field {s.name!r} has two types across event types")
            elif seen.maximum != s.maximum:  # one lake column, one range: a field name means one thing
                raise TypeError(f"field {s.name!r} has two maximums across event types")
    return specs


#: The envelope fields every event has, never null in the lake.
ENVELOPE_REQUIRED = tuple(s.name for s in field_specs(Event) if not s.nullable)

#: All events in one table: the envelope plus every payload field (nullable unless envelope-required).
EVENTS_SCHEMA: pa.Schema = pa.schema(
    [arrow_field(s, nullable=s.name not in ENVELOPE_REQUIRED) for s in _lake_specs().values()],
    metadata={"servelens.record": "events", "servelens.schema_version": SCHEMA_VERSION},
)


def events_to_table(events: Iterable[Event]) -> pa.Table:
    """Events of any types as one table with ``EVENTS_SCHEMA``."""
    events = list(events)
    columns = {name: [getattr(e, name, None) for e in events] for name in EVENTS_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=EVENTS_SCHEMA)


def event_from_row(row: dict[str, Any]) -> Event:
    """Build the typed event from a lake row (or an already validated wire dict)."""
    cls = EVENT_TYPES[row["event_type"]]
    return cls(**{s.name: row[s.name] for s in field_specs(cls) if s.name != "event_type" and s.name in row})


def table_to_events(table: pa.Table) -> list[Event]:
    """The typed events of a table with ``EVENTS_SCHEMA`` (for tests and small tools)."""
    return [event_from_row(row) for row in table.to_pylist()]


def records_to_table(records: Iterable[Any], cls: type) -> pa.Table:
    """Records of one class as a table with that class's Arrow schema."""
    records = list(records)
    schema = arrow_schema(cls)
    return pa.Table.from_pydict({n: [getattr(r, n) for r in records] for n in schema.names}, schema=schema)


def table_to_records(table: pa.Table, cls: type) -> list[Any]:
    """Typed records of one class from a table with (at least) that class's columns."""
    names = [s.name for s in field_specs(cls)]
    return [cls(**{n: row[n] for n in names}) for row in table.select(names).to_pylist()]
