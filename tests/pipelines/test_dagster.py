"""The Dagster definitions, executed in-process on a slice of a real trace that went through Kafka.

The slice: the first 300 requests of the bundled Azure 2023 conversation trace (2023-11-16), replayed
through FCFS with three tenants and two service classes assigned, every event emitted to the test
broker and ingested into a fresh lake by the real consumer. Each check is then shown to fail on a
deliberately broken copy (a raw tenant id, a shuffled workload, a nondeterministic replay).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines import batch
from pipelines import dagster_assets as assets
from pipelines.broker import free_port
from pipelines.emitter import Emitter
from pipelines.lake import EVENTS, Lake, OffsetRange
from replay.config import parse_instance
from replay.policies import POLICIES, AdmissionDecision, Policy, register
from replay.run import run_replay
from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
from replay.traces import read_trace
from schemas.arrow import events_to_table
from schemas.events import RequestArrived
from tests.pipelines.test_ingest import KEYRING, consumer

DAY = "2023-11-16"
NUM_REQUESTS = 300
ENGINE = "llama-3-8b@h100-sxm"
CHECK_NAMES = {key.name for check in assets.CHECKS for key in check.check_keys}
KEY_ENV = "test:" + base64.b64encode(KEYRING.secrets["test"]).decode()


@dataclass(frozen=True)
class NoSettings:
    """The test policies have nothing to configure."""


class ShortestPromptFirst(Policy):
    """A deterministic candidate for the tests: waiting requests by prompt length."""

    name = "test-spf"
    config_type = NoSettings

    def order(self, view, waiting):
        return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_ns))


class CoinFlipAdmission(Policy):
    """A broken candidate: rejects at random from an unseeded generator (not reproducible)."""

    name = "test-coin-flip"
    config_type = NoSettings

    def admit(self, view, request):
        if random.random() < 0.3:
            return AdmissionDecision(decision="reject", reason="coin flip", retry_after_s=1.0)
        return super().admit(view, request)


@contextmanager
def registered(*policies: type[Policy]) -> Iterator[None]:
    for policy in policies:
        register(policy)
    try:
        yield
    finally:
        for policy in policies:
            POLICIES.pop(policy.name, None)


@dataclass(frozen=True)
class Deployment:
    """A lake and an output folder, and the environment that points the resources at them."""

    root: Path
    topic: str
    bootstrap: str

    @property
    def lake_root(self) -> Path:
        return self.root / "lake"

    @property
    def out_dir(self) -> Path:
        return self.root / "out"

    @contextmanager
    def environment(self) -> Iterator[None]:
        values = {"SERVELENS_ENV": "local", "SERVELENS_LAKE__ROOT": str(self.lake_root),
                  "SERVELENS_PATHS__OUT_DIR": str(self.out_dir), "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap,
                  "SERVELENS_KAFKA__TOPIC": self.topic, "SERVELENS_PSEUDONYM_KEY": KEY_ENV}
        with pytest.MonkeyPatch.context() as patch:
            for name, value in values.items():
                patch.setenv(name, value)
            yield

    def copy(self, root: Path) -> Deployment:
        shutil.copytree(self.root, root)
        return Deployment(root, self.topic, self.bootstrap)


def resources(**plan) -> dict:
    plan = {"production": "fcfs", "candidates": ["test-spf"], "loads": ["1x", "2x"], **plan}
    return {"lake": assets.LakeResource(), "kafka": assets.KafkaResource(timeout_s=3.0),
            "privacy_key": assets.PrivacyKeyResource(), "plan": assets.ReplayPlanResource(**plan)}


@pytest.fixture(scope="module")
def ingested(broker, tmp_path_factory, shared) -> Deployment:
    """The trace slice through the replay engine, Kafka and the ingest consumer into a lake."""
    root = tmp_path_factory.mktemp("dagster")
    deployment = Deployment(root / "deployment", "dagster-events", broker.bootstrap)
    trace = read_trace("azure-conv", shared).slice(0, NUM_REQUESTS)
    scenario = Scenario(name="three-tenants",
                        tenants=(TenantSpec(name="acme", share=3), TenantSpec(name="globex", share=1),
                                 TenantSpec(name="initech", share=1)),
                        service_classes=(ServiceClassSpec(name="interactive", share=2, ttft_objective_s=2.0),
                                         ServiceClassSpec(name="batch", share=1)))
    recorded = run_replay(trace, scenario=scenario, instance=parse_instance(ENGINE), out_dir=root / "recorded")
    with Emitter(broker.bootstrap, deployment.topic) as emitter:
        assert emitter.emit_table(pq.read_table(recorded.events_path)) == recorded.num_events
        assert emitter.flush(30)
    stats = consumer(broker.bootstrap, deployment.topic, deployment.lake_root).run(idle_exit_s=2.0)
    assert stats.events_written == recorded.num_events and stats.dead_letters == 0
    return deployment


def materialize(selection, *, instance, partition_key=None, **plan) -> dg.ExecuteInProcessResult:
    return dg.materialize([*assets.ASSETS, *assets.CHECKS], selection=selection, partition_key=partition_key,
                          instance=instance, resources=resources(**plan))


def run_key(policy: str, load: str) -> dg.MultiPartitionKey:
    return assets.run_partition(DAY, batch.ReplayCase(policy, load))


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """A throwaway Dagster instance (``instance_for_test``: ephemeral ones can lose their storage's
    back-reference when another test's instance is collected)."""
    with dg.instance_for_test() as test_instance:
        yield test_instance


@pytest.fixture(scope="module")
def materialized(ingested, tmp_path_factory) -> Iterator[tuple[Deployment, dg.DagsterInstance, list[dg.ExecuteInProcessResult]]]:
    deployment = ingested.copy(tmp_path_factory.mktemp("full") / "deployment")
    with dg.instance_for_test() as test_instance:
        with deployment.environment(), registered(ShortestPromptFirst):
            results = assets.materialize_day(DAY, resources(), test_instance)
        yield deployment, test_instance, results


# ------------------------------------------------------------------------------------------ loading


def test_the_definitions_load_and_name_every_asset_check_job_sensor_and_schedule():
    from pipelines.definitions import defs

    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {
        "ingested_events", "request_table", "step_table", "workload", "scaled_workload", "replay_runs", "comparisons",
        "gate_verdicts"}
    assert {k.name for k in graph.asset_check_keys} == CHECK_NAMES
    assert {j.name for j in assets.JOBS} <= {j.name for j in defs.resolve_all_job_defs()}
    assert defs.resolve_sensor_def("new_ingest_commits") and defs.resolve_schedule_def("nightly_replay")


def test_an_unknown_or_incomplete_environment_profile_fails_with_the_fix(monkeypatch):
    from pipelines.dagster_resources import resources_for_env
    from servelens.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown SERVELENS_ENV 'staging'") as error:
        resources_for_env("staging")
    assert "local, compose, production" in error.value.hint
    monkeypatch.delenv("SERVELENS_LAKE__ROOT", raising=False)
    with pytest.raises(ConfigError, match="production needs SERVELENS_LAKE__ROOT"):
        resources_for_env("production")


def test_the_nightly_plan_comes_from_the_configuration_and_is_checked(monkeypatch):
    from pipelines.dagster_resources import resources_for_env
    from replay.errors import ReplayError
    from servelens.errors import ConfigError

    monkeypatch.setenv("SERVELENS_NIGHTLY__CANDIDATES", "test-spf, fcfs")
    monkeypatch.setenv("SERVELENS_NIGHTLY__LOADS", "1x,1.5x")
    plan = resources_for_env("local")["plan"]
    with registered(ShortestPromptFirst):
        assert plan.candidate_names() == ["test-spf"]
        assert [c.key for c in plan.cases()] == ["fcfs@1x", "fcfs@1.5x", "test-spf@1x", "test-spf@1.5x"]
    with pytest.raises(ReplayError, match="unknown policy 'test-spf'"):
        plan.candidate_names()
    monkeypatch.setenv("SERVELENS_NIGHTLY__LOADS", "1x,3x")
    with registered(ShortestPromptFirst), pytest.raises(ConfigError, match="'3x' is not a load scenario"):
        resources_for_env("local")["plan"].candidate_names()


# ------------------------------------------------------------------------------------------ the graph


def test_the_whole_graph_materializes_in_process_with_every_check_passing(materialized):
    deployment, instance, results = materialized
    assert all(r.success for r in results)
    evaluations = {name: e for r in results for name, e in check_results(r).items()}
    assert set(evaluations) == CHECK_NAMES
    failed = {name: e.metadata for name, e in evaluations.items() if not e.passed}
    assert not failed

    out = deployment.out_dir
    requests = pq.read_table(out / "tables" / "requests" / f"dt={DAY}.parquet")
    assert requests.num_rows == NUM_REQUESTS
    assert set(requests["tenant"].to_pylist()) <= set(KEYRING.pseudonyms("tn", ["acme", "globex", "initech"]))
    assert pq.read_metadata(out / "tables" / "steps" / f"dt={DAY}.parquet").num_rows > 0
    recorded = np.sort(requests["arrival_ns"].to_numpy())
    assert np.array_equal(pq.read_table(batch.workload_path(out, DAY))["arrival_ns"].to_numpy(), recorded)
    doubled = pq.read_table(batch.workload_path(out, DAY, "2x"))["arrival_ns"].to_numpy()
    assert np.allclose(doubled - doubled[0], (recorded - recorded[0]) / 2, atol=1)

    verdicts = pq.read_table(out / "verdicts" / f"dt={DAY}.parquet").to_pylist()
    assert [(v["candidate"], v["load"]) for v in verdicts] == [("test-spf", "1x"), ("test-spf", "2x")]
    for v in verdicts:
        report = json.loads((Path(v["report"]).with_name("gate.json")).read_text())
        assert v["status"] == report["status"] in ("pass", "fail", "inconclusive") and v["reasons"]
        assert report["candidate"]["manifest"].endswith(f"replay/{DAY}/test-spf@{v['load']}/manifest.json")

    ingest = next(r for r in results if r.get_asset_materialization_events()[0].asset_key == dg.AssetKey("ingested_events"))
    metadata = ingest.get_asset_materialization_events()[0].materialization.metadata
    assert metadata["kafka_partitions"].value > 0 and metadata["kafka_backlog_records"].value >= 0


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_rematerializing_one_replay_partition_touches_only_that_replay(materialized):
    deployment, instance, _ = materialized
    before = _snapshot(deployment.out_dir)
    counts = {key: len(instance.fetch_materializations(key, limit=100).records) for key in
              (dg.AssetKey(a.key.path) for a in assets.ASSETS)}
    with deployment.environment(), registered(ShortestPromptFirst):
        result = materialize([assets.replay_runs], instance=instance, partition_key=run_key("test-spf", "2x"))
    assert result.success
    [event] = result.get_asset_materialization_events()
    assert event.asset_key == dg.AssetKey("replay_runs") and event.partition == f"test-spf@2x|{DAY}"
    after = _snapshot(deployment.out_dir)
    changed = {path for path in after if after[path] != before.get(path)}
    assert changed and all(path.startswith(f"replay/{DAY}/test-spf@2x/") for path in changed)
    for key, count in counts.items():
        expected = count + (key == dg.AssetKey("replay_runs"))
        assert len(instance.fetch_materializations(key, limit=100).records) == expected, key


# ------------------------------------------------------------------------------------------ checks fail


def _ingest_checks(deployment: Deployment) -> dict[str, dg.AssetCheckEvaluation]:
    with dg.instance_for_test() as instance, deployment.environment():
        return check_results(materialize([assets.ingested_events], instance=instance))


def test_a_raw_tenant_id_in_the_lake_fails_the_identifier_check(ingested, tmp_path):
    broken = ingested.copy(tmp_path / "deployment")
    raw = events_to_table([RequestArrived(event_id=f"ev_{1:032x}", ts_ns=1_700_136_000 * 10**9, engine_id="eng",
                                          request_id="rq_00ab", tenant="acme-corp", num_prompt_tokens=10,
                                          pseudonym_key_id="test")])
    Lake(broken.lake_root).commit(EVENTS, raw, [OffsetRange("side-door", 0, 0, 0, 1)], {("side-door", 0, 0): None})
    evaluations = _ingest_checks(broken)
    assert not evaluations["no_raw_identifiers"].passed
    assert evaluations["no_raw_identifiers"].metadata["raw_tenants"].value == 1
    assert _ingest_checks(ingested)["no_raw_identifiers"].passed


def test_events_under_an_unknown_key_and_too_many_dimensions_fail_their_checks(ingested, tmp_path):
    broken = ingested.copy(tmp_path / "deployment")
    models = [RequestArrived(event_id=f"ev_{i:032x}", ts_ns=1_700_136_000 * 10**9 + i, engine_id="eng",
                             request_id=f"rq_{i:04x}", model=f"model-{i}", num_prompt_tokens=10,
                             pseudonym_key_id="rotated-away") for i in range(100)]
    Lake(broken.lake_root).commit(EVENTS, events_to_table(models), [OffsetRange("side-door", 0, 0, 0, 100)],
                                  {("side-door", 0, 0): None})
    evaluations = _ingest_checks(broken)
    assert evaluations["no_raw_identifiers"].metadata["rows_without_a_known_key"].value == 100
    assert not evaluations["cardinality_within_budget"].passed
    assert "model" in evaluations["cardinality_within_budget"].metadata["over_budget"].value
    assert evaluations["events_schema_conforms"].passed and evaluations["dead_letter_rate"].passed


def _workload_check(deployment: Deployment, mutate) -> dg.AssetCheckEvaluation:
    path = batch.workload_path(deployment.out_dir, DAY)
    pq.write_table(mutate(pq.read_table(path)), path)
    with dg.instance_for_test() as instance, deployment.environment():
        result = dg.materialize([*assets.ASSETS, *assets.CHECKS], instance=instance,
                                resources=resources(), selection=dg.AssetSelection.checks(assets.workload_keeps_bursts))
    return check_results(result)["workload_keeps_bursts"]


def test_a_shuffled_workload_fails_the_burstiness_check(materialized, tmp_path):
    deployment = materialized[0].copy(tmp_path / "rows")
    rng = np.random.default_rng(7)
    evaluation = _workload_check(deployment, lambda t: t.take(rng.permutation(t.num_rows)))
    assert not evaluation.passed and evaluation.metadata["days"].value[DAY]["in_order"] is False

    # Shuffling the gaps keeps the order and the inter-arrival CV, but moves the bursts: caught too.
    deployment = materialized[0].copy(tmp_path / "gaps")

    def shuffle_gaps(table: pa.Table) -> pa.Table:
        arrivals = table["arrival_ns"].to_numpy()
        gaps = rng.permutation(np.diff(arrivals))
        shuffled = np.concatenate([[arrivals[0]], arrivals[0] + np.cumsum(gaps)])
        return table.set_column(table.schema.get_field_index("arrival_ns"), "arrival_ns", pa.array(shuffled))

    evaluation = _workload_check(deployment, shuffle_gaps)
    assert not evaluation.passed and evaluation.metadata["days"].value[DAY]["arrivals_as_recorded"] is False


def test_a_request_whose_first_token_precedes_its_arrival_warns_in_its_check(materialized, tmp_path):
    deployment = materialized[0].copy(tmp_path / "skewed")
    path = deployment.out_dir / "tables" / "requests" / f"dt={DAY}.parquet"
    table = pq.read_table(path)
    first = table["first_token_ns"].to_pylist()
    first[3] = table["arrival_ns"][3].as_py() - 1  # one request's first token 1 ns before its arrival
    pq.write_table(table.set_column(table.schema.get_field_index("first_token_ns"), "first_token_ns", pa.array(first)), path)
    with dg.instance_for_test() as instance, deployment.environment():
        result = dg.materialize([*assets.ASSETS, *assets.CHECKS], instance=instance, resources=resources(),
                                selection=dg.AssetSelection.checks(assets.request_timestamps_in_order))
    evaluation = check_results(result)["request_timestamps_in_order"]
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
    assert evaluation.metadata["requests_out_of_order_by_day"].value == {DAY: 1}


def test_a_nondeterministic_replay_fails_the_determinism_check(materialized, instance, tmp_path):
    deployment = materialized[0].copy(tmp_path / "deployment")
    instance.add_dynamic_partitions("replay_case", ["test-coin-flip@2x"])
    with deployment.environment(), registered(CoinFlipAdmission):
        result = materialize([assets.replay_runs, assets.replay_is_deterministic], instance=instance,
                             partition_key=run_key("test-coin-flip", "2x"))
    evaluation = check_results(result)["replay_is_deterministic"]
    assert not evaluation.passed
    assert evaluation.metadata["mismatched"].value == [f"{DAY}/test-coin-flip@2x"]


# ------------------------------------------------------------------------------------------ automation


def test_the_sensor_derives_the_days_of_new_commits_once(ingested):
    with ingested.environment():
        lake = assets.LakeResource()
        first = assets.new_ingest_commits(dg.build_sensor_context(resources={"lake": lake}))
        assert [r.partition_key for r in first] == [DAY]
        version = Lake(ingested.lake_root).table(EVENTS).version()
        again = assets.new_ingest_commits(dg.build_sensor_context(cursor=str(version), resources={"lake": lake}))
        assert isinstance(again, dg.SkipReason)


def test_the_nightly_schedule_replays_yesterday_through_every_candidate_at_every_load():
    import datetime as dt

    with dg.instance_for_test() as instance, registered(ShortestPromptFirst):
        context = dg.build_schedule_context(instance=instance, resources=resources(),
                                            scheduled_execution_time=dt.datetime(2023, 11, 17, 2, tzinfo=dt.UTC))
        requests = assets.nightly_replay(context)
        assert sorted(r.partition_key for r in requests) == [
            f"fcfs@1x|{DAY}", f"fcfs@2x|{DAY}", f"test-spf@1x|{DAY}", f"test-spf@2x|{DAY}"]
        assert sorted(instance.get_dynamic_partitions("replay_case")) == ["fcfs@1x", "fcfs@2x", "test-spf@1x",
                                                                          "test-spf@2x"]


def test_the_on_demand_job_replays_and_gates_a_new_candidate(ingested, instance, tmp_path):
    deployment = ingested.copy(tmp_path / "deployment")
    with deployment.environment(), registered(ShortestPromptFirst):
        materialize([assets.request_table, assets.step_table, assets.workload], instance=instance, partition_key=DAY)
        result = assets.compare_candidate_job.execute_in_process(
            instance=instance, resources=resources(),
            run_config={"ops": {"compare_candidate": {"config": {"candidate": "test-spf", "day": DAY, "loads": ["1x"]}}}})
    assert result.success
    verdicts = pq.read_table(result.output_for_node("compare_candidate")).to_pylist()
    assert [(v["candidate"], v["load"]) for v in verdicts] == [("test-spf", "1x")]


# ------------------------------------------------------------------------------------------ webserver


def test_the_webserver_serves_the_asset_graph_on_loopback_and_shuts_down_cleanly(tmp_path):
    port = free_port()
    home = tmp_path / "dagster-home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "SERVELENS_ENV": "local"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("dagster-webserver")), "-m", "pipelines.definitions",
                               "-h", "127.0.0.1", "-p", str(port)], env=env, cwd=Path(__file__).parents[2],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    query = json.dumps({"query": "{ assetNodes { assetKey { path } dependencyKeys { path } } }"}).encode()
    try:
        deadline, answer = time.monotonic() + 120, None
        while answer is None and time.monotonic() < deadline and server.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=query,
                                                 headers={"Content-Type": "application/json"})
                answer = json.load(urllib.request.urlopen(request, timeout=5))
            except OSError:
                time.sleep(0.5)
        assert answer is not None, server.stdout.read1().decode(errors="replace") if server.poll() is not None else "timeout"
        nodes = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]}
                 for n in answer["data"]["assetNodes"]}
        assert nodes["replay_runs"] == {"scaled_workload"} and nodes["gate_verdicts"] == {"comparisons"}
        assert nodes["request_table"] == {"ingested_events"}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code in (0, -signal.SIGTERM)
    assert not _port_in_use(port)


def _port_in_use(port: int) -> bool:
    from pipelines.broker import port_is_free

    return not port_is_free("127.0.0.1", port)
