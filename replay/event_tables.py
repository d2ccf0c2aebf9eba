"""The replay's lifecycle events as ``EVENTS_SCHEMA`` tables, one per flush, from the columns the event writer
gathered (``replay.gathered``): Arrow compute and numpy only, so it runs wherever the outputs are built
(``replay.outputs``: beside the replay, in a process of its own for a large one).

Requests are named by index in the gathered columns; ``KnownRequests`` keeps the ids and labels of the
requests in flight (learned when the workload feeds them in, dropped once they finish) and resolves them. Event ids
are derived from the run id and the request id (``<run>:<request>:<what>``), so they are unique per run
and identical for identical runs. Rows are grouped by event type within a table, in the writer's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.gathered import LABELS, Admissions, Arrivals, Ends, Gathered, Members, Preemptions, Runs, Steps, Tokens
from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION

_TYPES = {f.name: f.type for f in EVENTS_SCHEMA}
_STRING_LIST = _TYPES["request_ids"]
_INT_LIST = _TYPES["request_num_tokens"]


class KnownRequests:
    """The ids and labels of the requests fed in that have not finished, by request index."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._base = 0  # the index of position 0 of ``_pos``
        self._pos = np.zeros(0, np.int64)  # each index's row in the store (-1: not known)
        self._ids = pa.array([], pa.string())
        self._labels = {name: pa.array([], pa.string()) for name in LABELS}
        self._num_known = 0

    def add(self, idx: np.ndarray, ids: pa.Array, labels: dict[str, pa.Array]) -> None:
        """Requests fed in (an index given again keeps its latest row)."""
        if not len(idx):
            return
        if not self._num_known:
            self._base, self._pos = int(idx.min()), np.zeros(0, np.int64)
        low = min(self._base, int(idx.min()))
        top = int(idx.max()) - low + 1
        pos = np.full(max(top, len(self._pos) + self._base - low), -1, np.int64)
        pos[self._base - low: self._base - low + len(self._pos)] = self._pos
        self._base, self._pos = low, pos
        first_row = len(self._ids)
        fresh = self._pos[idx - low] < 0
        self._num_known += int(np.unique(idx[fresh]).size)
        self._pos[idx - low] = first_row + np.arange(len(idx))  # a later duplicate overwrites an earlier one
        self._ids = pa.concat_arrays([self._ids, ids])
        for name in LABELS:
            self._labels[name] = pa.concat_arrays([self._labels[name], labels[name]])

    def rows(self, idx: np.ndarray) -> pa.Array:
        """The store rows of requests ``idx`` (each must be known)."""
        local = idx - self._base
        if len(idx) and (int(local.min()) < 0 or int(local.max()) >= len(self._pos)):
            raise AssertionError("an event names a request never fed in")
        rows = self._pos[local]
        if len(rows) and int(rows.min()) < 0:
            raise AssertionError(f"an event names request #{int(idx[rows < 0][0])}, which is not in flight")
        return pa.array(rows)

    def ids(self, idx: np.ndarray) -> pa.Array:
        return self._ids.take(self.rows(idx))

    def labels(self, idx: np.ndarray) -> dict[str, pa.Array]:
        rows = self.rows(idx)
        return {name: column.take(rows) for name, column in self._labels.items()}

    def drop(self, idx: np.ndarray) -> None:
        """Requests that finished; the store is compacted once most of it is finished requests'."""
        local = idx - self._base
        local = local[(local >= 0) & (local < len(self._pos))]
        was = local[self._pos[local] >= 0]
        self._num_known -= int(np.unique(was).size)
        self._pos[local] = -1
        if len(self._ids) > 2 * self._num_known + 4096:
            self._compact()

    def _compact(self) -> None:
        live = np.flatnonzero(self._pos >= 0)
        if not len(live):
            self._reset()
            return
        rows = self._pos[live]
        self._ids = self._ids.take(pa.array(rows))
        self._labels = {name: column.take(pa.array(rows)) for name, column in self._labels.items()}
        start = int(live[0])
        pos = np.full(len(self._pos) - start, -1, np.int64)
        pos[live - start] = np.arange(len(live))
        self._base, self._pos = self._base + start, pos


