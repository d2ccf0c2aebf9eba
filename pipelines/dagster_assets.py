"""The assets, checks, jobs, sensor and schedule of ``pipelines.definitions``: thin wrappers over
``pipelines.batch``, which does the work and needs no Dagster.

Partitions: the day (UTC) is a partition of every asset downstream of the lake: the day's tables,
workload and load scenarios, its comparisons and verdicts by day, its replay runs by day x case (a
case is ``policy@load``, a dynamic dimension: a new candidate or load is a new partition). So
re-running one policy at one load on one day is one partition, a backfill is a range of days, and
lineage reads per day. The nightly schedule launches one run per case (the queued run coordinator
bounds how many run at once, ``deploy/dagster.yaml``).
"""

import datetime as dt
import json
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq

from pipelines import batch
from pipelines.dagster_resources import KafkaResource, LakeResource, PrivacyKeyResource, ReplayPlanResource
from pipelines.ingest import read_statuses
from pipelines.lake import DEAD_LETTERS, EVENTS
from servelens import layout
from servelens.errors import ServelensError

DAYS = dg.DailyPartitionsDefinition(start_date="2023-01-01", timezone="UTC")
CASES = dg.DynamicPartitionsDefinition(name="replay_case")  # policy@load
RUNS = dg.MultiPartitionsDefinition({"day": DAYS, "case": CASES})
#: The tag of every replay run: the queued run coordinator's concurrency limit counts it.
REPLAY_TAG = "servelens/replay"
MAX_DEAD_LETTER_RATE = 0.01
MAX_BURSTINESS_DRIFT = 0.1  # relative change of the inter-arrival CV a workload may show
_BY_DAY = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name="day")


def run_partition(day: str, case: batch.ReplayCase) -> dg.MultiPartitionKey:
    """The partition of ``replay_runs`` that replays ``case`` on ``day``."""
    return dg.MultiPartitionKey({"day": day, "case": case.key})


# ------------------------------------------------------------------------------------------ assets


@dg.asset(group_name="servelens", description="The sanitized events and dead letters the ingest consumers committed "
                                              "(the Delta commit log is the ingest manifest).")
def ingested_events(context: dg.AssetExecutionContext, lake: LakeResource, kafka: KafkaResource) -> dg.MaterializeResult:
    store = lake.lake()
    store.ensure_tables()
    events, dead = store.table(EVENTS), store.table(DEAD_LETTERS)
    metadata = {"events_version": events.version(), "dead_letters_version": dead.version(),
                "event_files": len(store.files(EVENTS)), "dead_letter_files": len(store.files(DEAD_LETTERS)),
                "consumers": [s["consumer"] for s in read_statuses(store.root)]}
    try:
        backlog = kafka.backlog(store)
        metadata["kafka_backlog_records"] = sum(p.lag for p in backlog)
        metadata["kafka_partitions"] = len(backlog)
    except ServelensError as exc:  # the lake is readable without the broker; say so, do not fail
        context.log.warning(f"Kafka backlog unknown: {exc}")
        metadata["kafka_backlog_records"] = "unknown: broker unreachable"
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[ingested_events],
          description="One row per request that arrived that day (UTC), from the lake's events.")
def request_table(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    written = batch.request_table_for_day(lake.lake(), context.partition_key, lake.out_dir())
    return dg.MaterializeResult(metadata={"path": str(written.path), "num_requests": written.num_rows})


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[ingested_events],
          description="The engine steps that ended that day (UTC).")
def step_table(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    written = batch.step_table_for_day(lake.lake(), context.partition_key, lake.out_dir())
    return dg.MaterializeResult(metadata={"path": str(written.path), "num_steps": written.num_rows})


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[request_table],
          description="The day's workload (arrivals, lengths, tenants, classes) in recorded order, ready to replay.")
def workload(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    out, day = lake.out_dir(), context.partition_key
    written = batch.workload_for_day(out / "tables" / "requests" / f"dt={day}.parquet", day, out)
    return dg.MaterializeResult(metadata={"path": str(written.path), "num_requests": written.num_rows})


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[workload],
          description="The day's load scenarios (the nightly plan's loads): its workload at 1.5x, 2x... its arrival "
                      "rate (gaps divided, bursts kept).")
def scaled_workload(context: dg.AssetExecutionContext, lake: LakeResource, plan: ReplayPlanResource) -> dg.MaterializeResult:
    day = context.partition_key
    written = {load: batch.scaled_workload(lake.out_dir(), day, load) for load in plan.loads}
    return dg.MaterializeResult(metadata={"day": day, "loads": list(written),
                                          "paths": [str(w.path) for w in written.values()],
                                          "num_requests": max((w.num_rows for w in written.values()), default=0)})


