"""The lake: sanitized events in Parquet, and the staging of event files into it.

Nothing reaches a Parquet file here without passing validation (``schemas.validate``) and
sanitization (``privacy.sanitize``). The Kafka ingest consumer writes the hive-partitioned lake;
the functions below stage single files (a JSONL export, a foreign Parquet file) the same way.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from privacy.sanitize import Sanitizer
from schemas.arrow import EVENTS_SCHEMA
from schemas.validate import detect_format, iter_event_tables


def events_to_parquet(path: str | Path, out: str | Path, sanitizer: Sanitizer, *, batch_rows: int = 65_536) -> int:
    """Validate and sanitize a JSONL or Parquet events file into zstd Parquet (``EVENTS_SCHEMA``).

    Streams in batches; raises ``schemas.validate.InvalidEventsError`` at the first invalid record
    (nothing is silently dropped). Nothing reaches the file un-sanitized. Returns the event count.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with pq.ParquetWriter(out, EVENTS_SCHEMA, compression="zstd") as writer:
        ignored: Counter[str] = Counter()
        for table in iter_event_tables(path, batch_rows=batch_rows, ignored_fields=ignored):
            writer.write_table(sanitizer.sanitize(table, ignored))
            ignored.clear()
            count += table.num_rows
    return count


def is_sanitized(path: str | Path) -> bool:
    """Whether every event of a Parquet file carries the id of the key that pseudonymized it."""
    schema = pq.read_schema(path)
    if "pseudonym_key_id" not in schema.names:
        return False
    column = pq.read_table(path, columns=["pseudonym_key_id"]).column(0)
    return column.null_count == 0


def staged_parquet(path: str | Path, work_dir: str | Path, sanitizer: Sanitizer) -> Path:
    """A sanitized Parquet events file for ``path``: itself if already sanitized, else a
    validated, sanitized conversion in ``work_dir``."""
    path = Path(path)
    if detect_format(path) == "parquet" and is_sanitized(path):
        return path
    out = Path(work_dir) / f"{path.stem}.sanitized.parquet"
    events_to_parquet(path, out, sanitizer)
    return out
