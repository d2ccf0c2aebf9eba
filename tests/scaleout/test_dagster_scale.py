"""The nightly day as Dagster runs it at scale: PostgreSQL storage, the queued run coordinator with
a concurrency limit, one replay run per (policy, load) on the multiprocess executor, in parallel;
the lake on an S3-compatible server, the outputs on a shared folder.

Real processes throughout: PostgreSQL (Debian's), moto's S3 server, ``dagster-daemon`` and
``dagster-webserver`` with the shipped ``deploy/dagster.yaml``; runs are submitted through the
webserver's GraphQL API as the UI would, each a partition of the day.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks.servers import DagsterDeployment, overlap
from pipelines import batch
from pipelines import dagster_assets as assets
from pipelines.lake import EVENTS, Lake

DAY = "2023-11-16"
NUM_REQUESTS = 300
MAX_RUNS = 2
CASES = [batch.ReplayCase(p, load) for p in ("fcfs", "sarathi") for load in ("1x", "2x")]
KEY = bytes(range(32))
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def s3_day(store_env, shared, tmp_path_factory) -> str:
    """A day of replayed traffic (300 requests of the bundled Azure trace, three tenants, two
    classes), sanitized and committed to ``s3://<bucket>/lake`` as ingest commits."""
    from dashboard.sample import replay_into_lake
    from privacy.keys import KeyRing
    from replay.config import parse_instance
    from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
    from replay.traces import read_trace

    root = f"s3://{store_env.bucket()}/lake"
    scenario = Scenario(name="three-tenants",
                        tenants=(TenantSpec(name="acme", share=3), TenantSpec(name="globex", share=1),
                                 TenantSpec(name="initech", share=1)),
                        service_classes=(ServiceClassSpec(name="interactive", share=2, ttft_objective_s=2.0),
                                         ServiceClassSpec(name="batch", share=1)))
    replay_into_lake(read_trace("azure-conv", shared).slice(0, NUM_REQUESTS), root, KeyRing("test", {"test": KEY}),
                     scenario=scenario, instance=parse_instance("llama-3-8b@h100-sxm"), chunk_rows=5_000)
    return root


@pytest.fixture(scope="module")
def deployment(s3_day, store_env, postgres, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared-out")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SERVELENS_")}, **store_env.env(),
           **postgres.env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "SERVELENS_ENV": "local", "SERVELENS_LAKE__ROOT": s3_day, "SERVELENS_PATHS__OUT_DIR": str(out),
           "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9", "SERVELENS_PSEUDONYM_KEY": "test:" + base64.b64encode(KEY).decode(),
           "SERVELENS_NIGHTLY__PRODUCTION": "fcfs", "SERVELENS_NIGHTLY__CANDIDATES": "sarathi",
           "SERVELENS_NIGHTLY__LOADS": "1x,2x", "SERVELENS_DAGSTER__EXECUTOR": "multiprocess"}
    if "SERVELENS_SHARED_DIR" in os.environ:
        env["SERVELENS_SHARED_DIR"] = os.environ["SERVELENS_SHARED_DIR"]
    running = DagsterDeployment.start(tmp_path_factory.mktemp("dagster-home"), env, max_concurrent_runs=MAX_RUNS)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in running.env.items():
                patch.setenv(name, value)
            yield running, out
    finally:
        running.stop()


def test_the_nightly_day_runs_as_parallel_runs_on_postgres_storage(deployment):
    running, out = deployment
    instance = running.instance()
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    assets.add_cases(instance, CASES)

    derive = running.submit("derive_day", assets.DAYS.get_tags_for_partition_key(DAY))
    assert running.wait([derive], 240) == {derive: "SUCCESS"}
    requests = pq.read_table(out / "tables" / "requests" / f"dt={DAY}.parquet")  # derived from s3://
    assert requests.num_rows == NUM_REQUESTS

    replays = [running.submit("replay", assets.RUNS.get_tags_for_partition_key(assets.run_partition(DAY, c)))
               for c in CASES]
    assert set(running.wait(replays, 420).values()) == {"SUCCESS"}
    records = {r.dagster_run.run_id: r for r in instance.get_run_records()}
    spans = [(records[r].start_time, records[r].end_time) for r in replays]
    assert overlap(spans) == MAX_RUNS  # in parallel, never more than the coordinator's limit
    for run_id in replays:
        assert records[run_id].dagster_run.tags[assets.REPLAY_TAG] == "true"
        logs = " ".join(e.message or "" for e in instance.all_logs(run_id))
        assert "multiprocess executor" in logs  # each step in its own process

    verdicts = running.submit("verdicts", assets.DAYS.get_tags_for_partition_key(DAY))
    assert running.wait([verdicts], 240) == {verdicts: "SUCCESS"}
    table = pq.read_table(out / "verdicts" / f"dt={DAY}.parquet").to_pylist()
    assert sorted((v["candidate"], v["load"]) for v in table) == [("sarathi", "1x"), ("sarathi", "2x")]
    assert all(v["status"] in ("pass", "fail", "inconclusive") and v["reasons"] for v in table)

    # lineage per day: every downstream asset was materialized for this day's partition
    import dagster as dg

    for key, expected in (("replay_runs", {str(assets.run_partition(DAY, c)) for c in CASES}),
                          ("comparisons", {DAY}), ("gate_verdicts", {DAY}), ("scaled_workload", {DAY})):
        records_ = instance.fetch_materializations(dg.AssetKey(key), limit=100).records
        assert {r.partition_key for r in records_} == expected, key
    assert Lake(os.environ["SERVELENS_LAKE__ROOT"]).table(EVENTS) is not None


def _validate(executor: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_")}
    return subprocess.run([str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-m",
                           "pipelines.definitions"], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**environ, "SERVELENS_DAGSTER__EXECUTOR": executor, **env})


@pytest.mark.parametrize("executor,setting", [("k8s", {"SERVELENS_DAGSTER__MAX_CONCURRENT_STEPS": "4"}),
                                              ("celery", {"SERVELENS_DAGSTER__CELERY_BROKER": "redis://redis:6379/0"})])
def test_the_definitions_validate_with_the_kubernetes_and_celery_executors(executor, setting, tmp_path):
    done = _validate(executor, **setting, DAGSTER_HOME=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "All code locations passed validation" in done.stdout + done.stderr
    from pipelines.dagster_resources import executor_for
    from servelens.config import load_config

    chosen = executor_for(load_config(env={"SERVELENS_DAGSTER__EXECUTOR": executor, **setting}).dagster)
    assert chosen.name == executor


def test_the_kubernetes_instance_file_is_valid_for_its_launcher_and_coordinator(tmp_path, monkeypatch):
    from dagster._config import process_config, resolve_to_config_type
    from dagster._core.instance.config import dagster_instance_config
    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster_k8s import K8sRunLauncher

    for name, value in {"SERVELENS_IMAGE": "servelens:1", "DAGSTER_K8S_NAMESPACE": "servelens",
                        "DAGSTER_MAX_CONCURRENT_RUNS": "32"}.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "dagster.yaml").write_text((ROOT / "deploy" / "dagster-k8s.yaml").read_text())
    config, _ = dagster_instance_config(str(tmp_path))
    for cls, section in ((K8sRunLauncher, "run_launcher"), (QueuedRunCoordinator, "run_coordinator")):
        assert config[section]["class"] == cls.__name__
        result = process_config(resolve_to_config_type(cls.config_type()), config[section]["config"])
        assert result.success, result.errors
