"""Typed settings from mappings: the mechanism under the configuration tree (a base module).

``build`` makes a frozen dataclass from a mapping (TOML, YAML, the environment), checking types and
refusing unknown keys with the valid ones listed; ``read_settings`` reads the raw tree from a TOML file
(``--config`` or ``$SERVELENS_CONFIG``) and environment variables named ``SERVELENS_<SECTION>__<FIELD>``;
``read_document`` reads any YAML or JSON file a user hands over, every fault an error naming the file.
The tree itself (``servelens.config.Config``) sits at the top, beside the CLI; the packages below build
their own sections with ``build`` and never import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from servelens.errors import ConfigError

ENV_PREFIX = "SERVELENS_"


def coerce(value: Any, annotation: Any, key: str) -> Any:
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
    elif inner in (int, float) and not isinstance(value, bool):
        number = _number(value, inner, key)
        if number is not None:
            return number
    elif inner is str:
        if isinstance(value, (str, Path)):
            return str(value)
    raise ConfigError(
        f"config key {key} has value {value!r} ({type(value).__name__}); expected {getattr(inner, '__name__', inner)}"
    )


def _number(value: Any, kind: type, key: str) -> int | float | None:
    """``value`` as ``kind`` (int or float), from a number or the environment's text; None when it is neither.
    NaN and infinities (TOML's nan/inf, YAML's .nan/.inf) and a fraction for a whole number are refused."""
    if not isinstance(value, (str, int, float)):
        return None
    try:
        as_float = float(value)
    except ValueError:
        return None
    except OverflowError:  # an integer beyond any float
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ConfigError(f"config key {key} must be a finite number, not {value!r}", "leave the key out for its default")
    if kind is float:
        return as_float
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    if as_float != int(as_float):
        raise ConfigError(f"config key {key} must be a whole number, not {value!r}")
    return int(value)


def check_bounds(section: str, config: object, *, at_least: Mapping[str, float] = {},
                 above: Mapping[str, float] = {}) -> None:
    """Refuse, naming it, the first setting of ``config`` below its ``at_least`` bound or not above its
    ``above`` bound (a section's ``__post_init__`` calls it: a count of 0 or a negative time is refused
    where it is set, not found as a hang or a lost guarantee later)."""
    for name, least in at_least.items():
        if getattr(config, name) < least:
            raise ConfigError(f"{section}.{name} must be at least {least:g}, not {getattr(config, name)}")
    for name, bound in above.items():
        if not getattr(config, name) > bound:
            raise ConfigError(f"{section}.{name} must be above {bound:g}, not {getattr(config, name)}")


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
            kwargs[name] = coerce(value, annotation, f"{prefix}{name}")
    missing = [f.name for f in fields.values() if f.name not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"config key {prefix}{missing[0]} is required", f"give {', '.join(prefix + m for m in missing)}")
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


def read_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The raw settings tree: an optional TOML file, overridden by the environment."""
    env = os.environ if env is None else env
    path = path or env.get(f"{ENV_PREFIX}CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist", "pass an existing TOML file or unset SERVELENS_CONFIG") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {_fault(exc)}") from None
    data = _merge(data, _env_overrides(env))
    if "SERVELENS_SHARED_DIR" in env:  # the short, documented spelling
        data = _merge(data, {"paths": {"shared_dir": env["SERVELENS_SHARED_DIR"]}})
    return data


def read_document(path: str | Path, what: str, hint: str | None = None) -> Any:
    """The content of the YAML (or, named ``*.json``, JSON) file ``path``; a ``ConfigError`` naming ``what`` and
    the file when it is missing, a folder, not UTF-8 text, not valid YAML or JSON, nested too deeply to read,
    or (YAML) a mapping that gives a key twice. An empty YAML file is ``None``."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        text = path.read_text()
        return json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", hint) from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file", hint) from None
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{what} {path} is not valid {kind}: {_fault(exc)}", hint) from None


def _fault(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    if isinstance(exc, RecursionError):
        return "nested too deeply to read"
    return str(exc)


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no type hints here
    """PyYAML's safe loader, refusing a mapping that gives a key twice (the last would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping
