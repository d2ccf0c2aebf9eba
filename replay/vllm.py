"""A vLLM server's settings by vLLM's own names, as the replay models them.

``VllmSettings`` mirrors the ``vllm serve`` options the replay has a model for; every field is
optional (None: what ``vllm serve`` would use: its step budget and batch size by device (``serve_batch_defaults``),
the rest ``replay.config.EngineConfig``'s). The command line generates its
engine options from these fields (``--max-num-seqs``, ``--enable-prefix-caching/--no-enable-prefix-caching``,
...), and an engine YAML file holds the same keys, with dashes or underscores, as a ``vllm serve
--config`` file does (``read_vllm_settings``). ``vllm_instance`` assembles the instance.

What is not modelled is not here: a setting vLLM has and the replay ignores would be a silent lie.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.catalog import generation_penalties, parse_engine_spec, resolve_instance
from replay.config import GIB, AcceleratorConfig, EngineConfig, InstanceConfig, accelerator
from schemas.types import doc
from servelens.errors import ConfigError
from servelens.settings import read_document


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmSettings:
    """``vllm serve`` settings the replay models (None: the engine default)."""

    tensor_parallel_size: int | None = doc("Tensor-parallel degree (overrides an xTP suffix of --engine).", None)
    pipeline_parallel_size: int | None = doc("Pipeline stages (each tensor_parallel_size accelerators wide).", None)
    max_num_seqs: int | None = doc(
        "Most requests in the running batch [vllm serve: 1024 on H100, H200, B200; 256 on A100, L40S].", None)
    max_num_batched_tokens: int | None = doc(
        "Token budget of one step [vllm serve: 8192 on H100, H200, B200; 2048 on A100, L40S].", None)
    gpu_memory_utilization: float | None = doc("Share of device memory for weights, activations and KV [0.9].", None)
    num_gpu_blocks_override: int | None = doc("Exactly this many KV blocks (e.g. as a run's log reported).", None)
    block_size: int | None = doc("Tokens per KV cache block [16].", None)
    enable_prefix_caching: bool | None = doc("Reuse cached KV blocks of shared prompt prefixes [on].", None)
    enable_chunked_prefill: bool | None = doc("Split long prompts into chunks within the step budget [on].", None)
    async_scheduling: bool | None = doc(
        "Plan the next step while the current one runs [vLLM >= 0.12: on; the calibration's default].", None
    )
    kv_offloading_size: float | None = doc(
        "CPU tier of the prefix cache, GiB (vLLM's native KV offloading): device evictions are kept there and "
        "copied back on a hit [off].", None
    )
    quantization: str | None = doc("Weight quantization: fp8 (W8A8 where the GPU has fp8 tensor cores) [none].", None)
    dtype: str | None = doc("Weight and activation dtype: auto, bf16, fp16 [auto].", None)
    kv_cache_dtype: str | None = doc("KV cache dtype: auto or fp8 [auto].", None)
    generation_config: str | None = doc(
        "Default sampling parameters of requests that set none: auto (the model's generation_config.json), vllm "
        "(vLLM's own: no penalties) or a folder holding a generation_config.json [auto]. A repetition penalty "
        "there adds vLLM's penalty pass to every step.", None
    )

    def engine(self, base: EngineConfig | None = None) -> EngineConfig:
        """``base`` with every setting given here."""
        changes: dict[str, Any] = {}
        for name, field_name in _ENGINE_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                changes[field_name] = value
        if self.kv_offloading_size is not None:
            changes["cpu_kv_offload_bytes"] = round(self.kv_offloading_size * GIB)
        if self.generation_config not in (None, "auto"):
            changes["sampling_penalties"] = self.generation_config != "vllm" and generation_penalties(self.generation_config)
        return dataclasses.replace(base or EngineConfig(), **changes)

    def check(self, base: EngineConfig) -> None:
        """Refuse, by vLLM's option names, what ``vllm serve`` refuses at start-up; ``base`` is the engine
        configuration these settings change (the values they leave unset are its)."""
        self.check_values()
        self._check_budget(base)

    def check_values(self, name: Callable[[str], str] = _flag) -> None:
        """Refuse each setting vLLM would refuse on its own, named by ``name(field)`` (default: its option)."""
        for field_name in _AT_LEAST_ONE:
            value = getattr(self, field_name)
            if value is not None and value < 1:
                raise ConfigError(f"{name(field_name)} must be at least 1, not {value}", _AT_LEAST_ONE[field_name])
        if self.block_size is not None and self.block_size not in VLLM_BLOCK_SIZES:
            raise ConfigError(f"{name('block_size')} {self.block_size} is not one of vLLM's block sizes",
                              f"use one of {', '.join(map(str, VLLM_BLOCK_SIZES))} (16 is vLLM's default)")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ConfigError(f"{name('gpu_memory_utilization')} must be in (0, 1], not {share}",
                              "it is the share of each device's memory vLLM may use (0.9 by default)")
        if self.kv_offloading_size is not None and not 0 <= self.kv_offloading_size <= MAX_KV_OFFLOAD_GIB:
            raise ConfigError(f"{name('kv_offloading_size')} must be between 0 and {MAX_KV_OFFLOAD_GIB:,} GiB, not "
                              f"{self.kv_offloading_size:g}",
                              "it is the CPU tier's size in GiB, at most a server's host memory; leave it out for no "
                              "CPU tier")
        if self.generation_config not in (None, "auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ConfigError(f"{name('generation_config')} {self.generation_config!r} is neither auto, vllm nor a folder",
                              "auto: the model's generation_config.json (vLLM's default); vllm: vLLM's own defaults; "
                              "or the folder of a generation_config.json")

    def _check_budget(self, base: EngineConfig) -> None:
        if self.max_num_batched_tokens is None and self.max_num_seqs is None:
            return  # the base's own pair is the library's to choose
        budget = base.max_num_batched_tokens if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        seqs = base.max_num_seqs if self.max_num_seqs is None else self.max_num_seqs
        if budget < seqs:
            raise ConfigError(
                f"--max-num-batched-tokens {budget} is below --max-num-seqs {seqs}: vLLM refuses a step budget "
                "smaller than its batch (each running sequence takes at least one token a step)",
                "raise --max-num-batched-tokens or lower --max-num-seqs")

    def merged(self, other: VllmSettings) -> VllmSettings:
        """These settings with every setting ``other`` gives (``other`` wins)."""
        given = {f.name: getattr(other, f.name) for f in dataclasses.fields(other) if getattr(other, f.name) is not None}
        return dataclasses.replace(self, **given)


#: The largest CPU tier of the prefix cache, GiB (64 TiB): more host memory than any one server holds (a GPU
#: server has 1 to 4 TiB; the largest 8-socket machines take 32 TiB).
MAX_KV_OFFLOAD_GIB = 64 * 1024


#: VllmSettings fields that are EngineConfig fields under another name (or the same).
_ENGINE_FIELDS = {
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "num_gpu_blocks_override": "num_kv_blocks_override",
    "block_size": "block_size_tokens",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "async_scheduling": "async_scheduling",
}


#: vLLM's choices for --block-size (``vllm.config.cache.BlockSize`` in v0.15).
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)

#: Settings that are counts of at least one, with the hint for a smaller value.
_AT_LEAST_ONE = {
    "tensor_parallel_size": "1 is one accelerator (no parallelism)",
    "pipeline_parallel_size": "1 is one accelerator (no parallelism)",
    "max_num_seqs": "it is the most requests in the running batch (vllm serve's default: 1024 on H100, 256 on A100)",
    "max_num_batched_tokens": "it is one step's token budget (vllm serve's default: 8192 on H100, 2048 on A100)",
    "num_gpu_blocks_override": "it is the KV cache's size in blocks; leave it out to size the cache from memory",
}


def read_vllm_settings(path: str | Path) -> tuple[VllmSettings, str | None]:
    """(settings, engine spec) of an engine YAML file: ``vllm serve`` keys with dashes or underscores, and
    optionally ``engine: MODEL@ACCELERATOR[xTP]`` (or ``model`` and ``accelerator``)."""
    path = Path(path)
    data = read_document(path, "engine file") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an engine file is a mapping of vllm serve settings")
    data = _one_spelling(path, data)
    spec = data.pop("engine", None)
    model, accel = data.pop("model", None), data.pop("accelerator", None)
    for key, value in (("engine", spec), ("model", model), ("accelerator", accel)):
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise ConfigError(f"{path}: {key} must be {'non-empty ' if isinstance(value, str) else ''}text, not {value!r}",
                              "e.g. engine: meta-llama/Llama-3.1-8B-Instruct@h100 (or model: ... and accelerator: h100)")
    if spec is None and model is not None:
        if accel is None:
            raise ConfigError(f"{path}: 'model' needs 'accelerator' (e.g. accelerator: h100-sxm)")
        spec = f"{model}@{accel}"
    if spec is not None:
        check_engine_spec(spec, str(path))
    names = {f.name: f for f in dataclasses.fields(VllmSettings)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}",
                          f"the replay models: engine (or model and accelerator), {', '.join(names)}")
    settings = VllmSettings(**{k: _typed(path, names[k], v) for k, v in data.items()})
    settings.check_values(lambda key: f"{path}: {key}")
    return settings, spec


def _one_spelling(path: Path, data: dict) -> dict[str, Any]:
    """The file's settings under their underscored names; a setting given under both spellings is refused (the
    last would silently win)."""
    settings: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in settings:
            raise ConfigError(f"{path}: {name} is given twice, as {spelled[name]} and as {key}",
                              "keep one of the two spellings")
        settings[name], spelled[name] = value, str(key)
    return settings


def check_engine_spec(spec: str, where: str = "--engine") -> None:
    """Refuse an engine spec that can name no instance: an empty one, or one ``parse_engine_spec`` refuses (no
    ``@``, fewer than one accelerator after ``x``); ``where`` (an option or a file) says where it was given."""
    if not spec.strip():
        raise ConfigError(f"{where}: the engine is empty", "give MODEL@ACCELERATOR[xTP], e.g. llama-3-8b@h100-sxm")
    try:
        parse_engine_spec(spec)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}", exc.hint) from None


def _typed(path: Path, f: dataclasses.Field, value: Any) -> Any:
    kind = str(f.type)
    ok = (
        ("bool" in kind and isinstance(value, bool))
        or ("int" in kind and isinstance(value, int) and not isinstance(value, bool))
        or ("float" in kind and isinstance(value, (int, float)) and not isinstance(value, bool))
        or ("str" in kind and isinstance(value, str))
    )
    if not ok:
        expected = kind.replace(" | None", "")
        raise ConfigError(f"{path}: {f.name} must be {expected}, not {value!r}", _type_hint(f.name, expected, value))
    return float(value) if "float" in kind else value


def _type_hint(name: str, expected: str, value: Any) -> str:
    """How to write ``name``'s value as ``expected`` in YAML. A number YAML read as text (YAML 1.1 takes ``1e30`` and
    ``1.0e30`` for strings: its floats need a dot and a signed exponent) is shown written as one; a whole number
    for an int setting in full."""
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is not None and not math.isfinite(number):
        number = None
    if number is not None and expected == "float":
        return (f"YAML reads {value} as text, not a number: write a dot and a signed exponent, e.g. {name}: "
                f"{number:.1e}" if "e" in value.lower() else f"write it unquoted, e.g. {name}: {number:g}")
    if number is not None and expected == "int" and number.is_integer() and abs(number) < 1e18:
        return f"YAML reads {value} as text, not a number: write the whole number, e.g. {name}: {int(number)}"
    examples = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "text"}
    return f"give {name} as {examples.get(expected, expected)} (the `vllm serve` option of that name)"


#: ``vllm serve``'s step budget and batch size (max_num_batched_tokens, max_num_seqs) where they are not given:
#: on a device of at least 70 GiB that is not an A100 (H100, H200, B200) and on any other GPU (vLLM's
#: ``EngineArgs`` defaults for the OpenAI API server, unchanged from v0.10 to v0.15).
SERVE_BATCH_DEFAULTS_LARGE = (8192, 1024)
SERVE_BATCH_DEFAULTS = (2048, 256)


def serve_batch_defaults(accelerator: AcceleratorConfig) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) ``vllm serve`` picks on ``accelerator`` when neither is given."""
    large = accelerator.memory_bytes >= 70 * GIB and not accelerator.name.lower().startswith("a100")
    return SERVE_BATCH_DEFAULTS_LARGE if large else SERVE_BATCH_DEFAULTS


