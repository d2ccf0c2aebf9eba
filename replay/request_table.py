"""The replay's own request table: one row per request (``schemas.records.RequestRow``), written while the
events are, so that metrics, the gate and the dashboard never re-derive a replay.

The replay knows every timing. ``RequestTable`` is fed the columns the ``EventWriter`` gathers at every
flush (``replay.gathered``: the same ones the event tables are built from, ``replay.outputs``) and writes a
request's row once its ``request_finished`` has been gathered and its first step written (the replay's
``DoneTracker`` says which). Its values are those that
``replay.derive.derive_requests`` computes from the same events, column for column, with the same
rules: timestamps are the earliest (or latest) of their event type, the last admission decision and the
instance are the latest by ``(ts_ns, event_id)``, and the inter-token gaps read the deliveries in
``(ts_ns, event_type, event_id)`` order, a delivery of k tokens after a gap g counting as k gaps of g/k
(``docs/metrics.md``). Every replay of the test suite compares the two (``tests/replay/conftest.py``).

Scalar columns come from the requests' own events, kept as numpy columns while they are in flight and
reduced per request when it finishes (``replay.request_events``). Deliveries, the bulk of a replay's
events, are handled as numpy columns per chunk: their gaps are computed once the order around them is
settled (a request's deliveries at its latest timestamp wait for the next chunk, where a tie could
still reorder them), and the per-request nearest-rank percentiles are taken when the request finishes.
Rows are written in arrival order (``arrival_ns``, then ``request_id``, as the derivation sorts): a row
waits until no request in flight or still to come can arrive before it. Memory therefore follows the
requests in flight, not the length of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay import request_events
from replay.errors import ReplayError
from replay.event_tables import RunRows
from replay.gathered import LABELS, Done, Gathered
from replay.request_events import isin as _in
from replay.request_events import object_array
from schemas.arrow import arrow_schema
from schemas.records import RequestRow
from schemas.validate import read_parquet_table

REQUESTS_SCHEMA = arrow_schema(RequestRow)
REQUESTS_FILE = "requests.parquet"
_MISSING = np.iinfo(np.int64).min  # no value (a delivery before any settled one; a request without deliveries)
_FIRST_TOKEN, _TOKENS = 0, 1  # event types in the order 'first_token' < 'tokens_delivered'
_ROW_GROUP_ROWS = 65_536


#: The columns every reader of a request table needs (``pipelines.exposition``'s export; the gate and
#: ``replay.metrics`` read these and ``GATE_COLUMNS``).
REQUIRED_COLUMNS = ("request_id", "outcome", "ttft_s", "e2e_s", "queue_s", "tpot_s", "arrival_ns", "scheduled_ns",
                    "first_token_ns", "last_token_ns", "finish_ns", "num_prompt_tokens", "num_output_tokens")
GATE_COLUMNS = (*REQUIRED_COLUMNS, "service_class", "tenant", "itl_p99_s", "num_preemptions", "num_lost_tokens",
                "num_admission_decisions")
#: Durations in seconds: null where not reached, else finite and not negative.
DURATION_COLUMNS = ("queue_s", "ttft_s", "tpot_s", "e2e_s", "ttft_client_s", "e2e_client_s", "itl_mean_s", "itl_p50_s",
                    "itl_p99_s", "itl_max_s")
#: Counts: null where not known, else not negative (a negative count turns a metric's sense: -3 preemptions a request
#: read as fewer than none, negative output tokens as negative goodput).
COUNT_COLUMNS = ("num_admission_decisions", "num_prompt_tokens", "num_cached_prefix_tokens", "max_output_tokens",
                 "num_branches", "num_output_tokens", "num_preemptions", "num_migrations", "num_lost_tokens",
                 "num_itl_gaps", "num_events")
#: (earlier, later, what is wrong when later < earlier): a request's values in the order they must come, where both
#: are known. A latency is measured from the earlier timestamp (the derivation leaves it null when they run backwards,
#: ``replay.derive.BACKWARDS_SQL``, and the gate would judge the run without it).
ORDERED_COLUMNS = tuple((earlier, later, f"{later} is before {earlier} ({what})") for later, earlier, what in (
    ("scheduled_ns", "arrival_ns", "a negative queue time"), ("first_token_ns", "arrival_ns", "a negative TTFT"),
    ("last_token_ns", "arrival_ns", "a negative E2E"), ("last_token_ns", "first_token_ns", "a negative decode time"),
    ("first_byte_ns", "client_sent_ns", "a negative client-side TTFT"),
    ("last_byte_ns", "client_sent_ns", "a negative client-side E2E"),
)) + (("num_cached_prefix_tokens", "num_prompt_tokens", "num_cached_prefix_tokens is above num_prompt_tokens"),)
_FIX = "derive one with `servelens requests derive EVENTS --out requests.parquet`, or replay the run again"
_ORDER = ("a request is scheduled and gets its first and last token after it arrives, its client receives bytes after "
          "sending it, and its cached prefix is part of its prompt: values out of order come from clocks that disagree "
          "or a broken emitter; fix them or drop those requests")


def read_request_table(path: str | Path, columns: Sequence[str] = GATE_COLUMNS) -> pa.Table:
    """A request table file, checked (``check_request_table``): errors name the file."""
    return check_request_table(read_parquet_table(path), path, columns)


def check_request_table(table: pa.Table, source: str | Path, columns: Sequence[str] = REQUIRED_COLUMNS) -> pa.Table:
    """``table`` if it is a request table (``REQUESTS_SCHEMA``) that can be judged, else a ``ReplayError`` naming
    ``source`` and what to fix: ``columns`` missing, a column of the wrong type, durations negative, NaN or
    infinite, counts negative, timestamps out of order (a first token before the arrival), no arrival times at
    all, request ids that repeat. A bad value is named with its column and the first request that has it."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ReplayError(f"{source}: not a request table: columns {', '.join(missing)} are missing", _FIX)
    wrong = [f"{f.name} is {table.schema.field(f.name).type}, not {f.type}" for f in REQUESTS_SCHEMA
             if f.name in table.column_names and not _same_kind(table.schema.field(f.name).type, f.type)]
    if wrong:
        raise ReplayError(f"{source}: request table columns of the wrong type: {'; '.join(wrong)}",
                          f"write them with the request table's types (schemas.records.RequestRow); {_FIX}")
    _check_values(table, source)
    if table.num_rows and "arrival_ns" in table.column_names and table["arrival_ns"].null_count == table.num_rows:
        raise ReplayError(f"{source}: no request has an arrival_ns (all {table.num_rows:,} are null)",
                          f"every request needs its arrival time; {_FIX}")
    if "request_id" in table.column_names:
        repeated = table.num_rows - pc.count_distinct(table["request_id"], mode="all").as_py()
        if repeated:
            raise ReplayError(f"{source}: {repeated:,} rows repeat a request id of an earlier row (a request table "
                              "holds one row per request)", f"drop the repeated rows (a table joined to itself?); {_FIX}")
    return table


