"""The gate's rule: each metric and each absolute condition judged from its interval, then the run.

A metric (``MetricSpec``) is judged from the bootstrap interval [lo, hi] of its bad effect
(positive is worse), once it has enough evidence:

- **not enough data** (undecided) below ``min_points`` requests a side, or below ``min_windows``
  windows holding ``min_window_requests`` requests each side: one or two blocks of a block
  bootstrap have no uncertainty to show, so a decision there would be a guess;
- **pass** when hi <= allowed (and, for replays, hi + the replay model's known error <= allowed:
  a pass that rests on a margin smaller than the model's error is undecided, reason stated);
- **fail** when lo > allowed; a **critical failure** when its estimate is also beyond ``critical``
  (a confident failure of critical size: Kayenta's rule, with the interval in place of its
  Mann-Whitney test);
- **undecided** when the interval straddles the allowed effect.

An absolute condition (``Condition``, Argo Rollouts' success/failure condition) is judged on the
candidate's own interval: **met** when the whole interval satisfies the bound, **missed** when
none of it does, undecided otherwise. The baseline is judged the same way, but only to say so: a
baseline out of SLO excuses nothing.

The run, over the metrics not marked informative:

- **fail** on any critical failure, any missed condition, or a score below ``score.marginal``;
- else **inconclusive** when a metric has not enough data, when a metric's interval still reaches
  beyond its critical effect (a critical failure not ruled out), when a condition is undecided, or
  when the score is below ``score.pass``; with an estimate of how many more minutes would decide it;
- else **pass**.

The score is Kayenta's: the share of decided metrics (passed or failed) that passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replay.compare import Difference
from replay.gate_config import Condition, GateConfig, MetricSpec

PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
#: Why a metric or condition is undecided ('' when it is decided).
NOT_ENOUGH_DATA = "not enough data"
STRADDLES = "interval straddles the limit"
MODEL_ERROR = "within the replay model's error"
NO_VALUE = "no value"
NO_INTERVAL = "no interval"


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    """The judgement of one metric (of the whole run, or of one class)."""

    metric: str
    group: str
    status: str  # pass, fail, inconclusive (undecided), skipped
    critical: bool  # a critical failure: confidently beyond allowed, estimate beyond critical
    informative: bool  # judged and shown only: never fails or holds the run
    undecided: str  # why it is undecided ('' when decided or skipped)
    critical_possible: bool  # the interval (plus any model error) reaches beyond the critical effect
    reason: str
    bad: str
    effect_kind: str
    effect: float | None  # the bad effect's estimate (relative or absolute, as configured)
    effect_ci: tuple[float, float] | None
    allowed: float
    critical_effect: float
    model_error: float | None  # the replay model's known error applied to this metric (a fraction)
    num_windows_used: int  # windows holding min_window_requests requests on each side
    min_windows: int
    min_window_requests: int
    more_windows: float | None  # estimated windows more to decide it (undecided metrics); None: no estimate
    difference: Difference


@dataclass(frozen=True, slots=True)
class ConditionVerdict:
    """An absolute condition judged on the candidate, and the baseline's standing on it."""

    metric: str
    group: str
    bound: str  # 'at least 0.9', 'at most 2 s'
    status: str  # pass (met), fail (missed), inconclusive
    undecided: str
    reason: str
    baseline_status: str  # the same judgement of the baseline (stated, never decisive)
    baseline_reason: str
    more_windows: float | None
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
    conditions: tuple[ConditionVerdict, ...] = ()
    notes: tuple[str, ...] = ()  # stated at the top: a baseline out of SLO, model error, unequal pools
    wait_minutes: float | None = None  # inconclusive: about how much more traffic would decide it

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    value += 0.0  # no "-0"
    return f"{value:+.1%}" if kind == "relative" else f"{value:+.4g}"


def label(metric: str, group: str) -> str:
    return metric + (f" ({group})" if group else "")


@dataclass(frozen=True, slots=True)
class Needs:
    """The evidence a metric needs, and what it has."""

    points: int
    windows: int
    window_requests: int
    windows_used: int
    num_windows: int


def needs(spec: MetricSpec | None, config: GateConfig, windows_used: int, num_windows: int) -> Needs:
    def pick(name: str) -> int:
        own = getattr(spec, name) if spec is not None else None
        return own or getattr(config, name)

    return Needs(pick("min_points"), pick("min_windows"), pick("min_window_requests"), windows_used, num_windows)