def serve_engine(spec: str, settings: VllmSettings) -> EngineConfig:
    """The engine configuration ``vllm serve`` starts from on ``spec``'s accelerator: its step budget and batch
    size by device (a budget given and no batch size: vLLM caps the batch at the budget), the rest
    ``EngineConfig``'s."""
    budget, seqs = serve_batch_defaults(accelerator(parse_engine_spec(spec)[1]))
    if settings.max_num_batched_tokens is not None and settings.max_num_batched_tokens >= 1:  # else refused by check
        budget = settings.max_num_batched_tokens
    return EngineConfig(max_num_batched_tokens=budget, max_num_seqs=min(seqs, budget))


def vllm_instance(spec: str, settings: VllmSettings | None = None, shared: Path | None = None,
                  base: EngineConfig | None = None) -> InstanceConfig:
    """The instance ``MODEL@ACCELERATOR[xTP]`` run with ``settings`` (see ``replay.catalog``); what they leave
    unset is ``base``'s, or where no ``base`` is given what ``vllm serve`` would use (``serve_engine``)."""
    s = settings or VllmSettings()
    weight_dtype = "fp8" if (s.quantization or "").lower() == "fp8" else s.dtype
    if s.quantization not in (None, "fp8", "FP8", "none"):
        raise ConfigError(f"quantization {s.quantization!r} is not modelled", "the replay models fp8 (W8A8) or none")
    base = base or serve_engine(spec, s)
    s.check(base)
    instance = resolve_instance(
        spec, s.engine(base), shared,
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size or 1,
        weight_dtype=weight_dtype,
        kv_cache_dtype=s.kv_cache_dtype,
    )
    _check_blocks_fit(instance)
    return instance


