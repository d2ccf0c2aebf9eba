"""OpenTelemetry in: vLLM's per-request spans, as the OTel Collector's Kafka exporter writes them, as events.

vLLM (``--otlp-traces-endpoint``; ``--collect-detailed-traces`` adds the model-time attributes)
ends one span per finished request, named ``llm_request``, starting at the request's arrival and
carrying ``gen_ai.*`` attributes. The OpenTelemetry Collector's Kafka exporter writes batches of
spans to a topic (default ``otlp_spans``), one ``TracesData`` message per batch, encoded
``otlp_proto`` (protobuf, its default) or ``otlp_json`` (lowerCamelCase keys, hex ids, 64-bit
integers as strings). ``decode_spans`` reads either and turns each request span into lifecycle events:

==========================================  ================================================================
span                                        event (``ts_ns``)
==========================================  ================================================================
``startTimeUnixNano``                       ``request_arrived`` (arrival; prompt tokens, max_tokens, n)
start + ``gen_ai.latency.time_in_queue``    ``step_executed`` start: first scheduled (one-member step)
... + ``gen_ai.latency.time_in_model_prefill``  that step's end (else the first token)
start + ``gen_ai.latency.time_to_first_token``  ``first_token``
start + ``gen_ai.latency.e2e``              ``tokens_delivered``: completion_tokens - 1 as one chunk
``endTimeUnixNano`` (not before the last)   ``request_finished`` (error if the span's status is ERROR,
                                            cancelled if its finish reason is abort)
==========================================  ================================================================

So the request table's ``queue_s``, ``ttft_s`` and ``e2e_s`` equal the span's values (to the nanosecond). For
a one-token response our E2E is its TTFT by definition (last token = first); a larger ``e2e`` of vLLM's
(output processing after the token) then bounds only the finish from below. What the attributes measure
differs from servelens's boundaries, and some things cannot be recovered at all (per-token gaps, preemptions,
the engine's batches): ``docs/interop.md``.

A span that is not a vLLM request span, or lacks a required attribute, or carries an impossible
value, makes its message a dead letter with the reason and the span's path; the message's good
spans are still ingested. Event ids derive from the trace and span ids, so a redelivered message
is de-duplicated like any producer retry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipelines.decoded import DecodedBatch, Rejected
from schemas.arrow import EVENTS_SCHEMA, events_to_table
from schemas.events import Event, FirstToken, RequestArrived, RequestFinished, StepExecuted, TokensDelivered
from schemas.validate import INCONSISTENT, MISSING_FIELD, OUT_OF_RANGE, WRONG_TYPE, FieldError

NOT_OTLP = "not_otlp"  # the message is not an OTLP TracesData in the expected encoding
UNKNOWN_SPAN = "unknown_span"  # neither named llm_request nor carrying gen_ai.latency.* attributes
FORMATS = ("servelens", "otlp_json", "otlp_proto", "otlp")

REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
QUEUE = "gen_ai.latency.time_in_queue"
TTFT = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
PREFILL = "gen_ai.latency.time_in_model_prefill"
MAX_TOKENS = "gen_ai.request.max_tokens"
NUM_SEQUENCES = "gen_ai.request.n"
CACHED_TOKENS = "gen_ai.usage.cached_tokens"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MODEL = "gen_ai.request.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
#: Attributes without which a span cannot become a request's events.
REQUIRED = (REQUEST_ID, PROMPT_TOKENS, COMPLETION_TOKENS, QUEUE, TTFT, E2E)
STATUS_ERROR = 2  # OTLP Status.StatusCode STATUS_CODE_ERROR
MAX_COUNT = 10**9  # tokens (and n) beyond this are corrupt
MAX_LATENCY_S = 10**7  # ~115 days: beyond this a latency is corrupt (and nanoseconds would overflow)
MAX_TS_NS = 2**62


@dataclass(frozen=True, slots=True)
class Span:
    """One span with what the conversion reads, decoded from either encoding."""

    path: str  # where it sits in its message, for dead letters
    trace_id: str  # hex
    span_id: str  # hex
    name: str
    start_ns: int
    end_ns: int
    status_code: int
    attributes: tuple[tuple[str, object], ...]
    service_name: str | None
    instance_id: str | None


class _Unreadable(Exception):
    pass


# ------------------------------------------------------------------------------------------ decoding


def _json_value(value: dict) -> object:
    """An OTLP/JSON AnyValue as a Python value (intValue may be a string, as 64-bit ints are)."""
    if not isinstance(value, dict):
        return None
    for key, cast in (("stringValue", str), ("boolValue", bool), ("doubleValue", float)):
        if key in value:
            return cast(value[key])
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_json_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    return None


def _get(obj: dict, camel: str, snake: str, default=None):
    """OTLP/JSON readers accept lowerCamelCase and the proto's snake_case names."""
    return obj.get(camel, obj.get(snake, default))


def _json_attributes(items) -> tuple[tuple[str, object], ...]:
    if not isinstance(items, list):
        return ()
    return tuple((a["key"], _json_value(a.get("value"))) for a in items if isinstance(a, dict) and isinstance(a.get("key"), str))


