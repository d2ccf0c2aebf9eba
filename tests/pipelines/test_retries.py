"""pipelines.retries: the windows of recent ids that drop producer retries."""

import hashlib

import numpy as np

from pipelines.retries import RecentIds, RetryFilter


def _pseudonym_like(i: int) -> str:
    return "ev_" + hashlib.sha256(str(i).encode()).hexdigest()[:32]  # uniform digits, as real pseudonyms


def test_recent_ids_remember_a_window_in_fixed_memory():
    recent = RecentIds(capacity=1_000)
    ids = [_pseudonym_like(i) for i in range(600)]
    assert not recent.seen(RecentIds.keys(ids)).any()
    recent.add(ids)
    assert recent.seen(RecentIds.keys(ids[:10])).all()
    assert not recent.seen(RecentIds.keys([_pseudonym_like(-1)])).any()
    for start in range(0, 100_000, 1_000):
        recent.add([_pseudonym_like(i) for i in range(start + 10_000, start + 11_000)])
        assert len(recent) <= 1_000 + 1_000  # a window of 1,000 plus the batch being remembered
    assert recent.seen(RecentIds.keys([_pseudonym_like(109_999)])).all()
    assert not recent.seen(RecentIds.keys([_pseudonym_like(10_000)])).any()  # long forgotten


def _ids(start: int, stop: int) -> list[str]:
    return [_pseudonym_like(i) for i in range(start, stop)]


def test_a_partition_read_late_keeps_its_own_window():
    """Partition 1 is read again only after 10 windows' worth of partition 0: its retry is still
    caught (the consumer's overall window alone has forgotten it), partition 0's old one is not."""
    retries = RetryFilter(window=1_000)
    retries.assign([0, 1])
    retries.add(_ids(0, 100), np.full(100, 1))  # partition 1's first records, stored
    for start in range(1_000, 11_000, 500):  # then partition 0 races ahead
        ids = _ids(start, start + 500)
        assert retries.first_sightings(ids, np.zeros(500, dtype=np.int64)).all()
        retries.add(ids, np.zeros(500, dtype=np.int64))
    assert not retries.overall.seen(RecentIds.keys(_ids(0, 1))).any()  # gone from the overall window
    late = _ids(50, 51) + _ids(20_000, 20_001)  # a retry in partition 1, and a new event
    assert retries.first_sightings(late, np.array([1, 1])).tolist() == [False, True]
    assert retries.first_sightings(_ids(1_000, 1_001), np.array([0])).tolist() == [True]  # 10,000 records ago


def test_retry_windows_hold_fixed_memory_and_follow_the_assignment():
    retries = RetryFilter(window=1_000)
    retries.assign(range(4))
    for start in range(0, 40_000, 400):
        retries.add(_ids(start, start + 400), np.arange(400) % 4)
    assert len(retries.overall) <= 2_000 and all(len(w) <= 2 * 250 for w in retries.partitions.values())
    retries.assign([2, 3])  # a rebalance took 0 and 1: their windows go, the rest may hold 500 each
    assert sorted(retries.partitions) == [2, 3] and {w.capacity for w in retries.partitions.values()} == {500}
    # a retry across partitions (a producer without keys) is still caught by the overall window
    assert retries.first_sightings(_ids(39_990, 39_991), np.array([2])).tolist() == [False]
    # duplicates inside one batch: the first copy is kept
    assert retries.first_sightings(_ids(-3, -2) * 2, np.array([2, 2])).tolist() == [True, False]
