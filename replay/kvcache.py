"""The KV cache block pool of one instance: free blocks in LRU order, cached prefix units, checked counts.

Blocks are counted, not named: a request holds some anonymous blocks (its private KV) and some
*cached units*, each a run of consecutive full blocks of a prompt prefix identified by a key. A unit
held by no request stays cached but is free: it can be reused by a request with the same prefix
(a prefix-cache hit) until an allocation evicts it.

The free queue mirrors vLLM v1's ``FreeKVCacheBlockQueue``: freed blocks join the tail, allocation
takes from the head (least recently freed first), evicting cached units it reaches. Entries are
either a count of anonymous blocks or a unit key; a unit taken back by a hit leaves a stale entry
that is skipped later (lazy deletion), so every operation is O(1) amortized.

What a unit is (see docs/replay.md): the Mooncake trace names one hash id per 512-token block, so one
unit covers the 32 engine blocks (of 16 tokens) inside that trace block (fewer for a prompt's last,
partial block: only its full engine blocks); a unit is evicted as a whole. A request preempted by
recompute also leaves its remaining full blocks as one private unit, so that, as in vLLM, its
recomputation can hit its own blocks if they were not evicted meanwhile.

A CPU tier (vLLM's native KV offloading) keeps evicted units in host memory, least recently used
first out, up to ``cpu_blocks``: a later lookup that misses on the device can find them there
(``offloaded_blocks``); the engine then copies them back instead of recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any


class BlockPool:
    """Counts of used and free KV blocks, the LRU free queue and the cached units."""

    __slots__ = ("num_total", "num_free", "_queue", "_units", "_stamp", "num_evictions", "cpu_blocks", "_cpu",
                 "_cpu_used")

    def __init__(self, num_total: int, cpu_blocks: int = 0) -> None:
        if num_total <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_total = num_total
        self.num_free = num_total
        self._queue: deque[Any] = deque([num_total])  # ints: anonymous runs; tuples: (key, stamp)
        self._units: dict[Hashable, list[int]] = {}  # key -> [num_blocks, num_holders, stamp]
        self._stamp = 0
        self.num_evictions = 0
        self.cpu_blocks = cpu_blocks  # capacity of the CPU tier (0: none)
        self._cpu: OrderedDict[Hashable, int] = OrderedDict()  # evicted units kept in host memory, LRU first
        self._cpu_used = 0

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    # -------------------------------------------------------------------- anonymous blocks

    def allocate(self, num_blocks: int) -> None:
        """Take ``num_blocks`` free blocks (the caller checked they exist), evicting LRU units as needed."""
        if num_blocks > self.num_free:
            raise AssertionError(f"allocating {num_blocks} blocks with {self.num_free} free")
        self.num_free -= num_blocks
        queue, units = self._queue, self._units
        while num_blocks > 0:
            head = queue[0]
            if head.__class__ is int:
                if head > num_blocks:
                    queue[0] = head - num_blocks
                    return
                queue.popleft()
                num_blocks -= head
                continue
            queue.popleft()
            key, stamp = head
            unit = units.get(key)
            if unit is None or unit[2] != stamp:
                continue  # stale: the unit was taken back by a hit (or already evicted)
            del units[key]
            self.num_evictions += 1
            size = unit[0]
            if self.cpu_blocks:
                self._offload(key, size)
            if size > num_blocks:
                queue.appendleft(size - num_blocks)
                return
            num_blocks -= size

    def release(self, num_blocks: int) -> None:
        """Return anonymous blocks to the tail of the free queue."""
        if num_blocks <= 0:
            return
        self.num_free += num_blocks
        queue = self._queue
        if queue and queue[-1].__class__ is int:
            queue[-1] += num_blocks
        else:
            queue.append(num_blocks)
        if self.num_free > self.num_total:
            raise AssertionError(f"{self.num_free} free blocks in a pool of {self.num_total}")

    def unallocate(self, num_blocks: int) -> None:
        """Give back the last ``num_blocks`` an allocation took, to the head of the free queue, as if never taken
        (a cut decode run's later steps: exact when that allocation evicted no cached unit)."""
        if num_blocks <= 0:
            return
        self.num_free += num_blocks
        queue = self._queue
        if queue and queue[0].__class__ is int:
            queue[0] += num_blocks
        else:
            queue.appendleft(num_blocks)
        if self.num_free > self.num_total:
            raise AssertionError(f"{self.num_free} free blocks in a pool of {self.num_total}")

    def free_before_eviction(self, limit: int) -> int:
        """Free blocks an allocation can take before it must evict a cached unit (counted up to ``limit``)."""
        total = 0
        units = self._units
        for entry in self._queue:
            if entry.__class__ is int:
                total += entry
            else:
                unit = units.get(entry[0])
                if unit is not None and unit[2] == entry[1]:
                    return total
            if total >= limit:
                return total
        return total

    # -------------------------------------------------------------------- the CPU tier

    def _offload(self, key: Hashable, size: int) -> None:
        """An evicted unit goes to the CPU tier (the least recently used there leave to make room)."""
        if size > self.cpu_blocks:
            return
        cpu = self._cpu
        if key in cpu:
            self._cpu_used -= cpu.pop(key)
        cpu[key] = size
        self._cpu_used += size
        while self._cpu_used > self.cpu_blocks:
            self._cpu_used -= cpu.popitem(last=False)[1]

    def offloaded_blocks(self, key: Hashable) -> int:
        """Blocks of unit ``key`` in the CPU tier, or 0 (a query: the tier's order is by eviction time)."""
        return self._cpu.get(key, 0)

    # -------------------------------------------------------------------- cached units

    def cached_blocks(self, key: Hashable) -> int:
        """Blocks of the cached unit ``key``, or 0 when it is not cached."""
        unit = self._units.get(key)
        return unit[0] if unit is not None else 0

    def is_free_unit(self, key: Hashable) -> bool:
        """The unit is cached and held by nobody (taking it back makes its blocks used again)."""
        unit = self._units.get(key)
        return unit is not None and unit[1] == 0

    def hold(self, key: Hashable) -> int:
        """A request takes a reference to the cached unit ``key``; returns its blocks."""
        unit = self._units[key]
        if unit[1] == 0:
            self.num_free -= unit[0]
            unit[2] = -1  # its queue entry is now stale
        unit[1] += 1
        return unit[0]

    def unhold(self, key: Hashable) -> None:
        """A request drops its reference; a unit nobody holds becomes free (and evictable) but stays cached."""
        unit = self._units[key]
        unit[1] -= 1
        if unit[1] == 0:
            self._stamp += 1
            unit[2] = self._stamp
            self._queue.append((key, self._stamp))
            self.num_free += unit[0]

    def register(self, key: Hashable, num_blocks: int) -> bool:
        """Turn ``num_blocks`` of a request's just-computed blocks into the cached unit ``key``, held by it.

        False (nothing changes) when the key is already cached: the request keeps its duplicate
        blocks private, as vLLM does for a block hash computed twice.
        """
        if key in self._units:
            return False
        self._units[key] = [num_blocks, 1, -1]
        return True

    # -------------------------------------------------------------------- checks

    def check(self, num_anonymous_held: int) -> None:
        """Assert the accounting: counts in range, free = queue contents, used = held blocks."""
        assert 0 <= self.num_free <= self.num_total, (self.num_free, self.num_total)
        in_queue = 0
        seen = set()
        for entry in self._queue:
            if entry.__class__ is int:
                assert entry > 0
                in_queue += entry
            else:
                key, stamp = entry
                unit = self._units.get(key)
                if unit is not None and unit[2] == stamp:
                    assert unit[1] == 0 and key not in seen
                    seen.add(key)
                    in_queue += unit[0]
        assert in_queue == self.num_free, (in_queue, self.num_free)
        held_units = sum(u[0] for u in self._units.values() if u[1] > 0)
        assert all(u[1] >= 0 for u in self._units.values())
        free_units = sum(u[0] for u in self._units.values() if u[1] == 0)
        assert len(seen) == sum(1 for u in self._units.values() if u[1] == 0)
        assert held_units + num_anonymous_held == self.num_used, (held_units, num_anonymous_held, self.num_used)
        assert free_units <= self.num_free
