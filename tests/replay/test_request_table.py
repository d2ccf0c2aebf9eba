"""The replay's own request table (replay.request_table) equals the derivation (replay.derive) over the same events.

Every replay through ``tests/replay/conftest.run`` is compared too; here, the cases that stress it: real traces
with the shipped calibration (client-side columns, async scheduling), fast and reference modes, tiny event
chunks (requests spanning many flushes), cancellations and preemptions, prefix caching, clusters with
disaggregated pools and failures, and the tie rule between deliveries at one instant.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replay.abuse import TWO_CLASS_TENANCY
from replay.calibration import default_calibration
from replay.cluster import ClusterConfig, InstanceFailure, run_cluster_replay
from replay.config import EngineConfig, instance_config, parse_instance
from replay.derive import derive_requests
from replay.emit import EventWriter
from replay.gathered import Ends
from replay.policies import DeadlineConfig
from replay.presets import TWO_CLASS, LoadShape, prepared_workload
from replay.request_table import Deliveries, _delivery_order
from replay.run import OFFLOAD_MIN_REQUESTS, offload, run_replay
from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
from replay.traces import read_trace
from replay.workload import TiledWorkload, as_workload
from tests.replay.conftest import assert_same_requests, make_workload

MS = 1_000_000


def _same(summary) -> None:
    assert_same_requests(pq.read_table(summary.requests_path), derive_requests(summary.events_path))


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_a_calibrated_deadline_replay_of_the_azure_trace_at_twice_its_rate(shared, tmp_path, mode):
    workload, preset = prepared_workload(read_trace("azure-conv", shared).slice(0, 1500), "azure-conv",
                                         preset="two-class", shape=LoadShape(load=2))
    instance = parse_instance("llama-2-7b@a100-80gx2", EngineConfig(gpu_memory_utilization=0.5))
    summary = run_replay(workload, policy_name="deadline", policy_config=DeadlineConfig(tenancy=TWO_CLASS_TENANCY),
                         scenario=preset.scenario, instance=instance, calibration=default_calibration(), mode=mode,
                         out_dir=tmp_path, chunk_rows=5_000)
    own = pq.read_table(summary.requests_path)
    assert own["ttft_client_s"].null_count < own.num_rows  # the calibration's frontend: client-side columns
    assert pc.sum(pc.equal(own["outcome"], "rejected")).as_py() > 0
    _same(summary)


def test_requests_spanning_many_tiny_chunks_with_cancellations_and_preemptions(tmp_path):
    n = 400
    w = make_workload([i * 3 * MS for i in range(n)], [100 + 97 * (i % 23) for i in range(n)],
                      [1 + 11 * (i % 31) for i in range(n)],
                      cancel_after_ns=[120 * MS if i % 7 == 0 else None for i in range(n)],
                      num_branches=[3 if i % 13 == 0 else 1 for i in range(n)])
    small = instance_config(engine=EngineConfig(num_kv_blocks_override=500))  # recompute preemptions
    for mode in ("fast", "reference"):
        summary = run_replay(w, instance=small, mode=mode, out_dir=tmp_path / mode, chunk_rows=37)
        assert summary.num_preemptions > 0
        _same(summary)


def test_the_table_records_the_engines_prefix_hits_on_mooncake(shared, tmp_path):
    scenario = Scenario(name="t", tenants=(TenantSpec(name="a", share=1),),
                        service_classes=(ServiceClassSpec(name="chat", share=1, ttft_objective_s=2.0),),
                        cancel_share=0.05, cancel_after_s_min=2, cancel_after_s_max=20)
    summary = run_replay(read_trace("mooncake", shared).slice(0, 400), scenario=scenario, out_dir=tmp_path,
                         chunk_rows=3_000)
    own = pq.read_table(summary.requests_path)
    assert pc.sum(own["num_cached_prefix_tokens"]).as_py() == summary.num_prefix_hit_tokens > 0
    _same(summary)


def test_a_disaggregated_cluster_with_a_failure_built_here_and_in_a_process_of_its_own(tmp_path):
    n = 300
    w = make_workload([i * 4 * MS for i in range(n)], [100 + 53 * (i % 29) for i in range(n)],
                      [1 + 7 * (i % 19) for i in range(n)],
                      cancel_after_ns=[250 * MS if i % 11 == 0 else None for i in range(n)])
    small = instance_config(engine=EngineConfig(num_kv_blocks_override=700))
    config = ClusterConfig(instances=(instance_config(),) * 3, router="least-outstanding-tokens",
                           decode_instances=(small,) * 2, decode_router="least-load")
    failing = dataclasses.replace(config, failures=(InstanceFailure(at_s=0.3, instance=1),))
    for name, cfg in (("disagg", config), ("failure", failing)):
        for mode in ("fast", "reference"):
            summary = run_cluster_replay(w, cfg, out_dir=tmp_path / f"{name}-{mode}", mode=mode, chunk_rows=250)
            _same(summary)
        # the outputs built in a process of their own are the same files
        offloaded = run_cluster_replay(w, cfg, out_dir=tmp_path / f"{name}-off", chunk_rows=250, offload_outputs=True)
        fast = tmp_path / f"{name}-fast"
        assert offloaded.requests_path.read_bytes() == (fast / "requests.parquet").read_bytes()
        assert offloaded.events_path.read_bytes() == (fast / "events.parquet").read_bytes()


def test_deliveries_at_one_instant_follow_the_event_ids_text_order():
    # request 7: a first token at 5, then two deliveries at 9 numbered 10 and 9: ':tokens10' sorts before ':tokens9'
    d = Deliveries(idx=np.array([7, 7, 7, 3]), ts=np.array([9, 9, 5, 9]), kind=np.array([1, 1, 0, 1]),
                   tb=np.array([9, 10, 0, 4]), tokens=np.array([1, 2, 1, 1]), coalesced=np.zeros(4, bool),
                   instance=np.zeros(4, np.int64))
    assert _delivery_order(d).tolist() == [3, 2, 1, 0]


def test_a_run_without_an_output_folder_writes_no_table():
    summary = run_replay(make_workload([0, MS], [100, 100], [3, 3]), sink=lambda table: None)
    assert summary.requests_path is None


def test_the_two_class_preset_is_the_documented_tenancy():
    assert TWO_CLASS.tenancy == TWO_CLASS_TENANCY
    assert {c.name for c in TWO_CLASS.metrics.classes} == {"interactive", "batch"}


def test_outputs_built_in_a_process_of_their_own_are_the_same_files(shared, tmp_path):
    # labelled requests (two classes, tenants), rejections, client-side columns, requests spanning many chunks
    workload, preset = prepared_workload(read_trace("azure-conv", shared).slice(0, 800), "azure-conv",
                                         preset="two-class", shape=LoadShape(load=2))
    instance = parse_instance("llama-2-7b@a100-80gx2", EngineConfig(gpu_memory_utilization=0.5))
    tables = {}
    for offloaded in (False, True):
        summary = run_replay(workload, policy_name="deadline", policy_config=DeadlineConfig(tenancy=TWO_CLASS_TENANCY),
                             scenario=preset.scenario, instance=instance, calibration=default_calibration(),
                             out_dir=tmp_path / str(offloaded), chunk_rows=3_000, offload_outputs=offloaded)
        tables[offloaded] = (summary.requests_path.read_bytes(), summary.events_path.read_bytes(), summary.output_sha256)
    assert pq.read_table(summary.requests_path)["tenant"].null_count == 0
    assert tables[True] == tables[False]
    _same(summary)


def test_large_replays_build_their_outputs_in_a_process_of_their_own():
    small = as_workload(make_workload([0, MS], [100, 100], [3, 3]))
    large = TiledWorkload(make_workload([0, MS], [100, 100], [3, 3]), OFFLOAD_MIN_REQUESTS // 2)
    assert (offload(small, None), offload(large, None)) == (False, True)
    assert (offload(small, True), offload(large, False)) == (True, False)


@pytest.mark.parametrize("offloaded", [False, True])
def test_an_error_in_the_table_fails_the_replay_and_leaves_no_file(tmp_path, monkeypatch, offloaded):
    # a request that finishes twice is an engine bug the table catches; in a process of its own it fails the run too
    gather = EventWriter._finishes

    def twice(self):
        ends = gather(self)
        if ends is None:
            return None
        return Ends(*(pa.concat_arrays([v, v]) if isinstance(v, pa.Array) else np.concatenate([v, v])
                      for v in (getattr(ends, f.name) for f in dataclasses.fields(Ends))))

    monkeypatch.setattr(EventWriter, "_finishes", twice)
    with pytest.raises(AssertionError, match="finished twice"):
        run_replay(make_workload([0, MS], [100, 100], [3, 3]), out_dir=tmp_path, offload_outputs=offloaded)
    assert not list(tmp_path.glob("*requests.parquet*"))
