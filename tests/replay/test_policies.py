"""The policy seam: a registry by name, FCFS with vLLM v1 semantics, and new policies without engine changes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest

from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.errors import ReplayError
from replay.policies import POLICIES, AdmissionDecision, FcfsConfig, Policy, make_policy, register
from replay.request import Request
from replay.views import EngineView, RequestView
from schemas.types import doc
from tests.replay.conftest import make_workload

MS = 1_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}


def test_registry_by_name_with_typed_configs():
    assert POLICIES["fcfs"].config_type is FcfsConfig
    p = make_policy("fcfs", FcfsConfig(long_prefill_token_threshold=256))
    assert p.config.long_prefill_token_threshold == 256
    with pytest.raises(ReplayError, match="unknown policy 'lottery'") as err:
        make_policy("lottery")
    assert "fcfs" in err.value.hint
    with pytest.raises(ReplayError, match="takes a FcfsConfig"):
        make_policy("fcfs", object())
    with pytest.raises(ReplayError, match="not supported by an instance's admission policy"):
        AdmissionDecision(decision="shuffle")
    with pytest.raises(ReplayError, match="names its target model"):
        AdmissionDecision(decision="downgrade")  # to which model?


def test_one_registry_type_serves_policies_routers_and_autoscalers():
    from replay.policies.autoscale import AUTOSCALERS
    from replay.policies.base import Registry
    from replay.policies.routing import ROUTERS

    assert all(isinstance(r, Registry) for r in (POLICIES, ROUTERS, AUTOSCALERS))
    assert (POLICIES.kind, ROUTERS.kind, AUTOSCALERS.kind) == ("policy", "router", "autoscaler")
    widgets = Registry("widget")

    class A:
        name, config_type = "a", FcfsConfig

    class B:
        name, config_type = "a", FcfsConfig

    class Nameless:
        name = ""

    assert widgets.register(A) is A and widgets.register(A) is A  # registering the same class again is fine
    with pytest.raises(TypeError, match="widget name 'a' is taken by A"):
        widgets.register(B)
    with pytest.raises(TypeError, match="widget Nameless needs a name"):
        widgets.register(Nameless)
    assert widgets.lookup("a") is A and widgets.checked("a", None) is A and widgets.checked("a", FcfsConfig()) is A
    with pytest.raises(ReplayError, match="unknown widget 'b'") as err:
        widgets.lookup("b")
    assert "a" in err.value.hint
    with pytest.raises(ReplayError, match="widget 'a' takes a FcfsConfig, not a object"):
        widgets.checked("a", object())


def test_views_are_read_only_and_hide_the_true_output_length():
    r = Request(0, "secret", 0, 12, num_branches=1)
    view = RequestView(r)
    public = {name for name in dir(view) if not name.startswith("_")}
    assert "num_output_tokens" in public and not public & {"target", "num_target_tokens", "true_output_tokens"}
    with pytest.raises(AttributeError):
        view.num_prompt_tokens = 5  # type: ignore[misc]
    # the request state itself carries no output length at all: the engine keeps it apart
    assert not any("target" in slot for slot in Request.__slots__)


def test_long_prefill_threshold_caps_chunks(run):
    w = make_workload([0], [1000], [1])
    out = run(w, policy_config=FcfsConfig(long_prefill_token_threshold=300), **CONSTANT)
    assert [s["num_prefill_tokens"] for s in sorted(out.of_type("step_executed"), key=lambda s: s["start_ns"])] == [300, 300, 300, 100]


# ---------------------------------------------------------------------------------------------- new policies


@dataclass(frozen=True, slots=True, kw_only=True)
class GateConfig:
    """Settings of the test admission gate."""

    max_prompt_tokens: int = doc("Reject longer prompts.", 500)
    hold_until_ns: int = doc("Queue class 'batch' requests until this time.", 40 * MS)


@register
class GatePolicy(Policy):
    """Rejects long prompts with retry-after, holds 'batch' requests for a while: a deadline-admission shape."""

    name = "test-gate"
    config_type = GateConfig

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        if request.num_prompt_tokens > self.config.max_prompt_tokens:
            return AdmissionDecision(decision="reject", reason="prompt too long", retry_after_s=2.5,
                                     predicted_output_tokens_low=10, predicted_output_tokens_high=90)
        if request.service_class == "batch" and view.now_ns < self.config.hold_until_ns:
            wait_s = (self.config.hold_until_ns - view.now_ns) / 1e9
            return AdmissionDecision(decision="queue", reason="batch window closed", retry_after_s=wait_s)
        return AdmissionDecision(decision="accept", predicted_output_tokens_low=1, predicted_output_tokens_high=50)


@register
class OldestVictimPolicy(Policy):
    """Preempts the oldest candidate instead of the newest, and orders waiting by shortest prompt."""

    name = "test-oldest-victim"
    config_type = FcfsConfig

    def victim(self, view: EngineView, candidates: Sequence[RequestView]) -> RequestView:
        return min(candidates, key=lambda r: r.arrival_ns)

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_ns))


@register
class StepCounterPolicy(Policy):
    """Counts decoded tokens through observe_step and bounds fast-mode runs to 3 steps."""

    name = "test-counter"
    config_type = FcfsConfig

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.tokens = 0
        self.steps = 0

    def run_horizon_steps(self, view: EngineView) -> int | None:
        return 3

    def observe_step(self, view, requests, num_tokens, num_steps) -> None:
        self.tokens += sum(num_tokens) * num_steps
        self.steps += num_steps


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_admission_can_accept_queue_and_reject_with_retry_after(run, mode):
    w = make_workload([0, 1 * MS, 2 * MS], [100, 900, 100], [3, 3, 3], service_class=["interactive", "interactive", "batch"])
    out = run(w, policy_name="test-gate", mode=mode, **CONSTANT)
    decisions = {}
    for e in sorted(out.of_type("admission_decided"), key=lambda e: e["ts_ns"]):
        decisions.setdefault(e["request_id"], []).append(e)
    assert [d["decision"] for d in decisions["r0"]] == ["accept"]
    r1 = decisions["r1"][0]
    assert (r1["decision"], r1["retry_after_s"], r1["predicted_output_tokens_low"], r1["predicted_output_tokens_high"],
            r1["reason"]) == ("reject", 2.5, 10, 90, "prompt too long")
    assert out.row("r1")["outcome"] == "rejected" and out.row("r1")["scheduled_ns"] is None
    # r2 is held ("queue") and offered again at each scheduling point (10, 20, 30 ms: still closed,
    # no new event) and when its retry-after says (40 ms, the engine idle since r0 ended at 30 ms)
    assert [d["decision"] for d in decisions["r2"]] == ["queue", "accept"]
    assert decisions["r2"][1]["ts_ns"] == 40 * MS
    assert out.row("r2")["admission_decision"] == "accept" and out.row("r2")["num_admission_decisions"] == 2
    assert out.row("r2")["scheduled_ns"] >= 40 * MS and out.row("r2")["outcome"] == "completed"


def test_a_custom_victim_and_order_change_who_is_preempted(run):
    w = make_workload([0, 1 * MS], [60, 60], [100, 100])
    kwargs = dict(instance=instance_config(engine=EngineConfig(num_kv_blocks_override=12)), check_invariants=True, **CONSTANT)
    fcfs = run(w, **kwargs)
    oldest = run(w, policy_name="test-oldest-victim", **kwargs)
    assert fcfs.row("r0")["num_preemptions"] == 0 and fcfs.row("r1")["num_preemptions"] > 0
    assert oldest.row("r0")["num_preemptions"] > 0


def test_step_feedback_and_run_horizon(run):
    w = make_workload([0], [50], [20])
    out = run(w, policy_name="test-counter", **CONSTANT)
    steps = out.of_type("step_executed")
    assert max(s["num_steps"] for s in steps) == 3  # the policy's horizon bounds coalescing
    assert sum(s["num_steps"] for s in steps) == 20 and out.row("r0")["num_output_tokens"] == 20


@register
class ConfiglessPolicy(Policy):
    """A policy that declares no config of its own."""

    name = "test-configless"


def test_a_configless_policy_gets_an_empty_config_and_a_serializable_manifest(run):
    import json

    from replay.policies import NoConfig

    assert isinstance(make_policy("test-configless").config, NoConfig)
    out = run(make_workload([0], [10], [2]), policy_name="test-configless", **CONSTANT)
    manifest = json.loads(out.summary.manifest_path.read_text())
    assert manifest["policy"] == {"name": "test-configless", "config": {}}


def test_a_degrade_decision_carries_its_cap():
    assert AdmissionDecision(decision="degrade", max_output_tokens=64).max_output_tokens == 64
    with pytest.raises(ReplayError, match="carries max_output_tokens"):
        AdmissionDecision(decision="degrade")
    with pytest.raises(ReplayError, match="carries max_output_tokens"):
        AdmissionDecision(decision="accept", max_output_tokens=64)
