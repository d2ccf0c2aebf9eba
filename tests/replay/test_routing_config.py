"""The routers' settings: bad values (out of range, NaN, infinite, no scorer at all) are refused where the
config is built, naming the setting, whether given in code, in a router YAML file or on the command line."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from replay.cluster import cluster_config, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.errors import ReplayError
from replay.policies.routing import (
    GieConfig,
    LeastLoadConfig,
    LeastOutstandingTokensConfig,
    SheddingConfig,
    load_router_config,
    make_router,
)
from replay.scenario import Scenario, ServiceClassSpec
from tests.replay.conftest import make_workload

# ------------------------------------------------------------------------------------------- gie weights


def test_gie_weights_all_zero_are_refused_as_no_scorer(tmp_path):
    with pytest.raises(ReplayError, match=r"gie\.queue_weight, gie\.kv_weight and gie\.prefix_weight are all 0") as e:
        GieConfig(queue_weight=0, kv_weight=0, prefix_weight=0)
    assert "no scorer counts" in e.value.message and "positive weight" in (e.value.hint or "")
    path = tmp_path / "gie.yaml"
    path.write_text("queue_weight: 0\nkv_weight: 0\nprefix_weight: 0\n")
    with pytest.raises(ReplayError, match="are all 0"):
        load_router_config("gie", path)


@pytest.mark.parametrize("field", ["queue_weight", "kv_weight", "prefix_weight"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_gie_weights_not_finite_are_refused(field, value):
    with pytest.raises(ReplayError, match=rf"gie\.{field} must be a finite number, not {value!r}"):
        GieConfig(**{field: value})


def test_gie_weights_negative_or_absurd_are_refused_naming_the_weight():
    with pytest.raises(ReplayError, match=r"gie: scorer weights must be non-negative, not gie\.kv_weight = -0\.5"):
        GieConfig(kv_weight=-0.5)
    with pytest.raises(ReplayError, match=r"gie\.prefix_weight must be at most 1e\+15 in size"):
        GieConfig(prefix_weight=1e300)


def test_gie_weights_with_one_scorer_are_accepted():
    config = GieConfig(queue_weight=0, kv_weight=0, prefix_weight=1)
    assert make_router("gie", config).config.prefix_weight == 1


# ------------------------------------------------------------------------------------------- shedding


@pytest.mark.parametrize("value", [1.5, 0.0, -0.5])
def test_kv_threshold_outside_zero_one_is_refused(value):
    with pytest.raises(ReplayError, match=rf"shedding\.kv_threshold must be in \(0, 1\], not {value:g}") as e:
        SheddingConfig(sheddable_classes=("batch",), kv_threshold=value)
    assert "share of an instance's KV pool" in (e.value.hint or "")


def test_kv_threshold_above_one_in_a_router_file_is_refused(tmp_path):
    path = tmp_path / "gie.yaml"
    path.write_text("shedding: {sheddable_classes: [batch], kv_threshold: 1.5}\n")
    with pytest.raises(ReplayError, match=r"shedding\.kv_threshold must be in \(0, 1\], not 1\.5"):
        load_router_config("gie", path)
    path.write_text("shedding: {sheddable_classes: [batch], kv_threshold: 1}\n")
    assert load_router_config("gie", path).shedding.kv_threshold == 1.0


@pytest.mark.parametrize("field", ["queue_threshold", "kv_threshold", "shed_at", "retry_after_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_shedding_settings_not_finite_are_refused(field, value):
    with pytest.raises(ReplayError, match=rf"shedding\.{field} must be a finite number, not {value!r}"):
        SheddingConfig(**{field: value})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("queue_threshold", 0.0, r"shedding\.queue_threshold must be positive, not 0"),
    ("queue_threshold", 1e300, r"shedding\.queue_threshold must be at most 1e\+15 in size"),
    ("shed_at", -1.0, r"shedding\.shed_at must be positive, not -1"),
    ("retry_after_s", -1.0, r"shedding\.retry_after_s must be non-negative, not -1"),
    ("retry_after_s", 1e300, r"shedding\.retry_after_s must be at most 1e\+09 s"),
])
def test_shedding_settings_out_of_range_are_refused_naming_the_setting(field, value, message):
    with pytest.raises(ReplayError, match=message):
        SheddingConfig(**{field: value})


def test_shedding_settings_at_their_edges_are_accepted():
    config = SheddingConfig(sheddable_classes=("batch",), kv_threshold=1.0, retry_after_s=0.0, shed_at=0.5)
    router = make_router("least-load", LeastLoadConfig(shedding=config))
    assert (router.config.shedding.kv_threshold, router.config.shedding.retry_after_s) == (1.0, 0.0)


# ------------------------------------------------------------------------------------------- sheddable classes

TWO_CLASSES = Scenario(name="two", service_classes=(ServiceClassSpec(name="interactive", share=2),
                                                    ServiceClassSpec(name="batch", share=1)))


def test_a_sheddable_class_the_scenario_does_not_define_is_refused():
    from replay.policies.routing import check_sheddable_classes

    config = LeastOutstandingTokensConfig(shedding=SheddingConfig(sheddable_classes=("batch", "bulk")))
    defined = [c.name for c in TWO_CLASSES.service_classes]
    with pytest.raises(ReplayError, match=r"shedding\.sheddable_classes names 'bulk', a class the scenario does not"
                                          ) as e:
        check_sheddable_classes(config, defined)
    assert e.value.hint == "list only defined classes: interactive, batch"
    check_sheddable_classes(LeastOutstandingTokensConfig(shedding=SheddingConfig(sheddable_classes=("batch",))), defined)
    check_sheddable_classes(None, defined)  # no shedding: nothing to check
    check_sheddable_classes(config, [])  # a scenario without classes: the workload's own, unknown here


def test_a_cluster_replay_refuses_a_sheddable_class_the_scenario_does_not_define(tmp_path):
    shedding = SheddingConfig(sheddable_classes=("bulk",), queue_threshold=1.0)
    config = cluster_config(2, instance_config(engine=EngineConfig(max_num_seqs=2)), "least-outstanding-tokens",
                            router_config=LeastOutstandingTokensConfig(shedding=shedding))
    w = make_workload([0] * 4, [500] * 4, [10] * 4, service_class=["batch", "interactive"] * 2)
    with pytest.raises(ReplayError, match=r"shedding\.sheddable_classes names 'bulk'"):
        run_cluster_replay(w, config, scenario=TWO_CLASSES, out_dir=tmp_path)


def test_sheddable_classes_given_as_one_string_are_refused():
    # a string is a sequence of characters: "batch" would shed the classes "b", "a", ... and never "batch"
    with pytest.raises(ReplayError, match=r"shedding\.sheddable_classes must be a list of class names, not the string"):
        SheddingConfig(sheddable_classes="batch")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- command line


def test_bad_router_settings_fail_cleanly_on_the_command_line(tmp_path):
    for name, text, message in (
        ("zero", "queue_weight: 0\nkv_weight: 0\nprefix_weight: 0\n", "gie.prefix_weight are all 0"),
        ("kv", "shedding: {sheddable_classes: [batch], kv_threshold: 1.5}\n", "shedding.kv_threshold must be in (0, 1]"),
        ("retry", "shedding: {sheddable_classes: [batch], retry_after_s: 1e300}\n", "shedding.retry_after_s must be at most"),
        ("class", "shedding: {sheddable_classes: [bulk]}\n", "shedding.sheddable_classes names 'bulk', a class the scenario"),
    ):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "servelens", "replay", "--workload", "azure-conv", "--requests", "20",
                               "--instances", "2", "--router", "gie", "--router-config", str(path),
                               "--out", str(tmp_path / "x")], capture_output=True, text=True, env=dict(os.environ))
        assert proc.returncode == 3 and message in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr)
