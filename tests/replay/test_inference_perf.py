"""inference-perf workload configs: both layouts, arrivals per stage, prompts that repeat whole, determinism."""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml

from replay.errors import ReplayError
from replay.inference_perf import (
    inference_perf_workload,
    parse_inference_perf,
    read_inference_perf,
)

NESTED = {  # inference-perf's own layout (its examples/vllm/config-shared-prefix-multi-turn.yml, shortened)
    "load": {"type": "constant", "stages": [{"rate": 20, "duration": 5}, {"rate": 4, "duration": 5}]},
    "api": {"type": "completion"},
    "data": {"type": "shared_prefix", "shared_prefix": {
        "num_unique_system_prompts": 2, "num_users_per_system_prompt": 3, "system_prompt_len": 100,
        "question_len": 250, "output_len": 40, "enable_multi_turn_chat": False}},
}


SHARED = NESTED["data"]["shared_prefix"]


def test_the_fidelity_specs_read_as_transcribed(shared):
    spec = read_inference_perf(shared / "fidelity" / "workloads" / "general.yaml")
    assert (spec.name, spec.arrivals, spec.num_groups, spec.num_prompts_per_group) == ("general", "poisson", 9, 5)
    assert [(s.rate_per_s, s.duration_s) for s in spec.stages] == [(8.0, 600.0), (20.0, 600.0)]
    assert spec.num_requests == 16_800 and spec.chat  # multi-turn chat: templated prompts
    w = inference_perf_workload(spec, seed=1)
    prompts = w["num_prompt_tokens"].to_numpy()
    assert set(prompts) == {100 + 447 + 27}  # 574: the fidelity data's measured prompt length
    assert abs(w.num_rows - 16_800) < 4 * np.sqrt(16_800)  # Poisson counts per stage


def test_constant_arrivals_per_stage_and_prompts_that_repeat_whole():
    spec = parse_inference_perf(NESTED, name="nested")
    assert not spec.chat  # the completion API, no multi-turn chat: no template tokens
    w = inference_perf_workload(spec, seed=0)
    arrivals = w["arrival_ns"].to_numpy()
    # inference-perf's constant timer: exactly rate x duration requests a stage (20 x 5, then 4 x 5), at
    # exponential gaps scaled to the stage, the last at its end: not evenly spaced
    assert w.num_rows == 100 + 20
    assert np.all(np.diff(arrivals) >= 0) and 0 < arrivals[0] < 5_000_000_000
    assert arrivals[99] == 5_000_000_000 and arrivals[100] > 5_000_000_000 and arrivals[-1] == 10_000_000_000
    gaps = np.diff(arrivals[:100]) / 50_000_000  # in units of the mean gap (50 ms)
    assert gaps.std() > 0.5 and gaps.min() < 0.1  # exponential gaps (coefficient of variation 1), not a grid
    ids = w["prefix_block_ids"].to_pylist()
    # prefix blocks of 96 tokens, the engine blocks (16 tokens) the 100-token system prompt fills: a
    # 350-token prompt has 3 full ones, the first shared by the 3 prompts of its group
    assert set(w["prefix_block_size_tokens"].to_numpy()) == {96} and all(len(b) == 3 for b in ids)
    # request i is sent prompt i mod 6: whole prompts repeat, block for block
    assert all(ids[i] == ids[i + 6] for i in range(len(ids) - 6))
    assert len({tuple(b) for b in ids}) == 6
    assert len({b[0] for b in ids}) == 2 and len({tuple(b[1:]) for b in ids}) == 6
    assert set(w["num_output_tokens"].to_numpy()) == {40}


def test_a_measured_mean_output_replaces_the_spec_and_the_table_is_deterministic(shared):
    spec = read_inference_perf(shared / "fidelity" / "workloads" / "codegen.yaml")
    a = inference_perf_workload(spec, seed=3, mean_output_tokens=195.1)
    assert a["num_output_tokens"].to_numpy().mean() == pytest.approx(195.1, abs=1 / a.num_rows + 1e-9)
    assert a.equals(inference_perf_workload(spec, seed=3, mean_output_tokens=195.1))
    assert not a.equals(inference_perf_workload(spec, seed=4, mean_output_tokens=195.1))


