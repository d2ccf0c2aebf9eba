"""Benchmark: replay speed (simulated requests per wall-clock second) and faithfulness of the fast mode.

1. Throughput. The Azure conversation trace, tiled into time-shifted copies laid back to back (same
   load per instance, a longer trace: ``replay.workload.TiledWorkload``), is replayed in the default
   fast mode to Parquet at 10,000, 100,000 and 1,000,000 requests, each size in a fresh process of
   its own, which reports its wall time and peak memory (max RSS); the largest size again with the
   shipped calibration (async scheduling, the frontend: ``servelens replay``'s default). Cost should grow linearly (flat
   requests/s) and memory should stay flat: it follows the requests in flight, not the trace length.
2. Fast vs reference. The full Azure and Mooncake traces are replayed in both modes; the request
   tables' timestamps are compared (largest relative difference) and the speed ratio is reported.
3. Cluster. 8 instances behind the least-outstanding-tokens router replay 8 superposed copies of the
   Azure trace (each shifted by 60 s: eight user populations, so the load per instance is the single
   instance's), tiled to 1,000,000 requests (``--quick``: 100,000), in a fresh process; its
   requests/s is set against the single instance's at the same number of requests (the ratio
   single / cluster: the cost per request of the cluster layer; the target is at most 2).

    python benchmarks/replay.py            # the README figures (a few minutes)
    python benchmarks/replay.py --quick    # 10k and 100k requests, trace slices: under a minute
    python benchmarks/replay.py --cluster  # the cluster case alone (with its single-instance baseline)

The last line of output is one JSON object with the figures. Single process, single thread of
simulation; from 5,000 requests the outputs (the events' tables and Parquet file, the run's request table:
``replay.outputs``) are built in a process of their own, whose peak memory is reported beside.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMESTAMPS = ["arrival_ns", "admission_ns", "scheduled_ns", "first_token_ns", "last_token_ns", "cancel_ns", "finish_ns"]


def replay_tiled(num_requests: int, out_dir: Path, calibrated: bool = False) -> dict:
    """Replay the tiled Azure trace in this process; report speed and peak memory (``calibrated``: with the
    shipped calibration, as ``servelens replay`` replays by default)."""
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TiledWorkload
    from servelens.config import load_config, shared_dir

    base = read_trace("azure-conv", shared_dir(load_config()))
    workload = TiledWorkload(base, -(-num_requests // base.num_rows), num_requests=num_requests, name="azure-conv-tiled")
    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu0 = time.process_time()
    from replay.calibration import default_calibration

    summary = run_replay(workload, out_dir=out_dir, calibration=default_calibration() if calibrated else None)
    cpu_s = time.process_time() - cpu0
    return {
        "calibrated": calibrated,
        "requests": summary.num_requests,
        "events": summary.num_events,
        "steps": summary.num_steps,
        "step_events": summary.num_step_events,
        "simulated_s": round(summary.simulated_s, 1),
        "wall_s": round(summary.wall_s, 2),
        "process_cpu_s": round(cpu_s, 2),
        "outputs_cpu_s": round(children_cpu_s(), 2),
        "requests_per_s": round(summary.requests_per_wall_s),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # the outputs' own process (replay.outputs, from 5,000 requests): its peak, beside this one
        "peak_rss_outputs_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "rss_before_replay_mb": round(rss_before_mb, 1),
        "events_mb": round((out_dir / "events.parquet").stat().st_size / 1e6, 1),
    }


CLUSTER_INSTANCES = 8
CLUSTER_ROUTER = "least-outstanding-tokens"


def replay_cluster_tiled(num_requests: int, out_dir: Path) -> dict:
    """Replay 8 superposed copies of the Azure trace, tiled, on an 8-instance cluster in this process."""
    from replay.cluster import cluster_config, run_cluster_replay
    from replay.traces import read_trace
    from replay.workload import TiledWorkload, superpose
    from servelens.config import load_config, shared_dir

    base = superpose(read_trace("azure-conv", shared_dir(load_config())), CLUSTER_INSTANCES, 60_000_000_000)
    workload = TiledWorkload(base, -(-num_requests // base.num_rows), num_requests=num_requests,
                             name="azure-conv-x8-tiled")
    cpu0 = time.process_time()
    summary = run_cluster_replay(workload, cluster_config(CLUSTER_INSTANCES, router=CLUSTER_ROUTER), out_dir=out_dir)
    cpu_s = time.process_time() - cpu0
    routed = [x.num_routed for x in summary.instances]
    return {
        "requests": summary.num_requests,
        "instances": len(summary.instances),
        "router": summary.router,
        "events": summary.num_events,
        "steps": summary.num_steps,
        "simulated_s": round(summary.simulated_s, 1),
        "wall_s": round(summary.wall_s, 2),
        "process_cpu_s": round(cpu_s, 2),
        "outputs_cpu_s": round(children_cpu_s(), 2),
        "requests_per_s": round(summary.requests_per_wall_s),
        "routed_min_max": [min(routed), max(routed)],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_outputs_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "events_mb": round((out_dir / "events.parquet").stat().st_size / 1e6, 1),
    }


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children: the outputs' own process (``replay.outputs``, from
    5,000 requests), which ends with its replay."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _child(flag: str, n: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, flag, str(n)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cluster_case(num_requests: int, single: dict | None) -> dict:
    """The cluster case and its ratio to the single instance at the same size (measured here if not given)."""
    cluster = _child("--one-cluster", num_requests)
    print(f"cluster, {num_requests:,} requests: {cluster}", file=sys.stderr)
    if single is None or single["requests"] != num_requests:
        single = _child("--one", num_requests)
        print(f"tiled azure-conv, {num_requests:,} requests: {single}", file=sys.stderr)
    return {
        "cluster": cluster,
        "single_requests_per_s": single["requests_per_s"],
        "cluster_over_single_wall_per_request": round(single["requests_per_s"] / cluster["requests_per_s"], 2),
        # process CPU per request: steadier than wall time on a shared machine
        "cluster_over_single_cpu_per_request": round(
            (cluster["process_cpu_s"] / cluster["requests"]) / (single["process_cpu_s"] / single["requests"]), 2
        ),
        "target_at_most": 2.0,
    }


def compare_modes(trace: str, num_requests: int | None, out_dir: Path) -> dict:
    """Both modes on one trace: largest relative timestamp difference and the speed ratio."""
    from replay.derive import derive_requests
    from replay.run import run_replay
    from replay.traces import read_trace
    from servelens.config import load_config, shared_dir

    workload = read_trace(trace, shared_dir(load_config()))
    if num_requests is not None:
        workload = workload.slice(0, num_requests)
    runs = {}
    for mode in ("fast", "reference"):
        summary = run_replay(workload, out_dir=out_dir / f"{trace}-{mode}", mode=mode)
        runs[mode] = (summary, derive_requests(summary.events_path))
    worst = 0.0
    for column in TIMESTAMPS:
        for a, b in zip(runs["fast"][1][column].to_pylist(), runs["reference"][1][column].to_pylist()):
            if (a is None) != (b is None):
                worst = float("inf")
            elif a is not None:
                worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1))
    fast, ref = runs["fast"][0], runs["reference"][0]
    return {
        "trace": trace,
        "requests": fast.num_requests,
        "max_relative_timestamp_difference": worst,
        "fast_wall_s": round(fast.wall_s, 2),
        "reference_wall_s": round(ref.wall_s, 2),
        "fast_over_reference_speed": round(ref.wall_s / fast.wall_s, 1),
        "fast_events": fast.num_events,
        "reference_events": ref.num_events,
        "steps": fast.num_steps,
        "fast_step_events": fast.num_step_events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k and 100k requests; mode comparison on trace slices")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="tiled workload sizes (overrides --quick)")
    parser.add_argument("--cluster", action="store_true", help="only the cluster case and its single-instance baseline")
    parser.add_argument("--one", type=int, metavar="N", help=argparse.SUPPRESS)  # child: replay N requests
    parser.add_argument("--one-cluster", type=int, metavar="N", help=argparse.SUPPRESS)  # child: the cluster case
    parser.add_argument("--one-calibrated", type=int, metavar="N", help=argparse.SUPPRESS)  # child: calibrated
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(replay_tiled(args.one, Path(tmp))))
        return
    if args.one_calibrated:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(replay_tiled(args.one_calibrated, Path(tmp), calibrated=True)))
        return
    if args.one_cluster:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(replay_cluster_tiled(args.one_cluster, Path(tmp))))
        return
    cluster_size = 100_000 if args.quick else 1_000_000
    if args.cluster:
        figures = cluster_case(cluster_size, None)
        figures["cpu_count"] = os.cpu_count()
        figures["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(figures))
        return
    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    throughput = []
    for n in sizes:
        result = _child("--one", n)
        print(f"tiled azure-conv, {n:,} requests: {result}", file=sys.stderr)
        throughput.append(result)
    calibrated = _child("--one-calibrated", sizes[-1])
    print(f"tiled azure-conv, {sizes[-1]:,} requests, calibrated: {calibrated}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        modes = [
            compare_modes("azure-conv", 3_000 if args.quick else None, Path(tmp)),
            compare_modes("mooncake", 500 if args.quick else None, Path(tmp)),
        ]
    for m in modes:
        print(f"fast vs reference: {m}", file=sys.stderr)
    largest = throughput[-1]
    cluster = cluster_case(cluster_size, next((t for t in throughput if t["requests"] == cluster_size), None))
    figures = {
        "throughput": throughput,
        "requests_per_s_at_largest": largest["requests_per_s"],
        "largest_requests": largest["requests"],
        "calibrated_requests_per_s_at_largest": calibrated["requests_per_s"],
        "target_requests_per_s": 20_000,
        "peak_rss_mb_by_size": {str(t["requests"]): t["peak_rss_mb"] for t in throughput},
        "peak_rss_outputs_mb_by_size": {str(t["requests"]): t["peak_rss_outputs_mb"] for t in throughput},
        "modes": modes,
        "fast_over_reference_speed": {m["trace"]: m["fast_over_reference_speed"] for m in modes},
        "max_relative_timestamp_difference": max(m["max_relative_timestamp_difference"] for m in modes),
        "cluster": cluster,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
