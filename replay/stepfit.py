"""Fitting the step cost to recorded engine steps: ``step_executed`` events with their batch composition.

An engine that emits ``step_executed`` (its batch members and the tokens each processed, the step's
start and end) records exactly what the cost model predicts. ``step_shapes`` rebuilds every step's
composition (``StepShape``): each member's tokens computed before the step come from its earlier
steps (a preemption by recompute starts it again), its prompt length from ``request_arrived``; a
member still inside its prompt is a prefill chunk, the others decode. ``fit_steps`` then solves for the
roofline terms that make the model's step times match the recorded ones (least squares on log
ratios, bounded like every calibration term), a run of ``num_steps`` identical decode steps judged
by its total.

What one model's steps can separate: the per-step overhead and the weights' bandwidth share both
add a constant to every step of a dense model, so only one of them is fitted (``STEP_PARAMETERS``:
the overhead; the weights' share stays at the base calibration's); compute efficiency from prefill
chunks, KV bandwidth from decode contexts, the per-sequence cost from batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.config import InstanceConfig
from replay.costmodel import RooflineConfig, RooflineCostModel, StepShape
from replay.errors import ReplayError
from replay.fit import Parameter, roofline_at

STEP_PARAMETERS = (
    Parameter("compute_efficiency", 0.1, 1.0, 0.6),
    Parameter("kv_memory_efficiency", 0.15, 1.0, 0.5),
    Parameter("step_overhead_ns", 0, 5_000_000, 1_000_000, integer=True),
    Parameter("seq_overhead_ns", 0, 100_000, 10_000, integer=True),
)


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One ``step_executed`` event: its composition (per step) and its recorded duration."""

    shape: StepShape
    num_steps: int
    duration_ns: int


def step_shapes(events: pa.Table) -> list[RecordedStep]:
    """The recorded steps of an event table, in time order, with their compositions rebuilt."""
    prompts = _prompt_tokens(events)
    steps = events.filter(pc.equal(events["event_type"], "step_executed"))
    resets = _preemptions(events)
    if steps.num_rows == 0:
        raise ReplayError("no step_executed events to fit", "the engine must emit step_executed with its batch members")
    steps = steps.sort_by([("start_ns", "ascending"), ("step_index", "ascending")])
    progress: dict[str, int] = {}
    out = []
    rows = zip(*(steps[c].to_pylist() for c in ("start_ns", "end_ns", "num_steps", "request_ids", "request_num_tokens")))
    for start, end, k, ids, tokens in rows:
        while resets and resets[-1][0] <= start:  # preemptions before this step: those requests start over
            _, rid, lost = resets.pop()
            progress[rid] = max(0, progress.get(rid, 0) - lost)
        chunks, num_decode, context = [], 0, 0
        for rid, m in zip(ids, tokens):
            done = progress.get(rid, 0)
            if done < prompts.get(rid, 0):
                chunks.append((m, done))
            else:
                num_decode += m
                context += m * (done + 1)
            progress[rid] = done + m * (k or 1)
        out.append(RecordedStep(StepShape(tuple(chunks), num_decode, context), k or 1, end - start))
    return out


def _prompt_tokens(events: pa.Table) -> dict[str, int]:
    arrived = events.filter(pc.equal(events["event_type"], "request_arrived"))
    return dict(zip(arrived["request_id"].to_pylist(), arrived["num_prompt_tokens"].to_pylist()))


def _preemptions(events: pa.Table) -> list[tuple[int, str, int]]:
    """(time, request, tokens lost) of every preemption, latest first (popped in time order)."""
    pre = events.filter(pc.equal(events["event_type"], "request_preempted"))
    rows = zip(pre["ts_ns"].to_pylist(), pre["request_id"].to_pylist(), pre["num_lost_tokens"].to_pylist())
    return sorted(((t, r, lost or 0) for t, r, lost in rows), reverse=True)


def predicted_ns(model: RooflineCostModel, step: RecordedStep) -> int:
    """The model's time of a recorded step (a run of decode steps: their total, each one longer)."""
    shape = step.shape
    if step.num_steps > 1 and not shape.prefill_chunks:
        return model.decode_run(shape.num_decode_seqs, shape.decode_context_tokens, step.num_steps, None).duration_ns
    return model.step_time_ns(shape) * step.num_steps


#: The fewest timed steps a fit takes per fitted term.
STEPS_PER_TERM = 5


def check_timed(steps: Sequence[RecordedStep], terms: int) -> None:
    """Refuse a fit of ``terms`` terms to fewer than ``STEPS_PER_TERM`` timed steps (a positive duration) a term,
    saying whether the steps were too few or recorded without durations."""
    recorded, timed = len(steps), sum(s.duration_ns > 0 for s in steps)
    if timed >= terms * STEPS_PER_TERM:
        return
    if recorded > timed:
        raise ReplayError(f"{recorded - timed:,} of the {recorded:,} recorded steps have no duration (end_ns at or "
                          f"before start_ns), leaving {timed:,} timed steps, too few to fit {terms} terms",
                          "the step_executed events must stamp each step's start_ns and end_ns with a clock that "
                          "resolves a step (microseconds or finer): check the engine's step timestamps")
    raise ReplayError(f"{timed:,} recorded steps are too few to fit {terms} terms", "record more traffic (thousands of steps)")


@dataclass(frozen=True, slots=True)
class StepFit:
    """The fitted terms and how well the steps agree (median and 90th percentile absolute error, %)."""

    roofline: RooflineConfig
    num_steps: int
    median_abs_error_pct: float
    p90_abs_error_pct: float


def fit_steps(
    steps: Sequence[RecordedStep],
    instance: InstanceConfig,
    base: RooflineConfig | None = None,
    parameters: Sequence[Parameter] = STEP_PARAMETERS,
    max_steps: int = 20_000,
) -> StepFit:
    """The roofline terms ``parameters`` (the rest from ``base``) that best match the recorded step times."""
    from scipy.optimize import least_squares

    check_timed(steps, len(parameters))
    sample = [s for s in steps if s.duration_ns > 0]
    if len(sample) > max_steps:  # an even subsample keeps the mix of compositions
        sample = [sample[i] for i in np.linspace(0, len(sample) - 1, max_steps).astype(int)]
    recorded = np.log(np.array([s.duration_ns for s in sample], dtype=np.float64))

    def residuals(x: np.ndarray) -> np.ndarray:
        model = RooflineCostModel(instance, roofline_at(x, base, parameters))
        return np.log(np.array([max(predicted_ns(model, s), 1) for s in sample], dtype=np.float64)) - recorded

    x0 = np.array([p.unit(p.start) for p in parameters])
    solution = least_squares(residuals, x0, bounds=(0.0, 1.0), diff_step=1e-3, xtol=1e-6, ftol=1e-8)
    errors = np.abs(np.expm1(solution.fun)) * 100
    return StepFit(roofline_at(solution.x, base, parameters), len(sample), float(np.median(errors)),
                   float(np.percentile(errors, 90)))


__all__ = ["RecordedStep", "STEPS_PER_TERM", "STEP_PARAMETERS", "StepFit", "check_timed", "fit_steps", "predicted_ns",
           "step_shapes"]
