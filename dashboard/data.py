"""What the lake pages show, as small functions over DuckDB that know nothing of Streamlit.

The lake's events are never loaded whole. Once per Delta version, ``materialize_requests`` derives
the request table (``replay.derive``, the one code path for real and replayed events) with each
request's busy accelerator-seconds into one Parquet file in the dashboard's cache, sorted by
arrival; every page then aggregates that file in DuckDB and plots the aggregate (time bins chosen
so that a series has at most ``max_points`` points, quantiles for distributions).

Privacy (``docs/privacy.md``): every figure computed across tenants goes through
``privacy.views.k_anonymous``: a cell (a time bin of a class, a class, a tenant) with fewer than k
tenants or k requests is suppressed and counted. Requests without a tenant count as their own
crowd members (there is no tenant to single out). The derived file holds one row per request,
checked as it is written (``check_one_row_per_request``), so the pages count a cell's requests as
its rows (``k_anonymous(..., one_row_per_request=True)``) rather than distinct ids. Per-request
detail and per-tenant timing come only from ``TenantScope.where``: the viewer's own tenant,
resolved from server configuration.

Definitions follow ``docs/metrics.md``: a request is *good* when it completed within every
objective of its class (TTFT, its p99 inter-token gap, E2E), exactly as ``replay.metrics`` judges
it; attainment is good requests over arrivals; goodput is good requests per second of the window;
delivered service is input tokens x 1 + output tokens x 2 (VTC); each step's time is charged to its
members by the tokens each processed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.config import LakeConfig
from pipelines.tables import locked_connection, readable_dirs
from privacy.views import KAnonymousResult, TenantScope, k_anonymous
from replay.derive import requests_sql
from replay.metrics import DEFAULT_CLASS, MetricsConfig
from servelens.sql import parquet_relation, sql_literal

NS = 1_000_000_000
#: The fixed, published time grid of every lake view (seconds, aligned to the epoch): time filters
#: snap to it, series bins are whole multiples of it, and figures across tenants count only its
#: k-anonymous cells (docs/privacy.md, "Differencing").
WINDOW_GRID_S = 60
#: Bin widths a time series may use, seconds (the smallest that keeps a series under max_points).
BIN_LADDER_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
                7200, 10800, 21600, 43200, 86400)
#: Probabilities at which latency CDFs are drawn. The extremes (0 and 1) are left out: a minimum
#: or maximum is one request's value, not an aggregate.
CDF_PROBABILITIES = tuple(round(float(p), 4) for p in np.concatenate([np.linspace(0.001, 0.99, 199), [0.995, 0.999]]))
LATENCY_COLUMNS = ("ttft_s", "itl_p99_s", "e2e_s")
#: Columns the derived request file adds to ``schemas.records.RequestRow``: the request's charged
#: busy time; its position in arrival order (1, 2, ...); and its crowd member for k-anonymity
#: counting, an integer per tenant (dense rank of the pseudonym) or, without a tenant, minus its
#: position (a crowd of its own). Integers count distinct in about half the time of strings.
BUSY_COLUMN = "busy_accelerator_s"
REQUEST_SEQ = "request_seq"
CROWD_ID = "crowd_id"
#: Bumped whenever the derived file's columns, encoding or derivation change, so files of an older layout are
#: rebuilt (5: durations whose end precedes their start are null, the first of conflicting finishes counts).
DERIVED_FORMAT = 5
#: Compression of the derived request file: every page query decodes it, and Snappy decodes in
#: about a fifth less CPU time than zstd for these pages (1,000,000 requests: 133 MB against 76 MB).
DERIVED_COMPRESSION = "snappy"


# ------------------------------------------------------------------------------------------ windows


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """Arrivals from ``start_ns`` (inclusive) to ``end_ns`` (exclusive), UTC epoch ns."""

    start_ns: int
    end_ns: int

    @property
    def span_s(self) -> float:
        return max(0.0, (self.end_ns - self.start_ns) / NS)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which requests a view covers: arrivals in a window, of one class or all."""

    window: TimeWindow | None = None
    service_class: str | None = None  # None: every class


def choose_bin_s(span_s: float, max_points: int, *, num_requests: int | None = None, num_series: int = 1,
                 min_requests_per_bin: float = 0.0) -> float:
    """The narrowest bin of ``BIN_LADDER_S`` that cuts ``span_s`` into at most ``max_points`` bins
    and, given ``num_requests`` spread over ``num_series`` series, holds ``min_requests_per_bin``
    requests per series on average (so k-anonymous cells are not mostly suppressed)."""
    max_points = max(1, max_points)
    floor_s = span_s * min_requests_per_bin * max(1, num_series) / num_requests if num_requests else 0.0
    for width in BIN_LADDER_S:
        if span_s / width <= max_points and width >= floor_s:
            return float(width)
    return float(max(math.ceil(span_s / max_points / 86400), math.ceil(floor_s / 86400), 1) * 86400)


def _covered_s(bin_start_ns: np.ndarray, bin_ns: int, window: TimeWindow | None) -> np.ndarray:
    """Seconds of each bin inside the window (the first and last bins may be partial)."""
    start = bin_start_ns.astype(np.int64)
    end = start + bin_ns
    if window is not None:
        start = np.maximum(start, window.start_ns)
        end = np.minimum(end, window.end_ns)
    return np.maximum(end - start, 1) / NS


# ------------------------------------------------------------------------------------------ the lake


@dataclass(frozen=True, slots=True)
class LakeSnapshot:
    """One version of the lake's tables: the files a consistent view reads."""

    root: str
    events_version: int | None  # Delta version of the events table; None: never written
    event_files: tuple[str, ...]
    dead_letters_version: int | None
    dead_letter_files: tuple[str, ...]
    last_commit_ms: int | None  # when the events table was last committed (Delta commit time)

    @property
    def is_empty(self) -> bool:
        return not self.event_files


