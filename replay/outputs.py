"""The replay's outputs, built from each flush's gathered columns (``replay.gathered``): the events' table, to
a zstd Parquet file (one row group per flush, encoded on a background thread) and/or a sink (the Kafka
emitter SDK, a calibration's reader), and the run's own request table (``replay.request_table``).

``ReplayOutputs`` runs in the replay's process, or, for a large replay, in a process of its own
(``replay.offload``), where building the tables, the request table and the Parquet encoding take a core
of their own beside the simulation: the replay's thread then only gathers its buffers into columns. The
files are the same byte for byte either way.

The output hash of the manifest is the SHA-256 of the Parquet file's bytes, or, when events only go to a
sink, of the Arrow IPC stream of the tables.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from replay.event_tables import EventTables, expand_runs
from replay.gathered import Gathered
from replay.load import StepLoadMeter
from replay.parquet_out import BackgroundParquet
from replay.request_table import RequestTable
from schemas.arrow import EVENTS_SCHEMA

#: What a replay hands its event tables to, besides (or instead of) a Parquet file.
TableSink = Callable[[pa.Table], None]
#: Columns with few distinct values: dictionary-encoded in Parquet (the rest are near-unique).
_DICTIONARY_COLUMNS = [
    "schema_version", "event_type", "engine_id", "instance_id", "tenant", "service_class", "model", "adapter",
    "decision", "mode", "outcome", "state", "coalesced",
]


@dataclass(frozen=True, slots=True)
class Written:
    """What a replay's outputs say once closed: the output hash and, where measured, the run's load."""

    output_sha256: str
    load: StepLoadMeter | None


class ReplayOutputs:
    """Each flush's events as a table, to ``events_path`` and/or ``sink``, and the request table to
    ``requests_path`` (None: not written); ``hash_tables``: the tables' Arrow IPC stream is hashed (the output
    hash when no Parquet file is written); ``measure_load``: the step events are summed for the run's load
    (``replay.load``)."""

    def __init__(self, run_id: str, engine_id: str, *, events_path: Path | None = None,
                 requests_path: Path | None = None, sink: TableSink | None = None,
                 hash_tables: bool = False, measure_load: bool = False) -> None:
        self.tables = EventTables(run_id, engine_id)
        self.load = StepLoadMeter() if measure_load else None
        self.events_path = events_path
        self.sink = sink
        self.hash = hashlib.sha256() if hash_tables else None
        self.requests = RequestTable(requests_path, engine_id) if requests_path is not None else None
        if events_path is not None:
            events_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = (BackgroundParquet(events_path, EVENTS_SCHEMA, use_dictionary=_DICTIONARY_COLUMNS)
                      if events_path is not None else None)

    def feed(self, g: Gathered) -> None:
        """One flush: its events' table written and handed on, its request events to the request table."""
        runs = expand_runs(g)
        table = self.tables.table(g, runs)
        steps = g.steps
        if self.load is not None and steps is not None:
            self.load.add(pa.table({"instance_id": steps.instance, "start_ns": steps.start, "end_ns": steps.end,
                                    "num_decode_seqs": steps.decode, "num_kv_blocks_used": steps.used,
                                    "num_kv_blocks_free": steps.free}))
        if self.requests is not None:
            ids = self.tables.known.ids(g.finished.idx) if g.finished is not None else None
            self.requests.add(g, runs, ids)
        self.tables.forget(g)
        if table is None:
            return
        if self.hash is not None:
            stream = pa.BufferOutputStream()
            with pa.ipc.new_stream(stream, EVENTS_SCHEMA) as ipc:
                ipc.write_table(table)
            self.hash.update(stream.getvalue())
        if self._file is not None:
            self._file.put(table)
        if self.sink is not None:
            self.sink(table)

    def close(self) -> Written:
        """Finish the files; the output hash is the Parquet file's SHA-256, or the tables' stream's."""
        if self.requests is not None:
            self.requests.close()
        if self._file is None:
            return Written(self.hash.hexdigest() if self.hash is not None else "", self.load)
        self._file.close()
        assert self.events_path is not None
        digest = hashlib.sha256()
        with self.events_path.open("rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
        return Written(digest.hexdigest(), self.load)

    def abort(self) -> None:
        """Stop after a failed replay: the request table's file is dropped, the events' left incomplete."""
        if self.requests is not None:
            self.requests.abort()
        if self._file is not None:
            self._file.abort()
