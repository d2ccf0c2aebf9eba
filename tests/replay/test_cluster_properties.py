"""Properties of any cluster replay (hypothesis): every request ends once, is routed once to a live
instance, and is served by that instance alone; instance lifecycles are well formed; the fast mode
equals the reference mode."""

from __future__ import annotations

from collections import defaultdict

import pyarrow.parquet as pq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replay.cluster import ScaleStep, ScalingDelays, cluster_config, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.derive import derive_requests
from replay.errors import ReplayError
from replay.policies.routing import (
    GieConfig,
    LeastLoadConfig,
    LeastOutstandingTokensConfig,
    RoundRobinConfig,
    SheddingConfig,
)
from tests.replay.conftest import make_workload

ROUTER_CONFIGS = {
    "round-robin": RoundRobinConfig,
    "least-outstanding-tokens": LeastOutstandingTokensConfig,
    "least-load": LeastLoadConfig,
    "gie": GieConfig,
}
LIFECYCLES = {  # what an instance may report, in order
    ("ready", "stopped"),
    ("ready", "draining", "stopped"),
    ("starting", "ready", "stopped"),
    ("starting", "ready", "draining", "stopped"),
    ("starting", "stopped"),
}


@st.composite
def requests(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.integers(0, 60_000_000), min_size=n, max_size=n))
    arrivals = [sum(gaps[: i + 1]) for i in range(n)]
    prompts = draw(st.lists(st.integers(1, 2500), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    cancels = draw(st.lists(st.one_of(st.none(), st.integers(1, 400_000_000)), min_size=n, max_size=n))
    branches = draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=n, max_size=n))
    classes = draw(st.lists(st.sampled_from([None, "batch"]), min_size=n, max_size=n))
    # prompts sharing prefixes: ids from a small alphabet, one per 64-token trace block
    blocks = [draw(st.lists(st.integers(0, 3), max_size=p // 64)) for p in prompts]
    return make_workload(arrivals, prompts, outputs, cancel_after_ns=cancels, num_branches=branches,
                         service_class=classes, prefix_block_ids=blocks, prefix_block_size_tokens=[64] * n)


@st.composite
def clusters(draw):
    router = draw(st.sampled_from(sorted(ROUTER_CONFIGS)))
    shedding = draw(st.one_of(st.none(), st.just(SheddingConfig(sheddable_classes=("batch",), queue_threshold=1.0))))
    steps = draw(st.lists(st.tuples(st.integers(0, 1500), st.sampled_from([-2, -1, 1, 2])), max_size=3))
    steps = [ScaleStep(at_s=at / 1000, delta=d) for at, d in sorted(steps)]
    blocks = draw(st.integers(300, 1500))
    instance = instance_config(engine=EngineConfig(num_kv_blocks_override=blocks, max_num_seqs=draw(st.sampled_from([4, 128]))))
    delays = ScalingDelays(startup_s=draw(st.sampled_from([0.0, 0.05, 0.3])), weight_load_s=0.1, cache_warm_s=0.05)
    try:
        return cluster_config(draw(st.integers(1, 4)), instance, router,
                              router_config=ROUTER_CONFIGS[router](shedding=shedding), scaling=steps, delays=delays)
    except ReplayError:
        assume(False)


def _check(events: list[dict], workload_ids: set[str]) -> None:
    by_type: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by_type[e["event_type"]].append(e)
    finished = [e["request_id"] for e in by_type["request_finished"]]
    assert sorted(finished) == sorted(workload_ids)  # every request ends exactly once

    states: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for e in by_type["instance_state"]:
        states[e["instance_id"]].append((e["ts_ns"], e["state"]))
    for seq in states.values():
        assert tuple(s for _, s in seq) in LIFECYCLES, seq
        assert [t for t, _ in seq] == sorted(t for t, _ in seq)

    def live(instance: str, ts: int) -> bool:
        seq = dict((s, t) for t, s in states[instance])
        return seq["ready"] <= ts and ts < seq.get("draining", seq["stopped"]) and ts <= seq["stopped"]

    target: dict[str, str | None] = {}
    for e in by_type["admission_decided"]:
        if e["decision"] == "route":
            assert e["request_id"] not in target  # routed once
            assert live(e["target"], e["ts_ns"]), e  # to an instance that took traffic then
            target[e["request_id"]] = e["target"]
        elif e["instance_id"] is None:  # shed by the router: no instance ever sees it
            assert e["decision"] == "reject" and e["request_id"] not in target
            target[e["request_id"]] = None
    assert set(target) == workload_ids
    for e in events:  # served by its instance alone
        if e["request_id"] is not None and not (e["event_type"] == "admission_decided" and e["decision"] == "route"):
            assert e["instance_id"] == target[e["request_id"]], e
    for e in by_type["step_executed"]:
        assert all(target[r] == e["instance_id"] for r in e["request_ids"]), e
    # every output token of a request comes from its instance, and adds up to what it finished with
    produced: dict[str, int] = defaultdict(int)
    branches = {e["request_id"]: e["num_branches"] for e in by_type["request_arrived"]}
    for e in by_type["first_token"]:
        produced[e["request_id"]] += branches[e["request_id"]]
    for e in by_type["tokens_delivered"]:
        produced[e["request_id"]] += e["num_tokens"]
    for e in by_type["request_finished"]:
        assert produced[e["request_id"]] == e["num_output_tokens"], e


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(workload=requests(), config=clusters())
def test_any_cluster_replay_routes_serves_and_ends_each_request_once(tmp_path_factory, workload, config):
    out = tmp_path_factory.mktemp("cluster")
    ids = set(workload["request_id"].to_pylist())
    fast = run_cluster_replay(workload, config, out_dir=out / "fast", check_invariants=True, chunk_rows=64)
    ref = run_cluster_replay(workload, config, out_dir=out / "ref", mode="reference", check_invariants=True)
    for summary in (fast, ref):
        _check(pq.read_table(summary.events_path).to_pylist(), ids)
    cols = ["request_id", "arrival_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "finish_ns", "outcome",
            "num_output_tokens", "num_preemptions"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    assert f == r
