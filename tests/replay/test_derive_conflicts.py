"""The request table from conflicting or extreme events (probe findings): a request's arrival is one event, never a
mix of several, and a number the table cannot hold is a clean error naming the problem."""

from __future__ import annotations

import base64
import json
import random

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.derive import DerivationError, connect, count_repeated_arrivals, derive_requests, read_events
from schemas.arrow import events_to_table
from schemas.events import FirstToken, RequestArrived, RequestFinished, TokensDelivered
from schemas.types import MAX_COUNT
from servelens.cli import cli

T0 = 1_765_000_000_000_000_000
ENV = {"engine_id": "eng-1", "instance_id": "inst-1"}
KEY = "test-key:" + base64.b64encode(bytes(range(32))).decode()


def _arrived(event_id: str, ts_ns: int, **fields) -> RequestArrived:
    defaults = {"request_id": "r1", "tenant": "a", "num_prompt_tokens": 1, "max_output_tokens": 1}
    return RequestArrived(event_id=event_id, ts_ns=ts_ns, **ENV, **{**defaults, **fields})


def _finished(ts_ns: int = T0 + 9) -> RequestFinished:
    return RequestFinished(event_id="fin", ts_ns=ts_ns, request_id="r1", outcome="completed", num_output_tokens=1, **ENV)


#: Two arrivals of r1 as distinct events: the later one has another tenant, prompt, limit, session and more.
EARLY = _arrived("e1", T0, session_id=None, client_sent_ns=T0 - 5, num_branches=1)
LATE = _arrived("e2", T0 + 5, tenant="b", num_prompt_tokens=999, max_output_tokens=77, session_id="s-late",
                client_sent_ns=T0 - 100, num_branches=3, num_cached_prefix_tokens=10, model="m-late", pool="canary")
ARRIVAL_FIELDS = ["arrival_ns", "tenant", "num_prompt_tokens", "max_output_tokens", "session_id", "client_sent_ns",
                  "num_branches", "num_cached_prefix_tokens", "model", "pool"]


def _arrival(row: dict) -> dict:
    return {name: row[name] for name in ARRIVAL_FIELDS}


def test_every_field_of_the_arrival_comes_from_the_earliest_arrival():
    (row,) = derive_requests(events_to_table([LATE, EARLY, _finished()])).to_pylist()
    assert _arrival(row) == {"arrival_ns": T0, "tenant": "a", "num_prompt_tokens": 1, "max_output_tokens": 1,
                             "session_id": None, "client_sent_ns": T0 - 5, "num_branches": 1,
                             "num_cached_prefix_tokens": None, "model": "m-late", "pool": "canary"}
    # model and pool: the earliest arrival names none, so they come from the request's other events (as before)
    events = [EARLY, LATE, _finished(), EARLY, LATE]  # retries: the same event_id twice; in any order
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(events)
        assert derive_requests(events_to_table(events)).to_pylist() == [row]


def test_arrivals_at_the_same_instant_are_ordered_by_event_id():
    first = _arrived("a-first", T0, tenant="x", num_prompt_tokens=5)
    second = _arrived("b-second", T0, tenant="y", num_prompt_tokens=6)
    (row,) = derive_requests(events_to_table([second, first])).to_pylist()
    assert (row["tenant"], row["num_prompt_tokens"]) == ("x", 5)


def test_requests_that_arrived_more_than_once_are_counted():
    other = _arrived("o1", T0, request_id="r2")
    assert count_repeated_arrivals(connect(), events_to_table([EARLY, LATE, other, other, _finished()])) == 1
    assert count_repeated_arrivals(connect(), events_to_table([EARLY, EARLY, other])) == 0  # a retry is one arrival


def test_derive_on_the_command_line_takes_the_earliest_arrival_whole(tmp_path):
    path = tmp_path / "two.jsonl"
    events = [LATE, EARLY, _finished()]
    path.write_text("".join(json.dumps({**_wire(e)}) + "\n" for e in events))
    out = tmp_path / "r.parquet"
    done = CliRunner().invoke(cli, ["requests", "derive", str(path), "--out", str(out)],
                              env={"SERVELENS_PSEUDONYM_KEY": KEY}, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    (row,) = pq.read_table(out).to_pylist()
    assert (row["arrival_ns"], row["num_prompt_tokens"], row["max_output_tokens"], row["num_branches"]) == (T0, 1, 1, 1)
    assert row["client_sent_ns"] == T0 - 5 and row["session_id"] is None
    assert row["tenant"] == _lookup("a", "tenant")  # the pseudonym of the earliest arrival's tenant, not max()'s
    assert "warning: 1 requests arrived more than once (distinct request_arrived events)" in done.output


def test_a_file_read_back_gives_the_same_arrival(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(_wire(e)) + "\n" for e in [LATE, EARLY]))
    (row,) = derive_requests(read_events(path)).to_pylist()
    assert (row["arrival_ns"], row["num_prompt_tokens"], row["tenant"]) == (T0, 1, "a")


# -- numbers the table cannot hold ---------------------------------------------------------------------------------


def _deliveries(num_tokens: int) -> list:
    events = [EARLY, FirstToken(event_id="ft", ts_ns=T0 + 1, request_id="r1", **ENV)]
    return events + [TokensDelivered(event_id=f"d{i}", ts_ns=T0 + 2 + i, request_id="r1", num_tokens=num_tokens, **ENV)
                     for i in range(2)]


@pytest.mark.parametrize("write", [False, True], ids=["table", "file"])
def test_unvalidated_counts_beyond_int64_sums_are_a_derivation_error(tmp_path, write):
    (row,) = derive_requests(events_to_table(_deliveries(MAX_COUNT))).to_pylist()  # the largest valid: exact sums
    assert row["num_output_tokens"] == 1 + 2 * MAX_COUNT and row["num_itl_gaps"] == 2 * MAX_COUNT
    table = events_to_table(_deliveries(2**63 - 1))  # the dataclasses do not check ranges: only the validators do
    source = table
    if write:
        source = tmp_path / "events.parquet"
        pq.write_table(table, source)
    with pytest.raises(DerivationError) as raised:
        derive_requests(source)
    assert "a value of the events is out of range for the request table" in raised.value.message
    assert "servelens events validate" in (raised.value.hint or "") and f"{MAX_COUNT:,}" in (raised.value.hint or "")


def _wire(event) -> dict:
    from schemas.events import event_as_dict

    return event_as_dict(event)


def _lookup(value: str, field: str) -> str:
    done = CliRunner().invoke(cli, ["privacy", "lookup", value, "--field", field],
                              env={"SERVELENS_PSEUDONYM_KEY": KEY}, catch_exceptions=False)
    return done.stdout.split()[0]
