"""Servers for the scale-out tests and benchmarks, started on this machine's loopback: moto's
S3-compatible server, PostgreSQL (Debian's), and a Dagster deployment on it (webserver + daemon
with ``deploy/dagster.yaml``: PostgreSQL storage, the queued run coordinator).

``python -m benchmarks.servers s3 PORT`` runs moto's S3 application with one difference from
``moto_server``: requests are applied one at a time. moto checks ``If-None-Match: *`` and then
stores the object in two steps, so two threads could both pass the check; S3 (and MinIO) make the
check and the write one atomic step, which Delta's commit coordination relies on. Connections
stay concurrent (a threaded server).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.broker import free_port

ROOT = Path(__file__).parents[1]
ACCESS_KEY, SECRET_KEY = "servelens-test", "servelens-test-secret-7f3a"


def serve_s3(port: int) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ, start_response):
        with lock:
            return list(app(environ, start_response))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple("127.0.0.1", port, one_at_a_time, threaded=True, request_handler=MotoRequestHandler)


def _wait_http(url: str, process: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.2)


@dataclass
class S3Server:
    """moto's S3 server process; ``env()`` points clients (servelens included) at it."""

    endpoint: str
    process: subprocess.Popen

    @classmethod
    def start(cls, log_path: Path) -> S3Server:
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "benchmarks.servers", "s3", str(port)], cwd=ROOT,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(f"http://127.0.0.1:{port}", process)
        try:
            _wait_http(f"{server.endpoint}/moto-api/", process, 60, f"moto's S3 server (log: {log_path})")
        except RuntimeError:
            server.stop()
            raise
        return server

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def _client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def bucket(self, prefix: str = "lake") -> str:
        """A new, empty bucket; its name."""
        import uuid

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self._client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def postgres_bin(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


@dataclass
class Postgres:
    """A PostgreSQL server in a fresh data folder on a free port, with a database for Dagster. As
    root it runs as the ``postgres`` user (the server refuses root)."""

    port: int
    data: Path
    as_user: list[str]
    database: str = "dagster"
    user: str = "dagster"
    password: str = "dagster-test"

    @classmethod
    def start(cls) -> Postgres:
        missing = [n for n in ("initdb", "pg_ctl") if postgres_bin(n) is None]
        if missing:
            raise RuntimeError(f"PostgreSQL's {missing[0]} is not installed: run 'make env' or 'apt-get install postgresql'")
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        data = Path(tempfile.mkdtemp(prefix="servelens-pg-"))
        if as_user:
            shutil.chown(data, "postgres", "postgres")
        server = cls(free_port(), data, as_user)
        pwfile = data / "pw"
        subprocess.run([*as_user, "sh", "-c", f"echo {server.password} > {pwfile}"], check=True)
        subprocess.run([*as_user, postgres_bin("initdb"), "-D", str(data / "db"), "-U", server.user, "-A",
                        "scram-sha-256", f"--pwfile={pwfile}", "--no-sync"], check=True, capture_output=True)
        options = f"-c listen_addresses=127.0.0.1 -c port={server.port} -c unix_socket_directories='' -c fsync=off"
        subprocess.run([*as_user, postgres_bin("pg_ctl"), "-D", str(data / "db"), "-o", options, "-l",
                        str(data / "log"), "-w", "start"], check=True, capture_output=True)
        server.create_database(server.database)
        return server

    def create_database(self, name: str) -> None:
        import psycopg2

        con = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                               dbname="postgres")
        con.autocommit = True
        con.cursor().execute(f"CREATE DATABASE {name}")
        con.close()

    def env(self, database: str | None = None) -> dict[str, str]:
        """The variables ``deploy/dagster.yaml`` reads."""
        return {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(self.port),
                "DAGSTER_PG_DB": database or self.database, "DAGSTER_PG_USER": self.user,
                "DAGSTER_PG_PASSWORD": self.password}

    def stop(self) -> None:
        subprocess.run([*self.as_user, postgres_bin("pg_ctl"), "-D", str(self.data / "db"), "-m", "immediate",
                        "stop"], capture_output=True)
        shutil.rmtree(self.data, ignore_errors=True)


@dataclass
class DagsterDeployment:
    """``dagster-daemon`` and ``dagster-webserver`` over ``pipelines.definitions`` with the instance
    of ``deploy/dagster.yaml`` (PostgreSQL storage, queued runs); runs are submitted through the
    webserver's GraphQL API, as the UI and the schedule's daemon would launch them."""

    home: Path
    env: dict[str, str]
    port: int
    processes: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, home: Path, env: dict[str, str], max_concurrent_runs: int) -> DagsterDeployment:
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "deploy" / "dagster.yaml", home / "dagster.yaml")
        env = {**env, "DAGSTER_HOME": str(home), "DAGSTER_MAX_CONCURRENT_RUNS": str(max_concurrent_runs),
               "DAGSTER_STORAGE_DIR": str(home / "storage")}
        deployment = cls(home, env, free_port())
        bin_dir = Path(sys.executable).parent
        commands = {"daemon": [str(bin_dir / "dagster-daemon"), "run", "-m", "pipelines.definitions"],
                    "webserver": [str(bin_dir / "dagster-webserver"), "-m", "pipelines.definitions", "-h", "127.0.0.1",
                                  "-p", str(deployment.port)]}
        for name, command in commands.items():
            with (home / f"{name}.log").open("wb") as log:
                deployment.processes.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=log,
                                                             stderr=subprocess.STDOUT, start_new_session=True))
        try:
            _wait_http(f"http://127.0.0.1:{deployment.port}/server_info", deployment.processes[1], 180,
                       f"dagster-webserver (log: {home / 'webserver.log'})")
        except RuntimeError:
            deployment.stop()
            raise
        return deployment

    def instance(self):
        """The deployment's Dagster instance, read from this process (the variables must be set here too)."""
        import dagster as dg

        return dg.DagsterInstance.from_config(str(self.home))

    def submit(self, job: str, tags: dict[str, str]) -> str:
        """Queue a run of ``job`` (partition tags as ``PartitionsDefinition.get_tags_for_partition_key``)."""
        import warnings

        from dagster_graphql import DagsterGraphQLClient

        with warnings.catch_warnings():  # Dagster's own partition tag keys ("dagster/partition/day") trip its check
            warnings.simplefilter("ignore", DeprecationWarning)
            return DagsterGraphQLClient("127.0.0.1", port_number=self.port).submit_job_execution(job, tags=tags)

    def wait(self, run_ids: list[str], timeout_s: float) -> dict[str, str]:
        """Each run's final status (SUCCESS, FAILURE, CANCELED), waiting for all of them to end."""
        from dagster_graphql import DagsterGraphQLClient

        client = DagsterGraphQLClient("127.0.0.1", port_number=self.port)
        deadline, done = time.monotonic() + timeout_s, {}
        while len(done) < len(run_ids) and time.monotonic() < deadline:
            for run_id in run_ids:
                if run_id not in done:
                    status = client.get_run_status(run_id).value
                    if status in ("SUCCESS", "FAILURE", "CANCELED"):
                        done[run_id] = status
            time.sleep(0.5)
        return {run_id: done.get(run_id, "TIMED_OUT") for run_id in run_ids}

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals (start, end) that were open at one moment."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


if __name__ == "__main__":
    if sys.argv[1:2] == ["s3"]:
        serve_s3(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m benchmarks.servers s3 PORT")
