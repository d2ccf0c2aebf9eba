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
import queue
import threading
from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION

if TYPE_CHECKING:
    from replay.request import Request

Sink = Callable[[pa.Table], None]

_TYPES = {f.name: f.type for f in EVENTS_SCHEMA}
_STRING_LIST = _TYPES["request_ids"]
_INT_LIST = _TYPES["request_num_tokens"]
#: Columns with few distinct values: dictionary-encoded in Parquet (the rest are near-unique).
_DICTIONARY_COLUMNS = [
    "schema_version", "event_type", "engine_id", "instance_id", "tenant", "service_class", "model", "adapter",
    "decision", "mode", "outcome", "state", "coalesced",
]


class Snapshot:
    """The lockstep members at one moment, with what their deliveries need (fixed at creation)."""

    __slots__ = ("requests", "ids", "offsets", "branches", "num_seqs", "tokens")

    def __init__(self, requests: tuple[Request, ...], num_seqs: int) -> None:
        self.requests = requests
        self.ids = list(map(_REQUEST_ID, requests))
        # output positions of member i at lockstep clock t are offsets[i] + t
        self.offsets = list(map(_LOCK_OUTPUT, requests))
        self.num_seqs = num_seqs
        # branches per member (None: all 1), and the tokens each member decodes per step
        self.branches = None if num_seqs == len(requests) else list(map(_BRANCHES, requests))
        self.tokens = self.branches if self.branches is not None else [1] * len(requests)


_REQUEST_ID = attrgetter("request_id")
_LOCK_OUTPUT = attrgetter("lock_output")
_BRANCHES = attrgetter("num_branches")


