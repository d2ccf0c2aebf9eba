"""Servers the scale-out tests start for themselves: moto's S3-compatible server and PostgreSQL.

Both are real server processes on free loopback ports (``benchmarks.servers``), started once per
session and stopped at its end. A missing PostgreSQL fails the test with the command that installs
it (``make test`` does). Every test here is marked ``scaleout`` (``pytest -m scaleout``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.servers import SECRET_KEY, Postgres, S3Server, postgres_bin
from tests.pipelines.conftest import broker, topic  # noqa: F401  (the Kafka fixtures, for these tests too)

__all__ = ["SECRET_KEY"]


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "tests/scaleout/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.scaleout)


@pytest.fixture(scope="session")
def object_store(tmp_path_factory) -> Iterator[S3Server]:
    """moto's S3 server on a free port, for the session."""
    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def store_env(object_store) -> Iterator[S3Server]:
    """This process reads the object store too (its variables set for the module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in object_store.env().items():
            patch.setenv(name, value)
        yield object_store


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """PostgreSQL (Debian's binaries) in a fresh data folder on a free port, for the session."""
    if postgres_bin("initdb") is None:
        pytest.fail("PostgreSQL's initdb is not installed: run 'make env' (it installs Debian's postgresql) "
                    "or 'apt-get install postgresql'")
    server = Postgres.start()
    try:
        yield server
    finally:
        server.stop()
