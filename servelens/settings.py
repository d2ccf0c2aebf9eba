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
import re
import stat
import tomllib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from schemas.wire import DuplicateKeyError, unique_keys
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
    if isinstance(value, str):
        return _plain_number(value, kind, key)
    if kind is float:
        return as_float
    if as_float != int(as_float):
        raise ConfigError(f"config key {key} must be a whole number, not {value!r}")
    return int(value)


#: Text the environment (or a TOML/YAML string) may give for an int, and for a float: plain decimal notation.
#: Python's own parsers also take ``5_0`` (as 50), surrounding blanks and non-ASCII digits.
_PLAIN_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_PLAIN_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _plain_number(text: str, kind: type, key: str) -> int | float:
    """``text`` (a finite number to Python) as ``kind``, refused by name unless written in plain decimal notation."""
    if kind is int and _PLAIN_INT.fullmatch(text):
        return int(text)
    if kind is float and _PLAIN_FLOAT.fullmatch(text):
        return float(text)
    what, example = ("a whole number", "50 or -3") if kind is int else ("a number", "0.25, -3 or 1e-3")
    raise ConfigError(f"config key {key} must be {what} in plain decimal digits, not {text!r}",
                      f"write it like {example}: no '_' and no blanks")


def check_bounds(section: str, config: object, *, at_least: Mapping[str, float] = {},
                 above: Mapping[str, float] = {}, at_most: Mapping[str, float] = {},
                 non_empty: Collection[str] = ()) -> None:
    """Refuse, naming it, the first setting of ``config`` below its ``at_least`` bound, not above its
    ``above`` bound, above its ``at_most`` bound or empty (of ``non_empty``) (a section's ``__post_init__``
    calls it: a count of 0, a negative time or an absurdly large budget is refused where it is set, not
    found as a hang or a lost guarantee later)."""
    for name, least in at_least.items():
        if getattr(config, name) < least:
            raise ConfigError(f"{section}.{name} must be at least {least:g}, not {getattr(config, name)}")
    for name, bound in above.items():
        if not getattr(config, name) > bound:
            raise ConfigError(f"{section}.{name} must be above {bound:g}, not {getattr(config, name)}")
    for name, most in at_most.items():
        if getattr(config, name) > most:
            raise ConfigError(f"{section}.{name} must be at most {most:,g}, not {_shown(getattr(config, name))}",
                              f"leave it out for the default, {_default(config, name)}")
    for name in non_empty:
        if not str(getattr(config, name)).strip():
            raise ConfigError(f"{section}.{name} must not be empty", f"leave it out for the default, {_default(config, name)!r}")


def _shown(value: float) -> str:
    """A number for an error message: in full, unless it is too long to read (``1e300`` read as an int)."""
    text = str(value)
    return text if len(text) <= 20 else f"{value:.3g}"


def _default(config: object, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(config) if f.name == name)  # type: ignore[arg-type]


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
    """The settings tree the ``SERVELENS_<SECTION>__<KEY>`` variables give; a malformed name, and two
    variables of which one sets a key and the other a key inside it, are refused naming the variables."""
    named: dict[tuple[str, ...], str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        if not all(parts):
            raise ConfigError(f"environment variable {name} is malformed: it has an empty name around '__'",
                              "a setting's variable is SERVELENS_<SECTION>__<KEY>, e.g. SERVELENS_LAKE__ROOT")
        seen = next((k for k in named if k[: len(parts)] == parts or parts[: len(k)] == k), None)
        if seen is not None:
            both = (f"both set {'.'.join(parts)}" if seen == parts else f"set {'.'.join(seen)} and {'.'.join(parts)}, "
                    "and one setting cannot be both a value and a table holding another")
            raise ConfigError(f"environment variables {named[seen]} and {name} conflict: they {both}", "unset one of them")
        named[parts] = name
    tree: dict[str, Any] = {}
    for parts, name in named.items():
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = env[name]
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_one_underscore(env: Mapping[str, str], tree: type) -> None:
    """Refuse, naming it and the name it probably meant, a variable ``SERVELENS_<SECTION>_<KEY>`` (one '_' where
    a setting's variable has two) whose <SECTION> is a section of ``tree`` and <KEY> one of that section's keys:
    nothing reads it, so the setting it was meant to change would silently keep its value. Other ``SERVELENS_*``
    variables (``SERVELENS_SHARED_DIR``, ``SERVELENS_DASHBOARD_SETTINGS``, ``SERVELENS_PSEUDONYM_KEY``) pass."""
    sections = {name: {f.name for f in dataclasses.fields(kind)}
                for name, kind in typing.get_type_hints(tree).items() if dataclasses.is_dataclass(kind)}
    for name in sorted(env):
        rest = name[len(ENV_PREFIX):].lower() if name.startswith(ENV_PREFIX) else "__"
        section, sep, key = rest.partition("_")
        if "__" in rest or not sep or key not in sections.get(section, ()):
            continue
        meant = f"{ENV_PREFIX}{section.upper()}__{key.upper()}"
        raise ConfigError(f"environment variable {name} sets nothing: it has one '_' after {section.upper()}, where "
                          f"a setting's variable has two; it probably means {meant} ({section}.{key})",
                          f"rename it {meant} (a setting's variable is SERVELENS_<SECTION>__<KEY>), or unset it")


def read_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None, *,
                  tree: type | None = None) -> dict[str, Any]:
    """The raw settings tree: an optional TOML file, overridden by the environment. With ``tree`` (the
    dataclass whose fields are the sections), a variable naming a setting with one '_' after its section
    (``SERVELENS_LAKE_ROOT`` for ``SERVELENS_LAKE__ROOT``) is refused rather than silently ignored."""
    env = os.environ if env is None else env
    if tree is not None:
        _check_one_underscore(env, tree)
    path = path or env.get(f"{ENV_PREFIX}CONFIG")
    data: dict[str, Any] = {}
    if path:
        data = read_toml(path, "config file", "fix the file (TOML, https://toml.io), or pass another with --config",
                         missing_hint="pass an existing TOML file or unset SERVELENS_CONFIG")
    data = _merge(data, _env_overrides(env))
    if "SERVELENS_SHARED_DIR" in env:  # the short, documented spelling
        data = _merge(data, {"paths": {"shared_dir": env["SERVELENS_SHARED_DIR"]}})
    return data