def _check_values(table: pa.Table, source: str | Path) -> None:
    """Durations finite and not negative, counts not negative, timestamps in order (nulls are fine everywhere)."""
    names = set(table.column_names)
    bad = [why for name in DURATION_COLUMNS if name in names for why in _bad_durations(table, name)]
    if bad:
        raise ReplayError(f"{source}: durations must be seconds, finite and not negative (null where not reached): "
                          + "; ".join(bad), f"drop or fix those rows (null where a request never got there); {_FIX}")
    bad = [_rows_where(table, pc.less(table[name], 0), f"{name} is negative", name)
           for name in COUNT_COLUMNS if name in names]
    if any(bad):
        raise ReplayError(f"{source}: counts must not be negative (null where not known): " + "; ".join(filter(None, bad)),
                          f"drop or fix those rows; {_FIX}")
    bad = [_rows_where(table, pc.less(table[later], table[earlier]), what, earlier, later)
           for earlier, later, what in ORDERED_COLUMNS if {earlier, later} <= names]
    if any(bad):
        raise ReplayError(f"{source}: values out of order: " + "; ".join(filter(None, bad)), _ORDER)


def _rows_where(table: pa.Table, mask: pa.ChunkedArray | pa.Array, what: str, *shown: str) -> str:
    """``what`` with how many rows ``mask`` marks and the first of them (its request id, and the values of the
    ``shown`` columns), or '' when it marks none."""
    mask = pc.fill_null(mask, False)
    count = pc.sum(pc.cast(mask, pa.int64())).as_py() or 0
    if not count:
        return ""
    row = pc.index(mask, True).as_py()
    who = f"request {table['request_id'][row].as_py()!r}" if "request_id" in table.column_names else f"row {row:,}"
    values = ", ".join(f"{name} {table[name][row].as_py()}" for name in shown)
    return f"{what} in {count:,} row{'s' if count != 1 else ''} (the first: {who}, {values})"


