"""Autoscalers on hand-built load summaries: the request-rate baseline and the workload-aware estimator
(prefill and decode sized apart, KV- and ITL-bounded decode batches, the backlog that queues while new
instances start), hold-down against flapping, and the registry."""

from __future__ import annotations

import pytest

from replay.config import EngineConfig, instance_config
from replay.costmodel import StepShape
from replay.errors import ReplayError
from replay.policies.autoscale import (
    LoadSummary,
    RequestRateConfig,
    WorkloadAwareConfig,
    make_autoscaler,
)

MS = 1_000_000


class StubCost:
    """A linear step: 1 ms, plus 0.01 ms per prefill token and 0.1 ms per decode sequence (hand-checkable)."""

    def step_time_ns(self, shape: StepShape) -> int:
        return MS + 10_000 * sum(c for c, _ in shape.prefill_chunks) + 100_000 * shape.num_decode_seqs

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int:
        return MS + 100_000 * num_decode_seqs


# 1,000 blocks of 16 tokens: 16,000 tokens of KV
INSTANCE = instance_config(engine=EngineConfig(num_kv_blocks_override=1000))


def summary(**kwargs) -> LoadSummary:
    args = dict(window_s=60.0, num_arrivals=1200, prompt_tokens_mean=1000.0, num_output_samples=100,
                output_tokens_mean=300.0, output_tokens_high=600.0, num_instances=2, num_instances_ready=2) | kwargs
    return LoadSummary(**args)


def workload_aware(ready_delay_s: float = 48.0, **kwargs):
    kwargs.setdefault("target_utilization", 0.8)
    return make_autoscaler("workload-aware", WorkloadAwareConfig(**kwargs), INSTANCE, StubCost(), ready_delay_s)


def request_rate(**kwargs):
    return make_autoscaler("request-rate", RequestRateConfig(**kwargs), INSTANCE, StubCost(), 48.0)


def test_request_rate_counts_requests_only():
    # 1,200 arrivals in 60 s = 20 req/s over 8 per instance: 3, whatever the requests ask for
    a = request_rate(target_requests_per_s=8.0)
    for out in (30.0, 300.0, 3000.0):
        assert a.decide(summary(output_tokens_mean=out), 0.0).num_instances == 3
    assert a.decide(summary(num_arrivals=0, num_instances=1, num_instances_ready=1), 0.0).num_instances == 1  # min


def test_workload_aware_capacity_comes_from_the_token_mix_and_the_kv_pool():
    # A stream holds 1,000 prompt + 600 high output = 1,600 tokens: the pool holds 16,000 / 1,600 = 10.
    # At rate r, a step of s seconds carries 1,000 r s prompt tokens and 300 r s decodes, so s = 1 ms +
    # 0.01 ms x 1,000 r s + 0.1 ms x 300 r s: s = 1 ms / (1 - 0.04 r). The decodes, 300 r s = 0.3 r /
    # (1 - 0.04 r), reach the 10 streams at r = 100 / 7 = 14.29 req/s (the step shapes round chunks and
    # decodes up, so a little less); the step is then 2.3 ms, far inside the ITL target.
    a = workload_aware()
    assert a.max_streams(1000.0, 600.0) == 10
    assert a.capacity_per_s(1000.0, 1000.0, 300.0, 600.0) == pytest.approx(100 / 7, rel=0.01)
    # a decode-only instance: s = 1 ms + 0.1 ms x 300 r s; 300 r s = 10 at r = 50 / 3
    assert a.capacity_per_s(1000.0, 1000.0, 300.0, 600.0, colocated=False) == pytest.approx(50 / 3, rel=0.01)
    # 20 req/s at 80% of 14.25: 20 / 11.4 = 1.75 -> 2 (prefill pool: 20 x 11 ms / 0.8 -> 1; decode pool:
    # 20 / (0.8 x 16.67) = 1.5 -> 2)
    d = a.decide(summary(), 0.0)
    assert (d.num_instances, d.num_prefill_instances, d.num_decode_instances) == (2, 1, 2)
    # the same rate with short outputs (30, high 60): 15 streams of 1,060 tokens, s = 1 ms / (1 - 0.013 r),
    # 30 r s = 15 at r = 66.7: one instance; request-rate says 3 for both
    assert a.capacity_per_s(1000.0, 1000.0, 30.0, 60.0) == pytest.approx(200 / 3, rel=0.01)
    short = a.decide(summary(output_tokens_mean=30.0, output_tokens_high=60.0), 1000.0)
    assert (short.num_instances, short.num_prefill_instances, short.num_decode_instances) == (1, 1, 1)
    # long outputs (3,000, high 3,000): 4 streams of 4,000 tokens, s = 1 ms / (1 - 0.31 r), 3,000 r s = 4
    # at r = 4 / 4.24 = 0.94 req/s: 20 req/s want 20 / (0.8 x 0.94) = 26.5 -> 27 (from 30 ready, so
    # nothing queues meanwhile)
    long = a.decide(summary(output_tokens_mean=3000.0, output_tokens_high=3000.0, num_instances=30,
                            num_instances_ready=30), 1000.0)
    assert long.num_instances == 27


