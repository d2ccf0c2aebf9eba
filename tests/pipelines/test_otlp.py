"""OpenTelemetry in: vLLM request spans (OTLP JSON and protobuf) become events whose request table equals the spans."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

from pipelines.decode import Decoder
from pipelines.otlp import NOT_OTLP, UNKNOWN_SPAN, read_spans
from replay.derive import derive_requests
from schemas.validate import INCONSISTENT, MISSING_FIELD
from servelens.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_spans.otlp.json"
START_NS = 1_764_000_000_123_456_789


def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def spans(data: dict) -> list[dict]:
    return data["resourceSpans"][0]["scopeSpans"][0]["spans"]


def with_spans(data: dict, new: list[dict]) -> dict:
    data = copy.deepcopy(data)
    data["resourceSpans"][0]["scopeSpans"][0]["spans"] = new
    return data


def renamed(span: dict, suffix: str) -> dict:
    """The span as another request: new trace, span and request ids (the timings unchanged)."""
    span = copy.deepcopy(span)
    span["traceId"] = span["traceId"][:-len(suffix)] + suffix
    span["spanId"] = span["spanId"][:-len(suffix)] + suffix
    for a in span["attributes"]:
        if a["key"] == "gen_ai.request.id":
            a["value"]["stringValue"] += "-" + suffix
    return span


def without(span: dict, key: str) -> dict:
    span = copy.deepcopy(span)
    span["attributes"] = [a for a in span["attributes"] if a["key"] != key]
    return span


def to_proto(data: dict) -> bytes:
    """The same TracesData in the Collector's otlp_proto encoding, built with opentelemetry-proto."""
    message = TracesData()
    for rs in data["resourceSpans"]:
        out_rs = message.resource_spans.add()
        for a in rs["resource"]["attributes"]:
            _set(out_rs.resource.attributes.add(), a)
        for ss in rs["scopeSpans"]:
            out_ss = out_rs.scope_spans.add()
            out_ss.scope.name = ss["scope"]["name"]
            for span in ss["spans"]:
                out = out_ss.spans.add()
                out.trace_id, out.span_id = bytes.fromhex(span["traceId"]), bytes.fromhex(span["spanId"])
                out.name, out.kind = span["name"], span["kind"]
                out.start_time_unix_nano = int(span["startTimeUnixNano"])
                out.end_time_unix_nano = int(span["endTimeUnixNano"])
                out.status.code = span.get("status", {}).get("code", 0)
                for a in span["attributes"]:
                    _set(out.attributes.add(), a)
    return message.SerializeToString()


def _set(kv, attribute: dict) -> None:
    kv.key = attribute["key"]
    (kind, value), = attribute["value"].items()
    if kind == "intValue":
        kv.value.int_value = int(value)
    elif kind == "doubleValue":
        kv.value.double_value = value
    elif kind == "stringValue":
        kv.value.string_value = value
    elif kind == "arrayValue":
        for v in value["values"]:
            kv.value.array_value.values.add().string_value = v["stringValue"]


def request_rows(events) -> dict[int, dict]:
    return {r["num_prompt_tokens"]: r for r in derive_requests(events).to_pylist()}


# ------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("encoding", ["otlp_json", "otlp_proto"])
def test_each_span_becomes_a_request_whose_table_equals_the_span(encoding):
    data = fixture()
    value = json.dumps(data).encode() if encoding == "otlp_json" else to_proto(data)
    batch = Decoder(message_format=encoding).decode([value])
    assert batch.rejected == [] and set(batch.indices.tolist()) == {0}
    rows = request_rows(batch.events)
    full, short = rows[12], rows[40]
    assert full["arrival_ns"] == START_NS
    assert full["queue_s"] == 0.012345 and full["ttft_s"] == 0.087654321 and full["e2e_s"] == 1.234567891
    assert full["num_output_tokens"] == 16 and full["max_output_tokens"] == 256 and full["num_branches"] == 1
    assert full["model"] == "facebook/opt-125m" and full["outcome"] == "completed" and full["itl_from_chunks"]
    assert full["engine_id"] == "otlp:vllm" and full["instance_id"] == "vllm-pod-0"
    assert full["request_id"] == "cmpl-7c5e1f0a9b2d4e6f8a1b3c5d7e9f0a1b"
    assert full["finish_ns"] == 1_764_000_001_358_056_789  # the span's end
    assert full["tpot_s"] == pytest.approx((1.234567891 - 0.087654321) / 15)
    assert (short["queue_s"], short["ttft_s"], short["e2e_s"]) == (0.2, 0.42, 0.42) and short["num_output_tokens"] == 1
    steps = [e for e in batch.events.to_pylist() if e["event_type"] == "step_executed"]
    prefill = next(s for s in steps if s["request_num_tokens"] == [12])
    assert prefill["end_ns"] - prefill["start_ns"] == 50_000_000  # time_in_model_prefill