class ParquetSink:
    """Writes event tables to one zstd Parquet file, one row group per chunk, on a background thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a path, not a Python file object: Arrow's own file writer never needs the GIL
        self._writer = pq.ParquetWriter(
            str(self.path), EVENTS_SCHEMA, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS
        )
        self._queue: queue.Queue[pa.Table | None] = queue.Queue(maxsize=2)  # bounded: memory stays flat
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replay-parquet", daemon=True)
        self._thread.start()
        self.num_rows = 0

    def _run(self) -> None:
        while True:
            table = self._queue.get()
            if table is None:
                return
            try:
                self._writer.write_table(table, row_group_size=max(1, table.num_rows))
            except BaseException as exc:  # surfaced on the next call or at close
                self._error = exc
                return

    def __call__(self, table: pa.Table) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(table)
        self.num_rows += table.num_rows

    def abort(self) -> None:
        """Stop the writer thread after a failed replay (the file is left incomplete)."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - best effort after the original error
            pass

    def close(self) -> str:
        """Finish the file; returns the SHA-256 of its bytes."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._writer.close()
        digest = hashlib.sha256()
        with self.path.open("rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
        return digest.hexdigest()


class EventWriter:
    """Per-type event buffers, flushed as ``EVENTS_SCHEMA`` tables to a sink."""

    def __init__(self, sink: Sink, *, run_id: str, engine_id: str, chunk_rows: int = 200_000,
                 hash_tables: bool = True) -> None:
        self.sink = sink
        self.run_id = run_id
        self.engine_id = engine_id
        self.chunk_rows = chunk_rows
        self.hash_tables = hash_tables
        self.hash = hashlib.sha256()
        self.num_events = 0
        self.num_chunks = 0
        # one list of tuples per event type; field order documented at each table builder
        self.arrived: list[tuple] = []
        self.admission: list[tuple] = []
        self.steps: list[tuple] = []
        self.preempted: list[tuple] = []
        self.first_tokens: list[tuple] = []
        self.tokens: list[tuple] = []
        self.runs: list[tuple] = []
        self.cancelled: list[tuple] = []
        self.finished: list[tuple] = []
        self.states: list[tuple] = []
        #: set by the engine once a request carries a tenant, class, model or adapter label
        self.labelled = False

    def on_state(self, ts_ns: int, instance_id: str, state: str, num_blocks: int, block_size: int, models: list[str]) -> None:
        self.states.append((ts_ns, instance_id, state, num_blocks, block_size, models))

    def pending_rows(self) -> int:
        """Events buffered (a run counts as its members), checked by the engine after each step."""
        return len(self.tokens) + len(self.steps) + len(self.finished) * 3 + len(self.runs) * 8

    # ------------------------------------------------------------------ flush

    def flush(self) -> None:
        parts = [
            t
            for t in (
                self._arrived_table(),
                self._admission_table(),
                self._steps_table(),
                self._preempted_table(),
                self._first_token_table(),
                self._tokens_table(),
                self._runs_table(),
                self._cancelled_table(),
                self._finished_table(),
                self._states_table(),
            )
            if t is not None
        ]
        if not parts:
            return
        table = pa.concat_tables(parts)
        if self.hash_tables:
            stream = pa.BufferOutputStream()
            with pa.ipc.new_stream(stream, EVENTS_SCHEMA) as ipc:
                ipc.write_table(table)
            self.hash.update(stream.getvalue())
        self.num_events += table.num_rows
        self.num_chunks += 1
        self.sink(table)

    def output_sha256(self) -> str:
        return self.hash.hexdigest()

    # ------------------------------------------------------------------ table builders

    def _table(self, event_type: str, n: int, columns: dict[str, pa.Array]) -> pa.Table:
        columns["schema_version"] = _repeat(SCHEMA_VERSION, n)
        columns["event_type"] = _repeat(event_type, n)
        columns["engine_id"] = _repeat(self.engine_id, n)
        arrays = [columns[f.name] if f.name in columns else _nulls(n, f.type) for f in EVENTS_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)

    def _event_ids(self, ids: pa.Array, suffix: pa.Array | str) -> pa.Array:
        return pc.binary_join_element_wise(f"{self.run_id}:", ids, suffix, "")

    def _request_columns(self, reqs: list[Request], suffix: pa.Array | str) -> dict[str, pa.Array]:
        """Envelope columns of request-scoped events: ids, event ids, the request's labels."""
        ids = pa.array([r.request_id for r in reqs], pa.string())
        columns = {"event_id": self._event_ids(ids, suffix), "request_id": ids}
        if self.labelled:
            columns.update(_labels(reqs))
        return columns

    @staticmethod
    def _numbered(label: str, numbers) -> pa.Array:
        return pc.binary_join_element_wise(label, pc.cast(pa.array(numbers, pa.int64()), pa.string()), "")

    def _arrived_table(self) -> pa.Table | None:
        buf, self.arrived = self.arrived, []
        if not buf:
            return None
        # (request, instance_id, num_cached_prefix_tokens)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, ":arrived")
        cols["ts_ns"] = pa.array([r.arrival_ns for r in reqs], pa.int64())
        cols["instance_id"] = pa.array([b[1] for b in buf], pa.string())
        cols["num_prompt_tokens"] = pa.array([r.num_prompt_tokens for r in reqs], pa.int64())
        cols["num_cached_prefix_tokens"] = pa.array([b[2] for b in buf], pa.int64())
        cols["max_output_tokens"] = pa.array([r.max_output_tokens for r in reqs], pa.int64())
        cols["num_branches"] = pa.array([r.num_branches for r in reqs], pa.int64())
        cols["ttft_deadline_ns"] = pa.array([r.ttft_deadline_ns for r in reqs], pa.int64())
        cols["e2e_deadline_ns"] = pa.array([r.e2e_deadline_ns for r in reqs], pa.int64())
        cols["session_id"] = pa.array([r.session_id for r in reqs], pa.string())
        cols["prefix_block_ids"] = pa.array([r.prefix_block_ids for r in reqs], _TYPES["prefix_block_ids"])
        return self._table("request_arrived", len(buf), cols)

    def _admission_table(self) -> pa.Table | None:
        buf, self.admission = self.admission, []
        if not buf:
            return None
        # (request, ts_ns, AdmissionDecision, decision number, instance_id)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, self._numbered(":admission", [b[3] for b in buf]))
        cols["ts_ns"] = pa.array([b[1] for b in buf], pa.int64())
        cols["instance_id"] = pa.array([b[4] for b in buf], pa.string())
        decisions = [b[2] for b in buf]
        cols["decision"] = pa.array([d.decision for d in decisions], pa.string())
        cols["reason"] = pa.array([d.reason for d in decisions], pa.string())
        cols["retry_after_s"] = pa.array([d.retry_after_s for d in decisions], pa.float64())
        cols["predicted_output_tokens_low"] = pa.array([d.predicted_output_tokens_low for d in decisions], pa.int64())
        cols["predicted_output_tokens_high"] = pa.array([d.predicted_output_tokens_high for d in decisions], pa.int64())
        return self._table("admission_decided", len(buf), cols)

    def _steps_table(self) -> pa.Table | None:
        buf, self.steps = self.steps, []
        if not buf:
            return None
        n = len(buf)
        # (instance_id, step_index, start_ns, end_ns, num_steps, num_prefill_tokens, num_decode_seqs,
        #  lockstep Snapshot or None, explicit request ids, their tokens per step, kv used, kv free)
        instance, index, start, end, num_steps, prefill, decode, snaps, ids, tokens, used, free = zip(*buf)
        # members: the lockstep snapshot's, then those scheduled one by one
        id_lists = [i if s is None else (s.ids + i if i else s.ids) for s, i in zip(snaps, ids)]
        token_lists = [t if s is None else (s.tokens + t if t else s.tokens) for s, t in zip(snaps, tokens)]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, id_lists), np.int64, n), out=offsets[1:])
        off = pa.array(offsets.astype(np.int32))
        flat_ids = list(chain.from_iterable(id_lists))
        flat_tokens = np.fromiter(chain.from_iterable(token_lists), np.int64, int(offsets[-1]))
        inst = pa.array(instance, pa.string())
        cols = {
            "event_id": self._event_ids(inst, self._numbered(":step", index)),
            "ts_ns": pa.array(end, pa.int64()),
            "instance_id": inst,
            "step_index": pa.array(index, pa.int64()),
            "start_ns": pa.array(start, pa.int64()),
            "end_ns": pa.array(end, pa.int64()),
            "num_prefill_tokens": pa.array(prefill, pa.int64()),
            "num_decode_seqs": pa.array(decode, pa.int64()),
            "request_ids": pa.ListArray.from_arrays(off, pa.array(flat_ids, pa.string()), type=_STRING_LIST),
            "request_num_tokens": pa.ListArray.from_arrays(off, pa.array(flat_tokens), type=_INT_LIST),
            "num_kv_blocks_used": pa.array(used, pa.int64()),
            "num_kv_blocks_free": pa.array(free, pa.int64()),
            "num_steps": pa.array(num_steps, pa.int64()),
        }
        return self._table("step_executed", n, cols)

    def _preempted_table(self) -> pa.Table | None:
        buf, self.preempted = self.preempted, []
        if not buf:
            return None
        # (request, ts_ns, mode, preemption number, num_lost_tokens, instance_id)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, self._numbered(":preempted", [b[3] for b in buf]))
        cols["ts_ns"] = pa.array([b[1] for b in buf], pa.int64())
        cols["mode"] = pa.array([b[2] for b in buf], pa.string())
        cols["lease_generation"] = pa.array([b[3] for b in buf], pa.int64())
        cols["num_lost_tokens"] = pa.array([b[4] for b in buf], pa.int64())
        cols["instance_id"] = pa.array([b[5] for b in buf], pa.string())
        return self._table("request_preempted", len(buf), cols)

    def _first_token_table(self) -> pa.Table | None:
        buf, self.first_tokens = self.first_tokens, []
        if not buf:
            return None
        # (request, ts_ns, instance_id)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, ":first_token")
        cols["ts_ns"] = pa.array([b[1] for b in buf], pa.int64())
        cols["instance_id"] = pa.array([b[2] for b in buf], pa.string())
        return self._table("first_token", len(buf), cols)

    def _tokens_table(self) -> pa.Table | None:
        buf, self.tokens = self.tokens, []
        if not buf:
            return None
        # (request, ts_ns, num_tokens, tokens delivered in total after this delivery, coalesced, instance_id)
        reqs, ts, num, upto, coalesced, instance = zip(*buf)
        cols = self._request_columns(list(reqs), self._numbered(":tokens", upto))
        cols["ts_ns"] = pa.array(ts, pa.int64())
        cols["num_tokens"] = pa.array(num, pa.int64())
        cols["coalesced"] = pa.array(coalesced, pa.bool_())
        cols["instance_id"] = pa.array(instance, pa.string())
        return self._table("tokens_delivered", len(buf), cols)

    def _runs_table(self) -> pa.Table | None:
        """One ``tokens_delivered`` per lockstep member per recorded run, expanded with numpy."""
        buf, self.runs = self.runs, []
        if not buf:
            return None
        # (Snapshot, ts_ns = the run's last step end, num_steps, lockstep clock after it, coalesced, instance_id)
        snaps, ts, steps, clock, coalesced, instance = zip(*buf)
        lengths = np.fromiter((len(s.ids) for s in snaps), np.int64, len(snaps))
        n = int(lengths.sum())
        branches = np.fromiter(chain.from_iterable(s.tokens for s in snaps), np.int64, n)
        offsets = np.fromiter(chain.from_iterable(s.offsets for s in snaps), np.int64, n)
        upto = (offsets + np.repeat(np.asarray(clock, np.int64), lengths)) * branches
        ids = pa.array(list(chain.from_iterable(s.ids for s in snaps)), pa.string())
        cols = {
            "event_id": self._event_ids(ids, self._numbered(":tokens", upto)),
            "request_id": ids,
            "ts_ns": pa.array(np.repeat(np.asarray(ts, np.int64), lengths)),
            "num_tokens": pa.array(np.repeat(np.asarray(steps, np.int64), lengths) * branches),
            "coalesced": pa.array(np.repeat(np.asarray(coalesced, bool), lengths)),
            "instance_id": (
                _repeat(instance[0], n)
                if instance.count(instance[0]) == len(instance)
                else pa.array(instance, pa.string()).take(pa.array(np.repeat(np.arange(len(snaps)), lengths)))
            ),
        }
        if self.labelled:
            cols.update(_labels(list(chain.from_iterable(s.requests for s in snaps))))
        return self._table("tokens_delivered", n, cols)

    def _cancelled_table(self) -> pa.Table | None:
        buf, self.cancelled = self.cancelled, []
        if not buf:
            return None
        # (request, ts_ns, instance_id)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, ":cancelled")
        cols["ts_ns"] = pa.array([b[1] for b in buf], pa.int64())
        cols["instance_id"] = pa.array([b[2] for b in buf], pa.string())
        return self._table("request_cancelled", len(buf), cols)

    def _finished_table(self) -> pa.Table | None:
        buf, self.finished = self.finished, []
        if not buf:
            return None
        # (request, ts_ns, outcome, num_output_tokens, error_message, instance_id)
        reqs = [b[0] for b in buf]
        cols = self._request_columns(reqs, ":finished")
        cols["ts_ns"] = pa.array([b[1] for b in buf], pa.int64())
        cols["outcome"] = pa.array([b[2] for b in buf], pa.string())
        cols["num_output_tokens"] = pa.array([b[3] for b in buf], pa.int64())
        cols["error_message"] = pa.array([b[4] for b in buf], pa.string())
        cols["instance_id"] = pa.array([b[5] for b in buf], pa.string())
        return self._table("request_finished", len(buf), cols)

    def _states_table(self) -> pa.Table | None:
        buf, self.states = self.states, []
        if not buf:
            return None
        # (ts_ns, instance_id, state, num_kv_blocks_total, kv_block_size_tokens, resident_models)
        ts, inst, state, blocks, size, models = zip(*buf)
        instances = pa.array(inst, pa.string())
        cols = {
            "event_id": self._event_ids(
                instances, pc.binary_join_element_wise(":state:", pa.array(state, pa.string()), "")
            ),
            "ts_ns": pa.array(ts, pa.int64()),
            "instance_id": instances,
            "state": pa.array(state, pa.string()),
            "num_kv_blocks_total": pa.array(blocks, pa.int64()),
            "kv_block_size_tokens": pa.array(size, pa.int64()),
            "resident_models": pa.array(models, _STRING_LIST),
            "resident_adapters": pa.array([[] for _ in buf], _STRING_LIST),
        }
        return self._table("instance_state", len(buf), cols)


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


def _labels(reqs: list[Request]) -> dict[str, pa.Array]:
    """The envelope's request labels."""
    return {
        "tenant": pa.array([r.tenant for r in reqs], pa.string()),
        "service_class": pa.array([r.service_class for r in reqs], pa.string()),
        "model": pa.array([r.model for r in reqs], pa.string()),
        "adapter": pa.array([r.adapter for r in reqs], pa.string()),
    }
