"""The whole path on one machine, offline (README's first command): engine events to a canary verdict.

Stages, each a library call that this module only strings together and reports:

1. read a bundled real trace (default: Azure 2023 conversations);
2. start a local Kafka-compatible broker on a free loopback port;
3. replay the trace through the production policy on a modelled instance: this plays the engine
   fleet, with a scenario that gives the requests tenants and service classes;
4. emit those events through the emitter SDK, time-accelerated with their burst timing kept
   (events due in the same 10 ms of wall time go together, in recorded order), while an ingest
   consumer decodes, validates, sanitizes and commits them to the Delta/Parquet lake;
5. run the Dagster asset graph in process for each day of data: request and step tables, the
   workload, its load scenarios, one replay per (policy, load), the gate's comparisons and verdicts;
6. summarize: the workload, privacy, production's service levels and a verdict per candidate;
7. serve the dashboard over the demo's lake, runs and reports (the CLI prints its URL and keeps it
   up until Ctrl-C).

Every run starts from an empty demo folder (the demo's pseudonym key is kept), so running it twice
gives the same figures. Nothing leaves the loopback interface.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.abuse import TWO_CLASS_TENANCY
from replay.figures import RunFigures
from replay.metrics import MetricValue, run_metrics
from replay.policies.tenancy import Tenancy, TenantConfig
from replay.scenario import TenantSpec
from replay.traces import BUNDLED_TRACES
from replay.workload import WorkloadStats
from servelens.config import Config
from servelens.errors import ServelensError

#: The engine of the fleet and of every replay: the policy comparison's (README, docs/policies.md): one
#: llama-2-7b on two A100-80GB whose engine gets half of their memory, so that twice the trace's rate
#: overloads it and the policies differ; calibrated as `servelens replay` is by default.
DEMO_ENGINE = "llama-2-7b@a100-80gx2"
DEMO_ENGINE_SETTINGS = "gpu_memory_utilization: 0.5\nmax_num_seqs: 128\n"
DEMO_CANDIDATES = ("sarathi", "vtc", "deadline", "prefill-first")
DEMO_LOADS = ("1x", "2x")
#: The engine fleet's tenants, by falling volume: shares proportional to 1 / rank^0.9 (a Zipf skew: the
#: first sends 21% of the requests, the last 1.4%), every third rank entitled to ``batch`` (6 tenants),
#: the others to ``interactive`` (14), with the classes and objectives of the policy comparison
#: (``replay.abuse.TWO_CLASS_TENANCY``). Each request's tenant is a seeded draw (``assign_tenants``, seed 0).
DEMO_TENANT_NAMES = (
    "acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "wonka", "tyrell", "cyberdyne",
    "soylent", "oscorp", "aperture", "monarch", "vandelay", "dunder", "gringotts", "nakatomi", "massive", "prestige",
)
DEMO_TENANTS = tuple(TenantSpec(name=t, share=1 / (rank + 1) ** 0.9) for rank, t in enumerate(DEMO_TENANT_NAMES))
DEMO_TENANCY = Tenancy(
    classes=TWO_CLASS_TENANCY.classes,
    tenants=tuple(TenantConfig(name=t, service_class="batch" if rank % 3 == 2 else "interactive")
                  for rank, t in enumerate(DEMO_TENANT_NAMES)),
    default_class="interactive",
)
#: The tenant whose own requests the demo's dashboard shows (``dashboard.viewer_tenant``).
DEMO_VIEWER = "acme"
PACE_S = 0.01  # wall-clock granularity of the time-accelerated emission


@dataclass(frozen=True, slots=True)
class Verdict:
    """One candidate at one load, judged against production."""

    candidate: str
    load: str
    status: str
    reasons: str
    report: str


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo produced and measured."""

    trace: str
    stats: WorkloadStats
    out_dir: Path
    num_events: int
    num_stored: int
    num_dead_letters: int
    emit_wall_s: float
    speedup: float
    key_path: Path
    days: tuple[str, ...]
    metrics: tuple[MetricValue, ...]  # production's, at the recorded load
    verdicts: tuple[Verdict, ...]
    failed_checks: tuple[str, ...]
    wall_s: float
    policies: tuple[tuple[str, str, RunFigures], ...] = ()  # (policy, load, its replay's figures) on the first day