def _shortfall(need: Needs, num_baseline: int, num_candidate: int, side: str = "on each side",
               ) -> tuple[str, float | None] | None:
    """What evidence is short, and about how many windows more would do (None: no estimate)."""
    fewest = min(num_baseline, num_candidate)
    why, more = [], []
    if need.windows_used < need.windows:
        share = need.windows_used / need.num_windows if need.num_windows else 0.0
        why.append(f"{need.windows_used} of {need.num_windows} windows hold {need.window_requests}+ of its requests"
                   f"{' ' + side if side else ''}; {need.windows} needed")
        more.append((need.windows - need.windows_used) / share if share else math.inf)
    if fewest < need.points:
        counts = f"{num_baseline:,} baseline and {num_candidate:,} candidate" if side == "on each side" else f"{fewest:,}"
        why.append(f"{counts} requests; {need.points:,} needed")
        more.append((need.points - fewest) / (fewest / need.num_windows) if fewest else math.inf)
    if not why:
        return None
    estimate = max(more)
    return "; ".join(why), (None if math.isinf(estimate) else math.ceil(estimate))


def _more_to_decide(num_windows: int, effect: float, lo: float, hi: float, allowed: float, critical: float,
                    margin: float) -> float | None:
    """Windows more until the interval (narrowing as 1/sqrt(windows)) either rules out a critical
    failure or confirms one; None when the estimate sits on the threshold."""
    if effect + margin < critical and hi > effect:
        factor = ((hi - effect) / (critical - margin - effect)) ** 2
    elif effect > critical and effect > lo:
        factor = ((effect - lo) / (effect - allowed)) ** 2
    else:
        return None
    return max(0.0, math.ceil(num_windows * (factor - 1)))


def judge_metric(diff: Difference, spec: MetricSpec, need: Needs, model_error: tuple[float, str] | None = None,
                 ) -> MetricVerdict:
    """One metric's status and its reason, from its paired difference and its evidence."""
    name = label(spec.name, diff.group)

    def verdict(status: str, reason: str, undecided: str = "", effect=None, ci=None, critical=False, possible=True,
                more=None, error=None) -> MetricVerdict:
        possible = possible and status in (INCONCLUSIVE, FAIL) and not critical
        return MetricVerdict(diff.metric, diff.group, status, critical and not spec.informative, spec.informative,
                             undecided, possible, reason, spec.bad, spec.effect, effect, ci, spec.allowed, spec.critical,
                             error, need.windows_used, need.windows, need.window_requests, more, diff)

    if diff.num_baseline == 0 and diff.num_candidate == 0 and not spec.must_have_data:
        return verdict(SKIPPED, f"{name}: no data on either side (not required)", possible=False)
    raw, ci = (diff.relative, diff.relative_ci) if spec.effect == "relative" else (diff.absolute, diff.absolute_ci)
    sign = 1.0 if spec.bad == "increase" else -1.0
    effect = None if raw is None else sign * raw
    interval = None if ci is None else tuple(sorted((sign * ci[0], sign * ci[1])))
    short = _shortfall(need, diff.num_baseline, diff.num_candidate)
    if short is not None:  # the figures so far are shown, and decide nothing
        return verdict(INCONCLUSIVE, f"{name}: not enough data: {short[0]}" + _so_far(raw, spec.effect), NOT_ENOUGH_DATA,
                       effect, interval, more=short[1])
    missing = "baseline" if diff.baseline is None else "candidate" if diff.candidate is None else None
    if missing:
        return verdict(INCONCLUSIVE if spec.must_have_data else SKIPPED,
                       f"{name}: the {missing} has no value for this metric", NO_VALUE)
    if raw is None:
        return verdict(INCONCLUSIVE, f"{name}: the baseline is 0, so a relative effect is undefined (use effect: absolute)",
                       NO_VALUE)
    if ci is None:
        return verdict(INCONCLUSIVE, f"{name}: too few usable bootstrap resamples for an interval", NO_INTERVAL, effect)
    return _judge_interval(diff, spec, name, effect, interval, model_error, verdict)


def _so_far(raw: float | None, kind: str) -> str:
    return "" if raw is None else f" (so far {_fmt(raw, kind)}, not a decision)"


