"""Deadline admission in a cluster with multi-model residency: 'downgrade' sends a request that would miss its
deadline on its model's instance to an instance serving a smaller qualified model, where it is served as that
model (``DeadlineConfig.qualified_downgrades``)."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from replay.cluster import ClusterConfig, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.errors import ReplayError
from replay.policies import DeadlineConfig
from replay.policies.base import AdmissionDecision
from replay.policies.deadline import QualifiedDowngrade
from replay.policies.tenancy import ClassConfig, Tenancy
from replay.residency import ResidencyConfig, Weights
from tests.replay.conftest import make_workload

MS = 1_000_000
GB = 10**9
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}
SMALL = instance_config(engine=EngineConfig(num_kv_blocks_override=40))
TENANCY = Tenancy(classes=(ClassConfig(name="chat", ttft_objective_s=1.0),), default_class="chat")
BASE = DeadlineConfig(tenancy=TENANCY, prior_output_tokens_high=250, min_history=1000, chunk_from_itl=False)
DOWN = dataclasses.replace(BASE, qualified_downgrades=(QualifiedDowngrade(model="big", to="small"),))
BIG_SMALL = (Weights(name="big", weight_bytes=4 * GB), Weights(name="small", weight_bytes=2 * GB))
PINNED = ResidencyConfig(policy="pinned", catalogue=BIG_SMALL, initial=(("big",), ("small",)))


def _replay(tmp_path, w, policy: DeadlineConfig, mode: str = "fast", name: str = "run", residency=PINNED):
    config = ClusterConfig(instances=(SMALL, SMALL), router="round-robin", residency=residency)
    summary = run_cluster_replay(w, config, policy_name="deadline", policy_config=policy, out_dir=tmp_path / name,
                                 mode=mode, check_invariants=True, **CONSTANT)
    return summary, pq.read_table(summary.events_path).to_pylist()


def _short(instance_id: str | None) -> str | None:
    return None if instance_id is None else instance_id.rsplit("-", 1)[1]


def _of(events, request_id: str) -> list[dict]:
    """A request's arrival, admission decisions, first token and end in the order they happened: by time,
    then its admission decisions by number."""
    rank = {"request_arrived": 0, "admission_decided": 1, "first_token": 2, "request_finished": 3}
    mine = [e for e in events if e["request_id"] == request_id and e["event_type"] in rank]

    def number(e: dict) -> int:
        return int(e["event_id"].rsplit(":admission", 1)[1]) if e["event_type"] == "admission_decided" else 0

    return sorted(mine, key=lambda e: (e["ts_ns"], rank[e["event_type"]], number(e)))


# Two instances of 40 KV blocks (16 tokens each; reservations may use int(40 x (1 - 0.05 - 0.1)) = 34), pinned:
# i0 holds "big", i1 holds "small". r0 and r1 name "big", so the router is offered i0 alone. r0 (100 prompt
# tokens, predicted up to 250 output: ceil(350 / 16) = 22 blocks at completion) is accepted at 0 and runs to
# 2.5 s. r1 (alike) arrives at 100 ms: 22 + 22 = 44 > 34 and nothing has drained, so it has no predicted first
# token on i0. Without qualified downgrades it is rejected (retry-after: the 30 s drain window). With "big" ->
# ("small",), i0's view says i1 serves "small": i0 answers 'downgrade' (target "small"), the cluster routes it to
# i1, whose admission accepts it (idle: 22 blocks fit): its 100-token prompt is one 10 ms step, first token at
# 110 ms (objective 1 s), its 250 tokens done at 110 ms + 249 x 10 ms = 2.6 s, served as "small".
WORKLOAD = make_workload([0, 100 * MS], [100, 100], [250, 250], model=["big", "big"])


def test_a_request_that_would_miss_its_deadline_is_downgraded_and_meets_it(tmp_path):
    off, events = _replay(tmp_path, WORKLOAD, BASE, name="off")
    assert [(e["event_type"], e.get("decision"), e.get("reason"), e.get("retry_after_s"))
            for e in _of(events, "r1")] == [
        ("request_arrived", None, None, None),
        ("admission_decided", "route", "round-robin", None),
        ("admission_decided", "reject", "would miss its deadline", 30.0),
        ("request_finished", None, None, None),
    ]
    assert off.num_downgrades == 0

    summary, events = _replay(tmp_path, WORKLOAD, DOWN)
    i0 = summary.instances[0].instance_id
    mine = _of(events, "r1")
    assert [(e["event_type"], e.get("decision"), _short(e["instance_id"]), e.get("target"), e.get("reason"),
             e["ts_ns"]) for e in mine] == [
        ("request_arrived", None, "i0", None, None, 100 * MS),
        ("admission_decided", "route", "i0", i0, "round-robin", 100 * MS),  # the cluster's router, on arrival
        ("admission_decided", "downgrade", "i0", "small", "would miss its deadline here as big", 100 * MS),  # i0
        ("admission_decided", "route", "i1", summary.instances[1].instance_id,
         f"downgraded to small from {i0} (round-robin)", 100 * MS),  # the cluster, to an instance serving "small"
        ("admission_decided", "accept", "i1", None, None, 100 * MS),  # i1's admission
        ("first_token", None, "i1", None, None, 110 * MS),
        ("request_finished", None, "i1", None, None, 2_600 * MS),
    ]
    assert (mine[-1]["outcome"], mine[-1]["num_output_tokens"]) == ("completed", 250)
    assert {e["model"] for e in mine} == {"big"}  # its events keep the model it named; served as "small" (i1)
    assert summary.num_downgrades == 1 and summary.num_reroutes == 0
    assert [x.num_routed for x in summary.instances] == [2, 1]
    (r0_done,) = [e for e in _of(events, "r0") if e["event_type"] == "request_finished"]
    assert (r0_done["outcome"], _short(r0_done["instance_id"]), r0_done["ts_ns"]) == ("completed", "i0", 2_500 * MS)

    manifest = json.loads(summary.manifest_path.read_text())
    assert manifest["policy"]["config"]["qualified_downgrades"] == [{"model": "big", "to": "small"}]
    assert "qualified_downgrades" not in json.loads(off.manifest_path.read_text())["policy"]["config"]

    ref, ref_events = _replay(tmp_path, WORKLOAD, DOWN, mode="reference", name="ref")
    cols = ("event_type", "request_id", "ts_ns", "decision", "reason", "target", "instance_id", "model", "outcome")

    def table(evs, s):
        return sorted(tuple(str(e.get(c)).replace(s.run_id, "") for c in cols) for e in evs
                      if e["event_type"] in ("request_arrived", "admission_decided", "first_token", "request_finished"))

    assert table(events, summary) == table(ref_events, ref)
    assert ref.num_downgrades == 1


def test_no_downgrade_without_an_instance_serving_the_smaller_model(tmp_path):
    # both instances hold only "big" (pinned): i0's view never offers "small", so r1 is rejected as without the
    # config; a request without a model (the catalogue's first) or with an unqualified one is never downgraded
    both_big = dataclasses.replace(PINNED, initial=(("big",),))
    summary, events = _replay(tmp_path, make_workload([0, 0, 100 * MS], [100] * 3, [250] * 3, model=["big"] * 3),
                              DOWN, residency=both_big, name="big")
    assert summary.num_downgrades == 0
    assert [e["decision"] for e in _of(events, "r2") if e["event_type"] == "admission_decided"] == ["route", "reject"]
    other = dataclasses.replace(BASE, qualified_downgrades=(QualifiedDowngrade(model="other", to="small"),))
    summary, events = _replay(tmp_path, WORKLOAD, other, name="other")
    assert summary.num_downgrades == 0
    assert [e["decision"] for e in _of(events, "r1") if e["event_type"] == "admission_decided"] == ["route", "reject"]
    unnamed = make_workload([0, 100 * MS], [100, 100], [250, 250])  # model None: "big", the catalogue's first
    summary, events = _replay(tmp_path, unnamed, DOWN, name="unnamed")
    assert summary.num_downgrades == 0


def test_a_request_with_an_adapter_is_not_downgraded(tmp_path):
    # an adapter belongs to its base model: the view does not offer a downgrade for a request that names one
    catalogue = BIG_SMALL + (Weights(name="big-lora", weight_bytes=GB // 10, kind="adapter"),)
    residency = dataclasses.replace(PINNED, catalogue=catalogue, max_resident_adapters=1)
    w = make_workload([0, 100 * MS], [100, 100], [250, 250], model=["big", "big"], adapter=[None, "big-lora"])
    summary, events = _replay(tmp_path, w, DOWN, residency=residency)
    assert summary.num_downgrades == 0
    assert [e["decision"] for e in _of(events, "r1") if e["event_type"] == "admission_decided"] == ["route", "reject"]


def test_a_lone_instance_never_downgrades(run):
    out = run(WORKLOAD, policy_name="deadline", policy_config=DOWN, instance=SMALL, **CONSTANT)
    assert [e["decision"] for e in out.of_type("admission_decided")] == ["accept", "reject"]


def test_the_config_and_the_decision_are_checked():
    with pytest.raises(ReplayError, match="another model"):
        QualifiedDowngrade(model="big", to="big")
    with pytest.raises(ReplayError, match="twice"):
        twice = QualifiedDowngrade(model="a", to="b")
        DeadlineConfig(qualified_downgrades=(twice, twice))
    with pytest.raises(ReplayError, match="target model"):
        AdmissionDecision(decision="downgrade")
    with pytest.raises(ReplayError, match="target model"):
        AdmissionDecision(decision="accept", target="small")


def test_qualified_downgrades_load_from_yaml(tmp_path):
    from replay.policies.base import load_policy_config

    path = tmp_path / "deadline.yaml"
    path.write_text("qualified_downgrades:\n  - {model: big, to: small}\n  - {model: big, to: tiny}\n")
    assert load_policy_config("deadline", path).qualified_downgrades == (
        QualifiedDowngrade(model="big", to="small"), QualifiedDowngrade(model="big", to="tiny"))


def test_the_first_qualified_model_an_instance_serves_is_chosen(tmp_path):
    # "big" -> "tiny" is preferred, but no instance holds "tiny": i0's view refuses it and offers "small"
    catalogue = BIG_SMALL + (Weights(name="tiny", weight_bytes=GB),)
    residency = dataclasses.replace(PINNED, catalogue=catalogue)
    policy = dataclasses.replace(BASE, qualified_downgrades=(QualifiedDowngrade(model="big", to="tiny"),
                                                             QualifiedDowngrade(model="big", to="small")))
    summary, events = _replay(tmp_path, WORKLOAD, policy, residency=residency)
    decided = [(e["decision"], e["target"] if e["decision"] == "downgrade" else _short(e["target"]))
               for e in _of(events, "r1") if e["event_type"] == "admission_decided"]
    assert decided == [("route", "i0"), ("downgrade", "small"), ("route", "i1"), ("accept", None)]
    assert summary.num_downgrades == 1


def test_on_demand_downgrades_only_to_an_instance_holding_the_model_now(tmp_path):
    # on-demand: the router is offered both instances. Round-robin sends r0 ("big") to i0, r1 ("small", 10 tokens,
    # 5 out: done at 60 ms) to i1, r2 ("big", like r0) at 100 ms to i0 again, saturated as in the first test. i1
    # holds "small" (its initial set), so r2 is downgraded there and completes by 2.6 s; where i1 holds only "big"
    # (it could load "small", but a downgrade never waits for a load), r2 is rejected.
    w = make_workload([0, 1 * MS, 100 * MS], [100, 10, 100], [250, 5, 250], model=["big", "small", "big"])
    on_demand = dataclasses.replace(PINNED, policy="on-demand")
    summary, events = _replay(tmp_path, w, DOWN, residency=on_demand, name="held")
    decided = [(e["decision"], e["target"] if e["decision"] == "downgrade" else _short(e["target"]))
               for e in _of(events, "r2") if e["event_type"] == "admission_decided"]
    assert decided == [("route", "i0"), ("downgrade", "small"), ("route", "i1"), ("accept", None)]
    (done,) = [e for e in _of(events, "r2") if e["event_type"] == "request_finished"]
    assert (done["outcome"], _short(done["instance_id"]), done["ts_ns"]) == ("completed", "i1", 2_600 * MS)
    assert summary.num_downgrades == 1 and sum(x.num_weight_loads for x in summary.instances) == 0

    big_only = dataclasses.replace(on_demand, initial=(("big",),), model_capacity_bytes=4 * GB)
    w = make_workload([0, 1 * MS, 100 * MS], [100, 10, 100], [250, 5, 250], model=["big", "big", "big"])
    summary, events = _replay(tmp_path, w, DOWN, residency=big_only, name="not-held")
    assert summary.num_downgrades == 0
    assert [e["decision"] for e in _of(events, "r2") if e["event_type"] == "admission_decided"] == ["route", "reject"]
