"""One request's life, an instance's batches, and who may open which request."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dashboard import data, explorer
from dashboard.data import NS, TimeWindow
from dashboard.explorer import Visibility
from privacy.views import TenantScope
from servelens.sql import parquet_relation

from .conftest import KEYRING, VIEWER


@pytest.fixture(scope="module")
def lake(sample):
    snapshot = data.lake_snapshot(sample.settings.lake.root)
    path = data.lake_requests_path(snapshot, sample.root / "cache-explorer")
    return snapshot, path, pq.read_table(path)


def test_a_preempted_requests_life_holds_its_queue_chunks_decode_and_preemptions(lake):
    snapshot, path, requests = lake
    scope = TenantScope.for_tenant(KEYRING, VIEWER)
    mine = requests.filter(pc.and_(pc.is_in(requests["tenant"], pa.array(sorted(scope.pseudonyms))),
                                   pc.greater(requests["num_preemptions"], 0)))
    assert mine.num_rows, "the sample lake must hold a preempted request of the viewer"
    row = mine.sort_by([("num_preemptions", "descending")]).slice(0, 1).to_pylist()[0]
    summary = explorer.find_request(path, row["request_id"], Visibility(scope, lake=True))
    assert summary is not None and summary.num_preemptions == row["num_preemptions"]
    life = explorer.request_life(parquet_relation(snapshot.event_files, hive=True), summary, hive=True)
    kinds = life.events["event_type"].to_pylist()
    assert kinds[0] == "request_arrived" and kinds[-1] == "request_finished"
    assert kinds.count("request_preempted") == summary.num_preemptions
    steps = life.steps.to_pylist()
    assert steps[0]["start_ns"] == summary.scheduled_ns
    prefill = [s for s in steps if s["phase"] == "prefill"]
    decode = [s for s in steps if s["phase"] == "decode"]
    assert sum(s["own_tokens"] * s["num_steps"] for s in prefill) >= summary.num_prompt_tokens
    assert decode and all(s["end_ns"] > summary.first_token_ns for s in decode)
    preempted_at = [e["ts_ns"] for e in life.events.to_pylist() if e["event_type"] == "request_preempted"]
    assert any(s["start_ns"] > preempted_at[0] and s["phase"] == "prefill" for s in steps)  # the recompute
    assert all(s["num_members"] >= 1 for s in steps)
    pruned = explorer.lake_events(snapshot.event_files, summary.arrival_ns, summary.end_ns + 1)
    again = explorer.request_life(pruned, summary, hive=True)
    assert again.events.equals(life.events) and again.steps.equals(life.steps)


def test_only_the_lake_files_of_the_hours_in_question_are_read():
    import datetime as dt

    def ns(text: str) -> int:
        return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()) * NS

    files = ["s3://b/events/dt=2023-11-16/hour=23/part-0.parquet", "/l/events/dt=2023-11-17/hour=0/p.parquet",
             "/l/events/dt=2023-11-17/hour=1/p.parquet", "/l/events/dt=2023-11-17/hour=10/p.parquet", "/l/events/odd.parquet"]
    assert explorer.files_between(files, ns("2023-11-16T23:59:00"), ns("2023-11-17T00:30:00")) == (
        files[0], files[1], files[4])
    assert explorer.files_between(files, ns("2023-11-17T01:00:00"), ns("2023-11-17T10:00:00")) == (
        files[2], files[3], files[4])
    assert explorer.files_between(files[:4], ns("2023-11-18T00:00:00"), ns("2023-11-18T01:00:00")) == ()
    assert explorer.lake_events(files[:1], 0, 1).startswith("read_parquet(['s3://b/events/dt=2023-11-16")  # never empty


def test_who_may_open_a_request(lake):
    _, path, requests = lake
    scope = TenantScope.for_tenant(KEYRING, VIEWER)
    other = TenantScope.for_tenant(KEYRING, "tenant-1")
    mine = requests.filter(pc.is_in(requests["tenant"], pa.array(sorted(scope.pseudonyms))))["request_id"][0].as_py()
    theirs = requests.filter(pc.is_in(requests["tenant"], pa.array(sorted(other.pseudonyms))))["request_id"][0].as_py()
    assert explorer.find_request(path, mine, Visibility(None, lake=True)) is None  # no viewer: no lake request at all
    assert explorer.find_request(path, theirs, Visibility(scope, lake=True)) is None  # someone else's: as if absent
    assert explorer.find_request(path, "no-such-request", Visibility(scope, lake=True)) is None
    assert explorer.find_request(path, mine, Visibility(scope, lake=True)).request_id == mine
    listed = explorer.candidate_requests(path, Visibility(scope, lake=True), window=None, service_class=None)
    assert listed.num_rows and set(listed["request_id"].to_pylist()) <= set(
        requests.filter(pc.is_in(requests["tenant"], pa.array(sorted(scope.pseudonyms))))["request_id"].to_pylist())
    assert explorer.candidate_requests(path, Visibility(None, lake=True), window=None, service_class=None).num_rows == 0


def test_in_a_replay_run_only_lake_pseudonyms_need_the_viewers_scope():
    scope = TenantScope.for_tenant(KEYRING, VIEWER)
    (own,) = sorted(scope.pseudonyms)
    tenants = pa.table({"tenant": ["tn_0123456789abcdef0123", own, "tenant-1", None, "other"]})
    con = duckdb.connect()
    con.register("t", tenants)
    for vis, expected in ((Visibility(None, lake=False), [False, False, True, True, True]),
                          (Visibility(scope, lake=False), [False, True, True, True, True]),
                          (Visibility(scope, lake=True), [False, True, False, False, False])):
        predicate, params = vis.predicate()
        got = [r[0] for r in con.execute(f"SELECT coalesce({predicate}, false) FROM t", params).fetchall()]
        assert got == expected, vis


def test_batch_composition_bins_every_step_of_the_instance_once(lake):
    snapshot, path, requests = lake
    relation = parquet_relation(snapshot.event_files, hive=True)
    (instance,) = data.requests_overview(path).instances
    first, last = pc.min(requests["arrival_ns"]).as_py(), pc.max(requests["arrival_ns"]).as_py()
    window = TimeWindow(first, last + 60 * NS)
    table, bin_s = explorer.batch_composition(relation, instance, window, hive=True, max_points=50)
    assert 0 < table.num_rows <= 51 and window.span_s / bin_s <= 50
    (expected,) = duckdb.connect().execute(
        f"SELECT sum(coalesce(num_steps, 1)) FROM {relation} WHERE event_type = 'step_executed' AND instance_id = ? "
        f"AND start_ns >= {window.start_ns} AND start_ns < {window.end_ns}", [instance]).fetchone()
    assert sum(table["num_steps"].to_pylist()) == expected
    assert all(0 <= b <= 1 for b in table["busy_share"].to_pylist())
    assert max(table["mean_batch_size"].to_pylist()) > 1


def test_a_disaggregated_hand_off_shows_as_a_move_to_the_decode_instance_not_a_preemption(tmp_path):
    from replay.cluster import disaggregated_config, run_cluster_replay
    from replay.derive import derive_requests
    from tests.replay.conftest import make_workload

    ms = 1_000_000
    w = make_workload([i * 15 * ms for i in range(6)], [300] * 6, [8] * 6)
    summary = run_cluster_replay(w, disaggregated_config(1, 1), out_dir=tmp_path / "run")
    (row,) = [r for r in derive_requests(summary.events_path).to_pylist() if r["request_id"] == "r3"]
    assert (row["num_preemptions"], row["num_migrations"]) == (0, 1)
    fields = explorer.RequestSummary.__dataclass_fields__
    found = explorer.RequestSummary(**{k: row.get(k) for k in fields})  # the dashboard adds busy_accelerator_s
    life = explorer.request_life(parquet_relation([summary.events_path]), found, hive=False)
    events = life.events.to_pylist()
    (move,) = [e for e in events if e["event_type"] == "request_preempted"]
    assert move["mode"] == "migrate" and not explorer.is_preemption(move)
    label, hover = explorer.event_mark(move)
    assert label == "moved" and "lease generation 1" in hover and "recompute" not in hover.split(",")[0]
    prefill, decode = (x.instance_id for x in summary.instances)
    routes = [explorer.event_mark(e) for e in events if e["event_type"] == "admission_decided" and e["decision"] == "route"]
    assert [r[0] for r in routes] == ["admission: route"] * 2
    assert f"route to {prefill} " in routes[0][1] and f"route to {decode} hand-off to decode" in routes[1][1]
    assert found.instance_id == decode
    # a real preemption still reads as one
    recompute = {**move, "mode": "recompute", "num_lost_tokens": 300}
    assert explorer.is_preemption(recompute)
    assert explorer.event_mark(recompute) == ("preempted", "preempted (recompute), 300 tokens to recompute")
