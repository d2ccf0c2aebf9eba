"""The canary gate: pass, fail or inconclusive, with the reason and the statistics of every metric.

A gate configuration (YAML, ``GateConfig``; ``docs/gate.md`` is its reference) lists the metrics to
judge, each with the direction that is bad, the allowed and critical effect sizes (relative or
absolute), the data it needs, whether missing data is acceptable and whether it is critical. Each
metric is compared (``replay.compare``) and judged from its bootstrap interval of the bad effect:

- **pass** when the whole interval lies within the allowed effect;
- **fail** when the whole interval lies beyond it; a *critical* failure when the estimate also
  lies beyond the critical effect;
- **inconclusive** when the interval straddles the allowed effect, when either side has fewer
  requests than the metric needs (e.g. ten requests against 50), or when the baseline has no data.

The run: **fail** on any critical failure of a metric marked critical, or when the score (the
share of decided metrics, passed or failed, that passed, as Kayenta scores; inconclusive metrics
are not counted, like Kayenta's "no data") is below ``score.marginal``; **pass** when the score
reaches ``score.pass`` and no critical metric is inconclusive; **inconclusive** otherwise.
Inconclusive is never pass. Rejections, cancellations and cost are metrics like any other, so a
candidate cannot win goodput by shedding load unnoticed.

For a live canary (a one-pool or shadow pool against the baseline pool over the same period, read
from the lake by the ``pool`` label), ``decide`` turns the verdict into an action: promote, keep
watching, or roll back, naming the configuration to restore.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay.compare import (
    Difference,
    block_counts,
    default_block_windows,
    compare_stats,
    distribution_of,
    evaluator,
    metric_names,
    rank_tests,
    window_stats,
)
from replay.metrics import ClassObjectives, CostConfig, MetricsConfig, TenantWeight, load_requests, load_steps
from schemas.types import doc
from servelens.errors import ConfigError, DataNotFoundError, ServelensError

PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """How one metric is judged."""

    name: str = doc("Metric name (`servelens gate --list-metrics` lists them).")
    bad: str = doc("Which direction is bad: 'increase' or 'decrease'.")
    effect: str = doc("'relative' ((candidate - baseline) / |baseline|) or 'absolute' (candidate - baseline).", "relative")
    allowed: float = doc("Largest bad effect that still passes.")
    critical: float = doc("Bad effect beyond which a failure is critical.")
    per_class: bool = doc("Judge each service class separately too (each class a metric of its own).", False)
    min_points: int | None = doc("Requests each side needs (default: the gate's min_points).", None)
    must_have_data: bool = doc("Missing data makes the metric inconclusive (else it is skipped).", True)
    critical_flag: bool = doc("A critical failure of this metric fails the whole run.", False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreConfig:
    """Kayenta-style score thresholds (percent of judged metrics that passed)."""

    marginal: float = doc("Below this score the run fails.", 75.0)
    pass_: float = doc("At or above this score (and no critical metric inconclusive) the run passes.", 90.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class GateConfig:
    """The gate: objectives, statistics and the metrics judged."""

    version: int = doc("Configuration format version.", 1)
    classes: tuple[ClassObjectives, ...] = doc("Objectives per service class ('default' for others).",
                                                MetricsConfig().classes)
    cost: CostConfig = doc("Accelerator prices, for cost metrics.", CostConfig())
    tenant_weights: tuple[TenantWeight, ...] = doc("Entitlement weights for fairness metrics.", ())
    window_s: float = doc("Time window of the block bootstrap (and of over-time charts), seconds.", 60.0)
    block_windows: int = doc("Windows per bootstrap block; 0 picks 1.5 x the cube root of the number of windows.", 0)
    resamples: int = doc("Bootstrap resamples.", 1000)
    confidence: float = doc("Confidence of the intervals.", 0.90)
    seed: int = doc("Seed of the bootstrap and of the rank tests' subsamples.", 7)
    min_points: int = doc("Requests each side needs per metric, unless the metric says otherwise.", 50)
    score: ScoreConfig = doc("Score thresholds.", ScoreConfig())
    rollback_on: str = doc("Live canaries roll back on 'fail', on 'critical' failures only, or 'never'.", "fail")
    metrics: tuple[MetricSpec, ...] = doc("The metrics judged.", ())

    def metrics_config(self) -> MetricsConfig:
        return MetricsConfig(classes=self.classes, window_s=self.window_s, cost=self.cost,
                             tenant_weights=self.tenant_weights)


def _m(name: str, bad: str, allowed: float, critical: float, effect: str = "relative", **kw) -> MetricSpec:
    return MetricSpec(name=name, bad=bad, allowed=allowed, critical=critical, effect=effect, **kw)


#: The metrics judged when a configuration lists none: deadline misses, starvation, oscillation
#: and cost regressions are failures; rejections and cancellations are judged beside goodput.
DEFAULT_METRICS: tuple[MetricSpec, ...] = (
    _m("goodput_rps", "decrease", 0.05, 0.20, per_class=True, critical_flag=True),
    _m("attainment", "decrease", 0.02, 0.10, "absolute", per_class=True, critical_flag=True),
    _m("ttft_p99_s", "increase", 0.10, 0.25, per_class=True, critical_flag=True),
    _m("itl_p99_p99_s", "increase", 0.10, 0.25, per_class=True),
    _m("e2e_p99_s", "increase", 0.10, 0.25, per_class=True),
    _m("ttft_spread_s", "increase", 0.20, 0.50),
    _m("rejected_share", "increase", 0.01, 0.05, "absolute", critical_flag=True),
    _m("cancelled_share", "increase", 0.01, 0.05, "absolute"),
    _m("max_queue_s", "increase", 0.25, 1.00),
    _m("past_queue_limit_share", "increase", 0.01, 0.05, "absolute", critical_flag=True),
    _m("preemptions_per_request", "increase", 0.05, 0.25, "absolute"),
    _m("oscillating_share", "increase", 0.01, 0.05, "absolute", critical_flag=True),
    _m("admission_flaps_per_hour", "increase", 10.0, 60.0, "absolute"),
    _m("jain_index", "decrease", 0.02, 0.10, "absolute", must_have_data=False),
    _m("cost_per_1k_goodput_tokens", "increase", 0.05, 0.20, must_have_data=False, critical_flag=True),
)


def default_config() -> GateConfig:
    return GateConfig(metrics=DEFAULT_METRICS)


def _validate(config: GateConfig) -> GateConfig:
    known = set(metric_names(config.metrics_config()))
    for spec in config.metrics:
        if spec.name not in known:
            raise ConfigError(f"unknown metric {spec.name!r} in the gate configuration",
                              f"valid metrics: {', '.join(sorted(known))}")
        if spec.bad not in ("increase", "decrease"):
            raise ConfigError(f"metric {spec.name}: bad must be 'increase' or 'decrease', not {spec.bad!r}")
        if spec.effect not in ("relative", "absolute"):
            raise ConfigError(f"metric {spec.name}: effect must be 'relative' or 'absolute', not {spec.effect!r}")
        if not 0 <= spec.allowed <= spec.critical:
            raise ConfigError(f"metric {spec.name}: need 0 <= allowed ({spec.allowed}) <= critical ({spec.critical})")
    if not 0 < config.confidence < 1:
        raise ConfigError(f"confidence must be between 0 and 1, not {config.confidence}")
    if config.rollback_on not in ("fail", "critical", "never"):
        raise ConfigError(f"rollback_on must be 'fail', 'critical' or 'never', not {config.rollback_on!r}")
    if not 0 <= config.score.marginal <= config.score.pass_ <= 100:
        raise ConfigError("score thresholds need 0 <= marginal <= pass <= 100")
    if config.resamples < 100 or config.window_s <= 0:
        raise ConfigError("resamples must be >= 100 and window_s > 0")
    return config


def load_config(path: str | Path | None) -> GateConfig:
    """The gate configuration from YAML (``None``: the defaults), validated with clear errors."""
    if path is None:
        return default_config()
    import yaml

    from servelens.config import build

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"gate configuration {path} does not exist",
                          "write one with `servelens gate --write-default-config gate.yaml`") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"gate configuration {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"gate configuration {path} must be a mapping of settings")
    if isinstance(data.get("score"), dict) and "pass" in data["score"]:
        data = {**data, "score": {("pass_" if k == "pass" else k): v for k, v in data["score"].items()}}
    config = build(GateConfig, data)
    if not config.metrics:
        config = replace(config, metrics=DEFAULT_METRICS)
    return _validate(config)


def config_yaml(config: GateConfig) -> str:
    """A configuration as commented YAML (what `--write-default-config` writes)."""
    import dataclasses

    import yaml

    def plain(obj):
        if dataclasses.is_dataclass(obj):
            return {("pass" if f.name == "pass_" else f.name): plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, tuple):
            return [plain(o) for o in obj]
        return obj

    header = (
        "# servelens gate configuration (docs/gate.md explains every key)\n"
        "# metrics: bad = increase|decrease, effect = relative|absolute, allowed <= critical\n"
    )
    return header + yaml.safe_dump(plain(config), sort_keys=False)


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


def load_run(path: str | Path, label: str, *, memory_limit: str | None = None) -> Run:
    """A replay output folder (events.parquet + manifest.json), an events file, or a request table.

    ``memory_limit`` (e.g. "2GB", ``lake.duckdb_memory_limit``) caps DuckDB while it derives the
    request table from events: it spills to disk beyond it (unset: DuckDB's default, 80% of RAM).
    """
    import hashlib

    from pipelines.tables import connect, derive_requests
    from schemas.validate import detect_format, iter_event_tables

    path = Path(path)
    manifest = None
    if path.is_dir():
        manifest = path / "manifest.json" if (path / "manifest.json").is_file() else None
        for name in ("requests.parquet", "events.parquet"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise DataNotFoundError(f"{path} holds neither requests.parquet nor events.parquet",
                                    "give a replay output folder, an events file or a request table")
    elif not path.is_file():
        raise DataNotFoundError(f"{label} {path} does not exist", "give a replay output folder, an events file or a request table")
    steps = None
    if detect_format(path) == "parquet":
        names = pq.read_schema(path).names
        if "ttft_s" in names:
            requests = pq.read_table(path)
        elif "event_type" in names:
            # DuckDB streams the file: events never all in memory
            requests = derive_requests(path, con=connect(memory_limit))
            # member ids as dictionary codes: a request sits in hundreds of steps
            steps = pq.read_table(path, columns=STEP_COLUMNS, filters=[("event_type", "==", "step_executed")],
                                  read_dictionary=["request_ids.list.element"])
        else:
            raise ServelensError(f"{path} is neither an events file nor a request table")
    else:
        events = pa.concat_tables(list(iter_event_tables(path))) if path.stat().st_size else None
        if events is None:
            raise ServelensError(f"{path} is empty")
        requests = derive_requests(events)
        steps = events.filter(pc.equal(events["event_type"], "step_executed")).select(STEP_COLUMNS)
    sha = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest else None
    return Run(label, requests, steps, str(path), str(manifest) if manifest else None, sha)


def lake_pools(lake_root: str, baseline_pool: str, candidate_pool: str, since_ns: int | None, until_ns: int | None,
               ) -> tuple[Run, Run]:
    """Two live pools from the lake over the same period (by the events' ``pool`` label)."""
    from pipelines.lake import Lake

    con = Lake(lake_root).connect()
    runs = []
    for label, pool in (("baseline", baseline_pool), ("candidate", candidate_pool)):
        clauses = ["pool = ?"]
        params: list = [pool]
        if since_ns is not None:
            clauses.append("arrival_ns >= ?")
            params.append(since_ns)
        if until_ns is not None:
            clauses.append("arrival_ns < ?")
            params.append(until_ns)
        requests = con.sql(f"SELECT * FROM requests WHERE {' AND '.join(clauses)}", params=params).to_arrow_table()
        steps = con.sql(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM events WHERE event_type = 'step_executed' AND pool = ?", params=[pool]
        ).to_arrow_table()
        runs.append(Run(label, requests, steps if steps.num_rows else None, f"{lake_root} (pool {pool})", None, None))
    return runs[0], runs[1]


# ------------------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    """The judgement of one metric (of the whole run, or of one class)."""

    metric: str
    group: str
    status: str  # pass, fail, inconclusive, skipped
    critical: bool  # a failure beyond the critical effect
    critical_flag: bool
    reason: str
    bad: str
    effect_kind: str
    effect: float | None  # the bad effect's estimate (relative or absolute, as configured)
    effect_ci: tuple[float, float] | None
    allowed: float
    critical_effect: float
    difference: Difference


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's answer."""

    status: str  # pass, fail, inconclusive
    score: float | None
    reasons: tuple[str, ...]
    metrics: tuple[MetricVerdict, ...]
    baseline: str
    candidate: str
    baseline_manifest: str | None
    candidate_manifest: str | None
    config: GateConfig

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    value += 0.0  # no "-0"
    return f"{value:+.1%}" if kind == "relative" else f"{value:+.4g}"


def judge_metric(diff: Difference, spec: MetricSpec, min_points: int) -> MetricVerdict:
    """One metric's status and its reason, from its paired difference."""
    label = spec.name + (f" ({diff.group})" if diff.group else "")
    need = spec.min_points or min_points

    def verdict(status: str, reason: str, effect=None, ci=None, critical=False) -> MetricVerdict:
        return MetricVerdict(diff.metric, diff.group, status, critical, spec.critical_flag, reason, spec.bad,
                             spec.effect, effect, ci, spec.allowed, spec.critical, diff)

    if diff.num_baseline == 0 and diff.num_candidate == 0 and not spec.must_have_data:
        return verdict(SKIPPED, f"{label}: no data on either side (not required)")
    if diff.num_baseline < need or diff.num_candidate < need:
        return verdict(INCONCLUSIVE, f"{label}: too little data (baseline {diff.num_baseline:,}, candidate "
                                     f"{diff.num_candidate:,} requests; {need:,} needed)")
    if diff.baseline is None:
        return verdict(INCONCLUSIVE if spec.must_have_data else SKIPPED, f"{label}: the baseline has no value for this metric")
    if diff.candidate is None:
        return verdict(INCONCLUSIVE if spec.must_have_data else SKIPPED, f"{label}: the candidate has no value for this metric")
    sign = 1.0 if spec.bad == "increase" else -1.0
    raw, ci = (diff.relative, diff.relative_ci) if spec.effect == "relative" else (diff.absolute, diff.absolute_ci)
    if raw is None:
        return verdict(INCONCLUSIVE, f"{label}: the baseline is 0, so a relative effect is undefined (use effect: absolute)")
    effect = sign * raw
    if ci is None:
        return verdict(INCONCLUSIVE, f"{label}: too few usable bootstrap resamples for an interval", effect)
    lo, hi = sorted((sign * ci[0], sign * ci[1]))
    level = f"{diff.confidence:.0%}"
    change = (f"{label} {'rose' if raw > 0 else 'fell' if raw < 0 else 'held'} {_fmt(raw, spec.effect)} "
              f"({diff.baseline:.4g} -> {diff.candidate:.4g}; {level} interval of the bad effect "
              f"[{_fmt(lo, spec.effect)}, {_fmt(hi, spec.effect)}])")
    limits = f"allowed {_fmt(spec.allowed, spec.effect)}, critical {_fmt(spec.critical, spec.effect)}"
    if hi <= spec.allowed:
        return verdict(PASS, f"{change}: within the allowed effect ({limits})", effect, (lo, hi))
    if lo > spec.allowed:
        critical = effect > spec.critical
        kind = "a critical failure" if critical else "a failure"
        return verdict(FAIL, f"{change}: beyond the allowed effect, {kind} ({limits})", effect, (lo, hi), critical)
    return verdict(INCONCLUSIVE, f"{change}: the interval straddles the allowed effect ({limits})", effect, (lo, hi))


def compare_runs(baseline: Run, candidate: Run, config: GateConfig) -> Verdict:
    """Compare two runs on every configured metric and reach the verdict."""
    mconfig = config.metrics_config()
    starts = [int(pc.min(r.requests["arrival_ns"]).as_py()) for r in (baseline, candidate)
              if r.requests.num_rows and r.requests["arrival_ns"].null_count < r.requests.num_rows]
    origin = min(starts) if starts else 0
    rb, rc = load_requests(baseline.requests, mconfig, origin), load_requests(candidate.requests, mconfig, origin)
    sb = load_steps(baseline.steps, origin) if baseline.steps is not None else None
    sc = load_steps(candidate.steps, origin) if candidate.steps is not None else None
    end = max([r.arrival_s.max() for r in (rb, rc) if r.size] or [0.0])
    num_windows = max(1, int(np.floor(end / config.window_s)) + 1)
    tenants = np.union1d(rb.tenant_names, rc.tenant_names)
    rng = np.random.default_rng(config.seed)
    block = min(config.block_windows or default_block_windows(num_windows), num_windows)
    counts = block_counts(num_windows, config.resamples, block, rng)
    num_blocks = -(-num_windows // block)
    classes = np.union1d(rb.class_names, rc.class_names)
    groups = [("", np.ones(rb.size, bool), np.ones(rc.size, bool))]
    groups += [(str(name), _of_class(rb, name), _of_class(rc, name)) for name in classes]
    stats = {
        g: (window_stats(rb, mb, sb if not g else None, num_windows, mconfig, tenants),
            window_stats(rc, mc, sc if not g else None, num_windows, mconfig, tenants))
        for g, mb, mc in groups
    }
    tests_cache: dict[tuple[str, str], object] = {}
    verdicts = []
    for spec in config.metrics:
        for group, mb, mc in groups if spec.per_class else groups[:1]:
            if group and not spec.per_class:
                continue
            column = distribution_of(spec.name)
            tests = None
            if column is not None:
                key = (column, group)
                if key not in tests_cache:
                    tests_cache[key] = rank_tests(getattr(rb, column)[mb], getattr(rc, column)[mc], rng)
                tests = tests_cache[key]
            base, cand = stats[group]
            diff = compare_stats(spec.name, group, base, cand, counts, config.confidence, evaluator(spec.name, mconfig),
                                 tests, num_blocks)
            verdicts.append(judge_metric(diff, spec, config.min_points))
    return _overall(verdicts, baseline, candidate, config)


def _of_class(r, name: str) -> np.ndarray:
    """Mask of the requests of one class (none when the run never saw it)."""
    found = np.flatnonzero(r.class_names == name)
    return r.class_code == found[0] if len(found) else np.zeros(r.size, dtype=bool)


def _overall(verdicts: list[MetricVerdict], baseline: Run, candidate: Run, config: GateConfig) -> Verdict:
    judged = [v for v in verdicts if v.status != SKIPPED]
    decided = [v for v in judged if v.status in (PASS, FAIL)]
    passed = sum(v.status == PASS for v in decided)
    score = 100.0 * passed / len(decided) if decided else None
    critical_failures = [v for v in decided if v.status == FAIL and v.critical and v.critical_flag]
    open_critical = [v for v in judged if v.status == INCONCLUSIVE and v.critical_flag]
    reasons: list[str] = []
    if critical_failures:
        status = FAIL
        reasons += [f"critical failure: {v.reason}" for v in critical_failures]
    elif score is not None and score < config.score.marginal:
        status = FAIL
        reasons.append(f"score {score:.0f} is below the marginal threshold {config.score.marginal:.0f}")
    elif score is not None and score >= config.score.pass_ and not open_critical:
        status = PASS
        reasons.append(f"score {score:.0f} reaches the pass threshold {config.score.pass_:.0f}")
    else:
        status = INCONCLUSIVE
        if score is None:
            reasons.append("no metric could be decided")
        elif score < config.score.pass_:
            reasons.append(f"score {score:.0f} is between the marginal ({config.score.marginal:.0f}) and pass "
                           f"({config.score.pass_:.0f}) thresholds")
        reasons += [f"critical metric undecided: {v.reason}" for v in open_critical]
    reasons += [f"failed: {v.reason}" for v in decided if v.status == FAIL and v not in critical_failures]
    return Verdict(status, score, tuple(reasons), tuple(verdicts), baseline.source, candidate.source,
                   baseline.manifest_path, candidate.manifest_path, config)


@dataclass(frozen=True, slots=True)
class Decision:
    """What a live canary should do next."""

    action: str  # promote, continue, rollback
    restore: str | None  # the configuration to restore on rollback
    reason: str


def decide(verdict: Verdict, previous_config: str | None) -> Decision:
    """Promote on pass, keep watching when inconclusive, roll back on failure (per ``rollback_on``)."""
    rollback_on = verdict.config.rollback_on
    critical = any(v.critical and v.status == FAIL for v in verdict.metrics)
    if verdict.status == FAIL and (rollback_on == "fail" or (rollback_on == "critical" and critical)):
        restore = previous_config or "the previous configuration (pass --previous-config to name it)"
        return Decision("rollback", previous_config, f"the canary failed; restore {restore}: " + "; ".join(verdict.reasons[:3]))
    if verdict.status == PASS:
        return Decision("promote", None, "the canary passed: " + "; ".join(verdict.reasons[:1]))
    return Decision("continue", None, "keep the canary running and gather data: " + "; ".join(verdict.reasons[:3]))
