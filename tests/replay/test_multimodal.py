"""Multimodal requests: image tokens from the scenario, their encoder work charged to the first prefill step."""

from __future__ import annotations

from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.scenario import Scenario, image_tokens
from tests.replay.conftest import make_workload, replay

MS = 1_000_000


def test_image_tokens_are_drawn_for_the_scenario_share():
    assert image_tokens(Scenario(), 0, 0, 100) is None
    drawn = image_tokens(Scenario(image_share=0.3, image_tokens=576), seed=2, row_offset=0, n=4000)
    assert set(drawn) == {0, 576} and 0.27 < sum(1 for x in drawn if x) / 4000 < 0.33
    # batch-independent: a later batch draws what the whole would have
    assert image_tokens(Scenario(image_share=0.3), 2, 1000, 50) == drawn[1000:1050]


def test_the_encoder_lengthens_the_first_prefill_step_by_hand(tmp_path):
    # 10 ms steps; 576 image tokens at 10 us each: 5.76 ms of encoder work in the first prefill step
    engine = EngineConfig(encoder_s_per_image_token=1e-5, max_num_batched_tokens=256)
    inst = instance_config(engine=engine)
    w = make_workload([0, 100 * MS], [600, 100], [3, 3])
    for mode in ("fast", "reference"):
        out = replay(w, tmp_path / mode, instance=inst, cost_model="constant",
                     cost_model_config=ConstantCostConfig(step_time_ns=10 * MS), mode=mode,
                     scenario=Scenario(image_share=1.0, image_tokens=576))
        # r0: three prefill chunks (256 + 256 + 88): the first step carries the encoder, the next two do not
        assert out.row("r0")["first_token_ns"] == 30 * MS + 5_760_000
        assert out.row("r0")["last_token_ns"] == 50 * MS + 5_760_000
        assert out.row("r1")["first_token_ns"] == 100 * MS + 10 * MS + 5_760_000
    plain = replay(w, tmp_path / "plain", instance=inst, cost_model="constant",
                   cost_model_config=ConstantCostConfig(step_time_ns=10 * MS))
    assert plain.row("r0")["first_token_ns"] == 30 * MS  # no images: no encoder