def _same_kind(found: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether a column of type ``found`` reads as ``wanted``: any width of integer, float (a duration may be
    integer seconds), text (dictionary-encoded or large)."""
    if pa.types.is_dictionary(found):
        found = found.value_type
    if pa.types.is_integer(wanted):
        return pa.types.is_integer(found)
    if pa.types.is_floating(wanted):
        return pa.types.is_floating(found) or pa.types.is_integer(found)
    if pa.types.is_string(wanted):
        return pa.types.is_string(found) or pa.types.is_large_string(found)
    return bool(found == wanted)


def _bad_durations(table: pa.Table, name: str) -> list[str]:
    """What is wrong with a duration column: rows negative, rows NaN or infinite (nulls are fine)."""
    values = pc.cast(table[name], pa.float64())
    return [why for why in (_rows_where(table, pc.less(values, 0.0), f"{name} is negative", name),
                            _rows_where(table, pc.invert(pc.is_finite(values)), f"{name} is NaN or infinite", name)) if why]


class Deliveries:
    """A chunk's token deliveries as columns: request index, ts, type, tie-break number (the ``:tokens<n>``
    of the event id), tokens (first_token: 1), coalesced, instance code."""

    __slots__ = ("idx", "ts", "kind", "tb", "tokens", "coalesced", "instance")

    def __init__(self, idx, ts, kind, tb, tokens, coalesced, instance) -> None:
        self.idx, self.ts, self.kind, self.tb = idx, ts, kind, tb
        self.tokens, self.coalesced, self.instance = tokens, coalesced, instance

    @classmethod
    def concat(cls, parts: Sequence[Deliveries]) -> Deliveries:
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in cls.__slots__))

    def take(self, rows: np.ndarray) -> Deliveries:
        return Deliveries(*(getattr(self, name)[rows] for name in self.__slots__))

    def __len__(self) -> int:
        return len(self.idx)


class _Ordered:
    """The columns of deliveries that every row's settling reads, taken in delivery order (the others are
    read only at a few rows, through the order)."""

    __slots__ = ("idx", "ts", "tokens", "coalesced")

    def __init__(self, x: Deliveries, order: np.ndarray) -> None:
        self.idx, self.ts, self.tokens, self.coalesced = x.idx[order], x.ts[order], x.tokens[order], x.coalesced[order]


def no_deliveries() -> Deliveries:
    i = np.zeros(0, np.int64)
    return Deliveries(i, i, i, i, i, np.zeros(0, bool), i)


class _Settled:
    """Per request with deliveries: what is settled so far (columns keyed by request index, sorted)."""

    __slots__ = ("idx", "first_ts", "prev_ts", "count", "tokens", "coalesced")

    def __init__(self, idx, first_ts, prev_ts, count, tokens, coalesced) -> None:
        self.idx, self.first_ts, self.prev_ts = idx, first_ts, prev_ts
        self.count, self.tokens, self.coalesced = count, tokens, coalesced

    def take(self, rows: np.ndarray) -> _Settled:
        return _Settled(*(getattr(self, name)[rows] for name in self.__slots__))


class DoneTracker:
    """The replay's side of the request table (``replay.emit``): at each flush, the finished requests whose rows
    can be written (``Done``), read from the engine's requests; a request cancelled during its first step waits
    for that step's event, which gives its ``scheduled_ns``."""

    def __init__(self) -> None:
        self._waiting: list[Any] = []  # finished requests whose first step is still in flight

    def done(self, finished: Sequence[Any], labelled: bool) -> Done:
        """``finished``: the requests of the flush's ``request_finished`` events."""
        candidates = [*self._waiting, *finished]
        self._waiting = [r for r in candidates if r.first_step_pending]
        done = sorted((r for r in candidates if not r.first_step_pending), key=_INDEX)
        scheduled = [_MISSING if r.first_step_ns is None else r.first_step_ns for r in done]
        return Done(np.fromiter(map(_INDEX, done), np.int64, len(done)), np.fromiter(scheduled, np.int64, len(done)),
                    {name: object_array(values) for name, values in _columns(done, LABELS).items()} if labelled else None)


