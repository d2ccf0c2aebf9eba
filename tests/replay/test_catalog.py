"""Any model on any accelerator: config.json shapes (dense, MoE, fp8), the fidelity model table, presets,
engine specs, and a model too large for its accelerators."""

from __future__ import annotations

import json
import re

import pytest

from replay.catalog import fidelity_models, find_model, model_from_hf_config, parse_engine_spec, read_hf_config, resolve_instance
from replay.config import ACCELERATORS, EngineConfig, accelerator
from replay.costmodel import RooflineConfig, UnitCosts
from servelens.errors import ConfigError, ServelensError

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json (the fields the replay reads)
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_a_dense_config_json_by_hand(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_31_8B))
    m = read_hf_config(tmp_path / "llama")  # a folder holding config.json
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.num_experts) == (32, 8, 128, 0)
    # 32 x (4096*4096*2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 2 * 128256*4096 + 4096 = 8,030,261,248
    assert m.num_params == 8_030_261_248
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert read_hf_config(tmp_path / "llama" / "config.json").num_params == m.num_params  # the file itself


def test_a_mixture_of_experts_counts_every_expert_stored_and_top_k_active():
    m = model_from_hf_config(MIXTRAL_8X7B, "mixtral-8x7b")
    expert = 3 * 4096 * 14336
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert m.active_linear_params == 32 * (attention + 2 * expert)
    assert m.layers_params == 32 * (attention + 2 * 4096 + 8 * (expert + 4096))
    assert m.num_params / 1e9 == pytest.approx(46.70, abs=0.01)  # the published 46.7B
    assert m.expected_experts_touched(1) == pytest.approx(2.0)
    assert m.expected_experts_touched(64) == pytest.approx(8.0, abs=1e-6)  # every expert, once the batch is large


def test_llama_4_scout_from_its_text_config_with_a_shared_expert_and_fp8():
    config = {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "vocab_size": 202048, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1},
        "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}}}}
    m = model_from_hf_config(config, "scout")
    assert (m.num_experts, m.experts_per_token, m.num_shared_experts, m.num_moe_layers_resolved) == (16, 1, 1, 48)
    assert (m.bytes_per_param, m.compute_dtype) == (1, "fp8")
    assert m.active_linear_params / 1e9 == pytest.approx(15.1, abs=0.1)  # 17B active less the embeddings


def test_a_config_json_missing_a_field_names_it(tmp_path):
    broken = dict(LLAMA_31_8B)
    del broken["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        read_hf_config(path)
    with pytest.raises(ConfigError, match="no config.json"):
        read_hf_config(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", "32"), ("hidden_size", 0), ("num_attention_heads", -4), ("vocab_size", 1.5e5 + 0.5),
     ("intermediate_size", True), ("head_dim", float("inf")), ("num_key_value_heads", [8])],
)
def test_a_config_json_field_that_is_not_a_positive_whole_number_is_named(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"field '{field}' must be a positive whole number, not {value!r}")):
        model_from_hf_config({**LLAMA_31_8B, field: value}, "broken")
    assert model_from_hf_config({**LLAMA_31_8B, "hidden_size": 4096.0}, "m").hidden_size == 4096  # 4096.0 is whole


