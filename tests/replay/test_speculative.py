"""Speculative decoding per request: expected tokens, the deterministic token schedule, the step's cost,
hand-checked timelines (speculating, not speculating, both in one batch), the admission cap, memory."""

from __future__ import annotations

import dataclasses

import pytest

from replay.config import EngineConfig, ModelConfig, SpeculativeConfig, instance_config
from replay.cost_models import make_cost_model
from replay.costmodel import ConstantCostConfig, RooflineCostModel, StepShape
from replay.errors import ReplayError
from replay.policies.base import POLICIES, AdmissionDecision, Policy
from replay.speculative import SpeculativeCostModel, step_advance, tokens_after_steps
from replay.views import EngineView, RequestView
from tests.replay.conftest import make_workload

MS = 1_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}

# Llama-3.2-1B's shape (tied embeddings counted twice here: the draft's weights are a little high)
DRAFT = ModelConfig(name="draft-1b", num_layers=16, hidden_size=2048, num_attention_heads=32, num_kv_heads=8, head_dim=64,
                    intermediate_size=8192, vocab_size=128256)


def _spec(k: int = 3, alpha: float = 0.5, **kwargs):
    return dataclasses.replace(instance_config(**kwargs),
                               speculative=SpeculativeConfig(draft=DRAFT, num_speculative_tokens=k, acceptance_rate=alpha))


class _DraftsOff(Policy):
    """Test policy: turns speculation off for the odd-numbered requests (r1, r3, ...), as a degrade."""

    name = "test-drafts-off"

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        if int(request.request_id[1:]) % 2:
            return AdmissionDecision(decision="degrade", num_speculative_tokens=0, reason="test")
        return AdmissionDecision(decision="accept")


class _DraftsUp(Policy):
    """Test policy: asks for more speculative tokens than the instance drafts (the engine must refuse)."""

    name = "test-drafts-up"

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        return AdmissionDecision(decision="degrade", num_speculative_tokens=view.instance.speculative.num_speculative_tokens + 1
                                 if view.instance.speculative else 1)


@pytest.fixture(autouse=True)
def _test_policies():
    """The two test policies, registered for this module's tests only."""
    for cls in (_DraftsOff, _DraftsUp):
        POLICIES[cls.name] = cls
    yield
    for cls in (_DraftsOff, _DraftsUp):
        del POLICIES[cls.name]


def test_expected_tokens_per_step_is_the_sum_of_powers_of_the_acceptance_rate():
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=3, acceptance_rate=0.5).expected_tokens_per_step == 1.875
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4, acceptance_rate=0.0).expected_tokens_per_step == 1
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4, acceptance_rate=1.0).expected_tokens_per_step == 5
    # per request: k_r = 1 gives 1 + 0.5; k_r = 0 (speculation off) one token per step
    config = SpeculativeConfig(draft=DRAFT, num_speculative_tokens=3, acceptance_rate=0.5)
    assert config.expected_tokens(1) == 1.5 and config.expected_tokens(0) == 1
    with pytest.raises(ReplayError):
        SpeculativeConfig(draft=DRAFT, num_speculative_tokens=0)
    with pytest.raises(ReplayError):
        SpeculativeConfig(draft=DRAFT, acceptance_rate=1.5)


def test_the_token_schedule_is_deterministic_floor_of_steps_times_e():
    # E = 1.875: floor(n x 1.875) for n = 1..9 is 1, 3, 5, 7, 9, 11, 13, 15, 16, so the steps deliver
    # 1, 2, 2, 2, 2, 2, 2, 2, 1 (15 tokens in 8 steps: 1.875 per step)
    assert [tokens_after_steps(1.875, n) for n in range(10)] == [0, 1, 3, 5, 7, 9, 11, 13, 15, 16]
    assert [step_advance(1.875, n) for n in range(1, 10)] == [1, 2, 2, 2, 2, 2, 2, 2, 1]
    # E = 2.7731 (k = 4, alpha = 0.7): floor(n x E) = 2, 5, 8, 11, 13: steps of 2, 3, 3, 3, 2
    e = SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4, acceptance_rate=0.7).expected_tokens_per_step
    assert [step_advance(e, n) for n in range(1, 6)] == [2, 3, 3, 3, 2]
    assert step_advance(1.0, 7) == 1  # every draft rejected (or k_r = 0): one token per step


