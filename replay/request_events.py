"""The request table's scalar columns: each request's own events (all but its token deliveries) as numpy
columns, kept while it is in flight and reduced to one value per column when its row is written
(``replay.request_table``).

Each flush's events of one type (``replay.gathered``) are appended as columns (request index, ts, instance
code and what that type carries) to its log; a finished request's rows are taken out and reduced by request,
with the derivation's rules: timestamps are the earliest of their type, the arrival's fields are those of
the earliest arrival, and the admission decision and the instance are the latest by ``(ts_ns, event_id)``.
Event ids are ``<run>:<request><suffix>``: at one timestamp they order as their suffixes, the suffix's
text (``:admission``, ``:arrived`` ...) and then its number compared as text (``number_key``). Where
keys tie, the event gathered first wins. Apart from the few optional fields kept as Python values, everything
here is numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.gathered import Admissions, Arrivals, Ends, Preemptions, Tokens

_MISSING = np.iinfo(np.int64).min  # no value
#: The suffixes of request event ids, in text order: a suffix's rank orders events at one timestamp.
SUFFIXES = sorted([":admission", ":arrived", ":cancelled", ":finished", ":first_token", ":preempted", ":tokens"])
RANK = {suffix: rank for rank, suffix in enumerate(SUFFIXES)}
_POWERS = 10 ** np.arange(1, 18, dtype=np.int64)

Log = dict[str, np.ndarray]
#: Each log's columns and their dtypes (``idx``: the request index, ``inst``: an instance code, -1 none).
_LOGS: dict[str, dict[str, Any]] = {
    "arrived": {"idx": np.int64, "ts": np.int64, "inst": np.int64, "cached": object, "prompt": object,
                "max_output": object, "branches": object, "session": object, "sent": object},
    "admission": {"idx": np.int64, "ts": np.int64, "num": np.int64, "inst": np.int64, "decision": object},
    "preempted": {"idx": np.int64, "ts": np.int64, "num": np.int64, "inst": np.int64, "migrate": bool,
                  "lost": np.int64},
    "first": {"idx": np.int64, "ts": np.int64, "byte": np.int64},
    "cancelled": {"idx": np.int64, "ts": np.int64, "inst": np.int64},
    "finished": {"idx": np.int64, "ts": np.int64, "inst": np.int64, "outcome": object, "output": np.int64,
                 "hit": object, "last_byte": np.int64, "rid": object},
}
#: The logs whose events name an instance, and each one's suffix (numbered when the log has ``num``).
_NAMING = {"arrived": ":arrived", "admission": ":admission", "preempted": ":preempted", "cancelled": ":cancelled",
           "finished": ":finished"}


def number_key(numbers: np.ndarray) -> np.ndarray:
    """An int64 per non-negative number (below 10**17) that orders them as their decimal texts: the digits
    left-aligned in 17 places, then the length (a prefix sorts first)."""
    length = 1 + np.searchsorted(_POWERS, numbers, side="right")
    return numbers * 10 ** (17 - length) * 32 + length


def object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), object)
    out[:] = values
    return out


def isin(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``np.isin(values, keys)`` for request indices, through a dense mask when they span a small range."""
    if not len(values) or not len(keys):
        return np.zeros(len(values), bool)
    low = min(int(values.min()), int(keys.min()))
    span = max(int(values.max()), int(keys.max())) - low + 1
    if span > 1 << 24:
        return np.isin(values, keys)
    mask = np.zeros(span, bool)
    mask[keys - low] = True
    return mask[values - low]


def empty_logs() -> dict[str, Log]:
    return {name: {col: np.zeros(0, dtype) for col, dtype in cols.items()} for name, cols in _LOGS.items()}


def _objects_of(values: pa.Array | np.ndarray) -> np.ndarray:
    """A column as Python values (None: null), as the logs keep optional fields."""
    return object_array(values.to_pylist() if isinstance(values, pa.Array) else values.tolist())


def arrived_log(a: Arrivals, codes: np.ndarray) -> Log:
    """``request_arrived`` events (their instances' codes given)."""
    n = len(a.idx)
    return {"idx": a.idx, "ts": a.ts, "inst": codes, "cached": _objects_of(a.cached), "prompt": _objects_of(a.prompt),
            "max_output": _objects_of(a.max_output), "branches": _objects_of(a.branches),
            "session": _objects_of(a.session),
            "sent": _objects_of(a.sent) if a.sent is not None else np.full(n, None, object)}


