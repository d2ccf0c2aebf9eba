"""The lake: atomic commits that carry offsets, fencing, epochs, compaction, views, de-duplication."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pytest

from pipelines.config import LakeConfig
from pipelines.lake import DEAD_LETTERS, EVENTS, CommitFenced, Lake, OffsetRange
from schemas.arrow import arrow_schema, events_to_table
from schemas.events import FirstToken, RequestArrived
from schemas.records import DeadLetter

T0 = 1_764_400_000_000_000_000  # 2025-11-29T07:06:40Z


def _events(start: int, n: int, ts: int = T0) -> pa.Table:
    return events_to_table(
        RequestArrived(event_id=f"ev_{i:032x}", ts_ns=ts + i, engine_id="eng", request_id=f"r{i}", num_prompt_tokens=i)
        for i in range(start, start + n)
    )


def test_commits_carry_offsets_and_views_show_exactly_the_committed_rows(tmp_path):
    lake = Lake(tmp_path / "lake")
    lake.ensure_tables()
    lake.commit(EVENTS, _events(0, 10), [OffsetRange("t", 0, 0, 0, 10)], {("t", 0, 0): None})
    lake.commit(
        EVENTS, _events(10, 5), [OffsetRange("t", 0, 0, 10, 15), OffsetRange("t", 1, 0, 0, 7)], {("t", 0, 0): 10, ("t", 1, 0): None}
    )
    assert lake.high_water_mark(EVENTS, "t", 0, 0) == 15 and lake.high_water_mark(EVENTS, "t", 1, 0) == 7
    assert lake.high_water_mark(DEAD_LETTERS, "t", 0, 0) is None
    con = lake.connect()
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (15, 15)
    assert con.execute("SELECT DISTINCT dt, hour FROM events").fetchall() == [(datetime.date(2025, 11, 29), 7)]
    assert con.execute("SELECT count(*) FROM requests").fetchone() == (15,)
    assert con.execute("SELECT count(*) FROM dead_letters").fetchone() == (0,)


def test_a_stale_consumer_is_fenced_and_writes_nothing(tmp_path):
    lake = Lake(tmp_path / "lake")
    lake.commit(EVENTS, _events(0, 3), [OffsetRange("t", 0, 0, 0, 3)], {("t", 0, 0): None})
    with pytest.raises(CommitFenced, match="another consumer"):
        lake.commit(EVENTS, _events(0, 3), [OffsetRange("t", 0, 0, 0, 3)], {("t", 0, 0): None})
    assert lake.connect().execute("SELECT count(*) FROM events").fetchone() == (3,)


def _race_after_first_snapshot(monkeypatch, lake: Lake, other_partition: int) -> None:
    """Make another consumer commit partition ``other_partition`` right after ``lake`` takes its
    first table snapshot, i.e. between its mark check and its write."""
    other = Lake(lake.root)
    real_table = Lake.table
    calls = {"n": 0}

    def table_then_race(self, name):
        snapshot = real_table(self, name)
        calls["n"] += 1
        if calls["n"] == 1 and self is lake:
            other.commit(EVENTS, _events(100, 2), [OffsetRange("t", other_partition, 0, 0, 2)], {("t", other_partition, 0): None})
        return snapshot

    monkeypatch.setattr(Lake, "table", table_then_race)


def test_a_concurrent_commit_between_check_and_write_is_refused(tmp_path, monkeypatch):
    lake = Lake(tmp_path / "lake")
    lake.ensure_tables()
    _race_after_first_snapshot(monkeypatch, lake, other_partition=0)  # the same partition: a zombie
    with pytest.raises(CommitFenced):
        lake.commit(EVENTS, _events(0, 2), [OffsetRange("t", 0, 0, 0, 2)], {("t", 0, 0): None})
    monkeypatch.undo()
    assert lake.connect().execute("SELECT count(*) FROM events").fetchone() == (2,)


def test_a_concurrent_commit_for_other_partitions_is_retried_not_fenced(tmp_path, monkeypatch):
    lake = Lake(tmp_path / "lake")
    lake.ensure_tables()
    _race_after_first_snapshot(monkeypatch, lake, other_partition=1)  # another consumer's partition
    lake.commit(EVENTS, _events(0, 2), [OffsetRange("t", 0, 0, 0, 2)], {("t", 0, 0): None})
    monkeypatch.undo()
    assert lake.high_water_mark(EVENTS, "t", 0, 0) == 2 and lake.high_water_mark(EVENTS, "t", 1, 0) == 2
    assert lake.connect().execute("SELECT count(*) FROM events").fetchone() == (4,)


def test_a_re_created_topic_starts_a_new_epoch(tmp_path):
    lake = Lake(tmp_path / "lake")
    assert lake.epoch("t", "id-a") == (0, False)  # the first incarnation
    lake.commit(EVENTS, _events(0, 4), [OffsetRange("t", 2, 0, 0, 4, "id-a")], {("t", 2, 0): None})
    assert lake.epoch("t", "id-a") == (0, False)
    assert lake.epoch("t", "id-b") == (1, True)  # re-created: a new id
    lake.commit(EVENTS, _events(4, 2), [OffsetRange("t", 2, 1, 0, 2, "id-b")], {("t", 2, 1): None})
    assert lake.epoch("t", "id-b") == (1, False) and lake.epoch("t", None) == (1, False)
    assert lake.high_water_mark(EVENTS, "t", 2, 1) == 2 and lake.high_water_mark(EVENTS, "t", 2, 0) == 4


def test_compaction_merges_small_files_and_keeps_every_row(tmp_path):
    lake = Lake(tmp_path / "lake", LakeConfig(compact_min_files=4))
    for k in range(6):
        lake.commit(EVENTS, _events(k * 10, 10), [OffsetRange("t", 0, 0, k * 10, k * 10 + 10)], {("t", 0, 0): (k * 10) or None})
    assert lake.num_files_by_partition(EVENTS)[("2025-11-29", 7)] == 6
    assert lake.compact(before=("2025-11-29", 7))[EVENTS] == 0  # the hour is still open: left alone
    assert lake.compact()[EVENTS] == 6
    assert lake.num_files_by_partition(EVENTS)[("2025-11-29", 7)] == 1
    assert lake.high_water_mark(EVENTS, "t", 0, 0) == 60  # compaction keeps the offsets
    assert lake.vacuum(retention_hours=0) == 6
    assert lake.connect().execute("SELECT count(DISTINCT event_id), count(*) FROM events").fetchone() == (60, 60)


def test_dead_letters_table_and_recent_ids(tmp_path):
    lake = Lake(tmp_path / "lake")
    dead = pa.Table.from_pylist(
        [dict(topic="t", partition=0, offset=3, epoch=0, key=None, size_bytes=9, reason="invalid_json", path="$",
              value_type=None, expected=None, num_errors=1, event_type=None, received_ns=T0)],
        schema=arrow_schema(DeadLetter),
    )
    lake.commit(DEAD_LETTERS, dead, [OffsetRange("t", 0, 0, 0, 4)], {("t", 0, 0): None})
    assert lake.connect().execute("SELECT reason, \"offset\" FROM dead_letters").fetchall() == [("invalid_json", 3)]
    lake.commit(EVENTS, _events(0, 5), [OffsetRange("t", 0, 0, 0, 5)], {("t", 0, 0): None})
    assert sorted(lake.recent_event_ids(3))[:1] and len(lake.recent_event_ids(3)) == 3


def test_recent_ids_are_the_newest_events_even_after_compaction_rewrote_an_older_hour(tmp_path):
    """A restart warms de-duplication with the newest events by event time: compacting a closed
    hour writes it into the newest file, which must not crowd out the hour being written."""
    lake = Lake(tmp_path / "lake", LakeConfig(compact_min_files=2))
    hour = 3_600 * 10**9
    for k in range(3):  # the older hour, in three small files
        lake.commit(EVENTS, _events(k * 10, 10), [OffsetRange("t", 0, 0, k * 10, k * 10 + 10)], {("t", 0, 0): (k * 10) or None})
    lake.commit(EVENTS, _events(30, 10, ts=T0 + hour), [OffsetRange("t", 0, 0, 30, 40)], {("t", 0, 0): 30})
    assert lake.compact(before=("2025-11-29", 8))[EVENTS] == 3  # the older hour is now the newest file
    assert sorted(lake.recent_event_ids(10)) == [f"ev_{i:032x}" for i in range(30, 40)]
    assert sorted(lake.recent_event_ids(12)) == [f"ev_{i:032x}" for i in (28, 29, *range(30, 40))]


def test_first_token_events_land_in_the_hour_of_their_own_timestamp(tmp_path):
    lake = Lake(tmp_path / "lake")
    late = events_to_table([FirstToken(event_id="ev_" + "1" * 32, ts_ns=T0 + 3_600 * 10**9, engine_id="e", request_id="r")])
    lake.commit(EVENTS, late, [OffsetRange("t", 0, 0, 0, 1)], {("t", 0, 0): None})
    assert lake.connect().execute("SELECT dt, hour FROM events").fetchall() == [(datetime.date(2025, 11, 29), 8)]


def test_time_partitions_are_those_of_each_rows_own_timestamp():
    """dt/hour come from each row's distinct hour, formatted once: the same as formatting every row,
    across hours, days, the epoch and before it, and over a table in several chunks."""
    import pyarrow.compute as pc

    from pipelines.lake import with_time_partitions

    hour_ns = 3_600_000_000_000
    stamps = [0, -1, 1, hour_ns - 1, hour_ns, 1_764_028_799_999_999_999, 1_764_028_800_000_000_000, -25 * hour_ns]
    table = pa.concat_tables([pa.table({"ts_ns": pa.array(stamps, pa.int64())})] * 2)
    got = with_time_partitions(table, "ts_ns")
    utc = pc.cast(table["ts_ns"], pa.timestamp("ns", tz="UTC"))
    assert got["dt"].to_pylist() == pc.strftime(utc, format="%Y-%m-%d").to_pylist()
    assert got["hour"].to_pylist() == pc.hour(utc).to_pylist()
    assert got["dt"].to_pylist()[:8] == ["1970-01-01", "1969-12-31", "1970-01-01", "1970-01-01", "1970-01-01",
                                         "2025-11-24", "2025-11-25", "1969-12-30"]
    assert got["hour"].to_pylist()[:8] == [0, 23, 0, 0, 1, 23, 0, 23]
    assert got.schema.field("hour").type == pa.int32()
    with_null = with_time_partitions(pa.table({"ts_ns": pa.array([hour_ns, None], pa.int64())}), "ts_ns")
    assert with_null["dt"].to_pylist() == ["1970-01-01", None] and with_null["hour"].to_pylist() == [1, None]


def test_lake_sql_is_read_only_and_refuses_each_attack_with_a_clear_error(tmp_path, monkeypatch):
    """Issue #22: reading files outside the lake (/etc/passwd, the key file), COPY anywhere (onto the
    lake with OVERWRITE too), ATTACH, INSTALL/LOAD, SET: each refused, exit 3; the lake untouched."""
    from click.testing import CliRunner

    from servelens.cli import cli

    lake = Lake(tmp_path / "lake")
    lake.commit(EVENTS, _events(0, 10), [OffsetRange("t", 0, 0, 0, 10)], {("t", 0, 0): None})
    key = tmp_path / "key.toml"
    key.write_text('active = "k"\n[keys]\nk = "c2VjcmV0LWtleS1tYXRlcmlhbC1mb3ItdGhlLXRlc3Q="\n')
    monkeypatch.setenv("SERVELENS_LAKE__ROOT", str(tmp_path / "lake"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    run = lambda sql: CliRunner().invoke(cli, ["lake", "sql", sql])  # noqa: E731
    ok = run("SELECT count(*) AS n FROM events; SELECT count(*) AS m FROM requests")
    assert ok.exit_code == 0 and "10" in ok.output
    events_dir = tmp_path / "lake" / "events"
    attacks = [
        "SELECT * FROM read_text('/etc/passwd')",
        f"SELECT content FROM read_text('{key}')",
        f"SELECT * FROM read_csv('{tmp_path}/lake/../key.toml')",
        f"COPY (SELECT 1 AS x) TO '{tmp_path}/out.csv'",
        f"COPY (SELECT * FROM events LIMIT 0) TO '{events_dir}' (FORMAT parquet, PARTITION_BY (dt), OVERWRITE)",
        f"ATTACH '{tmp_path}/new.duckdb' AS other",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "PRAGMA enable_profiling",
        "CREATE TABLE t AS SELECT 1",
        "SELECT * FROM read_parquet('https://example.org/x.parquet')",
    ]
    for sql in attacks:
        result = run(sql)
        assert result.exit_code == 3, (sql, result.output)
        assert "refused" in result.output or "query failed" in result.output, (sql, result.output)
        assert "root:" not in result.output and "c2VjcmV0" not in result.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert Lake(tmp_path / "lake").connect().execute("SELECT count(*) FROM events").fetchone() == (10,)


def test_lake_sql_stops_a_query_that_runs_past_its_timeout_and_refuses_a_lake_that_is_not_there(tmp_path, monkeypatch):
    """A recursive query ran until killed; a --lake typo read as an empty lake (0 rows, 0 files compacted); a
    memory limit DuckDB cannot parse was an internal ParserException naming no setting."""
    from click.testing import CliRunner

    from servelens.cli import cli

    Lake(tmp_path / "lake").commit(EVENTS, _events(0, 10), [OffsetRange("t", 0, 0, 0, 10)], {("t", 0, 0): None})
    monkeypatch.setenv("SERVELENS_LAKE__ROOT", str(tmp_path / "lake"))
    forever = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
    stopped = CliRunner().invoke(cli, ["lake", "sql", "--timeout-s", "1", forever])
    assert stopped.exit_code == 3 and "the query ran past --timeout-s (1 s) and was stopped" in stopped.output
    assert CliRunner().invoke(cli, ["lake", "sql", "SELECT count(*) AS n FROM events"]).output.split() == ["n", "10"]
    (tmp_path / "afile").write_text("")
    for root, what in ((tmp_path / "typo", "not there"), (tmp_path / "afile", "a file, not a lake folder")):
        for command in (["lake", "sql", "SELECT 1"], ["lake", "compact"]):
            done = CliRunner().invoke(cli, ["--lake", str(root), *command])
            assert done.exit_code == 3 and f"no lake at {root}: {what}" in done.output, done.output
    monkeypatch.setenv("SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT", "banana")
    bad = CliRunner().invoke(cli, ["lake", "sql", "SELECT 1"])
    assert bad.exit_code == 3 and "lake.duckdb_memory_limit 'banana' is not a memory size DuckDB takes" in bad.output
