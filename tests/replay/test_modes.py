"""The fast mode gives the reference mode's per-request timestamps on real traces, with far fewer events."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from replay.config import EngineConfig, instance_config
from replay.traces import read_trace

TIMESTAMPS = ["arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "cancel_ns", "finish_ns"]


def _max_relative_difference(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1))
    return worst


CASES = {
    # (trace, requests, engine settings, at least how many times fewer events the fast mode writes):
    # the Azure conversation trace at its recorded rate; the Mooncake trace (long prompts: chunked
    # prefill in nearly every step, prefix-cache hits, a growing queue on one GPU, so few pure decode
    # runs to coalesce); Azure again on a small KV pool, so that requests are preempted and recomputed
    "azure": ("azure-conv", 2000, EngineConfig(), 3),
    "mooncake": ("mooncake", 400, EngineConfig(), 1),
    "azure-small-pool": ("azure-conv", 1500, EngineConfig(num_kv_blocks_override=600), 3),
    # async scheduling (a request that arrives during a step waits a step more: a run stops after one step)
    "azure-async": ("azure-conv", 2000, EngineConfig(async_scheduling=True), 3),
    # a small pool with a CPU tier: evicted prefix units are found there and copied back
    "mooncake-cpu-tier": ("mooncake", 400, EngineConfig(num_kv_blocks_override=10_000, cpu_kv_offload_bytes=8 << 30,
                                                        async_scheduling=True), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_and_reference_modes_agree_per_request(shared, run, case):
    trace, n, engine, fewer = CASES[case]
    w = read_trace(trace, shared).slice(0, n)
    inst = instance_config(engine=engine)
    fast = run(w, instance=inst)  # the default mode
    ref = run(w, instance=inst, mode="reference")
    assert fast.summary.mode == "fast" and ref.summary.mode == "reference"
    assert fast.requests.num_rows == ref.requests.num_rows == n
    for column in TIMESTAMPS:
        assert _max_relative_difference(fast.requests[column].to_pylist(), ref.requests[column].to_pylist()) <= 1e-9, column
        assert fast.requests[column].equals(ref.requests[column])  # in fact identical to the nanosecond
    for column in ("outcome", "num_output_tokens", "num_preemptions", "num_lost_tokens", "num_cached_prefix_tokens"):
        assert fast.requests[column].equals(ref.requests[column]), column
    # same engine iterations, far fewer events
    assert fast.summary.num_steps == ref.summary.num_steps
    assert fast.summary.num_events * fewer < ref.summary.num_events
    f_steps, r_steps = fast.events.filter(pc.equal(fast.events["event_type"], "step_executed")), ref.events.filter(
        pc.equal(ref.events["event_type"], "step_executed"))
    assert pc.sum(f_steps["num_steps"]).as_py() == pc.sum(r_steps["num_steps"]).as_py() == ref.summary.num_steps
    assert pc.max(f_steps["num_steps"]).as_py() > 1 and pc.max(r_steps["num_steps"]).as_py() == 1
    f_tok = fast.events.filter(pc.equal(fast.events["event_type"], "tokens_delivered"))
    r_tok = ref.events.filter(pc.equal(ref.events["event_type"], "tokens_delivered"))
    assert pc.any(f_tok["coalesced"]).as_py() and not pc.any(r_tok["coalesced"]).as_py()
    assert pc.sum(f_tok["num_tokens"]).as_py() == pc.sum(r_tok["num_tokens"]).as_py()
    if case == "azure-small-pool":
        assert pc.sum(ref.requests["num_preemptions"]).as_py() > 100
    if case.startswith("mooncake"):
        assert pc.sum(ref.requests["num_cached_prefix_tokens"]).as_py() > 0