@dg.asset(group_name="servelens", partitions_def=RUNS,
          deps=[dg.AssetDep(scaled_workload, partition_mapping=_BY_DAY)],
          description="A replay of the day's workload through one policy at one load: events.parquet + manifest.json.")
def replay_runs(context: dg.AssetExecutionContext, lake: LakeResource, plan: ReplayPlanResource) -> dg.MaterializeResult:
    keys = context.partition_key.keys_by_dimension
    case, day = batch.ReplayCase.from_key(keys["case"]), keys["day"]
    summary = batch.replay_day(lake.out_dir(), day, case, seed=plan.seed, **plan.engine_kwargs())
    return dg.MaterializeResult(metadata={
        "day": day, "run": case.key, "manifest": str(summary.manifest_path), "num_requests": summary.num_requests,
        "events_sha256": summary.output_sha256, "num_preemptions": summary.num_preemptions,
    })


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[dg.AssetDep(replay_runs, partition_mapping=_BY_DAY)],
          description="Every candidate's replay against production's at the same load: gate.json/.md/.html each.")
def comparisons(context: dg.AssetExecutionContext, lake: LakeResource, plan: ReplayPlanResource) -> dg.MaterializeResult:
    day = context.partition_key
    reports = batch.compare_day(lake.out_dir(), day, plan.production, plan.cases())
    return dg.MaterializeResult(metadata={"day": day, "reports": [str(r) for r in reports]})


@dg.asset(group_name="servelens", partitions_def=DAYS, deps=[comparisons],
          description="The day's gate verdicts: pass, fail or inconclusive per candidate and load, with reasons.")
