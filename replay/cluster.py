"""A cluster of serving instances behind a router, with scaling on a fixed schedule (the library entry point).

Each instance is an ordinary ``replay.engine.Engine`` with its own ``InstanceConfig``, cost model and
policy object; all of them run on one ``Kernel`` and write to one ``EventWriter``. A request's path:

1. it arrives at the cluster (the workload feed of ``replay.run``);
2. the router (``replay.policies.routing``) picks one of the instances that take traffic now (ready,
   not draining), from the request's view and their load views; the decision is an
   ``admission_decided`` event with decision ``route`` and ``target`` = the instance (or ``reject``
   when a sheddable request is shed, which then finishes ``rejected`` without reaching an instance);
3. the chosen instance's own admission policy decides as for a lone instance (a second
   ``admission_decided``), and the request lives there until it ends or moves.

**Re-routes** (``max_reroutes`` > 0): an instance's admission may answer ``route`` for an arriving
request ("not here": ``EngineView.can_route`` says when it may); the request leaves that instance before
holding anything, the router picks one of the instances taking traffic that it has not tried (an
``admission_decided`` ``route`` naming it), and that instance's admission decides; at most
``max_reroutes`` times per request. Its arrival event is the first instance's, once.

**Moves.** A request leaves its instance for another (``Engine.release``, then ``Engine.receive``
at the destination; in between no engine holds it) when: a disaggregated cluster's prefill instance
produced its first token (``decode_instances``: it moves with its KV to a decode instance); a
migration step moves it (``MigrationStep``: with its KV or to be recomputed, within its pool); its
instance fails (``InstanceFailure``, random failures: recomputed within the pool, or ``error`` with
nowhere to go). Each move is a ``request_preempted`` at the source (mode ``migrate`` with the KV,
else ``recompute``) carrying the request's new lease generation (``num_preemptions``, bumped by one
per preemption or move), then an ``admission_decided`` ``route`` whose ``target`` is the
destination. KV crosses the source's link (transfers leaving one instance queue; bytes / bandwidth,
then the latency). The lease is ``Request.owner`` at that generation: an engine refuses the result
of a step for a request it no longer holds (``Engine.track_leases``), so two workers never advance
the same state. A move is routed at the instant it is decided, after the steps that end then; the
hand-offs of one instant in arrival order.

**Scaling** follows a fixed schedule (``ScaleStep``: at a time after the first arrival, add or remove
instances). An added instance reports ``instance_state`` ``starting`` (``scale_action`` scale_up)
when the step is decided and ``ready`` (scale_up) only after its start-up, weight-load and
cache-warm delays (``ScalingDelays``), and takes traffic from then on. A removal takes the newest
instance: one still starting is stopped at once (``stopped``, scale_down); a ready one reports
``draining`` (scale_down), receives no new requests, finishes those it holds, and reports
``stopped`` (scale_down) when the last one ends. The three start-up phases are not separate events
(the event contract's lifecycle has no states for them: adding some is a minor schema version); the
manifest records each instance's phase durations.

**Time.** Kernel ties at one instant keep the lone engine's order (step ends, then cancellations and
scaling transitions, then arrivals, then scheduling passes), so an instance that becomes ready at
the instant of an arrival takes it. In the fast mode an instance's decode run stops at the step
during which one of its own cancellations happens, never for other instances' events nor for
arrivals: an arrival routed to an instance cuts that instance's run at the step during which it
happens (``Engine.interrupt_run``: the later steps' blocks go back to the pool, which is exact
because a cluster's runs never evict a cached unit beyond their first step), so runs stay as long as
on a lone instance at the same per-instance load. A router reading an instance in a run sees the
reference mode's state: queues do not change inside a run, KV use is counted without the blocks
allocated ahead for later steps (``Engine.kv_blocks_used_now``), and cached prefixes are those of
the reference (no eviction ahead). Every timestamp and every routing decision equals the reference
mode's (``tests/replay/test_cluster.py``, ``tests/replay/test_cluster_properties.py``).

Identical inputs and seed give byte-identical events and manifest, as for a lone instance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from replay.calibration import Calibration, apply_calibration, calibration_record
from replay.config import InstanceConfig, instance_config
from replay.cost_models import make_cost_model
from replay.costmodel import StepCostModel
from replay.emit import EventWriter
from replay.engine import MODES, Engine, Mode
from replay.errors import ReplayError
from replay.kernel import ARRIVAL, CONTROL, Kernel
from replay.outputs import TableSink
from replay.policies import make_policy
from replay.policies.base import AdmissionDecision
from replay.policies.routing import (
    ROUTERS,
    RouteDecision,
    Router,
    check_sheddable_classes,
    load_router_config,
    make_router,
)
from replay.request import FINISHED, Request
from replay.residency import Residency, ResidencyConfig, sized_instance
from replay.run import PROGRESS_EVERY, ReplayProgress, _Feeder, _manifest, _Outputs, _plain, offload
from replay.scenario import Scenario
from replay.views import RequestView
from replay.workload import Workload, as_workload
from schemas.types import doc


def _INDEX(r: Request) -> int:
    return r.index

Lifecycle = Literal["starting", "ready", "draining", "stopped"]
#: serve: prefills and decodes (aggregated); prefill / decode: one pool of a disaggregated cluster
Role = Literal["serve", "prefill", "decode"]


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingDelays:
    """What an added instance waits before it takes traffic: start-up, then weight load, then cache warm-up."""

    startup_s: float = doc("Process and container start until the engine can load weights, seconds.", 30.0)
    weight_load_s: float | None = doc(
        "Weight loading, seconds (None: the model's weight bytes / weight_load_bandwidth_bytes_per_s).", None
    )
    weight_load_bandwidth_bytes_per_s: float = doc(
        "Bandwidth weights load at when weight_load_s is None (storage to device, all shards together), bytes/s.",
        2e9,
    )
    cache_warm_s: float = doc("Warm-up after loading (CUDA graphs, compilation, cache priming), seconds.", 10.0)

    def __post_init__(self) -> None:
        for name in ("startup_s", "weight_load_s", "cache_warm_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_SCHEDULE_S:
                raise ReplayError(f"the scaling delay {name} must be between 0 and {MAX_SCHEDULE_S:g} s, not {value:g}",
                                  f"--{name.replace('_', '-')} takes seconds (0 for none)")
        if not self.weight_load_bandwidth_bytes_per_s >= MIN_LINK_GBPS * 1e9:
            raise ReplayError(f"the weight-load bandwidth must be at least {MIN_LINK_GBPS:g} GB/s, not "
                              f"{self.weight_load_bandwidth_bytes_per_s / 1e9:g} GB/s",
                              "--weight-load-gbps takes the storage-to-device bandwidth in GB/s (default 2)")

    def phases_ns(self, instance: InstanceConfig, weight_bytes: int | None = None) -> tuple[int, int, int]:
        """(start-up, weight load, cache warm) of ``instance``, integer ns (``weight_bytes``: what it loads
        when not its model's weights: a residency's initial set)."""
        load_s = (
            self.weight_load_s
            if self.weight_load_s is not None
            else (instance.model.weight_bytes if weight_bytes is None else weight_bytes) / self.weight_load_bandwidth_bytes_per_s
        )
        return round(self.startup_s * 1e9), round(load_s * 1e9), round(self.cache_warm_s * 1e9)


#: The latest time a schedule may name, seconds after the first arrival (about 31 years: nanoseconds of it
#: still fit the kernel's 64-bit clock), and the most instances a cluster may ever hold (initial, decode
#: and scaled up: each is an engine with its KV pool in memory).
MAX_SCHEDULE_S = 1e9
MAX_INSTANCES = 10_000
#: The slowest link weights load or KV moves over, GB/s (1 MB/s): slower than any storage or network a server
#: has, and fast enough that a petabyte still moves within MAX_SCHEDULE_S (its nanoseconds fit the clock).
MIN_LINK_GBPS = 1e-3
#: The most random failures a replay draws (rate x window): each fails an instance that is up, and no cluster
#: holds more than MAX_INSTANCES, so more would fail nothing more (and only make the replay draw them).
MAX_RANDOM_FAILURES = MAX_INSTANCES
#: The shortest autoscaler interval and window, seconds: real autoscalers decide every 15 s or more
#: (Kubernetes' HPA) and an added instance takes tens of seconds to start, so ten decisions a second is
#: already beyond any; shorter only multiplies the decisions an hour's replay makes.
MIN_AUTOSCALE_S = 0.1


def _check_time(what: object, at_s: float) -> None:
    if not 0 <= at_s <= MAX_SCHEDULE_S:
        raise ReplayError(f"{what}: the time must be between 0 and {MAX_SCHEDULE_S:g} s after the first arrival, "
                          f"not {at_s:g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleStep:
    """One step of a fixed scaling schedule."""

    at_s: float = doc("When the step is decided, seconds after the first arrival.")
    delta: int = doc("Instances to add (positive) or remove (negative; the newest go first).")
    instance: InstanceConfig | None = doc("Configuration of added instances (None: the cluster's first).", None)

    def __post_init__(self) -> None:
        _check_time("scale step", self.at_s)
        if self.delta == 0:
            raise ReplayError(f"scale step at {self.at_s} s by 0: the delta must be non-zero")


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationStep:
    """One move of a fixed migration schedule: a request leaves an instance for another of its pool."""

    at_s: float = doc("When, seconds after the first arrival.")
    instance: int = doc("The source instance, by creation index (0 = the first; decode instances follow the prefill pool).")
    request_rank: int = doc(
        "Which request: the running one at this rank in arrival order (modulo their number); with none running, "
        "the waiting one at this rank; with none at all the step does nothing.",
        0,
    )
    keep_kv: bool = doc("True: its KV moves with it (a transfer); False: it is recomputed at the destination.", True)

    def __post_init__(self) -> None:
        _check_time("migration step", self.at_s)
        if self.instance < 0 or self.request_rank < 0:
            raise ReplayError(f"migration step {self}: instance and rank must be >= 0")


#: What --fail takes.
_FAIL_HINT = ("--fail AT_S:INDEX: instances count from 0 in creation order (the initial ones, the decode pool, then "
              "those scaled up), e.g. 300:1")


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceFailure:
    """An instance fails: it stops at once, and the requests it holds are recomputed elsewhere."""

    at_s: float = doc("When, seconds after the first arrival.")
    instance: int = doc("The instance, by creation index (nothing happens if it is not up then).")

    def __post_init__(self) -> None:
        _check_time("instance failure", self.at_s)
        if self.instance < 0:
            raise ReplayError(f"the instance failure at {self.at_s:g} s names instance {self.instance}: instances "
                              "count from 0", _FAIL_HINT)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """Instances (ready when the replay starts), their router, and the scaling schedule or an autoscaler;
    optionally a separate decode pool (disaggregated serving) and the interconnect KV crosses between
    instances."""

    instances: tuple[InstanceConfig, ...] = doc(
        "The instances up from the start (at least one); with decode_instances, the prefill pool."
    )
    router: str = doc("Registered router: " + ", ".join(sorted(ROUTERS)) + ".", "round-robin")
    router_config: object | None = doc("The router's typed config (None: its defaults).", None)
    scaling: tuple[ScaleStep, ...] = doc("Fixed scaling schedule, in time order.", ())
    delays: ScalingDelays = field(default_factory=ScalingDelays, metadata={"doc": "Delays of an added instance."})
    decode_instances: tuple[InstanceConfig, ...] = doc(
        "Disaggregated serving: the decode pool. Empty (the default): aggregated, each instance prefills and "
        "decodes its requests. Set: a request is prefilled on a prefill instance (instances), which produces "
        "its first token, then its KV moves to a decode instance, which produces the rest.",
        (),
    )
    decode_router: str = doc(
        "Registered router that picks the decode instance of a prefilled request (disaggregated serving).",
        "least-outstanding-tokens",
    )
    decode_router_config: object | None = doc("The decode router's typed config (None: its defaults; no shedding).", None)
    kv_transfer_bandwidth_bytes_per_s: float = doc(
        "Bandwidth of one instance's link for KV leaving it (transfers from one instance queue on its link), bytes/s. "
        "Default 50e9: a 400 Gb/s RDMA NIC.",
        50e9,
    )
    kv_transfer_latency_s: float = doc("Fixed latency added to every KV transfer, seconds.", 20e-6)
    migrations: tuple[MigrationStep, ...] = doc("Fixed migration schedule (any order).", ())
    failures: tuple[InstanceFailure, ...] = doc("Instance failures at fixed times (any order).", ())
    failure_rate_per_s: float = doc(
        "Random failures: their rate over the cluster, per second (Poisson, seeded by failure_seed), within "
        "failure_window_s of the first arrival; each fails an instance up then, drawn uniformly.",
        0.0,
    )
    failure_window_s: float = doc("Span after the first arrival within which random failures happen, seconds.", 3600.0)
    failure_seed: int = doc("Seed of the random failures (their times and instances).", 0)
    autoscaler: str | None = doc(
        "Registered autoscaler consulted every autoscale_interval_s (replay.policies.autoscale; None: none).", None
    )
    autoscaler_config: object | None = doc("The autoscaler's typed config (None: its defaults).", None)
    autoscale_interval_s: float = doc("Seconds between consultations of the autoscaler.", 15.0)
    autoscale_window_s: float = doc("Arrivals are measured over this many seconds before each consultation.", 60.0)
    max_reroutes: int = doc(
        "Re-routes per request: how many times instances' admission may answer 'route' (not here) for one arriving "
        "request, each time sending it to another instance taking traffic that it has not tried, which the router "
        "picks. 0 (the default): never; admission answers as on a lone instance.",
        0,
    )
    residency: ResidencyConfig | None = doc(
        "Multi-model residency (replay.residency; None: each instance holds its own model alone).", None
    )

    def __post_init__(self) -> None:
        if not self.instances:
            raise ReplayError("a cluster needs at least one instance")
        most = self.most_instances
        if most > MAX_INSTANCES:
            raise ReplayError(f"the cluster could hold {most:,} instances (initial, decode, scaled up or the autoscaler's "
                              f"max_instances): at most {MAX_INSTANCES:,}",
                              "model a larger fleet as a sample of it at the same load per instance")
        if self.autoscaler is not None:
            from replay.policies.autoscale import autoscaler_class

            autoscaler_class(self.autoscaler)  # raises the error listing the valid names
            if not (MIN_AUTOSCALE_S <= self.autoscale_interval_s <= MAX_SCHEDULE_S
                    and MIN_AUTOSCALE_S <= self.autoscale_window_s <= MAX_SCHEDULE_S):
                raise ReplayError(f"the autoscaler's interval and window must be positive: between {MIN_AUTOSCALE_S:g} "
                                  f"and {MAX_SCHEDULE_S:g} s, not {self.autoscale_interval_s:g} and "
                                  f"{self.autoscale_window_s:g}",
                                  "--autoscale-interval-s and --autoscale-window-s take seconds (defaults 15 and 60)")
        ROUTERS.lookup(self.router)  # an unknown name: the error lists the valid ones
        if self.decode_instances:
            ROUTERS.lookup(self.decode_router)
            if getattr(self.decode_router_config, "shedding", None) is not None:
                raise ReplayError("the decode router cannot shed", "a prefilled request always moves to a decode instance")
            if self.scaling or self.autoscaler is not None:
                raise ReplayError("a scaling schedule or an autoscaler with disaggregated pools is not supported yet",
                                  "scale an aggregated cluster, or size the two pools")
        if self.max_reroutes < 0:
            raise ReplayError(f"max_reroutes must be non-negative, not {self.max_reroutes}")
        if self.residency is not None and (self.decode_instances or self.migrations or self.failures
                                           or self.failure_rate_per_s or self.max_reroutes):
            raise ReplayError("multi-model residency with disaggregated pools, migrations, failures or re-routes is not "
                              "supported yet",
                              "replay residency on an aggregated cluster without faults")
        self._check_faults_and_links()
        live = len(self.instances)
        last = 0.0
        for step in self.scaling:
            if step.at_s < last:
                raise ReplayError("the scaling schedule must be in time order", f"step at {step.at_s} s comes after {last} s")
            last = step.at_s
            live += step.delta
            if live < 1:
                raise ReplayError(
                    f"the scaling step at {step.at_s} s leaves {live} instances", "a cluster keeps at least one instance"
                )
        configs = list(self.instances) + list(self.decode_instances) + [s.instance for s in self.scaling if s.instance is not None]
        sizes = {(c.engine.block_size_tokens, c.engine.enable_prefix_caching) for c in configs}
        if len(sizes) > 1:
            raise ReplayError(
                "the instances of a cluster differ in KV block size or prefix caching",
                "the workload's prefix blocks are cut once for the whole cluster: use one block size and setting",
            )

    def _check_faults_and_links(self) -> None:
        """Random failures a replay can draw, and a KV link whose transfer times fit the clock."""
        if not (0 <= self.failure_window_s <= MAX_SCHEDULE_S
                and 0 <= self.failure_rate_per_s * self.failure_window_s <= MAX_RANDOM_FAILURES):
            raise ReplayError(
                f"random failures at {self.failure_rate_per_s * 3600:g} per hour within {self.failure_window_s:g} s: "
                f"the rate must be non-negative, the window within 0 to {MAX_SCHEDULE_S:g} s, and at most "
                f"{MAX_RANDOM_FAILURES:,} failures expected in it",
                "--failure-rate-per-hour takes failures per hour over the cluster (0 or more)")
        if not (self.kv_transfer_bandwidth_bytes_per_s >= MIN_LINK_GBPS * 1e9
                and 0 <= self.kv_transfer_latency_s <= MAX_SCHEDULE_S):
            raise ReplayError(
                f"the KV transfer link must move at least {MIN_LINK_GBPS:g} GB/s with a latency of 0 to "
                f"{MAX_SCHEDULE_S:g} s, not {self.kv_transfer_bandwidth_bytes_per_s / 1e9:g} GB/s and "
                f"{self.kv_transfer_latency_s:g} s (kv_transfer_bandwidth_bytes_per_s, kv_transfer_latency_s)",
                "--kv-transfer-gbps (default 50) and --kv-transfer-latency-s (default 0.00002)")

    @property
    def most_instances(self) -> int:
        """The most instances the cluster may ever hold: initial, decode, scaled up, or the autoscaler's most."""
        most = len(self.instances) + len(self.decode_instances) + sum(max(0, s.delta) for s in self.scaling)
        if self.autoscaler is None:
            return most
        if self.autoscaler_config is None:
            from replay.policies.autoscale import autoscaler_class

            return max(most, getattr(autoscaler_class(self.autoscaler).config_type(), "max_instances", 0))
        return max(most, getattr(self.autoscaler_config, "max_instances", 0))