class EventTables:
    """Builds each flush's ``EVENTS_SCHEMA`` table from its gathered columns (``table``), in flush order."""

    def __init__(self, run_id: str, engine_id: str) -> None:
        self.run_id = run_id
        self.engine_id = engine_id
        self.known = KnownRequests()

    def table(self, g: Gathered, runs: RunRows | None) -> pa.Table | None:
        """The flush's events (``runs``: its runs expanded, ``expand_runs``); None when it holds none. The requests
        fed in are learned first; those that finished stay known until ``forget`` (the request table reads their
        ids)."""
        if g.new is not None:
            self.known.add(g.new.idx, g.new.request_id, g.new.labels)
        member_ids = self.known.ids(g.members.idx)
        parts = [
            part
            for part in (
                self._arrived(g.arrived, g) if g.arrived is not None else None,
                self._admission(g.admission, g) if g.admission is not None else None,
                self._steps(g.steps, member_ids, g.members) if g.steps is not None else None,
                self._preempted(g.preempted, g) if g.preempted is not None else None,
                self._first_token(g.first, g) if g.first is not None else None,
                self._tokens(g.tokens, g) if g.tokens is not None else None,
                self._runs(runs, member_ids, g) if runs is not None and runs.n else None,
                self._cancelled(g.cancelled, g) if g.cancelled is not None else None,
                self._finished(g.finished, g) if g.finished is not None else None,
                self._states(g.states) if g.states else None,
            )
            if part is not None
        ]
        return pa.concat_tables(parts) if parts else None

    def forget(self, g: Gathered) -> None:
        """The flush's finished requests are no longer in flight."""
        if g.finished is not None:
            self.known.drop(g.finished.idx)

    def _table(self, event_type: str, columns: dict[str, pa.Array]) -> pa.Table:
        n = len(columns["ts_ns"])
        columns["schema_version"] = _repeat(SCHEMA_VERSION, n)
        columns["event_type"] = _repeat(event_type, n)
        columns["engine_id"] = _repeat(self.engine_id, n)
        arrays = [columns[f.name] if f.name in columns else _nulls(n, f.type) for f in EVENTS_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)

    def _event_ids(self, ids: pa.Array, suffix: pa.Array | str) -> pa.Array:
        return pc.binary_join_element_wise(f"{self.run_id}:", ids, suffix, "")

    def _request_part(self, event_type: str, idx: np.ndarray, g: Gathered, columns: dict[str, pa.Array],
                      suffix: str | pa.Array, ids: pa.Array | None = None,
                      labels: dict[str, pa.Array] | None = None) -> pa.Table:
        """Request-scoped events: ids and labels resolved by index (unless given), ids ``<run>:<request><suffix>``."""
        columns["request_id"] = ids = ids if ids is not None else self.known.ids(idx)
        if g.labelled:
            columns.update(labels if labels is not None else self.known.labels(idx))
        columns["event_id"] = self._event_ids(ids, suffix)
        return self._table(event_type, columns)

    def _arrived(self, a: Arrivals, g: Gathered) -> pa.Table:
        cols = {
            "ts_ns": pa.array(a.ts), "instance_id": a.instance, "num_prompt_tokens": pa.array(a.prompt),
            "num_cached_prefix_tokens": a.cached, "max_output_tokens": a.max_output,
            "num_branches": pa.array(a.branches), "ttft_deadline_ns": a.ttft_deadline,
            "e2e_deadline_ns": a.e2e_deadline, "session_id": a.session, "prefix_block_ids": a.block_ids,
        }
        if a.sent is not None:
            cols["client_sent_ns"] = a.sent
        return self._request_part("request_arrived", a.idx, g, cols, ":arrived")

    def _admission(self, d: Admissions, g: Gathered) -> pa.Table:
        cols = {
            "ts_ns": pa.array(d.ts), "instance_id": d.instance, "decision": d.decision, "reason": d.reason,
            "retry_after_s": d.retry_after, "predicted_output_tokens_low": d.low,
            "predicted_output_tokens_high": d.high,
        }
        if d.target is not None:  # a cluster's route decisions name their instance (the column stays null otherwise)
            cols["target"] = d.target
        return self._request_part("admission_decided", d.idx, g, cols, numbered(":admission", d.number))

    def _steps(self, s: Steps, member_ids: pa.Array, members: Members) -> pa.Table:
        # a step's members: its snapshot's rows of the member log, then those scheduled one by one (their own
        # rows, appended after all the snapshots' rows)
        n = len(s.end)
        own_starts = len(members.idx) + np.cumsum(s.own_lengths) - s.own_lengths
        rows = ranges(np.column_stack((s.snap_starts, own_starts)).ravel(),
                      np.column_stack((s.snap_lengths, s.own_lengths)).ravel())
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(s.snap_lengths + s.own_lengths, out=offsets[1:])
        flat_tokens = np.concatenate((members.tokens, s.own_tokens))[rows]
        flat_ids = pa.concat_arrays([member_ids, s.own_ids]).take(pa.array(rows))
        cols = {
            "ts_ns": pa.array(s.end), "instance_id": s.instance, "step_index": pa.array(s.step_index),
            "start_ns": pa.array(s.start), "end_ns": pa.array(s.end), "num_prefill_tokens": pa.array(s.prefill),
            "num_decode_seqs": pa.array(s.decode),
            "request_num_tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_tokens), type=_INT_LIST),
            "request_ids": pa.ListArray.from_arrays(pa.array(offsets), flat_ids, type=_STRING_LIST),
            "num_kv_blocks_used": pa.array(s.used), "num_kv_blocks_free": pa.array(s.free),
            "num_steps": pa.array(s.num_steps),
        }
        cols["event_id"] = self._event_ids(s.instance, numbered(":step", s.step_index))
        return self._table("step_executed", cols)

    def _preempted(self, p: Preemptions, g: Gathered) -> pa.Table:
        cols = {"ts_ns": pa.array(p.ts), "mode": p.mode, "lease_generation": pa.array(p.number),
                "num_lost_tokens": pa.array(p.lost), "instance_id": p.instance}
        return self._request_part("request_preempted", p.idx, g, cols, numbered(":preempted", p.number))

    def _first_token(self, t: Tokens, g: Gathered) -> pa.Table:
        cols = {"ts_ns": pa.array(t.ts), "instance_id": t.instance}
        if g.out_delay_ns is not None:
            cols["first_byte_ns"] = pa.array(t.ts + g.out_delay_ns)
        return self._request_part("first_token", t.idx, g, cols, ":first_token")

    def _tokens(self, t: Tokens, g: Gathered) -> pa.Table:
        cols = {"ts_ns": pa.array(t.ts), "num_tokens": pa.array(t.num), "coalesced": pa.array(t.coalesced),
                "instance_id": t.instance}
        return self._request_part("tokens_delivered", t.idx, g, cols, numbered(":tokens", t.upto))

    def _runs(self, runs: RunRows, member_ids: pa.Array, g: Gathered) -> pa.Table:
        """One ``tokens_delivered`` per lockstep member per recorded run."""
        rows = pa.array(runs.rows)
        instance = runs.instance
        cols = {"ts_ns": pa.array(runs.ts), "num_tokens": pa.array(runs.num_tokens), "coalesced": pa.array(runs.coalesced)}
        if instance.count(instance[0]) == len(instance):
            cols["instance_id"] = _repeat(instance[0], runs.n)
        else:
            cols["instance_id"] = pa.array(instance, pa.string()).take(pa.array(runs.run_of_row))
        labels = self.known.labels(g.members.idx) if g.labelled else None
        return self._request_part(
            "tokens_delivered", runs.idx, g, cols, numbered(":tokens", runs.upto), member_ids.take(rows),
            {name: column.take(rows) for name, column in labels.items()} if labels is not None else None)

    def _cancelled(self, c: Ends, g: Gathered) -> pa.Table:
        return self._request_part("request_cancelled", c.idx, g, {"ts_ns": pa.array(c.ts), "instance_id": c.instance},
                                  ":cancelled")

    def _finished(self, f: Ends, g: Gathered) -> pa.Table:
        assert f.outcome is not None and f.num_output is not None
        cols = {"ts_ns": pa.array(f.ts), "outcome": f.outcome, "num_output_tokens": pa.array(f.num_output),
                "error_message": f.error, "instance_id": f.instance, "num_cached_prefix_tokens": f.hits}
        if g.out_delay_ns is not None:  # a completed request's last token reached the client
            delivered = pc.and_(pc.equal(f.outcome, "completed"), pc.greater(cols["num_output_tokens"], 0))
            last = pa.array(f.ts + g.out_delay_ns)
            cols["last_byte_ns"] = pc.if_else(delivered, last, pa.scalar(None, pa.int64()))
        return self._request_part("request_finished", f.idx, g, cols, ":finished")

    def _states(self, rows: list[tuple[Any, ...]]) -> pa.Table:
        # StateRow fields
        ts, inst, state, blocks, size, models, scale, adapters, tags = zip(*rows)
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
        suffix = pc.binary_join_element_wise(":state:", cols["state"], pa.array(tags, pa.string()), "")
        cols["event_id"] = self._event_ids(cols["instance_id"], suffix)
        return self._table("instance_state", cols)


