"""The gate's configuration: defaults, the YAML round trip, errors that name the key, model error."""

from __future__ import annotations

import pytest

from replay.compare import metric_info, metric_names
from replay.gate_config import (
    DEFAULT_CONDITIONS,
    DEFAULT_METRICS,
    FIDELITY_FIGURES,
    GateConfig,
    ModelError,
    config_yaml,
    default_config,
    describe_metrics,
    load_config,
    model_errors,
    parse_model_error,
    with_model_error,
)
from replay.metrics import MetricsConfig
from servelens.errors import ConfigError


def test_the_defaults_judge_what_a_release_manager_needs_and_mark_the_rest_informative():
    judged = {s.name for s in DEFAULT_METRICS if not s.informative}
    for family in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_p99_s", "e2e_p50_s", "e2e_p99_s"):
        assert family in judged and next(s for s in DEFAULT_METRICS if s.name == family).per_class
    assert {"goodput_rps", "attainment", "rejected_share", "cancelled_share", "max_queue_s", "past_queue_limit_share",
            "preemptions_per_request", "oscillating_share", "admission_flaps_per_hour", "cost_per_1k_goodput_tokens"} <= judged
    assert {s.name for s in DEFAULT_METRICS if s.informative} == {"ttft_spread_s", "jain_index"}
    assert DEFAULT_CONDITIONS[0].metric == "attainment" and DEFAULT_CONDITIONS[0].at_least == 0.9
    for spec in DEFAULT_METRICS:  # each default judges the direction the metric's meaning calls worse
        assert metric_info(spec.name).worse == spec.bad, spec.name


def test_every_metric_has_a_meaning_a_unit_and_a_worse_direction():
    for name in metric_names(MetricsConfig()):
        info = metric_info(name)
        assert info.meaning and info.unit and info.worse in ("increase", "decrease"), name
    with pytest.raises(KeyError):
        metric_info("p99_latency")


def test_list_metrics_prints_meaning_unit_direction_and_thresholds():
    lines = describe_metrics(default_config())
    (itl,) = [line for line in lines if line.startswith("itl_p99_p99_s ")]
    assert " s " in itl and "increase" in itl and "10% / 25% relative, per class" in itl and "p99 inter-token gap" in itl
    (jain,) = [line for line in lines if line.startswith("jain_index ")]
    assert "informative" in jain and "decrease" in jain
    (queue,) = [line for line in lines if line.startswith("queue_p50_s ")]
    assert "not judged" in queue
    assert lines[-1] == "absolute conditions (the candidate alone; '*' = each class): attainment >= 0.9 (*)"


