"""Multi-model residency: which weights each instance of a cluster holds, and what loading them costs.

An instance's accelerator memory is cut in three (``sized_instance``): a **weight region** that holds
the resident base models (full or quantized variants) and the speculative draft model, an
**adapter region** of ``max_resident_adapters`` slots for LoRA adapters, and the activation reserve;
the KV pool is what is left. The regions are fixed for the whole replay (a static partition: the KV
pool never grows or shrinks as weights come and go), so a configuration that lets an instance hold
two models pays for it in KV blocks all the time.

A request names its model (``Request.model``, from the workload or the scenario; none: the
catalogue's first model) and perhaps an adapter. The policy (``ResidencyConfig.policy``):

``pinned``     each instance holds a fixed set of models (``initial``) and never loads another; the
               router is offered only the instances that hold the request's model (a request whose
               model no routable instance holds is rejected).
``on-demand``  every ready instance is offered, and the instance the router picks loads what the
               request needs and does not hold, evicting the least recently used weights that are
               not in use to make room.

Adapters load on demand under both policies (into their own slots, LRU). The weights an instance
holds and what it is loading are its state; the mechanism is here, the choice of what to evict is
the policy's (least recently used: a weight is used when a request needing it is submitted to the
engine).

**Load model.** Each instance has one weight-transfer queue, served in order (first come, first
loaded). A request that needs weights its instance lacks waits in the instance's deferred list (it
is not in the engine yet: its queue time and TTFT include the wait); it enters the engine when all it
needs is resident. Loading ``W`` (``WeightTransfer``):

- if ``W`` fits in the region's free bytes: ``load_latency_s + bytes(W) / bandwidth``;
- otherwise victims are picked, least recently used first, until it fits; the victims leave the
  resident set at once for new requests (a request for a victim arriving now waits, behind the
  load, for its reload), the load waits until the victims' in-flight requests have finished
  (*drain*), then each victim costs ``evict_latency_s`` (plus ``bytes / offload_bandwidth`` when
  evicted weights are kept in host memory) before the load starts.

So a swap costs ``drain + sum(evict) + load``, a step function of the resident set, not a linear
function of bytes: a load into free space costs only its transfer, one that evicts first waits for
the victim's requests and pays the eviction too. With ``offload_bandwidth_bytes_per_s`` set,
evicted weights go to host memory (unbounded) and a later load of them comes from there at that
bandwidth instead of storage.

**Events.** Every residency change is an ``instance_state`` event in the instance's current lifecycle
state (``ready`` or ``draining``; ``scale_action`` null) with the full new ``resident_models`` and
``resident_adapters``: one when victims are evicted (without them), one when a load completes (with
the loaded weights). Their event ids end ``:state:<state>:evict:<n>`` and ``:state:<state>:load:<n>``
(``n`` counts the instance's residency changes), so they stay distinct from the lifecycle's. The
instance's ``ready`` and ``stopped`` events list what it holds then.

**Step costs.** Requests of all resident models share the instance's batch and KV pool, and a step
costs what the cost model gives for the instance's model (``InstanceConfig.model``): exact for
adapters and for models of one shape, an approximation otherwise (the benchmark pairs Llama-3-8B
with Mistral-7B, which have the same layers, heads and KV bytes per token). LoRA compute is not
charged. ``max_adapters_per_batch`` caps the distinct adapters in one batch (vLLM's ``max_loras``):
a waiting request whose adapter would exceed it is skipped by the scheduling pass, later ones may
still join.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from replay.config import GIB, InstanceConfig, model
from replay.errors import ReplayError, unknown_name
from replay.kernel import CONTROL, Kernel
from schemas.types import doc

if TYPE_CHECKING:
    from replay.emit import EventWriter
    from replay.engine import Engine
    from replay.request import Request


class ClusterInstance(Protocol):
    """What residency reads of a cluster's instance (``replay.cluster.ClusterInstance``)."""

    index: int
    instance_id: str
    config: InstanceConfig
    engine: Engine
    state: str

