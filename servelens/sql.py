"""SQL text the project writes itself: string literals and identifiers, quoted one way everywhere (a base
module). Values a user gives travel as query parameters, never through these."""

from __future__ import annotations


def sql_literal(text: str) -> str:
    """``text`` as a SQL string literal (single quotes doubled): file paths, settings."""
    return "'" + text.replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier (double quotes doubled): column and view names."""
    return '"' + name.replace('"', '""') + '"'


def sql_literal_list(texts: list[str]) -> str:
    """Comma-separated literals, as in ``read_parquet([...])``."""
    return ", ".join(sql_literal(t) for t in texts)
