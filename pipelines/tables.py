"""The lake's SQL sandbox: connections that may read only the lake's own folders and run only queries.

``lake sql`` and every dashboard query run on ``locked_connection``: files only under the folders a
query must read (``readable_dirs``), no network, no extension installed or loaded, the configuration
locked; ``check_query`` refuses any statement but SELECT. The request table itself is derived by
``replay.derive`` (a layer below, which the replay's gate also uses).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import duckdb

from pipelines import objectstore
from replay import derive
from servelens.sql import sql_literal


def connect(memory_limit: str | None = None, *, storage: objectstore.StorageOptions | None = None) -> duckdb.DuckDBPyConnection:
    """``replay.derive.connect`` that also reads ``s3://`` files through the object store of ``storage``
    (``pipelines.objectstore``; default: the one the environment configures, if any): the connection for
    anything that reads the lake."""
    con = derive.connect(memory_limit)
    objectstore.register(con, objectstore.storage_options() if storage is None else storage)
    return con


class ReadOnlyViolation(ValueError):
    """A statement other than a query was given where only queries may run."""


_QUOTED = re.compile(r"'((?:[^']|'')*)'")


def readable_dirs(*sources: str | Path) -> list[str]:
    """The folders a query must read: each source is a file path, a folder (ending in /) or a SQL
    relation built by servelens (its quoted absolute paths; other literals are not paths)."""
    found: set[str] = set()
    for source in sources:
        text = str(source)
        literals = [m.replace("''", "'") for m in _QUOTED.findall(text)] if "'" in text else [text]
        for literal in literals:
            if literal.startswith("/"):
                found.add(literal.rstrip("/") if literal.endswith("/") else str(Path(literal).parent))
            elif "://" in literal:
                found.add(literal.rsplit("/", 1)[0])
    return sorted(found)


def lock_down(con: duckdb.DuckDBPyConnection, readable: Sequence[str | Path]) -> duckdb.DuckDBPyConnection:
    """Lock a connection: files only under ``readable`` (resolved), no other file, no network, no
    extension installed or loaded, and the configuration itself locked (a query cannot undo it).
    Writing is refused by ``check_query`` (statement types); a COPY or ATTACH outside ``readable``
    fails here too."""
    dirs = sorted({(d if "://" in str(d) else str(Path(d).resolve())).rstrip("/") + "/" for d in readable})
    con.execute(f"SET allowed_directories = [{', '.join(sql_literal(d) for d in dirs)}]")
    for setting in ("enable_external_access = false", "autoinstall_known_extensions = false",
                    "autoload_known_extensions = false", "allow_community_extensions = false",
                    "lock_configuration = true"):
        con.execute(f"SET {setting}")
    return con


def locked_connection(readable: Sequence[str | Path], memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """``connect`` then ``lock_down``: the connection every dashboard query and ``lake sql`` use."""
    return lock_down(connect(memory_limit), readable)


def check_query(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise ``ReadOnlyViolation`` unless ``sql`` is one or more SELECT queries (no COPY, ATTACH,
    INSTALL, LOAD, SET, PRAGMA, CREATE, INSERT, ...)."""
    statements = con.extract_statements(sql)
    for statement in statements:
        if statement.type != duckdb.StatementType.SELECT:
            raise ReadOnlyViolation(f"only queries (SELECT) may run here, not {statement.type.name}")
    if not statements:
        raise ReadOnlyViolation("the text holds no query")
