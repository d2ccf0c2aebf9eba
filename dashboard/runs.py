"""Replay runs and gate reports as the Policies and Gate pages read them.

A run is a folder holding ``events.parquet`` and ``manifest.json`` (what ``replay.run.run_replay``
writes) anywhere up to ``MAX_DEPTH`` levels below ``runs_dir``: ``<runs_dir>/<run>/`` from
``servelens replay --out``, ``<runs_dir>/<day>/<policy>@<load>/`` from the nightly Dagster batch
(``pipelines.batch.replay_dir``); its name is that path. Its request table and metrics are derived once per version of
its events file (modification time and size) into the dashboard's cache, with the same code the
gate uses (``replay.derive`` and ``replay.metrics.run_metrics``), so a page only reads a few
hundred numbers.

**Load factor of a run** (``load_factor``), for the load sweep: the manifest's
``workload.load_factor`` when present; else a ``@<k>x`` suffix of ``workload.name``
(``azure-conv@1.5x`` is 1.5); else 1.0.

A gate report is a ``gate.json`` (``replay.report.verdict_dict``) in ``gate_dir`` or below it
(``<gate_dir>/<day>/<policy>@<load>/`` from the nightly batch), read into flat records.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dashboard.data import DERIVED_FORMAT, materialize_requests, metrics_config_token
from replay.figures import read_step_timing
from replay.metrics import MetricsConfig, metrics_table, run_metrics

MANIFEST = "manifest.json"
EVENTS = "events.parquet"
_LOAD_SUFFIX = re.compile(r"@(\d+(?:\.\d+)?)x$")


def load_factor(manifest: Mapping[str, Any]) -> float:
    """A run's load relative to the recorded workload: ``workload.load_factor`` if the manifest has
    one, else the ``@<k>x`` suffix of ``workload.name`` (``azure-conv@2x`` -> 2.0), else 1.0."""
    workload = manifest.get("workload") or {}
    if not isinstance(workload, Mapping):
        return 1.0
    value = workload.get("load_factor")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    match = _LOAD_SUFFIX.search(str(workload.get("name") or ""))
    return float(match.group(1)) if match and float(match.group(1)) > 0 else 1.0


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One replay run folder, described by its manifest."""

    name: str  # the folder name
    folder: str
    events_path: str
    manifest_path: str | None
    policy: str
    policy_config: str  # compact JSON of the policy's configuration
    scenario: str
    workload: str  # the workload name without its load suffix
    workload_sha256: str | None
    engine: str  # MODEL@ACCELERATOR[xTP]
    cost_model: str
    seed: int | None
    mode: str | None
    load_factor: float
    num_requests: int | None
    events_mtime_ns: int
    events_bytes: int
    requests_path: str | None = None  # the request table the replay wrote itself (its manifest names it)
    #: minutes beyond the load its calibration was fitted on (``replay.load``); None: no fitted load to compare
    minutes_beyond_fitted: int | None = None

    @property
    def version(self) -> str:
        """Changes whenever the events file is rewritten (cache key)."""
        return f"{self.events_mtime_ns}-{self.events_bytes}"

    @property
    def series(self) -> str:
        """What a load sweep holds constant: policy and its configuration, engine, scenario, workload."""
        config = "" if self.policy_config in ("{}", "null") else f" {self.policy_config}"
        return f"{self.policy}{config} on {self.engine} ({self.workload}, {self.scenario})"


def _engine(instance: Mapping[str, Any]) -> str:
    model = (instance.get("model") or {}).get("name", "?")
    accel = instance.get("accelerator") or {}
    tp = accel.get("tensor_parallel_size") or 1
    return f"{model}@{accel.get('name', '?')}" + (f"x{tp}" if tp and tp > 1 else "")