def _spans_from_json(value: bytes) -> Iterator[Span]:
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Unreadable(f"not JSON: {exc}") from None
    resource_spans = _get(data, "resourceSpans", "resource_spans") if isinstance(data, dict) else None
    if not isinstance(resource_spans, list):
        raise _Unreadable("no resourceSpans: not an OTLP/JSON TracesData")
    for r, rs in enumerate(resource_spans):
        resource = dict(_json_attributes((rs.get("resource") or {}).get("attributes")))
        for s, ss in enumerate(_get(rs, "scopeSpans", "scope_spans", []) or []):
            for k, span in enumerate(ss.get("spans") or []):
                try:
                    status = span.get("status") or {}
                    code = status.get("code", 0)
                    yield Span(
                        path=f"$.resourceSpans[{r}].scopeSpans[{s}].spans[{k}]",
                        trace_id=str(_get(span, "traceId", "trace_id", "")),
                        span_id=str(_get(span, "spanId", "span_id", "")),
                        name=str(span.get("name", "")),
                        start_ns=int(_get(span, "startTimeUnixNano", "start_time_unix_nano", 0)),
                        end_ns=int(_get(span, "endTimeUnixNano", "end_time_unix_nano", 0)),
                        status_code=STATUS_ERROR if code in (STATUS_ERROR, "STATUS_CODE_ERROR") else 0,
                        attributes=_json_attributes(span.get("attributes")),
                        service_name=_str_or_none(resource.get("service.name")),
                        instance_id=_str_or_none(resource.get("service.instance.id") or resource.get("host.name")),
                    )
                except (TypeError, ValueError, AttributeError) as exc:
                    raise _Unreadable(f"span {r}/{s}/{k} is malformed: {exc}") from None


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _proto_value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_proto_value(v) for v in value.array_value.values]
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None


def _spans_from_proto(value: bytes) -> Iterator[Span]:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    try:
        data = TracesData.FromString(value)
    except DecodeError as exc:
        raise _Unreadable(f"not an OTLP protobuf TracesData: {exc}") from None
    if not data.resource_spans:
        raise _Unreadable("no resource_spans: not an OTLP TracesData (or an empty one)")
    for r, rs in enumerate(data.resource_spans):
        resource = {a.key: _proto_value(a.value) for a in rs.resource.attributes}
        for s, ss in enumerate(rs.scope_spans):
            for k, span in enumerate(ss.spans):
                yield Span(
                    path=f"$.resourceSpans[{r}].scopeSpans[{s}].spans[{k}]",
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    name=span.name,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    status_code=span.status.code,
                    attributes=tuple((a.key, _proto_value(a.value)) for a in span.attributes),
                    service_name=_str_or_none(resource.get("service.name")),
                    instance_id=_str_or_none(resource.get("service.instance.id") or resource.get("host.name")),
                )


def read_spans(value: bytes, fmt: str = "otlp") -> list[Span]:
    """The spans of one message; ``otlp`` picks JSON for a message that starts with ``{``. Raises
    ``ValueError`` for a message that is not OTLP in that encoding."""
    if fmt == "otlp":
        fmt = "otlp_json" if value[:1] == b"{" else "otlp_proto"
    try:
        return list(_spans_from_json(value) if fmt == "otlp_json" else _spans_from_proto(value))
    except _Unreadable as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a JSON shape that is not OTLP's
        raise ValueError(f"not an OTLP TracesData: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------- conversion


def _number(attrs: dict, key: str, path: str, errors: list[FieldError], *, integer: bool) -> float | int | None:
    value = attrs.get(key)
    where = f"{path}.attributes['{key}']"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and float(value) != int(value)):
        errors.append(FieldError(WRONG_TYPE, where, "wrong type", type(value).__name__, "an integer" if integer else "a number"))
        return None
    if not math.isfinite(value) or value < 0 or value > (MAX_COUNT if integer else MAX_LATENCY_S):
        errors.append(FieldError(OUT_OF_RANGE, where, f"{value!r} is not a non-negative finite number within range"))
        return None
    return int(value) if integer else float(value)


