"""Benchmark: metrics and the gate's comparison over two replays of 1,000,000 requests each.

Two replays of the Azure conversation trace, tiled to the size asked (same load per instance, a
longer trace), on the same modelled Llama-3-8B/H100 instance, the candidate with half the batch
(``max_num_seqs`` 64 instead of 128), are produced first and not timed. Then, in a fresh process,
the gate's work is timed phase by phase: loading both runs (events to request tables, streamed by
DuckDB from the Parquet files, plus the step events),
the run metrics of each, the comparison (window statistics, 1,000 paired block-bootstrap resamples
of every default metric, rank tests) and the three reports. That process's peak memory is reported.

    python benchmarks/gate.py            # 2 x 1,000,000 requests (the README figure)
    python benchmarks/gate.py --quick    # 2 x 50,000 requests, under a minute
    python benchmarks/gate.py --duckdb-memory-limit none   # DuckDB's default cap (80% of RAM)

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_replays(num_requests: int, root: Path) -> None:
    from replay.config import parse_instance
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TiledWorkload
    from servelens.config import load_config, shared_dir

    base = read_trace("azure-conv", shared_dir(load_config()))
    copies = -(-num_requests // base.num_rows)
    instance = parse_instance("llama-3-8b@h100-sxm")
    smaller = dataclasses.replace(instance, engine=dataclasses.replace(instance.engine, max_num_seqs=64))
    for name, inst in (("baseline", instance), ("candidate", smaller)):
        started = time.perf_counter()
        summary = run_replay(TiledWorkload(base, copies, num_requests=num_requests, name="azure-conv-tiled"),
                             instance=inst, out_dir=root / name)
        print(f"replayed {name}: {summary.num_requests:,} requests in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def time_gate(root: Path, memory_limit: str | None) -> dict:
    from replay.gate import compare_runs, default_config, load_run
    from replay.metrics import run_metrics
    from replay.report import write_reports

    config = default_config()
    phases = {}
    started = time.perf_counter()
    base = load_run(root / "baseline", "baseline", memory_limit=memory_limit)
    cand = load_run(root / "candidate", "candidate", memory_limit=memory_limit)
    phases["load_s"] = time.perf_counter() - started
    started = time.perf_counter()
    for run in (base, cand):
        run_metrics(run.requests, run.steps, config.metrics_config())
    phases["metrics_s"] = time.perf_counter() - started
    started = time.perf_counter()
    verdict = compare_runs(base, cand, config)
    phases["compare_s"] = time.perf_counter() - started
    started = time.perf_counter()
    write_reports(verdict, base, cand, root / "gate")
    phases["reports_s"] = time.perf_counter() - started
    return {
        "requests_per_run": base.requests.num_rows,
        "step_events_per_run": base.steps.num_rows if base.steps is not None else None,
        **{k: round(v, 2) for k, v in phases.items()},
        "total_s": round(sum(phases.values()), 2),
        "verdict": verdict.status,
        "duckdb_memory_limit": memory_limit,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 x 50,000 requests instead of 2 x 1,000,000")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--duckdb-memory-limit", default="2GB",
                        help="DuckDB's cap while deriving the request tables, as lake.duckdb_memory_limit "
                             "(default 2GB; 'none': DuckDB's default, 80%% of RAM)")
    parser.add_argument("--time-gate", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = None if args.duckdb_memory_limit.lower() == "none" else args.duckdb_memory_limit
    if args.time_gate:
        print(json.dumps(time_gate(Path(args.time_gate), limit)))
        return
    num_requests = args.requests or (50_000 if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        make_replays(num_requests, Path(tmp))
        proc = subprocess.run([sys.executable, __file__, "--time-gate", tmp, "--duckdb-memory-limit", str(limit).lower()],
                              capture_output=True, text=True, check=True)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
