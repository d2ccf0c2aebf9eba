"""The KV block pool: counts stay in range, the free queue is LRU, cached units come back or get evicted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay.kvcache import BlockPool


def test_allocate_and_release_keep_counts():
    pool = BlockPool(10)
    pool.allocate(4)
    assert (pool.num_free, pool.num_used) == (6, 4)
    pool.release(3)
    assert pool.num_free == 9
    pool.check(num_anonymous_held=1)
    with pytest.raises(AssertionError, match="allocating 10 blocks with 9 free"):
        pool.allocate(10)
    pool.release(1)
    with pytest.raises(AssertionError, match="11 free blocks in a pool of 10"):
        pool.release(1)


def test_freed_units_stay_cached_until_evicted_in_lru_order():
    pool = BlockPool(10)
    pool.allocate(6)
    assert pool.register("a", 3) and pool.register("b", 3)
    assert not pool.register("a", 3)  # a second copy of a cached prefix stays private
    pool.unhold("a")  # a, then b, become free (a is the older)
    pool.unhold("b")
    assert pool.num_free == 10 and pool.cached_blocks("a") == 3 and pool.is_free_unit("a")
    pool.check(num_anonymous_held=0)
    pool.allocate(4)  # the 4 never-used blocks first
    assert pool.cached_blocks("a") == 3 and pool.num_evictions == 0
    pool.allocate(1)  # then the least recently freed unit: a goes, its 2 other blocks stay free
    assert pool.cached_blocks("a") == 0 and pool.cached_blocks("b") == 3 and pool.num_evictions == 1
    assert pool.num_free == 5
    pool.check(num_anonymous_held=5)


def test_a_hit_takes_a_unit_back_and_its_old_queue_entry_is_skipped():
    pool = BlockPool(8)
    pool.allocate(4)
    pool.register("p", 4)
    pool.unhold("p")
    assert pool.num_free == 8
    assert pool.hold("p") == 4  # a request with the same prefix reuses it
    assert pool.num_free == 4 and not pool.is_free_unit("p")
    pool.allocate(4)  # takes the anonymous blocks; the stale entry of p is skipped, p survives
    assert pool.cached_blocks("p") == 4 and pool.num_free == 0
    pool.check(num_anonymous_held=4)
    assert pool.free_before_eviction(10) == 0


def test_free_before_eviction_counts_only_blocks_ahead_of_a_unit():
    pool = BlockPool(10)
    pool.allocate(10)
    pool.release(2)
    pool.register("u", 3)
    pool.unhold("u")
    pool.release(1)
    assert pool.free_before_eviction(100) == 2  # two anonymous blocks, then the unit
    assert pool.free_before_eviction(1) >= 1


@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "register", "unhold", "hold"]),
                          st.integers(1, 6), st.sampled_from("abcd")), max_size=60))
def test_random_operations_keep_the_invariants(ops):
    pool = BlockPool(24)
    anon = 0  # anonymous blocks held by "requests"
    held: dict[str, int] = {}  # our references per unit key
    for op, n, key in ops:
        if op == "alloc" and n <= pool.num_free:
            cached_before = {k for k in "abcd" if pool.cached_blocks(k)}
            pool.allocate(n)
            anon += n
            for k in cached_before:  # an evicted unit was free (no holder)
                if not pool.cached_blocks(k):
                    assert held.get(k, 0) == 0
        elif op == "release" and n <= anon:
            pool.release(n)
            anon -= n
        elif op == "register" and n <= anon and not pool.cached_blocks(key):
            assert pool.register(key, n)
            anon -= n
            held[key] = 1
        elif op == "unhold" and held.get(key):
            pool.unhold(key)
            held[key] -= 1
        elif op == "hold" and pool.cached_blocks(key):
            pool.hold(key)
            held[key] = held.get(key, 0) + 1
        pool.check(num_anonymous_held=anon)
        assert 0 <= pool.num_free <= pool.num_total
        assert pool.num_used == anon + sum(pool.cached_blocks(k) for k, h in held.items() if h > 0)