@pytest.mark.parametrize(("config", "message"), [
    ({**LLAMA_31_8B, "num_key_value_heads": 5}, "field 'num_key_value_heads' \\(5\\) must divide 'num_attention_heads' \\(32\\)"),
    ({**LLAMA_31_8B, "num_key_value_heads": 64}, "field 'num_key_value_heads' \\(64\\) must divide"),
    ({**LLAMA_31_8B, "num_key_value_heads": 0}, "field 'num_key_value_heads' must be a positive whole number, not 0"),
    ({**LLAMA_31_8B, "tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false, not 'false'"),
    ({**LLAMA_31_8B, "text_config": "x"}, "field 'text_config' must be an object"),
    ({**LLAMA_31_8B, "text_config": [1]}, "field 'text_config' must be an object"),
    ({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"}, "missing field 'num_experts_per_tok'"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "field 'num_experts_per_tok' \\(9\\) is more than the model's experts \\(8\\)"),
    ({**MIXTRAL_8X7B, "first_k_dense_replace": 64}, "field 'first_k_dense_replace' \\(64\\) leaves no mixture-of-experts layer"),
    ({**MIXTRAL_8X7B, "model_type": "llama4_text", "interleave_moe_layer_step": 64},
     "field 'interleave_moe_layer_step' \\(64\\) leaves no mixture-of-experts layer in 32 layers"),
])
def test_a_config_json_vllm_could_not_serve_is_refused_naming_the_field(tmp_path, config, message):
    """Before, each of these was replayed: KV heads that do not divide the query heads (vLLM refuses them), 0 KV
    heads read as one per query head, the text "false" read as true, an expert count per token defaulted to 1,
    and more dense layers than layers gave a negative weight count (an ITL of 0.9 ms on an 8B shape)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"^{path}: {message}") as err:
        read_hf_config(path)
    assert err.value.hint


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_as_vllm_does():
    with pytest.raises(ConfigError, match="32 attention heads, which a tensor-parallel size of 3 does not divide") as err:
        resolve_instance("llama-3-8b@h100", tensor_parallel_size=3)
    assert "1, 2, 4, 8" in (err.value.hint or "")
    assert resolve_instance("llama-3-8b@h100", tensor_parallel_size=4).accelerator.tensor_parallel_size == 4


def test_fewer_kv_heads_than_devices_are_replicated_as_vllm_does(tmp_path):
    def instance(kv_heads: int, tp: int, heads: int = 32):
        path = tmp_path / f"kv{kv_heads}-h{heads}.json"
        path.write_text(json.dumps({**LLAMA_31_8B, "num_key_value_heads": kv_heads, "num_attention_heads": heads,
                                    "head_dim": 128}))  # 48 heads do not divide 4096: a head width is given
        return resolve_instance(f"{path}@h100x{tp}")

    two, four = instance(2, 4), instance(4, 4)  # 2 KV heads on 4 devices: each device holds one, each head twice
    assert (two.kv_head_replicas, four.kv_head_replicas, instance(2, 2).kv_head_replicas) == (2, 1, 1)
    assert two.kv_bytes_per_token == 2 * two.model.kv_bytes_per_token == four.kv_bytes_per_token
    assert two.num_kv_blocks == pytest.approx(four.num_kv_blocks, rel=0.01)  # the same KV bytes a token, all devices
    assert UnitCosts(two, RooflineConfig()).kv_token == UnitCosts(four, RooflineConfig()).kv_token  # and reads
    with pytest.raises(ConfigError, match="has 8 KV heads, which a tensor-parallel size of 12 neither divides"):
        instance(8, 12, heads=48)


def test_every_fidelity_model_resolves_by_id_or_short_name(shared):
    models = fidelity_models(shared)
    assert len(models) == 13
    assert find_model("meta-llama/Llama-3.1-8B-Instruct", shared) == models["meta-llama/Llama-3.1-8B-Instruct"]
    assert find_model("llama-3.1-8b-instruct", shared).num_params == models["meta-llama/Llama-3.1-8B-Instruct"].num_params
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'") as err:
        find_model("gpt-5", shared)
    assert "Qwen/Qwen2.5-7B-Instruct" in err.value.hint and "llama-3-8b" in err.value.hint


def test_every_fidelity_model_replays_on_every_accelerator_that_holds_it(shared):
    """On each accelerator, the fewest tensor-parallel devices that hold the model give a KV pool; a model
    that never fits says so with its sizes."""
    for name in fidelity_models(shared):
        for accel in ACCELERATORS:
            for tp in (1, 2, 4, 8):
                try:
                    instance = resolve_instance(f"{name}@{accel}x{tp}", shared=shared)
                except ServelensError as exc:
                    assert "does not fit" in str(exc) and "GiB of weights" in str(exc), str(exc)
                    continue
                assert instance.num_kv_blocks > 0
                break
            else:
                pytest.fail(f"{name} fits no {accel} instance of up to 8 devices")


def test_a_model_too_large_says_how_large():
    with pytest.raises(ServelensError) as err:
        resolve_instance("llama-2-70b@l40s")
    assert "does not fit on 1 x l40s" in err.value.message and "128.5 GiB of weights" in err.value.message
    assert "43.2 GiB usable" in err.value.message


def test_engine_specs_and_accelerator_aliases():
    assert parse_engine_spec("llama-2-70b@a100-80gx2") == ("llama-2-70b", "a100-80g", 2)
    assert parse_engine_spec("meta-llama/Llama-3.1-8B-Instruct@H100") == ("meta-llama/Llama-3.1-8B-Instruct", "H100", 1)
    assert parse_engine_spec("m@h100-sxm") == ("m", "h100-sxm", 1)
    assert accelerator("H100").name == "h100-sxm" and accelerator("A100-40GB").name == "a100-40g"
    with pytest.raises(ServelensError, match="unknown accelerator 'tpu-v5'"):
        accelerator("tpu-v5")
    with pytest.raises(ConfigError, match="is not MODEL@ACCELERATOR"):
        parse_engine_spec("llama-3-8b")


def test_dtypes_and_parallelism_reach_the_instance():
    fp8 = resolve_instance("llama-3-8b@h100x2", weight_dtype="fp8", kv_cache_dtype="fp8", pipeline_parallel_size=2)
    assert (fp8.model.bytes_per_param, fp8.model.compute_dtype, fp8.model.kv_bytes_per_element) == (1, "fp8", 1)
    assert (fp8.accelerator.tensor_parallel_size, fp8.accelerator.pipeline_parallel_size) == (2, 2)
    assert fp8.accelerator.peak_flops("fp8") == 1979e12 and accelerator("a100-80g").peak_flops("fp8") == 312e12
    bf16 = resolve_instance("llama-3-8b@h100x2", engine=EngineConfig(max_num_seqs=7))
    assert fp8.num_kv_blocks > 2 * bf16.num_kv_blocks  # half the weights and half the KV bytes on 4 devices
    assert bf16.engine.max_num_seqs == 7
    with pytest.raises(ConfigError, match="unknown weight dtype 'int3'"):
        resolve_instance("llama-3-8b@h100", weight_dtype="int3")


def test_a_repetition_penalty_in_generation_config_json_marks_the_model_s_requests(tmp_path):
    """vLLM's --generation-config auto serves a checkpoint's generation_config.json to requests that set no
    sampling parameters (inference-perf's): a repetition penalty there means a penalty pass in every step."""
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert not read_hf_config(folder).sampling_penalties  # no generation_config.json: vLLM's defaults
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.0, "top_p": 0.9}))
    assert not read_hf_config(folder).sampling_penalties  # 1.0 is no penalty; top-p alone is none
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.05, "top_k": 20}))
    assert read_hf_config(folder).sampling_penalties
    assert read_hf_config(folder / "config.json").sampling_penalties  # the file's folder is read the same
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": "high"}))
    with pytest.raises(ConfigError, match="repetition_penalty must be a number above 0, not 'high'"):
        read_hf_config(folder)
    (folder / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="generation_config.json is not valid JSON"):
        read_hf_config(folder)


def test_the_fidelity_models_penalized_are_those_whose_checkpoints_publish_a_penalty(shared):
    models = fidelity_models(shared)
    assert {name for name, m in models.items() if m.sampling_penalties} == {"Qwen/Qwen2.5-7B-Instruct"}
    qwen = resolve_instance("Qwen/Qwen2.5-7B-Instruct@h100", shared=shared)
    assert qwen.sampling_penalties
    off = resolve_instance("Qwen/Qwen2.5-7B-Instruct@h100", EngineConfig(sampling_penalties=False), shared)
    assert not off.sampling_penalties  # the engine's setting wins (--generation-config vllm)
    assert resolve_instance("llama-3-8b@h100", EngineConfig(sampling_penalties=True)).sampling_penalties


def test_a_name_too_long_for_a_path_is_an_unknown_model_shortened():
    with pytest.raises(ConfigError) as err:
        find_model("a" * 100_000)
    assert err.value.message == f"unknown model '{'a' * 100}... (100,000 characters)'"