def demo_config(config: Config, out_dir: Path) -> Config:
    """``config`` with the demo's own lake, output folder, key, engine and dashboard viewer (never a deployment's)."""
    return dataclasses.replace(
        config,
        lake=dataclasses.replace(config.lake, root=str(out_dir / "lake")),
        paths=dataclasses.replace(config.paths, out_dir=str(out_dir / "out")),
        privacy=dataclasses.replace(config.privacy, key_file=config.privacy.demo_key_file),
        nightly=dataclasses.replace(config.nightly, engine=DEMO_ENGINE, engine_config=str(out_dir / "engine.yaml"),
                                    calibration="auto"),
        dashboard=dataclasses.replace(config.dashboard, viewer_tenant=DEMO_VIEWER,
                                      gate_config_file=str(out_dir / "gate.yaml")),
    )


def write_demo_settings(out_dir: Path) -> None:
    """The engine's settings (engine.yaml), the gate configuration with the demo's objectives (gate.yaml) and,
    as an example to edit, the deadline policy's configuration under the documented two-class tenancy
    (deadline.yaml: what `servelens replay --policy deadline` uses on a trace without tenants)."""
    import yaml

    from replay.abuse import metric_classes
    from replay.gate_config import config_yaml, default_config

    (out_dir / "engine.yaml").write_text(DEMO_ENGINE_SETTINGS)
    gate = dataclasses.replace(default_config(), classes=metric_classes(DEMO_TENANCY))
    (out_dir / "gate.yaml").write_text(config_yaml(gate))
    tenancy = dataclasses.asdict(TWO_CLASS_TENANCY)
    (out_dir / "deadline.yaml").write_text(
        "# servelens replay --policy deadline --policy-config deadline.yaml (docs/policies.md): the two-class tenancy\n"
        + yaml.safe_dump({"overload_margin": 0.1, "tenancy": tenancy}, sort_keys=False))


def demo_workload(trace: pa.Table) -> pa.Table:
    """The trace with the demo's tenants drawn (seeded, by share) and each request's class its tenant's."""
    from replay.abuse import assign_tenants, stamp_classes

    return stamp_classes(assign_tenants(trace, DEMO_TENANTS, 0), DEMO_TENANCY)


