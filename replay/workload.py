"""Workload tables: burst statistics, arrivals as events, sources for the replay, load transforms.

A workload (``schemas.records.WorkloadRequest``) is what arrived and how much work it asked for. The
statistics here (rate, token percentiles, inter-arrival CV, peak-to-mean per window) describe the
burst structure that every load transform must keep. The replay reads a workload as a ``Workload``
source (a table, or copies of one generated on the fly); the transforms (rate scaling,
superposition of shifted copies, tiling, block bootstrap of time windows, trimming) change the
load without ever reordering arrivals within what they copy. Workloads come from a trace
converter (``replay.traces``) or from ingested telemetry (``workload_from_requests``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.errors import ReplayError
from replay.traces import WORKLOAD_SCHEMA, check_workload_size, first_below
from schemas.arrow import EVENTS_SCHEMA
from schemas.events import SCHEMA_VERSION
from schemas.validate import read_parquet_table

#: The longest span of a workload or a load shape (a --shift across the superposed copies, a --block-bootstrap
#: window), seconds: about 31 years, so that its arrival times in nanoseconds still fit a 64-bit integer with
#: the workload's own span added.
MAX_SPAN_S = 1e9


@dataclass(frozen=True, slots=True)
class Burstiness:
    """How bursty a stream of arrivals is."""

    interarrival_cv: float  # std / mean of the gaps between consecutive arrivals (population std)
    peak_to_mean_1s: float  # busiest 1 s window's arrivals / mean arrivals per 1 s window
    peak_to_mean_10s: float  # likewise for 10 s windows


def peak_to_mean(arrival_ns: np.ndarray, window_s: float) -> float:
    """Arrivals in the busiest window over the mean per window, windows tiling the span."""
    if len(arrival_ns) == 0:
        return float("nan")
    window_ns = int(window_s * 1e9)
    offsets = arrival_ns - arrival_ns.min()
    counts = np.bincount(offsets // window_ns)
    return float(counts.max() / counts.mean())


def sliding_peak_to_mean(arrival_ns: np.ndarray, window_s: float) -> float:
    """The most arrivals in any window of that length (at any position) over the mean per window.

    Unlike ``peak_to_mean``, it does not depend on where a fixed grid of windows happens to fall:
    shifting the Azure trace's 1 s grid by a fraction of a second moves ``peak_to_mean`` by up to 12%.
    """
    arrivals = np.sort(np.asarray(arrival_ns, dtype=np.int64))
    if len(arrivals) < 2 or arrivals[-1] == arrivals[0]:
        return float("nan")
    window_ns = int(window_s * 1e9)
    counts = np.searchsorted(arrivals, arrivals + window_ns, side="left") - np.arange(len(arrivals))
    mean = len(arrivals) * window_ns / float(arrivals[-1] - arrivals[0])
    return float(counts.max() / mean)


def burstiness(arrival_ns: np.ndarray) -> Burstiness:
    """Burst statistics of arrival times (ns, any order: they are sorted first)."""
    arrivals = np.sort(np.asarray(arrival_ns, dtype=np.int64))
    gaps = np.diff(arrivals).astype(np.float64)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else float("nan")
    return Burstiness(cv, peak_to_mean(arrivals, 1.0), peak_to_mean(arrivals, 10.0))


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """A one-screen description of a workload."""

    num_requests: int
    num_failed: int
    span_s: float
    mean_rate_per_s: float
    prompt_tokens_p50: float
    prompt_tokens_p99: float
    output_tokens_p50: float
    output_tokens_p99: float
    burst: Burstiness


def workload_stats(workload: pa.Table) -> WorkloadStats:
    """Counts, rate, token percentiles and burstiness of a workload table."""
    arrivals = workload["arrival_ns"].to_numpy()
    n = len(arrivals)
    span_s = float(arrivals.max() - arrivals.min()) / 1e9 if n else 0.0
    prompt = workload["num_prompt_tokens"].to_numpy()
    output = workload["num_output_tokens"].to_numpy()
    return WorkloadStats(
        num_requests=n,
        num_failed=int(pc.sum(workload["failed"]).as_py() or 0),
        span_s=span_s,
        mean_rate_per_s=n / span_s if span_s > 0 else float("nan"),
        prompt_tokens_p50=float(np.percentile(prompt, 50)),
        prompt_tokens_p99=float(np.percentile(prompt, 99)),
        output_tokens_p50=float(np.percentile(output, 50)),
        output_tokens_p99=float(np.percentile(output, 99)),
        burst=burstiness(arrivals),
    )


def arrival_events(workload: pa.Table, engine_id: str) -> pa.Table:
    """One ``request_arrived`` event per workload request, columnar (``EVENTS_SCHEMA``).

    A trace records arrivals and token counts, not what the engine did, so arrivals are the only
    events a trace yields on its own; a replay adds the rest. The recorded output length goes in
    ``max_output_tokens`` (the length the request generates when replayed, as BLIS traces record
    it), so the events keep it.
    """
    n = workload.num_rows
    ids = workload["request_id"]
    columns = {
        "event_id": pc.binary_join_element_wise(ids, pa.scalar(":arrived"), ""),
        "schema_version": pa.array([SCHEMA_VERSION] * n, pa.string()),
        "event_type": pa.array(["request_arrived"] * n, pa.string()),
        "ts_ns": workload["arrival_ns"],
        "engine_id": pa.array([engine_id] * n, pa.string()),
        "request_id": ids,
        "num_prompt_tokens": workload["num_prompt_tokens"],
        "max_output_tokens": workload["num_output_tokens"],
        "num_branches": workload["num_branches"],
        "prefix_block_ids": workload["prefix_block_ids"],
    }
    for name in ("tenant", "service_class", "model", "adapter", "session_id"):
        columns[name] = workload[name]
    arrays = [
        columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in EVENTS_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=EVENTS_SCHEMA)


# ---------------------------------------------------------------------------------------------- sources


class Workload:
    """A workload the replay reads in arrival order, a record batch at a time (``WORKLOAD_SCHEMA``).

    ``fingerprint`` identifies its content (the manifest's workload hash) without materializing it
    when the workload is generated (``TiledWorkload``), so memory stays independent of its length.
    """

    name: str
    num_requests: int | None
    #: what the manifest records beside the name (e.g. ``load_factor``, ``transforms``); empty: nothing
    meta: dict = {}

    def batches(self) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError


def table_sha256(table: pa.Table) -> str:
    """SHA-256 of a table's Arrow IPC stream (deterministic for equal tables and schemas)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


class TableWorkload(Workload):
    """A workload held as one table (a trace, a transformed trace, ingested telemetry)."""

    def __init__(self, table: pa.Table, name: str = "workload", batch_rows: int = 65_536) -> None:
        self.table = _checked(table, name)
        self.name = name
        self.num_requests = table.num_rows
        self._batch_rows = batch_rows
        self._fingerprint: str | None = None

    def batches(self) -> Iterator[pa.RecordBatch]:
        return iter(self.table.to_batches(max_chunksize=self._batch_rows))

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = table_sha256(self.table)
        return self._fingerprint


class TiledWorkload(Workload):
    """``num_copies`` time-shifted copies of a table laid back to back, generated batch by batch.

    Copy ``i`` is the base shifted by ``i * period_ns`` (the base's span plus one mean gap, rounded
    up to a 10 s grid: the load per instance is the base's and the trace just gets longer); request
    ids get ``#i``.
    """

    def __init__(self, base: pa.Table, num_copies: int, *, num_requests: int | None = None, name: str | None = None) -> None:
        self.base = _checked(base, name or "the workload")
        self.num_copies = num_copies
        self.num_requests = num_requests if num_requests is not None else base.num_rows * num_copies
        if self.num_requests > base.num_rows * num_copies:
            raise ReplayError(f"{num_copies} copies of {base.num_rows} requests hold fewer than {self.num_requests}")
        self.period_ns = tile_period_ns(base)
        self.name = name or f"tiled({num_copies})"

    def batches(self) -> Iterator[pa.RecordBatch]:
        left = self.num_requests
        for i in range(self.num_copies):
            if left <= 0:
                return
            copy = _shifted_copy(self.base, i * self.period_ns, f"#{i}")
            if copy.num_rows > left:
                copy = copy.slice(0, left)
            left -= copy.num_rows
            yield from copy.to_batches(max_chunksize=65_536)

    def batches_as_tables(self) -> list[pa.Table]:
        return [pa.Table.from_batches([b]) for b in self.batches()]

    def fingerprint(self) -> str:
        spec = f"tiled:{table_sha256(self.base)}:{self.num_copies}:{self.num_requests}:{self.period_ns}"
        return hashlib.sha256(spec.encode()).hexdigest()


def as_workload(workload: pa.Table | Workload, name: str = "workload") -> Workload:
    return workload if isinstance(workload, Workload) else TableWorkload(workload, name)


#: The longest label a workload may carry (request id, session, tenant, service class, model, adapter),
#: characters. Real ids and names are tens of characters; the replay copies a request's labels into each of its
#: events, per-tenant and per-class state and the request table, so megabyte labels multiply into gigabytes (200
#: requests with a 1,000,000-character tenant ended in a failed 5.9 GB allocation).
MAX_LABEL_CHARS = 256
_LABELS = ("request_id", "session_id", "tenant", "service_class", "model", "adapter")
#: Least value of each counted column (token counts 0: BurstGPT records empty prompts and outputs, replayed as one
#: token; see docs/replay.md).
_LEAST = (("arrival_ns", 0), ("num_prompt_tokens", 0), ("num_output_tokens", 0), ("num_branches", 1),
          ("prefix_block_size_tokens", 1), ("cancel_after_ns", 0))


def _checked(table: pa.Table, source: str = "the workload") -> pa.Table:
    """The table as a workload (``WORKLOAD_SCHEMA``), or a ``ReplayError`` naming ``source``, the column and the
    first bad row: missing columns, no rows, empty or fractional cells, overlong labels, rows out of arrival
    order, values below their least, a span beyond ``MAX_SPAN_S``, duplicate ids."""
    missing = [f.name for f in WORKLOAD_SCHEMA if f.name not in table.column_names]
    if missing:
        raise ReplayError(f"{source}: not a workload table: missing column(s) {', '.join(missing)}")
    if table.num_rows == 0:
        raise ReplayError(f"{source} holds no requests", "give a workload with at least one row")
    table = pa.Table.from_arrays([_column(table[f.name], f, source) for f in WORKLOAD_SCHEMA], schema=WORKLOAD_SCHEMA)
    _check_labels(table, source)
    arrivals = table["arrival_ns"].to_numpy()
    if len(arrivals) > 1 and (np.diff(arrivals) < 0).any():
        row = int(np.argmax(np.diff(arrivals) < 0)) + 1
        raise ReplayError(
            f"{source} is not in arrival order (row {row} arrives before row {row - 1})",
            "sort it by arrival_ns once; the replay never reorders arrivals itself",
        )
    for column, least in _LEAST:
        found = first_below(table, column, least)
        if found is not None:
            row, low = found
            raise ReplayError(f"{source}: the workload's {column} must be at least {least}: row {row} has {low}",
                              "fix the rows (a trace's converter wrote them wrong), or drop them")
    _check_span(arrivals, source)
    if pc.count_distinct(table["request_id"]).as_py() < table.num_rows:
        seen = pc.value_counts(table["request_id"])
        twice = seen.filter(pc.greater(seen.field("counts"), 1))[0]["values"].as_py()
        raise ReplayError(f"{source}: the workload's request ids are not unique: {twice!r} is there more than once",
                          "give every request its own id (the replay's events and request table are keyed by it)")
    return table


def _column(values: pa.ChunkedArray, field: pa.Field, source: str) -> pa.ChunkedArray:
    """One column cast to its workload type; an empty cell where a request needs a value, a fraction or NaN where
    a count or time is, or a type that does not convert is an error naming the column and the first such row."""
    if not field.nullable and values.null_count:
        row = pc.index(pc.is_null(values), True).as_py()
        raise ReplayError(f"{source}: column {field.name} is empty on row {row} ({values.null_count:,} rows in all)",
                          f"every request needs a {field.name}: fill in the rows or drop them")
    if pa.types.is_integer(field.type) and pa.types.is_floating(values.type):
        whole = pc.and_(pc.is_finite(values), pc.equal(pc.floor(values), values))
        bad = pc.and_(pc.is_valid(values), pc.invert(whole))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise ReplayError(f"{source}: column {field.name} holds {values[row].as_py()} on row {row}, not a whole number",
                              f"write {field.name} as integers (counts and nanoseconds), with no NaN or fraction")
    try:
        return pc.cast(values, field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise ReplayError(f"{source}: column {field.name} is {values.type}, which does not convert to {field.type}: {exc}",
                          f"write {field.name} as {field.type}") from None


def _check_labels(table: pa.Table, source: str) -> None:
    for name in _LABELS:
        lengths = pc.utf8_length(table[name])
        over = pc.greater(lengths, MAX_LABEL_CHARS)
        if pc.any(over).as_py():
            row = pc.index(over, True).as_py()
            raise ReplayError(f"{source}: column {name} on row {row} is {lengths[row].as_py():,} characters long, more "
                              f"than the {MAX_LABEL_CHARS} a label may have",
                              f"shorten the {name} values (an id or a name, not a payload), or drop the rows")


def _check_span(arrivals: np.ndarray, source: str) -> None:
    """Refuse arrivals spanning more than ``MAX_SPAN_S`` (about 31 years: a clock gone wrong, not a trace)."""
    span_ns = int(arrivals.max()) - int(arrivals.min())
    if span_ns > MAX_SPAN_S * 1e9:
        raise ReplayError(f"{source}: arrivals span {span_ns / 1e9:,.0f} s (rows {int(arrivals.argmin())} to "
                          f"{int(arrivals.argmax())}), more than the {MAX_SPAN_S:g} s a workload may span",
                          "check the workload's first and last arrival (a clock gone wrong spans years), or drop them")


# ---------------------------------------------------------------------------------------------- load transforms
#
# Each keeps the order of arrivals within what it copies (never a shuffle) and returns a workload
# table; request ids stay unique by suffixing the copy or window they come from.


def scale_rate(workload: pa.Table, factor: float | Fraction) -> pa.Table:
    """Rate x ``factor``: every gap between arrivals divided by ``factor`` (exactly, in rationals)."""
    f = Fraction(factor).limit_denominator(10**6)
    if f <= 0:
        raise ReplayError(f"rate factor must be positive, not {factor}")
    arrivals = workload["arrival_ns"].to_numpy().astype(object)
    if len(arrivals) == 0:
        return workload
    t0 = int(arrivals[0])
    scaled = [t0 + (int(a) - t0) * f.denominator // f.numerator for a in arrivals]
    index = workload.schema.get_field_index("arrival_ns")
    return workload.set_column(index, workload.schema.field(index), pa.array(scaled, pa.int64()))


#: The hint when superposed copies or bootstrapped windows would make too large a workload.
_TOO_MANY = "use fewer copies or windows; --requests N tiles the workload as a stream, without this bound"
#: The most windows a block bootstrap draws from or draws (10M: 115 days of 1 s windows; its arrays and its
#: loop over the draws are that long).
MAX_BOOTSTRAP_WINDOWS = 10_000_000


def superpose(workload: pa.Table, num_copies: int, shift_ns: int) -> pa.Table:
    """``num_copies`` copies, copy i shifted by ``i * shift_ns``, merged by arrival (ties: copy order)."""
    check_workload_size(num_copies * workload.num_rows, f"{num_copies:,} superposed copies make about", _TOO_MANY)
    copies = [_shifted_copy(workload, i * shift_ns, f"#{i}") for i in range(num_copies)]
    merged = pa.concat_tables(copies)
    copy_index = np.repeat(np.arange(num_copies), workload.num_rows)
    row_index = np.tile(np.arange(workload.num_rows), num_copies)
    order = np.lexsort((row_index, copy_index, merged["arrival_ns"].to_numpy()))
    return merged.take(pa.array(order))


def tile(workload: pa.Table, num_copies: int) -> pa.Table:
    """Copies laid back to back (see ``TiledWorkload``, the streaming form), as one table."""
    return pa.concat_tables(TiledWorkload(workload, num_copies).batches_as_tables())


#: Tiled copies start on this grid, so per-1 s and per-10 s window counts repeat exactly in each copy.
TILE_GRID_NS = 10 * 10**9


def tile_period_ns(workload: pa.Table) -> int:
    """The shift between tiled copies: the span plus one mean inter-arrival gap, rounded up to 10 s."""
    arrivals = workload["arrival_ns"].to_numpy()
    if len(arrivals) < 2:
        return TILE_GRID_NS
    span = int(arrivals[-1] - arrivals[0])
    period = span + max(1, span // (len(arrivals) - 1))
    return -(-period // TILE_GRID_NS) * TILE_GRID_NS


def block_bootstrap(workload: pa.Table, window_ns: int, num_windows: int, seed: int) -> pa.Table:
    """A trace of ``num_windows`` windows, each a copy of a window of the original drawn with replacement.

    Windows tile the original from its first arrival; only whole windows are drawn (a partial last
    window would leave a silent gap). Output window j holds the arrivals of the drawn window at the
    same offsets, so bursts shorter than a window keep their shape exactly; ids get ``#b<j>``.
    """
    arrivals = workload["arrival_ns"].to_numpy()
    t0 = int(arrivals[0])
    num_source = int((arrivals[-1] - t0) // window_ns)
    if num_source < 1:
        raise ReplayError(f"the workload spans less than one {window_ns / 1e9:g} s window")
    if max(num_source, num_windows) > MAX_BOOTSTRAP_WINDOWS:
        raise ReplayError(f"{max(num_source, num_windows):,} windows of {window_ns / 1e9:g} s to draw from or to draw: at "
                          f"most {MAX_BOOTSTRAP_WINDOWS:,}", "a longer window, fewer windows, or check the workload's "
                          "first and last arrival (a clock gone wrong spans years)")
    check_workload_size(num_windows * len(arrivals) // num_source, f"{num_windows:,} bootstrapped windows make about",
                        _TOO_MANY)
    window_of = (arrivals - t0) // window_ns
    draws = np.random.default_rng(seed).integers(0, num_source, size=num_windows)
    starts = np.searchsorted(window_of, np.arange(num_source + 1))
    parts = [_shifted_copy(workload.slice(int(starts[w]), int(starts[w + 1] - starts[w])), (j - int(w)) * window_ns,
                           f"#b{j}")
             for j, w in enumerate(draws) if starts[w + 1] > starts[w]]  # an empty window adds nothing but time
    return pa.concat_tables(parts) if parts else workload.slice(0, 0)


def trim(workload: pa.Table, start_ns: int, end_ns: int) -> pa.Table:
    """The requests arriving in [start_ns, end_ns)."""
    a = workload["arrival_ns"]
    return workload.filter(pc.and_(pc.greater_equal(a, start_ns), pc.less(a, end_ns)))


def _shifted_copy(table: pa.Table, shift_ns: int, suffix: str) -> pa.Table:
    schema = table.schema
    arrivals = pc.add(table["arrival_ns"], pa.scalar(shift_ns, pa.int64()))
    ids = pc.binary_join_element_wise(table["request_id"], suffix, "")
    table = table.set_column(schema.get_field_index("arrival_ns"), "arrival_ns", arrivals)
    return table.set_column(schema.get_field_index("request_id"), "request_id", ids).cast(schema)


# ---------------------------------------------------------------------------------------------- builders


def poisson_workload(
    rate_per_s: float,
    num_requests: int,
    seed: int,
    *,
    num_prompt_tokens: int = 128,
    num_output_tokens: int = 1,
    start_ns: int = 0,
) -> pa.Table:
    """Poisson arrivals (exponential gaps, seeded) with fixed lengths: for closed-form queueing checks."""
    gaps = np.random.default_rng(seed).exponential(1e9 / rate_per_s, size=num_requests)
    arrivals = start_ns + np.floor(np.cumsum(gaps)).astype(np.int64)
    n = num_requests
    width = max(6, len(str(n)))
    columns = {
        "request_id": pa.array([f"poisson-{i:0{width}d}" for i in range(n)], pa.string()),
        "arrival_ns": pa.array(arrivals, pa.int64()),
        "num_prompt_tokens": pa.array(np.full(n, num_prompt_tokens), pa.int64()),
        "num_output_tokens": pa.array(np.full(n, num_output_tokens), pa.int64()),
        "num_branches": pa.array(np.ones(n, dtype=np.int64), pa.int64()),
        "failed": pa.array(np.zeros(n, dtype=bool), pa.bool_()),
    }
    return pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA],
        schema=WORKLOAD_SCHEMA,
    )


def workload_from_requests(requests: pa.Table) -> pa.Table:
    """A workload from a request table (``replay.derive.derive_requests``: ingested telemetry).

    Keeps what the table records: arrival, prompt and output lengths (the tokens actually produced),
    session, tenant pseudonym, class, model, adapter, branches, and the cancellation offset of
    cancelled requests; a request that ended in ``error`` is marked failed. A cancelled request's
    intended length is unknown: it gets its ``max_output_tokens`` when telemetry recorded one, else
    what it produced (so a faster replay may complete it before its cancellation). Prefix block ids
    are not in the request table, so a workload from telemetry has none.
    """
    t = requests.filter(pc.is_valid(requests["arrival_ns"])).sort_by([("arrival_ns", "ascending"), ("request_id", "ascending")])
    n = t.num_rows
    cancel_after = pc.subtract(t["cancel_ns"], t["arrival_ns"])
    columns = {
        "request_id": t["request_id"],
        "arrival_ns": t["arrival_ns"],
        "num_prompt_tokens": pc.fill_null(t["num_prompt_tokens"], 0),
        "num_output_tokens": pc.fill_null(
            pc.if_else(
                pc.and_(pc.is_valid(t["cancel_ns"]), pc.is_valid(t["max_output_tokens"])),
                t["max_output_tokens"],
                t["num_output_tokens"],
            ),
            0,
        ),
        "session_id": t["session_id"],
        "tenant": t["tenant"],
        "service_class": t["service_class"],
        "model": t["model"],
        "adapter": t["adapter"],
        "num_branches": pc.fill_null(t["num_branches"], 1),
        "cancel_after_ns": cancel_after,
        "failed": pc.fill_null(pc.equal(t["outcome"], "error"), False),
    }
    return pa.Table.from_arrays(
        [pc.cast(columns[f.name], f.type) if f.name in columns else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA],
        schema=WORKLOAD_SCHEMA,
    )


#: Folder of the bundled inference-perf workload specs, relative to the shared data folder.
SPECS_DIR = Path("fidelity") / "workloads"


def load_workload(name_or_path: str, shared: Path | None, num_requests: int | None = None, seed: int = 0) -> Workload:
    """A workload from a bundled trace name, a trace file, a workload Parquet file, or an inference-perf
    config (a ``.yaml`` file, or the name of a bundled spec such as ``general``: generated with ``seed``);
    tiled (copies back to back, burst timing kept) to ``num_requests`` when given."""

    from replay.traces import BUNDLED_TRACES, read_trace

    path = Path(name_or_path)
    bundled_spec = shared / SPECS_DIR / f"{name_or_path}.yaml" if shared is not None else None
    if path.suffix in (".yaml", ".yml") or (name_or_path not in BUNDLED_TRACES and bundled_spec and bundled_spec.is_file()):
        from replay.inference_perf import inference_perf_workload, read_inference_perf

        spec_path = path if path.suffix in (".yaml", ".yml") else bundled_spec
        if not spec_path.is_file():
            raise ReplayError(f"no inference-perf config {name_or_path}", "give the path of its YAML file")
        table = inference_perf_workload(read_inference_perf(spec_path), seed)
    elif path.suffix == ".parquet" and path.is_file():
        table = read_parquet_table(path)
    else:
        table = read_trace(name_or_path, shared)
    if num_requests:
        return TiledWorkload(table, -(-num_requests // table.num_rows), num_requests=num_requests, name=name_or_path)
    return TableWorkload(table, name=name_or_path)
