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
``workload-aware``  sizes capacity from what the requests ask for (token, phase and KV estimates),
                    with the cost model of the instance type being scaled:

                    - an instance's capacity is the highest rate at which its steady step still
                      exists: each step carries the prompt tokens arriving meanwhile (rate x prompt
                      tokens less prefix-cache hits x step) beside the running decodes (rate x mean
                      output x step, Little's law), priced by the cost model (the fixed point of
                      step = cost(shape)); the decodes must fit the sequence cap and the KV pool
                      (prompt + high output per stream), the step the token budget and
                      ``itl_target_s``;
                    - backlog: the queued requests plus those that queue while instances started now
                      load (the arrivals above what the ready instances take at the target
                      utilization, x the start-up, weight-load and warm-up delay), to be served
                      within ``backlog_drain_s``;
                    - instances = (rate + backlog / backlog_drain_s) / (``target_utilization`` x
                      capacity), the rate being the higher of the window's and the last interval's
                      (``react_to_recent_rate``: up at a burst's first interval); beside it, what disaggregated pools would need (DistServe,
                      Splitwise): prefill instances at the prefill time of a prompt alone, decode
                      instances at a decode-only instance's capacity.

Both scale up at once and scale down only after ``scale_down_delay_s`` without a change (no
flapping), within ``min_instances`` .. ``max_instances``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from replay.config import InstanceConfig
from replay.costmodel import StepCostModel, StepShape, prefill_time_ns
from replay.errors import ReplayError
from replay.policies.base import Registry, read_settings
from schemas.types import doc
from servelens.settings import build

NS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSummary:
    """The load of the last window and the cluster's state now, as an autoscaler sees it."""

    window_s: float = doc("Length of the window the rates are measured over, seconds.")
    num_arrivals: int = doc("Requests that arrived in the window.")
    recent_window_s: float | None = doc("A shorter window ending now (the last decision interval), seconds.", None)
    num_recent_arrivals: int = doc("Requests that arrived in the shorter window.", 0)
    prompt_tokens_mean: float = doc("Mean prompt length of the window's arrivals, tokens (0 when none).", 0.0)
    prefix_hit_share: float = doc("Share of those arrivals' prompt tokens found in a prefix cache, 0..1.", 0.0)
    num_output_samples: int = doc("Finished requests the output figures come from (0: none yet).", 0)
    output_tokens_mean: float = doc("Mean output tokens (all branches) of recently finished requests.", 0.0)
    output_tokens_high: float = doc("High output (the 0.9 quantile) of recently finished requests, tokens.", 0.0)
    num_queued_requests: int = doc("Requests waiting or held on any instance now (admitted, not running).", 0)
    queued_prompt_tokens: int = doc("Prompt tokens of the queued requests not yet computed.", 0)
    num_instances: int = doc("Instances ready or starting now (not draining, not stopped).", 1)
    num_instances_ready: int = doc("Of those, the ones taking traffic now.", 1)

    def __post_init__(self) -> None:
        if not self.window_s > 0 or (self.recent_window_s is not None and not self.recent_window_s > 0):
            raise ReplayError(f"a load summary's windows must be positive, not {self.window_s}, {self.recent_window_s}")
        if min(self.num_arrivals, self.prompt_tokens_mean, self.num_output_samples, self.output_tokens_mean,
               self.output_tokens_high, self.num_queued_requests, self.queued_prompt_tokens) < 0:
            raise ReplayError("a load summary's counts and token figures must be non-negative")
        if not 0 <= self.prefix_hit_share <= 1:
            raise ReplayError("prefix_hit_share must be in [0, 1]")
        if self.num_recent_arrivals > self.num_arrivals:
            raise ReplayError("the recent window's arrivals are among the window's: num_recent_arrivals <= num_arrivals")
        if not 0 <= self.num_instances_ready <= self.num_instances:
            raise ReplayError("a load summary needs 0 <= num_instances_ready <= num_instances")

    @property
    def requests_per_s(self) -> float:
        return self.num_arrivals / self.window_s

    @property
    def recent_requests_per_s(self) -> float | None:
        return None if self.recent_window_s is None else self.num_recent_arrivals / self.recent_window_s


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


AUTOSCALERS = Registry("autoscaler")
register_autoscaler = AUTOSCALERS.register
autoscaler_class = AUTOSCALERS.lookup


def load_autoscaler_config(name: str, path: str | Path) -> object:
    """The named autoscaler's config from a YAML (or JSON) mapping of its fields: types checked, unknown keys
    refused."""
    cls = autoscaler_class(name).config_type  # an unknown name: the error lists the valid ones
    return build(cls, read_settings("autoscaler", path, cls))


