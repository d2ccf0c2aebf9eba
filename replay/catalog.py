"""Any model on any accelerator: Hugging Face ``config.json`` shapes, the fidelity data's model table, presets.

A model is named by

- a preset of ``replay.config.MODELS`` (``llama-3-8b``, ``llama-2-70b``, ...);
- a path to a Hugging Face ``config.json``, or to a folder holding one (read locally, never from the hub);
- a model of the shared data's ``fidelity/models.csv`` (every model of the fidelity experiments), by its
  Hugging Face id (``meta-llama/Llama-3.1-8B-Instruct``) or the id's last part, in any case.

``config.json`` fields read (a multimodal checkpoint's ``text_config`` first): ``num_hidden_layers``,
``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the attention heads),
``head_dim`` (default hidden / heads), ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``;
for mixtures of experts ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, shared experts (``n_shared_experts``,
``shared_expert_intermediate_size``; Llama 4 has one per MoE layer), dense layers
(``first_k_dense_replace``, Llama 4's ``interleave_moe_layer_step``); fp8 checkpoints from
``quantization_config``. A missing required field is an error that names it. Beside it, a
``generation_config.json`` whose ``repetition_penalty`` is not 1 marks the model's requests as penalized
(``ModelConfig.sampling_penalties``): vLLM applies a checkpoint's generation config to requests that set no
sampling parameters of their own (``--generation-config auto``, its default since 0.8), as inference-perf's
do not. The fidelity table holds config.json fields only; the penalties its checkpoints publish are in
``GENERATION_PENALTIES``.

``resolve_instance("meta-llama/Llama-3.1-70B-Instruct@H100x4", engine, shared)`` assembles an instance;
``MODEL@ACCELERATOR[xTP]`` names keep working.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from replay.config import MODELS, EngineConfig, InstanceConfig, ModelConfig, SpeculativeConfig, accelerator
from servelens.errors import ConfigError
from servelens.settings import read_document

#: The fidelity data's model table, relative to the shared data folder.
MODELS_CSV = Path("fidelity") / "models.csv"

#: The fidelity models whose published generation_config.json sets a repetition penalty (its value): vLLM
#: serves their requests with it unless a request sets its own (Qwen2.5-7B-Instruct: 1.05, with top-k 20,
#: top-p 0.8 and temperature 0.7, the defaults its model card recommends).
GENERATION_PENALTIES = {"Qwen/Qwen2.5-7B-Instruct": 1.05}

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def model_from_hf_config(config: dict[str, Any], name: str, *, where: str = "config.json") -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` mapping (see the module docstring)."""
    text_config = config.get("text_config")
    if text_config is not None and not isinstance(text_config, dict):
        raise ConfigError(f"{where}: field 'text_config' must be an object (a multimodal model's language model), "
                          f"not {type(text_config).__name__}", "fix that value, or remove it for a text-only model")
    cfg = {**config, **text_config} if text_config else dict(config)
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConfigError(
            f"{where}: missing field {missing[0]!r}" + (f" (and {', '.join(missing[1:])})" if missing[1:] else ""),
            "a decoder's config.json needs num_hidden_layers, hidden_size, num_attention_heads, "
            "intermediate_size and vocab_size",
        )
    count = functools.partial(_count, cfg, where)
    layers, hidden, heads = count("num_hidden_layers"), count("hidden_size"), count("num_attention_heads")
    model_type = str(cfg.get("model_type", ""))
    experts = next((count(k) for k in _EXPERT_KEYS if cfg.get(k)), 0)
    kv_heads = count("num_key_value_heads", heads)
    _check_head_width(cfg, where, hidden, heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: field 'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' "
                          f"({heads}): every KV head serves the same number of query heads, as vLLM requires",
                          "fix that value (a Hugging Face model's own config.json has it right)")
    fields: dict[str, Any] = dict(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=count("head_dim", hidden // heads),
        intermediate_size=count("intermediate_size"),
        vocab_size=count("vocab_size"),
        tie_word_embeddings=_flag(cfg, where, "tie_word_embeddings"),
    )
    if experts:
        fields.update(_moe_fields(cfg, model_type, experts, layers, where))
    if _is_fp8(config):
        fields.update(bytes_per_param=1, compute_dtype="fp8")
    return ModelConfig(**fields)


def _check_head_width(cfg: dict[str, Any], where: str, hidden: int, heads: int) -> None:
    """A config.json without ``head_dim`` must have attention heads that divide ``hidden_size``: each head is then
    ``hidden_size / num_attention_heads`` wide (Hugging Face's default). Otherwise no head width follows from it
    (``hidden // heads`` would be a guess, and 0 where the heads outnumber the hidden size)."""
    if cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: field 'num_attention_heads' ({heads}) does not divide 'hidden_size' ({hidden}), "
                          "and no 'head_dim' gives each head's width",
                          "fix num_attention_heads or hidden_size, or give head_dim (a Hugging Face model's own "
                          "config.json has them right)")


