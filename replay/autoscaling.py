"""A cluster's autoscaling loop: measure the load, ask the autoscaler, scale through the cluster.

When ``ClusterConfig.autoscaler`` names an autoscaler (``replay.policies.autoscale``), the cluster
builds an ``Autoscaling`` at its start. Every ``autoscale_interval_s`` after the first arrival it
summarizes what it measured (``LoadSummary``) and asks the autoscaler how many instances to run; the
difference from the instances ready or starting becomes a ``ScaleStep`` handed to
``Cluster._scale``, the path a fixed schedule takes (start-up, weight-load and warm-up delays;
scale-downs take the newest instance: one starting stops at once, a ready one drains).

What is measured, and only from the past (never the trace's true future):

- arrivals over the last ``autoscale_window_s``: their count and mean prompt tokens (known when a
  request arrives), and their count over the last interval (the recent rate);
- output tokens (all branches) of the latest ``OUTPUT_HISTORY`` requests that finished having
  produced at least one token, and the share of their prompts found in a prefix cache;
- the queue now (requests waiting or held on every instance not stopped, and their prompt tokens
  not yet computed), and the instances ready or starting.

A tick runs at the scaling transitions' priority (after step ends, before arrivals at the same
instant), reads no state that a fast-mode run changes ahead (queues do not change inside a run;
finishes end runs), so the fast and the reference modes take the same decisions. Ticks stop once
nothing else is pending and every request has finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from replay.errors import ReplayError
from replay.kernel import CONTROL, Kernel
from replay.policies.autoscale import Autoscaler, LoadSummary, ScaleDecision, make_autoscaler
from replay.request import Request
from schemas.types import doc


class ScalableCluster(Protocol):
    """What the loop needs of a cluster (``replay.cluster.Cluster``): its configuration, kernel and
    instances (each with ``state`` and ``engine``), and a way to scale."""

    config: Any
    kernel: Kernel
    instances: list[Any]

    @property
    def num_active(self) -> int: ...

    def scale_by(self, at_s: float, delta: int) -> None: ...


NS = 1_000_000_000
#: The most consultations of one replay (each is recorded): 2M are 347 days at the default 15 s, about a
#: minute of replay; beyond them the workload's span is wrong or the interval is far too short for it.
MAX_CONSULTATIONS = 2_000_000

#: Finished requests the output figures are taken from.
OUTPUT_HISTORY = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRecord:
    """One consultation of the autoscaler (the manifest lists them: ``cluster.autoscaler.decisions``)."""

    at_s: float = doc("When, seconds after the first arrival.")
    num_instances_before: int = doc("Instances ready or starting then.")
    num_instances_wanted: int = doc("Instances the autoscaler asked for.")
    reason: str = doc("Its reason.")


class LoadMeter:
    """Arrivals in a sliding time window and the outputs of the latest finished requests."""

    __slots__ = ("window_ns", "recent_ns", "_arrivals", "_prompt_tokens", "_outputs")

    def __init__(self, window_ns: int, recent_ns: int) -> None:
        self.window_ns = window_ns
        self.recent_ns = recent_ns
        self._arrivals: deque[tuple[int, int]] = deque()  # (arrival ns, prompt tokens)
        self._prompt_tokens = 0  # of the arrivals in the deque
        self._outputs: deque[tuple[int, int, int]] = deque(maxlen=OUTPUT_HISTORY)  # (output, prompt, cached prefix)

    def arrived(self, r: Request, now_ns: int) -> None:
        self._arrivals.append((now_ns, r.num_prompt_tokens))
        self._prompt_tokens += r.num_prompt_tokens

    def finished(self, r: Request) -> None:
        if r.first_token_ns is not None:  # served: rejected and never-started requests say nothing of lengths
            self._outputs.append((r.num_output * r.num_branches, r.num_prompt_tokens, r.num_cached_prefix_tokens))

    def summary(self, now_ns: int, *, num_queued: int, queued_prompt_tokens: int, num_instances: int,
                num_ready: int) -> LoadSummary:
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now_ns - self.window_ns:
            self._prompt_tokens -= arrivals.popleft()[1]
        n = len(arrivals)
        recent = 0
        for t, _ in reversed(arrivals):
            if t <= now_ns - self.recent_ns:
                break
            recent += 1
        outputs = sorted(o for o, _, _ in self._outputs)
        m = len(outputs)
        prompts = sum(p for _, p, _ in self._outputs)
        return LoadSummary(
            window_s=self.window_ns / NS,
            num_arrivals=n,
            recent_window_s=self.recent_ns / NS,
            num_recent_arrivals=recent,
            prompt_tokens_mean=self._prompt_tokens / n if n else 0.0,
            prefix_hit_share=min(1.0, sum(c for _, _, c in self._outputs) / prompts) if prompts else 0.0,
            num_output_samples=m,
            output_tokens_mean=sum(outputs) / m if m else 0.0,
            output_tokens_high=float(outputs[max(0, -(-9 * m // 10) - 1)]) if m else 0.0,  # nearest-rank 0.9
            num_queued_requests=num_queued,
            queued_prompt_tokens=queued_prompt_tokens,
            num_instances=num_instances,
            num_instances_ready=num_ready,
        )


class Autoscaling:
    """The loop that consults a cluster's autoscaler every interval."""

    def __init__(self, cluster: ScalableCluster, start_ns: int) -> None:
        config = cluster.config
        self.cluster = cluster
        self.kernel = cluster.kernel
        self.start_ns = start_ns
        self.interval_ns = round(config.autoscale_interval_s * NS)
        first = config.instances[0]
        engine = cluster.instances[0].engine
        ready_delay_s = sum(config.delays.phases_ns(first)) / NS
        self.autoscaler: Autoscaler = make_autoscaler(config.autoscaler, config.autoscaler_config, first,
                                                      engine.cost_model, ready_delay_s)
        self.meter = LoadMeter(round(config.autoscale_window_s * NS),
                               min(self.interval_ns, round(config.autoscale_window_s * NS)))
        self.last_change_ns = start_ns
        self.records: list[ScaleRecord] = []

    def start(self) -> None:
        self._control(self.start_ns + self.interval_ns, self.tick)

    def _control(self, at_ns: int, action) -> None:
        self.kernel.schedule(at_ns, CONTROL, action)

    def arrived(self, r: Request) -> None:
        self.meter.arrived(r, self.kernel.now_ns)

    def finished(self, r: Request) -> None:
        self.meter.finished(r)

    def tick(self) -> None:
        cluster = self.cluster
        now = self.kernel.now_ns
        if len(self.records) >= MAX_CONSULTATIONS:
            raise ReplayError(
                f"the autoscaler was consulted {MAX_CONSULTATIONS:,} times, every {self.interval_ns / NS:g} s for "
                f"{(now - self.start_ns) / NS / 86_400:,.1f} days of the workload, with requests still to come",
                "check the workload's first and last arrival (a clock gone wrong spans years), or consult it less often "
                "(--autoscale-interval-s)")
        live = ready = queued = queued_tokens = 0
        for inst in cluster.instances:
            if inst.state in ("starting", "ready"):
                live += 1
                ready += inst.state == "ready"
            if inst.state in ("ready", "draining"):
                e = inst.engine
                for q in (e.waiting, e.held):
                    queued += len(q)
                    for r in q:
                        queued_tokens += max(0, r.num_prompt_tokens - r.num_computed)
        summary = self.meter.summary(now, num_queued=queued, queued_prompt_tokens=queued_tokens, num_instances=live,
                                     num_ready=ready)
        d: ScaleDecision = self.autoscaler.decide(summary, (now - self.last_change_ns) / NS)
        at_s = (now - self.start_ns) / NS
        self.records.append(ScaleRecord(at_s=at_s, num_instances_before=live, num_instances_wanted=d.num_instances,
                                        reason=d.reason))
        if d.num_instances != live:
            cluster.scale_by(at_s, d.num_instances - live)
            self.last_change_ns = now
        if len(self.kernel) or cluster.num_active:  # something is still to come
            self._control(now + self.interval_ns, self.tick)
