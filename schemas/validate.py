"""Validation of untrusted event records, with errors a person can act on.

``validate_record`` checks one decoded record against the contract and either returns the typed
event or explains every problem: the field path, the value's type and what was expected.
``iter_file`` streams a JSONL or Parquet file record by record (a 1 GB file is never loaded at
once) and ``ValidationSummary`` counts the results by reason.

Beyond the JSON Schema, the validator checks what a schema cannot: a known major version, a step's
``start_ns <= end_ns``, parallel lists of equal length, at least one token per delivery; and, across the
records of a file, an event id reused with other content (``duplicate_event_id``, ``schemas.duplicates``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from schemas.duplicates import EventIdLedger, event_hashes, table_hashes
from schemas.events import EVENT_TYPES, SCHEMA_MAJOR, SCHEMA_VERSION, SCHEMA_VERSION_PATTERN, Event
from schemas.types import BAD_IDENTIFIER, FieldSpec, field_specs
from schemas.wire import MAX_RECORD_BYTES, NOT_UTF8, OVERSIZED, decode_json

if TYPE_CHECKING:
    import pyarrow as pa

_BAD_IDENTIFIER = re.compile(BAD_IDENTIFIER)
_IDENTIFIER_FIELDS = frozenset(s.name for cls in EVENT_TYPES.values() for s in field_specs(cls) if s.identifier)
_VERSION_FORM = re.compile(r"(0|[1-9][0-9]*)\.[0-9]+")  # MAJOR.MINOR, ASCII digits ([0-9]: not \d, not isdigit)
_READABLE_VERSION = re.compile(SCHEMA_VERSION_PATTERN.removeprefix("^").removesuffix("$"))  # fullmatch: no "1.2\n"

# Reasons (stable identifiers, used for counting and in dead-letter tables); see also schemas.wire.
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
NOT_ALLOWED = "value_not_allowed"
OUT_OF_RANGE = "out_of_range"
UNKNOWN_EVENT_TYPE = "unknown_event_type"
BAD_VERSION = "bad_schema_version"
UNSUPPORTED_MAJOR = "unsupported_major_version"
INCONSISTENT = "inconsistent_fields"
DUPLICATE_ITEM = "duplicate_item"  # a value twice in a list that holds each once (a step's request_ids)
DUPLICATE_EVENT_ID = "duplicate_event_id"  # another event under an event id already given (schemas.duplicates)


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem with one record."""

    reason: str
    path: str
    message: str
    value_type: str | None = None
    expected: str | None = None

    def render(self) -> str:
        text = f"{self.path}: {self.reason.replace('_', ' ')}: {self.message}"
        if self.expected is not None:
            got = f"got {self.value_type}" if self.value_type else ""
            text += f" ({got}{', ' if got else ''}expected {self.expected})"
        return text


@dataclass(frozen=True, slots=True)
class RecordResult:
    """The outcome of validating one record: an event, or the errors; plus fields it ignored."""

    number: int  # 1-based line (JSONL) or row (Parquet)
    event: Event | None
    errors: tuple[FieldError, ...]
    ignored_fields: tuple[str, ...] = ()


