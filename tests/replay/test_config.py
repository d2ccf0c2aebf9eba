"""Instance configuration: presets, derived sizes (checked by hand), clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from replay.config import (
    ACCELERATORS,
    GIB,
    MODELS,
    AcceleratorConfig,
    EngineConfig,
    FrontendConfig,
    InstanceConfig,
    ModelConfig,
    instance_config,
    parse_instance,
)
from replay.errors import ReplayError
from schemas.types import field_specs


def test_every_field_has_help_text():
    for cls in (AcceleratorConfig, ModelConfig, EngineConfig, InstanceConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name}"


def test_llama_3_8b_shape_by_hand():
    m = MODELS["llama-3-8b"]
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert m.kv_bytes_per_token == 131_072
    # per layer: q 4096*4096 + kv 2*4096*1024 + o 4096*4096 + mlp 3*4096*14336 + 2 norms of 4096
    assert m.num_layer_params == 16_777_216 + 8_388_608 + 16_777_216 + 176_160_768 + 8_192
    # 32 layers + embedding and LM head (128256 x 4096 each) + final norm: the published 8.03B
    assert m.num_params == 8_030_261_248
    assert MODELS["llama-2-7b"].num_params == 6_738_415_616  # the published 6.74B
    assert MODELS["llama-2-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_kv_capacity_by_hand():
    inst = instance_config("llama-3-8b", "h100-sxm")
    usable = int(80 * GIB * 0.9)
    free = usable - 8_030_261_248 * 2 - 2 * GIB
    assert inst.num_kv_blocks == free // (131_072 * 16) == 28_181
    override = instance_config(engine=EngineConfig(num_kv_blocks_override=100))
    assert override.num_kv_blocks == 100
    tp2 = instance_config("llama-2-70b", "a100-80g", tensor_parallel_size=2)
    assert tp2.accelerator.tensor_parallel_size == 2 and tp2.num_kv_blocks > 0


def test_a_model_that_does_not_fit_says_so():
    with pytest.raises(ReplayError, match="does not fit on 1 x a100-80g") as err:
        _ = instance_config("llama-2-70b", "a100-80g").num_kv_blocks
    assert "tensor parallelism" in err.value.hint


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ReplayError, match="unknown model 'gpt-5'") as err:
        instance_config("gpt-5")
    assert all(name in err.value.hint for name in MODELS)
    with pytest.raises(ReplayError, match="unknown accelerator 'tpu'") as err:
        instance_config("llama-3-8b", "tpu")
    assert all(name in err.value.hint for name in ACCELERATORS)


def test_engine_spec_strings():
    a = parse_instance("llama-2-70b@a100-80gx2")
    assert (a.model.name, a.accelerator.name, a.accelerator.tensor_parallel_size) == ("llama-2-70b", "a100-80g", 2)
    b = parse_instance("llama-3-8b@h200")
    assert (b.accelerator.name, b.accelerator.tensor_parallel_size) == ("h200", 1)
    with pytest.raises(ReplayError, match="not MODEL@ACCELERATOR"):
        parse_instance("llama-3-8b")


def test_engine_defaults_are_vllm_v1s_and_validated():
    e = EngineConfig()
    assert (e.max_num_batched_tokens, e.max_num_seqs, e.block_size_tokens) == (2048, 128, 16)
    assert e.enable_chunked_prefill and e.enable_prefix_caching and e.preemption_mode == "recompute"
    for bad in ({"max_num_seqs": 0}, {"gpu_memory_utilization": 1.5}, {"preemption_mode": "migrate"},
                {"kv_watermark_fraction": 1.0}, {"activation_reserve_bytes": -1}, {"encoder_s_per_image_token": -0.1}):
        with pytest.raises(ReplayError):
            EngineConfig(**bad)


def test_configs_are_frozen_and_slotted():
    e = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.max_num_seqs = 3  # type: ignore[misc]
    assert not hasattr(e, "__dict__")
    assert [s.name for s in field_specs(EngineConfig)][:2] == ["max_num_batched_tokens", "max_num_seqs"]


def test_settings_that_are_infinite_or_beyond_any_engine_are_refused():
    """Infinities passed the positive and non-negative checks and then crashed a replay converting them to integer
    nanoseconds (an internal OverflowError)."""
    with pytest.raises(ReplayError, match="swap_bandwidth_bytes_per_s must be positive and finite, not inf"):
        EngineConfig(swap_bandwidth_bytes_per_s=float("inf"))
    with pytest.raises(ReplayError, match="request_jitter_s must be >= 0 and finite, not inf"):
        FrontendConfig(request_jitter_s=float("inf"))
    with pytest.raises(ReplayError, match="request_overhead_s must be at most 60 s, not 1e\\+30"):
        FrontendConfig(request_overhead_s=1e30)
    assert FrontendConfig(request_overhead_s=60.0).request_overhead_s == 60.0