def run_demo(
    trace: str,
    shared: Path | None,
    out_dir: Path,
    config: Config,
    *,
    candidates: tuple[str, ...] = DEMO_CANDIDATES,
    loads: tuple[str, ...] = DEMO_LOADS,
    speedup: float = 100.0,
    num_requests: int | None = None,
    progress: Callable[[str], None] = print,
) -> DemoResult:
    """Run stages 1 to 6 on ``trace`` (its first ``num_requests``, if given) under ``out_dir``
    (emptied first); the dashboard is ``serve_demo``."""
    from pipelines.broker import LocalBroker
    from replay.abuse import scenario_for
    from replay.calibration import default_calibration
    from replay.run import run_replay
    from replay.vllm import read_vllm_settings, vllm_instance
    from replay.workload import TableWorkload

    started = time.monotonic()
    production = config.nightly.production
    config, key_path, keyring = _prepare_demo(config, out_dir, candidates, progress)

    progress(f"[1/6] reading trace {trace}; {len(DEMO_TENANTS)} tenants drawn by a Zipf skew (docs/operations.md, The demo)")
    workload, stats = _demo_trace(trace, shared, num_requests)

    topic = config.kafka.topic
    with LocalBroker(topics={topic: config.kafka.num_partitions}) as broker:
        progress(f"[2/6] local Kafka-compatible broker on {broker.bootstrap}")
        progress(f"[3/6] the engine fleet: replaying {workload.num_rows:,} requests through {production} on {DEMO_ENGINE}")
        instance = vllm_instance(DEMO_ENGINE, read_vllm_settings(config.nightly.engine_config)[0])
        fleet = run_replay(TableWorkload(workload, name=trace), scenario=scenario_for(DEMO_TENANCY, "demo"),
                           policy_name=production, instance=instance, calibration=default_calibration(),
                           out_dir=out_dir / "engine")
        kafka = dataclasses.replace(config.kafka, bootstrap_servers=broker.bootstrap)
        progress(f"[4/6] emitting {fleet.num_events:,} events to Kafka at {speedup:g}x real time; ingesting into {config.lake.root}")
        emit_wall_s, ingest = stream_through_kafka(fleet.events_path, kafka, config, keyring, speedup, progress)
        config = dataclasses.replace(config, kafka=kafka)
        days = tuple(_days(config))
        progress(f"[5/6] Dagster, in process: tables, {len(loads)} loads x {1 + len(candidates)} policies, gate "
                 f"({', '.join(days)})")
        verdicts, failed_checks = run_dagster(config, out_dir, days, candidates, loads, progress)

    progress("[6/6] production's service levels")
    out = Path(config.paths.out_dir)
    metrics = production_metrics(out, days, production)
    policies = policy_figures(out, days[0], (production, *candidates), loads)
    return DemoResult(trace, stats, out_dir, fleet.num_events, ingest.events_written, ingest.dead_letters, emit_wall_s,
                      speedup, key_path, days, metrics, verdicts, failed_checks, time.monotonic() - started, policies)


#: The folders of a demo folder that each run empties first, and the file that marks a folder as a demo's.
DEMO_STAGES = ("lake", "out", "engine", "dagster")
DEMO_MARKER = ".servelens-demo"


def _check_demo_folder(out_dir: Path) -> None:
    """Refuse to empty the stage folders of a folder that is not a demo's: ``--out .`` in a project would
    have deleted its ``out/`` (every replay there), ``--out ~`` a home's ``lake/`` or ``engine/``."""
    if not out_dir.exists() or (out_dir / DEMO_MARKER).is_file():
        return
    if not out_dir.is_dir():
        raise ServelensError(f"--out {out_dir} is a file, not a folder", "give a new or empty folder, e.g. out/demo")
    earlier = all((out_dir / name).is_file() for name in ("engine.yaml", "deadline.yaml"))  # a demo before the marker
    if any(out_dir.iterdir()) and not earlier:
        held = sorted(s for s in DEMO_STAGES if (out_dir / s).exists())
        raise ServelensError(
            f"--out {out_dir} is not a demo folder (it has files, and no {DEMO_MARKER} from an earlier demo): the "
            "demo empties " + ", ".join(f"{s}/" for s in DEMO_STAGES) + " in it first"
            + (f", and this folder holds {', '.join(f'{s}/' for s in held)}" if held else ""),
            "give a new or empty folder (the default is out/demo)")


def _prepare_demo(config: Config, out_dir: Path, candidates: tuple[str, ...], progress: Callable[[str], None]):
    """Check the policies, get the demo's pseudonym key (created on first use), empty ``out_dir``'s stages and
    write the demo's settings there; returns (the demo's configuration, the key's path, the keyring)."""
    from privacy.keys import demo_keyring
    from replay.policies import policy_class

    for name in (config.nightly.production, *candidates):
        policy_class(name)  # an unknown policy fails now, naming the valid ones
    if len(candidates) < 1:
        raise ServelensError("the demo needs at least one candidate policy", "pass --candidates a,b,c")
    key_path = Path(config.privacy.demo_key_file)
    keyring, key_created = demo_keyring(key_path)
    if key_created:
        progress(f"generated a local pseudonym key for the demo at {key_path} (demo only: configure your own key)")
    _check_demo_folder(out_dir)
    for stale in DEMO_STAGES:
        shutil.rmtree(out_dir / stale, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DEMO_MARKER).write_text("a servelens demo folder: `servelens demo --out` empties its "
                                       + ", ".join(f"{s}/" for s in DEMO_STAGES) + " before each run\n")
    config = demo_config(config, out_dir)
    write_demo_settings(out_dir)
    return config, key_path, keyring


