"""The gate's rule, by hand: differences with known intervals in, metric and run verdicts out."""

from __future__ import annotations

import dataclasses

import pytest

from replay.compare import Difference
from replay.gate_config import Condition, GateConfig, MetricSpec
from replay.judge import (
    FAIL,
    INCONCLUSIVE,
    MODEL_ERROR,
    NOT_ENOUGH_DATA,
    PASS,
    STRADDLES,
    Verdict,
    decide,
    failed_names,
    headline,
    judge_condition,
    judge_metric,
    judge_run,
    needs,
)

CONFIG = GateConfig()
ITL = MetricSpec(name="itl_p99_p99_s", bad="increase", allowed=0.10, critical=0.25)


def _diff(metric: str = "itl_p99_p99_s", effect: float = 0.0, ci: tuple[float, float] = (-0.02, 0.02), *, group: str = "",
          n: int = 5000, windows: int = 40, base: float = 0.05) -> Difference:
    """A relative effect ``effect`` with interval ``ci`` on a baseline of ``base``."""
    return Difference(metric, group, base, base * (1 + effect), n, n, base * effect, effect,
                      (base * ci[0], base * ci[1]), ci, 0.9, None, (base * 0.95, base * 1.05),
                      (base * (1 + effect) * 0.95, base * (1 + effect) * 1.05), windows, 4, 10, 1000)


def _judge(diff: Difference, spec: MetricSpec = ITL, used: int = 40, error=None):
    return judge_metric(diff, spec, needs(spec, CONFIG, used, diff.num_windows), error)


def test_a_metric_passes_fails_critically_or_is_undecided_from_its_interval():
    assert _judge(_diff(effect=0.02, ci=(-0.01, 0.05))).status == PASS
    critical = _judge(_diff(effect=0.40, ci=(0.30, 0.50)))
    assert critical.status == FAIL and critical.critical and "a critical failure" in critical.reason
    mild = _judge(_diff(effect=0.15, ci=(0.12, 0.18)))  # beyond allowed, not critical, critical ruled out
    assert mild.status == FAIL and not mild.critical and not mild.critical_possible
    open_ = _judge(_diff(effect=0.08, ci=(-0.05, 0.30)))
    assert open_.status == INCONCLUSIVE and open_.undecided == STRADDLES and open_.critical_possible
    assert open_.more_windows and open_.more_windows > 0  # narrowing to below +25% takes more windows


def test_too_few_windows_is_not_enough_data_whatever_the_interval_says():
    """One window of a block bootstrap has no uncertainty to show: a zero-width interval decides nothing."""
    verdict = _judge(_diff(effect=0.009, ci=(0.009, 0.009), windows=1), used=1)
    assert verdict.status == INCONCLUSIVE and verdict.undecided == NOT_ENOUGH_DATA
    assert "1 of 1 windows hold 5+ of its requests on each side; 30 needed" in verdict.reason
    assert verdict.more_windows == 29  # every window held enough: 29 more of the same
    sparse = _judge(_diff(windows=40), used=10)  # a quarter of the windows qualify
    assert sparse.more_windows == 80


def test_an_informative_metric_is_judged_but_never_critical_and_never_holds_the_run():
    spec = dataclasses.replace(ITL, informative=True)
    verdict = _judge(_diff(effect=0.9, ci=(0.8, 1.0)), spec)
    assert verdict.status == FAIL and not verdict.critical and "never fails the run" in verdict.reason
    run = judge_run([verdict, _judge(_diff())], [], CONFIG)
    assert run.status == PASS and any(r.startswith("informative only") for r in run.reasons)


def test_any_critical_failure_fails_the_run_whatever_the_score():
    passes = [_judge(_diff(metric=f"m{i}")) for i in range(30)]
    critical = _judge(_diff(effect=1.0, ci=(0.9, 1.1)))
    run = judge_run([*passes, critical], [], CONFIG)
    assert run.status == FAIL and run.score == pytest.approx(100 * 30 / 31)
    assert run.reasons[0].startswith("critical failure: itl_p99_p99_s rose +100.0%")


