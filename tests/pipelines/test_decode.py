"""Columnar decoding: the fast path agrees with the reference validator on every message."""

from __future__ import annotations

import json

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from pipelines.decode import CLOCK_SKEW, OVERSIZED, Decoder
from schemas.arrow import EVENTS_SCHEMA, events_to_table
from schemas.events import EVENT_TYPES, RequestArrived, event_as_dict
from schemas.validate import validate_record
from schemas.wire import decode_json, encode_event
from tests.strategies import any_event


def _arrived(i: int) -> RequestArrived:
    return RequestArrived(event_id=f"e{i}", ts_ns=1_000 + i, engine_id="eng", request_id=f"r{i}", num_prompt_tokens=i)


def test_a_clean_batch_takes_the_fast_path_and_keeps_order():
    events = [_arrived(i) for i in range(500)]
    batch = Decoder().decode([encode_event(e) for e in events])
    assert batch.num_slow == 0 and batch.rejected == []
    assert batch.events.equals(events_to_table(events))
    assert batch.indices.tolist() == list(range(500))


def test_messages_that_are_not_one_object_take_the_reference_path_and_only_they():
    """In a batch with no newline, CR, NaN or Infinity anywhere, the framing check is vectorized over
    the joined batch: an empty message, one with leading blanks, a JSON array, or one after an oversized
    message is still found, and judged as the reference validator judges it alone."""
    values = [encode_event(_arrived(i)) for i in range(200)]
    values[10] = b""
    values[20] = b"  " + values[20]  # valid JSON, but not "{" first: the reference path accepts it
    values[30] = b"[1, 2]"
    values[40] = b"{" + b"x" * 3_000  # oversized: not parsed, and later messages shift in the joined batch
    values[199] = b" " + values[199]
    batch = Decoder(max_message_bytes=2_000).decode(values)
    assert batch.num_slow == 4
    assert {r.index: r.errors[0].reason for r in batch.rejected} == {10: "invalid_json", 30: "not_an_object", 40: OVERSIZED}
    assert batch.indices.tolist() == [i for i in range(200) if i not in (10, 30, 40)]
    for i in (10, 30):
        alone = Decoder().decode([values[i]])
        assert alone.rejected[0].errors[0].reason == {r.index: r.errors[0].reason for r in batch.rejected}[i]


def test_a_poison_message_mid_batch_is_isolated_and_the_rest_kept():
    values = [encode_event(_arrived(i)) for i in range(1_000)]
    values[517] = b'{"event_id": "x", "ts_ns": "soon"'
    batch = Decoder().decode(values)
    assert [r.index for r in batch.rejected] == [517]
    assert batch.rejected[0].errors[0].reason == "invalid_json"
    assert batch.events.num_rows == 999 and 517 not in batch.indices.tolist()
    assert batch.num_slow < 64  # bisection, not a slow pass over the whole batch


def test_every_kind_of_bad_message_is_rejected_with_its_reason():
    good = event_as_dict(_arrived(1))
    cases = {
        "wrong_type": json.dumps({**good, "num_prompt_tokens": "many"}).encode(),
        "missing_field": json.dumps({k: v for k, v in good.items() if k != "request_id"}).encode(),
        "unknown_event_type": json.dumps({**good, "event_type": "request_teleported"}).encode(),
        "unsupported_major_version": json.dumps({**good, "schema_version": "2.0"}).encode(),
        "invalid_json": json.dumps({**good, "num_prompt_tokens": float("nan")}).encode(),
        "not_utf8": b'{"event_id": "\xff"}',
        "out_of_range": json.dumps({**good, "num_prompt_tokens": -1}).encode(),
        OVERSIZED: json.dumps({**good, "user_agent": "x" * 2_000}).encode(),
    }
    decoder = Decoder(max_message_bytes=1_500)
    batch = decoder.decode(list(cases.values()) + [encode_event(_arrived(9))])
    reasons = {r.index: r.errors[0].reason for r in batch.rejected}
    assert reasons == {i: reason for i, reason in enumerate(cases)}
    assert batch.events.num_rows == 1


def test_fields_of_other_types_and_unknown_fields_are_dropped_and_counted():
    record = {**event_as_dict(_arrived(1)), "decision": "accept", "prompt": "secret text"}
    batch = Decoder().decode([json.dumps(record).encode()] * 3)
    assert batch.events.num_rows == 3 and batch.events["decision"].null_count == 3
    assert batch.dropped_fields == {"decision": 3, "prompt": 3}


