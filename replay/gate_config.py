"""The canary gate's configuration: the metrics judged, the absolute conditions, the evidence
minimums and the replay model's known error (``docs/gate.md`` is the reference).

- ``MetricSpec``: one metric, the direction that is bad, its allowed and critical effects, per class
  or not, and whether it is only ``informative`` (judged and shown, never failing the run);
- ``Condition``: an absolute objective judged on the candidate alone, per class (Argo Rollouts'
  successCondition / failureCondition): attainment at least X, TTFT p99 at most Y s;
- ``min_windows`` / ``min_window_requests``: below them a metric is "not enough data";
- ``model_error``: the replay model's known error per metric (a fraction, from a fidelity report),
  so a pass that rests on a margin smaller than that error is not called a pass.

Configuration version 2 replaced version 1's ``critical_flag`` (only some metrics could fail a
run) by one rule: any metric not marked ``informative`` fails the run on a critical failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from replay.compare import metric_info, metric_names
from replay.metrics import ClassObjectives, CostConfig, MetricsConfig, TenantWeight
from schemas.types import doc
from servelens.errors import ConfigError
from servelens.settings import build, read_document

CONFIG_VERSION = 2
#: The configuration versions read: a version 1 file is read by version 2's rule (its ``critical_flag`` is refused,
#: ``_renamed_keys``); a later version, or one written as text, is refused.
READ_VERSIONS = (1, CONFIG_VERSION)
EACH_CLASS = "*"  # a condition's service_class that judges every class on its own
#: Bounds of the bootstrap's resamples: below 100 a 90% interval's ends rest on 5 of them; above 10,000 the
#: Monte Carlo error is long negligible and memory is not (10,000 take 0.6 GB on 8 windows). How many windows
#: the runs span is checked when they are judged (``replay.gate``).
MIN_RESAMPLES, MAX_RESAMPLES = 100, 10_000
#: The fewest bootstrap blocks a resample of ``min_windows`` windows may hold (``block_windows``).
MIN_BLOCKS = 5
#: The longest window, seconds (a day): a window is the bootstrap's unit of time, and a run needs ``min_windows``
#: of them (30 by default) before a metric is decided.
MAX_WINDOW_S = 86_400


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """How one metric is judged."""

    name: str = doc("Metric name (`servelens gate --list-metrics` lists them with their meaning).")
    bad: str = doc("Which direction is bad: 'increase' or 'decrease'.")
    effect: str = doc("'relative' ((candidate - baseline) / |baseline|) or 'absolute' (candidate - baseline).", "relative")
    allowed: float = doc("Largest bad effect that still passes.")
    critical: float = doc("A confident failure whose estimate is beyond this effect is critical: it fails the run.")
    per_class: bool = doc("Judge each service class separately too (each class a metric of its own).", False)
    min_points: int | None = doc("Requests each side needs in all (default: the gate's min_points).", None)
    min_windows: int | None = doc("Windows with enough requests each side needs (default: the gate's min_windows).", None)
    min_window_requests: int | None = doc(
        "Requests a window needs on each side to count toward min_windows (default: the gate's).", None)
    must_have_data: bool = doc("Missing data makes the metric undecided (else it is skipped).", True)
    informative: bool = doc("Only informative: judged and reported, never fails or holds the run.", False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    """An absolute objective, judged on the candidate alone (and stated for the baseline)."""

    metric: str = doc("Metric name, e.g. attainment, ttft_p99_s, goodput_rps.")
    service_class: str = doc("'' for the whole run, a class name, or '*' for each class on its own.", EACH_CLASS)
    at_least: float | None = doc("The candidate's value must be at least this (e.g. attainment 0.9).", None)
    at_most: float | None = doc("The candidate's value must be at most this (e.g. ttft_p99_s 2.0).", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelError:
    """The replay model's known error on one metric (a fidelity report's figure)."""

    metric: str = doc("A gate metric (ttft_p99_s) or a fidelity figure (itl_mean, ttft_p99, e2e_p90).")
    error: float = doc("The model's error as a fraction of the value, e.g. 0.05 for 5%.")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreConfig:
    """Kayenta-style score thresholds (percent of decided metrics that passed)."""

    marginal: float = doc("Below this score the run fails.", 75.0)
    pass_: float = doc("Below this score (and at least marginal) the run is inconclusive.", 90.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class GateConfig:
    """The gate: objectives, conditions, statistics, evidence minimums and the metrics judged."""

    version: int = doc("Configuration format version.", CONFIG_VERSION)
    classes: tuple[ClassObjectives, ...] = doc("Objectives per service class ('default' for others).",
                                                MetricsConfig().classes)
    cost: CostConfig = doc("Accelerator prices, for cost metrics.", CostConfig())
    tenant_weights: tuple[TenantWeight, ...] = doc("Entitlement weights for fairness metrics.", ())
    window_s: float = doc("Time window of the block bootstrap (and of over-time charts), seconds.", 60.0)
    block_windows: int = doc("Windows per bootstrap block; 0 picks 1.5 x the cube root of the number of windows.", 0)
    resamples: int = doc("Bootstrap resamples.", 1000)
    confidence: float = doc("Confidence of the intervals.", 0.90)
    seed: int = doc("Seed of the bootstrap and of the rank tests' subsamples.", 7)
    min_points: int = doc("Requests each side needs per metric in all, unless the metric says otherwise.", 50)
    min_windows: int = doc("Windows with enough requests each side needs per metric before it is decided.", 30)
    min_window_requests: int = doc("Requests of a metric a window needs on each side to count toward min_windows.", 5)
    rank_tests: bool = doc("Compute the descriptive rank tests (Mann-Whitney, Hodges-Lehmann, Brown-Forsythe); "
                           "they never change a verdict.", True)
    score: ScoreConfig = doc("Score thresholds.", ScoreConfig())
    rollback_on: str = doc("Live canaries roll back on 'fail', on 'critical' failures only, or 'never'.", "fail")
    conditions: tuple[Condition, ...] = doc("Absolute objectives judged on the candidate alone (Argo-style).", ())
    model_error: tuple[ModelError, ...] = doc("The replay model's known error per metric (replays only).", ())
    calibration_error: bool = doc(
        "Apply the held-out errors of the calibration the replays' manifests name (servelens calibrate) as "
        "model_error, beside any given here (the larger counts).", True
    )
    metrics: tuple[MetricSpec, ...] = doc("The metrics judged.", ())

    def metrics_config(self) -> MetricsConfig:
        return MetricsConfig(classes=self.classes, window_s=self.window_s, cost=self.cost,
                             tenant_weights=self.tenant_weights)


def _m(name: str, bad: str, allowed: float, critical: float, effect: str = "relative", **kw) -> MetricSpec:
    return MetricSpec(name=name, bad=bad, allowed=allowed, critical=critical, effect=effect, **kw)


#: The metrics judged when a configuration lists none. Every one but the informative ones fails the
#: run on a critical failure: latency at p50 and p99 per class (TTFT, ITL, E2E), goodput and
#: attainment, rejections and cancellations beside them, starvation, preemption, oscillation, cost.
DEFAULT_METRICS: tuple[MetricSpec, ...] = (
    _m("goodput_rps", "decrease", 0.05, 0.20, per_class=True),
    _m("attainment", "decrease", 0.02, 0.10, "absolute", per_class=True),
    _m("ttft_p50_s", "increase", 0.10, 0.25, per_class=True),
    _m("ttft_p99_s", "increase", 0.10, 0.25, per_class=True),
    _m("tpot_p50_s", "increase", 0.10, 0.25, per_class=True),
    _m("itl_p99_p99_s", "increase", 0.10, 0.25, per_class=True),
    _m("e2e_p50_s", "increase", 0.10, 0.25, per_class=True),
    _m("e2e_p99_s", "increase", 0.10, 0.25, per_class=True),
    _m("rejected_share", "increase", 0.01, 0.05, "absolute"),
    _m("cancelled_share", "increase", 0.01, 0.05, "absolute"),
    _m("max_queue_s", "increase", 1.0, 5.0, "absolute"),
    _m("past_queue_limit_share", "increase", 0.01, 0.05, "absolute"),
    _m("preemptions_per_request", "increase", 0.05, 0.25, "absolute"),
    _m("oscillating_share", "increase", 0.01, 0.05, "absolute"),
    _m("admission_flaps_per_hour", "increase", 10.0, 60.0, "absolute"),
    _m("cost_per_1k_goodput_tokens", "increase", 0.05, 0.20, must_have_data=False),
    _m("ttft_spread_s", "increase", 0.20, 0.50, informative=True),
    _m("jain_index", "decrease", 0.02, 0.10, "absolute", must_have_data=False, informative=True),
)

#: The absolute conditions of a configuration that lists none: every class meets its objectives
#: for at least 90% of its requests (the attainment DistServe measures capacity at).
DEFAULT_CONDITIONS: tuple[Condition, ...] = (Condition(metric="attainment", service_class=EACH_CLASS, at_least=0.90),)


def default_config() -> GateConfig:
    return GateConfig(metrics=DEFAULT_METRICS, conditions=DEFAULT_CONDITIONS)


#: Fidelity figures (what a sim-to-real report measures: mean, p50, p90, p99 of TTFT, ITL and E2E)
#: and the gate metrics each one bounds. A gate metric named directly takes precedence; several
#: figures on one metric: the largest error counts.
FIDELITY_FIGURES: dict[str, tuple[str, ...]] = {
    "ttft_mean": ("ttft_p50_s",), "ttft_p50": ("ttft_p50_s",), "ttft_p90": ("ttft_p90_s",),
    "ttft_p99": ("ttft_p99_s", "ttft_spread_s"),
    "itl_mean": ("tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "itl_p99_p50_s", "itl_p99_p90_s", "itl_p99_p99_s"),
    "itl_p50": ("itl_p99_p50_s", "tpot_p50_s"), "itl_p99": ("itl_p99_p99_s", "itl_p99_spread_s"),
    "e2e_mean": ("e2e_p50_s",), "e2e_p50": ("e2e_p50_s",), "e2e_p90": ("e2e_p90_s",), "e2e_p99": ("e2e_p99_s", "e2e_spread_s"),
}


def model_errors(config: GateConfig) -> dict[str, tuple[float, str]]:
    """Gate metric -> (the replay model's error on it, the figure it came from)."""
    direct: dict[str, tuple[float, str]] = {}
    via: dict[str, tuple[float, str]] = {}
    for item in config.model_error:
        if item.metric in FIDELITY_FIGURES:
            for metric in FIDELITY_FIGURES[item.metric]:
                if item.error > via.get(metric, (-1.0, ""))[0]:
                    via[metric] = (item.error, item.metric)
        elif item.error > direct.get(item.metric, (-1.0, ""))[0]:
            direct[item.metric] = (item.error, item.metric)
    return via | direct


def with_model_error(config: GateConfig, errors: Mapping[str, float]) -> GateConfig:
    """``config`` with the replay model's known errors added (a fidelity report's figures, e.g.
    ``{"itl_mean": 0.05}``), validated: the hook a ``servelens fidelity`` report plugs into."""
    added = tuple(ModelError(metric=name, error=float(error)) for name, error in errors.items())
    return validate(replace(config, model_error=config.model_error + added))


def parse_model_error(text: str) -> ModelError:
    """``NAME=FRACTION`` (the CLI's ``--model-error itl_mean=0.05``)."""
    name, sep, value = text.partition("=")
    try:
        if sep and name.strip():
            return ModelError(metric=name.strip(), error=float(value))
    except ValueError:
        pass
    raise ConfigError(f"--model-error {text!r} is not NAME=FRACTION", "e.g. --model-error itl_mean=0.05 (5%)")


# ------------------------------------------------------------------------------------------ checks


def _validate_metric(spec: MetricSpec, known: set[str]) -> None:
    if spec.name not in known:
        raise ConfigError(f"unknown metric {spec.name!r} in the gate configuration",
                          f"valid metrics: {', '.join(sorted(known))}")
    if spec.bad not in ("increase", "decrease"):
        raise ConfigError(f"metric {spec.name}: bad must be 'increase' or 'decrease', not {spec.bad!r}")
    if spec.effect not in ("relative", "absolute"):
        raise ConfigError(f"metric {spec.name}: effect must be 'relative' or 'absolute', not {spec.effect!r}")
    if not 0 <= spec.allowed <= spec.critical:
        raise ConfigError(f"metric {spec.name}: need 0 <= allowed ({spec.allowed}) <= critical ({spec.critical})")
    for name in ("min_points", "min_windows", "min_window_requests"):
        if (getattr(spec, name) or 1) < 1:
            raise ConfigError(f"metric {spec.name}: {name} must be at least 1")


def _validate_condition(i: int, cond: Condition, known: set[str]) -> None:
    if cond.metric not in known:
        raise ConfigError(f"unknown metric {cond.metric!r} in a condition", f"valid metrics: {', '.join(sorted(known))}")
    if cond.at_least is None and cond.at_most is None:
        raise ConfigError(f"condition on {cond.metric}: give at_least or at_most", "e.g. {metric: attainment, at_least: 0.9}")
    if cond.at_least is not None and cond.at_most is not None and cond.at_least > cond.at_most:
        raise ConfigError(f"condition on {cond.metric}: at_least ({cond.at_least}) is above at_most ({cond.at_most})")
    low, high, what = _value_range(cond.metric)
    for key, bound in (("at_least", cond.at_least), ("at_most", cond.at_most)):
        if bound is None or low <= bound <= (high if high is not None else bound):
            continue
        never = (key == "at_least") == (bound > low)  # above the range for at_least, below it for at_most
        raise ConfigError(f"conditions[{i}].{key} {bound:g} on {cond.metric} {'can never be met' if never else 'is always met'}:"
                          f" {cond.metric} is {what}", f"give a bound it can take, e.g. {_example(cond.metric, high)}")


def _value_range(metric: str) -> tuple[float, float | None, str]:
    """The values a metric can take: (lowest, highest or None, in words). Shares and indices lie from 0 to 1;
    every other metric (latencies, rates, counts per request, cost) is never negative."""
    try:
        unit = metric_info(metric).unit
    except KeyError:
        return 0.0, None, "never negative"
    if unit in ("share", "index"):
        return 0.0, 1.0, f"a {unit} from 0 to 1 (0.9 is 90%)"
    return 0.0, None, f"in {unit}, never negative"


def _example(metric: str, high: float | None) -> str:
    return f"{{metric: {metric}, at_least: 0.9}}" if high is not None else f"{{metric: {metric}, at_most: 2.0}}"


def _validate_unique(config: GateConfig) -> None:
    """A class or a tenant named twice would silently keep one of its entries; a metric listed twice would be judged
    twice, with thresholds that may disagree."""
    for key, names, fix in (
        ("classes", [c.name for c in config.classes], "merge them into one entry: a class has one set of objectives"),
        ("metrics", [m.name for m in config.metrics],
         "keep one entry per metric, with the thresholds you mean (per_class: true judges each class too)"),
        ("tenant_weights", [t.tenant for t in config.tenant_weights], "keep one weight per tenant"),
    ):
        seen: dict[str, int] = {}
        for i, name in enumerate(names):
            if name in seen:
                raise ConfigError(f"{key}[{i}] names {name!r} again ({key}[{seen[name]}] names it first): "
                                  "only one of them could apply", fix)
            seen[name] = i


def _validate_model_error(item: ModelError, known: set[str]) -> None:
    if item.metric not in known and item.metric not in FIDELITY_FIGURES:
        raise ConfigError(f"unknown metric {item.metric!r} in model_error",
                          f"a gate metric (servelens gate --list-metrics) or a fidelity figure: "
                          f"{', '.join(FIDELITY_FIGURES)}")
    if not 0 <= item.error < 1:
        raise ConfigError(f"model_error {item.metric}: error is a fraction below 1 (0.05 for 5%), not {item.error}")


def _validate_objectives(config: GateConfig) -> None:
    """Class objectives, tenant weights and prices: a negative or zero one would turn a metric's sense."""
    for cls in config.classes:
        for key in ("ttft_s", "itl_s", "e2e_s", "max_queue_s"):
            value = getattr(cls, key)
            if value is not None and not value > 0:
                raise ConfigError(f"class {cls.name!r}: {key} must be above 0 seconds, not {value:g}",
                                  "leave it out for no objective on that latency")
    for tw in config.tenant_weights:
        if not tw.weight > 0:
            raise ConfigError(f"tenant_weights {tw.tenant!r}: weight must be above 0, not {tw.weight:g}",
                              "an entitlement weight: 1 for an ordinary tenant, 2 for one entitled to twice the service")
    if not config.cost.accelerator_hour_price >= 0 or config.cost.accelerators_per_instance < 1:
        raise ConfigError(f"cost: accelerator_hour_price must be at least 0 and accelerators_per_instance at least 1 "
                          f"(got {config.cost.accelerator_hour_price:g} and {config.cost.accelerators_per_instance})")


def _validate_bootstrap(config: GateConfig) -> None:
    """The resampling: a block so long that a resample holds few blocks gives intervals far too narrow
    (one block: every resample is the run itself, shifted, and every interval has zero width)."""
    if not MIN_RESAMPLES <= config.resamples <= MAX_RESAMPLES or not config.window_s > 0:
        raise ConfigError(f"resamples must be between {MIN_RESAMPLES} and {MAX_RESAMPLES:,} and window_s above 0 "
                          f"(got {config.resamples} and {config.window_s:g})", "the defaults are 1000 resamples of 60 s windows")
    if config.window_s > MAX_WINDOW_S:
        raise ConfigError(f"window_s must be at most {MAX_WINDOW_S:,} s (a day), not {config.window_s:g}",
                          "a window is the bootstrap's unit of time and a metric needs min_windows of them (docs/gate.md, "
                          "'How an interval is made'): 60 s (the default) to a few minutes")
    if config.min_windows < 1 or config.min_window_requests < 1 or config.min_points < 1:
        raise ConfigError("min_windows, min_window_requests and min_points must be at least 1")
    if config.seed < 0:
        raise ConfigError(f"seed must be at least 0, not {config.seed}")
    if config.block_windows < 0 or config.block_windows * MIN_BLOCKS > config.min_windows:
        raise ConfigError(
            f"block_windows {config.block_windows} must be from 0 to min_windows / {MIN_BLOCKS} "
            f"({config.min_windows // MIN_BLOCKS} with min_windows {config.min_windows}), so that a resample of the fewest "
            f"windows decided holds at least {MIN_BLOCKS} blocks", "0 (the default) picks 1.5 x the cube root of the windows")


def validate(config: GateConfig) -> GateConfig:
    """The configuration, or a ``ConfigError`` naming the first bad setting and how to fix it."""
    if type(config.version) is not int or config.version not in READ_VERSIONS:
        raise ConfigError(f"version {config.version!r} is not supported: this servelens reads version {CONFIG_VERSION}",
                          f"set version: {CONFIG_VERSION} (docs/gate.md, 'Configuration reference')")
    known = set(metric_names(config.metrics_config()))
    _validate_unique(config)
    for spec in config.metrics:
        _validate_metric(spec, known)
    for i, cond in enumerate(config.conditions):
        _validate_condition(i, cond, known)
    for item in config.model_error:
        _validate_model_error(item, known)
    _validate_objectives(config)
    _validate_bootstrap(config)
    if not 0 < config.confidence < 1:
        raise ConfigError(f"confidence must be between 0 and 1, not {config.confidence}")
    if config.rollback_on not in ("fail", "critical", "never"):
        raise ConfigError(f"rollback_on must be 'fail', 'critical' or 'never', not {config.rollback_on!r}")
    if not 0 <= config.score.marginal <= config.score.pass_ <= 100:
        raise ConfigError("score thresholds need 0 <= marginal <= pass <= 100")
    return config


def _renamed_keys(data: dict, path: Path | str) -> dict:
    """Version 1's keys: ``score.pass`` is ``pass_`` here; ``critical_flag`` is gone (one rule now)."""
    if isinstance(data.get("score"), dict) and "pass" in data["score"]:
        data = {**data, "score": {("pass_" if k == "pass" else k): v for k, v in data["score"].items()}}
    metrics = data.get("metrics")
    for i, metric in enumerate(metrics if isinstance(metrics, list) else []):  # else build() names the type
        if isinstance(metric, dict) and "critical_flag" in metric:
            raise ConfigError(
                f"gate configuration {path}: metrics[{i}] ({metric.get('name')}) has critical_flag, which version 2 "
                "removed: every metric whose bad effect crosses its critical threshold with confidence now fails the run",
                "delete critical_flag; mark a metric `informative: true` to judge it without failing the run "
                "(`servelens gate --write-default-config` writes the current defaults)")
    return data


def _check_version(version: object, path: Path | str) -> None:
    """The file's ``version`` as written: the number 2 (or 1, or none); a later or mistyped version is not what this
    servelens reads."""
    if type(version) is int and version in READ_VERSIONS:
        return
    where = f"gate configuration {path}: version {version!r}"
    if isinstance(version, str) and version.strip() in map(str, READ_VERSIONS):
        raise ConfigError(f"{where} is text, not a number", f"write version: {version.strip()}, unquoted")
    raise ConfigError(f"{where} is not supported: this servelens reads version {CONFIG_VERSION} (docs/gate.md, "
                      "'Configuration reference')",
                      f"set version: {CONFIG_VERSION} with the keys docs/gate.md lists; `servelens gate "
                      f"--write-default-config gate.yaml` writes a version {CONFIG_VERSION} file to start from")


def load_config(path: str | Path | None) -> GateConfig:
    """The gate configuration from YAML (``None``: the defaults), validated with clear errors.
    A file without metrics gets the default metrics; without conditions, the default conditions
    (``conditions: []`` judges none)."""
    if path is None:
        return default_config()
    data = read_document(path, "gate configuration", "write one with `servelens gate --write-default-config gate.yaml`") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"gate configuration {path} must be a mapping of settings")
    data = _renamed_keys(data, path)
    _check_version(data.get("version", CONFIG_VERSION), path)
    try:
        config = build(GateConfig, data)
        if not config.metrics:
            config = replace(config, metrics=DEFAULT_METRICS)
        if "conditions" not in data:
            config = replace(config, conditions=DEFAULT_CONDITIONS)
        return validate(config)
    except ConfigError as exc:  # named with the file it is in
        raise ConfigError(f"gate configuration {path}: {exc.message}", exc.hint) from None


