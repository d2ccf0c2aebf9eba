"""The batch side as plain library functions: one day of the lake into tables, replays and verdicts.

Each function reads and writes files under an output folder and returns a small record of what it
did; the Dagster assets of ``pipelines.definitions`` are thin wrappers around them, and the same
functions run without Dagster (tests, scripts, the demo). Layout under ``out_dir``::

    tables/requests/dt=YYYY-MM-DD.parquet     one row per request that arrived that day (UTC)
    tables/steps/dt=YYYY-MM-DD.parquet        that day's engine steps
    workloads/dt=YYYY-MM-DD.parquet           the day's workload (replay input)
    workloads/scaled/YYYY-MM-DD/<load>.parquet  the same at 1.5x, 2x... the rate (gaps divided)
    replay/YYYY-MM-DD/<policy>@<load>/        events.parquet + manifest.json of one replay
    gate/YYYY-MM-DD/<policy>@<load>/          gate.json, gate.md, gate.html: candidate vs production
    verdicts/dt=YYYY-MM-DD.parquet            one row per candidate and load: status, score, reasons
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.lake import EVENTS, Lake
from replay.derive import REQUESTS_SCHEMA, requests_sql, typed_select
from servelens import layout
from servelens.errors import ConfigError
from servelens.sql import parquet_relation, sql_literal

DAY_NS = 86_400 * 1_000_000_000
STEP_COLUMNS = ["event_type", "instance_id", "start_ns", "end_ns", "request_ids", "request_num_tokens"]


@dataclass(frozen=True, slots=True)
class TableWritten:
    """A table written for one day."""

    path: Path
    num_rows: int


def day_start_ns(day: str) -> int:
    """UTC midnight of ``YYYY-MM-DD`` in epoch ns."""
    start = dt.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=dt.UTC)
    return int(start.timestamp()) * 1_000_000_000


def _day_files(lake: Lake, *days: str) -> list[str]:
    return [f for f in lake.files(EVENTS) if any(f"dt={day}" in f for day in days)]


def days_committed_since(table, version: int, storage_options: dict[str, str] | None = None) -> list[str]:
    """The UTC days (``dt`` partitions) of the files a Delta table gained after ``version``
    (-1: all); a compaction counts, re-deriving its days changes nothing. ``storage_options``:
    the object store's, for a table on S3 (``Lake.storage``)."""
    from deltalake import DeltaTable

    before = set() if version < 0 else set(
        DeltaTable(table.table_uri, version=version, storage_options=storage_options).file_uris())
    added = set(table.file_uris()) - before
    return sorted({part.removeprefix("dt=") for uri in added for part in uri.split("/") if part.startswith("dt=")})


def request_table_for_day(lake: Lake, day: str, out_dir: Path) -> TableWritten:
    """The requests that arrived on ``day`` (UTC), from that day's and the next day's events (a
    request may finish after midnight)."""
    next_day = (dt.date.fromisoformat(day) + dt.timedelta(days=1)).isoformat()
    files = _day_files(lake, day, next_day)
    path = out_dir / "tables" / "requests" / f"dt={day}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not files:
        pq.write_table(REQUESTS_SCHEMA.empty_table(), path)
        return TableWritten(path, 0)
    start = day_start_ns(day)
    con = lake.duckdb()
    source = parquet_relation(files)
    query = typed_select(REQUESTS_SCHEMA, f"SELECT * FROM ({requests_sql(source)}) WHERE arrival_ns >= {start} "
                         f"AND arrival_ns < {start + DAY_NS}", "arrival_ns, request_id")
    (count,) = con.execute(f"COPY ({query}) TO {sql_literal(str(path))} (FORMAT parquet, COMPRESSION zstd)").fetchone()
    return TableWritten(path, count)


def step_table_for_day(lake: Lake, day: str, out_dir: Path) -> TableWritten:
    """The engine steps that ended on ``day`` (UTC)."""
    files = _day_files(lake, day)
    path = out_dir / "tables" / "steps" / f"dt={day}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not files:
        from schemas.arrow import EVENTS_SCHEMA

        pq.write_table(pa.schema([EVENTS_SCHEMA.field(c) for c in STEP_COLUMNS]).empty_table(), path)
        return TableWritten(path, 0)
    con = lake.duckdb()
    query = (f"SELECT {', '.join(STEP_COLUMNS)} FROM {parquet_relation(files)} "
             "WHERE event_type = 'step_executed' ORDER BY end_ns")
    (count,) = con.execute(f"COPY ({query}) TO {sql_literal(str(path))} (FORMAT parquet, COMPRESSION zstd)").fetchone()
    return TableWritten(path, count)


def workload_for_day(requests_path: Path, day: str, out_dir: Path) -> TableWritten:
    """The day's workload (arrivals, lengths, tenants, classes...) from its request table."""
    from replay.workload import workload_from_requests

    workload = workload_from_requests(pq.read_table(requests_path))
    path = out_dir / "workloads" / f"dt={day}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(workload, path, compression="zstd")
    return TableWritten(path, workload.num_rows)


#: The load scenarios replays run at: multiples of the recorded arrival rate.
LOAD_SCENARIOS = ("1x", "1.5x", "2x")


@dataclass(frozen=True, slots=True)
class ReplayCase:
    """One replay of a day's workload: a policy at a load (the arrival rate times ``load``)."""

    policy: str
    load: str  # "1x", "1.5x", "2x"

    @property
    def key(self) -> str:
        return f"{self.policy}@{self.load}"

    @classmethod
    def from_key(cls, key: str) -> ReplayCase:
        """``"sarathi@1.5x"`` -> ReplayCase("sarathi", "1.5x"), with a clear error for anything else."""
        policy, _, load = key.rpartition("@")
        if not policy:
            raise ConfigError(f"replay case {key!r} is not POLICY@LOAD", "write it like fcfs@1x or sarathi@1.5x")
        load_factor(load)
        return cls(policy, load)