def type_name(value: Any) -> str:
    """The JSON name of a Python value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar_error(spec: FieldSpec, value: Any, path: str) -> FieldError | None:
    if spec.enum is not None:
        if isinstance(value, str) and value in spec.enum:
            return None
        if isinstance(value, str):
            return FieldError(NOT_ALLOWED, path, "the value is not allowed", "string", spec.describe())
        return FieldError(WRONG_TYPE, path, "wrong type", type_name(value), spec.describe())
    kind = spec.kind
    if kind == "string":
        ok = isinstance(value, str)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        return FieldError(WRONG_TYPE, path, "wrong type", type_name(value), spec.describe())
    if kind == "string" and not _is_unicode(value):
        return FieldError(NOT_UTF8, path, "the string holds a lone surrogate, not valid Unicode", "string", spec.describe())
    if spec.identifier and _BAD_IDENTIFIER.search(value):
        return FieldError(NOT_ALLOWED, path, "an id that is blank or holds a control character (the value is not "
                          "printed)", "string", spec.describe())
    if kind == "int" and not 0 <= value <= spec.upper:
        return _int_range_error(spec, value, path)
    if kind == "float" and (not math.isfinite(value) or value < 0):
        return FieldError(OUT_OF_RANGE, path, f"{value} is not a finite number >= 0", "number", spec.describe())
    return None


def _int_range_error(spec: FieldSpec, value: int, path: str) -> FieldError:
    """An integer below 0 or above the field's maximum (int64, or ``MAX_COUNT`` for a count), the value shortened."""
    text = str(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value))):,} digits"
    if spec.maximum is None:
        return FieldError(OUT_OF_RANGE, path, f"{text} is outside 0..2^63-1", "integer", spec.describe())
    return FieldError(OUT_OF_RANGE, path, f"{text} is outside 0..{spec.maximum:,} (the most a count holds, so "
                      "sums over many events stay exact in int64)", "integer",
                      f"{spec.describe().removesuffix(' or null')} from 0 to {spec.maximum:,}{' or null' * spec.nullable}")


def _field_errors(spec: FieldSpec, value: Any) -> list[FieldError]:
    path = f"$.{spec.name}"
    if value is None:
        if spec.nullable:
            return []
        return [FieldError(WRONG_TYPE, path, "null is not allowed", "null", spec.describe())]
    if not spec.is_list:
        err = _scalar_error(spec, value, path)
        return [err] if err else []
    if not isinstance(value, list):
        return [FieldError(WRONG_TYPE, path, "wrong type", type_name(value), spec.describe())]
    errors = []
    for i, item in enumerate(value):
        err = _scalar_error(spec, item, f"{path}[{i}]")
        if err:
            errors.append(err)
            if len(errors) >= 3:  # one bad list should not flood the report
                break
    return errors if errors or not spec.unique_items else _repeated_items(spec, value)


def _version_error(version: Any) -> FieldError | None:
    """A ``schema_version`` that is not MAJOR.MINOR in ASCII digits, the major without a leading zero (``"1.²"``,
    ``"١.٢"``, ``"01.2"``: ``bad_schema_version``), or of another major; the readable ones are exactly those of
    ``SCHEMA_VERSION_PATTERN`` (the JSON Schema's and the columnar check's)."""
    if not isinstance(version, str):
        return FieldError(WRONG_TYPE, "$.schema_version", "wrong type", type_name(version), 'a "MAJOR.MINOR" string')
    form = _VERSION_FORM.fullmatch(version)
    if form is None:
        return FieldError(BAD_VERSION, "$.schema_version", "the value is not MAJOR.MINOR (ASCII digits, no leading "
                          "zero in MAJOR)", "string", f'"{SCHEMA_VERSION}"')
    if not _READABLE_VERSION.fullmatch(version):
        major = form.group(1)
        shown = major if len(major) <= 12 else f"{major[:12]}... ({len(major):,} digits)"
        return FieldError(
            UNSUPPORTED_MAJOR,
            "$.schema_version",
            f"major version {shown} is not readable by this build (it reads {SCHEMA_MAJOR}.x); "
            "upgrade servelens or have the producer write a supported version",
            "string",
            f'"{SCHEMA_MAJOR}.<minor>"',
        )
    return None


def identifier_problem(name: str, value: str) -> str | None:
    """What makes ``value`` one the contract refuses in the string field ``name`` (None: nothing): an id (a field
    declared ``identifier``) blank or with a control character (``BAD_IDENTIFIER``), or any string that is not
    valid Unicode (a lone surrogate). For input that names an event's field, such as a raw id to look up."""
    if not _is_unicode(value):
        return f"{shown_id(value)} holds a lone surrogate (bytes that are not UTF-8), not valid Unicode"
    if name in _IDENTIFIER_FIELDS and _BAD_IDENTIFIER.search(value):
        return (f"{shown_id(value)} is blank or holds a control character: the event contract refuses such an id "
                "(a visible character, no control characters), so no event in the lake carries it")
    return None


