"""vLLM's settings by vLLM's names: an engine YAML read with dashes or underscores, typed, and bad values named."""

from __future__ import annotations

import re

import pytest

from replay.vllm import VllmSettings, read_vllm_settings, vllm_instance
from servelens.errors import ConfigError


def test_an_engine_file_takes_vllm_serve_keys_with_dashes_or_underscores(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("model: meta-llama/Llama-3.1-8B-Instruct\naccelerator: h100\nmax-num-seqs: 64\n"
                    "max_num_batched_tokens: 4096\ngpu-memory-utilization: 1\nenable-prefix-caching: false\n")
    settings, spec = read_vllm_settings(path)
    assert spec == "meta-llama/Llama-3.1-8B-Instruct@h100"
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (64, 4096)
    assert settings.gpu_memory_utilization == 1.0 and isinstance(settings.gpu_memory_utilization, float)
    assert settings.enable_prefix_caching is False
    engine = settings.engine()
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.gpu_memory_utilization) == (64, 4096, 1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seqs: lots\n", "max_num_seqs must be int, not 'lots'"),
        ("gpu-memory-utilization: true\n", "gpu_memory_utilization must be float, not True"),
        ("engine: 5\n", "engine must be text, not 5"),
        ("model: llama-3-8b\n", "'model' needs 'accelerator'"),
        ("max-num-sequences: 8\n", "unknown setting(s) max_num_sequences"),
        ("- a\n- b\n", "an engine file is a mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_a_bad_engine_file_is_named(tmp_path, text, message):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_vllm_settings(path)


def test_parallel_sizes_below_one_are_refused_before_an_instance_is_built():
    assert vllm_instance("llama-3-8b@h100", VllmSettings(tensor_parallel_size=2)).accelerator.tensor_parallel_size == 2
    for settings in (VllmSettings(tensor_parallel_size=0), VllmSettings(pipeline_parallel_size=-1)):
        with pytest.raises(ConfigError, match="must be at least 1"):
            vllm_instance("llama-3-8b@h100", settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (VllmSettings(max_num_seqs=0), "--max-num-seqs must be at least 1, not 0"),
        (VllmSettings(max_num_batched_tokens=-4), "--max-num-batched-tokens must be at least 1, not -4"),
        (VllmSettings(num_gpu_blocks_override=0), "--num-gpu-blocks-override must be at least 1, not 0"),
        (VllmSettings(block_size=0), "--block-size 0 is not one of vLLM's block sizes"),
        (VllmSettings(block_size=24), "--block-size 24 is not one of vLLM's block sizes"),
        (VllmSettings(gpu_memory_utilization=0.0), "--gpu-memory-utilization must be in (0, 1], not 0.0"),
        (VllmSettings(kv_offloading_size=-1.0), "--kv-offloading-size must be between 0 and 65,536 GiB, not -1"),
        (VllmSettings(kv_offloading_size=1e30), "--kv-offloading-size must be between 0 and 65,536 GiB, not 1e+30"),
        # vLLM's SchedulerConfig refuses a step budget below the batch; the default budget (8192 on an H100) counts
        (VllmSettings(max_num_batched_tokens=2048, max_num_seqs=4096),
         "--max-num-batched-tokens 2048 is below --max-num-seqs 4096"),
        (VllmSettings(max_num_seqs=9000), "--max-num-batched-tokens 8192 is below --max-num-seqs 9000"),
    ],
)
def test_settings_vllm_refuses_are_refused_by_their_option_names_with_a_hint(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        vllm_instance("llama-3-8b@h100", settings)
    assert caught.value.hint


@pytest.mark.parametrize(
    ("accelerator", "budget", "seqs"),
    # vllm serve's defaults (EngineArgs, v0.10-v0.15): 8192 / 1024 on a device of >= 70 GiB that is not an A100
    [("h100", 8192, 1024), ("h100-pcie", 8192, 1024), ("h200", 8192, 1024), ("b200", 8192, 1024),
     ("a100-80g", 2048, 256), ("a100-40g", 2048, 256), ("l40s", 2048, 256)],
)
def test_what_is_not_given_is_what_vllm_serve_picks_on_that_device(accelerator, budget, seqs):
    engine = vllm_instance(f"llama-3-8b@{accelerator}").engine
    assert (engine.max_num_batched_tokens, engine.max_num_seqs) == (budget, seqs)
    # a budget given and no batch: vLLM caps the batch at the budget; a batch given keeps the device's budget
    assert vllm_instance(f"llama-3-8b@{accelerator}", VllmSettings(max_num_batched_tokens=64)).engine.max_num_seqs == 64
    given = vllm_instance(f"llama-3-8b@{accelerator}", VllmSettings(max_num_seqs=32)).engine
    assert (given.max_num_batched_tokens, given.max_num_seqs) == (budget, 32)


def test_settings_vllm_accepts_replay():
    instance = vllm_instance("llama-3-8b@h100", VllmSettings(block_size=32, max_num_seqs=256, max_num_batched_tokens=256,
                                                              gpu_memory_utilization=1.0, kv_offloading_size=0.0))
    engine = instance.engine
    assert (engine.block_size_tokens, engine.max_num_seqs, engine.max_num_batched_tokens) == (32, 256, 256)


def test_more_pipeline_stages_than_layers_are_refused_with_the_sizes():
    assert vllm_instance("llama-3-8b@h100", VllmSettings(pipeline_parallel_size=32)).accelerator.pipeline_parallel_size == 32
    with pytest.raises(ConfigError, match="has 32 layers, too few for 33 pipeline stages") as caught:
        vllm_instance("llama-3-8b@h100", VllmSettings(pipeline_parallel_size=33))
    assert caught.value.hint == "use at most 32 pipeline stages"


def test_generation_config_auto_vllm_or_a_folder_decides_the_penalty_pass(tmp_path, shared):
    qwen = "Qwen/Qwen2.5-7B-Instruct@h100"
    assert vllm_instance(qwen, VllmSettings(), shared).sampling_penalties  # auto: the checkpoint's 1.05
    assert vllm_instance(qwen, VllmSettings(generation_config="auto"), shared).sampling_penalties
    assert not vllm_instance(qwen, VllmSettings(generation_config="vllm"), shared).sampling_penalties
    (tmp_path / "generation_config.json").write_text('{"repetition_penalty": 1.1}')
    assert vllm_instance("llama-3-8b@h100", VllmSettings(generation_config=str(tmp_path))).sampling_penalties
    with pytest.raises(ConfigError, match="--generation-config 'greedy' is neither auto, vllm nor a folder"):
        vllm_instance(qwen, VllmSettings(generation_config="greedy"), shared)
    path = tmp_path / "engine.yaml"
    path.write_text("generation-config: vllm\n")
    assert read_vllm_settings(path)[0].engine().sampling_penalties is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # each was taken, or refused naming an option the user never typed
        ("gpu_memory_utilization: .nan\n", "engine.yaml: gpu_memory_utilization must be in (0, 1], not nan"),
        ("kv-offloading-size: .inf\n", "engine.yaml: kv_offloading_size must be between 0 and 65,536 GiB, not inf"),
        ("max-num-seqs: 0\n", "engine.yaml: max_num_seqs must be at least 1, not 0"),
        ("tensor-parallel-size: 1\ntensor_parallel_size: 2\n",
         "engine.yaml: tensor_parallel_size is given twice, as tensor-parallel-size and as tensor_parallel_size"),
        ('engine: ""\n', "engine.yaml: engine must be non-empty text, not ''"),
        ("engine: llama-3-8b@h100x0\n", "engine.yaml: engine 'llama-3-8b@h100x0' asks for 0 accelerators"),
    ],
)
def test_a_bad_value_in_an_engine_file_names_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        read_vllm_settings(path)
    assert caught.value.hint and "--" not in caught.value.message.replace(str(path), "")  # no option the user never typed