def read_run(folder: str | Path, name: str | None = None) -> RunInfo | None:
    """The run in ``folder`` (None when it holds no events.parquet), called ``name`` (default: the
    folder's name). A missing or unreadable manifest leaves the run's description unknown, never
    hides the run."""
    folder = Path(folder)
    events = folder / EVENTS
    if not events.is_file():
        return None
    manifest_path = folder / MANIFEST
    manifest: dict[str, Any] = {}
    if manifest_path.is_file():
        try:
            loaded = json.loads(manifest_path.read_text())
            manifest = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            manifest = {}
    workload = manifest.get("workload") if isinstance(manifest.get("workload"), dict) else {}
    policy = manifest.get("policy") if isinstance(manifest.get("policy"), dict) else {}
    scenario = manifest.get("scenario") if isinstance(manifest.get("scenario"), dict) else {}
    cost = manifest.get("cost_model") if isinstance(manifest.get("cost_model"), dict) else {}
    instance = manifest.get("instance") if isinstance(manifest.get("instance"), dict) else {}
    stat = events.stat()
    workload_name = str(workload.get("name") or "unknown")
    seed = manifest.get("seed")
    return RunInfo(
        name=name or folder.name,
        folder=str(folder),
        events_path=str(events),
        manifest_path=str(manifest_path) if manifest_path.is_file() else None,
        policy=str(policy.get("name") or "unknown"),
        policy_config=json.dumps(policy.get("config"), sort_keys=True, separators=(",", ":")),
        scenario=str(scenario.get("name") or "unknown"),
        workload=_LOAD_SUFFIX.sub("", workload_name),
        workload_sha256=workload.get("sha256"),
        engine=_engine(instance) if instance else "unknown",
        cost_model=str(cost.get("name") or "unknown"),
        seed=seed if isinstance(seed, int) else None,
        mode=manifest.get("mode") if isinstance(manifest.get("mode"), str) else None,
        load_factor=load_factor(manifest),
        num_requests=workload.get("num_requests") if isinstance(workload.get("num_requests"), int) else None,
        events_mtime_ns=stat.st_mtime_ns,
        events_bytes=stat.st_size,
        requests_path=_own_requests(folder, manifest),
        minutes_beyond_fitted=_minutes_beyond_fitted(manifest),
    )


def _minutes_beyond_fitted(manifest: Mapping[str, Any]) -> int | None:
    """The manifest's count of minutes beyond its calibration's fitted load (``replay.load.load_record``)."""
    load = manifest.get("load") if isinstance(manifest.get("load"), dict) else {}
    beyond = load.get("windows_beyond_fitted")
    return beyond if isinstance(beyond, int) and not isinstance(beyond, bool) else None


def _own_requests(folder: Path, manifest: Mapping[str, Any]) -> str | None:
    """The replay's own request table, when this run's manifest says it wrote one (``replay.request_table``)."""
    output = manifest.get("output") if isinstance(manifest.get("output"), dict) else {}
    name = output.get("requests_file")
    path = folder / name if isinstance(name, str) and "/" not in name and name != ".." else None
    return str(path) if path is not None and path.is_file() else None


#: How deep under runs_dir (and gate_dir) folders are searched: ``<run>/`` as ``servelens replay
#: --out`` writes, ``<day>/<policy>@<load>/`` as the nightly Dagster replays write.
MAX_DEPTH = 3


def _folders_holding(root: Path, filename: str, *, within_matches: bool) -> list[Path]:
    """Folders under ``root`` (itself included, at most ``MAX_DEPTH`` deep) holding ``filename``;
    ``within_matches``: also search below a folder that holds it."""
    found, level = [], [root]
    for _ in range(MAX_DEPTH + 1):
        below = []
        for folder in level:
            match = (folder / filename).is_file()
            if match:
                found.append(folder)
            if within_matches or not match:
                try:
                    below += sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
                except OSError:  # unreadable or vanished while listing: skip it, keep the rest
                    continue
        level = below
    return found


def list_runs(runs_dir: str | Path) -> tuple[RunInfo, ...]:
    """Every run folder under ``runs_dir`` (a folder holding events.parquet, up to ``MAX_DEPTH``
    deep), named by its path below ``runs_dir`` (``fcfs``, ``2023-11-16/sarathi@2x``), by name.
    When ``runs_dir`` is itself a run folder, that one run (named by its folder)."""
    root = Path(runs_dir)
    if not root.is_dir():
        return ()
    if (root / EVENTS).is_file():
        only = read_run(root, root.name)
        return (only,) if only is not None else ()
    runs = [read_run(f, f.relative_to(root).as_posix()) for f in _folders_holding(root, EVENTS, within_matches=False)]
    return tuple(sorted((r for r in runs if r is not None), key=lambda r: r.name))


