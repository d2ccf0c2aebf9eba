"""The lockstep set's aggregates equal what its members would give one by one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from replay.emit import EventWriter
from replay.lockstep import Lockstep
from replay.request import Request
from replay.views import blocks_for

BS = 16


def _member(index: int, prompt: int, generated: int, branches: int) -> Request:
    r = Request(index, f"r{index}", 0, prompt, num_branches=branches)
    r.num_output = generated + 1
    r.num_tokens = prompt + r.num_output
    r.num_computed = r.num_tokens - 1  # decoding: the last sampled token's KV is computed next
    return r


members = st.lists(st.tuples(st.integers(1, 200), st.integers(1, 40), st.sampled_from([1, 1, 2, 3]),
                             st.integers(1, 50)), min_size=1, max_size=12)


@given(members, st.integers(0, 30), st.integers(1, 70))
def test_aggregates_match_the_members(specs, advance, num_steps):
    lock = Lockstep(BS)
    reqs = []
    for i, (prompt, generated, branches, left) in enumerate(specs):
        r = _member(i, prompt, generated, branches)
        lock.join(r, left, unit_blocks=0)
        reqs.append(r)
        lock.ticks += 1 if i % 3 == 0 else 0  # members join at different clocks
    lock.ticks += advance
    live = [r.num_computed + lock.ticks - r.g0 for r in reqs]
    # composition: sequences and summed context (computed + 1 per sequence)
    assert lock.num_seqs == sum(r.num_branches for r in reqs)
    assert lock.ctx_base + lock.num_seqs * lock.ticks == sum(r.num_branches * (c + 1) for r, c in zip(reqs, live))
    # blocks the next num_steps steps allocate, member by member
    expected = sum(blocks_for(r, c + num_steps, BS) - blocks_for(r, c, BS) for r, c in zip(reqs, live))
    assert lock.blocks_needed(lock.ticks, num_steps) == expected
    # the first to finish, and leaving restores the explicit progress
    assert lock.first_finish() == min(r.g_finish for r in reqs)
    gone = reqs[0]
    lock.leave(gone)
    assert gone.lock is None and gone.num_computed == live[0] and gone.num_output == gone.num_tokens - gone.num_prompt_tokens
    assert gone not in lock.members and lock.snapshot is None


def test_finished_members_leave_in_clock_then_index_order():
    writer = EventWriter(lambda gathered: None)
    lock = Lockstep(BS, writer.snapshot)
    a, b, c = (_member(i, 32, 1, 1) for i in range(3))
    lock.join(b, 2, 0)
    lock.join(a, 2, 0)
    lock.join(c, 5, 0)
    lock.ticks += 2
    assert lock.pop_finished() == [a, b]  # same clock: by index
    assert list(lock.members) == [c] and lock.current_snapshot().requests == (c,)
    members = writer.gather().members  # the snapshot's row of the member log: its index and output offset
    assert members.idx.tolist() == [c.index] and members.offsets.tolist() == [c.num_output - c.g0]
