"""Policy settings from YAML (library and `servelens replay --policy-config`), recorded in the manifest."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from replay.errors import ReplayError
from replay.policies import DeadlineConfig, load_policy_config
from servelens.errors import ConfigError
from tests.replay.conftest import make_workload

YAML = """\
overload_margin: 0.2
tenancy:
  default_class: batch
  classes:
    - {name: interactive, priority: 0, ttft_objective_s: 1.0, itl_objective_s: 0.15}
    - {name: batch, priority: 1, e2e_objective_s: 120, sheddable: true}
  tenants:
    - {name: chat-a, service_class: interactive, max_concurrent_requests: 4}
"""


def test_load_policy_config_builds_the_typed_config(tmp_path):
    path = tmp_path / "deadline.yaml"
    path.write_text(YAML)
    config = load_policy_config("deadline", path)
    assert isinstance(config, DeadlineConfig) and config.overload_margin == 0.2
    assert [c.name for c in config.tenancy.classes] == ["interactive", "batch"]
    assert config.tenancy.tenants[0].max_concurrent_requests == 4 and config.tenancy.classes[1].sheddable
    path.write_text("overload_margn: 0.2\n")
    with pytest.raises(ConfigError, match="unknown config key overload_margn"):
        load_policy_config("deadline", path)
    with pytest.raises(ReplayError, match="unknown policy"):
        load_policy_config("lottery", path)


@pytest.mark.parametrize(("policy", "text", "message"), [
    ("deadline", "step_time_share: 0\n", r"deadline: step_time_share must be in \(0, 1\]"),
    ("deadline", "min_chunk_tokens: -5\n", "deadline: min_chunk_tokens must be at least 1"),
    ("deadline", "input_token_weight: -1\n", "deadline: token weights must be non-negative"),
    ("deadline", "prior_output_tokens_low: -3\n", "need 0 <= prior_output_tokens_low <= prior_output_tokens_high"),
    ("deadline", "prior_output_tokens_low: 600\n", "need 0 <= prior_output_tokens_low"),  # above the default high, 512
    ("sarathi", "default_itl_objective_s: 0\n", "default_itl_objective_s must be positive"),
    ("fcfs", "long_prefill_token_threshold: -1\n", "long_prefill_token_threshold must be >= 0"),
    ("prefill-first", "long_prefill_token_threshold: -1\n", "long_prefill_token_threshold must be >= 0"),
])
def test_settings_the_policies_cannot_mean_are_refused_by_name(tmp_path, policy, text, message):
    """Each of these replayed silently before (a negative token weight ranks the heaviest tenant first)."""
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ReplayError, match=message):
        load_policy_config(policy, path)


def test_a_negative_router_weight_is_refused(tmp_path):
    from replay.policies.routing import load_router_config

    path = tmp_path / "gie.yaml"
    path.write_text("prefix_weight: -3\n")
    with pytest.raises(ReplayError, match="gie: scorer weights must be non-negative"):
        load_router_config("gie", path)
    path.write_text("prefix_weight: 0\n")
    assert load_router_config("gie", path).prefix_weight == 0.0


def test_cli_replays_with_a_policy_config(tmp_path):
    workload = tmp_path / "w.parquet"
    pq.write_table(make_workload([0, 1_000_000], [10, 20], [3, 4], tenant=["chat-a", "x"]), workload)
    config = tmp_path / "deadline.yaml"
    config.write_text(YAML)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "servelens", "replay", "--workload", str(workload), "--policy", "deadline",
         "--policy-config", str(config), "--cost-model", "constant", "--out", str(out)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["policy"]["name"] == "deadline"
    assert manifest["policy"]["config"]["overload_margin"] == 0.2
    assert manifest["policy"]["config"]["tenancy"]["tenants"][0]["name"] == "chat-a"
