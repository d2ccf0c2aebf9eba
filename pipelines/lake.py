"""The lake: sanitized events and dead letters as Delta Lake tables of zstd Parquet, dt/hour partitioned.

Exactly once, without Kafka transactions: every commit to a table carries, as Delta *application
transactions*, the next Kafka offset of each partition whose records it holds
(``<table>|<topic>|p<partition>|e<epoch>`` -> offset). Data and offsets are committed in one atomic
step, so after a crash the consumer resumes exactly where the lake ends; records below a table's
high-water mark are never written again. A consumer first checks that the marks are still the ones
it resumed from, then commits against that snapshot: if another consumer (after a rebalance, or a
paused zombie) has committed for the same partition meanwhile, Delta refuses the commit
(``CommitFenced``) and the batch is dropped, never stored twice.

An *epoch* per topic incarnation absorbs a topic that was re-created (a development broker keeps
memory only; on Kafka, a deleted and re-created topic): Kafka gives each incarnation its own topic
id, the lake maps it to an epoch (``epoch|<topic>|<topic id>`` -> n, ``epoch|<topic>`` -> latest),
and offsets start again at 0 in the new epoch.

Files stay healthy through ``compact`` (Delta's optimize: small files of a partition merged into
``target_file_bytes``) and ``vacuum``. Readers query through DuckDB views over the files of the
current table version (``connect``), so they never see a file that is not committed.

``events_to_parquet`` and ``staged_parquet`` stage single files (a JSONL export, a foreign Parquet
file) through the same validation and sanitization; a file that claims to be sanitized already is
validated too, and its key ids must be the configured key ring's.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines import objectstore
from pipelines.config import LakeConfig
from privacy.keys import KeyRing
from privacy.sanitize import Sanitizer
from schemas.arrow import EVENTS_SCHEMA, arrow_schema
from schemas.records import DeadLetter
from schemas.validate import detect_format, iter_event_tables, read_parquet_schema, read_parquet_table
from servelens.errors import ServelensError
from servelens.sql import parquet_relation

EVENTS = "events"
DEAD_LETTERS = "dead_letters"
PARTITION_COLUMNS = ("dt", "hour")
TABLE_SCHEMAS = {EVENTS: EVENTS_SCHEMA, DEAD_LETTERS: arrow_schema(DeadLetter)}
TIME_COLUMN = {EVENTS: "ts_ns", DEAD_LETTERS: "received_ns"}


class CommitFenced(ServelensError):
    """Another consumer committed records of a partition this one was about to commit."""


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """Records [start, end) of one Kafka partition in one epoch (of a topic incarnation)."""

    topic: str
    partition: int
    epoch: int
    start: int
    end: int
    topic_id: str | None = None  # Kafka's id of the topic incarnation, when the broker gives one


def offsets_app_id(table: str, topic: str, partition: int, epoch: int) -> str:
    return f"{table}|{topic}|p{partition}|e{epoch}"


def epoch_app_id(topic: str, topic_id: str | None = None) -> str:
    """The app id mapping a topic incarnation to its epoch (or, without an id, the latest epoch)."""
    return f"epoch|{topic}" if topic_id is None else f"epoch|{topic}|{topic_id}"


def with_time_partitions(table: pa.Table, ts_column: str) -> pa.Table:
    """Add the hive partition columns ``dt`` (YYYY-MM-DD, UTC) and ``hour`` from a ns timestamp.

    A batch spans a few hours: each distinct hour is formatted once and taken row by row (formatting
    every row cost more than the rest of a commit's preparation together); a null stays null."""
    column = table[ts_column]
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    hours = pc.dictionary_encode(pc.floor_temporal(pc.cast(column, pa.timestamp("ns", tz="UTC")), unit="hour"))
    dt = pc.strftime(hours.dictionary, format="%Y-%m-%d").take(hours.indices)
    return table.append_column("dt", dt).append_column("hour", pc.cast(pc.hour(hours.dictionary), pa.int32()).take(hours.indices))


def _stored_schema(name: str) -> pa.Schema:
    schema = TABLE_SCHEMAS[name]
    return pa.schema([*schema, pa.field("dt", pa.string()), pa.field("hour", pa.int32())], metadata=schema.metadata)


class Lake:
    """The two Delta tables of a lake root, and the DuckDB views over them."""

    COMMIT_ATTEMPTS = 8

    def __init__(self, root: str | Path, config: LakeConfig | None = None) -> None:
        self.root = str(root)
        self.config = config or LakeConfig()

    @functools.cached_property
    def storage(self) -> objectstore.StorageOptions:
        """The object store's options (``pipelines.objectstore``), read on first use; a root no
        reader can reach (another scheme, S3 without credentials) fails here with the fix."""
        options = objectstore.storage_options(self.config.storage_options_file)
        objectstore.check_root(self.root, options)
        return options

    @property
    def is_remote(self) -> bool:
        return objectstore.is_remote(self.root)

    def _options(self) -> dict[str, str] | None:
        return self.storage.as_dict() if self.is_remote else None

    def duckdb(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection that reads this lake's files (local or ``s3://``), under its memory limit."""
        from pipelines.tables import connect

        return connect(self.config.duckdb_memory_limit, storage=self.storage)

    def read_schema(self, path: str) -> pa.Schema:
        """The Arrow schema of one of the lake's Parquet files."""
        filesystem, where = objectstore.open_input(path, self.storage)
        return pq.read_schema(where, filesystem=filesystem)

    def uri(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    # -- tables ---------------------------------------------------------------------------------

    def table(self, name: str):
        """The Delta table, or None if nothing was ever committed to it."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri(name), storage_options=self._options())
        except TableNotFoundError:
            return None

    def ensure_tables(self) -> None:
        """Create the empty tables if missing (idempotent; safe when several consumers race)."""
        from deltalake import DeltaTable

        for name in TABLE_SCHEMAS:
            if self.table(name) is not None:
                continue
            if "://" not in self.root:
                Path(self.uri(name)).mkdir(parents=True, exist_ok=True)
            try:
                DeltaTable.create(self.uri(name), _stored_schema(name), partition_by=list(PARTITION_COLUMNS), mode="ignore",
                                  storage_options=self._options())
            except Exception:  # another consumer created it first
                if self.table(name) is None:
                    raise

    def high_water_mark(self, name: str, topic: str, partition: int, epoch: int) -> int | None:
        """The next offset to read for this partition and epoch, as committed to ``name``."""
        table = self.table(name)
        return None if table is None else table.transaction_version(offsets_app_id(name, topic, partition, epoch))

    def _txn(self, app_id: str) -> int | None:
        versions = [t.transaction_version(app_id) for t in map(self.table, TABLE_SCHEMAS) if t is not None]
        known = [v for v in versions if v is not None]
        return max(known) if known else None

    def epoch(self, topic: str, topic_id: str | None) -> tuple[int, bool]:
        """(epoch, is_new) of a topic incarnation: its recorded epoch, else the next one.

        Without a topic id (a broker that gives none) the latest epoch is assumed. ``is_new`` is
        true when the lake holds records of an earlier incarnation: the topic was re-created.
        """
        latest = self._txn(epoch_app_id(topic))
        if topic_id is None:
            return latest or 0, False
        known = self._txn(epoch_app_id(topic, topic_id))
        if known is not None:
            return known, False
        if latest is None:
            return 0, False
        return latest + 1, True

    def commit(
        self,
        name: str,
        rows: pa.Table,
        ranges: Sequence[OffsetRange],
        expected: dict[tuple[str, int, int], int | None],
        *,
        writer: str | None = None,
    ) -> int:
        """Append ``rows`` with the ranges' end offsets in one atomic commit; return the version.

        ``expected`` maps (topic, partition, epoch) to the high-water mark the caller resumed from;
        if the lake holds another one, or another commit for those partitions lands first, raises
        ``CommitFenced`` and writes nothing. ``writer`` (the ingest process's name) is recorded in
        the commit's info (``servelens.writer``), so the table's history says who wrote what.
        """
        from deltalake import CommitProperties, Transaction, WriterProperties, write_deltalake
        from deltalake.exceptions import CommitFailedError

        data = with_time_partitions(rows, TIME_COLUMN[name]).cast(_stored_schema(name))
        transactions = [Transaction(offsets_app_id(name, r.topic, r.partition, r.epoch), r.end) for r in ranges]
        incarnations = {(r.topic, r.topic_id, r.epoch) for r in ranges if r.topic_id is not None}
        for topic, topic_id, epoch in sorted(incarnations, key=str):
            transactions += [Transaction(epoch_app_id(topic, topic_id), epoch), Transaction(epoch_app_id(topic), epoch)]
        for _attempt in range(self.COMMIT_ATTEMPTS):
            table = self.table(name)
            if table is None:
                self.ensure_tables()
                table = self.table(name)
            for r in ranges:  # the marks must still be the ones the caller resumed from
                held = table.transaction_version(offsets_app_id(name, r.topic, r.partition, r.epoch))
                if held != expected.get((r.topic, r.partition, r.epoch)):
                    raise CommitFenced(
                        f"partition {r.partition} of {r.topic} (epoch {r.epoch}) was committed to {name} up to "
                        f"offset {held} by another consumer; this consumer resumed at "
                        f"{expected.get((r.topic, r.partition, r.epoch))}",
                        "its records are dropped here and re-read from the lake's mark; nothing is stored twice",
                    )
            try:
                write_deltalake(
                    table,
                    data,
                    mode="append",
                    schema_mode="merge",  # a newer minor version of the contract adds nullable columns
                    partition_by=list(PARTITION_COLUMNS),
                    writer_properties=WriterProperties(compression="ZSTD"),
                    commit_properties=CommitProperties(
                        app_transactions=transactions,
                        custom_metadata={"servelens.writer": writer} if writer else None,
                    ),
                )
                return table.version() + 1
            except CommitFailedError as exc:
                # Delta refuses a commit whenever another one with application transactions landed
                # since our snapshot, even for other partitions: check the marks again and retry
                last = exc
        raise CommitFenced(f"commits to {name} kept colliding with other consumers' ({last})") from None

    def files(self, name: str) -> list[str]:
        """The Parquet files of the table's current version."""
        table = self.table(name)
        return [] if table is None else sorted(table.file_uris())

    def num_files_by_partition(self, name: str) -> Counter[tuple[str, int]]:
        table = self.table(name)
        if table is None:
            return Counter()
        actions = pa.table(table.get_add_actions(flatten=True))
        return Counter(zip(actions["partition.dt"].to_pylist(), actions["partition.hour"].to_pylist()))

    # -- maintenance ----------------------------------------------------------------------------

    def compact(self, *, min_files: int | None = None, before: tuple[str, int] | None = None) -> dict[str, int]:
        """Merge the small files of every partition holding at least ``min_files`` files
        (only partitions before ``before`` = (dt, hour), if given: closed hours, not the one
        still being written)."""
        min_files = self.config.compact_min_files if min_files is None else min_files
        merged: dict[str, int] = {}
        for name in TABLE_SCHEMAS:
            table = self.table(name)
            if table is None:
                continue
            crowded = [
                key for key, count in self.num_files_by_partition(name).items()
                if count >= min_files and (before is None or key < before)
            ]
            removed = 0
            for dt, hour in crowded:
                result = table.optimize.compact(
                    partition_filters=[("dt", "=", dt), ("hour", "=", str(hour))],
                    target_size=self.config.target_file_bytes,
                )
                removed += int(result.get("numFilesRemoved", 0))
                table = self.table(name)
            merged[name] = removed
        return merged

    def vacuum(self, *, retention_hours: int | None = None) -> int:
        """Delete files no current version references (after compaction, or of failed writes)."""
        hours = self.config.vacuum_retention_hours if retention_hours is None else retention_hours
        deleted = 0
        for name in TABLE_SCHEMAS:
            table = self.table(name)
            if table is not None:
                deleted += len(table.vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False))
        return deleted

    # -- reading --------------------------------------------------------------------------------

    def connect(self, con: duckdb.DuckDBPyConnection | None = None, *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection with the views ``events``, ``dead_letters`` and ``requests``;
        ``read_only``: locked to the lake's folder (``pipelines.tables.lock_down``: no other file, no
        network, no extension, the configuration locked), for ``lake sql``."""
        from pipelines.tables import lock_down
        from replay.derive import requests_sql, with_all_columns

        con = self.duckdb() if con is None else con
        for name in TABLE_SCHEMAS:
            files = self.files(name)
            if files:
                source = parquet_relation(files, hive=True)
                if name == EVENTS:  # files written under an older minor version lack the newer fields
                    source = with_all_columns(con, source)
                con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source}")
            else:
                empty = _stored_schema(name)
                empty = empty.set(empty.get_field_index("dt"), pa.field("dt", pa.date32()))
                con.register(f"{name}_empty", empty.empty_table())
                con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {name}_empty")
        con.execute(f"CREATE OR REPLACE VIEW requests AS {requests_sql('events')}")
        return lock_down(con, [self.root]) if read_only else con

    def recent_event_ids(self, limit: int) -> list[str]:
        """The ``limit`` newest event ids by event time (to warm de-duplication after a restart).

        Not "the ids of the newest files": compaction rewrites a closed hour into a new file, which
        would put that hour's oldest events first and leave out the ones a producer may still retry
        (the reliability soak caught exactly that). Files are taken newest events first (their
        ``ts_ns`` statistics) until they hold ``limit`` rows, then DuckDB keeps the newest ids.
        """
        table = self.table(EVENTS)
        if table is None or limit <= 0:
            return []
        actions = pa.table(table.get_add_actions(flatten=True))
        if not actions.num_rows:
            return []
        newest = "max.ts_ns" if "max.ts_ns" in actions.column_names else "modification_time"
        actions = actions.sort_by([(newest, "descending")])
        base, files, rows = self.uri(EVENTS), [], 0
        for path, num_records in zip(actions["path"].to_pylist(), actions["num_records"].to_pylist()):
            files.append(f"{base}/{path}")
            rows += num_records or 0
            if rows >= limit:
                break
        query = "SELECT event_id FROM read_parquet($files) ORDER BY ts_ns DESC LIMIT $limit"
        return [r[0] for r in self.duckdb().execute(query, {"files": files, "limit": limit}).fetchall()]


def events_to_parquet(path: str | Path, out: str | Path, sanitizer: Sanitizer, *, batch_rows: int = 65_536,
                      progress: Callable[[int], None] | None = None) -> int:
    """Validate and sanitize a JSONL or Parquet events file into zstd Parquet (``EVENTS_SCHEMA``).

    Streams in batches; raises ``schemas.validate.InvalidEventsError`` at the first invalid record
    (nothing is silently dropped). Nothing reaches the file un-sanitized. Returns the event count;
    ``progress`` is called with the count so far after each batch.
    """
    ignored: Counter[str] = Counter()

    def sanitize(table: pa.Table) -> pa.Table:
        sanitized = sanitizer.sanitize(table, ignored)
        ignored.clear()
        return sanitized

    return _write_events(iter_event_tables(path, batch_rows=batch_rows, ignored_fields=ignored), out, sanitize, progress)


def _write_events(tables: Iterator[pa.Table], out: str | Path, transform: Callable[[pa.Table], pa.Table],
                  progress: Callable[[int], None] | None) -> int:
    """Write ``transform`` of each table to one zstd Parquet file (``EVENTS_SCHEMA``); return the row count."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with pq.ParquetWriter(out, EVENTS_SCHEMA, compression="zstd") as writer:
        for table in tables:
            writer.write_table(transform(table))
            count += table.num_rows
            if progress is not None:
                progress(count)
    return count


def is_sanitized(path: str | Path) -> bool:
    """Whether a Parquet file *claims* to be sanitized: every event carries the (text) id of the key that
    pseudonymized it. A claim only: ``staged_parquet`` checks it."""
    return _claimed_key_ids(path) is not None


def _claimed_key_ids(path: str | Path) -> set[str] | None:
    """The key ids a Parquet file's events carry when every event carries one (``is_sanitized``), else None."""
    schema = read_parquet_schema(path)
    if "pseudonym_key_id" not in schema.names or not pa.types.is_string(schema.field("pseudonym_key_id").type):
        return None
    column = read_parquet_table(path, columns=["pseudonym_key_id"]).column(0)
    return None if column.null_count else set(pc.unique(column).to_pylist())


def check_key_ids(path: str | Path, keyring: KeyRing, found: set[str] | None = None) -> None:
    """Refuse a file that claims to be sanitized under keys the configured ring does not hold: a foreign
    ring's pseudonyms, or raw values under a made-up key id (``found``: its key ids, when already read)."""
    if found is None:
        found = set(pc.unique(read_parquet_table(path, columns=["pseudonym_key_id"]).column(0)).to_pylist())
    foreign = sorted(found - set(keyring.secrets))
    if foreign:
        shown = ", ".join(repr(k) for k in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ServelensError(
            f"{path} claims to be sanitized (every event carries a pseudonym key id) but names key ids the configured "
            f"key ring does not hold: {shown} (the ring holds {', '.join(sorted(keyring.secrets))})",
            "configure the key ring that sanitized it (privacy.key_file, SERVELENS_PRIVACY__KEY_FILE), or sanitize "
            "the raw events with `servelens privacy sanitize`; nothing was written",
        )


def staged_parquet(path: str | Path, work_dir: str | Path, sanitizer: Sanitizer,
                   progress: Callable[[int], None] | None = None) -> Path:
    """A validated, sanitized Parquet events file (``EVENTS_SCHEMA``) for ``path``, written in ``work_dir``
    (the caller's temporary folder, which it removes). Every record is validated as ``events validate`` does
    (``InvalidEventsError`` at the first invalid one). A Parquet file that claims to be sanitized
    (``is_sanitized``) is not pseudonymized again, but its key ids must be the ring's (``check_key_ids``)."""
    path = Path(path)
    out = Path(work_dir) / "events.sanitized.parquet"
    claimed = _claimed_key_ids(path) if detect_format(path) == "parquet" else None
    if claimed is not None:
        check_key_ids(path, sanitizer.keyring, claimed)
        _write_events(iter_event_tables(path), out, lambda table: table, progress)
    else:
        events_to_parquet(path, out, sanitizer, progress=progress)
    return out