def test_a_step_costs_the_draft_passes_and_one_target_pass_with_the_verification():
    model = make_cost_model("constant", _spec(), config=ConstantCostConfig(step_time_ns=10 * MS))
    assert isinstance(model, SpeculativeCostModel)
    # plain decodes only (every request's drafts off): the target's step alone
    assert model.step_time_ns(StepShape((), 4, 400)) == 10 * MS
    # 4 speculating sequences with k = 3: 3 draft passes + one verification pass, 10 ms each
    assert model.step_time_ns(StepShape((), 0, 0, ((3, 4, 400),))) == 40 * MS
    # prefill chunks, plain decodes and the verification share the one target pass
    assert model.step_time_ns(StepShape(((100, 0),), 2, 200, ((3, 4, 400),))) == 40 * MS
    # groups with k = 1 and k = 3: the draft runs max k = 3 passes over all of them
    assert model.step_time_ns(StepShape((), 0, 0, ((1, 1, 100), (3, 1, 100)))) == 40 * MS
    assert model.step_time_ns(StepShape(((100, 0),), 0, 0)) == 10 * MS  # no decodes: no speculation
    assert StepShape((), 2, 200, ((3, 4, 400),)).num_tokens == 2 + 4 * 4  # verification tokens go through the target
    assert "speculative" in model.info().name and ("draft", "draft-1b") in model.info().parameters


def test_the_step_cost_with_the_roofline_adds_the_drafts_to_a_target_pass_with_verification_chunks():
    inst = _spec(k=3, alpha=0.5)
    model = make_cost_model("roofline", inst)
    target = RooflineCostModel(dataclasses.replace(inst, speculative=None))
    draft = RooflineCostModel(dataclasses.replace(inst, speculative=None, model=DRAFT))
    # 2 sequences with 999 computed tokens each (context 1,000 each): 3 draft passes over 2 sequences at
    # summed context 2,000, 2,002, 2,004; the target verifies 4 tokens after 999 for each, beside a plain decode
    drafts = sum(draft.decode_step_ns(2, 2000 + 2 * i) for i in range(3))
    verify = target.step_time_ns(StepShape(((4, 999), (4, 999)), 1, 500))
    assert model.step_time_ns(StepShape((), 1, 500, ((3, 2, 2000),))) == drafts + verify


def test_a_replay_with_speculation_times_its_tokens_by_hand(run):
    # one request, 100 prompt + 5 output tokens, constant 10 ms passes, k = 3, alpha = 0.5 (E = 1.875):
    # the prefill step (10 ms) samples token 1; each decode step is 3 draft passes + 1 verification =
    # 40 ms and delivers 1, 2, then 2 capped at the 1 left (schedule 1, 2, 2): tokens at 50, 90, 130 ms
    w = make_workload([0], [100], [5])
    for mode in ("fast", "reference"):
        out = run(w, instance=_spec(), mode=mode, check_invariants=True, **CONSTANT)
        row = out.row("r0")
        assert row["first_token_ns"] == 10 * MS
        assert row["last_token_ns"] == 130 * MS and row["num_output_tokens"] == 5
        assert [(e["ts_ns"], e["num_tokens"]) for e in out.of_type("tokens_delivered")] == [
            (50 * MS, 1), (90 * MS, 2), (130 * MS, 1)]
        steps = out.of_type("step_executed")
        assert [s["num_steps"] for s in steps] == [1, 1, 1, 1]  # one pass at a time, in both modes
        assert [s["request_num_tokens"] for s in steps[1:]] == [[4], [4], [4]]  # k + 1 verified per step


def test_a_request_with_its_drafts_off_decodes_one_token_per_shorter_step(run):
    # r0 speculates (k = 3), r1's admission turned its drafts off (test policy). Both arrive at 0 with
    # 100 prompt + 5 output tokens. Step 1 prefills both (10 ms): first tokens at 10 ms. Then each step
    # runs 3 draft passes (for r0) + one target pass = 40 ms: r0 advances 1, 2, 1 (capped), done at
    # 130 ms; r1 advances 1 per step: 3 tokens by 130 ms, then alone, plain: one 10 ms step -> 140 ms
    w = make_workload([0, 0], [100, 100], [5, 5])
    for mode in ("fast", "reference"):
        out = run(w, instance=_spec(), policy_name="test-drafts-off", mode=mode, check_invariants=True, **CONSTANT)
        assert out.row("r0")["last_token_ns"] == 130 * MS
        assert out.row("r1")["last_token_ns"] == 140 * MS
        assert out.row("r1")["num_output_tokens"] == 5
        r1 = [(e["ts_ns"], e["num_tokens"]) for e in out.of_type("tokens_delivered") if e["request_id"] == "r1"]
        assert r1 == [(50 * MS, 1), (90 * MS, 1), (130 * MS, 1), (140 * MS, 1)]
        (decision,) = [e for e in out.of_type("admission_decided") if e["request_id"] == "r1"]
        assert decision["decision"] == "degrade"


