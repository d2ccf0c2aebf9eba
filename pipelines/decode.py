"""Columnar decoding and validation of raw Kafka messages into events and dead letters.

The fast path parses a whole batch of JSON messages at once with ``pyarrow.json`` against the wire
schema, then checks the contract column by column (``schemas.columnar``): known event type and
major version, required fields present, enum values allowed, numbers in range, cross-field rules;
fields omitted by the producer get their defaults. Rows it cannot vouch for (a failed check,
an explicit null, a message that is not one line of ``{...}``) take the slow path: ``schemas.validate.validate_record``,
the reference validator, which either accepts the record or gives the reasons for the dead-letter
store. A test proves the two paths agree on every record.

When ``pyarrow.json`` refuses a batch (one poison message makes the whole parse fail), the batch is
bisected until the poison is isolated, so one bad message costs a few extra parses, not a slow pass
over the whole batch.

Before any parser sees a message, its nesting depth is bounded by a byte scan (``json_depth``):
pyarrow's JSON reader crashes the process (SIGSEGV) on a message nested 100,000 deep and spends
super-linear time on one nested 10,000 deep, so a message deeper than ``max_json_depth`` goes to
dead letters as ``too_deep`` unparsed. The scan counts brackets (two C calls per message); only a
message with more brackets than the limit is scanned exactly (strings stripped, then a running sum).
"""

from __future__ import annotations

import io
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from pipelines.decoded import DecodedBatch, Rejected
from pipelines.otlp import FORMATS, decode_spans
from schemas.arrow import EVENTS_SCHEMA, events_to_table
from schemas.columnar import WIRE_SCHEMA, check_table
from schemas.validate import FieldError, validate_record
from schemas.wire import OVERSIZED, decode_json

CLOCK_SKEW = "clock_skew"
TOO_DEEP = "too_deep"

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # linear: each match ends at the next unescaped quote
_EVENT_TYPE = re.compile(rb'"event_type"\s*:\s*"([a-z_]{1,40})"')


def json_depth(value: bytes) -> int:
    """The deepest nesting of objects and arrays in a JSON message, outside its strings (a byte scan,
    linear in the message: no parser involved). Unbalanced input is scanned as far as it goes."""
    stripped = _JSON_STRING.sub(b'""', value)
    data = np.frombuffer(stripped, dtype=np.uint8)
    steps = (data == 0x7B).astype(np.int32) + (data == 0x5B) - (data == 0x7D) - (data == 0x5D)
    return int(np.cumsum(steps).max(initial=0))


def sniff_event_type(value: bytes) -> str | None:
    """The event type a message names in its first 4 KB, when it is a known one (for dead letters:
    never a value outside the contract's vocabulary)."""
    from schemas.events import EVENT_TYPES

    found = _EVENT_TYPE.search(value[:4096])
    name = found.group(1).decode() if found else None
    return name if name in EVENT_TYPES else None

_SLOW_BATCH = 32  # below this many messages a failed parse goes straight to the slow path


def _parse(values: Sequence[bytes], joined: bytes | None = None) -> pa.Table | None:
    """pyarrow's parse of the messages (``joined``: them joined by newlines already), or None if it
    refuses them."""
    try:
        table = pajson.read_json(
            io.BytesIO(b"\n".join(values) if joined is None else joined),
            read_options=pajson.ReadOptions(use_threads=True, block_size=1 << 22),
            parse_options=pajson.ParseOptions(explicit_schema=WIRE_SCHEMA, unexpected_field_behavior="infer"),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError, ValueError):
        return None
    return table if table.num_rows == len(values) else None


def _slow(value: bytes, index: int) -> tuple[object | None, Rejected | None, tuple[str, ...]]:
    record, reason, message = decode_json(value)
    if reason:
        return None, Rejected(index, len(value), (FieldError(reason, "$", message),), sniff_event_type(value)), ()
    result = validate_record(record, index)
    if result.event is None:
        etype = record.get("event_type") if isinstance(record, dict) else None
        from schemas.events import EVENT_TYPES

        known = etype if isinstance(etype, str) and etype in EVENT_TYPES else None
        return None, Rejected(index, len(value), result.errors, known), ()
    return result.event, None, result.ignored_fields


