"""The documented replay scenarios by name, the load transforms as one shape, and each policy's defaults.

What ``servelens replay`` and the benchmarks share, so that a command line replays exactly what a
documented table was made from:

- ``LoadShape``: a block bootstrap of time windows, a superposition of shifted copies and a rate
  scaling, applied in that order (``reshape``); each keeps the order of arrivals within what it copies,
  so bursts keep their shape (``replay.workload``).
- Scenario presets. ``two-class`` (``docs/policies.md``): a trace that records no tenants gets five
  (seeded draws of equal share: chat-a, chat-b, chat-c entitled to ``interactive``, docs-a, docs-b to
  ``batch``), each request the class of its tenant, and the classes' TTFT and E2E objectives as its
  deadlines (``replay.abuse.TWO_CLASS_TENANCY``). ``as-recorded``: the workload's own tenants, with the
  two documented classes and objectives; each recorded tenant is entitled to the class recorded for most
  of its requests (telemetry records the class the gateway assigned), others to ``interactive``, and
  every request is served and judged under its tenant's class. ``auto`` picks ``two-class`` for a
  workload without tenants, else ``as-recorded``.
- ``default_policy_config``: every class-aware policy (``priority``, ``sarathi``, ``vtc``, ``deadline``,
  ``deadline-vtc``) gets the preset's tenancy, so ``--policy deadline`` alone admits against the
  documented objectives; the others keep their own defaults.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, fields
from fractions import Fraction

import pyarrow as pa
import pyarrow.compute as pc

from replay.abuse import TWO_CLASS_TENANCY, metric_classes, scenario_for, stamp_classes, two_class_workload
from replay.errors import ReplayError
from replay.metrics import MetricsConfig
from replay.policies import policy_class
from replay.policies.tenancy import Tenancy, TenantConfig
from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
from replay.workload import MAX_SPAN_S, TableWorkload, TiledWorkload, Workload, block_bootstrap, scale_rate, superpose
from schemas.types import doc

NS = 1_000_000_000
PRESETS = ("auto", "two-class", "as-recorded")
#: The scenario the gate's error rates were measured on (``benchmarks/gate_power.py``, ``docs/gate.md``) and its
#: known-answer tests use: three tenants of unequal volume (3:1:1), interactive requests (TTFT objective 2 s)
#: and batch ones (2:1), seeded draws per request.
THREE_TENANT_SCENARIO = Scenario(
    name="demo-three-tenants",  # the name it was measured under (manifests record it)
    tenants=(TenantSpec(name="acme", share=3), TenantSpec(name="globex", share=1), TenantSpec(name="initech", share=1)),
    service_classes=(ServiceClassSpec(name="interactive", share=2, ttft_objective_s=2.0),
                     ServiceClassSpec(name="batch", share=1)),
)


#: The largest rate multiplier: a millionfold rate turns a second between arrivals into a microsecond, a thousand
#: times shorter than one engine step, so every request of the trace lands in the queue at once and the load
#: means nothing more (and a trace's gaps, recorded to the microsecond or coarser, fall below a nanosecond).
MAX_LOAD = 10**6


def parse_load(text: str | float | Fraction) -> Fraction:
    """A rate multiplier: ``2x``, ``1.5x``, ``2`` or ``3/2`` -> Fraction (positive, at most ``MAX_LOAD``)."""
    raw = str(text).strip().lower().removesuffix("x")
    try:
        value = Fraction(raw).limit_denominator(10**6)
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or value <= 0:
        raise ReplayError(f"load {text!r} is not a positive rate multiplier", "write it like 2x, 1.5x or 0.5x")
    if value > MAX_LOAD:
        raise ReplayError(f"load {text!r} is more than {MAX_LOAD:,}x the recorded rate",
                          f"a rate multiplier is at most {MAX_LOAD:,}x: beyond it every request arrives at once")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration_s(text: str | float) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``2h``, ``1d`` or ``250ms``."""
    match = _DURATION.match(str(text))
    if match is None:
        raise ReplayError(f"{text!r} is not a duration", "write it like 30s, 10m, 1h or 1d (plain numbers are seconds)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadShape:
    """How a workload is reshaped before the replay: bootstrap, then superpose, then scale the rate."""

    load: Fraction = doc("Rate multiplier: every gap between arrivals divided by it (2 = twice the rate).", Fraction(1))
    superpose: int = doc("Copies of the workload merged by arrival (1 = the workload itself).", 1)
    shift_s: float = doc("Copy i of a superposition starts i x this many seconds later.", 0.0)
    bootstrap_window_s: float | None = doc("Block bootstrap: windows of this many seconds drawn with replacement.", None)
    bootstrap_windows: int | None = doc("Windows a bootstrap draws (default: as many whole windows as the workload holds).", None)
    bootstrap_seed: int = doc("Seed of the bootstrap's draws.", 0)

    def __post_init__(self) -> None:
        if not 0 < self.load <= MAX_LOAD:
            raise ReplayError(f"--load {self.load} is not a rate multiplier above 0 and at most {MAX_LOAD:,}x",
                              "write it like 2x, 1.5x or 0.5x")
        if self.superpose < 1 or self.shift_s < 0 or not self.shift_s * (self.superpose - 1) <= MAX_SPAN_S:
            raise ReplayError(f"--superpose {self.superpose} --shift {self.shift_s:g}s: the copies must number at least "
                              f"1 and the last start within {MAX_SPAN_S:g} s of the first",
                              "use fewer copies or a shorter --shift (0 or more: 30s, 10m, 1h)")
        if self.bootstrap_window_s is not None and not 0 < self.bootstrap_window_s <= MAX_SPAN_S:
            raise ReplayError(f"--block-bootstrap {self.bootstrap_window_s:g}s is not a window length above 0 and at "
                              f"most {MAX_SPAN_S:g} s", "write it like 60s or 5m")
        if self.bootstrap_windows is not None and (self.bootstrap_windows < 1 or self.bootstrap_window_s is None):
            raise ReplayError("--windows needs --block-bootstrap and at least 1 window",
                              "e.g. --block-bootstrap 5m --windows 12")

    @property
    def is_identity(self) -> bool:
        return self.load == 1 and self.superpose == 1 and self.bootstrap_window_s is None

    def describe(self) -> list[str]:
        """The transforms, as the manifest records them (in the order they apply)."""
        steps = []
        if self.bootstrap_window_s is not None:
            steps.append(f"block_bootstrap(window_s={self.bootstrap_window_s:g}, windows={self.bootstrap_windows or 'all'}, "
                         f"seed={self.bootstrap_seed})")
        if self.superpose > 1:
            steps.append(f"superpose(copies={self.superpose}, shift_s={self.shift_s:g})")
        if self.load != 1:
            steps.append(f"scale_rate({self.load})")
        return steps


def reshape(table: pa.Table, shape: LoadShape) -> pa.Table:
    """``table`` under ``shape``: bootstrap, superpose, scale the rate (arrival order kept within each copy)."""
    if shape.bootstrap_window_s is not None:
        window_ns = round(shape.bootstrap_window_s * NS)
        arrivals = table["arrival_ns"]
        span = (pc.max(arrivals).as_py() - pc.min(arrivals).as_py()) if table.num_rows else 0
        windows = shape.bootstrap_windows or max(1, span // window_ns)
        table = block_bootstrap(table, window_ns, windows, shape.bootstrap_seed)
    if shape.superpose > 1:
        table = superpose(table, shape.superpose, round(shape.shift_s * NS))
    if shape.load != 1:
        table = scale_rate(table, shape.load)
    return table


@dataclass(frozen=True, slots=True)
class Preset:
    """A resolved scenario preset: its name, the tenancy it labels and admits by, and the scenario that
    puts the classes' objectives on each request as deadlines."""

    name: str
    tenancy: Tenancy
    scenario: Scenario

    @property
    def metrics(self) -> MetricsConfig:
        """The metrics' objectives: the tenancy's classes."""
        return MetricsConfig(classes=metric_classes(self.tenancy))


#: The documented two-class scenario of the policy comparison (docs/policies.md).
TWO_CLASS = Preset("two-class", TWO_CLASS_TENANCY, scenario_for(TWO_CLASS_TENANCY, "two-class"))


def resolve_preset(name: str, table: pa.Table, seed: int = 0) -> tuple[Preset, pa.Table]:
    """The preset ``name`` (``auto``, ``two-class``, ``as-recorded``) for ``table``, and the table as it labels it."""
    if name not in PRESETS:
        raise ReplayError(f"unknown scenario {name!r}", f"scenarios: {', '.join(PRESETS)}")
    if name == "auto":
        name = "two-class" if table.num_rows and table["tenant"].null_count == table.num_rows else "as-recorded"
    if name == "two-class":
        return TWO_CLASS, two_class_workload(table, seed)
    tenancy = recorded_tenancy(table)
    return Preset(name, tenancy, scenario_for(tenancy, "as-recorded")), stamp_classes(table, tenancy)


def recorded_tenancy(table: pa.Table) -> Tenancy:
    """The documented two classes; each recorded tenant entitled to the class most of its requests recorded
    (when it is one of them), everyone else to ``interactive``."""
    classes = {c.name for c in TWO_CLASS_TENANCY.classes}
    votes: dict[str, Counter] = {}
    for tenant, cls in zip(table["tenant"].to_pylist(), table["service_class"].to_pylist()):
        if tenant is not None and cls in classes:
            votes.setdefault(tenant, Counter())[cls] += 1
    tenants = tuple(TenantConfig(name=t, service_class=c.most_common(1)[0][0]) for t, c in sorted(votes.items()))
    return Tenancy(classes=TWO_CLASS_TENANCY.classes, tenants=tenants, default_class="interactive")


def prepared_workload(table: pa.Table, name: str, *, preset: str = "auto", shape: LoadShape = LoadShape(),
                      seed: int = 0, num_requests: int | None = None) -> tuple[Workload, Preset]:
    """The workload a replay of ``table`` runs: labelled by the preset, reshaped, then tiled to ``num_requests``
    (copies back to back) when given; named ``name`` (``@<load>x`` added) with its transforms in the manifest."""
    resolved, table = resolve_preset(preset, table, seed)
    table = reshape(table, shape)
    if shape.load != 1:
        name = f"{name}@{_load_text(shape.load)}x"
    if num_requests:
        workload: Workload = TiledWorkload(table, -(-num_requests // max(table.num_rows, 1)), num_requests=num_requests,
                                           name=name)
    else:
        workload = TableWorkload(table, name=name)
    if not shape.is_identity:
        workload.meta = {"load_factor": float(shape.load), "transforms": shape.describe()}
    return workload, resolved


def _load_text(load: Fraction) -> str:
    return f"{float(load):g}"


def default_policy_config(policy_name: str, preset: Preset) -> object | None:
    """The policy's config with the preset's tenancy, for policies that have one; None (their own defaults) else."""
    config_type = policy_class(policy_name).config_type
    if "tenancy" in {f.name for f in fields(config_type)}:
        return config_type(tenancy=preset.tenancy)
    return None


__all__ = ["LoadShape", "MAX_LOAD", "MAX_SPAN_S", "PRESETS", "Preset", "TWO_CLASS", "default_policy_config",
           "parse_duration_s", "parse_load", "prepared_workload", "recorded_tenancy", "reshape", "resolve_preset"]
