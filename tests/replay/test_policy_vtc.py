"""VTC fair share and per-tenant quotas: counters, lifting, weighted order and token buckets, checked by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest

from replay.config import EngineConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.errors import ReplayError
from replay.policies import VtcConfig
from replay.policies.tenancy import ClassConfig, Tenancy, TenantBook, TenantConfig
from replay.policies.vtc import FairShare
from replay.request import FINISHED, Request
from replay.views import RequestView
from tests.replay.conftest import make_workload

MS = 1_000_000
ONE_AT_A_TIME = dict(instance=instance_config(engine=EngineConfig(max_num_seqs=1)), cost_model="constant",
                     cost_model_config=ConstantCostConfig(step_time_ns=10 * MS))


def two_tenants(n: int):
    """n requests of tenant A at 0, then n of B at 1 ns; 10 prompt and 5 output tokens each."""
    ids = [f"a{i}" for i in range(n)] + [f"b{i}" for i in range(n)]
    return make_workload([0] * n + [1] * n, [10] * (2 * n), [5] * (2 * n), request_id=ids,
                         tenant=["A"] * n + ["B"] * n)


def served_order(out) -> list[str]:
    return [r["request_id"] for r in sorted(out.requests.to_pylist(), key=lambda r: r["scheduled_ns"])]


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_vtc_alternates_between_equal_tenants(run, mode):
    # one request in service at a time; a request's service is 10 input x 1 + 4 decoded tokens x 2 = 18
    # (its first token comes with the prefill). After a0, A has 18 and B 0: b0; then a tie (18, 18),
    # broken by who queued first (A): a1; and so on. FCFS serves all of A first.
    w = two_tenants(4)
    assert served_order(run(w, mode=mode, **ONE_AT_A_TIME)) == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    vtc = run(w, policy_name="vtc", mode=mode, **ONE_AT_A_TIME)
    assert served_order(vtc) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


def test_vtc_divides_service_by_the_entitlement_weight(run):
    # B's weight is 2: each of its requests adds 9 to its counter, A's 18:
    # a0 (A 18), b0 (B 9), b1 (18, tie: A queued first), a1 (36), b2 (27), b3 (36, tie), a2 (54), b4, b5
    tenancy = Tenancy(tenants=(TenantConfig(name="B", service_class="default", weight=2.0),))
    out = run(two_tenants(6), policy_name="vtc", policy_config=VtcConfig(tenancy=tenancy), **ONE_AT_A_TIME)
    assert served_order(out)[:9] == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "b4", "b5"]


def test_a_returning_tenant_is_lifted_to_the_smallest_active_counter():
    fair = FairShare(TenantBook(Tenancy()), 1, 2)
    a = RequestView(Request(0, "a", 0, 10, tenant="A"))
    b = RequestView(Request(1, "b", 0, 10, tenant="B"))
    fair.arrive(a)
    fair.arrive(b)
    fair.counters.update({"A": Fraction(100), "B": Fraction(40), "C": Fraction(0), "D": Fraction(60)})
    assert fair.lifted("C") == 40  # idle with 0: lifted to min(100, 40), so idleness is not banked
    assert fair.lifted("D") == 60  # already above it: keeps its own
    assert fair.lifted("A") == 100  # active tenants are never lifted
    b._r.state = FINISHED  # B leaves: only A is active now
    assert fair.lifted("C") == 100
    fair.arrive(RequestView(Request(2, "c", 0, 10, tenant="C")))
    assert fair.counters["C"] == 100


def test_observe_counts_input_once_and_output_twice():
    fair = FairShare(TenantBook(Tenancy()), 1, 2)
    prefill = Request(0, "p", 0, 100, tenant="A")
    prefill.num_computed = 100  # its prompt's last chunk just computed: counted as input
    decode = Request(1, "d", 0, 100, tenant="A")
    decode.num_computed = 150
    fair.observe([RequestView(prefill), RequestView(decode)], [64, 1], 3)
    assert fair.counters["A"] == 64 * 3 * 1 + 1 * 3 * 2


def test_rate_quota_is_a_token_bucket_with_retry_after(run):
    # bucket of 200 service units refilled at 100/s; each request is charged 50 prompt + 25 x 2 = 100:
    # the first two pass (the second finds 100.1), the third at 2 ms finds 0.2 and must wait
    # (100 - 0.2) / 100 = 0.998 s
    tenancy = Tenancy(tenants=(TenantConfig(name="q", service_class="default", max_service_per_s=100.0,
                                            burst_service=200.0),))
    config = VtcConfig(tenancy=tenancy, quota_output_tokens=25, quota_retry_after_min_s=0.0)
    w = make_workload([0, 1 * MS, 2 * MS], [50, 50, 50], [3, 3, 3], tenant=["q"] * 3)
    out = run(w, policy_name="vtc", policy_config=config, **ONE_AT_A_TIME)
    assert [out.row(r)["outcome"] for r in ("r0", "r1", "r2")] == ["completed", "completed", "rejected"]
    (d,) = [e for e in out.of_type("admission_decided") if e["request_id"] == "r2"]
    assert d["reason"] == "tenant over its service-rate quota"
    assert d["retry_after_s"] == pytest.approx(0.998)


def test_concurrency_quota(run):
    tenancy = Tenancy(tenants=(TenantConfig(name="q", service_class="default", max_concurrent_requests=1),))
    w = make_workload([0, 1 * MS, 100 * MS], [50, 50, 50], [3, 3, 3], tenant=["q"] * 3)
    out = run(w, policy_name="vtc", policy_config=VtcConfig(tenancy=tenancy), **ONE_AT_A_TIME)
    # r1 arrives while r0 runs (3 steps, until 30 ms): rejected; r2 arrives after r0 left: accepted
    assert [out.row(r)["outcome"] for r in ("r0", "r1", "r2")] == ["completed", "rejected", "completed"]
    (d,) = [e for e in out.of_type("admission_decided") if e["request_id"] == "r1"]
    assert d["reason"].startswith("tenant over its concurrency quota") and d["retry_after_s"] == 1.0


def test_tenancy_is_validated_and_classes_come_from_it():
    with pytest.raises(ReplayError, match="not defined"):
        Tenancy(tenants=(TenantConfig(name="x", service_class="gold"),))
    with pytest.raises(ReplayError, match="default class"):
        Tenancy(classes=(ClassConfig(name="a"),), default_class="b")
    tenancy = Tenancy(classes=(ClassConfig(name="gold", priority=0), ClassConfig(name="free", priority=9)),
                      tenants=(TenantConfig(name="payer", service_class="gold"),), default_class="free")
    book = TenantBook(tenancy)
    # an unlisted tenant claiming "gold" gets the default; the listed tenant gets its entitlement
    claim = RequestView(Request(0, "r", 0, 1, tenant="stranger", service_class="gold"))
    assert book.class_of(claim).name == "free"
    assert book.class_of(RequestView(Request(1, "s", 0, 1, tenant="payer", service_class="free"))).name == "gold"
