"""Step cost models: how long one engine step takes, given everything the step does.

A step's time depends on its whole composition (``StepShape``): its prefill chunks with the context
each one extends, and its decode sequences with their context lengths, because one forward pass
serves them all: a prefill chunk lengthens the step every decode stream in it experiences.

Every model returns integer nanoseconds, and answers two questions:

- ``step_time_ns(shape)``: one step (the reference mode asks this for every step);
- ``decode_run(num_decode_seqs, context_tokens, max_steps, horizon_ns)``: a run of decode-only steps
  over the same sequences, each step lengthening every context by one token. It returns how many
  steps run until the elapsed time reaches ``horizon_ns`` (at most ``max_steps``), their total time
  and the last step's time, and it must equal summing ``step_time_ns`` step by step, exactly.
  The fast mode relies on this; ``tests/replay/test_costmodel.py`` checks it against the loop.

Models (``replay.cost_models.make_cost_model`` by name; an unknown name lists the valid ones):

``constant``  every step takes the same time (closed-form queueing checks).
``roofline``  FLOPs and bytes of the step against the accelerator's peak and bandwidth, with
              efficiency factors: weights read once per step, KV read per decode sequence and per
              prefill chunk's context, attention FLOPs per (query, key) pair (quadratic in a chunk),
              LM head per sampled row, ring all-reduces for tensor parallelism.
``profile``   measured Vidur operator timings (``replay.profiles``): per-layer non-attention
              operators by token count, attention where a profile exists, all-reduce by message
              size, interpolated; where no measurement covers a shape, the roofline attention term
              fills in (see docs/replay.md). With a ``FittedProfileConfig``: the step-time table
              fitted to a profile of our own profiler (``replay.measured.fit``, docs/calibration.md).

Units: the roofline terms are kept as integer *ticks* of 1/1024 ns per unit of work (rounded once,
at most 0.0005 ns per token off), so a decode run's time is a sum of ceilings of affine functions of
the step index, which ``floor_sum`` adds in closed form (O(log) instead of O(steps)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from replay.config import InstanceConfig
from replay.errors import ReplayError
from schemas.types import doc

#: Ticks per nanosecond of the integer cost arithmetic.
TICKS_PER_NS = 1024


class StepShape(NamedTuple):
    """What one step computes: prefill chunks and decode sequences (a named tuple: built every step)."""

    #: (tokens in the chunk, tokens of context before it) for each prefill chunk
    prefill_chunks: tuple[tuple[int, int], ...]
    #: sequences decoding one token each (a request with n branches counts n)
    num_decode_seqs: int
    #: keys the decode sequences attend to, summed (each sequence's computed tokens + 1)
    decode_context_tokens: int
    #: speculating decode sequences, apart from the plain ones above (``replay.speculative``): for each
    #: group, (speculative tokens k each drafts and verifies, sequences, their summed context as above);
    #: only a speculative instance's engine builds them, and only ``SpeculativeCostModel`` prices them
    speculative_decodes: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for c, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        """Tokens through the target's linear layers (a speculating sequence verifies k + 1)."""
        return self.num_prefill_tokens + self.num_decode_seqs + sum((k + 1) * n for k, n, _ in self.speculative_decodes)


class DecodeRun(NamedTuple):
    """The outcome of advancing a run of identical-composition decode steps (a named tuple: built per run)."""

    num_steps: int
    duration_ns: int  # the run's steps' times, summed
    last_step_ns: int  # the last step's time


@dataclass(frozen=True, slots=True)
class CostModelInfo:
    """What a run manifest records about the cost model."""

    name: str
    description: str
    parameters: tuple[tuple[str, str], ...]  # (name, value as text), for the manifest


class StepCostModel(Protocol):
    """A step cost model (see the module docstring for the exactness contract)."""

    name: str

    def step_time_ns(self, shape: StepShape) -> int: ...

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int: ...

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun: ...

    def info(self) -> CostModelInfo: ...


