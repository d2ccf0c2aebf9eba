"""A Parquet file written on a background thread, so that encoding never holds up the replay.

The replay's thread hands over tables (or items that ``prepare`` turns into one); a thread of the same
process writes each as one zstd row group. pyarrow encodes and compresses without the GIL, so the
work runs beside the simulation. The queue between them is bounded: memory stays flat, and a replay
that produces faster than the file is written waits for it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def _as_table(item: Any) -> pa.Table:
    table: pa.Table = item
    return table


class BackgroundParquet:
    """Writes tables to ``path`` (``schema``, zstd), one row group per table, on a background thread; an
    error there is raised by the next ``put`` or by ``close``."""

    def __init__(self, path: str | Path, schema: pa.Schema, *, use_dictionary: bool | list[str] = True,
                 prepare: Callable[[Any], pa.Table] = _as_table) -> None:
        self.path = Path(path)
        # a path, not a Python file object: Arrow's own file writer never needs the GIL
        self._writer = pq.ParquetWriter(str(self.path), schema, compression="zstd", use_dictionary=use_dictionary)
        self._prepare = prepare
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2)  # bounded: memory stays flat
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replay-parquet", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # after a failure, drain: a put never blocks on a full queue
            try:
                table = self._prepare(item)
                self._writer.write_table(table, row_group_size=max(1, table.num_rows))
            except BaseException as exc:  # surfaced on the next call or at close
                self._error = exc

    def put(self, item: Any) -> None:
        """Queue ``item`` (a table, or what ``prepare`` takes) to be written."""
        if self._error is not None:
            raise self._error
        self._queue.put(item)

    def close(self) -> None:
        """Write what is queued and finish the file."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._writer.close()

    def abort(self) -> None:
        """Stop the thread after a failure (the file is left incomplete)."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - best effort after the original error
            pass