WeightKind = Literal["model", "adapter", "draft"]
POLICIES: tuple[str, ...] = ("pinned", "on-demand")


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class Weights:
    """Weights a request or an instance may need: a base model (or a quantized variant), an adapter, a draft model."""

    name: str = doc("Name requests use (Request.model or Request.adapter).")
    weight_bytes: int = doc("Bytes the weights occupy in device memory (all tensor-parallel shards together).")
    kind: WeightKind = doc("model, adapter or draft.", "model")

    def __post_init__(self) -> None:
        if self.weight_bytes <= 0 or self.kind not in ("model", "adapter", "draft"):
            raise ReplayError(f"weights {self.name!r}: weight_bytes must be positive and kind model, adapter or draft")


def model_weights(name: str, *, bytes_per_param: int | None = None, variant: str | None = None,
                  kind: WeightKind = "model") -> Weights:
    """A catalogue model's weights (``replay.config.MODELS``); ``bytes_per_param`` makes a quantized
    variant (named ``variant``, default ``<name>-<bits>bit``): ``model_weights("llama-3-8b", bytes_per_param=1)``."""
    m = model(name)
    if bytes_per_param is None:
        return Weights(name=variant or name, weight_bytes=m.weight_bytes, kind=kind)
    return Weights(name=variant or f"{name}-{8 * bytes_per_param}bit", weight_bytes=m.num_params * bytes_per_param, kind=kind)