def _moe_fields(cfg: dict[str, Any], model_type: str, experts: int, layers: int, where: str) -> dict[str, Any]:
    count = functools.partial(_count, cfg, where)
    if cfg.get("num_experts_per_tok") is None:
        raise ConfigError(f"{where}: missing field 'num_experts_per_tok' (the experts each token is routed to)",
                          "a mixture of experts' config.json gives it beside the number of experts")
    out: dict[str, Any] = {"num_experts": experts, "experts_per_token": count("num_experts_per_tok")}
    if out["experts_per_token"] > experts:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' ({out['experts_per_token']}) is more than the "
                          f"model's experts ({experts})", "fix that value (a Hugging Face model's own config.json has it right)")
    if model_type.startswith("llama4"):  # routed and shared experts of intermediate_size; dense MLPs are wider
        out.update(num_shared_experts=1, moe_intermediate_size=count("intermediate_size"))
        if cfg.get("intermediate_size_mlp"):
            out["intermediate_size"] = count("intermediate_size_mlp")
        out["num_moe_layers"] = layers // _within_layers(cfg, where, "interleave_moe_layer_step", layers, 1)
        return out
    if cfg.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = count("moe_intermediate_size")
    if cfg.get("n_shared_experts"):
        out["num_shared_experts"] = count("n_shared_experts")
    elif cfg.get("shared_expert_intermediate_size"):
        out.update(num_shared_experts=1, shared_expert_intermediate_size=count("shared_expert_intermediate_size"))
    if cfg.get("first_k_dense_replace"):
        out["num_moe_layers"] = layers - _within_layers(cfg, where, "first_k_dense_replace", layers - 1)
    return out


def _within_layers(cfg: dict[str, Any], where: str, key: str, most: int, default: Any = None) -> int:
    """A layer count or step of ``cfg`` that leaves the model at least one MoE layer: at most ``most``."""
    value = _count(cfg, where, key, default)
    if value > most:
        raise ConfigError(f"{where}: field {key!r} ({value}) leaves no mixture-of-experts layer in "
                          f"{cfg['num_hidden_layers']} layers", "fix that value, or remove the experts for a dense model")
    return value


def _flag(cfg: dict[str, Any], where: str, key: str) -> bool:
    """``cfg[key]`` as a JSON boolean (absent or null: false), else an error naming it."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{where}: field {key!r} must be true or false, not {value!r}",
                          "fix that value (a Hugging Face model's own config.json has it right)")
    return bool(value)


def _count(cfg: dict[str, Any], where: str, key: str, default: Any = None) -> int:
    """``cfg[key]`` (``default`` when absent or null) as a positive whole number, else an error naming it."""
    raw = cfg.get(key)
    value = default if raw is None else raw
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 2**53 or value != int(value):
        raise ConfigError(
            f"{where}: field {key!r} must be a positive whole number, not {raw if raw is not None else value!r}",
            "fix that value (a Hugging Face model's own config.json has it right)",
        )
    return int(value)


def _is_fp8(config: dict[str, Any]) -> bool:
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")  # checked: a dict
    if not isinstance(q, dict):
        return False
    if q.get("quant_method") == "fp8":
        return True
    text = json.dumps(q).lower()
    return q.get("quant_method") == "compressed-tensors" and ('"type": "float"' in text and '"num_bits": 8' in text)


def read_hf_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """The model of a ``config.json`` file or of a folder that holds one."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json there", "give a Hugging Face config.json or the folder holding it")
    config = _read_json(file, _CONFIG_HINT)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: not a config.json (the top level is a JSON {_json_type(config)}, not an object)",
                          _CONFIG_HINT)
    default = p.name if p.is_dir() else (p.parent.name if p.name == "config.json" else p.stem)
    model = model_from_hf_config(config, name or config.get("_name_or_path") or default, where=str(file))
    return dataclasses.replace(model, sampling_penalties=generation_penalties(file.parent))


_CONFIG_HINT = "give the model's config.json as Hugging Face publishes it: a JSON object of its fields"
_GENERATION_HINT = "fix the file, or remove it to serve vLLM's defaults"


