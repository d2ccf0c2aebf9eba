"""The canary gate: pass, fail or inconclusive, with the action, the reason and the statistics of
every metric and every absolute condition.

``compare_runs`` puts two runs on one grid of time windows, reduces each window to sufficient
statistics (``replay.compare``), resamples blocks of windows (the same for both runs), computes each
configured metric (``replay.gate_config``) and each absolute condition on that resampling, and hands
the figures to ``replay.judge``, which holds the rule: any metric not marked informative that fails
critically fails the run; so does a candidate that misses an absolute condition; too little
evidence, or an interval that still reaches a critical effect, is inconclusive with an estimate of
how much more traffic would decide. ``docs/gate.md`` explains it beside Kayenta's and Argo
Rollouts' semantics.

Runs come from replay output folders, events files or request tables (``load_run``), or, for a live
canary, from the lake's pools (``pipelines.canary.lake_pools``); ``decide`` turns a live verdict into
an action: promote, keep watching, or roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.calibration import MAX_ERROR_PCT
from replay.compare import (
    Difference,
    Resampling,
    WindowStats,
    compare_stats,
    distribution_of,
    evaluator,
    rank_tests,
    resampling,
    window_stats,
    windows_with,
)
from replay.figures import read_step_timing
from replay.gate_config import (  # noqa: F401  (the gate's public names, re-exported)
    DEFAULT_CONDITIONS,
    DEFAULT_METRICS,
    EACH_CLASS,
    FIDELITY_FIGURES,
    Condition,
    GateConfig,
    MetricSpec,
    ModelError,
    ScoreConfig,
    config_yaml,
    default_config,
    load_config,
    model_errors,
    parse_model_error,
    with_model_error,
)
from replay.judge import (  # noqa: F401
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    ConditionVerdict,
    Decision,
    MetricVerdict,
    Verdict,
    decide,
    headline,
    judge_condition,
    judge_metric,
    judge_run,
    needs,
)
from replay.load import describe_load
from replay.metrics import Requests, load_requests, load_steps
from replay.request_table import GATE_COLUMNS, REQUESTS_FILE, check_request_table, read_request_table
from schemas.validate import read_parquet_schema, read_parquet_table
from servelens.errors import DataNotFoundError, ServelensError

# ------------------------------------------------------------------------------------------ runs


#: The columns of the step events the gate reads (for cost and idle time).
STEP_COLUMNS = ["event_type", "instance_id", "start_ns", "end_ns", "request_ids", "request_num_tokens"]


@dataclass(frozen=True, slots=True)
class Run:
    """One side of a comparison: its request table, its engine steps and where it came from."""

    label: str
    requests: pa.Table
    steps: pa.Table | None  # the step_executed events (STEP_COLUMNS); None when only a request table was given
    source: str
    manifest_path: str | None
    manifest_sha256: str | None
    measured: bool = False  # measured on real engines (live pools): the replay model's error does not apply
    files: tuple[str, ...] = ()  # the files read, resolved (a run is never compared with itself)


def load_run(path: str | Path, label: str, *, memory_limit: str | None = None) -> Run:
    """A replay output folder (events.parquet + manifest.json, and the request table the replay wrote itself,
    requests.parquet), an events file, or a request table.

    A replay folder's own request table is read as it is (``replay.request_table``: what the derivation would
    give) and its steps' timing from its events (the gate reads busy time, never batch membership). Otherwise
    the request table is derived from the events; ``memory_limit`` (e.g. "2GB", ``lake.duckdb_memory_limit``)
    caps DuckDB while it does (it spills to disk beyond it; unset: DuckDB's default, 80% of RAM).
    """
    import hashlib

    path = Path(path)
    manifest = None
    if path.is_dir():
        manifest = path / "manifest.json" if (path / "manifest.json").is_file() else None
        own, events = path / REQUESTS_FILE, path / "events.parquet"
        if own.is_file() and events.is_file():
            sha = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest else None
            return Run(label, _with_requests(read_request_table(own), own), read_step_timing(events), str(events),
                       str(manifest) if manifest else None, sha, files=_resolved(own, events))
        for candidate in (own, events):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise DataNotFoundError(f"{path} holds neither requests.parquet nor events.parquet",
                                    "give a replay output folder, an events file or a request table")
    elif not path.is_file():
        raise DataNotFoundError(f"{label} {path} does not exist", "give a replay output folder, an events file or a request table")
    requests, steps = _requests_and_steps(path, memory_limit)
    sha = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest else None
    return Run(label, _with_requests(check_request_table(requests, path, GATE_COLUMNS), path), steps, str(path),
               str(manifest) if manifest else None, sha, files=_resolved(path))


def _with_requests(requests: pa.Table, path: Path) -> pa.Table:
    """A run's request table, refused when it holds no request (nothing to judge)."""
    if not requests.num_rows:
        raise ServelensError(f"{path}: the run holds no requests (its request table has 0 rows)",
                             "give a run that served traffic: replay a workload with requests, or check the file")
    return requests


def _resolved(*paths: Path) -> tuple[str, ...]:
    return tuple(str(p.resolve()) for p in paths)


def _refuse_same_run(baseline: Run, candidate: Run) -> None:
    """Comparing a run with itself (the same files, through any path) can only say +0.0% everywhere."""
    same = sorted(set(baseline.files) & set(candidate.files))
    if same:
        raise ServelensError(f"the baseline and the candidate are the same run ({', '.join(same)})",
                             "give the candidate's run as --candidate: a run compared with itself shows no difference")


def _requests_and_steps(path: Path, memory_limit: str | None) -> tuple[pa.Table, pa.Table | None]:
    """A request table file as it is (no steps), or an events file's derived request table and steps' timing."""
    from replay.derive import connect, derive_requests
    from schemas.validate import detect_format, iter_event_tables

    if detect_format(path) == "parquet":
        names = read_parquet_schema(path).names
        if "ttft_s" in names:
            return read_parquet_table(path), None
        if "event_type" in names:
            # DuckDB streams the file: events never all in memory
            return derive_requests(path, con=connect(memory_limit)), read_step_timing(path)
        raise ServelensError(f"{path} is neither an events file nor a request table",
                             "give a replay output folder, an events file (it has event_type) or a request table (ttft_s); "
                             "a workload is replayed first: servelens replay --workload FILE --out DIR")
    events = pa.concat_tables(list(iter_event_tables(path))) if path.stat().st_size else None
    if events is None:
        raise ServelensError(f"{path} is empty", "give the events of a run (JSONL or Parquet), or its replay folder")
    steps = events.filter(pc.equal(events["event_type"], "step_executed")).select(STEP_COLUMNS)
    return derive_requests(events), steps


# ------------------------------------------------------------------------------------------ comparing


@dataclass
class _Grid:
    """Both runs on one grid of windows, per group (the whole run, then each class), resampled."""

    rb: Requests
    rc: Requests
    classes: list[str]  # the classes either run holds
    groups: dict[str, tuple[np.ndarray, np.ndarray]]  # group ('' the whole run, a class) -> rows of each run
    stats: dict[str, tuple[WindowStats, WindowStats]]
    boot: Resampling
    rng: np.random.Generator


def _grid(baseline: Run, candidate: Run, config: GateConfig) -> _Grid:
    mconfig = config.metrics_config()
    starts = [int(pc.min(r.requests["arrival_ns"]).as_py()) for r in (baseline, candidate)
              if r.requests.num_rows and r.requests["arrival_ns"].null_count < r.requests.num_rows]
    origin = min(starts) if starts else 0
    rb, rc = load_requests(baseline.requests, mconfig, origin), load_requests(candidate.requests, mconfig, origin)
    sb = load_steps(baseline.steps, origin) if baseline.steps is not None else None
    sc = load_steps(candidate.steps, origin) if candidate.steps is not None else None
    end = max([r.arrival_s.max() for r in (rb, rc) if r.size] or [0.0])
    num_windows = max(1, int(np.floor(end / config.window_s)) + 1)
    _check_resampled_size(num_windows, config)
    tenants = np.union1d(rb.tenant_names, rc.tenant_names)
    rng = np.random.default_rng(config.seed)
    boot = resampling(num_windows, config.resamples, config.block_windows, rng)
    classes = [str(name) for name in np.union1d(rb.class_names, rc.class_names)]
    named = [c.service_class for c in config.conditions if c.service_class not in ("", EACH_CLASS)]  # held or not
    groups = {"": (np.ones(rb.size, bool), np.ones(rc.size, bool))}
    groups |= {name: (_of_class(rb, name), _of_class(rc, name)) for name in [*classes, *named]}
    stats = {g: (window_stats(rb, mb, sb if not g else None, num_windows, mconfig, tenants),
                 window_stats(rc, mc, sc if not g else None, num_windows, mconfig, tenants))
             for g, (mb, mc) in groups.items()}
    return _Grid(rb, rc, classes, groups, stats, boot, rng)


#: The most windows a judgement holds (each side's per-window histograms take about 50 kB a window: 20,000 are
#: two weeks of 60 s windows and about 1 GB) and the most window draws its bootstrap holds (resamples x windows).
MAX_WINDOWS, MAX_RESAMPLED_WINDOWS = 20_000, 20_000_000
#: The longest span a judgement covers, seconds (366 days: admission flaps are counted on a 1 s grid of the span).
MAX_SPAN_S = 366 * 86_400


def _check_resampled_size(num_windows: int, config: GateConfig) -> None:
    span_s = num_windows * config.window_s
    if not span_s <= MAX_SPAN_S:  # a configuration built in code, unchecked (a file's window_s is bounded)
        raise ServelensError(
            f"the runs' {num_windows:,} windows of {config.window_s:g} s span "
            f"{f'{span_s:,.0f}' if span_s < 1e15 else f'{span_s:.3g}'} s: the gate judges at most "
            f"{MAX_SPAN_S:,} s (366 days)", "judge a shorter span (--since with --live) or shorter windows (window_s)")
    draws = num_windows * config.resamples
    if num_windows > MAX_WINDOWS or draws > MAX_RESAMPLED_WINDOWS:
        raise ServelensError(
            f"the runs span {num_windows:,} windows of {config.window_s:g} s, {draws:,} window draws with "
            f"{config.resamples:,} resamples: the gate holds at most {MAX_WINDOWS:,} windows and {MAX_RESAMPLED_WINDOWS:,} draws",
            "judge a shorter span (--since with --live), longer windows (window_s) or fewer resamples")


def _of_class(r: Requests, name: str) -> np.ndarray:
    """Mask of the requests of one class (none when the run never saw it)."""
    found = np.flatnonzero(r.class_names == name)
    return r.class_code == found[0] if len(found) else np.zeros(r.size, dtype=bool)


class _Differences:
    """Each (metric, group)'s paired difference, computed once (metrics and conditions share them)."""

    def __init__(self, grid: _Grid, config: GateConfig) -> None:
        self.grid, self.config = grid, config
        self.found: dict[tuple[str, str], Difference] = {}
        self.tests: dict[tuple[str, str], object] = {}

    def __call__(self, metric: str, group: str) -> Difference:
        key = (metric, group)
        if key not in self.found:
            base, cand = self.grid.stats[group]
            self.found[key] = compare_stats(metric, group, base, cand, self.grid.boot, self.config.confidence,
                                            evaluator(metric, self.config.metrics_config()), self._tests(metric, group))
        return self.found[key]

    def windows_used(self, metric: str, group: str, min_requests: int, side: str = "both") -> int:
        """Windows with ``min_requests`` of the metric's requests on both sides (or on one side)."""
        base, cand = self.grid.stats[group]
        return windows_with(metric, cand if side == "candidate" else base, base if side == "baseline" else cand,
                            min_requests)

    def _tests(self, metric: str, group: str):
        column = distribution_of(metric)
        if column is None or not self.config.rank_tests:
            return None
        if (column, group) not in self.tests:
            mb, mc = self.grid.groups[group]
            self.tests[(column, group)] = rank_tests(getattr(self.grid.rb, column)[mb], getattr(self.grid.rc, column)[mc],
                                                     self.grid.rng)
        return self.tests[(column, group)]


def _metric_verdicts(diffs: _Differences, config: GateConfig, errors: dict[str, tuple[float, str]]) -> list[MetricVerdict]:
    out = []
    for spec in config.metrics:
        for group in ["", *diffs.grid.classes] if spec.per_class else [""]:
            used = diffs.windows_used(spec.name, group, spec.min_window_requests or config.min_window_requests)
            need = needs(spec, config, used, diffs.grid.boot.num_windows)
            out.append(judge_metric(diffs(spec.name, group), spec, need, errors.get(spec.name)))
    return out


def _condition_verdicts(diffs: _Differences, config: GateConfig, errors: dict[str, tuple[float, str]],
                        ) -> list[ConditionVerdict]:
    out = []
    for cond in config.conditions:
        for group in diffs.grid.classes if cond.service_class == EACH_CLASS else [cond.service_class]:
            need_c, need_b = (needs(None, config, diffs.windows_used(cond.metric, group, config.min_window_requests, side),
                                    diffs.grid.boot.num_windows) for side in ("candidate", "baseline"))
            out.append(judge_condition(diffs(cond.metric, group), cond, need_c, errors.get(cond.metric), need_b))
    return out


#: The largest model error a calibration record adds (a fraction): a held-out error of 100% or more says
#: the model cannot vouch for the figure, and this much error keeps every metric resting on it from passing.
MAX_CALIBRATION_ERROR = 0.99
#: The largest held-out error a manifest may record, percent (beyond it the record is taken as corrupt).
MAX_HELD_OUT_PCT = MAX_ERROR_PCT


def calibration_errors(*runs: Run) -> tuple[dict[str, float], list[str]]:
    """The held-out errors (fractions, the larger of the runs' per figure) of the calibrations the runs'
    manifests name, and a line per calibration for the report (and one per run whose load lies beyond the
    load its calibration was fitted on, ``replay.load``)."""
    errors: dict[str, float] = {}
    lines: list[str] = []
    for run in runs:
        if run.manifest_path is None:
            continue
        manifest = read_manifest(run.manifest_path)
        try:
            record = manifest.get("calibration")
            if not record:
                continue
            if not isinstance(record, dict) or (manifest.get("load") and not isinstance(manifest["load"], dict)):
                which, value = ("calibration", record) if not isinstance(record, dict) else ("load", manifest["load"])
                raise _bad_manifest(run.manifest_path, f"its {which} is a JSON {type(value).__name__}, not an object of fields")
            held = _held_out(record)
            if not isinstance(record["name"], str):
                raise TypeError(f"calibration name is {record['name']!r}, not text")
            line = (f"replay model: calibration {record['name']} ({record.get('engine', '')}"
                    + (", extrapolated to this accelerator" if record.get("extrapolated") else "")
                    + (f"; {record['other_engine']}" if record.get("other_engine") else "") + "), held-out error "
                    + (", ".join(f"{k} {v:.1f}%" for k, v in sorted(held.items())) or "not measured"))
            load, beyond = describe_load(manifest["load"]) if manifest.get("load") else ("", False)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _bad_manifest(run.manifest_path, f"its calibration or load record is malformed ({type(exc).__name__}: {exc})") from None
        for figure, pct in held.items():
            errors[figure] = max(errors.get(figure, 0.0), min(pct / 100, MAX_CALIBRATION_ERROR))
        if line not in lines:
            lines.append(line)
        if beyond:  # the held-out errors above do not vouch for this run
            lines.append(f"{run.label} replay {load}")
    return errors, lines


def read_manifest(path: str | Path) -> dict:
    """A run's ``manifest.json`` as written by ``servelens replay``, or an error that names the file."""
    import json

    try:
        manifest = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise _bad_manifest(path, f"it is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise _bad_manifest(path, f"it holds a JSON {type(manifest).__name__}, not an object")
    return manifest


def _held_out(record: dict) -> dict[str, float]:
    """A calibration record's held-out errors: percentages, finite and not negative."""
    held = record.get("held_out_error_pct") or {}
    if not isinstance(held, dict):
        raise TypeError(f"held_out_error_pct is {held!r}, not a mapping of figure to percent")
    for figure, pct in held.items():
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= MAX_HELD_OUT_PCT:
            raise ValueError(f"held_out_error_pct {figure} is {pct!r}, not a percentage from 0 to {MAX_HELD_OUT_PCT:g}")
    return {str(k): float(v) for k, v in held.items()}


def _bad_manifest(path: str | Path, why: str) -> ServelensError:
    return ServelensError(f"the run manifest {path} cannot be read: {why}",
                             "it is written by `servelens replay`: replay the run again, or give the gate the run's "
                             "events.parquet instead of its folder to judge it without its manifest")


def compare_runs(baseline: Run, candidate: Run, config: GateConfig) -> Verdict:
    """Compare two runs on every configured metric and condition and reach the verdict."""
    _refuse_same_run(baseline, candidate)
    grid = _grid(baseline, candidate, config)
    diffs = _Differences(grid, config)
    modelled = not (baseline.measured or candidate.measured)
    fidelity: list[str] = []
    if modelled and config.calibration_error:
        found, fidelity = calibration_errors(baseline, candidate)
        known = {figure: e for figure, e in found.items() if figure in FIDELITY_FIGURES}
        if known:
            config = with_model_error(config, known)
    errors = model_errors(config) if modelled else {}
    metrics = _metric_verdicts(diffs, config, errors)
    conditions = _condition_verdicts(diffs, config, errors)
    run = judge_run(metrics, conditions, config)
    notes = fidelity + _notes(grid, conditions, config, modelled)
    wait = None if run.wait_windows is None else float(np.ceil(run.wait_windows * config.window_s / 60))
    return Verdict(run.status, run.score, run.reasons, tuple(metrics), baseline.source, candidate.source,
                   baseline.manifest_path, candidate.manifest_path, config, tuple(conditions), tuple(notes), wait)


def _notes(grid: _Grid, conditions: list[ConditionVerdict], config: GateConfig, modelled: bool) -> list[str]:
    """What the reader must know before the details: the baseline's own standing, unlike pools, model error."""
    out = []
    unknown = sorted({c.service_class for c in config.conditions} - {"", EACH_CLASS, *grid.classes})
    if unknown and grid.rb.size + grid.rc.size:  # a misspelt class, or one without traffic in a live window
        out.append(f"conditions on service_class {', '.join(map(repr, unknown))} judge nothing: neither run holds it "
                   f"(they hold {', '.join(map(repr, grid.classes))}; a misspelt name?)")
    out_of_slo = [c for c in conditions if c.baseline_status == FAIL]
    if out_of_slo:
        out.append("baseline itself out of SLO: " + "; ".join(c.baseline_reason for c in out_of_slo)
                   + " (the candidate is judged on its own against the conditions)")
    sizes = (grid.rb.size, grid.rc.size)
    if min(sizes) < 0.8 * max(sizes):
        out.append(f"the runs hold {sizes[0]:,} and {sizes[1]:,} requests: rates (goodput_rps, throughput_rps) compare "
                   "unequal traffic; give the baseline pool the canary's share of traffic (Kayenta's practice)")
    if config.model_error and modelled:
        out.append("replay model error applied to passes: " + ", ".join(f"{m.metric} {m.error:.1%}" for m in config.model_error))
    elif config.model_error:
        out.append("model_error not applied: live pools are measured, not modelled")
    return out
