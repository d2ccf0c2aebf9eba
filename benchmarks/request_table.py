"""Benchmark: the request table, derived from events and written by the replay itself.

1. Synthetic events (``--source synthetic``): a Parquet file of arrivals, admissions, shared engine
   steps, first tokens, token deliveries and finishes, plus 1% duplicated events as producer retries
   would leave; the request table derived in a fresh process (DuckDB, ``replay.derive``): events
   per second and that process's peak memory, with DuckDB's default memory limit and capped at 1 GB.
2. A replay's events (``--source replay``): the Azure conversation trace tiled to ``--requests`` (1,000,000
   by default) replayed as `servelens replay` does (the shipped calibration, llama-3-8b on an H100), in a
   fresh process each: without its own request table, then writing it (``replay.request_table``), and the
   run's metrics from that table (``replay.figures.run_figures``): the table's cost inside the replay and
   the metrics' cost, each against the replay's own time (target: at most 20% together); then the
   derivation (``servelens requests derive``'s path) over the replay's events in a fresh process, DuckDB
   capped at ``REPLAY_DERIVE_CAP`` so that the whole process stays under 1 GB: events per second and peak
   memory (target 500,000 events/s under 1 GB), or how it failed.

    python benchmarks/request_table.py                    # both; 10,000,000 synthetic events, 1,000,000 requests
    python benchmarks/request_table.py --quick            # 1,000,000 events, 50,000 requests: under a minute or two
    python benchmarks/request_table.py --source replay --requests 200000

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import generate  # noqa: E402

#: DuckDB's memory_limit bounds its buffer pool, not the interpreter, Arrow or the allocator's slack:
#: at "1GB" the process peaked at 1.23 GB on a 1,000,000-request replay; at 600 MB, at 857 MB
REPLAY_DERIVE_CAP = "600MB"


def derive_in_this_process(path: Path, out: Path, memory_limit: str) -> dict:
    from replay.derive import connect, write_requests

    con = connect(None if memory_limit == "none" else memory_limit)
    started = time.perf_counter()
    rows = write_requests(path, out, con=con)
    elapsed = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"requests": rows, "seconds": round(elapsed, 3), "peak_rss_mb": round(peak_kb / 1024, 1)}


def replay_in_this_process(num_requests: int, out: Path, write: bool) -> dict:
    """One replay as `servelens replay --workload azure-conv --requests N` runs it; with its own table, also the
    run's metrics from that table."""
    import pyarrow.parquet as pq

    from replay.calibration import default_calibration
    from replay.figures import busy_steps, run_figures
    from replay.presets import prepared_workload
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.vllm import VllmSettings, vllm_instance
    from servelens.config import load_config, shared_dir

    seats = VllmSettings(max_num_seqs=128, max_num_batched_tokens=2048)  # the engine its README figures were measured on

    workload, preset = prepared_workload(read_trace("azure-conv", shared_dir(load_config())), "azure-conv",
                                         num_requests=num_requests)
    cpu0 = time.process_time()
    summary = run_replay(workload, scenario=preset.scenario, instance=vllm_instance("llama-3-8b@h100-sxm", seats),
                         calibration=default_calibration(), out_dir=out, write_requests=write)
    figures = {"replay_wall_s": round(summary.wall_s, 2), "replay_cpu_s": round(time.process_time() - cpu0, 2),
               "events": summary.num_events, "requests": summary.num_requests}
    if write:
        started, cpu0 = time.perf_counter(), time.process_time()
        run_figures(pq.read_table(summary.requests_path), busy_steps(summary.busy_s), preset.metrics)
        figures |= {"metrics_wall_s": round(time.perf_counter() - started, 2),
                    "metrics_cpu_s": round(time.process_time() - cpu0, 2)}
    figures["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return figures


def _child(*args: str, timeout_s: float = 7200) -> dict:
    """Run this script's hidden mode in a fresh process: its JSON, or how it failed."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replay_figures(num_requests: int) -> dict:
    """The replay without and with its own table, the metrics from it, and the derivation from its events."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = _child("--replay", str(num_requests), str(Path(tmp) / "plain"), "0")
        print(f"replay without its table: {plain}", file=sys.stderr)
        shutil.rmtree(Path(tmp) / "plain", ignore_errors=True)
        own = _child("--replay", str(num_requests), str(Path(tmp) / "own"), "1")
        print(f"replay writing its table, then its metrics: {own}", file=sys.stderr)
        derived = _child("--derive", str(Path(tmp) / "own" / "events.parquet"), str(Path(tmp) / "derived.parquet"),
                         REPLAY_DERIVE_CAP)
        print(f"derivation over its events, DuckDB capped at {REPLAY_DERIVE_CAP}: {derived}", file=sys.stderr)
    out = {"replay_requests": num_requests, "replay_plain": plain, "replay_own_table": own,
           "replay_derive_duckdb_cap": REPLAY_DERIVE_CAP, "replay_derive": derived}
    if "failed" not in plain and "failed" not in own:
        base = plain["replay_cpu_s"]
        out["table_cost_share_cpu"] = round((own["replay_cpu_s"] - base) / base, 3)
        out["metrics_cost_share_cpu"] = round(own["metrics_cpu_s"] / base, 3)
        out["table_and_metrics_share_cpu"] = round(out["table_cost_share_cpu"] + out["metrics_cost_share_cpu"], 3)
        out["metrics_cost_share_wall"] = round(own["metrics_wall_s"] / plain["replay_wall_s"], 3)
    if "failed" not in derived and "failed" not in own:
        out["replay_derive_events_per_s"] = round(own["events"] / derived["seconds"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000,000 events and 50,000 requests")
    parser.add_argument("--events", type=int, default=None, help="number of synthetic events (overrides --quick)")
    parser.add_argument("--requests", type=int, default=None, help="requests of the replay (overrides --quick)")
    parser.add_argument("--source", choices=["synthetic", "replay", "both"], default="both")
    parser.add_argument("--derive", nargs=3, metavar=("EVENTS", "OUT", "LIMIT"), help=argparse.SUPPRESS)
    parser.add_argument("--replay", nargs=3, metavar=("REQUESTS", "OUT", "WRITE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.derive:
        print(json.dumps(derive_in_this_process(Path(args.derive[0]), Path(args.derive[1]), args.derive[2])))
        return
    if args.replay:
        print(json.dumps(replay_in_this_process(int(args.replay[0]), Path(args.replay[1]), args.replay[2] == "1")))
        return
    figures: dict = {"benchmark": "request_table", "quick": args.quick}
    if args.source in ("replay", "both"):
        figures |= replay_figures(args.requests or (50_000 if args.quick else 1_000_000))
    if args.source == "replay":
        print(json.dumps(figures))
        return
    num_events = args.events or (1_000_000 if args.quick else 10_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.parquet"
        started = time.perf_counter()
        count = generate(events, num_events)
        print(f"generated {count:,} events in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        runs = {}
        for limit in ("none", "1GB"):  # DuckDB's default (80% of RAM), then capped: it spills to disk
            proc = subprocess.run(
                [sys.executable, __file__, "--derive", str(events), str(Path(tmp) / "requests.parquet"), limit],
                capture_output=True, text=True, check=True,
            )
            runs[limit] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"memory limit {limit}: {runs[limit]}", file=sys.stderr)
    free, capped = runs["none"], runs["1GB"]
    figures |= {
        "events": count,
        "requests": free["requests"],
        "seconds": free["seconds"],
        "events_per_s": round(count / free["seconds"]),
        "peak_rss_mb": free["peak_rss_mb"],
        "capped_1gb_seconds": capped["seconds"],
        "capped_1gb_events_per_s": round(count / capped["seconds"]),
        "capped_1gb_peak_rss_mb": capped["peak_rss_mb"],
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
