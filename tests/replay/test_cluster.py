"""The cluster layer: routing, scaling with delays, draining, determinism, fast against reference."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from replay.cluster import (
    ClusterConfig,
    ScaleStep,
    ScalingDelays,
    cluster_config,
    parse_scale_step,
    run_cluster_replay,
)
from replay.config import EngineConfig, instance_config
from replay.errors import ReplayError
from replay.policies.routing import LoadRecord, make_router
from tests.replay.conftest import make_workload

S = 1_000_000_000


def _events(summary) -> list[dict]:
    return pq.read_table(summary.events_path).to_pylist()


def _steady(n: int, gap_ns: int = 50_000_000, start_ns: int = 0):
    return make_workload([start_ns + i * gap_ns for i in range(n)], [200 + 13 * (i % 11) for i in range(n)],
                         [30 + i % 17 for i in range(n)])


# ---------------------------------------------------------------------------------------------- routers


def test_round_robin_cycles_over_the_instances_given():
    router = make_router("round-robin")
    loads = [LoadRecord(instance_id=f"i{k}") for k in range(3)]
    assert [router.route(None, loads).index for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_tokens_picks_the_fewest_tokens_then_requests_then_the_first():
    router = make_router("least-outstanding-tokens")
    loads = [
        LoadRecord(instance_id="a", num_outstanding_tokens=500, num_outstanding=1),
        LoadRecord(instance_id="b", num_outstanding_tokens=300, num_outstanding=4),
        LoadRecord(instance_id="c", num_outstanding_tokens=300, num_outstanding=2),
        LoadRecord(instance_id="d", num_outstanding_tokens=300, num_outstanding=2),
    ]
    d = router.route(None, loads)
    assert d.index == 2 and not d.shed and d.reason == "least-outstanding-tokens"


def test_an_unknown_router_lists_the_valid_ones():
    with pytest.raises(ReplayError) as err:
        make_router("random-ish")
    assert "least-outstanding-tokens" in str(err.value.hint) and "round-robin" in str(err.value.hint)
    with pytest.raises(ReplayError):
        cluster_config(2, router="random-ish")


def test_scaling_schedules_that_cannot_run_are_refused():
    with pytest.raises(ReplayError, match="leaves 0 instances"):
        cluster_config(1, scaling=[ScaleStep(at_s=1.0, delta=-1)])
    with pytest.raises(ReplayError, match="time order"):
        cluster_config(2, scaling=[ScaleStep(at_s=2.0, delta=1), ScaleStep(at_s=1.0, delta=-1)])
    with pytest.raises(ReplayError, match="AT_S"):
        parse_scale_step("120+2")
    assert parse_scale_step("120:+2") == ScaleStep(at_s=120.0, delta=2)
    small = instance_config(engine=EngineConfig(block_size_tokens=32))
    with pytest.raises(ReplayError, match="block size"):
        ClusterConfig(instances=(instance_config(), small))


# ---------------------------------------------------------------------------------------------- routing in a replay


def test_every_request_is_routed_once_and_lives_on_its_instance(tmp_path):
    summary = run_cluster_replay(_steady(60, gap_ns=5_000_000), cluster_config(3, router="round-robin"),
                                 out_dir=tmp_path, check_invariants=True)
    events = _events(summary)
    routes = [e for e in events if e["event_type"] == "admission_decided" and e["decision"] == "route"]
    ids = [x.instance_id for x in summary.instances]
    assert [e["target"] for e in routes] == [ids[i % 3] for i in range(60)]  # arrival order, in turn
    target = {e["request_id"]: e["target"] for e in routes}
    for e in events:
        if e["request_id"] is not None and e["event_type"] != "admission_decided":
            assert e["instance_id"] == target[e["request_id"]], e
        if e["event_type"] == "step_executed":
            assert all(target[r] == e["instance_id"] for r in e["request_ids"])
    finished = [e["request_id"] for e in events if e["event_type"] == "request_finished"]
    assert sorted(finished) == sorted(target)
    assert [x.num_routed for x in summary.instances] == [20, 20, 20]


def test_least_outstanding_tokens_spreads_a_burst(tmp_path):
    burst = make_workload([0] * 12, [1000] * 6 + [100] * 6, [50] * 12)
    summary = run_cluster_replay(burst, cluster_config(3, router="least-outstanding-tokens"), out_dir=tmp_path)
    routes = [e["target"] for e in _events(summary) if e["event_type"] == "admission_decided" and e["decision"] == "route"]
    ids = [x.instance_id for x in summary.instances]
    # the six long prompts go two to each instance, then the short ones too
    assert routes[:6] == ids * 2
    assert [x.num_routed for x in summary.instances] == [4, 4, 4]


# ---------------------------------------------------------------------------------------------- scaling


def test_a_scale_up_at_the_start_of_a_burst_takes_traffic_only_after_its_delays(tmp_path):
    # light load for 10 s, then a burst; the scale-up is decided as the burst begins
    light = [i * 500_000_000 for i in range(20)]
    burst = [10 * S + i * 10_000_000 for i in range(400)]  # 4 s of burst
    w = make_workload(light + burst, [500] * 420, [100] * 420)
    instance = instance_config("llama-3-8b", "h100-sxm")
    delays = ScalingDelays(startup_s=0.5, weight_load_bandwidth_bytes_per_s=16e9, cache_warm_s=0.5)
    config = cluster_config(1, instance, "least-outstanding-tokens", scaling=[ScaleStep(at_s=10.0, delta=1)],
                            delays=delays)
    summary = run_cluster_replay(w, config, out_dir=tmp_path)
    events = _events(summary)
    new = summary.instances[1].instance_id
    load_ns = round(instance.model.weight_bytes / 16e9 * 1e9)
    ready_ns = 10 * S + S // 2 + load_ns + S // 2
    states = [(e["ts_ns"], e["state"], e["scale_action"]) for e in events
              if e["event_type"] == "instance_state" and e["instance_id"] == new]
    assert states[:2] == [(10 * S, "starting", "scale_up"), (ready_ns, "ready", "scale_up")]
    assert summary.instances[1].weight_load_ns == load_ns and summary.instances[1].ready_s == ready_ns / S
    to_new = [e["ts_ns"] for e in events if e["event_type"] == "admission_decided" and e["target"] == new]
    assert to_new and min(to_new) >= ready_ns  # nothing before its delays are over ...
    assert sum(1 for e in events if e["event_type"] == "admission_decided" and e["decision"] == "route"
               and 10 * S <= e["ts_ns"] < ready_ns and e["target"] != new) > 0  # ... while the burst went to the old one


def test_a_removed_instance_drains_then_stops(tmp_path):
    w = _steady(200, gap_ns=10_000_000)
    config = cluster_config(2, router="round-robin", scaling=[ScaleStep(at_s=1.0, delta=-1)])
    summary = run_cluster_replay(w, config, out_dir=tmp_path, check_invariants=True)
    events = _events(summary)
    gone = summary.instances[1].instance_id
    states = [(e["ts_ns"], e["state"], e["scale_action"]) for e in events
              if e["event_type"] == "instance_state" and e["instance_id"] == gone]
    assert [s[1:] for s in states] == [("ready", None), ("draining", "scale_down"), ("stopped", "scale_down")]
    assert states[1][0] == S
    routed_there = {e["request_id"] for e in events if e["event_type"] == "admission_decided" and e["target"] == gone}
    assert max(e["ts_ns"] for e in events if e["event_type"] == "admission_decided" and e["target"] == gone) < S
    last_finish = max(e["ts_ns"] for e in events if e["event_type"] == "request_finished" and e["request_id"] in routed_there)
    assert last_finish > S and states[2][0] == last_finish  # it served what it held, then stopped


def test_an_instance_removed_while_starting_never_serves(tmp_path):
    config = cluster_config(1, scaling=[ScaleStep(at_s=0.5, delta=1), ScaleStep(at_s=0.6, delta=-1)],
                            delays=ScalingDelays(startup_s=1.0, weight_load_s=1.0, cache_warm_s=0.0))
    summary = run_cluster_replay(_steady(60), config, out_dir=tmp_path)
    events = _events(summary)
    new = summary.instances[1].instance_id
    states = [(e["ts_ns"], e["state"]) for e in events if e["event_type"] == "instance_state" and e["instance_id"] == new]
    assert states == [(S // 2, "starting"), (600_000_000, "stopped")]
    assert summary.instances[1].num_routed == 0


# ---------------------------------------------------------------------------------------------- determinism and modes


def test_identical_inputs_give_byte_identical_events_and_manifest(tmp_path):
    config = cluster_config(4, router="least-outstanding-tokens",
                            scaling=[ScaleStep(at_s=0.5, delta=2), ScaleStep(at_s=2.0, delta=-3)],
                            delays=ScalingDelays(startup_s=0.1, weight_load_s=0.1, cache_warm_s=0.1))
    w = _steady(300, gap_ns=7_000_000)
    # small chunks: instances flush while others have steps in flight (their members are logged again)
    a = run_cluster_replay(w, config, out_dir=tmp_path / "a", seed=3, chunk_rows=300)
    b = run_cluster_replay(w, config, out_dir=tmp_path / "b", seed=3, chunk_rows=300)
    assert a.events_path.read_bytes() == b.events_path.read_bytes()
    assert a.manifest_path.read_bytes() == b.manifest_path.read_bytes()
    assert a.output_sha256 == b.output_sha256 and a.run_id == b.run_id
    c = run_cluster_replay(w, cluster_config(4, router="round-robin"), out_dir=tmp_path / "c", seed=3)
    assert c.run_id != a.run_id


def test_fast_and_reference_modes_route_and_time_every_request_alike(tmp_path):
    from replay.derive import derive_requests

    config = cluster_config(3, router="least-outstanding-tokens", scaling=[ScaleStep(at_s=0.3, delta=1)],
                            delays=ScalingDelays(startup_s=0.1, weight_load_s=0.1, cache_warm_s=0.0))
    w = make_workload([i * 3_000_000 for i in range(250)], [100 + 37 * (i % 23) for i in range(250)],
                      [20 + 11 * (i % 13) for i in range(250)], cancel_after_ns=[300_000_000 if i % 9 == 0 else None for i in range(250)])
    fast = run_cluster_replay(w, config, out_dir=tmp_path / "fast", mode="fast", check_invariants=True, chunk_rows=500)
    ref = run_cluster_replay(w, config, out_dir=tmp_path / "ref", mode="reference", check_invariants=True)

    def routes(s):
        return sorted((e["request_id"], e["target"].rsplit("-", 1)[1]) for e in _events(s)
                      if e["event_type"] == "admission_decided" and e["decision"] == "route")

    assert routes(fast) == routes(ref)
    cols = ["request_id", "instance_id", "arrival_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "finish_ns",
            "outcome", "num_output_tokens"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:  # run ids (so instance ids) differ by mode: compare the instance's number
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert f == r and len(f) == 250
    assert fast.num_events < ref.num_events


TRACE_CASES = {
    # (trace, requests, rate factor, instances, router, engine settings)
    "azure-lot": ("azure-conv", 3000, 3, 3, "least-outstanding-tokens", EngineConfig()),
    "mooncake-rr": ("mooncake", 600, 1, 2, "round-robin", EngineConfig()),  # prefix hits, long prompts
    "azure-small-pool-lot": ("azure-conv", 2000, 3, 3, "least-outstanding-tokens", EngineConfig(num_kv_blocks_override=600)),
    "azure-least-load": ("azure-conv", 1500, 3, 3, "least-load", EngineConfig()),  # reads engine state
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_fast_and_reference_modes_agree_on_traces(shared, tmp_path, case):
    from replay.derive import derive_requests
    from replay.traces import read_trace
    from replay.workload import scale_rate

    trace, n, factor, num_instances, router, engine = TRACE_CASES[case]
    w = scale_rate(read_trace(trace, shared).slice(0, n), factor)
    config = cluster_config(num_instances, instance_config(engine=engine), router,
                            scaling=[ScaleStep(at_s=20.0, delta=1), ScaleStep(at_s=60.0, delta=-2)],
                            delays=ScalingDelays(startup_s=1.0, weight_load_s=2.0, cache_warm_s=1.0))
    fast = run_cluster_replay(w, config, out_dir=tmp_path / "fast", check_invariants=True)
    ref = run_cluster_replay(w, config, out_dir=tmp_path / "ref", mode="reference")
    cols = ["request_id", "instance_id", "arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns", "last_token_ns",
            "finish_ns", "outcome", "num_output_tokens", "num_preemptions", "num_cached_prefix_tokens"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert len(f) == n and f == r
    assert sum(x.num_steps for x in fast.instances) == sum(x.num_steps for x in ref.instances)
    assert fast.num_events * (1 if trace == "mooncake" else 2) < ref.num_events  # Mooncake: few pure decode runs
    if case == "azure-small-pool-lot":
        assert fast.num_preemptions > 0
    if case == "mooncake-rr":
        assert any(row["num_cached_prefix_tokens"] for row in f)


def test_instances_may_differ_in_model_and_accelerator(tmp_path):
    fast_gpu, slow_gpu = instance_config("llama-3-8b", "h100-sxm"), instance_config("llama-3-8b", "a100-80g")
    config = ClusterConfig(instances=(fast_gpu, slow_gpu), router="round-robin")
    w = make_workload([0, 0], [2000, 2000], [50, 50])
    summary = run_cluster_replay(w, config, out_dir=tmp_path)
    assert [x.accelerator for x in summary.instances] == ["h100-sxm", "a100-80g"]
    events = _events(summary)
    first = {e["request_id"]: e["ts_ns"] for e in events if e["event_type"] == "first_token"}
    assert first["r0"] < first["r1"]  # same request, the slower accelerator takes longer
    import json

    manifest = json.loads(summary.manifest_path.read_text())
    assert len(manifest["cluster"]["instances"]) == 2 and len(manifest["cluster"]["cost_models"]) == 2
    assert manifest["instance_ids"] == [x.instance_id for x in summary.instances]


def test_sheddable_requests_are_shed_when_the_pool_saturates(tmp_path):
    from replay.policies.routing import LeastOutstandingTokensConfig, SheddingConfig

    shedding = SheddingConfig(sheddable_classes=("batch",), queue_threshold=2.0, retry_after_s=3.0)
    config = cluster_config(2, instance_config(engine=EngineConfig(max_num_seqs=2)), "least-outstanding-tokens",
                            router_config=LeastOutstandingTokensConfig(shedding=shedding))
    n = 40
    w = make_workload([0] * n, [500] * n, [100] * n, service_class=["batch" if i % 2 else "interactive" for i in range(n)])
    summary = run_cluster_replay(w, config, out_dir=tmp_path)
    events = _events(summary)
    shed = [e for e in events if e["event_type"] == "admission_decided" and e["decision"] == "reject"]
    assert summary.num_shed == len(shed) > 0
    assert all(e["service_class"] == "batch" and e["instance_id"] is None and e["retry_after_s"] == 3.0 for e in shed)
    outcomes = {e["request_id"]: e["outcome"] for e in events if e["event_type"] == "request_finished"}
    assert all(outcomes[e["request_id"]] == "rejected" for e in shed)
    assert all(outcomes[f"r{i}"] == "completed" for i in range(0, n, 2))  # interactive: always routed


def test_cluster_from_options_defaults_are_the_configs_and_units_convert():
    from replay.cluster import cluster_from_options

    instance = instance_config()
    plain = cluster_from_options(instance, 2)
    assert plain == ClusterConfig(instances=(instance,) * 2)
    assert plain.delays == ScalingDelays()
    given = cluster_from_options(instance, 2, router="least-load", scale=["5:+1"], weight_load_gbps=4.0,
                                 decode_instances=0, fail=["30:1"], failure_rate_per_hour=36.0, failure_seed=7)
    assert (given.router, given.scaling[0].delta, given.delays.weight_load_bandwidth_bytes_per_s) == ("least-load", 1, 4e9)
    assert (given.failure_rate_per_s, given.failure_seed) == (0.01, 7)
    assert given.failures[0].instance == 1 and given.decode_instances == ()
    disaggregated = cluster_from_options(instance, 1, decode_instances=2, kv_transfer_gbps=25.0)
    assert disaggregated.kv_transfer_bandwidth_bytes_per_s == 25e9 and disaggregated.decode_instances == (instance,) * 2
    scaled = cluster_from_options(instance, autoscaler="request-rate", autoscale_window_s=30.0)
    assert (scaled.autoscaler, scaled.autoscale_window_s, scaled.autoscale_interval_s) == ("request-rate", 30.0, 15.0)
    for kwargs, message in (
        ({"instances": 0}, "--instances must be at least 1, not 0"),
        ({"decode_instances": -1}, "--decode-instances must be between 1 and 10,000, not -1"),
        ({"instances": 10_001}, "--instances 10,001 is more than a cluster may hold: at most 10,000"),
        ({"kv_transfer_gbps": 25.0}, "--kv-transfer-gbps needs --decode-instances"),
        ({"decode_router": "gie"}, "--decode-router needs --decode-instances"),
        ({"decode_instances": 1, "decode_router": "nope"}, "--decode-router: unknown router 'nope'"),
        ({"instances": 2, "fail": ["5:0", "5:0"]}, "--fail 5:0 is given twice"),
        ({"autoscale_interval_s": 5.0}, "need --autoscaler"),
    ):
        with pytest.raises(ReplayError, match=message):
            cluster_from_options(instance, **kwargs)


def test_a_failure_of_an_instance_the_cluster_never_holds_is_refused_by_its_flag():
    """--fail 10:99 on one instance failed nothing, silently; --fail 10:-1 named InstanceFailure(...)."""
    from replay.cluster import cluster_from_options

    instance = instance_config()
    with pytest.raises(ReplayError, match=r"--fail 10:99 names instance 99, but the cluster holds at most 1 instance "
                                          r"\(indexes 0 to 0\)") as caught:
        cluster_from_options(instance, 1, fail=["10:99"])
    assert "--fail AT_S:INDEX" in caught.value.hint
    # scaled-up and autoscaled instances count (the autoscaler's default max_instances: 64)
    assert cluster_from_options(instance, 2, scale=["5:+1"], fail=["10:2"]).failures[0].instance == 2
    with pytest.raises(ReplayError, match="holds at most 3 instances"):
        cluster_from_options(instance, 2, scale=["5:+1"], fail=["10:3"])
    assert cluster_from_options(instance, 1, autoscaler="request-rate", fail=["10:63"]).failures[0].instance == 63
    with pytest.raises(ReplayError, match="holds at most 64 instances"):
        cluster_from_options(instance, 1, autoscaler="request-rate", fail=["10:64"])
    with pytest.raises(ReplayError, match="--fail 10:-1: the instance index must be 0 or more, not -1") as caught:
        cluster_from_options(instance, 1, fail=["10:-1"])
    assert caught.value.hint


@pytest.mark.parametrize(
    ("build", "message", "flag"),
    [
        # were "scaling delays must be non-negative" and "..._bytes_per_s must be positive", without a hint, or an
        # internal OverflowError once the replay scheduled them
        (lambda: ScalingDelays(startup_s=-1.0), "the scaling delay startup_s must be between 0 and 1e+09 s", "--startup-s"),
        (lambda: ScalingDelays(cache_warm_s=1e308), "cache_warm_s must be between 0 and 1e+09 s", "--cache-warm-s"),
        (lambda: ScalingDelays(weight_load_bandwidth_bytes_per_s=1e-300), "at least 0.001 GB/s", "--weight-load-gbps"),
        (lambda: ClusterConfig(instances=(instance_config(),), kv_transfer_bandwidth_bytes_per_s=0.0),
         "the KV transfer link must move at least 0.001 GB/s", "--kv-transfer-gbps"),
        (lambda: ClusterConfig(instances=(instance_config(),), kv_transfer_latency_s=1e300),
         "with a latency of 0 to 1e+09 s", "--kv-transfer-latency-s"),
        (lambda: ClusterConfig(instances=(instance_config(),), failure_rate_per_s=1e12),  # drew 3.6e15 failures
         "at most 10,000 failures expected in it", "--failure-rate-per-hour"),
        (lambda: ClusterConfig(instances=(instance_config(),), autoscaler="request-rate", autoscale_interval_s=1e-300),
         "the autoscaler's interval and window must be positive: between 0.1 and 1e+09 s", "--autoscale-interval-s"),
    ],
)
def test_out_of_range_cluster_settings_say_which_option_sets_them(build, message, flag):
    with pytest.raises(ReplayError, match=re.escape(message)) as caught:
        build()
    assert flag in caught.value.hint