def test_a_run_passes_with_an_undecided_metric_that_cannot_be_critical_but_not_with_one_that_can():
    passes = [_judge(_diff(metric=f"m{i}")) for i in range(20)]
    harmless = _judge(_diff(effect=0.08, ci=(0.05, 0.12)))  # straddles allowed, far from critical
    assert harmless.status == INCONCLUSIVE and not harmless.critical_possible
    assert judge_run([*passes, harmless], [], CONFIG).status == PASS
    risky = _judge(_diff(effect=0.12, ci=(0.02, 0.30)))
    run = judge_run([*passes, risky], [], CONFIG)
    assert run.status == INCONCLUSIVE and any("a critical failure not ruled out" in r for r in run.reasons)
    assert run.wait_windows == risky.more_windows


def test_the_score_fails_or_holds_a_run_of_many_mild_failures():
    """Failures beyond allowed but never critical count against Kayenta's score (marginal 75, pass 90)."""
    mild = [_judge(_diff(metric=f"m{i}", effect=0.15, ci=(0.12, 0.18))) for i in range(3)]
    passes = [_judge(_diff(metric=f"p{i}")) for i in range(21)]
    low = judge_run([*mild, *passes[:7]], [], CONFIG)  # 7 of 10
    assert low.status == FAIL and "score 70: 7 of 10 decided metrics passed: below the marginal score 75" in low.reasons
    assert judge_run([*mild, *passes], [], CONFIG).status == INCONCLUSIVE  # 21 of 24: 87.5
    assert judge_run([*mild[:1], *passes], [], CONFIG).status == PASS  # 21 of 22: 95


def test_failures_are_named_most_certain_first():
    """A tight interval far beyond critical comes before a larger but wider one."""
    wide = _judge(_diff(metric="ttft_p99_s", effect=4.0, ci=(3.0, 5.0)))
    tight = _judge(_diff(effect=2.17, ci=(2.17, 2.17)))
    verdict = Verdict(FAIL, 0.0, (), (wide, tight), "b", "c", None, None, CONFIG)
    assert failed_names(verdict) == ["itl_p99_p99_s (all)", "ttft_p99_s (all)"]


def test_a_pass_by_less_than_the_replay_models_error_is_undecided_with_the_reason():
    """The model-fidelity hook: +6% [+4%, +8%] passes an allowed +10%, but not when the replay
    model's ITL is known to be off by 5% (8% + 5% > 10%)."""
    diff = _diff(effect=0.06, ci=(0.04, 0.08))
    assert _judge(diff).status == PASS
    held = _judge(diff, error=(0.05, "itl_mean"))
    assert held.status == INCONCLUSIVE and held.undecided == MODEL_ERROR and held.model_error == 0.05
    assert "less than the replay model's known error on it (itl_mean 5.0%)" in held.reason
    assert not held.critical_possible and judge_run([held], [], CONFIG).status != PASS  # nothing decided: no score
    near = _judge(_diff(effect=0.06, ci=(0.04, 0.08)), error=(0.20, "itl_mean"))  # 8% + 20% reaches critical 25%
    assert near.critical_possible
    passes = [_judge(_diff(metric=f"m{i}")) for i in range(20)]
    assert judge_run([*passes, held], [], CONFIG).status == PASS  # the error cannot make it critical
    assert judge_run([*passes, near], [], CONFIG).status == INCONCLUSIVE
    assert _judge(_diff(effect=0.0, ci=(-0.02, 0.02)), error=(0.05, "itl_mean")).status == PASS  # a wide margin stands
    failing = _judge(_diff(effect=0.5, ci=(0.4, 0.6)), error=(0.05, "itl_mean"))
    assert failing.status == FAIL and failing.critical  # the error never excuses a failure


def _condition(metric: str, value: float, ci: tuple[float, float], base: float, base_ci: tuple[float, float]) -> Difference:
    return Difference(metric, "batch", base, value, 5000, 5000, value - base, None, None, None, 0.9, None, base_ci, ci,
                      40, 4, 10, 1000)


