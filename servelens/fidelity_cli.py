"""``servelens fidelity`` and ``servelens calibrate``: how faithful the replay is, and making it so.

Thin commands over ``replay.fidelity``, ``replay.fit`` and ``replay.stepfit`` (docs/calibration.md).
"""

from __future__ import annotations

from pathlib import Path

import click

from replay.calibration import Calibration, write_calibration
from replay.load import sequences
from servelens.click_types import OUT_FILE, OUT_FOLDER, SEED, refuse_overwriting
from servelens.config import Config, shared_dir
from servelens.engine_options import (
    ENGINE_HELP,
    ENGINE_PARAMETERS,
    check_engine,
    choose_calibration,
    engine_instance,
    refuse_given_options,
    vllm_options,
)
from servelens.errors import ServelensError

SOURCES = ("experiments", "requests", "steps")


def _config(ctx: click.Context) -> Config:
    return ctx.find_root().obj["config"]


def _fidelity_folder(ctx: click.Context, data: Path | None) -> Path:
    from replay.fidelity import FIDELITY_DIR

    return data if data is not None else shared_dir(_config(ctx)) / FIDELITY_DIR


def _shared_or_none(ctx: click.Context) -> Path | None:
    try:
        return shared_dir(_config(ctx))
    except ServelensError:
        return None


def _experiment_targets(ctx: click.Context, data: Path | None, ids: str | None) -> list:
    from replay.fidelity import read_experiments
    from replay.fit import Target

    experiments = read_experiments(_fidelity_folder(ctx, data))
    if ids is not None:
        wanted = [i.strip() for i in ids.split(",") if i.strip()]
        if not wanted:
            raise ServelensError(f"--experiments {ids!r} names no experiment",
                                 f"give comma-separated ids ({', '.join(e.id for e in experiments)}), or leave "
                                 "--experiments out for every one")
        unknown = sorted(set(wanted) - {e.id for e in experiments})
        if unknown:
            raise ServelensError(f"unknown experiment(s) {', '.join(unknown)}",
                                 f"measured experiments: {', '.join(e.id for e in experiments)}")
        experiments = [e for e in experiments if e.id in wanted]
    return [Target.of_experiment(e, _shared_or_none(ctx)) for e in experiments]


def _events(ctx: click.Context, events: str):
    """A recorded run's events: a JSONL or Parquet file, or ``lake`` (the configured lake's events)."""
    from replay.derive import read_events

    if events != "lake":
        path = Path(events)
        if not path.is_file():
            raise ServelensError(f"no events file {events}", "give a JSONL or Parquet events file, or `lake`")
        return read_events(path)
    from pipelines.lake import Lake

    config = _config(ctx)
    return Lake(config.lake.root, config.lake).connect().sql("SELECT * FROM events").to_arrow_table()


def _progress(message: str) -> None:
    click.echo(message, err=True)


# ---------------------------------------------------------------------------------------------- fidelity