def cluster_config(num_instances: int, instance: InstanceConfig | None = None, router: str = "round-robin", *,
                   router_config: object | None = None, scaling: Sequence[ScaleStep] = (),
                   delays: ScalingDelays | None = None) -> ClusterConfig:
    """``num_instances`` alike instances (``instance``, default ``instance_config()``) behind ``router``."""
    if num_instances < 1:
        raise ReplayError(f"a cluster needs at least one instance, not {num_instances}")
    instance = instance or instance_config()
    return ClusterConfig(instances=(instance,) * num_instances, router=router, router_config=router_config,
                         scaling=tuple(scaling), delays=delays or ScalingDelays())


def disaggregated_config(num_prefill: int, num_decode: int, instance: InstanceConfig | None = None,
                         router: str = "least-outstanding-tokens", *, decode_instance: InstanceConfig | None = None,
                         decode_router: str = "least-outstanding-tokens", **fields) -> ClusterConfig:
    """``num_prefill`` prefill instances (``instance``) behind ``router``, ``num_decode`` decode instances
    (``decode_instance``, default ``instance``) behind ``decode_router``; ``fields``: the other
    ``ClusterConfig`` fields (e.g. ``kv_transfer_bandwidth_bytes_per_s``)."""
    if num_prefill < 1 or num_decode < 1:
        raise ReplayError(f"disaggregated serving needs both pools, not {num_prefill} prefill + {num_decode} decode")
    instance = instance or instance_config()
    return ClusterConfig(instances=(instance,) * num_prefill, router=router,
                         decode_instances=(decode_instance or instance,) * num_decode, decode_router=decode_router, **fields)


