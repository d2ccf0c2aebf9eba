"""Benchmark: a night's replays as parallel Dagster runs against the same runs one at a time.

Starts the deployment of docker-compose.yml on this machine (``benchmarks/servers.py``): moto's
S3-compatible server holding the lake, PostgreSQL for Dagster's storage, ``dagster-daemon`` and
``dagster-webserver`` with ``deploy/dagster.yaml`` (the queued run coordinator, its limit set to
``--parallel``). It commits one day of replayed traffic (the bundled Azure conversation trace, three
tenants, two classes) to ``s3://<bucket>/lake`` and derives the day (the ``derive_day`` job), then
replays the day once per (policy, load) case twice over:

1. one at a time: each ``replay`` run submitted when the one before it has ended;
2. in parallel: every run submitted at once, the coordinator keeping ``--parallel`` of them going.

Each run is what the nightly schedule launches: a run worker process with the multiprocess
executor, the replay of one partition and its determinism check (the replay done again). Runs per
hour count from the first submission to the last run's end. The parallel figure is bounded by the
machine's cores (``cpu_count`` in the output): a replay is one single-threaded process.

    python benchmarks/scale.py            # 19,366 requests (the whole trace), 8 runs, 4 at once
    python benchmarks/scale.py --quick    # 100 requests, 2 runs, 2 at once: under a minute

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import DagsterDeployment, Postgres, S3Server, overlap  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DAY = "2023-11-16"
KEY = bytes(range(32))


def fill_day(root: str, num_requests: int) -> int:
    """Replay the trace's first ``num_requests`` and commit its sanitized events to the lake at
    ``root``, as ingest would; the number of requests."""
    from dashboard.sample import replay_into_lake
    from privacy.keys import KeyRing
    from replay.config import parse_instance
    from replay.scenario import Scenario, ServiceClassSpec, TenantSpec
    from replay.traces import read_trace
    from servelens.config import load_config, shared_dir

    scenario = Scenario(name="three-tenants",
                        tenants=(TenantSpec(name="acme", share=3), TenantSpec(name="globex", share=1),
                                 TenantSpec(name="initech", share=1)),
                        service_classes=(ServiceClassSpec(name="interactive", share=2, ttft_objective_s=2.0),
                                         ServiceClassSpec(name="batch", share=1)))
    workload = read_trace("azure-conv", shared_dir(load_config())).slice(0, num_requests)
    replay_into_lake(workload, root, KeyRing("bench", {"bench": KEY}), scenario=scenario,
                     instance=parse_instance("llama-3-8b@h100-sxm"))
    return workload.num_rows


def deployment_env(root: str, out: Path, store: S3Server, postgres: Postgres) -> dict[str, str]:
    """The environment of the daemon, the webserver and their run workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVELENS_", "AWS_", "DAGSTER_"))}
    env.update(store.env())
    env.update(postgres.env())
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "SERVELENS_ENV": "local", "SERVELENS_LAKE__ROOT": root, "SERVELENS_PATHS__OUT_DIR": str(out),
                "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9",
                "SERVELENS_PSEUDONYM_KEY": "bench:" + base64.b64encode(KEY).decode(),
                "SERVELENS_DAGSTER__EXECUTOR": "multiprocess"})
    if "SERVELENS_SHARED_DIR" in os.environ:
        env["SERVELENS_SHARED_DIR"] = os.environ["SERVELENS_SHARED_DIR"]
    return env


def run_all(deployment: DagsterDeployment, cases: list, parallel: bool, timeout_s: float) -> dict:
    """Replay every case of the day, one at a time or all submitted at once; wall time, statuses and
    the most runs that were going at one moment."""
    from pipelines import dagster_assets as assets

    def tags(case) -> dict[str, str]:
        return assets.RUNS.get_tags_for_partition_key(assets.run_partition(DAY, case))

    started = time.perf_counter()
    statuses: dict[str, str] = {}
    if parallel:
        run_ids = [deployment.submit("replay", tags(case)) for case in cases]
        statuses = deployment.wait(run_ids, timeout_s)
    else:
        for case in cases:
            run_id = deployment.submit("replay", tags(case))
            statuses.update(deployment.wait([run_id], timeout_s))
    elapsed_s = time.perf_counter() - started
    records = {r.dagster_run.run_id: r for r in deployment.instance().get_run_records()}
    spans = [(records[r].start_time, records[r].end_time) for r in statuses if records[r].end_time]
    return {"elapsed_s": elapsed_s, "statuses": statuses, "most_at_once": overlap(spans),
            "run_s": sorted(end - start for start, end in spans)}