def _check_blocks_fit(instance: InstanceConfig) -> None:
    """Refuse --num-gpu-blocks-override beyond the accelerators' memory: vLLM allocates that many blocks on them."""
    blocks = instance.engine.num_kv_blocks_override
    block_bytes = instance.kv_bytes_per_token * instance.engine.block_size_tokens
    memory = instance.accelerator.memory_bytes * instance.accelerator.num_devices
    if blocks is not None and blocks * block_bytes > memory:
        raise ConfigError(
            f"--num-gpu-blocks-override {blocks:,}: {blocks:,} KV blocks of {block_bytes / 2**20:g} MiB are "
            f"{blocks * block_bytes / GIB:,.1f} GiB, more than the {memory / GIB:,.1f} GiB of memory of "
            f"{instance.accelerator.num_devices} x {instance.accelerator.name}",
            f"at most {memory // block_bytes:,} blocks fit there; leave it out to size the cache from memory")


__all__ = ["MAX_KV_OFFLOAD_GIB", "SERVE_BATCH_DEFAULTS", "SERVE_BATCH_DEFAULTS_LARGE", "VLLM_BLOCK_SIZES",
           "VllmSettings", "check_engine_spec", "read_vllm_settings", "serve_batch_defaults", "serve_engine",
           "vllm_instance"]