def admission_log(d: Admissions, codes: np.ndarray) -> Log:
    """``admission_decided`` events."""
    return {"idx": d.idx, "ts": d.ts, "num": d.number, "inst": codes, "decision": _objects_of(d.decision)}


def preempted_log(p: Preemptions, codes: np.ndarray) -> Log:
    """``request_preempted`` events."""
    return {"idx": p.idx, "ts": p.ts, "num": p.number, "inst": codes,
            "migrate": np.asarray(pc.equal(p.mode, "migrate").fill_null(False), bool), "lost": p.lost}


def first_log(t: Tokens, out_delay_ns: int | None) -> Log:
    """``first_token`` events; ``byte``: when the client got it, where known."""
    return {"idx": t.idx, "ts": t.ts,
            "byte": t.ts + out_delay_ns if out_delay_ns is not None else np.full(len(t.ts), _MISSING)}


def cancelled_log(c: Ends, codes: np.ndarray) -> Log:
    """``request_cancelled`` events."""
    return {"idx": c.idx, "ts": c.ts, "inst": codes}


def finished_log(f: Ends, ids: pa.Array, codes: np.ndarray, out_delay_ns: int | None) -> Log:
    """``request_finished`` events (``ids``: their request ids); ``last_byte``: when a completed request's last
    token reached the client."""
    assert f.outcome is not None and f.num_output is not None and f.hits is not None
    t, out = f.ts, f.num_output
    last_byte = np.full(len(t), _MISSING)
    if out_delay_ns is not None:
        delivered = np.asarray(pc.equal(f.outcome, "completed").fill_null(False), bool) & (out > 0)
        last_byte[delivered] = t[delivered] + out_delay_ns
    return {"idx": f.idx, "ts": t, "inst": codes, "outcome": _objects_of(f.outcome), "output": out,
            "hit": _objects_of(f.hits), "last_byte": last_byte, "rid": _objects_of(ids)}


def append(logs: dict[str, Log], name: str, new: Log) -> None:
    logs[name] = {col: np.concatenate([values, new[col]]) for col, values in logs[name].items()}


def check_finished_once(logs: dict[str, Log]) -> None:
    """Raise if a request in flight has two ``request_finished`` events."""
    idx = logs["finished"]["idx"]
    unique, counts = np.unique(idx, return_counts=True)
    if (counts > 1).any():
        twice = logs["finished"]["rid"][np.flatnonzero(idx == unique[counts > 1][0])[0]]
        raise AssertionError(f"request {twice} finished twice")


def take_done(logs: dict[str, Log], done: np.ndarray) -> dict[str, Log]:
    """Remove the ``done`` requests' rows from ``logs``; returns them (each log sorted by request, stably)."""
    out = {}
    for name, log in logs.items():
        mine = isin(log["idx"], done)
        rows = np.flatnonzero(mine)
        rows = rows[np.argsort(log["idx"][rows], kind="stable")]
        out[name] = {col: values[rows] for col, values in log.items()}
        keep = np.flatnonzero(~mine)
        logs[name] = {col: values[keep] for col, values in log.items()}
    return out


class _Groups:
    """A log's rows (sorted by request) grouped by request, and each group's position among ``done``."""

    def __init__(self, idx: np.ndarray, done: np.ndarray) -> None:
        n = len(idx)
        self.n = len(done)
        self.starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]]) if n else np.zeros(0, np.int64)
        self.ends = np.r_[self.starts[1:], n] - 1 if n else np.zeros(0, np.int64)
        self.pos = np.searchsorted(done, idx[self.starts])

    def put(self, values: np.ndarray, default: Any, dtype: Any = None) -> np.ndarray:
        """One value per group, spread over ``done`` (``default`` where a request has none)."""
        out = np.full(self.n, default, dtype if dtype is not None else values.dtype)
        out[self.pos] = values
        return out

    def count(self) -> np.ndarray:
        return self.put(self.ends - self.starts + 1, 0, np.int64)

    def reduce(self, ufunc: np.ufunc, values: np.ndarray, default: Any) -> np.ndarray:
        return self.put(ufunc.reduceat(values, self.starts) if len(self.starts) else values[:0], default)


