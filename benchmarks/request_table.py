"""Benchmark: request-table derivation over synthetic lifecycle events.

Generates a Parquet file of synthetic events (arrivals, admissions, shared engine steps, first
tokens, token deliveries, finishes, plus 1% duplicated events as producer retries would leave),
then derives the request table in a fresh process and reports events per second and that process's
peak memory (max RSS).

    python benchmarks/request_table.py            # 10,000,000 events (the README figure)
    python benchmarks/request_table.py --quick    # 1,000,000 events, well under a minute

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import generate  # noqa: E402

def derive_in_this_process(path: Path, out: Path, memory_limit: str) -> dict:
    from pipelines.tables import connect, write_requests

    con = connect(None if memory_limit == "none" else memory_limit)
    started = time.perf_counter()
    rows = write_requests(path, out, con=con)
    elapsed = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"requests": rows, "seconds": round(elapsed, 3), "peak_rss_mb": round(peak_kb / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000,000 events instead of 10,000,000")
    parser.add_argument("--events", type=int, default=None, help="number of events (overrides --quick)")
    parser.add_argument("--derive", nargs=3, metavar=("EVENTS", "OUT", "LIMIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.derive:
        print(json.dumps(derive_in_this_process(Path(args.derive[0]), Path(args.derive[1]), args.derive[2])))
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
    figures = {
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