def config_yaml(config: GateConfig) -> str:
    """A configuration as commented YAML (what `--write-default-config` writes)."""
    import yaml

    def plain(obj):
        if dataclasses.is_dataclass(obj):
            return {("pass" if f.name == "pass_" else f.name): plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, tuple):
            return [plain(o) for o in obj]
        return obj

    header = (
        "# servelens gate configuration (docs/gate.md explains every key)\n"
        "# metrics: bad = increase|decrease, effect = relative|absolute, allowed <= critical; a critical failure of\n"
        "#   any metric not marked informative fails the run\n"
        "# conditions: absolute objectives on the candidate alone (service_class '*' = each class)\n"
        "# model_error: the replay model's known error per metric, e.g. [{metric: itl_mean, error: 0.05}]\n"
    )
    return header + yaml.safe_dump(plain(config), sort_keys=False)


def _thresholds(spec: MetricSpec) -> str:
    fmt = (lambda x: f"{x:.0%}") if spec.effect == "relative" else (lambda x: f"{x:g}")
    flags = [w for w, on in (("per class", spec.per_class), ("informative", spec.informative)) if on]
    return f"{fmt(spec.allowed)} / {fmt(spec.critical)} {spec.effect}" + (f", {', '.join(flags)}" if flags else "")


def describe_metrics(config: GateConfig) -> list[str]:
    """``servelens gate --list-metrics``: each metric's unit, worse direction, thresholds in this
    configuration (or 'not judged') and meaning; then the absolute conditions."""
    specs = {s.name: s for s in config.metrics}
    currency = config.cost.currency
    rows = [("metric", "unit", "worse", "allowed / critical (bad effect)", "meaning")]
    for name in metric_names(config.metrics_config()):
        info = metric_info(name)
        unit = currency if info.unit == "currency" else info.unit
        rows.append((name, unit, info.worse, _thresholds(specs[name]) if name in specs else "not judged", info.meaning))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines.append("")
    lines.append("absolute conditions (the candidate alone; '*' = each class): " + (
        "; ".join(f"{c.metric} {_bound(c)} ({c.service_class or 'whole run'})" for c in config.conditions) or "none"))
    return lines


def _bound(cond: Condition) -> str:
    return " and ".join(([f">= {cond.at_least:g}"] if cond.at_least is not None else [])
                        + ([f"<= {cond.at_most:g}"] if cond.at_most is not None else []))
