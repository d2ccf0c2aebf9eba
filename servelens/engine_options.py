"""The engine options of the command line, generated from ``replay.vllm.VllmSettings`` (one source of names,
help and defaults), and the assembly of the instance and calibration they describe.

Every ``VllmSettings`` field becomes an option with vLLM's name: ``--max-num-seqs N``,
``--enable-prefix-caching/--no-enable-prefix-caching``, ... (unset: the engine default). Besides them,
``--engine-config FILE.yaml`` (the same keys, as a ``vllm serve --config`` file, plus ``engine:``) and
``--calibration NAME|FILE|none`` (default ``auto``: the shipped calibration, ``replay.calibration``).
Options given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from replay.calibration import Calibration, calibration_named
from replay.config import InstanceConfig
from replay.vllm import VllmSettings, check_engine_spec, read_vllm_settings, vllm_instance
from servelens.click_types import Finite
from servelens.config import Config, shared_dir
from servelens.errors import DataNotFoundError, ServelensError

_META = "vllm."
DEFAULT_ENGINE = "llama-3-8b@h100-sxm"
ENGINE_HELP = (
    "MODEL@ACCELERATOR[xTP]: a preset (llama-3-8b, llama-2-70b), a Hugging Face id of the fidelity model table "
    "(meta-llama/Llama-3.1-8B-Instruct) or a config.json path; accelerators h100-sxm (h100), h100-pcie, h200, "
    "a100-80g (a100), a100-40g, l40s, b200. e.g. llama-2-70b@a100-80gx2"
)


def _stash(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            ctx.meta[_META + name] = value

    return callback


#: Other names an option also answers to.
_ALIASES = {"kv_offloading_size": ("--kv-offload",)}


def _option(f: dataclasses.Field) -> Callable:
    flag = "--" + f.name.replace("_", "-")
    kind = str(f.type)
    help_text = f.metadata.get("doc", "")
    if "bool" in kind:
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, expose_value=False, callback=_stash(f.name),
                            help=help_text)
    click_type = int if "int" in kind else float if "float" in kind else str
    metavar = {int: "N", float: "X", str: "NAME"}[click_type]
    return click.option(flag, *_ALIASES.get(f.name, ()), type=Finite() if click_type is float else click_type,
                        default=None, expose_value=False,
                        callback=_stash(f.name), metavar=metavar, help=help_text)


def vllm_options(command: Callable) -> Callable:
    """Add the engine options (vLLM's names), ``--engine-config`` and ``--calibration`` to a command."""
    options = [_option(f) for f in dataclasses.fields(VllmSettings)]
    options.append(click.option(
        "--engine-config", type=click.Path(exists=True, dir_okay=False, path_type=Path), expose_value=False,
        callback=_stash("engine_config"),
        help="YAML file of vllm serve settings (these options' names, dashes or underscores) and optionally "
             "engine: MODEL@ACCELERATOR[xTP]; options on the command line win."))
    options.append(click.option(
        "--calibration", expose_value=False, callback=_stash("calibration"), metavar="NAME|FILE|none",
        help="Calibration of the roofline cost model (servelens calibrate; docs/calibration.md) [default: auto, "
             "the shipped one; none: the uncalibrated roofline, engine-side times only]."))
    for option in reversed(options):
        command = option(command)
    return command


def _settings(ctx: click.Context) -> VllmSettings:
    names = {f.name for f in dataclasses.fields(VllmSettings)}
    return VllmSettings(**{k[len(_META):]: v for k, v in ctx.meta.items()
                           if k.startswith(_META) and k[len(_META):] in names})


def _shared(config: Config) -> Path | None:
    try:
        return shared_dir(config)
    except DataNotFoundError:
        return None


def engine_instance(ctx: click.Context, config: Config, engine_spec: str | None, cost_model: str = "roofline"
                    ) -> tuple[InstanceConfig, Calibration | None]:
    """The instance the options describe, and the calibration to replay it with (None: uncalibrated)."""
    settings, spec = _settings(ctx), engine_spec
    file = ctx.meta.get(_META + "engine_config")
    if file is not None:
        from_file, file_spec = read_vllm_settings(file)
        settings = from_file.merged(settings)
        spec = file_spec if spec is None else spec
    instance = vllm_instance(DEFAULT_ENGINE if spec is None else spec, settings, _shared(config))
    return instance, choose_calibration(ctx.meta.get(_META + "calibration", "auto"), cost_model)


def choose_calibration(name: str, cost_model: str) -> Calibration | None:
    """``auto``: the shipped calibration (for the roofline model); ``none``: none; else a name or a file."""
    if name == "none":
        return None
    if cost_model != "roofline":
        if name == "auto":
            return None
        raise ServelensError(f"--calibration {name} calibrates the roofline cost model, not {cost_model}",
                             "drop --calibration or use --cost-model roofline")
    return calibration_named(name)


def engine_spec_given(ctx: click.Context, param: str = "engine_spec") -> bool:
    """Whether ``--engine`` was given on the command line (not its default)."""
    return ctx.get_parameter_source(param) not in (click.core.ParameterSource.DEFAULT, None)


def check_engine(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The callback of every ``--engine``: refuse a name that can name no instance (``check_engine_spec``)."""
    if value is not None:
        check_engine_spec(value, "--engine")
    return value


def given_options(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The options of ``names`` (parameter names) given explicitly, as typed (``--no-...`` for a switch turned off)."""
    given = []
    for param in ctx.command.params:
        if param.name in names and engine_spec_given(ctx, param.name):
            off = ctx.meta.get(_META + param.name) is False and isinstance(param, click.Option) and param.secondary_opts
            given.append(param.secondary_opts[0] if off else param.opts[0])
    return given


#: The parameters of the engine the options describe: --engine, vLLM's settings and --engine-config.
ENGINE_PARAMETERS = ("engine_spec", *(f.name for f in dataclasses.fields(VllmSettings)), "engine_config")


def refuse_given_options(ctx: click.Context, why: str, hint: str, names: tuple[str, ...] = ENGINE_PARAMETERS) -> None:
    """Refuse the engine options (or other ``names``) given explicitly where the command would ignore them."""
    given = given_options(ctx, names)
    if given:
        raise ServelensError(f"{', '.join(given)}: {why}", hint)


__all__ = ["DEFAULT_ENGINE", "ENGINE_HELP", "ENGINE_PARAMETERS", "check_engine", "choose_calibration", "engine_instance",
           "engine_spec_given", "given_options", "refuse_given_options", "vllm_options"]
