"""`requests derive` and `privacy sanitize` on hostile input (probe 3, D1-D4, D7, D8): a claim of being sanitized is
checked, outputs are replaced only on success, a manifest names only a file beside the events, no side files."""

from __future__ import annotations

import base64
import json
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from schemas.arrow import events_to_table
from servelens.cli import cli
from tests.pipelines.test_tables import completed_request

KEY = "test-key:" + base64.b64encode(bytes(range(32))).decode()
ENV = {"SERVELENS_PSEUDONYM_KEY": KEY}
NO_KEY = {"SERVELENS_PSEUDONYM_KEY": None, "SERVELENS_PRIVACY__KEY_FILE": None}
CLAIM = "claims to be sanitized (every event carries a pseudonym key id)"


def _run(*args: str, env: dict[str, str | None] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {}, catch_exceptions=False)


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def _raw() -> pa.Table:
    return events_to_table(completed_request())


def _sanitized(table: pa.Table) -> pa.Table:
    from privacy.config import PrivacyConfig
    from privacy.keys import load_keyring
    from privacy.sanitize import Sanitizer

    return Sanitizer(load_keyring(None, ENV), PrivacyConfig()).sanitize(table)


def _with(table: pa.Table, name: str, values: list) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))


# -- D1: a file that claims to be sanitized --------------------------------------------------------------------


def test_derive_refuses_raw_events_under_a_made_up_key_id_and_writes_nothing(tmp_path):
    fake = tmp_path / "fake.parquet"
    raw = _raw()
    pq.write_table(_with(raw, "pseudonym_key_id", ["fake"] * raw.num_rows), fake)
    done = _run("requests", "derive", str(fake), "--out", str(tmp_path / "r.parquet"), env=ENV)
    assert done.exit_code == 3
    assert (f"error: {fake} {CLAIM} but names key ids the configured key ring does not hold: 'fake' "
            "(the ring holds test-key)") in done.output
    assert ("hint: configure the key ring that sanitized it (privacy.key_file, SERVELENS_PRIVACY__KEY_FILE), or "
            "sanitize the raw events with `servelens privacy sanitize`; nothing was written") in done.output
    assert _listing(tmp_path) == ["fake.parquet"]


def test_derive_validates_events_that_claim_to_be_sanitized(tmp_path):
    bad = tmp_path / "bad.parquet"
    table = _sanitized(_raw())
    counts = table["num_prompt_tokens"].to_pylist()
    pq.write_table(_with(table, "num_prompt_tokens", [-5, *counts[1:]]), bad)  # the first event is the arrival
    done = _run("requests", "derive", str(bad), "--out", str(tmp_path / "r.parquet"), env=ENV)
    assert done.exit_code == 3
    assert f"{bad} {CLAIM}: validating it and checking its key ids against the configured key ring" in done.output
    assert f"error: {bad}:1: $.num_prompt_tokens: " in done.output
    assert f"hint: run `servelens events validate {bad}` to see every error" in done.output
    assert _listing(tmp_path) == ["bad.parquet"]


def test_derive_reads_sanitized_events_that_lack_the_step_columns(tmp_path):
    table = _sanitized(_raw())
    table = table.filter(pc.not_equal(table["event_type"], "step_executed"))
    table = table.select([n for n in table.column_names if table[n].null_count < table.num_rows])
    assert "request_ids" not in table.column_names and "pseudonym_key_id" in table.column_names
    path, out = tmp_path / "nosteps.parquet", tmp_path / "r.parquet"
    pq.write_table(table, path)
    done = _run("requests", "derive", str(path), "--out", str(out), env=ENV)
    assert done.exit_code == 0, done.output
    (row,) = pq.read_table(out).to_pylist()
    assert row["request_id"] == table["request_id"][0].as_py() and row["scheduled_ns"] is None
    assert _listing(tmp_path) == ["nosteps.parquet", "r.parquet"]


