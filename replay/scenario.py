"""Scenarios: what a replay adds to a workload that its trace does not record, explicitly and seeded.

A public trace records arrivals and token lengths; it does not say who sent a request, under which
service class, to which model or adapter, with how many parallel samples, or whether the client
gave up. A ``Scenario`` states those assumptions in one place, the run manifest records it, and the
assignment is reproducible: each request's draws are a hash of (run seed, what is drawn, the
request's position in the workload), so they do not depend on how the workload is batched, and
adding a tenant does not reshuffle the classes.

By default a scenario only fills what the workload leaves null (``overwrite=False``): what a trace
or telemetry records is kept as recorded. ``Scenario()`` adds nothing.

Service classes carry objectives; a request's deadlines are its arrival plus its class's TTFT and
E2E objectives (``request_arrived.ttft_deadline_ns`` / ``e2e_deadline_ns``), and a class may cap
output (``max_output_tokens``, the request's max_tokens).

The model mix may change over time (``model_phases``): phases of given durations, each with its own
mix, repeat from the workload's first arrival; a request draws its model from the mix of the phase
its arrival falls in (the same seeded draw as ``models``). ``alternating_models`` builds the common
case, a two-model mix that alternates: the transition frequency is one over the phase duration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.errors import ReplayError
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """A named value drawn with probability proportional to ``share``."""

    name: str = doc("The value (a model, an adapter).")
    share: float = doc("Relative frequency (normalized over the list).")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantSpec:
    """A tenant: how much of the traffic it sends and what it is entitled to."""

    name: str = doc("Tenant pseudonym.")
    share: float = doc("Relative share of requests.")
    weight: float = doc("Entitlement weight for fairness policies (VTC divides service by it).", 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceClassSpec:
    """A service class and its objectives."""

    name: str = doc("Class name, e.g. 'interactive'.")
    share: float = doc("Relative share of requests.")
    ttft_objective_s: float | None = doc("TTFT objective (sets ttft_deadline = arrival + this), seconds.", None)
    itl_objective_s: float | None = doc("Inter-token latency objective, seconds (for reports).", None)
    e2e_objective_s: float | None = doc("E2E objective (sets e2e_deadline = arrival + this), seconds.", None)
    max_output_tokens: int | None = doc("max_tokens the class's requests carry, if any.", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPhase:
    """One phase of a time-varying model mix."""

    duration_s: float = doc("How long the phase lasts, seconds (phases repeat in order).")
    models: tuple[Share, ...] = doc("The model mix of requests arriving during the phase.")

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.models or sum(m.share for m in self.models) <= 0:
            raise ReplayError("a model phase needs a positive duration and model shares adding up to more than 0")


def alternating_models(first: str, second: str, phase_s: float, majority: float = 1.0) -> tuple[ModelPhase, ...]:
    """Two phases of ``phase_s`` each: ``majority`` of requests name ``first`` then ``second`` (the rest the other)."""
    if not 0.5 <= majority <= 1:
        raise ReplayError(f"majority must be in [0.5, 1], not {majority}")

    def mix(a: str, b: str) -> tuple[Share, ...]:
        return (Share(name=a, share=majority),) + ((Share(name=b, share=1 - majority),) if majority < 1 else ())

    return (ModelPhase(duration_s=phase_s, models=mix(first, second)), ModelPhase(duration_s=phase_s, models=mix(second, first)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """Assumptions added to a workload, recorded in the run manifest."""

    name: str = doc("Scenario name.", "as-recorded")
    tenants: tuple[TenantSpec, ...] = doc("Tenants to assign where none is recorded.", ())
    service_classes: tuple[ServiceClassSpec, ...] = doc("Classes to assign where none is recorded.", ())
    models: tuple[Share, ...] = doc("Model mix to assign where none is recorded.", ())
    model_phases: tuple[ModelPhase, ...] = doc(
        "Time-varying model mix, repeating from the first arrival (replaces ``models`` when set).", ()
    )
    adapters: tuple[Share, ...] = doc("Adapter mix (a share named '' means no adapter).", ())
    parallel_sampling_share: float = doc("Share of requests that ask for several samples.", 0.0)
    num_branches: int = doc("Samples (n) of those requests.", 2)
    image_share: float = doc("Share of requests that carry images (multimodal: encoder work in prefill).", 0.0)
    image_tokens: int = doc("Encoder tokens (image patches) of each such request, e.g. 576 for one 336 px image.", 576)
    cancel_share: float = doc("Share of requests whose client cancels.", 0.0)
    cancel_after_s_min: float = doc("Cancellations happen uniformly between this ...", 1.0)
    cancel_after_s_max: float = doc("... and this long after arrival, seconds.", 30.0)
    overwrite: bool = doc("Replace recorded values too (default: fill only what is null).", False)

    def __post_init__(self) -> None:
        for label, items in (("tenant", self.tenants), ("service class", self.service_classes),
                             ("model", self.models), ("adapter", self.adapters)):
            if items and sum(i.share for i in items) <= 0:
                raise ReplayError(f"scenario {self.name!r}: {label} shares must add up to more than 0")
        for label, value in (("parallel_sampling_share", self.parallel_sampling_share), ("cancel_share", self.cancel_share),
                             ("image_share", self.image_share)):
            if not 0 <= value <= 1:
                raise ReplayError(f"scenario {self.name!r}: {label} must be in [0, 1], not {value}")
        if self.num_branches < 1 or self.cancel_after_s_min < 0 or self.cancel_after_s_max < self.cancel_after_s_min:
            raise ReplayError(f"scenario {self.name!r}: num_branches >= 1 and 0 <= cancel_after_s_min <= max")

    def service_class(self, name: str | None) -> ServiceClassSpec | None:
        """The spec of a class by name (None when the scenario does not define it)."""
        for c in self.service_classes:
            if c.name == name:
                return c
        return None


# Stream ids of the independent draws (so adding one kind of assignment leaves the others unchanged).
_TENANT, _CLASS, _MODEL, _ADAPTER, _BRANCHES, _CANCEL, _CANCEL_AFTER, _IMAGE = range(1, 9)
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) draws from (seed, stream, row index) by SplitMix64: batch-independent and seeded."""
    with np.errstate(over="ignore"):
        x = np.asarray(index, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0xBF58476D1CE4E5B9)
        x += np.uint64(stream) * np.uint64(0x94D049BB133111EB)
        for _ in range(2):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _pick(names: list[str], shares: list[float], u: np.ndarray) -> np.ndarray:
    cumulative = np.cumsum(np.asarray(shares, dtype=np.float64))
    cumulative /= cumulative[-1]
    idx = np.minimum(np.searchsorted(cumulative, u, side="right"), len(names) - 1)
    return np.asarray(names, dtype=object)[idx]