class RequestTable:
    """The run's request table, fed each flush's gathered events (``add``), written to ``path``."""

    def __init__(self, path: str | Path, engine_id: str) -> None:
        self.path = Path(path)
        self.engine_id = engine_id
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._writer: pq.ParquetWriter | None = None
        self.num_rows = 0
        self._logs = request_events.empty_logs()  # the events of the requests in flight (all but deliveries)
        self._instances: list[str] = []
        self._instance_code: dict[str, int] = {}
        self._tails = no_deliveries()  # deliveries at each open request's latest timestamp (order not settled)
        z = np.zeros(0, np.int64)
        self._settled = _Settled(z, z, z, z, z, np.zeros(0, bool))
        self._gaps = (z, np.zeros(0), z)  # (request index, per-token gap ns, weight) of open requests
        self._ready: list[pa.Table] = []  # finished rows not yet written (sorted on the way out)
        self._ready_rows = 0
        self._last_arrival = _MISSING  # requests still to come arrive no earlier than this

    def add(self, g: Gathered, runs: RunRows | None, finished_ids: pa.Array | None) -> None:
        """A flush's events (``runs``: its lockstep runs expanded; ``finished_ids``: the ids of its finished
        requests): kept while their requests are in flight; the rows of its ``done`` requests are built, and
        written once ready."""
        assert g.done is not None, "a replay writing its request table says which rows are done"
        for name, new in self._logs_of(g, finished_ids).items():
            request_events.append(self._logs, name, new)
        if g.arrived is not None:
            self._last_arrival = max(self._last_arrival, int(g.arrived.ts.max()))
        request_events.check_finished_once(self._logs)
        self.settle(self._deliveries(g, runs), g.done)

    def _logs_of(self, g: Gathered, finished_ids: pa.Array | None) -> dict[str, request_events.Log]:
        logs = {}
        if g.arrived is not None:
            logs["arrived"] = request_events.arrived_log(g.arrived, self._codes(g.arrived.instance))
        if g.admission is not None:
            logs["admission"] = request_events.admission_log(g.admission, self._codes(g.admission.instance))
        if g.preempted is not None:
            logs["preempted"] = request_events.preempted_log(g.preempted, self._codes(g.preempted.instance))
        if g.first is not None:
            logs["first"] = request_events.first_log(g.first, g.out_delay_ns)
        if g.cancelled is not None:
            logs["cancelled"] = request_events.cancelled_log(g.cancelled, self._codes(g.cancelled.instance))
        if g.finished is not None:
            assert finished_ids is not None
            logs["finished"] = request_events.finished_log(g.finished, finished_ids, self._codes(g.finished.instance),
                                                           g.out_delay_ns)
        return logs

    def _deliveries(self, g: Gathered, runs: RunRows | None) -> list[Deliveries]:
        parts = []
        if g.first is not None:
            t = g.first
            n = len(t.idx)
            zeros = np.zeros(n, np.int64)
            parts.append(Deliveries(t.idx, t.ts, zeros, zeros, t.num, t.coalesced, self._codes(t.instance)))
        if g.tokens is not None:
            t = g.tokens
            parts.append(Deliveries(t.idx, t.ts, np.ones(len(t.idx), np.int64), t.upto, t.num, t.coalesced,
                                    self._codes(t.instance)))
        if runs is not None and runs.n:
            codes = np.fromiter(map(self._code, runs.instance), np.int64, len(runs.instance))
            parts.append(Deliveries(runs.idx, runs.ts, np.ones(runs.n, np.int64), runs.upto, runs.num_tokens,
                                    runs.coalesced, codes[runs.run_of_row]))
        return parts

    def _codes(self, names: pa.Array) -> np.ndarray:
        """Integer codes of instance ids (-1: none)."""
        encoded = names.dictionary_encode()
        codes = np.fromiter(map(self._code, [*encoded.dictionary.to_pylist(), None]), np.int64, len(encoded.dictionary) + 1)
        return codes[np.asarray(encoded.indices.fill_null(len(encoded.dictionary)), np.int64)]

    def _code(self, name: str | None) -> int:
        if name is None:
            return -1
        code = self._instance_code.get(name)
        if code is None:
            code = self._instance_code[name] = len(self._instances)
            self._instances.append(name)
        return code

    # ------------------------------------------------------------------ deliveries

    def settle(self, parts: Sequence[Deliveries], done: Done) -> None:
        """A flush's deliveries (``parts``) and the rows of its ``done`` requests: their events are taken out of the
        logs, the deliveries settled, and the rows built and written once ready."""
        finished = done.idx
        new_idx = np.concatenate([p.idx for p in parts]) if parts else np.zeros(0, np.int64)
        known = _in(new_idx, np.concatenate([log["idx"] for log in self._logs.values()]))
        if not known.all():
            raise AssertionError(f"a delivery for request #{int(new_idx[~known][0])} after its request_finished")
        logs = request_events.take_done(self._logs, finished) if len(finished) else None
        arrivals = self._logs["arrived"]["ts"]  # of the requests still in flight: no later row precedes them
        cut = min(self._last_arrival, int(arrivals.min())) if len(arrivals) else self._last_arrival
        deliveries = self._add_deliveries(parts, finished)
        if logs is None:
            return
        values = request_events.reduce_logs(logs, finished)
        values.update(scheduled_ns=done.scheduled_ns, labels=done.labels)
        table = _rows_table(values, deliveries, self.engine_id, self._instances)
        self._ready.append(table)
        self._ready_rows += table.num_rows
        self._write_ready(cut)

    def _add_deliveries(self, parts: Sequence[Deliveries], finished: np.ndarray) -> dict[str, np.ndarray]:
        """Settle this chunk's deliveries (``parts``); returns the delivery columns of the ``finished`` requests
        (request index order): count, tokens, coalesced, first and last ts, the last one's kind, number
        and instance, and the gap statistics."""
        unsorted = Deliveries.concat([self._tails, *parts])
        order = _delivery_order(unsorted)
        x = _Ordered(unsorted, order)  # the columns read row by row, in delivery order
        fresh = order >= len(self._tails)
        n = len(order)
        starts = np.flatnonzero(np.r_[True, x.idx[1:] != x.idx[:-1]]) if n else np.zeros(0, np.int64)
        ends = np.r_[starts[1:], n] - 1 if n else np.zeros(0, np.int64)
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n])) if n else np.zeros(0, np.int64)
        gidx = x.idx[starts]
        done = _in(gidx, finished)
        old = _lookup(self._settled, gidx)
        # settled rows: before the group's latest timestamp, or all of a finished request's
        final = (x.ts < x.ts[ends][group]) | done[group]
        prev = np.empty(n, np.int64)
        if n:
            prev[1:] = x.ts[:-1]
            prev[starts] = old.prev_ts
        has_gap = final & (prev != _MISSING)
        gap_rows = np.flatnonzero(has_gap)
        gap_ns = x.ts[gap_rows] - prev[gap_rows]
        if (gap_ns < 0).any() or not _in(self._settled.idx, gidx).all():
            raise AssertionError("a request's deliveries came out of time order across chunks")
        gaps = (x.idx[gap_rows], gap_ns / x.tokens[gap_rows], x.tokens[gap_rows])
        last_final = _last_where(final, starts, ends)  # per group: its last settled row, or -1
        settled = _Settled(
            gidx,
            np.where(old.first_ts != _MISSING, old.first_ts, x.ts[starts]) if n else old.first_ts,
            np.where(last_final >= 0, x.ts[np.maximum(last_final, 0)], old.prev_ts),
            old.count + _group_sum(fresh.astype(np.int64), starts),
            old.tokens + _group_sum(np.where(fresh, x.tokens, 0), starts),
            old.coalesced | (_group_sum((fresh & x.coalesced).astype(np.int64), starts) > 0),
        )
        keep = ~done
        self._settled = settled.take(np.flatnonzero(keep))
        self._tails = unsorted.take(order[~final])
        all_gaps = tuple(np.concatenate([a, b]) for a, b in zip(self._gaps, gaps))
        closing = _in(all_gaps[0], finished)
        self._gaps = tuple(a[~closing] for a in all_gaps)
        last = order[ends[done]]  # each finished request's last delivery, a row of ``unsorted``
        return _finished_deliveries(settled.take(np.flatnonzero(done)), unsorted, last, tuple(a[closing] for a in all_gaps))

    # ------------------------------------------------------------------ rows

    def _write_ready(self, cut: int | None) -> None:
        """Write the ready rows that arrived before ``cut`` (nothing in flight or to come can precede them; None:
        every one, at the end), once they make a row group."""
        if not self._ready or (cut is not None and self._ready_rows < _ROW_GROUP_ROWS):
            return
        pending = pa.concat_tables(self._ready)
        if cut is None:
            out, rest = pending, pending.slice(0, 0)
        else:
            mask = pc.fill_null(pc.less(pending["arrival_ns"], pa.scalar(cut, pa.int64())), False)
            out, rest = pending.filter(mask), pending.filter(pc.invert(mask))
            if out.num_rows < _ROW_GROUP_ROWS // 2:  # most are still held back: wait for more
                return
        self._ready, self._ready_rows = ([rest] if rest.num_rows else []), rest.num_rows
        if out.num_rows:
            self._write(_in_arrival_order(out))

    def _write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(str(self._tmp), REQUESTS_SCHEMA, compression="zstd")
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.num_rows += table.num_rows

    def close(self) -> Path:
        """Write what is left and put the file in place; returns its path."""
        waiting = len(self._logs["finished"]["idx"])
        if waiting:
            raise AssertionError(f"{waiting} finished requests still wait for a step event")
        in_flight = np.unique(np.concatenate([log["idx"] for log in self._logs.values()]))
        if len(in_flight):
            raise AssertionError(f"{len(in_flight)} requests never finished")
        self._close_file()
        self._tmp.replace(self.path)
        return self.path

    def _close_file(self) -> None:
        """Write every row left and finish the file."""
        self._write_ready(None)
        if self._writer is None:
            self._write(REQUESTS_SCHEMA.empty_table())
        assert self._writer is not None
        self._writer.close()

    def abort(self) -> None:
        """Drop the unfinished file (a failed replay)."""
        if self._writer is not None:
            self._writer.close()
        self._tmp.unlink(missing_ok=True)


