"""Policy config files: the scenario's tenancy kept when a file gives none, duplicate JSON keys and
non-string YAML keys refused, and absurd-but-typed numbers refused by key (not internal errors)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.errors import ReplayError
from replay.policies import load_policy_config
from replay.policies.tenancy import ClassConfig, Tenancy, TenantConfig
from replay.traces import read_trace
from servelens.errors import ConfigError
from servelens.settings import read_document

SCENARIO = Tenancy(classes=(ClassConfig(name="gold", ttft_objective_s=1.0), ClassConfig(name="bronze")),
                   tenants=(TenantConfig(name="t1", service_class="gold"),), default_class="bronze")


@pytest.fixture(scope="module")
def workload(shared, tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "azure-50.parquet"
    pq.write_table(read_trace("azure-conv", shared).slice(0, 50), path)
    return path


def test_a_file_without_tenancy_keeps_the_scenarios(tmp_path):
    path = tmp_path / "deadline.yaml"
    path.write_text("overload_margin: 0.2\n")
    config = load_policy_config("deadline", path, SCENARIO)
    assert config.tenancy == SCENARIO and config.overload_margin == 0.2
    assert load_policy_config("deadline", path).tenancy == Tenancy()  # no scenario given: the policy's default
    assert load_policy_config("fcfs", _write(tmp_path, "f.yaml", ""), SCENARIO).long_prefill_token_threshold == 0


def test_a_file_with_tenancy_wins(tmp_path):
    path = _write(tmp_path, "deadline.yaml", "tenancy: {classes: [{name: solo}], default_class: solo}\n")
    assert [c.name for c in load_policy_config("deadline", path, SCENARIO).tenancy.classes] == ["solo"]


def test_replay_with_a_file_restating_a_default_keeps_the_scenario_tenancy(workload, tmp_path):
    from servelens.cli import cli

    path = _write(tmp_path, "dl.yaml", "overload_margin: 0.1\n")
    runs = {}
    for name, flags in (("none", []), ("file", ["--policy-config", str(path)])):
        done = CliRunner().invoke(cli, ["replay", "--workload", str(workload), "--policy", "deadline", *flags,
                                        "--out", str(tmp_path / name)])
        assert done.exit_code == 0, done.output
        runs[name] = json.loads((tmp_path / name / "manifest.json").read_text())["policy"]["config"]
    assert runs["file"] == runs["none"]
    assert [c["name"] for c in runs["file"]["tenancy"]["classes"]] == ["interactive", "batch"]


def test_json_duplicate_keys_are_refused(tmp_path):
    path = _write(tmp_path, "p.json", '{"aging_s": 1, "nested": {"a": 1, "a": 2}}')
    with pytest.raises(ConfigError, match=r"policy configuration .*p\.json is not valid JSON: the key 'a' is given twice"):
        read_document(path, "policy configuration")
    assert read_document(_write(tmp_path, "ok.json", '{"a": 1, "b": {"a": 2}}'), "x") == {"a": 1, "b": {"a": 2}}


def test_yaml_keys_that_are_not_strings_are_refused(tmp_path):
    path = _write(tmp_path, "mixed.yaml", "1: 2\nfoo: 3\n")
    with pytest.raises(ConfigError, match=r"policy configuration .*mixed\.yaml has the key 1, which is not a name"):
        load_policy_config("fcfs", path)
    with pytest.raises(ConfigError, match=r"has the key None"):
        read_document(_write(tmp_path, "n.yaml", "a: [{null: 1}]\n"), "policy configuration")


@pytest.mark.parametrize(
    ("policy", "text", "message"),
    [
        ("decode-first", "max_prefilling: 100000000000000000000000000000",
         "decode-first.max_prefilling must be at most 2**53 (9,007,199,254,740,992) in size, not 1e+29"),
        ("priority", "aging_s: 1.0e+300", "priority.aging_s must be at most 1e+09 s (about 30 years), not 1e+300"),
        ("priority", "tenancy: {classes: [{name: default, max_queue_s: 1.0e+300}]}",
         "tenancy class 'default'.max_queue_s must be at most 1e+09 s (about 30 years), not 1e+300"),
        ("sarathi", "default_itl_objective_s: 1.0e+300",
         "sarathi.default_itl_objective_s must be at most 1e+09 s (about 30 years), not 1e+300"),
        ("deadline", "tenancy: {classes: [{name: default, ttft_objective_s: 1.0e+300}]}",
         "tenancy class 'default'.ttft_objective_s must be at most 1e+09 s (about 30 years), not 1e+300"),
        ("vtc", "tenancy: {tenants: [{name: chat-a, service_class: default, weight: 1.0e-300}]}",
         "tenancy tenant 'chat-a'.weight must be at least 1e-06, not 1e-300"),
        ("deadline-vtc", "tenancy: {tenants: [{name: chat-a, service_class: default, weight: 1.0e-7}]}",
         "tenancy tenant 'chat-a'.weight must be at least 1e-06, not 1e-07"),
        ("deadline", "prior_output_tokens_high: 100000000000000000000000000000",
         "deadline.prior_output_tokens_high must be at most 2**53 (9,007,199,254,740,992) in size, not 1e+29"),
    ],
)
def test_absurd_numbers_are_refused_by_key(tmp_path, policy, text, message):
    with pytest.raises(ReplayError) as caught:
        load_policy_config(policy, _write(tmp_path, "p.yaml", text + "\n"))
    assert caught.value.message == message


def test_nan_and_infinities_built_in_the_library_are_refused_by_key():
    # a YAML file's .nan is refused by the reader; a config built in Python meets the same check
    import math

    from replay.policies.priority import PriorityConfig
    from replay.policies.sarathi import SarathiConfig

    for build, key in ((lambda v: PriorityConfig(aging_s=v), "priority.aging_s"),
                       (lambda v: SarathiConfig(default_itl_objective_s=v), "sarathi.default_itl_objective_s"),
                       (lambda v: TenantConfig(name="t", service_class="gold", weight=v), "tenancy tenant 't'.weight")):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ReplayError) as caught:
                build(value)
            assert caught.value.message == f"{key} must be a finite number, not {value!r}"


@pytest.mark.parametrize(
    ("policy", "text"),
    [("priority", "aging_s: 1.0e+9"), ("decode-first", "max_prefilling: 9007199254740992"),
     ("vtc", "tenancy: {tenants: [{name: chat-a, service_class: default, weight: 1.0e-6}]}"),
     ("deadline-vtc", "tenancy: {tenants: [{name: chat-a, service_class: default, weight: 1.0e-6}]}")],
)
def test_the_bounds_themselves_replay(workload, tmp_path, policy, text):
    from servelens.cli import cli

    path = _write(tmp_path, "p.yaml", text + "\n")
    done = CliRunner().invoke(cli, ["replay", "--workload", str(workload), "--policy", policy,
                                    "--policy-config", str(path), "--out", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output


def _write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return path
