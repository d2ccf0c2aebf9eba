"""The end-to-end path that exists so far, on a bundled real trace (README's first command).

Stages: read the trace into a workload table, turn its arrivals into lifecycle events (JSONL, the
wire form), validate and sanitize every event into Parquet, derive the request table, and
summarize. Each stage is a library call; this module only strings them together and reports
progress. The demo pseudonymizes with a local key it generates on first use (and says so); real
deployments configure their own key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import json

import pyarrow.parquet as pq

from pipelines.lake import events_to_parquet
from pipelines.tables import write_requests
from privacy.config import PrivacyConfig
from privacy.keys import demo_keyring
from privacy.sanitize import PrivacyReport, Sanitizer
from replay.traces import BUNDLED_TRACES, read_trace
from replay.workload import WorkloadStats, arrival_events, workload_stats
from schemas.wire import iter_table_json, write_jsonl


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo produced and measured."""

    trace: str
    stats: WorkloadStats
    events_path: Path
    num_valid_events: int
    privacy: PrivacyReport
    key_path: Path
    key_created: bool
    requests_path: Path
    num_request_rows: int
    num_with_arrival: int
    num_finished: int


def run_demo(
    trace: str,
    shared: Path | None,
    out_dir: Path,
    privacy: PrivacyConfig,
    progress: Callable[[str], None] = print,
) -> DemoResult:
    """Run the demo path on ``trace`` and write its outputs under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path = Path(privacy.demo_key_file)
    keyring, key_created = demo_keyring(key_path)
    if key_created:
        progress(f"generated a local pseudonym key for the demo at {key_path} (demo only: configure your own key)")
    progress(f"[1/4] reading trace {trace}")
    workload = read_trace(trace, shared)
    stats = workload_stats(workload)

    events_path = out_dir / "events.jsonl"
    progress(f"[2/4] writing {workload.num_rows:,} arrival events to {events_path}")
    write_jsonl(iter_table_json(arrival_events(workload, engine_id=f"trace:{trace}")), events_path)

    staged_path = out_dir / "events.parquet"
    progress(f"[3/4] validating and sanitizing every event into {staged_path}")
    sanitizer = Sanitizer(keyring, privacy)
    num_valid = events_to_parquet(events_path, staged_path, sanitizer)  # raises at the first invalid event
    report = sanitizer.report()
    (out_dir / "privacy-report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")

    requests_path = out_dir / "requests.parquet"
    progress(f"[4/4] deriving the request table into {requests_path}")
    num_rows = write_requests(staged_path, requests_path)
    requests = pq.read_table(requests_path, columns=["arrival_ns", "outcome"])
    return DemoResult(
        trace=trace,
        stats=stats,
        events_path=events_path,
        num_valid_events=num_valid,
        privacy=report,
        key_path=key_path,
        key_created=key_created,
        requests_path=requests_path,
        num_request_rows=num_rows,
        num_with_arrival=requests.num_rows - requests["arrival_ns"].null_count,
        num_finished=requests.num_rows - requests["outcome"].null_count,
    )


def render_summary(result: DemoResult) -> str:
    """The one-screen summary the demo prints."""
    s, b = result.stats, result.stats.burst
    bundled = BUNDLED_TRACES.get(result.trace)
    title = f"{result.trace}: {bundled.description} [{bundled.licence}]" if bundled else result.trace
    lines = [
        f"servelens summary for {title}",
        f"  workload     {s.num_requests:,} requests over {s.span_s:,.1f} s ({s.mean_rate_per_s:.2f} req/s), {s.num_failed:,} failed",
        f"  tokens       prompt p50 {s.prompt_tokens_p50:,.0f} / p99 {s.prompt_tokens_p99:,.0f}; "
        f"output p50 {s.output_tokens_p50:,.0f} / p99 {s.output_tokens_p99:,.0f}",
        f"  burstiness   inter-arrival CV {b.interarrival_cv:.2f}; peak/mean {b.peak_to_mean_1s:.2f} per 1 s, "
        f"{b.peak_to_mean_10s:.2f} per 10 s",
        f"  events       {result.num_valid_events:,} in {result.events_path}, every one valid",
        f"  privacy      pseudonymized with key {result.key_path}; "
        f"{sum(result.privacy.folded_into_other.values()):,} values folded into 'other', "
        f"{sum(result.privacy.redactions.values()):,} redacted, "
        f"{sum(result.privacy.fields_dropped.values()):,} unknown fields dropped",
        f"  requests     {result.num_request_rows:,} rows in {result.requests_path}: "
        f"{result.num_with_arrival:,} with an arrival, {result.num_finished:,} finished "
        "(a trace records arrivals, not engine timing)",
    ]
    return "\n".join(lines)
