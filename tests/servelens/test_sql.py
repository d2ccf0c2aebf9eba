"""SQL quoting: what the helpers quote reads back unchanged through DuckDB, quotes included."""

from __future__ import annotations

import duckdb
import pytest

from servelens.sql import sql_identifier, sql_literal, sql_literal_list

AWKWARD = ["plain", "it's", "''", 'say "hi"', "/tmp/a'; DROP TABLE x; --/b.parquet", ""]


@pytest.mark.parametrize("text", AWKWARD)
def test_a_literal_reads_back_as_the_text(text):
    assert duckdb.connect().execute(f"SELECT {sql_literal(text)} AS v").fetchone() == (text,)


@pytest.mark.parametrize("name", [n for n in AWKWARD if n])
def test_an_identifier_names_the_column(name):
    assert duckdb.connect().sql(f"SELECT 1 AS {sql_identifier(name)}").columns == [name]


def test_a_list_of_literals_reads_back_in_order():
    assert duckdb.connect().execute(f"SELECT [{sql_literal_list(AWKWARD)}]").fetchone() == (AWKWARD,)