def gate_verdicts(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    written = batch.verdicts_for_day(lake.out_dir(), context.partition_key)
    verdicts = pq.read_table(written.path).to_pylist()
    lines = [f"- {v['candidate']}@{v['load']}: **{v['status']}** ({v['reasons']})" for v in verdicts]
    return dg.MaterializeResult(metadata={
        "path": str(written.path), "num_verdicts": written.num_rows,
        "verdicts": dg.MetadataValue.md("\n".join(lines) or "no candidate besides production"),
    })


ASSETS = [ingested_events, request_table, step_table, workload, scaled_workload, replay_runs, comparisons, gate_verdicts]

# ------------------------------------------------------------------------------------------ checks


@dg.asset_check(asset=ingested_events, description="Every stored event file carries the contract's columns and types.")
def events_schema_conforms(lake: LakeResource) -> dg.AssetCheckResult:
    from schemas.arrow import EVENTS_SCHEMA

    missing, wrong = set(), set()
    store = lake.lake()
    for path in store.files(EVENTS):
        schema = store.read_schema(path)
        for field in EVENTS_SCHEMA:
            if field.name not in schema.names:
                missing.add(field.name)
            elif not schema.field(field.name).type.equals(field.type):
                wrong.add(f"{field.name}: {schema.field(field.name).type} (contract: {field.type})")
    return dg.AssetCheckResult(passed=not missing and not wrong,
                               metadata={"missing_columns": sorted(missing), "wrong_types": sorted(wrong)})


@dg.asset_check(asset=ingested_events, description="No raw identifier in the sanitized events: every id, user and tenant "
                                                   "is a pseudonym made with a configured key, and every clear-text "
                                                   "label has the allowlist's shape (privacy.labels).")
def no_raw_identifiers(lake: LakeResource, privacy_key: PrivacyKeyResource) -> dg.AssetCheckResult:
    key_ids = sorted(privacy_key.keyring().secrets)
    # clear-text labels outside the allowlist's shape (privacy.labels): a sentence, a credential, a bare number
    label = "'^[A-Za-z0-9][A-Za-z0-9._:/@+\\-]{0,127}$'"
    raw_label = " OR ".join(
        f"({c} IS NOT NULL AND {c} NOT IN ('other', '_REDACTED_') AND NOT regexp_matches({c}, '^replay-[0-9a-f]{{12}}$') "
        f"AND (NOT regexp_matches({c}, {label}) "
        f"OR regexp_matches({c}, '(^|[^A-Za-z0-9])[0-9]{{7,}}([^A-Za-z0-9]|$)')))"
        for c in ("engine_id", "instance_id", "service_class", "model", "pool", "target"))
    query = f"""
        SELECT count(*) FILTER (WHERE NOT regexp_matches(event_id, '^ev_[0-9a-f]+$')),
               count(*) FILTER (WHERE request_id IS NOT NULL AND NOT regexp_matches(request_id, '^rq_[0-9a-f]+$')),
               count(*) FILTER (WHERE tenant IS NOT NULL AND tenant <> 'other' AND NOT regexp_matches(tenant, '^tn_[0-9a-f]+$')),
               count(*) FILTER (WHERE pseudonym_key_id IS NULL OR NOT list_contains($keys, pseudonym_key_id)),
               count(*) FILTER (WHERE ("user" IS NOT NULL AND NOT regexp_matches("user", '^us_[0-9a-f]+$'))
                                   OR (session_id IS NOT NULL AND NOT regexp_matches(session_id, '^se_[0-9a-f]+$'))
                                   OR (api_key_id IS NOT NULL AND NOT regexp_matches(api_key_id, '^ak_[0-9a-f]+$'))),
               count(*) FILTER (WHERE {raw_label})
        FROM events"""
    counts = lake.lake().connect().execute(query, {"keys": key_ids}).fetchone()
    names = ("raw_event_ids", "raw_request_ids", "raw_tenants", "rows_without_a_known_key", "raw_user_ids",
             "raw_labels")
    return dg.AssetCheckResult(passed=not any(counts), metadata={**dict(zip(names, counts)), "key_ids": key_ids})


@dg.asset_check(asset=ingested_events, description="Distinct values per bounded column stay within its dimension's "
                                                   "privacy budget (+1 for 'other').")
def cardinality_within_budget(lake: LakeResource) -> dg.AssetCheckResult:
    from privacy.sanitize import bounded_columns

    budgets = bounded_columns(lake.config().privacy)
    con = lake.lake().connect()
    counts = {c: con.execute(f'SELECT count(DISTINCT "{c}") FROM events').fetchone()[0] for c in budgets}
    over = {c: n for c, n in counts.items() if n > budgets[c] + 1}
    return dg.AssetCheckResult(passed=not over, metadata={"distinct": counts, "budgets": budgets, "over_budget": over})


@dg.asset_check(asset=ingested_events, description=f"Dead letters stay under {MAX_DEAD_LETTER_RATE:.0%} of the records read.")
def dead_letter_rate(lake: LakeResource) -> dg.AssetCheckResult:
    con = lake.lake().connect()
    events = con.execute("SELECT count(*) FROM events").fetchone()[0]
    dead = con.execute("SELECT count(*) FROM dead_letters").fetchone()[0]
    rate = dead / (events + dead) if events + dead else 0.0
    return dg.AssetCheckResult(passed=rate < MAX_DEAD_LETTER_RATE, metadata={"dead_letter_rate": rate, "dead_letters": dead})


@dg.asset_check(asset=request_table, description="No request holds a timestamp before the one its latency is measured "
                                                 "from (a first token before its arrival: clocks that disagree, a "
                                                 "broken emitter); the request table leaves such latencies null.")
def request_timestamps_in_order(lake: LakeResource) -> dg.AssetCheckResult:
    from replay.derive import BACKWARDS_SQL, connect, count_backwards

    con = connect(lake.config().lake.duckdb_memory_limit)
    days = {path.stem.removeprefix("dt="): count_backwards(con, path)
            for path in sorted((lake.out_dir() / "tables" / "requests").glob("dt=*.parquet"))}
    return dg.AssetCheckResult(passed=not any(days.values()), severity=dg.AssetCheckSeverity.WARN,
                               metadata={"requests_out_of_order_by_day": days, "condition": BACKWARDS_SQL})


def _bursts_kept(arrivals: np.ndarray, recorded: np.ndarray, factor: Fraction = Fraction(1)) -> dict[str, bool]:
    """Same order and gaps (divided by ``factor``, to the nanosecond) as recorded, and the same
    inter-arrival CV."""
    from replay.workload import burstiness

    in_order = bool(np.all(np.diff(arrivals) >= 0))
    expected = recorded[0] + (recorded - recorded[0]) * factor.denominator // factor.numerator if len(recorded) else recorded
    same = len(arrivals) == len(recorded) and bool(np.array_equal(arrivals, expected))
    cv_kept = True
    if len(arrivals) > 2 and in_order:
        a, b = burstiness(arrivals).interarrival_cv, burstiness(recorded).interarrival_cv
        cv_kept = abs(a - b) <= MAX_BURSTINESS_DRIFT * b
    return {"in_order": in_order, "arrivals_as_recorded": same, "burstiness_kept": cv_kept}


def _arrivals(path: Path) -> np.ndarray:
    return pq.read_table(path, columns=["arrival_ns"])["arrival_ns"].drop_null().to_numpy()


@dg.asset_check(asset=workload, description="Each day's workload keeps the recorded arrivals: order, gaps and burstiness "
                                            "(never shuffled).")
def workload_keeps_bursts(lake: LakeResource) -> dg.AssetCheckResult:
    out = lake.out_dir()
    days = {}
    for path in sorted((out / "workloads").glob("dt=*.parquet")):
        day = path.stem.removeprefix("dt=")
        days[day] = _bursts_kept(_arrivals(path), np.sort(_arrivals(out / "tables" / "requests" / f"dt={day}.parquet")))
    return dg.AssetCheckResult(passed=bool(days) and all(all(v.values()) for v in days.values()), metadata={"days": days})


@dg.asset_check(asset=scaled_workload, description="A load scenario is its day's workload with every gap divided by "
                                                   "the load: same order, same burstiness.")
def scaled_workload_keeps_bursts(lake: LakeResource) -> dg.AssetCheckResult:
    out = lake.out_dir()
    runs = {}
    for path in sorted((out / "workloads" / "scaled").glob("*/*.parquet")):
        day, load = path.parent.name, path.stem
        recorded = _arrivals(batch.workload_path(out, day))
        runs[f"{day}@{load}"] = _bursts_kept(_arrivals(path), recorded, batch.load_factor(load))
    return dg.AssetCheckResult(passed=all(all(v.values()) for v in runs.values()), metadata={"scaled": runs})


@dg.asset_check(asset=replay_runs, description="Replays are deterministic: rerunning a manifest's workload, policy and "
                                               "seed reproduces its events hash (the partition just materialized, "
                                               "else every stored replay).")
def replay_is_deterministic(context: dg.AssetCheckExecutionContext, lake: LakeResource,
                            plan: ReplayPlanResource) -> dg.AssetCheckResult:
    out = lake.out_dir()
    manifests = layout.replay_manifests(out)
    if context.op_execution_context.has_partition_key:
        keys = context.op_execution_context.partition_key.keys_by_dimension
        mine = [m for m in manifests if m.parent.name == keys["case"] and m.parent.parent.name == keys["day"]]
        manifests = sorted(mine, key=lambda m: m.stat().st_mtime_ns)[-1:]
    mismatched = []
    for manifest_path in manifests:
        manifest = json.loads(manifest_path.read_text())
        day, (policy, _, load) = manifest_path.parent.parent.name, manifest_path.parent.name.rpartition("@")
        with tempfile.TemporaryDirectory() as tmp:
            rerun = batch.replay_day(out, day, batch.ReplayCase(policy, load), seed=manifest["seed"],
                                     run_dir=Path(tmp), **plan.engine_kwargs())
        if rerun.output_sha256 != manifest["output"]["events_sha256"]:
            mismatched.append(f"{day}/{manifest_path.parent.name}")
    return dg.AssetCheckResult(passed=bool(manifests) and not mismatched,
                               metadata={"checked": len(manifests), "mismatched": mismatched})


CHECKS = [events_schema_conforms, no_raw_identifiers, cardinality_within_budget, dead_letter_rate,
          request_timestamps_in_order, workload_keeps_bursts, scaled_workload_keeps_bursts, replay_is_deterministic]


# ------------------------------------------------------------------------------------------ automation

derive_day_job = dg.define_asset_job("derive_day", selection=[request_table, step_table, workload, scaled_workload])
replay_job = dg.define_asset_job("replay", selection=[replay_runs], tags={REPLAY_TAG: "true"})
verdicts_job = dg.define_asset_job("verdicts", selection=[comparisons, gate_verdicts])


@dg.sensor(job=derive_day_job, minimum_interval_seconds=60,
           description="Derives the days of new ingest commits: each new Delta version of the events table.")
def new_ingest_commits(context: dg.SensorEvaluationContext, lake: LakeResource):
    store = lake.lake()
    table = store.table(EVENTS)
    if table is None:
        return dg.SkipReason("the lake has no events table yet")
    version, seen = table.version(), int(context.cursor or -1)
    if version <= seen:
        return dg.SkipReason(f"no new commit since version {version}")
    days = batch.days_committed_since(table, seen, store.storage.as_dict() if store.is_remote else None)
    context.update_cursor(str(version))
    return [dg.RunRequest(run_key=f"events-v{version}-{day}", partition_key=day) for day in days]


@dg.schedule(cron_schedule="0 2 * * *", execution_timezone="UTC", job=replay_job,
             description="Every night: replay yesterday through production and the candidates at every load, one run "
                         "per (policy, load); the queued run coordinator runs them in parallel up to its limit.")
def nightly_replay(context: dg.ScheduleEvaluationContext, plan: ReplayPlanResource):
    day = (context.scheduled_execution_time.date() - dt.timedelta(days=1)).isoformat()
    cases = plan.cases()
    add_cases(context.instance, cases)
    return [dg.RunRequest(run_key=f"{day}-{case.key}", partition_key=run_partition(day, case)) for case in cases]


def add_cases(instance: dg.DagsterInstance, cases: list[batch.ReplayCase]) -> None:
    """Register the replay cases (``policy@load``) as partitions of ``replay_runs``."""
    known = set(instance.get_dynamic_partitions(CASES.name))
    instance.add_dynamic_partitions(CASES.name, [c.key for c in dict.fromkeys(cases) if c.key not in known])


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[replay_job], request_job=verdicts_job,
                      description="Once every planned replay of a day succeeded, ask for that day's comparisons and "
                                  "verdicts (once per day).")