def _in_arrival_order(table: pa.Table) -> pa.Table:
    """``table`` sorted by (arrival_ns, request_id), as the derivation sorts (rows mostly come in that order
    already: then the table is kept as it is)."""
    order = pc.sort_indices(table, [("arrival_ns", "ascending"), ("request_id", "ascending")]).to_numpy()
    if (order == np.arange(len(order))).all():
        return table
    return table.take(order)


# ---------------------------------------------------------------------------------------------- columns


def _delivery_order(x: Deliveries) -> np.ndarray:
    """Rows by (request, ts, kind, event id): ts first (the parts are time-ordered runs, so cheap), then
    a stable sort by request; ties on (request, ts) are put in event-id order (string order of the number)."""
    n = len(x)
    if not n:
        return np.zeros(0, np.int64)
    order = _by_request(x.idx, np.argsort(x.ts, kind="stable"))
    idx, ts = x.idx[order], x.ts[order]
    tied = np.flatnonzero((idx[1:] == idx[:-1]) & (ts[1:] == ts[:-1]))
    if len(tied):
        order = _settle_ties(order, tied, x)
    return order


def _settle_ties(order: np.ndarray, tied: np.ndarray, x: Deliveries) -> np.ndarray:
    """Reorder runs of rows of one request at one timestamp by (kind, the event id's number as text)."""
    order = order.copy()
    i = 0
    while i < len(tied):
        start = tied[i]
        end = start + 1
        while i < len(tied) and tied[i] == end - 1:
            end += 1
            i += 1
        rows = order[start:end]
        order[start:end] = sorted(rows, key=lambda r: (int(x.kind[r]), str(int(x.tb[r]))))
    return order


