"""One typed configuration tree of frozen dataclasses; every field carries its help text.

Values come from, in increasing precedence: the defaults below, a TOML file (``--config`` or
``$SERVELENS_CONFIG``), and environment variables named ``SERVELENS_<SECTION>__<FIELD>``
(``SERVELENS_PATHS__SHARED_DIR=/data/shared``). Loading never does I/O beyond reading that file;
unknown keys and wrongly typed values are errors that name the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboard.config import DashboardConfig
from pipelines.config import DagsterConfig, IngestConfig, LakeConfig, NightlyConfig
from pipelines.kafka_config import KafkaConfig
from privacy.config import PrivacyConfig
from schemas.types import doc
from servelens.errors import ConfigError, DataNotFoundError

ENV_PREFIX = "SERVELENS_"

#: Where the bundled data sets are published, for users without ``../shared``.
SHARED_DATA_SOURCES = {
    "traces/azure2023": "https://github.com/Azure/AzurePublicDataset (data/AzureLLMInferenceTrace_conv.csv)",
    "traces/mooncake": "https://github.com/kvcache-ai/Mooncake (FAST25-release/traces/)",
    "traces/burstgpt": "https://github.com/HPMLL/BurstGPT (data/)",
    "profiles/vidur": "https://github.com/microsoft/vidur (data/profiling/)",
}


@dataclass(frozen=True, slots=True)
class PathsConfig:
    """Where servelens reads shared data and writes its outputs."""

    shared_dir: str | None = doc(
        "Folder holding traces/ and profiles/ (the bundled real data). Unset: ../shared beside "
        "the checkout or the working directory.",
        None,
    )
    out_dir: str = doc("Folder for command outputs (events, tables, reports).", "out")


@dataclass(frozen=True, slots=True)
class Config:
    """The servelens configuration tree."""

    paths: PathsConfig = field(default_factory=PathsConfig, metadata={"doc": "Data locations."})
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig, metadata={"doc": "Sanitization and views."})
    kafka: KafkaConfig = field(default_factory=KafkaConfig, metadata={"doc": "The event stream in Kafka."})
    lake: LakeConfig = field(default_factory=LakeConfig, metadata={"doc": "The Parquet/Delta lake."})
    ingest: IngestConfig = field(default_factory=IngestConfig, metadata={"doc": "The ingest consumer."})
    nightly: NightlyConfig = field(default_factory=NightlyConfig, metadata={"doc": "The nightly replay and gate."})
    dagster: DagsterConfig = field(default_factory=DagsterConfig, metadata={"doc": "Dagster's step executor."})
    dashboard: DashboardConfig = field(default_factory=DashboardConfig, metadata={"doc": "The Streamlit dashboard."})


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check (and, for strings from the environment, convert) one leaf value."""
    args = typing.get_args(annotation)
    nullable = type(None) in args
    inner = next((a for a in args if a is not type(None)), annotation)
    if value is None or (nullable and value == ""):
        if nullable:
            return None
        raise ConfigError(f"config key {key} must not be empty")
    if inner is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if isinstance(value, bool):
            return value
    elif inner in (int, float):
        try:
            if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                return inner(value)
        except ValueError:
            pass
    elif inner is str:
        if isinstance(value, (str, Path)):
            return str(value)
    raise ConfigError(
        f"config key {key} has value {value!r} ({type(value).__name__}); expected {getattr(inner, '__name__', inner)}"
    )


def build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """A frozen dataclass from a mapping (TOML, YAML, environment): types checked, nested sections
    and lists of sections built, unknown keys refused with the valid ones listed."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}",
            f"valid keys in {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}",
        )
    kwargs = {}
    for name, value in data.items():
        annotation = hints[name]
        item = _section_list(annotation)
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key {prefix}{name} must be a table of settings")
            kwargs[name] = build(annotation, value, f"{prefix}{name}.")
        elif item is not None:
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise ConfigError(f"config key {prefix}{name} must be a list of tables of settings")
            kwargs[name] = tuple(build(item, v, f"{prefix}{name}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(value, annotation, f"{prefix}{name}")
    return cls(**kwargs)


def _section_list(annotation: Any) -> type | None:
    """``X`` for an annotation ``tuple[X, ...]`` whose X is a dataclass, else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The configuration from defaults, an optional TOML file and the environment."""
    env = os.environ if env is None else env
    path = path or env.get(f"{ENV_PREFIX}CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist", "pass an existing TOML file or unset SERVELENS_CONFIG") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = _merge(data, _env_overrides(env))
    if "SERVELENS_SHARED_DIR" in env:  # the short, documented spelling
        data = _merge(data, {"paths": {"shared_dir": env["SERVELENS_SHARED_DIR"]}})
    return build(Config, data, "")


def shared_dir(config: Config) -> Path:
    """The folder holding the bundled traces and profiles (never copied into the repository)."""
    if config.paths.shared_dir:
        candidates = [Path(config.paths.shared_dir)]
    else:
        checkout = Path(__file__).resolve().parents[1]
        candidates = [checkout.parent / "shared", Path.cwd().parent / "shared", Path.cwd() / "shared"]
    for candidate in candidates:
        if (candidate / "traces").is_dir():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    sources = "; ".join(f"{k}: {v}" for k, v in SHARED_DATA_SOURCES.items())
    raise DataNotFoundError(
        f"shared data not found (looked for traces/ in {looked})",
        f"set SERVELENS_SHARED_DIR to the folder holding traces/ and profiles/; the data is published at {sources}",
    )
