"""De-duplication of producer retries in ingest: the ids seen lately, in fixed memory.

A producer that retries a send may store an event twice in the topic, a little later and (keyed by
its request) in the same partition. ``RetryFilter`` drops the second copy when its id is among the
consumer's last ``window`` ids, or among the last ``window / assigned partitions`` ids of its own
partition: a partition read late (consumption across partitions is uneven on a loaded machine)
keeps its own window, so its retries are caught however many records of other partitions came in
between. ``RecentIds`` is one such window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def first_in_batch(keys: np.ndarray) -> np.ndarray:
    """Mask of the first occurrence of each key in ``keys``."""
    _, first = np.unique(keys, return_index=True)
    once = np.zeros(len(keys), dtype=bool)
    once[first] = True
    return once


class RecentIds:
    """The last ``capacity`` event ids seen, in fixed memory: 64-bit keys in numpy generations.

    Ids are sanitized pseudonyms (``ev_`` + hex digits of a keyed hash), so the first 64 bits of
    their digits are uniformly distributed: the chance that two of a million remembered ids share
    a key is about 3e-8. Memory is 8 bytes per remembered id; a batch is checked with one
    vectorized lookup per generation, not a Python loop.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.generation_size = max(1, capacity // 4)
        self._generations: list[np.ndarray] = []  # sorted keys, oldest first
        self._current: list[np.ndarray] = []
        self._current_size = 0

    def resize(self, capacity: int) -> None:
        """Hold ``capacity`` ids from now on (the oldest fall out at the next generation)."""
        self.capacity = capacity
        self.generation_size = max(1, capacity // 4)

    @staticmethod
    def keys(event_ids: pa.Array | pa.ChunkedArray | Sequence[str]) -> np.ndarray:
        """64-bit keys of pseudonymized event ids (``ev_`` + at least 16 hex digits), vectorized:
        the 16 digits after the prefix of every id, sliced by Arrow, parsed as one hex string."""
        ids = pa.array(event_ids, pa.string()) if not isinstance(event_ids, (pa.Array, pa.ChunkedArray)) else event_ids
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        if not len(ids):
            return np.zeros(0, dtype=np.uint64)
        digits = pc.utf8_slice_codeunits(ids, 3, 19)
        try:
            if digits.null_count or not pc.all(pc.equal(pc.utf8_length(digits), 16)).as_py():
                raise ValueError("not pseudonyms")
            text = b"".join(digits.cast(pa.binary()).to_pylist()) if digits.offset else digits.buffers()[2].to_pybytes()
            return np.frombuffer(bytes.fromhex(text[: 16 * len(ids)].decode()), dtype=">u8").astype(np.uint64)
        except ValueError:  # not pseudonyms (tests, foreign ids): hash them instead
            import hashlib

            return np.array(
                [int.from_bytes(hashlib.blake2b(e.encode(), digest_size=8).digest(), "big") for e in ids.to_pylist()],
                dtype=np.uint64,
            )

    def __len__(self) -> int:
        return sum(len(g) for g in self._generations) + self._current_size

    def seen(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the keys remembered."""
        seen = np.zeros(len(keys), dtype=bool)
        for generation in [*self._generations, *self._current]:
            if len(generation):
                pos = np.searchsorted(generation, keys)
                pos[pos == len(generation)] = 0
                seen |= generation[pos] == keys
        return seen

    def remember(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        self._current.append(np.sort(keys))
        self._current_size += len(keys)
        if self._current_size >= self.generation_size:
            self._generations.append(np.sort(np.concatenate(self._current)))
            self._current, self._current_size = [], 0
            while len(self._generations) > 1 and sum(map(len, self._generations)) > self.capacity:
                del self._generations[0]  # the oldest generation falls out of the window

    def add(self, event_ids: pa.Array | pa.ChunkedArray | Sequence[str]) -> None:
        self.remember(self.keys(event_ids))


class RetryFilter:
    """The consumer's window of recent ids plus one window per assigned partition (module docstring).

    Ids are remembered only once stored (``add``): a batch whose commit failed is read again, and
    its ids must not count as seen then.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.overall = RecentIds(window)
        self.partitions: dict[int, RecentIds] = {}

    def assign(self, partitions: Iterable[int]) -> None:
        """Keep a window for each of ``partitions`` (the consumer's whole assignment) and drop the
        rest; each holds ``window / len(partitions)`` ids, so memory stays fixed by ``window``."""
        assigned = set(partitions)
        capacity = max(1, self.window // max(1, len(assigned)))
        self.partitions = {p: self.partitions.get(p) or RecentIds(capacity) for p in sorted(assigned)}
        for recent in self.partitions.values():
            recent.resize(capacity)

    def warm(self, event_ids: pa.Array | pa.ChunkedArray | Sequence[str]) -> None:
        """Remember ids stored before this consumer started (their partition unknown)."""
        self.overall.add(event_ids)

    def add(self, event_ids: pa.Array | pa.ChunkedArray | Sequence[str], partitions: np.ndarray) -> None:
        """Remember stored ids, ``partitions[i]`` the partition of the i-th."""
        keys = RecentIds.keys(event_ids)
        self.overall.remember(keys)
        for p, sel in self._by_partition(partitions):
            self._window(p).remember(keys[sel])

    def first_sightings(self, event_ids: pa.Array | pa.ChunkedArray | Sequence[str], partitions: np.ndarray) -> np.ndarray:
        """Mask of the ids in neither window nor earlier in this batch (nothing is remembered)."""
        keys = RecentIds.keys(event_ids)
        keep = ~self.overall.seen(keys) & first_in_batch(keys)
        for p, sel in self._by_partition(partitions):
            keep[sel] &= ~self._window(p).seen(keys[sel])
        return keep

    def _window(self, partition: int) -> RecentIds:
        if partition not in self.partitions:  # read before its assignment was announced: give it one
            self.partitions[partition] = RecentIds(max(1, self.window // max(1, len(self.partitions) + 1)))
        return self.partitions[partition]

    @staticmethod
    def _by_partition(partitions: np.ndarray) -> list[tuple[int, np.ndarray]]:
        return [(int(p), partitions == p) for p in np.unique(partitions)]