def test_omitted_defaults_are_filled_and_multiline_json_takes_the_slow_path():
    record = {k: v for k, v in event_as_dict(_arrived(1)).items() if k != "num_branches" and v is not None}
    pretty = json.dumps(record, indent=2).encode()
    explicit_null = json.dumps({**record, "num_branches": None}).encode()
    batch = Decoder().decode([json.dumps(record).encode(), pretty, explicit_null])
    assert batch.num_slow == 2  # the pretty one and the explicit null; the omitted default is filled fast
    assert batch.events.num_rows == 2 and batch.events["num_branches"].to_pylist() == [1, 1]
    assert [r.index for r in batch.rejected] == [2] and batch.rejected[0].errors[0].reason == "wrong_type"


def test_clock_skewed_events_go_to_dead_letters():
    now = 1_000_000_000_000
    events = [_arrived(1), RequestArrived(event_id="f", ts_ns=now + 10**13, engine_id="e", request_id="r", num_prompt_tokens=1)]
    batch = Decoder(max_future_skew_ns=10**9).decode([encode_event(e) for e in events], now_ns=now)
    assert [r.errors[0].reason for r in batch.rejected] == [CLOCK_SKEW] and batch.events.num_rows == 1


def test_found_by_hypothesis_infinity_in_an_unknown_field_and_a_huge_integer_for_a_float():
    good = event_as_dict(_arrived(1))
    infinite = json.dumps({**good, "prompt": float("inf")}).encode()  # Infinity: not JSON, even unknown
    decision = {**good, "event_type": "admission_decided", "decision": "accept", "retry_after_s": 2**63}
    batch = Decoder().decode([infinite, json.dumps(decision).encode()])
    assert [(r.index, r.errors[0].reason) for r in batch.rejected] == [(0, "invalid_json")]
    assert batch.events["retry_after_s"].to_pylist() == [float(2**63)]


# ----------------------------------------------------------------------------- agreement with the reference

WRONG_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(2**63, 2**64), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(-1, 3), max_size=2), st.lists(st.none(), min_size=1, max_size=2),
)


@st.composite
def messages(draw) -> bytes:
    record = {k: v for k, v in event_as_dict(draw(any_event)).items() if v is not None or draw(st.booleans())}
    mutation = draw(st.sampled_from(["none", "none", "delete", "retype", "enum", "unknown", "foreign", "type", "version", "garbage"]))
    keys = sorted(record)
    if mutation == "delete":
        record.pop(draw(st.sampled_from(keys)))
    elif mutation == "retype":
        record[draw(st.sampled_from(keys))] = draw(WRONG_VALUES)
    elif mutation == "enum":
        record[draw(st.sampled_from(["decision", "mode", "outcome", "state"]))] = draw(st.sampled_from(["accept", "nope", "swap", "ready"]))
    elif mutation == "unknown":
        record[draw(st.sampled_from(["prompt", "zz_new", "x"]))] = draw(WRONG_VALUES)
    elif mutation == "foreign":
        record[draw(st.sampled_from(["decision", "num_tokens", "request_ids", "outcome"]))] = draw(
            st.sampled_from(["accept", 3, ["a"], "completed"])
        )
    elif mutation == "type":
        record["event_type"] = draw(st.sampled_from([*EVENT_TYPES, "nope", 5]))
    elif mutation == "version":
        record["schema_version"] = draw(st.sampled_from(["1.0", "1.9", "2.0", "x", 1]))
    elif mutation == "garbage":
        return draw(st.binary(max_size=30))
    return json.dumps(record, allow_nan=True).encode()


@given(st.lists(messages(), min_size=1, max_size=40))
def test_fast_path_agrees_with_the_reference_validator(values):
    batch = Decoder().decode(values)
    expected_events, expected_rejected = [], []
    for i, value in enumerate(values):
        record, reason, _ = decode_json(value)
        result = validate_record(record, i) if reason is None else None
        if result is not None and result.event is not None:
            expected_events.append(result.event)
        else:
            expected_rejected.append(i)
    assert [r.index for r in batch.rejected] == expected_rejected
    assert batch.events.equals(events_to_table(expected_events)), (batch.events.to_pylist(), expected_events)
    assert batch.events.schema == EVENTS_SCHEMA
    assert isinstance(batch.events, pa.Table)