def test_derive_of_sanitized_events_needs_the_key_ring_to_check_them(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(_sanitized(_raw()), path)
    done = _run("requests", "derive", str(path), "--out", str(tmp_path / "r.parquet"), env=NO_KEY)
    assert done.exit_code == 3 and "error: no pseudonym key is configured" in done.output
    assert _listing(tmp_path) == ["s.parquet"]


# -- D2: privacy sanitize replaces --out only on success -------------------------------------------------------


def test_sanitize_failure_leaves_the_previous_output_and_its_report_as_they_were(tmp_path):
    good, bad, out = tmp_path / "good.parquet", tmp_path / "bad.parquet", tmp_path / "out.parquet"
    raw = _raw()
    pq.write_table(raw, good)
    pq.write_table(_with(raw, "ts_ns", [*raw["ts_ns"].to_pylist()[:-1], -1]), bad)  # the last record is invalid
    assert _run("privacy", "sanitize", str(good), "--out", str(out), env=ENV).exit_code == 0
    report = tmp_path / "out.parquet.privacy.json"
    before = {p: p.read_bytes() for p in (out, report)}
    assert json.loads(report.read_text())["num_events"] == raw.num_rows
    done = _run("privacy", "sanitize", str(bad), "--out", str(out), env=ENV)
    assert done.exit_code == 3 and f"error: {bad}:{raw.num_rows}: $.ts_ns: " in done.output
    assert {p: p.read_bytes() for p in (out, report)} == before
    assert _listing(tmp_path) == ["bad.parquet", "good.parquet", "out.parquet", "out.parquet.privacy.json"]
    fresh = tmp_path / "fresh" / "f.parquet"
    assert _run("privacy", "sanitize", str(bad), "--out", str(fresh), env=ENV).exit_code == 3
    assert _listing(fresh.parent) == []  # no partial output, no report, no temporary file


# -- D3: the manifest names only a readable request table beside the events ------------------------------------


def _replay_folder(tmp_path, manifest) -> tuple:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    from replay.derive import derive_requests

    pq.write_table(_raw(), run / "events.parquet")
    pq.write_table(derive_requests(_raw()), elsewhere / "other.parquet")  # a real request table, of raw ids
    (run / "manifest.json").write_text(json.dumps(manifest(elsewhere / "other.parquet")))
    return run, elsewhere / "other.parquet"


@pytest.mark.parametrize("manifest", [
    lambda other: {"output": {"requests_file": str(other)}},
    lambda other: {"output": {"requests_file": "../elsewhere/other.parquet"}},
    lambda other: {"output": {"requests_file": "."}},
    lambda other: {"output": {"requests_file": 5}},
    lambda other: {"output": ["requests.parquet"]},
    lambda other: [1, 2],
], ids=["absolute", "dotdot", "dot", "number", "output-list", "list"])
def test_derive_ignores_a_manifest_that_names_no_file_beside_the_events(tmp_path, manifest):
    run, other = _replay_folder(tmp_path, manifest)
    done = _run("requests", "derive", str(run / "events.parquet"), "--out", str(run / "r.parquet"), env=ENV)
    assert done.exit_code == 0, done.output
    assert "copied" not in done.output and f"validating and sanitizing {run / 'events.parquet'}" in done.output
    assert pq.read_table(run / "r.parquet")["request_id"].to_pylist()[0].startswith("rq_")  # derived, sanitized


def test_derive_ignores_a_link_beside_the_events_to_a_table_elsewhere(tmp_path):
    run, other = _replay_folder(tmp_path, lambda other: {"output": {"requests_file": "requests.parquet"}})
    (run / "requests.parquet").symlink_to(other)
    done = _run("requests", "derive", str(run / "events.parquet"), "--out", str(run / "r.parquet"), env=ENV)
    assert done.exit_code == 0 and "copied" not in done.output, done.output
    assert pq.read_table(run / "r.parquet")["request_id"].to_pylist()[0].startswith("rq_")


@pytest.mark.parametrize("content, why", [
    (b"junk", "is not a readable Parquet file"),
    (None, "not a request table: columns"),  # the events themselves, as requests.parquet
])
def test_derive_derives_when_the_replays_own_table_is_unusable(tmp_path, content, why):
    run, _ = _replay_folder(tmp_path, lambda other: {"output": {"requests_file": "requests.parquet"}})
    own = run / "requests.parquet"
    own.write_bytes(content if content is not None else (run / "events.parquet").read_bytes())
    done = _run("requests", "derive", str(run / "events.parquet"), "--out", str(run / "r.parquet"), env=ENV)
    assert done.exit_code == 0, done.output
    assert f"warning: the replay's own request table is unusable: {own}" in done.output and why in done.output
    assert "deriving it from the events instead" in done.output
    assert pq.read_table(run / "r.parquet")["request_id"].to_pylist()[0].startswith("rq_")


# -- D4: no side file ------------------------------------------------------------------------------------------


def test_derive_writes_no_side_file_and_leaves_a_file_of_the_old_side_files_name_alone(tmp_path):
    events, out = tmp_path / "bar.parquet", tmp_path / "req.parquet"
    pq.write_table(_raw(), events)
    (tmp_path / "bar.sanitized.parquet").write_bytes(b"precious")
    assert _run("requests", "derive", str(events), "--out", str(out), env=ENV).exit_code == 0
    assert (tmp_path / "bar.sanitized.parquet").read_bytes() == b"precious"
    assert _listing(tmp_path) == ["bar.parquet", "bar.sanitized.parquet", "req.parquet"]
    raw = _raw()
    pq.write_table(_with(raw, "ts_ns", [*raw["ts_ns"].to_pylist()[:-1], -1]), events)  # now invalid at the end
    before = out.read_bytes()
    done = _run("requests", "derive", str(events), "--out", str(out), env=ENV)
    assert done.exit_code == 3 and f"error: {events}:{raw.num_rows}: $.ts_ns: " in done.output
    assert out.read_bytes() == before
    assert _listing(tmp_path) == ["bar.parquet", "bar.sanitized.parquet", "req.parquet"]


# -- D7, D8: lake.duckdb_memory_limit --------------------------------------------------------------------------


@pytest.mark.parametrize("limit, message", [
    ("-5GB", "lake.duckdb_memory_limit '-5GB' is negative: DuckDB would take it as no limit at all"),
    ("1B", "lake.duckdb_memory_limit '1B' is below 16MB: DuckDB cannot run a derivation in that little memory"),
])
def test_derive_refuses_a_memory_limit_that_is_negative_or_too_small(tmp_path, limit, message):
    events = tmp_path / "e.parquet"
    pq.write_table(_sanitized(_raw()), events)
    done = _run("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"),
                env={**ENV, "SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT": limit})
    assert done.exit_code == 3 and f"error: {message}" in done.output, done.output
    assert "hint: e.g. 2GB or 600MB ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT)" in done.output
    assert _listing(tmp_path) == ["e.parquet"]