def _by_request(idx: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Rows in request order, keeping the order ``first`` gives within a request (a stable sort on the index,
    a radix sort when the indices span fewer than 65,536)."""
    idx = idx[first]
    low = int(idx.min()) if len(idx) else 0
    span = int(idx.max()) - low if len(idx) else 0
    key = (idx - low).astype(np.uint16 if span < 1 << 16 else np.int64)
    return first[np.argsort(key, kind="stable")]


def _lookup(settled: _Settled, idx: np.ndarray) -> _Settled:
    """The settled columns of each request in ``idx`` (sorted); a request not there yet gets zeros and no timestamps."""
    pos = np.searchsorted(settled.idx, idx)
    pos_ok = np.minimum(pos, max(len(settled.idx) - 1, 0))
    found = (pos < len(settled.idx)) & (settled.idx[pos_ok] == idx) if len(settled.idx) else np.zeros(len(idx), bool)

    def col(values: np.ndarray, default) -> np.ndarray:
        if not len(values):
            return np.full(len(idx), default, values.dtype)
        return np.where(found, values[pos_ok], default)

    return _Settled(idx, col(settled.first_ts, _MISSING), col(settled.prev_ts, _MISSING), col(settled.count, 0),
                    col(settled.tokens, 0), col(settled.coalesced, False))


def _group_sum(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.add.reduceat(values, starts) if len(starts) else np.zeros(0, values.dtype)


def _last_where(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per group (rows starts..ends), the last row where ``mask`` holds, else -1."""
    if not len(starts):
        return np.zeros(0, np.int64)
    marked = np.where(mask, np.arange(len(mask)), -1)
    return np.maximum.reduceat(marked, starts)


def _finished_deliveries(settled: _Settled, x: Deliveries, last_rows: np.ndarray, gaps: tuple) -> dict[str, np.ndarray]:
    """The delivery columns of finished requests (``settled`` holds them in request order)."""
    out = {
        "idx": settled.idx, "count": settled.count, "tokens": settled.tokens, "coalesced": settled.coalesced,
        "first_ts": settled.first_ts, "last_ts": x.ts[last_rows], "last_kind": x.kind[last_rows],
        "last_tb": x.tb[last_rows], "last_instance": x.instance[last_rows],
    }
    idx, token_gap, weight = gaps
    order = _by_request(idx, np.argsort(token_gap))  # equal gaps in any order: the statistics read values only
    idx, token_gap, weight = idx[order], token_gap[order], weight[order]
    m = len(idx)
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]]) if m else np.zeros(0, np.int64)
    total = _group_sum(weight, starts)
    cum = np.cumsum(weight)  # non-decreasing over all rows (weights are token counts)
    before = cum[starts] - weight[starts] if m else cum  # each request's cumulative weight before its first gap
    ends = np.r_[starts[1:], m] - 1 if m else starts

    def first_at_rank(numerator: int, denominator: int) -> np.ndarray:
        # nearest rank: the smallest gap whose cumulative weight in its request reaches numerator/denominator of
        # the request's total (``denominator * below >= numerator * total``, below the weight up to it): the first
        # row whose running sum reaches ``before`` plus the ceiling of that share, found by bisection
        first = np.searchsorted(cum, before + -(-numerator * total // denominator), side="left")
        return token_gap[np.clip(first, starts, ends)]

    pos = np.searchsorted(settled.idx, idx[starts])
    n = len(settled.idx)
    stats = {"gaps": np.zeros(n, np.int64), "p50": np.full(n, np.nan), "p99": np.full(n, np.nan), "max": np.full(n, np.nan)}
    if m:
        stats["gaps"][pos] = total
        stats["p50"][pos] = first_at_rank(1, 2)
        stats["p99"][pos] = first_at_rank(99, 100)
        stats["max"][pos] = token_gap[ends]  # each request's gaps are in ascending order
    out.update(stats)
    return out


_INDEX = attrgetter("index")
#: Integer columns taken as ``request_events.reduce_logs`` gives them (int64, _MISSING: null).
_TIMESTAMPS = ("arrival_ns", "admission_ns", "first_token_ns", "first_byte_ns", "cancel_ns", "finish_ns", "last_byte_ns",
               "scheduled_ns")
_COUNTS = ("num_admission_decisions", "num_preemptions", "num_migrations", "num_lost_tokens")
#: Columns taken as they are (Python values, None: null).
_VALUES = ("request_id", "outcome", "session_id", "num_prompt_tokens", "max_output_tokens", "num_branches")


def _columns(items: Sequence[Any], names: tuple[str, ...]) -> dict[str, tuple]:
    """Attributes ``names`` of each of ``items``, as one tuple per name."""
    values = list(map(attrgetter(*names), items))
    return dict(zip(names, zip(*values))) if values else {name: () for name in names}


def _rows_table(v: dict[str, Any], d: dict[str, np.ndarray], engine_id: str, instances: Sequence[str]) -> pa.Table:
    """The finished requests' rows (``v``: ``request_events.reduce_logs``'s columns with their ``scheduled_ns`` and
    ``labels``, ``d``: their deliveries', in request index order) as a ``REQUESTS_SCHEMA`` table, built column by
    column (the durations and gap statistics with null-aware Arrow arithmetic)."""
    n = len(v["idx"])
    found = _Found(d["idx"], v["idx"])
    labels = v["labels"] if v["labels"] is not None else {name: pa.nulls(n, pa.string()) for name in LABELS}
    gaps = found.filled(d["gaps"], 0)
    cached = pc.coalesce(pa.array(v["cached_finished"], pa.int64()), pa.array(v["cached_arrival"], pa.int64()))
    cols: dict[str, Sequence | pa.Array | np.ndarray] = {
        "engine_id": pa.repeat(pa.scalar(engine_id), n),
        "instance_id": _instance_ids(v, found, d, instances), **labels, "pool": pa.nulls(n, pa.string()),
        "last_token_ns": found.array(d["last_ts"]),
        "admission_decision": v["decision"], "num_cached_prefix_tokens": cached,
        "client_sent_ns": pa.array(v["client_sent_ns"], pa.int64()),
        # the finish event's count, else the tokens counted in deliveries (none: null)
        "num_output_tokens": pc.coalesce(pa.array(v["output_tokens"], pa.int64()), found.array(d["tokens"], nonzero=True)),
        "num_itl_gaps": gaps, "itl_from_chunks": found.filled(d["coalesced"], False),
        "num_events": v["num_events"] + found.filled(d["count"], 0),
        **{name: pa.array(v[name], pa.int64(), mask=v[name] == _MISSING) for name in _TIMESTAMPS},
        **{name: v[name] for name in _COUNTS + _VALUES},
    }
    for name, (end, start) in _DURATIONS.items():
        cols[name] = _seconds(cols[end], cols[start])
    _gap_columns(cols, found, d, gaps)
    arrays = [_as_array(cols[f.name], f.type) for f in REQUESTS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=REQUESTS_SCHEMA)


def _gap_columns(cols: dict, found: _Found, d: dict[str, np.ndarray], gaps: np.ndarray) -> None:
    """TPOT and the per-token gap statistics, in seconds (each divided as the derivation divides: integer ns
    differences to float, then by the count, then by 1e9)."""
    has_gaps = gaps > 0
    later_tokens = pc.subtract(cols["num_output_tokens"], 1)
    cols["tpot_s"] = pc.divide(_seconds(cols["last_token_ns"], cols["first_token_ns"]),
                               _float(pc.if_else(pc.greater(later_tokens, 0), later_tokens, pa.scalar(None, pa.int64()))))
    # the gaps' integer sum is the span of the deliveries; the derivation divides it by their count, then by 1e9
    span = pc.subtract(cols["last_token_ns"], found.array(d["first_ts"]))
    cols["itl_mean_s"] = pc.divide(pc.divide(_float(span), _float(pa.array(gaps, mask=~has_gaps))), 1e9)
    for name in ("p50", "p99", "max"):
        cols[f"itl_{name}_s"] = pa.array(found.filled(d[name], 0.0) / 1e9, pa.float64(), mask=~has_gaps)


#: Durations in seconds: (later timestamp, earlier timestamp), each (later - earlier) / 1e9 as the derivation divides.
_DURATIONS = {
    "queue_s": ("scheduled_ns", "arrival_ns"),
    "ttft_s": ("first_token_ns", "arrival_ns"),
    "e2e_s": ("last_token_ns", "arrival_ns"),
    "ttft_client_s": ("first_byte_ns", "client_sent_ns"),
    "e2e_client_s": ("last_byte_ns", "client_sent_ns"),
}


def _float(values: pa.Array) -> pa.Array:
    return pc.cast(values, pa.float64())


def _seconds(later: pa.Array, earlier: pa.Array) -> pa.Array:
    """(later - earlier) / 1e9 per row, null where either is (integer ns, one float division)."""
    return pc.divide(_float(pc.subtract(later, earlier)), 1e9)


def _as_array(values: Sequence | pa.Array | np.ndarray, type_: pa.DataType) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values if values.type == type_ else values.cast(type_)
    return pa.array(values, type_)


class _Found:
    """Rows of ``keys`` (sorted request indices) for each of ``wanted``."""

    def __init__(self, keys: np.ndarray, wanted: np.ndarray) -> None:
        self.n = len(wanted)
        self.pos = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
        self.has = (keys[self.pos] == wanted) if len(keys) else np.zeros(len(wanted), bool)

    def filled(self, column: np.ndarray, default: object) -> np.ndarray:
        """The column's value where found, else ``default``."""
        if not len(column):
            return np.full(self.n, default, column.dtype)
        return np.where(self.has, column[self.pos], default)

    def array(self, column: np.ndarray, nonzero: bool = False) -> pa.Array:
        """The column's value where found (and not zero, with ``nonzero``), else null."""
        if not len(column):
            return pa.nulls(self.n, pa.from_numpy_dtype(column.dtype))
        values = column[self.pos]
        return pa.array(values, mask=~(self.has & (values != 0)) if nonzero else ~self.has)


def _instance_ids(v: dict[str, Any], found: _Found, d: dict[str, np.ndarray], instances: Sequence[str]) -> np.ndarray:
    """Each request's instance: that of its latest event (by ts, then event id) that names one, its own events'
    (``v``) or its last delivery's (``d``), which wins when later."""
    code = v["instance"]
    if len(d["idx"]):
        ts, rank, num = v["instance_key"]
        d_ts, d_code = found.filled(d["last_ts"], _MISSING), found.filled(d["last_instance"], -1)
        d_rank = np.where(found.filled(d["last_kind"], 0) == _FIRST_TOKEN, request_events.RANK[":first_token"],
                          request_events.RANK[":tokens"])
        d_num = np.where(d_rank == request_events.RANK[":tokens"], request_events.number_key(found.filled(d["last_tb"], 0)), 0)
        later = (d_ts > ts) | ((d_ts == ts) & ((d_rank > rank) | ((d_rank == rank) & (d_num > num))))
        code = np.where(found.has & (d_code >= 0) & ((code < 0) | later), d_code, code)
    names = np.empty(len(instances) + 1, object)
    names[:-1] = instances  # code -1: the None at the end
    return names[code]
