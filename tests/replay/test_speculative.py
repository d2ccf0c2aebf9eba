"""Speculative decoding: expected tokens per step, the step's cost, hand-checked timelines, memory."""

from __future__ import annotations

import dataclasses

import pytest

from replay.config import ModelConfig, SpeculativeConfig, instance_config
from replay.costmodel import ConstantCostConfig, RooflineCostModel, StepShape, make_cost_model
from replay.errors import ReplayError
from replay.speculative import SpeculativeCostModel
from tests.replay.conftest import make_workload, replay

MS = 1_000_000

# Llama-3.2-1B's shape (tied embeddings counted twice here: the draft's weights are a little high)
DRAFT = ModelConfig(name="draft-1b", num_layers=16, hidden_size=2048, num_attention_heads=32, num_kv_heads=8, head_dim=64,
                    intermediate_size=8192, vocab_size=128256)


def _spec(k: int = 3, alpha: float = 0.5, **kwargs):
    return dataclasses.replace(instance_config(**kwargs),
                               speculative=SpeculativeConfig(draft=DRAFT, num_speculative_tokens=k, acceptance_rate=alpha))


def test_expected_tokens_per_step_is_the_sum_of_powers_of_the_acceptance_rate():
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=3, acceptance_rate=0.5).expected_tokens_per_step == 1.875
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4, acceptance_rate=0.0).expected_tokens_per_step == 1
    assert SpeculativeConfig(draft=DRAFT, num_speculative_tokens=4, acceptance_rate=1.0).expected_tokens_per_step == 5
    with pytest.raises(ReplayError):
        SpeculativeConfig(draft=DRAFT, num_speculative_tokens=0)
    with pytest.raises(ReplayError):
        SpeculativeConfig(draft=DRAFT, acceptance_rate=1.5)


def test_a_step_costs_k_draft_passes_and_a_verification_over_the_expected_tokens():
    model = make_cost_model("constant", _spec(), config=ConstantCostConfig(step_time_ns=10 * MS))
    assert isinstance(model, SpeculativeCostModel)
    # decode only: (3 x 10 ms + 10 ms) / 1.875
    assert model.step_time_ns(StepShape((), 4, 400)) == round(40 * MS / 1.875)
    # with a prefill chunk: the chunk in full, the drafts and the rest of the shared pass per expected token
    assert model.step_time_ns(StepShape(((100, 0),), 4, 400)) == 10 * MS + round(30 * MS / 1.875)
    assert model.step_time_ns(StepShape(((100, 0),), 0, 0)) == 10 * MS  # no decodes: no speculation
    run = model.decode_run(4, 400, 7, None)
    assert run.num_steps == 7 and run.duration_ns == 7 * round(40 * MS / 1.875)
    assert "speculative" in model.info().name and ("draft", "draft-1b") in model.info().parameters


def test_a_replay_with_speculation_times_its_tokens_by_hand():
    import tempfile
    from pathlib import Path

    w = make_workload([0], [100], [5])
    for mode in ("fast", "reference"):
        with tempfile.TemporaryDirectory() as tmp:
            out = replay(w, Path(tmp), instance=_spec(), cost_model="constant",
                         cost_model_config=ConstantCostConfig(step_time_ns=10 * MS), mode=mode)
            row = out.row("r0")
            assert row["first_token_ns"] == 10 * MS  # the prefill step
            assert row["last_token_ns"] == 10 * MS + 4 * round(40 * MS / 1.875)  # four decode steps


def test_speculation_pays_off_only_when_drafts_are_accepted():
    plain = RooflineCostModel(instance_config())
    shape = StepShape((), 8, 8 * 1000)
    good = make_cost_model("roofline", _spec(k=4, alpha=0.8))
    bad = make_cost_model("roofline", _spec(k=4, alpha=0.0))
    # memory-bound small batch: 4 cheap draft passes + one verification yield 3.36 tokens
    assert good.step_time_ns(shape) < plain.step_time_ns(shape)
    assert bad.step_time_ns(shape) > plain.step_time_ns(shape)  # every draft rejected: all cost, one token


def test_the_draft_weights_take_memory_from_the_kv_pool():
    inst, spec = instance_config(), _spec()
    block_bytes = inst.model.kv_bytes_per_token * inst.engine.block_size_tokens
    lost = inst.num_kv_blocks - spec.num_kv_blocks
    assert lost in (DRAFT.weight_bytes // block_bytes, DRAFT.weight_bytes // block_bytes + 1)