def test_derive_running_out_of_memory_names_the_setting(tmp_path):
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    n = 20  # a replay's 198 events: more than DuckDB can derive in 16MB
    summary = run_replay(make_workload([i * 10**7 for i in range(n)], [100] * n, [5] * n), out_dir=tmp_path / "run")
    events = tmp_path / "e.parquet"
    pq.write_table(_sanitized(pq.read_table(summary.events_path)), events)
    done = _run("requests", "derive", str(events), "--out", str(tmp_path / "r.parquet"),
                env={**ENV, "SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT": "16MB"})
    assert done.exit_code == 3, done.output
    assert "error: DuckDB ran out of memory deriving the request table under lake.duckdb_memory_limit" in done.output
    assert "hint: raise it ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT)" in done.output
    assert "internal error" not in done.output and _listing(tmp_path) == ["e.parquet", "run"]


def test_an_input_without_events_is_written_empty_with_a_warning(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    sanitized = _run("privacy", "sanitize", str(empty), "--out", str(tmp_path / "s.parquet"), env=ENV)
    assert sanitized.exit_code == 0 and pq.read_table(tmp_path / "s.parquet").num_rows == 0
    assert f"warning: {empty} holds no events (an empty file, or only blank lines): {tmp_path / 's.parquet'} is empty" in sanitized.output
    derived = _run("requests", "derive", str(empty), "--out", str(tmp_path / "r.parquet"), env=ENV)
    assert derived.exit_code == 0 and pq.read_table(tmp_path / "r.parquet").num_rows == 0
    assert f"warning: {empty} holds no request's events: {tmp_path / 'r.parquet'} has no rows" in derived.output