@click.command("fidelity")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A fidelity folder (experiments.csv and workloads/) [default: the shared data's fidelity/].")
@click.option("--experiments", "ids", default=None, help="Comma-separated experiment ids [default: every measured one].")
@click.option("--events", default=None, metavar="FILE|lake",
              help="Instead: a recorded run's events (JSONL or Parquet, or `lake`), replayed on --engine with its "
                   "settings; compared client side where the events record client times, else engine side.")
@click.option("--engine", "engine_spec", default=None, callback=check_engine, help=ENGINE_HELP + " (with --events)")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the replayed workloads.")
@click.option("--out", type=OUT_FOLDER, required=True,
              help="Folder for fidelity.json, fidelity.md and fidelity.html.")
@vllm_options
@click.pass_context
def fidelity_command(ctx: click.Context, data: Path | None, ids: str | None, events: str | None,
                     engine_spec: str | None, seed: int, out: Path) -> None:
    """Replay recorded runs under their recorded settings and report recorded vs replayed latencies.

    TTFT, ITL and E2E (mean, p50, p90, p99, as each run recorded them) with signed and absolute errors
    per run and the median absolute error across runs: the field's measure of a simulator's fidelity
    (docs/calibration.md). The replay uses the calibration (--calibration, default the shipped one).

    \b
    Example:
      servelens fidelity --out out/fidelity
      servelens fidelity --experiments 60,61 --calibration none --out out/fidelity-raw
      servelens fidelity --events out/demo/engine/events.parquet --engine llama-2-7b@a100-80gx2 --out out/fidelity-demo
    """
    from replay.fidelity import FidelityReport, compare, stage_errors, write_report
    from replay.fit import Target, replay_measured

    if events is not None:
        refuse_given_options(ctx, "given with --events, which replays one recorded run (--data and --experiments "
                              "pick fidelity experiments instead)", "drop them, or drop --events to replay the "
                              "fidelity experiments", ("data", "ids"))
        instance, calibration = engine_instance(ctx, _config(ctx), engine_spec)
        from replay.derive import derive_requests

        targets = [Target.of_requests(Path(events).stem, derive_requests(_events(ctx, events)), instance)]
    else:
        refuse_given_options(ctx, "given with fidelity experiments, which replay their own recorded engine and "
                              "settings (--engine and the engine options go with --events)",
                              "drop them, or give the recorded run with --events")
        targets = _experiment_targets(ctx, data, ids)
        calibration = choose_calibration(ctx.meta.get("vllm.calibration", "auto"), "roofline")
    cal = calibration or _uncalibrated()
    errors, labels, loads, by_stage = [], [], [], []
    for t in targets:
        replayed, stages, load = replay_measured(t, cal, seed)
        loads.append((t.name, load))
        errors.extend(compare(t.name, t.recorded, replayed))
        by_stage.extend(stage_errors(t.name, t.recorded_stages, stages))
        labels.append((t.name, t.experiment.label() if t.experiment is not None else t.name))
        worst = max((e for e in errors if e.experiment == t.name), key=lambda e: e.abs_pct)
        _progress(f"  {labels[-1][1]}: worst {worst.metric} {worst.signed_pct:+.1f}%")
    report = FidelityReport(cal.name, tuple(errors), tuple(labels), loads=tuple(loads), fitted_load=cal.fitted_load,
                            stage_errors=tuple(by_stage))
    paths = write_report(report, out)
    medians = report.median_abs_error_pct
    click.echo("median absolute error across runs: " + ", ".join(f"{k} {v:.1f}%" for k, v in medians.items()))
    click.echo(f"report: {paths['md']} (and fidelity.json, fidelity.html)")


def _uncalibrated() -> Calibration:
    """The roofline's defaults as a calibration (no frontend, no async scheduling): what --calibration none
    replays."""
    from replay.config import FrontendConfig
    from replay.costmodel import RooflineConfig

    return Calibration(name="uncalibrated roofline", engine="", accelerators=(), roofline=RooflineConfig(),
                       frontend=FrontendConfig(), async_scheduling=False)


# ---------------------------------------------------------------------------------------------- calibrate


@click.command("calibrate")
@click.option("--from", "source", type=click.Choice(SOURCES), default="experiments", show_default=True,
              help="experiments: run summaries (a fidelity folder), fitted by simulation; requests: a recorded "
                   "run's per-request telemetry, fitted by simulation; steps: its step_executed events, by "
                   "least squares.")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="With --from experiments: a fidelity folder [default: the shared data's fidelity/].")
@click.option("--experiments", "ids", default=None, help="With --from experiments: comma-separated ids [default: all].")
@click.option("--events", default=None, metavar="FILE|lake", help="With --from requests or steps: the recorded events.")
@click.option("--engine", "engine_spec", default=None, callback=check_engine,
              help=ENGINE_HELP + " (with --from requests or steps)")
@click.option("--held-out/--no-held-out", default=True, show_default=True,
              help="Measure the held-out error: leave each experiment out in turn, each fold fitted from the full "
                   "fit's start without it (experiments; about 30 minutes for the 13 shared runs on two cores), or "
                   "fit on the first half and judge the second (requests, steps).")
