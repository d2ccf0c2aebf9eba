"""Scenarios: explicit, seeded, batch-independent assumptions that fill only what a trace lacks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay.errors import ReplayError
from replay.scenario import Scenario, ServiceClassSpec, Share, TenantSpec, apply_scenario, uniform
from replay.traces import read_trace
from tests.replay.conftest import make_workload

SCENARIO = Scenario(
    name="two-tenants",
    tenants=(TenantSpec(name="acme", share=3, weight=2.0), TenantSpec(name="globex", share=1)),
    service_classes=(
        ServiceClassSpec(name="interactive", share=1, ttft_objective_s=0.5, e2e_objective_s=30.0),
        ServiceClassSpec(name="batch", share=1, max_output_tokens=64),
    ),
    models=(Share(name="llama-3-8b", share=1),),
    adapters=(Share(name="", share=1), Share(name="sql-lora", share=1)),
    parallel_sampling_share=0.1,
    num_branches=4,
    cancel_share=0.2,
    cancel_after_s_min=1.0,
    cancel_after_s_max=5.0,
)


def _apply(table: pa.Table, scenario: Scenario, seed: int, batch_rows: int) -> pa.Table:
    out, offset = [], 0
    for batch in table.to_batches(max_chunksize=batch_rows):
        out.append(apply_scenario(batch, scenario, seed, offset))
        offset += batch.num_rows
    return pa.Table.from_batches(out)


def test_assignments_are_seeded_and_do_not_depend_on_batching(shared):
    w = read_trace("azure-conv", shared).slice(0, 10_000)
    a = _apply(w, SCENARIO, seed=5, batch_rows=10_000)
    assert a.equals(_apply(w, SCENARIO, seed=5, batch_rows=777))
    assert not a.equals(_apply(w, SCENARIO, seed=6, batch_rows=10_000))
    # what the trace records is untouched
    for name in ("request_id", "arrival_ns", "num_prompt_tokens", "num_output_tokens"):
        assert a[name].equals(w[name])


def test_shares_and_ranges(shared):
    a = _apply(read_trace("azure-conv", shared).slice(0, 10_000), SCENARIO, seed=5, batch_rows=4096)
    tenants = a["tenant"].to_pylist()
    assert tenants.count("acme") / len(tenants) == pytest.approx(0.75, abs=0.02)
    assert set(a["service_class"].to_pylist()) == {"interactive", "batch"}
    assert set(a["model"].to_pylist()) == {"llama-3-8b"}
    assert set(a["adapter"].to_pylist()) == {None, "sql-lora"}
    branches = np.asarray(a["num_branches"].to_pylist())
    assert set(branches) == {1, 4} and np.mean(branches == 4) == pytest.approx(0.1, abs=0.015)
    cancels = [c for c in a["cancel_after_ns"].to_pylist() if c is not None]
    assert len(cancels) / a.num_rows == pytest.approx(0.2, abs=0.015)
    assert 1e9 <= min(cancels) and max(cancels) < 5e9


def test_recorded_values_are_kept_unless_overwrite(shared):
    w = read_trace("burstgpt-1", shared)  # records the model of every request
    kept = _apply(w, Scenario(models=(Share(name="other", share=1),)), seed=1, batch_rows=100)
    assert kept["model"].equals(w["model"])
    replaced = _apply(w, Scenario(models=(Share(name="other", share=1),), overwrite=True), seed=1, batch_rows=100)
    assert set(replaced["model"].to_pylist()) == {"other"}
    assert _apply(w, Scenario(), seed=1, batch_rows=100).equals(w)  # the empty scenario adds nothing


def test_uniform_draws_are_uniform_and_independent_streams():
    idx = np.arange(100_000)
    u1, u2 = uniform(0, 1, idx), uniform(0, 2, idx)
    assert 0 <= u1.min() and u1.max() < 1 and abs(u1.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(u1, u2)[0, 1]) < 0.01


def test_objectives_become_deadlines_and_class_limits_cap_output(run):
    w = make_workload([0, 0], [10, 10], [200, 200], service_class=["interactive", "batch"])
    out = run(w, scenario=SCENARIO)
    arrived = {e["request_id"]: e for e in out.of_type("request_arrived")}
    assert arrived["r0"]["ttft_deadline_ns"] == 500_000_000 and arrived["r0"]["e2e_deadline_ns"] == 30_000_000_000
    assert arrived["r1"]["ttft_deadline_ns"] is None and arrived["r1"]["max_output_tokens"] == 64
    assert out.row("r1")["num_output_tokens"] == 64 and out.row("r0")["num_output_tokens"] == 200
    # labels travel on every request-scoped event
    labelled = [e for e in out.events.to_pylist() if e["request_id"] == "r0"]
    assert {e["service_class"] for e in labelled} == {"interactive"} and None not in {e["tenant"] for e in labelled}


def test_invalid_scenarios_say_what_is_wrong():
    with pytest.raises(ReplayError, match="cancel_share must be in"):
        Scenario(cancel_share=1.5)
    with pytest.raises(ReplayError, match="tenant shares"):
        Scenario(tenants=(TenantSpec(name="a", share=0),))


def test_a_recorded_class_the_scenario_does_not_define_is_an_error_listing_its_classes():
    batch = make_workload([0, 1], [5, 5], [1, 1], service_class=["batch", "platinum"]).to_batches()[0]
    with pytest.raises(ReplayError, match=r"scenario 'two-tenants': the workload's service_class 'platinum' \(row 11\) "
                                          r"is not one of its classes\n  hint: valid classes: interactive, batch"):
        apply_scenario(batch, SCENARIO, seed=1, row_offset=10)
    relabelled = apply_scenario(batch, Scenario(service_classes=SCENARIO.service_classes, overwrite=True), 1, 0)
    assert set(relabelled.column("service_class").to_pylist()) <= {"interactive", "batch"}