def check_classes(classes: pa.Array | pa.ChunkedArray, valid: list[str], where: str, row_offset: int = 0) -> None:
    """A ``ReplayError`` naming the first recorded service class that is not one of ``valid`` (its row, counted
    from ``row_offset``, and the valid classes): replaying it under another class's objectives, or none, would
    judge it against objectives it never had."""
    if not valid:
        return
    unknown = pc.and_(pc.is_valid(classes), pc.invert(pc.is_in(classes, pa.array(valid, pa.string()))))
    if pc.any(unknown).as_py():
        row = pc.index(unknown, True).as_py()
        raise ReplayError(f"{where}: the workload's service_class {classes[row].as_py()!r} (row {row_offset + row}) is "
                          f"not one of its classes", f"valid classes: {', '.join(valid)}; relabel the rows or clear "
                          "the column to let the scenario assign classes")


def apply_scenario(batch: pa.RecordBatch, scenario: Scenario, seed: int, row_offset: int,
                   origin_ns: int | None = None) -> pa.RecordBatch:
    """The batch with the scenario's assignments (rows numbered from ``row_offset`` in the workload;
    ``origin_ns``: the workload's first arrival, where model phases start, default the batch's first)."""
    n = batch.num_rows
    if n == 0:
        return batch
    index = np.arange(row_offset, row_offset + n, dtype=np.uint64)
    columns = {name: batch.column(name) for name in batch.schema.names}

    def fill(name: str, values: np.ndarray) -> None:
        new = pa.array(values.tolist(), columns[name].type)
        columns[name] = new if scenario.overwrite else pc.coalesce(columns[name], new)

    if scenario.tenants:
        fill("tenant", _pick([t.name for t in scenario.tenants], [t.share for t in scenario.tenants], uniform(seed, _TENANT, index)))
    if scenario.service_classes:
        specs = scenario.service_classes
        if not scenario.overwrite:  # recorded classes are kept: each must be one the scenario defines
            check_classes(columns["service_class"], [c.name for c in specs], f"scenario {scenario.name!r}", row_offset)
        fill("service_class", _pick([c.name for c in specs], [c.share for c in specs], uniform(seed, _CLASS, index)))
    if scenario.model_phases:
        fill("model", _phase_models(batch, scenario.model_phases, uniform(seed, _MODEL, index), origin_ns))
    elif scenario.models:
        fill("model", _pick([m.name for m in scenario.models], [m.share for m in scenario.models], uniform(seed, _MODEL, index)))
    if scenario.adapters:
        picked = _pick([a.name for a in scenario.adapters], [a.share for a in scenario.adapters], uniform(seed, _ADAPTER, index))
        fill("adapter", np.where(picked == "", None, picked))
    if scenario.parallel_sampling_share > 0:
        multi = uniform(seed, _BRANCHES, index) < scenario.parallel_sampling_share
        branches = np.where(multi, scenario.num_branches, 1).astype(np.int64)
        recorded = columns["num_branches"].to_numpy(zero_copy_only=False)
        columns["num_branches"] = pa.array(branches if scenario.overwrite else np.maximum(recorded, branches), pa.int64())
    if scenario.cancel_share > 0:
        cancels = uniform(seed, _CANCEL, index) < scenario.cancel_share
        lo, hi = scenario.cancel_after_s_min, scenario.cancel_after_s_max
        after = np.floor((lo + (hi - lo) * uniform(seed, _CANCEL_AFTER, index)) * 1e9).astype(np.int64)
        fill("cancel_after_ns", np.where(cancels, after, None))
    return pa.RecordBatch.from_arrays([columns[name] for name in batch.schema.names], schema=batch.schema)