def verdicts_when_replays_done(context: dg.RunStatusSensorContext, lake: LakeResource, plan: ReplayPlanResource):
    day = context.dagster_run.tags.get("dagster/partition/day")
    if not day:
        return dg.SkipReason("the replay run has no day partition")
    missing = [c.key for c in plan.cases() if not (batch.replay_dir(lake.out_dir(), day, c) / "manifest.json").is_file()]
    if missing:
        return dg.SkipReason(f"{day}: waiting for {', '.join(missing)}")
    return dg.RunRequest(run_key=f"verdicts-{day}", partition_key=day)


def materialize_day(day: str, resources: dict, instance: dg.DagsterInstance,
                    progress: Callable[[str], None] = lambda _: None,
                    log_level: str = "INFO") -> list[dg.ExecuteInProcessResult]:
    """Every asset of the graph for ``day``, in process, in the order the sensor, the nightly
    schedule and the run-status sensor launch them in a deployment: the ingested events, the day's
    tables, workload and load scenarios, one run per (policy, load) replay, then comparisons and
    verdicts (a deployment runs the replays in parallel: ``docs/pipelines.md``). Asset checks run with
    their assets (a failed check is in the results, not raised).
    ``log_level`` is the console logger's (Dagster logs each step at DEBUG).
    """
    plan: ReplayPlanResource = resources["plan"]
    cases = plan.cases()
    add_cases(instance, cases)
    definitions = [*ASSETS, *CHECKS]
    run_config = {"loggers": {"console": {"config": {"log_level": log_level}}}}

    def run(selection, partition_key=None) -> dg.ExecuteInProcessResult:
        return dg.materialize(definitions, selection=selection, partition_key=partition_key, instance=instance,
                              resources=resources, run_config=run_config)

    progress(f"deriving the request table, steps, workload and load scenarios of {day}")
    results = [run([ingested_events]), run([request_table, step_table, workload, scaled_workload], day)]
    for n, case in enumerate(cases, 1):
        progress(f"replay {n}/{len(cases)}: {case.policy} at {case.load} load")
        results.append(run([replay_runs], run_partition(day, case)))
    progress("comparing each candidate with production and writing the verdicts")
    results.append(run([comparisons, gate_verdicts], day))
    return results


