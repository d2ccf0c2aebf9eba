"""replay.event_tables: the ids and labels of requests in flight, by index, through arrivals, finishes and the
store's compaction; the expansion of lockstep runs to one delivery per member."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay.event_tables import KnownRequests, RunRows, ranges
from replay.gathered import LABELS, Members, Runs


def _labels(idx: np.ndarray) -> dict[str, pa.Array]:
    return {name: pa.array([f"{name}-{i}" if i % 3 else None for i in idx], pa.string()) for name in LABELS}


def _add(known: KnownRequests, idx: np.ndarray) -> None:
    known.add(idx, pa.array([f"r{i}" for i in idx], pa.string()), _labels(idx))


def test_ids_and_labels_resolve_by_index_through_many_finishes_and_compactions():
    known = KnownRequests()
    live: list[int] = []
    rng = np.random.default_rng(3)
    for start in range(0, 60_000, 1_000):  # requests fed in chunk by chunk, most finishing soon after
        _add(known, np.arange(start, start + 1_000))
        live.extend(range(start, start + 1_000))
        done = np.array(sorted(rng.choice(live, size=len(live) - 150, replace=False)))
        known.drop(done)
        live = sorted(set(live) - set(done.tolist()))
        asked = np.array(live[::-1])  # any order, repeated
        asked = np.concatenate([asked, asked[:5]])
        assert known.ids(asked).to_pylist() == [f"r{i}" for i in asked]
        assert known.labels(asked)["tenant"].to_pylist() == [f"tenant-{i}" if i % 3 else None for i in asked]
    assert len(known._ids) <= 2 * len(live) + 4096  # the store holds about what is in flight, not all 60,000


def test_a_request_not_fed_in_or_already_finished_is_an_error():
    known = KnownRequests()
    _add(known, np.array([5, 6, 7]))
    with pytest.raises(AssertionError, match="never fed in"):
        known.ids(np.array([8]))
    known.drop(np.array([6, 99]))  # an index it never had is ignored
    with pytest.raises(AssertionError, match="request #6, which is not in flight"):
        known.ids(np.array([5, 6]))
    assert known.ids(np.array([7, 5])).to_pylist() == ["r7", "r5"]


def test_an_index_fed_in_again_keeps_its_latest_id_and_indices_may_come_out_of_order():
    known = KnownRequests()
    known.add(np.array([10, 3]), pa.array(["a", "b"]), _labels(np.array([10, 3])))
    known.add(np.array([3, 1]), pa.array(["c", "d"]), _labels(np.array([3, 1])))
    assert known.ids(np.array([1, 3, 10])).to_pylist() == ["d", "c", "a"]
    known.drop(np.array([3]))
    with pytest.raises(AssertionError):
        known.ids(np.array([3]))


def test_a_run_expands_to_one_delivery_per_member_of_its_snapshot():
    # member log: a snapshot of requests 4 and 9 (rows 0-1), then one of 9 alone (row 2); 9 decodes 2 branches
    members = Members(idx=np.array([4, 9, 9]), offsets=np.array([10, 3, 7]), tokens=np.array([1, 2, 2]))
    runs = Runs(snap_starts=np.array([0, 2]), snap_lengths=np.array([2, 1]), ts=np.array([100, 250]),
                num_steps=np.array([5, 1]), clock=np.array([20, 21]), coalesced=np.array([True, False]),
                instance=("i0", "i1"))
    rows = RunRows(runs, members)
    assert rows.idx.tolist() == [4, 9, 9]
    assert rows.ts.tolist() == [100, 100, 250]
    assert rows.num_tokens.tolist() == [5, 10, 2]  # steps x branches
    assert rows.upto.tolist() == [30, 46, 56]  # (offset + clock) x branches: delivered so far
    assert rows.coalesced.tolist() == [True, True, False] and rows.run_of_row.tolist() == [0, 0, 1]
    assert ranges(np.array([5, 0]), np.array([2, 3])).tolist() == [5, 6, 0, 1, 2]
