"""SQL text the project writes itself: string literals and identifiers, quoted one way everywhere (a base
module). Values a user gives travel as query parameters, never through these."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def sql_literal(text: str) -> str:
    """``text`` as a SQL string literal (single quotes doubled): file paths, settings."""
    return "'" + text.replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier (double quotes doubled): column and view names."""
    return '"' + name.replace('"', '""') + '"'


def sql_literal_list(texts: Sequence[str]) -> str:
    """Comma-separated literals, as in ``read_parquet([...])``."""
    return ", ".join(sql_literal(t) for t in texts)


def parquet_relation(files: Sequence[str | Path], *, hive: bool = False) -> str:
    """``read_parquet`` over files, columns united by name (``hive``: with the lake's ``dt=``/``hour=``
    partition columns, typed DATE and INTEGER)."""
    extra = ", hive_partitioning = true, hive_types = {'dt': DATE, 'hour': INTEGER}" if hive else ""
    return f"read_parquet([{sql_literal_list([str(f) for f in files])}], union_by_name = true{extra})"