class CandidateConfig(dg.Config):
    """An on-demand comparison: which candidate, on which day's workload, at which loads."""

    candidate: str
    day: str
    loads: list[str] = ["1x", "2x"]


@dg.op(description="Replay a day's workload through a new candidate (and production, if not yet replayed), then gate it.")
def compare_candidate(context: dg.OpExecutionContext, config: CandidateConfig, lake: LakeResource,
                      plan: ReplayPlanResource) -> str:
    out = lake.out_dir()
    cases = [batch.ReplayCase(p, load) for p in (plan.production, config.candidate) for load in config.loads]
    for case in cases:
        if not (batch.replay_dir(out, config.day, case) / "manifest.json").is_file() or case.policy == config.candidate:
            batch.replay_day(out, config.day, case, seed=plan.seed, **plan.engine_kwargs())
    batch.compare_day(out, config.day, plan.production, cases)
    written = batch.verdicts_for_day(out, config.day)
    for row in pq.read_table(written.path).to_pylist():
        if row["candidate"] == config.candidate:
            context.log.info(f"{row['candidate']}@{row['load']}: {row['status']} ({row['reasons']}) -> {row['report']}")
    return str(written.path)


@dg.job(description="On demand: replay a new candidate policy on a recorded day and gate it against production.")
def compare_candidate_job():
    compare_candidate()


JOBS = [derive_day_job, replay_job, verdicts_job, compare_candidate_job]
