"""Benchmark: sanitizer throughput per core, for structured events and for events with free text.

- structured: synthetic lifecycle events (tenants, users, sessions, models, instances; no free
  text), sanitized in batches of about 20,000 events;
- text, repeated: the same events, each with a 200-character error message drawn from a pool of
  1,000 distinct messages (each analysed once, then cached);
- text, unique: every event with its own 200-character message (every one goes through Presidio).

One core: pyarrow is limited to one thread. Presidio's start-up (about 2 s) is excluded. Target for
structured events: 100,000 events/s/core.

    python benchmarks/sanitize.py            # 2,000,000 structured events
    python benchmarks/sanitize.py --quick    # 200,000 structured events, under a minute

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import iter_chunks  # noqa: E402
from privacy.config import PrivacyConfig  # noqa: E402
from privacy.keys import KeyRing  # noqa: E402
from privacy.sanitize import Sanitizer  # noqa: E402

TARGET_STRUCTURED = 100_000
WORDS = "upstream worker timeout retry cache shard token decode prefill batch node replica queue".split()


def _text(rng: np.random.Generator) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < 200:
        words.append(WORDS[rng.integers(len(WORDS))])
    return " ".join(words)[:200]


def _rate(sanitizer: Sanitizer, tables: list[pa.Table]) -> float:
    started = time.perf_counter()
    for table in tables:
        sanitizer.sanitize(table)
    return sum(t.num_rows for t in tables) / (time.perf_counter() - started)


def _with_text(tables: list[pa.Table], texts: list[str]) -> list[pa.Table]:
    out, i = [], 0
    for table in tables:
        n = table.num_rows
        column = pa.array([texts[(i + j) % len(texts)] for j in range(n)], pa.string())
        out.append(table.set_column(table.schema.get_field_index("error_message"), "error_message", column))
        i += n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200,000 structured events instead of 2,000,000")
    args = parser.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    num_structured = 200_000 if args.quick else 2_000_000
    num_unique_text = 2_000 if args.quick else 20_000
    keyring = KeyRing("bench", {"bench": bytes(range(32))})
    config = PrivacyConfig(scrub_budget_per_batch=10**9)  # measure the analyses, never skip them

    structured = list(iter_chunks(num_structured, requests_per_chunk=2_000))
    rng = np.random.default_rng(3)
    warm = Sanitizer(keyring, config)
    warm.sanitize(structured[0])  # loads Presidio once (excluded from the figures)

    sanitizer = Sanitizer(keyring, config)
    sanitizer.scrubber._analyzer = warm.scrubber._analyzer
    structured_rate = _rate(sanitizer, structured)
    print(f"structured: {structured_rate:,.0f} events/s", file=sys.stderr)

    pool = [_text(rng) + f" #{i}" for i in range(1_000)]
    repeated = _with_text(structured, pool)
    sanitizer = Sanitizer(keyring, config)
    sanitizer.scrubber._analyzer = warm.scrubber._analyzer
    repeated_rate = _rate(sanitizer, repeated)
    print(f"text, 1,000 distinct messages: {repeated_rate:,.0f} events/s", file=sys.stderr)

    unique_rows = []
    budget = num_unique_text
    for table in structured:
        take = min(budget, table.num_rows)
        unique_rows.append(table.slice(0, take))
        budget -= take
        if budget <= 0:
            break
    unique = _with_text(unique_rows, [_text(rng) + f" #{i}" for i in range(num_unique_text)])
    sanitizer = Sanitizer(keyring, config)
    sanitizer.scrubber._analyzer = warm.scrubber._analyzer
    unique_rate = _rate(sanitizer, unique)
    print(f"text, every message unique: {unique_rate:,.0f} events/s", file=sys.stderr)

    print(
        json.dumps(
            {
                "structured_events": sum(t.num_rows for t in structured),
                "structured_events_per_s_per_core": round(structured_rate),
                "structured_vs_target": round(structured_rate / TARGET_STRUCTURED, 2),
                "text200_repeated_events_per_s_per_core": round(repeated_rate),
                "text200_unique_events_per_s_per_core": round(unique_rate),
            }
        )
    )


if __name__ == "__main__":
    main()