def test_the_configuration_round_trips_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "gate.yaml"
    path.write_text(config_yaml(default_config()))
    assert load_config(path) == default_config()
    cases = {
        "metrics:\n  - {name: p99_latency, bad: increase, allowed: 0.1, critical: 0.2}\n": "unknown metric 'p99_latency'",
        "metrics:\n  - {name: ttft_p99_s, bad: up, allowed: 0.1, critical: 0.2}\n": "bad must be 'increase' or 'decrease'",
        "metrics:\n  - {name: ttft_p99_s, bad: increase, allowed: 0.3, critical: 0.2}\n": "allowed",
        "windows_s: 60\n": "unknown config key windows_s",
        "min_windows: 0\n": "min_windows",
        "conditions:\n  - {metric: attainment}\n": "give at_least or at_most",
        "conditions:\n  - {metric: attainment, at_least: 0.9, at_most: 0.5}\n": "is above at_most",
        "model_error:\n  - {metric: itl_average, error: 0.05}\n": "unknown metric 'itl_average' in model_error",
        "model_error:\n  - {metric: itl_mean, error: 5}\n": "a fraction",
        "metrics: 5\n": "metrics must be a list",
        "min_windows: many\n": "min_windows has value 'many'",
        "min_windows: 2.7\n": "min_windows must be a whole number, not 2.7",
        "window_s: .nan\n": "window_s must be a finite number, not nan",  # was an internal ValueError
        "window_s: .inf\n": "window_s must be a finite number",             # an OverflowError
        "window_s: 0\n": "window_s above 0",
        "resamples: 1000000000\n": "resamples must be between 100 and 10,000",  # a MemoryError of 7 TiB
        "conditions:\n  - {metric: attainment, at_least: .nan}\n": r"conditions\[0\]\.at_least must be a finite",
        "metrics:\n  - {name: ttft_p99_s, allowed: 0.1, critical: 0.2}\n": r"metrics\[0\]\.bad is required",  # a TypeError
        "seed: -5\n": "seed must be at least 0",  # was numpy's internal "expected non-negative integer"
        "block_windows: -3\n": "block_windows -3 must be from 0",  # "negative dimensions are not allowed"
        "block_windows: 7\n": r"block_windows 7 must be from 0 to min_windows / 5 \(6 with min_windows 30\)",
        "classes:\n  - {name: default, ttft_s: -2.0}\n": "class 'default': ttft_s must be above 0 seconds",
        "classes:\n  - {name: default, e2e_s: 0}\n": "e2e_s must be above 0",
        "tenant_weights:\n  - {tenant: t1, weight: -1}\n": "tenant_weights 't1': weight must be above 0",
        "cost: {accelerator_hour_price: -1}\n": "accelerator_hour_price must be at least 0",  # a cost rise read as a fall
        "cost: {accelerators_per_instance: 0}\n": "accelerators_per_instance at least 1",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    path.write_text("block_windows: 6\n")  # the longest block: 5 of them in 30 windows
    assert load_config(path).block_windows == 6
    path.write_text("score: {pass: 80, marginal: 60}\nconditions: []\n")
    loaded = load_config(path)
    assert loaded.score.pass_ == 80 and loaded.conditions == () and loaded.metrics == DEFAULT_METRICS


def test_a_version_1_file_with_critical_flag_is_refused_with_the_new_rule_and_the_fix(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("version: 1\nmetrics:\n  - {name: itl_p99_p99_s, bad: increase, allowed: 0.1, critical: 0.25, "
                    "critical_flag: false}\n")
    with pytest.raises(ConfigError, match="critical_flag, which version 2 removed") as err:
        load_config(path)
    assert "informative: true" in err.value.hint


def test_model_error_names_a_gate_metric_or_a_fidelity_figure_and_the_largest_error_counts():
    config = GateConfig(model_error=(ModelError(metric="itl_mean", error=0.05), ModelError(metric="itl_p99", error=0.08),
                                     ModelError(metric="ttft_p99_s", error=0.02), ModelError(metric="ttft_p99", error=0.1)))
    errors = model_errors(config)
    assert errors["tpot_p50_s"] == (0.05, "itl_mean")
    assert errors["itl_p99_p99_s"] == (0.08, "itl_p99")  # both figures bound it: the larger
    assert errors["ttft_p99_s"] == (0.02, "ttft_p99_s")  # named directly: it wins over the figure
    assert "goodput_rps" not in errors
    assert set(m for ms in FIDELITY_FIGURES.values() for m in ms) <= set(metric_names(MetricsConfig()))
    assert parse_model_error("itl_mean=0.05") == ModelError(metric="itl_mean", error=0.05)
    for bad in ("itl_mean", "itl_mean=five", "=0.1"):
        with pytest.raises(ConfigError, match="NAME=FRACTION"):
            parse_model_error(bad)


def test_a_fidelity_reports_figures_plug_into_a_configuration_validated():
    config = with_model_error(default_config(), {"itl_mean": 0.05, "ttft_p99": 0.1})
    assert model_errors(config)["itl_p99_p99_s"] == (0.05, "itl_mean") and model_errors(config)["ttft_p99_s"][0] == 0.1
    assert config.metrics == default_config().metrics  # nothing else moves
    with pytest.raises(ConfigError, match="unknown metric 'itl_median' in model_error"):
        with_model_error(default_config(), {"itl_median": 0.05})
