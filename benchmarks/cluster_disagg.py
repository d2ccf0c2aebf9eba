"""Aggregated versus disaggregated serving on the same workload and the same hardware budget.

The Azure conversation trace (its first 10 minutes; ``--quick``: 2 minutes, one load, three cases),
loaded by superposing ``k`` copies shifted by 1 s each (k user populations: the trace's own arrival
pattern at k times its rate; ``--loads``, default 8, 12, 16), on four Llama-3-8B / H100 instances:

- aggregated: 4 instances behind least-outstanding-tokens, each prefilling and decoding;
- disaggregated 2+2 (and 2+2 with decode instances at ``max_num_seqs`` 512), 1+3, and 3+1 (decode at
  512): prefill instances behind least-outstanding-tokens, decode instances behind
  least-outstanding-tokens, the KV of each prefilled prompt moving over a 50 GB/s link (400 Gb/s
  RDMA) with 20 us latency (``ClusterConfig`` defaults).

Reported per case and load: TTFT p50/p99 (arrival to first token, which a disaggregated request gets
from its prefill instance), ITL p99 (the 99th percentile over requests of each request's p99
inter-token gap; a disaggregated request's first gap includes its KV transfer and its wait for the
decode batch; the fast mode's coalesced runs give per-token gaps as run gaps / tokens: the mean of
steps that differ only as their context grows), attainment (completed within every objective of the default class: TTFT 2
s, ITL 0.2 s, E2E 60 s, queue 30 s), goodput (such requests per second), KV transfers and bytes.

    python benchmarks/cluster_disagg.py            # a few minutes; last line: JSON
    python benchmarks/cluster_disagg.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

S = 1_000_000_000
#: (name, prefill or aggregated instances, decode instances, the decode instances' max_num_seqs)
CASES = (
    ("aggregated 4", 4, 0, None),
    ("disaggregated 2P+2D", 2, 2, None),
    ("disaggregated 2P+2D, decode batch 512", 2, 2, 512),
    ("disaggregated 1P+3D", 1, 3, None),
    ("disaggregated 3P+1D, decode batch 512", 3, 1, 512),
)


def workload(minutes: float, copies: int):
    from replay.traces import read_trace
    from replay.workload import superpose, trim
    from servelens.config import load_config, shared_dir

    base = read_trace("azure-conv", shared_dir(load_config()))
    t0 = base["arrival_ns"][0].as_py()
    window = trim(base, t0, t0 + round(minutes * 60 * S))
    return window if copies == 1 else superpose(window, copies, S)


def run_case(name: str, num_prefill: int, num_decode: int, decode_max_seqs: int | None, w, out: Path) -> dict:
    import numpy as np

    from replay.cluster import cluster_config, disaggregated_config, run_cluster_replay
    from replay.config import EngineConfig, instance_config
    from replay.derive import derive_requests
    from replay.metrics import MetricsConfig, load_requests, percentile

    instance = instance_config("llama-3-8b", "h100-sxm")
    if num_decode:
        decode = instance if decode_max_seqs is None else instance_config(
            "llama-3-8b", "h100-sxm", engine=EngineConfig(max_num_seqs=decode_max_seqs))
        config = disaggregated_config(num_prefill, num_decode, instance, decode_instance=decode)
    else:
        config = cluster_config(num_prefill, instance, "least-outstanding-tokens")
    summary = run_cluster_replay(w, config, out_dir=out / "".join(c if c.isalnum() else "_" for c in name))
    r = load_requests(derive_requests(summary.events_path), MetricsConfig())
    arrivals = w["arrival_ns"].to_numpy()
    span_s = (arrivals[-1] - arrivals[0]) / S
    done_s = float(np.nanmax(r.arrival_s + np.nan_to_num(r.e2e_s)) - np.nanmin(r.arrival_s))

    def p(values: np.ndarray, q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(v, 3)

    return {
        "case": name,
        "requests": summary.num_requests,
        "offered_rps": round(float(summary.num_requests / span_s), 1),
        "ttft_p50_s": p(r.ttft_s, 50),
        "ttft_p99_s": p(r.ttft_s, 99),
        "itl_p99_s": p(r.itl_p99_s, 99),
        "attainment": round(float(r.good.mean()), 3),
        "goodput_rps": round(float(r.good.sum()) / max(span_s, done_s), 2),
        "kv_transfers": summary.num_kv_transfers,
        "kv_transfer_gb": round(summary.kv_transfer_bytes / 1e9, 1),
        "wall_s": round(summary.wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 minutes of trace, one load, three cases")
    parser.add_argument("--loads", default=None, help="copies of the trace superposed, comma-separated (default 8,12,16)")
    args = parser.parse_args()
    minutes, loads, cases = (2, (16,), CASES[:3]) if args.quick else (10, (8, 12, 16), CASES)
    if args.loads:
        loads = tuple(int(x) for x in args.loads.split(","))
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for copies in loads:
            w = workload(minutes, copies)
            for name, num_prefill, num_decode, decode_max_seqs in cases:
                result = {"load_copies": copies, **run_case(name, num_prefill, num_decode, decode_max_seqs, w, Path(tmp))}
                print(result, file=sys.stderr)
                results.append(result)
    print(json.dumps({"minutes": minutes, "wall_s": round(time.perf_counter() - t0, 1), "results": results}))


if __name__ == "__main__":
    main()