@click.option("--name", default=None, help="The calibration's name [default: from the output file].")
@click.option("--engine-version", default="vLLM 0.15.1", show_default=True, help="The engine the data came from.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Replays in parallel [default: the CPUs, at most 4].")
@click.option("--out", type=OUT_FILE, required=True, help="Calibration file (JSON).")
@vllm_options
@click.pass_context
def calibrate_command(ctx: click.Context, source: str, data: Path | None, ids: str | None, events: str | None,
                      engine_spec: str | None, held_out: bool, name: str | None, engine_version: str,
                      workers: int | None, out: Path) -> None:
    """Fit the replay's step cost and frontend to recorded runs; write a calibration file.

    The fitted terms are physically bounded (shares of the hardware's peak, non-negative times), few,
    and reported with the error on runs the fit never saw. Use the file with
    `servelens replay --calibration FILE` (docs/calibration.md). --calibration here is the fit's base:
    with --from requests or steps the terms one run cannot separate come from it (default: the shipped
    one; none: the uncalibrated roofline); with --from experiments, when given, a second search starts
    from its terms and the lower loss is kept.

    \b
    Example:
      servelens calibrate --out out/vllm-h100.json                       # the shared fidelity experiments
      servelens calibrate --from steps --events out/demo/engine/events.parquet --engine llama-2-7b@a100-80gx2 --out my.json
      servelens --lake out/demo/lake calibrate --from requests --events lake --engine llama-2-7b@a100-80gx2 --out my.json
    """
    refuse_overwriting(out, events)
    name = name or out.stem
    if source == "experiments":
        refuse_given_options(ctx, "given with --from experiments, whose runs carry their own workload, engine and "
                              "settings (--events, --engine and the engine options go with --from requests or steps)",
                              "drop them, or calibrate a recorded run with --from requests or steps and --events",
                              ("events", *ENGINE_PARAMETERS))
        calibration = _calibrate_experiments(ctx, data, ids, held_out, name, engine_version, workers)
    else:
        if events is None:
            raise ServelensError(f"--from {source} needs --events FILE (or lake)", "give the recorded run's events")
        refuse_given_options(ctx, f"given with --from {source}, which fits the run --events recorded (--data and "
                              "--experiments go with --from experiments)", "drop them", ("data", "ids"))
        instance, base = engine_instance(ctx, _config(ctx), engine_spec)
        if base is None:
            base = _base_calibration(ctx)
        from replay.calibrate import calibrate_requests, calibrate_steps

        recorded = _events(ctx, events)
        if source == "requests":
            from replay.derive import derive_requests

            fit, recorded = calibrate_requests, derive_requests(recorded)
        else:
            fit = calibrate_steps
        calibration = fit(recorded, instance, base, name=name, engine=engine_version, held_out=held_out,
                          workers=workers, progress=_progress)
    path = write_calibration(calibration, out)
    click.echo(f"calibration {calibration.name}: " + ", ".join(
        f"{f}={getattr(calibration.roofline, f)}" for f in ("memory_efficiency", "kv_memory_efficiency",
                                                             "step_overhead_ns", "seq_overhead_ns")))
    if calibration.held_out_error_pct:
        click.echo("held-out median absolute error: " + ", ".join(f"{k} {v:.1f}%" for k, v in calibration.held_out_error_pct))
    if calibration.fitted_load is not None:
        load = calibration.fitted_load
        click.echo(f"fitted load: its runs' busiest minute {load.batch_share:.0%} of max_num_seqs decoding"
                   f"{sequences(load.batch_seqs)}, "
                   f"{load.kv_share:.0%} of the KV pool in use (replays beyond it are flagged as extrapolations)")
    click.echo(f"written: {path}  (use: servelens replay --calibration {path} ...)")


def _base_calibration(ctx: click.Context) -> Calibration:
    """The base of a fit where --calibration names none: ``none`` is the uncalibrated roofline; ``auto`` with no
    shipped calibration is an error."""
    if ctx.meta.get("vllm.calibration") != "none":
        raise ServelensError("no base calibration to start from", "calibrate --from experiments first, or give "
                             "--calibration FILE (or none: the uncalibrated roofline)")
    return _uncalibrated()


def _calibrate_experiments(ctx: click.Context, data: Path | None, ids: str | None, held_out: bool, name: str,
                           engine_version: str, workers: int | None) -> Calibration:
    """The fit to the experiments from the default start and, where --calibration names one, from its terms too
    (the lower loss kept)."""
    from replay.calibrate import calibrate_experiments
    from replay.fit import ENGINE_PARAMETERS as FITTED

    targets = _experiment_targets(ctx, data, ids)
    if len(targets) < 2:
        raise ServelensError("a calibration from run summaries needs at least two experiments",
                             f"give more experiments (the fit has {len(FITTED)} terms)")
    given = ctx.meta.get("vllm.calibration")
    start = choose_calibration(given, "roofline") if given is not None else None
    return calibrate_experiments(targets, name=name, engine=engine_version, held_out=held_out, workers=workers,
                                 progress=_progress, also_from=() if start is None else (start,))[0]


COMMANDS = (fidelity_command, calibrate_command)
