"""JSON Schema (draft 2020-12) of the wire format, generated from the event dataclasses.

The wire format is one flat JSON object per event. Fields of a newer minor version that this build
does not know are allowed (``additionalProperties``) and dropped by the privacy allowlist; the major
version is pinned by a pattern on ``schema_version``.
"""

from __future__ import annotations

from typing import Any

from schemas.events import EVENT_TYPES, SCHEMA_VERSION, SCHEMA_VERSION_PATTERN
from schemas.types import FieldSpec, field_specs

_JSON_KIND = {"string": "string", "int": "integer", "float": "number", "bool": "boolean"}


def json_field_schema(spec: FieldSpec) -> dict[str, Any]:
    """The JSON Schema of one field's value."""
    if spec.enum:
        item: dict[str, Any] = {"enum": list(spec.enum)}
    else:
        item = {"type": _JSON_KIND[spec.kind]}
        if spec.kind in ("int", "float"):
            item["minimum"] = 0
        if spec.kind == "int":  # int64, or a count's maximum (schemas.types.MAX_COUNT)
            item["maximum"] = spec.upper
        if spec.identifier:  # a visible character, no control characters (schemas.types.BAD_IDENTIFIER)
            item["pattern"] = r"^[^\x00-\x1f\x7f]*[^\x00-\x20\x7f][^\x00-\x1f\x7f]*$"
    value: dict[str, Any] = item
    if spec.is_list:  # a list that holds each value once (a step's members): uniqueItems
        value = {"type": "array", "items": item, **({"uniqueItems": True} if spec.unique_items else {})}
    if spec.nullable:
        value = {"anyOf": [value, {"type": "null"}]}
    return {"description": spec.doc, **value}


def event_json_schema(event_type: str) -> dict[str, Any]:
    """The JSON Schema of one event type."""
    specs = field_specs(EVENT_TYPES[event_type])
    properties = {s.name: json_field_schema(s) for s in specs}
    properties["event_type"] = {"description": properties["event_type"]["description"], "const": event_type}
    properties["schema_version"] = {
        "description": properties["schema_version"]["description"],
        "type": "string",
        "pattern": SCHEMA_VERSION_PATTERN,
    }
    return {
        "type": "object",
        "description": (EVENT_TYPES[event_type].__doc__ or "").strip(),
        "properties": properties,
        "required": [s.name for s in specs if s.required],
        "additionalProperties": True,
    }


def events_json_schema() -> dict[str, Any]:
    """The JSON Schema of any event: one of the event types, chosen by ``event_type``."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://servelens.dev/schemas/events-{SCHEMA_VERSION}.json",
        "title": f"servelens lifecycle event, schema {SCHEMA_VERSION}",
        "oneOf": [{"$ref": f"#/$defs/{name}"} for name in EVENT_TYPES],
        "$defs": {name: event_json_schema(name) for name in EVENT_TYPES},
    }