def lake_snapshot(root: str, lake_config: LakeConfig | None = None) -> LakeSnapshot:
    """The current versions of the lake's tables and their files (no data is read)."""
    from pipelines.lake import DEAD_LETTERS, EVENTS, Lake

    lake = Lake(root, lake_config)
    out: dict[str, tuple[int | None, tuple[str, ...], int | None]] = {}
    for name in (EVENTS, DEAD_LETTERS):
        table = lake.table(name)
        if table is None:
            out[name] = (None, (), None)
            continue
        history = table.history(1)
        stamp = history[0].get("timestamp") if history else None
        out[name] = (table.version(), tuple(sorted(table.file_uris())), int(stamp) if stamp is not None else None)
    version, files, stamp = out[EVENTS]
    dl_version, dl_files, _ = out[DEAD_LETTERS]
    return LakeSnapshot(root, version, files, dl_version, dl_files, stamp)


@dataclass(frozen=True, slots=True)
class IngestHealth:
    """The last health line an ingest process wrote (``pipelines.ingest.write_status``)."""

    consumer: str
    records_read: int
    events_written: int
    events_per_s: float
    dead_letters: int
    dead_letter_rate: float
    duplicates_dropped: int
    total_lag: int
    last_commit_ns: int | None
    reported_ns: int
    broker_reachable: bool


def ingest_health(root: str) -> tuple[IngestHealth, ...]:
    """Every ingest process's last status (``pipelines.ingest.read_statuses``); files that do not
    parse are skipped (a process writing its first line)."""
    from pipelines.ingest import read_statuses

    if "://" in root:
        return ()
    out = []
    try:
        statuses = read_statuses(root)
    except (OSError, ValueError):
        return ()
    for s in statuses:
        try:
            out.append(IngestHealth(
                consumer=str(s["consumer"]), records_read=int(s["records_read"]), events_written=int(s["events_written"]),
                events_per_s=float(s["events_per_s"]), dead_letters=int(s["dead_letters"]),
                dead_letter_rate=float(s["dead_letter_rate"]), duplicates_dropped=int(s.get("duplicates_dropped", 0)),
                total_lag=int(s.get("total_lag", 0)),
                last_commit_ns=None if s.get("last_commit_ns") is None else int(s["last_commit_ns"]),
                reported_ns=int(s.get("written_ns", 0)), broker_reachable=bool(s.get("broker_reachable", True)),
            ))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(out)


def dead_letters_by_reason(snapshot: LakeSnapshot, memory_limit: str | None = None) -> pa.Table:
    """Dead letters per reason (and event type): count and the last time one arrived. Dead letters
    hold no tenant data (``schemas.records.DeadLetter``), so no suppression is needed."""
    schema = pa.schema([("reason", pa.string()), ("event_type", pa.string()), ("num_dead_letters", pa.int64()),
                        ("last_received_ns", pa.int64())])
    if not snapshot.dead_letter_files:
        return schema.empty_table()
    con = locked_connection(readable_dirs(*snapshot.dead_letter_files), memory_limit)
    query = (f"SELECT reason, event_type, count(*) AS num_dead_letters, max(received_ns) AS last_received_ns "
             f"FROM {parquet_relation(snapshot.dead_letter_files)} GROUP BY ALL ORDER BY num_dead_letters DESC, reason")
    return con.sql(query).to_arrow_table().cast(schema)


# ------------------------------------------------------------------------------------------ derived requests


class NotOneRowPerRequest(ValueError):
    """A request relation holds a request on more than one row, or a row without a request id."""


def check_one_row_per_request(con: duckdb.DuckDBPyConnection, relation: str) -> int:
    """Raise ``NotOneRowPerRequest`` unless every row of ``relation`` is a different request:
    ``request_id`` and ``REQUEST_SEQ`` each unique and never null. This is the precondition of
    ``k_anonymous(..., one_row_per_request=True)``, which every page query over the derived request
    file relies on (it counts a cell's rows as its requests). Returns the rows."""
    num_rows, num_ids, num_seqs = con.execute(
        f"SELECT count(*), count(DISTINCT request_id), count(DISTINCT {REQUEST_SEQ}) FROM {relation}").fetchone()
    if not num_rows == num_ids == num_seqs:
        raise NotOneRowPerRequest(
            f"{num_rows} rows but {num_ids} distinct request ids and {num_seqs} distinct {REQUEST_SEQ}: "
            "the request table must hold each request on exactly one row")
    return int(num_rows)


