"""Calibrations with known answers: synthetic engines whose step costs are known are recovered.

A synthetic engine is the replay itself with chosen terms (``truth``): its step events and its latencies
are what a real engine's would be if the roofline with those terms were exactly right. The fits must
find step costs within 2% of the truth's (the terms themselves may trade off where the data cannot
tell them apart: a summary of latencies cannot always separate a per-step cost from a per-sequence one).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from replay.calibration import Calibration, apply_calibration, calibration_from_json, load_calibration, write_calibration
from replay.config import EngineConfig, FrontendConfig, instance_config
from replay.costmodel import RooflineConfig, RooflineCostModel, StepShape
from replay.fidelity import FidelityExperiment, compare, median_abs_error, median_signed_error
from replay.fit import ENGINE_PARAMETERS, PENALTY_PARAMETER, Simulator, Target, fit, simulate, units_of
from replay.run import run_replay
from replay.stepfit import fit_steps, step_shapes
from replay.traces import read_trace
from servelens.errors import ConfigError

TRUTH = RooflineConfig(compute_efficiency=0.55, memory_efficiency=0.82, kv_memory_efficiency=0.45,
                       step_overhead_ns=900_000, seq_overhead_ns=12_000, allreduce_latency_ns=9_000)
SHAPES = [StepShape((), d, d * ctx) for d in (1, 8, 32, 96) for ctx in (300, 1500)] + [
    StepShape(((512, 0),), 16, 16 * 800), StepShape(((2048, 1024),), 0, 0)]


def _step_costs_agree(instance, fitted: RooflineConfig, within: float) -> None:
    truth, got = RooflineCostModel(instance, TRUTH), RooflineCostModel(instance, fitted)
    for shape in SHAPES:
        assert got.step_time_ns(shape) == pytest.approx(truth.step_time_ns(shape), rel=within), shape


def test_step_events_give_back_the_engine_s_terms(shared, tmp_path):
    """Least squares on a synthetic engine's step_executed events (3,000 Azure requests, fast mode: runs of
    decode steps judged by their totals) recovers every fitted term, and so every step cost, within 2%."""
    instance = instance_config("llama-3-8b", "h100-sxm")
    summary = run_replay(read_trace("azure-conv", shared).slice(0, 3000), instance=instance, cost_model_config=TRUTH,
                         out_dir=tmp_path)
    steps = step_shapes(pq.read_table(summary.events_path))
    assert len(steps) == summary.num_step_events and sum(s.num_steps for s in steps) == summary.num_steps
    result = fit_steps(steps, instance, RooflineConfig(memory_efficiency=TRUTH.memory_efficiency))
    for name in ("compute_efficiency", "kv_memory_efficiency", "step_overhead_ns", "seq_overhead_ns"):
        assert getattr(result.roofline, name) == pytest.approx(getattr(TRUTH, name), rel=0.02), name
    assert result.median_abs_error_pct < 0.01
    _step_costs_agree(instance, result.roofline, 0.02)


@pytest.fixture
def small_spec(tmp_path):
    # three loads, so that the summaries tell a per-step cost from a per-sequence and per-token one (with
    # two, 4 and 14 requests/s, the one-shot all-reduce's bytes on four GPUs left the fit 3-6% off)
    stages = [{"rate": 2, "duration": 40}, {"rate": 8, "duration": 40}, {"rate": 24, "duration": 40}]
    spec = {"load": {"type": "poisson", "stages": stages},
            "data": {"type": "shared_prefix", "num_unique_system_prompts": 4, "num_users_per_system_prompt": 3,
                     "system_prompt_len": 100, "question_len": 300, "output_len": 120, "enable_multi_turn_chat": True}}
    path = tmp_path / "workloads" / "small.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(spec))
    return path


def _synthetic(shared, spec, model, tp, frontend, truth=TRUTH, penalties=False):
    exp = FidelityExperiment(id=f"{model}-tp{tp}", model=model, accelerator="h100-sxm", tensor_parallel_size=tp,
                             precision="FP16", max_num_seqs=128, max_num_batched_tokens=2048, num_gpu_blocks=None,
                             cpu_kv_blocks=0, profile="small", workload_path=spec, counted_output_tokens=None, recorded=())
    target = Target.of_experiment(exp, shared)
    if penalties:  # requests served with a repetition penalty: vLLM's penalty pass in every step
        engine = dataclasses.replace(target.instance_config.engine, sampling_penalties=True)
        target = dataclasses.replace(target, instance_config=dataclasses.replace(target.instance_config, engine=engine))
    recorded = simulate(target, truth, True, 0, None).metrics(frontend)
    return dataclasses.replace(target, recorded_items=tuple(recorded.items()))


@pytest.mark.slow
def test_latency_summaries_of_two_engines_give_back_their_step_costs(shared, small_spec):
    """The simulation-based fit, from nothing but each run's TTFT/ITL/E2E summary (a 7B on one GPU, a 70B on
    four; three load stages), finds the step costs of both within 2%, the frontend's time within 0.5 ms (its
    parts, a fixed time, tokenization and a queueing wait, add up the same on prompts of one length: only
    the sum is determined) and so every latency within 3%."""
    frontend = (0.004, 0.0, 0.0)
    targets = [_synthetic(shared, small_spec, "llama-2-7b", 1, frontend),
               _synthetic(shared, small_spec, "llama-2-70b", 4, frontend)]
    params = [p for p in ENGINE_PARAMETERS if p.name in ("memory_efficiency", "kv_memory_efficiency", "step_overhead_ns")]
    base = dataclasses.replace(TRUTH, memory_efficiency=0.6, kv_memory_efficiency=0.6, step_overhead_ns=0)
    with Simulator(1) as sim:
        result = fit(targets, sim, parameters=params, base=base, max_stage_s=None, max_evaluations=40)
    for t in targets:
        _step_costs_agree(t.instance_config, result.roofline, 0.02)
    prompt = 100 + 300 + 27  # system prompt, question, chat template
    total = result.frontend[0] + result.frontend[1] * prompt + result.frontend[2]  # the wait's mean: its term
    assert total == pytest.approx(frontend[0], abs=5e-4)
    assert max(e.abs_pct for e in result.errors) < 3.0  # every latency of both runs (tails move more than steps)


def test_the_penalty_pass_is_fitted_on_the_runs_that_carry_penalties_alone(shared, small_spec):
    """A synthetic engine whose requests carry sampling penalties (the penalty pass: 400 us a step) beside one
    whose requests do not: with the other terms known, the fit's second stage finds the pass's cost within 2%
    from the penalized run's latency summary alone, and both runs' latencies then agree within 1%."""
    truth = dataclasses.replace(TRUTH, penalty_overhead_ns=400_000)
    frontend = (0.004, 0.0, 0.0)
    targets = [_synthetic(shared, small_spec, "llama-2-7b", 1, frontend, truth),
               _synthetic(shared, small_spec, "llama-2-7b", 2, frontend, truth, penalties=True)]
    params = [p for p in ENGINE_PARAMETERS if p.name == "step_overhead_ns"]
    with Simulator(1) as sim:
        result = fit(targets, sim, start=units_of(TRUTH, params), parameters=params, base=TRUTH, max_stage_s=None,
                     max_evaluations=1)
    assert result.roofline.step_overhead_ns == TRUTH.step_overhead_ns  # one evaluation: the search stays put
    assert result.roofline.penalty_overhead_ns == pytest.approx(400_000, rel=0.02)
    assert max(e.abs_pct for e in result.errors) < 1.0
    with Simulator(1) as sim:  # no run carries penalties: the stage is skipped and the term stays unset
        alone = fit(targets[:1], sim, start=units_of(TRUTH, params), parameters=params, base=TRUTH,
                    max_stage_s=None, max_evaluations=1)
    assert alone.roofline.penalty_overhead_ns == 0 and alone.num_replays < result.num_replays


def test_leaving_out_a_group_fits_each_fold_without_any_run_of_that_group(shared, small_spec):
    """Leave-one-model-out: the two runs of one model are predicted by one fit that saw neither (only the
    other model's run), and that model's run by a fit on the two it did not see."""
    from replay.fit import leave_one_out

    frontend = (0.004, 0.0, 0.0)
    targets = [_synthetic(shared, small_spec, "llama-2-7b", 1, frontend),
               _synthetic(shared, small_spec, "llama-2-7b", 2, frontend),
               _synthetic(shared, small_spec, "llama-2-70b", 4, frontend)]
    params = [p for p in ENGINE_PARAMETERS if p.name == "step_overhead_ns"]
    with Simulator(1) as sim:
        folds = leave_one_out(targets, sim, group=lambda t: t.experiment.model, parameters=params, base=TRUTH,
                              max_stage_s=10.0, max_evaluations=2)
    assert [f.target.name for f in folds] == [t.name for t in targets]
    seen = [{e.experiment for e in f.fit.errors} for f in folds]
    assert seen == [{"llama-2-70b-tp4"}, {"llama-2-70b-tp4"}, {"llama-2-7b-tp1", "llama-2-7b-tp2"}]
    assert folds[0].fit is folds[1].fit and folds[2].fit is not folds[0].fit


def test_a_refit_also_searched_from_a_previous_calibration_keeps_the_lower_loss(shared, small_spec):
    """``also_from``: the all-data fit searches from the default start and from the given calibration's terms
    and keeps whichever ended lower; one evaluation each, so each search ends where it started: the
    synthetic engine's own terms (loss near 0) beat the default start, and the notes say where the terms
    came from."""
    from replay.calibrate import calibrate_experiments

    targets = [_synthetic(shared, small_spec, "llama-2-7b", 1, (0.004, 0.0, 0.0))]
    # compute is not fitted; the MoE share is (an unset one reads as the weights')
    truth = dataclasses.replace(TRUTH, compute_efficiency=RooflineConfig().compute_efficiency,
                                moe_memory_efficiency=TRUTH.memory_efficiency)
    previous = Calibration(name="previous", engine="", accelerators=("h100-sxm",), roofline=truth, frontend=FrontendConfig())
    calibration, _ = calibrate_experiments(targets, name="c", engine="", held_out=False, workers=1,
                                           max_stage_s=10.0, max_evaluations=1, also_from=[previous])
    assert calibration.roofline == truth
    (note,) = [n for n in calibration.notes if n.startswith("terms:")]
    assert note.startswith("terms: the search from previous's terms ended lowest (final loss from the default start ")
    alone, _ = calibrate_experiments(targets, name="c", engine="", held_out=False, workers=1, max_stage_s=10.0,
                                     max_evaluations=1)
    assert alone.roofline != truth and not any(n.startswith("terms:") for n in alone.notes)


def test_a_calibration_round_trips_and_applies(tmp_path):
    cal = Calibration(name="c", engine="vLLM 0.15.1", accelerators=("h100-sxm",), roofline=TRUTH,
                      frontend=FrontendConfig(request_overhead_s=0.002, tokenize_s_per_token=1e-5),
                      held_out_error_pct=(("itl_mean", 3.2),))
    path = write_calibration(cal, tmp_path / "c.json")
    assert load_calibration(path) == cal
    assert json.loads(path.read_text())["engine_defaults"] == {"async_scheduling": True}
    instance, roofline = apply_calibration(instance_config(), cal)
    assert roofline is TRUTH and instance.frontend == cal.frontend and instance.engine.async_scheduling is True
    kept, _ = apply_calibration(instance_config(engine=EngineConfig(async_scheduling=False)), cal)
    assert kept.engine.async_scheduling is False  # a setting the user gave wins over the engine default
    with pytest.raises(Exception, match="not a calibration of version"):
        calibration_from_json({"name": "x"})
    with pytest.raises(Exception, match="not a calibration of version"):
        calibration_from_json([1, 2])  # type: ignore[arg-type]  # a JSON file whose top level is a list
    broken = {**cal.as_json(), "engine_defaults": [True]}
    with pytest.raises(Exception, match="engine_defaults must be a mapping"):
        calibration_from_json(broken)


def _shipped_with(path: str, value) -> dict:
    """The shipped calibration's JSON with the key at ``path`` (dotted) set to ``value``."""
    from replay.calibration import CALIBRATIONS_DIR

    doc = json.loads(sorted(CALIBRATIONS_DIR.glob("*.json"))[-1].read_text())
    *parents, key = path.split(".")
    node = doc
    for parent in parents:
        node = node[parent]
    node[key] = value
    return doc


@pytest.mark.parametrize(("path", "value", "message"), [
    ("roofline.step_overhead_ns", float("nan"), "roofline.step_overhead_ns must be a finite number, not nan"),
    ("roofline.step_overhead_ns", 1e30, r"step_overhead_ns must be in \[0, 1,000,000,000\] ns"),
    ("roofline.memory_efficiency", True, "roofline.memory_efficiency has value True \\(bool\\); expected float"),
    ("roofline.memory_efficiency", 5, r"memory_efficiency must be in \(0, 1\]"),
    ("frontend.request_jitter_s", float("inf"), "frontend.request_jitter_s must be a finite number, not inf"),
    ("frontend.request_overhead_s", 3600.0, "request_overhead_s must be at most 60 s"),
    ("accelerators", "h100-sxm", "accelerators must be a list of names, not 'h100-sxm'"),
    ("name", None, "name must be text, not None"),
    ("engine_defaults.async_scheduling", 2, "engine_defaults.async_scheduling has value 2"),
    ("held_out_error_pct.e2e_mean", float("nan"), "held_out_error_pct.e2e_mean must be a finite number"),
    ("held_out_error_pct.itl_mean", -5, "held_out_error_pct.itl_mean is an absolute error in percent, from 0 to 1000, not -5"),
    ("fitted_load.kv_share", 1.5, r"fitted_load.kv_share must be in \[0, 1\], not 1.5"),
    ("fitted_load", [0.5], "fitted_load must be a mapping"),
    ("notes", "x", "notes must be a list of names"),
])
def test_a_calibration_file_of_the_wrong_types_or_out_of_bounds_is_refused_naming_the_key(tmp_path, path, value, message):
    """Each fault of a hand-edited calibration is an error naming the file and the key (before: NaN or 1e30 crashed
    the replay as an internal error, a string list of accelerators was read letter by letter, a NaN held-out error
    was printed as the model's error)."""
    file = tmp_path / "cal.json"
    file.write_text(json.dumps(_shipped_with(path, value)))
    with pytest.raises(ConfigError, match=f"^{file}: .*{message}"):
        load_calibration(file)
    file.write_text(json.dumps(_shipped_with("name", "unchanged")))
    assert load_calibration(file).name == "unchanged"  # the shipped values themselves pass


def test_the_shipped_calibration_is_bounded_and_says_its_held_out_error():
    from replay.calibration import default_calibration

    cal = default_calibration()
    assert cal is not None and cal.engine.startswith("vLLM") and "h100-sxm" in cal.accelerators
    r = cal.roofline
    assert all(0 < getattr(r, f) <= 1 for f in ("compute_efficiency", "memory_efficiency", "kv_memory_efficiency",
                                                "moe_memory_efficiency"))
    assert all(getattr(r, f) >= 0 for f in ("step_overhead_ns", "seq_overhead_ns", "allreduce_latency_ns"))
    assert PENALTY_PARAMETER.lower <= r.penalty_overhead_ns <= PENALTY_PARAMETER.upper
    held = dict(cal.held_out_error_pct)
    assert {"e2e_mean", "ttft_mean", "itl_mean", "e2e_p99", "ttft_p99"} <= set(held)
    assert len(cal.fitted_on) >= 10


def test_errors_and_their_medians_by_hand():
    errors = compare("a", {"ttft_mean": 0.1, "itl_mean": 0.01}, {"ttft_mean": 0.11, "itl_mean": 0.009}) + compare(
        "b", {"ttft_mean": 0.2, "itl_mean": 0.02}, {"ttft_mean": 0.17, "itl_mean": 0.022}) + compare(
        "c", {"ttft_mean": 0.1, "itl_mean": 0.01}, {"ttft_mean": 0.1, "itl_mean": 0.0105})
    assert [round(e.signed_pct, 6) for e in errors if e.metric == "ttft_mean"] == [10.0, -15.0, 0.0]
    assert median_abs_error(errors) == pytest.approx({"ttft_mean": 10.0, "itl_mean": 10.0})
    assert median_signed_error(errors) == pytest.approx({"ttft_mean": 0.0, "itl_mean": 5.0})
    assert np.isclose(errors[1].abs_pct, 10.0)


def test_a_held_out_run_s_stage_errors_are_its_recorded_stages_against_its_replayed_ones():
    from replay.fit import FitResult, HeldOut
    from replay.load import Load

    target = Target("t", (("ttft_p99", 0.1),), instance_config(),
                    recorded_stages=((0, (("ttft_p99", 0.2),)), (1, (("ttft_p99", 0.05),))))
    fit_result = FitResult(RooflineConfig(), (0.0, 0.0, 0.0), (), (), 0)
    held = HeldOut(target, fit_result, {"ttft_p99": 0.09}, Load(0.1, 0.1), Load(0.5, 0.5),
                   {0: {"ttft_p99": 0.1}, 1: {"ttft_p99": 0.06}})
    # by hand: stage 0 0.1 against 0.2 is -50%, stage 1 0.06 against 0.05 is +20%; the whole run's -10% apart
    assert [(i, e.metric, round(e.signed_pct, 6)) for i, e in held.stage_errors] == [(0, "ttft_p99", -50.0),
                                                                                       (1, "ttft_p99", 20.0)]
    assert [round(e.signed_pct, 6) for e in held.errors] == [-10.0]
    assert HeldOut(target, fit_result, {"ttft_p99": 0.09}, Load(0.1, 0.1), Load(0.5, 0.5)).stage_errors == []


def test_a_held_out_error_needs_enough_of_the_run_in_each_half(tmp_path):
    """50 requests (25 a half) gave a held-out TTFT p99 error of 6.0% from a half's near-largest value, which the
    gate would then have applied as the model's error; now refused before any fitting, with the way out."""
    from replay.calibrate import MIN_HELD_OUT_PER_HALF, calibrate_requests, calibrate_steps
    from replay.calibration import calibration_named
    from replay.derive import derive_requests
    from replay.errors import ReplayError
    from tests.replay.conftest import make_workload

    n = 2 * MIN_HELD_OUT_PER_HALF - 1
    summary = run_replay(make_workload([i * 10**8 for i in range(n)], [100] * n, [2] * n), out_dir=tmp_path)
    events = pq.read_table(summary.events_path)
    requests, instance, base = derive_requests(events), instance_config(), calibration_named("vllm-0.15.1-h100")
    with pytest.raises(ReplayError, match=f"at least 100 requests in each half of the run; this run holds {n}") as err:
        calibrate_requests(requests, instance, base, name="mine", engine="test")
    assert "--no-held-out" in err.value.hint
    short = pq.read_table(run_replay(make_workload([i * 10**8 for i in range(40)], [100] * 40, [2] * 40),
                                     out_dir=tmp_path / "short").events_path)
    assert len(step_shapes(short)) == 80  # one request at a time: its prefill step and its one decode
    with pytest.raises(ReplayError, match="at least 100 steps in each half of the run; this run holds 80"):
        calibrate_steps(short, instance, base, name="mine", engine="test")


@pytest.mark.parametrize(("engine", "note"), [
    ("vLLM 0.15.1", None), ("", None), ("vllm v0.8.0", None),
    ("SGLang 0.4", "fitted on SGLang 0.4, not vLLM: the replay schedules as vLLM v1 does"),
    ("vLLM 0.6.0", "fitted on vLLM 0.6.0, which ran vLLM's v0 engine: the replay schedules as v1 does (0.8 and later)"),
])
def test_a_calibration_fitted_on_another_engine_says_so_in_the_manifest(engine, note):
    from replay.calibration import calibration_record, default_calibration, other_engine

    cal = dataclasses.replace(default_calibration(), engine=engine)
    record = calibration_record(cal, instance_config())
    if note is None:
        assert other_engine(cal) is None and "other_engine" not in record
    else:
        assert record["other_engine"].startswith(note) and record["other_engine"].endswith("may not carry over")