def _demo_trace(trace: str, shared: Path | None, num_requests: int | None) -> tuple[pa.Table, WorkloadStats]:
    """The trace (its first ``num_requests``, if given) with the demo's tenants, and its statistics."""
    from replay.traces import read_trace
    from replay.workload import workload_stats

    workload = read_trace(trace, shared)
    if num_requests is not None:
        workload = workload.slice(0, num_requests)
    stats = workload_stats(workload)
    return demo_workload(workload), stats


def stream_through_kafka(events_path: Path, kafka, config: Config, keyring, speedup: float,
                         progress: Callable[[str], None]):
    """Emit the events paced at ``speedup`` x their recorded timing while an ingest consumer
    commits them; returns (emission wall seconds, the consumer's stats)."""
    from pipelines.emitter import Emitter
    from pipelines.ingest import IngestConsumer

    events = pq.read_table(events_path)
    events = events.take(pa.array(np.argsort(events["ts_ns"].to_numpy(), kind="stable")))  # recorded order
    consumer = IngestConsumer(kafka, config.ingest, config.lake, config.privacy, keyring, consumer_name="demo")
    consumer.start()
    outcome: list = []
    ingesting = threading.Thread(target=lambda: outcome.append(consumer.run(max_records=events.num_rows)),
                                 name="demo-ingest", daemon=True)
    ingesting.start()
    emitter = Emitter.from_config(kafka).start()
    try:
        wall_s = emit_paced(emitter, events, speedup, progress)
        if not emitter.flush(120):
            raise ServelensError("the emitter could not deliver the demo's events within 120 s",
                                 "is the machine very busy? run the demo again")
        while ingesting.is_alive():
            ingesting.join(5)
            if ingesting.is_alive():
                progress(f"      ingest: {consumer.stats().events_written:,} of {events.num_rows:,} events stored")
    except BaseException:
        consumer.stop()
        raise
    finally:
        emitter.close()
    if not outcome:
        raise ServelensError("the demo's ingest consumer stopped early", "its log lines above say why")
    return wall_s, outcome[0]


def emit_paced(emitter, events: pa.Table, speedup: float, progress: Callable[[str], None]) -> float:
    """Emit ``events`` (in recorded order) so that each leaves ``(ts - first ts) / speedup`` seconds
    after the first: the trace's bursts arrive as bursts, only faster. Returns the wall seconds."""
    ts = events["ts_ns"].to_numpy()
    due_s = (ts - ts[0]) / 1e9 / speedup
    edges = np.searchsorted(due_s, np.arange(PACE_S, due_s[-1] + 2 * PACE_S, PACE_S), side="left")
    started, start, last_report = time.monotonic(), 0, time.monotonic()
    for n, end in enumerate(edges.tolist()):
        if end > start:
            time.sleep(max(0.0, started + n * PACE_S - time.monotonic()))
            emitter.emit_table(events.slice(start, end - start), timeout_s=60)
            start = end
        if time.monotonic() - last_report >= 5:
            last_report = time.monotonic()
            progress(f"      emitted {start:,} of {events.num_rows:,} events ({start / events.num_rows:.0%})")
    return time.monotonic() - started


def _days(config: Config) -> list[str]:
    from pipelines.batch import days_committed_since
    from pipelines.lake import EVENTS, Lake

    table = Lake(config.lake.root, config.lake).table(EVENTS)
    days = days_committed_since(table, -1) if table is not None else []
    if not days:
        raise ServelensError("the demo's lake holds no events", "the ingest log lines above say why")
    return days


