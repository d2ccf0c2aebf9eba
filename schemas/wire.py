"""The JSON wire form of events: one flat JSON object per event, UTF-8, no NaN or Infinity.

Producers write every envelope field and the non-null payload fields of their event type;
consumers decode with ``decode_json`` and check with ``schemas.validate.validate_record``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa

from schemas.events import EVENT_TYPES, Event, event_as_dict
from schemas.types import field_specs

INVALID_JSON = "invalid_json"
NOT_UTF8 = "not_utf8"
OVERSIZED = "oversized"
#: The longest JSON document read from a file, like the ingest's default ``max_message_bytes`` (Kafka's
#: own default message size): a longer line is an ``oversized`` record, skipped without being held.
MAX_RECORD_BYTES = 1_048_576


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def encode_event(event: Event) -> bytes:
    """One event as compact JSON bytes (null payload fields omitted)."""
    return _dumps({k: v for k, v in event_as_dict(event).items() if v is not None})


def wire_row(row: dict[str, Any]) -> dict[str, Any]:
    """A lake row (all event types' columns) reduced to its event type's non-null fields."""
    names = {s.name for s in field_specs(EVENT_TYPES[row["event_type"]])}
    return {k: v for k, v in row.items() if k in names and v is not None}


def iter_table_json(table: pa.Table, *, batch_rows: int = 65_536) -> Iterator[bytes]:
    """Encode the rows of an events table (``EVENTS_SCHEMA``) as JSON documents, streaming."""
    for batch in table.to_batches(max_chunksize=batch_rows):
        for row in batch.to_pylist():
            yield _dumps(wire_row(row))


def write_jsonl(docs: Iterable[bytes], out: Path | str | IO[bytes]) -> int:
    """Write JSON documents one per line; return how many."""
    if isinstance(out, (str, Path)):
        with Path(out).open("wb") as fh:
            return write_jsonl(docs, fh)
    count = 0
    for doc in docs:
        out.write(doc)
        out.write(b"\n")
        count += 1
    return count


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


class DuplicateKeyError(ValueError):
    """A JSON object gives ``key`` twice: parsers disagree on which of its values wins."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} is given more than once in one object (which value holds?)")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` for an object whose keys are each given once (``DuplicateKeyError``
    otherwise; ``json`` alone would silently keep the last value)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


def decode_json(data: bytes) -> tuple[Any, str | None, str | None]:
    """Decode one JSON document: (value, None, None) or (None, reason, message).

    Bad UTF-8, the non-standard constants NaN/Infinity and a key given twice in one object are errors,
    never values.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, NOT_UTF8, f"byte {exc.start} is not valid UTF-8"
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=unique_keys), None, None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        return None, INVALID_JSON, f"not JSON: {exc}"
