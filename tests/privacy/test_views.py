"""Views: k-anonymous aggregates with visible suppression, tenant-scoped detail, coarsened exports."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

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