def _latest(idx: np.ndarray, ts: np.ndarray, rank: np.ndarray, num: np.ndarray) -> np.ndarray:
    """Rows ordered by (request, ts, rank, number key) ascending, the first gathered last among equals: the
    last row of each request's group is its latest event (ties: the first gathered)."""
    return np.lexsort((-np.arange(len(idx)), num, rank, ts, idx))


def reduce_logs(logs: dict[str, Log], done: np.ndarray) -> dict[str, np.ndarray]:
    """The per-request columns of the ``done`` requests (``take_done``'s logs), in ``done`` order."""
    out = _arrival_columns(logs["arrived"], done)
    out["idx"] = done
    adm = logs["admission"]
    g = _Groups(adm["idx"], done)
    out["admission_ns"] = g.reduce(np.minimum, adm["ts"], _MISSING)
    out["num_admission_decisions"] = g.count()
    order = _latest(adm["idx"], adm["ts"], np.zeros(len(adm["ts"]), np.int64), number_key(adm["num"]))
    out["decision"] = g.put(adm["decision"][order][g.ends], None, object)
    pre = logs["preempted"]
    g = _Groups(pre["idx"], done)
    out["num_migrations"] = g.reduce(np.add, pre["migrate"].astype(np.int64), 0)
    out["num_preemptions"] = g.count() - out["num_migrations"]
    out["num_lost_tokens"] = g.reduce(np.add, pre["lost"], 0)
    first = logs["first"]
    g = _Groups(first["idx"], done)
    out["first_token_ns"] = g.reduce(np.minimum, first["ts"], _MISSING)
    byte = np.where(first["byte"] == _MISSING, np.iinfo(np.int64).max, first["byte"])
    out["first_byte_ns"] = g.reduce(np.minimum, byte, _MISSING)
    out["first_byte_ns"][out["first_byte_ns"] == np.iinfo(np.int64).max] = _MISSING
    can = logs["cancelled"]
    g = _Groups(can["idx"], done)
    out["cancel_ns"] = g.reduce(np.minimum, can["ts"], _MISSING)
    num_cancels = g.count()
    fin = logs["finished"]  # exactly one per done request, in done order
    out.update(finish_ns=fin["ts"], outcome=fin["outcome"], output_tokens=fin["output"], cached_finished=fin["hit"],
               last_byte_ns=fin["last_byte"], request_id=fin["rid"])
    # every event but the deliveries (counted with them): arrivals, admissions, preemptions, cancellations, the finish
    out["num_events"] = (out.pop("num_arrivals") + out["num_admission_decisions"] + out["num_preemptions"]
                         + out["num_migrations"] + num_cancels + 1)
    out["instance"], out["instance_key"] = _latest_instance(logs, done)
    return out


def _arrival_columns(arr: Log, done: np.ndarray) -> dict[str, np.ndarray]:
    """The earliest arrival's fields (ties: the first gathered) and the number of arrivals, per request."""
    order = np.lexsort((np.arange(len(arr["idx"])), arr["ts"], arr["idx"]))
    g = _Groups(arr["idx"][order], done)
    first = order[g.starts]
    out = {"num_arrivals": g.count(), "arrival_ns": g.put(arr["ts"][first], _MISSING)}
    for name, col in (("num_prompt_tokens", "prompt"), ("max_output_tokens", "max_output"),
                      ("num_branches", "branches"), ("session_id", "session"), ("client_sent_ns", "sent"),
                      ("cached_arrival", "cached")):
        out[name] = g.put(arr[col][first], None, object)
    return out


def _latest_instance(logs: dict[str, Log], done: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Per request, the instance code of its latest event that names one (-1: none) and that event's key
    (ts, suffix rank, number key)."""
    parts = []
    for name, suffix in _NAMING.items():
        log = logs[name]
        n = len(log["idx"])
        num = number_key(log["num"]) if "num" in log else np.zeros(n, np.int64)
        parts.append((log["idx"], log["ts"], np.full(n, RANK[suffix], np.int64), num, log["inst"]))
    idx, ts, rank, num, inst = (np.concatenate(cols) for cols in zip(*parts))
    named = np.flatnonzero(inst >= 0)
    idx, ts, rank, num, inst = idx[named], ts[named], rank[named], num[named], inst[named]
    order = _latest(idx, ts, rank, num)
    g = _Groups(idx[order], done)
    last = order[g.ends]
    key = (g.put(ts[last], _MISSING), g.put(rank[last], -1), g.put(num[last], -1))
    return g.put(inst[last], -1), key