def test_every_request_with_its_drafts_off_costs_what_an_instance_without_speculation_does(run):
    # with the roofline: the target's step alone when nobody speculates (same KV pool for both)
    engine = EngineConfig(num_kv_blocks_override=2000)
    w = make_workload([0, 0, 5 * MS, 20 * MS], [300, 50, 700, 120], [9, 20, 3, 15], request_id=["r1", "r3", "r5", "r7"])
    plain = run(w, instance=instance_config(engine=engine))
    off = run(w, instance=_spec(engine=engine), policy_name="test-drafts-off")
    for rid in ("r1", "r3", "r5", "r7"):
        for column in ("first_token_ns", "last_token_ns", "num_output_tokens"):
            assert off.row(rid)[column] == plain.row(rid)[column], (rid, column)


def test_speculation_pays_off_only_when_drafts_are_accepted():
    plain = RooflineCostModel(instance_config())
    shape = StepShape((), 8, 8 * 1000)
    spec_shape = StepShape((), 0, 0, ((4, 8, 8 * 1000),))
    good = make_cost_model("roofline", _spec(k=4, alpha=0.8))
    bad = make_cost_model("roofline", _spec(k=4, alpha=0.0))
    # memory-bound small batch: 4 cheap draft passes + one verification yield 3.36 tokens per sequence
    assert good.step_time_ns(spec_shape) / 3.3616 < plain.step_time_ns(shape)
    assert bad.step_time_ns(spec_shape) / 1 > plain.step_time_ns(shape)  # every draft rejected: all cost, one token


def test_a_degrade_may_lower_the_speculative_tokens_never_raise_them(run):
    w = make_workload([0], [100], [5])
    with pytest.raises(ReplayError, match="not raise them"):
        run(w, instance=_spec(), policy_name="test-drafts-up", **CONSTANT)
    with pytest.raises(ReplayError, match="not raise them"):  # a plain instance's requests have k = 0
        run(w, instance=instance_config(), policy_name="test-drafts-up", **CONSTANT)
    with pytest.raises(ReplayError):
        AdmissionDecision(decision="degrade", num_speculative_tokens=-1)
    with pytest.raises(ReplayError):
        AdmissionDecision(decision="accept", num_speculative_tokens=0)
    assert AdmissionDecision(decision="degrade", num_speculative_tokens=0).max_output_tokens is None


def test_a_measured_clock_refuses_a_speculative_instance(run):
    # the measured executor runs the target model only: its clock would omit the drafts
    with pytest.raises(ReplayError, match="not speculative drafts"):
        run(make_workload([0], [100], [5]), instance=_spec(), mode="reference", step_timer=lambda shape, scheduled: MS)


def test_fast_and_reference_agree_on_a_speculative_instance(run):
    # a few hundred requests on a small pool (preemptions, recomputed speculating requests): per-request
    # timestamps and token counts identical
    import numpy as np

    rng = np.random.default_rng(11)
    n = 200
    w = make_workload(sorted(int(x) for x in rng.integers(0, 2_000 * MS, n)), [int(x) for x in rng.integers(20, 1500, n)],
                      [int(x) for x in rng.integers(1, 300, n)])
    inst = _spec(k=4, alpha=0.7, engine=EngineConfig(num_kv_blocks_override=300))
    fast = run(w, instance=inst, policy_name="test-drafts-off", check_invariants=True)
    ref = run(w, instance=inst, policy_name="test-drafts-off", mode="reference")
    assert fast.summary.num_preemptions > 0
    for column in ("first_token_ns", "last_token_ns", "finish_ns", "num_output_tokens", "num_preemptions"):
        assert fast.requests[column].equals(ref.requests[column]), column
    assert fast.requests["num_output_tokens"].to_pylist() == w["num_output_tokens"].to_pylist()


def test_the_draft_weights_take_memory_from_the_kv_pool():
    inst, spec = instance_config(), _spec()
    block_bytes = inst.model.kv_bytes_per_token * inst.engine.block_size_tokens
    lost = inst.num_kv_blocks - spec.num_kv_blocks
    assert lost in (DRAFT.weight_bytes // block_bytes, DRAFT.weight_bytes // block_bytes + 1)
