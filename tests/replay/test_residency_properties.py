"""Properties of any replay with multi-model residency (hypothesis): every request ends exactly once and
on the instance it was routed to; no instance ever holds more than its regions allow; a request only
runs once its weights are resident; the fast mode equals the reference mode."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.cluster import ScaleStep, ScalingDelays, cluster_config, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.derive import derive_requests
from replay.residency import ResidencyConfig, Weights, WeightTransfer
from tests.replay.conftest import make_workload

GB = 10**9
CATALOGUE = (Weights(name="a", weight_bytes=2 * GB), Weights(name="b", weight_bytes=3 * GB),
             Weights(name="c", weight_bytes=GB), Weights(name="x", weight_bytes=GB // 100, kind="adapter"),
             Weights(name="y", weight_bytes=GB // 100, kind="adapter"), Weights(name="z", weight_bytes=GB // 100, kind="adapter"))
SIZES = {w.name: w.weight_bytes for w in CATALOGUE}


@st.composite
def cases(draw):
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.integers(0, 300_000_000), min_size=n, max_size=n))
    arrivals = [sum(gaps[: i + 1]) for i in range(n)]
    prompts = draw(st.lists(st.integers(1, 1500), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 120), min_size=n, max_size=n))
    cancels = draw(st.lists(st.one_of(st.none(), st.integers(1, 3_000_000_000)), min_size=n, max_size=n))
    models = draw(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=n, max_size=n))
    adapters = draw(st.lists(st.sampled_from(["x", "y", "z", None]), min_size=n, max_size=n))
    workload = make_workload(arrivals, prompts, outputs, cancel_after_ns=cancels, model=models, adapter=adapters)
    policy = draw(st.sampled_from(["pinned", "on-demand"]))
    capacity = draw(st.sampled_from([3, 4, 5, 6])) * GB
    pinned_sets = [("a",), ("b",), ("c",), ("a", "c"), ("b", "c")]
    initial = tuple(s for s in draw(st.lists(st.sampled_from(pinned_sets), min_size=1, max_size=3))
                    if sum(SIZES[m] for m in s) <= capacity) or (("a",),)
    transfer = WeightTransfer(load_bandwidth_bytes_per_s=draw(st.sampled_from([1e9, 1e10])),
                              load_latency_s=draw(st.sampled_from([0.0, 0.3])), evict_latency_s=0.1,
                              offload_bandwidth_bytes_per_s=draw(st.sampled_from([None, 5e9])))
    residency = ResidencyConfig(policy=policy, catalogue=CATALOGUE, initial=initial, model_capacity_bytes=capacity,
                                max_resident_adapters=draw(st.integers(1, 3)),
                                max_adapters_per_batch=draw(st.sampled_from([None, 1, 2])), transfer=transfer)
    num = draw(st.integers(1, 3))
    blocks = draw(st.sampled_from([None, 300]))
    scaling = draw(st.sampled_from([(), (ScaleStep(at_s=0.5, delta=1),), (ScaleStep(at_s=0.5, delta=1), ScaleStep(at_s=1.5, delta=-1))]))
    config = dataclasses.replace(
        cluster_config(num, instance_config(engine=EngineConfig(num_kv_blocks_override=blocks)),
                       draw(st.sampled_from(["round-robin", "least-outstanding-tokens"])), scaling=scaling,
                       delays=ScalingDelays(startup_s=0.2, weight_load_s=0.1, cache_warm_s=0.0)),
        residency=residency)
    return workload, config, n


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_residency_replays_are_well_formed_and_fast_equals_reference(tmp_path_factory, case):
    workload, config, n = case
    tmp = tmp_path_factory.mktemp("res")
    fast = run_cluster_replay(workload, config, out_dir=tmp / "f", check_invariants=True)
    ref = run_cluster_replay(workload, config, out_dir=tmp / "r", mode="reference", check_invariants=True)
    res = config.residency
    for summary in (fast, ref):
        events = pq.read_table(summary.events_path).to_pylist()
        finished = defaultdict(int)
        for e in events:
            if e["event_type"] == "request_finished":
                finished[e["request_id"]] += 1
        assert sorted(finished) == sorted(f"r{i}" for i in range(n)) and set(finished.values()) == {1}
        for e in events:
            if e["event_type"] == "instance_state":  # never more than the regions hold
                assert sum(SIZES[m] for m in e["resident_models"]) <= res.capacity_bytes
                assert len(e["resident_adapters"]) <= res.max_resident_adapters
        requests = {r["request_id"]: r for r in derive_requests(summary.events_path).to_pylist()}
        for row in workload.to_pylist():
            got = requests[row["request_id"]]
            if got["scheduled_ns"] is None:
                continue
            # it ran: its instance held its model and adapter when it was scheduled
            states = [e for e in events if e["event_type"] == "instance_state" and e["instance_id"] == got["instance_id"]
                      and e["ts_ns"] <= got["scheduled_ns"]]
            models, adapters = set(states[-1]["resident_models"]), set(states[-1]["resident_adapters"])
            assert (row["model"] or "a") in models
            assert row["adapter"] is None or row["adapter"] in adapters
    cols = ["request_id", "instance_id", "arrival_ns", "scheduled_ns", "first_token_ns", "finish_ns", "outcome",
            "num_output_tokens"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"] and row["instance_id"].rsplit("-", 1)[1]
    assert f == r
    assert [(x.num_weight_loads, x.num_weight_evictions, x.num_deferred) for x in fast.instances] == [
        (x.num_weight_loads, x.num_weight_evictions, x.num_deferred) for x in ref.instances]