def _judge_interval(diff: Difference, spec: MetricSpec, name: str, effect: float, interval: tuple[float, float],
                    model_error: tuple[float, str] | None, verdict) -> MetricVerdict:
    lo, hi = interval
    error = model_error[0] if model_error else None
    margin = (error or 0.0) * (1.0 if spec.effect == "relative" else abs(diff.baseline))
    raw = effect if spec.bad == "increase" else -effect
    change = (f"{name} {'rose' if raw > 0 else 'fell' if raw < 0 else 'held'} {_fmt(raw, spec.effect)} "
              f"({diff.baseline:.4g} -> {diff.candidate:.4g}; {diff.confidence:.0%} interval of the bad effect "
              f"[{_fmt(lo, spec.effect)}, {_fmt(hi, spec.effect)}] over {diff.num_windows} windows)")
    limits = f"allowed {_fmt(spec.allowed, spec.effect)}, critical {_fmt(spec.critical, spec.effect)}"
    possible = hi + margin > spec.critical
    more = _more_to_decide(diff.num_windows, effect, lo, hi, spec.allowed, spec.critical, margin)
    if hi <= spec.allowed and hi + margin <= spec.allowed:
        return verdict(PASS, f"{change}: within the allowed effect ({limits})", "", effect, (lo, hi), possible=False,
                       error=error)
    if hi <= spec.allowed:
        return verdict(INCONCLUSIVE, f"{change}: within the allowed effect by {_fmt(spec.allowed - hi, spec.effect)}, less "
                       f"than the replay model's known error on it ({model_error[1]} {error:.1%}), so not a pass ({limits})",
                       MODEL_ERROR, effect, (lo, hi), possible=possible, more=more, error=error)
    if lo > spec.allowed:
        critical = effect > spec.critical
        kind = ("an informative metric: it never fails the run" if spec.informative
                else "a critical failure" if critical else "a failure, not critical")
        return verdict(FAIL, f"{change}: beyond the allowed effect, {kind} ({limits})", "", effect, (lo, hi), critical,
                       possible=possible, more=more, error=error)
    return verdict(INCONCLUSIVE, f"{change}: the interval straddles the allowed effect ({limits})", STRADDLES, effect,
                   (lo, hi), possible=possible, more=more, error=error)


# ------------------------------------------------------------------------------------------ conditions


def bound_text(cond: Condition) -> str:
    parts = ([f"at least {cond.at_least:g}"] if cond.at_least is not None else []) + (
        [f"at most {cond.at_most:g}"] if cond.at_most is not None else [])
    return " and ".join(parts)


def _standing(cond: Condition, value: float | None, ci: tuple[float, float] | None, margin: float) -> str:
    """met (pass), missed (fail) or undecided, from a value's interval against the bound."""
    if value is None or ci is None:
        return INCONCLUSIVE
    lo, hi = ci
    met = (cond.at_least is None or lo - margin >= cond.at_least) and (cond.at_most is None or hi + margin <= cond.at_most)
    missed = (cond.at_least is not None and hi < cond.at_least) or (cond.at_most is not None and lo > cond.at_most)
    return PASS if met else FAIL if missed else INCONCLUSIVE


def _side(cond: Condition, group: str, who: str, value: float | None, ci: tuple[float, float] | None, margin: float,
          ) -> tuple[str, str]:
    status = _standing(cond, value, ci, margin)
    name = label(cond.metric, group)
    if value is None:
        return status, f"{name}: the {who} has no value"
    shown = f"{name} {value:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "")
    if status == PASS:
        return status, f"{shown} meets {bound_text(cond)}"
    if status == FAIL:
        return status, f"{shown} misses {bound_text(cond)}"
    within = " (within the replay model's error of the bound)" if margin else ""
    return status, f"{shown}: undecided against {bound_text(cond)}{within}"


def judge_condition(diff: Difference, cond: Condition, need: Needs, model_error: tuple[float, str] | None = None,
                    baseline_need: Needs | None = None) -> ConditionVerdict:
    """The candidate against an absolute bound (its own interval); the baseline's standing beside it
    (``baseline_need``: the baseline's evidence, judged by the same minimums)."""
    def margin_of(v: float | None) -> float:
        return (model_error[0] if model_error else 0.0) * abs(v) if v is not None else 0.0

    status, reason = _side(cond, diff.group, "candidate", diff.candidate, diff.candidate_ci, margin_of(diff.candidate))
    base_status, base_reason = _side(cond, diff.group, "baseline", diff.baseline, diff.baseline_ci,
                                     margin_of(diff.baseline))
    base_short = _shortfall(baseline_need or need, diff.num_baseline, diff.num_baseline, "")
    if base_short is not None:
        base_status, base_reason = INCONCLUSIVE, f"{label(cond.metric, diff.group)}: not enough data: {base_short[0]}"
    undecided, more = ("" if status != INCONCLUSIVE else STRADDLES), None
    short = _shortfall(need, diff.num_candidate, diff.num_candidate, "")
    if short is not None:
        status, undecided, more = INCONCLUSIVE, NOT_ENOUGH_DATA, short[1]
        reason = f"{label(cond.metric, diff.group)}: not enough data on the candidate: {short[0]}"
    elif status == INCONCLUSIVE and diff.candidate is not None and diff.candidate_ci is not None:
        more = _more_for_bound(cond, diff.candidate, diff.candidate_ci, diff.num_windows)
    return ConditionVerdict(cond.metric, diff.group, bound_text(cond), status, undecided, reason, base_status,
                            base_reason, more, diff)


