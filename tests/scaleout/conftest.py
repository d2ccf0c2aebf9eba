"""Servers the scale-out tests start for themselves: moto's S3-compatible server and PostgreSQL.

Both are real server processes on free loopback ports, started once per session and stopped at
its end. A missing one fails the test with the command that installs it (``make test`` does).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.broker import free_port

ROOT = Path(__file__).parents[2]
ACCESS_KEY, SECRET_KEY = "servelens-test", "servelens-test-secret-7f3a"


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "tests/scaleout/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.scaleout)


@dataclass(frozen=True)
class ObjectStore:
    """A running S3-compatible server: its endpoint and the environment that points clients at it."""

    endpoint: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def bucket(self, prefix: str = "lake") -> str:
        """A new, empty bucket; its name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.fixture(scope="session")
def object_store(tmp_path_factory) -> Iterator[ObjectStore]:
    """moto's S3 server (``tests.scaleout.s3server``) on a free port, for the session."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "tests.scaleout.s3server", str(port)], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto's S3 server did not start (see {log.name})")
            time.sleep(0.1)
    try:
        yield ObjectStore(endpoint)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def store_env(object_store) -> Iterator[ObjectStore]:
    """This process reads the object store too (its variables set for the module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in object_store.env().items():
            patch.setenv(name, value)
        yield object_store


def _postgres_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: run 'make env' (it installs Debian's postgresql) "
                    "or 'apt-get install postgresql'")
    return found


@dataclass(frozen=True)
class Postgres:
    """A running PostgreSQL server with a database for Dagster."""

    port: int
    database: str = "dagster"
    user: str = "dagster"
    password: str = "dagster-test"

    def env(self) -> dict[str, str]:
        """The variables ``deploy/dagster.yaml`` reads."""
        return {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(self.port), "DAGSTER_PG_DB": self.database,
                "DAGSTER_PG_USER": self.user, "DAGSTER_PG_PASSWORD": self.password}


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """PostgreSQL (Debian's binaries) in a fresh data folder on a free port, for the session. As root
    it runs as the ``postgres`` user (the server refuses root)."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="servelens-pg-"))
    if as_user:
        shutil.chown(data, "postgres", "postgres")
    pwfile = data / "pw"
    server = Postgres(free_port())
    subprocess.run([*as_user, "sh", "-c", f"echo {server.password} > {pwfile}"], check=True)
    subprocess.run([*as_user, _postgres_bin("initdb"), "-D", str(data / "db"), "-U", server.user, "-A", "scram-sha-256",
                    f"--pwfile={pwfile}", "--no-sync"], check=True, capture_output=True)
    options = f"-c listen_addresses=127.0.0.1 -c port={server.port} -c unix_socket_directories='' -c fsync=off"
    subprocess.run([*as_user, _postgres_bin("pg_ctl"), "-D", str(data / "db"), "-o", options, "-l", str(data / "log"),
                    "-w", "start"], check=True, capture_output=True)
    try:
        import psycopg2

        con = psycopg2.connect(host="127.0.0.1", port=server.port, user=server.user, password=server.password,
                               dbname="postgres")
        con.autocommit = True
        con.cursor().execute(f"CREATE DATABASE {server.database}")
        con.close()
        yield server
    finally:
        subprocess.run([*as_user, _postgres_bin("pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


from tests.pipelines.conftest import broker, topic  # noqa: E402,F401  (the Kafka fixtures, for these tests too)