def image_tokens(scenario: Scenario, seed: int, row_offset: int, n: int) -> list[int] | None:
    """Encoder tokens of ``n`` rows from ``row_offset`` (None: the scenario gives no request images). The
    workload schema has no column for them, so they come from the scenario alone."""
    if scenario.image_share <= 0 or n == 0:
        return None
    index = np.arange(row_offset, row_offset + n, dtype=np.uint64)
    return np.where(uniform(seed, _IMAGE, index) < scenario.image_share, scenario.image_tokens, 0).tolist()


def _phase_models(batch: pa.RecordBatch, phases: tuple[ModelPhase, ...], u: np.ndarray, origin_ns: int | None) -> np.ndarray:
    """Each row's model, drawn from the mix of the phase its arrival falls in."""
    arrival = batch.column("arrival_ns").to_numpy(zero_copy_only=False).astype(np.int64)
    origin = int(arrival[0]) if origin_ns is None else origin_ns
    ends = np.cumsum([round(p.duration_s * 1e9) for p in phases])
    offset = (arrival - origin) % int(ends[-1])
    which = np.searchsorted(ends, offset, side="right")
    out = np.empty(len(arrival), dtype=object)
    for k, phase in enumerate(phases):
        rows = which == k
        if rows.any():
            out[rows] = _pick([m.name for m in phase.models], [m.share for m in phase.models], u[rows])
    return out
