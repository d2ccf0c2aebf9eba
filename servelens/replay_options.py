"""`servelens replay`'s scenario options and its summary (a thin layer over ``replay.presets`` and
``replay.figures``).

``--scenario``, ``--load``, ``--superpose``/``--shift`` and ``--block-bootstrap``/``--windows`` say which
documented scenario and which load a replay runs (``docs/replay.md``, Scenarios on the command line);
``prepare`` turns them into the workload, the scenario and the policy configuration, exactly as
``benchmarks/policies.py`` builds its table's runs. ``echo_summary`` prints what the run's own request
table says: goodput and attainment per class beside rejections, latency percentiles, the prefix-cache
hit rate and cost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from replay.presets import MAX_SPAN_S, PRESETS, LoadShape, Preset, parse_load
from servelens.click_types import Duration
from servelens.errors import ServelensError

_META = "shape."


def _stash(name: str, convert: Callable[[Any], Any] | None = None):
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            try:
                ctx.meta[_META + name] = convert(value) if convert else value
            except ValueError as exc:
                raise click.BadParameter(str(exc)) from None

    return callback


def _load(value: str):
    try:
        return parse_load(value)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(str(exc).split("\n")[0]) from None


def scenario_options(command: Callable) -> Callable:
    """Add --scenario, --load, --superpose, --shift, --block-bootstrap and --windows to a command."""
    options = [
        click.option("--scenario", expose_value=False, callback=_stash("scenario"), type=click.Choice(PRESETS),
                     help="Who sends what under which objectives (docs/policies.md): two-class (five tenants drawn, "
                          "interactive and batch, their objectives as deadlines), as-recorded (the workload's tenants "
                          "and classes) [default: auto, two-class for a trace without tenants]."),
        click.option("--load", expose_value=False, callback=_stash("load", _load), metavar="2x",
                     help="Rate multiplier: every gap between arrivals divided by it, bursts kept (2x, 1.5x, 0.5x)."),
        click.option("--superpose", expose_value=False, callback=_stash("superpose"), type=click.IntRange(min=1),
                     metavar="N", help="Merge N copies of the workload, copy i shifted by i x --shift."),
        click.option("--shift", expose_value=False, callback=_stash("shift"), type=Duration(0, MAX_SPAN_S), metavar="S",
                     help="Shift between superposed copies: 30s, 10m, 1h [default: 0]."),
        click.option("--block-bootstrap", expose_value=False, callback=_stash("bootstrap"),
                     type=Duration(0, MAX_SPAN_S, min_open=True), metavar="S",
                     help="Resample windows of this length with replacement (seeded by --seed): 60s, 5m."),
        click.option("--windows", expose_value=False, callback=_stash("windows"), type=click.IntRange(min=1),
                     metavar="N", help="Windows the block bootstrap draws [default: as many as the workload holds]."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def load_shape(ctx: click.Context, seed: int) -> LoadShape:
    """The options' load shape."""
    meta = {k.removeprefix(_META): v for k, v in ctx.meta.items() if k.startswith(_META)}
    if "shift" in meta and meta.get("superpose", 1) == 1:
        raise ServelensError("--shift needs --superpose N (N > 1)", "e.g. --superpose 4 --shift 10m")
    from fractions import Fraction

    return LoadShape(load=meta.get("load", Fraction(1)), superpose=meta.get("superpose", 1), shift_s=meta.get("shift", 0.0),
                     bootstrap_window_s=meta.get("bootstrap"), bootstrap_windows=meta.get("windows"),
                     bootstrap_seed=seed)


def prepare(ctx: click.Context, workload_name: str, shared: Path | None, num_requests: int | None, seed: int,
            policy_name: str, policy_config: Path | None):
    """(workload, preset, the policy's config) for the replay the options describe."""
    from replay.policies import load_policy_config
    from replay.presets import default_policy_config, prepared_workload
    from replay.workload import load_workload

    base = load_workload(workload_name, shared, None, seed)
    workload, preset = prepared_workload(base.table, base.name, preset=ctx.meta.get(_META + "scenario", "auto"),
                                         shape=load_shape(ctx, seed), seed=seed, num_requests=num_requests)
    config = (load_policy_config(policy_name, policy_config, preset.tenancy) if policy_config is not None
              else default_policy_config(policy_name, preset))
    describe = f"scenario {preset.name}"
    if preset.tenancy.tenants:
        describe += f" ({len(preset.tenancy.tenants)} tenants, classes {', '.join(c.name for c in preset.tenancy.classes)})"
    transforms = workload.meta.get("transforms", [])
    click.echo(f"{describe}; workload {workload.name}: {workload.num_requests:,} requests"
               + (f" after {', '.join(transforms)}" if transforms else ""), err=True)
    if preset.name == "as-recorded":
        _warn_relabelled(base.table, preset)
    _warn_empty_lengths(base.table)
    return workload, preset, config


