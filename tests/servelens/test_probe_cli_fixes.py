"""What a hostile-input probe found in the command line, each run as users run it (a real process, real files):
`lake sql`'s unbounded --timeout-s (a thread's traceback, the timeout silently off) and --limit (a DuckDB
conversion error), a refusal naming another statement than the one given, and a connection that could read
files under ./.tmp/; `demo --requests` past a C long (an internal error); an --out whose folder cannot be made
(the message named a temporary file the user never gave, or "File exists"); a --runs-dir that does not exist
(accepted, the dashboard started); and messages that echoed a 400-digit number or a 100,000-character id whole."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from pipelines.lake import EVENTS, Lake, OffsetRange
from schemas.arrow import events_to_table
from schemas.events import RequestArrived
from schemas.wire import iter_table_json, write_jsonl

KEY_ENV = {"SERVELENS_PSEUDONYM_KEY": "test-key:" + base64.b64encode(bytes(range(32))).decode()}
T0 = 1_764_400_000_000_000_000
HUGE = "9" * 400


def servelens(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelens", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _clean(proc: subprocess.CompletedProcess) -> str:
    """Exit 3 with no traceback, no internal error: the message (stderr)."""
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert "Exception in thread" not in proc.stderr, proc.stderr
    return proc.stderr


def _events(n: int) -> pa.Table:
    return events_to_table(
        RequestArrived(event_id=f"ev_{i:032x}", ts_ns=T0 + i, engine_id="eng", request_id=f"r{i}", num_prompt_tokens=i)
        for i in range(n)
    )


@pytest.fixture
def lake(tmp_path) -> Path:
    root = tmp_path / "lake"
    Lake(root).commit(EVENTS, _events(10), [OffsetRange("t", 0, 0, 0, 10)], {("t", 0, 0): None})
    return root


def test_lake_sql_timeout_is_bounded_at_parse_time(lake):
    """--timeout-s 1e10 printed "Exception in thread Thread-1: Traceback ... OverflowError", then the result, exit 0."""
    for value in ("1e10", "1e308", "86400.5"):
        message = _clean(servelens("--lake", str(lake), "lake", "sql", "SELECT 1 AS one", "--timeout-s", value))
        assert "Invalid value for '--timeout-s'" in message and "is not in the range 0<x<=86400" in message, message
    done = servelens("--lake", str(lake), "lake", "sql", "SELECT 1 AS one", "--timeout-s", "86400")
    assert done.returncode == 0 and done.stdout.split() == ["one", "1"] and done.stderr == "", done.stderr
    assert "at most 86,400, a day" in " ".join(servelens("lake", "sql", "--help").stdout.split())


def test_lake_sql_limit_is_bounded_at_parse_time_and_a_huge_one_shown_cut(lake):
    """--limit 99999999999999999999 reached DuckDB: a conversion error with a hint about the views."""
    message = _clean(servelens("--lake", str(lake), "lake", "sql", "SELECT 1", "--limit", "99999999999999999999"))
    assert "Invalid value for '--limit': 99999999999999999999 is not in the range 1<=x<=1000000" in message, message
    assert "Conversion Error" not in message
    message = _clean(servelens("--lake", str(lake), "lake", "sql", "SELECT 1", "--limit", HUGE))
    assert f"{'9' * 64}... (400 characters) is not in the range 1<=x<=1000000" in message and HUGE not in message
    done = servelens("--lake", str(lake), "lake", "sql", "SELECT count(*) AS n FROM events", "--limit", "1000000")
    assert done.returncode == 0 and done.stdout.split() == ["n", "10"], done.stderr


def test_lake_sql_names_the_statement_it_refuses(lake):
    """INSTALL httpfs was refused "... not LOAD" (DuckDB's type of the statement)."""
    for sql, named in (("INSTALL httpfs", "not INSTALL httpfs"), ("SELECT 1; FORCE  INSTALL\n httpfs;", "not FORCE INSTALL httpfs"),
                       ("LOAD httpfs", "not LOAD httpfs"), ("SELECT 1; UPDATE t SET a = 1", "not UPDATE t SET a = 1")):
        message = _clean(servelens("--lake", str(lake), "lake", "sql", sql))
        assert f"error: refused: only queries (SELECT) may run here, {named}\n" in message, (sql, message)
        assert "hint: lake sql runs queries only" in message
    assert "not LOAD" not in _clean(servelens("--lake", str(lake), "lake", "sql", "INSTALL httpfs"))


def test_lake_sql_cannot_read_files_under_the_current_folders_tmp_and_leaves_no_spill_folder(lake, tmp_path):
    """DuckDB allowed its default temp_directory, <cwd>/.tmp/, beside the lake: user SQL could read files there."""
    work = tmp_path / "work"
    (work / ".tmp").mkdir(parents=True)
    secret = work / ".tmp" / "secret.csv"
    secret.write_text("word\nswordfish\n")
    proc = servelens("--lake", str(lake), "lake", "sql", f"SELECT * FROM read_csv('{secret}')", cwd=work)
    message = _clean(proc)
    assert "refused" in message and "swordfish" not in proc.stdout + message, message
    shown = servelens("--lake", str(lake), "lake", "sql", "--limit", "1",
                      "SELECT current_setting('temp_directory') AS t, array_to_string(current_setting("
                      "'allowed_directories'), '|') AS a", cwd=work)
    assert shown.returncode == 0, shown.stderr
    spill, allowed = shown.stdout.splitlines()[1].split()
    assert allowed.split("|") == sorted([f"{lake.resolve()}/", f"{spill}/"]), allowed
    assert str(work) not in allowed and not Path(spill).exists()  # a fresh folder, removed afterwards
    temp = tmp_path / "temp"  # where the spill folder is made: removed after a failure too
    temp.mkdir()
    for env in ({"TMPDIR": str(temp)}, {"TMPDIR": str(temp), "SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT": "banana"}):
        servelens("--lake", str(lake), "lake", "sql", "SELECT 1", env=env)
    assert list(temp.iterdir()) == []


def test_demo_requests_is_bounded_like_replay_requests(tmp_path):
    """Was "internal error: OverflowError: Python int too large to convert to C long" after the demo key was made."""
    env = {"SERVELENS_PRIVACY__DEMO_KEY_FILE": str(tmp_path / "demo-key.toml")}
    for value in ("99999999999999999999999", "1000000001"):
        message = _clean(servelens("demo", "--requests", value, "--no-serve", "--out", str(tmp_path / "demo"),
                                   cwd=tmp_path, env=env))
        assert f"Invalid value for '--requests': {value} is not in the range 100<=x<=1000000000" in message, message
    assert not (tmp_path / "demo-key.toml").exists() and not (tmp_path / "demo").exists()
    assert "at most 1,000,000,000" in " ".join(servelens("demo", "--help").stdout.split())


@pytest.fixture
def events_file(tmp_path) -> Path:
    path = tmp_path / "events.jsonl"
    write_jsonl(iter_table_json(_events(3)), path)
    return path


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_where_no_file_can_be_made_names_the_users_path(tmp_path, events_file):
    """Was "error: No such file or directory: /proc/.x.parquet.a9t9i9jf.tmp", a name the user never gave."""
    message = _clean(servelens("privacy", "sanitize", str(events_file), "--out", "/proc/x.parquet", env=KEY_ENV))
    assert "error: cannot write /proc/x.parquet: creating a file in /proc failed" in message, message
    assert ".tmp" not in message and "hint: give --out a path in a folder you can write" in message


def test_an_out_inside_a_file_is_refused_saying_so(tmp_path, events_file):
    """Was "File exists: q/in.jsonl" where q/in.jsonl is a file that --out's path runs through."""
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "in.jsonl").write_text("{}\n")
    for args in (["privacy", "sanitize", str(events_file), "--out", "q/in.jsonl/x.parquet"],
                 ["privacy", "sanitize", str(events_file), "--out", "q/in.jsonl/a/b/x.parquet"],
                 ["trace", "convert", str(tmp_path / "missing.csv"), "--out", "q/in.jsonl/x.parquet"],
                 ["requests", "derive", str(events_file), "--out", "q/in.jsonl/r.parquet"]):
        message = _clean(servelens(*args, cwd=tmp_path, env=KEY_ENV))
        assert message.startswith(f"error: cannot write {args[-1]}: q/in.jsonl is a file, not a folder, so nothing "
                                  "can be created inside it\n  hint: give --out a path in a folder"), (args, message)
        assert "File exists" not in message
    assert (tmp_path / "q" / "in.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("flag", ["--runs-dir", "--gate-dir"])
def test_dashboard_refuses_a_folder_that_does_not_exist(tmp_path, flag):
    """--runs-dir /nonexistent was accepted and the server started, listing no runs as if none were made."""
    missing = tmp_path / "nonexistent"
    message = _clean(servelens("dashboard", "--port", "0", flag, str(missing), timeout=60))
    assert f"error: {flag} {missing} does not exist" in message, message
    assert f"leave {flag} out for dashboard.{flag[2:].replace('-', '_')}" in message


def test_a_huge_key_id_is_refused_shown_cut(tmp_path):
    """A 100,000-character --id was echoed whole in privacy keygen's error."""
    long_id = "a" * 100_000
    message = _clean(servelens("privacy", "keygen", "--out", str(tmp_path / "k.toml"), "--id", long_id))
    assert f"{'a' * 64}... (100,000 characters) is longer than the 64 characters a key id may have" in message
    assert len(message) < 1_000 and not (tmp_path / "k.toml").exists()
    assert servelens("privacy", "keygen", "--out", str(tmp_path / "k.toml"), "--id", "a" * 64).returncode == 0
    message = _clean(servelens("privacy", "rotate", str(tmp_path / "k.toml"), "--id", "b" * 65))
    assert f"{'b' * 64}... (65 characters) is longer than the 64 characters" in message


def test_numbers_too_long_to_read_are_shown_cut():
    for args in (["replay", "--requests", HUGE], ["demo", "--speedup", HUGE], ["replay", "--seed", "9" * 5000]):
        message = _clean(servelens(*args))
        assert "9" * 65 not in message and "characters)" in message, (args, message)