def cluster_from_options(
    instance: InstanceConfig,
    instances: int = 1,
    *,
    router: str | None = None,
    router_config_file: str | Path | None = None,
    scale: Sequence[str] = (),
    startup_s: float | None = None,
    weight_load_s: float | None = None,
    weight_load_gbps: float | None = None,
    cache_warm_s: float | None = None,
    decode_instances: int = 0,
    decode_router: str | None = None,
    kv_transfer_gbps: float | None = None,
    kv_transfer_latency_s: float | None = None,
    fail: Sequence[str] = (),
    failure_rate_per_hour: float | None = None,
    autoscaler: str | None = None,
    autoscaler_config_file: str | Path | None = None,
    autoscale_interval_s: float | None = None,
    autoscale_window_s: float | None = None,
    failure_seed: int = 0,
) -> ClusterConfig:
    """The cluster of ``servelens replay``'s cluster options, in their plain units and names (``--instances``,
    ``--scale AT_S:+N``, ``--weight-load-gbps`` ...): ``instances`` alike instances (``instance``), a decode
    pool of ``decode_instances`` more (0: aggregated), the routers' and the autoscaler's settings read from
    their YAML files. An option left None takes its ``ClusterConfig`` (or ``ScalingDelays``) field's default.
    """
    if instances < 1:
        raise ReplayError(f"--instances must be at least 1, not {instances}")
    if instances > MAX_INSTANCES:
        raise ReplayError(f"--instances {instances:,} is more than a cluster may hold: at most {MAX_INSTANCES:,}",
                          "model a larger fleet as a sample of it at the same load per instance")
    _check_decode_options(decode_instances, decode_router, kv_transfer_gbps, kv_transfer_latency_s)
    delays = ScalingDelays(**_given(startup_s=startup_s, weight_load_s=weight_load_s, cache_warm_s=cache_warm_s,
                                    weight_load_bandwidth_bytes_per_s=_times(weight_load_gbps, 1e9)))
    router = "round-robin" if router is None else router
    router_config = load_router_config(router, router_config_file) if router_config_file is not None else None
    config = cluster_config(instances, instance, router, router_config=router_config,
                            scaling=[parse_scale_step(s) for s in scale], delays=delays)
    config = dataclasses.replace(
        config,
        decode_instances=(instance,) * decode_instances,
        failures=tuple(parse_failure(f) for f in fail),
        failure_seed=failure_seed,
        **_given(decode_router=decode_router, kv_transfer_bandwidth_bytes_per_s=_times(kv_transfer_gbps, 1e9),
                 kv_transfer_latency_s=kv_transfer_latency_s,
                 failure_rate_per_s=None if failure_rate_per_hour is None else failure_rate_per_hour / 3600),
    )
    config = _with_autoscaler(config, autoscaler, autoscaler_config_file, autoscale_interval_s, autoscale_window_s)
    _check_failed_instances(config)
    return config


def _check_decode_options(decode_instances: int, decode_router: str | None, kv_transfer_gbps: float | None,
                          kv_transfer_latency_s: float | None) -> None:
    """Refuse a decode pool of no instances, an unknown --decode-router, and the options of a decode pool
    without one (they would be silently ignored)."""
    if decode_instances < 0 or decode_instances > MAX_INSTANCES:
        raise ReplayError(f"--decode-instances must be between 1 and {MAX_INSTANCES:,}, not {decode_instances:,}",
                          "leave --decode-instances out for aggregated serving")
    if decode_router is not None and decode_router not in ROUTERS:
        raise ReplayError(f"--decode-router: unknown router {decode_router!r}", "valid names: " + ", ".join(sorted(ROUTERS)))
    if decode_instances == 0:
        given = [flag for flag, value in (("--decode-router", decode_router), ("--kv-transfer-gbps", kv_transfer_gbps),
                                          ("--kv-transfer-latency-s", kv_transfer_latency_s)) if value is not None]
        if given:
            one = len(given) == 1
            raise ReplayError(f"{', '.join(given)} need{'s' if one else ''} --decode-instances: "
                              f"{'it configures' if one else 'they configure'} the decode pool of disaggregated serving",
                              "add --decode-instances N, or drop " + " and ".join(given))


def _with_autoscaler(config: ClusterConfig, autoscaler: str | None, config_file: str | Path | None,
                     interval_s: float | None, window_s: float | None) -> ClusterConfig:
    """``config`` sized by ``autoscaler`` (its settings from ``config_file``); the settings need one."""
    if autoscaler is None:
        if config_file is not None or interval_s is not None or window_s is not None:
            raise ReplayError("--autoscaler-config, --autoscale-interval-s and --autoscale-window-s need --autoscaler",
                              "name one: request-rate or workload-aware")
        return config
    from replay.policies.autoscale import load_autoscaler_config

    return dataclasses.replace(
        config,
        autoscaler=autoscaler,
        autoscaler_config=load_autoscaler_config(autoscaler, config_file) if config_file is not None else None,
        **_given(autoscale_interval_s=interval_s, autoscale_window_s=window_s),
    )