class RunRows:
    """A flush's lockstep runs expanded: one row per member per run, as numpy columns (the events' and the
    request table's)."""

    __slots__ = ("rows", "idx", "n", "ts", "num_tokens", "upto", "coalesced", "instance", "run_of_row")

    def __init__(self, runs: Runs, members: Members) -> None:
        lengths = runs.snap_lengths
        self.rows = rows = ranges(runs.snap_starts, lengths)  # each run's members, as rows of the member log
        self.idx = members.idx[rows]
        self.n = len(rows)
        branches = members.tokens[rows]
        self.upto = (members.offsets[rows] + np.repeat(runs.clock, lengths)) * branches
        self.ts = np.repeat(runs.ts, lengths)
        self.num_tokens = np.repeat(runs.num_steps, lengths) * branches
        self.coalesced = np.repeat(runs.coalesced, lengths)
        self.instance = runs.instance
        self.run_of_row = np.repeat(np.arange(len(lengths)), lengths)


def expand_runs(g: Gathered) -> RunRows | None:
    return RunRows(g.runs, g.members) if g.runs is not None else None


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated index ranges ``starts[i] .. starts[i] + lengths[i]``."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)


def numbered(label: str, numbers: np.ndarray) -> pa.Array:
    """``label`` followed by each number (``:tokens42``): small numbers are looked up in a cached table."""
    numbers = np.asarray(numbers, np.int64)
    top = int(numbers.max()) if len(numbers) else 0
    if top >= _MAX_TABLED_NUMBER or (len(numbers) and int(numbers.min()) < 0):
        return pc.binary_join_element_wise(label, pc.cast(pa.array(numbers), pa.string()), "")
    table = _NUMBERED.get(label)
    if table is None or len(table) <= top:
        size = min(_MAX_TABLED_NUMBER, max(top + 1, 2 * len(table) if table is not None else 1024))
        table = _NUMBERED[label] = pa.array([f"{label}{i}" for i in range(size)], pa.string())
    return table.take(pa.array(numbers))


_NUMBERED: dict[str, pa.Array] = {}
_MAX_TABLED_NUMBER = 1 << 16


def strings(values: Sequence[str | None]) -> pa.Array:
    """A string column, built from buffers when it holds one value (an instance id, usually)."""
    if values and values.count(values[0]) == len(values) and values[0] is not None:
        return _repeat(values[0], len(values))
    return pa.array(values, pa.string())


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