def make_autoscaler(name: str, config: object | None, instance: InstanceConfig, cost_model: StepCostModel,
                    ready_delay_s: float) -> Autoscaler:
    """An autoscaler by name with its typed config (None: its defaults)."""
    return AUTOSCALERS.checked(name, config)(config, instance, cost_model, ready_delay_s)


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
    react_to_recent_rate: bool = doc(
        "Size for the higher of the window's and the recent window's arrival rate: scale up within one interval "
        "of a burst's start (scale-downs still follow the longer window).", True
    )
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
    """Instance capacity from the cost model at the measured token mix (prefill and decode in the same
    steps, bounded by the KV pool, the sequence cap, the step budget and the ITL target), plus the
    backlog that queues while new instances start; disaggregated pool sizes reported beside."""

    name = "workload-aware"
    config_type = WorkloadAwareConfig

    def outputs(self, load: LoadSummary) -> tuple[float, float]:
        """(mean, high) output tokens per request: measured once enough requests finished, else the prior."""
        c = self.config
        if load.num_output_samples >= max(1, c.min_output_samples):
            return load.output_tokens_mean, load.output_tokens_high
        return c.prior_output_tokens, c.prior_output_tokens_high

    def max_streams(self, prompt_tokens: float, output_high: float) -> int:
        """Decode streams one instance holds: the sequence cap, and the KV pool at prompt + high output each."""
        e = self.instance.engine
        kv_cap = int(self.instance.num_kv_blocks * e.block_size_tokens // max(1.0, prompt_tokens + output_high))
        return max(1, min(e.max_num_seqs, kv_cap))

    def step_s(self, rate_per_s: float, prompt_tokens: float, prefill_tokens: float, output_mean: float,
               streams: int, *, colocated: bool = True) -> float | None:
        """The steady step time of one instance serving ``rate_per_s``, seconds, or None when it cannot.

        Each step carries the prefill tokens that arrive during it (rate x prefill tokens x step) beside
        the decodes that are running (rate x output x step, by Little's law), and its time is the cost
        model's for that shape: the fixed point of step = cost(rate x prefill x step, rate x output x
        step), found by iterating from an empty step (it grows towards the fixed point, and without
        bound when the rate is beyond the instance). ``colocated=False``: a decode-only instance."""
        c = self.config
        budget = self.instance.engine.max_num_batched_tokens
        ctx = prompt_tokens + output_mean / 2  # a stream's mean context while it decodes
        step = self.cost_model.decode_step_ns(1, int(ctx)) / NS
        for _ in range(200):
            decodes = rate_per_s * output_mean * step
            chunk = rate_per_s * prefill_tokens * step if colocated else 0.0
            if decodes > streams or chunk + decodes > budget or step > c.itl_target_s:
                return None
            n = max(1, math.ceil(decodes))
            if chunk > 0:
                shape = StepShape(((math.ceil(chunk), int(prompt_tokens // 2)),), n, int(n * ctx))
                new = self.cost_model.step_time_ns(shape) / NS
            else:
                new = self.cost_model.decode_step_ns(n, int(n * ctx)) / NS
            if abs(new - step) <= 1e-9 * max(step, 1e-9):
                break
            step = new
        return step  # converging slowly (a rate near capacity) but within every bound: it holds

    def capacity_per_s(self, prompt_tokens: float, prefill_tokens: float, output_mean: float, output_high: float,
                       *, colocated: bool = True) -> float:
        """The highest request rate one instance sustains (bisection on ``step_s``), requests per second."""
        streams = self.max_streams(prompt_tokens, output_high)

        def ok(rate: float) -> bool:
            return self.step_s(rate, prompt_tokens, prefill_tokens, output_mean, streams, colocated=colocated) is not None

        lo, hi = 0.0, 1.0
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > 1e6:
                return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def decide(self, load: LoadSummary, seconds_since_last_change: float) -> ScaleDecision:
        c = self.config
        out_mean, out_high = self.outputs(load)
        prompt = load.prompt_tokens_mean
        prefill = prompt * (1 - load.prefix_hit_share)  # prompt tokens computed: prefix-cache hits are not
        rate = load.requests_per_s
        recent = load.recent_requests_per_s
        if c.react_to_recent_rate and recent is not None and recent > rate:
            rate = recent
        capacity = self.capacity_per_s(prompt, prefill, out_mean, out_high)
        u = c.target_utilization
        # what queues while instances started now load: the arrivals above what the ready instances take
        # at the target utilization (beyond it their queues grow)
        shortfall = max(0.0, rate - load.num_instances_ready * u * capacity) * self.ready_delay_s
        backlog = load.num_queued_requests + shortfall  # requests, to be served within backlog_drain_s
        wanted = (rate + backlog / c.backlog_drain_s) / (u * capacity) if capacity > 0 else math.inf
        raw = c.max_instances if wanted == math.inf else math.ceil(wanted - 1e-9)
        # disaggregated pools: prefill instances do prompts alone (chunks of the step budget), decode
        # instances decode alone (no prefill in their steps)
        prefill_s = prefill_time_ns(self.cost_model, max(1, round(prefill)),
                                    self.instance.engine.max_num_batched_tokens) / NS
        decode_capacity = self.capacity_per_s(prompt, prefill, out_mean, out_high, colocated=False)
        n_prefill = max(1, math.ceil((rate + backlog / c.backlog_drain_s) * prefill_s / u - 1e-9))
        n_decode = max(1, math.ceil((rate + backlog / c.backlog_drain_s) / (u * decode_capacity) - 1e-9)
                       if decode_capacity > 0 else c.max_instances)
        target, held = _clamp_and_hold(raw, load.num_instances, seconds_since_last_change,
                                       min_instances=c.min_instances, max_instances=c.max_instances,
                                       scale_down_delay_s=c.scale_down_delay_s)
        return ScaleDecision(
            num_instances=target, num_prefill_instances=n_prefill, num_decode_instances=n_decode,
            reason=held or (f"{rate:.2f} req/s, {capacity:.2f} per instance at the measured mix, backlog "
                            f"{backlog:.0f} requests over {c.backlog_drain_s:g} s, at {u:.0%}"),
        )