@contextmanager
def _environment(config: Config) -> Iterator[None]:
    """The demo's settings for the Dagster resources, which read the environment as a deployment's do."""
    values = {"SERVELENS_ENV": "local", "SERVELENS_LAKE__ROOT": config.lake.root,
              "SERVELENS_PATHS__OUT_DIR": config.paths.out_dir, "SERVELENS_PRIVACY__DEMO_KEY_FILE": config.privacy.demo_key_file,
              "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": config.kafka.bootstrap_servers, "SERVELENS_KAFKA__TOPIC": config.kafka.topic}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_dagster(config: Config, out_dir: Path, days: tuple[str, ...], candidates: tuple[str, ...],
                loads: tuple[str, ...], progress: Callable[[str], None]) -> tuple[tuple[Verdict, ...], tuple[str, ...]]:
    """Materialize the asset graph for each day (a persistent instance under ``out_dir/dagster``,
    so ``make dagster`` with that DAGSTER_HOME shows the runs); returns the verdicts and failed checks."""
    import dagster as dg

    from pipelines import batch
    from pipelines.dagster_assets import materialize_day
    from pipelines.dagster_resources import KafkaResource, LakeResource, PrivacyKeyResource, ReplayPlanResource

    home = out_dir / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")  # no telemetry banner, no telemetry
    nightly = config.nightly
    plan = ReplayPlanResource(production=nightly.production, candidates=list(candidates), loads=list(loads),
                              engine=nightly.engine, engine_config=nightly.engine_config, calibration=nightly.calibration,
                              seed=nightly.seed)
    resources = {"lake": LakeResource(), "kafka": KafkaResource(timeout_s=5.0), "privacy_key": PrivacyKeyResource(),
                 "plan": plan}
    verdicts: list[Verdict] = []
    failed: list[str] = []
    with _environment(config), dg.DagsterInstance.local_temp(str(home), overrides={"telemetry": {"enabled": False}}) as instance:
        for day in days:
            for result in materialize_day(day, resources, instance, progress=lambda line: progress("      " + line),
                                          log_level="WARNING"):
                failed += [f"{e.check_name} ({day})" for e in result.get_asset_check_evaluations() if not e.passed]
            table = pq.read_table(batch.verdicts_for_day(Path(config.paths.out_dir), day).path)
            verdicts += [Verdict(v["candidate"], v["load"], v["status"], v["reasons"], v["report"])
                         for v in table.to_pylist()]
    return tuple(verdicts), tuple(dict.fromkeys(failed))


def production_metrics(out: Path, days: tuple[str, ...], production: str) -> tuple[MetricValue, ...]:
    """Production's overall run metrics at the recorded load (the first day's replay), against the demo's objectives."""
    from pipelines.batch import ReplayCase, day_gate_config, replay_dir
    from replay.gate import load_run

    run = load_run(replay_dir(out, days[0], ReplayCase(production, "1x")), production)
    config = day_gate_config(out, days[0]).metrics_config()
    return tuple(m for m in run_metrics(run.requests, run.steps, config) if m.scope == "overall")


def policy_figures(out: Path, day: str, policies: tuple[str, ...], loads: tuple[str, ...]
                   ) -> tuple[tuple[str, str, RunFigures], ...]:
    """Every replay's figures (from its own request table and its manifest's busy time), by load then policy."""
    import json

    from pipelines.batch import ReplayCase, day_gate_config, replay_dir
    from replay.figures import busy_steps, run_figures

    config = day_gate_config(out, day).metrics_config()
    rows = []
    for load in loads:
        for policy in policies:
            folder = replay_dir(out, day, ReplayCase(policy, load))
            busy = json.loads((folder / "manifest.json").read_text())["output"]["busy_s"]
            rows.append((policy, load, run_figures(pq.read_table(folder / "requests.parquet"), busy_steps(busy), config)))
    return tuple(rows)