def _more_for_bound(cond: Condition, value: float, ci: tuple[float, float], num_windows: int) -> float | None:
    bound = cond.at_least if cond.at_least is not None and (cond.at_most is None or value < cond.at_most) else cond.at_most
    half = max(value - ci[0], ci[1] - value)
    gap = abs(value - bound)
    return max(0.0, math.ceil(num_windows * ((half / gap) ** 2 - 1))) if gap > 0 and half > 0 else None


# ------------------------------------------------------------------------------------------ the run


def _certainty(m: MetricVerdict) -> tuple:
    """Sort key of failures, most certain first: how many interval widths the interval's near end
    clears the critical effect, then the size of the effect against it."""
    lo, hi = m.effect_ci or (0.0, 0.0)
    width = hi - lo
    clear = (lo - m.critical_effect) / width if width > 0 else math.copysign(math.inf, lo - m.critical_effect)
    size = (m.effect or 0.0) / m.critical_effect if m.critical_effect else math.inf
    return (-clear, -size)


@dataclass(frozen=True, slots=True)
class RunJudgement:
    """The run's status and the lines that explain it, in the order a reader needs them."""

    status: str
    score: float | None
    reasons: tuple[str, ...]
    wait_windows: float | None


def judge_run(metrics: list[MetricVerdict], conditions: list[ConditionVerdict], config: GateConfig) -> RunJudgement:
    """Fail, inconclusive or pass (the module docstring's rule), with its reasons."""
    judged = [m for m in metrics if m.status != SKIPPED and not m.informative]
    decided = [m for m in judged if m.status in (PASS, FAIL)]
    score = 100.0 * sum(m.status == PASS for m in decided) / len(decided) if decided else None
    critical = sorted((m for m in judged if m.critical), key=_certainty)
    missed = [c for c in conditions if c.status == FAIL]
    other_fails = sorted((m for m in judged if m.status == FAIL and not m.critical), key=_certainty)
    short = [m for m in judged if m.undecided == NOT_ENOUGH_DATA]
    open_ = [m for m in judged if m.critical_possible and m.undecided != NOT_ENOUGH_DATA]
    open_conditions = [c for c in conditions if c.status == INCONCLUSIVE]
    counts = _score_line(score, decided, judged, config)
    reasons = [f"critical failure: {m.reason}" for m in critical] + [f"missed condition: {c.reason}" for c in missed]
    if critical or missed or (score is not None and score < config.score.marginal):
        if not (critical or missed):
            reasons.append(f"{counts}: below the marginal score {config.score.marginal:.0f}")
        reasons += [f"failed (not critical): {m.reason}" for m in other_fails]
        return RunJudgement(FAIL, score, tuple(reasons + _informative(metrics)), None)
    reasons += [m.reason for m in short]
    reasons += [f"{'failed' if m.status == FAIL else 'undecided'}, a critical failure not ruled out: {m.reason}"
                for m in open_]
    reasons += [f"condition undecided: {c.reason}" for c in open_conditions]
    blocked = short or open_ or open_conditions or score is None or score < config.score.pass_
    if score is None:
        reasons.append("no metric could be decided")
    elif score < config.score.pass_:
        reasons.append(f"{counts}: below the pass score {config.score.pass_:.0f}")
    elif not blocked:
        reasons.append(f"{counts}; every condition met; no metric can be a critical failure")
    reasons += [f"failed (not critical): {m.reason}" for m in other_fails if m not in open_]
    waits = [x.more_windows for x in [*short, *open_, *open_conditions]]
    wait = None if not waits or any(w is None for w in waits) else max(waits)
    return RunJudgement(INCONCLUSIVE if blocked else PASS, score, tuple(reasons + _informative(metrics)), wait)