def read_toml(path: str | Path, what: str, hint: str | None = None, *, missing_hint: str | None = None,
              folder_hint: str | None = None, max_bytes: int | None = None,
              size_hint: str | None = None) -> dict[str, Any]:
    """The content of the TOML file ``path``; a ``ConfigError`` naming ``what`` and the file when it is missing,
    a folder, not UTF-8 text, not valid TOML, nested too deeply to read or (with ``max_bytes``) larger than
    ``max_bytes`` (``hint`` unless a more special one is given)."""
    path = Path(path)
    try:
        if max_bytes is None:
            return tomllib.loads(path.read_text())
        return tomllib.loads(_read_bounded(path, max_bytes, what, size_hint or hint).decode())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", missing_hint or hint) from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file", folder_hint or hint) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {_fault(exc)}", hint) from None


def _regular_file(path: Path, what: str, hint: str | None) -> os.stat_result:
    """``path``'s status, checked before it is opened (opening a named pipe blocks until something writes to it):
    ``IsADirectoryError`` for a folder, a ``ConfigError`` naming ``what`` for anything else but a regular file."""
    info = path.stat()
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file (a pipe, a device or a socket)", hint)
    return info


def _read_bounded(path: Path, max_bytes: int, what: str, hint: str | None) -> bytes:
    """The bytes of the regular file ``path``, refused (naming ``what``) when it is none (a pipe would block
    the reader until something writes to it, a device may never end) or larger than ``max_bytes``: by its
    size, before any of it is read (and by what it gave, should it grow meanwhile)."""
    bound = f"{max_bytes:,} bytes" + (f" ({max_bytes >> 20} MiB)" if max_bytes % (1 << 20) == 0 else "")
    info = _regular_file(path, what, hint)
    if info.st_size > max_bytes:
        raise ConfigError(f"{what} {path} is {info.st_size:,} bytes, above the bound of {bound}", hint)
    with path.open("rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{what} {path} is more than the bound of {bound}", hint)
    return data


def read_document(path: str | Path, what: str, hint: str | None = None) -> Any:
    """The content of the YAML (or, named ``*.json``, JSON) file ``path``; a ``ConfigError`` naming ``what`` and
    the file when it is missing, a folder, not UTF-8 text, not valid YAML or JSON, nested too deeply to read,
    or (YAML) a mapping that gives a key twice, or holding a number of more digits than Python reads (4,300).
    A path that is no regular file (a named pipe would block the reader) is refused before it is opened.
    An empty YAML file is ``None``."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        _regular_file(path, what, hint)
        text = path.read_text()
        if kind == "JSON":
            return json.loads(text, object_pairs_hook=unique_keys)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
        _check_string_keys(data, path, what)
        return data
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: the key {exc.key!r} is given twice", hint) from None
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", hint) from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file", hint) from None
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{what} {path} is not valid {kind}: {_fault(exc)}", hint) from None
    except ValueError:  # an integer of more than 4,300 digits (Python's conversion limit)
        raise ConfigError(f"{what} {path} holds a number of more than 4,300 digits, which no setting needs",
                          hint) from None


#: The most nodes a YAML document may hold once its aliases are expanded: a settings file holds hundreds;
#: nine levels of nine aliases (a 324-byte "billion laughs") would hold 9**9 and hang every reader of it.
MAX_EXPANDED_NODES = 1_000_000


def _check_string_keys(data: Any, path: Path, what: str) -> None:
    """Refuse, naming the file, a YAML mapping with a key that is not a string (``1: 2``, ``null: x``):
    settings are named, and keys of mixed types cannot even be sorted for a message. Also refused: aliases
    that expand to more than ``MAX_EXPANDED_NODES`` nodes, or that hold themselves (``&a [*a]``), which no
    reader could walk to its end. Each node is visited once, however many aliases name it."""
    sizes: dict[int, int] = {}  # id of a finished node -> its expanded size
    open_: set[int] = set()  # ids of the nodes on the current path
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)) or (not children_done and id(node) in sizes):
            continue
        children = list(node.values()) if isinstance(node, dict) else node
        if children_done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes.get(id(c), 1) for c in children)
            if sizes[id(node)] > MAX_EXPANDED_NODES:
                raise ConfigError(f"{what} {path} expands its aliases to more than {MAX_EXPANDED_NODES:,} values",
                                  "write the values out, or use fewer nested aliases (*name)")
            continue
        if id(node) in open_:
            raise ConfigError(f"{what} {path} holds an alias inside the value it names (&a [*a]): it never ends",
                              "remove the alias from inside its own anchor's value")
        if isinstance(node, dict) and (bad := [k for k in node if not isinstance(k, str)]):
            raise ConfigError(f"{what} {path} has the key {bad[0]!r}, which is not a name",
                              "every key of a configuration is a name: quote it (e.g. '1': ...) or remove it")
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children)


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
