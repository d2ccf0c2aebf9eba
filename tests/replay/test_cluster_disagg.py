"""Disaggregated serving: prefill and decode pools, the KV hand-off between them and its events."""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from replay.cluster import ClusterConfig, ScaleStep, cluster_config, disaggregated_config, run_cluster_replay
from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.errors import ReplayError
from replay.policies.routing import LeastOutstandingTokensConfig, SheddingConfig
from tests.replay.conftest import make_workload

MS = 1_000_000


def _events(summary) -> list[dict]:
    return pq.read_table(summary.events_path).to_pylist()


def _by_request(events: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e["request_id"] is not None:
            out[e["request_id"]].append(e)
    return out


def test_a_request_is_prefilled_on_the_prefill_pool_and_decoded_on_the_decode_pool(tmp_path):
    n = 40
    w = make_workload([i * 15 * MS for i in range(n)], [150 + 37 * (i % 9) for i in range(n)], [2 + i % 13 for i in range(n)])
    summary = run_cluster_replay(w, disaggregated_config(2, 2), out_dir=tmp_path, check_invariants=True)
    roles = {x.instance_id: x.role for x in summary.instances}
    assert sorted(roles.values()) == ["decode", "decode", "prefill", "prefill"]
    events = _events(summary)
    for evs in _by_request(events).values():
        first = [e for e in evs if e["event_type"] == "first_token"]
        assert len(first) == 1 and roles[first[0]["instance_id"]] == "prefill"
        t = first[0]["ts_ns"]
        moved = [e for e in evs if e["event_type"] == "request_preempted"]
        routes = [e for e in evs if e["event_type"] == "admission_decided" and e["decision"] == "route"]
        # one migrate at the prefill instance when its first token is out, lease generation 1 ...
        assert [(e["mode"], e["lease_generation"], e["num_lost_tokens"], e["ts_ns"], e["instance_id"]) for e in moved] == [
            ("migrate", 1, 0, t, first[0]["instance_id"])
        ]
        # ... and a second route, to a decode instance, at that instant
        assert [roles[e["target"]] for e in routes] == ["prefill", "decode"] and routes[1]["ts_ns"] == t
        assert [e["reason"] for e in routes] == ["least-outstanding-tokens", "hand-off to decode (least-outstanding-tokens)"]
        decode = routes[1]["target"]
        later = [e for e in evs if e["ts_ns"] > t or e["event_type"] in ("tokens_delivered", "request_finished")]
        assert later and all(e["instance_id"] == decode for e in later), later
        finished = [e for e in evs if e["event_type"] == "request_finished"]
        assert len(finished) == 1 and finished[0]["outcome"] == "completed"
    steps = [e for e in events if e["event_type"] == "step_executed"]
    assert all(e["num_decode_seqs"] == 0 for e in steps if roles[e["instance_id"]] == "prefill")
    assert all(e["num_prefill_tokens"] == 0 for e in steps if roles[e["instance_id"]] == "decode")
    # a request with one output token ends on the prefill instance: nothing moves
    assert summary.num_kv_transfers == sum(1 for i in range(n) if 2 + i % 13 > 1)


def test_the_transfer_is_charged_by_size_over_the_link_then_the_latency(tmp_path):
    # constant 10 ms steps; two 1000-token prompts prefilled in one step on the one prefill instance
    instance = instance_config("llama-3-8b", "h100-sxm")
    bandwidth, latency_s = 2e9, 0.003
    config = disaggregated_config(1, 2, instance, kv_transfer_bandwidth_bytes_per_s=bandwidth, kv_transfer_latency_s=latency_s,
                                  decode_router="round-robin")
    w = make_workload([0, 0], [1000, 1000], [5, 5])
    summary = run_cluster_replay(w, config, cost_model="constant", cost_model_config=ConstantCostConfig(step_time_ns=10 * MS),
                                 out_dir=tmp_path, check_invariants=True)
    evs = _by_request(_events(summary))
    transfer_ns = -(-1000 * instance.model.kv_bytes_per_token * 10**9 // int(bandwidth))
    assert transfer_ns > 30 * MS  # the case means something: the transfer dominates the gap
    tokens = {rid: sorted(e["ts_ns"] for e in x if e["event_type"] in ("first_token", "tokens_delivered")) for rid, x in evs.items()}
    assert tokens["r0"][0] == tokens["r1"][0] == 10 * MS  # one prefill step for both
    # r0's KV leaves first; r1's waits for the link, then both pay the latency; one decode step each
    assert tokens["r0"][1] == 10 * MS + transfer_ns + 3 * MS + 10 * MS
    assert tokens["r1"][1] == 10 * MS + 2 * transfer_ns + 3 * MS + 10 * MS
    assert summary.kv_transfer_bytes == 2 * 1000 * instance.model.kv_bytes_per_token
    assert [x.num_kv_transfers_out for x in summary.instances] == [2, 0, 0]


def test_a_request_cancelled_while_its_kv_is_in_transit_ends_once_where_it_was_going(tmp_path):
    instance = instance_config("llama-3-8b", "h100-sxm")
    config = disaggregated_config(1, 1, instance, kv_transfer_bandwidth_bytes_per_s=1e9)  # 1000 tokens: 131 ms
    w = make_workload([0, 0], [1000, 1000], [50, 50], cancel_after_ns=[60 * MS, None])
    summary = run_cluster_replay(w, config, cost_model="constant", cost_model_config=ConstantCostConfig(step_time_ns=10 * MS),
                                 out_dir=tmp_path, check_invariants=True)
    evs = _by_request(_events(summary))
    decode = summary.instances[1].instance_id
    r0 = [(e["event_type"], e["ts_ns"], e["instance_id"]) for e in evs["r0"] if e["ts_ns"] >= 60 * MS]
    assert r0 == [("request_cancelled", 60 * MS, decode), ("request_finished", 60 * MS, decode)]
    assert [e["outcome"] for e in evs["r1"] if e["event_type"] == "request_finished"] == ["completed"]


def test_fast_and_reference_modes_agree_when_disaggregated(tmp_path):
    from replay.derive import derive_requests

    n = 300
    w = make_workload([i * 4 * MS for i in range(n)], [100 + 53 * (i % 29) for i in range(n)], [1 + 7 * (i % 19) for i in range(n)],
                      cancel_after_ns=[250 * MS if i % 11 == 0 else None for i in range(n)],
                      num_branches=[2 if i % 17 == 0 else 1 for i in range(n)])
    small = instance_config(engine=EngineConfig(num_kv_blocks_override=700))  # decode preemptions
    config = ClusterConfig(instances=(instance_config(),) * 2, router="least-outstanding-tokens",
                           decode_instances=(small,) * 2, decode_router="least-load")
    fast = run_cluster_replay(w, config, out_dir=tmp_path / "fast", check_invariants=True, chunk_rows=400)
    ref = run_cluster_replay(w, config, out_dir=tmp_path / "ref", mode="reference", check_invariants=True)
    cols = ["request_id", "instance_id", "arrival_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "finish_ns",
            "outcome", "num_output_tokens", "num_preemptions"]  # ITL: fast coalesces deliveries
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert len(f) == n and f == r
    assert fast.num_preemptions > 0  # the small decode pools preempted (beyond the hand-offs)
    assert fast.num_events < ref.num_events


def test_disaggregated_runs_are_deterministic_and_aggregated_manifests_unchanged(tmp_path):
    w = make_workload([i * 5 * MS for i in range(120)], [300] * 120, [20] * 120)
    a = run_cluster_replay(w, disaggregated_config(1, 3), out_dir=tmp_path / "a", chunk_rows=200)
    b = run_cluster_replay(w, disaggregated_config(1, 3), out_dir=tmp_path / "b", chunk_rows=200)
    assert a.events_path.read_bytes() == b.events_path.read_bytes()
    assert a.manifest_path.read_bytes() == b.manifest_path.read_bytes()
    manifest = json.loads(a.manifest_path.read_text())
    assert manifest["cluster"]["disaggregation"]["kv_transfer_bandwidth_bytes_per_s"] == 50e9
    agg = run_cluster_replay(w, cluster_config(4), out_dir=tmp_path / "c")
    assert "disaggregation" not in json.loads(agg.manifest_path.read_text())["cluster"]
    assert agg.num_kv_transfers == 0 and {x.role for x in agg.instances} == {"serve"}


def test_disaggregated_configurations_that_cannot_run_are_refused():
    with pytest.raises(ReplayError, match="both pools"):
        disaggregated_config(2, 0)
    with pytest.raises(ReplayError, match="cannot shed"):
        disaggregated_config(1, 1, decode_router_config=LeastOutstandingTokensConfig(
            shedding=SheddingConfig(sheddable_classes=("batch",))))
    with pytest.raises(ReplayError, match="scaling schedule"):
        disaggregated_config(1, 1, scaling=(ScaleStep(at_s=1.0, delta=1),))
    with pytest.raises(ReplayError, match="kv_transfer"):
        disaggregated_config(1, 1, kv_transfer_bandwidth_bytes_per_s=0)
    with pytest.raises(ReplayError, match="block size"):
        disaggregated_config(1, 1, decode_instance=instance_config(engine=EngineConfig(block_size_tokens=32)))


def test_fast_and_reference_modes_agree_on_the_azure_trace_when_disaggregated(shared, tmp_path):
    from replay.derive import derive_requests
    from replay.traces import read_trace
    from replay.workload import scale_rate

    w = scale_rate(read_trace("azure-conv", shared).slice(0, 1500), 3)
    config = disaggregated_config(1, 2, decode_router="least-load")
    fast = run_cluster_replay(w, config, out_dir=tmp_path / "fast", check_invariants=True)
    ref = run_cluster_replay(w, config, out_dir=tmp_path / "ref", mode="reference")
    cols = ["request_id", "instance_id", "arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns", "last_token_ns",
            "finish_ns", "outcome", "num_output_tokens", "num_preemptions"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert len(f) == 1500 and f == r
    assert fast.num_kv_transfers == ref.num_kv_transfers > 1000
    assert fast.num_events * 2 < ref.num_events


def test_a_request_cancelled_at_the_instant_of_its_first_token_ends_on_the_prefill_instance(tmp_path):
    # the first token (step end) comes before the cancellation at one instant: it is delivered, the
    # request is released for its move, and the cancellation finds it between the two instances
    config = disaggregated_config(1, 1)
    w = make_workload([0, 0], [1000, 1000], [50, 50], cancel_after_ns=[10 * MS, None])
    for mode in ("fast", "reference"):
        summary = run_cluster_replay(w, config, cost_model="constant", mode=mode,
                                     cost_model_config=ConstantCostConfig(step_time_ns=10 * MS),
                                     out_dir=tmp_path / mode, check_invariants=True)
        evs = _by_request(_events(summary))
        prefill = summary.instances[0].instance_id
        r0 = sorted((e["ts_ns"], e["event_type"], e["instance_id"]) for e in evs["r0"] if e["ts_ns"] == 10 * MS)
        assert r0 == [(10 * MS, t, prefill) for t in
                      sorted(["first_token", "request_preempted", "request_cancelled", "request_finished"])]
        assert [e["outcome"] for e in evs["r0"] if e["event_type"] == "request_finished"] == ["cancelled"]
        assert summary.num_kv_transfers == 1  # r1's