def load_factor(load: str) -> Fraction:
    """``"1.5x"`` -> 3/2, with a clear error for anything else."""
    try:
        factor = Fraction(load.removesuffix("x"))
    except (ValueError, ZeroDivisionError):
        factor = None
    if not load.endswith("x") or factor is None or factor <= 0:
        raise ConfigError(f"load {load!r} is not a rate multiplier", "write it like 1x, 1.5x or 2x")
    return factor


def workload_path(out_dir: Path, day: str, load: str = "1x") -> Path:
    if load == "1x":
        return out_dir / "workloads" / f"dt={day}.parquet"
    return out_dir / "workloads" / "scaled" / day / f"{load}.parquet"


def scaled_workload(out_dir: Path, day: str, load: str) -> TableWritten:
    """The day's workload at ``load`` times its arrival rate: every gap divided, bursts and order kept."""
    from replay.workload import scale_rate

    factor = load_factor(load)
    path = workload_path(out_dir, day, load)
    if factor == 1:
        return TableWritten(path, pq.read_metadata(path).num_rows)
    scaled = scale_rate(pq.read_table(workload_path(out_dir, day)), factor)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(scaled, path, compression="zstd")
    return TableWritten(path, scaled.num_rows)


def replay_dir(out_dir: Path, day: str, case: ReplayCase) -> Path:
    return layout.replay_dir(out_dir, day, case.key)


def replay_day(out_dir: Path, day: str, case: ReplayCase, *, engine: str, seed: int = 0, scenario=None,
               run_dir: Path | None = None, engine_config: str = "", calibration: str = "auto"):
    """Replay the day's workload at ``case.load`` through ``case.policy`` as `servelens replay` would: its
    tenants and classes as recorded (``replay.presets``, ``as-recorded``: the documented classes'
    objectives as deadlines, each tenant's class from the telemetry), the policy's default configuration
    under that tenancy, the engine with ``engine_config``'s settings and the calibration. The load
    scenario's workload (``scaled_workload``) is written first when it is missing or older than the day's."""
    from replay.calibration import calibration_named
    from replay.presets import default_policy_config, resolve_preset
    from replay.run import run_replay
    from replay.vllm import VllmSettings, read_vllm_settings, vllm_instance
    from replay.workload import TableWorkload

    path = workload_path(out_dir, day, case.load)
    if not path.is_file() or path.stat().st_mtime_ns < workload_path(out_dir, day).stat().st_mtime_ns:
        scaled_workload(out_dir, day, case.load)
    preset, table = resolve_preset("as-recorded", pq.read_table(path))
    settings = read_vllm_settings(engine_config)[0] if engine_config else VllmSettings()
    return run_replay(TableWorkload(table, name=f"{day}@{case.load}"), scenario=scenario or preset.scenario,
                      policy_name=case.policy, policy_config=default_policy_config(case.policy, preset),
                      instance=vllm_instance(engine, settings), calibration=calibration_named(calibration), seed=seed,
                      out_dir=run_dir or replay_dir(out_dir, day, case))


def day_gate_config(out_dir: Path, day: str):
    """The gate's defaults, judged against the objectives the day's replays admitted by (the documented
    classes, ``replay.presets``)."""
    from replay.gate import default_config
    from replay.presets import resolve_preset

    preset, _ = resolve_preset("as-recorded", pq.read_table(workload_path(out_dir, day)))
    return dataclasses.replace(default_config(), classes=preset.metrics.classes)


def compare_day(out_dir: Path, day: str, production: str, cases: list[ReplayCase], gate_config=None) -> list[Path]:
    """Gate every candidate replay against the production policy's at the same load: one report
    folder (gate.json, gate.md, gate.html) per candidate and load under ``gate/<day>/``."""
    from replay.gate import compare_runs, load_run
    from replay.report import write_reports

    config = gate_config or day_gate_config(out_dir, day)
    written = []
    for case in cases:
        if case.policy == production:
            continue
        base = load_run(replay_dir(out_dir, day, dataclasses.replace(case, policy=production)), "baseline")
        cand = load_run(replay_dir(out_dir, day, case), "candidate")
        report = layout.gate_dir(out_dir, day, case.key)
        write_reports(compare_runs(base, cand, config), base, cand, report)
        written.append(report)
    return written


VERDICTS_SCHEMA = pa.schema([("day", pa.string()), ("candidate", pa.string()), ("load", pa.string()),
                             ("status", pa.string()), ("score", pa.float64()), ("reasons", pa.string()),
                             ("report", pa.string())])


def verdicts_for_day(out_dir: Path, day: str) -> TableWritten:
    """One row per comparison of the day (from its gate.json): candidate, load, status, score, reasons."""
    rows = []
    for report in sorted(layout.gate_dir(out_dir, day).glob("*/gate.json")):
        verdict = json.loads(report.read_text())
        candidate, _, load = report.parent.name.rpartition("@")
        rows.append({"day": day, "candidate": candidate, "load": load, "status": verdict["status"],
                     "score": verdict["score"], "reasons": " | ".join(verdict["reasons"]),
                     "report": str(report.with_name("gate.html"))})
    path = out_dir / "verdicts" / f"dt={day}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=VERDICTS_SCHEMA), path)
    return TableWritten(path, len(rows))
