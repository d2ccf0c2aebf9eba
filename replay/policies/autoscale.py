"""The autoscaling seam: how many instances a cluster should run, decided from a measured load summary.

The cluster (``replay.cluster``, ``ClusterConfig.autoscaler``) consults its autoscaler every
``autoscale_interval_s`` with a ``LoadSummary`` it measured over the last ``autoscale_window_s``
(``replay.autoscaling.LoadMeter``): arrivals and their prompt tokens (known at arrival), output
tokens of requests that *finished* (a scheduler cannot know a running request's length; never the
trace's true future), the queue now, and the instances ready or starting. The autoscaler answers a
``ScaleDecision`` (the instance count it wants); the cluster turns the difference into a scale step
through its ordinary scaling path, so start-up, weight-load and warm-up delays and draining apply
as for a fixed schedule. An autoscaler is a pure function of the summaries it was given (it may
keep its own state); it never changes the cluster.

Autoscalers (``make_autoscaler`` by name; an unknown name lists the valid ones):

``request-rate``    the baseline, as a Kubernetes HPA on requests per second: instances =
                    ceil(arrival rate / ``target_requests_per_s``). It ignores what the requests ask
                    for: longer prompts or outputs at the same rate need capacity it does not see,
                    and it does not see a queue that built up while instances started.
``workload-aware``  sizes prefill and decode capacity separately (in the spirit of DistServe's and
                    Splitwise's phase-aware provisioning) from the cost model and the KV pool of the
                    instance type being scaled:

                    - prefill: busy seconds per second = rate x the time to prefill a mean prompt
                      (less its prefix-cache hits) alone, in chunks of the step budget;
                    - decode: the largest batch one instance holds, bounded by ``max_num_seqs``, by
                      the KV pool (each stream holds its prompt and a high output) and by
                      ``itl_target_s`` (the cost model's decode step at that batch); busy seconds per
                      second = rate x mean output / (that batch / its step time);
                    - backlog: the queued requests' prefill and decode work, plus the shortfall that
                      keeps queueing while instances started now load (the demand above the ready
                      instances x the start-up, weight-load and warm-up delay), to be cleared within
                      ``backlog_drain_s``;
                    - instances = (prefill + decode + backlog / backlog_drain_s) / ``target_utilization``;
                      the prefill and decode counts alone are what disaggregated pools would run.

Both scale up at once and scale down only after ``scale_down_delay_s`` without a change (no
flapping), within ``min_instances`` .. ``max_instances``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from replay.config import InstanceConfig
from replay.costmodel import StepCostModel, prefill_time_ns
from replay.errors import ReplayError, unknown_name
from schemas.types import doc

NS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSummary:
    """The load of the last window and the cluster's state now, as an autoscaler sees it."""

    window_s: float = doc("Length of the window the rates are measured over, seconds.")
    num_arrivals: int = doc("Requests that arrived in the window.")
    prompt_tokens_mean: float = doc("Mean prompt length of those arrivals, tokens (0 when none).", 0.0)
    prefix_hit_share: float = doc("Share of those arrivals' prompt tokens found in a prefix cache, 0..1.", 0.0)
    num_output_samples: int = doc("Finished requests the output figures come from (0: none yet).", 0)
    output_tokens_mean: float = doc("Mean output tokens (all branches) of recently finished requests.", 0.0)
    output_tokens_high: float = doc("High output (the 0.9 quantile) of recently finished requests, tokens.", 0.0)
    num_queued_requests: int = doc("Requests waiting or held on any instance now (admitted, not running).", 0)
    queued_prompt_tokens: int = doc("Prompt tokens of the queued requests not yet computed.", 0)
    num_instances: int = doc("Instances ready or starting now (not draining, not stopped).", 1)
    num_instances_ready: int = doc("Of those, the ones taking traffic now.", 1)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ReplayError(f"a load summary's window must be positive, not {self.window_s}")
        if min(self.num_arrivals, self.prompt_tokens_mean, self.num_output_samples, self.output_tokens_mean,
               self.output_tokens_high, self.num_queued_requests, self.queued_prompt_tokens) < 0:
            raise ReplayError("a load summary's counts and token figures must be non-negative")
        if not 0 <= self.prefix_hit_share <= 1:
            raise ReplayError("prefix_hit_share must be in [0, 1]")
        if not 0 <= self.num_instances_ready <= self.num_instances:
            raise ReplayError("a load summary needs 0 <= num_instances_ready <= num_instances")

    @property
    def requests_per_s(self) -> float:
        return self.num_arrivals / self.window_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleDecision:
    """How many instances to run, and why."""

    num_instances: int = doc("Instances to run (ready or starting; colocated prefill and decode).")
    num_prefill_instances: int | None = doc("Instances a disaggregated prefill pool would need (workload-aware).", None)
    num_decode_instances: int | None = doc("Instances a disaggregated decode pool would need (workload-aware).", None)
    reason: str = doc("Why, in a few words.", "")

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ReplayError(f"an autoscaler must keep at least one instance, not {self.num_instances}")


