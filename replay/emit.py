"""The replay's lifecycle events, buffered as the engine makes them and gathered into columns in bounded chunks.

The engine appends one small tuple per event to a per-type buffer, and one tuple per *run* of the
lockstep set (a ``Snapshot`` of its members plus the run's end, length and clock). Every ``chunk_rows``
events the writer gathers the buffers into numpy and Arrow columns (``replay.gathered.Gathered``), the
only step that reads the engine's objects, and hands them to its sink: the replay's outputs
(``replay.outputs``: the events' table and Parquet file, the run's request table, built beside the
replay, in a process of their own for a large one), which expand each run to one ``tokens_delivered``
per member. A run therefore costs the engine O(1), and memory grows with the chunk size and the
requests in flight, never with the length of the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from replay.event_tables import strings
from replay.gathered import LABELS, Admissions, Arrivals, Ends, Gathered, Members, NewRequests, Preemptions, Runs, Steps, Tokens
from schemas.arrow import EVENTS_SCHEMA

if TYPE_CHECKING:
    from replay.request import Request
    from replay.request_table import DoneTracker

# The rows the engine (and a cluster) append to an EventWriter's buffers, one tuple per event, its fields in
# this order (plain tuples: appending one costs the least on the replay's hot path). Snapshots are
# ``replay.lockstep.Snapshot``; an instance id of None is the cluster's frontend.
#: (request, instance_id, num_cached_prefix_tokens)
ArrivedRow = tuple["Request", "str | None", "int | None"]
#: (request, ts_ns, AdmissionDecision or a cluster's route record, decision number, instance_id)
AdmissionRow = tuple["Request", int, Any, int, "str | None"]
#: (instance_id, step_index, start_ns, end_ns, num_steps, num_prefill_tokens, num_decode_seqs, lockstep Snapshot
#: (or NO_MEMBERS), explicit request ids, their tokens per step, kv blocks used, kv blocks free)
StepRow = tuple[str, int, int, int, int, int, int, Any, Any, Any, int, int]
#: (request, ts_ns, mode, preemption number, num_lost_tokens, instance_id)
PreemptedRow = tuple["Request", int, str, int, int, "str | None"]
#: (request, ts_ns, instance_id)
FirstTokenRow = tuple["Request", int, "str | None"]
#: (request, ts_ns, num_tokens, tokens delivered in total after this delivery, coalesced, instance_id)
TokensRow = tuple["Request", int, int, int, bool, "str | None"]
#: (Snapshot, ts_ns = the run's last step end, num_steps, lockstep clock after it, coalesced, instance_id)
RunRow = tuple[Any, int, int, int, bool, "str | None"]
#: (request, ts_ns, instance_id)
CancelledRow = tuple["Request", int, "str | None"]
#: (request, ts_ns, outcome, num_output_tokens, error_message, instance_id)
FinishedRow = tuple["Request", int, str, int, "str | None", "str | None"]
#: (ts_ns, instance_id, state, num_kv_blocks_total, kv_block_size_tokens, resident_models, scale_action,
#: resident_adapters (None: none), event id tag)
StateRow = tuple[int, str, str, int, int, Any, Any, Any, Any]


class Snapshot:
    """The lockstep members at one moment; run and step events that name it expand to its members.

    Taken through ``EventWriter.snapshot``, which also appends one row per member (the request and
    its output offset: its output position at lockstep clock t is offset + t) to the chunk's member
    log: rows ``row`` .. ``row + num_rows`` of member log number ``chunk`` (the writer starts a new
    log at each flush).
    """

    __slots__ = ("requests", "num_seqs", "row", "num_rows", "chunk")

    def __init__(self, requests: tuple[Request, ...], num_seqs: int, row: int = 0, chunk: int = -1) -> None:
        self.requests = requests
        self.num_seqs = num_seqs  # decode sequences: the members' branches summed
        self.row = row
        self.num_rows = len(requests)
        self.chunk = chunk



_REQUEST_ID = attrgetter("request_id")
_INDEX = attrgetter("index")
_LOCK_OUTPUT = attrgetter("lock_output")
_BRANCHES = attrgetter("num_branches")
_ROW = attrgetter("row")
_NUM_ROWS = attrgetter("num_rows")
_CHUNK = attrgetter("chunk")

#: The members of a step without lockstep members.
NO_MEMBERS = Snapshot((), 0)

Sink = Callable[[Gathered], None]

_BLOCK_IDS = next(f.type for f in EVENTS_SCHEMA if f.name == "prefix_block_ids")


class EventWriter:
    """Per-type event buffers, gathered into columns (``replay.gathered.Gathered``) and handed to a sink at
    every flush."""

    def __init__(self, sink: Sink, *, chunk_rows: int = 200_000) -> None:
        self.sink = sink
        self.chunk_rows = chunk_rows
        self.num_events = 0
        self.num_chunks = 0
        # the requests fed in (their ids and labels travel once), then one list of rows per event type (the row
        # types above)
        self.new_requests: list[Request] = []
        self.arrived: list[ArrivedRow] = []
        self.admission: list[AdmissionRow] = []
        self.steps: list[StepRow] = []
        self.preempted: list[PreemptedRow] = []
        self.first_tokens: list[FirstTokenRow] = []
        self.tokens: list[TokensRow] = []
        self.runs: list[RunRow] = []
        self.cancelled: list[CancelledRow] = []
        self.finished: list[FinishedRow] = []
        self.states: list[StateRow] = []
        # the member log: one row per member of each snapshot taken for this chunk (number _log_number)
        self._log_number = 0
        self._member_requests: list[Request] = []
        self._member_offsets: list[int] = []
        self._member_branches = False  # some member decodes several sequences
        #: set by the engine once a request carries a tenant, class, model or adapter label
        self.labelled = False
        #: set by a cluster: admission decisions may carry a ``target`` (the instance a request is routed to)
        self.routed = False
        #: set by an engine with a frontend model (``FrontendConfig``): a token reaches the client this long
        #: after its step, which stamps ``first_byte_ns`` and ``last_byte_ns``; None: the client is not modelled
        self.out_delay_ns: int | None = None
        #: which finished requests' rows the run's request table can write (``replay.request_table``); None: none
        self.requests: DoneTracker | None = None

    def snapshot(self, members: tuple[Request, ...], num_seqs: int) -> Snapshot:
        """The lockstep members now, their rows appended to the member log (valid until the next flush)."""
        taken = Snapshot(members, num_seqs, len(self._member_requests), self._log_number)
        self._member_requests.extend(members)
        self._member_offsets.extend(map(_LOCK_OUTPUT, members))
        if num_seqs != len(members):
            self._member_branches = True
        return taken

    def on_state(self, ts_ns: int, instance_id: str, state: str, num_blocks: int, block_size: int, models: list[str],
                 scale_action: str | None = None, *, adapters: list[str] | None = None, tag: str = "") -> None:
        """An ``instance_state`` event; ``tag`` (e.g. ``:load:3``) ends its id, for a state reported again
        (a residency change: ``replay.residency``)."""
        self.states.append((ts_ns, instance_id, state, num_blocks, block_size, models, scale_action, adapters, tag))

    def pending_rows(self) -> int:
        """Events buffered (a run counts as its members), checked by the engine after each step."""
        return len(self.tokens) + len(self.steps) + len(self.finished) * 3 + len(self.runs) * 8

    # ------------------------------------------------------------------ flush

    def flush(self) -> None:
        """Gather the buffered events into columns and hand them to the sink (nothing when none are buffered)."""
        g = self.gather()
        if not g.num_rows:
            return
        self.num_events += g.num_rows
        self.num_chunks += 1
        self.sink(g)

    def gather(self) -> Gathered:
        """The buffered events as columns; the buffers and the member log start again empty."""
        members = self._members()
        log_number = self._log_number
        self._log_number += 1
        finished = self.finished  # (read before ``_finishes`` empties it: the request table's rows done now)
        return Gathered(
            members=members,
            new=self._new_requests(),
            arrived=self._arrivals(),
            admission=self._admissions(),
            steps=self._steps(log_number),
            preempted=self._preemptions(),
            first=self._first_tokens(),
            tokens=self._tokens(),
            runs=self._runs(log_number),
            cancelled=self._cancellations(),
            finished=self._finishes(),
            states=self._states(),
            done=self.requests.done([row[0] for row in finished], self.labelled) if self.requests is not None else None,
            labelled=self.labelled,
            out_delay_ns=self.out_delay_ns,
        )

    # ------------------------------------------------------------------ each buffer's columns
    #
    # Each reads one buffer's tuples and their requests into arrays and empties it.

    def _members(self) -> Members:
        requests, n = self._member_requests, len(self._member_requests)
        members = Members(
            np.fromiter(map(_INDEX, requests), np.int64, n),
            np.fromiter(self._member_offsets, np.int64, n),
            np.fromiter(map(_BRANCHES, requests), np.int64, n) if self._member_branches else np.ones(n, np.int64),
        )
        self._member_requests, self._member_offsets, self._member_branches = [], [], False
        return members

    def _new_requests(self) -> NewRequests | None:
        reqs, self.new_requests = self.new_requests, []
        if not reqs:
            return None
        labels = zip(*map(_LABEL_FIELDS, reqs))
        return NewRequests(_indices(reqs), pa.array(list(map(_REQUEST_ID, reqs)), pa.string()),
                           {name: pa.array(values, pa.string()) for name, values in zip(LABELS, labels)})

    def _arrivals(self) -> Arrivals | None:
        buf, self.arrived = self.arrived, []
        if not buf:
            return None
        # ArrivedRow fields
        reqs, instance, cached = zip(*buf)
        (arrival, prompt, max_output, branches, ttft_deadline, e2e_deadline, session, block_ids, sent) = zip(
            *map(_ARRIVAL_FIELDS, reqs))
        return Arrivals(
            idx=_indices(reqs), ts=_ints(arrival), instance=strings(instance), cached=pa.array(cached, pa.int64()), prompt=_ints(prompt),
            max_output=pa.array(max_output, pa.int64()), branches=_ints(branches),
            ttft_deadline=pa.array(ttft_deadline, pa.int64()), e2e_deadline=pa.array(e2e_deadline, pa.int64()),
            session=pa.array(session, pa.string()), block_ids=pa.array(block_ids, _BLOCK_IDS),
            sent=pa.array(sent, pa.int64()) if self.out_delay_ns is not None else None,
        )

    def _admissions(self) -> Admissions | None:
        buf, self.admission = self.admission, []
        if not buf:
            return None
        # AdmissionRow fields
        reqs, ts, decisions, number, instance = zip(*buf)
        decision, reason, retry_after, low, high = zip(*map(_DECISION_FIELDS, decisions))
        return Admissions(
            idx=_indices(reqs), ts=_ints(ts), instance=strings(instance), number=_ints(number),
            decision=pa.array(decision, pa.string()), reason=pa.array(reason, pa.string()),
            retry_after=pa.array(retry_after, pa.float64()), low=pa.array(low, pa.int64()),
            high=pa.array(high, pa.int64()),
            target=pa.array([getattr(d, "target", None) for d in decisions], pa.string()) if self.routed else None,
        )

    def _steps(self, log_number: int) -> Steps | None:
        buf, self.steps = self.steps, []
        if not buf:
            return None
        n = len(buf)
        # StepRow fields
        instance, index, start, end, num_steps, prefill, decode, snaps, ids, tokens, used, free = zip(*buf)
        snap_starts, snap_lengths = _snapshot_rows(snaps, log_number)
        own_ids = pa.array(list(chain.from_iterable(ids)), pa.string())
        return Steps(
            instance=strings(instance), step_index=_ints(index), start=_ints(start), end=_ints(end),
            num_steps=_ints(num_steps), prefill=_ints(prefill), decode=_ints(decode), snap_starts=snap_starts,
            snap_lengths=snap_lengths, own_ids=own_ids, own_lengths=np.fromiter(map(len, ids), np.int64, n),
            own_tokens=np.fromiter(chain.from_iterable(tokens), np.int64, len(own_ids)), used=_ints(used),
            free=_ints(free),
        )

    def _preemptions(self) -> Preemptions | None:
        buf, self.preempted = self.preempted, []
        if not buf:
            return None
        # PreemptedRow fields
        reqs, ts, mode, number, lost, instance = zip(*buf)
        return Preemptions(idx=_indices(reqs), ts=_ints(ts), instance=strings(instance), mode=pa.array(mode, pa.string()),
                           number=_ints(number), lost=_ints(lost))

    def _first_tokens(self) -> Tokens | None:
        buf, self.first_tokens = self.first_tokens, []
        if not buf:
            return None
        # FirstTokenRow fields
        reqs, ts, instance = zip(*buf)
        n = len(buf)
        return Tokens(idx=_indices(reqs), ts=_ints(ts), instance=strings(instance), num=np.ones(n, np.int64),
                      upto=np.zeros(n, np.int64), coalesced=np.zeros(n, bool))

    def _tokens(self) -> Tokens | None:
        buf, self.tokens = self.tokens, []
        if not buf:
            return None
        # TokensRow fields
        reqs, ts, num, upto, coalesced, instance = zip(*buf)
        return Tokens(idx=_indices(reqs), ts=_ints(ts), instance=strings(instance), num=_ints(num), upto=_ints(upto),
                      coalesced=np.array(coalesced, bool))

    def _runs(self, log_number: int) -> Runs | None:
        buf, self.runs = self.runs, []
        if not buf:
            return None
        # RunRow fields
        snaps, ts, steps, clock, coalesced, instance = zip(*buf)
        starts, lengths = _snapshot_rows(snaps, log_number)
        return Runs(snap_starts=starts, snap_lengths=lengths, ts=_ints(ts), num_steps=_ints(steps), clock=_ints(clock),
                    coalesced=np.array(coalesced, bool), instance=instance)

    def _cancellations(self) -> Ends | None:
        buf, self.cancelled = self.cancelled, []
        if not buf:
            return None
        # CancelledRow fields
        reqs, ts, instance = zip(*buf)
        return Ends(idx=_indices(reqs), ts=_ints(ts), instance=strings(instance))

    def _finishes(self) -> Ends | None:
        buf, self.finished = self.finished, []
        if not buf:
            return None
        # FinishedRow fields
        reqs, ts, outcome, num_output, error, instance = zip(*buf)
        return Ends(idx=_indices(reqs), ts=_ints(ts), instance=strings(instance), outcome=pa.array(outcome, pa.string()),
                    num_output=_ints(num_output), error=pa.array(error, pa.string()),
                    hits=pa.array(list(map(cached_prefix_hit, reqs)), pa.int64()))

    def _states(self) -> list[StateRow]:
        buf, self.states = self.states, []
        return buf


def _snapshot_rows(snapshots: tuple[Snapshot, ...], log_number: int) -> tuple[np.ndarray, np.ndarray]:
    """Each snapshot's first row and number of rows in member log ``log_number`` (they must be in that log)."""
    n = len(snapshots)
    first = np.fromiter(map(_ROW, snapshots), np.int64, n)
    count = np.fromiter(map(_NUM_ROWS, snapshots), np.int64, n)
    taken = np.fromiter(map(_CHUNK, snapshots), np.int64, n)
    if ((taken != log_number) & (count > 0)).any():
        raise AssertionError("an event names lockstep members logged in an earlier chunk")
    return first, count


def cached_prefix_hit(r: Request) -> int | None:
    """``request_finished.num_cached_prefix_tokens``: the prompt tokens the engine found cached when it first
    scheduled the request (0 if it never did), for a request with prefix blocks on a caching engine; else None."""
    return r.num_cached_prefix_tokens if r.looks_up_prefix else None


def _ints(values: tuple[int, ...]) -> np.ndarray:
    """An int64 column from Python ints (never None)."""
    return np.fromiter(values, np.int64, len(values))


def _indices(reqs: Sequence[Request]) -> np.ndarray:
    return np.fromiter(map(_INDEX, reqs), np.int64, len(reqs))


_LABEL_FIELDS = attrgetter(*LABELS)
_ARRIVAL_FIELDS = attrgetter(
    "arrival_ns", "num_prompt_tokens", "max_output_tokens", "num_branches_requested", "ttft_deadline_ns", "e2e_deadline_ns",
    "session_id", "prefix_block_ids", "client_sent_ns",
)
_DECISION_FIELDS = attrgetter(
    "decision", "reason", "retry_after_s", "predicted_output_tokens_low", "predicted_output_tokens_high"
)