def shown_id(value: str, limit: int = 64) -> str:
    """An id quoted for a message, cut at ``limit`` characters (``repr``: control characters and anything else
    unprintable escaped, so a message stays one inert line)."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value):,} characters)"


def _repeated_items(spec: FieldSpec, items: list[Any], limit: int = 3) -> list[FieldError]:
    """A ``unique_items`` list (a step's members) holds each value once: each repeat (at most ``limit``) is an
    error naming the value (an id that passed the identifier check, or a number) and where it first appears."""
    first: dict[Any, int] = {}
    errors: list[FieldError] = []
    for i, item in enumerate(items):
        j = first.setdefault(item, i)
        if j != i and len(errors) < limit:
            shown = shown_id(item) if isinstance(item, str) else repr(item)
            errors.append(FieldError(DUPLICATE_ITEM, f"$.{spec.name}[{i}]", f"{shown} is listed again (first at "
                                     f"{spec.name}[{j}]): {spec.name} holds each value once"))
    return errors


def duplicate_event_id_error(event_id: str, earlier: str) -> FieldError:
    """The error of an event whose id ``earlier`` (an earlier record, named for the reader) holds with other
    content: a retry repeats its event exactly, so this is another event under an id already given."""
    return FieldError(DUPLICATE_EVENT_ID, "$.event_id", f"event id {shown_id(event_id)} already names the event "
                      f"of {earlier}, and this one differs from it (a repeated event, a retry, is identical): give "
                      "each event an id of its own")


def _consistency_errors(values: dict[str, Any]) -> list[FieldError]:
    errors = []
    etype = values["event_type"]
    if etype == "step_executed":
        if values["start_ns"] > values["end_ns"]:
            errors.append(FieldError(INCONSISTENT, "$.start_ns", "start_ns is after end_ns"))
        if len(values["request_ids"]) != len(values["request_num_tokens"]):
            errors.append(
                FieldError(INCONSISTENT, "$.request_num_tokens", "request_ids and request_num_tokens differ in length")
            )
        if values.get("num_steps", 1) < 1:
            errors.append(FieldError(OUT_OF_RANGE, "$.num_steps", "a step event covers at least one step"))
    elif etype == "tokens_delivered" and values["num_tokens"] < 1:
        errors.append(FieldError(OUT_OF_RANGE, "$.num_tokens", "a delivery carries at least one token"))
    elif etype == "request_arrived":
        if values.get("num_branches", 1) < 1:
            errors.append(FieldError(OUT_OF_RANGE, "$.num_branches", "a request has at least one branch"))
        cached = values.get("num_cached_prefix_tokens")
        if cached is not None and cached > values["num_prompt_tokens"]:
            errors.append(FieldError(INCONSISTENT, "$.num_cached_prefix_tokens", "more cached tokens than the prompt holds"))
    elif etype == "instance_state" and values["kv_block_size_tokens"] < 1:
        errors.append(FieldError(OUT_OF_RANGE, "$.kv_block_size_tokens", "a KV block holds at least one token"))
    elif etype == "admission_decided":
        low, high = values.get("predicted_output_tokens_low"), values.get("predicted_output_tokens_high")
        if low is not None and high is not None and low > high:
            errors.append(FieldError(INCONSISTENT, "$.predicted_output_tokens_low", "the interval's low end exceeds its high end"))
    return errors


def validate_record(record: Any, number: int = 0) -> RecordResult:
    """Check one decoded record; return the typed event or every error found."""
    if not isinstance(record, dict):
        not_object = FieldError(NOT_AN_OBJECT, "$", "a record must be a JSON object", type_name(record), "an object")
        return RecordResult(number, None, (not_object,))
    errors: list[FieldError] = []
    if "schema_version" not in record:
        errors.append(FieldError(MISSING_FIELD, "$.schema_version", "required field is missing"))
    elif err := _version_error(record["schema_version"]):
        if err.reason == UNSUPPORTED_MAJOR:  # a different major means a different shape: stop here
            return RecordResult(number, None, (err,))
        errors.append(err)
    etype = record.get("event_type")
    cls = EVENT_TYPES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        if "event_type" not in record:
            errors.append(FieldError(MISSING_FIELD, "$.event_type", "required field is missing"))
        else:
            errors.append(
                FieldError(
                    UNKNOWN_EVENT_TYPE,
                    "$.event_type",
                    "unknown event type (the value is not printed: only contract names are)",
                    type_name(etype),
                    "one of " + ", ".join(EVENT_TYPES),
                )
            )
        return RecordResult(number, None, tuple(errors))
    values: dict[str, Any] = {}
    for spec in field_specs(cls):
        if spec.name == "schema_version":
            values[spec.name] = record.get(spec.name)
            continue
        if spec.name not in record:
            if spec.required:
                errors.append(FieldError(MISSING_FIELD, f"$.{spec.name}", "required field is missing", None, spec.describe()))
            values[spec.name] = spec.default
            continue
        value = record[spec.name]
        found = _field_errors(spec, value)
        if not found and spec.kind == "float" and isinstance(value, int):  # JSON 3 for a float field: 3.0
            try:
                value = float(value)
            except OverflowError:
                found = [FieldError(OUT_OF_RANGE, f"$.{spec.name}", "the number is too large", "integer", spec.describe())]
        errors.extend(found)
        values[spec.name] = value
    known = {s.name for s in field_specs(cls)}
    ignored = tuple(k for k, v in record.items() if k not in known and v is not None)
    if not errors:
        errors.extend(_consistency_errors(values))
    if errors:
        return RecordResult(number, None, tuple(errors), ignored)
    values.pop("event_type")
    return RecordResult(number, cls(**values), (), ignored)


def _lines(fh: IO[bytes], limit: int) -> Iterator[tuple[bytes | None, int]]:
    """Each line and its length in bytes, or ``None`` and the length of a line whose record is longer
    than ``limit``: that one is read in pieces, never held whole (``/dev/zero`` has no newline)."""
    while line := fh.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line, len(line)
            continue
        size = len(line)
        while (piece := fh.readline(limit)) and not piece.endswith(b"\n"):
            size += len(piece)
        yield None, size + len(piece) - piece.endswith(b"\n")


def _iter_jsonl(path: Path, limit: int = MAX_RECORD_BYTES) -> Iterator[RecordResult]:
    with path.open("rb") as fh:
        for number, (line, size) in enumerate(_lines(fh, limit), start=1):
            if line is None:
                yield RecordResult(number, None, (FieldError(OVERSIZED, "$", f"the line holds {size:,} bytes, more than "
                                                              f"the {limit:,}-byte limit on one record"),))
                continue
            if not line.strip():
                continue
            record, reason, message = decode_json(line)
            if reason:
                yield RecordResult(number, None, (FieldError(reason, "$", message or reason),))
            else:
                yield validate_record(record, number)


class UnreadableFileError(ValueError):
    """A file that claims to be Parquet (magic bytes or suffix) and cannot be read as Parquet, or names a column
    twice; ``hint``: what to do, where it is not the default (check the file is complete)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def read_parquet_table(path: str | Path, **kwargs: Any) -> pa.Table:
    """``pyarrow.parquet.read_table`` of an input file (``kwargs`` as there); one that is not Parquet, or cut
    short, raises ``UnreadableFileError`` naming it (a missing file stays ``FileNotFoundError``)."""
    import pyarrow.parquet as pq

    return _readable(path, lambda: pq.read_table(path, **kwargs))


def read_parquet_schema(path: str | Path) -> pa.Schema:
    """The schema of an input Parquet file; errors as ``read_parquet_table``'s."""
    import pyarrow.parquet as pq

    return _readable(path, lambda: pq.read_schema(path))


def _readable(path: str | Path, read: Any) -> Any:
    import pyarrow as pa

    try:
        return read()
    except FileNotFoundError:
        if Path(path).exists():  # pyarrow's word for a device or a pipe: there, but not a file
            raise UnreadableFileError(f"{path} is not a regular file (a device or a pipe?): give a Parquet file") from None
        raise
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: str | Path, exc: BaseException) -> UnreadableFileError:
    return UnreadableFileError(f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc})")


