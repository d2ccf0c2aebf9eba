"""Autoscaling policies against a fixed schedule on a bursty slice of the Azure conversation trace.

The workload of ``benchmarks/cluster_scaling.py`` with a tail: the trace's first 2 minutes at its
recorded rate, 5 minutes at 6x (six superposed copies of the next 5 minutes, shifted by 1 s each),
then 5 minutes at the recorded rate again; Llama-3-8B / H100 instances behind the
least-outstanding-tokens router, default delays (start-up 30 s, weights 16 GB at 2 GB/s: 8 s,
warm-up 10 s). One instance runs from the start. Compared:

- ``fixed: 1``: no scaling; ``fixed: 2 from the start``: enough for the burst, all along;
- ``fixed: +3 at the burst``: a schedule that adds three instances at the burst's first arrival and
  removes them at its end (it knows when the burst comes: an oracle no autoscaler has);
- ``request-rate``: instances = ceil(rate / target) on the last 60 s, consulted every 15 s, at
  targets of 8, 12 and 16 req/s per instance (its one knob);
- ``workload-aware``: instance capacity from the cost model, KV pool and measured token mix, the
  higher of the window's and the last interval's rate, plus the backlog that queues while instances
  start (100 ms ITL bound, backlog served within 60 s), at 70% and 50% target utilization (its knob),
  consulted alike.

Both autoscalers hold scale-downs for 60 s. Reported: attainment (every objective of the default
class: TTFT 2 s, ITL 0.2 s, E2E 60 s, queue 30 s) over the run and over the burst's requests, burst
TTFT p99, instance-seconds (each instance from its start decision, or the first arrival, to its stop)
and the most instances at once.

    python benchmarks/autoscaling.py      # a few minutes; last line: JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_scaling import burst_workload  # noqa: E402

S = 1_000_000_000


def instance_seconds(events_path) -> tuple[float, int]:
    """(instance-seconds, most instances at once) from the instance_state events."""
    import pyarrow.parquet as pq

    rows = [e for e in pq.read_table(events_path, columns=["event_type", "ts_ns", "instance_id", "state"]).to_pylist()
            if e["event_type"] == "instance_state"]
    begin: dict[str, int] = {}
    end: dict[str, int] = {}
    for e in rows:
        begin.setdefault(e["instance_id"], e["ts_ns"])
        if e["state"] == "stopped":
            end[e["instance_id"]] = e["ts_ns"]
    changes = sorted([(t, 1) for t in begin.values()] + [(t, -1) for t in end.values()])
    live = most = 0
    for _, d in changes:
        live += d
        most = max(most, live)
    return sum(end[i] - begin[i] for i in begin) / S, most


def run_case(name: str, workload, t0: int, burst_ns: int, burst_end_ns: int, config, out: Path) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    from replay.cluster import run_cluster_replay
    from replay.derive import derive_requests
    from replay.metrics import MetricsConfig, load_requests

    summary = run_cluster_replay(workload, config, out_dir=out / name.replace(" ", "_").replace(":", ""))
    table = derive_requests(summary.events_path)
    in_burst = table.filter(pc.and_(pc.greater_equal(table["arrival_ns"], burst_ns), pc.less(table["arrival_ns"], burst_end_ns)))
    everything = load_requests(table, MetricsConfig())
    burst = load_requests(in_burst, MetricsConfig())
    ttft = burst.ttft_s[~np.isnan(burst.ttft_s)]
    inst_s, most = instance_seconds(summary.events_path)
    return {
        "case": name,
        "requests": summary.num_requests,
        "run_attainment": round(float(everything.good.mean()), 3),
        "burst_attainment": round(float(burst.good.mean()), 3),
        "burst_ttft_p99_s": round(float(np.percentile(ttft, 99)), 2),
        "instance_seconds": round(inst_s),
        "max_instances": most,
        "instances_started": len(summary.instances),
        "wall_s": round(summary.wall_s, 1),
    }


def main() -> None:
    from replay.cluster import ScaleStep, cluster_config
    from replay.policies.autoscale import RequestRateConfig, WorkloadAwareConfig

    workload, t0, burst_ns, burst_end_ns = burst_workload(tail_s=300)
    base = cluster_config(1, router="least-outstanding-tokens")
    at, until = (burst_ns - t0) / S, (burst_end_ns - t0) / S
    def request_rate(target: float):
        return (f"request-rate ({target:g} req/s per instance)", dataclasses.replace(
            base, autoscaler="request-rate",
            autoscaler_config=RequestRateConfig(target_requests_per_s=target, scale_down_delay_s=60.0)))

    def workload_aware(utilization: float):
        return (f"workload-aware ({utilization:.0%} utilization)", dataclasses.replace(
            base, autoscaler="workload-aware",
            autoscaler_config=WorkloadAwareConfig(target_utilization=utilization, scale_down_delay_s=60.0)))

    cases = [
        ("fixed: 1", base),
        ("fixed: 2 from the start", cluster_config(2, router="least-outstanding-tokens")),
        ("fixed: +3 at the burst, -3 at its end", dataclasses.replace(
            base, scaling=(ScaleStep(at_s=at, delta=3), ScaleStep(at_s=until, delta=-3)))),
        request_rate(8.0), request_rate(12.0), request_rate(16.0),
        workload_aware(0.7), workload_aware(0.5),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in cases:
            result = run_case(name, workload, t0, burst_ns, burst_end_ns, config, Path(tmp))
            print(result, file=sys.stderr, flush=True)
            results.append(result)
    print(json.dumps({"cases": results}))  # one JSON object on the last line


if __name__ == "__main__":
    main()
