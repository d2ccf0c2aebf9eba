"""Fitting a calibration (``replay.calibration``) by simulation: the replay is fast, so use it.

The targets are recorded runs with their latencies (run summaries such as the fidelity data's
experiments, or the summary of a recorded request table). A candidate set of step-cost terms is
judged by replaying every target and comparing the replay's latencies with the recorded ones:

    residual(target, metric) = log(replayed / recorded)

over TTFT and E2E (mean, p90, p99) and the mean ITL, of the whole run and, for a run of several load
stages where they were recorded, of each stage (the step cost's dependence on load shows between
stages), with a robust loss (soft L1 at ``LOSS_SCALE``).
Two kinds of parameters:

- the engine's (``ENGINE_PARAMETERS``: shares of peak bandwidth for weights, KV and MoE experts, a
  fixed cost per step and per sequence, an all-reduce latency per peer and the interconnect's bandwidth
  share), each bounded; they change the simulated batches, so every candidate is replayed.
  ``scipy.optimize.least_squares`` (trust region, bounds, finite differences over the parameters scaled
  to [0, 1]) searches them. Then, where some runs' requests carry sampling penalties, the penalty pass's
  cost per step (``PENALTY_PARAMETER``), which no other run's latencies depend on, is fitted with every
  other engine term held, only those runs replayed again (``fit_penalty``: a bounded one-dimensional
  search on the same loss);
- the frontend's (``FrontendConfig``: a fixed overhead, tokenization per prompt token, the mean of a
  queueing wait): they add to client-side TTFT and E2E and change nothing inside the engine that
  matters (each request reaches it a little later), so for each candidate they are solved from that
  candidate's replays (``best_frontend``), not replayed again.

Replays during the search use each stage's first ``max_stage_s`` seconds (the statistics are
steady-state averages); held-out errors are measured on full-length replays that use the calibration
exactly as ``servelens replay`` does (``replay_target``). Targets replay in parallel worker processes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pyarrow as pa

from replay.calibration import Calibration, apply_calibration
from replay.config import FrontendConfig, InstanceConfig, standard_exponential
from replay.costmodel import RooflineConfig
from replay.errors import ReplayError
from replay.fidelity import (
    RECORDED_METRICS,
    FidelityExperiment,
    MetricError,
    RequestTimes,
    compare,
    experiment_instance,
    experiment_spec,
    experiment_workload,
    output_count_ratio,
    stage_errors,
    stage_starts_s,
    summarize,
)
from replay.load import Load, StepLoadMeter

#: Metrics the fit compares (the fidelity data's), equally weighted.
FIT_METRICS = RECORDED_METRICS
#: Bounds of the frontend's terms: the request overhead (s), tokenization (s per prompt token), the mean
#: of the frontend's queueing wait (s).
FRONTEND_BOUNDS = ((0.0, 0.05), (0.0, 50e-6), (0.0, 0.05))


@dataclass(frozen=True, slots=True)
class Parameter:
    """A fitted term of ``RooflineConfig``: its bounds and where a search starts."""

    name: str
    lower: float
    upper: float
    start: float
    integer: bool = False

    def value(self, unit: float) -> float | int:
        """The value at ``unit`` in [0, 1] of the bounds."""
        v = self.lower + min(1.0, max(0.0, float(unit))) * (self.upper - self.lower)
        return round(v) if self.integer else round(v, 6)

    def unit(self, value: float) -> float:
        return (value - self.lower) / (self.upper - self.lower)


ENGINE_PARAMETERS = (
    Parameter("memory_efficiency", 0.3, 1.0, 0.85),
    Parameter("kv_memory_efficiency", 0.15, 1.0, 0.5),
    Parameter("moe_memory_efficiency", 0.1, 1.0, 0.5),
    Parameter("step_overhead_ns", 0, 4_000_000, 1_000_000, integer=True),
    Parameter("seq_overhead_ns", 0, 100_000, 10_000, integer=True),
    Parameter("allreduce_latency_ns", 0, 50_000, 8_000, integer=True),
    Parameter("interconnect_efficiency", 0.05, 1.0, 0.5),
)
#: The penalty pass's cost per step (``RooflineConfig.penalty_overhead_ns``): fitted after the search, only the
#: runs whose requests carry sampling penalties replayed for it (``fit_penalty``).
PENALTY_PARAMETER = Parameter("penalty_overhead_ns", 0, 2_000_000, 0, integer=True)
#: Robust loss of the fit: residuals (log errors) beyond about 5% count linearly, not squared, so that one
#: run the model cannot explain does not pull every other run off (the field reports the median).
LOSS_SCALE = 0.05


def roofline_at(units: Sequence[float], base: RooflineConfig | None = None,
                parameters: Sequence[Parameter] = ENGINE_PARAMETERS) -> RooflineConfig:
    """``base`` with the parameters set at ``units`` (each in [0, 1] of its bounds)."""
    values = {p.name: p.value(u) for p, u in zip(parameters, units)}
    return dataclasses.replace(base or RooflineConfig(), **values)


def units_of(roofline: RooflineConfig, parameters: Sequence[Parameter] = ENGINE_PARAMETERS) -> tuple[float, ...]:
    """Where ``roofline``'s terms sit in [0, 1] of each parameter's bounds (a search's start; ``roofline_at``'s
    inverse, clipped to the bounds; an unset KV or MoE share is the weights' one, as the cost model reads it)."""
    values = [getattr(roofline, p.name) for p in parameters]
    return tuple(min(1.0, max(0.0, p.unit(roofline.memory_efficiency if v is None else v)))
                 for p, v in zip(parameters, values))


# ---------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Target:
    """A recorded run to match: its recorded latencies (s), the instance it ran on, and its workload, either
    a fidelity experiment's spec (``of_experiment``) or a workload table (``of_requests``: from telemetry).
    ``client_side``: the recorded latencies are the client's, so the frontend's terms are fitted too."""

    name: str
    recorded_items: tuple[tuple[str, float], ...]
    instance_config: InstanceConfig
    experiment: FidelityExperiment | None = None
    #: recorded metrics per load stage (index, metric -> s), for runs of several stages
    workload_table: object | None = None  # a pyarrow workload table
    client_side: bool = True
    recorded_stages: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = ()
    #: output tokens the recording counted per token generated (``replay.fidelity.output_count_ratio``): the
    #: replay's ITL is taken over its generated tokens times this, as the recorded one was
    output_count_ratio: float = 1.0

    @classmethod
    def of_experiment(cls, experiment: FidelityExperiment, shared: Path | None) -> Target:
        return cls(experiment.id, experiment.recorded, experiment_instance(experiment, shared), experiment,
                   recorded_stages=experiment.recorded_stages, output_count_ratio=output_count_ratio(experiment))

    def stage_starts_s(self, max_stage_s: float | None) -> list[float]:
        """Stage boundaries of the (possibly shortened) workload a replay of this target uses."""
        if self.experiment is None:
            return [0.0]
        return stage_starts_s(experiment_spec(self.experiment, max_stage_s))

    @classmethod
    def of_requests(cls, name: str, requests: object, instance: InstanceConfig) -> Target:
        """A recorded request table (``replay.derive``): its completed requests' latencies, client side
        where they were measured there, and its workload (``replay.workload.workload_from_requests``)."""
        from replay.workload import workload_from_requests

        recorded, client = recorded_latencies(requests)
        return cls(name, tuple(recorded.items()), instance, workload_table=workload_from_requests(requests),
                   client_side=client)

    @property
    def recorded(self) -> dict[str, float]:
        return dict(self.recorded_items)

    def instance(self, async_scheduling: bool | None) -> InstanceConfig:
        engine = dataclasses.replace(self.instance_config.engine, async_scheduling=async_scheduling)
        return dataclasses.replace(self.instance_config, engine=engine)

    def workload(self, seed: int, max_stage_s: float | None) -> object:
        if self.experiment is not None:
            return experiment_workload(self.experiment, seed, max_stage_s)
        return self.workload_table


def recorded_latencies(requests: object) -> tuple[dict[str, float], bool]:
    """The summary (``summarize``) of a request table's completed requests, and whether it is client side."""
    import pyarrow.compute as pc

    done = requests.filter(pc.equal(requests["outcome"], "completed"))
    client = done.num_rows > 0 and done["ttft_client_s"].null_count == 0 and done["e2e_client_s"].null_count == 0
    ttft, e2e = ("ttft_client_s", "e2e_client_s") if client else ("ttft_s", "e2e_s")
    keep = done.filter(pc.and_(pc.is_valid(done[ttft]), pc.is_valid(done[e2e])))
    if keep.num_rows == 0:
        raise ReplayError("the recorded requests hold no completed request with a first and last token",
                          "record request_arrived, first_token and request_finished events")
    return summarize(keep[ttft].to_numpy(), keep[e2e].to_numpy(),
                     keep["num_output_tokens"].to_numpy().astype(np.float64)), client


@dataclass(frozen=True, slots=True)
class EngineSample:
    """A replay's engine-side latencies of completed requests, before any frontend time is added."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    num_output_tokens: np.ndarray
    num_prompt_tokens: np.ndarray
    jitter: np.ndarray  # each request's standard exponential draw (``replay.config.standard_exponential``)
    stage: np.ndarray  # the load stage each request was sent in
    client_side: bool = True  # compared with client-side figures: the frontend's time is added
    output_count_ratio: float = 1.0  # output tokens counted per token generated (``Target.output_count_ratio``)

    def metrics(self, frontend: Sequence[float], stage: int | None = None) -> dict[str, float]:
        """The client-side figures (of one load stage's requests, or all) with the frontend's time added to
        every TTFT and E2E: ``frontend`` is (request overhead s, tokenization s per prompt token, mean
        queueing wait s)."""
        rows = slice(None) if stage is None else self.stage == stage
        extra = (frontend[0] + frontend[1] * self.num_prompt_tokens[rows] + frontend[2] * self.jitter[rows]
                 if self.client_side else 0.0)
        return summarize(self.ttft_s[rows] + extra, self.e2e_s[rows] + extra,
                         self.num_output_tokens[rows] * self.output_count_ratio)

    def residuals(self, target: Target, frontend: Sequence[float]) -> list[float]:
        """Log errors of the whole run's metrics and of each recorded load stage's."""
        out = log_residuals(target.recorded, self.metrics(frontend))
        for index, recorded in target.recorded_stages:
            if (self.stage == index).any():
                out += log_residuals(dict(recorded), self.metrics(frontend, index))
        return out


_WORKLOADS: dict[tuple, object] = {}  # per worker process: workloads by (target, seed, stage length)


def simulate(target: Target, roofline: RooflineConfig, async_scheduling: bool, seed: int,
             max_stage_s: float | None) -> EngineSample:
    """Replay ``target`` with ``roofline`` (no frontend: engine-side times)."""
    from replay.run import run_replay

    key = (target.name, seed, max_stage_s)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = target.workload(seed, max_stage_s)
    times = RequestTimes()
    run_replay(_WORKLOADS[key], instance=target.instance(async_scheduling), cost_model_config=roofline, sink=times,
               seed=seed)
    lat = times.latencies()
    jitter = np.array([standard_exponential(r) for r in lat["request_id"]])
    return EngineSample(lat["ttft_s"], lat["e2e_s"], lat["num_output_tokens"], lat["num_prompt_tokens"], jitter,
                        _stages(target, lat["start_s"], max_stage_s), target.client_side, target.output_count_ratio)


def _stages(target: Target, start_s: np.ndarray, max_stage_s: float | None) -> np.ndarray:
    """The load stage each request (sent at ``start_s``) of a replay of ``target`` belongs to."""
    return np.searchsorted(np.array(target.stage_starts_s(max_stage_s)), start_s, side="right") - 1


def _simulate_job(args: tuple) -> EngineSample:
    return simulate(*args)


class Simulator:
    """Replays targets, in parallel worker processes when more than one CPU is there."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers if workers is not None else max(1, min(4, os.cpu_count() or 1))
        self._pool: ProcessPoolExecutor | None = None
        self.num_replays = 0

    def __enter__(self) -> Simulator:
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("fork"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def run(self, targets: Sequence[Target], roofline: RooflineConfig, async_scheduling: bool, seed: int,
            max_stage_s: float | None) -> list[EngineSample]:
        jobs = [(t, roofline, async_scheduling, seed, max_stage_s) for t in targets]
        self.num_replays += len(jobs)
        if self._pool is None:
            return [_simulate_job(j) for j in jobs]
        return list(self._pool.map(_simulate_job, jobs))


# ---------------------------------------------------------------------------------------------- the fit


def log_residuals(recorded: dict[str, float], replayed: dict[str, float], metrics: Sequence[str] = FIT_METRICS) -> list[float]:
    return [math.log(max(replayed[m], 1e-12) / recorded[m]) for m in metrics if m in recorded]


def best_frontend(samples: Sequence[EngineSample], targets: Sequence[Target]) -> tuple[float, ...]:
    """The frontend terms (request overhead s, tokenization s per prompt token, mean queueing wait s) that
    minimize the fit's loss over every target; they shift client-side times only, so no replay is needed (the
    engine sees each request a little later, which changes its batches negligibly)."""
    from scipy.optimize import minimize

    scale = np.array([1e-3, 1e-6, 1e-3])  # search in ms, us per token, ms

    def cost(x: np.ndarray) -> float:
        frontend = tuple(x * scale)
        return sum(_soft_l1(r) for s, t in zip(samples, targets) for r in s.residuals(t, frontend))

    bounds = [(lo / k, hi / k) for (lo, hi), k in zip(FRONTEND_BOUNDS, scale)]
    best = minimize(cost, np.array([5.0, 5.0, 2.0]), bounds=bounds, method="L-BFGS-B")
    return tuple(float(v) for v in best.x * scale)


def _soft_l1(r: float) -> float:
    """scipy's soft_l1 loss of one residual at ``LOSS_SCALE`` (the fit's loss)."""
    z = (r / LOSS_SCALE) ** 2
    return 2.0 * LOSS_SCALE**2 * (math.sqrt(1.0 + z) - 1.0)


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted step cost and frontend constant, and the fit's in-sample errors."""

    roofline: RooflineConfig
    frontend: tuple[float, ...]  # request overhead s, tokenization s per prompt token, mean queueing wait s
    units: tuple[float, ...]
    errors: tuple[MetricError, ...]
    num_replays: int
    loss: float = math.nan  # the search's final cost: half the soft-L1 sum of the residuals on the cut replays


def fit(
    targets: Sequence[Target],
    simulator: Simulator,
    *,
    start: Sequence[float] | None = None,
    base: RooflineConfig | None = None,
    async_scheduling: bool = True,
    seed: int = 0,
    max_stage_s: float | None = 300.0,
    max_evaluations: int = 60,
    parameters: Sequence[Parameter] = ENGINE_PARAMETERS,
    progress: Callable[[int, float], None] | None = None,
) -> FitResult:
    """Fit ``parameters`` (of ``RooflineConfig``; the rest from ``base``) and the frontend's terms to
    ``targets`` (see the module docstring)."""
    from scipy.optimize import least_squares

    if not targets:
        raise ReplayError("nothing to fit: no recorded run with latencies")
    x0 = np.array(start if start is not None else [p.unit(p.start) for p in parameters])
    cache: dict[tuple, tuple[np.ndarray, float, list[EngineSample]]] = {}
    before = simulator.num_replays

    def evaluate(x: np.ndarray) -> tuple[np.ndarray, float, list[EngineSample]]:
        key = tuple(np.round(x, 9))
        if key not in cache:
            samples = simulator.run(targets, roofline_at(x, base, parameters), async_scheduling, seed, max_stage_s)
            c = best_frontend(samples, targets)
            res = np.array([r for s, t in zip(samples, targets) for r in s.residuals(t, c)])
            cache[key] = (res, c, samples)
            if progress is not None:
                progress(len(cache), float(np.sum(res * res)))
        return cache[key]

    solution = least_squares(lambda x: evaluate(x)[0], x0, bounds=(0.0, 1.0), diff_step=0.03, x_scale=1.0,
                             loss="soft_l1", f_scale=LOSS_SCALE, xtol=1e-3, ftol=1e-4, max_nfev=max_evaluations)
    _, c, samples = evaluate(solution.x)
    roofline = roofline_at(solution.x, base, parameters)
    if PENALTY_PARAMETER not in parameters and any(t.instance_config.sampling_penalties for t in targets):
        roofline, c, samples = fit_penalty(targets, samples, simulator, roofline, async_scheduling, seed, max_stage_s)
    errors = tuple(e for s, t in zip(samples, targets) for e in compare(t.name, t.recorded, s.metrics(c)))
    return FitResult(roofline, c, tuple(float(u) for u in solution.x), errors,
                     simulator.num_replays - before, float(solution.cost))


def fit_penalty(targets: Sequence[Target], samples: Sequence[EngineSample], simulator: Simulator,
                roofline: RooflineConfig, async_scheduling: bool = True, seed: int = 0,
                max_stage_s: float | None = 300.0) -> tuple[RooflineConfig, tuple[float, ...], list[EngineSample]]:
    """``roofline`` with the penalty pass's cost per step fitted: the fit's robust loss over every target
    minimized over ``PENALTY_PARAMETER``'s bounds (a bounded one-dimensional search), the frontend solved
    again at each value, every other term held. Only the targets whose requests carry sampling penalties are
    replayed again (``samples``: every target's replay at ``roofline``); the others' latencies do not depend
    on it. Returns the roofline, the frontend and every target's replay at the chosen value."""
    from scipy.optimize import minimize_scalar

    penalized = [i for i, t in enumerate(targets) if t.instance_config.sampling_penalties]
    seen: dict[int, tuple[float, tuple[float, ...], list[EngineSample]]] = {}

    def at(unit: float) -> float:
        value = int(PENALTY_PARAMETER.value(unit))
        if value not in seen:
            rerun = simulator.run([targets[i] for i in penalized], dataclasses.replace(roofline, penalty_overhead_ns=value),
                                  async_scheduling, seed, max_stage_s)
            merged = list(samples)
            for i, sample in zip(penalized, rerun):
                merged[i] = sample
            c = best_frontend(merged, targets)
            loss = sum(_soft_l1(r) for s, t in zip(merged, targets) for r in s.residuals(t, c))
            seen[value] = (loss, c, merged)
        return seen[value][0]

    minimize_scalar(at, bounds=(0.0, 1.0), method="bounded", options={"xatol": 2e-3})
    value = min(seen, key=lambda v: seen[v][0])  # the lowest loss met (the search's end, or a point before it)
    _, c, merged = seen[value]
    return dataclasses.replace(roofline, penalty_overhead_ns=value), c, merged


def as_calibration(result: FitResult, *, name: str, engine: str, accelerators: Sequence[str], method: str,
                   fitted_on: Sequence[str], held_out: dict[str, float] | None = None,
                   in_sample: dict[str, float] | None = None, notes: Sequence[str] = ()) -> Calibration:
    """A calibration of the fitted terms (the frontend's fitted constant as its request overhead)."""
    return Calibration(
        name=name, engine=engine, accelerators=tuple(accelerators), roofline=result.roofline,
        frontend=FrontendConfig(request_overhead_s=round(result.frontend[0], 7),
                                tokenize_s_per_token=round(result.frontend[1], 10),
                                request_jitter_s=round(result.frontend[2], 7)), async_scheduling=True,
        method=method, fitted_on=tuple(fitted_on),
        held_out_error_pct=tuple(sorted((held_out or {}).items())),
        in_sample_error_pct=tuple(sorted((in_sample or {}).items())), notes=tuple(notes),
    )


def replay_target(target: Target, calibration: Calibration, seed: int = 0, meter: StepLoadMeter | None = None) -> dict[str, float]:
    """A full-length replay of ``target`` with ``calibration`` applied as ``servelens replay`` applies it;
    its client-side figures (``meter``: also handed the replay's events, to measure its load)."""
    return _replay(target, calibration, seed, meter)[0]


def replay_measured(target: Target, calibration: Calibration,
                    seed: int = 0) -> tuple[dict[str, float], dict[int, dict[str, float]], Load]:
    """``replay_target``'s figures of the whole run, those of each load stage the target recorded on its own
    (stage index -> figures; none for a run recorded as a whole), and the replay's load (``replay.load``)."""
    meter = StepLoadMeter()
    figures, stages = _replay(target, calibration, seed, meter)
    return figures, stages, meter.load(target.instance_config.engine.max_num_seqs)


def _replay(target: Target, calibration: Calibration, seed: int,
            meter: StepLoadMeter | None) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """The replay behind ``replay_target`` and ``replay_measured``: the whole run's figures and each recorded stage's."""
    from replay.run import run_replay

    instance, roofline = apply_calibration(target.instance(None), calibration)
    if not target.client_side:
        instance = dataclasses.replace(instance, frontend=None)
    times = RequestTimes()
    sink = times if meter is None else _Both(times, meter)
    run_replay(target.workload(seed, None), instance=instance, cost_model_config=roofline, sink=sink, seed=seed)
    lat = times.latencies()
    counted = lat["num_output_tokens"] * target.output_count_ratio
    stage = _stages(target, lat["start_s"], None)
    per_stage = {}
    for index, _ in target.recorded_stages:
        rows = stage == index
        if rows.any():
            per_stage[index] = summarize(lat["ttft_s"][rows], lat["e2e_s"][rows], counted[rows])
    return summarize(lat["ttft_s"], lat["e2e_s"], counted), per_stage


class _Both:
    """A replay sink handing each chunk of events to two (neither hashes them)."""

    digest = False

    def __init__(self, first: Callable[[pa.Table], None], second: Callable[[pa.Table], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, table: pa.Table) -> None:
        self.first(table)
        self.second(table)


def replay_targets(targets: Sequence[Target], calibration: Calibration, seed: int = 0) -> tuple[list[dict[str, float]], Load]:
    """Each of ``targets`` replayed with ``calibration`` (``replay_measured``): their figures, and the largest of
    their busiest minutes (``replay.load``), the load the calibration vouches for when fitted on them."""
    runs = [replay_measured(target, calibration, seed) for target in targets]
    return [figures for figures, _, _ in runs], Load.peak([load for _, _, load in runs])


@dataclass(frozen=True, slots=True)
class HeldOut:
    """One target predicted by a fit that never saw it: the fit, the full-length replay's figures, that replay's
    load and the load the fold's calibration vouches for (its other targets', ``replay_targets``)."""

    target: Target
    fit: FitResult
    replayed: dict[str, float]
    load: Load
    fitted_load: Load
    replayed_stages: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)  # per recorded stage

    @property
    def beyond_fitted_load(self) -> bool:
        """The held-out run went beyond the load its fold's calibration was fitted on (a replay would warn)."""
        return self.load.beyond(self.fitted_load)

    @property
    def errors(self) -> list[MetricError]:
        return compare(self.target.name, self.target.recorded, self.replayed)

    @property
    def stage_errors(self) -> list[tuple[int, MetricError]]:
        """Each recorded load stage's errors (``replay.fidelity.stage_errors``; none for a run recorded whole)."""
        return stage_errors(self.target.name, self.target.recorded_stages, self.replayed_stages)


def leave_one_out(
    targets: Sequence[Target],
    simulator: Simulator,
    *,
    start: Sequence[float] | None = None,
    held: Sequence[str] | None = None,
    group: Callable[[Target], str] | None = None,
    seed: int = 0,
    max_stage_s: float | None = 300.0,
    max_evaluations: int = 30,
    parameters: Sequence[Parameter] = ENGINE_PARAMETERS,
    base: RooflineConfig | None = None,
    calibration: Callable[[FitResult], Calibration] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[HeldOut]:
    """Each target (or each of ``held``) predicted by a calibration fitted on all the others, starting from
    ``start`` (e.g. the fit on all targets, so each fold only corrects it).

    With ``group`` (e.g. a target's model), a fold leaves out every target of the held-out one's group, so
    a run is never predicted by a fit that saw its model; one fit serves every target of a group."""
    out = []
    keys = [group(t) if group is not None else str(j) for j, t in enumerate(targets)]
    fits: dict[str, tuple[FitResult, Calibration, Load]] = {}  # per left-out group: its fold, fitted once
    for target, key in zip(targets, keys):
        if held is not None and target.name not in held:
            continue
        if key not in fits:
            rest = [t for t, k in zip(targets, keys) if k != key]
            result = fit(rest, simulator, start=start, seed=seed, max_stage_s=max_stage_s,
                         max_evaluations=max_evaluations, parameters=parameters, base=base)
            cal = calibration(result) if calibration is not None else as_calibration(
                result, name=f"loo-{target.name}", engine="", accelerators=(), method="leave-one-out fold",
                fitted_on=[t.name for t in rest])
            fits[key] = (result, cal, replay_targets(rest, cal, seed)[1])
        result, cal, fitted_load = fits[key]
        replayed, stages, load = replay_measured(target, cal, seed)
        held_out = HeldOut(target, result, replayed, load, fitted_load, stages)
        out.append(held_out)
        if progress is not None:
            worst = max(held_out.errors, key=lambda e: e.abs_pct)
            progress(f"{target.experiment.label()}: worst {worst.metric} {worst.signed_pct:+.1f}%")
    return out


__all__ = [
    "ENGINE_PARAMETERS",
    "PENALTY_PARAMETER",
    "EngineSample",
    "FIT_METRICS",
    "FitResult",
    "HeldOut",
    "Parameter",
    "Simulator",
    "Target",
    "recorded_latencies",
    "as_calibration",
    "best_frontend",
    "fit",
    "fit_penalty",
    "leave_one_out",
    "log_residuals",
    "replay_measured",
    "replay_target",
    "replay_targets",
    "roofline_at",
    "units_of",
    "simulate",
]
