"""Metrics of a request table: hand-checked on a tiny run, tenants through the k-anonymous helper."""

from __future__ import annotations

import pyarrow as pa
import pytest

from privacy.views import TenantScope
from replay.derive import derive_requests
from replay.metrics import ClassObjectives, CostConfig, MetricsConfig, TenantWeight, run_metrics, tenant_metrics
from schemas.arrow import events_to_table
from schemas.events import FirstToken, RequestArrived, RequestFinished, StepExecuted, TokensDelivered

S = 1_000_000_000
T0 = 1_764_000_000 * S
CONFIG = MetricsConfig(
    classes=(ClassObjectives(name="interactive", ttft_s=0.5, itl_s=0.2, e2e_s=5.0, max_queue_s=1.0),),
    window_s=10.0,
    cost=CostConfig(accelerator_hour_price=3600.0, currency="USD"),  # 1 USD per accelerator-second
)


def _request(rid: str, tenant: str, arrival_s: float, ttft_s: float | None, outcome: str, tokens: int = 3) -> list:
    env = {"engine_id": "e", "instance_id": "i0", "tenant": tenant, "service_class": "interactive", "request_id": rid}
    t = T0 + int(arrival_s * S)
    events = [RequestArrived(event_id=f"{rid}:a", ts_ns=t, num_prompt_tokens=10, **env)]
    if ttft_s is not None:
        first = t + int(ttft_s * S)
        events += [
            FirstToken(event_id=f"{rid}:f", ts_ns=first, **env),
            TokensDelivered(event_id=f"{rid}:d", ts_ns=first + int(0.1 * S) * (tokens - 1), num_tokens=tokens - 1, **env),
        ]
    events.append(RequestFinished(event_id=f"{rid}:z", ts_ns=t + 2 * S, outcome=outcome,
                                  num_output_tokens=tokens if ttft_s is not None else 0, **env))
    return events


def _run() -> tuple[pa.Table, pa.Table]:
    events = (
        _request("r1", "tn_a", 0.0, 0.2, "completed")  # good
        + _request("r2", "tn_a", 1.0, 0.9, "completed")  # TTFT 0.9 > 0.5: a miss
        + _request("r3", "tn_b", 2.0, None, "rejected")  # rejected: a miss, no output
        + _request("r4", "tn_b", 10.0, 0.3, "completed")  # good, second window
    )
    step = StepExecuted(event_id="s1", ts_ns=T0 + 3 * S, engine_id="e", instance_id="i0", step_index=0, start_ns=T0 + S,
                        end_ns=T0 + 3 * S, num_prefill_tokens=30, num_decode_seqs=0, request_ids=["r1", "r2"],
                        request_num_tokens=[10, 30], num_kv_blocks_used=1, num_kv_blocks_free=1)
    table = events_to_table(events + [step])
    return derive_requests(table), table


def _value(values, name, scope="overall", group=""):
    (found,) = [v for v in values if v.name == name and v.scope == scope and v.group == group]
    return found.value


def test_goodput_attainment_and_shares_are_hand_checked():
    requests, events = _run()
    values = run_metrics(requests, events, CONFIG)
    # span: first arrival (0 s) to the last token (r4: 10 s + 0.3 s + 2 x 0.1 s = 10.5 s)
    assert _value(values, "goodput_rps") == pytest.approx(2 / 10.5)
    assert _value(values, "goodput_tokens_per_s") == pytest.approx(6 / 10.5)  # r1 and r4, 3 tokens each
    assert _value(values, "attainment") == 0.5  # 2 good of 4 arrived: the rejection counts as a miss
    assert _value(values, "attainment_ttft") == 0.5
    assert _value(values, "rejected_share") == 0.25
    assert _value(values, "ttft_p50_s") == pytest.approx(0.3)  # of 0.2, 0.3, 0.9
    assert _value(values, "attainment", "class", "interactive") == 0.5
    assert _value(values, "num_requests", "window", "0") == 3 and _value(values, "num_requests", "window", "10") == 1


def test_fairness_counts_vtc_service_per_entitlement():
    requests, events = _run()
    weighted = MetricsConfig(classes=CONFIG.classes, window_s=10.0, tenant_weights=(TenantWeight(tenant="tn_a", weight=2.0),))
    # service = input x 1 + output x 2: tn_a 2 x (10 + 6) = 32, over weight 2 -> 16; tn_b (10 + 6) = 16 (r3 got nothing)
    assert _value(run_metrics(requests, events, weighted), "jain_index") == pytest.approx(1.0)
    assert _value(run_metrics(requests, events, CONFIG), "jain_index") == pytest.approx((32 + 16) ** 2 / (2 * (32**2 + 16**2)))


