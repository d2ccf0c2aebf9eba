"""The end-to-end path that exists so far, on a bundled real trace (README's first command).

Stages: read the trace into a workload table, replay it through the production policy (FCFS with
vLLM v1 semantics) on a modelled Llama-3-8B/H100 instance, validate and sanitize every event the
replay emitted (as the ingest path does for a real engine's), derive the request table, and
summarize the workload and its service levels. Each stage is a library call; this module only
strings them together and reports progress. The demo pseudonymizes with a local key it generates
on first use (and says so); real deployments configure their own key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.lake import events_to_parquet
from pipelines.tables import write_requests
from privacy.config import PrivacyConfig
from privacy.keys import demo_keyring
from privacy.sanitize import PrivacyReport, Sanitizer
from replay.config import parse_instance
from replay.metrics import MetricsConfig, MetricValue, run_metrics
from replay.run import run_replay
from replay.traces import BUNDLED_TRACES, read_trace
from replay.workload import TableWorkload, WorkloadStats, workload_stats

DEMO_ENGINE = "llama-3-8b@h100-sxm"


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo produced and measured."""

    trace: str
    stats: WorkloadStats
    replay_dir: Path
    num_events: int
    replay_wall_s: float
    privacy: PrivacyReport
    key_path: Path
    key_created: bool
    requests_path: Path
    num_request_rows: int
    metrics: tuple[MetricValue, ...]


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

    replay_dir = out_dir / "replay-fcfs"
    progress(f"[2/4] replaying {workload.num_rows:,} requests through fcfs on {DEMO_ENGINE} into {replay_dir}")
    summary = run_replay(TableWorkload(workload, name=trace), instance=parse_instance(DEMO_ENGINE), out_dir=replay_dir)

    staged_path = out_dir / "events.parquet"
    progress(f"[3/4] validating and sanitizing {summary.num_events:,} events into {staged_path}")
    sanitizer = Sanitizer(keyring, privacy)
    num_valid = events_to_parquet(summary.events_path, staged_path, sanitizer)  # raises at the first invalid event
    report = sanitizer.report()
    (out_dir / "privacy-report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")

    requests_path = out_dir / "requests.parquet"
    progress(f"[4/4] deriving the request table into {requests_path} and its service levels")
    num_rows = write_requests(staged_path, requests_path)
    steps = pq.read_table(staged_path, columns=["event_type", "instance_id", "start_ns", "end_ns", "request_ids",
                                               "request_num_tokens"], filters=[("event_type", "==", "step_executed")])
    metrics = run_metrics(pq.read_table(requests_path), steps, MetricsConfig())
    return DemoResult(trace, stats, replay_dir, num_valid, summary.wall_s, report, key_path, key_created,
                      requests_path, num_rows, tuple(m for m in metrics if m.scope == "overall"))


def render_summary(result: DemoResult) -> str:
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
        f"  replay       fcfs on {DEMO_ENGINE}: {result.num_events:,} events in {result.replay_wall_s:.1f} s, "
        f"every one valid ({result.replay_dir})",
        f"  privacy      pseudonymized with key {result.key_path}; "
        f"{sum(result.privacy.folded_into_other.values()):,} values folded into 'other', "
        f"{sum(result.privacy.redactions.values()):,} redacted, "
        f"{sum(result.privacy.fields_dropped.values()):,} unknown fields dropped",
        f"  requests     {result.num_request_rows:,} rows in {result.requests_path}",
        f"  service      goodput {m.get('goodput_rps', 0):.2f} req/s, attainment {m.get('attainment', 0):.1%} "
        f"(default objectives: TTFT 2 s, ITL p99 0.2 s, E2E 60 s); rejected {m.get('rejected_share', 0):.1%}",
        f"  latency      TTFT p50 {ms('ttft_p50_s')} / p99 {ms('ttft_p99_s')}; TPOT p50 {ms('tpot_p50_s')}; "
        f"E2E p99 {ms('e2e_p99_s')}",
        f"  cost         {m.get('idle_share', 0):.1%} of the accelerator idle; "
        f"{m.get('preemptions_per_request', 0):.3f} preemptions per request",
    ]
    return "\n".join(lines)
