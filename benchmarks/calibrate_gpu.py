"""Produce the shipped GPU profiles in one time-boxed run (prepared for a session with an NVIDIA GPU).

Run on the GPU machine, from the repository root, with a CUDA build of torch 2.13.0:

    python benchmarks/calibrate_gpu.py --budget-s 480 --out "${OUT:-profiles}"

What it does, in order, each step inside what is left of ``--budget-s`` (it never starts a step it
cannot finish in time, and every profile it writes is complete and self-describing):

1. checks that CUDA is visible and prints the device, driver, torch and CUDA versions; then a
   preflight (about 10 s): the executor's tests on this device (``tests/replay/test_executor.py``:
   its cuda cases compare the CUDA executor with a float64 reference) and one bf16 step checked for
   finite logits; a failed preflight stops the run before any profiling time is spent;
2. profiles the 1B-class shape (all 16 layers, bf16, CUDA events) with the GPU sweep of
   ``replay.measured.profiler.default_sweep`` (prefill chunks 16-4096 tokens over contexts 0-8192,
   decode batches 1-256 over contexts 128-8192, hybrid steps), time-boxed;
3. profiles the 8B-class shape the same way (all 32 layers);
4. if time is left: the 70B-class shape scaled by layer count (8 of its 80 layers);
5. for each profile, writes ``<name>.parquet`` (metadata: GPU name, driver, torch, dtype, model
   shape, date) and ``<name>.parquet.fit.json`` (held-out median/p95 error, roofline fraction);
6. if time is left: a measured-versus-modelled replay of 40 Azure conversation requests on the 1B
   shape (``compare-measured``), into ``<out>/compare-llama-1b`` (the trace is read from
   ``$SERVELENS_SHARED_DIR``, else ``../shared`` beside the checkout);
7. writes ``<out>/calibration-summary.json`` with every figure and how long each step took.

The files under ``--out`` are what a session commits to ``profiles/`` (with docs/calibration.md's
"measured profiles" table updated from the summary). Nothing here downloads weights: the executor
builds random weights of each shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (shape, layers built or None for all, share of the remaining budget it may use, minimum seconds to start)
PLAN = (
    ("llama-1b", None, 0.40, 60),
    ("llama-8b", None, 0.55, 90),
    ("llama-70b", 8, 0.80, 90),
)
SETUP_S = 25  # weights and KV cache allocation, peak lookup, fit: per profile, outside the sweep's time box
COMPARE_MIN_S = 150  # 40 requests on the 1B shape took 146 s on an H200 (each step run twice: warm-up, timed)


def _gpu_slug(name: str) -> str:
    for fragment in ("H200", "H100", "A100", "L40S", "L4", "A10"):
        if fragment in name:
            return fragment.lower()
    return "".join(c for c in name.lower() if c.isalnum())[:16] or "gpu"


def preflight(device: str) -> str | None:
    """None when the executor is right on this device, else what went wrong."""
    import subprocess

    import torch

    from replay.measured.executor import SeqWork, StepExecutor
    from replay.measured.shapes import llama_shape

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/replay/test_executor.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    print(tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-2000:])
    if tests.returncode != 0:
        return "tests/replay/test_executor.py failed:\n" + tests.stdout[-4000:]
    ex = StepExecutor(llama_shape("tiny"), device=device, num_kv_blocks=64)  # the device's default dtype
    with torch.inference_mode():
        logits = ex.execute([SeqWork("a", 40, 0), SeqWork("b", 1, 30), SeqWork("c", 1, 3)])
    if not bool(torch.isfinite(logits).all()):
        return f"non-finite logits from a {ex.dtype_name} step"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=480.0, help="Wall-clock budget for everything, seconds.")
    parser.add_argument("--out", type=Path, default=ROOT / "profiles", help="Folder for the profiles and the summary.")
    parser.add_argument("--skip-compare", action="store_true", help="Profiles only.")
    parser.add_argument("--skip-preflight", action="store_true", help="Do not run the executor's tests first.")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="Run the whole flow on the CPU with the tiny shape (checks the script, measures nothing shippable).")
    args = parser.parse_args()
    device = "cpu" if args.cpu_rehearsal else "cuda"
    plan = (("tiny", None, 0.5, 5),) if args.cpu_rehearsal else PLAN
    deadline = time.monotonic() + args.budget_s
    left = lambda: deadline - time.monotonic()  # noqa: E731

    import torch

    from replay.measured.fit import evaluate_profile, fit_report_lines, write_fit_report
    from replay.measured.profiler import default_sweep, nvidia_driver, run_profile
    from replay.measured.shapes import llama_shape

    summary: dict = {"budget_s": args.budget_s, "steps": []}
    if device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device visible to torch {torch.__version__}: nothing to calibrate", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    summary["device"] = {"name": gpu, "driver": nvidia_driver(), "torch": torch.__version__, "cuda": torch.version.cuda}
    print(f"device: {gpu}, driver {summary['device']['driver']}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if args.cpu_rehearsal:
        torch.set_num_threads(1)
    if not args.skip_preflight:
        t0 = time.monotonic()
        problem = preflight(device)
        summary["steps"].append({"step": "preflight", "seconds": round(time.monotonic() - t0, 1), "error": problem})
        if problem:
            print(f"preflight failed: {problem}", file=sys.stderr)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "calibration-summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
            return 3
        print(f"preflight passed in {time.monotonic() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = _gpu_slug(gpu)
    first_profile = None
    for name, layers, share, minimum in plan:
        if left() < minimum + SETUP_S:
            summary["steps"].append({"step": f"profile {name}", "skipped": f"{left():.0f} s left"})
            continue
        shape = llama_shape(name, layers)
        box = max(30.0, min(left() - SETUP_S, share * left()))
        stem = f"{name}{'' if layers is None else f'-{layers}l'}-{slug}"
        out = args.out / f"{stem}.parquet"
        t0 = time.monotonic()
        try:
            profile = run_profile(shape, device=device, sweep=default_sweep(device, shape, max_seconds=box), out=out)
            _, report = evaluate_profile(profile)
            fit_path = write_fit_report(report, profile, out)
        except Exception as exc:  # a failed shape (e.g. out of memory) must not cost the others
            traceback.print_exc()
            summary["steps"].append({"step": f"profile {name}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        took = time.monotonic() - t0
        print(f"{stem}: {profile.table.num_rows}/{profile.meta.num_shapes_planned} shapes in {took:.0f} s")
        for line in fit_report_lines(report):
            print("  " + line)
        summary["steps"].append({
            "step": f"profile {name}", "profile": out.name, "fit": fit_path.name, "seconds": round(took, 1),
            "num_shapes": profile.table.num_rows, "truncated": profile.meta.truncated, "report": asdict(report),
        })
        if name in ("llama-1b", "tiny"):
            first_profile = out
    if not args.skip_compare and first_profile is not None and left() > (5 if args.cpu_rehearsal else COMPARE_MIN_S):
        from replay.measured.measured import compare_measured, comparison_lines
        from replay.workload import load_workload

        t0 = time.monotonic()
        try:
            shared = Path(os.environ.get("SERVELENS_SHARED_DIR") or ROOT.parent / "shared")
            workload = load_workload("azure-conv", shared if shared.is_dir() else None, 40)
            result = compare_measured(workload, first_profile, device=device, out_dir=args.out / "compare-llama-1b")
            for line in comparison_lines(result):
                print(line)
            summary["steps"].append({
                "step": "compare-measured llama-1b", "seconds": round(time.monotonic() - t0, 1),
                "rows": [asdict(r) for r in result.rows], "step_error": asdict(result.step_error),
            })
        except Exception as exc:
            traceback.print_exc()
            summary["steps"].append({"step": "compare-measured llama-1b", "error": f"{type(exc).__name__}: {exc}"})
    summary["seconds_left"] = round(left(), 1)
    (args.out / "calibration-summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"summary: {args.out / 'calibration-summary.json'} ({left():.0f} s of the budget left)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
