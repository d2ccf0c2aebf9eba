"""Views: k-anonymous aggregates with visible suppression, tenant-scoped detail, coarsened exports."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.keys import rotate
from privacy.views import TenantScope, coarsen_ns, k_anonymous
from replay.workload import burstiness


def _requests(con, rows):
    table = pa.table(
        {
            "tenant": [r[0] for r in rows],
            "request_id": [f"r{i}" for i in range(len(rows))],
            "service_class": [r[1] for r in rows],
            "ttft_s": [r[2] for r in rows],
        }
    )
    con.register("requests", table)


def test_small_cells_are_suppressed_and_counted_not_hidden():
    con = duckdb.connect()
    rows = [(f"t{i % 6}", "interactive", 0.1 * i) for i in range(30)]  # 6 tenants, 30 requests
    rows += [("t0", "batch", 1.0), ("t1", "batch", 2.0)]  # 2 tenants, 2 requests
    _requests(con, rows)
    result = k_anonymous(con, "requests", ["service_class"], {"p50_ttft_s": "median(ttft_s)"}, k=5)
    cells = {r["service_class"]: r for r in result.table.to_pylist()}
    assert result.num_suppressed == 1
    assert cells["batch"]["suppressed"] and cells["batch"]["p50_ttft_s"] is None
    assert cells["batch"]["num_tenants"] is None and cells["batch"]["num_requests"] is None
    assert "fewer than 5 tenants" in cells["batch"]["suppressed_reason"]
    assert not cells["interactive"]["suppressed"]
    assert cells["interactive"]["num_tenants"] == 6 and cells["interactive"]["num_requests"] == 30
    assert cells["interactive"]["p50_ttft_s"] == np.median([0.1 * i for i in range(30)])


def test_many_requests_from_one_tenant_are_still_suppressed():
    con = duckdb.connect()
    _requests(con, [("t0", "interactive", 0.2)] * 100)
    assert k_anonymous(con, "requests", ["service_class"], {"n": "count(*)"}, k=5).num_suppressed == 1


def test_tenant_scope_finds_own_rows_across_a_key_rotation(keyring):
    rotated = rotate(keyring, "test-2")
    mine_old = keyring.pseudonym("tn", "acme")
    mine_new = rotated.pseudonym("tn", "acme")
    theirs = rotated.pseudonym("tn", "globex")
    con = duckdb.connect()
    con.register("requests", pa.table({"tenant": [mine_old, mine_new, theirs], "ttft_s": [0.1, 0.2, 0.3]}))
    predicate, params = TenantScope.for_tenant(rotated, "acme").where()
    rows = con.execute(f"SELECT ttft_s FROM requests WHERE {predicate} ORDER BY ttft_s", params).fetchall()
    assert rows == [(0.1,), (0.2,)]


def test_coarsened_exports_keep_order_and_burst_structure(shared):
    from replay.traces import read_trace

    arrivals = read_trace("azure-conv", shared)["arrival_ns"].to_numpy()
    coarse = coarsen_ns(arrivals, 100_000_000)
    assert np.all(np.diff(coarse) >= 0)  # order kept
    assert np.all(coarse % 100_000_000 == 0) and np.all(arrivals - coarse < 100_000_000)
    before, after = burstiness(arrivals), burstiness(coarse)
    assert abs(after.peak_to_mean_1s - before.peak_to_mean_1s) / before.peak_to_mean_1s < 0.10
    assert abs(after.peak_to_mean_10s - before.peak_to_mean_10s) / before.peak_to_mean_10s < 0.05


def _cells(result):
    return {r["service_class"]: r for r in result.table.to_pylist()}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["a", "b", "c"]), st.floats(0, 10)), max_size=60),
       st.integers(1, 6), st.integers(1, 6))
def test_counting_rows_equals_counting_distinct_requests_when_each_row_is_one_request(rows, k, min_tenants):
    con = duckdb.connect()
    _requests(con, [(f"t{t}", c, x) for t, c, x in rows])  # request ids r0, r1, ...: one row each
    args = ("requests", ["service_class"], {"p50_ttft_s": "median(ttft_s)", "n": "count(*)"})
    distinct = k_anonymous(con, *args, k=k, min_tenants=min_tenants)
    counted = k_anonymous(con, *args, k=k, min_tenants=min_tenants, one_row_per_request=True)
    assert counted.table.equals(distinct.table)
    assert counted.num_suppressed == distinct.num_suppressed


def test_a_cell_of_fewer_than_k_requests_is_still_suppressed_when_rows_are_counted():
    con = duckdb.connect()
    rows = [(f"t{i}", "small", 1.0) for i in range(4)]  # 4 tenants, 4 requests
    rows += [(f"t{i}", "exact", 2.0) for i in range(5)]  # 5 and 5: the threshold itself passes
    rows += [("t0", "one-tenant", 3.0)] * 50  # many requests, one tenant
    _requests(con, rows)
    for min_tenants in (1, 3):  # a tenant threshold that alone would let "small" through
        result = k_anonymous(con, "requests", ["service_class"], {"mean_ttft_s": "avg(ttft_s)"}, k=5,
                             min_tenants=min_tenants, one_row_per_request=True)
        cells = _cells(result)
        assert cells["small"]["suppressed"] and cells["small"]["num_requests"] is None
        assert cells["small"]["mean_ttft_s"] is None and "5 requests" in cells["small"]["suppressed_reason"]
        assert not cells["exact"]["suppressed"] and cells["exact"]["num_requests"] == 5
        assert cells["one-tenant"]["suppressed"] == (min_tenants > 1)
    cells = _cells(k_anonymous(con, "requests", ["service_class"], {}, k=5, one_row_per_request=True))
    assert cells["one-tenant"]["suppressed"] and cells["one-tenant"]["num_tenants"] is None
    assert k_anonymous(con, "requests", [], {}, k=60, min_tenants=1, one_row_per_request=True).num_suppressed == 1


def test_counting_rows_overstates_a_request_spread_over_rows_so_the_precondition_matters():
    con = duckdb.connect()
    con.register("requests", pa.table({
        "tenant": [f"t{i}" for i in range(5)] * 2,
        "request_id": ["r0", "r1", "r0", "r1", "r0"] * 2,  # 2 requests on 10 rows
        "service_class": ["interactive"] * 10,
    }))
    assert k_anonymous(con, "requests", ["service_class"], {}, k=5, min_tenants=1).num_suppressed == 1
    overstated = k_anonymous(con, "requests", ["service_class"], {}, k=5, min_tenants=1, one_row_per_request=True)
    assert overstated.num_suppressed == 0  # why callers must check uniqueness where the relation is built