def serve_demo(config: Config, out_dir: Path, port: int | None = None):
    """Start the dashboard over the demo's lake, runs and reports; returns (process, URL).
    The configured port when it is free, else any free one."""
    from dashboard.server import dashboard_url, serve, wait_until_ready

    config = demo_config(config, out_dir)
    if port is None:
        port = config.dashboard.port if _port_free(config.dashboard.host, config.dashboard.port) else 0
    process = serve(config, port=port, stdout=subprocess.DEVNULL)
    url = dashboard_url(process)
    try:
        wait_until_ready(url, 120, process)
    except BaseException:
        process.terminate()
        raise
    return process, url


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _policy_lines(rows: tuple[tuple[str, str, RunFigures], ...]) -> list[str]:
    """Each replay's goodput beside what could buy it (rejections) and its tail, by load."""
    if not rows:
        return []
    lines = ["  policies     (SLO goodput, attainment, rejected, TTFT p99, engine side; docs/policies.md)"]
    for policy, load, f in rows:
        ttft = f.latency("ttft", 99)
        lines.append(f"    {policy + '@' + load:<18} {'n/a' if f.goodput_rps is None else f'{f.goodput_rps:5.2f}'} req/s  "
                     f"{'n/a' if f.attainment is None else f'{f.attainment:6.1%}'}  rejected {f.rejected_share:5.1%}  "
                     f"TTFT p99 {'n/a' if ttft is None else f'{ttft:,.1f} s'}")
    return lines


def render_summary(result: DemoResult, url: str | None = None) -> str:
    """The one-screen summary the demo prints."""
    s, b = result.stats, result.stats.burst
    m = {v.name: v.value for v in result.metrics}
    bundled = BUNDLED_TRACES.get(result.trace)
    title = f"{result.trace}: {bundled.description} [{bundled.licence}]" if bundled else result.trace

    def ms(name: str) -> str:
        return "n/a" if m.get(name) is None else f"{m[name] * 1000:,.0f} ms"

    lines = [
        f"servelens summary for {title}",
        f"  workload     {s.num_requests:,} requests over {s.span_s:,.1f} s ({s.mean_rate_per_s:.2f} req/s), {s.num_failed:,} failed",
        f"  tokens       prompt p50 {s.prompt_tokens_p50:,.0f} / p99 {s.prompt_tokens_p99:,.0f}; "
        f"output p50 {s.output_tokens_p50:,.0f} / p99 {s.output_tokens_p99:,.0f}",
        f"  burstiness   inter-arrival CV {b.interarrival_cv:.2f}; peak/mean {b.peak_to_mean_1s:.2f} per 1 s, "
        f"{b.peak_to_mean_10s:.2f} per 10 s",
        f"  kafka        {result.num_events:,} events emitted at {result.speedup:g}x in {result.emit_wall_s:.0f} s; "
        f"{result.num_stored:,} stored once each, {result.num_dead_letters:,} dead letters",
        f"  privacy      tenants and ids pseudonymized with the demo key {result.key_path}",
        f"  production   goodput {m.get('goodput_rps', 0):.2f} req/s, attainment {m.get('attainment', 0):.1%}; "
        f"TTFT p50 {ms('ttft_p50_s')} / p99 {ms('ttft_p99_s')}; E2E p99 {ms('e2e_p99_s')}",
        f"  checks       {'all asset checks passed' if not result.failed_checks else 'FAILED: ' + ', '.join(result.failed_checks)}",
        *_policy_lines(result.policies),
        "  verdicts     (candidate at load, against production at the same load)",
    ]
    for v in result.verdicts:
        reason = v.reasons.split(" | ")[0] if v.reasons else ""
        lines.append(f"    {v.candidate + '@' + v.load:<18} {v.status.upper():<13} {reason[:90]}")
    lines.append(f"  reports      {result.out_dir / 'out' / 'gate'} (gate.html per candidate and load)")
    if url:
        lines.append(f"  dashboard    {url}")
    lines.append(f"  took         {result.wall_s:.0f} s")
    return "\n".join(lines)
