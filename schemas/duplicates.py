"""Repeated event ids: a harmless repeat, or a conflict.

``event_id`` names one event. The same event delivered again (a producer retry, Kafka's at-least-once
delivery, a file that holds a record twice) carries the same id and the same content: consumers keep one
copy (ingest's ``pipelines.retries``, the derivations' ``DISTINCT ON (event_id)``). Another event under an
id already given is a *conflict*: de-duplication would keep either of the two and lose the other,
so validation refuses the later one (``schemas.validate.DUPLICATE_EVENT_ID``).

Content is the validated event, the fields the contract stores: key order, an omitted default, an
unknown field (never stored) do not make two records differ. Two ways to find conflicts:

- ``conflicting_rows``: within one events table (an ingest batch), exact;
- ``EventIdLedger`` with ``event_hashes`` (typed events, the row validator) or ``table_hashes`` (Arrow
  tables, the columnar path): across a whole file, batch by batch, in 24 bytes per id.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from schemas.events import Event
from schemas.types import cached_by_class, field_specs

if TYPE_CHECKING:
    import pyarrow as pa

#: Arrays of one batch: 64-bit id keys, 64-bit content digests, record numbers.
Int64s = np.ndarray


def event_hashes(events: Sequence[Event]) -> tuple[Int64s, Int64s]:
    """Each event's id key and content digest (Python's 64-bit hashes: comparable within this process only)."""
    keys = np.fromiter((hash(e.event_id) for e in events), dtype=np.int64, count=len(events))
    digests = np.fromiter((hash(_content(type(e))(e)) for e in events), dtype=np.int64, count=len(events))
    return keys, digests


@cached_by_class
def _content(cls: type) -> Callable[[Event], tuple[object, ...]]:
    """The function giving an event of ``cls`` as a hashable tuple of its fields' values (lists as tuples)."""
    specs = field_specs(cls)
    values = operator.attrgetter(*(s.name for s in specs))  # a tuple: every event has the envelope's fields
    lists = [i for i, s in enumerate(specs) if s.is_list]

    def content(event: Event) -> tuple[object, ...]:
        found = values(event)
        if not lists:
            return found
        items = list(found)
        for i in lists:
            items[i] = None if items[i] is None else tuple(items[i])
        return tuple(items)

    return content


def table_hashes(table: pa.Table) -> tuple[Int64s, Int64s]:
    """Each row's id key and content digest (DuckDB's 64-bit hashes of ``event_id`` and of every column),
    for a table with the lake's columns (``EVENTS_SCHEMA``)."""
    import duckdb

    columns = ", ".join('"' + name.replace('"', '""') + '"' for name in table.column_names)
    with duckdb.connect() as con:
        con.register("batch", table)
        found = con.execute(f"SELECT hash(event_id) AS k, hash({columns}) AS d FROM batch").fetchnumpy()
    return np.asarray(found["k"], dtype=np.uint64).view(np.int64), np.asarray(found["d"], dtype=np.uint64).view(np.int64)


def conflicting_rows(table: pa.Table) -> dict[int, int]:
    """Rows whose ``event_id`` an earlier row of ``table`` holds with other content, each mapped to the first
    row with that id (exact: ids and contents compared as values; only repeated ids are read in Python)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = table["event_id"]
    if not table.num_rows or pc.count_distinct(ids).as_py() == table.num_rows:
        return {}
    codes = pc.dictionary_encode(ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids).indices
    codes_np = codes.to_numpy(zero_copy_only=False)
    repeated = np.flatnonzero(np.bincount(codes_np)[codes_np] > 1)
    first: dict[str, tuple[int, dict[str, object]]] = {}
    conflicts: dict[int, int] = {}
    for row, values in zip(repeated.tolist(), table.take(pa.array(repeated)).to_pylist()):
        earlier, content = first.setdefault(values["event_id"], (row, values))
        if content != values:
            conflicts[row] = earlier
    return conflicts


class EventIdLedger:
    """The event ids of a file seen so far, each with its first event's content digest and record number.

    Checked batch by batch (``check``) with vectorized lookups; held in sorted runs that merge as they grow
    (a few runs, whatever the file's length): 24 bytes an id, so 4 million events hold 96 MB. Keys are
    64-bit hashes: two different ids of a 4-million-event file share one with a chance of about 1 in 2
    million, and a shared content digest (a conflict taken for a repeat) is rarer still.
    """

    def __init__(self) -> None:
        self._runs: list[tuple[Int64s, Int64s, Int64s]] = []  # (sorted keys, digests, numbers), largest first

    def check(self, keys: Int64s, digests: Int64s, numbers: Int64s) -> list[tuple[int, int]]:
        """Positions of the batch whose id an earlier record (in this batch or a batch checked before) holds
        with another content digest, each with that record's number; then remember each new id's first record."""
        if not len(keys):
            return []
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        ref_digests, ref_numbers = digests[first], numbers[first]
        found = self._lookup(keys[first], ref_digests, ref_numbers)
        conflicts = np.flatnonzero(digests != ref_digests[inverse])
        new = first[~found]
        self._remember(keys[new], digests[new], numbers[new])
        return [(int(i), int(ref_numbers[inverse[i]])) for i in conflicts]

    def _lookup(self, keys: Int64s, digests: Int64s, numbers: Int64s) -> np.ndarray:
        """Mask of ``keys`` already held; for those, ``digests`` and ``numbers`` are overwritten with the held ones."""
        found = np.zeros(len(keys), dtype=bool)
        for run_keys, run_digests, run_numbers in self._runs:
            pos = np.minimum(np.searchsorted(run_keys, keys), len(run_keys) - 1)
            hit = run_keys[pos] == keys
            digests[hit], numbers[hit] = run_digests[pos[hit]], run_numbers[pos[hit]]
            found |= hit
        return found

    def _remember(self, keys: Int64s, digests: Int64s, numbers: Int64s) -> None:
        if not len(keys):
            return
        self._runs.append((keys, digests, numbers))
        while len(self._runs) > 1 and len(self._runs[-2][0]) <= len(self._runs[-1][0]):  # a binary counter's carries
            merged = [np.concatenate(parts) for parts in zip(*self._runs[-2:])]
            self._runs[-2:] = []
            self._runs.append((merged[0], merged[1], merged[2]))
        order = np.argsort(self._runs[-1][0], kind="stable")
        self._runs[-1] = (self._runs[-1][0][order], self._runs[-1][1][order], self._runs[-1][2][order])

    def __len__(self) -> int:
        return sum(len(run[0]) for run in self._runs)
