"""Calibrations from recorded runs, with the error on data the fit never saw (what ``servelens calibrate`` runs).

Three sources (docs/calibration.md):

- ``calibrate_experiments``: run summaries of several runs (the fidelity data's experiments), fitted by
  simulation (``replay.fit``); held-out error by leaving each run out in turn: each fold is fitted as the
  full fit is, from the same start, on the other runs alone, and the run left out is then replayed at
  full length with that fold's calibration;
- ``calibrate_requests``: one recorded run's per-request telemetry (its request table), fitted by
  simulation on top of a base calibration (one model cannot separate the weights' bandwidth share from
  the per-step overhead: the base keeps the first); held-out: fitted on the first half of the run (by
  arrival), judged on the second;
- ``calibrate_steps``: one run's ``step_executed`` events, by least squares on step times
  (``replay.stepfit``); held out likewise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.calibration import Calibration
from replay.config import InstanceConfig
from replay.errors import ReplayError
from replay.fidelity import compare, median_abs_error
from replay.fit import (
    ENGINE_PARAMETERS,
    FitResult,
    HeldOut,
    Parameter,
    Simulator,
    Target,
    as_calibration,
    fit,
    leave_one_out,
    replay_target,
    replay_targets,
    units_of,
)
from replay.load import Load, StepLoadMeter

Progress = Callable[[str], None]
#: The fewest requests (or steps) in each half of a run for its held-out error: fewer, and a second half's
#: p99 is its largest value or near it, and the figure the gate would apply as the model's error is noise.
MIN_HELD_OUT_PER_HALF = 100
#: What one recorded run can separate (the weights' bandwidth share comes from the base calibration).
REQUEST_PARAMETERS = tuple(p for p in ENGINE_PARAMETERS if p.name in ("kv_memory_efficiency", "step_overhead_ns",
                                                                     "seq_overhead_ns"))


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def calibrate_experiments(targets: Sequence[Target], *, name: str, engine: str, held_out: bool = True,
                          workers: int | None = None, seed: int = 0, max_stage_s: float | None = 150.0,
                          max_evaluations: int = 40, progress: Progress | None = None,
                          held: Sequence[str] | None = None, group: Callable[[Target], str] | None = None,
                          warm_folds: bool = False, also_from: Sequence[Calibration] = ()) -> tuple[Calibration, list[HeldOut]]:
    """A calibration fitted to every target and, when ``held_out``, the leave-one-out folds behind its
    held-out error (every target, or those named in ``held``; with ``group``, each fold also leaves out
    every run of the held-out run's group, e.g. its model).

    Each fold's fit starts where the full fit does and never sees the held-out run (cold folds: the
    held-out figures describe the procedure that made the calibration). ``warm_folds`` starts each fold
    from the fit on every run instead, so each fold only corrects it: about three times faster, but that
    start has seen the held-out run, so its figures are optimistic (docs/calibration.md).

    ``also_from`` (e.g. the calibration this one replaces) searches again from each one's terms and keeps
    the search that ended at the lowest loss: the search stops where its path takes it on a rough loss, so a
    refit from the default start alone can end above the calibration it replaces. The folds never start
    there (each has seen every run): the held-out figures are then the default start's, and the notes say
    which search the terms came from."""
    also = " or any run of its group" if group is not None else ""

    with Simulator(workers) as sim:
        result, origin = _fit_all(targets, sim, also_from, seed=seed, max_stage_s=max_stage_s,
                                  max_evaluations=max_evaluations, progress=progress)
        folds: list[HeldOut] = []
        if held_out and len(targets) >= 3:
            _say(progress, f"held-out error: {len(held or targets)} runs, each predicted by a fit without it{also}")
            folds = leave_one_out(targets, sim, start=result.units if warm_folds else None, seed=seed,
                                  max_stage_s=max_stage_s, max_evaluations=max_evaluations, held=held, group=group,
                                  progress=progress)
    accelerators = sorted({t.instance_config.accelerator.name for t in targets})
    draft = as_calibration(result, name=name, engine=engine, accelerators=accelerators, fitted_on=[t.name for t in targets],
                           method=f"simulation-based fit to {len(targets)} run summaries (replay.fit)")
    figures, load = replay_targets(targets, draft, seed)
    in_sample = [e for t, f in zip(targets, figures) for e in compare(t.name, t.recorded, f)]
    held_errors = median_abs_error([e for f in folds for e in f.errors]) if folds else None
    notes = [f"held-out errors: leave-one-out over {len(folds)} runs, each predicted by a calibration fitted "
             f"without it{also}" + (", each fold started from the fit on every run (warm: optimistic)" if warm_folds else "")
             if folds else "held-out error not measured"] + _beyond_note(folds) + origin
    calibration = dataclasses.replace(
        draft, held_out_error_pct=_rounded(held_errors), in_sample_error_pct=_rounded(median_abs_error(in_sample)),
        notes=tuple(notes), fitted_load=load,
    )
    return calibration, folds


def _fit_all(targets: Sequence[Target], sim: Simulator, also_from: Sequence[Calibration], *, seed: int,
             max_stage_s: float | None, max_evaluations: int, progress: Progress | None) -> tuple[FitResult, list[str]]:
    """The fit to every target from the default start and from each of ``also_from``'s terms, the lowest loss
    kept, and a note saying where it came from (none when only the default start searched)."""

    def step(n: int, cost: float) -> None:
        _say(progress, f"  fit: candidate {n}, loss {cost:.4f}")

    _say(progress, f"fitting {len(ENGINE_PARAMETERS)} step-cost terms and the frontend to {len(targets)} runs")
    best = fit(targets, sim, seed=seed, max_stage_s=max_stage_s, max_evaluations=max_evaluations, progress=step)
    if not also_from:
        return best, []
    losses, origin = [f"the default start {best.loss:.4f}"], "the default start"
    for previous in also_from:
        _say(progress, f"fitting again, from calibration {previous.name}'s terms")
        result = fit(targets, sim, start=units_of(previous.roofline), seed=seed, max_stage_s=max_stage_s,
                     max_evaluations=max_evaluations, progress=step)
        losses.append(f"{previous.name}'s terms {result.loss:.4f}")
        if result.loss < best.loss:
            best, origin = result, f"{previous.name}'s terms"
    return best, [f"terms: the search from {origin} ended lowest (final loss from {', '.join(losses)})"]


def median_abs_error_by_load(folds: Sequence[HeldOut]) -> dict[str, dict[str, float]]:
    """The folds' median absolute errors per metric, apart for the held-out runs ``within`` their fold's fitted
    load and those ``beyond`` it (an empty group: no figures)."""
    return {group: median_abs_error([e for f in folds if f.beyond_fitted_load == beyond for e in f.errors])
            for group, beyond in (("within", False), ("beyond", True))}


def _beyond_note(folds: Sequence[HeldOut]) -> list[str]:
    """What the load flag said in the leave-one-out: the held-out runs beyond their fold's fitted load, and their
    median absolute E2E mean error against the others'."""
    beyond = [f for f in folds if f.beyond_fitted_load]
    if not folds or not beyond:
        return [f"leave-one-out: none of the {len(folds)} held-out runs went beyond its fold's fitted load"] if folds else []
    e2e = {group: f"{m['e2e_mean']:.1f}%" if "e2e_mean" in m else "n/a"
           for group, m in median_abs_error_by_load(folds).items()}
    return [f"leave-one-out: {len(beyond)} of {len(folds)} held-out runs went beyond their fold's fitted load "
            f"({', '.join(f.target.name for f in beyond)}): median absolute E2E mean error {e2e['beyond']}, "
            f"against {e2e['within']} for the others"]