def _given(**values: object) -> dict[str, object]:
    """The values that are not None (the others keep their field's default)."""
    return {k: v for k, v in values.items() if v is not None}


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def parse_scale_step(spec: str) -> ScaleStep:
    """A scale step from ``AT_S:+N`` or ``AT_S:-N`` (the CLI's ``--scale``), e.g. ``120:+2``."""
    at, sep, delta = spec.partition(":")
    try:
        if not sep or not delta or delta[0] not in "+-":
            raise ValueError
        return ScaleStep(at_s=float(at), delta=int(delta))
    except ValueError:
        raise ReplayError(f"scale step {spec!r} is not AT_S:+N or AT_S:-N", "e.g. 120:+2 (add two at 120 s), 600:-1") from None


def parse_failure(spec: str) -> InstanceFailure:
    """An instance failure from ``AT_S:INDEX`` (the CLI's ``--fail``), e.g. ``300:1``."""
    at, sep, index = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        at_s, instance = float(at), int(index)
    except ValueError:
        raise ReplayError(f"instance failure {spec!r} is not AT_S:INDEX", "e.g. 300:1 (instance 1 fails at 300 s)") from None
    if instance < 0:
        raise ReplayError(f"--fail {spec}: the instance index must be 0 or more, not {instance}", _FAIL_HINT)
    return InstanceFailure(at_s=at_s, instance=instance)


def _check_failed_instances(config: ClusterConfig) -> None:
    """Refuse a --fail of an instance the cluster never holds (it would silently fail nothing)."""
    most = config.most_instances
    seen: set[tuple[float, int]] = set()
    for f in config.failures:
        if (f.at_s, f.instance) in seen:
            raise ReplayError(f"--fail {f.at_s:g}:{f.instance} is given twice (an instance fails once at a time)",
                              "give each failure once; " + _FAIL_HINT)
        seen.add((f.at_s, f.instance))
        if f.instance >= most:
            raise ReplayError(f"--fail {f.at_s:g}:{f.instance} names instance {f.instance}, but the cluster holds at most "
                              f"{most} instance{'s' if most != 1 else ''} (indexes 0 to {most - 1})", _FAIL_HINT)


# ---------------------------------------------------------------------------------------------- instances


#: The route decision when no routable instance holds a request's model (pinned residency).
_NOT_HELD = RouteDecision(index=None, reason="no ready instance holds the model", shed=True)


class _Route:
    """A route decision as the ``admission_decided`` event records it (one per instance, reused)."""

    __slots__ = ("decision", "reason", "retry_after_s", "predicted_output_tokens_low", "predicted_output_tokens_high",
                 "target")

    def __init__(self, reason: str, target: str) -> None:
        self.decision = "route"
        self.reason = reason
        self.retry_after_s = None
        self.predicted_output_tokens_low = None
        self.predicted_output_tokens_high = None
        self.target = target


class ClusterInstance:
    """One instance of the cluster: its engine, lifecycle state and router counts (its router load view)."""

    __slots__ = ("index", "instance_id", "config", "engine", "state", "num_outstanding", "num_outstanding_tokens",
                 "num_routed", "phases_ns", "ready_ns", "_cancels", "_route", "role", "link_free_ns", "num_transfers_out",
                 "kv_bytes_out")

    def __init__(self, index: int, instance_id: str, config: InstanceConfig, engine: Engine, router_name: str,
                 role: Role = "serve") -> None:
        self.index = index
        self.role = role
        self.link_free_ns = 0  # when its link for outgoing KV is free
        self.num_transfers_out = 0
        self.kv_bytes_out = 0
        self.instance_id = instance_id
        self.config = config
        self.engine = engine
        self.state: Lifecycle = "starting"
        self.num_outstanding = 0  # routed, not finished
        self.num_outstanding_tokens = 0  # their prompt tokens
        self.num_routed = 0
        self.phases_ns = (0, 0, 0)
        self.ready_ns: int | None = None
        self._cancels: list[int] = []  # this instance's pending cancellation times (a heap)
        self._route = _Route(router_name, instance_id)
        engine.next_event_ns = self.next_event_ns
        engine.interruptible = True

    # the router's load view (replay.policies.routing.InstanceLoad)
    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting) + len(self.engine.held)

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    @property
    def kv_utilization(self) -> float:
        return self.engine.kv_blocks_used_now() / self.engine.pool.num_total

    @property
    def kv_block_size_tokens(self) -> int:
        return self.engine.block_size

    def prefix_hit_blocks(self, request: RequestView) -> int:
        return self.engine.view.cached_prefix_blocks(request)[0]

    def next_event_ns(self) -> int | None:
        """When a run of this instance must stop: at its next cancellation. Arrivals do not stop it: one
        routed here cuts the run then (``Engine.interrupt_run``)."""
        cancels = self._cancels
        now = self.engine.kernel.now_ns
        while cancels and cancels[0] <= now:
            heapq.heappop(cancels)
        return cancels[0] if cancels else None

    def __repr__(self) -> str:
        return f"ClusterInstance({self.instance_id!r}, {self.state}, outstanding={self.num_outstanding})"


