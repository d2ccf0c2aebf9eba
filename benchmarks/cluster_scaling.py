"""What a scale-up's delays cost: a burst on a cluster that scales up as the burst begins.

The Azure conversation trace's first 2 minutes at its recorded rate, then 5 minutes at 6x (six
superposed copies of the next 5 minutes, shifted by 1 s each), on Llama-3-8B / H100 instances behind
the least-outstanding-tokens router. One instance runs from the start; at the burst's first arrival
a fixed schedule adds three. Compared: no scale-up; a scale-up with no delay (the ideal); the
defaults (start-up 30 s, weights at 2 GB/s: 8 s, warm-up 10 s); a slow start (60 s, 0.5 GB/s: 32 s,
30 s). Reported per case: when the new instances took traffic, TTFT p50/p99 over the burst's
requests, and attainment (completed within every objective of the default class: TTFT 2 s, ITL
0.2 s, E2E 60 s, queue 30 s) over the burst and over the whole run.

    python benchmarks/cluster_scaling.py      # under a minute (--quick: the same); last line: JSON
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

S = 1_000_000_000


def burst_workload(tail_s: float = 0.0):
    """The Azure conversation trace's first 2 minutes at its rate, the next 5 at 6x (six copies
    shifted by 1 s each), then ``tail_s`` more at its rate; returns (workload, first arrival ns,
    burst start ns, burst end ns)."""
    import pyarrow as pa

    from replay.traces import read_trace
    from replay.workload import superpose, trim
    from servelens.config import load_config, shared_dir

    base = read_trace("azure-conv", shared_dir(load_config()))
    t0 = base["arrival_ns"][0].as_py()
    start, end = t0 + 120 * S, t0 + 420 * S
    parts = [trim(base, t0, start), trim(superpose(trim(base, start, end), 6, S), start, end)]
    if tail_s > 0:
        parts.append(trim(base, end, end + round(tail_s * S)))
    return pa.concat_tables(parts).sort_by([("arrival_ns", "ascending")]), t0, start, end


def run_case(name: str, workload, burst_ns: int, delays, scale: bool, out: Path) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    from replay.cluster import ScaleStep, cluster_config, run_cluster_replay
    from replay.derive import derive_requests
    from replay.metrics import MetricsConfig, load_requests

    t0 = workload["arrival_ns"][0].as_py()
    steps = [ScaleStep(at_s=(burst_ns - t0) / S, delta=3)] if scale else []
    config = cluster_config(1, router="least-outstanding-tokens", scaling=steps, delays=delays)
    summary = run_cluster_replay(workload, config, out_dir=out / name.replace(" ", "_"))
    table = derive_requests(summary.events_path)
    in_burst = table.filter(pc.greater_equal(table["arrival_ns"], burst_ns))
    everything = load_requests(table, MetricsConfig())
    burst = load_requests(in_burst, MetricsConfig())
    ttft = burst.ttft_s[~np.isnan(burst.ttft_s)]
    ready = [x.ready_s for x in summary.instances[1:]]
    return {
        "case": name,
        "requests": summary.num_requests,
        "burst_requests": in_burst.num_rows,
        "new_instances_ready_after_burst_start_s": None if not ready else round(ready[0] - (burst_ns - t0) / S, 1),
        "burst_ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
        "burst_ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "burst_attainment": round(float(burst.good.mean()), 3),
        "run_attainment": round(float(everything.good.mean()), 3),
        "wall_s": round(summary.wall_s, 1),
    }


def main() -> None:
    import argparse

    from replay.cluster import ScalingDelays

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same run: the full one takes well under a minute")
    parser.parse_args()

    workload, _, burst_ns, _ = burst_workload()
    cases = [
        ("no scale-up", ScalingDelays(), False),
        ("scale-up, no delay", ScalingDelays(startup_s=0, weight_load_s=0, cache_warm_s=0), True),
        ("scale-up, default delays (30 s + 8 s + 10 s)", ScalingDelays(), True),
        ("scale-up, slow start (60 s + 32 s + 30 s)", ScalingDelays(startup_s=60, weight_load_bandwidth_bytes_per_s=0.5e9,
                                                                    cache_warm_s=30), True),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, delays, scale in cases:
            result = run_case(name, workload, burst_ns, delays, scale, Path(tmp))
            print(result, file=sys.stderr)
            results.append(result)
    print(json.dumps({"cases": results}))  # one JSON object on the last line


if __name__ == "__main__":
    main()