def _rounded(errors: dict[str, float] | None) -> tuple[tuple[str, float], ...]:
    return tuple((k, round(v, 2)) for k, v in sorted((errors or {}).items()))


def _halves(requests: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The request table split at its median arrival."""
    ordered = requests.filter(pc.is_valid(requests["arrival_ns"])).sort_by("arrival_ns")
    _check_enough(ordered.num_rows, "requests")
    half = ordered.num_rows // 2
    return ordered.slice(0, half), ordered.slice(half)


def _check_enough(count: int, what: str) -> None:
    if count < 2 * MIN_HELD_OUT_PER_HALF:
        raise ReplayError(
            f"a held-out error needs at least {MIN_HELD_OUT_PER_HALF} {what} in each half of the run; this run "
            f"holds {count:,}",
            f"record a longer run ({2 * MIN_HELD_OUT_PER_HALF} {what} or more), or fit with --no-held-out: the "
            "calibration then states no held-out error, and the gate applies none from it")


def _fit_requests(target: Target, base: Calibration, sim: Simulator, parameters: Sequence[Parameter],
                  seed: int) -> Calibration:
    start = [p.unit(getattr(base.roofline, p.name) or p.start) for p in parameters]
    result = fit([target], sim, start=start, base=base.roofline, parameters=parameters, seed=seed, max_stage_s=None)
    cal = as_calibration(result, name=base.name, engine=base.engine, accelerators=(target.instance_config.accelerator.name,),
                         method="", fitted_on=(target.name,))
    return cal if target.client_side else dataclasses.replace(cal, frontend=base.frontend)


def calibrate_requests(requests: pa.Table, instance: InstanceConfig, base: Calibration, *, name: str, engine: str,
                       held_out: bool = True, workers: int | None = None, seed: int = 0,
                       progress: Progress | None = None) -> Calibration:
    """A calibration fitted to one recorded run's request table (``replay.derive``; ``base`` gives the
    terms one run cannot separate)."""
    held: dict[str, float] | None = None
    with Simulator(1 if workers is None else workers) as sim:
        if held_out:
            first, second = _halves(requests)
            _say(progress, f"held-out error: fitting the first {first.num_rows:,} requests, judging the other "
                           f"{second.num_rows:,}")
            half = _fit_requests(Target.of_requests("first half", first, instance), base, sim, REQUEST_PARAMETERS, seed)
            judged = Target.of_requests("second half", second, instance)
            held = median_abs_error(compare(judged.name, judged.recorded, replay_target(judged, half, seed)))
        _say(progress, f"fitting {requests.num_rows:,} requests")
        target = Target.of_requests("recorded run", requests, instance)
        cal = _fit_requests(target, base, sim, REQUEST_PARAMETERS, seed)
    (figures,), load = replay_targets([target], cal, seed)
    in_sample = median_abs_error(compare(target.name, target.recorded, figures))
    return dataclasses.replace(
        cal, name=name, engine=engine,
        method=f"simulation-based fit to one run's request table ({requests.num_rows:,} requests) over {base.name}",
        held_out_error_pct=_rounded(held), in_sample_error_pct=_rounded(in_sample),
        notes=(f"terms one run cannot separate (weights' bandwidth share, MoE, all-reduce) from {base.name}",),
        fitted_load=load,
    )


def calibrate_steps(events: pa.Table, instance: InstanceConfig, base: Calibration, *, name: str, engine: str,
                    held_out: bool = True, workers: int | None = None, seed: int = 0,
                    progress: Progress | None = None) -> Calibration:
    """A calibration fitted to one run's ``step_executed`` events (``base`` gives the frontend and the
    terms one model's steps cannot separate)."""
    from replay.stepfit import STEP_PARAMETERS, check_timed, fit_steps, predicted_ns, step_shapes

    steps = step_shapes(events)
    check_timed(steps, len(STEP_PARAMETERS))  # the whole run's steps, before the held-out split halves them
    held: dict[str, float] | None = None
    if held_out:
        _check_enough(len(steps), "steps")
        half = len(steps) // 2
        _say(progress, f"held-out error: fitting the first {half:,} steps, judging the other {len(steps) - half:,}")
        first = fit_steps(steps[:half], instance, base.roofline)
        from replay.costmodel import RooflineCostModel

        model = RooflineCostModel(instance, first.roofline)
        errors = [abs(predicted_ns(model, s) / s.duration_ns - 1) * 100 for s in steps[half:] if s.duration_ns > 0]
        if not errors:
            raise ReplayError(f"none of the last {len(steps) - half:,} recorded steps has a duration (end_ns after "
                              "start_ns): there is nothing to judge the held-out error on",
                              "check the engine's step timestamps, or fit with --no-held-out")
        held = {"step_time_median": float(np.median(errors)), "step_time_p90": float(np.percentile(errors, 90))}
    _say(progress, f"fitting {len(steps):,} steps")
    result = fit_steps(steps, instance, base.roofline)
    return dataclasses.replace(
        base, name=name, engine=engine, accelerators=(instance.accelerator.name,), roofline=result.roofline,
        method=f"least squares on {result.num_steps:,} recorded step times (replay.stepfit) over {base.name}",
        fitted_on=(f"{len(steps):,} steps",), held_out_error_pct=_rounded(held),
        in_sample_error_pct=_rounded({"step_time_median": result.median_abs_error_pct,
                                      "step_time_p90": result.p90_abs_error_pct}),
        notes=(f"frontend and the weights' bandwidth share from {base.name}",),
        fitted_load=_recorded_load(events, instance),
    )


def _recorded_load(events: pa.Table, instance: InstanceConfig) -> Load:
    """The load of the recorded steps a calibration was fitted on."""
    meter = StepLoadMeter()
    meter.add(events)
    return meter.load(instance.engine.max_num_seqs)


__all__ = ["REQUEST_PARAMETERS", "calibrate_experiments", "calibrate_requests", "calibrate_steps", "median_abs_error_by_load"]
