"""Benchmark: the canary gate's measured error rates (a test of a test), with the default configuration.

A/A: two runs of the same policy on the same engine that differ only by chance, judged by the gate
with its defaults (``replay.gate.default_config``), many trials each:

- ``seed``: one slice of the Azure conversation trace replayed twice, the replays differing only in
  their seed (the scenario's seeded draws: which tenant and which class each request belongs to);
  the offline gate's situation (two replays of one workload);
- ``split``: the slice at twice its recorded rate, its requests split at random into two pools (a
  resampled workload each), each replayed on its own instance over the same period; a live canary's
  situation (two pools of equal size taking the traffic at random).

Every trial takes a fresh slice per run length (its start drawn at random from all that the trace
allows for that length, so each length's figures cover the whole trace) and fresh seeds. The gate
should pass an A/A pair: a FAIL is a false fail. A/B: the same pairs with a regression of known
size injected into the candidate's request table (so the effect is exact and the noise is the A/A
pair's):

- ``itl_x1.25``, ``itl_x1.5``, ``itl_x2``: every inter-token gap x f (ITL and TPOT columns; E2E
  lengthened by the decode time added);
- ``ttft_tail_x2``: the slowest 10% of requests' TTFT doubled (p99 +100%, p50 unchanged; E2E
  lengthened by the time added);
- ``goodput_-10%``, ``goodput_-25%``: that share of requests, drawn at random, times out (goodput
  and attainment fall; nothing else moves).

The default thresholds make ITL x1.25 and goodput -10% threshold-sized (the ITL effect is exactly
the critical +25%; goodput -10% lies between the allowed 5% and the critical 20%, attainment -0.1
on its critical 0.10): their FAIL rate is expected near half, and they should rarely PASS. The
other four are critical-size (twice the critical effect or more): the target is FAIL in at least
95% of trials once the run holds 30 windows. Each trial is judged at several run lengths (N
one-minute windows), each on a slice of its own. Targets (defaults): A/A false fail at most 5% and
A/A pass at least 90% at every length with the evidence minimums met (``min_windows``); below them
the gate says "not enough data" (inconclusive), by design.

    python benchmarks/gate_power.py            # seed: 120 trials at 30 and 45 windows; split: 200 trials at 30, 35,
                                               # 40 and 45; the injected effects at 30; rewrites docs/gate.md's table
    python benchmarks/gate_power.py --quick    # 8 trials, split design, 30 windows: under a minute
    python benchmarks/gate_power.py --designs split > split.json    # one design per run (or machine),
    python benchmarks/gate_power.py --designs seed > seed.json      # then one table of both
    python benchmarks/gate_power.py --merge seed.json split.json    # (rewrites docs/gate.md's table)

The last line of output is one JSON object with the figures (``aa_false_fail_rate``,
``detection_rate`` per injected effect, and the breakdowns by design and run length).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

ENGINE = "llama-3-8b@h100-sxm"
TRACE = "azure-conv"
WINDOW_NS = 60 * 1_000_000_000
EFFECTS = ("itl_x1.25", "itl_x1.5", "itl_x2", "ttft_tail_x2", "goodput_-10%", "goodput_-25%")
CRITICAL_SIZE = ("itl_x1.5", "itl_x2", "ttft_tail_x2", "goodput_-25%")
DETECTION_WINDOWS = 30  # the target holds from this run length on
#: The run lengths (windows) judged by default: the evidence minimum on, and the trials per design.
DEFAULT_WINDOWS = {"seed": (30, 45), "split": (30, 35, 40, 45)}
DEFAULT_TRIALS = {"seed": 120, "split": 200}
BEGIN, END = "<!-- gate-power:begin -->", "<!-- gate-power:end -->"
#: The metric each injected effect is read on (its measured effect is reported beside the rates).
PRIMARY = {"itl_x1.25": "itl_p99_p99_s", "itl_x1.5": "itl_p99_p99_s", "itl_x2": "itl_p99_p99_s",
           "ttft_tail_x2": "ttft_p99_s", "goodput_-10%": "goodput_rps", "goodput_-25%": "goodput_rps"}


# ------------------------------------------------------------------------------------------ injections


def _scaled(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def _column(table: pa.Table, name: str) -> np.ndarray:
    return pc.fill_null(table[name], np.nan).to_numpy().astype(np.float64)


def slower_decode(table: pa.Table, factor: float) -> pa.Table:
    """Every inter-token gap x ``factor``; E2E grows by the decode time added."""
    for name in ("itl_mean_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "tpot_s"):
        table = _scaled(table, name, _column(table, name) * factor)
    ttft, e2e = _column(table, "ttft_s"), _column(table, "e2e_s")
    return _scaled(table, "e2e_s", ttft + (e2e - ttft) * factor)


def ttft_tail(table: pa.Table, factor: float, share: float = 0.10) -> pa.Table:
    """The slowest ``share`` of requests' TTFT x ``factor``; E2E grows by the same time."""
    ttft, e2e = _column(table, "ttft_s"), _column(table, "e2e_s")
    tail = ttft > np.nanquantile(ttft, 1 - share) if np.isfinite(ttft).any() else np.zeros(len(ttft), bool)
    added = np.where(tail, ttft * (factor - 1), 0.0)
    return _scaled(_scaled(table, "ttft_s", ttft + added), "e2e_s", e2e + added)