def test_an_engine_spec_that_names_no_instance_is_refused_where_it_was_given():
    from replay.vllm import check_engine_spec

    with pytest.raises(ConfigError, match="--engine: the engine is empty") as caught:
        check_engine_spec(" ", "--engine")
    assert "MODEL@ACCELERATOR" in caught.value.hint
    # was AcceleratorConfig.tensor_parallel_size must be positive, not 0 (no hint)
    with pytest.raises(ConfigError, match=re.escape("engine 'llama-3-8b@h100-sxmx0' asks for 0 accelerators: the count "
                                                    "after 'x' must be at least 1")) as caught:
        vllm_instance("llama-3-8b@h100-sxmx0")
    assert "a100-80gx2" in caught.value.hint
    # was an OSError echoing the whole name (File name too long)
    with pytest.raises(ConfigError, match=r"unknown model 'a{100}\.\.\. \(100,000 characters\)'") as caught:
        vllm_instance("a" * 100_000 + "@h100")
    assert len(caught.value.message) < 150


def test_more_gpu_blocks_than_the_accelerators_hold_are_refused():
    assert vllm_instance("llama-3-8b@h100", VllmSettings(num_gpu_blocks_override=40_960)).num_kv_blocks == 40_960
    with pytest.raises(ConfigError, match=re.escape("--num-gpu-blocks-override 40,961: 40,961 KV blocks of 2 MiB are "
                                                    "80.0 GiB, more than the 80.0 GiB of memory of 1 x h100-sxm")) as caught:
        vllm_instance("llama-3-8b@h100", VllmSettings(num_gpu_blocks_override=40_961))
    assert caught.value.hint.startswith("at most 40,960 blocks fit there")
    doubled = vllm_instance("llama-3-8b@h100x2", VllmSettings(num_gpu_blocks_override=81_920))  # two devices' memory
    assert doubled.num_kv_blocks == 81_920
