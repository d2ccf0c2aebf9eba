"""Streaming the replay's lifecycle events out as ``EVENTS_SCHEMA`` tables, in bounded chunks.

The engine appends one small tuple per event to a per-type buffer, and one tuple per *run* of the
lockstep set (a ``Snapshot`` of its members plus the run's end, length and clock): those expand to
one ``tokens_delivered`` per member at flush time, columnar (numpy), so a run costs the engine O(1).
Every ``chunk_rows`` events the writer builds one Arrow table with the lake schema (rows grouped by
event type within a chunk) and hands it to the sink: a Parquet file (``ParquetSink``, encoded on a
background thread, which pyarrow runs without the GIL), or any callable that takes a table (the
Kafka emitter SDK plugs in here). Memory therefore grows with the chunk size and the requests in
flight, never with the length of the trace.

Event ids are derived from the run id and the request id (``<run>:<request>:<what>``), so they are
unique per run and identical for identical runs. The output hash of the manifest is the SHA-256 of
the Parquet file's bytes, or, when events only go to a custom sink, of the Arrow IPC stream of the
chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from itertools import chain
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.load import STEP_COLUMNS, StepLoadMeter
from replay.parquet_out import BackgroundParquet
from replay.request_table import Deliveries, RequestTableWriter
from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION

if TYPE_CHECKING:
    from replay.request import Request

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

Sink = Callable[[pa.Table], None]
#: One event type's rows of a chunk: the row count, and the function that builds their table.
_Part = tuple[int, Callable[[], pa.Table]]

_TYPES = {f.name: f.type for f in EVENTS_SCHEMA}
_STRING_LIST = _TYPES["request_ids"]
_INT_LIST = _TYPES["request_num_tokens"]
#: Columns with few distinct values: dictionary-encoded in Parquet (the rest are near-unique).
_DICTIONARY_COLUMNS = [
    "schema_version", "event_type", "engine_id", "instance_id", "tenant", "service_class", "model", "adapter",
    "decision", "mode", "outcome", "state", "coalesced",
]


class Snapshot:
    """The lockstep members at one moment; run and step events that name it expand to its members.

    Taken through ``EventWriter.snapshot``, which also appends one row per member (the request and
    its output offset) to the chunk's member log: rows ``row`` .. ``row + num_rows`` of member log
    number ``chunk`` (the writer starts a new log at each flush).
    """

    __slots__ = ("requests", "offsets", "num_seqs", "row", "num_rows", "chunk")

    def __init__(self, requests: tuple[Request, ...], num_seqs: int, row: int = 0, chunk: int = -1) -> None:
        self.requests = requests
        # output positions of member i at lockstep clock t are offsets[i] + t
        self.offsets = list(map(_LOCK_OUTPUT, requests))
        self.num_seqs = num_seqs  # decode sequences: the members' branches summed
        self.row = row
        self.num_rows = len(requests)
        self.chunk = chunk

    @property
    def ids(self) -> list[str]:
        """The members' request ids."""
        return list(map(_REQUEST_ID, self.requests))


_REQUEST_ID = attrgetter("request_id")
_FIRST = itemgetter(0)
_INDEX = attrgetter("index")
_LOCK_OUTPUT = attrgetter("lock_output")
_BRANCHES = attrgetter("num_branches")
_ROW = attrgetter("row")
_NUM_ROWS = attrgetter("num_rows")
_CHUNK = attrgetter("chunk")

#: The members of a step without lockstep members.
NO_MEMBERS = Snapshot((), 0)


