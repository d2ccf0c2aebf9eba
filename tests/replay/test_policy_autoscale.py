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
    """Every prefill step 10 ms; a decode step 2 ms per sequence (so the ITL target bounds the batch)."""

    def step_time_ns(self, shape: StepShape) -> int:
        return 10 * MS

    def decode_step_ns(self, num_decode_seqs: int, context_tokens: int) -> int:
        return 2 * MS * num_decode_seqs


# 1,000 blocks of 16 tokens: 16,000 tokens of KV
INSTANCE = instance_config(engine=EngineConfig(num_kv_blocks_override=1000))


def summary(**kwargs) -> LoadSummary:
    args = dict(window_s=60.0, num_arrivals=600, prompt_tokens_mean=1000.0, num_output_samples=100,
                output_tokens_mean=300.0, output_tokens_high=600.0, num_instances=5, num_instances_ready=5) | kwargs
    return LoadSummary(**args)


def workload_aware(ready_delay_s: float = 48.0, **kwargs):
    return make_autoscaler("workload-aware", WorkloadAwareConfig(**kwargs), INSTANCE, StubCost(), ready_delay_s)


def request_rate(**kwargs):
    return make_autoscaler("request-rate", RequestRateConfig(**kwargs), INSTANCE, StubCost(), 48.0)


def test_request_rate_counts_requests_only():
    # 600 arrivals in 60 s = 10 req/s over 8 per instance: 2, whatever the requests ask for
    a = request_rate(target_requests_per_s=8.0)
    for out in (30.0, 300.0, 3000.0):
        assert a.decide(summary(output_tokens_mean=out, num_instances=2, num_instances_ready=2), 0.0).num_instances == 2
    assert a.decide(summary(num_arrivals=0, num_instances=1, num_instances_ready=1), 0.0).num_instances == 1  # min


def test_workload_aware_sizes_decode_from_the_kv_pool_and_prefill_from_the_prompt():
    # a stream holds 1,000 prompt + 600 high output = 1,600 tokens: the pool holds 16,000 / 1,600 = 10
    # streams; 10 x 2 ms = 20 ms is within the 100 ms ITL target, so a batch of 10 makes 10 tokens per
    # 20 ms: 2 ms per output token. Decode: 10 req/s x 300 tokens x 2 ms = 6.0 busy s/s; prefill: one
    # 10 ms chunk per 1,000-token prompt: 0.1. At 70%: 6.1 / 0.7 = 8.71 -> 9 instances (prefill alone:
    # 1, decode alone: ceil(6 / 0.7) = 9). Seven are ready, more than the 6.1 busy s/s: nothing queues
    # while new instances start.
    a = workload_aware()
    assert a.decode_batch(1000.0, 300.0, 600.0) == (10, 0.02)
    d = a.decide(summary(num_instances=7, num_instances_ready=7), 0.0)
    assert (d.num_instances, d.num_prefill_instances, d.num_decode_instances) == (9, 1, 9)
    # the same rate with short outputs (30, high 60): 15 streams of 1,060 tokens, 30 ms steps, 2 ms a
    # token: decode 10 x 30 x 0.002 = 0.6, prefill 0.1: 0.7 / 0.7 = 1 instance; request-rate says 2 for both
    short = a.decide(summary(output_tokens_mean=30.0, output_tokens_high=60.0), 1000.0)
    assert (short.num_instances, short.num_prefill_instances, short.num_decode_instances) == (1, 1, 1)


def test_the_itl_target_bounds_the_decode_batch():
    # short streams (100 + 100 tokens): the pool would hold 80, but 2 ms per sequence keeps a 50 ms
    # target to 25 sequences
    a = workload_aware(itl_target_s=0.05)
    assert a.decode_batch(100.0, 50.0, 100.0) == (25, 0.05)


def test_workload_aware_counts_the_backlog_and_what_queues_while_instances_start():
    # demand as above: 6.1 busy s/s. Only 2 instances are ready (5 counted, 3 starting): for the 48 s an
    # instance takes to come up, 6.1 - 2 = 4.1 busy s/s queue: 196.8 s of work. 100 queued requests of
    # 1,000 prompt tokens add 100 x 10 ms = 1 s of prefill and 100 x 300 x 2 ms = 60 s of decode. All of it
    # cleared within 60 s: (196.8 + 61) / 60 = 4.297 busy s/s more: (6.1 + 4.297) / 0.7 = 14.85 -> 15
    a = workload_aware()
    d = a.decide(summary(num_instances_ready=2, num_queued_requests=100, queued_prompt_tokens=100_000), 0.0)
    assert d.num_instances == 15
    # prefill alone: (0.1 + 1 / 60) / 0.7 -> 1; decode alone: (6.0 + 60 / 60) / 0.7 = 10
    assert (d.num_prefill_instances, d.num_decode_instances) == (1, 10)
    # a longer start-up means more queues meanwhile: 96 s -> (393.6 + 61) / 60 = 7.577: 13.677 / 0.7 -> 20
    assert workload_aware(ready_delay_s=96.0).decide(
        summary(num_instances_ready=2, num_queued_requests=100, queued_prompt_tokens=100_000), 0.0).num_instances == 20


def test_outputs_come_from_finished_requests_or_the_prior():
    # fewer than 20 finished: the prior (256, high 512) stands in; a stream of 1,512 tokens: 10 fit
    # (15,120 <= 16,000): 2 ms a token, decode 10 x 256 x 0.002 = 5.12, prefill 0.1: 5.22 / 0.7 -> 8
    # (six ready: nothing queues meanwhile)
    a = workload_aware()
    assert a.outputs(summary(num_output_samples=19)) == (256.0, 512.0)
    few = summary(num_output_samples=19, output_tokens_mean=1.0, output_tokens_high=1.0, num_instances=6,
                  num_instances_ready=6)
    assert a.decide(few, 0.0).num_instances == 8


@pytest.mark.parametrize("make", [request_rate, workload_aware])
def test_scale_down_is_held_but_scale_up_is_not(make):
    a = make(scale_down_delay_s=300.0, max_instances=12)
    quiet = summary(num_arrivals=6, num_instances=10, num_instances_ready=10)
    held = a.decide(quiet, 120.0)
    assert held.num_instances == 10 and "held" in held.reason
    assert a.decide(quiet, 300.0).num_instances == 1
    busy = summary(num_arrivals=60_000, num_instances=2, num_instances_ready=2)
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