class Autoscaler:
    """Base of the autoscalers: ``decide`` from the load summary of the last window.

    Built by the cluster with the instance type it scales, that type's cost model and the delay
    before an instance started now takes traffic (start-up + weight load + warm-up, seconds)."""

    name: ClassVar[str] = ""
    config_type: ClassVar[type] = object

    def __init__(self, config: object | None, instance: InstanceConfig, cost_model: StepCostModel,
                 ready_delay_s: float) -> None:
        self.config = config if config is not None else self.config_type()
        self.instance = instance
        self.cost_model = cost_model
        self.ready_delay_s = ready_delay_s

    def decide(self, load: LoadSummary, seconds_since_last_change: float) -> ScaleDecision:
        raise NotImplementedError


AUTOSCALERS: dict[str, type[Autoscaler]] = {}


def register_autoscaler(cls: type[Autoscaler]) -> type[Autoscaler]:
    """Class decorator: make an autoscaler available by its ``name``."""
    if not cls.name or (cls.name in AUTOSCALERS and AUTOSCALERS[cls.name] is not cls):
        raise TypeError(f"autoscaler {cls.__name__} needs a unique name")
    AUTOSCALERS[cls.name] = cls
    return cls


def autoscaler_class(name: str) -> type[Autoscaler]:
    """The registered autoscaler class of that name."""
    if name not in AUTOSCALERS:
        raise unknown_name("autoscaler", name, list(AUTOSCALERS))
    return AUTOSCALERS[name]


def make_autoscaler(name: str, config: object | None, instance: InstanceConfig, cost_model: StepCostModel,
                    ready_delay_s: float) -> Autoscaler:
    """An autoscaler by name with its typed config (None: its defaults)."""
    cls = autoscaler_class(name)
    if config is not None and not isinstance(config, cls.config_type):
        raise ReplayError(f"autoscaler {name!r} takes a {cls.config_type.__name__}, not a {type(config).__name__}")
    return cls(config, instance, cost_model, ready_delay_s)


def _clamp_and_hold(raw: int, current: int, since_s: float, *, min_instances: int, max_instances: int,
                    scale_down_delay_s: float) -> tuple[int, str]:
    """Clamp to [min, max]; scale up at once, down only after ``scale_down_delay_s`` without a change."""
    target = min(max_instances, max(min_instances, raw))
    if target < current and since_s < scale_down_delay_s:
        return current, f"scale-down to {target} held ({since_s:.0f} s of {scale_down_delay_s:g} s since the last change)"
    return target, ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRateConfig:
    """Settings of the request-rate autoscaler."""

    target_requests_per_s: float = doc("Requests per second one instance is sized for.", 8.0)
    min_instances: int = doc("Fewest instances.", 1)
    max_instances: int = doc("Most instances.", 64)
    scale_down_delay_s: float = doc("Scale down only after this long without a change, seconds.", 300.0)

    def __post_init__(self) -> None:
        if not self.target_requests_per_s > 0 or not 1 <= self.min_instances <= self.max_instances:
            raise ReplayError("request-rate: target_requests_per_s > 0 and 1 <= min_instances <= max_instances")
        if self.scale_down_delay_s < 0:
            raise ReplayError("request-rate: scale_down_delay_s must be non-negative")


@register_autoscaler
class RequestRateAutoscaler(Autoscaler):
    """Instances = ceil(arrival rate / target rate per instance), clamped; reacts to the rate only."""

    name = "request-rate"
    config_type = RequestRateConfig

    def decide(self, load: LoadSummary, seconds_since_last_change: float) -> ScaleDecision:
        c = self.config
        raw = math.ceil(load.requests_per_s / c.target_requests_per_s - 1e-9)
        target, held = _clamp_and_hold(raw, load.num_instances, seconds_since_last_change,
                                       min_instances=c.min_instances, max_instances=c.max_instances,
                                       scale_down_delay_s=c.scale_down_delay_s)
        return ScaleDecision(num_instances=target, reason=held or (
            f"{load.requests_per_s:.2f} req/s / {c.target_requests_per_s:g} per instance"))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadAwareConfig:
    """Settings of the workload-aware autoscaler (the instance type and cost model come from the cluster)."""

    itl_target_s: float = doc("Decode step time a full decode batch must stay within, seconds.", 0.1)
    target_utilization: float = doc("Busy share each instance is sized for, 0..1.", 0.7)
    backlog_drain_s: float = doc(
        "Queued work (and what queues while new instances start) is to be cleared within this long, seconds.", 60.0
    )
    prior_output_tokens: float = doc("Mean output per request assumed before any request finished, tokens.", 256.0)
    prior_output_tokens_high: float = doc("High output per request assumed before any finished, tokens.", 512.0)
    min_output_samples: int = doc("Finished requests needed before their output figures replace the prior.", 20)
    min_instances: int = doc("Fewest instances.", 1)
    max_instances: int = doc("Most instances.", 64)
    scale_down_delay_s: float = doc("Scale down only after this long without a change, seconds.", 300.0)

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1 or not self.itl_target_s > 0 or not self.backlog_drain_s > 0:
            raise ReplayError("workload-aware: target_utilization in (0, 1], itl_target_s and backlog_drain_s > 0")
        if not 1 <= self.min_instances <= self.max_instances or self.scale_down_delay_s < 0:
            raise ReplayError("workload-aware: 1 <= min_instances <= max_instances, scale_down_delay_s >= 0")
        if min(self.prior_output_tokens, self.prior_output_tokens_high) < 0 or self.min_output_samples < 0:
            raise ReplayError("workload-aware: priors and min_output_samples must be non-negative")