class Decoder:
    """Turns raw messages into valid events and rejections; keeps no state between batches."""

    def __init__(self, *, max_message_bytes: int = 1_048_576, max_future_skew_ns: int | None = None,
                 message_format: str = "servelens", max_json_depth: int = 32) -> None:
        """``message_format``: servelens (our JSON events), or OTLP spans from the OpenTelemetry
        Collector's Kafka exporter: otlp_json, otlp_proto, or otlp (either, per message; ``pipelines.otlp``)."""
        if message_format not in FORMATS:
            from servelens.errors import ConfigError

            raise ConfigError(f"ingest.message_format: unknown format {message_format!r}; valid: {', '.join(FORMATS)}")
        self.max_message_bytes = max_message_bytes
        self.max_future_skew_ns = max_future_skew_ns
        self.message_format = message_format
        self.max_json_depth = max_json_depth

    def _too_deep(self, values: Sequence[bytes], candidates: list[int]) -> list[int]:
        """The candidates nested deeper than ``max_json_depth`` (JSON messages only: a protobuf
        message's bytes are not brackets)."""
        limit = self.max_json_depth
        if limit <= 0:
            return []
        json_only = self.message_format in ("servelens", "otlp_json")
        return [i for i in candidates
                if values[i].count(b"{") + values[i].count(b"[") > limit
                and (json_only or values[i][:1] == b"{") and json_depth(values[i]) > limit]

    def _screen(self, values: Sequence[bytes], sizes: np.ndarray) -> tuple[list[Rejected], list[int]]:
        """Before any parser: oversized and too deeply nested messages rejected; the rest (candidates)."""
        rejected: list[Rejected] = []
        for i in np.flatnonzero(sizes > self.max_message_bytes).tolist():
            error = FieldError(OVERSIZED, "$", f"{sizes[i]:,} bytes exceed the {self.max_message_bytes:,}-byte limit")
            rejected.append(Rejected(i, int(sizes[i]), (error,), sniff_event_type(values[i])))
        candidates = np.flatnonzero(sizes <= self.max_message_bytes).tolist()
        deep = self._too_deep(values, candidates)
        for i in deep:
            error = FieldError(TOO_DEEP, "$", f"nested deeper than {self.max_json_depth} levels (not parsed)")
            rejected.append(Rejected(i, int(sizes[i]), (error,), sniff_event_type(values[i])))
        if deep:
            deep_set = set(deep)
            candidates = [i for i in candidates if i not in deep_set]
        return rejected, candidates

    def decode(self, values: Sequence[bytes], now_ns: int | None = None) -> DecodedBatch:
        sizes = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        rejected, candidates = self._screen(values, sizes)
        if self.message_format != "servelens":
            batch = decode_spans(values, candidates, rejected, self.message_format)
            return self._reject_skewed(batch, values, now_ns) if self.max_future_skew_ns is not None else batch
        every = len(candidates) == len(values)  # the usual case: nothing oversized or too deep
        joined = b"\n".join(values if every else [values[i] for i in candidates])
        # NaN and Infinity are not JSON, but pyarrow reads them (in an unknown field, unchecked): the
        # reference path refuses them. A mention anywhere sends the message there (conservative).
        suspicious = (b"\r", b"NaN", b"Infinity")
        if joined.count(b"\n") == len(candidates) - 1 and not any(s in joined for s in suspicious):  # the usual case, in C
            lengths = sizes[candidates]
            starts = np.cumsum(lengths + 1) - lengths - 1  # where each message begins in ``joined``
            first = np.zeros(len(lengths), dtype=np.uint8)  # each message's first byte; none if empty
            filled = lengths > 0
            first[filled] = np.frombuffer(joined, dtype=np.uint8)[starts[filled]]
            odd = np.asarray(candidates, dtype=np.int64)[first != 0x7B].tolist()
        else:
            odd = [i for i in candidates if not values[i] or values[i][0] != 0x7B or b"\n" in values[i]
                   or any(s in values[i] for s in suspicious)]
        slow: list[int] = odd  # not "{...}" on one line: the reference path decides
        odd_set = set(odd)
        fast = [i for i in candidates if i not in odd_set] if odd else candidates
        parts: list[tuple[np.ndarray, pa.Table]] = []
        dropped: Counter[str] = Counter()
        self._fast(values, fast, parts, slow, dropped, joined=None if odd else joined)
        slow_events, slow_index = [], []
        for i in sorted(slow):
            event, rejection, ignored = _slow(values[i], i)
            if rejection:
                rejected.append(rejection)
            else:
                slow_events.append(event)
                slow_index.append(i)
                dropped.update(ignored)
        if slow_events:
            parts.append((np.array(slow_index, dtype=np.int64), events_to_table(slow_events)))
        if len(parts) == 1:  # the usual case: one fast part, already in message order
            indices, events = parts[0]
        elif parts:
            indices = np.concatenate([p[0] for p in parts])
            order = np.argsort(indices, kind="stable")
            events = pa.concat_tables([p[1] for p in parts]).take(pa.array(order))
            indices = indices[order]
        else:
            indices, events = np.zeros(0, dtype=np.int64), EVENTS_SCHEMA.empty_table()
        batch = DecodedBatch(events, indices, sorted(rejected, key=lambda r: r.index), dropped, len(slow))
        return self._reject_skewed(batch, values, now_ns) if self.max_future_skew_ns is not None else batch

    def _fast(self, values, idx: list[int], parts, slow: list[int], dropped: Counter[str], joined: bytes | None = None) -> None:
        """Parse and check ``values[idx]`` columnar (``joined``: those messages joined by newlines already)."""
        if not idx:
            return
        mine = values if len(idx) == len(values) else [values[i] for i in idx]
        table = _parse(mine, joined)
        if table is None:
            if len(idx) < _SLOW_BATCH:
                slow.extend(idx)
            else:  # a poison message somewhere: bisect to isolate it
                half = len(idx) // 2
                self._fast(values, idx[:half], parts, slow, dropped)
                self._fast(values, idx[half:], parts, slow, dropped)
            return
        extra = [n for n in table.column_names if n not in EVENTS_SCHEMA.names]
        valid, clean, foreign = check_table(table, mine)
        positions = np.array(idx, dtype=np.int64)
        slow.extend(positions[~valid].tolist())
        if valid.any():
            for name in extra:
                count = int((pc.is_valid(table[name]).to_numpy(zero_copy_only=False) & valid).sum())
                if count:
                    dropped[name] += count
            dropped.update({k: v for k, v in foreign.items()})
            kept = clean.filter(pa.array(valid)).cast(EVENTS_SCHEMA)
            parts.append((positions[valid], kept))

    def _reject_skewed(self, batch: DecodedBatch, values: Sequence[bytes], now_ns: int | None) -> DecodedBatch:
        """Events stamped further in the future than the allowed clock skew go to dead letters."""
        import time

        limit = (now_ns if now_ns is not None else time.time_ns()) + self.max_future_skew_ns
        ahead = pc.greater(batch.events["ts_ns"], limit).to_numpy(zero_copy_only=False)
        if not ahead.any():
            return batch
        types = batch.events["event_type"].to_numpy(zero_copy_only=False)
        for i in np.unique(batch.indices[ahead]):  # one dead letter per message (a span yields several events)
            error = FieldError(CLOCK_SKEW, "$.ts_ns", "the timestamp is further in the future than the allowed clock skew")
            etype = str(types[np.flatnonzero(batch.indices == i)[0]])
            batch.rejected.append(Rejected(int(i), len(values[int(i)]), (error,), etype))
        batch.rejected.sort(key=lambda r: r.index)
        keep = pa.array(~ahead)
        return DecodedBatch(batch.events.filter(keep), batch.indices[~ahead], batch.rejected, batch.dropped_fields, batch.num_slow)
