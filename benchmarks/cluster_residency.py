"""What weight swapping costs: two models on four instances, pinned against loaded on demand.

The Azure conversation trace, six superposed copies (shifted by 1 s each: six user populations, so
six times the recorded rate), on four Llama-3-8B / H100 instances behind the
least-outstanding-tokens router. Each request names one of two models of one shape (Llama-3-8B and
Mistral-7B: same layers, heads and KV bytes per token, so the step cost model holds for both),
assigned by a documented scenario:

- ``phased``: the model alternates every 5 minutes (all requests of a phase name one model);
- ``mixed``: every request draws its model 50/50, all the time.

Residency cases (the same instances, router and load; ``replay.residency``):

- ``pinned 2+2``: two instances hold Llama-3-8B, two Mistral-7B (weight region: one model), and a
  request is routed only to an instance that holds its model;
- ``on-demand``: the same weight region (one model), every instance offered to the router, and the
  instance it picks loads the model it lacks (evicting the other once its requests have drained):
  storage at 2 GB/s, 1 s per load, 0.25 s per eviction (a Llama-3-8B load: 9.0 s);
- ``on-demand, host copy``: the same, but evicted weights are kept in host memory and reload over
  PCIe at 25 GB/s (a Llama-3-8B reload: 1.6 s);
- ``both resident``: every instance holds both models (weight region of two: about 14.5 GB less KV
  cache each), no loads.

Reported per case: weight loads, seconds spent evicting and loading (summed over instances),
seconds loads waited for their victims' requests to drain, requests that waited for a load, and TTFT
(arrival to first token: the user-facing one) p50 / p99 / p99.9 over completed requests.

    python benchmarks/cluster_residency.py           # the whole trace (116,196 requests per case); minutes
    python benchmarks/cluster_residency.py --quick   # its first 5.5 minutes (one transition), six cases; under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

S = 1_000_000_000
MODELS = ("llama-3-8b", "mistral-7b")
COPIES = 6
NUM_INSTANCES = 4
PHASE_S = 300.0


def workload(quick: bool):
    from replay.traces import read_trace
    from replay.workload import superpose, trim
    from servelens.config import load_config, shared_dir

    base = read_trace("azure-conv", shared_dir(load_config()))
    if quick:
        t0 = base["arrival_ns"][0].as_py()
        base = trim(base, t0, t0 + 330 * S)
    return superpose(base, COPIES, S)


def scenarios():
    from replay.scenario import Scenario, Share, alternating_models

    return {
        "phased": Scenario(name="two-model-phased", model_phases=alternating_models(*MODELS, PHASE_S)),
        "mixed": Scenario(name="two-model-mixed", models=tuple(Share(name=m, share=0.5) for m in MODELS)),
    }


def residencies():
    from replay.residency import ResidencyConfig, WeightTransfer, model_weights

    catalogue = tuple(model_weights(m) for m in MODELS)
    storage = WeightTransfer(load_bandwidth_bytes_per_s=2e9, load_latency_s=1.0, evict_latency_s=0.25)
    one = ResidencyConfig(catalogue=catalogue, initial=tuple((m,) for m in MODELS), transfer=storage)
    return {
        "pinned 2+2": dataclasses.replace(one, policy="pinned"),
        "on-demand": one,
        "on-demand, host copy": dataclasses.replace(one, transfer=dataclasses.replace(storage, offload_bandwidth_bytes_per_s=25e9)),
        "both resident": dataclasses.replace(one, policy="pinned", initial=(MODELS,)),
    }


def run_case(scenario_name: str, scenario, case: str, residency, table, out: Path) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    from replay.cluster import cluster_config, run_cluster_replay
    from replay.derive import derive_requests
    from replay.residency import sized_instance

    config = dataclasses.replace(cluster_config(NUM_INSTANCES, router="least-outstanding-tokens"), residency=residency)
    summary = run_cluster_replay(table, config, scenario=scenario, out_dir=out / f"{scenario_name}-{case}".replace(" ", "_"))
    requests = derive_requests(summary.events_path)
    done = requests.filter(pc.equal(requests["outcome"], "completed"))
    ttft = (done["first_token_ns"].to_numpy(zero_copy_only=False) - done["arrival_ns"].to_numpy()) / 1e9
    p50, p99, p999 = (float(np.percentile(ttft, q)) for q in (50, 99, 99.9))
    xs = summary.instances
    return {
        "scenario": scenario_name,
        "case": case,
        "requests": summary.num_requests,
        "completed": done.num_rows,
        "kv_blocks_per_instance": sized_instance(config.instances[0], residency).num_kv_blocks,
        "loads": sum(x.num_weight_loads for x in xs),
        "swap_s": round(sum(x.weight_swap_ns for x in xs) / 1e9, 1),
        "drain_wait_s": round(sum(x.weight_drain_ns for x in xs) / 1e9, 1),
        "deferred_requests": sum(x.num_deferred for x in xs),
        "ttft_p50_s": round(p50, 3),
        "ttft_p99_s": round(p99, 3),
        "ttft_p999_s": round(p999, 3),
        "wall_s": round(summary.wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the trace's first 5.5 minutes, without the mixed both-resident case (under a minute)"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    table = workload(args.quick)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for scenario_name, scenario in scenarios().items():
            for case, residency in residencies().items():
                if scenario_name == "mixed" and (case == "on-demand, host copy" or (args.quick and case == "both resident")):
                    continue  # the phased rows show what a host copy changes (and, quick, both resident)
                result = run_case(scenario_name, scenario, case, residency, table, Path(tmp))
                print(result, file=sys.stderr)
                results.append(result)
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps({"cases": results}))  # one JSON object on the last line


if __name__ == "__main__":
    main()
