"""Autoscaling in the cluster replay: the autoscaler is consulted every interval with the load measured
over the last window, its decisions go through the cluster's scaling path (delays, draining), it never
sees the workload's future, and the fast mode decides as the reference does."""

from __future__ import annotations

import dataclasses

import pyarrow.parquet as pq
import pytest

from replay.cluster import ClusterConfig, ScalingDelays, cluster_config, run_cluster_replay
from replay.errors import ReplayError
from replay.policies.autoscale import RequestRateConfig, WorkloadAwareConfig
from tests.replay.conftest import make_workload

S = 1_000_000_000
MS = 1_000_000
DELAYS = ScalingDelays(startup_s=1.0, weight_load_s=1.0, cache_warm_s=0.0)


def _states(summary) -> list[tuple[float, int, str, str | None]]:
    """(seconds after the first arrival, instance number, state, scale action) of every instance_state event."""
    events = pq.read_table(summary.events_path).to_pylist()
    t0 = min(e["ts_ns"] for e in events if e["event_type"] == "request_arrived")
    return [((e["ts_ns"] - t0) / S, int(e["instance_id"].rsplit("-i", 1)[1]), e["state"], e["scale_action"])
            for e in events if e["event_type"] == "instance_state"]


def _phases(*phases: tuple[float, float], prompt_tokens: int = 300, output_tokens: int = 40):
    """Arrivals at a steady rate per phase: (requests per second, until second), one after the other."""
    arrivals: list[int] = []
    start_ns = 0
    for rate, until_s in phases:
        gap_ns = round(S / rate)
        t = start_ns
        while t < round(until_s * S):
            arrivals.append(t)
            t += gap_ns
        start_ns = round(until_s * S)
    n = len(arrivals)
    return make_workload(arrivals, [prompt_tokens + 7 * (i % 13) for i in range(n)],
                         [output_tokens + i % 23 for i in range(n)])


def _burst():
    """2 req/s until 20 s, 12 req/s until 40 s, then 1 req/s until 80 s."""
    return _phases((2, 20.0), (12, 40.0), (1, 80.0))


def _autoscaled(name: str, config, **kwargs) -> ClusterConfig:
    return dataclasses.replace(cluster_config(1, router="least-outstanding-tokens", delays=DELAYS),
                               autoscaler=name, autoscaler_config=config, **kwargs)


def test_request_rate_scales_up_where_the_window_says_and_down_after_the_hold(tmp_path):
    # consulted every 5 s on the last 10 s. Until 20 s: 2 req/s at most, one instance (target 4 req/s).
    # At 25 s the window (15, 25] holds 9 light arrivals (15.5 .. 19.5 s) and 61 of the burst (20 s +
    # k / 12 s, k = 0 .. 60): 7 req/s -> 2 instances: the second starts at 25 s and is ready 2 s later
    # (start-up 1 s + weights 1 s). At 30 s, (20, 30] holds 120 burst arrivals (k = 1 .. 120; the one at
    # 20 s was at the window's edge): 12 req/s -> 3. No 10 s window holds more than 120: never more than
    # 3. After the burst, 1 req/s wants 1 again, and the scale-downs wait 10 s after the last change.
    config = _autoscaled("request-rate", RequestRateConfig(target_requests_per_s=4.0, scale_down_delay_s=10.0),
                         autoscale_interval_s=5.0, autoscale_window_s=10.0)
    summary = run_cluster_replay(_burst(), config, out_dir=tmp_path, check_invariants=True)
    import json

    decisions = json.loads(summary.manifest_path.read_text())["cluster"]["autoscaler"]["decisions"]
    assert [(d["at_s"], d["num_instances_before"], d["num_instances_wanted"]) for d in decisions[:6]] == [
        (5.0, 1, 1), (10.0, 1, 1), (15.0, 1, 1), (20.0, 1, 1), (25.0, 1, 2), (30.0, 2, 3)]
    assert decisions[4]["reason"] == "7.00 req/s / 4 per instance"
    states = _states(summary)
    ups = [(t, i, s) for t, i, s, a in states if a == "scale_up"]
    assert ups[:4] == [(25.0, 1, "starting"), (27.0, 1, "ready"), (30.0, 2, "starting"), (32.0, 2, "ready")]
    assert len(summary.instances) == 3
    downs = [(t, i, s) for t, i, s, a in states if a == "scale_down"]
    assert downs and all(t >= 40.0 for t, _, _ in downs)
    assert {s for _, _, s in downs} <= {"draining", "stopped"}
    # the newest goes first, and at least ten seconds after the last change
    first_down = min(t for t, _, _ in downs)
    assert [i for t, i, s in downs if s == "draining"][0] == 2 and first_down - 30.0 >= 10.0
    assert summary.num_requests == 40 + 241 + 40  # the burst's gap is 83,333,333 ns: 241 fit before 40 s


def test_the_autoscaler_never_sees_the_future(tmp_path):
    # two workloads alike until 30 s (a burst of long requests from 10 to 20 s), one with a second burst
    # after 30 s: every scaling event up to 30 s is the same (the tick at 30 s runs before the arrivals
    # of that instant), and there are some
    config = _autoscaled("workload-aware", WorkloadAwareConfig(scale_down_delay_s=10.0), autoscale_interval_s=5.0,
                         autoscale_window_s=10.0)
    long = dict(prompt_tokens=2000, output_tokens=400)
    calm = _phases((2, 10.0), (24, 20.0), (2, 60.0), **long)
    stormy = _phases((2, 10.0), (24, 20.0), (2, 30.0), (24, 60.0), **long)
    a = [x for x in _states(run_cluster_replay(calm, config, out_dir=tmp_path / "a")) if x[0] <= 30.0]
    b = [x for x in _states(run_cluster_replay(stormy, config, out_dir=tmp_path / "b")) if x[0] <= 30.0]
    assert a == b and any(action == "scale_up" for _, _, _, action in a)
    later = _states(run_cluster_replay(stormy, config, out_dir=tmp_path / "c"))
    assert any(t > 30.0 and action == "scale_up" for t, _, _, action in later)  # it does react to the burst


