"""Sample data for the dashboard: a replay committed to a lake the way ingest commits real traffic.

The tests, ``benchmarks/dashboard.py`` and the README's screenshots need a lake with tenants,
classes, queueing and cancellations, and replay runs beside it. ``replay_into_lake`` replays a
workload (``replay.run.run_replay``) with a seeded scenario and commits each chunk of its events,
sanitized with the given key ring (``privacy.sanitize.Sanitizer``), to the lake (``Lake.commit``,
one Delta commit per chunk, with offsets as the ingest consumer would carry them). Optionally the
same run is also written as a run folder (events.parquet + manifest.json).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa

from pipelines.lake import EVENTS, Lake, OffsetRange
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.sanitize import Sanitizer
from replay.config import InstanceConfig
from replay.run import ReplaySummary, run_replay
from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
from replay.workload import Workload

#: Tenants with Zipf-like shares (the last is small enough to be suppressed in short samples) and
#: two classes: interactive with tight objectives, batch with the defaults.
SAMPLE_SCENARIO = Scenario(
    name="dashboard-sample",
    tenants=tuple(TenantSpec(name=f"tenant-{i}", share=s, weight=w) for i, (s, w) in enumerate(
        [(36.0, 2.0), (22.0, 1.0), (14.0, 1.0), (10.0, 1.0), (8.0, 1.0), (6.0, 0.5), (3.8, 0.5), (0.35, 1.0)])),
    service_classes=(
        ServiceClassSpec(name="interactive", share=0.35, ttft_objective_s=0.5, itl_objective_s=0.1, e2e_objective_s=30.0),
        ServiceClassSpec(name="batch", share=0.65),
    ),
    cancel_share=0.02,
    cancel_after_s_min=0.5,
    cancel_after_s_max=20.0,
)

#: The gate configuration matching ``SAMPLE_SCENARIO``'s classes (objectives for the dashboard).
SAMPLE_GATE_YAML = """\
version: 1
classes:
  - {name: interactive, ttft_s: 0.5, itl_s: 0.1, e2e_s: 30, max_queue_s: 5}
  - {name: default, ttft_s: 2.0, itl_s: 0.2, e2e_s: 60, max_queue_s: 30}
resamples: 200
"""


class LakeSink:
    """A replay sink that sanitizes each chunk of events and commits it to the lake."""

    def __init__(self, lake: Lake, sanitizer: Sanitizer, topic: str) -> None:
        self.lake = lake
        self.sanitizer = sanitizer
        self.topic = topic
        self.num_events = 0
        self.num_commits = 0

    def __call__(self, table: pa.Table) -> None:
        start = self.num_events
        end = start + table.num_rows
        self.lake.commit(EVENTS, self.sanitizer.sanitize(table), [OffsetRange(self.topic, 0, 0, start, end)],
                         {(self.topic, 0, 0): start or None})
        self.num_events = end
        self.num_commits += 1


def replay_into_lake(
    workload: pa.Table | Workload,
    lake_root: str | Path,
    keyring: KeyRing,
    *,
    privacy: PrivacyConfig | None = None,
    scenario: Scenario | None = SAMPLE_SCENARIO,
    instance: InstanceConfig | None = None,
    policy_name: str = "fcfs",
    policy_config: object | None = None,
    run_dir: str | Path | None = None,
    chunk_rows: int = 200_000,
    seed: int = 0,
) -> ReplaySummary:
    """Replay ``workload`` and commit its events, sanitized, to the lake at ``lake_root`` (and, with
    ``run_dir``, write the run folder too). Returns the replay's summary."""
    lake = Lake(str(lake_root))
    sink = LakeSink(lake, Sanitizer(keyring, privacy or PrivacyConfig()), topic=f"replay.{uuid.uuid4().hex[:12]}")
    return run_replay(workload, scenario=scenario, policy_name=policy_name, policy_config=policy_config,
                      instance=instance, seed=seed, out_dir=run_dir, sink=sink, chunk_rows=chunk_rows)