def test_both_encodings_give_the_same_events_and_auto_detects_each():
    data = fixture()
    as_json = Decoder(message_format="otlp").decode([json.dumps(data).encode()]).events
    as_proto = Decoder(message_format="otlp").decode([to_proto(data)]).events
    assert as_json.equals(as_proto)
    snake = json.dumps(data).replace('"resourceSpans"', '"resource_spans"').replace('"scopeSpans"', '"scope_spans"')
    assert Decoder(message_format="otlp_json").decode([snake.encode()]).events.equals(as_json)


def test_partial_and_unknown_spans_go_to_dead_letters_with_the_reason_and_good_spans_stay():
    data = fixture()
    full, short = spans(data)
    http = {"traceId": "1" * 32, "spanId": "2" * 16, "name": "POST /v1/completions", "kind": 2,
            "startTimeUnixNano": "1764000000000000000", "endTimeUnixNano": "1764000001000000000",
            "attributes": [{"key": "http.request.method", "value": {"stringValue": "POST"}}]}
    messages = [
        json.dumps(with_spans(data, [full, without(renamed(short, "aa"), "gen_ai.latency.e2e")])).encode(),
        to_proto(with_spans(data, [http])),
        b"\x00\x01 not a protobuf or json at all",
        json.dumps({"hello": "world"}).encode(),
        json.dumps(with_spans(data, [_set_attr(renamed(full, "bb"), "gen_ai.latency.time_in_queue", 5.0)])).encode(),
    ]
    batch = Decoder(message_format="otlp").decode(messages)
    assert batch.indices.tolist() == [0] * 5  # the good span of message 0: arrival, step, first, rest, finish
    reasons = {r.index: r.errors[0] for r in batch.rejected}
    assert reasons[0].reason == MISSING_FIELD
    assert reasons[0].path == "$.resourceSpans[0].scopeSpans[0].spans[1].attributes['gen_ai.latency.e2e']"
    assert reasons[1].reason == UNKNOWN_SPAN and "POST /v1/completions" in (reasons[1].message or "")
    client = {**http, "name": "chat facebook/opt-125m", "attributes": [{"key": "gen_ai.request.model", "value": {"stringValue": "m"}}]}
    (rejection,) = Decoder(message_format="otlp").decode([json.dumps(with_spans(data, [client])).encode()]).rejected
    assert rejection.errors[0].reason == UNKNOWN_SPAN  # a GenAI client span is not a vLLM request span
    assert reasons[2].reason == NOT_OTLP and reasons[3].reason == NOT_OTLP
    assert reasons[4].reason == INCONSISTENT  # queued longer than its first-token latency


def _set_attr(span: dict, key: str, value: float) -> dict:
    for a in span["attributes"]:
        if a["key"] == key:
            a["value"] = {"doubleValue": value}
    return span


def test_error_status_and_aborted_requests_are_outcomes():
    data = fixture()
    full, short = spans(data)
    failed = copy.deepcopy(full)
    failed["status"] = {"code": 2, "message": "engine dead"}
    aborted = renamed(short, "cc")
    aborted["attributes"].append({"key": "gen_ai.response.finish_reasons", "value": {"arrayValue": {"values": [{"stringValue": "abort"}]}}})
    rows = request_rows(Decoder(message_format="otlp_proto").decode([to_proto(with_spans(data, [failed, aborted]))]).events)
    assert rows[12]["outcome"] == "error" and rows[40]["outcome"] == "cancelled"


def test_a_redelivered_message_yields_the_same_event_ids():
    value = json.dumps(fixture()).encode()
    a, b = (Decoder(message_format="otlp").decode([value]).events["event_id"].to_pylist() for _ in range(2))
    assert a == b and len(set(a)) == len(a)


def test_unknown_formats_are_configuration_errors():
    with pytest.raises(ConfigError, match="otlp_json"):
        Decoder(message_format="zipkin")
    with pytest.raises(ValueError, match="resourceSpans"):
        read_spans(b"{}", "otlp_json")


# ------------------------------------------------------------------------------------------ broker


def test_spans_through_the_real_broker_land_as_requests_and_dead_letters(broker, topic, tmp_path):
    from pipelines.lake import Lake
    from tests.pipelines.test_ingest import consumer, produce

    data = fixture()
    full, short = spans(data)
    json_message = json.dumps(data).encode()
    proto_message = to_proto(with_spans(data, [renamed(full, "dd"), renamed(short, "dd")]))
    partial = to_proto(with_spans(data, [without(renamed(full, "ee"), "gen_ai.usage.prompt_tokens")]))
    produce(broker.bootstrap, topic, [(b"5b8efff798038103d269b633813fc60c", json_message), (None, proto_message), (None, partial)])
    stats = consumer(broker.bootstrap, topic, tmp_path / "lake", message_format="otlp").run(idle_exit_s=1.5)
    assert stats.events_written == 2 * 9 and stats.dead_letters == 1  # 5 events for a 16-token span, 4 for a 1-token one
    con = Lake(tmp_path / "lake").connect()
    rows = con.execute("SELECT num_prompt_tokens, queue_s, ttft_s, e2e_s, request_id FROM requests ORDER BY 1, 5").fetchall()
    assert [r[:4] for r in rows] == [(12, 0.012345, 0.087654321, 1.234567891)] * 2 + [(40, 0.2, 0.42, 0.42)] * 2
    assert all(r[4].startswith("rq_") for r in rows)  # request ids pseudonymized like any other
    (reason, path), = con.execute("SELECT reason, path FROM dead_letters").fetchall()
    assert reason == MISSING_FIELD and path.endswith("attributes['gen_ai.usage.prompt_tokens']")