def test_cost_and_idle_share_come_from_the_steps():
    requests, events = _run()
    values = run_metrics(requests, events, CONFIG)
    # one instance over the 10.5 s span; busy 2 s; price 1 per accelerator-second; 6 goodput tokens
    assert _value(values, "accelerator_seconds") == pytest.approx(10.5)
    assert _value(values, "idle_share") == pytest.approx(1 - 2 / 10.5)
    assert _value(values, "cost_per_1k_goodput_tokens_usd") == pytest.approx(10.5 / (6 / 1000))


def test_tenant_cost_attribution_charges_reserved_work_and_stays_k_anonymous():
    requests, events = _run()
    table, suppressed = tenant_metrics(requests, events, CONFIG, k=2)
    rows = {r["tenant"]: r for r in table.to_pylist()}
    # the 2 s step is split by tokens processed: r1 10 of 40, r2 30 of 40; both tn_a's
    assert rows["tn_a"]["accelerator_seconds"] == pytest.approx(2.0)
    assert rows["tn_a"]["cost_usd"] == pytest.approx(2.0)
    assert "ttft_p99_s" not in table.column_names  # no per-tenant timing across tenants
    assert suppressed == 0 and not rows["tn_b"]["suppressed"]
    _, suppressed = tenant_metrics(requests, events, CONFIG, k=3)  # 2 requests each: below k = 3
    assert suppressed == 2


def test_a_tenant_sees_its_own_timing_in_scope():
    requests, events = _run()
    scope = TenantScope(frozenset({"tn_a"}))
    table, _ = tenant_metrics(requests, events, CONFIG, scope=scope)
    assert table["tenant"].to_pylist() == ["tn_a"]
    assert table["ttft_p99_s"][0].as_py() == pytest.approx(0.2 + 0.99 * (0.9 - 0.2))


def test_window_metrics_are_summarize_over_each_windows_requests(tmp_path, shared):
    """The per-window figures (one pass in window order) equal ``summarize`` over each window's requests."""
    import dataclasses

    import numpy as np
    import pyarrow.parquet as pq

    from replay.metrics import _subset, load_requests, summarize, window_metrics
    from replay.presets import prepared_workload
    from replay.run import run_replay
    from replay.traces import read_trace

    workload, preset = prepared_workload(read_trace("azure-conv", shared).slice(0, 3000), "azure-conv", shape=_twice())
    summary = run_replay(workload, scenario=preset.scenario, policy_name="fcfs", out_dir=tmp_path)
    config = dataclasses.replace(preset.metrics, window_s=10.0)
    r = load_requests(pq.read_table(summary.requests_path), config)
    got = window_metrics(r, config)
    windows = np.floor(r.arrival_s / config.window_s).astype(np.int64)
    names = [m.name for m in got[:7]]
    expected = []
    for w in np.unique(windows):
        values = summarize(_subset(r, windows == w), None, config, scope="window", group=f"{w * config.window_s:g}",
                           span_s=config.window_s)
        expected += sorted((m for m in values if m.name in names), key=lambda m: names.index(m.name))
    assert len(np.unique(windows)) > 10 and got == expected


def _twice():
    from replay.presets import LoadShape

    return LoadShape(load=2)


def test_metrics_over_a_span_of_decades_between_two_requests_stay_sparse():
    """Per-window and per-second figures are built over the windows that hold arrivals: a request 30 years
    after the others (a clock gone wrong) used to allocate every second between them (gigabytes)."""
    requests, events = _run()
    late = events_to_table(_request("r5", "tn_b", 1e9, 0.3, "completed"))
    far_events = pa.concat_tables([events, late])
    values = run_metrics(derive_requests(far_events), far_events, CONFIG)
    near = run_metrics(requests, events, CONFIG)
    # flaps: rejecting in second 2 only, so on at 2 and off at 3: 2 switches, over each run's own span
    assert _value(near, "admission_flaps_per_hour") == pytest.approx(2 / (10.5 / 3600))
    assert _value(values, "admission_flaps_per_hour") == pytest.approx(2 / ((1e9 + 0.5) / 3600))
    # the backlog gap of the first window (tn_a 32 against tn_b's 0) is unchanged; r5's window has one tenant
    assert _value(values, "max_backlogged_service_gap") == _value(near, "max_backlogged_service_gap") == 32