def lora_weights(name: str, base: str, rank: int, bytes_per_param: int = 2) -> Weights:
    """A LoRA adapter of catalogue model ``base`` on the Q, K, V and O projections of every layer:
    ``rank x (inputs + outputs)`` per projection."""
    if rank <= 0:
        raise ReplayError(f"adapter {name!r}: rank must be positive")
    m = model(base)
    q, kv = m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim
    h = m.hidden_size
    per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h))
    return Weights(name=name, weight_bytes=m.num_layers * per_layer * bytes_per_param, kind="adapter")


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightTransfer:
    """What moving weights costs (see the module's load model)."""

    load_bandwidth_bytes_per_s: float = doc("Storage to device bandwidth of a load, bytes/s (ScalingDelays' default).", 2e9)
    load_latency_s: float = doc("Fixed cost of each load (allocation, kernel warm-up for the new weights), seconds.", 1.0)
    evict_latency_s: float = doc("Fixed cost of each eviction (freeing, synchronising the device), seconds.", 0.25)
    offload_bandwidth_bytes_per_s: float | None = doc(
        "Evicted weights are copied to host memory at this bandwidth, and later loads of them come from there "
        "at it too, bytes/s (None: evicted weights are dropped and reload from storage).", None
    )

    def __post_init__(self) -> None:
        if not self.load_bandwidth_bytes_per_s > 0 or self.load_latency_s < 0 or self.evict_latency_s < 0:
            raise ReplayError("weight transfer: the bandwidth must be positive and the latencies non-negative")
        if self.offload_bandwidth_bytes_per_s is not None and not self.offload_bandwidth_bytes_per_s > 0:
            raise ReplayError("weight transfer: offload_bandwidth_bytes_per_s must be positive")

    def load_ns(self, w: Weights, from_host: bool) -> int:
        """Loading ``w`` into free space, integer ns."""
        bw = self.offload_bandwidth_bytes_per_s if from_host and self.offload_bandwidth_bytes_per_s else self.load_bandwidth_bytes_per_s
        return round((self.load_latency_s + w.weight_bytes / bw) * 1e9)

    def evict_ns(self, w: Weights) -> int:
        """Evicting ``w`` (and copying it to host memory when evicted weights are kept there), integer ns."""
        copy_s = w.weight_bytes / self.offload_bandwidth_bytes_per_s if self.offload_bandwidth_bytes_per_s else 0.0
        return round((self.evict_latency_s + copy_s) * 1e9)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyConfig:
    """Which weights a cluster's instances hold, how much room they have, and how they change."""

    policy: str = doc("pinned (fixed model sets, routing by residency) or on-demand (load on demand, LRU eviction).",
                      "on-demand")
    catalogue: tuple[Weights, ...] = doc("Every model and adapter requests may name (a request naming none: the first model).")
    initial: tuple[tuple[str, ...], ...] = doc(
        "Models each instance holds when it comes up, by instance index (cycled for more instances); "
        "pinned: all it ever holds. Empty: the catalogue's first model everywhere.", ()
    )
    model_capacity_bytes: int | None = doc(
        "Size of each instance's weight region for models, bytes (None: its largest initial set's bytes).", None
    )
    max_resident_adapters: int = doc("Adapter slots per instance (memory for this many of the largest adapter).", 0)
    max_adapters_per_batch: int | None = doc("Most distinct adapters in one batch (vLLM's max_loras; None: no cap).", None)
    transfer: WeightTransfer = field(default_factory=WeightTransfer, metadata={"doc": "Load and eviction costs."})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise unknown_name("residency policy", self.policy, list(POLICIES))
        names = [w.name for w in self.catalogue]
        if not self.models or len(set(names)) != len(names):
            raise ReplayError("the residency catalogue needs at least one model and distinct names")
        for models in self.initial:
            if not models:
                raise ReplayError("every instance's initial model set needs at least one model")
            for name in models:
                if self.weights(name).kind != "model":
                    raise ReplayError(f"{name!r} in an initial model set is not a model")
        capacity = self.capacity_bytes
        for models in self.initial_sets:
            if sum(self.weights(n).weight_bytes for n in models) > capacity:
                raise ReplayError(f"the initial set {models} does not fit in model_capacity_bytes {capacity:,}")
        if self.policy == "on-demand":
            for w in self.models:
                if w.weight_bytes > capacity:
                    raise ReplayError(f"model {w.name!r} ({w.weight_bytes:,} bytes) can never load: "
                                      f"model_capacity_bytes is {capacity:,}")
        if self.max_resident_adapters < 0 or (self.max_adapters_per_batch is not None and self.max_adapters_per_batch < 1):
            raise ReplayError("max_resident_adapters must be >= 0 and max_adapters_per_batch >= 1")
        if any(w.kind == "adapter" for w in self.catalogue) and self.max_resident_adapters < 1:
            raise ReplayError("the catalogue lists adapters but max_resident_adapters is 0")

    @property
    def models(self) -> tuple[Weights, ...]:
        return tuple(w for w in self.catalogue if w.kind == "model")

    @property
    def initial_sets(self) -> tuple[tuple[str, ...], ...]:
        return self.initial or ((self.models[0].name,),)

    def initial_set(self, index: int) -> tuple[str, ...]:
        sets = self.initial_sets
        return sets[index % len(sets)]

    def weights(self, name: str) -> Weights:
        for w in self.catalogue:
            if w.name == name:
                return w
        raise unknown_name("model or adapter", name, [w.name for w in self.catalogue])

    @property
    def capacity_bytes(self) -> int:
        """The model weight region's size, bytes."""
        if self.model_capacity_bytes is not None:
            return self.model_capacity_bytes
        return max(sum(self.weights(n).weight_bytes for n in models) for models in self.initial_sets)

    @property
    def adapter_region_bytes(self) -> int:
        sizes = [w.weight_bytes for w in self.catalogue if w.kind == "adapter"]
        return self.max_resident_adapters * max(sizes, default=0)


