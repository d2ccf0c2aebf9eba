"""A BLIS (inference-sim) trace v2 from any servelens input: events, a workload or a trace.

``replay.blis.to_blis`` writes events as a trace v2 given their request table. This module reads
the input (events as JSONL or Parquet, as ``servelens events validate`` reads them; a workload
Parquet; a bundled trace or a trace file, whose arrival events carry its output lengths), derives
the request table (``replay.derive``), and takes the prefix block size where the input records
it (a workload's ``prefix_block_size_tokens``: Mooncake's 512).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from privacy.views import coarsen_ns
from replay.blis import BlisExport, BlisHeader, to_blis
from replay.derive import derive_requests, read_events
from replay.traces import BUNDLED_TRACES, detect_format
from replay.workload import arrival_events, load_workload
from schemas.arrow import EVENTS_SCHEMA
from schemas.validate import detect_format as events_format
from schemas.validate import read_parquet_schema
from servelens.errors import ServelensError

_INPUTS = ("events (JSONL or Parquet), a workload (Parquet), or a trace: a bundled name "
           f"({', '.join(BUNDLED_TRACES)}) or an Azure, Mooncake, BurstGPT or BLIS file")


class ExportInputError(ServelensError):
    """The input of a BLIS export is not events, a workload or a trace, or holds invalid events."""


#: The events' times (every ``*_ns`` field of the contract), which an export writes directly or through the
#: request table derived from them: a field the contract gains is rounded too.
TIME_COLUMNS = tuple(f.name for f in EVENTS_SCHEMA if f.name.endswith("_ns"))


def export_blis(source: str, shared: Path | None, *, header: BlisHeader, block_tokens: int | None = None,
                time_quantum_ns: int = 0) -> BlisExport:
    """``source`` (events file, workload Parquet, trace file or bundled trace name) as a trace v2.

    ``block_tokens`` (tokens per prefix block id) defaults to what the input records: a workload's
    ``prefix_block_size_tokens``; events do not record it (``to_blis`` then notes its default).
    ``time_quantum_ns`` > 0 rounds every time of an events input down to that quantum before anything
    is derived (``privacy.views.coarsen_ns``: a shareable trace of recorded traffic keeps its order and
    bursts but not the sub-quantum timing where prefix-cache hits show); workloads and traces are
    exported as they are.
    """
    events, recorded, is_events = export_input(source, shared)
    quantum = time_quantum_ns if is_events else 0
    if quantum:
        events = coarsened(events, quantum)
    export = to_blis(events, derive_requests(events), header=header,
                     block_tokens=block_tokens if block_tokens is not None else recorded)
    return replace(export, time_quantum_ns=quantum)


def coarsened(events: pa.Table, quantum_ns: int) -> pa.Table:
    """``events`` with each of its ``TIME_COLUMNS`` rounded down to ``quantum_ns`` (nulls stay null)."""
    for name in TIME_COLUMNS:
        if name not in events.column_names:
            continue
        column = events[name].combine_chunks()
        rounded = coarsen_ns(column.fill_null(0).to_numpy(), quantum_ns)
        mask = column.is_null().to_numpy(zero_copy_only=False)
        events = events.set_column(events.column_names.index(name), events.field(name),
                                   pa.array(rounded, type=column.type, mask=mask))
    return events


def export_input(source: str, shared: Path | None) -> tuple[pa.Table, int | None, bool]:
    """(events, the prefix block size they were recorded with if known, whether the input was events)."""
    path = Path(source)
    if source not in BUNDLED_TRACES and path.is_file() and _is_events(path):
        return read_events(path), None, True
    workload = load_workload(source, shared).table
    return arrival_events(workload, engine_id=f"trace:{source}"), _prefix_block_tokens(workload), False


def _is_events(path: Path) -> bool:
    """Events (Parquet with an event_type column, or JSONL that is not a trace) rather than a workload or a trace."""
    if events_format(path) == "parquet":
        return "event_type" in read_parquet_schema(path).names
    try:
        detect_format(path)
    except ServelensError:
        with path.open("rb") as fh:
            if fh.read(64).lstrip().startswith(b"{"):
                return True  # JSON lines: events, validated record by record
        raise ExportInputError(f"{path}: not one of the inputs a BLIS export reads", f"give {_INPUTS}") from None
    return False


def _prefix_block_tokens(workload: pa.Table) -> int | None:
    """The workload's one prefix block size (None without prefix blocks)."""
    sizes = sorted(pc.unique(pc.drop_null(workload["prefix_block_size_tokens"])).to_pylist())
    if len(sizes) > 1:
        raise ExportInputError(f"the workload mixes prefix block sizes ({', '.join(map(str, sizes))} tokens)",
                               "a BLIS trace has one block size: export each part on its own")
    return sizes[0] if sizes else None