def test_fast_and_reference_modes_scale_alike_on_a_trace(shared, tmp_path):
    from replay.derive import derive_requests
    from replay.traces import read_trace
    from replay.workload import scale_rate

    w = scale_rate(read_trace("azure-conv", shared).slice(0, 1500), 4)
    config = _autoscaled("workload-aware", WorkloadAwareConfig(scale_down_delay_s=20.0), autoscale_interval_s=5.0,
                         autoscale_window_s=15.0)
    fast = run_cluster_replay(w, config, out_dir=tmp_path / "fast", check_invariants=True)
    ref = run_cluster_replay(w, config, out_dir=tmp_path / "ref", mode="reference")
    assert _states(fast) == _states(ref)
    assert len(fast.instances) > 1  # it did scale
    cols = ["request_id", "instance_id", "arrival_ns", "scheduled_ns", "first_token_ns", "finish_ns", "outcome",
            "num_output_tokens"]
    f = derive_requests(fast.events_path).select(cols).sort_by("request_id").to_pylist()
    r = derive_requests(ref.events_path).select(cols).sort_by("request_id").to_pylist()
    for row in f + r:
        row["instance_id"] = row["instance_id"].rsplit("-", 1)[1]
    assert f == r and len(f) == 1500


def test_autoscaler_settings_are_checked_and_recorded(tmp_path):
    with pytest.raises(ReplayError) as err:
        _autoscaled("hpa-ish", None)
    assert "request-rate" in str(err.value.hint) and "workload-aware" in str(err.value.hint)
    with pytest.raises(ReplayError, match="positive"):
        _autoscaled("request-rate", None, autoscale_interval_s=0.0)
    import json

    summary = run_cluster_replay(_phases((2, 4.0)), _autoscaled("request-rate", None), out_dir=tmp_path)
    manifest = json.loads(summary.manifest_path.read_text())
    assert manifest["cluster"]["autoscaler"]["name"] == "request-rate"
    assert manifest["cluster"]["autoscaler"]["config"]["target_requests_per_s"] == 8.0
    # every consultation, with its reason: 2 req/s until 4 s, consulted at 15 s (the requests still run)
    # or not at all (all done before), never more than one instance
    for d in manifest["cluster"]["autoscaler"]["decisions"]:
        assert d["num_instances_wanted"] == 1 and "req/s" in d["reason"]
    plain = run_cluster_replay(_phases((2, 4.0)), cluster_config(1, delays=DELAYS), out_dir=tmp_path / "plain")
    assert "autoscaler" not in json.loads(plain.manifest_path.read_text())["cluster"]


def test_workload_aware_scales_for_what_the_requests_ask_request_rate_does_not(tmp_path):
    # the same arrivals (2 req/s, then 24 req/s for 30 s) with 20-token or 400-token outputs: request-rate
    # (8 req/s per instance) starts the same instances for both; workload-aware starts more for the
    # long outputs than for the short ones (3 against 2 when this was written)
    def most(summary) -> int:
        return len(summary.instances)

    short = _phases((2, 10.0), (24, 40.0), prompt_tokens=2000, output_tokens=20)
    long = _phases((2, 10.0), (24, 40.0), prompt_tokens=2000, output_tokens=400)
    rr = _autoscaled("request-rate", RequestRateConfig(target_requests_per_s=8.0), autoscale_interval_s=5.0,
                     autoscale_window_s=10.0)
    wa = _autoscaled("workload-aware", WorkloadAwareConfig(), autoscale_interval_s=5.0, autoscale_window_s=10.0)
    rr_short, rr_long = (run_cluster_replay(w, rr, out_dir=tmp_path / f"rr{i}") for i, w in enumerate((short, long)))
    wa_short, wa_long = (run_cluster_replay(w, wa, out_dir=tmp_path / f"wa{i}") for i, w in enumerate((short, long)))
    assert most(rr_short) == most(rr_long) == 3  # ceil(24 / 8), whatever the outputs
    assert most(wa_long) > most(wa_short), (most(wa_short), most(wa_long))


def test_an_autoscaler_consulted_without_end_stops_with_the_likely_cause(tmp_path, monkeypatch):
    """A request 146 years after the others (a clock gone wrong) kept a replay consulting its autoscaler every
    15 s for minutes without end; the bound (2M consultations, about a minute) is lowered here to 40."""
    import replay.autoscaling

    monkeypatch.setattr(replay.autoscaling, "MAX_CONSULTATIONS", 40)
    late = make_workload([0, 1 * S, 2 * S, 3_600 * S], [300] * 4, [40] * 4)  # an hour: 240 consultations of 15 s
    with pytest.raises(ReplayError, match="consulted 40 times, every 15 s for 0.0 days of the workload") as err:
        run_cluster_replay(late, _autoscaled("request-rate", None), out_dir=tmp_path / "late")
    assert "a clock gone wrong" in err.value.hint
    early = make_workload([0, 1 * S, 2 * S, 500 * S], [300] * 4, [40] * 4)  # 34 consultations: within the bound
    assert run_cluster_replay(early, _autoscaled("request-rate", None), out_dir=tmp_path / "early").num_requests == 4
