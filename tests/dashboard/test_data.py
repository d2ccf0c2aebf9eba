"""The lake queries agree with the one metrics code path (replay.metrics) and stay k-anonymous."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dashboard import data
from dashboard.data import NS, Selection, TimeWindow
from pipelines.lake import Lake
from privacy.views import TenantScope, k_anonymous
from replay.derive import derive_requests
from replay.gate import load_config
from replay.metrics import MetricsConfig, TenantWeight, attribution, load_requests, load_steps, run_metrics, tenant_metrics

from .conftest import KEYRING, VIEWER


@pytest.fixture(scope="module")
def lake_tables(sample):
    """The sample lake: its snapshot, derived request file, and (small enough here) its events in memory."""
    snapshot = data.lake_snapshot(sample.settings.lake.root)
    path = data.lake_requests_path(snapshot, sample.root / "cache-data")
    events = Lake(sample.settings.lake.root).connect().sql("SELECT * EXCLUDE (dt, hour) FROM events").to_arrow_table()
    return snapshot, path, events


@pytest.fixture(scope="module")
def config(sample) -> MetricsConfig:
    base = load_config(sample.root / "gate.yaml").metrics_config()
    heavy = KEYRING.pseudonym("tn", VIEWER)
    return MetricsConfig(classes=base.classes, window_s=base.window_s, cost=base.cost,
                         tenant_weights=(TenantWeight(tenant=heavy, weight=2.0),))


def _by(table: pa.Table, key: str) -> dict:
    return {row[key]: row for row in table.to_pylist()}


def test_the_derived_request_file_is_the_request_table_plus_each_requests_charged_busy_time(lake_tables, config):
    snapshot, path, events = lake_tables
    cached = pq.read_table(path)
    expected = derive_requests(events)
    assert cached.drop_columns([data.BUSY_COLUMN, data.REQUEST_SEQ, data.CROWD_ID]).cast(expected.schema).equals(expected)
    assert cached[data.REQUEST_SEQ].to_pylist() == list(range(1, cached.num_rows + 1))  # in arrival order
    crowd = dict(zip(cached[data.CROWD_ID].to_pylist(), cached["tenant"].to_pylist()))
    assert len(crowd) == len(set(crowd.values()))  # one integer per tenant, and back
    assert cached.num_rows == expected.num_rows and snapshot.events_version is not None
    r = load_requests(expected, config)
    charge = dict(zip(r.request_id.tolist(), attribution(r, load_steps(events, r.origin_ns))))
    busy = dict(zip(cached["request_id"].to_pylist(), cached[data.BUSY_COLUMN].to_pylist()))
    assert busy.keys() == charge.keys()
    assert np.allclose([busy[k] for k in charge], list(charge.values()), rtol=1e-9, atol=1e-12)
    assert sum(charge.values()) > 0


def test_the_derived_request_file_holds_each_request_on_exactly_one_row(lake_tables, tmp_path):
    # the precondition of k_anonymous(..., one_row_per_request=True), which the pages pass for this file
    _, path, _ = lake_tables
    cached = pq.read_table(path, columns=["request_id", data.REQUEST_SEQ])
    ids = cached["request_id"].to_pylist()
    assert cached.num_rows > 0 and None not in ids and len(set(ids)) == cached.num_rows
    assert data.check_one_row_per_request(duckdb.connect(), f"read_parquet('{path}')") == cached.num_rows
    doubled = tmp_path / "doubled.parquet"
    pq.write_table(pa.concat_tables([pq.read_table(path), pq.read_table(path).slice(3, 1)]), doubled)
    with pytest.raises(data.NotOneRowPerRequest):
        data.check_one_row_per_request(duckdb.connect(), f"read_parquet('{doubled}')")


def test_a_request_table_with_a_request_on_two_rows_is_never_written(lake_tables, tmp_path, monkeypatch):
    snapshot, _, _ = lake_tables
    derive = data.requests_sql
    monkeypatch.setattr(data, "requests_sql", lambda events: f"SELECT * FROM ({derive(events)}) UNION ALL "
                                                             f"(SELECT * FROM ({derive(events)}) LIMIT 1)")
    out = tmp_path / "requests.parquet"
    with pytest.raises(data.NotOneRowPerRequest):
        data.materialize_requests(snapshot.event_files, out)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_the_page_queries_count_rows_exactly_as_a_distinct_count_of_requests(lake_tables, config, monkeypatch):
    # every relation the pages hand to k_anonymous with one_row_per_request (the file joined with
    # peaks, objectives and weights) keeps one row per request: counting distinct gives the same tables
    _, path, _ = lake_tables
    ov = data.requests_overview(path)
    objectives = data.objectives_for(config, ov.classes)
    scope = TenantScope.for_tenant(KEYRING, VIEWER)
    half = TimeWindow(ov.first_arrival_ns, (ov.first_arrival_ns + ov.last_arrival_ns) // 2)

    def views():
        out = []
        for selection in (Selection(), Selection(half, "interactive")):
            out += [data.arrivals_over_time(path, selection, 60.0, k=5), data.arrivals_over_time(path, selection, 0.5, k=5),
                    data.selection_totals(path, selection, k=5).table,
                    data.service_over_time(path, selection, objectives, 60.0, k=5),
                    data.service_by_class(path, selection, objectives, k=5), data.latency_cdfs(path, selection, k=5),
                    data.tenant_service(path, selection, config, k=5).table]
            detail = data.tenant_detail(path, selection, config, scope)
            out += [detail.summary, detail.by_class]
        return out

    counted = views()
    calls = []

    def distinct(*args, one_row_per_request=False, **kwargs):
        calls.append(one_row_per_request)
        return k_anonymous(*args, **kwargs)

    monkeypatch.setattr(data, "k_anonymous", distinct)
    assert views() == counted
    assert calls and all(calls)  # every one of these queries took the row-counting path
    hidden = [v[1] for v in counted if isinstance(v, tuple)]
    assert any(hidden) and not all(hidden)  # some cells suppressed, some shown: the comparison covers both


def test_a_new_lake_version_gets_its_own_file_and_the_old_one_is_reused_until_then(sample, lake_tables, tmp_path):
    snapshot, path, _ = lake_tables
    again = data.lake_requests_path(snapshot, sample.root / "cache-data")
    assert again == path and path.name == f"requests-f{data.DERIVED_FORMAT}-v{snapshot.events_version}.parquet"
    empty = data.lake_snapshot(str(tmp_path / "no-lake"))
    assert empty.is_empty and empty.events_version is None
    assert pq.read_table(data.lake_requests_path(empty, tmp_path / "cache")).num_rows == 0


def test_service_by_class_judges_requests_exactly_as_replay_metrics_does(lake_tables, config):
    _, path, events = lake_tables
    objectives = data.objectives_for(config, data.requests_overview(path).classes)
    table, hidden = data.service_by_class(path, Selection(), objectives, k=1)
    assert hidden == 0
    mine = _by(table, "service_class")
    theirs = {(m.group, m.name): m.value for m in run_metrics(derive_requests(events), None, config) if m.scope == "class"}
    assert set(mine) == {"batch", "interactive"}
    for cls, row in mine.items():
        assert row["num_requests"] == theirs[(cls, "num_requests")]
        for name in ("attainment", "attainment_ttft", "attainment_itl", "attainment_e2e", "rejected_share", "cancelled_share"):
            assert row[name] == pytest.approx(theirs[(cls, name)], abs=1e-12), (cls, name)
    assert 0 < mine["interactive"]["attainment"] < 1  # the sample is loaded enough to miss objectives


def test_tenant_views_equal_replay_metrics_tenant_metrics_suppression_included(lake_tables, config):
    _, path, events = lake_tables
    requests = derive_requests(events)
    expected, expected_hidden = tenant_metrics(requests, events, config, k=5)
    result = data.tenant_service(path, Selection(), config, k=5)
    assert result.num_suppressed == expected_hidden == 1  # the sample's smallest tenant
    mine, theirs = _by(result.table, "tenant"), _by(expected, "tenant")
    assert mine.keys() == theirs.keys()
    for tenant, row in theirs.items():
        for name, value in row.items():
            if isinstance(value, float):
                assert mine[tenant][name] == pytest.approx(value, rel=1e-9), (tenant, name)
            else:
                assert mine[tenant][name] == value, (tenant, name)
    assert "ttft_p99_s" not in result.table.column_names  # no timing across tenants
    overall = {m.name: m.value for m in run_metrics(requests, None, config) if m.scope == "overall"}
    fair = data.fairness(path, Selection(), config, k=5)
    # over the 7 tenants the table shows: the suppressed one is in no figure beside them (issue #22)
    x = [row["service_per_weight"] for row in theirs.values() if row["service_per_weight"] is not None]
    assert not fair.suppressed and fair.num_tenants == len(x) == 7
    assert fair.jain_index == pytest.approx(sum(x) ** 2 / (len(x) * sum(v * v for v in x)), rel=1e-9)
    assert fair.jain_index != pytest.approx(overall["jain_index"], rel=1e-6)  # all 8 would give another figure
    assert data.fairness(path, Selection(), config, k=9).suppressed  # fewer than k tenants: hidden


def test_tenant_detail_holds_the_viewers_rows_only(lake_tables, config):
    _, path, events = lake_tables
    scope = TenantScope.for_tenant(KEYRING, VIEWER)
    detail = data.tenant_detail(path, Selection(), config, scope)
    requests = derive_requests(events)
    mine = requests.filter(pc.is_in(requests["tenant"], pa.array(sorted(scope.pseudonyms))))
    summary = detail.summary.to_pylist()[0]
    assert summary["num_requests"] == mine.num_rows == data.tenant_pseudonyms_present(path, scope)
    assert summary["ttft_p99_s"] == pytest.approx(float(np.quantile(mine["ttft_s"].to_numpy(), 0.99)))
    ids = set(mine["request_id"].to_pylist())
    assert detail.slowest.num_rows == 20 and set(detail.slowest["request_id"].to_pylist()) <= ids
    assert sum(r["num_requests"] for r in detail.by_class.to_pylist()) == mine.num_rows
    nobody = TenantScope.for_tenant(KEYRING, "no-such-tenant")
    assert data.tenant_detail(path, Selection(), config, nobody).slowest.num_rows == 0


def test_latency_cdfs_are_the_quantiles_of_each_class_and_small_classes_are_left_out(lake_tables):
    _, path, events = lake_tables
    cdfs, hidden = data.latency_cdfs(path, Selection(), k=5)
    assert hidden == 0 and set(cdfs["metric"].to_pylist()) == set(data.LATENCY_COLUMNS)
    requests = derive_requests(events)
    batch = requests.filter(pc.equal(requests["service_class"], "batch"))
    rows = cdfs.filter(pc.and_(pc.equal(cdfs["service_class"], "batch"), pc.equal(cdfs["metric"], "ttft_s")))
    values = batch["ttft_s"].drop_null().to_numpy()
    assert rows["value_s"].to_pylist() == pytest.approx(np.quantile(values, rows["probability"].to_numpy()), rel=1e-9)
    assert min(rows["probability"].to_pylist()) > 0 and max(rows["probability"].to_pylist()) < 1  # no single request's extreme
    first = int(pc.min(requests["arrival_ns"]).as_py())
    one_second = Selection(TimeWindow(first, first + NS))  # snapped to its whole grid cell
    minute = data.snap(one_second.window)
    assert minute.end_ns - minute.start_ns == data.WINDOW_GRID_S * NS
    assert data.latency_cdfs(path, one_second, k=5)[0].equals(data.latency_cdfs(path, Selection(minute), k=5)[0])
    few, _ = data.latency_cdfs(path, one_second, k=10**6)
    assert few.num_rows == 0  # no cell of a million requests: nothing drawn


def test_cdf_quantiles_are_duckdbs_quantile_cont_of_each_visible_class(lake_tables):
    _, path, _ = lake_tables
    cdfs, _ = data.latency_cdfs(path, Selection(), k=5)
    probabilities = "[" + ", ".join(repr(p) for p in data.CDF_PROBABILITIES) + "]"
    columns = ", ".join(f"quantile_cont({c}, {probabilities}) AS {c}, count({c}) AS n_{c}" for c in data.LATENCY_COLUMNS)
    expected = duckdb.sql(f"SELECT coalesce(service_class, 'default') AS class_name, {columns} "
                          f"FROM read_parquet('{path}') GROUP BY ALL").to_arrow_table().to_pylist()
    assert len(expected) == 2
    for row in expected:
        for column in data.LATENCY_COLUMNS:
            mine = cdfs.filter(pc.and_(pc.equal(cdfs["service_class"], row["class_name"]), pc.equal(cdfs["metric"], column)))
            assert mine["probability"].to_pylist() == list(data.CDF_PROBABILITIES)
            assert mine["value_s"].to_pylist() == pytest.approx(row[column], rel=1e-12, abs=1e-15), (row["class_name"], column)
            assert set(mine["num_points"].to_pylist()) == {row[f"n_{column}"]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=300),
       st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=20))
def test_interpolated_quantiles_are_numpys_linear_quantiles(values, probabilities):
    mine = data.interpolated_quantiles(np.asarray(values), probabilities)
    assert mine.tolist() == pytest.approx(np.quantile(np.asarray(values), probabilities).tolist(), rel=1e-9, abs=1e-9)


def test_the_service_levels_page_query_equals_its_three_views(lake_tables, config):
    _, path, _ = lake_tables
    ov = data.requests_overview(path)
    objectives = data.objectives_for(config, ov.classes)
    half = TimeWindow(ov.first_arrival_ns, (ov.first_arrival_ns + ov.last_arrival_ns) // 2)
    for selection, k in ((Selection(), 5), (Selection(half), 5), (Selection(half, "interactive"), 5), (Selection(), 10**6)):
        levels = data.service_levels(path, selection, objectives, 60.0, k)
        by_class, hidden_classes = data.service_by_class(path, selection, objectives, k)
        series, hidden_bins = data.service_over_time(path, selection, objectives, 60.0, k)
        cdfs, hidden_cdfs = data.latency_cdfs(path, selection, k)
        assert levels.by_class.equals(by_class) and levels.num_hidden_classes == hidden_classes == hidden_cdfs
        assert levels.series.equals(series) and levels.num_hidden_bins == hidden_bins
        assert levels.cdfs.equals(cdfs)
    # every grid cell under k: no request counts, so no class and no distribution is drawn
    assert levels.by_class.num_rows == 0 and levels.cdfs.num_rows == 0


def test_arrivals_over_time_add_up_show_the_busiest_second_and_suppress_small_cells(sample, lake_tables):
    _, path, events = lake_tables
    ov = data.requests_overview(path)
    window = TimeWindow(ov.first_arrival_ns, ov.last_arrival_ns + 1)
    table, hidden = data.arrivals_over_time(path, Selection(window), 60.0, k=1)
    assert hidden == 0
    covered = np.minimum(table["bin_start_ns"].to_numpy() + 60 * NS, window.end_ns) - np.maximum(
        table["bin_start_ns"].to_numpy(), window.start_ns)
    assert round(float((table["arrivals_per_s"].to_numpy() * covered / NS).sum())) == sample.num_requests
    assert sum(table["num_requests"].to_pylist()) == sample.num_requests
    assert (table["peak_arrivals_per_s"].to_numpy() >= table["arrivals_per_s"].to_numpy()).all()
    arrivals = pq.read_table(path, columns=["arrival_ns", "service_class"]).to_pylist()
    for width_s, bins in ((60.0, table), (0.5, data.arrivals_over_time(path, Selection(window), 0.5, k=1)[0])):
        per_second: dict[tuple, int] = {}
        for row in arrivals:  # the busiest second of each bin, counted here request by request
            key = (row["service_class"], row["arrival_ns"] // NS)
            per_second[key] = per_second.get(key, 0) + 1
        expected = {}
        for row in arrivals:
            cell = (row["service_class"], row["arrival_ns"] // int(width_s * NS))
            expected[cell] = max(expected.get(cell, 0), per_second[(row["service_class"], row["arrival_ns"] // NS)])
        got = {(c, b // int(width_s * NS)): p for c, b, p in zip(bins["service_class"].to_pylist(),
                                                                 bins["bin_start_ns"].to_pylist(), bins["peak_arrivals_per_s"].to_pylist())}
        assert got == expected
    assert set(table["service_class"].to_pylist()) == {"batch", "interactive"}
    fine, hidden_fine = data.arrivals_over_time(path, Selection(window), 1.0, k=5)
    assert hidden_fine > 0 and all(v is None for v, s in zip(fine["arrivals_per_s"].to_pylist(), fine["suppressed"].to_pylist()) if s)
    one_class, _ = data.arrivals_over_time(path, Selection(window, "interactive"), 60.0, k=1)
    assert set(one_class["service_class"].to_pylist()) == {"interactive"}
    totals = data.selection_totals(path, Selection(window), k=5).table.to_pylist()[0]
    assert totals["num_requests"] == sample.num_requests and totals["num_tenants"] == 8


def test_bins_respect_max_points_and_the_k_anonymity_density_floor():
    assert data.choose_bin_s(3600, 1500) == 5
    assert data.choose_bin_s(3600, 60) == 60
    assert data.choose_bin_s(10, 1500) == 0.01
    assert data.choose_bin_s(365 * 86400, 100) % 86400 == 0 and 365 * 86400 / data.choose_bin_s(365 * 86400, 100) <= 100
    # 1,000 requests over an hour in 2 series, 40 requests per bin and series: at least 288 s
    assert data.choose_bin_s(3600, 1500, num_requests=1000, num_series=2, min_requests_per_bin=40) == 300
    assert data.choose_bin_s(3600, 1500, num_requests=None, min_requests_per_bin=40) == 5


def test_dead_letters_by_reason_and_ingest_health(sample, lake_tables):
    snapshot, _, _ = lake_tables
    table = data.dead_letters_by_reason(snapshot)
    assert dict(zip(table["reason"].to_pylist(), table["num_dead_letters"].to_pylist())) == {
        "missing_field": 3, "wrong_type": 2, "oversized": 2}
    (health,) = data.ingest_health(sample.settings.lake.root)
    assert health.consumer == "ingest-test" and health.dead_letters == 7 and health.broker_reachable


def test_getting_started_names_the_exact_commands_with_the_configured_paths(empty):
    text = data.getting_started(empty)
    for command in (
        "servelens broker",
        "servelens ingest",
        f"servelens replay --workload azure-conv --policy fcfs --out {empty.dashboard.runs_dir}/fcfs",
        f"servelens gate --baseline {empty.dashboard.runs_dir}/fcfs",
        f"--out {empty.dashboard.gate_dir}",
        "servelens demo",
    ):
        assert command in text
    assert "keygen" not in text  # a key file is configured


def test_requests_without_a_tenant_are_each_a_crowd_of_their_own(shared, tmp_path):
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TableWorkload

    run_replay(TableWorkload(read_trace("azure-conv", shared).slice(0, 40), name="azure-conv"), out_dir=tmp_path / "run")
    path = tmp_path / "requests.parquet"
    assert data.materialize_requests([tmp_path / "run" / "events.parquet"], path) == 40
    requests = pq.read_table(path)
    assert requests["tenant"].null_count == 40
    assert requests[data.CROWD_ID].to_pylist() == [-i for i in requests[data.REQUEST_SEQ].to_pylist()]
    minutes = [a // (data.WINDOW_GRID_S * NS) for a in requests["arrival_ns"].to_pylist()]
    biggest = max(minutes.count(m) for m in set(minutes))
    totals = data.selection_totals(path, Selection(), k=biggest).table.to_pylist()[0]
    assert not totals["suppressed"] and totals["num_tenants"] == totals["num_requests"] == biggest
    assert data.selection_totals(path, Selection(), k=biggest + 1).table.to_pylist()[0]["suppressed"]


def _with_rows(path, out, change) -> str:
    """A copy of a derived request file with ``change(table) -> table`` applied."""
    table = change(pq.read_table(path))
    pq.write_table(table, out)
    return str(out)


def test_differencing_the_tenants_page_recovers_nothing_of_a_suppressed_tenant(lake_tables, config, tmp_path):
    """Issue #22 attack 1: with Jain's index over every tenant, the tenant count and the visible tenants'
    service, a suppressed tenant's service was solved exactly. Now the page's figures are the same
    whatever the suppressed tenant did: there is nothing to solve for."""
    _, path, _ = lake_tables
    table = data.tenant_service(path, Selection(), config, k=5)
    hidden = [r["tenant"] for r in table.table.to_pylist() if r["suppressed"]]
    assert len(hidden) == 1

    def triple(t: pa.Table) -> pa.Table:  # the hidden tenant sends three times the output
        mine = pc.equal(t["tenant"], hidden[0])
        tokens = pc.if_else(mine, pc.multiply(t["num_output_tokens"], 3), t["num_output_tokens"])
        return t.set_column(t.schema.get_field_index("num_output_tokens"), "num_output_tokens", tokens)

    other = _with_rows(path, tmp_path / "requests.parquet", triple)
    for k in (5, 3):
        seen = [data.tenant_service(p, Selection(), config, k=k).table for p in (path, other)]
        fair = [data.fairness(p, Selection(), config, k=k) for p in (path, other)]
        if k == 5:
            assert seen[0].equals(seen[1]) and fair[0] == fair[1]
            assert fair[0].num_tenants == sum(not r["suppressed"] for r in seen[0].to_pylist())
        else:  # a k under which the tenant is visible: then its change shows, as it should
            assert fair[0] != fair[1]


def test_two_traffic_windows_a_second_apart_show_the_same_figures(lake_tables, tmp_path):
    """Issue #22 attack 2: windows ending at T0+605 s and T0+606 s differed by one tenant's 2 requests.
    Windows snap to the fixed grid and figures count only k-anonymous grid cells, so (a) the two views
    are identical and (b) adding a lone tenant's 2 requests in a minute of their own changes no view."""
    _, path, _ = lake_tables
    ov = data.requests_overview(path)
    t0 = ov.first_arrival_ns
    lone_ns = ov.last_arrival_ns + 10 * 60 * NS  # a minute of its own, far from the others

    def plus_two(t: pa.Table) -> pa.Table:
        extra = t.slice(0, 2).to_pylist()
        for i, row in enumerate(extra):
            row.update(request_id=f"lone-{i}", arrival_ns=lone_ns + i, tenant="tn_lone", num_prompt_tokens=4242,
                       request_seq=10**9 + i, crowd_id=10**9)
        return pa.concat_tables([t, pa.Table.from_pylist(extra, schema=t.schema)])

    other = _with_rows(path, tmp_path / "requests.parquet", plus_two)
    for p in (path, other):
        views = []
        for end_s in (605, 606):
            window = Selection(TimeWindow(t0, t0 + end_s * NS))
            views.append((data.selection_totals(p, window, 5).table, data.arrivals_over_time(p, window, 60.0, 5)[0]))
        assert views[0][0].equals(views[1][0]) and views[0][1].equals(views[1][1])
    for start_ns, end_ns in ((t0, lone_ns + 60 * NS), (lone_ns - 120 * NS, lone_ns + 120 * NS), (t0, lone_ns - 60 * NS)):
        window = Selection(TimeWindow(start_ns, end_ns))
        mine = [data.selection_totals(p, window, 5).table for p in (path, other)]
        assert mine[0].equals(mine[1]), (start_ns, end_ns)
        series = [data.arrivals_over_time(p, window, 60.0, 5)[0] for p in (path, other)]
        assert series[0].equals(series[1])
