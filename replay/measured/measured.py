"""Measured replay, and the comparison of a modelled and a measured replay of the same workload.

*Measured replay* (``run_measured_replay``): the replay engine runs as always (same scheduler, same
policy, same KV pool, reference mode: one scheduling pass per step), but each step it composes is
executed on the device by the step executor (``replay.measured.executor``), and the step's measured
time is the clock: the step ends, and its tokens are delivered, that long after it started. Each
request's prefill chunks and decodes run against its own paged KV cache on the device (a request
with n branches decodes n sequences); a request's device KV is freed when it leaves the running
batch (finished, or preempted: a recomputation prefills again). Policies still ask the cost model
for their *predictions* (a deadline policy's estimate is a model in production too); only the clock
is measured. Events, request tables and metrics are the modelled replay's, so everything downstream
reads a measured run as it reads any run. A measured run is not byte-reproducible (its clock is a
measurement); its manifest says what measured it.

For small workloads only (``MAX_MEASURED_REQUESTS``): every step is a real forward pass.

*Comparison* (``compare_measured``): the same workload, policy, instance and seed, once with the
profile's fitted cost model (``replay.measured.fit``) and once measured; TTFT, ITL (every per-token
gap, pooled) and E2E at p50/p90/p99 with the relative error (modelled - measured) / measured, plus
the fitted model's error on every step the measured run executed (its own shapes, predicted against
their measured times).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.config import EngineConfig, InstanceConfig
from replay.costmodel import StepCostModel, StepShape
from replay.errors import ReplayError
from replay.measured.fit import (
    ErrorSummary,
    FitReport,
    FittedProfileCostModel,
    evaluate_profile,
    profile_instance,
)
from replay.measured.profiler import read_profile, step_timer
from replay.measured.shapes import LlamaShape
from replay.request import RUNNING, Request
from replay.run import ReplaySummary, run_replay
from replay.scenario import Scenario
from replay.workload import Workload, as_workload

MAX_MEASURED_REQUESTS = 2_000
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
LATENCY_METRICS = ("ttft_s", "itl_s", "e2e_s")


class MeasuredStepTimer:
    """The engine's measured clock: runs each composed step on the executor and returns its time."""

    def __init__(self, executor, *, warmup_steps: int = 2, warm_each_step: bool = True) -> None:
        self.executor = executor
        # Each step's work runs once untimed before its timed run, as every profile shape is warmed up:
        # a replay's steps are nearly all new shapes (contexts grow by one token a step), and on a GPU
        # the first call of a shape pays per-shape set-up (attention plans, kernel selection) that a
        # serving engine with captured graphs does not pay per step (docs/calibration.md).
        self.warm_each_step = warm_each_step
        self._timed = step_timer(executor)
        self._held: dict[Request, int] = {}  # requests with device KV -> their branches
        self.steps: list[tuple[StepShape, int]] = []  # every step executed: (shape, measured ns)
        self.wall_s = 0.0
        self._warm_up(warmup_steps)

    def _warm_up(self, steps: int) -> None:
        from replay.measured.executor import SeqWork

        ex = self.executor
        for i in range(steps):  # first calls pay for allocations and kernel selection: not a step's time
            ex.execute([SeqWork(("warmup", i), 8, 0), SeqWork(("warmup", -1 - i), 1, 8)])
        ex.synchronize()
        ex.free_all()

    def __call__(self, shape: StepShape, scheduled: list) -> int:
        from replay.measured.executor import SeqWork

        for r in [r for r in self._held if r.state != RUNNING]:  # finished or preempted: KV dropped
            for b in range(self._held.pop(r)):
                self.executor.free((r.index, b))
        work = []
        for r, m in scheduled:
            if r.is_decoding:  # as the engine decides
                work.extend(SeqWork((r.index, b), 1, r.num_computed) for b in range(r.num_branches))
            else:
                work.append(SeqWork((r.index, 0), m, r.num_computed, sample=r.num_computed + m >= r.num_prompt_tokens))
            self._held[r] = r.num_branches
        wall0 = time.perf_counter()
        if self.warm_each_step:
            self.executor.execute(work)  # the same cache slots again: the block tables are unchanged
        ns = max(1, self._timed(work))
        self.wall_s += time.perf_counter() - wall0
        self.steps.append((shape, ns))
        return ns

    def info(self) -> dict:
        ex = self.executor
        return {
            "measured": True,
            "device": ex.device.type,
            "dtype": ex.dtype_name,
            "model": ex.shape.as_dict(),
            "timer": "cuda-events" if ex.device.type == "cuda" else "perf_counter",
            "num_kv_blocks": ex.num_kv_blocks,
            "block_size": ex.block_size,
        }