# ------------------------------------------------------------------------------------------ properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40)
@given(st.lists(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                          st.recursive(st.none() | st.integers() | st.text(max_size=10),
                                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                           st.sampled_from(["resourceSpans", "scopeSpans", "spans", "attributes", "key", "value",
                                                            "intValue", "doubleValue", "startTimeUnixNano", "name"]), inner, max_size=4),
                                       max_leaves=12).map(lambda v: json.dumps(v).encode())), min_size=1, max_size=5))
def test_any_message_is_either_events_or_a_dead_letter_never_a_crash(messages):
    batch = Decoder(message_format="otlp").decode(messages)
    stored = set(batch.indices.tolist())
    rejected = {r.index for r in batch.rejected}
    assert stored | rejected <= set(range(len(messages)))
    assert all(r.errors and r.errors[0].reason for r in batch.rejected)


@settings(max_examples=25)
@given(
    queue_ns=st.integers(0, 10**10), prefill_ns=st.integers(0, 10**10), decode_ns=st.integers(0, 10**11),
    completion=st.integers(1, 10_000), encoding=st.sampled_from(["otlp_json", "otlp_proto"]),
)
def test_queue_ttft_and_e2e_equal_the_span_for_any_valid_latencies(queue_ns, prefill_ns, decode_ns, completion, encoding):
    queue_s, ttft_s, e2e_s = queue_ns / 1e9, (queue_ns + prefill_ns) / 1e9, (queue_ns + prefill_ns + decode_ns) / 1e9
    data = fixture()
    span = copy.deepcopy(spans(data)[1])
    values = {"gen_ai.latency.time_in_queue": queue_s, "gen_ai.latency.time_to_first_token": ttft_s, "gen_ai.latency.e2e": e2e_s}
    for a in span["attributes"]:
        if a["key"] in values:
            a["value"] = {"doubleValue": values[a["key"]]}
        if a["key"] == "gen_ai.usage.completion_tokens":
            a["value"] = {"intValue": str(completion)}
    data = with_spans(data, [span])
    value = json.dumps(data).encode() if encoding == "otlp_json" else to_proto(data)
    batch = Decoder(message_format=encoding).decode([value])
    if batch.rejected:  # seconds that do not round back to an ordered ns triple: refused, never reordered
        assert batch.rejected[0].errors[0].reason == INCONSISTENT
        return
    (row,) = derive_requests(batch.events).to_pylist()
    assert abs(row["queue_s"] - queue_s) <= 1e-9 and abs(row["ttft_s"] - ttft_s) <= 1e-9
    if completion > 1:
        assert abs(row["e2e_s"] - e2e_s) <= 1e-9
    else:  # one token: our E2E is its TTFT (last token = first); vLLM's e2e bounds the finish
        assert row["e2e_s"] == row["ttft_s"] and (row["finish_ns"] - row["arrival_ns"]) / 1e9 >= e2e_s - 1e-9
    assert row["num_output_tokens"] == completion


def test_mutated_fixtures_never_crash_the_decoder():
    """Fields deleted or replaced by junk (nulls, wrong types, huge numbers) at random, seeded."""
    import random

    rng = random.Random(1)
    junk = [None, 0, -1, 1.5, "x", [], {}, [None], {"a": 1}, True, "1e400", 10**30, 2**64]

    def mutate(value):
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                r = rng.random()
                if r < 0.04:
                    continue
                out[k] = rng.choice(junk) if r < 0.12 else mutate(v)
            return out
        if isinstance(value, list):
            return [mutate(v) for v in value if rng.random() > 0.05]
        return value

    decoder = Decoder(message_format="otlp")
    base = fixture()
    for _ in range(400):
        data = mutate(base)
        batch = decoder.decode([json.dumps(data).encode()])
        assert batch.rejected or batch.events.num_rows  # events, a dead letter, or both


def test_the_checked_in_protobuf_fixture_names_its_source_and_matches_the_json_one():
    value = (FIXTURE.parent / "vllm_spans.otlp.pb").read_bytes()
    assert value == to_proto(fixture())
    message = TracesData.FromString(value)
    source = {a.key: a.value.string_value for a in message.resource_spans[0].resource.attributes}["fixture.source"]
    assert "vllm/tracing.py" in source and "tests/tracing/test_tracing.py" in source
    as_proto = Decoder(message_format="otlp_proto").decode([value]).events
    assert as_proto.equals(Decoder(message_format="otlp_json").decode([FIXTURE.read_bytes()]).events)
