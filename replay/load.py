"""How heavily a run loaded its engine, window by window, and whether that lies beyond the load a
calibration was fitted on.

A calibration's error figures hold for runs like the ones it was fitted on. Load matters most: near
``max_num_seqs`` an error in how the step grows with the batch is amplified (the batch is the arrival
rate times E2E, and E2E grows with the step: docs/calibration.md, "The load a calibration vouches
for"). So a run's load is measured the same way for both: from its ``step_executed`` events, per
window of ``WINDOW_S`` seconds and per instance, the busy-time-weighted mean decode batch, in sequences
and as a share of ``max_num_seqs``, and the mean KV blocks in use as a share of the pool. The busiest
window of each is the run's ``Load``; a calibration records the largest over its fitted runs
(``fitted_load``), and a replay counts its windows beyond that. The batch in sequences matters where the
caps differ: a replay with ``vllm serve``'s 1024 seats on an H100 can decode more sequences a step than any
fitted run (each capped at 128) while using a small share of its own cap; the step's growth with the batch
is then an extrapolation, though no queue forms.

``StepLoadMeter`` sums the step events per window as they come: the replay's event writer feeds one for the
manifest, a replay sink can be one (a calibration's replays), and recorded events can be added (a
lake's, where an engine emits its steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from servelens.errors import ConfigError
from servelens.settings import build

#: The window over which a run's load is averaged (a minute: a burst, not a single step).
WINDOW_S = 60.0
#: How far beyond a fitted share a window must go to count as beyond it (a point: shares are recorded rounded).
MARGIN = 0.01
#: How far beyond the fitted decode batch a window's must go, in sequences (batches are recorded to a tenth).
SEQS_MARGIN = 1.0
#: The step events' columns a load is measured from.
STEP_COLUMNS = ("instance_id", "start_ns", "end_ns", "num_decode_seqs", "num_kv_blocks_used", "num_kv_blocks_free")


@dataclass(frozen=True, slots=True)
class Load:
    """The busiest window's load: its mean decode batch over ``max_num_seqs``, its mean KV blocks in use
    over the pool, its mean decode batch in sequences (each the largest over windows and instances,
    busy-time-weighted within a window; ``batch_seqs`` 0: not recorded, as in files written before it)."""

    batch_share: float
    kv_share: float
    batch_seqs: float = 0.0

    def beyond(self, fitted: Load) -> bool:
        """Either share beyond ``fitted``'s by more than ``MARGIN``, or the batch beyond ``fitted``'s by more than
        ``SEQS_MARGIN`` sequences (where ``fitted`` records one)."""
        return (self.batch_share > fitted.batch_share + MARGIN or self.kv_share > fitted.kv_share + MARGIN
                or 0 < fitted.batch_seqs < self.batch_seqs - SEQS_MARGIN)

    def as_json(self) -> dict[str, float]:
        return {"batch_share": round(self.batch_share, 4), "kv_share": round(self.kv_share, 4),
                **({"batch_seqs": round(self.batch_seqs, 1)} if self.batch_seqs else {})}

    @classmethod
    def of_json(cls, doc: Mapping[str, float]) -> Load:
        """A load from its JSON form: each share a number in [0, 1], the batch a number >= 0 (else an error naming
        the key)."""
        if not isinstance(doc, Mapping):
            raise ConfigError("fitted_load must be a mapping of batch_share, kv_share and batch_seqs")
        load: Load = build(cls, doc, "fitted_load.")
        for name, top in (("batch_share", 1.0), ("kv_share", 1.0), ("batch_seqs", math.inf)):
            if not 0 <= getattr(load, name) <= top:
                raise ConfigError(f"fitted_load.{name} must be in [0, {top:g}], not {getattr(load, name)}")
        return load

    @staticmethod
    def peak(loads: list[Load]) -> Load:
        """The largest of each figure over ``loads`` (a calibration's fitted runs)."""
        return Load(*(max((getattr(x, f) for x in loads), default=0.0) for f in FIGURES))


#: ``Load``'s figures, in its order: the columns of ``StepLoadMeter.windows`` a load is read from.
FIGURES = ("batch_share", "kv_share", "batch_seqs")


class StepLoadMeter:
    """Sums step events per instance and window as they come (a replay sink, the replay's event writer, or
    ``add`` with recorded ones): a few numbers per window, whatever the run's length. Their shares of each
    instance's ``max_num_seqs`` are taken when asked (``windows``, ``load``)."""

    digest = False  # a replay need not hash events it only hands here

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_ns = int(window_s * 1e9)
        self._sums: list[pa.Table] = []

    def __call__(self, events: pa.Table) -> None:
        self.add(events)

    def add(self, events: pa.Table) -> None:
        """Add the step events of ``events`` (an ``EVENTS_SCHEMA`` table, or its step rows' columns)."""
        if "event_type" in events.column_names:
            events = events.select([*STEP_COLUMNS, "event_type"])
            events = events.filter(pc.equal(events["event_type"], "step_executed"))
        steps = events.filter(pc.and_(pc.is_valid(events["start_ns"]), pc.is_valid(events["end_ns"])))
        if not steps.num_rows:
            return

        def column(name: str) -> np.ndarray:  # an unrecorded count (a lake's engine may not say) counts 0
            return np.asarray(pc.fill_null(steps[name], 0), np.float64)

        start = np.asarray(steps["start_ns"], np.int64)
        busy = np.asarray(steps["end_ns"], np.int64) - start
        used = column("num_kv_blocks_used")
        pool = used + column("num_kv_blocks_free")
        self._sums.append(_summed(pa.table({
            "instance_id": steps["instance_id"],
            "window_start_ns": (start // self.window_ns) * self.window_ns,
            "busy": busy.astype(np.float64),
            "seqs": busy * column("num_decode_seqs"),
            "kv": busy * np.divide(used, pool, out=np.zeros_like(used), where=pool > 0),
        })))

    def windows(self, max_num_seqs: int | Mapping[str, int]) -> pa.Table:
        """One row per instance and window with steps in it: ``instance_id``, ``window_start_ns``, ``busy_s``,
        ``batch_share`` (of ``max_num_seqs``: one for all, or by instance id), ``kv_share``, ``batch_seqs``."""
        if not self._sums:
            return pa.table({"instance_id": pa.array([], pa.string()), "window_start_ns": pa.array([], pa.int64()),
                             **{c: pa.array([], pa.float64()) for c in ("busy_s", *FIGURES)}})
        sums = _summed(pa.concat_tables(self._sums))
        busy = sums["busy"].to_numpy()
        weight = np.where(busy > 0, busy, 1.0)
        return pa.table({
            "instance_id": sums["instance_id"],
            "window_start_ns": sums["window_start_ns"],
            "busy_s": busy / 1e9,
            "batch_share": sums["seqs"].to_numpy() / weight / _caps(max_num_seqs, sums["instance_id"]),
            "kv_share": sums["kv"].to_numpy() / weight,
            "batch_seqs": sums["seqs"].to_numpy() / weight,
        }).sort_by([("window_start_ns", "ascending"), ("instance_id", "ascending")])

    def load(self, max_num_seqs: int | Mapping[str, int]) -> Load:
        """The busiest window's load."""
        return peak_of(self.windows(max_num_seqs))


def _summed(parts: pa.Table) -> pa.Table:
    """``parts``' busy time, decode sequences and KV share (each times busy time) summed per instance and window."""
    sums = parts.group_by(["instance_id", "window_start_ns"]).aggregate([("busy", "sum"), ("seqs", "sum"), ("kv", "sum")])
    return sums.rename_columns([n.removesuffix("_sum") for n in sums.column_names])


def _caps(max_num_seqs: int | Mapping[str, int], instance_ids: pa.ChunkedArray) -> np.ndarray:
    """Each row's ``max_num_seqs`` (an instance not named: the largest named)."""
    if isinstance(max_num_seqs, int):
        return np.full(len(instance_ids), max(1, max_num_seqs), np.float64)
    largest = max(max_num_seqs.values(), default=1)
    return np.array([max(1, max_num_seqs.get(i, largest)) for i in instance_ids.to_pylist()], np.float64)


def peak_of(windows: pa.Table) -> Load:
    """The largest batch and KV shares and batch of ``windows`` (``StepLoadMeter.windows``)."""
    return Load(*(float(pc.max(windows[c]).as_py() or 0.0) for c in FIGURES))


def windows_beyond(windows: pa.Table, fitted: Load) -> int:
    """How many of ``windows`` lie beyond ``fitted`` (``Load.beyond``: a few rows, one per minute)."""
    rows = zip(*(windows[c].to_pylist() for c in FIGURES))
    return sum(Load(*row).beyond(fitted) for row in rows)


def load_record(windows: pa.Table, fitted: Load | None, window_s: float = WINDOW_S) -> dict[str, Any]:
    """What a run manifest says about the run's load (``fitted``: the calibration's, when it records one)."""
    record: dict[str, Any] = {"window_s": window_s, "busy_windows": windows.num_rows, **peak_of(windows).as_json()}
    if fitted is not None:
        record["fitted"] = fitted.as_json()
        record["windows_beyond_fitted"] = windows_beyond(windows, fitted)
    return record


def describe_load(record: Mapping[str, Any]) -> tuple[str, bool]:
    """A manifest's ``load`` record in words, and whether the run went beyond its calibration's fitted load."""
    minute = "minute" if record.get("window_s") == 60.0 else f"{record.get('window_s')} s window"
    line = (f"load: busiest {minute} {_pct(record['batch_share'])} of max_num_seqs decoding{sequences(record.get('batch_seqs'))}, "
            f"{_pct(record['kv_share'])} of the KV pool in use")
    fitted = record.get("fitted")
    beyond = int(record.get("windows_beyond_fitted") or 0)
    if not isinstance(fitted, Mapping) or not beyond:
        return line, False
    seqs = f", {fitted['batch_seqs']:,.0f} sequences" if fitted.get("batch_seqs") else ""
    return (line + f"; beyond the calibration's fitted runs (up to {_pct(fitted['batch_share'])}{seqs} and "
            f"{_pct(fitted['kv_share'])}) in {beyond} of {record['busy_windows']} busy {minute}s: an extrapolation, "
            "where errors can be several times the held-out figures (docs/calibration.md)"), True


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def sequences(batch_seqs: object) -> str:
    """`` (N sequences)`` for a recorded batch in sequences; nothing where none is recorded (older manifests and
    calibrations)."""
    return f" ({batch_seqs:,.0f} sequences)" if isinstance(batch_seqs, (int, float)) and batch_seqs > 0 else ""


__all__ = ["FIGURES", "MARGIN", "SEQS_MARGIN", "STEP_COLUMNS", "WINDOW_S", "describe_load", "Load", "StepLoadMeter",
           "load_record", "peak_of", "sequences", "windows_beyond"]
