"""``lake.duckdb_memory_limit`` in ``replay.derive.connect``: a negative or tiny limit is refused by name, and DuckDB
running out of memory while deriving is an error that names the setting (probe 3, D7 and D8)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from replay.derive import connect, derive_requests, write_requests
from servelens.errors import ConfigError

HINT = "e.g. 2GB or 600MB ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT), or leave it unset"


@pytest.mark.parametrize("limit, why", [
    ("-5GB", "is negative: DuckDB would take it as no limit at all"),
    (" - 1 TB", "is negative: DuckDB would take it as no limit at all"),
    ("1B", "is below 16MB: DuckDB cannot run a derivation in that little memory"),
    ("20k", "is below 16MB: DuckDB cannot run a derivation in that little memory"),
    ("15MiB", "is below 16MB: DuckDB cannot run a derivation in that little memory"),
    ("0.001GB", "is below 16MB: DuckDB cannot run a derivation in that little memory"),
])
def test_a_negative_or_tiny_memory_limit_is_refused_by_name(limit, why):
    with pytest.raises(ConfigError) as refused:
        connect(limit)
    assert refused.value.message.startswith(f"lake.duckdb_memory_limit {limit!r} {why}")
    assert refused.value.hint is not None and refused.value.hint.startswith(HINT)


@pytest.mark.parametrize("limit, shown", [("16MB", "15.2 MiB"), ("600M", "572.2 MiB"), ("2 GiB", "2.0 GiB"),
                                          ("1.5GB", "1.3 GiB"), ("20000kilobytes", "19.0 MiB")])
def test_sizes_from_the_floor_up_are_taken(limit, shown):
    (setting,) = connect(limit).execute("SELECT current_setting('memory_limit')").fetchone()
    assert setting == shown


@pytest.mark.parametrize("limit", ["lots", "0", "1e400GB", "20 PB"])
def test_what_duckdb_does_not_take_is_still_refused_with_its_reason(limit):
    with pytest.raises(ConfigError, match=f"lake.duckdb_memory_limit '{limit}' is not a memory size DuckDB takes"):
        connect(limit)


def test_running_out_of_memory_while_deriving_names_the_setting(tmp_path):
    from replay.run import run_replay
    from tests.replay.conftest import make_workload

    n = 20
    summary = run_replay(make_workload([i * 10**7 for i in range(n)], [100] * n, [5] * n), out_dir=tmp_path / "run")
    for derive in (lambda con: write_requests(summary.events_path, tmp_path / "r.parquet", con=con),
                   lambda con: derive_requests(pq.read_table(summary.events_path), con=con)):
        con = connect("16MB")
        con.execute("SET threads = 4")  # a few MB each: 16MB is too little whatever the machine's cores
        with pytest.raises(ConfigError) as ran_out:
            derive(con)
        assert ran_out.value.message.startswith("DuckDB ran out of memory deriving the request table under "
                                                "lake.duckdb_memory_limit (now 15.2 MiB): Out of Memory Error")
        assert ran_out.value.hint is not None and ran_out.value.hint.startswith(
            "raise it ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT), e.g. to 2GB")
    assert write_requests(summary.events_path, tmp_path / "r.parquet", con=connect("600MB")) == n