class _ClusterWriter(EventWriter):
    """The writer the instances share. A chunk's member log is valid until the next flush, and one
    instance flushes while others have steps in flight whose lockstep members were logged before:
    after each flush those snapshots are logged again into the new chunk's log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engines: list[Engine] = []

    def flush(self) -> None:
        logged = self._member_offsets  # the flushed log's offsets, which the snapshots' rows index
        super().flush()
        seen: set[int] = set()
        for e in self.engines:
            for snap in (e._flight.snapshot if e._flight is not None else None, e._lock.snapshot):
                if snap is None or not snap.num_rows or id(snap) in seen:
                    continue
                seen.add(id(snap))
                if snap.chunk != self._log_number - 1:
                    raise AssertionError("a step in flight names lockstep members of an older chunk")
                offsets = logged[snap.row: snap.row + snap.num_rows]
                snap.row = len(self._member_requests)
                snap.chunk = self._log_number
                self._member_requests.extend(snap.requests)
                self._member_offsets.extend(offsets)
                if snap.num_seqs != snap.num_rows:
                    self._member_branches = True


class _ClusterStats:
    __slots__ = ("num_finished",)

    def __init__(self) -> None:
        self.num_finished = 0


class Cluster:
    """The instances on one kernel behind a router; what the workload feed submits arrivals to."""

    def __init__(self, kernel: Kernel, config: ClusterConfig, writer: EventWriter, *, engine_id: str,
                 make_engine: Callable[[InstanceConfig, str], Engine]) -> None:
        self.kernel = kernel
        self.config = config
        self.writer = writer
        self.engine_id = engine_id
        self.router: Router = make_router(config.router, config.router_config)
        self._make_engine = make_engine
        self.instances: list[ClusterInstance] = []
        self.routable: list[ClusterInstance] = []  # ready, not draining, in creation order
        self.stats = _ClusterStats()
        self.num_shed = 0
        self.autoscaling = None  # replay.autoscaling.Autoscaling when the config names an autoscaler
        self.residency = Residency(config.residency, kernel, writer) if config.residency is not None else None
        writer.routed = True
        # disaggregated serving: the decode pool and its router
        self.decode_router: Router | None = (
            make_router(config.decode_router, config.decode_router_config) if config.decode_instances else None
        )
        self.decode_routable: list[ClusterInstance] = []
        # requests whose KV is on its way to a decode instance: decided at one instant, routed together
        self._moves: list[tuple[Request, int, ClusterInstance]] = []
        self._in_transit: dict[Request, ClusterInstance] = {}  # request -> its destination
        self._bandwidth = config.kv_transfer_bandwidth_bytes_per_s
        self._latency_ns = round(config.kv_transfer_latency_s * 1e9)
        self.num_transfers = 0
        self.kv_transfer_bytes = 0
        # requests may move mid-step (migrations, failures): engines record the leases of their steps
        self._faults = bool(config.migrations or config.failures or config.failure_rate_per_s)
        self.num_migrations = 0
        self.num_failures = 0
        # re-routes (max_reroutes): the request being routed on arrival now, and the instances it tried
        self._routing: Request | None = None
        self._tried: list[ClusterInstance] = []
        self.num_reroutes = 0
        self.num_downgrades = 0  # requests an instance's admission downgraded to a smaller model (residency)

    # ------------------------------------------------------------------ lifecycle

    def _add(self, config: InstanceConfig, role: Role = "serve") -> ClusterInstance:
        index = len(self.instances)
        instance_id = f"{self.engine_id}-i{index}"
        engine = self._make_engine(config, instance_id)
        self.writer.engines.append(engine)
        inst = ClusterInstance(index, instance_id, config, engine,
                               self.config.decode_router if role == "decode" else self.config.router, role)
        engine.on_finish = lambda r, inst=inst: self._finished(inst, r)
        engine.cancel_elsewhere = self._cancel_moved
        engine.track_leases = self._faults
        if role == "prefill":
            engine.handoff = lambda r, target, inst=inst: self._handoff(inst, r, target)
        if self.config.max_reroutes and role != "decode":
            engine.reroute = lambda r, target, model, inst=inst: self._reroute(inst, r, target, model)
            engine.view.route_check = self._can_route
        if self.residency is not None:
            self.residency.attach(inst)
            engine.reroute = lambda r, target, model, inst=inst: self._reroute(inst, r, target, model)
            engine.view.downgrade_check = self._can_downgrade
        self.instances.append(inst)
        return inst

    def start(self) -> None:
        """The initial instances come up ready when the replay starts; the schedule is set."""
        now = self.kernel.now_ns
        disaggregated = bool(self.config.decode_instances)
        pools = [(c, "prefill" if disaggregated else "serve") for c in self.config.instances]
        pools += [(c, "decode") for c in self.config.decode_instances]
        for config, role in pools:
            inst = self._add(config, role)
            inst.state = "ready"
            inst.ready_ns = now
            inst.engine.start()
            (self.decode_routable if role == "decode" else self.routable).append(inst)
        for step in self.config.scaling:
            self.kernel.schedule(now + round(step.at_s * 1e9), CONTROL, lambda step=step: self._scale(step))
        for m in self.config.migrations:
            self.kernel.schedule(now + round(m.at_s * 1e9), CONTROL, lambda m=m: self._migrate(m))
        for f in self.config.failures:
            self.kernel.schedule(now + round(f.at_s * 1e9), CONTROL, lambda f=f: self._fail_index(f.instance))
        if self.config.failure_rate_per_s > 0:
            rng = random.Random(self.config.failure_seed)
            t = rng.expovariate(self.config.failure_rate_per_s)
            while t <= self.config.failure_window_s:
                u = rng.random()
                self.kernel.schedule(now + round(t * 1e9), CONTROL, lambda u=u: self._fail_random(u))
                t += rng.expovariate(self.config.failure_rate_per_s)
        if self.config.autoscaler is not None:
            from replay.autoscaling import Autoscaling

            self.autoscaling = Autoscaling(self, now)
            self.autoscaling.start()

    def _state(self, inst: ClusterInstance, state: Lifecycle, action: str | None) -> None:
        inst.state = state
        e = inst.engine
        models, adapters = ([inst.config.model.name], None) if self.residency is None else self.residency.resident_lists(inst)
        self.writer.on_state(self.kernel.now_ns, inst.instance_id, state, e.pool.num_total, e.block_size,
                             models, action, adapters=adapters)

    def scale_by(self, at_s: float, delta: int) -> None:
        """Add (``delta`` > 0) or remove instances now, as a schedule's step would (the autoscaling loop's way in)."""
        self._scale(ScaleStep(at_s=at_s, delta=delta))

    def _scale(self, step: ScaleStep) -> None:
        now = self.kernel.now_ns
        if step.delta > 0:
            for _ in range(step.delta):
                inst = self._add(step.instance or self.config.instances[0])
                inst.phases_ns = self.config.delays.phases_ns(
                    inst.config, None if self.residency is None else self.residency.initial_bytes(inst))
                self._state(inst, "starting", "scale_up")
                self.kernel.schedule(now + sum(inst.phases_ns), CONTROL, lambda inst=inst: self._ready(inst))
            return
        for _ in range(-step.delta):
            live = [x for x in self.instances if x.state in ("starting", "ready")]
            if len(live) <= 1:
                if self._faults:
                    break  # failures took the others: the last one stays
                raise ReplayError("a scale-down would leave no instance (a cluster bug: the schedule is checked)")
            inst = live[-1]  # the newest goes first
            if inst.state == "starting":
                self._state(inst, "stopped", "scale_down")  # never served: its pending ready is ignored
                continue
            self.routable.remove(inst)
            self._state(inst, "draining", "scale_down")
            if self._idle(inst):
                self._state(inst, "stopped", "scale_down")

    def _ready(self, inst: ClusterInstance) -> None:
        if inst.state != "starting":
            return  # removed while starting
        inst.ready_ns = self.kernel.now_ns
        self._state(inst, "ready", "scale_up")
        self.routable.append(inst)
        self.routable.sort(key=lambda x: x.index)

    def stop(self) -> None:
        """End of the replay: every instance not yet stopped stops (what never ran ends as an error)."""
        for inst in self.instances:
            if inst.state == "starting":
                self._state(inst, "stopped", None)
            elif inst.state != "stopped":
                inst.engine.stop()
                inst.state = "stopped"

    # ------------------------------------------------------------------ requests

    def submit(self, r: Request, num_output_tokens: int) -> None:
        """A request arrives: route it (an admission_decided 'route' event), then its instance admits it."""
        now = self.kernel.now_ns
        view = RequestView(r)
        routable = self.routable
        writer = self.writer
        if self.autoscaling is not None:
            self.autoscaling.arrived(r)
        if not routable:  # only after failures: every instance of the pool is down
            writer.arrived.append((r, None, None))
            writer.finished.append((r, now, "error", 0, "no instance takes traffic (all failed or stopped)", None))
            self.stats.num_finished += 1
            return
        if self.residency is not None:
            routable = self.residency.candidates(r, routable)
        d = self.router.route(view, routable) if routable else _NOT_HELD
        r.num_admission_decisions += 1
        if d.shed:
            self.num_shed += 1
            reject = AdmissionDecision(decision="reject", reason=d.reason, retry_after_s=d.retry_after_s)
            writer.arrived.append((r, None, None))
            writer.admission.append((r, now, reject, r.num_admission_decisions, None))
            writer.finished.append((r, now, "rejected", 0, d.reason, None))
            self.stats.num_finished += 1
            if not writer.labelled and (r.tenant or r.service_class or r.model or r.adapter):
                writer.labelled = True
            return
        inst = routable[d.index]
        writer.admission.append((r, now, inst._route, r.num_admission_decisions, inst.instance_id))
        inst.num_outstanding += 1
        inst.num_outstanding_tokens += r.num_prompt_tokens
        inst.num_routed += 1
        if r.cancel_after_ns is not None:
            heapq.heappush(inst._cancels, now + r.cancel_after_ns)
        if self.residency is not None:  # into the engine now (its admission may downgrade it), or once loaded
            self._routing, self._tried = r, [inst]
            self.residency.submit(inst, r, num_output_tokens)
            self._routing = None
            return
        engine = inst.engine
        engine.interrupt_run()
        if not self.config.max_reroutes:
            engine.submit(r, num_output_tokens)
            return
        self._routing, self._tried = r, [inst]
        engine.submit(r, num_output_tokens)
        self._routing = None

    def _can_route(self, r: Request) -> bool:
        """Whether an instance's admission may answer 'route' for ``r`` now (``EngineView.can_route``): only
        while the cluster routes it on arrival (a held request's later decisions never move it), fewer
        than ``max_reroutes`` times, and while an instance taking traffic has not been tried."""
        tried = self._tried
        return r is self._routing and len(tried) <= self.config.max_reroutes and any(
            x not in tried for x in self.routable
        )

    def _can_downgrade(self, r: Request, model: str) -> bool:
        """Whether an instance's admission may answer 'downgrade' to ``model`` for ``r`` now
        (``EngineView.can_downgrade``): only while the cluster routes it on arrival, once per request, for a
        request without an adapter (an adapter belongs to its base model), and while an instance taking
        traffic that it has not tried holds ``model`` resident (a downgrade never waits for a load)."""
        return (r is self._routing and len(self._tried) == 1 and r.adapter is None
                and bool(self.residency.serving(model, [x for x in self.routable if x not in self._tried])))

    def _reroute(self, src: ClusterInstance, r: Request, target: int, model: str | None = None) -> None:
        """``src``'s admission answered 'route' for ``r`` (not here) and released it: the router picks one of
        the instances taking traffic that it has not tried (an ``admission_decided`` 'route' naming it), and
        that instance's admission decides (it may route again, within ``max_reroutes``). 'downgrade'
        (``model``): ``r`` is served as ``model`` from now on (its weights; its events keep the model it named),
        and the router picks among the instances not tried that hold it resident (the route event's reason
        names the downgrade)."""
        now = self.kernel.now_ns
        writer = self.writer
        self._left(src, r)
        candidates = [x for x in self.routable if x not in self._tried]
        if model is not None:
            self.residency.serve_as(r, model)
            candidates = self.residency.serving(model, candidates)
            self.num_downgrades += 1
        d = self.router.route(r.view, candidates)
        r.num_admission_decisions += 1
        if d.shed:  # the router sheds it now: it ends rejected, on no instance
            self.num_shed += 1
            reject = AdmissionDecision(decision="reject", reason=d.reason, retry_after_s=d.retry_after_s)
            writer.admission.append((r, now, reject, r.num_admission_decisions, None))
            self._end_moved(r, src, "rejected", d.reason, counted=False)
            if model is not None:
                self.residency.serve_as(r, None)
            return
        dest = candidates[d.index]
        self._tried.append(dest)
        why = f"{'re-routed' if model is None else f'downgraded to {model}'} from {src.instance_id}"
        if model is None:
            self.num_reroutes += 1
        writer.admission.append((r, now, _Route(f"{why} ({dest._route.reason})", dest.instance_id),
                                 r.num_admission_decisions, dest.instance_id))
        dest.num_outstanding += 1
        dest.num_outstanding_tokens += r.num_prompt_tokens
        dest.num_routed += 1
        if r.cancel_after_ns is not None:
            heapq.heappush(dest._cancels, r.arrival_ns + r.cancel_after_ns)
        if model is not None:  # its model is resident there: it enters the engine now
            self.residency.submit(dest, r, target, rerouted=True)
            return
        engine = dest.engine
        engine.interrupt_run()
        engine.submit(r, target, rerouted=True)

    def _finished(self, inst: ClusterInstance, r: Request) -> None:
        if self.autoscaling is not None:
            self.autoscaling.finished(r)
        self.stats.num_finished += 1
        self._left(inst, r)

    def _left(self, inst: ClusterInstance, r: Request) -> None:
        """``r`` no longer counts on ``inst`` (it finished there or moved away)."""
        inst.num_outstanding -= 1
        inst.num_outstanding_tokens -= r.num_prompt_tokens
        if self.residency is not None:
            self.residency.finished(inst, r)
        if inst.state == "draining" and self._idle(inst):
            # after the step that finished it has been written
            self.kernel.schedule(self.kernel.now_ns, CONTROL, lambda: self._drained(inst))

    def _idle(self, inst: ClusterInstance) -> bool:
        """Nothing left on ``inst``: no request in its engine, none waiting there for weights."""
        return inst.engine.num_active == 0 and (self.residency is None or self.residency.num_deferred(inst) == 0)

    def _drained(self, inst: ClusterInstance) -> None:
        if inst.state == "draining" and self._idle(inst):
            self._state(inst, "stopped", "scale_down")

    @property
    def num_active(self) -> int:
        return sum(x.engine.num_active for x in self.instances) + len(self._in_transit)

    # ------------------------------------------------------------------ moves between instances

    def _handoff(self, src: ClusterInstance, r: Request, target: int) -> None:
        """A prefill instance produced ``r``'s first token and released it (its KV with it): at this
        instant, after every step that ends now, it is routed to a decode instance."""
        self._left(src, r)
        if not self._moves:
            self.kernel.schedule(self.kernel.now_ns, ARRIVAL, self._route_moves)
        self._moves.append((r, target, src))

    def _route_moves(self) -> None:
        """Route the requests released at this instant (in arrival order, whatever order their steps
        ended in) to decode instances, and start their KV transfers."""
        moves, self._moves = self._moves, []
        moves.sort(key=lambda m: m[0].index)
        for r, target, src in moves:
            self._move(r, target, src, self.decode_router, self.decode_routable, "hand-off to decode")

    def _move(self, r: Request, target: int, src: ClusterInstance, router: Router, routable: list[ClusterInstance],
              why: str) -> None:
        """Route ``r`` (released by ``src``) to one of ``routable`` and send it there (its KV over ``src``'s
        link first, if it carries any); the route event's reason says ``why``, then the router."""
        now = self.kernel.now_ns
        if not routable:
            self._end_moved(r, src, "error", "no instance to move to (all failed, stopped or draining)", counted=False)
            return
        dest = routable[router.route(r.view, routable).index]
        r.num_admission_decisions += 1
        self.writer.admission.append((r, now, _Route(f"{why} ({dest._route.reason})", dest.instance_id),
                                      r.num_admission_decisions, dest.instance_id))
        dest.num_outstanding += 1
        dest.num_outstanding_tokens += r.num_prompt_tokens
        dest.num_routed += 1
        if r.cancel_after_ns is not None and r.arrival_ns + r.cancel_after_ns > now:
            heapq.heappush(dest._cancels, r.arrival_ns + r.cancel_after_ns)
        at = now
        if r.moved_tokens:  # its KV crosses src's link, after what is queued there, then the latency
            kv_bytes = r.moved_tokens * src.config.model.kv_bytes_per_token
            start = max(now, src.link_free_ns)
            src.link_free_ns = start + -(-kv_bytes * 1_000_000_000 // int(self._bandwidth))
            at = src.link_free_ns + self._latency_ns
            src.num_transfers_out += 1
            src.kv_bytes_out += kv_bytes
            self.num_transfers += 1
            self.kv_transfer_bytes += kv_bytes
        self._in_transit[r] = dest
        self.kernel.schedule(at, ARRIVAL, lambda: self._arrive_moved(r, target, dest))

    def _arrive_moved(self, r: Request, target: int, dest: ClusterInstance) -> None:
        if r.state == FINISHED:
            return  # cancelled on the way
        del self._in_transit[r]
        if dest.state == "stopped":  # it failed while the request was on its way: on, recomputing
            lost = r.num_computed if r.moved_tokens else 0
            r.num_computed = r.moved_tokens = 0
            r.num_preemptions += 1
            self.writer.preempted.append((r, self.kernel.now_ns, "recompute", r.num_preemptions, lost, dest.instance_id))
            self._left(dest, r)
            self._move(r, target, dest, *self._pool(dest), "destination failed")
            return
        engine = dest.engine
        engine.interrupt_run()
        engine.receive(r, target)

    def _pool(self, inst: ClusterInstance) -> tuple[Router, list[ClusterInstance]]:
        """The router and the instances taking traffic now of ``inst``'s pool, less ``inst``."""
        if inst.role == "decode":
            return self.decode_router, [x for x in self.decode_routable if x is not inst]
        return self.router, [x for x in self.routable if x is not inst]

    def _migrate(self, step: MigrationStep) -> None:
        """A migration step: move one request of the instance (if it is up and holds one) to another of its pool."""
        if step.instance >= len(self.instances):
            return
        src = self.instances[step.instance]
        if src.state not in ("ready", "draining"):
            return
        engine = src.engine
        engine.interrupt_run()  # its queues as the reference mode has them now
        candidates = sorted(engine.running, key=_INDEX) or sorted([*engine.waiting, *engine.held], key=_INDEX)
        router, routable = self._pool(src)
        if not candidates or not routable:
            return
        r = candidates[step.request_rank % len(candidates)]
        self.num_migrations += 1
        target = engine.release(r, step.keep_kv)
        self._left(src, r)
        self._move(r, target, src, router, routable, "migration")

    def _fail_index(self, index: int) -> None:
        if index < len(self.instances):
            self._fail(self.instances[index])

    def _fail_random(self, u: float) -> None:
        live = [x for x in self.instances if x.state in ("ready", "draining")]
        if live:
            self._fail(live[int(u * len(live))])

    def _fail(self, inst: ClusterInstance) -> None:
        """``inst`` fails now: it stops (``instance_state`` stopped, no scale action) and each request it held
        is recomputed on another instance of its pool (routed as a move), or ends ``error`` if none is up."""
        if inst.state not in ("ready", "draining"):
            return
        self.num_failures += 1
        for pool in (self.routable, self.decode_routable):
            if inst in pool:
                pool.remove(inst)
        moved = inst.engine.fail()
        self._state(inst, "stopped", None)
        router, routable = self._pool(inst)
        for r, target in moved:
            self._left(inst, r)
            self._move(r, target, inst, router, routable, "instance failed")

    def _cancel_moved(self, r: Request) -> None:
        """A cancellation comes due for a request that moved since it was scheduled."""
        if r.owner is not None:
            r.owner.cancel(r)
            return
        now = self.kernel.now_ns
        dest = self._in_transit.pop(r, None)
        if dest is None:  # released at this instant, not yet routed (a hand-off): it ends where it was
            k = next((k for k, move in enumerate(self._moves) if move[0] is r), None)
            if k is None:
                raise ReplayError(f"request {r.request_id} is held by no engine and on no move (a cluster bug)")
            src = self._moves.pop(k)[2]
            self.writer.cancelled.append((r, now, src.instance_id))
            self._end_moved(r, src, "cancelled", None, counted=False)
            return
        self.writer.cancelled.append((r, now, dest.instance_id))  # on its way: it ends where it was going
        self._end_moved(r, dest, "cancelled", None, counted=True)

    def _end_moved(self, r: Request, inst: ClusterInstance, outcome: str, error: str | None, *, counted: bool) -> None:
        """``r`` ends while no engine holds it; ``inst`` reports it (and counts it as outstanding: ``counted``)."""
        r.state = FINISHED
        r.view = None
        self.writer.finished.append((r, self.kernel.now_ns, outcome, r.num_output * r.num_branches, error, inst.instance_id))
        self.stats.num_finished += 1
        if counted:
            self._left(inst, r)


# ---------------------------------------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class InstanceSummary:
    """What one instance of a cluster replay did."""

    instance_id: str
    model: str
    accelerator: str
    role: str  # serve (aggregated), prefill or decode
    num_routed: int
    num_steps: int
    num_preemptions: int
    ready_s: float | None  # seconds after the first arrival when it took traffic (None: never)
    startup_ns: int
    weight_load_ns: int
    cache_warm_ns: int
    num_kv_transfers_out: int  # KV transfers that left it (disaggregated hand-offs, migrations)
    kv_bytes_out: int
    num_stale_steps_refused: int  # step results refused for requests that had moved away (stale leases)
    num_weight_loads: int = 0  # residency (replay.residency): loads completed
    num_weight_evictions: int = 0
    weight_swap_ns: int = 0  # time spent evicting and loading
    weight_drain_ns: int = 0  # time loads waited for their victims' requests to finish
    num_deferred: int = 0  # requests that waited for a load


@dataclass(frozen=True, slots=True)
class ClusterSummary:
    """What a finished cluster replay did and where its outputs are."""

    run_id: str
    engine_id: str
    mode: str
    router: str
    num_requests: int
    num_shed: int
    num_events: int
    num_steps: int
    num_preemptions: int
    simulated_s: float
    wall_s: float
    requests_per_wall_s: float
    output_sha256: str
    workload_sha256: str
    events_path: Path | None
    manifest_path: Path | None
    instances: tuple[InstanceSummary, ...]
    num_kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    num_migrations: int = 0
    num_failures: int = 0
    num_reroutes: int = 0  # requests sent on because an instance's admission answered 'route' (max_reroutes)
    num_downgrades: int = 0  # requests an instance's admission answered 'downgrade' for (served as a smaller model)
    num_prefix_hit_tokens: int = 0  # prompt tokens found in the instances' prefix caches when first scheduled
    requests_path: Path | None = None  # the run's own request table (replay.request_table)
    busy_s: tuple[tuple[str, float], ...] = ()  # (instance, seconds its step events span in total)


def _calibrated(cluster: ClusterConfig, calibration: Calibration) -> ClusterConfig:
    """Every instance configuration of ``cluster`` with ``calibration``'s frontend and engine defaults."""

    def on(instance: InstanceConfig) -> InstanceConfig:
        return apply_calibration(instance, calibration)[0]

    return dataclasses.replace(
        cluster,
        instances=tuple(on(i) for i in cluster.instances),
        decode_instances=tuple(on(i) for i in cluster.decode_instances),
        scaling=tuple(dataclasses.replace(s, instance=on(s.instance)) if s.instance is not None else s
                      for s in cluster.scaling),
    )


def run_cluster_replay(
    workload: pa.Table | Workload,
    cluster: ClusterConfig,
    *,
    scenario: Scenario | None = None,
    policy_name: str = "fcfs",
    policy_config: object | None = None,
    cost_model: str | StepCostModel = "roofline",
    cost_model_config: object | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    sink: TableSink | None = None,
    mode: Mode = "fast",
    progress: Callable[[ReplayProgress], None] | None = None,
    shared: Path | None = None,
    chunk_rows: int = 200_000,
    check_invariants: bool = False,
    progress_every: int = PROGRESS_EVERY,
    calibration: Calibration | None = None,
    write_requests: bool = True,
    offload_outputs: bool | None = None,
) -> ClusterSummary:
    """Replay ``workload`` through a cluster; write events and a manifest (as ``run_replay`` does).

    Every instance runs ``policy_name`` (its own policy object); ``cost_model`` is a name, built
    once per distinct instance configuration, or one model used by every instance (then they must
    be alike). ``calibration`` applies to every instance configuration, as in ``run_replay``.
    """
    if mode not in MODES:
        raise ReplayError(f"unknown replay mode {mode!r}", "valid modes: fast, reference")
    cluster, cost_model_config = _prepared(cluster, calibration, cost_model, cost_model_config)
    source = as_workload(workload)
    scenario = scenario or Scenario()
    configs = _instance_configs(cluster)
    models = _cost_models(cost_model, configs, cost_model_config, shared)
    first = cluster.instances[0]
    policy_cfg = make_policy(policy_name, policy_config).config
    router = _router(cluster, scenario)
    manifest = _manifest(source, scenario, policy_name, policy_cfg, first, models[first], seed, mode)
    if calibration is not None:
        manifest["calibration"] = calibration_record(calibration, first)
    manifest["cluster"] = _cluster_record(cluster, router, models, configs)
    run_id = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:12]
    engine_id = f"replay-{run_id}"
    outputs = _Outputs(out_dir, sink, write_requests=write_requests, offload=offload(source, offload_outputs))
    writer = outputs.writer(_ClusterWriter, run_id=run_id, engine_id=engine_id, chunk_rows=chunk_rows)
    kernel = Kernel()

    def make_engine(config: InstanceConfig, instance_id: str) -> Engine:
        return Engine(kernel, config, models[config], make_policy(policy_name, policy_config), writer,
                      instance_id=instance_id, mode=mode, check_invariants=check_invariants)

    cl = Cluster(kernel, cluster, writer, engine_id=engine_id, make_engine=make_engine)
    feeder = _Feeder(kernel, cl, source, scenario, seed, first, progress, progress_every)
    output_sha256, wall_s, wall0 = outputs.drive(kernel, feeder, cl, writer)
    if progress is not None:
        progress(feeder.report(wall0))
    manifest_path = _write_cluster_manifest(outputs, manifest, (run_id, engine_id), cl, output_sha256, writer.num_events, calibration)
    return _cluster_summary(cluster, cl, kernel, feeder, outputs, manifest, manifest_path, mode=mode,
                            output_sha256=output_sha256, wall_s=wall_s, num_events=writer.num_events)


def _router(cluster: ClusterConfig, scenario: Scenario) -> Router:
    """The cluster's router, its shedding naming only classes the scenario defines."""
    check_sheddable_classes(cluster.router_config, [c.name for c in scenario.service_classes])
    return make_router(cluster.router, cluster.router_config)


def _prepared(cluster: ClusterConfig, calibration: Calibration | None, cost_model: str | StepCostModel,
              cost_model_config: object | None) -> tuple[ClusterConfig, object | None]:
    """``cluster`` calibrated (and its KV pools sized by its residency), and the cost model's config
    (a calibration's roofline for the default roofline model without a config of its own)."""
    if calibration is not None:
        cluster = _calibrated(cluster, calibration)
        if cost_model == "roofline" and cost_model_config is None:
            cost_model_config = calibration.roofline
    if cluster.residency is not None:
        cluster = _sized(cluster)
    return cluster, cost_model_config


def _instance_configs(cluster: ClusterConfig) -> list[InstanceConfig]:
    """The distinct instance configurations of ``cluster`` (its instances, decode pool, scaling steps), in order."""
    return list(dict.fromkeys(list(cluster.instances) + list(cluster.decode_instances)
                              + [s.instance for s in cluster.scaling if s.instance is not None]))


def _cost_models(cost_model: str | StepCostModel, configs: list[InstanceConfig], config: object | None,
                 shared: Path | None) -> dict[InstanceConfig, StepCostModel]:
    """One cost model per instance configuration: built by name for each, or the one object given for all."""
    if not isinstance(cost_model, str) and len(configs) > 1:
        raise ReplayError("one cost model object was given for instances that differ", "pass the cost model's name")
    return {
        c: make_cost_model(cost_model, c, config=config, shared=shared) if isinstance(cost_model, str) else cost_model
        for c in configs
    }


def _cluster_record(cluster: ClusterConfig, router: Router, models: dict[InstanceConfig, StepCostModel],
                    configs: list[InstanceConfig]) -> dict:
    """The manifest's ``cluster`` entry; the optional parts only when used, so that a run without them keeps
    its manifest and run id."""
    record: dict = {
        "instances": [_plain(c) for c in cluster.instances],
        "router": {"name": cluster.router, "config": _plain(router.config)},
        "scaling": [_plain(s) for s in cluster.scaling],
        "delays": _plain(cluster.delays),
        "cost_models": [models[c].info().name for c in configs],
    }
    if cluster.decode_instances:  # only then: an aggregated cluster's manifest (and run id) stays as it was
        record["disaggregation"] = {
            "decode_instances": [_plain(c) for c in cluster.decode_instances],
            "decode_router": {"name": cluster.decode_router,
                              "config": _plain(make_router(cluster.decode_router, cluster.decode_router_config).config)},
            "kv_transfer_bandwidth_bytes_per_s": cluster.kv_transfer_bandwidth_bytes_per_s,
            "kv_transfer_latency_s": cluster.kv_transfer_latency_s,
        }
    if cluster.migrations or cluster.failures or cluster.failure_rate_per_s:  # likewise
        record["faults"] = _faults_record(cluster)
    if cluster.max_reroutes:  # likewise
        record["max_reroutes"] = cluster.max_reroutes
    if cluster.autoscaler is not None:  # absent otherwise: a run without one keeps its manifest and run id
        from replay.policies.autoscale import autoscaler_class

        cfg = cluster.autoscaler_config or autoscaler_class(cluster.autoscaler).config_type()
        record["autoscaler"] = {"name": cluster.autoscaler, "config": _plain(cfg),
                                "interval_s": cluster.autoscale_interval_s,
                                "window_s": cluster.autoscale_window_s}
    if cluster.residency is not None:
        record["residency"] = _plain(cluster.residency)
    return record


def _faults_record(cluster: ClusterConfig) -> dict:
    """The manifest's record of ``cluster``'s migrations and failures."""
    return {
        "migrations": [_plain(m) for m in cluster.migrations],
        "failures": [_plain(f) for f in cluster.failures],
        "failure_rate_per_s": cluster.failure_rate_per_s,
        "failure_window_s": cluster.failure_window_s,
        "failure_seed": cluster.failure_seed,
        "kv_transfer_bandwidth_bytes_per_s": cluster.kv_transfer_bandwidth_bytes_per_s,
        "kv_transfer_latency_s": cluster.kv_transfer_latency_s,
    }


def _busy_s(cl: Cluster) -> dict[str, float]:
    """Seconds each instance that stepped spent in steps, by instance id."""
    return {x.instance_id: x.engine.stats.busy_ns / 1e9 for x in cl.instances if x.engine.stats.num_step_events}


def _write_cluster_manifest(outputs: _Outputs, manifest: dict, ids: tuple[str, str], cl: Cluster,
                            output_sha256: str, num_events: int, calibration: Calibration | None) -> Path | None:
    """Complete ``manifest`` with the run's ids (run, engine) and outcomes, and write it."""
    manifest["run_id"], manifest["engine_id"] = ids
    manifest["instance_ids"] = [x.instance_id for x in cl.instances]
    if cl.autoscaling is not None:  # every consultation and why (after the run id: it is an outcome)
        manifest["cluster"]["autoscaler"]["decisions"] = [_plain(d) for d in cl.autoscaling.records]
    caps = {x.instance_id: x.config.engine.max_num_seqs for x in cl.instances}
    return outputs.write_manifest(manifest, output_sha256, num_events, default=str, busy_s=_busy_s(cl), max_num_seqs=caps,
                                  calibration=calibration)


def _instance_summaries(cl: Cluster, start_ns: int) -> tuple[InstanceSummary, ...]:
    """What each instance of ``cl`` did (``start_ns``: the first arrival)."""
    return tuple(
        InstanceSummary(
            instance_id=x.instance_id, model=x.config.model.name, accelerator=x.config.accelerator.name, role=x.role,
            num_routed=x.num_routed, num_steps=x.engine.stats.num_steps, num_preemptions=x.engine.stats.num_preemptions,
            ready_s=None if x.ready_ns is None else (x.ready_ns - start_ns) / 1e9,
            startup_ns=x.phases_ns[0], weight_load_ns=x.phases_ns[1], cache_warm_ns=x.phases_ns[2],
            num_kv_transfers_out=x.num_transfers_out, kv_bytes_out=x.kv_bytes_out,
            num_stale_steps_refused=x.engine.stats.num_stale_refused,
            **(_residency_counts(cl.residency.state[x.index]) if cl.residency is not None else {}),
        )
        for x in cl.instances
    )


def _cluster_summary(cluster: ClusterConfig, cl: Cluster, kernel: Kernel, feeder: _Feeder, outputs: _Outputs,
                     manifest: dict, manifest_path: Path | None, *, mode: str, output_sha256: str, wall_s: float,
                     num_events: int) -> ClusterSummary:
    """The summary of a finished cluster replay."""
    start_ns = feeder.first_arrival_ns if feeder.first_arrival_ns is not None else 0
    instances = _instance_summaries(cl, start_ns)
    return ClusterSummary(
        run_id=manifest["run_id"],
        engine_id=manifest["engine_id"],
        mode=mode,
        router=cluster.router,
        num_requests=feeder.num_arrived,
        num_shed=cl.num_shed,
        num_events=num_events,
        num_steps=sum(x.num_steps for x in instances),
        num_preemptions=sum(x.num_preemptions for x in instances),
        simulated_s=(kernel.now_ns - start_ns) / 1e9 if feeder.first_arrival_ns is not None else 0.0,
        wall_s=wall_s,
        requests_per_wall_s=feeder.num_arrived / wall_s if wall_s > 0 else float("inf"),
        output_sha256=output_sha256,
        workload_sha256=manifest["workload"]["sha256"],
        events_path=outputs.events_path,
        manifest_path=manifest_path,
        instances=instances,
        num_kv_transfers=cl.num_transfers,
        kv_transfer_bytes=cl.kv_transfer_bytes,
        num_migrations=cl.num_migrations,
        num_failures=cl.num_failures,
        num_reroutes=cl.num_reroutes,
        num_downgrades=cl.num_downgrades,
        num_prefix_hit_tokens=sum(x.engine.stats.num_prefix_hit_tokens for x in cl.instances),
        requests_path=outputs.requests_path,
        busy_s=tuple(_busy_s(cl).items()),
    )


def _sized(cluster: ClusterConfig) -> ClusterConfig:
    """``cluster`` with every instance's KV pool sized by its residency's weight regions."""
    res = cluster.residency
    return dataclasses.replace(
        cluster,
        instances=tuple(sized_instance(c, res) for c in cluster.instances),
        scaling=tuple(dataclasses.replace(s, instance=sized_instance(s.instance, res)) if s.instance is not None else s
                      for s in cluster.scaling),
    )


def _residency_counts(st) -> dict[str, int]:
    return {"num_weight_loads": st.num_loads, "num_weight_evictions": st.num_evictions, "weight_swap_ns": st.load_ns,
            "weight_drain_ns": st.drain_ns, "num_deferred": st.num_deferred}