@register_autoscaler
class WorkloadAwareAutoscaler(Autoscaler):
    """Prefill and decode capacity sized separately from token, phase and KV estimates, plus the backlog
    that queues while new instances start."""

    name = "workload-aware"
    config_type = WorkloadAwareConfig

    def outputs(self, load: LoadSummary) -> tuple[float, float]:
        """(mean, high) output tokens per request: measured once enough requests finished, else the prior."""
        c = self.config
        if load.num_output_samples >= max(1, c.min_output_samples):
            return load.output_tokens_mean, load.output_tokens_high
        return c.prior_output_tokens, c.prior_output_tokens_high

    def decode_batch(self, prompt_tokens: float, output_mean: float, output_high: float) -> tuple[int, float]:
        """(the largest decode batch one instance holds, its step time in seconds): bounded by the
        sequence cap, the KV pool (prompt + high output per stream) and the ITL target."""
        c = self.config
        e = self.instance.engine
        per_stream = max(1.0, prompt_tokens + output_high)
        kv_cap = int(self.instance.num_kv_blocks * e.block_size_tokens // per_stream)
        cap = max(1, min(e.max_num_seqs, kv_cap))
        ctx = prompt_tokens + output_mean / 2  # a stream's mean context while it decodes

        def step_s(b: int) -> float:
            return self.cost_model.decode_step_ns(b, int(b * ctx)) / NS

        if step_s(cap) <= c.itl_target_s:
            return cap, step_s(cap)
        lo, hi = 1, cap  # the step time grows with the batch: the largest batch within the target
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if step_s(mid) <= c.itl_target_s:
                lo = mid
            else:
                hi = mid
        return lo, step_s(lo)

    def phase_seconds(self, load: LoadSummary) -> tuple[float, float, float, float]:
        """(prefill busy s per s, decode busy s per s, busy seconds of the prefill backlog, of the decode
        backlog): what the load asks of one instance's worth of capacity."""
        out_mean, out_high = self.outputs(load)
        prompt = max(1, round(load.prompt_tokens_mean * (1 - load.prefix_hit_share)))
        prefill_s = prefill_time_ns(self.cost_model, prompt, self.instance.engine.max_num_batched_tokens) / NS
        batch, step_s = self.decode_batch(load.prompt_tokens_mean, out_mean, out_high)
        decode_s_per_token = step_s / batch
        rate = load.requests_per_s
        prefill = rate * prefill_s
        decode = rate * out_mean * decode_s_per_token
        backlog_prefill = load.queued_prompt_tokens * prefill_s / prompt
        backlog_decode = load.num_queued_requests * out_mean * decode_s_per_token
        return prefill, decode, backlog_prefill, backlog_decode

    def decide(self, load: LoadSummary, seconds_since_last_change: float) -> ScaleDecision:
        c = self.config
        prefill, decode, backlog_prefill, backlog_decode = self.phase_seconds(load)
        # what queues while instances started now load: the demand above the ready instances' capacity
        shortfall = max(0.0, prefill + decode - load.num_instances_ready) * self.ready_delay_s
        drain = c.backlog_drain_s
        u = c.target_utilization
        total = prefill + decode + (backlog_prefill + backlog_decode + shortfall) / drain
        raw = math.ceil(total / u - 1e-9)
        n_prefill = max(1, math.ceil((prefill + backlog_prefill / drain) / u - 1e-9))
        n_decode = max(1, math.ceil((decode + backlog_decode / drain) / u - 1e-9))
        target, held = _clamp_and_hold(raw, load.num_instances, seconds_since_last_change,
                                       min_instances=c.min_instances, max_instances=c.max_instances,
                                       scale_down_delay_s=c.scale_down_delay_s)
        return ScaleDecision(
            num_instances=target, num_prefill_instances=n_prefill, num_decode_instances=n_decode,
            reason=held or (f"prefill {prefill:.2f} + decode {decode:.2f} busy s/s, backlog "
                            f"{backlog_prefill + backlog_decode + shortfall:.1f} s over {drain:g} s, at {u:.0%}"),
        )
