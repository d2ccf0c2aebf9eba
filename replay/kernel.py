"""A small deterministic discrete-event kernel: integer-nanosecond clock, one heap, a pinned tie-break.

Pending actions sit in a heap of ``(time_ns, priority, seq, action)``. ``seq`` is a counter, so
actions due at the same time and priority run in the order they were scheduled, and an action is
never compared with another: the order of a run depends only on the inputs, never on object ids
or hashing. The priorities below fix what happens first at one instant; ``tests/replay/test_kernel.py``
pins the order.

At one instant the replay engine handles, in this order: the end of a step (its tokens are
delivered), then cancellations, then arrivals, then the scheduling of the next step, so that a
request arriving exactly when a step ends is seen by the next step, and a token produced exactly
when its request is cancelled is still delivered.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

#: A step (or a run of identical decode steps) ended.
STEP_END = 0
#: A client cancelled a request.
CANCEL = 1
#: A cluster's control actions (scaling, migrations, failures, weight residency) run at the cancellations'
#: priority: after step ends, before arrivals.
CONTROL = CANCEL
#: A request arrived at the frontend.
ARRIVAL = 2
#: The engine picks the next step's batch (after everything else due at that instant).
SCHEDULE = 3

Action = Callable[[], None]


class Kernel:
    """The event loop: ``schedule`` actions at integer-ns times, ``run`` them in order."""

    __slots__ = ("now_ns", "_heap", "_seq", "num_actions")

    def __init__(self, start_ns: int = 0) -> None:
        self.now_ns = start_ns
        self._heap: list[tuple[int, int, int, Action]] = []
        self._seq = itertools.count()
        self.num_actions = 0

    def schedule(self, time_ns: int, priority: int, action: Action) -> None:
        """Run ``action`` at ``time_ns`` (never in the past); ties by priority, then scheduling order."""
        if time_ns < self.now_ns:
            raise ValueError(f"cannot schedule at {time_ns} ns: the clock is already at {self.now_ns} ns")
        heapq.heappush(self._heap, (time_ns, priority, next(self._seq), action))

    def next_time_ns(self) -> int | None:
        """When the earliest pending action is due, or None when nothing is pending."""
        return self._heap[0][0] if self._heap else None

    def advance(self, time_ns: int) -> None:
        """Move the clock to ``time_ns`` directly: an actor running ahead while nothing else is due.

        Allowed only when no pending action is due at or before ``time_ns`` (the order stays the one
        the heap would give).
        """
        if time_ns < self.now_ns or (self._heap and self._heap[0][0] <= time_ns):
            raise ValueError(f"cannot advance to {time_ns} ns: an action is due first")
        self.now_ns = time_ns

    def try_advance(self, time_ns: int) -> bool:
        """``advance`` to ``time_ns`` if no pending action is due at or before it; returns whether it did."""
        heap = self._heap
        if (heap and heap[0][0] <= time_ns) or time_ns < self.now_ns:
            return False
        self.now_ns = time_ns
        return True

    def step(self) -> bool:
        """Run the earliest pending action; False when nothing was pending."""
        if not self._heap:
            return False
        time_ns, _, _, action = heapq.heappop(self._heap)
        self.now_ns = time_ns
        self.num_actions += 1
        action()
        return True

    def run(self, until_ns: int | None = None) -> None:
        """Run actions until none is pending, or until the next one is due after ``until_ns``."""
        heap = self._heap
        pop = heapq.heappop
        count = 0
        while heap:
            if until_ns is not None and heap[0][0] > until_ns:
                break
            time_ns, _, _, action = pop(heap)
            self.now_ns = time_ns
            count += 1
            action()
        self.num_actions += count

    def __len__(self) -> int:
        return len(self._heap)