def _column(batch: object, name: str, fill: int) -> np.ndarray:
    return pc.fill_null(batch.column(name), fill).to_numpy(zero_copy_only=False)


def _device_blocks(workload: Workload, block_size: int) -> int:
    """Device KV blocks for every request of the workload at its full length at once (never runs out)."""
    total = 0
    for batch in workload.batches():
        prompt = np.maximum(1, _column(batch, "num_prompt_tokens", 1))
        output = np.maximum(0, _column(batch, "num_output_tokens", 0))
        branches = np.maximum(1, _column(batch, "num_branches", 1))
        total += int((((prompt + output + block_size) // block_size + 1) * branches).sum())
    return total


def _check_size(source: Workload, max_requests: int) -> None:
    if source.num_requests is None or source.num_requests > max_requests:
        raise ReplayError(
            f"a measured replay runs every step on the device: at most {max_requests:,} requests, "
            f"not {source.num_requests if source.num_requests is not None else 'an unknown number'}",
            "take a slice of the workload (--requests N), or raise the limit knowingly",
        )


def run_measured_replay(
    workload: pa.Table | Workload,
    shape: LlamaShape,
    *,
    device: str = "cpu",
    instance: InstanceConfig,
    cost_model: StepCostModel,
    policy_name: str = "fcfs",
    policy_config: object | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    sink=None,
    max_requests: int = MAX_MEASURED_REQUESTS,
    num_threads: int | None = None,
    scenario: Scenario | None = None,
) -> tuple[ReplaySummary, MeasuredStepTimer]:
    """Replay ``workload`` with every step executed on ``device`` and its measured time as the clock.

    ``cost_model`` answers the policies' predictions only. Returns the replay summary and the timer,
    which holds every executed step's shape and measured time.
    """
    from replay.measured.executor import StepExecutor, require_torch

    torch = require_torch()
    source = as_workload(workload)
    _check_size(source, max_requests)
    if instance.model.num_layers != shape.num_layers or instance.model.hidden_size != shape.hidden_size:
        raise ReplayError(f"the instance's model {instance.model.name} is not the executor's {shape.name}")
    before = torch.get_num_threads()
    if num_threads is not None:
        if num_threads < 1:
            raise ReplayError(f"--threads must be at least 1, not {num_threads}")
        torch.set_num_threads(num_threads)
    try:
        executor = StepExecutor(
            shape, device=device, num_kv_blocks=_device_blocks(source, instance.engine.block_size_tokens),
            block_size=instance.engine.block_size_tokens, seed=seed,
        )
        timer = MeasuredStepTimer(executor)
        with torch.inference_mode():
            summary = run_replay(
                source, scenario=scenario, policy_name=policy_name, policy_config=policy_config, instance=instance,
                cost_model=cost_model, seed=seed, out_dir=out_dir, sink=sink, mode="reference", step_timer=timer,
            )
    finally:
        torch.set_num_threads(before)
    return summary, timer


# ------------------------------------------------------------------------------------------ comparison


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """One latency percentile, modelled against measured."""

    metric: str  # ttft_s, itl_s, e2e_s
    quantile: str  # p50, p90, p99
    modelled_s: float | None
    measured_s: float | None
    relative_error: float | None  # (modelled - measured) / measured


@dataclass(frozen=True, slots=True)
class MeasuredComparison:
    """A modelled and a measured replay of one workload and policy, side by side."""

    rows: tuple[LatencyRow, ...]
    step_error: ErrorSummary  # the fitted model on each measured step's shape
    num_steps: int
    modelled_busy_s: float  # summed step times
    measured_busy_s: float
    fit: FitReport
    modelled: ReplaySummary
    measured: ReplaySummary
    device: str
    model: str

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("modelled", "measured"):
            d[key] = {k: (str(v) if isinstance(v, Path) else v) for k, v in d[key].items()}
        return d


def latency_samples(events: pa.Table) -> dict[str, np.ndarray]:
    """TTFT and E2E per request (from the request table) and every per-token gap (ITL), seconds."""
    from replay.derive import derive_requests

    req = derive_requests(events)
    out = {
        name: req[name].drop_null().to_numpy(zero_copy_only=False).astype(float) for name in ("ttft_s", "e2e_s")
    }
    mask = pc.is_in(events["event_type"], pa.array(["first_token", "tokens_delivered"]))
    d = events.filter(mask).select(["request_id", "ts_ns", "event_type", "num_tokens"]).sort_by(
        [("request_id", "ascending"), ("ts_ns", "ascending")]
    )
    rid = d["request_id"].to_numpy(zero_copy_only=False)
    ts = d["ts_ns"].to_numpy(zero_copy_only=False).astype(np.int64)
    k = pc.fill_null(d["num_tokens"], 1).to_numpy(zero_copy_only=False).astype(np.int64)
    same = rid[1:] == rid[:-1]
    gaps = (ts[1:] - ts[:-1])[same]
    weights = np.maximum(1, k[1:][same])
    out["itl_s"] = np.repeat(gaps / weights, weights) / 1e9  # a delivery of k tokens after g: k gaps of g/k
    return out


def _q(values: np.ndarray, q: float) -> float | None:
    return float(np.quantile(values, q)) if values.size else None


def compare_measured(
    workload: pa.Table | Workload,
    profile_path: str | Path,
    *,
    device: str | None = None,
    policy_name: str = "fcfs",
    policy_config: object | None = None,
    engine: EngineConfig | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    max_requests: int = MAX_MEASURED_REQUESTS,
    num_threads: int | None = None,
) -> MeasuredComparison:
    """Replay the workload modelled (the profile's fitted table) and measured (the profile's model on
    its device; ``device``, when given, must be that one); compare latency percentiles and step times.

    Both replays use the instance the profile describes with the layers it built (no layer scaling: the
    measured executor builds those layers). Outputs, with ``out_dir``: ``modelled/`` and ``measured/``
    replay folders (events + manifest) and ``comparison.json``; none are left when a replay fails."""
    source = as_workload(workload)
    _check_size(source, max_requests)
    profile = read_profile(profile_path)
    meta = profile.meta
    _check_runnable(profile_path, meta.device, device)
    table, report = evaluate_profile(profile, seed)
    model = FittedProfileCostModel(table, source=Path(profile_path).name, report=report)
    instance = profile_instance(meta, engine or EngineConfig(block_size_tokens=meta.block_size), full_layers=False)
    out = Path(out_dir) if out_dir is not None else None
    modelled_events: list[pa.Table] = []
    measured_events: list[pa.Table] = []
    with _removed_on_failure(out):
        modelled = run_replay(
            source, policy_name=policy_name, policy_config=policy_config, instance=instance, cost_model=model,
            seed=seed, out_dir=out / "modelled" if out else None, sink=modelled_events.append, mode="reference",
        )
        measured, timer = run_measured_replay(
            source, meta.shape, device=meta.device, instance=instance, cost_model=model,
            policy_name=policy_name, policy_config=policy_config, seed=seed,
            out_dir=out / "measured" if out else None, sink=measured_events.append, max_requests=max_requests,
            num_threads=num_threads,
        )
    rows = _latency_rows(pa.concat_tables(modelled_events), pa.concat_tables(measured_events))
    predicted = np.array([model.step_time_ns(s) for s, _ in timer.steps], dtype=float)
    measured_ns = np.array([ns for _, ns in timer.steps], dtype=float)
    result = MeasuredComparison(
        rows=rows,
        step_error=_step_error(predicted, measured_ns),
        num_steps=len(timer.steps),
        modelled_busy_s=float(predicted.sum()) / 1e9,
        measured_busy_s=float(measured_ns.sum()) / 1e9,
        fit=report,
        modelled=modelled,
        measured=measured,
        device=meta.device,
        model=meta.shape.model_config(1).name,
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.json").write_text(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
    return result


@contextlib.contextmanager
def _removed_on_failure(out: Path | None) -> Iterator[None]:
    """Remove the output folders made inside the block if it fails (``out`` itself when it was made
    here; folders that were there before are left as they were)."""
    made = [] if out is None else [d for d in (out, out / "modelled", out / "measured") if not d.exists()]
    try:
        yield
    except BaseException:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _check_runnable(profile_path: str | Path, device: str, asked: str | None) -> None:
    """Refuse, before any output folder is made, a measured replay on another device than the profile's
    (``asked``), or one this machine cannot run (no torch, no CUDA)."""
    from replay.measured.executor import require_torch

    _check_device(device, asked)
    if device == "cuda" and not require_torch().cuda.is_available():
        raise ReplayError(
            f"{profile_path} was measured on cuda, and no CUDA device is visible to PyTorch here: the measured "
            "replay runs on the profile's device",
            "run it where a GPU is (a CUDA build of torch), or use a CPU profile (servelens profile --device cpu)",
        )


def _check_device(profiled: str, device: str | None) -> None:
    """Refuse to measure on another device than the profile's (``device`` None: the profile's)."""
    if device is not None and device != profiled:
        raise ReplayError(
            f"the profile was measured on {profiled}: measuring on {device} would compare a {profiled} model "
            f"with {device} times",
            f"profile on {device} first (servelens profile --device {device})",
        )


def _latency_rows(modelled_events: pa.Table, measured_events: pa.Table) -> tuple[LatencyRow, ...]:
    """Each latency metric's percentiles, modelled against measured."""
    a = latency_samples(modelled_events)
    b = latency_samples(measured_events)
    rows = []
    for metric in LATENCY_METRICS:
        for label, q in QUANTILES:
            m, x = _q(a[metric], q), _q(b[metric], q)
            err = (m - x) / x if m is not None and x else None
            rows.append(LatencyRow(metric, label, m, x, err))
    return tuple(rows)


def _step_error(predicted: np.ndarray, measured_ns: np.ndarray) -> ErrorSummary:
    """The relative errors of the predicted step times against the measured ones."""
    errors = np.abs(predicted - measured_ns) / measured_ns if measured_ns.size else np.array([])
    return ErrorSummary(
        int(errors.size),
        float(np.median(errors)) if errors.size else float("nan"),
        float(np.quantile(errors, 0.95)) if errors.size else float("nan"),
        float(errors.max()) if errors.size else float("nan"),
    )


def comparison_lines(c: MeasuredComparison) -> list[str]:
    """The comparison as a plain-text table (the CLI prints it)."""
    fmt = lambda v: "-" if v is None else f"{v * 1e3:,.2f} ms"  # noqa: E731
    lines = [
        f"{c.model} on {c.device}: {c.measured.num_requests:,} requests, {c.num_steps:,} steps executed",
        f"{'metric':<8} {'pct':<4} {'modelled':>14} {'measured':>14} {'rel. error':>11}",
    ]
    for r in c.rows:
        err = "-" if r.relative_error is None else f"{r.relative_error:+.1%}"
        lines.append(f"{r.metric:<8} {r.quantile:<4} {fmt(r.modelled_s):>14} {fmt(r.measured_s):>14} {err:>11}")
    s = c.step_error
    lines.append(
        f"step times: fitted model vs measured on the run's {s.num_shapes:,} steps: median {s.median:.1%}, "
        f"p95 {s.p95:.1%} relative error; busy {c.modelled_busy_s:,.3f} s modelled, {c.measured_busy_s:,.3f} s measured"
    )
    h = c.fit.held_out
    lines.append(f"profile fit: held-out median {h.median:.1%}, p95 {h.p95:.1%} relative error ({h.num_shapes} shapes)")
    return lines


__all__ = [
    "LatencyRow",
    "MAX_MEASURED_REQUESTS",
    "MeasuredComparison",
    "MeasuredStepTimer",
    "compare_measured",
    "comparison_lines",
    "latency_samples",
    "run_measured_replay",
]