def span_events(span: Span) -> tuple[list[Event], list[FieldError]]:
    """A vLLM request span as lifecycle events, or the errors that keep it out."""
    attrs = dict(span.attributes)
    if span.name != "llm_request" and not any(k.startswith("gen_ai.latency.") for k in attrs):
        return [], [FieldError(UNKNOWN_SPAN, span.path,
                               f"span {span.name!r} is not a vLLM request span (not llm_request, no gen_ai.latency.* attributes)")]
    errors = [FieldError(MISSING_FIELD, f"{span.path}.attributes['{key}']", "required attribute is missing")
              for key in REQUIRED if attrs.get(key) is None]
    rid = attrs.get(REQUEST_ID)
    if rid is not None and (not isinstance(rid, str) or not rid):
        path = f"{span.path}.attributes['{REQUEST_ID}']"
        errors.append(FieldError(WRONG_TYPE, path, "wrong type", type(rid).__name__, "a non-empty string"))
    prompt = _number(attrs, PROMPT_TOKENS, span.path, errors, integer=True)
    completion = _number(attrs, COMPLETION_TOKENS, span.path, errors, integer=True)
    queue_s = _number(attrs, QUEUE, span.path, errors, integer=False)
    ttft_s = _number(attrs, TTFT, span.path, errors, integer=False)
    e2e_s = _number(attrs, E2E, span.path, errors, integer=False)
    prefill_s = _number(attrs, PREFILL, span.path, errors, integer=False)
    max_tokens = _number(attrs, MAX_TOKENS, span.path, errors, integer=True)
    n = _number(attrs, NUM_SEQUENCES, span.path, errors, integer=True)
    cached = _number(attrs, CACHED_TOKENS, span.path, errors, integer=True)
    if span.start_ns <= 0:
        errors.append(FieldError(MISSING_FIELD, f"{span.path}.startTimeUnixNano", "the span has no start time (the arrival)"))
    elif span.start_ns > MAX_TS_NS or not 0 <= span.end_ns <= MAX_TS_NS:
        errors.append(FieldError(OUT_OF_RANGE, f"{span.path}.startTimeUnixNano", "a span time is beyond 2^62 ns"))
    if errors:
        return [], errors
    arrival = span.start_ns
    scheduled = arrival + round(queue_s * 1e9)
    first = arrival + round(ttft_s * 1e9)
    last = arrival + round(e2e_s * 1e9)
    if not scheduled <= first <= last:
        return [], [FieldError(INCONSISTENT, f"{span.path}.attributes",
                               "time_in_queue <= time_to_first_token <= e2e does not hold")]
    if completion == 0:
        return [], [FieldError(OUT_OF_RANGE, f"{span.path}.attributes['{COMPLETION_TOKENS}']",
                               "a span with a first-token latency reports at least one completion token")]
    prefill_end = min(scheduled + round(prefill_s * 1e9), first) if prefill_s is not None else first
    engine = f"otlp:{span.service_name or 'unknown'}"
    model = attrs.get(RESPONSE_MODEL) or attrs.get(REQUEST_MODEL)
    common = {"engine_id": engine, "instance_id": span.instance_id, "request_id": rid,
              "model": str(model) if model is not None else None}
    base = f"otlp:{span.trace_id}:{span.span_id}"
    events: list[Event] = [
        RequestArrived(event_id=f"{base}:arrived", ts_ns=arrival, num_prompt_tokens=prompt, max_output_tokens=max_tokens,
                       num_branches=max(n or 1, 1), num_cached_prefix_tokens=cached, **common),
        StepExecuted(event_id=f"{base}:scheduled", ts_ns=prefill_end, engine_id=engine, instance_id=span.instance_id,
                     model=common["model"], step_index=0, start_ns=scheduled, end_ns=prefill_end,
                     num_prefill_tokens=prompt, num_decode_seqs=0, request_ids=[rid], request_num_tokens=[prompt],
                     num_kv_blocks_used=0, num_kv_blocks_free=0),
        FirstToken(event_id=f"{base}:first", ts_ns=first, **common),
    ]
    if completion > 1:
        events.append(TokensDelivered(event_id=f"{base}:rest", ts_ns=last, num_tokens=completion - 1, coalesced=True, **common))
    reasons = attrs.get(FINISH_REASONS)
    reasons = reasons if isinstance(reasons, list) else [reasons] if reasons else []
    outcome = "error" if span.status_code == STATUS_ERROR else "cancelled" if "abort" in reasons else "completed"
    events.append(RequestFinished(event_id=f"{base}:finished", ts_ns=max(span.end_ns, last), outcome=outcome,
                                  num_output_tokens=completion, **common))
    return events, []


def decode_spans(values: Sequence[bytes], candidates: Sequence[int], rejected: list[Rejected], fmt: str) -> DecodedBatch:
    """Decode messages of OTLP spans (``fmt``: otlp_json, otlp_proto or otlp) into a batch: the
    events of every good span, one rejection per message with a bad span (all its errors)."""
    events: list[Event] = []
    index: list[int] = []
    for i in candidates:
        try:
            spans = read_spans(values[i], fmt)
        except ValueError as exc:
            rejected.append(Rejected(i, len(values[i]), (FieldError(NOT_OTLP, "$", str(exc)),)))
            continue
        if not spans:  # the Collector never sends an empty batch; garbage often decodes as one
            rejected.append(Rejected(i, len(values[i]), (FieldError(NOT_OTLP, "$", "the message holds no span"),)))
            continue
        errors: list[FieldError] = []
        for span in spans:
            got, bad = span_events(span)
            events += got
            index += [i] * len(got)
            errors += bad
        if errors:
            rejected.append(Rejected(i, len(values[i]), tuple(errors)))
    table = events_to_table(events) if events else EVENTS_SCHEMA.empty_table()
    return DecodedBatch(table, np.array(index, dtype=np.int64), sorted(rejected, key=lambda r: r.index))