def test_length_distributions_and_the_random_generator():
    doc = {"load": {"stages": [{"rate": 50, "duration": 20}]},
           "data": {"type": "random", "input_distribution": {"min": 10, "max": 100, "mean": 50, "std": 10},
                    "output_distribution": {"mean": 150, "std_dev": 60, "min": 1, "max": 4096,
                                            "distribution": "lognormal"}}}
    w = inference_perf_workload(parse_inference_perf(doc), seed=0)
    prompts, outputs = w["num_prompt_tokens"].to_numpy(), w["num_output_tokens"].to_numpy()
    assert prompts.min() >= 10 and prompts.max() <= 100 and abs(prompts.mean() - 50) < 2
    assert abs(outputs.mean() - 150) < 10 and outputs.std() > 40
    ids = [i for b in w["prefix_block_ids"].to_pylist() for i in b]
    assert len(ids) == len(set(ids))  # nothing shared between requests


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"load": {"stages": []}}, "at least one stage"),
        ({"load": {"type": "burst", "stages": [{"rate": 1, "duration": 1}]}}, "load.type 'burst'"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {"num_unique_system_prompts": 2}}},
         "num_users_per_system_prompt"),
        ({"data": {"type": "sharegpt"}}, "data.type 'sharegpt'"),
        ({"load": {"stages": [{"rate": "fast", "duration": 1}]}}, "rate must be a positive number, not 'fast'"),
        ({"load": {"stages": [{"rate": 1, "duration": -5}]}}, "duration must be a positive number, not -5"),
        ({"load": {"stages": [7]}}, "at least one stage"),
        # YAML reads 1e12 as a string; inference-perf takes it as a number, and so the count is refused
        ({"load": {"stages": [{"rate": "1e12", "duration": 1e9}]}}, "ask for 1,000,000,000,000,000,000,000 requests"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {
            "num_unique_system_prompts": 2.5, "num_users_per_system_prompt": 3, "system_prompt_len": 100,
            "question_len": 250, "output_len": 40}}}, "num_unique_system_prompts must be a positive whole number"),
        ({"data": {"type": "random", "input_distribution": {"mean": 50, "distribution": "zipf"},
                   "output_distribution": 10}}, "input_distribution's distribution 'zipf' is not supported"),
        ({"data": {"type": "random", "input_distribution": {"mean": 50, "std": 5, "min": 90, "max": 10},
                   "output_distribution": 10}}, "min <= max"),
        ({"data": {"type": "random", "input_distribution": {"mean": float("nan")}, "output_distribution": 10}},
         "input_distribution's mean must be a positive number, not nan"),
        ({"data": {"type": "random", "input_distribution": 50, "output_distribution": -3}},
         "output_distribution must be a positive whole number, not -3"),
        # lengths are token counts: whole numbers, within the longest context window (10M tokens)
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "question_len": 466.5}}},
         "question_len must be a positive whole number, not 466.5"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "question_len": "466.5"}}},
         "question_len must be a positive whole number, not 466.5"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "question_len": 10_000_001}}},
         "question_len 10,000,001 is more than the 10,000,000 tokens of the longest context window"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "question_len": 10_000_000}}},  # an ArrowMemoryError
         "system_prompt_len + question_len + output_len is 10,000,140 tokens a sequence, more than the 10,000,000"),
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "system_prompt_len": 2e7}}},
         "system_prompt_len 20,000,000 is more than the 10,000,000 tokens"),
        ({"data": {"type": "random", "input_distribution": {"mean": 100, "std": 10, "max": 2**30},
                   "output_distribution": 10}}, "input_distribution's max 1,073,741,824 is more than the 10,000,000"),
        ({"data": {"type": "random", "input_distribution": 10, "output_distribution": {"mean": 2e7, "std": 1}}},
         "output_distribution's mean 20,000,000 is more than the 10,000,000"),
        # as many distinct prompts as the request cap: each is drawn (a MemoryError at 100M)
        ({"data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "num_unique_system_prompts": 100_000_000}}},
         "num_unique_system_prompts x num_users_per_system_prompt (100,000,000 x 3) are distinct prompts, as many "
         "as 300,000,000 requests, more than the 50,000,000"),
        # lengths within bounds, but too many prefix block ids for the requests asked
        ({"load": {"stages": [{"rate": 100, "duration": 600}]},
          "data": {"type": "shared_prefix", "shared_prefix": {**SHARED, "question_len": 1_000_000}}},
         "60,000 requests of 1,000,100 prompt tokens are 625,020,000 prefix block ids of 96 tokens, more than the "
         "50,000,000 a workload built in memory may hold"),
    ],
)
def test_bad_configs_name_what_is_wrong(change, message):
    with pytest.raises(ReplayError, match=re.escape(message)) as err:
        parse_inference_perf({**NESTED, **change})
    assert "Traceback" not in str(err.value)


def test_a_file_that_is_not_a_config(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"hello": 1}))
    with pytest.raises(ReplayError, match="not an inference-perf config"):
        read_inference_perf(path)


def test_a_length_as_a_numeric_string_is_taken_as_inference_perf_takes_it():
    """inference-perf's config parser takes a numeric string for a number (YAML reads 1e3 as one): a whole one is a
    length, a fraction is refused above."""
    spec = parse_inference_perf({**NESTED, "data": {"type": "shared_prefix", "shared_prefix": {
        **SHARED, "question_len": "466", "output_len": "1e3"}}})
    assert (spec.question_tokens.mean, spec.output_tokens.mean) == (466.0, 1000.0)
    assert set(inference_perf_workload(spec)["num_prompt_tokens"].to_numpy()) == {100 + 466}


def test_a_spec_just_within_the_bounds_builds():
    """The refused specs above cost no memory: the bound is checked on the spec, and a spec just within it builds."""
    from replay.inference_perf import MAX_SEQUENCE_TOKENS

    doc = {"load": {"type": "constant", "stages": [{"rate": 2, "duration": 1}]},
           "data": {"type": "random", "input_distribution": MAX_SEQUENCE_TOKENS - 10, "output_distribution": 10}}
    table = inference_perf_workload(parse_inference_perf(doc))
    assert table.num_rows == 2 and set(table["num_prompt_tokens"].to_numpy()) == {MAX_SEQUENCE_TOKENS - 10}


def test_a_distribution_takes_inference_perfs_defaults_and_its_fixed_and_poisson_shapes():
    # inference-perf's Distribution: min 10, max 1024, mean 512, std_dev 200, normal, for a field left out
    def lengths(dist):
        doc = {"load": {"stages": [{"rate": 100, "duration": 20}]},
               "data": {"type": "random", "input_distribution": dist, "output_distribution": 5}}
        return inference_perf_workload(parse_inference_perf(doc), seed=0)["num_prompt_tokens"].to_numpy()

    defaults = lengths({})
    assert defaults.min() >= 10 and defaults.max() <= 1024
    assert abs(defaults.mean() - 512) < 15 and abs(defaults.std() - 200) < 15
    assert set(lengths({"type": "fixed", "mean": 300.7})) == {300}  # the mean, truncated, as inference-perf draws it
    poisson = lengths({"type": "poisson", "mean": 50})
    assert abs(poisson.mean() - 50) < 1 and abs(poisson.var() - 50) < 6  # a Poisson count: variance = mean
