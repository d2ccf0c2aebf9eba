"""The request table: hand-checked rows, requests that legitimately lack events, order and duplication."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay.derive import REQUESTS_SCHEMA, connect, count_backwards, derive_requests, write_requests
from schemas.arrow import events_to_table
from schemas.events import (
    AdmissionDecided,
    FirstToken,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    RequestPreempted,
    StepExecuted,
    TokensDelivered,
)

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
ENV = {"engine_id": "eng-1", "instance_id": "i-1", "tenant": "t-a", "service_class": "interactive", "model": "m"}


def arrived(rid: str, t: int, **kw) -> RequestArrived:
    return RequestArrived(event_id=f"{rid}:arr", ts_ns=t, request_id=rid, num_prompt_tokens=100, **ENV, **kw)


def step(idx: int, start: int, end: int, members: dict[str, int]) -> StepExecuted:
    return StepExecuted(
        event_id=f"step:{idx}", ts_ns=end, engine_id="eng-1", instance_id="i-1", step_index=idx, start_ns=start,
        end_ns=end, num_prefill_tokens=sum(v for v in members.values() if v > 1),
        num_decode_seqs=sum(1 for v in members.values() if v == 1), request_ids=list(members),
        request_num_tokens=list(members.values()), num_kv_blocks_used=4, num_kv_blocks_free=60,
    )


def finished(rid: str, t: int, outcome: str, n: int) -> RequestFinished:
    return RequestFinished(event_id=f"{rid}:fin", ts_ns=t, request_id=rid, outcome=outcome, num_output_tokens=n, **ENV)


def completed_request() -> list:
    """r1: arrives at 0, admitted at 10 ms, prefilled in the step 20-50 ms, then 4 deliveries (one a 2-token chunk)."""
    return [
        arrived("r1", T0),
        AdmissionDecided(event_id="r1:adm", ts_ns=T0 + 10 * MS, request_id="r1", decision="accept", **ENV),
        step(1, T0 + 20 * MS, T0 + 50 * MS, {"r1": 100}),
        FirstToken(event_id="r1:ft", ts_ns=T0 + 50 * MS, request_id="r1", first_byte_ns=T0 + 52 * MS, **ENV),
        TokensDelivered(event_id="r1:d1", ts_ns=T0 + 80 * MS, request_id="r1", num_tokens=1, **ENV),
        TokensDelivered(event_id="r1:d2", ts_ns=T0 + 100 * MS, request_id="r1", num_tokens=2, coalesced=True, **ENV),
        TokensDelivered(event_id="r1:d3", ts_ns=T0 + 160 * MS, request_id="r1", num_tokens=1, **ENV),
        finished("r1", T0 + 161 * MS, "completed", 5),
    ]


def test_a_completed_request_row_is_hand_checked():
    (row,) = derive_requests(events_to_table(completed_request())).to_pylist()
    # Checked by hand from the timeline in completed_request():
    assert row["arrival_ns"] == T0 and row["admission_ns"] == T0 + 10 * MS
    assert row["scheduled_ns"] == T0 + 20 * MS  # start of the first step holding r1
    assert row["first_token_ns"] == T0 + 50 * MS and row["first_byte_ns"] == T0 + 52 * MS
    assert row["last_token_ns"] == T0 + 160 * MS and row["finish_ns"] == T0 + 161 * MS
    assert row["queue_s"] == pytest.approx(0.020, abs=1e-12)
    assert row["ttft_s"] == pytest.approx(0.050, abs=1e-12)
    assert row["e2e_s"] == pytest.approx(0.160, abs=1e-12)  # to the last token, not to finish
    assert row["tpot_s"] == pytest.approx((0.160 - 0.050) / 4, abs=1e-12)  # 5 tokens -> 4 intervals
    # deliveries at 50 (first), 80 (1 token), 100 (a 2-token chunk), 160 ms (1 token): per-token gaps
    # 30, 10, 10, 60 ms (the chunk's 20 ms split evenly over its 2 tokens); 4 gaps for 5 tokens.
    # Nearest rank: p50 is the 2nd of [10, 10, 30, 60] = 10 ms, p99 the 4th = 60 ms; mean 110 / 4 ms.
    assert row["num_itl_gaps"] == 4
    assert row["itl_mean_s"] == pytest.approx(0.110 / 4, abs=1e-12)
    assert row["itl_p50_s"] == pytest.approx(0.010, abs=1e-12)
    assert row["itl_p99_s"] == pytest.approx(0.060, abs=1e-12)
    assert row["itl_max_s"] == pytest.approx(0.060, abs=1e-12)
    assert row["itl_from_chunks"] is True
    assert row["num_output_tokens"] == 5 and row["outcome"] == "completed"
    assert row["admission_decision"] == "accept" and row["num_admission_decisions"] == 1
    assert (row["tenant"], row["service_class"], row["instance_id"]) == ("t-a", "interactive", "i-1")
    assert row["num_events"] == 7  # request-scoped events; the step is engine-level


def test_output_tokens_fall_back_to_counted_deliveries_without_a_finish():
    events = [e for e in completed_request() if e.event_type != "request_finished"]
    (row,) = derive_requests(events_to_table(events)).to_pylist()
    assert row["num_output_tokens"] == 5  # 1 first token + 1 + 2 + 1
    assert row["outcome"] is None and row["finish_ns"] is None


def test_requests_that_legitimately_lack_events():
    events = [
        # rejected before scheduling: no step, no token
        arrived("rej", T0),
        AdmissionDecided(event_id="rej:q", ts_ns=T0 + MS, request_id="rej", decision="queue", **ENV),
        AdmissionDecided(
            event_id="rej:adm", ts_ns=T0 + 5 * MS, request_id="rej", decision="reject", retry_after_s=2.0, **ENV
        ),
        finished("rej", T0 + 5 * MS, "rejected", 0),
        # cancelled after a prefill chunk, before its first token
        arrived("can", T0 + MS),
        step(1, T0 + 2 * MS, T0 + 9 * MS, {"can": 64}),
        RequestCancelled(event_id="can:c", ts_ns=T0 + 10 * MS, request_id="can", **ENV),
        finished("can", T0 + 11 * MS, "cancelled", 0),
        # still in flight: only its arrival
        arrived("new", T0 + 2 * MS),
    ]
    rows = {r["request_id"]: r for r in derive_requests(events_to_table(events)).to_pylist()}
    rej, can, new = rows["rej"], rows["can"], rows["new"]
    assert rej["outcome"] == "rejected" and rej["admission_decision"] == "reject"
    assert rej["num_admission_decisions"] == 2 and rej["admission_ns"] == T0 + MS
    assert rej["scheduled_ns"] is None and rej["ttft_s"] is None and rej["e2e_s"] is None
    assert rej["num_output_tokens"] == 0 and rej["tpot_s"] is None and rej["num_itl_gaps"] == 0
    assert can["outcome"] == "cancelled" and can["cancel_ns"] == T0 + 10 * MS
    assert can["scheduled_ns"] == T0 + 2 * MS and can["queue_s"] == pytest.approx(0.001, abs=1e-12)
    assert can["first_token_ns"] is None and can["ttft_s"] is None
    assert new["outcome"] is None and new["num_output_tokens"] is None and new["num_events"] == 1
    assert [r["request_id"] for r in derive_requests(events_to_table(events)).to_pylist()] == ["rej", "can", "new"]


def test_a_duration_whose_end_precedes_its_start_is_null_and_the_timestamps_are_kept(tmp_path):
    """One engine clock makes these impossible; a skewed clock or a broken emitter makes them anyway. They were
    derived as negative latencies (TTFT -4 s) that the gate, the metrics and a Prometheus export took."""
    early = [e for e in completed_request() if e.event_type != "first_token"] + [
        FirstToken(event_id="r1:ft", ts_ns=T0 - 4_000 * MS, request_id="r1", **ENV),  # 4 s before the arrival
    ]
    (row,) = derive_requests(events_to_table(early)).to_pylist()
    assert row["first_token_ns"] == T0 - 4_000 * MS and row["arrival_ns"] == T0  # kept as recorded
    assert row["ttft_s"] is None  # not -4.0
    assert row["e2e_s"] == pytest.approx(0.160, abs=1e-12)  # last token 160 ms after the arrival: still a duration
    assert row["queue_s"] == pytest.approx(0.020, abs=1e-12)
    client = completed_request()
    client[0] = arrived("r1", T0, client_sent_ns=T0 + 60 * MS)  # the client "sent" after its first byte (52 ms)
    (row,) = derive_requests(events_to_table(client)).to_pylist()
    assert row["ttft_client_s"] is None and row["ttft_s"] == pytest.approx(0.050, abs=1e-12)
    path = tmp_path / "requests.parquet"
    write_requests(events_to_table(early), path)
    assert count_backwards(connect(), path) == 1
    write_requests(events_to_table(completed_request()), path)
    assert count_backwards(connect(), path) == 0


def test_of_two_conflicting_finishes_the_first_counts_with_its_own_fields():
    # a request finishes once; before, the finish time was the first's and the outcome the last's
    events = [*completed_request(), RequestFinished(event_id="r1:fin2", ts_ns=T0 + 900 * MS, request_id="r1",
                                                    outcome="cancelled", num_output_tokens=2, **ENV)]
    (row,) = derive_requests(events_to_table(events)).to_pylist()
    assert (row["finish_ns"], row["outcome"], row["num_output_tokens"]) == (T0 + 161 * MS, "completed", 5)


def test_preemptions_and_lost_tokens_are_counted():
    events = [
        arrived("p", T0),
        RequestPreempted(event_id="p:1", ts_ns=T0 + 5, request_id="p", mode="recompute", lease_generation=1, num_lost_tokens=40, **ENV),
        RequestPreempted(event_id="p:2", ts_ns=T0 + 9, request_id="p", mode="swap", lease_generation=2, **ENV),
    ]
    (row,) = derive_requests(events_to_table(events)).to_pylist()
    assert (row["num_preemptions"], row["num_migrations"], row["num_lost_tokens"]) == (2, 0, 40)


def test_a_move_with_its_kv_is_a_migration_not_a_preemption():
    """mode migrate (a disaggregated hand-off, a migration) counts in num_migrations only; a move
    without the KV is a recompute and counts as a preemption (its tokens are lost)."""
    events = [
        arrived("m", T0),
        RequestPreempted(event_id="m:1", ts_ns=T0 + 5, request_id="m", mode="migrate", lease_generation=1, **ENV),
        RequestPreempted(event_id="m:1", ts_ns=T0 + 5, request_id="m", mode="migrate", lease_generation=1, **ENV),  # a retry
        RequestPreempted(event_id="m:2", ts_ns=T0 + 7, request_id="m", mode="recompute", lease_generation=2,
                         num_lost_tokens=12, **ENV),
        RequestPreempted(event_id="m:3", ts_ns=T0 + 9, request_id="m", mode="migrate", lease_generation=3, **ENV),
    ]
    (row,) = derive_requests(events_to_table(events)).to_pylist()
    assert (row["num_preemptions"], row["num_migrations"], row["num_lost_tokens"]) == (1, 2, 12)


def test_arrow_and_parquet_sources_give_the_same_table(tmp_path):
    table = events_to_table(completed_request())
    path = tmp_path / "events.parquet"
    pq.write_table(table, path)
    out = tmp_path / "requests.parquet"
    assert write_requests(path, out) == 1
    from_parquet = pq.read_table(out)
    assert from_parquet.schema.equals(REQUESTS_SCHEMA, check_metadata=False) or from_parquet.cast(REQUESTS_SCHEMA)
    assert from_parquet.cast(REQUESTS_SCHEMA).equals(derive_requests(table))
    assert derive_requests(path).equals(derive_requests(table))


# ------------------------------------------------------------------------------- order and duplication


@st.composite
def event_streams(draw):
    """Random lifecycles for a handful of requests, including partial ones and shared steps."""
    n = draw(st.integers(1, 6))
    ids = [f"r{i}" for i in range(n)]
    t = st.integers(0, 10_000)
    events = []
    for rid in ids:
        if draw(st.booleans()):
            events.append(arrived(rid, T0 + draw(t)))
        for k in range(draw(st.integers(0, 2))):
            decision = draw(st.sampled_from(["accept", "queue", "reject"]))
            events.append(AdmissionDecided(event_id=f"{rid}:a{k}", ts_ns=T0 + draw(t), request_id=rid, decision=decision, **ENV))
        if draw(st.booleans()):
            events.append(FirstToken(event_id=f"{rid}:ft", ts_ns=T0 + draw(t), request_id=rid, **ENV))
        for k in range(draw(st.integers(0, 4))):
            events.append(
                TokensDelivered(event_id=f"{rid}:d{k}", ts_ns=T0 + draw(t), request_id=rid, num_tokens=draw(st.integers(1, 3)),
                                coalesced=draw(st.booleans()), **ENV)
            )
        if draw(st.booleans()):
            events.append(RequestPreempted(event_id=f"{rid}:p", ts_ns=T0 + draw(t), request_id=rid, mode="recompute",
                                           lease_generation=1, num_lost_tokens=draw(st.integers(0, 50)), **ENV))
        if draw(st.booleans()):
            events.append(RequestCancelled(event_id=f"{rid}:c", ts_ns=T0 + draw(t), request_id=rid, **ENV))
        if draw(st.booleans()):
            events.append(finished(rid, T0 + draw(t), draw(st.sampled_from(["completed", "cancelled", "error"])), draw(st.integers(0, 9))))
    for k in range(draw(st.integers(0, 4))):
        members = draw(st.lists(st.sampled_from(ids), unique=True, max_size=n))
        start = T0 + draw(t)
        events.append(step(k, start, start + draw(st.integers(0, 500)), {m: 1 for m in members}))
    return events


@given(data=st.data(), events=event_streams())
def test_the_table_is_the_same_whatever_order_and_duplication(data, events):
    reference = derive_requests(events_to_table(events))
    duplicates = data.draw(st.lists(st.sampled_from(events), max_size=len(events))) if events else []
    shuffled = data.draw(st.permutations(events + duplicates))
    assert derive_requests(events_to_table(shuffled)).equals(reference)