def test_prefix_hits_lower_the_prefill_not_the_kv():
    # half the prompt cached: 500 prompt tokens computed per request, s = 1 ms / (1 - 0.035 r); the
    # streams still hold 1,600 tokens: 300 r s = 10 at r = 10 / 0.65 = 15.38
    a = workload_aware()
    assert a.capacity_per_s(1000.0, 500.0, 300.0, 600.0) == pytest.approx(10 / 0.65, rel=0.01)


def test_the_itl_target_bounds_the_step():
    # a 2 ms target: 1 ms / (1 - 0.04 r) <= 2 ms at r <= 12.5 (a little less with the shapes rounded up)
    a = workload_aware(itl_target_s=0.002)
    assert 11.5 < a.capacity_per_s(1000.0, 1000.0, 300.0, 600.0) < 12.5


def test_workload_aware_counts_the_backlog_and_what_queues_while_instances_start():
    # one instance ready (capacity 14.25 req/s, 11.4 at 80%) at 20 req/s: for the 48 s a new instance
    # takes, 20 - 11.4 = 8.6 req/s queue: 413 requests, plus the 100 queued: 513, to be served within
    # 60 s: 8.55 req/s more. (20 + 8.55) / 11.4 = 2.5 -> 3 instances, where the rate alone wants 2
    a = workload_aware()
    d = a.decide(summary(num_instances=1, num_instances_ready=1, num_queued_requests=100), 0.0)
    assert d.num_instances == 3
    assert a.decide(summary(num_instances=1, num_instances_ready=1), 0.0).num_instances == 3  # 413 alone: 2.4
    # nothing queued and capacity ready (2 x 11.4 >= 20): only the rate
    assert a.decide(summary(num_instances=2, num_instances_ready=2), 0.0).num_instances == 2
    # a longer start-up queues more: 240 s -> 2,065 + 100 requests: (20 + 36.1) / 11.4 = 4.9 -> 5
    assert workload_aware(ready_delay_s=240.0).decide(
        summary(num_instances=1, num_instances_ready=1, num_queued_requests=100), 0.0).num_instances == 5


def test_outputs_come_from_finished_requests_or_the_prior():
    a = workload_aware()
    assert a.outputs(summary(num_output_samples=19)) == (256.0, 512.0)
    assert a.outputs(summary(num_output_samples=20)) == (300.0, 600.0)


@pytest.mark.parametrize("make", [request_rate, workload_aware])
def test_scale_down_is_held_but_scale_up_is_not(make):
    a = make(scale_down_delay_s=300.0, max_instances=12)
    quiet = summary(num_arrivals=6, num_instances=10, num_instances_ready=10)  # 0.1 req/s
    held = a.decide(quiet, 120.0)
    assert held.num_instances == 10 and "held" in held.reason
    assert a.decide(quiet, 300.0).num_instances == 1
    busy = summary(num_arrivals=60_000, num_instances=2, num_instances_ready=2)  # 1,000 req/s
    assert a.decide(busy, 0.0).num_instances == 12  # at once, clamped to max_instances


def test_registry_configs_and_summaries_are_checked():
    with pytest.raises(ReplayError, match="request-rate"):
        make_autoscaler("nope", None, INSTANCE, StubCost(), 0.0)
    with pytest.raises(ReplayError, match="takes a WorkloadAwareConfig"):
        make_autoscaler("workload-aware", RequestRateConfig(), INSTANCE, StubCost(), 0.0)
    with pytest.raises(ReplayError):
        RequestRateConfig(target_requests_per_s=0)
    with pytest.raises(ReplayError):
        WorkloadAwareConfig(target_utilization=1.5)
    with pytest.raises(ReplayError):
        summary(num_instances_ready=6)
    with pytest.raises(ReplayError):
        summary(window_s=0)


def test_a_burst_in_the_last_interval_is_sized_for_at_once():
    # 900 arrivals in the 60 s window (15 req/s), 600 of them in the last 15 s (40 req/s). Workload-aware
    # sizes for 40: two ready at 80% take 22.8 req/s, the other 17.2 queue for the 48 s a new instance
    # takes (826 requests, 13.8 req/s more to serve them within 60 s): (40 + 13.8) / 11.4 = 4.7 -> 5.
    # Without the recent rate, 15 / 11.4 -> 2; request-rate follows the window: 15 / 8 -> 2.
    burst = summary(num_arrivals=900, recent_window_s=15.0, num_recent_arrivals=600)
    assert burst.recent_requests_per_s == 40.0
    assert workload_aware().decide(burst, 1000.0).num_instances == 5
    assert workload_aware(react_to_recent_rate=False).decide(burst, 1000.0).num_instances == 2
    assert request_rate(target_requests_per_s=8.0).decide(burst, 1000.0).num_instances == 2
    # a quiet last interval does not lower the window's rate (20 req/s: 2)
    quiet = summary(recent_window_s=15.0, num_recent_arrivals=0)
    assert workload_aware().decide(quiet, 0.0).num_instances == 2
    with pytest.raises(ReplayError):
        summary(num_arrivals=10, recent_window_s=15.0, num_recent_arrivals=11)