def test_an_absolute_condition_judges_the_candidate_alone_and_states_the_baselines_standing():
    cond = Condition(metric="attainment", service_class="*", at_least=0.9)
    need = needs(None, CONFIG, 40, 40)
    broken = judge_condition(_condition("attainment", 0.0015, (0.001, 0.002), 0.0014, (0.001, 0.002)), cond, need)
    assert broken.status == FAIL and broken.baseline_status == FAIL
    assert broken.reason == "attainment (batch) 0.0015 [0.001, 0.002] misses at least 0.9"
    run = judge_run([_judge(_diff())], [broken], CONFIG)
    assert run.status == FAIL and run.reasons[0].startswith("missed condition: attainment (batch)")
    met = judge_condition(_condition("attainment", 0.97, (0.95, 0.99), 0.5, (0.4, 0.6)), cond, need)
    assert met.status == PASS and met.baseline_status == FAIL
    close = judge_condition(_condition("attainment", 0.91, (0.88, 0.94), 0.95, (0.93, 0.97)), cond, need)
    assert close.status == INCONCLUSIVE and close.more_windows > 0
    ttft = Condition(metric="ttft_p99_s", service_class="batch", at_most=2.0)
    assert judge_condition(_condition("ttft_p99_s", 1.9, (1.8, 1.95), 1.0, (0.9, 1.1)), ttft, need).status == PASS
    assert judge_condition(_condition("ttft_p99_s", 1.9, (1.8, 1.95), 1.0, (0.9, 1.1)), ttft, need,
                           (0.05, "ttft_p99")).status == INCONCLUSIVE  # 1.95 + 5% is over 2 s
    short = judge_condition(_condition("attainment", 0.0, (0.0, 0.0), 0.0, (0.0, 0.0)), cond, needs(None, CONFIG, 3, 3))
    assert short.status == INCONCLUSIVE and short.undecided == NOT_ENOUGH_DATA


def test_the_headline_says_the_action_live_and_offline():
    failing = judge_run([_judge(_diff(effect=1.0, ci=(0.9, 1.1)))], [], CONFIG)
    verdict = Verdict(failing.status, failing.score, failing.reasons, (), "b", "c", None, None, CONFIG)
    assert headline(verdict) == "FAIL: do not ship the candidate"
    assert headline(verdict, decide(verdict, "policy=fcfs@v12")) == "FAIL: roll back to policy=fcfs@v12"
    never = dataclasses.replace(verdict, config=dataclasses.replace(CONFIG, rollback_on="never"))
    assert headline(never, decide(never, None)) == "FAIL: keep watching (rollback_on: never)"
    waiting = dataclasses.replace(verdict, status=INCONCLUSIVE, wait_minutes=12.0)
    assert headline(waiting) == "INCONCLUSIVE: replay 12 more minutes of traffic"
    assert headline(waiting, decide(waiting, None)) == "INCONCLUSIVE: continue 12 more minutes"
    assert decide(waiting, None).wait_minutes == 12.0
    passing = dataclasses.replace(verdict, status=PASS)
    assert headline(passing) == "PASS: ready for a canary" and headline(passing, decide(passing, None)) == "PASS: promote"


def test_offline_a_metric_the_replay_models_error_keeps_undecided_is_sent_to_a_measured_run():
    """+6% [+4%, +8%] with a 20% model error can never pass and more traffic cannot rule out the critical
    +25%: the headline says to measure, not to replay more; with a 5% error more traffic can settle it."""
    stuck = _judge(_diff(effect=0.06, ci=(0.04, 0.08)), error=(0.20, "itl_mean"))
    assert stuck.undecided == MODEL_ERROR and stuck.more_windows is None
    run = judge_run([stuck], [], CONFIG)
    verdict = Verdict(run.status, run.score, run.reasons, (stuck,), "b", "c", None, None, CONFIG)
    assert headline(verdict) == ("INCONCLUSIVE: judge it on a measured run (the replay model's known error is larger "
                                 "than a metric's margin)")
    settles = _judge(_diff(effect=0.0, ci=(-0.05, 0.09)), error=(0.05, "itl_mean"))
    assert settles.undecided == MODEL_ERROR and settles.more_windows is not None
    run = judge_run([settles], [], CONFIG)
    verdict = Verdict(run.status, run.score, run.reasons, (settles,), "b", "c", None, None, CONFIG, wait_minutes=run.wait_windows)
    assert headline(verdict).startswith("INCONCLUSIVE: replay ")