def sized_instance(instance: InstanceConfig, residency: ResidencyConfig) -> InstanceConfig:
    """``instance`` with its KV pool set to what memory leaves after the weight and adapter regions,
    the speculative draft model's weights (always resident) and the activation reserve
    (``num_kv_blocks_override``)."""
    if instance.engine.num_kv_blocks_override is not None:
        return instance  # the caller fixed the pool
    tp = instance.accelerator.tensor_parallel_size
    usable = int(instance.accelerator.memory_bytes * instance.engine.gpu_memory_utilization) * tp
    draft = instance.speculative.draft.weight_bytes if instance.speculative is not None else 0
    weights = residency.capacity_bytes + residency.adapter_region_bytes + draft
    free = usable - weights - instance.engine.activation_reserve_bytes * tp
    block_bytes = instance.kv_bytes_per_token * instance.engine.block_size_tokens
    if free < block_bytes:
        raise ReplayError(
            f"{weights / GIB:.1f} GiB of weight regions leave no KV cache on {tp} x {instance.accelerator.name} "
            f"({usable / GIB:.1f} GiB usable)", "lower model_capacity_bytes or max_resident_adapters")
    engine = dataclasses.replace(instance.engine, num_kv_blocks_override=free // block_bytes)
    return dataclasses.replace(instance, engine=engine)


# ---------------------------------------------------------------------------------------------- mechanism


class InstanceWeights:
    """One instance's residency: what it holds (LRU order), its transfer queue, its deferred requests."""

    __slots__ = ("models", "adapters", "in_use", "leaving", "queue", "loading", "deferred", "host",
                 "num_loads", "num_evictions", "load_ns", "drain_ns", "num_deferred", "num_changes", "pinned")

    def __init__(self, initial: tuple[str, ...], pinned: bool) -> None:
        self.models: dict[str, None] = dict.fromkeys(initial)  # resident, least recently used first
        self.adapters: dict[str, None] = {}
        self.in_use: dict[str, int] = {}  # weights name -> requests in the engine that need it
        self.leaving: set[str] = set()  # victims of the load at the queue's head (waiting to drain)
        self.queue: list[str] = []  # weights to load, in order
        self.loading = False  # a transfer is under way
        self.deferred: list[tuple[Request, int, tuple[str, ...]]] = []  # (request, output tokens, needs)
        self.host: set[str] = set()  # evicted weights kept in host memory
        self.pinned = pinned
        self.num_loads = 0
        self.num_evictions = 0
        self.load_ns = 0  # time spent evicting and loading
        self.drain_ns = 0  # time loads waited for victims' requests to finish
        self.num_deferred = 0  # requests that waited for a load
        self.num_changes = 0

    def resident(self, name: str) -> bool:
        return (name in self.models or name in self.adapters) and name not in self.leaving


class Residency:
    """The residency mechanism of a cluster (``replay.cluster.Cluster`` calls it; see the module docstring)."""

    def __init__(self, config: ResidencyConfig, kernel: Kernel, writer: EventWriter) -> None:
        self.config = config
        self.kernel = kernel
        self.writer = writer
        self.pinned = config.policy == "pinned"
        self.default_model = config.models[0].name
        self._kinds = {w.name: w.kind for w in config.catalogue}
        self.state: dict[int, InstanceWeights] = {}
        # requests an admission downgraded (replay.policies.deadline), while in the cluster: the model each is served
        # as (its events keep the model it named)
        self._served: dict[Request, str] = {}
        self._wait_since: dict[int, int] = {}

    # ------------------------------------------------------------------ instances

    def attach(self, inst: ClusterInstance) -> None:
        """A new instance holds its initial set; its engine reports it and caps adapters per batch."""
        st = InstanceWeights(self.config.initial_set(inst.index), self.pinned)
        self.state[inst.index] = st
        inst.engine.max_adapters_per_batch = self.config.max_adapters_per_batch
        inst.engine.resident = lambda: (list(st.models), list(st.adapters))

    def resident_lists(self, inst: ClusterInstance) -> tuple[list[str], list[str]]:
        st = self.state[inst.index]
        return list(st.models), list(st.adapters)

    def initial_bytes(self, inst: ClusterInstance) -> int:
        """What an added instance loads before it takes traffic: its initial models and the draft model."""
        draft = inst.config.speculative.draft.weight_bytes if inst.config.speculative is not None else 0
        return sum(self.config.weights(n).weight_bytes for n in self.config.initial_set(inst.index)) + draft

    def num_deferred(self, inst: ClusterInstance) -> int:
        return len(self.state[inst.index].deferred)

    # ------------------------------------------------------------------ requests

    def needs(self, r: Request) -> tuple[str, ...]:
        """The weights ``r`` needs resident: its model (or the default) and its adapter, if any."""
        name = self._served.get(r) or r.model or self.default_model
        kinds = self._kinds
        if kinds.get(name) != "model":
            self.config.weights(name)  # raises the error listing the valid names
            raise ReplayError(f"request {r.request_id} names {name!r} as its model, which is a {kinds[name]}")
        if r.adapter is None:
            return (name,)
        if kinds.get(r.adapter) != "adapter":
            self.config.weights(r.adapter)
            raise ReplayError(f"request {r.request_id} names {r.adapter!r} as its adapter, which is a {kinds[r.adapter]}")
        return name, r.adapter

    def candidates(self, r: Request, routable: list[ClusterInstance]) -> list[ClusterInstance]:
        """The instances the router is offered for ``r``: pinned, those holding its model; else all."""
        if not self.pinned:
            return routable
        name = r.model or self.default_model
        return [x for x in routable if name in self.state[x.index].models]

    def serving(self, model: str, instances: list[ClusterInstance]) -> list[ClusterInstance]:
        """Those of ``instances`` that hold ``model`` resident now (where a downgraded request may go: it
        never waits for a load)."""
        if self._kinds.get(model) != "model":
            return []
        return [x for x in instances if self.state[x.index].resident(model)]

    def serve_as(self, r: Request, model: str | None) -> None:
        """``r`` is served as ``model`` from now on, its weights are what it needs (a downgrade; None: as it named,
        when it ends without reaching an instance)."""
        if model is None:
            self._served.pop(r, None)
        else:
            self._served[r] = model

    def submit(self, inst: ClusterInstance, r: Request, num_output_tokens: int, *, rerouted: bool = False) -> None:
        """``r`` was routed to ``inst``: into its engine now if all it needs is resident, else after the loads
        (``rerouted``: another instance's admission sent it on; its model is resident here)."""
        st = self.state[inst.index]
        needs = self.needs(r)
        if all(st.resident(n) for n in needs):
            self._enter(inst, st, r, num_output_tokens, needs, rerouted)
            return
        if rerouted:
            raise ReplayError(f"request {r.request_id} was sent on to {inst.instance_id}, which does not hold {needs} "
                              "(a cluster bug: a downgrade goes only where its model is resident)")
        if self.pinned and not st.resident(needs[0]):
            raise ReplayError(f"request {r.request_id} was routed to {inst.instance_id}, which does not hold {needs[0]!r} "
                              "(a cluster bug: pinned routing offers only the instances that hold it)")
        st.num_deferred += 1
        st.deferred.append((r, num_output_tokens, needs))
        if r.cancel_after_ns is not None:
            self.kernel.schedule(r.arrival_ns + r.cancel_after_ns, CONTROL, lambda: self._cancel_deferred(inst, st, r))
        self._queue_missing(st, needs)
        self._advance(inst, st)

    def _cancel_deferred(self, inst: ClusterInstance, st: InstanceWeights, r: Request) -> None:
        """The client of a request still waiting for weights cancels: it reaches the engine and is cancelled there
        at once (its events: arrived, admission, cancelled, finished, all now)."""
        for k, entry in enumerate(st.deferred):
            if entry[0] is r:
                del st.deferred[k]
                self._enter(inst, st, r, entry[1], entry[2])
                inst.engine.cancel(r)
                return

    def _enter(self, inst: ClusterInstance, st: InstanceWeights, r: Request, n: int, needs: tuple[str, ...],
               rerouted: bool = False) -> None:
        for name in needs:
            st.in_use[name] = st.in_use.get(name, 0) + 1
            lru = st.models if name in st.models else st.adapters
            if name in lru:  # (not when a cancelled request enters without its weights: _cancel_deferred)
                del lru[name]
                lru[name] = None  # most recently used
        engine = inst.engine
        engine.interrupt_run()
        engine.submit(r, n, rerouted=rerouted)

    def finished(self, inst: ClusterInstance, r: Request) -> None:
        """``r`` left ``inst``'s engine: its weights may now be evicted."""
        st = self.state[inst.index]
        for name in self.needs(r):
            st.in_use[name] -= 1
        if self._served:
            self._served.pop(r, None)
        if st.leaving and not st.loading:
            self._advance(inst, st)

    # ------------------------------------------------------------------ loads

    def _queue_missing(self, st: InstanceWeights, needs: tuple[str, ...]) -> None:
        for name in needs:
            if not st.resident(name) and name not in st.queue:
                st.queue.append(name)

    def _advance(self, inst: ClusterInstance, st: InstanceWeights) -> None:
        """Start the load at the queue's head once its victims have drained."""
        if st.loading or not st.queue:
            return
        now = self.kernel.now_ns
        name = st.queue[0]
        w = self.config.weights(name)
        if not st.leaving:
            victims = self._victims(st, w)
            if victims is None:
                return  # cannot make room yet (pinned weights): retried when requests finish
            st.leaving.update(victims)
            self._wait_since[inst.index] = now
        if any(st.in_use.get(v, 0) for v in st.leaving):
            return  # drain: retried as the victims' requests finish
        st.drain_ns += now - self._wait_since.pop(inst.index, now)
        st.loading = True
        victims = [self.config.weights(v) for v in (list(st.models) + list(st.adapters)) if v in st.leaving]
        evict_ns = sum(self.config.transfer.evict_ns(v) for v in victims)
        load_ns = self.config.transfer.load_ns(w, name in st.host)
        st.load_ns += evict_ns + load_ns
        if victims:
            self.kernel.schedule(now + evict_ns, CONTROL, lambda: self._evicted(inst, st))
        self.kernel.schedule(now + evict_ns + load_ns, CONTROL, lambda: self._loaded(inst, st, w))

    def _victims(self, st: InstanceWeights, w: Weights) -> list[str] | None:
        """Least recently used weights of ``w``'s region to evict so that it fits (None: it cannot)."""
        if w.kind == "adapter":
            lru, room = st.adapters, self.config.max_resident_adapters
            used = len(lru)
            size = 1
            sizes = dict.fromkeys(lru, 1)
        else:
            lru, room = st.models, self.config.capacity_bytes
            sizes = {n: self.config.weights(n).weight_bytes for n in lru}
            used = sum(sizes.values())
            size = w.weight_bytes
        victims: list[str] = []
        if st.pinned and w.kind != "adapter":
            return None if used + size > room else victims
        for name in lru:  # least recently used first
            if used + size <= room:
                break
            victims.append(name)
            used -= sizes[name]
        return victims if used + size <= room else None

    def _evicted(self, inst: ClusterInstance, st: InstanceWeights) -> None:
        for name in st.leaving:
            st.models.pop(name, None)
            st.adapters.pop(name, None)
            st.num_evictions += 1
            if self.config.transfer.offload_bandwidth_bytes_per_s:
                st.host.add(name)
        st.leaving.clear()
        self._report(inst, st, "evict")

    def _loaded(self, inst: ClusterInstance, st: InstanceWeights, w: Weights) -> None:
        st.leaving.clear()  # (already, unless the load evicted nothing)
        (st.adapters if w.kind == "adapter" else st.models)[w.name] = None
        st.queue.remove(w.name)
        st.loading = False
        st.num_loads += 1
        self._report(inst, st, "load")
        ready, waiting = [], []
        for entry in st.deferred:
            (ready if all(st.resident(n) for n in entry[2]) else waiting).append(entry)
        st.deferred = waiting
        for r, n, needs in ready:  # in arrival order
            self._enter(inst, st, r, n, needs)
        for _, _, needs in waiting:  # a need evicted meanwhile is queued again
            self._queue_missing(st, needs)
        self._advance(inst, st)

    def _report(self, inst: ClusterInstance, st: InstanceWeights, what: str) -> None:
        st.num_changes += 1
        e = inst.engine
        self.writer.on_state(self.kernel.now_ns, inst.instance_id, inst.state, e.pool.num_total, e.block_size,
                             list(st.models), adapters=list(st.adapters), tag=f":{what}:{st.num_changes}")