class _Members:
    """A chunk's member log as columns: row i is one member of one snapshot."""

    def __init__(self, requests: list[Request], offsets: list[int], branches: bool, labelled: bool,
                 indices: bool = False) -> None:
        self.num_rows = n = len(requests)
        self.ids = pa.array(list(map(_REQUEST_ID, requests)), pa.string())
        # the requests' indices (the request table keys deliveries by them)
        self.idx = np.fromiter(map(_INDEX, requests), np.int64, n) if indices else None
        # output positions of a member at lockstep clock t: offset + t
        self.offsets = np.fromiter(offsets, np.int64, n)
        # tokens each member decodes per step: its branches
        self.tokens = np.fromiter(map(_BRANCHES, requests), np.int64, n) if branches else np.ones(n, np.int64)
        self.labels = _labels(requests) if labelled else None

    def rows(self, snapshots: tuple[Snapshot, ...], log_number: int) -> tuple[np.ndarray, np.ndarray]:
        """Each snapshot's first row and number of rows in this log (they must be in this log)."""
        n = len(snapshots)
        first = np.fromiter(map(_ROW, snapshots), np.int64, n)
        count = np.fromiter(map(_NUM_ROWS, snapshots), np.int64, n)
        taken = np.fromiter(map(_CHUNK, snapshots), np.int64, n)
        if ((taken != log_number) & (count > 0)).any():
            raise AssertionError("an event names lockstep members logged in an earlier chunk")
        return first, count


class _FirstTokenRows:
    """A chunk's buffered first tokens as columns."""

    __slots__ = ("reqs", "ts", "instance")

    def __init__(self, reqs: tuple[Request, ...], ts: tuple[int, ...], instance: tuple[str, ...]) -> None:
        self.reqs, self.ts, self.instance = reqs, _int_array(ts), instance

    def idx(self) -> np.ndarray:
        return np.fromiter(map(_INDEX, self.reqs), np.int64, len(self.reqs))


class _TokenRows(_FirstTokenRows):
    """A chunk's buffered deliveries (beyond lockstep runs) as columns."""

    __slots__ = ("num", "upto", "coalesced")

    def __init__(self, reqs: tuple[Request, ...], ts: tuple[int, ...], num: tuple[int, ...], upto: tuple[int, ...],
                 coalesced: tuple[bool, ...], instance: tuple[str, ...]) -> None:
        super().__init__(reqs, ts, instance)
        self.num, self.upto, self.coalesced = _int_array(num), _int_array(upto), np.array(coalesced, bool)


class _RunRows:
    """The deliveries of a chunk's recorded lockstep runs: one row per member per run, as numpy columns."""

    __slots__ = ("members", "rows", "lengths", "n", "ts", "num_tokens", "upto", "coalesced", "instances")

    def __init__(self, buf: list[RunRow], members: _Members, log_number: int) -> None:
        # RunRow fields
        snaps, ts, steps, clock, coalesced, instance = zip(*buf)
        starts, lengths = members.rows(snaps, log_number)
        self.members = members
        self.rows = rows = _ranges(starts, lengths)  # each run's members, as rows of the member log
        self.lengths = lengths
        self.n = len(rows)
        branches = members.tokens[rows]
        self.upto = (members.offsets[rows] + np.repeat(np.array(clock, np.int64), lengths)) * branches
        self.ts = np.repeat(np.array(ts, np.int64), lengths)
        self.num_tokens = np.repeat(np.array(steps, np.int64), lengths) * branches
        self.coalesced = np.repeat(np.array(coalesced, bool), lengths)
        self.instances = instance


class EventChunk:
    """About ``chunk_rows`` events, gathered from the engine's buffers; ``table()`` finishes them.

    Gathering reads the engine's Python objects, so it runs on the replay's thread. What is left,
    building event id strings, list columns and the table, is Arrow compute over those arrays, which
    releases the GIL: ``ParquetSink`` finishes chunks on its background thread, beside the replay.
    """

    __slots__ = ("num_rows", "_parts", "_table")

    def __init__(self, parts: list[_Part]) -> None:
        self.num_rows = sum(n for n, _ in parts)
        self._parts = parts
        self._table: pa.Table | None = None

    def table(self) -> pa.Table:
        """The chunk as one ``EVENTS_SCHEMA`` table (built once; rows grouped by event type)."""
        if self._table is None:
            self._table = pa.concat_tables([build() for _, build in self._parts])
            self._parts = []
        return self._table