def _parquet_batches(path: Path, batch_rows: int, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The file's record batches; a corrupt file raises ``UnreadableFileError`` (not pyarrow's error)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        _refuse_repeated_columns(path, file.schema_arrow)
        yield from file.iter_batches(batch_size=batch_rows, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(path, exc) from None


def _refuse_repeated_columns(path: Path, schema: pa.Schema) -> None:
    """A column named twice is ambiguous (readers disagree on which holds the field): refused by name."""
    names = Counter(schema.names)
    twice = sorted(name for name, count in names.items() if count > 1)
    if twice:
        shown = ", ".join(f"{name!r} ({names[name]} times)" for name in twice)
        raise UnreadableFileError(f"{path} names a column more than once: {shown}; which one holds the field is "
                                  "ambiguous, so the file is refused", "write each column once")


def _iter_parquet(path: Path, batch_rows: int) -> Iterator[RecordResult]:
    number = 0
    for batch in _parquet_batches(path, batch_rows):
        for row in batch.to_pylist():
            number += 1
            yield validate_record(row, number)


def detect_format(path: Path) -> str:
    """'parquet' or 'jsonl', from the file's magic bytes (falling back to the suffix)."""
    with path.open("rb") as fh:
        head = fh.read(4)
    if head == b"PAR1":
        return "parquet"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def iter_file(
    path: Path | str, *, batch_rows: int = 65_536, max_record_bytes: int = MAX_RECORD_BYTES
) -> Iterator[RecordResult]:
    """Validate every record of a JSONL or Parquet file, streaming (a JSONL line longer than
    ``max_record_bytes`` is an ``oversized`` record)."""
    path = Path(path)
    if detect_format(path) == "parquet":
        yield from _refuse_conflicting_ids(_iter_parquet(path, batch_rows), "row")
    else:
        yield from _refuse_conflicting_ids(_iter_jsonl(path, max_record_bytes), "line")


def _refuse_conflicting_ids(results: Iterator[RecordResult], unit: str, chunk: int = 4096) -> Iterator[RecordResult]:
    """``results`` in order, where a valid event reuses the event id of an earlier valid one with other content
    refused (``duplicate_event_id``, naming the earlier record's ``unit``: line or row); an exact repeat stays
    valid (a retry: consumers keep one copy). Checked ``chunk`` records at a time against the file's ids so far
    (``schemas.duplicates``)."""
    ledger = EventIdLedger()
    while batch := list(itertools.islice(results, chunk)):
        valid = [r for r in batch if r.event is not None]
        events = [r.event for r in valid if r.event is not None]
        numbers = np.fromiter((r.number for r in valid), dtype=np.int64, count=len(valid))
        refused = {}
        for i, first in ledger.check(*event_hashes(events), numbers):
            error = duplicate_event_id_error(events[i].event_id, f"{unit} {first}")
            refused[valid[i].number] = RecordResult(valid[i].number, None, (error,), valid[i].ignored_fields)
        yield from (refused.get(r.number, r) for r in batch)


@dataclass
class ValidationSummary:
    """Counts of a validation run."""

    num_valid: int = 0
    num_invalid: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_event_type: Counter[str] = field(default_factory=Counter)
    ignored_fields: Counter[str] = field(default_factory=Counter)

    def add(self, result: RecordResult) -> None:
        if result.event is not None:
            self.num_valid += 1
            self.by_event_type[result.event.event_type] += 1
        else:
            self.num_invalid += 1
            for reason in {e.reason for e in result.errors}:
                self.by_reason[reason] += 1
        self.ignored_fields.update(result.ignored_fields)


class InvalidEventsError(ValueError):
    """A file holds an invalid record where only valid events are accepted."""

    def __init__(self, path: Path, result: RecordResult) -> None:
        self.path, self.result = path, result
        first = result.errors[0].render()
        super().__init__(f"{path}:{result.number}: {first}")


def iter_event_tables(
    path: Path | str, *, batch_rows: int = 65_536, ignored_fields: Counter[str] | None = None
) -> Iterator[pa.Table]:
    """The valid events of a JSONL or Parquet file as ``EVENTS_SCHEMA`` tables, streaming.

    Raises ``InvalidEventsError`` at the first invalid record: callers that must not lose data
    refuse the file and point at ``servelens events validate``. Unknown fields the records carried
    are counted into ``ignored_fields`` (for the privacy report). Parquet is checked column by
    column (``schemas.columnar``); JSONL record by record.
    """
    path = Path(path)
    if detect_format(path) == "parquet":
        yield from _parquet_event_tables(path, batch_rows, ignored_fields)
        return
    from schemas.arrow import events_to_table

    batch: list[Event] = []
    for result in iter_file(path, batch_rows=batch_rows):
        if result.event is None:
            raise InvalidEventsError(path, result)
        if ignored_fields is not None:
            ignored_fields.update(result.ignored_fields)
        batch.append(result.event)
        if len(batch) >= batch_rows:
            yield events_to_table(batch)
            batch = []
    if batch:
        yield events_to_table(batch)


def _parquet_event_tables(path: Path, batch_rows: int, ignored_fields: Counter[str] | None) -> Iterator[pa.Table]:
    import pyarrow as pa

    from schemas.arrow import EVENTS_SCHEMA, events_to_table
    from schemas.columnar import WIRE_SCHEMA, check_table

    number, ledger = 0, EventIdLedger()
    for batch in _parquet_batches(path, batch_rows):
        table = pa.Table.from_batches([batch])
        n = table.num_rows
        try:
            wire = pa.table({f.name: table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(n, f.type)
                             for f in WIRE_SCHEMA}, schema=WIRE_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a column of another type: the reference explains
            wire = None
        valid, clean, dropped = check_table(wire) if wire is not None else (None, None, Counter())
        if valid is None or not valid.all():  # the reference validator names the first bad record
            events = []
            for offset, row in enumerate(table.to_pylist()):
                result = validate_record(row, number + offset + 1)
                if result.event is None:
                    raise InvalidEventsError(path, result)
                events.append(result.event)
            clean = events_to_table(events)
        if ignored_fields is not None:
            ignored_fields.update(dropped)
            for name in table.column_names:
                if name not in WIRE_SCHEMA.names and (count := n - table[name].null_count):
                    ignored_fields[name] += count
        assert clean is not None  # check_table gives a table whenever every row is valid
        clean = clean.cast(EVENTS_SCHEMA)
        _refuse_conflicts(path, ledger, clean, number)
        number += n
        yield clean


def _refuse_conflicts(path: Path, ledger: EventIdLedger, table: pa.Table, number: int) -> None:
    """``InvalidEventsError`` at the first row of ``table`` (rows ``number`` + 1 on) whose event id an earlier
    row of the file holds with other content (``schemas.duplicates``)."""
    numbers = np.arange(number + 1, number + table.num_rows + 1, dtype=np.int64)
    for i, first in ledger.check(*table_hashes(table), numbers)[:1]:
        error = duplicate_event_id_error(table["event_id"][i].as_py(), f"row {first}")
        raise InvalidEventsError(path, RecordResult(number + i + 1, None, (error,)))
