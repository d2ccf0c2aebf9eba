"""The fast mode's lockstep set: decoding requests advanced together by one decode clock.

While a request decodes one position per step, its progress is a function of a clock shared by
all such requests: ``computed(t) = t - offset``. The set keeps the aggregates a scheduling pass
needs, updated only when a request joins or leaves, never per step:

- the step's decode sequences (``num_seqs``) and summed context (``ctx_base + num_seqs * t``), the
  composition the cost model prices;
- the KV blocks the members need at clock t: a sequence needs a new block when its computed tokens
  reach a multiple of the block size, i.e. at clocks congruent to its offset modulo the block size,
  so a histogram by that phase gives the blocks of any run of steps in O(block size);
- the clock at which the first member produces its last token (a heap, lazily cleaned).

Members' ``num_computed``, ``num_output`` and ``num_tokens`` freeze at their values when they joined;
``leave`` writes the live values back. A ``Snapshot`` of the members is what their deliveries and
step events record, rebuilt only after the membership changed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from replay.emit import Snapshot
from replay.request import Request
from replay.views import blocks_for


class Lockstep:
    """Decoding requests advanced together by one decode clock."""

    __slots__ = (
        "ticks", "ahead", "block_size", "members", "num_seqs", "ctx_base", "hist", "heap", "snapshot", "_take_snapshot"
    )

    def __init__(self, block_size: int, take_snapshot: Callable[[tuple[Request, ...], int], Snapshot] = Snapshot) -> None:
        self.ticks = 0  # decode positions every member has gained since the clock started
        self.ahead = 0  # positions whose KV blocks are allocated but not yet computed (inside a flight)
        self.block_size = block_size
        self.members: dict[Request, None] = {}  # insertion-ordered set
        self.num_seqs = 0  # decode sequences (a request with n branches counts n)
        self.ctx_base = 0  # summed context at the step of clock t is ctx_base + num_seqs * t
        self.hist = [0] * block_size  # sequences that need a new block at clock t, by t mod block_size
        self.heap: list[tuple[int, int, Request]] = []  # (clock of a member's last token, index, member)
        self.snapshot: Snapshot | None = None  # of the current members, once taken (``current_snapshot``)
        self._take_snapshot = take_snapshot  # (members, num_seqs) -> Snapshot: the writer's, which logs them

    def join(self, r: Request, num_tokens_left: int, unit_blocks: int) -> None:
        """``r`` decodes from now on in lockstep; it produces ``num_tokens_left`` more positions."""
        t = self.ticks
        offset = t - r.num_computed
        n = r.num_branches
        r.lock = self
        r.g0 = t
        r.lock_offset = offset
        r.lock_output = r.num_output - t
        r.unit_blocks = unit_blocks
        self.num_seqs += n
        self.ctx_base += n * (1 - offset)  # each sequence attends to its computed tokens + 1
        self.hist[offset % self.block_size] += n
        r.g_finish = t + num_tokens_left
        heapq.heappush(self.heap, (r.g_finish, r.index, r))
        self.members[r] = None
        self.snapshot = None

    def leave(self, r: Request) -> None:
        """``r`` leaves: its progress and its blocks (including those allocated ahead) become explicit."""
        gained = self.ticks - r.g0
        r.num_computed += gained
        r.num_output += gained
        r.num_tokens += gained
        n = r.num_branches
        self.num_seqs -= n
        self.ctx_base -= n * (1 - r.lock_offset)
        self.hist[r.lock_offset % self.block_size] -= n
        r.num_blocks = blocks_for(r, r.num_computed + self.ahead, self.block_size)
        r.num_anon_blocks = r.num_blocks - r.unit_blocks
        r.lock = None
        del self.members[r]
        self.snapshot = None

    def first_finish(self) -> int:
        """The clock at which the first member produces its last token (members must exist)."""
        heap = self.heap
        top = heap[0]
        while top[2].lock is not self or top[2].g_finish != top[0]:
            heapq.heappop(heap)  # a member that left (or left and joined again)
            top = heap[0]
        return top[0]

    def pop_finished(self) -> list[Request]:
        """Members whose last token is produced by the current clock, in (clock, index) order; they leave."""
        heap = self.heap
        done: list[Request] = []
        while heap and heap[0][0] <= self.ticks:
            r = heapq.heappop(heap)[2]
            if r.lock is self and r.g_finish <= self.ticks:
                self.leave(r)
                done.append(r)
        return done

    def blocks_needed(self, t0: int, num_steps: int) -> int:
        """Blocks the members allocate over the steps at clocks t0 .. t0 + num_steps - 1."""
        bs, hist = self.block_size, self.hist
        full, part = divmod(num_steps, bs)
        total = full * self.num_seqs  # every sequence crosses one block boundary per block_size steps
        if part:  # the phases t0 .. t0 + part - 1 (mod block_size), wrapping around at most once
            start = t0 % bs
            end = start + part
            total += sum(hist[start:end]) if end <= bs else sum(hist[start:]) + sum(hist[: end - bs])
        return total

    def current_snapshot(self) -> Snapshot:
        if self.snapshot is None:
            self.snapshot = self._take_snapshot(tuple(self.members), self.num_seqs)
        return self.snapshot
