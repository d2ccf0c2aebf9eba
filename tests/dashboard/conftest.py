"""Dashboard fixtures: a small lake (a replayed slice of the bundled Azure trace, sanitized and
committed as ingest would), replay runs at three loads, a gate report, dead letters and an ingest
health line; an empty lake; and a helper that runs the app under AppTest with given settings."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from dashboard.config import SETTINGS_ENV, DashboardConfig, Settings, settings_json
from pipelines.config import LakeConfig
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing, write_keyfile
from tests.scaleout.conftest import object_store  # noqa: F401  (moto's S3 server, for test_browser_s3)

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
PAGES = ("traffic", "service_levels", "load_latency", "policies", "gate", "request_explorer", "tenants")
VIEWER = "tenant-0"
KEYRING = KeyRing("test-1", {"test-1": bytes(range(32))})


@dataclass(frozen=True)
class Sample:
    """Paths of the sample data, and the settings that point the dashboard at it."""

    root: Path
    settings: Settings
    num_requests: int

    def with_dashboard(self, **changes) -> Settings:
        return dataclasses.replace(self.settings, dashboard=dataclasses.replace(self.settings.dashboard, **changes))


def _settings(root: Path, **dashboard) -> Settings:
    return Settings(
        dashboard=DashboardConfig(runs_dir=str(root / "runs"), gate_dir=str(root / "gate"), cache_dir=str(root / "cache"),
                                  gate_config_file=str(root / "gate.yaml"), **dashboard),
        lake=LakeConfig(root=str(root / "lake")),
        privacy=PrivacyConfig(key_file=str(root / "key.toml")),
    )


def _dead_letters(n: int) -> pa.Table:
    from schemas.arrow import arrow_schema
    from schemas.records import DeadLetter

    now = time.time_ns()
    reasons = ["missing_field", "wrong_type", "oversized", "missing_field"]
    return pa.Table.from_pylist([
        {"topic": "servelens.events.v1", "partition": 0, "offset": i, "epoch": 0, "key": None, "size_bytes": 100 + i,
         "reason": reasons[i % len(reasons)], "path": "$.ts_ns", "value_type": "string", "expected": "an integer",
         "num_errors": 1, "event_type": "request_arrived", "received_ns": now - (n - i) * 10**9}
        for i in range(n)
    ], schema=arrow_schema(DeadLetter))


@pytest.fixture(scope="session")
def sample(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Sample:
    """The small lake, three load levels of one policy plus a second configuration, a gate report."""
    from dashboard.sample import SAMPLE_GATE_YAML, SAMPLE_SCENARIO, replay_into_lake
    from pipelines.ingest import IngestStats, write_status
    from pipelines.lake import DEAD_LETTERS, Lake, OffsetRange
    from replay.config import EngineConfig, parse_instance
    from replay.gate import compare_runs, load_config, load_run
    from replay.policies.fcfs import FcfsConfig
    from replay.report import write_reports
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TableWorkload, scale_rate

    root = tmp_path_factory.mktemp("dashboard-sample")
    write_keyfile(root / "key.toml", KEYRING)
    (root / "gate.yaml").write_text(SAMPLE_GATE_YAML)
    trace = read_trace("azure-conv", shared)
    instance = parse_instance("llama-3-8b@h100-sxm", EngineConfig(num_kv_blocks_override=2000, max_num_seqs=48))
    lake_slice = trace.slice(0, 1200)
    replay_into_lake(TableWorkload(scale_rate(lake_slice, 1.5), name="azure-conv"), root / "lake", KEYRING,
                     instance=instance, chunk_rows=25_000)
    lake = Lake(str(root / "lake"))
    lake.commit(DEAD_LETTERS, _dead_letters(7), [OffsetRange("dead", 0, 0, 0, 7)], {("dead", 0, 0): None})
    write_status(str(root / "lake"), IngestStats(
        consumer="ingest-test", records_read=120_000, events_written=119_993, dead_letters=7, duplicates_dropped=3,
        commits=12, commits_fenced=0, events_per_s=41_000.0, dead_letter_rate=7 / 120_000,
        last_commit_ns=time.time_ns() - 2 * 10**9, lag=(), broker_reachable=True))

    runs = root / "runs"
    run_slice = trace.slice(0, 400)
    for name, factor in (("fcfs", 1.0), ("fcfs@1.5x", 1.5), ("fcfs@2x", 2.0)):
        workload = scale_rate(run_slice, factor) if factor != 1 else run_slice
        run_replay(TableWorkload(workload, name=f"azure-conv@{factor:g}x"), scenario=SAMPLE_SCENARIO, instance=instance,
                   out_dir=runs / name)
    run_replay(TableWorkload(run_slice, name="azure-conv"), scenario=SAMPLE_SCENARIO, instance=instance,
               policy_config=FcfsConfig(long_prefill_token_threshold=256), out_dir=runs / "fcfs-chunk256")
    config = load_config(root / "gate.yaml")
    baseline, candidate = load_run(runs / "fcfs", "baseline"), load_run(runs / "fcfs-chunk256", "candidate")
    write_reports(compare_runs(baseline, candidate, config), baseline, candidate, root / "gate")
    return Sample(root, _settings(root, viewer_tenant=VIEWER), lake_slice.num_rows)


@pytest.fixture
def empty(tmp_path: Path) -> Settings:
    """Settings for a dashboard with nothing yet: no lake, no runs, no gate report."""
    write_keyfile(tmp_path / "key.toml", KEYRING)
    return _settings(tmp_path)


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., object]]:
    """``app(settings, page=None, query=None)``: the dashboard under AppTest, run once (on ``page``,
    a file under dashboard/app_pages/, after the entry point), with the settings passed exactly as
    ``dashboard.serve`` passes them."""
    from streamlit.testing.v1 import AppTest

    def run(settings: Settings, page: str | None = None, query: dict | None = None, timeout: float = 60):
        monkeypatch.setenv(SETTINGS_ENV, settings_json(settings))
        at = AppTest.from_file(str(APP), default_timeout=timeout)
        at.run()
        if page is not None:
            at.switch_page(f"app_pages/{page}.py")
            at.query_params.update(query or {})
            at.run()
        return at

    yield run