class ParquetSink:
    """Writes event tables to one zstd Parquet file, one row group per chunk, on a background thread
    (``replay.parquet_out``).

    It takes tables or ``EventChunk``s; a chunk is finished (``EventChunk.table``) on that thread too.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = BackgroundParquet(self.path, EVENTS_SCHEMA, use_dictionary=_DICTIONARY_COLUMNS, prepare=_table_of)
        self.num_rows = 0

    def __call__(self, events: pa.Table | EventChunk) -> None:
        self._file.put(events)
        self.num_rows += events.num_rows

    def abort(self) -> None:
        """Stop the writer thread after a failed replay (the file is left incomplete)."""
        self._file.abort()

    def close(self) -> str:
        """Finish the file; returns the SHA-256 of its bytes."""
        self._file.close()
        digest = hashlib.sha256()
        with self.path.open("rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
        return digest.hexdigest()


def _table_of(item: pa.Table | EventChunk) -> pa.Table:
    return item.table() if isinstance(item, EventChunk) else item


class EventWriter:
    """Per-type event buffers, flushed as ``EventChunk``s to a sink (``hash_tables``: the SHA-256 of
    their tables' Arrow IPC stream is kept, for when no Parquet file is written)."""

    def __init__(self, sink: Callable[[EventChunk], None], *, run_id: str, engine_id: str, chunk_rows: int = 200_000,
                 hash_tables: bool = True) -> None:
        self.sink = sink
        self.run_id = run_id
        self.engine_id = engine_id
        self.chunk_rows = chunk_rows
        self.hash_tables = hash_tables
        self.hash = hashlib.sha256()
        self.num_events = 0
        self.num_chunks = 0
        # one list of rows per event type (the row types above)
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
        #: the run's own request table (``replay.request_table``), fed at every flush; None: not written
        self.requests: RequestTableWriter | None = None
        #: the run's load (``replay.load``), fed with each chunk's step events; None: not measured
        self.load: StepLoadMeter | None = None

    def snapshot(self, members: tuple[Request, ...], num_seqs: int) -> Snapshot:
        """The lockstep members now, their rows appended to the member log (valid until the next flush)."""
        taken = Snapshot(members, num_seqs, len(self._member_requests), self._log_number)
        self._member_requests.extend(members)
        self._member_offsets.extend(taken.offsets)
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
        """Gather the buffered events into one ``EventChunk`` and hand it to the sink."""
        members = _Members(self._member_requests, self._member_offsets, self._member_branches, self.labelled,
                           indices=self.requests is not None)
        log_number = self._log_number
        self._log_number += 1
        self._member_requests, self._member_offsets, self._member_branches = [], [], False
        runs = _RunRows(self.runs, members, log_number) if self.runs else None
        # FirstTokenRow fields
        first = _FirstTokenRows(*zip(*self.first_tokens)) if self.first_tokens else None
        # TokensRow fields
        tokens = _TokenRows(*zip(*self.tokens)) if self.tokens else None
        # the arrivals' fields and the finished requests' prefix hits, read once for the events and the request table
        arrival = list(map(_ARRIVAL_FIELDS, map(_FIRST, self.arrived)))
        hits = list(map(cached_prefix_hit, map(_FIRST, self.finished)))
        if self.requests is not None:
            self._feed_requests(self.requests, first, tokens, runs, arrival, hits)
        parts = [
            part
            for part in (
                self._arrived_part(arrival),
                self._admission_part(),
                self._steps_part(members, log_number),
                self._preempted_part(),
                self._first_token_part(first),
                self._tokens_part(tokens),
                self._runs_part(members, runs),
                self._cancelled_part(),
                self._finished_part(hits),
                self._states_part(),
            )
            if part is not None
        ]
        if not parts:
            return
        chunk = EventChunk(parts)
        if self.hash_tables:
            stream = pa.BufferOutputStream()
            with pa.ipc.new_stream(stream, EVENTS_SCHEMA) as ipc:
                ipc.write_table(chunk.table())
            self.hash.update(stream.getvalue())
        self.num_events += chunk.num_rows
        self.num_chunks += 1
        self.sink(chunk)

    def output_sha256(self) -> str:
        return self.hash.hexdigest()

    def _feed_requests(self, table: RequestTableWriter, first: _FirstTokenRows | None, tokens: _TokenRows | None,
                       runs: _RunRows | None, arrival: list[tuple[Any, ...]], hits: list[int | None]) -> None:
        """Hand the buffered request events to the request table (before the parts empty the buffers)."""
        parts = []
        if first is not None:
            n = len(first.reqs)
            zeros = np.zeros(n, np.int64)
            parts.append(Deliveries(first.idx(), first.ts, zeros, zeros, np.ones(n, np.int64), np.zeros(n, bool),
                                    table.instance_codes(first.instance)))
        if tokens is not None:
            n = len(tokens.reqs)
            parts.append(Deliveries(tokens.idx(), tokens.ts, np.ones(n, np.int64), tokens.upto, tokens.num,
                                    tokens.coalesced, table.instance_codes(tokens.instance)))
        if runs is not None and runs.n:
            assert runs.members.idx is not None  # a request table's chunks keep their members' indices
            parts.append(Deliveries(runs.members.idx[runs.rows], runs.ts, np.ones(runs.n, np.int64), runs.upto,
                                    runs.num_tokens, runs.coalesced, np.asarray(table.instance_codes(runs.instances))[
                                        np.repeat(np.arange(len(runs.instances)), runs.lengths)]))
        table.add(self, arrival, hits, parts, self.labelled)

    # ------------------------------------------------------------------ parts of a chunk
    #
    # Each ``_*_part`` empties one buffer: it reads the buffered tuples and the requests into arrays
    # (the engine's thread), and returns the row count and a ``build`` function that finishes the
    # table with Arrow compute only (event ids, takes, list columns), wherever the chunk is finished.

    def _table(self, event_type: str, n: int, columns: dict[str, pa.Array]) -> pa.Table:
        columns["schema_version"] = _repeat(SCHEMA_VERSION, n)
        columns["event_type"] = _repeat(event_type, n)
        columns["engine_id"] = _repeat(self.engine_id, n)
        arrays = [columns[f.name] if f.name in columns else _nulls(n, f.type) for f in EVENTS_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)

    def _event_ids(self, ids: pa.Array, suffix: pa.Array | str) -> pa.Array:
        return pc.binary_join_element_wise(f"{self.run_id}:", ids, suffix, "")

    def _request_columns(self, reqs: tuple[Request, ...]) -> dict[str, pa.Array]:
        """Envelope columns of request-scoped events: request ids and the requests' labels."""
        columns = {"request_id": pa.array(list(map(_REQUEST_ID, reqs)), pa.string())}
        if self.labelled:
            columns.update(_labels(reqs))
        return columns

    def _request_part(self, event_type: str, columns: dict[str, pa.Array], suffix: str | tuple[str, np.ndarray]) -> _Part:
        """Request-scoped events; their ids are ``<run>:<request><suffix>``, a suffix numbered per row
        when given as (label, numbers)."""

        def build() -> pa.Table:
            end = suffix if isinstance(suffix, str) else _numbered(*suffix)
            columns["event_id"] = self._event_ids(columns["request_id"], end)
            return self._table(event_type, n, columns)

        n = len(columns["request_id"])
        return n, build

    def _arrived_part(self, fields: list[tuple[Any, ...]]) -> _Part | None:
        """``fields``: each arrival's request's ``_ARRIVAL_FIELDS``."""
        buf, self.arrived = self.arrived, []
        if not buf:
            return None
        # ArrivedRow fields
        reqs, instance, cached = zip(*buf)
        (arrival, prompt, max_output, branches, ttft_deadline, e2e_deadline, session, block_ids, sent) = zip(*fields)
        cols = self._request_columns(reqs)
        cols["ts_ns"] = _ints(arrival)
        if self.out_delay_ns is not None:
            cols["client_sent_ns"] = pa.array(sent, pa.int64())
        cols["instance_id"] = _strings(instance)
        cols["num_prompt_tokens"] = _ints(prompt)
        cols["num_cached_prefix_tokens"] = pa.array(cached, pa.int64())
        cols["max_output_tokens"] = pa.array(max_output, pa.int64())
        cols["num_branches"] = _ints(branches)
        cols["ttft_deadline_ns"] = pa.array(ttft_deadline, pa.int64())
        cols["e2e_deadline_ns"] = pa.array(e2e_deadline, pa.int64())
        cols["session_id"] = pa.array(session, pa.string())
        cols["prefix_block_ids"] = pa.array(block_ids, _TYPES["prefix_block_ids"])
        return self._request_part("request_arrived", cols, ":arrived")

    def _admission_part(self) -> _Part | None:
        buf, self.admission = self.admission, []
        if not buf:
            return None
        # AdmissionRow fields
        reqs, ts, decisions, number, instance = zip(*buf)
        decision, reason, retry_after, low, high = zip(*map(_DECISION_FIELDS, decisions))
        cols = self._request_columns(reqs)
        cols["ts_ns"] = _ints(ts)
        cols["instance_id"] = _strings(instance)
        cols["decision"] = pa.array(decision, pa.string())
        cols["reason"] = pa.array(reason, pa.string())
        cols["retry_after_s"] = pa.array(retry_after, pa.float64())
        cols["predicted_output_tokens_low"] = pa.array(low, pa.int64())
        cols["predicted_output_tokens_high"] = pa.array(high, pa.int64())
        if self.routed:  # a cluster's route decisions name their instance (the column stays null otherwise)
            cols["target"] = pa.array([getattr(d, "target", None) for d in decisions], pa.string())
        return self._request_part("admission_decided", cols, (":admission", np.array(number, np.int64)))

    def _steps_part(self, members: _Members, log_number: int) -> _Part | None:
        buf, self.steps = self.steps, []
        if not buf:
            return None
        n = len(buf)
        # StepRow fields
        instance, index, start, end, num_steps, prefill, decode, snaps, ids, tokens, used, free = zip(*buf)
        # a step's members: its snapshot's rows of the chunk's members, then those scheduled one by one
        # (their own rows, appended after all the snapshots' rows)
        snap_starts, snap_lengths = members.rows(snaps, log_number)
        own_lengths = np.fromiter(map(len, ids), np.int64, n)
        own_ids = pa.array(list(chain.from_iterable(ids)), pa.string())
        own_tokens = np.fromiter(chain.from_iterable(tokens), np.int64, len(own_ids))
        own_starts = members.num_rows + np.cumsum(own_lengths) - own_lengths
        rows = _ranges(
            np.column_stack((snap_starts, own_starts)).ravel(),
            np.column_stack((snap_lengths, own_lengths)).ravel(),
        )
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(snap_lengths + own_lengths, out=offsets[1:])
        flat_tokens = np.concatenate((members.tokens, own_tokens))[rows]
        member_ids = members.ids
        step_index = np.array(index, np.int64)
        cols = {
            "ts_ns": _ints(end),
            "instance_id": _strings(instance),
            "step_index": pa.array(step_index),
            "start_ns": _ints(start),
            "end_ns": _ints(end),
            "num_prefill_tokens": _ints(prefill),
            "num_decode_seqs": _ints(decode),
            "request_num_tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_tokens), type=_INT_LIST),
            "num_kv_blocks_used": _ints(used),
            "num_kv_blocks_free": _ints(free),
            "num_steps": _ints(num_steps),
        }
        if self.load is not None:
            self.load.add(pa.table({name: cols[name] for name in STEP_COLUMNS}))

        def build() -> pa.Table:
            flat_ids = pa.concat_arrays([member_ids, own_ids]).take(rows)
            cols["request_ids"] = pa.ListArray.from_arrays(pa.array(offsets), flat_ids, type=_STRING_LIST)
            cols["event_id"] = self._event_ids(cols["instance_id"], _numbered(":step", step_index))
            return self._table("step_executed", n, cols)

        return n, build

    def _preempted_part(self) -> _Part | None:
        buf, self.preempted = self.preempted, []
        if not buf:
            return None
        # PreemptedRow fields
        reqs, ts, mode, number, lost, instance = zip(*buf)
        cols = self._request_columns(reqs)
        cols["ts_ns"] = _ints(ts)
        cols["mode"] = pa.array(mode, pa.string())
        cols["lease_generation"] = _ints(number)
        cols["num_lost_tokens"] = _ints(lost)
        cols["instance_id"] = _strings(instance)
        return self._request_part("request_preempted", cols, (":preempted", np.array(number, np.int64)))

    def _first_token_part(self, first: _FirstTokenRows | None) -> _Part | None:
        self.first_tokens = []
        if first is None:
            return None
        cols = self._request_columns(first.reqs)
        cols["ts_ns"] = pa.array(first.ts)
        cols["instance_id"] = _strings(first.instance)
        if self.out_delay_ns is not None:
            cols["first_byte_ns"] = pc.add(cols["ts_ns"], pa.scalar(self.out_delay_ns, pa.int64()))
        return self._request_part("first_token", cols, ":first_token")

    def _tokens_part(self, tokens: _TokenRows | None) -> _Part | None:
        self.tokens = []
        if tokens is None:
            return None
        cols = self._request_columns(tokens.reqs)
        cols["ts_ns"] = pa.array(tokens.ts)
        cols["num_tokens"] = pa.array(tokens.num)
        cols["coalesced"] = pa.array(tokens.coalesced)
        cols["instance_id"] = _strings(tokens.instance)
        return self._request_part("tokens_delivered", cols, (":tokens", tokens.upto))

    def _runs_part(self, members: _Members, runs: _RunRows | None) -> _Part | None:
        """One ``tokens_delivered`` per lockstep member per recorded run, expanded with numpy (``_RunRows``)."""
        self.runs = []
        if runs is None:
            return None
        rows, n, lengths, instance = runs.rows, runs.n, runs.lengths, runs.instances
        upto = runs.upto
        member_ids, labels = members.ids, members.labels
        cols = {
            "ts_ns": pa.array(runs.ts),
            "num_tokens": pa.array(runs.num_tokens),
            "coalesced": pa.array(runs.coalesced),
        }
        if instance.count(instance[0]) == len(instance):
            cols["instance_id"] = _repeat(instance[0], n)
        else:
            instance_rows = pa.array(np.repeat(np.arange(len(instance)), lengths))
            cols["instance_id"] = pa.array(instance, pa.string()).take(instance_rows)

        def build() -> pa.Table:
            ids = member_ids.take(rows)
            cols["request_id"] = ids
            cols["event_id"] = self._event_ids(ids, _numbered(":tokens", upto))
            if labels is not None:
                cols.update({name: column.take(rows) for name, column in labels.items()})
            return self._table("tokens_delivered", n, cols)

        return n, build

    def _cancelled_part(self) -> _Part | None:
        buf, self.cancelled = self.cancelled, []
        if not buf:
            return None
        # CancelledRow fields
        reqs, ts, instance = zip(*buf)
        cols = self._request_columns(reqs)
        cols["ts_ns"] = _ints(ts)
        cols["instance_id"] = _strings(instance)
        return self._request_part("request_cancelled", cols, ":cancelled")

    def _finished_part(self, hits: list[int | None]) -> _Part | None:
        """``hits``: each finished request's ``cached_prefix_hit``."""
        buf, self.finished = self.finished, []
        if not buf:
            return None
        # FinishedRow fields
        reqs, ts, outcome, num_output, error, instance = zip(*buf)
        cols = self._request_columns(reqs)
        cols["ts_ns"] = _ints(ts)
        cols["outcome"] = pa.array(outcome, pa.string())
        cols["num_output_tokens"] = _ints(num_output)
        cols["error_message"] = pa.array(error, pa.string())
        cols["instance_id"] = _strings(instance)
        cols["num_cached_prefix_tokens"] = pa.array(hits, pa.int64())
        if self.out_delay_ns is not None:  # a completed request's last token reached the client
            delivered = pc.and_(pc.equal(cols["outcome"], "completed"), pc.greater(cols["num_output_tokens"], 0))
            last = pc.add(cols["ts_ns"], pa.scalar(self.out_delay_ns, pa.int64()))
            cols["last_byte_ns"] = pc.if_else(delivered, last, pa.scalar(None, pa.int64()))
        return self._request_part("request_finished", cols, ":finished")

    def _states_part(self) -> _Part | None:
        buf, self.states = self.states, []
        if not buf:
            return None
        # StateRow fields
        ts, inst, state, blocks, size, models, scale, adapters, tags = zip(*buf)
        cols = {
            "ts_ns": pa.array(ts, pa.int64()),
            "instance_id": pa.array(inst, pa.string()),
            "state": pa.array(state, pa.string()),
            "num_kv_blocks_total": pa.array(blocks, pa.int64()),
            "kv_block_size_tokens": pa.array(size, pa.int64()),
            "resident_models": pa.array(models, _STRING_LIST),
            "resident_adapters": pa.array([a or [] for a in adapters], _STRING_LIST),
        }
        if any(a is not None for a in scale):  # scaling transitions (a cluster's); null for a lone instance
            cols["scale_action"] = pa.array(scale, pa.string())

        def build() -> pa.Table:
            suffix = pc.binary_join_element_wise(":state:", cols["state"], pa.array(tags, pa.string()), "")
            cols["event_id"] = self._event_ids(cols["instance_id"], suffix)
            return self._table("instance_state", len(buf), cols)

        return len(buf), build


def _int_array(values: tuple[int, ...]) -> np.ndarray:
    return np.fromiter(values, np.int64, len(values))


def cached_prefix_hit(r: Request) -> int | None:
    """``request_finished.num_cached_prefix_tokens``: the prompt tokens the engine found cached when it first
    scheduled the request (0 if it never did), for a request with prefix blocks on a caching engine; else None."""
    return r.num_cached_prefix_tokens if r.looks_up_prefix else None


def _ints(values: tuple[int, ...]) -> pa.Array:
    """An int64 column from Python ints (never None)."""
    return pa.array(np.fromiter(values, np.int64, len(values)))


def _strings(values: tuple[str, ...]) -> pa.Array:
    """A string column, built from buffers when it holds one value (an instance id, usually)."""
    if values and values.count(values[0]) == len(values) and values[0] is not None:
        return _repeat(values[0], len(values))
    return pa.array(values, pa.string())


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated index ranges ``starts[i] .. starts[i] + lengths[i]``."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)


def _numbered(label: str, numbers: np.ndarray | tuple[int, ...]) -> pa.Array:
    """``label`` followed by each number (``:tokens42``): small numbers are looked up in a cached table."""
    numbers = np.asarray(numbers, np.int64)
    top = int(numbers.max()) if len(numbers) else 0
    if top >= _MAX_TABLED_NUMBER or (len(numbers) and int(numbers.min()) < 0):
        return pc.binary_join_element_wise(label, pc.cast(pa.array(numbers), pa.string()), "")
    table = _NUMBERED.get(label)
    if table is None or len(table) <= top:
        size = min(_MAX_TABLED_NUMBER, max(top + 1, 2 * len(table) if table is not None else 1024))
        table = _NUMBERED[label] = pa.array([f"{label}{i}" for i in range(size)], pa.string())
    return table.take(numbers)


_NUMBERED: dict[str, pa.Array] = {}
_MAX_TABLED_NUMBER = 1 << 16


def _repeat(value: str, n: int) -> pa.Array:
    """A string column holding one value n times, built from buffers (not from a Python list)."""
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n))


