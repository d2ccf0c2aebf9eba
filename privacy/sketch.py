"""Bounded cardinality: a Space-Saving heavy-hitters sketch with hysteresis on membership.

Each dimension (tenant, model, adapter, instance, free labels) has a budget of distinct values it may
show. ``BoundedDimension`` keeps the heaviest values by volume and folds the rest into ``other``:

- **Space-Saving** (Metwally et al., 2005) monitors at most ``capacity`` values with a count and an
  error bound each. A new value, when the sketch is full, replaces the monitored value with the
  smallest count and inherits that count as its error. Any value whose true frequency exceeds
  ``total / capacity`` is guaranteed to be monitored. Memory is fixed by ``capacity`` whatever an
  attacker sends: a million distinct tenant ids occupy the same ``capacity`` entries as ten.
- **Hysteresis.** Membership of the kept set changes only at batch boundaries, and a challenger
  displaces the weakest member only when its *guaranteed* count (count minus the Space-Saving error
  bound) exceeds the member's count by the ``margin`` (default 25%). Two values of similar volume
  therefore do not swap places on every batch, and a flood of one-off values, whose counts are
  mostly inherited error, never displaces anyone. Kept values are pinned in the sketch (never
  evicted), so their counts are exact from the moment they are kept. Under a flood of distinct
  ids the output therefore holds at most ``budget`` values plus ``other`` for the whole run.
  Counts are cumulative over the sanitizer's life (a process restart starts afresh, and each
  ingest process decides for its own partitions): a tenant that was heavy long ago keeps its slot
  until a newcomer's volume overtakes its total by the margin.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

OTHER = "other"


class SpaceSaving:
    """Weighted Space-Saving: at most ``capacity`` monitored values, each with a count and an error."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.pinned: set[str] = set()  # never evicted (the kept values of a dimension)
        self._heap: list[tuple[int, str]] = []  # (count, value) of unpinned values, lazily invalidated

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def heap_size(self) -> int:
        return len(self._heap)

    def _pop_min(self) -> tuple[int, str]:
        while True:
            count, value = heapq.heappop(self._heap)
            if self.counts.get(value) == count and value not in self.pinned:
                return count, value

    def pin(self, value: str) -> None:
        self.pinned.add(value)

    def unpin(self, value: str) -> None:
        self.pinned.discard(value)
        if value in self.counts:
            heapq.heappush(self._heap, (self.counts[value], value))

    def guaranteed(self, value: str) -> int:
        """A lower bound of the value's true count."""
        return self.counts[value] - self.errors[value]

    def update(self, value: str, weight: int = 1) -> None:
        counts = self.counts
        if value in counts:
            counts[value] += weight
        elif len(counts) < self.capacity:
            counts[value] = weight
            self.errors[value] = 0
        else:
            floor, victim = self._pop_min()
            del counts[victim], self.errors[victim]
            counts[value] = floor + weight
            self.errors[value] = floor
        if value not in self.pinned:
            heapq.heappush(self._heap, (counts[value], value))
        if len(self._heap) > 4 * self.capacity + 64:  # keep the lazy heap bounded too
            self._heap = [(c, v) for v, c in counts.items() if v not in self.pinned]
            heapq.heapify(self._heap)

    def update_many(self, weights: Mapping[str, int]) -> None:
        for value in sorted(weights):  # a fixed order keeps the sketch deterministic
            self.update(value, weights[value])


class BoundedDimension:
    """The values of one dimension, at most ``budget`` of them kept, the rest folded into ``other``."""

    def __init__(self, name: str, budget: int, *, sketch_factor: int = 8, margin: float = 0.25) -> None:
        if budget < 1:
            raise ValueError(f"the budget of dimension {name} must be >= 1")
        self.name = name
        self.budget = budget
        self.margin = margin
        self.sketch = SpaceSaving(max(budget * sketch_factor, 2 * budget))
        self.kept: set[str] = set()
        self.num_folded = 0  # values (occurrences) folded into `other` so far

    def observe(self, weights: Mapping[str, int]) -> None:
        """Count one batch's values, then revise the kept set (the only point where it changes)."""
        self.sketch.update_many(weights)
        self._rebalance()

    def _rebalance(self) -> None:
        sketch, counts = self.sketch, self.sketch.counts
        challengers = sorted((v for v in counts if v not in self.kept), key=lambda v: (-sketch.guaranteed(v), v))
        for value in challengers:
            if len(self.kept) < self.budget:
                self._keep(value)
                continue
            weakest = min(self.kept, key=lambda v: (counts[v], v))
            if sketch.guaranteed(value) > (1 + self.margin) * counts[weakest]:
                self.kept.remove(weakest)
                sketch.unpin(weakest)
                self._keep(value)
            else:
                break  # challengers are sorted: no later one can do better

    def _keep(self, value: str) -> None:
        self.kept.add(value)
        self.sketch.pin(value)

    def fold(self, value: str) -> str:
        return value if value in self.kept else OTHER

    def fold_all(self, values: Iterable[str], weights: Mapping[str, int]) -> dict[str, str]:
        """Map each value to itself or ``other``; count the folded occurrences."""
        mapping = {v: self.fold(v) for v in values}
        self.num_folded += sum(weights.get(v, 0) for v, out in mapping.items() if out == OTHER)
        return mapping
