"""Deadline admission in a cluster: 'route' (not here) sends a request that would miss its deadline on its
instance to another one the router picks among those it has not tried, within ``max_reroutes``."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from replay.cluster import ClusterConfig, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.errors import ReplayError
from replay.policies import DeadlineConfig
from replay.policies.tenancy import ClassConfig, Tenancy
from tests.replay.conftest import make_workload

MS = 1_000_000
S = 1_000_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}
SMALL = instance_config(engine=EngineConfig(num_kv_blocks_override=40))
TENANCY = Tenancy(classes=(ClassConfig(name="chat", ttft_objective_s=1.0),), default_class="chat")
CONFIG = DeadlineConfig(tenancy=TENANCY, prior_output_tokens_high=250, min_history=1000, chunk_from_itl=False)


def _replay(tmp_path, w, num_instances: int, max_reroutes: int, mode: str = "fast", name: str = "run"):
    config = ClusterConfig(instances=(SMALL,) * num_instances, router="round-robin", max_reroutes=max_reroutes)
    summary = run_cluster_replay(w, config, policy_name="deadline", policy_config=CONFIG, out_dir=tmp_path / name,
                                 mode=mode, check_invariants=True, **CONSTANT)
    return summary, pq.read_table(summary.events_path).to_pylist()


def _of(events, request_id: str, event_type: str) -> list[dict]:
    return [e for e in events if e["request_id"] == request_id and e["event_type"] == event_type]


def _short(instance_id: str | None) -> str | None:
    return None if instance_id is None else instance_id.rsplit("-", 1)[1]


def test_a_request_that_would_miss_its_deadline_goes_to_the_other_instance_and_meets_it(tmp_path):
    # Two instances of 40 KV blocks (16 tokens each); reservations may use int(40 x (1 - 0.05 - 0.1)) = 34.
    # Round-robin sends r0 (100 prompt tokens, predicted up to 250 output: ceil(350 / 16) = 22 blocks at
    # completion) to i0, r1 (10 tokens, 5 out) to i1, and r2 (like r0) at 100 ms to i0 again. There, 22 + 22 =
    # 44 > 34 and nothing has drained yet: no predicted first token, so on i0 alone r2 would be rejected
    # (retry-after: the 30 s drain window). With one re-route allowed, i0 answers 'route' instead; i1 is the
    # only instance not tried, idle since r1 left at 60 ms (6 steps of 10 ms), so it accepts r2: its 100-token
    # prompt is one 10 ms step, first token at 110 ms (TTFT 10 ms, objective 1 s), 250 tokens by 2.6 s.
    w = make_workload([0, 1 * MS, 100 * MS], [100, 10, 100], [250, 5, 250])
    alone, events = _replay(tmp_path, w, 2, 0, name="off")
    assert [(e["decision"], e["reason"], e["retry_after_s"]) for e in _of(events, "r2", "admission_decided")] == [
        ("route", "round-robin", None), ("reject", "would miss its deadline", 30.0)]
    assert alone.num_reroutes == 0

    summary, events = _replay(tmp_path, w, 2, 1)
    decided = _of(events, "r2", "admission_decided")
    assert [(e["decision"], _short(e["instance_id"]), _short(e["target"]), e["reason"]) for e in decided] == [
        ("route", "i0", "i0", "round-robin"),  # the cluster's router, on arrival
        ("route", "i0", None, "would miss its deadline here"),  # i0's admission: not here (no target: it cannot know)
        ("route", "i1", "i1", f"re-routed from {summary.instances[0].instance_id} (round-robin)"),  # the cluster
        ("accept", "i1", None, None),  # i1's admission
    ]
    assert [e["ts_ns"] for e in decided] == [100 * MS] * 4
    assert [_short(e["instance_id"]) for e in _of(events, "r2", "request_arrived")] == ["i0"]  # arrived once
    (first,) = _of(events, "r2", "first_token")
    (done,) = _of(events, "r2", "request_finished")
    assert (_short(first["instance_id"]), first["ts_ns"] - 100 * MS) == ("i1", 10 * MS)
    assert (done["outcome"], _short(done["instance_id"]), done["ts_ns"]) == ("completed", "i1", 2_600 * MS)
    assert summary.num_reroutes == 1 and [x.num_routed for x in summary.instances] == [2, 2]
    import json

    assert json.loads(summary.manifest_path.read_text())["cluster"]["max_reroutes"] == 1
    assert "max_reroutes" not in json.loads(alone.manifest_path.read_text())["cluster"]  # run ids as before

    ref, ref_events = _replay(tmp_path, w, 2, 1, mode="reference", name="ref")
    cols = ("event_type", "request_id", "ts_ns", "decision", "reason", "target")

    def table(evs, s):
        return sorted(tuple(str(e.get(c)).replace(s.run_id, "") for c in cols) for e in evs
                      if e["event_type"] in ("admission_decided", "first_token", "request_finished"))

    assert table(events, summary) == table(ref_events, ref)


def test_re_routes_are_bounded_and_never_return_to_an_instance_tried(tmp_path):
    # Three saturated instances (r0, r1, r2 hold 22 blocks each), then r3 arrives at i0. Each instance in turn
    # finds r3 late; with max_reroutes=k it is sent on k times, each time to an instance it has not tried, and
    # the last one rejects it (it may not route again). With k=5 it still stops after two: no instance is left.
    w = make_workload([0, 0, 0, 100 * MS], [100] * 4, [250] * 4)
    for k, path in ((1, ["i0", "i1"]), (2, ["i0", "i1", "i2"]), (5, ["i0", "i1", "i2"])):
        summary, events = _replay(tmp_path, w, 3, k, name=f"k{k}")
        decided = _of(events, "r3", "admission_decided")
        own = [(e["decision"], _short(e["instance_id"])) for e in decided if e["target"] is None]
        assert own == [("route", x) for x in path[:-1]] + [("reject", path[-1])]
        assert [_short(e["target"]) for e in decided if e["target"] is not None] == path
        assert summary.num_reroutes == len(path) - 1
        (done,) = _of(events, "r3", "request_finished")
        assert (done["outcome"], _short(done["instance_id"])) == ("rejected", path[-1])


def test_a_lone_instance_never_routes(run):
    from replay.policies.base import POLICIES, AdmissionDecision, Policy

    seen = []

    class Probe(Policy):
        name = "test-route-probe"

        def admit(self, view, request):
            seen.append(view.can_route(request))
            return AdmissionDecision(decision="route", reason="not here")

    POLICIES[Probe.name] = Probe
    try:
        with pytest.raises(ReplayError, match="lone instance"):
            run(make_workload([0], [10], [5]), policy_name=Probe.name, **CONSTANT)
    finally:
        del POLICIES[Probe.name]
    assert seen == [False]
    # the deadline policy on one instance rejects where a cluster that re-routes would route
    out = run(make_workload([0, 100 * MS], [100, 100], [250, 250]), policy_name="deadline", policy_config=CONFIG,
              instance=SMALL, **CONSTANT)
    assert [e["decision"] for e in out.of_type("admission_decided")] == ["accept", "reject"]


def test_a_cluster_without_re_routes_never_offers_one(tmp_path):
    # max_reroutes=0 (the default): admission is never offered 'route', even with idle instances around
    w = make_workload([0, 0, 100 * MS], [100, 100, 100], [250, 250, 250])
    _, events = _replay(tmp_path, w, 3, 0)
    assert not [e for e in events if e["event_type"] == "admission_decided" and e["target"] is None
                and e["decision"] == "route"]
    with pytest.raises(ReplayError, match="max_reroutes"):
        ClusterConfig(instances=(SMALL,), max_reroutes=-1)


def test_a_re_routed_request_is_cancelled_where_it_went(tmp_path):
    # as in the first test, r2 is re-routed from i0 to i1; its client cancels 200 ms after arrival: it ends
    # cancelled on i1 at 300 ms, its KV freed there, in both modes alike
    w = make_workload([0, 1 * MS, 100 * MS], [100, 10, 100], [250, 5, 250], cancel_after_ns=[None, None, 200 * MS])
    for mode in ("fast", "reference"):
        _, events = _replay(tmp_path, w, 2, 1, mode=mode, name=mode)
        (done,) = _of(events, "r2", "request_finished")
        assert (done["outcome"], _short(done["instance_id"]), done["ts_ns"]) == ("cancelled", "i1", 300 * MS)
        (cancel,) = _of(events, "r2", "request_cancelled")
        assert _short(cancel["instance_id"]) == "i1"


def test_route_rejects_fewer_on_the_azure_conversation_trace(shared, tmp_path):
    # 2,000 Azure conversation requests at 5x their rate on two llama-2-7b instances (2 x A100 80 GB, half
    # the memory for the engine, as benchmarks/policies.py) behind least-outstanding-tokens, the two-class
    # scenario; deadline admission everywhere. One re-route per request turns part of the rejections into
    # requests served by the other instance; every request still ends once, and fast = reference. (Fewer
    # rejections is not more goodput here, nor fewer rejections in every cluster: docs/policies.md.)
    from replay.abuse import TWO_CLASS_TENANCY, scenario_for
    from replay.config import parse_instance
    from replay.derive import derive_requests
    from replay.traces import read_trace
    from replay.workload import scale_rate

    w = scale_rate(read_trace("azure-conv", shared).slice(0, 2000), 5)
    instance = parse_instance("llama-2-7b@a100-80gx2", EngineConfig(gpu_memory_utilization=0.5))
    cols = ["request_id", "instance_id", "arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns",
            "last_token_ns", "finish_ns", "outcome", "admission_decision", "num_output_tokens"]
    out = {}
    policy = DeadlineConfig(tenancy=TWO_CLASS_TENANCY)
    for k, mode in ((0, "fast"), (1, "fast"), (1, "reference")):
        config = ClusterConfig(instances=(instance, instance), router="least-outstanding-tokens", max_reroutes=k)
        s = run_cluster_replay(w, config, policy_name="deadline", policy_config=policy, mode=mode,
                               scenario=scenario_for(TWO_CLASS_TENANCY), out_dir=tmp_path / f"{k}{mode}")
        rows = derive_requests(s.events_path).select(cols).sort_by("request_id").to_pylist()
        for row in rows:
            row["instance_id"] = _short(row["instance_id"])
        out[k, mode] = (s, rows)
    (off, without), (on, with_route) = out[0, "fast"], out[1, "fast"]
    assert len(without) == len(with_route) == 2000
    rejected = [sum(r["outcome"] == "rejected" for r in rows) for rows in (without, with_route)]
    assert rejected == [151, 124]  # figures of this code, in docs/policies.md
    assert rejected[1] < rejected[0] and on.num_reroutes > 0 and off.num_reroutes == 0
    assert with_route == out[1, "reference"][1]  # fast = reference, re-routes included


def test_a_router_that_sheds_the_re_routed_request_ends_it_rejected(tmp_path):
    # a test router that routes round-robin on arrival but sheds whatever it is asked to re-route (it is then
    # given only the instances not tried: one of two): r2 ends rejected on no instance, with the router's reason
    from replay.policies.routing import ROUTERS, RoundRobinRouter, RouteDecision

    class ShedsReroutes(RoundRobinRouter):
        name = "test-sheds-reroutes"

        def route(self, request, loads):
            if len(loads) == 1:
                return RouteDecision(None, "shed on re-route", True, 2.0)
            return super().route(request, loads)

    ROUTERS[ShedsReroutes.name] = ShedsReroutes
    try:
        w = make_workload([0, 1 * MS, 100 * MS], [100, 10, 100], [250, 5, 250])
        config = ClusterConfig(instances=(SMALL, SMALL), router=ShedsReroutes.name, max_reroutes=1)
        summary = run_cluster_replay(w, config, policy_name="deadline", policy_config=CONFIG, out_dir=tmp_path,
                                     check_invariants=True, **CONSTANT)
    finally:
        del ROUTERS[ShedsReroutes.name]
    events = pq.read_table(summary.events_path).to_pylist()
    decided = _of(events, "r2", "admission_decided")
    assert [(e["decision"], _short(e["instance_id"]), e["retry_after_s"]) for e in decided] == [
        ("route", "i0", None), ("route", "i0", None), ("reject", None, 2.0)]
    (done,) = _of(events, "r2", "request_finished")
    assert (done["outcome"], done["ts_ns"]) == ("rejected", 100 * MS)
    assert summary.num_shed == 1 and summary.num_reroutes == 0
    assert [x.num_routed for x in summary.instances] == [2, 1]