def _read_json(file: Path, hint: str | None = None) -> Any:
    """``file``'s JSON, or an error naming the file and the fault (``servelens.settings.read_document``)."""
    return read_document(file, "model configuration", hint)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (array, string, number, ...)."""
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def generation_penalties(folder: str | Path) -> bool:
    """Whether the ``generation_config.json`` in ``folder`` (if any) sets a repetition penalty other than 1,
    which vLLM's ``--generation-config auto`` puts on every request that sets none."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return False
    config = _read_json(file, _GENERATION_HINT)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: not a generation_config.json (the top level is a JSON {_json_type(config)}, not an "
                          "object)", _GENERATION_HINT)
    penalty = config.get("repetition_penalty", 1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 < penalty < float("inf"):
        raise ConfigError(f"{file}: repetition_penalty must be a number above 0, not {penalty!r}",
                          "a Hugging Face model's own generation_config.json has it right (1.0: none)")
    return penalty != 1.0


def fidelity_models(shared: Path | None, table: Path | None = None) -> dict[str, ModelConfig]:
    """The models of a fidelity model table (``table``, else the shared data's ``fidelity/models.csv``), keyed by
    Hugging Face id."""
    table = table or (shared / MODELS_CSV if shared is not None else None)
    if table is None or not table.is_file():
        return {}
    models: dict[str, ModelConfig] = {}
    lines: dict[str, int] = {}  # a model id in lower case -> the line that gave it
    for line, row in _model_rows(table):
        key = (row["model"] or "").strip().lower()
        if key in lines:
            raise ConfigError(f"{table} line {line}: model {row['model']!r} is given twice (also line {lines[key]})",
                              "keep one of the two rows: a model id names one model (the replay would take one of "
                              "them silently)")
        lines[key] = line
        models[row["model"]] = _model_from_row(row, table)
    return models


_TABLE_HINT = "a model table has the columns of the fidelity data's models.csv"


def _model_rows(table: Path) -> list[tuple[int, dict[str, str]]]:
    """The rows of a model table with their line numbers; an error naming the file when it is not UTF-8 CSV text
    (a byte-order mark is taken) or has no 'model' column."""
    try:
        with table.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            rows = [(reader.line_num, row) for row in reader]
            columns = reader.fieldnames or ()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{table} is not a CSV file: not UTF-8 text (byte {exc.start})", _TABLE_HINT) from None
    except (csv.Error, OSError) as exc:
        raise ConfigError(f"{table} is not a readable CSV file: {exc}", _TABLE_HINT) from None
    if "model" not in columns:
        raise ConfigError(f"{table}: no column 'model'", _TABLE_HINT)
    return rows


def _model_from_row(row: dict[str, str], table: Path) -> ModelConfig:
    """A models.csv row (the config.json fields, flattened) as a model."""
    def number(column: str) -> Any:  # a CSV cell is text: a whole number read as one, anything else kept to be named
        text = (row.get(column) or "").strip()
        return int(text) if text.isdigit() else (text or None)

    config: dict[str, Any] = {
        "num_hidden_layers": number("num_layers"), "hidden_size": number("hidden_size"),
        "num_attention_heads": number("num_attention_heads"), "num_key_value_heads": number("num_kv_heads"),
        "head_dim": number("head_dim"), "intermediate_size": number("intermediate_size"),
        "vocab_size": number("vocab_size"), "num_local_experts": number("num_experts"),
        "num_experts_per_tok": number("experts_per_token"),
        "tie_word_embeddings": row.get("tie_word_embeddings") == "True",
        "model_type": "llama4" if row.get("architecture", "").startswith("Llama4") else "",
    }
    model = model_from_hf_config(config, row["model"], where=f"{table} row {row['model']}")
    if GENERATION_PENALTIES.get(row["model"], 1.0) != 1.0:
        model = dataclasses.replace(model, sampling_penalties=True)
    if row.get("serving_precision", "").upper() == "FP8":
        model = dataclasses.replace(model, bytes_per_param=1, compute_dtype="fp8")
    return model


def find_model(name: str, shared: Path | None = None, models_table: Path | None = None) -> ModelConfig:
    """A model by preset name, ``config.json`` path, or Hugging Face id of the fidelity model table (``models_table``,
    else the shared data's)."""
    if name in MODELS:
        return MODELS[name]
    p = Path(name)
    if p.suffix == ".json" or _is_path(p):
        return read_hf_config(p)
    known = fidelity_models(shared, models_table)
    key = name.lower()
    for model_id, model in known.items():
        if key in (model_id.lower(), model_id.rsplit("/", 1)[-1].lower()):
            return model
    names = sorted(MODELS) + sorted(known)
    raise ConfigError(
        f"unknown model {name if len(name) <= 120 else name[:100] + f'... ({len(name):,} characters)'!r}",
        f"known models: {', '.join(names)}; or give the path of a Hugging Face config.json"
        + ("" if known else " (the fidelity model table was not found: set the shared data folder)"),
    )


def _is_path(p: Path) -> bool:
    """Whether ``p`` names a file or folder here (a name too long for a path, or otherwise unusable, does not)."""
    try:
        return p.is_dir() or p.is_file()
    except OSError:
        return False


def parse_engine_spec(spec: str) -> tuple[str, str, int]:
    """(model, accelerator, tensor parallel) of ``MODEL@ACCELERATOR[xTP]``."""
    model_name, sep, rest = spec.rpartition("@")
    if not sep or not model_name or not rest:
        raise ConfigError(
            f"engine spec {spec!r} is not MODEL@ACCELERATOR",
            "e.g. llama-3-8b@h100-sxm, llama-2-70b@a100-80gx2 or meta-llama/Llama-3.1-8B-Instruct@h100",
        )
    head, x, tail = rest.rpartition("x")
    if x and head and tail.isdigit():
        if int(tail) < 1:
            raise ConfigError(f"engine {spec!r} asks for {int(tail)} accelerators: the count after 'x' must be at least 1",
                              "e.g. llama-2-70b@a100-80gx2; leave out the x suffix for one accelerator")
        return model_name, head, int(tail)
    return model_name, rest, 1


def resolve_instance(
    spec: str,
    engine: EngineConfig | None = None,
    shared: Path | None = None,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int = 1,
    weight_dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    speculative: SpeculativeConfig | None = None,
    models_table: Path | None = None,
) -> InstanceConfig:
    """An instance from ``MODEL@ACCELERATOR[xTP]`` and vLLM's settings: ``tensor_parallel_size`` overrides
    the spec's; ``weight_dtype`` 'fp8' (vLLM --quantization fp8) or 'bf16'/'fp16'/'auto'; ``kv_cache_dtype``
    'fp8' or 'auto'. A model that does not fit its accelerators' memory is an error with the sizes."""
    model_name, accel_name, tp = parse_engine_spec(spec)
    model = find_model(model_name, shared, models_table)
    if weight_dtype == "fp8":
        model = dataclasses.replace(model, bytes_per_param=1, compute_dtype="fp8")
    elif weight_dtype in ("bf16", "fp16", "bfloat16", "float16"):
        model = dataclasses.replace(model, bytes_per_param=2, compute_dtype="bf16")
    elif weight_dtype not in (None, "auto"):
        raise ConfigError(f"unknown weight dtype {weight_dtype!r}", "valid: auto, bf16, fp16, fp8")
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        model = dataclasses.replace(model, kv_bytes_per_element=1)
    elif kv_cache_dtype not in (None, "auto", "bf16", "fp16"):
        raise ConfigError(f"unknown KV cache dtype {kv_cache_dtype!r}", "valid: auto, fp8")
    tp = tensor_parallel_size or tp
    if tp > 0 and model.num_attention_heads % tp:
        raise ConfigError(
            f"{model.name} has {model.num_attention_heads} attention heads, which a tensor-parallel size of {tp} "
            "does not divide (vLLM refuses it too)",
            f"use a tensor-parallel size that divides {model.num_attention_heads}, e.g. "
            + ", ".join(str(d) for d in (1, 2, 4, 8) if model.num_attention_heads % d == 0),
        )
    kv = model.num_kv_heads
    if tp > 0 and (tp % kv if tp >= kv else kv % tp):
        raise ConfigError(
            f"{model.name} has {kv} KV heads, which a tensor-parallel size of {tp} neither divides nor is a multiple "
            "of (vLLM splits KV heads evenly, or replicates them when there are fewer than devices)",
            f"use a tensor-parallel size that divides {kv} or that {kv} divides",
        )
    if pipeline_parallel_size > model.num_layers:
        raise ConfigError(
            f"{model.name} has {model.num_layers} layers, too few for {pipeline_parallel_size} pipeline stages "
            "(each stage holds at least one layer)",
            f"use at most {model.num_layers} pipeline stages",
        )
    instance = InstanceConfig(
        accelerator=accelerator(accel_name, tp, pipeline_parallel_size),
        model=model,
        engine=engine or EngineConfig(),
        speculative=speculative,
    )
    instance.num_kv_blocks  # noqa: B018 -- a model that does not fit fails here, with its sizes
    return instance


__all__ = [
    "GENERATION_PENALTIES",
    "MODELS_CSV",
    "fidelity_models",
    "find_model",
    "generation_penalties",
    "model_from_hf_config",
    "parse_engine_spec",
    "read_hf_config",
    "resolve_instance",
]