def timeouts(table: pa.Table, share: float, seed: int) -> pa.Table:
    """``share`` of the completed requests, drawn at random, time out instead."""
    outcome = np.asarray(table["outcome"].to_pylist(), dtype=object)
    hit = (np.random.default_rng(seed).random(len(outcome)) < share) & (outcome == "completed")
    i = table.schema.get_field_index("outcome")
    return table.set_column(i, table.schema.field(i), pa.array(np.where(hit, "timed_out", outcome).tolist(), pa.string()))


def inject(table: pa.Table, effect: str, seed: int) -> pa.Table:
    if effect.startswith("itl_x"):
        return slower_decode(table, float(effect[len("itl_x"):]))
    if effect.startswith("ttft_tail_x"):
        return ttft_tail(table, float(effect[len("ttft_tail_x"):]))
    if effect.startswith("goodput_-"):
        return timeouts(table, float(effect[len("goodput_-"):].rstrip("%")) / 100, seed)
    raise ValueError(effect)


# ------------------------------------------------------------------------------------------ trials


def _replay(workload: pa.Table, seed: int, out: Path):
    from replay.config import parse_instance
    from replay.gate import load_run
    from replay.presets import THREE_TENANT_SCENARIO
    from replay.run import run_replay
    from replay.workload import TableWorkload

    run_replay(TableWorkload(workload, name="slice"), scenario=THREE_TENANT_SCENARIO, instance=parse_instance(ENGINE), seed=seed,
               out_dir=out)
    return load_run(out, out.name)


@functools.lru_cache(maxsize=1)
def _trace() -> pa.Table:
    from replay.traces import read_trace
    from servelens.config import load_config, shared_dir

    return read_trace(TRACE, shared_dir(load_config()))