def _score_line(score: float | None, decided: list[MetricVerdict], judged: list[MetricVerdict], config: GateConfig) -> str:
    if score is None:
        return "no metric decided"
    undecided = len(judged) - len(decided)
    return (f"score {score:.0f}: {sum(m.status == PASS for m in decided)} of {len(decided)} decided metrics passed"
            + (f" ({undecided} undecided, not counted)" if undecided else ""))


def _informative(metrics: list[MetricVerdict]) -> list[str]:
    return [f"informative only (never fails the run): {m.reason}" for m in metrics if m.informative and m.status == FAIL]


@dataclass(frozen=True, slots=True)
class Decision:
    """What a live canary should do next."""

    action: str  # promote, continue, rollback
    restore: str | None  # the configuration to restore on rollback
    reason: str
    wait_minutes: float | None = None  # continue: about how long before the gate can decide


def decide(verdict: Verdict, previous_config: str | None) -> Decision:
    """Promote on pass, keep watching when inconclusive (for about ``wait_minutes``), roll back on
    failure (per ``rollback_on``: any failure, critical ones and missed conditions, or never)."""
    rollback_on = verdict.config.rollback_on
    critical = any(m.critical for m in verdict.metrics) or any(c.status == FAIL for c in verdict.conditions)
    if verdict.status == FAIL and (rollback_on == "fail" or (rollback_on == "critical" and critical)):
        restore = previous_config or "the previous configuration (pass --previous-config to name it)"
        return Decision("rollback", previous_config, f"the canary failed; restore {restore}: " + "; ".join(verdict.reasons[:3]))
    if verdict.status == PASS:
        return Decision("promote", None, "the canary passed: " + "; ".join(verdict.reasons[:1]))
    why = "keep the canary running and gather data" if verdict.status == INCONCLUSIVE else (
        f"the canary failed, but rollback_on is {rollback_on!r}")
    return Decision("continue", None, why + ": " + "; ".join(verdict.reasons[:3]),
                    verdict.wait_minutes if verdict.status == INCONCLUSIVE else None)


def _wait(live: bool, wait: float | None) -> str:
    if live:
        return "continue (no estimate of how long)" if wait is None else f"continue {wait:,.0f} more minutes"
    return "replay more traffic (no estimate of how much)" if wait is None else f"replay {wait:,.0f} more minutes of traffic"


def action_words(status: str, decision: str | None, wait_minutes: float | None, rollback_on: str = "fail",
                 model_bound: bool = False) -> str:
    """What to do, in the gate's own words: from a live decision (``decision``: promote, continue,
    rollback) or, offline (None), from the status alone (``model_bound``: a metric that no amount of
    replayed traffic can decide, its margin smaller than the replay model's known error)."""
    if decision == "promote":
        return "promote"
    if decision == "rollback":
        return "roll back"
    if decision == "continue":
        return _wait(True, wait_minutes) if status == INCONCLUSIVE else f"keep watching (rollback_on: {rollback_on})"
    if status == INCONCLUSIVE and model_bound:
        return "judge it on a measured run (the replay model's known error is larger than a metric's margin)"
    return {PASS: "ready for a canary", FAIL: "do not ship the candidate",
            INCONCLUSIVE: _wait(False, wait_minutes)}.get(status, "see the reasons")


def headline(verdict: Verdict, decision: Decision | None = None) -> str:
    """The verdict and the action, first line of every report: 'FAIL: roll back', 'PASS: promote',
    'INCONCLUSIVE: continue 12 more minutes', or the offline equivalents."""
    model_bound = verdict.wait_minutes is None and any(
        m.undecided == MODEL_ERROR and m.more_windows is None and not m.informative for m in verdict.metrics)
    action = action_words(verdict.status, decision.action if decision else None,
                          decision.wait_minutes if decision else verdict.wait_minutes, verdict.config.rollback_on,
                          model_bound)
    restore = f" to {decision.restore}" if decision is not None and decision.action == "rollback" and decision.restore else ""
    return f"{verdict.status.upper()}: {action}{restore}"


def failed_names(verdict: Verdict) -> list[str]:
    """Each failed metric once (its groups after it), critical ones first, most certain first."""
    order: dict[str, list[str]] = {}
    failed = [m for m in verdict.metrics if m.status == FAIL and not m.informative]
    for m in sorted(failed, key=lambda m: (not m.critical, _certainty(m))):
        order.setdefault(m.metric, []).append(m.group or "all")
    return [f"{name} ({', '.join(groups)})" for name, groups in order.items()]
