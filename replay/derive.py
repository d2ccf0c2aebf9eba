"""Derived tables: one row per request from any stream of lifecycle events, real or replayed.

The derivation is one DuckDB query, columnar end to end (no Python loop per event). Each timestamp
of the guide's section 2 comes from an order-independent aggregate over the events of one type,
ties broken by ``(ts_ns, event_id)``. Duplicated events (the same ``event_id``, from producer
retries) cannot change a min, max or arg-max; counts use distinct event ids, and the token sums and
inter-token gaps read de-duplicated deliveries. So the table is the same whatever order and
duplication the events arrive in, and durations, computed from integer nanoseconds, are
bit-identical across runs and thread counts. A ``request_preempted`` with mode ``migrate`` (a move
to another instance with the KV: a disaggregated hand-off, a migration) counts in ``num_migrations``,
not in ``num_preemptions``. A request that arrived (or finished) more than once, as distinct events, takes
every field of its arrival (or finish) from the first, by ``(ts_ns, event_id)``; ``count_repeated_arrivals``
counts such requests. Metric definitions: ``docs/metrics.md``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb
import pyarrow as pa

from schemas.arrow import EVENTS_SCHEMA, arrow_schema
from schemas.records import RequestRow
from schemas.types import MAX_COUNT
from servelens.errors import ConfigError, ServelensError
from servelens.sql import parquet_relation, sql_literal

EventSource = pa.Table | str | Path | Sequence[str | Path]

_REQUESTS_SQL = """
WITH req AS (  -- every request-scoped event; min/max/arg_* are idempotent, so no de-duplication needed
    SELECT
        request_id,
        arg_min(engine_id, (ts_ns, event_id)) AS engine_id,
        arg_max(instance_id, (ts_ns, event_id)) FILTER (WHERE instance_id IS NOT NULL) AS instance_id,
        max(tenant) AS any_tenant, max(service_class) AS any_service_class, max(model) AS any_model,
        max(adapter) AS any_adapter, max(pool) AS any_pool
    FROM {source}
    WHERE request_id IS NOT NULL
    GROUP BY request_id
),
others AS (  -- the events that are not deliveries (deliveries are counted once each in tok): few
    SELECT request_id, count(DISTINCT event_id) AS num_other_events
    FROM {source}
    WHERE request_id IS NOT NULL AND event_type NOT IN ('first_token', 'tokens_delivered')
    GROUP BY request_id
),
arr AS (  -- a request arrives once: of conflicting arrivals the first (by ts_ns, then event_id) counts, every field
          -- from that one event (its nulls too: never one arrival's time with another's prompt)
    SELECT request_id, a.ts_ns AS arrival_ns, a.* EXCLUDE (ts_ns)
    FROM (
        SELECT request_id, arg_min(struct_pack(ts_ns, tenant, service_class, model, adapter, pool, session_id,
                                               num_prompt_tokens, num_cached_prefix_tokens, max_output_tokens,
                                               num_branches, client_sent_ns), (ts_ns, event_id)) AS a
        FROM {source} WHERE event_type = 'request_arrived' GROUP BY request_id
    )
),
adm AS (
    SELECT
        request_id, min(ts_ns) AS admission_ns, arg_max(decision, (ts_ns, event_id)) AS admission_decision,
        count(DISTINCT event_id) AS num_admission_decisions
    FROM {source} WHERE event_type = 'admission_decided' GROUP BY request_id
),
fin AS (
    SELECT
        -- a request finishes once; of conflicting finishes the first counts, each field from it (else a later's)
        request_id, min(ts_ns) AS finish_ns, arg_min(outcome, (ts_ns, event_id)) AS outcome,
        arg_min(num_output_tokens, (ts_ns, event_id)) AS finished_output_tokens,
        arg_min(last_byte_ns, (ts_ns, event_id)) AS last_byte_ns,
        arg_min(num_cached_prefix_tokens, (ts_ns, event_id)) AS finished_cached_tokens
    FROM {source} WHERE event_type = 'request_finished' GROUP BY request_id
),
can AS (
    SELECT request_id, min(ts_ns) AS cancel_ns
    FROM {source} WHERE event_type = 'request_cancelled' GROUP BY request_id
),
pre AS (  -- a migrate event is a move with the KV, not a preemption: counted apart
    SELECT
        request_id,
        count(*) FILTER (WHERE mode IS DISTINCT FROM 'migrate') AS num_preemptions,
        count(*) FILTER (WHERE mode = 'migrate') AS num_migrations,
        sum(num_lost_tokens) AS num_lost_tokens
    FROM (SELECT DISTINCT ON (event_id) request_id, mode, num_lost_tokens
          FROM {source} WHERE event_type = 'request_preempted')
    GROUP BY request_id
),
sched AS (
    SELECT rid AS request_id, min(start_ns) AS scheduled_ns
    FROM (SELECT unnest(request_ids) AS rid, start_ns FROM {source} WHERE event_type = 'step_executed')
    GROUP BY rid
),
ordered AS (  -- deliveries in order; a repeated delivery (the same event_id) sits right after its first copy
    SELECT request_id, is_first, ts_ns, first_byte_ns, num_tokens, coalesced,
           event_id IS NOT DISTINCT FROM lag(event_id) OVER w AS repeated,
           ts_ns - lag(ts_ns) OVER w AS gap_ns  -- a copy has its original's ts_ns: the gap after it is the same
    FROM (SELECT *, event_type = 'first_token' AS is_first
          FROM {source} WHERE event_type IN ('first_token', 'tokens_delivered'))
    WINDOW w AS (PARTITION BY request_id ORDER BY ts_ns, NOT is_first, event_id)  -- first_token first on a tie
),
deliveries AS (  -- sums and gaps need each delivery once
    SELECT * FROM ordered WHERE NOT repeated
),
gaps AS (  -- a delivery of k tokens after a gap g: k per-token gaps of g / k
    SELECT request_id, gap_ns, gap_ns::DOUBLE / coalesce(num_tokens, 1) AS token_gap_ns, coalesce(num_tokens, 1) AS weight
    FROM deliveries
    WHERE gap_ns IS NOT NULL
),
ranked AS (  -- cumulative weight, for nearest-rank percentiles of the per-token gaps
    SELECT request_id, gap_ns, token_gap_ns, weight,
           sum(weight) OVER (PARTITION BY request_id ORDER BY token_gap_ns RANGE UNBOUNDED PRECEDING) AS below,
           sum(weight) OVER (PARTITION BY request_id) AS total
    FROM gaps
),
tok AS (
    SELECT
        request_id,
        min(ts_ns) FILTER (WHERE is_first) AS first_token_ns,
        min(first_byte_ns) FILTER (WHERE is_first) AS first_byte_ns,
        max(ts_ns) AS last_token_ns,
        count(*) FILTER (WHERE is_first) + coalesce(sum(num_tokens) FILTER (WHERE NOT is_first), 0) AS delivered_tokens,
        coalesce(bool_or(coalesced), false) AS itl_from_chunks,
        count(*) AS num_deliveries
    FROM deliveries GROUP BY request_id
),
itl AS (
    SELECT
        request_id,
        max(total) AS num_itl_gaps,
        sum(gap_ns)::DOUBLE / max(total) / 1e9 AS itl_mean_s,  -- the gaps' sum in integer ns: exact, any order
        min(token_gap_ns) FILTER (WHERE 2 * below >= total) / 1e9 AS itl_p50_s,  -- integer ranks: exact
        min(token_gap_ns) FILTER (WHERE 100 * below >= 99 * total) / 1e9 AS itl_p99_s,
        max(token_gap_ns) / 1e9 AS itl_max_s
    FROM ranked GROUP BY request_id
)
SELECT
    request_id, engine_id, instance_id,
    coalesce(arr.tenant, any_tenant) AS tenant,
    coalesce(arr.service_class, any_service_class) AS service_class,
    coalesce(arr.model, any_model) AS model,
    coalesce(arr.adapter, any_adapter) AS adapter,
    coalesce(arr.pool, any_pool) AS pool,
    session_id,
    arrival_ns, admission_ns, scheduled_ns, first_token_ns, first_byte_ns, last_token_ns, cancel_ns,
    finish_ns, outcome, admission_decision, coalesce(num_admission_decisions, 0) AS num_admission_decisions,
    num_prompt_tokens,
    coalesce(finished_cached_tokens, num_cached_prefix_tokens) AS num_cached_prefix_tokens,  -- the engine's hit first
    max_output_tokens, num_branches,
    CASE WHEN finished_output_tokens IS NOT NULL THEN finished_output_tokens
         WHEN delivered_tokens > 0 THEN delivered_tokens END AS num_output_tokens,
    coalesce(num_preemptions, 0) AS num_preemptions, coalesce(num_migrations, 0) AS num_migrations,
    coalesce(num_lost_tokens, 0) AS num_lost_tokens,
    -- a duration whose end precedes its start (clocks that disagree, a broken emitter) is not one: null
    CASE WHEN scheduled_ns >= arrival_ns THEN (scheduled_ns - arrival_ns) / 1e9 END AS queue_s,
    CASE WHEN first_token_ns >= arrival_ns THEN (first_token_ns - arrival_ns) / 1e9 END AS ttft_s,
    CASE WHEN num_output_tokens > 1
         THEN (last_token_ns - first_token_ns) / 1e9 / (num_output_tokens - 1) END AS tpot_s,
    CASE WHEN last_token_ns >= arrival_ns THEN (last_token_ns - arrival_ns) / 1e9 END AS e2e_s,
    client_sent_ns, last_byte_ns,
    CASE WHEN first_byte_ns >= client_sent_ns THEN (first_byte_ns - client_sent_ns) / 1e9 END AS ttft_client_s,
    CASE WHEN last_byte_ns >= client_sent_ns THEN (last_byte_ns - client_sent_ns) / 1e9 END AS e2e_client_s,
    coalesce(num_itl_gaps, 0) AS num_itl_gaps, itl_mean_s, itl_p50_s, itl_p99_s, itl_max_s,
    coalesce(itl_from_chunks, false) AS itl_from_chunks, coalesce(num_other_events, 0) + coalesce(num_deliveries, 0) AS num_events
FROM req
LEFT JOIN others USING (request_id)
LEFT JOIN arr USING (request_id)
LEFT JOIN adm USING (request_id)
LEFT JOIN fin USING (request_id)
LEFT JOIN can USING (request_id)
LEFT JOIN pre USING (request_id)
LEFT JOIN sched USING (request_id)
LEFT JOIN tok USING (request_id)
LEFT JOIN itl USING (request_id)
"""

REQUESTS_SCHEMA = arrow_schema(RequestRow)


#: The least ``lake.duckdb_memory_limit`` taken: below it DuckDB cannot even start a derivation (it needs a few MB
#: per thread before it can spill), so a smaller value is a typo ("600KB" for "600MB"), not a budget.
MIN_MEMORY_LIMIT = "16MB"
_MIN_MEMORY_BYTES = 16 * 1000**2
_MEMORY_UNITS = {"b": 1, "byte": 1, "bytes": 1}  # DuckDB's units (its parser's spellings), lower case
for _power, (_short, _long) in enumerate((("k", "kilo"), ("m", "mega"), ("g", "giga"), ("t", "tera")), 1):
    _MEMORY_UNITS.update(dict.fromkeys((_short, _short + "b", _long + "byte", _long + "bytes"), 1000**_power))
    _MEMORY_UNITS[_short + "ib"] = 1024**_power
_MEMORY_SIZE = re.compile(r"(-?[0-9.e+-]*)\s*([a-z]*)")
_MEMORY_HINT = ("e.g. 2GB or 600MB ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT), or "
                "leave it unset for DuckDB's default")


def _memory_bytes(text: str) -> float | None:
    """The size ``text`` names in bytes, where it is a number and a unit DuckDB takes (None: left to DuckDB to judge)."""
    match = _MEMORY_SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _MEMORY_UNITS:
        return None
    try:
        return float(match.group(1)) * _MEMORY_UNITS[match.group(2)]
    except ValueError:
        return None


def connect(memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection for derivations; ``memory_limit`` (e.g. "1GB") makes it spill. A negative
    limit (DuckDB would take it as none) or one below ``MIN_MEMORY_LIMIT`` is a ``ConfigError``."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False})  # never downloads an extension
    con.execute("SET enable_progress_bar = false")
    if memory_limit:
        size = _memory_bytes(memory_limit)
        if memory_limit.strip().startswith("-") or (size is not None and size < 0):
            raise ConfigError(f"lake.duckdb_memory_limit {memory_limit!r} is negative: DuckDB would take it as no "
                              "limit at all", _MEMORY_HINT)
        if size is not None and size < _MIN_MEMORY_BYTES:
            raise ConfigError(f"lake.duckdb_memory_limit {memory_limit!r} is below {MIN_MEMORY_LIMIT}: DuckDB cannot run "
                              "a derivation in that little memory (it needs a few MB per thread before it can spill)",
                              _MEMORY_HINT)
        try:
            con.execute(f"SET memory_limit = {sql_literal(memory_limit)}")
        except duckdb.Error as exc:
            raise ConfigError(f"lake.duckdb_memory_limit {memory_limit!r} is not a memory size DuckDB takes ({exc})",
                              _MEMORY_HINT) from None
    return con


class DerivationError(ServelensError):
    """The events hold a value the request table cannot: a number beyond int64 after a sum or a cast."""


@contextlib.contextmanager
def _memory_named(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """DuckDB running out of memory, as a ``ConfigError`` that names the setting that caps it; a value out of range
    of its column (a conversion or arithmetic overflow), as a ``DerivationError`` naming it."""
    try:
        yield
    except (duckdb.ConversionException, duckdb.OutOfRangeException) as exc:
        raise DerivationError(f"a value of the events is out of range for the request table: "
                              f"{str(exc).splitlines()[0]}",
                              f"run `servelens events validate` on the events: counts are at most {MAX_COUNT:,} "
                              "(schemas.types.MAX_COUNT), other integers at most 2^63-1; fix or drop the events "
                              "that exceed them") from None
    except duckdb.OutOfMemoryException as exc:
        try:
            (limit,) = con.execute("SELECT current_setting('memory_limit')").fetchone() or ("?",)
        except duckdb.Error:
            limit = "?"
        raise ConfigError(f"DuckDB ran out of memory deriving the request table under lake.duckdb_memory_limit "
                          f"(now {limit}): {str(exc).splitlines()[0]}",
                          "raise it ([lake] duckdb_memory_limit, SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT), e.g. to 2GB, or "
                          "leave it unset for DuckDB's default: DuckDB spills to disk beyond the limit, but needs some "
                          "memory per thread") from None


def _source_sql(con: duckdb.DuckDBPyConnection, source: EventSource) -> str:
    """Register the events and return the SQL relation that reads them (every contract column present)."""
    if isinstance(source, pa.Table):
        con.register("events_input", source)
        return with_all_columns(con, "events_input")
    paths = [source] if isinstance(source, (str, Path)) else list(source)
    return with_all_columns(con, parquet_relation(paths))


def with_all_columns(con: duckdb.DuckDBPyConnection, relation: str) -> str:
    """``relation`` with the event contract's columns it lacks added as typed nulls: events written under an
    older minor version of the contract (fields added since) read like current ones."""
    have = set(con.sql(f"SELECT * FROM {relation} LIMIT 0").columns)
    missing = [f for f in EVENTS_SCHEMA if f.name not in have and f.type in _DUCKDB_TYPE]
    if not missing:
        return relation
    nulls = ", ".join(f'NULL::{_DUCKDB_TYPE[f.type]} AS "{f.name}"' for f in missing)
    return f"(SELECT *, {nulls} FROM {relation})"


_DUCKDB_TYPE = {pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN"}


def typed_select(schema: pa.Schema, query: str, order_by: str) -> str:
    """Wrap ``query`` so that its columns come out with exactly ``schema``'s names and types."""
    columns = ", ".join(f'CAST("{f.name}" AS {_DUCKDB_TYPE[f.type]}) AS "{f.name}"' for f in schema)
    return f"SELECT {columns} FROM ({query}) ORDER BY {order_by}"


def requests_sql(relation: str) -> str:
    """The request-table SQL over a relation (a table, a view, or a ``read_parquet(...)`` call)."""
    query = _REQUESTS_SQL.format(source=relation)
    return typed_select(REQUESTS_SCHEMA, query, order_by="arrival_ns NULLS LAST, request_id")


def requests_query(con: duckdb.DuckDBPyConnection, source: EventSource) -> str:
    """The request-table SQL over ``source`` (an Arrow table or Parquet files/globs)."""
    return requests_sql(_source_sql(con, source))


def read_events(path: Path) -> pa.Table:
    """Every event of a JSONL or Parquet file (``EVENTS_SCHEMA``); an invalid record is a
    ``schemas.validate.InvalidEventsError`` naming the first (the CLI adds how to see them all)."""
    from schemas.validate import iter_event_tables

    tables = list(iter_event_tables(path))
    return pa.concat_tables(tables) if tables else EVENTS_SCHEMA.empty_table()


def derive_requests(source: EventSource, *, con: duckdb.DuckDBPyConnection | None = None) -> pa.Table:
    """One row per request (``schemas.records.RequestRow``) from events, as an Arrow table."""
    con = con or connect()
    with _memory_named(con):
        table = con.sql(requests_query(con, source)).to_arrow_table()
    return table.cast(REQUESTS_SCHEMA)


#: The request-table rows with a duration left null because its end precedes its start.
BACKWARDS_SQL = ("scheduled_ns < arrival_ns OR first_token_ns < arrival_ns OR last_token_ns < arrival_ns "
                 "OR first_byte_ns < client_sent_ns OR last_byte_ns < client_sent_ns")


def count_backwards(con: duckdb.DuckDBPyConnection, requests: str | Path) -> int:
    """How many requests of a request-table file have a timestamp before the one it is measured from."""
    with _memory_named(con):
        (count,) = con.execute(f"SELECT count(*) FROM {parquet_relation([requests])} WHERE {BACKWARDS_SQL}").fetchone()
    return int(count)


#: The requests with more than one ``request_arrived`` (distinct event ids): their row takes the first arrival whole.
REPEATED_ARRIVALS_SQL = ("SELECT request_id FROM {source} WHERE event_type = 'request_arrived' GROUP BY request_id "
                         "HAVING count(DISTINCT event_id) > 1")


def count_repeated_arrivals(con: duckdb.DuckDBPyConnection, source: EventSource) -> int:
    """How many requests of ``source`` (events, as ``derive_requests`` takes them) arrived more than once, as
    distinct events: the request table takes every field of such a request's arrival from its first (by ``ts_ns``,
    then ``event_id``), and the others are ignored (a retry, the same ``event_id``, is one arrival)."""
    with _memory_named(con):
        query = REPEATED_ARRIVALS_SQL.format(source=_source_sql(con, source))
        (count,) = con.execute(f"SELECT count(*) FROM ({query})").fetchone() or (0,)
    return int(count)


def write_requests(
    source: EventSource, out: str | Path, *, con: duckdb.DuckDBPyConnection | None = None
) -> int:
    """Derive the request table straight into a zstd Parquet file (streaming); return its row count. DuckDB
    running out of memory is a ``ConfigError`` naming ``lake.duckdb_memory_limit``."""
    con = con or connect()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _memory_named(con):
        query = requests_query(con, source)
        (count,) = con.execute(f"COPY ({query}) TO {sql_literal(str(out))} (FORMAT parquet, COMPRESSION zstd)").fetchone()
    return count
