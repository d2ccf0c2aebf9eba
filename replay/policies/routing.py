"""The routing seam: which instance of a cluster takes an arriving request, or whether it is shed.

The cluster (``replay.cluster``) asks its router once per arriving request, before any instance's
admission, with the request's read-only view and one *load view* per instance that can take traffic
now (ready, not draining), in the order the instances were created. The router returns a
``RouteDecision``: the index of the chosen load in that sequence, or ``shed``. It never changes
the cluster; it may keep its own state (round-robin's position), which is deterministic.

A load view (``InstanceLoad``) is what a router may know of an instance:

========================  ==========================================================================
``instance_id``           the instance
``num_waiting``           requests queued there (waiting or held by admission), not yet running
``num_running``           requests in its running batch
``kv_utilization``        share of its KV blocks in use, 0..1
``num_outstanding``       requests routed to it and not finished
``num_outstanding_tokens``  prompt tokens of those requests (what a router knows of a request's size:
                          its output length is unknown until it ends)
``prefix_hit_blocks(r)``  blocks of request ``r``'s prompt cached there now
``kv_block_size_tokens``  tokens per KV block there
========================  ==========================================================================

The cluster passes live views (``replay.cluster``); tests pass ``LoadRecord``s built by hand.

Routers (``make_router`` by name; an unknown name lists the valid ones):

``round-robin``              the next instance in turn (the position advances once per routed request;
                             instances joining or leaving change the cycle's length, not its position).
``least-outstanding-tokens`` the fewest outstanding prompt tokens; ties: fewer outstanding requests, then
                             the first listed.
``least-load``               the fewest requests waiting and running; ties: lower KV utilization, then
                             the first listed, as a plain load balancer does.
``gie``                      the Gateway API Inference Extension's scheduler (llm-d's default profile):
                             a weighted sum of scorers in [0, 1]: queue (weight 2: ``(max q - q) / (max q
                             - min q)`` over the candidates, 1 when all are equal), KV cache (weight 2:
                             ``1 - utilization``) and prefix cache (weight 3: the share of the request's
                             prompt blocks cached there); the highest total wins (ties: the first listed).

Shedding (optional on every router, the extension's saturation detector): saturation is the mean over
instances of ``max(waiting / queue_threshold, kv_utilization / kv_threshold)`` (thresholds 5 and
0.8); at saturation >= ``shed_at``, requests of a class listed in ``sheddable_classes`` are
rejected with a retry-after instead of routed; other classes are always routed.

Settings are refused where the config is built, naming the setting: any NaN or infinity, a threshold or
``shed_at`` not positive, a ``kv_threshold`` above 1 (a share of the KV pool), a negative
``retry_after_s``, a negative ``gie`` weight or all three 0 (no scorer); ``check_sheddable_classes``
refuses a sheddable class the scenario does not define.

In the fast replay mode every field equals the reference mode's at the arrival (``replay.cluster``:
KV use without blocks allocated ahead inside a decode run, no eviction ahead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from replay.errors import ReplayError
from replay.policies.base import Registry, read_settings
from replay.policies.limits import check_magnitudes
from replay.views import RequestView
from schemas.types import doc
from servelens.settings import build


class InstanceLoad(Protocol):
    """What a router may know of one instance (see the module's table)."""

    @property
    def instance_id(self) -> str: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def kv_utilization(self) -> float: ...
    @property
    def num_outstanding(self) -> int: ...
    @property
    def num_outstanding_tokens(self) -> int: ...
    @property
    def kv_block_size_tokens(self) -> int: ...
    def prefix_hit_blocks(self, request: RequestView) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRecord:
    """An instance's load as fixed values (tests, what-ifs): an ``InstanceLoad`` built by hand."""

    instance_id: str = doc("Instance id.")
    num_waiting: int = doc("Requests queued (waiting or held by admission), not yet running.", 0)
    num_running: int = doc("Requests in the running batch.", 0)
    kv_utilization: float = doc("Share of the KV blocks in use, 0..1.", 0.0)
    num_outstanding: int = doc("Requests routed to the instance and not finished.", 0)
    num_outstanding_tokens: int = doc("Prompt tokens of the outstanding requests.", 0)
    num_prefix_hit_blocks: int = doc("Blocks of the routed request's prompt cached on the instance.", 0)
    kv_block_size_tokens: int = doc("Tokens per KV block.", 16)

    def __post_init__(self) -> None:
        if min(self.num_waiting, self.num_running, self.num_outstanding, self.num_outstanding_tokens) < 0 or not (
            0 <= self.kv_utilization <= 1
        ):
            raise ReplayError(f"instance {self.instance_id!r}: counts must be non-negative and KV utilization in [0, 1]")

    def prefix_hit_blocks(self, request: RequestView) -> int:
        return self.num_prefix_hit_blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class SheddingConfig:
    """When sheddable classes are shed (the Gateway API Inference Extension's saturation detector)."""

    sheddable_classes: tuple[str, ...] = doc("Service classes that may be shed when the pool saturates.", ())
    queue_threshold: float = doc("Waiting requests at which an instance counts as saturated by its queue.", 5.0)
    kv_threshold: float = doc("KV utilization at which an instance counts as saturated by its cache.", 0.8)
    shed_at: float = doc("Shed sheddable requests when the pool's saturation reaches this.", 1.0)
    retry_after_s: float = doc("Retry-after sent with a shed request, seconds.", 1.0)

    def __post_init__(self) -> None:
        if isinstance(self.sheddable_classes, str):
            raise ReplayError(f"shedding.sheddable_classes must be a list of class names, not the string "
                              f"{self.sheddable_classes!r}", f"write [{self.sheddable_classes}]")
        check_magnitudes("shedding", self)
        if not self.queue_threshold > 0:
            raise ReplayError(f"shedding.queue_threshold must be positive, not {self.queue_threshold:g}",
                              "the waiting requests at which an instance counts as saturated, e.g. 5 (the default)")
        if not 0 < self.kv_threshold <= 1:
            raise ReplayError(f"shedding.kv_threshold must be in (0, 1], not {self.kv_threshold:g}",
                              "it is a share of an instance's KV pool, e.g. 0.8 (the default)")
        if not self.shed_at > 0:
            raise ReplayError(f"shedding.shed_at must be positive, not {self.shed_at:g}",
                              "the pool's saturation at which sheddable requests are shed, e.g. 1 (the default)")
        if not self.retry_after_s >= 0:
            raise ReplayError(f"shedding.retry_after_s must be non-negative, not {self.retry_after_s:g}",
                              "seconds a shed client waits before it retries, e.g. 1 (the default)")


def check_sheddable_classes(config: object | None, defined: Sequence[str]) -> None:
    """Refuse a router config (None: the defaults) whose shedding names a class not in ``defined``, the
    scenario's classes (a workload recording another is refused by the scenario): no request of it would ever be
    shed. Nothing is checked when ``defined`` is empty (the requests then carry the workload's own classes)."""
    shedding = getattr(config, "shedding", None)
    if shedding is None or not defined:
        return
    unknown = [c for c in shedding.sheddable_classes if c not in defined]
    if unknown:
        raise ReplayError(f"shedding.sheddable_classes names {unknown[0]!r}, a class the scenario does not define "
                          "(no request of it would ever be shed)",
                          f"list only defined classes: {', '.join(defined)}")


def saturation(loads: Sequence[InstanceLoad], config: SheddingConfig) -> float:
    """Mean over instances of max(waiting / queue_threshold, kv_utilization / kv_threshold)."""
    if not loads:
        raise ReplayError("saturation of an empty pool", "route only when at least one instance is up")
    q, kv = config.queue_threshold, config.kv_threshold
    return sum(max(x.num_waiting / q, x.kv_utilization / kv) for x in loads) / len(loads)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes (``index`` into the loads the router was given), or that it is shed."""

    index: int | None = doc("Position of the chosen instance in the loads given (None when shed).")
    reason: str = doc("Why, in a few words (the admission_decided event's reason).", "")
    shed: bool = doc("The request is rejected (sheddable class, saturated pool).", False)
    retry_after_s: float | None = doc("Retry-after of a shed request, seconds.", None)


class Router:
    """Base: shed sheddable requests at saturation (when configured), else ``choose`` an instance."""

    name: ClassVar[str] = ""
    config_type: ClassVar[type] = object

    def __init__(self, config: object | None = None) -> None:
        self.config = config if config is not None else self.config_type()
        self._shedding: SheddingConfig | None = getattr(self.config, "shedding", None)
        self._decisions: list[RouteDecision] = []  # one per index, built once (reason is the router's name)

    def choose(self, request: RequestView, loads: Sequence[InstanceLoad]) -> int:
        """The index of the instance that takes ``request`` (``loads`` is never empty)."""
        raise NotImplementedError

    def route(self, request: RequestView, loads: Sequence[InstanceLoad]) -> RouteDecision:
        """Route one request given the load of every instance that can take it now."""
        shedding = self._shedding
        if shedding is not None and request.service_class in shedding.sheddable_classes:
            sat = saturation(loads, shedding)
            if sat >= shedding.shed_at:
                return RouteDecision(None, f"pool saturated ({sat:.2f}), class is sheddable", True,
                                     shedding.retry_after_s)
        i = self.choose(request, loads)
        if not 0 <= i < len(loads):
            raise ReplayError(f"router {self.name!r} chose instance {i}, not one of the {len(loads)} given")
        decisions = self._decisions
        while len(decisions) <= i:
            decisions.append(RouteDecision(len(decisions), self.name))
        return decisions[i]


ROUTERS = Registry("router")
register_router = ROUTERS.register


def make_router(name: str, config: object | None = None) -> Router:
    """A router by name, with its typed config (defaults when None)."""
    return ROUTERS.checked(name, config)(config)


def load_router_config(name: str, path: str | Path) -> object:
    """The named router's config from a YAML (or JSON) mapping of its fields, e.g. ``shedding:
    {sheddable_classes: [batch], queue_threshold: 5}``: types checked, unknown keys refused."""
    import dataclasses

    cls = ROUTERS.lookup(name).config_type
    data = read_settings("router", path, cls)
    shedding = data.pop("shedding", None)
    config = build(cls, data)
    if shedding is not None:  # an optional section (the builder takes required ones)
        if not isinstance(shedding, dict):
            raise ReplayError(f"router configuration {path}: shedding must be a mapping of SheddingConfig settings")
        classes = shedding.pop("sheddable_classes", [])
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ReplayError(f"router configuration {path}: shedding.sheddable_classes must be a list of class names")
        config = dataclasses.replace(
            config, shedding=dataclasses.replace(build(SheddingConfig, shedding, "shedding."), sheddable_classes=tuple(classes))
        )
    return config


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundRobinConfig:
    """Settings of the round-robin router."""

    shedding: SheddingConfig | None = doc("When sheddable classes are shed (None: never).", None)


@register_router
class RoundRobinRouter(Router):
    """Each instance in turn."""

    name = "round-robin"
    config_type = RoundRobinConfig

    def __init__(self, config: object | None = None) -> None:
        super().__init__(config)
        self._position = 0

    def choose(self, request: RequestView, loads: Sequence[InstanceLoad]) -> int:
        i = self._position % len(loads)
        self._position += 1
        return i


@dataclass(frozen=True, slots=True, kw_only=True)
class LeastOutstandingTokensConfig:
    """Settings of the least-outstanding-tokens router."""

    shedding: SheddingConfig | None = doc("When sheddable classes are shed (None: never).", None)


@register_router
class LeastOutstandingTokensRouter(Router):
    """Fewest outstanding prompt tokens; ties by fewer outstanding requests, then the first listed."""

    name = "least-outstanding-tokens"
    config_type = LeastOutstandingTokensConfig

    def choose(self, request: RequestView, loads: Sequence[InstanceLoad]) -> int:
        best = 0
        best_key = (loads[0].num_outstanding_tokens, loads[0].num_outstanding)
        for i in range(1, len(loads)):
            x = loads[i]
            key = (x.num_outstanding_tokens, x.num_outstanding)
            if key < best_key:
                best, best_key = i, key
        return best


@dataclass(frozen=True, slots=True, kw_only=True)
class LeastLoadConfig:
    """Settings of the least-load router."""

    shedding: SheddingConfig | None = doc("When sheddable classes are shed (None: never).", None)


@register_router
class LeastLoadRouter(Router):
    """Fewest requests waiting and running; ties by lower KV utilization, then the first listed."""

    name = "least-load"
    config_type = LeastLoadConfig

    def choose(self, request: RequestView, loads: Sequence[InstanceLoad]) -> int:
        counts = [x.num_waiting + x.num_running for x in loads]
        fewest = min(counts)
        tied = [i for i, c in enumerate(counts) if c == fewest]
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda i: (loads[i].kv_utilization, i))  # KV use read only to break ties


_GIE_WEIGHTS = ("queue_weight", "kv_weight", "prefix_weight")


@dataclass(frozen=True, slots=True, kw_only=True)
class GieConfig:
    """Scorer weights of the Gateway API Inference Extension's default scheduling profile."""

    queue_weight: float = doc("Weight of the queue scorer.", 2.0)
    kv_weight: float = doc("Weight of the KV-cache utilization scorer.", 2.0)
    prefix_weight: float = doc("Weight of the prefix-cache scorer.", 3.0)
    shedding: SheddingConfig | None = doc("When sheddable classes are shed (None: never).", None)

    def __post_init__(self) -> None:
        check_magnitudes("gie", self)
        for name in _GIE_WEIGHTS:
            if getattr(self, name) < 0:
                raise ReplayError(f"gie: scorer weights must be non-negative, not gie.{name} = {getattr(self, name):g}",
                                  "a scorer that should not count has weight 0")
        if not any(getattr(self, name) > 0 for name in _GIE_WEIGHTS):
            raise ReplayError("gie: the scorer weights gie.queue_weight, gie.kv_weight and gie.prefix_weight are all 0: "
                              "no scorer counts, so every request would go to the first instance",
                              "give at least one scorer a positive weight (the defaults: queue 2, kv 2, prefix 3)")


@register_router
class GieRouter(Router):
    """Weighted queue, KV-cache and prefix-cache scorers (2, 2, 3); the highest total wins."""

    name = "gie"
    config_type = GieConfig

    def scores(self, request: RequestView, loads: Sequence[InstanceLoad]) -> list[float]:
        """Each instance's total score for ``request`` (higher is better)."""
        c = self.config
        queues = [x.num_waiting for x in loads]
        lo, hi = min(queues), max(queues)
        out = []
        for x in loads:
            num_blocks = -(-request.num_prompt_tokens // x.kv_block_size_tokens)
            queue = 1.0 if hi == lo else (hi - x.num_waiting) / (hi - lo)
            kv = 1.0 - x.kv_utilization
            prefix = min(1.0, x.prefix_hit_blocks(request) / num_blocks) if num_blocks else 0.0
            out.append(c.queue_weight * queue + c.kv_weight * kv + c.prefix_weight * prefix)
        return out

    def choose(self, request: RequestView, loads: Sequence[InstanceLoad]) -> int:
        scores = self.scores(request, loads)
        return max(range(len(loads)), key=lambda i: (scores[i], -i))