def materialize_requests(event_files: Sequence[str | Path], out: str | Path, *, memory_limit: str | None = None) -> int:
    """Derive the request table of ``event_files`` into one Parquet file sorted by arrival.

    Columns: ``schemas.records.RequestRow`` plus ``busy_accelerator_s``, each step's duration split among its
    members by the tokens each processed (``replay.metrics.attribution``), so a tenant's cost is a sum, and
    the integer keys ``request_seq`` and ``crowd_id`` (see ``CROWD_ID``). DuckDB streams the events (and
    spills under ``memory_limit``); the file is written under a temporary name and renamed, so readers never
    see half of it, and only once ``check_one_row_per_request`` passes on it. Returns the rows.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    con = locked_connection([*readable_dirs(*event_files), out.parent], memory_limit)
    events = parquet_relation(event_files)
    order = "r.arrival_ns NULLS LAST, r.request_id"
    query = f"""
        SELECT r.*, coalesce(c.{BUSY_COLUMN}, 0.0) AS {BUSY_COLUMN},
               row_number() OVER (ORDER BY {order}) AS {REQUEST_SEQ},
               CASE WHEN r.tenant IS NULL THEN -row_number() OVER (ORDER BY {order})
                    ELSE dense_rank() OVER (ORDER BY r.tenant) END AS {CROWD_ID}
        FROM ({requests_sql(events)}) r
        LEFT JOIN (
            SELECT rid AS request_id, sum(tokens * duration_s / total_tokens) AS {BUSY_COLUMN}
            FROM (
                SELECT unnest(request_ids) AS rid, unnest(request_num_tokens) AS tokens,
                       (end_ns - start_ns) / 1e9 AS duration_s, list_sum(request_num_tokens) AS total_tokens
                FROM {events} WHERE event_type = 'step_executed'
            )
            WHERE total_tokens > 0
            GROUP BY rid
        ) c USING (request_id)
        ORDER BY {order}
    """
    try:
        rows = _write_parquet(con.sql(query).to_arrow_reader(_ROW_GROUP_ROWS), tmp)
        check_one_row_per_request(con, f"read_parquet({sql_literal(str(tmp))})")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return int(rows)


_ROW_GROUP_ROWS = 122_880


def _write_parquet(reader: pa.RecordBatchReader, path: Path) -> int:
    """Stream a query's batches into a Parquet file by pyarrow (the dashboard's DuckDB connections
    write nothing: ``pipelines.tables.lock_down``); returns the rows."""
    rows = 0
    with pq.ParquetWriter(path, reader.schema, compression=DERIVED_COMPRESSION) as writer:
        for batch in reader:
            writer.write_batch(batch, row_group_size=_ROW_GROUP_ROWS)
            rows += batch.num_rows
    return rows


def _empty_requests(out: Path) -> Path:
    from replay.derive import REQUESTS_SCHEMA

    schema = (REQUESTS_SCHEMA.append(pa.field(BUSY_COLUMN, pa.float64())).append(pa.field(REQUEST_SEQ, pa.int64()))
              .append(pa.field(CROWD_ID, pa.int64())))
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(schema.empty_table(), out)
    return out


_PREFIX = f"requests-f{DERIVED_FORMAT}-v"


def _lake_cache(root: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "lake" / hashlib.sha256(root.encode()).hexdigest()[:16]


def requests_file(snapshot: LakeSnapshot, cache_dir: str | Path) -> Path:
    """Where the derived request file of this lake version lives (it may not be built yet)."""
    version = snapshot.events_version if snapshot.events_version is not None else "none"
    return _lake_cache(snapshot.root, cache_dir) / f"{_PREFIX}{version}.parquet"


@dataclass(frozen=True, slots=True)
class BuiltRequests:
    """A derived request file that exists, and the lake version it holds."""

    path: str
    events_version: int


def newest_built(root: str, cache_dir: str | Path) -> BuiltRequests | None:
    """The newest lake version whose request file is built (served while a newer one is derived)."""
    built = []
    for path in _lake_cache(root, cache_dir).glob(f"{_PREFIX}*.parquet"):
        version = path.stem.removeprefix(_PREFIX)
        if version.isdigit():
            built.append(BuiltRequests(str(path), int(version)))
    return max(built, key=lambda b: b.events_version, default=None)


#: Derived request files kept per lake: the newest and the two before it (pages may still read them).
KEEP_VERSIONS = 3


def lake_requests_path(snapshot: LakeSnapshot, cache_dir: str | Path, memory_limit: str | None = None) -> Path:
    """The derived request file of this lake version, built now if it is not yet; afterwards all but
    the ``KEEP_VERSIONS`` newest files are removed."""
    path = requests_file(snapshot, cache_dir)
    if path.is_file():
        return path
    if snapshot.is_empty:
        return _empty_requests(path)
    materialize_requests(snapshot.event_files, path, memory_limit=memory_limit)
    versions = sorted(path.parent.glob("requests-*.parquet"), key=lambda p: p.stat().st_mtime_ns)
    for old in versions[:-KEEP_VERSIONS]:
        old.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------------------ request-file queries


def query_connection(*sources: str | Path) -> duckdb.DuckDBPyConnection:
    """A connection for the pages' aggregates, locked to the folders of ``sources`` (files or
    relations built here): no other file, no write, no extension, no network."""
    return locked_connection(readable_dirs(*sources))


def snap(window: TimeWindow | None) -> TimeWindow | None:
    """The window widened to whole cells of the fixed grid (``WINDOW_GRID_S``, aligned to the epoch)."""
    if window is None:
        return None
    grid = int(WINDOW_GRID_S * NS)
    start = (window.start_ns // grid) * grid
    return TimeWindow(start, max(-(-window.end_ns // grid) * grid, start + grid))


def _selected(requests_path: str | Path, selection: Selection, scope: TenantScope | None = None,
              k: int | None = None) -> tuple[str, list[object]]:
    """The selected requests as a SQL relation (with its parameters): arrivals in the window (snapped
    to the grid), of the class (and of ``scope``'s tenant only, when given); ``class_name`` is the
    class ('default' when none), ``crowd_member`` the tenant or, without one, the request itself
    (``CROWD_ID``, for k-anonymity counting). With ``k`` (views across tenants), only the requests of
    grid cells (``WINDOW_GRID_S`` of one class) holding at least k crowd members and k requests: so
    every figure is a sum over whole k-anonymous cells, and two views differ by whole such cells."""
    clauses, params = ["arrival_ns IS NOT NULL"], []
    if scope is not None:
        predicate, scope_params = scope.where("tenant")
        clauses.append(predicate)
        params += scope_params
    window = snap(selection.window)
    if window is not None:
        clauses += ["arrival_ns >= ?", "arrival_ns < ?"]
        params += [int(window.start_ns), int(window.end_ns)]
    if selection.service_class is not None:
        clauses.append(f"coalesce(service_class, '{DEFAULT_CLASS}') = ?")
        params.append(str(selection.service_class))
    relation = (
        f"(SELECT *, coalesce(service_class, '{DEFAULT_CLASS}') AS class_name, "
        f"{CROWD_ID} AS crowd_member "
        f"FROM read_parquet({sql_literal(str(requests_path))}) WHERE {' AND '.join(clauses)})"
    )
    if k is None or scope is not None:
        return relation, params
    grid = int(WINDOW_GRID_S * NS)
    cells = (f"(SELECT arrival_ns // {grid} AS cell, class_name AS cell_class FROM {relation} GROUP BY ALL "
             f"HAVING count(DISTINCT crowd_member) >= {int(k)} AND count(*) >= {int(k)})")
    return (f"(SELECT r.* FROM {relation} r SEMI JOIN {cells} c ON r.arrival_ns // {grid} = c.cell "
            f"AND r.class_name = c.cell_class)"), params + params


@dataclass(frozen=True, slots=True)
class RequestsOverview:
    """The extent of a request file: its arrival range and classes (no tenant figures)."""

    num_requests: int
    first_arrival_ns: int | None
    last_arrival_ns: int | None
    classes: tuple[str, ...]
    instances: tuple[str, ...]


def requests_overview(requests_path: str | Path) -> RequestsOverview:
    """Row count, arrival range, classes and instances of a derived request file."""
    con = query_connection(requests_path)
    source = f"read_parquet({sql_literal(str(requests_path))})"
    n, first, last = con.execute(f"SELECT count(*), min(arrival_ns), max(arrival_ns) FROM {source} WHERE arrival_ns IS NOT NULL").fetchone()
    classes = [r[0] for r in con.execute(f"SELECT DISTINCT coalesce(service_class, '{DEFAULT_CLASS}') FROM {source} ORDER BY 1").fetchall()]
    instances = [
        r[0] for r in con.execute(f"SELECT DISTINCT instance_id FROM {source} WHERE instance_id IS NOT NULL ORDER BY 1").fetchall()
    ]
    return RequestsOverview(int(n), first, last, tuple(classes), tuple(instances))


def arrivals_over_time(requests_path: str | Path, selection: Selection, bin_s: float, k: int) -> tuple[pa.Table, int]:
    """Arrivals and token volume per time bin and class, k-anonymous; (table, cells suppressed).

    Columns: ``bin_start_ns``, ``service_class``, ``num_requests``, ``arrivals_per_s`` (mean over
    the bin), ``peak_arrivals_per_s`` (the busiest 1 s of the bin: bursts stay visible however wide
    the bin), ``prompt_tokens_per_s``, ``output_tokens_per_s``, ``suppressed``.
    """
    bin_ns = max(1, int(round(bin_s * NS)))
    relation, params = _selected(requests_path, selection, k=k)
    # Each request carries the arrivals of its class in the busiest second of its bin (bins of whole
    # seconds: one row per bin and class to join, not one per second) or, in bins under a second,
    # in its own second; the cell's peak is their maximum either way.
    seconds_per_bin = bin_ns // NS if bin_ns % NS == 0 else 0
    if seconds_per_bin:
        peaks = (f"(SELECT class_name AS peak_class, second // {seconds_per_bin} AS peak_key, max(n) AS same_second FROM ("
                 f"SELECT class_name, arrival_ns // {NS} AS second, count(*) AS n FROM {relation} GROUP BY ALL) GROUP BY ALL)")
        key = f"arrival_ns // {bin_ns}"
    else:
        peaks = (f"(SELECT class_name AS peak_class, arrival_ns // {NS} AS peak_key, count(*) AS same_second "
                 f"FROM {relation} GROUP BY ALL)")
        key = f"arrival_ns // {NS}"
    binned = (
        f"(SELECT crowd_member, {REQUEST_SEQ}, class_name, (arrival_ns // {bin_ns}) * {bin_ns} AS bin_start_ns, "
        f"p.same_second, coalesce(num_prompt_tokens, 0) AS prompt_tokens, coalesce(num_output_tokens, 0) AS output_tokens "
        f"FROM {relation} r JOIN {peaks} p ON p.peak_class = r.class_name AND p.peak_key = r.{key})"
    )
    result = k_anonymous(query_connection(requests_path), binned, ["bin_start_ns", "class_name"], {
        "num_arrivals": "count(*)", "peak_per_second": "max(same_second)",
        "prompt_tokens": "sum(prompt_tokens)::BIGINT", "output_tokens": "sum(output_tokens)::BIGINT",
    }, k=k, tenant_column="crowd_member", request_column=REQUEST_SEQ, params=[*params, *params], one_row_per_request=True)
    t = result.table
    covered = _covered_s(t["bin_start_ns"].to_numpy(zero_copy_only=False), bin_ns, selection.window)
    table = pa.table({
        "bin_start_ns": t["bin_start_ns"],
        "service_class": t["class_name"],
        "num_requests": t["num_requests"],
        "arrivals_per_s": _per_s(t["num_arrivals"], covered),
        "peak_arrivals_per_s": _nullable(_floats(t["peak_per_second"])),
        "prompt_tokens_per_s": _per_s(t["prompt_tokens"], covered),
        "output_tokens_per_s": _per_s(t["output_tokens"], covered),
        "suppressed": t["suppressed"],
    })
    return table, result.num_suppressed


def _floats(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(column.to_pylist() if len(column) else [], dtype=np.float64)


def _nullable(values: np.ndarray) -> pa.Array:
    """Floats with NaN (a suppressed or undefined cell) as null."""
    return pa.array(values, pa.float64(), from_pandas=True)


def _per_s(column: pa.ChunkedArray, covered_s: np.ndarray) -> pa.Array:
    return _nullable(_floats(column) / covered_s if len(column) else np.zeros(0))


def count_requests(requests_path: str | Path, selection: Selection) -> int:
    """How many requests the selection holds: only for choosing a series' bin width, never shown
    (what is shown goes through ``selection_totals``)."""
    relation, params = _selected(requests_path, selection)
    (n,) = query_connection(requests_path).execute(f"SELECT count(*) FROM {relation}", params).fetchone()
    return int(n)


def selection_totals(requests_path: str | Path, selection: Selection, k: int) -> KAnonymousResult:
    """Requests, tenants, prompt and output tokens of the selection as one k-anonymous cell (of its
    k-anonymous grid cells only: two windows never differ by a smaller group)."""
    relation, params = _selected(requests_path, selection, k=k)
    return k_anonymous(query_connection(requests_path), relation, [], {
        "num_prompt_tokens": "sum(coalesce(num_prompt_tokens, 0))::BIGINT",
        "num_output_tokens": "sum(coalesce(num_output_tokens, 0))::BIGINT",
    }, k=k, tenant_column="crowd_member", request_column=REQUEST_SEQ, params=params, one_row_per_request=True)


# ------------------------------------------------------------------------------------------ service levels


@dataclass(frozen=True, slots=True)
class Objective:
    """One class's objectives as the dashboard applies them (None: no limit)."""

    service_class: str
    ttft_s: float | None
    itl_s: float | None
    e2e_s: float | None
    max_queue_s: float | None


def objectives_for(config: MetricsConfig, classes: Sequence[str] = ()) -> tuple[Objective, ...]:
    """The objectives of the configured classes, of ``classes`` and of 'default', as
    ``MetricsConfig.objectives`` resolves them (a class's own, else the 'default' class's)."""
    out = []
    for name in sorted({c.name for c in config.classes} | set(classes) | {DEFAULT_CLASS}):
        o = config.objectives(name)
        out.append(Objective(name, o.ttft_s, o.itl_s, o.e2e_s, o.max_queue_s))
    return tuple(out)


def _with_verdicts(con: duckdb.DuckDBPyConnection, relation: str, objectives: Sequence[Objective]) -> str:
    """The relation with each request's objective verdicts (``good``, ``meets_*``), as
    ``replay.metrics.load_requests`` computes them: completed, and within each set objective (a
    request with no inter-token gap passes the ITL objective)."""
    con.register("dashboard_objectives", pa.table({
        "objective_class": [o.service_class for o in objectives],
        "ttft_limit_s": pa.array([o.ttft_s for o in objectives], pa.float64()),
        "itl_limit_s": pa.array([o.itl_s for o in objectives], pa.float64()),
        "e2e_limit_s": pa.array([o.e2e_s for o in objectives], pa.float64()),
    }))
    inf = "'infinity'::DOUBLE"

    def limit(name: str) -> str:
        return f"CASE WHEN o.objective_class IS NOT NULL THEN o.{name} ELSE d.{name} END"

    return f"""(
        SELECT *, meets_ttft AND meets_itl AND meets_e2e AS good FROM (
            SELECT r.*,
                coalesce(r.outcome = 'completed' AND r.ttft_s <= coalesce({limit("ttft_limit_s")}, {inf}), false) AS meets_ttft,
                coalesce(r.outcome = 'completed'
                         AND (r.itl_p99_s IS NULL OR r.itl_p99_s <= coalesce({limit("itl_limit_s")}, {inf})), false) AS meets_itl,
                coalesce(r.outcome = 'completed' AND r.e2e_s <= coalesce({limit("e2e_limit_s")}, {inf}), false) AS meets_e2e
            FROM {relation} r
            LEFT JOIN dashboard_objectives o ON o.objective_class = r.class_name
            LEFT JOIN dashboard_objectives d ON d.objective_class = '{DEFAULT_CLASS}'
        )
    )"""


_SERVICE_AGGREGATES = {
    "num_good": "sum(good::INTEGER)::BIGINT",
    "num_meets_ttft": "sum(meets_ttft::INTEGER)::BIGINT",
    "num_meets_itl": "sum(meets_itl::INTEGER)::BIGINT",
    "num_meets_e2e": "sum(meets_e2e::INTEGER)::BIGINT",
    "num_rejected": "sum((outcome = 'rejected')::INTEGER)::BIGINT",
    "num_cancelled": "sum((outcome = 'cancelled')::INTEGER)::BIGINT",
    "num_timed_out": "sum((outcome = 'timed_out')::INTEGER)::BIGINT",
    "num_error": "sum((outcome = 'error')::INTEGER)::BIGINT",
    "good_output_tokens": "sum(CASE WHEN good THEN coalesce(num_output_tokens, 0) ELSE 0 END)::BIGINT",
}


def _shares(t: pa.Table, covered_s: np.ndarray) -> dict[str, pa.Array]:
    n = _floats(t["num_requests"])
    with np.errstate(invalid="ignore", divide="ignore"):
        def share(name: str) -> pa.Array:
            return _nullable(_floats(t[name]) / n)

        return {
            "num_requests": t["num_requests"],
            "attainment": share("num_good"),
            "attainment_ttft": share("num_meets_ttft"),
            "attainment_itl": share("num_meets_itl"),
            "attainment_e2e": share("num_meets_e2e"),
            "goodput_rps": _nullable(_floats(t["num_good"]) / covered_s),
            "goodput_tokens_per_s": _nullable(_floats(t["good_output_tokens"]) / covered_s),
            "rejected_share": share("num_rejected"),
            "cancelled_share": share("num_cancelled"),
            "timed_out_share": share("num_timed_out"),
            "error_share": share("num_error"),
            "suppressed": t["suppressed"],
        }


def _service_over_time(con: duckdb.DuckDBPyConnection, relation: str, params: list[object], selection: Selection,
                       objectives: Sequence[Objective], bin_s: float, k: int) -> tuple[pa.Table, int]:
    bin_ns = max(1, int(round(bin_s * NS)))
    judged = _with_verdicts(con, relation, objectives)
    binned = f"(SELECT *, (arrival_ns // {bin_ns}) * {bin_ns} AS bin_start_ns FROM {judged})"
    result = k_anonymous(con, binned, ["bin_start_ns", "class_name"], _SERVICE_AGGREGATES, k=k,
                         tenant_column="crowd_member", request_column=REQUEST_SEQ, params=params, one_row_per_request=True)
    t = result.table
    covered = _covered_s(t["bin_start_ns"].to_numpy(zero_copy_only=False), bin_ns, selection.window)
    columns = {"bin_start_ns": t["bin_start_ns"], "service_class": t["class_name"]} | _shares(t, covered)
    return pa.table(columns), result.num_suppressed


def service_over_time(requests_path: str | Path, selection: Selection, objectives: Sequence[Objective], bin_s: float,
                      k: int) -> tuple[pa.Table, int]:
    """Attainment, SLO goodput, rejections and cancellations per time bin (by arrival) and class,
    k-anonymous; (table, cells suppressed)."""
    relation, params = _selected(requests_path, selection, k=k)
    return _service_over_time(query_connection(requests_path), relation, params, selection, objectives, bin_s, k)


def _service_by_class(con: duckdb.DuckDBPyConnection, relation: str, params: list[object], selection: Selection,
                      objectives: Sequence[Objective], k: int) -> tuple[pa.Table, KAnonymousResult]:
    judged = _with_verdicts(con, relation, objectives)
    result = k_anonymous(con, judged, ["class_name"], _SERVICE_AGGREGATES | {
        "first_arrival_ns": "min(arrival_ns)", "last_arrival_ns": "max(arrival_ns)"}, k=k,
        tenant_column="crowd_member", request_column=REQUEST_SEQ, params=params, one_row_per_request=True)
    t = result.table
    if selection.window is not None:
        covered = np.full(t.num_rows, max(selection.window.span_s, 1e-9))
    else:
        first, last = _floats(t["first_arrival_ns"]), _floats(t["last_arrival_ns"])
        covered = np.maximum((last - first) / NS, 1e-9) if t.num_rows else np.zeros(0)
    return pa.table({"service_class": t["class_name"]} | _shares(t, covered)), result


def service_by_class(requests_path: str | Path, selection: Selection, objectives: Sequence[Objective],
                     k: int) -> tuple[pa.Table, int]:
    """Per class over the whole selection: requests, attainment (overall and per objective),
    goodput per second of the window, and every outcome beside it; k-anonymous."""
    relation, params = _selected(requests_path, selection, k=k)
    table, result = _service_by_class(query_connection(requests_path), relation, params, selection, objectives, k)
    return table, result.num_suppressed


def interpolated_quantiles(values: np.ndarray, probabilities: Sequence[float]) -> np.ndarray:
    """The quantiles of ``values`` at ``probabilities``, interpolated linearly between the two
    nearest ranks (DuckDB's ``quantile_cont``, numpy's default): a partial sort places only the
    ranks needed (``np.partition``), a few times faster than sorting every value."""
    p = np.asarray(probabilities, dtype=np.float64)
    position = p * (values.size - 1)
    lo, hi = np.floor(position).astype(np.int64), np.ceil(position).astype(np.int64)
    ranked = np.partition(values, np.unique(np.concatenate([lo, hi])))
    return ranked[lo] + (position - lo) * (ranked[hi] - ranked[lo])


_CDF_SCHEMA = pa.schema([("service_class", pa.string()), ("metric", pa.string()), ("probability", pa.float64()),
                         ("value_s", pa.float64()), ("num_points", pa.int64())])


def _latency_quantiles(con: duckdb.DuckDBPyConnection, relation: str, params: list[object],
                       classes: Sequence[str]) -> pa.Table:
    """``CDF_PROBABILITIES`` quantiles of each latency column of ``classes`` (those that passed
    k-anonymity): one scan reads the three columns of those classes, numpy places the ranks."""
    rows: dict[str, list] = {name: [] for name in _CDF_SCHEMA.names}
    names = sorted(classes)
    if names:
        marks = ", ".join("?" for _ in names)
        table = con.sql(
            f"SELECT list_position([{marks}], class_name) AS class_index, {', '.join(LATENCY_COLUMNS)} "
            f"FROM {relation} WHERE class_name IN ({marks})", params=[*names, *params, *names],
        ).to_arrow_table()
        index = table["class_index"].to_numpy()
        columns = {c: (pc.is_valid(table[c]).to_numpy(), pc.fill_null(table[c], 0.0).to_numpy()) for c in LATENCY_COLUMNS}
        for position, name in enumerate(names, start=1):
            mine = index == position
            for column, (valid, values) in columns.items():
                values = values[mine & valid]
                if not values.size:
                    continue
                n = len(CDF_PROBABILITIES)
                rows["service_class"] += [name] * n
                rows["metric"] += [column] * n
                rows["probability"] += list(CDF_PROBABILITIES)
                rows["value_s"] += interpolated_quantiles(values, CDF_PROBABILITIES).tolist()
                rows["num_points"] += [int(values.size)] * n
    return pa.table(rows, schema=_CDF_SCHEMA)


def latency_cdfs(requests_path: str | Path, selection: Selection, k: int) -> tuple[pa.Table, int]:
    """Quantiles of TTFT, each request's p99 inter-token gap and E2E per class at
    ``CDF_PROBABILITIES`` (long format: ``service_class``, ``metric``, ``probability``, ``value_s``,
    ``num_points``), k-anonymous: a class with fewer than k tenants or requests is left out and
    counted. The classes that pass ``k_anonymous`` are found first; only theirs are then read."""
    con = query_connection(requests_path)
    relation, params = _selected(requests_path, selection, k=k)
    result = k_anonymous(con, relation, ["class_name"], {}, k=k, tenant_column="crowd_member",
                         request_column=REQUEST_SEQ, params=params, one_row_per_request=True)
    shown = [row["class_name"] for row in result.table.to_pylist() if not row["suppressed"]]
    return _latency_quantiles(con, relation, params, shown), result.num_suppressed


@dataclass(frozen=True, slots=True)
class ServiceLevels:
    """Everything the Service levels page draws, from one connection (``service_levels``)."""

    by_class: pa.Table  # ``service_by_class``
    num_hidden_classes: int  # classes suppressed (in the table and the CDFs alike)
    series: pa.Table  # ``service_over_time``
    num_hidden_bins: int
    cdfs: pa.Table  # ``latency_cdfs``


def service_levels(requests_path: str | Path, selection: Selection, objectives: Sequence[Objective], bin_s: float,
                   k: int) -> ServiceLevels:
    """``service_by_class``, ``service_over_time`` and ``latency_cdfs`` of one selection with two
    k-anonymous aggregates instead of three: the CDFs are drawn for the classes the per-class cells
    show (the same rows grouped the same way, so the same classes pass)."""
    con = query_connection(requests_path)
    relation, params = _selected(requests_path, selection, k=k)
    by_class, classes = _service_by_class(con, relation, params, selection, objectives, k)
    series, num_hidden_bins = _service_over_time(con, relation, params, selection, objectives, bin_s, k)
    shown = [row["class_name"] for row in classes.table.select(["class_name", "suppressed"]).to_pylist() if not row["suppressed"]]
    cdfs = _latency_quantiles(con, relation, params, shown)
    return ServiceLevels(by_class, classes.num_suppressed, series, num_hidden_bins, cdfs)


# ------------------------------------------------------------------------------------------ tenants


def _tenant_rows(con: duckdb.DuckDBPyConnection, requests_path: str | Path, selection: Selection, config: MetricsConfig,
                 *, scope: TenantScope | None = None, verdicts: bool = True, k: int | None = None) -> tuple[str, list[object]]:
    """Per-request rows for tenant views (as ``replay.metrics.tenant_metrics`` builds them): the
    tenant ('unknown' when none), delivered service, entitlement weight, charged accelerator-seconds,
    and (``verdicts``) each request's objective verdicts; only ``scope``'s rows when given (filtered
    as the file is read)."""
    relation, params = _selected(requests_path, selection, scope, k=k)
    weights = config.weights()
    con.register("dashboard_weights", pa.table({
        "weighted_tenant": pa.array(list(weights), pa.string()),
        "tenant_weight": pa.array(list(weights.values()), pa.float64()),
    }))
    accelerators = int(config.cost.accelerators_per_instance)
    judged = _with_verdicts(con, relation, objectives_for(config)) if verdicts else relation
    rows = f"""(
        SELECT coalesce(r.tenant, 'unknown') AS tenant, r.request_id, r.{REQUEST_SEQ}, r.class_name, r.outcome, r.ttft_s, r.queue_s,
               r.e2e_s, {'r.good' if verdicts else 'NULL::BOOLEAN AS good'}, r.num_prompt_tokens,
               r.num_cached_prefix_tokens, r.num_preemptions,
               CASE WHEN coalesce(r.num_output_tokens, 0) > 0
                    THEN coalesce(r.num_prompt_tokens, 0) + 2 * r.num_output_tokens ELSE 0 END AS service,
               coalesce(w.tenant_weight, 1.0) AS weight,
               coalesce(r.{BUSY_COLUMN}, 0.0) * {accelerators} AS accelerator_seconds
        FROM {judged} r
        LEFT JOIN dashboard_weights w ON w.weighted_tenant = coalesce(r.tenant, 'unknown')
    )"""
    return rows, params


def _tenant_aggregates(config: MetricsConfig) -> dict[str, str]:
    price = config.cost.accelerator_hour_price / 3600
    return {
        "service": "sum(service)::BIGINT",
        "entitlement_weight": "max(weight)",
        "service_per_weight": "sum(service) / max(weight)",
        "accelerator_seconds": "sum(accelerator_seconds)",
        f"cost_{config.cost.currency.lower()}": f"sum(accelerator_seconds) * {price!r}",
        "rejected_share": "avg((outcome = 'rejected')::DOUBLE)",
    }


def tenant_service(requests_path: str | Path, selection: Selection, config: MetricsConfig, k: int) -> KAnonymousResult:
    """Each tenant's delivered service against its entitlement, and its cost, through
    ``k_anonymous``: no timing figure, and tenants with fewer than k requests suppressed (the
    aggregates of ``replay.metrics.tenant_metrics``, computed in DuckDB)."""
    con = query_connection(requests_path)
    rows, params = _tenant_rows(con, requests_path, selection, config, verdicts=False, k=k)
    return k_anonymous(con, rows, ["tenant"], _tenant_aggregates(config), k=k, min_tenants=1, request_column=REQUEST_SEQ,
                       params=params, one_row_per_request=True)


@dataclass(frozen=True, slots=True)
class Fairness:
    """Fairness across tenants (null when fewer than k tenants: then it would describe too few)."""

    num_tenants: int | None
    jain_index: float | None  # of delivered service / entitlement weight; 1 = exactly proportional
    suppressed: bool


def fairness(requests_path: str | Path, selection: Selection, config: MetricsConfig, k: int) -> Fairness:
    """Jain's index of delivered service over entitlement weight across the tenants the Tenants table
    shows (those with at least k requests: a suppressed tenant is in no figure beside the visible
    ones, or it could be solved for), as ``replay.metrics.jain_index``; suppressed below k of them."""
    con = query_connection(requests_path)
    rows, params = _tenant_rows(con, requests_path, selection, config, verdicts=False, k=k)
    per_tenant = (f"(SELECT tenant, sum(service) / max(weight) AS x FROM {rows} GROUP BY tenant "
                  f"HAVING count(*) >= {int(k)})")
    result = k_anonymous(con, per_tenant, [], {
        "jain_index": "CASE WHEN sum(x * x) > 0 THEN sum(x) * sum(x) / (count(*) * sum(x * x)) END",
    }, k=k, tenant_column="tenant", request_column="tenant", params=params)
    row = result.table.to_pylist()[0] if result.table.num_rows else {}
    return Fairness(row.get("num_tenants"), row.get("jain_index"), bool(row.get("suppressed", True)))


@dataclass(frozen=True, slots=True)
class TenantDetail:
    """The viewer's own tenant, in full (within ``TenantScope`` only)."""

    summary: pa.Table  # one row: requests, service, entitlement, cost, attainment, TTFT p50/p99, queue p99, ...
    by_class: pa.Table  # the same per class
    slowest: pa.Table  # the tenant's requests with the longest TTFT (ids link to the request explorer)


def tenant_detail(requests_path: str | Path, selection: Selection, config: MetricsConfig, scope: TenantScope,
                  *, num_slowest: int = 20) -> TenantDetail:
    """Everything about the viewer's tenant, every figure including timing, from its rows only:
    ``scope`` filters the file as it is read (before the objectives and weights are joined), so
    other tenants never enter these queries."""
    con = query_connection(requests_path)
    rows, params = _tenant_rows(con, requests_path, selection, config, scope=scope)
    aggregates = _tenant_aggregates(config) | {
        "attainment": "avg(good::DOUBLE)",
        "ttft_p50_s": "quantile_cont(ttft_s, 0.5)",
        "ttft_p99_s": "quantile_cont(ttft_s, 0.99)",
        "queue_p99_s": "quantile_cont(queue_s, 0.99)",
        "e2e_p99_s": "quantile_cont(e2e_s, 0.99)",
        "cached_prefix_share": "sum(coalesce(num_cached_prefix_tokens, 0)) / nullif(sum(coalesce(num_prompt_tokens, 0)), 0)",
        "preemptions_per_request": "avg(coalesce(num_preemptions, 0)::DOUBLE)",
        "cancelled_share": "avg((outcome = 'cancelled')::DOUBLE)",
    }
    summary = k_anonymous(con, rows, [], aggregates, k=1, min_tenants=1, request_column=REQUEST_SEQ, params=params,
                          one_row_per_request=True)
    by_class = k_anonymous(con, rows, ["class_name"], aggregates, k=1, min_tenants=1, request_column=REQUEST_SEQ,
                           params=params, one_row_per_request=True)
    slowest = con.sql(
        f"SELECT request_id, class_name AS service_class, outcome, ttft_s, queue_s, e2e_s, num_preemptions "
        f"FROM {rows} ORDER BY ttft_s DESC NULLS LAST, request_id LIMIT {int(num_slowest)}", params=params,
    ).to_arrow_table()
    return TenantDetail(summary.table, by_class.table, slowest)


def tenant_pseudonyms_present(requests_path: str | Path, scope: TenantScope) -> int:
    """How many of the viewer's requests the file holds (0: the tenant is absent or folded into 'other')."""
    predicate, params = scope.where("tenant")
    con = query_connection(requests_path)
    (n,) = con.execute(f"SELECT count(*) FROM read_parquet({sql_literal(str(requests_path))}) WHERE {predicate}",
                       params).fetchone()
    return int(n)


def metrics_config_token(config: MetricsConfig) -> str:
    """A short stable fingerprint of a metrics configuration (for cache keys)."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------ first run


def getting_started(settings) -> str:
    """The exact commands that fill this dashboard, with its configured paths (``settings``:
    ``dashboard.config.Settings``)."""
    d = settings.dashboard
    runs, gate = d.runs_dir.rstrip("/"), d.gate_dir.rstrip("/")
    key = settings.privacy.key_file or ".servelens/pseudonym-key.toml"
    lines = [
        "# 1. a pseudonym key: the lake stores tenant data only pseudonymized",
        *([] if settings.privacy.key_file else [f"servelens privacy keygen --out {key}",
                                                 f"export SERVELENS_PRIVACY__KEY_FILE={key}"]),
        f"# 2. events into the lake at {settings.lake.root}: a broker, engines emitting to it, the ingest consumer",
        "servelens broker        # terminal 1: a Kafka-compatible broker on the configured kafka.bootstrap_servers",
        "servelens ingest        # terminal 2: validate, sanitize and commit the event topic into the lake",
        "#    engines embed the emitter SDK: pipelines.emitter.Emitter.from_config(config.kafka).start()",
        "servelens ingest status # the lake's totals and each ingest process's health",
        f"# 3. replay runs (Policies, Request explorer) into {runs}/, then a gate report (Gate) into {gate}/",
        f"servelens replay --workload azure-conv --policy fcfs --out {runs}/fcfs",
        f"servelens replay --workload azure-conv --policy fcfs --engine llama-3-8b@a100-80g --out {runs}/fcfs-a100",
        f"servelens gate --baseline {runs}/fcfs --candidate {runs}/fcfs-a100 --out {gate}",
        "#    or every night from the lake: `make dagster` replays each policy and load into <paths.out_dir>/replay/<day>/"
        "<policy>@<load>/ and gates them into <paths.out_dir>/gate/<day>/ (the defaults of these two folders)",
        "# or all of it offline on the bundled Azure trace, then a dashboard over that demo's own data (out/demo)",
        "servelens demo",
    ]
    return "\n".join(lines)
