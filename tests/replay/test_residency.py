"""Multi-model residency: memory regions, pinned routing, on-demand loads with LRU eviction, adapter slots, phases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.cluster import ClusterConfig, ScaleStep, ScalingDelays, cluster_config, run_cluster_replay
from replay.config import instance_config
from replay.derive import derive_requests
from replay.errors import ReplayError
from replay.residency import ResidencyConfig, Weights, WeightTransfer, lora_weights, model_weights, sized_instance
from replay.scenario import Scenario, alternating_models, apply_scenario
from replay.traces import WORKLOAD_SCHEMA
from tests.replay.conftest import make_workload

S = 1_000_000_000
GB = 10**9

# 2 GB at 1 GB/s plus 1 s: a load takes 3 s; an eviction 0.5 s
SLOW = WeightTransfer(load_bandwidth_bytes_per_s=1e9, load_latency_s=1.0, evict_latency_s=0.5)
FREE = WeightTransfer(load_bandwidth_bytes_per_s=1e18, load_latency_s=0.0, evict_latency_s=0.0)
AB = (Weights(name="a", weight_bytes=2 * GB), Weights(name="b", weight_bytes=2 * GB))


def _cluster(n: int, residency: ResidencyConfig, **kwargs) -> ClusterConfig:
    return dataclasses.replace(cluster_config(n, **kwargs), residency=residency)


def _events(summary) -> list[dict]:
    return pq.read_table(summary.events_path).to_pylist()


def _requests(summary) -> dict[str, dict]:
    return {r["request_id"]: r for r in derive_requests(summary.events_path).to_pylist()}


def _states(summary) -> list[tuple]:
    return [(e["ts_ns"], e["instance_id"].rsplit("-", 1)[1], e["state"], e["resident_models"], e["resident_adapters"],
             e["event_id"].rsplit(":state:", 1)[1]) for e in _events(summary) if e["event_type"] == "instance_state"]


# ---------------------------------------------------------------------------------------------- costs and memory


def test_transfer_costs_by_hand():
    w = Weights(name="a", weight_bytes=2 * GB)
    assert SLOW.load_ns(w, from_host=False) == 3 * S
    assert SLOW.evict_ns(w) == S // 2
    host = WeightTransfer(load_bandwidth_bytes_per_s=1e9, load_latency_s=1.0, evict_latency_s=0.5,
                          offload_bandwidth_bytes_per_s=4e9)
    assert host.evict_ns(w) == S  # 0.5 s + 2 GB / 4 GB/s
    assert host.load_ns(w, from_host=True) == 1.5 * S  # 1 s + 2 GB / 4 GB/s
    assert host.load_ns(w, from_host=False) == 3 * S


def test_weights_of_catalogue_models_quantized_variants_and_adapters():
    full = model_weights("llama-3-8b")
    assert full.weight_bytes == 8_030_261_248 * 2  # the published 8.03B parameters in bf16
    fp8 = model_weights("llama-3-8b", bytes_per_param=1)
    assert (fp8.name, fp8.weight_bytes) == ("llama-3-8b-8bit", 8_030_261_248)
    # rank 8 on Q, K, V, O of 32 layers: 8 x ((4096 + 4096) + 2 x (4096 + 1024) + (4096 + 4096)) x 32 x 2 bytes
    assert lora_weights("x", "llama-3-8b", 8).weight_bytes == 8 * 26_624 * 32 * 2
    with pytest.raises(ReplayError, match="model"):
        model_weights("gpt-17")


def test_the_kv_pool_is_what_the_weight_regions_leave():
    inst = instance_config("llama-3-8b", "h100-sxm")
    one = ResidencyConfig(catalogue=(model_weights("llama-3-8b"), model_weights("mistral-7b")))
    assert sized_instance(inst, one).num_kv_blocks == inst.num_kv_blocks  # a region of one llama-3-8b: as before
    both = dataclasses.replace(one, initial=(("llama-3-8b", "mistral-7b"),))
    block_bytes = inst.model.kv_bytes_per_token * 16
    lost = inst.num_kv_blocks - sized_instance(inst, both).num_kv_blocks
    assert lost in (model_weights("mistral-7b").weight_bytes // block_bytes,
                    model_weights("mistral-7b").weight_bytes // block_bytes + 1)
    assert sized_instance(inst, dataclasses.replace(one, max_resident_adapters=4,
                                                    catalogue=one.catalogue + (lora_weights("x", "llama-3-8b", 64),))
                          ).num_kv_blocks < inst.num_kv_blocks


def test_configurations_that_cannot_work_are_refused():
    with pytest.raises(ReplayError, match="residency policy"):
        ResidencyConfig(policy="sometimes", catalogue=AB)
    with pytest.raises(ReplayError, match="can never load"):
        ResidencyConfig(catalogue=(Weights(name="a", weight_bytes=GB), Weights(name="b", weight_bytes=2 * GB)))
    with pytest.raises(ReplayError, match="does not fit"):
        ResidencyConfig(catalogue=AB, initial=(("a", "b"),), model_capacity_bytes=3 * GB)
    with pytest.raises(ReplayError, match="max_resident_adapters"):
        ResidencyConfig(catalogue=AB + (Weights(name="x", weight_bytes=1, kind="adapter"),))


def test_a_request_naming_an_unknown_model_is_an_error_listing_the_catalogue(tmp_path):
    w = make_workload([0], [100], [5], model=["c"])
    with pytest.raises(ReplayError) as err:
        run_cluster_replay(w, _cluster(1, ResidencyConfig(catalogue=AB)), out_dir=tmp_path)
    assert "a" in str(err.value.hint) and "b" in str(err.value.hint)


# ---------------------------------------------------------------------------------------------- policies


def test_pinned_routes_each_request_to_an_instance_holding_its_model_and_never_loads(tmp_path):
    n = 60
    w = make_workload([i * 20_000_000 for i in range(n)], [150] * n, [10] * n, model=["a" if i % 3 else "b" for i in range(n)])
    res = ResidencyConfig(policy="pinned", catalogue=AB, initial=(("a",), ("b",), ("a",)), transfer=SLOW)
    summary = run_cluster_replay(w, _cluster(3, res, router="round-robin"), out_dir=tmp_path, check_invariants=True)
    rows = _requests(summary)
    holds = {"i0": "a", "i1": "b", "i2": "a"}
    for i in range(n):
        row = rows[f"r{i}"]
        assert holds[row["instance_id"].rsplit("-", 1)[1]] == ("a" if i % 3 else "b")
        assert row["outcome"] == "completed"
    assert [x.num_routed for x in summary.instances] == [20, 20, 20]
    assert all(x.num_weight_loads == 0 and x.num_deferred == 0 for x in summary.instances)
    assert [s[2] for s in _states(summary)] == ["ready"] * 3 + ["stopped"] * 3
    assert [s[3] for s in _states(summary)][:3] == [["a"], ["b"], ["a"]]


def test_pinned_rejects_a_request_whose_model_no_instance_holds(tmp_path):
    w = make_workload([0, S], [100, 100], [5, 5], model=["a", "b"])
    res = ResidencyConfig(policy="pinned", catalogue=AB, initial=(("a",),), model_capacity_bytes=4 * GB)
    rows = _requests(run_cluster_replay(w, _cluster(2, res), out_dir=tmp_path))
    assert rows["r0"]["outcome"] == "completed" and rows["r1"]["outcome"] == "rejected"


def test_on_demand_waits_for_the_victim_to_drain_then_evicts_then_loads(tmp_path):
    # one instance holding a (room for one model); r0 needs a; r1 (b) arrives while r0 runs; r2 (a) arrives
    # after the swap to b was decided, so it waits behind it for a's reload, which waits for r1 to drain
    w = make_workload([0, 100_000_000, 200_000_000], [100, 100, 100], [200, 50, 5], model=["a", "b", "a"])
    res = ResidencyConfig(catalogue=AB, initial=(("a",),), transfer=SLOW)
    summary = run_cluster_replay(w, _cluster(1, res), out_dir=tmp_path, check_invariants=True)
    rows = _requests(summary)
    a_done, b_done = rows["r0"]["finish_ns"], rows["r1"]["finish_ns"]
    assert rows["r1"]["scheduled_ns"] == a_done + S // 2 + 3 * S  # drain, evict a (0.5 s), load b (3 s)
    assert rows["r2"]["scheduled_ns"] == b_done + S // 2 + 3 * S  # behind b: drain r1, evict b, load a
    states = _states(summary)
    assert states == [
        (0, "i0", "ready", ["a"], [], "ready"),
        (a_done + S // 2, "i0", "ready", [], [], "ready:evict:1"),
        (a_done + S // 2 + 3 * S, "i0", "ready", ["b"], [], "ready:load:2"),
        (b_done + S // 2, "i0", "ready", [], [], "ready:evict:3"),
        (b_done + S // 2 + 3 * S, "i0", "ready", ["a"], [], "ready:load:4"),
        (states[-1][0], "i0", "stopped", ["a"], [], "stopped"),
    ]
    inst = summary.instances[0]
    assert (inst.num_weight_loads, inst.num_weight_evictions, inst.num_deferred) == (2, 2, 2)
    assert inst.weight_swap_ns == 2 * (S // 2 + 3 * S)
    assert inst.weight_drain_ns == (a_done - 100_000_000) + (b_done - (a_done + S // 2 + 3 * S))
    ids = [e["event_id"] for e in _events(summary)]
    assert len(ids) == len(set(ids))


def test_a_load_into_free_room_evicts_nothing_and_costs_only_its_transfer(tmp_path):
    w = make_workload([0, 0], [100, 100], [20, 20], model=["a", "b"])
    res = ResidencyConfig(catalogue=AB, initial=(("a",),), model_capacity_bytes=4 * GB, transfer=SLOW)
    summary = run_cluster_replay(w, _cluster(1, res), out_dir=tmp_path)
    rows = _requests(summary)
    assert rows["r1"]["scheduled_ns"] == 3 * S and rows["r0"]["scheduled_ns"] == 0
    assert [s[3] for s in _states(summary)] == [["a"], ["a", "b"], ["a", "b"]]
    assert summary.instances[0].num_weight_evictions == 0


def test_on_demand_evicts_the_least_recently_used_model(tmp_path):
    abc = AB + (Weights(name="c", weight_bytes=2 * GB),)
    # holds a and b (b was loaded last); r0 uses a at 0; r1 needs c at 1 s: b is the least recently used
    w = make_workload([0, S], [100, 100], [5, 5], model=["a", "c"])
    res = ResidencyConfig(catalogue=abc, initial=(("b", "a"),), transfer=SLOW)
    summary = run_cluster_replay(w, _cluster(1, res), out_dir=tmp_path)
    assert [s[3] for s in _states(summary)] == [["b", "a"], ["a"], ["a", "c"], ["a", "c"]]
    res = dataclasses.replace(res, initial=(("a", "b"),))  # now a is both first and used: b still goes
    w = make_workload([0, S], [100, 100], [5, 5], model=["b", "c"])  # b used at 0: a goes
    assert [s[3] for s in _states(run_cluster_replay(w, _cluster(1, res), out_dir=tmp_path / "2"))][2] == ["b", "c"]


def test_evicted_weights_kept_in_host_memory_reload_faster(tmp_path):
    host = dataclasses.replace(SLOW, offload_bandwidth_bytes_per_s=4e9)
    w = make_workload([0, 10 * S, 20 * S], [100] * 3, [5] * 3, model=["b", "a", "b"])
    res = ResidencyConfig(catalogue=AB, initial=(("a",),), transfer=host)
    rows = _requests(run_cluster_replay(w, _cluster(1, res), out_dir=tmp_path))
    assert rows["r0"]["scheduled_ns"] == S + 3 * S  # evict a to host (0.5 + 0.5 s), b from storage (3 s)
    assert rows["r1"]["scheduled_ns"] == 10 * S + S + 3 * S // 2  # evict b (1 s), a from host (1 + 0.5 s)
    assert rows["r2"]["scheduled_ns"] == 20 * S + S + 3 * S // 2


# ---------------------------------------------------------------------------------------------- adapters


def test_adapter_slots_per_batch_keep_a_second_adapter_out_of_the_batch(tmp_path):
    w = make_workload([0, 0, 0, 0], [100] * 4, [40, 40, 10, 40], adapter=["x", "y", "x", None])
    cat = AB + (Weights(name="x", weight_bytes=GB // 10, kind="adapter"), Weights(name="y", weight_bytes=GB // 10, kind="adapter"))
    capped = ResidencyConfig(catalogue=cat, max_resident_adapters=2, max_adapters_per_batch=1, transfer=FREE)
    rows = {}
    for mode in ("fast", "reference"):
        summary = run_cluster_replay(w, _cluster(1, capped), out_dir=tmp_path / mode, mode=mode, check_invariants=True)
        rows[mode] = _requests(summary)
    rows_c = rows["fast"]
    assert rows_c["r0"]["scheduled_ns"] == rows_c["r2"]["scheduled_ns"] == rows_c["r3"]["scheduled_ns"] == 0
    assert rows_c["r1"]["scheduled_ns"] == max(rows_c["r0"]["finish_ns"], rows_c["r2"]["finish_ns"])  # y waits for x
    keys = ("scheduled_ns", "first_token_ns", "finish_ns", "outcome", "num_output_tokens")
    assert {k: [v[c] for c in keys] for k, v in rows["fast"].items()} == {
        k: [v[c] for c in keys] for k, v in rows["reference"].items()}
    free = dataclasses.replace(capped, max_adapters_per_batch=2)
    rows_f = _requests(run_cluster_replay(w, _cluster(1, free), out_dir=tmp_path / "free"))
    assert all(r["scheduled_ns"] == 0 for r in rows_f.values())
    states = _states(run_cluster_replay(w, _cluster(1, free), out_dir=tmp_path / "free2"))
    assert sorted(states[-1][4]) == ["x", "y"]  # adapters loaded on demand are reported


# ---------------------------------------------------------------------------------------------- scenarios and modes


def test_model_phases_alternate_from_the_first_arrival():
    n = 6
    arrivals = [7 * S + k * 5 * S for k in range(n)]  # 0, 5, ..., 25 s after the first
    batch = pa.Table.from_arrays(
        [pa.array(arrivals, f.type) if f.name == "arrival_ns" else pa.array([f"r{i}" for i in range(n)], f.type)
         if f.name == "request_id" else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA], schema=WORKLOAD_SCHEMA,
    ).to_batches()[0]
    scenario = Scenario(model_phases=alternating_models("a", "b", 10.0))
    out = apply_scenario(batch, scenario, seed=1, row_offset=0)
    assert out.column("model").to_pylist() == ["a", "a", "b", "b", "a", "a"]
    later = apply_scenario(batch.slice(2), scenario, seed=1, row_offset=2, origin_ns=7 * S)  # a later batch
    assert later.column("model").to_pylist() == ["b", "b", "a", "a"]
    with pytest.raises(ReplayError):
        alternating_models("a", "b", 10.0, majority=0.3)


def test_a_phase_majority_sets_the_share_of_each_phase():
    n = 4000
    arrivals = np.arange(n, dtype=np.int64) * (S // 100)  # 40 s: two phases of 20 s
    t = pa.Table.from_arrays(
        [pa.array(arrivals, f.type) if f.name == "arrival_ns" else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA],
        schema=WORKLOAD_SCHEMA)
    models = np.array(apply_scenario(t.to_batches()[0], Scenario(model_phases=alternating_models("a", "b", 20.0, 0.8)), 0, 0)
                      .column("model").to_pylist())
    first, second = models[: n // 2], models[n // 2:]
    assert 0.77 < (first == "a").mean() < 0.83 and 0.77 < (second == "b").mean() < 0.83


def test_fast_and_reference_modes_agree_under_on_demand_swapping(tmp_path):
    n = 240
    w = make_workload([i * 25_000_000 for i in range(n)], [100 + 37 * (i % 23) for i in range(n)],
                      [20 + 11 * (i % 13) for i in range(n)],
                      cancel_after_ns=[400_000_000 if i % 11 == 0 else None for i in range(n)])
    res = ResidencyConfig(catalogue=AB, initial=(("a",), ("b",)), transfer=dataclasses.replace(SLOW, load_latency_s=0.2))
    config = _cluster(2, res, router="least-outstanding-tokens", scaling=[ScaleStep(at_s=2.0, delta=1)],
                      delays=ScalingDelays(startup_s=0.1, weight_load_s=0.1, cache_warm_s=0.0))
    scenario = Scenario(model_phases=alternating_models("a", "b", 1.5, 0.9))
    fast = run_cluster_replay(w, config, scenario=scenario, out_dir=tmp_path / "f", check_invariants=True, chunk_rows=400)
    ref = run_cluster_replay(w, config, scenario=scenario, out_dir=tmp_path / "r", mode="reference")
    cols = ["request_id", "instance_id", "arrival_ns", "scheduled_ns", "first_token_ns", "finish_ns", "outcome",
            "num_output_tokens"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert len(f) == n and f == r
    assert [x.num_weight_loads for x in fast.instances] == [x.num_weight_loads for x in ref.instances]
    assert sum(x.num_weight_loads for x in fast.instances) >= 3
    assert [s[1:] for s in _states(fast)] == [s[1:] for s in _states(ref)]


def test_a_draining_instance_stops_only_after_the_requests_waiting_for_its_loads(tmp_path):
    # i1 comes up at 0.5 s and is removed at 2 s; r1 (b) reaches it at 1 s (r0 keeps i0 busy) and waits for b
    w = make_workload([0, S], [100, 100], [2000, 5], model=["a", "b"])
    res = ResidencyConfig(catalogue=AB, initial=(("a",),), transfer=SLOW)
    config = _cluster(1, res, router="least-outstanding-tokens",
                      scaling=[ScaleStep(at_s=0.0, delta=1), ScaleStep(at_s=2.0, delta=-1)],
                      delays=ScalingDelays(startup_s=0.5, weight_load_s=0.0, cache_warm_s=0.0))
    summary = run_cluster_replay(w, config, out_dir=tmp_path)
    rows = _requests(summary)
    assert rows["r1"]["instance_id"].endswith("-i1") and rows["r1"]["outcome"] == "completed"
    assert rows["r1"]["scheduled_ns"] == S + S // 2 + 3 * S
    i1 = [(s[0], s[5]) for s in _states(summary) if s[1] == "i1"]
    assert i1 == [(0, "starting"), (S // 2, "ready"), (S + S // 2, "ready:evict:1"), (2 * S, "draining"),
                  (S + S // 2 + 3 * S, "draining:load:2"), (rows["r1"]["finish_ns"], "stopped")]


def test_an_added_instance_loads_its_initial_set_before_it_takes_traffic(tmp_path):
    w = make_workload([0, 10 * S], [100, 100], [5, 5], model=["a", "a"])
    res = ResidencyConfig(catalogue=AB, initial=(("a",), ("a", "b")))
    config = _cluster(1, res, scaling=[ScaleStep(at_s=0.0, delta=1)],
                      delays=ScalingDelays(startup_s=1.0, weight_load_bandwidth_bytes_per_s=1e9, cache_warm_s=0.0))
    summary = run_cluster_replay(w, config, out_dir=tmp_path)
    assert summary.instances[1].weight_load_ns == 4 * S  # a and b: 4 GB at 1 GB/s
    assert summary.instances[1].ready_s == 5.0


def test_residency_with_disaggregation_faults_or_reroutes_is_refused():
    from replay.cluster import disaggregated_config

    res = ResidencyConfig(catalogue=AB)
    with pytest.raises(ReplayError, match="not supported"):
        dataclasses.replace(disaggregated_config(1, 1), residency=res)
    with pytest.raises(ReplayError, match="not supported"):
        dataclasses.replace(cluster_config(2), residency=res, failure_rate_per_s=0.1)
    with pytest.raises(ReplayError, match="not supported"):
        dataclasses.replace(cluster_config(2), residency=res, max_reroutes=1)