def _run_cache(run: RunInfo, cache_dir: str | Path) -> Path:
    key = hashlib.sha256(f"{Path(run.folder).resolve()}|{run.version}|{DERIVED_FORMAT}".encode()).hexdigest()[:16]
    return Path(cache_dir) / "runs" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', run.name)[:60]}-{key}"


def run_requests_path(run: RunInfo, cache_dir: str | Path, memory_limit: str | None = None) -> Path:
    """The run's derived request file (``dashboard.data.materialize_requests``), built on first use."""
    path = _run_cache(run, cache_dir) / "requests.parquet"
    if not path.is_file():
        materialize_requests([run.events_path], path, memory_limit=memory_limit)
    return path


def step_timing(events_path: str | Path) -> pa.Table:
    """A run's engine steps with their timing and instance, and empty membership lists
    (``replay.figures.read_step_timing``: run metrics read only busy time and instances from steps)."""
    return read_step_timing(events_path)


def run_metric_values(run: RunInfo, cache_dir: str | Path, config: MetricsConfig, memory_limit: str | None = None) -> pa.Table:
    """The run's overall and per-class metrics (``replay.metrics.run_metrics``, as the gate computes
    them) as ``replay.metrics.metrics_table`` rows, cached per events version and configuration."""
    path = _run_cache(run, cache_dir) / f"metrics-{metrics_config_token(config)}.parquet"
    if path.is_file():
        return pq.read_table(path)
    own = run.requests_path  # a replay's own table: nothing to derive
    requests = pq.read_table(own if own is not None else run_requests_path(run, cache_dir, memory_limit))
    values = [v for v in run_metrics(requests, step_timing(run.events_path), config) if v.scope in ("overall", "class")]
    table = metrics_table(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return table


#: The comparison the Policies page shows, in order (rejections and cost always beside goodput).
POLICY_METRICS = (
    ("goodput_rps", "goodput, req/s"),
    ("attainment", "attainment, share of arrivals"),
    ("rejected_share", "rejected, share of arrivals"),
    ("cancelled_share", "cancelled, share of arrivals"),
    ("ttft_p99_s", "TTFT p99, s"),
    ("max_backlogged_service_gap", "fairness gap (service/weight)"),
    ("jain_index", "Jain's index"),
    ("max_queue_s", "starvation: max queue, s"),
    ("past_queue_limit_share", "past queue limit"),
    ("preemptions_per_request", "preemptions/request"),
    ("oscillating_share", "preempted twice or more"),
    ("cost_per_1k_goodput_tokens", "cost per 1k goodput tokens"),
)


def metric_value(values: pa.Table, name: str, group: str = "") -> float | None:
    """One metric of a ``metrics_table`` (``group`` '': the whole run, else a class); names ending
    in ``_tokens`` match the currency-suffixed cost metric."""
    scope = "overall" if not group else "class"
    mask = pc.and_(pc.equal(values["scope"], scope), pc.equal(values["group"], group))
    rows = values.filter(mask)
    names = rows["name"].to_pylist()
    for i, n in enumerate(names):
        if n == name or (name == "cost_per_1k_goodput_tokens" and n.startswith(name + "_")):
            return rows["value"][i].as_py()
    return None


def comparison_table(runs: tuple[RunInfo, ...], values: tuple[pa.Table, ...], group: str = "") -> pa.Table:
    """One row per run with its policy, load factor and the ``POLICY_METRICS`` (of the whole run, or
    of one class)."""
    columns: dict[str, list] = {"run": [r.name for r in runs], "policy": [r.policy for r in runs],
                                "load_factor": [r.load_factor for r in runs], "engine": [r.engine for r in runs]}
    for name, _ in POLICY_METRICS:
        columns[name] = [metric_value(v, name, group) for v in values]
    return pa.table(columns)


# ------------------------------------------------------------------------------------------ the gate


@dataclass(frozen=True, slots=True)
class GateMetric:
    """One metric's verdict, its statistics and the evidence behind its interval, flat."""

    metric: str
    group: str
    status: str
    critical: bool
    informative: bool
    undecided: str  # why it is undecided ('' when decided): not enough data, interval straddles the limit, ...
    critical_possible: bool
    reason: str
    bad: str
    effect_kind: str
    effect: float | None
    effect_low: float | None
    effect_high: float | None
    allowed: float | None
    critical_effect: float | None
    model_error: float | None
    baseline: float | None
    candidate: float | None
    num_baseline: int
    num_candidate: int
    num_windows_used: int
    num_windows: int
    min_windows: int
    num_resamples: int
    confidence: float | None
    mann_whitney_u: float | None
    mann_whitney_p: float | None
    hodges_lehmann_s: float | None
    brown_forsythe_stat: float | None
    brown_forsythe_p: float | None


@dataclass(frozen=True, slots=True)
class GateCondition:
    """An absolute condition: the candidate's standing, and the baseline's."""

    metric: str
    group: str
    bound: str
    status: str
    reason: str
    baseline_status: str
    baseline_reason: str


@dataclass(frozen=True, slots=True)
class GateReport:
    """A gate report (``<gate_dir>/gate.json``) and the files beside it."""

    folder: str
    status: str  # pass, fail, inconclusive (anything else is shown as 'unknown')
    headline: str  # the verdict and the action: 'FAIL: roll back', 'INCONCLUSIVE: continue 12 more minutes'
    rollback_on: str  # the configuration's rollback_on (what 'continue' after a failure means)
    failed: tuple[str, ...]  # each failed metric once, its classes after it
    undecided: tuple[str, ...]  # what holds the run, with why
    notes: tuple[str, ...]  # a baseline out of SLO, unequal pools, model error
    wait_minutes: float | None
    score: float | None
    reasons: tuple[str, ...]
    baseline: str
    baseline_manifest: str | None
    candidate: str
    candidate_manifest: str | None
    decision: str | None  # promote, continue, rollback (live canaries)
    decision_restore: str | None
    decision_reason: str | None
    metrics: tuple[GateMetric, ...]
    conditions: tuple[GateCondition, ...]
    report_files: tuple[str, ...]  # gate.json, gate.md, gate.html present in the folder
    written_ns: int


class GateReportError(ValueError):
    """gate.json exists but is not a gate report."""


@dataclass(frozen=True, slots=True)
class GateReportRef:
    """Where one gate report is: ``name`` is its folder below gate_dir ('' for gate_dir itself)."""

    name: str
    folder: str
    written_ns: int


def list_gate_reports(gate_dir: str | Path) -> tuple[GateReportRef, ...]:
    """Every gate report under ``gate_dir`` (``servelens gate --out`` writes one folder; the nightly
    comparisons one per ``<day>/<candidate>@<load>``), newest first."""
    root = Path(gate_dir)
    if not root.is_dir():
        return ()
    refs = [GateReportRef("" if f == root else f.relative_to(root).as_posix(), str(f), (f / "gate.json").stat().st_mtime_ns)
            for f in _folders_holding(root, "gate.json", within_matches=True)]
    return tuple(sorted(refs, key=lambda r: (-r.written_ns, r.name)))


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _gate_metric(m: Mapping) -> GateMetric:
    d = m.get("difference") or {}
    tests = d.get("rank_tests") or {}
    ci = m.get("effect_ci") or [None, None]
    return GateMetric(
        metric=_text(m.get("metric")), group=_text(m.get("group")), status=_text(m.get("status")),
        critical=bool(m.get("critical")), informative=bool(m.get("informative")), undecided=_text(m.get("undecided")),
        critical_possible=bool(m.get("critical_possible")), reason=_text(m.get("reason")),
        bad=_text(m.get("bad")), effect_kind=_text(m.get("effect_kind")), effect=_num(m.get("effect")),
        effect_low=_num(ci[0]), effect_high=_num(ci[1]), allowed=_num(m.get("allowed")),
        critical_effect=_num(m.get("critical_effect")), model_error=_num(m.get("model_error")),
        baseline=_num(d.get("baseline")), candidate=_num(d.get("candidate")),
        num_baseline=int(d.get("num_baseline") or 0), num_candidate=int(d.get("num_candidate") or 0),
        num_windows_used=int(m.get("num_windows_used") or 0), num_windows=int(d.get("num_windows") or 0),
        min_windows=int(m.get("min_windows") or 0), num_resamples=int(d.get("num_resamples") or 0),
        confidence=_num(d.get("confidence")),
        mann_whitney_u=_num(tests.get("mann_whitney_u")), mann_whitney_p=_num(tests.get("mann_whitney_p")),
        hodges_lehmann_s=_num(tests.get("hodges_lehmann_s")),
        brown_forsythe_stat=_num(tests.get("brown_forsythe_stat")),
        brown_forsythe_p=_num(tests.get("brown_forsythe_p")),
    )


def _rollback_on(value: Any) -> str:
    return value if value in ("fail", "critical", "never") else "fail"


def _gate_condition(c: Mapping) -> GateCondition:
    return GateCondition(metric=_text(c.get("metric")), group=_text(c.get("group")), bound=_text(c.get("bound")),
                         status=_text(c.get("status")), reason=_text(c.get("reason")),
                         baseline_status=_text(c.get("baseline_status")), baseline_reason=_text(c.get("baseline_reason")))


def read_gate_report(gate_dir: str | Path) -> GateReport | None:
    """The report in ``gate_dir`` (None when there is none; ``GateReportError`` when gate.json is
    not one). Reports written before the gate said its action read as their status alone."""
    folder = Path(gate_dir)
    path = folder / "gate.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        decision = data.get("decision") or {}
        baseline, candidate = data.get("baseline") or {}, data.get("candidate") or {}
        status = _text(data.get("status"))
        status = status if status in ("pass", "fail", "inconclusive") else "unknown"
        strings = lambda key: tuple(_text(r) for r in data.get(key) or [])  # noqa: E731
        return GateReport(
            folder=str(folder), status=status, headline=_text(data.get("headline")) or status.upper(),
            rollback_on=_rollback_on((data.get("config") or {}).get("rollback_on")),
            failed=strings("failed"), undecided=strings("undecided"), notes=strings("notes"),
            wait_minutes=_num(data.get("wait_minutes")), score=_num(data.get("score")), reasons=strings("reasons"),
            baseline=_text(baseline.get("source")), baseline_manifest=baseline.get("manifest"),
            candidate=_text(candidate.get("source")), candidate_manifest=candidate.get("manifest"),
            decision=decision.get("action"), decision_restore=decision.get("restore"),
            decision_reason=decision.get("reason"),
            metrics=tuple(_gate_metric(m) for m in data.get("metrics") or []),
            conditions=tuple(_gate_condition(c) for c in data.get("conditions") or []),
            report_files=tuple(str(folder / n) for n in ("gate.json", "gate.md", "gate.html") if (folder / n).is_file()),
            written_ns=path.stat().st_mtime_ns,
        )
    except (ValueError, TypeError, AttributeError, IndexError) as exc:
        raise GateReportError(f"{path} is not a gate report ({type(exc).__name__}: {exc})") from None


def _records_table(records: tuple, fields) -> pa.Table:
    return pa.table({name: [getattr(r, name) for r in records] for name in fields}) if records else pa.table(
        {name: pa.array([], pa.string()) for name in fields})


def gate_metrics_table(report: GateReport) -> pa.Table:
    """The per-metric verdicts as a table (the Gate page's main table)."""
    return _records_table(report.metrics, GateMetric.__dataclass_fields__)


def gate_conditions_table(report: GateReport) -> pa.Table:
    """The absolute conditions as a table (candidate and baseline standing)."""
    return _records_table(report.conditions, GateCondition.__dataclass_fields__)