# ------------------------------------------------------------------------------------------ arithmetic


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """Sum of floor((a*i + b) / m) for i in [0, n), with n >= 0, m >= 1, a >= 0, b >= 0.

    The Euclid-like reduction of the AtCoder Library (``floor_sum``): O(log m) iterations.
    """
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b, m, a = y_max // m, y_max % m, a, m


def _ceil_sum(lo: int, hi: int, a: int, b: int) -> int:
    """Sum of ceil((a + b*i) / TICKS_PER_NS) for i in [lo, hi)."""
    if hi <= lo:
        return 0
    return floor_sum(hi - lo, TICKS_PER_NS, b, a + b * lo + TICKS_PER_NS - 1)


class AffineDecode:
    """Decode step i of a run takes ``const_ns + ceil(max(a1 + b1*i, a2 + b2*i) / TICKS_PER_NS)``.

    Both lines have non-negative slopes, so step times never decrease along a run. (A plain slotted
    class: it is built once per run on the fast mode's hot path.)
    """

    __slots__ = ("const_ns", "a1", "b1", "a2", "b2")

    def __init__(self, const_ns: int, a1: int, b1: int, a2: int, b2: int) -> None:
        self.const_ns = const_ns
        self.a1 = a1
        self.b1 = b1
        self.a2 = a2
        self.b2 = b2

    def step_ns(self, i: int) -> int:
        x = max(self.a1 + self.b1 * i, self.a2 + self.b2 * i)
        return self.const_ns + -(-x // TICKS_PER_NS)

    def total_ns(self, k: int) -> int:
        """Sum of the first k steps, in closed form: split where the two lines cross."""
        a1, b1, a2, b2 = self.a1, self.b1, self.a2, self.b2
        da, db = a1 - a2, b1 - b2  # line 1 is the max where da + db*i >= 0
        if db == 0:
            split = k if da >= 0 else 0  # line 1 on [0, split), line 2 after
            first_is_1 = True
        elif db < 0:  # line 1 on [0, j], line 2 after
            split = min(k, da // -db + 1) if da >= 0 else 0
            first_is_1 = True
        else:  # line 2 on [0, j), line 1 after
            split = min(k, max(0, -(da // db)))  # ceil(-da / db)
            first_is_1 = False
        if first_is_1:
            varying = _ceil_sum(0, split, a1, b1) + _ceil_sum(split, k, a2, b2)
        else:
            varying = _ceil_sum(0, split, a2, b2) + _ceil_sum(split, k, a1, b1)
        return k * self.const_ns + varying


    def run(self, max_steps: int, horizon_ns: int | None) -> DecodeRun:
        """``search_run`` over this run, solved directly when one line dominates every step."""
        a1, b1, a2, b2 = self.a1, self.b1, self.a2, self.b2
        if a2 >= a1 and b2 >= b1:
            return single_line_run(self.const_ns, a2, b2, max_steps, horizon_ns)
        if a1 >= a2 and b1 >= b2:
            return single_line_run(self.const_ns, a1, b1, max_steps, horizon_ns)
        return search_run(self.step_ns, self.total_ns, max_steps, horizon_ns)


def single_line_run(c: int, a: int, b: int, max_steps: int, horizon_ns: int | None) -> DecodeRun:
    """The run whose step i takes ``c + ceil((a + b*i) / TICKS_PER_NS)`` ns (see ``search_run``).

    The total of k steps is about k*(c + a/m) + b*k^2/(2m): solve for k, then settle it on the exact
    total (``floor_sum``), one step at a time (the estimate is off by a step or two at most).
    """
    m = TICKS_PER_NS
    if horizon_ns is None or horizon_ns <= 0:
        k = max_steps if horizon_ns is None else 1
        return DecodeRun(k, k * c + floor_sum(k, m, b, a + m - 1), c + -(-(a + b * (k - 1)) // m))
    lin = c + a / m
    if b:
        quad = b / (2 * m)
        est = (-lin + (lin * lin + 4 * quad * horizon_ns) ** 0.5) / (2 * quad)
    else:
        est = horizon_ns / lin if lin else max_steps  # steps of 0 ns never reach the horizon
    k = min(max_steps, max(1, int(est)))
    total = k * c + floor_sum(k, m, b, a + m - 1)
    if total >= horizon_ns:
        while k > 1:
            prev = total - c + (a + b * (k - 1)) // -m  # total(k - 1)
            if prev < horizon_ns:
                break
            k -= 1
            total = prev
    else:
        while k < max_steps and total < horizon_ns:
            total += c + -(-(a + b * k) // m)
            k += 1
    return DecodeRun(k, total, c + -(-(a + b * (k - 1)) // m))


def search_run(
    step_ns: Callable[[int], int], total_ns: Callable[[int], int], max_steps: int, horizon_ns: int | None
) -> DecodeRun:
    """The run for non-decreasing step times: the fewest steps whose total reaches ``horizon_ns``.

    Brackets k between horizon/last-step and horizon/first-step, then bisects on the exact total.
    """
    if max_steps < 1:
        raise ValueError("a run has at least one step")
    if horizon_ns is None or horizon_ns <= 0:
        k = max_steps if horizon_ns is None else 1
        return DecodeRun(k, total_ns(k), step_ns(k - 1))
    first = step_ns(0)
    hi = min(max_steps, -(-horizon_ns // first)) if first else max_steps  # (0 ns steps: the last bound)
    total_hi = total_ns(hi)
    if total_hi < horizon_ns:  # only when hi == max_steps
        return DecodeRun(hi, total_hi, step_ns(hi - 1))
    lo = max(1, -(-horizon_ns // step_ns(hi - 1)))  # total(k) <= k * step(hi-1) < horizon below lo
    while lo < hi:  # invariant: total(hi) >= horizon, total(lo - 1) < horizon
        mid = (lo + hi) // 2
        total_mid = total_ns(mid)
        if total_mid >= horizon_ns:
            hi, total_hi = mid, total_mid
        else:
            lo = mid + 1
    return DecodeRun(hi, total_hi, step_ns(hi - 1))


class CostModelBase:
    """Shared behaviour: a decode run stepped one by one (exact for any model; slow for long runs)."""

    name: ClassVar[str] = ""

    def step_time_ns(self, shape: StepShape) -> int:
        raise NotImplementedError

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int:
        return self.step_time_ns(StepShape((), num_decode_seqs, context_tokens))

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun:
        elapsed = 0
        step = 0
        for i in range(max_steps):
            step = self.decode_step_ns(num_decode_seqs, context_tokens + num_decode_seqs * i)
            elapsed += step
            if horizon_ns is not None and elapsed >= horizon_ns:
                return DecodeRun(i + 1, elapsed, step)
        return DecodeRun(max_steps, elapsed, step)

    def info(self) -> CostModelInfo:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ constant


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstantCostConfig:
    """Every step takes the same time, whatever it computes."""

    step_time_ns: int = doc("Time of every step, ns.", 10_000_000)


class ConstantCostModel(CostModelBase):
    """Each step takes ``step_time_ns``: for closed-form checks (queueing formulas, hand timelines)."""

    name = "constant"

    def __init__(self, config: ConstantCostConfig) -> None:
        if config.step_time_ns < 1:
            raise ReplayError("the constant step time must be at least 1 ns")
        self.config = config
        self._t = config.step_time_ns

    def step_time_ns(self, shape: StepShape) -> int:
        return self._t

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int:
        return self._t

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun:
        t = self._t
        k = max_steps if horizon_ns is None else max(1, min(max_steps, -(-horizon_ns // t)))
        return DecodeRun(k, k * t, t)

    def info(self) -> CostModelInfo:
        return CostModelInfo(self.name, "every step takes the same time", (("step_time_ns", str(self._t)),))


# ------------------------------------------------------------------------------------------ roofline


#: The largest fixed cost a step, layer, sequence or all-reduce may add, ns: a second, far beyond any engine's (the
#: fitted ones are microseconds to milliseconds, docs/calibration.md); also what keeps a step's ticks an integer.
MAX_OVERHEAD_NS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class RooflineConfig:
    """Efficiency factors and fixed costs of the roofline model (a calibration fits them: replay.calibration)."""

    compute_efficiency: float = doc("Share of peak FLOP/s a step achieves (model FLOPs utilization).", 0.6)
    memory_efficiency: float = doc("Share of peak memory bandwidth a step achieves reading weights.", 0.8)
    kv_memory_efficiency: float | None = doc(
        "Share of peak memory bandwidth attention achieves reading and writing the KV cache (paged, scattered "
        "blocks); None: memory_efficiency.", None
    )
    moe_memory_efficiency: float | None = doc(
        "Share of peak memory bandwidth a mixture of experts' grouped kernels achieve reading the routed experts' "
        "weights; None: memory_efficiency.", None
    )
    interconnect_efficiency: float = doc("Share of interconnect bandwidth an all-reduce achieves.", 0.7)
    step_overhead_ns: int = doc("Fixed CPU time per step (scheduling, launch, sampling), ns.", 0)
    layer_overhead_ns: int = doc(
        "Fixed time per layer per step beyond its roofline (kernel launch floors, norms, rotary, activation), ns.", 0
    )
    seq_overhead_ns: int = doc(
        "Time per sequence in a step (input preparation, sampling, output processing), ns.", 0
    )
    penalty_overhead_ns: int = doc(
        "Time a step adds when its requests carry sampling penalties (InstanceConfig.sampling_penalties): vLLM's "
        "penalty pass pads every running request's output tokens on the host and counts them, and the prompt's, "
        "over the vocabulary, outside the CUDA graph, ns.", 0
    )
    allreduce_latency_ns: int | None = doc(
        "Latency of one all-reduce per peer device, ns: a one-shot all-reduce over tp devices waits on tp - 1 of "
        "them (a pipeline hop: one); None: the accelerator's interconnect latency, once per all-reduce.",
        None,
    )

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency", "interconnect_efficiency", "kv_memory_efficiency",
                     "moe_memory_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ReplayError(f"RooflineConfig.{name} must be in (0, 1] (a share of the hardware's peak), not {value}")
        for name in ("step_overhead_ns", "layer_overhead_ns", "seq_overhead_ns", "penalty_overhead_ns",
                     "allreduce_latency_ns"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_OVERHEAD_NS:
                raise ReplayError(f"RooflineConfig.{name} must be in [0, {MAX_OVERHEAD_NS:,}] ns, not {value}",
                                  None if value < 0 else "a fixed cost of a second or more per step is no engine's")


class UnitCosts:
    """Integer tick costs per unit of work, rounded once from the configuration.

    Linear layers: 2 FLOPs per active weight per token (a mixture of experts counts its top-k experts);
    weights are read once per step (a mixture of experts reads the experts its tokens touch, see
    ``weights``); tensor parallelism divides work and bytes over the devices, pipeline stages run one
    after another (same totals, plus a hop per stage boundary).
    """

    __slots__ = (
        "linear_token", "lm_head_row", "linear_decode", "attention_pair", "kv_token", "dense_weights", "expert_weights",
        "comm_fixed", "comm_token", "fixed_ns", "seq_ns", "_model", "_moe_layers", "_weights_cache",
    )

    def __init__(self, instance: InstanceConfig, config: RooflineConfig) -> None:
        acc, m = instance.accelerator, instance.model
        tp = acc.tensor_parallel_size
        flops_per_tick = acc.peak_flops(m.compute_dtype) * tp * config.compute_efficiency / (1e9 * TICKS_PER_NS)
        bf16_flops_per_tick = acc.peak_bf16_flops * tp * config.compute_efficiency / (1e9 * TICKS_PER_NS)
        bytes_per_tick = acc.memory_bandwidth_bytes_per_s * tp * config.memory_efficiency / (1e9 * TICKS_PER_NS)
        kv_efficiency = config.memory_efficiency if config.kv_memory_efficiency is None else config.kv_memory_efficiency
        kv_bytes_per_tick = acc.memory_bandwidth_bytes_per_s * tp * kv_efficiency / (1e9 * TICKS_PER_NS)
        self.linear_token = round(2 * m.active_linear_params / flops_per_tick)
        self.lm_head_row = round(2 * m.hidden_size * m.vocab_size / bf16_flops_per_tick)
        self.linear_decode = self.linear_token + self.lm_head_row  # a decode sequence: one token, one sampled row
        self.attention_pair = round(4 * m.num_attention_heads * m.head_dim * m.num_layers / bf16_flops_per_tick)
        self.kv_token = round(instance.kv_bytes_per_token / kv_bytes_per_tick)  # replicated heads read on each device
        self._model = m
        self._moe_layers = m.num_moe_layers_resolved
        moe_efficiency = config.memory_efficiency if config.moe_memory_efficiency is None else config.moe_memory_efficiency
        moe_bytes_per_tick = acc.memory_bandwidth_bytes_per_s * tp * moe_efficiency / (1e9 * TICKS_PER_NS)
        expert_bytes = m.expert_params * m.bytes_per_param / moe_bytes_per_tick
        routed = self._moe_layers * m.num_experts * m.expert_params
        dense_params = m.layers_params - routed + m.vocab_size * m.hidden_size  # layers + the LM head
        self.dense_weights = round(dense_params * m.bytes_per_param / bytes_per_tick)
        self.expert_weights = expert_bytes * self._moe_layers  # ticks per expert touched in every MoE layer
        self._weights_cache: dict[int, int] = {}
        per_peer = config.allreduce_latency_ns
        allreduce_ns = acc.interconnect_latency_ns if per_peer is None else per_peer * (tp - 1)
        link = acc.interconnect_bandwidth_bytes_per_s * config.interconnect_efficiency / (1e9 * TICKS_PER_NS)
        self.comm_token = self.comm_fixed = 0
        if tp > 1:  # two one-shot all-reduces per layer of (tokens x hidden) bf16 activations: each device
            per_token_bytes = (tp - 1) * m.hidden_size * 2  # reads every peer's whole buffer
            self.comm_token = round(2 * m.num_layers * per_token_bytes / link)
            self.comm_fixed = 2 * m.num_layers * allreduce_ns * TICKS_PER_NS
        hops = acc.pipeline_parallel_size - 1
        if hops:  # each stage boundary sends the step's activations once
            self.comm_token += round(hops * m.hidden_size * 2 / link)
            self.comm_fixed += hops * (acc.interconnect_latency_ns if per_peer is None else per_peer) * TICKS_PER_NS
        self.fixed_ns = config.step_overhead_ns + m.num_layers * config.layer_overhead_ns
        if instance.sampling_penalties:
            self.fixed_ns += config.penalty_overhead_ns
        self.seq_ns = config.seq_overhead_ns

    def weights(self, num_tokens: int) -> int:
        """Ticks to read the weights a step of ``num_tokens`` tokens touches: every dense weight, and of each
        mixture-of-experts layer the experts its tokens are routed to (expected distinct experts)."""
        if not self._moe_layers:
            return self.dense_weights
        cached = self._weights_cache.get(num_tokens)
        if cached is None:
            touched = self._model.expected_experts_touched(num_tokens)
            cached = self._weights_cache[num_tokens] = self.dense_weights + round(touched * self.expert_weights)
        return cached

    def comm_ns(self, num_tokens: int) -> int:
        return -(-(self.comm_fixed + self.comm_token * num_tokens) // TICKS_PER_NS) if self.comm_fixed or self.comm_token else 0


class RooflineCostModel(CostModelBase):
    """A step takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) plus all-reduces and fixed costs:
    per step, per layer and per sequence (``RooflineConfig``)."""

    name = "roofline"

    def __init__(self, instance: InstanceConfig, config: RooflineConfig | None = None) -> None:
        self.instance = instance
        self.config = config or RooflineConfig()
        self.units = UnitCosts(instance, self.config)
        self._const_ns: dict[int, int] = {}  # per decode batch size: fixed costs + all-reduces

    def _const(self, num_seqs: int, num_tokens: int) -> int:
        u = self.units
        return u.fixed_ns + u.seq_ns * num_seqs + u.comm_ns(num_tokens)

    def step_time_ns(self, shape: StepShape) -> int:
        u = self.units
        num_prefill = pairs = kv_tokens = 0
        for c, o in shape.prefill_chunks:
            num_prefill += c
            pairs += c * o + c * (c + 1) // 2
            kv_tokens += o + c
        d, ctx = shape.num_decode_seqs, shape.decode_context_tokens
        num_tokens = num_prefill + d
        num_seqs = len(shape.prefill_chunks) + d
        compute = num_tokens * u.linear_token + num_seqs * u.lm_head_row
        compute += (pairs + ctx) * u.attention_pair
        memory = u.weights(num_tokens) + (kv_tokens + ctx) * u.kv_token
        return self._const(num_seqs, num_tokens) + -(-max(compute, memory) // TICKS_PER_NS)

    def _affine(self, d: int, ctx: int) -> AffineDecode:
        u = self.units
        const = self._const_ns.get(d)
        if const is None:
            const = self._const_ns[d] = self._const(d, d)
        return AffineDecode(
            const,
            d * u.linear_decode + ctx * u.attention_pair,
            d * u.attention_pair,
            u.weights(d) + ctx * u.kv_token,
            d * u.kv_token,
        )

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int:
        return self._affine(num_decode_seqs, context_tokens).step_ns(0)

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun:
        u, d = self.units, num_decode_seqs
        const = self._const_ns.get(d)
        if const is None:
            const = self._const_ns[d] = self._const(d, d)
        a1 = d * u.linear_decode + context_tokens * u.attention_pair
        a2 = u.weights(d) + context_tokens * u.kv_token
        b1 = d * u.attention_pair
        b2 = d * u.kv_token
        if a2 >= a1 and b2 >= b1:  # memory-bound at every step of the run (the usual decode)
            return single_line_run(const, a2, b2, max_steps, horizon_ns)
        return AffineDecode(const, a1, b1, a2, b2).run(max_steps, horizon_ns)

    def info(self) -> CostModelInfo:
        c = self.config
        params = [
            ("compute_efficiency", repr(c.compute_efficiency)),
            ("memory_efficiency", repr(c.memory_efficiency)),
            ("interconnect_efficiency", repr(c.interconnect_efficiency)),
            ("step_overhead_ns", str(c.step_overhead_ns)),
        ]
        for name in ("kv_memory_efficiency", "moe_memory_efficiency", "layer_overhead_ns", "seq_overhead_ns",
                     "penalty_overhead_ns", "allreduce_latency_ns"):  # recorded once set
            if getattr(c, name):
                params.append((name, str(getattr(c, name))))
        return CostModelInfo(
            self.name,
            "max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) per step, plus all-reduces",
            tuple(params),
        )


def prefill_time_ns(model: StepCostModel, num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Time to prefill one prompt alone, in chunks of at most ``chunk_tokens`` (no decodes alongside)."""
    total = done = 0
    while done < num_prompt_tokens:
        c = min(chunk_tokens, num_prompt_tokens - done)
        total += model.step_time_ns(StepShape(((c, done),), 0, 0))
        done += c
    return total


__all__ = [
    "AffineDecode",
    "ConstantCostConfig",
    "ConstantCostModel",
    "CostModelBase",
    "CostModelInfo",
    "DecodeRun",
    "RooflineConfig",
    "RooflineCostModel",
    "StepCostModel",
    "StepShape",
    "TICKS_PER_NS",
    "floor_sum",
    "prefill_time_ns",
    "search_run",
    "single_line_run",
]
