"""Step cost models: exact closed forms, figures checked by hand, measured profiles read right."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.config import EngineConfig, instance_config
from replay.cost_models import make_cost_model
from replay.costmodel import (
    TICKS_PER_NS,
    AffineDecode,
    ConstantCostConfig,
    ConstantCostModel,
    CostModelBase,
    RooflineConfig,
    RooflineCostModel,
    StepShape,
    floor_sum,
    prefill_time_ns,
    search_run,
    single_line_run,
)
from replay.errors import ReplayError


@given(st.integers(0, 60), st.integers(1, 5000), st.integers(0, 10**7), st.integers(0, 10**7))
def test_floor_sum_matches_the_sum(n, m, a, b):
    assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def _loop_run(step, max_steps, horizon):
    elapsed = 0
    for i in range(max_steps):
        elapsed += step(i)
        if horizon is not None and elapsed >= horizon:
            return i + 1, elapsed, step(i)
    return max_steps, elapsed, step(max_steps - 1)


@given(
    st.integers(0, 10**6), st.integers(0, 10**9), st.integers(0, 10**7), st.integers(0, 10**9), st.integers(0, 10**7),
    st.integers(1, 400), st.one_of(st.none(), st.integers(-5, 10**9)),
)
def test_affine_runs_are_exact(c, a1, b1, a2, b2, max_steps, horizon):
    f = AffineDecode(c, a1, b1, a2, b2)
    assert f.total_ns(max_steps) == sum(f.step_ns(i) for i in range(max_steps))
    run = f.run(max_steps, horizon)
    assert tuple(run) == _loop_run(f.step_ns, max_steps, horizon)
    assert tuple(search_run(f.step_ns, f.total_ns, max_steps, horizon)) == tuple(run)
    if a2 >= a1 and b2 >= b1:
        assert tuple(single_line_run(c, a2, b2, max_steps, horizon)) == tuple(run)


ROOFLINES = [
    RooflineCostModel(instance_config("llama-3-8b", "h100-sxm")),
    RooflineCostModel(instance_config("llama-2-70b", "a100-80g", tensor_parallel_size=4), RooflineConfig(step_overhead_ns=40_000)),
    RooflineCostModel(instance_config("llama-2-7b", "h200"), RooflineConfig(compute_efficiency=0.05)),  # compute-bound decodes
]


@pytest.mark.parametrize("model", ROOFLINES, ids=["8b-h100", "70b-a100x4", "7b-h200-slow-compute"])
@settings(max_examples=60)
@given(st.integers(1, 256), st.integers(0, 400_000), st.integers(1, 300), st.one_of(st.none(), st.integers(1, 5 * 10**9)))
def test_decode_runs_equal_step_by_step_sums(model, num_seqs, ctx, max_steps, horizon):
    ctx = max(ctx, num_seqs)  # every sequence attends to at least itself
    run = model.decode_run(num_seqs, ctx, max_steps, horizon)
    assert tuple(run) == tuple(CostModelBase.decode_run(model, num_seqs, ctx, max_steps, horizon))
    # and the per-step time is the full step model's for that composition
    for i in (0, run.num_steps - 1):
        assert model.decode_step_ns(num_seqs, ctx + num_seqs * i) == model.step_time_ns(StepShape((), num_seqs, ctx + num_seqs * i))


def test_roofline_figures_by_hand():
    m = ROOFLINES[0]
    # decode of 1 sequence with 1,000 tokens of context, llama-3-8b on one H100 (memory-bound):
    # bytes = weights read (32 layers + LM head) + KV read = (32 x 218,112,000 + 128,256 x 4,096) x 2 + 1,000 x 131,072
    weights = (32 * 218_112_000 + 128_256 * 4096) * 2
    bytes_ = weights + 1000 * 131_072
    expected_ns = bytes_ / (3.35e12 * 0.8) * 1e9
    assert m.decode_step_ns(1, 1000) == pytest.approx(expected_ns, rel=1e-6)
    # prefill of 2,048 tokens alone (compute-bound): linear FLOPs 2 x 32 x 218,103,808 per token,
    # LM head 2 x 4096 x 128256 for the one sampled row, attention 4 x 32 heads x 128 x 32 layers per
    # (query, key) pair, 2048 x 2049 / 2 causal pairs. Per-unit costs are rounded to 1/1024 ns once
    # (an attention pair: 904.6 -> 905 ticks), hence the 5e-5 tolerance.
    flops = 2048 * 2 * 32 * 218_103_808 + 2 * 4096 * 128_256 + 4 * 32 * 128 * 32 * (2048 * 2049 // 2)
    assert m.step_time_ns(StepShape(((2048, 0),), 0, 0)) == pytest.approx(flops / (989e12 * 0.6) * 1e9, rel=5e-5)


def test_a_prefill_chunk_lengthens_the_step_for_every_decode():
    m = ROOFLINES[0]
    decodes = m.step_time_ns(StepShape((), 32, 32 * 2000))
    mixed = m.step_time_ns(StepShape(((1024, 0),), 32, 32 * 2000))
    assert mixed > 2 * decodes
    # attention is quadratic in a chunk: the second half of a prompt costs more than the first
    first = m.step_time_ns(StepShape(((1024, 0),), 0, 0))
    second = m.step_time_ns(StepShape(((1024, 1024),), 0, 0))
    assert second > first
    assert prefill_time_ns(m, 2048, 1024) == first + second


def test_constant_model_and_registry():
    c = ConstantCostModel(ConstantCostConfig(step_time_ns=7))
    assert c.step_time_ns(StepShape(((5, 0),), 3, 30)) == 7
    assert tuple(c.decode_run(3, 30, 10, 20)) == (3, 21, 7)
    assert tuple(c.decode_run(3, 30, 10, None)) == (10, 70, 7)
    with pytest.raises(ReplayError, match="unknown cost model 'magic'") as err:
        make_cost_model("magic", instance_config())
    assert "roofline" in err.value.hint and "profile" in err.value.hint
    with pytest.raises(ReplayError):
        ConstantCostModel(ConstantCostConfig(step_time_ns=0))


def test_an_all_reduce_is_one_shot_every_device_reads_each_peer_s_buffer():
    """Per token, two all-reduces per layer of hidden x 2 bytes, of which each device reads every peer's copy:
    llama-2-7b (32 layers, hidden 4096) on four H100s (450 GB/s each way) at half the link: 2 x 32 x 3 x 8,192
    bytes / 225 GB/s = 6.99 us a token (a ring would move 1.5 copies, not 3)."""
    config = RooflineConfig(interconnect_efficiency=0.5, allreduce_latency_ns=0)
    for tp, copies in ((2, 1), (4, 3)):
        units = RooflineCostModel(instance_config("llama-2-7b", "h100-sxm", tensor_parallel_size=tp), config).units
        assert units.comm_fixed == 0
        assert units.comm_token / TICKS_PER_NS == pytest.approx(2 * 32 * copies * 4096 * 2 / 225e9 * 1e9, rel=1e-3)
    assert RooflineCostModel(instance_config("llama-2-7b", "h100-sxm"), config).units.comm_token == 0


def test_tensor_parallelism_adds_all_reduces():
    one = RooflineCostModel(instance_config("llama-2-7b", "h100-sxm", engine=EngineConfig()))
    four = RooflineCostModel(instance_config("llama-2-7b", "h100-sxm", tensor_parallel_size=4))
    assert one.units.comm_fixed == 0 and four.units.comm_fixed > 0
    # sharding splits the weights read by four, so a small decode step is faster, but not 4x (all-reduces)
    assert one.decode_step_ns(1, 100) / 4 < four.decode_step_ns(1, 100) < one.decode_step_ns(1, 100)


def test_the_penalty_pass_costs_its_term_in_every_step_where_requests_carry_penalties():
    config = RooflineConfig(step_overhead_ns=100_000, penalty_overhead_ns=300_000)
    plain = RooflineCostModel(instance_config("llama-3-8b", "h100-sxm"), config)
    penalized = RooflineCostModel(instance_config("llama-3-8b", "h100-sxm", engine=EngineConfig(sampling_penalties=True)),
                                  config)
    for shape in (StepShape((), 1, 1000), StepShape((), 32, 64_000), StepShape(((512, 0),), 8, 8000)):
        assert penalized.step_time_ns(shape) - plain.step_time_ns(shape) == 300_000
    assert penalized.decode_run(16, 16_000, 50, None).duration_ns - plain.decode_run(16, 16_000, 50, None).duration_ns \
        == 50 * 300_000
    with pytest.raises(ReplayError, match=r"penalty_overhead_ns must be in \[0, 1,000,000,000\] ns, not -1"):
        RooflineConfig(penalty_overhead_ns=-1)