def _warn_empty_lengths(table) -> None:
    """Say how many requests record a prompt or an output of 0 tokens (not marked failed): each is served with
    one token there, as no engine serves an empty prompt or ``max_tokens`` 0 (vLLM refuses both)."""
    import pyarrow.compute as pc

    served = pc.invert(pc.fill_null(table["failed"], False)) if "failed" in table.column_names else None

    def count(column: str) -> int:
        empty = pc.equal(table[column], 0)
        return pc.sum(empty if served is None else pc.and_(empty, served)).as_py() or 0

    prompts, outputs = count("num_prompt_tokens"), count("num_output_tokens")
    for count, what in ((prompts, "a prompt"), (outputs, "an output")):
        if count:
            click.echo(f"warning: {count:,} {'request records' if count == 1 else 'requests record'} {what} of 0 tokens: "
                       "each is served with 1 token (no engine "
                       "serves an empty prompt or max_tokens 0); mark a failed request in the workload's failed "
                       "column instead (docs/replay.md)", err=True)


def _warn_relabelled(table, preset: Preset) -> None:
    """Say how many requests recorded a class the scenario does not define (each served as its tenant's)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    defined = [c.name for c in preset.tenancy.classes]
    recorded = table["service_class"]
    other = pc.and_(pc.is_valid(recorded), pc.invert(pc.is_in(recorded, value_set=pa.array(defined, pa.string()))))
    count = pc.sum(other).as_py() or 0
    if count:
        names = sorted(pc.unique(recorded.filter(other)).to_pylist())
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        click.echo(f"warning: {count:,} requests record a class the as-recorded scenario does not define ({shown}): "
                   f"each is served and judged under its tenant's class ({', '.join(defined)}; docs/replay.md)", err=True)


def echo_summary(summary, preset: Preset, calibration, instance) -> None:
    """The run's figures from its own request table, and the calibration behind them."""
    import pyarrow.parquet as pq

    from replay.calibration import other_engine
    from replay.figures import busy_steps, format_figures, run_figures

    if summary.requests_path is None:
        return
    requests = pq.read_table(summary.requests_path)
    figures = run_figures(requests, busy_steps(summary.busy_s), preset.metrics)
    objectives = "; ".join(
        f"{c.name}: " + ", ".join(f"{k} <= {v:g} s" for k, v in (("TTFT", c.ttft_s), ("ITL", c.itl_s), ("E2E", c.e2e_s))
                                  if v is not None)
        for c in preset.metrics.classes)
    click.echo(f"objectives ({preset.name}): {objectives}")
    for line in format_figures(figures):
        click.echo(line)
    _warn_errored(requests)
    if calibration is not None:
        where = "" if instance.accelerator.name in calibration.accelerators else (
            f", extrapolated from {', '.join(calibration.accelerators)} to {instance.accelerator.name}")
        held = ", ".join(f"{k} {v:.1f}%" for k, v in calibration.held_out_error_pct if k in ("ttft_mean", "e2e_mean", "itl_mean"))
        click.echo(f"calibration {calibration.name} ({calibration.engine}{where}; median held-out error "
                   f"{held or 'not measured'})")
        if note := other_engine(calibration):
            click.echo(f"warning: calibration {calibration.name}: {note}", err=True)
    echo_load(summary.manifest_path)


def _warn_errored(requests) -> None:
    """A warning where requests ended in ``error`` (their instance failed and no other took them): the figures
    above count them as missed, but not as rejected, cancelled or degraded."""
    import pyarrow.compute as pc

    if "outcome" not in requests.column_names:
        return
    errored = pc.sum(pc.equal(requests["outcome"], "error")).as_py() or 0
    if errored:
        click.echo(f"warning: {errored:,} of {requests.num_rows:,} requests ended in error (failed in the recorded trace, "
                   "its failed column, or their instance failed and no instance took them over); see the outcome column "
                   "of requests.parquet", err=True)


def echo_load(manifest_path) -> None:
    """The run's load (its manifest's, ``replay.load``): a warning where it lies beyond its calibration's fitted runs."""
    import json

    from replay.load import describe_load

    record = json.loads(manifest_path.read_text()).get("load") if manifest_path is not None else None
    if record:
        line, beyond = describe_load(record)
        click.echo(f"warning: {line}" if beyond else line, err=beyond)
