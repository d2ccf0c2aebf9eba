"""Dagster definitions for the batch side: ``dagster dev -m pipelines.definitions``.

Assets are thin wrappers over ``pipelines.batch`` (and, through it, the replay engine and the gate):
the ingested events, the daily request and step tables, the daily workload and its load scenarios,
the replay runs (partitioned by candidate policy x load), the comparisons and the gate verdicts.
Resources for the lake, Kafka and the pseudonym key come from one environment variable,
``SERVELENS_ENV`` (``local``, ``compose`` or ``production``; see ``pipelines.dagster_resources``).
Checks guard the assets. A sensor derives the days of new ingest commits; a schedule replays the
previous day every night and, once every replay of that night succeeded, a run-status sensor asks
for the day's verdicts; a job compares a new candidate on demand. Steps run on the executor the
``[dagster]`` section names (``SERVELENS_DAGSTER__EXECUTOR``: multiprocess, in_process, k8s or
celery); runs on the instance's run launcher, queued under its concurrency limits (``deploy/``).
"""

import dagster as dg

from pipelines import dagster_assets as assets
from pipelines.dagster_resources import executor_for_env, resources_for_env

defs = dg.Definitions(
    assets=assets.ASSETS,
    asset_checks=assets.CHECKS,
    jobs=assets.JOBS,
    sensors=[assets.new_ingest_commits, assets.verdicts_when_replays_done],
    schedules=[assets.nightly_replay],
    resources=resources_for_env(),
    executor=executor_for_env(),  # [dagster] executor: multiprocess (default), in_process, k8s or celery
)
