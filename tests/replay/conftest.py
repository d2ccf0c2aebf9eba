"""Small builders for replay tests: workload tables from columns, and a replay that returns its tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.derive import derive_requests
from replay.run import ReplaySummary, run_replay
from replay.traces import WORKLOAD_SCHEMA


def make_workload(
    arrival_ns: list[int],
    num_prompt_tokens: list[int],
    num_output_tokens: list[int],
    **columns: list,
) -> pa.Table:
    """A workload table from parallel columns (request ids r0, r1, ... unless given)."""
    n = len(arrival_ns)
    data = {
        "request_id": columns.pop("request_id", [f"r{i}" for i in range(n)]),
        "arrival_ns": arrival_ns,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "num_branches": columns.pop("num_branches", [1] * n),
        "failed": columns.pop("failed", [False] * n),
        **columns,
    }
    arrays = [pa.array(data[f.name], f.type) if f.name in data else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=WORKLOAD_SCHEMA)


@dataclass
class Replayed:
    """A finished replay with its events and request table."""

    summary: ReplaySummary
    events: pa.Table
    requests: pa.Table

    def row(self, request_id: str) -> dict:
        (row,) = [r for r in self.requests.to_pylist() if r["request_id"] == request_id]
        return row

    def of_type(self, event_type: str) -> list[dict]:
        return [e for e in self.events.to_pylist() if e["event_type"] == event_type]


def replay(workload: pa.Table, out_dir: Path, **kwargs) -> Replayed:
    """Run a replay into ``out_dir`` and read back its events and request table (the derivation's, checked
    equal to the one the replay wrote itself)."""
    summary = run_replay(workload, out_dir=out_dir, **kwargs)
    derived = derive_requests(summary.events_path)
    assert_same_requests(pq.read_table(summary.requests_path), derived)
    return Replayed(summary, pq.read_table(summary.events_path), derived)


def assert_same_requests(own: pa.Table, derived: pa.Table) -> None:
    """The replay's own request table holds exactly the derivation's rows and values, in its order."""
    assert own.schema.equals(derived.schema, check_metadata=False)
    assert own.num_rows == derived.num_rows
    for name in derived.column_names:
        mine, theirs = own[name].to_pylist(), derived[name].to_pylist()
        if mine != theirs:
            diff = [(own["request_id"][i].as_py(), a, b) for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
            raise AssertionError(f"column {name}: {len(diff)} rows differ, e.g. {diff[:3]}")


@pytest.fixture
def run(tmp_path):
    """``run(workload, **run_replay kwargs)`` -> Replayed, each call in its own folder."""
    counter = iter(range(10**6))

    def _run(workload: pa.Table, **kwargs) -> Replayed:
        return replay(workload, tmp_path / f"run{next(counter)}", **kwargs)

    return _run