def _nulls(n: int, type_: pa.DataType) -> pa.Array:
    """An all-null column, sliced from a cached one (building a large one each time is slow)."""
    cached = _NULL_LISTS.get(type_)
    if cached is None or len(cached) < n:
        cached = _NULL_LISTS[type_] = pa.nulls(max(n, 2 * len(cached) if cached is not None else n), type_)
    return cached.slice(0, n)


_NULL_LISTS: dict[pa.DataType, pa.Array] = {}


def _labels(reqs: Iterable[Request]) -> dict[str, pa.Array]:
    """The envelope's request labels."""
    columns = zip(*map(_LABEL_FIELDS, reqs))
    return {name: pa.array(values, pa.string()) for name, values in zip(_LABELS, columns)}


_LABELS = ("tenant", "service_class", "model", "adapter")
_LABEL_FIELDS = attrgetter(*_LABELS)
_ARRIVAL_FIELDS = attrgetter(
    "arrival_ns", "num_prompt_tokens", "max_output_tokens", "num_branches_requested", "ttft_deadline_ns", "e2e_deadline_ns",
    "session_id", "prefix_block_ids", "client_sent_ns",
)
_DECISION_FIELDS = attrgetter(
    "decision", "reason", "retry_after_s", "predicted_output_tokens_low", "predicted_output_tokens_high"
)