def _pair(design: str, trial: int, windows: int, out: Path):
    """The A/A pair of one trial at one run length: a fresh slice of ``windows`` windows, its start
    drawn from every start the trace allows for that length, and fresh seeds."""
    from replay.workload import superpose, trim

    trace = _trace()
    rng = np.random.default_rng([trial, 0 if design == "seed" else 1, windows])
    t0 = int(trace["arrival_ns"][0].as_py())
    span = int(trace["arrival_ns"][-1].as_py()) - t0
    start = t0 + int(rng.integers(0, max(1, span // WINDOW_NS - windows + 1))) * WINDOW_NS
    if design == "seed":
        w = trim(trace, start, start + windows * WINDOW_NS)
        return _replay(w, 2 * trial, out / "b"), _replay(w, 2 * trial + 1, out / "c")
    doubled = trim(superpose(trace, 2, span // 2), start, start + windows * WINDOW_NS)
    mask = rng.random(doubled.num_rows) < 0.5
    return (_replay(doubled.filter(pa.array(mask)), trial, out / "b"),
            _replay(doubled.filter(pa.array(~mask)), trial, out / "c"))


def _cut_together(base, cand, windows: int):
    origin = min(int(pc.min(r.requests["arrival_ns"]).as_py()) for r in (base, cand))
    cut = []
    for run in (base, cand):
        end = origin + windows * WINDOW_NS
        steps = run.steps.filter(pc.less(run.steps["start_ns"], end)) if run.steps is not None else None
        cut.append(dataclasses.replace(run, requests=run.requests.filter(pc.less(run.requests["arrival_ns"], end)),
                                       steps=steps))
    return cut


def run_trial(args: tuple[str, int, tuple[int, ...], tuple[int, ...]]) -> list[dict]:
    """One trial: an A/A pair at each run length (each on its own slice, so that every length's
    slices cover the whole trace), and each injected effect on it at each length of ``ab_lengths``."""
    from replay.gate import compare_runs, default_config

    design, trial, lengths, ab_lengths = args
    config = dataclasses.replace(default_config(), rank_tests=False)  # descriptive only: never change a verdict
    out = []
    with tempfile.TemporaryDirectory() as tmp:  # open while judging: the gate reads the runs' manifests
        for windows in lengths:
            base, cand = _pair(design, trial, windows, Path(tmp) / str(windows))
            b, c = _cut_together(base, cand, windows)
            for effect in ("none", *(EFFECTS if windows in ab_lengths else ())):
                injected = c if effect == "none" else dataclasses.replace(c, requests=inject(c.requests, effect, trial))
                verdict = compare_runs(b, injected, config)
                primary = next((m for m in verdict.metrics if m.metric == PRIMARY.get(effect) and not m.group), None)
                out.append({"design": design, "trial": trial, "windows": windows, "effect": effect,
                            "status": verdict.status, "held_by": [m.metric for m in verdict.metrics if _holds(m)],
                            "measured": primary.effect if primary is not None else None})
    return out


def _holds(m) -> bool:
    """Whether a metric holds the run undecided (not enough data, or a critical failure not ruled out)."""
    return not m.informative and m.status == "inconclusive" and (m.critical_possible or m.undecided == "not enough data")


# ------------------------------------------------------------------------------------------ figures


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 4) if values else None


def _rate(rows: list[dict], status: str) -> float | None:
    return round(sum(r["status"] == status for r in rows) / len(rows), 4) if rows else None


def _judged(pick, rates: list[float]) -> float | None:
    """The lowest or highest rate among the lengths where the effect was judged (None: judged at none)."""
    return pick(rates) if rates else None


def summarize(rows: list[dict], lengths: dict[str, tuple[int, ...]], min_windows: int) -> dict:
    """The rates per design and run length, and the headline figures they give (``headline``)."""
    def pick(effect: str, design: str, windows: int | None = None) -> list[dict]:
        return [r for r in rows if r["effect"] == effect and r["design"] == design
                and (windows is None or r["windows"] == windows)]

    by = lambda effect, status: {d: {str(n): _rate(pick(effect, d, n), status) for n in ns} for d, ns in lengths.items()}  # noqa: E731
    held: dict[str, dict[str, int]] = {}
    for design in lengths:
        counts: dict[str, int] = {}
        for r in pick("none", design):
            if r["windows"] >= min_windows and r["status"] == "inconclusive":
                for metric in set(r["held_by"]):
                    counts[metric] = counts.get(metric, 0) + 1
        held[design] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    figures = {
        "min_windows": min_windows,
        "aa_false_fail_rate_by_windows": by("none", "fail"),
        "aa_pass_rate_by_windows": by("none", "pass"),
        "aa_inconclusive_rate_by_windows": by("none", "inconclusive"),
        "detection_rate_by_windows": {e: by(e, "fail") for e in EFFECTS},
        "ab_pass_rate_by_windows": {e: by(e, "pass") for e in EFFECTS},
        "aa_inconclusive_held_by": held,
        "measured_effect_median": {d: {e: _median([r["measured"] for r in pick(e, d) if r["windows"] >= DETECTION_WINDOWS])
                                       for e in EFFECTS} for d in lengths},
    }
    return headline(figures) | figures


def _rates(table: dict, at_least: int) -> list[float]:
    """The rates of a per-design, per-length table at run lengths of ``at_least`` windows or more."""
    return [rate for by_length in table.values() for n, rate in by_length.items() if int(n) >= at_least and rate is not None]


def headline(figures: dict) -> dict:
    """The figures the targets are read on, from the per-design, per-length tables of ``figures``."""
    min_windows = figures["min_windows"]
    aa_fail = _rates(figures["aa_false_fail_rate_by_windows"], 0)
    aa_pass = _rates(figures["aa_pass_rate_by_windows"], min_windows)
    detection = {e: _judged(min, _rates(figures["detection_rate_by_windows"][e], DETECTION_WINDOWS)) for e in EFFECTS}
    false_pass = {e: _judged(max, _rates(figures["ab_pass_rate_by_windows"][e], min_windows)) for e in EFFECTS}
    return {
        "aa_false_fail_rate": max(aa_fail),
        "aa_pass_rate_min": min(aa_pass) if aa_pass else None,
        "detection_rate": detection,
        "ab_false_pass_rate": false_pass,
        "critical_size_effects": list(CRITICAL_SIZE),
        "targets_met": {
            "aa_false_fail_at_most_5pct": max(aa_fail) <= 0.05,
            "aa_pass_at_least_90pct": bool(aa_pass) and min(aa_pass) >= 0.90,
            "critical_size_detected_95pct_at_30_windows": all((detection.get(e) or 0.0) >= 0.95 for e in CRITICAL_SIZE),
        },
    }


def _read_run(path: Path) -> dict:
    """One earlier run's figures: the last line of its output."""
    try:
        figures = json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, IndexError, ValueError) as exc:
        raise SystemExit(f"gate_power: cannot read {path} ({exc}); --merge takes files holding a run's output") from None
    if not isinstance(figures, dict) or not isinstance(figures.get("windows"), dict) or "runs" not in figures:
        raise SystemExit(f"gate_power: {path} is not the output of a run of this version of gate_power.py; run it again")
    return figures


#: The figures keyed by design, and those keyed by injected effect and then design (what ``merge`` unites).
_PER_DESIGN = ("trials_per_design", "windows", "aa_false_fail_rate_by_windows", "aa_pass_rate_by_windows",
               "aa_inconclusive_rate_by_windows", "aa_inconclusive_held_by", "measured_effect_median")
_PER_EFFECT = ("detection_rate_by_windows", "ab_pass_rate_by_windows")


def merge(parts: list[dict]) -> dict:
    """Several runs' figures (the last lines of their output, e.g. one run per design) as one run's."""
    merged = dict(parts[0])
    for part in parts[1:]:
        if part["min_windows"] != merged["min_windows"] or (part["engine"], part["trace"]) != (merged["engine"], merged["trace"]):
            raise SystemExit("gate_power: --merge takes runs with the same engine, trace and min_windows")
        for key in _PER_DESIGN:
            merged[key] = merged[key] | part[key]
        for key in _PER_EFFECT:
            merged[key] = {e: merged[key][e] | part[key][e] for e in EFFECTS}
        merged["runs"] = merged["runs"] + part["runs"]
    merged["designs"] = list(merged["windows"])
    return merged | headline(merged)


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.0f}%" if rate in (0, 1) else f"{100 * rate:.1f}%"


def render_table(figures: dict) -> str:
    """The measured rates as Markdown (docs/gate.md, Measured error rates): a column per design and
    run length."""
    columns = [(d, str(n)) for d, ns in figures["windows"].items() for n in ns]
    lines = ["| | " + " | ".join(f"{d}, {n} windows" for d, n in columns) + " |", "|---|" + "---:|" * len(columns)]

    def row(label: str, table: dict) -> str:
        return f"| {label} | " + " | ".join(_pct(table[d].get(n)) for d, n in columns) + " |"

    first = figures["designs"][0]
    measured = figures["measured_effect_median"][first]
    lines.append(row("A/A: FAIL (false fail)", figures["aa_false_fail_rate_by_windows"]))
    lines.append(row("A/A: PASS", figures["aa_pass_rate_by_windows"]))
    lines.append(row("A/A: INCONCLUSIVE", figures["aa_inconclusive_rate_by_windows"]))
    for effect in EFFECTS:
        size = "critical-size" if effect in CRITICAL_SIZE else "threshold-sized"
        lines.append(row(f"{effect} ({size}; bad effect read {_signed(measured.get(effect))}): FAIL",
                         figures["detection_rate_by_windows"][effect]))
        lines.append(row(f"{effect}: PASS (false pass)", figures["ab_pass_rate_by_windows"][effect]))
    trials = figures["trials_per_design"]
    runs = "; ".join(f"{' and '.join(r['designs'])}: {'/'.join(str(trials[d]) for d in r['designs'])} trials, {r['seconds']:.0f} s"
                     for r in figures["runs"])
    held = "; ".join(f"{d}: " + (", ".join(f"{m} ({n})" for m, n in list(figures["aa_inconclusive_held_by"][d].items())[:5]) or "none")
                     for d in figures["designs"])
    lines += ["", f"{runs}. The effect read is the {first} design's median. A/A runs held inconclusive at "
              f"{figures['min_windows']}+ windows (all lengths together), by the metric that held them (runs): {held}."]
    return "\n".join(lines)


def _signed(effect: float | None) -> str:
    return "n/a" if effect is None else f"{100 * effect:+.1f}%"


def write_docs(markdown: str) -> None:
    """Rewrite the block between the markers of docs/gate.md."""
    path = Path(__file__).resolve().parents[1] / "docs" / "gate.md"
    text = path.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + f"{BEGIN}\n{markdown}\n{END}" + rest.split(END, 1)[1])


def _figures(args: argparse.Namespace) -> dict:
    """Run the trials that ``args`` ask for, and their figures."""
    from replay.gate import default_config

    designs = tuple((args.designs or ("split" if args.quick else "seed,split")).split(","))
    if unknown := set(designs) - set(DEFAULT_WINDOWS):
        raise SystemExit(f"gate_power: unknown design {sorted(unknown)}; the designs are seed and split")
    trials = {d: args.trials or (8 if args.quick else DEFAULT_TRIALS[d]) for d in designs}
    windows = args.windows or ("30" if args.quick else None)
    lengths = {d: tuple(int(n) for n in windows.split(",")) if windows else DEFAULT_WINDOWS[d] for d in designs}
    ab_lengths = tuple(int(n) for n in (args.ab_windows or str(DETECTION_WINDOWS)).split(","))
    jobs = [(d, t, lengths[d], ab_lengths) for t in range(max(trials.values())) for d in designs if t < trials[d]]
    started, rows = time.perf_counter(), []
    # One BLAS thread a worker, the workers being the parallelism: two workers on two cores, each with
    # OpenBLAS's own threads, spent a third of their time contending (--quick 41-45 s against 28 s).
    # Spawned workers, so that OpenBLAS starts with the setting (a forked one inherits the parent's).
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, result in enumerate(pool.map(run_trial, jobs), start=1):
            rows += result
            if i % 20 == 0 or i == len(jobs):
                print(f"{i}/{len(jobs)} trials, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return figures_of(rows, trials, lengths, default_config().min_windows, round(time.perf_counter() - started, 1))


def figures_of(rows: list[dict], trials: dict[str, int], lengths: dict[str, tuple[int, ...]], min_windows: int,
               seconds: float) -> dict:
    """One run's figures (what its last line prints and ``--merge`` reads): its settings, ``summarize``'s
    rates and headline, and the run's designs and duration."""
    designs = list(lengths)
    figures = {"trials_per_design": trials, "designs": designs, "windows": {d: list(ns) for d, ns in lengths.items()},
               "engine": ENGINE, "trace": TRACE}
    return figures | summarize(rows, lengths, min_windows) | {"runs": [{"designs": designs, "seconds": seconds}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 trials, split design, 30 windows: under a minute")
    parser.add_argument("--trials", type=int, default=None, help="trials per design [default: seed 120, split 200; quick 8]")
    parser.add_argument("--windows", default=None,
                        help="run lengths in windows, comma-separated [default: seed 30,45; split 30,35,40,45; quick 30]")
    parser.add_argument("--ab-windows", default=None,
                        help=f"run lengths at which the injected effects are judged [default: {DETECTION_WINDOWS}]")
    parser.add_argument("--designs", default=None, help="A/A designs: seed,split [default: both; quick: split]")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes [default: 2]")
    parser.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                        help="run nothing: the table of earlier runs, each FILE holding one run's output (its last "
                             "line is read), e.g. one run per design; rewrites docs/gate.md's table")
    parser.add_argument("--no-docs", action="store_true",
                        help="do not rewrite the table in docs/gate.md (a run with the defaults, or --merge, does)")
    args = parser.parse_args()
    if args.merge:
        figures = merge([_read_run(Path(f)) for f in args.merge])
    else:
        figures = _figures(args)
    table = render_table(figures)
    print(table, file=sys.stderr)
    defaults = not (args.quick or args.trials or args.windows or args.designs or args.ab_windows)
    if (defaults or args.merge) and not args.no_docs:
        write_docs(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