def measure(num_requests: int, cases: list, parallel: int, work: Path) -> dict:
    """Start the servers and the deployment, fill and derive the day, time the two ways."""
    from pipelines import dagster_assets as assets

    store = S3Server.start(work / "moto.log")
    postgres = Postgres.start()
    deployment = None
    try:
        root = f"s3://{store.bucket()}/lake"
        os.environ.update(store.env())
        num_requests = fill_day(root, num_requests)
        print(f"the day: {num_requests:,} requests in {root}", file=sys.stderr)
        deployment = DagsterDeployment.start(work / "dagster", deployment_env(root, work / "out", store, postgres),
                                             max_concurrent_runs=parallel)
        os.environ.update(deployment.env)
        assets.add_cases(deployment.instance(), cases)
        derive = deployment.submit("derive_day", assets.DAYS.get_tags_for_partition_key(DAY))
        if deployment.wait([derive], 600) != {derive: "SUCCESS"}:
            raise RuntimeError(f"derive_day failed (logs under {work / 'dagster'})")
        print("derived; replaying one at a time", file=sys.stderr)
        one = run_all(deployment, cases, parallel=False, timeout_s=1800)
        print(f"one at a time: {one['elapsed_s']:.1f} s; replaying {parallel} at once", file=sys.stderr)
        many = run_all(deployment, cases, parallel=True, timeout_s=1800)
    finally:
        if deployment is not None:
            deployment.stop()
        postgres.stop()
        store.stop()
    failed = [s for r in (one, many) for s in r["statuses"].values() if s != "SUCCESS"]
    if failed:
        raise RuntimeError(f"runs ended {failed} (logs under {work / 'dagster'})")
    return {"requests": num_requests, "one": one, "many": many}


def main() -> None:
    from pipelines.batch import ReplayCase

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 requests, 2 runs, 2 at once")
    parser.add_argument("--requests", type=int, default=None, help="requests of the day (default: the whole trace)")
    parser.add_argument("--parallel", type=int, default=None, help="the run coordinator's limit (default 4; quick 2)")
    args = parser.parse_args()
    num_requests = args.requests or (100 if args.quick else 1_000_000)
    parallel = args.parallel or (2 if args.quick else 4)
    loads = ("1x",) if args.quick else ("1x", "2x")
    policies = ("fcfs", "sarathi") if args.quick else ("fcfs", "sarathi", "deadline", "vtc")
    cases = [ReplayCase(policy, load) for policy in policies for load in loads]
    with tempfile.TemporaryDirectory(prefix="servelens-scale-") as tmp:
        result = measure(num_requests, cases, parallel, Path(tmp))
    one, many = result["one"], result["many"]
    per_hour_one = len(cases) / one["elapsed_s"] * 3600
    per_hour_many = len(cases) / many["elapsed_s"] * 3600
    print(f"one at a time: {per_hour_one:,.0f} runs/h; {parallel} at once: {per_hour_many:,.0f} runs/h",
          file=sys.stderr)
    print(json.dumps({
        "requests": result["requests"], "runs": len(cases), "parallel_limit": parallel,
        "cpu_count": os.cpu_count(),
        "one_at_a_time_s": round(one["elapsed_s"], 1), "parallel_s": round(many["elapsed_s"], 1),
        "one_at_a_time_runs_per_hour": round(per_hour_one), "parallel_runs_per_hour": round(per_hour_many),
        "parallel_vs_one_at_a_time": round(per_hour_many / per_hour_one, 2),
        "most_runs_at_once": many["most_at_once"],
        "run_s_median_one_at_a_time": round(one["run_s"][len(one["run_s"]) // 2], 1),
        "run_s_median_parallel": round(many["run_s"][len(many["run_s"]) // 2], 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
