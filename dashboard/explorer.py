"""One request's life, and what an instance's batches held over time (the Request explorer).

A request's life is read from its own events (arrival, admission decisions, preemptions, first
token, deliveries, cancellation, finish) and from the engine steps whose batch held it, found by
time (from its arrival to its finish, so the lake's dt/hour partitions and Parquet statistics prune
the files) and membership. Each step is classified as a *prefill chunk* (the request processed
more than one token, or the step ended before its first token; after a preemption that is the
recompute) or *decode*. The other members of a batch are counted, never named. In a cluster a
``request_preempted`` with mode ``migrate`` is a *move* to another instance with the KV (a
disaggregated hand-off, a migration), labelled as one, not as a preemption; the ``route`` that
follows names the instance the request went to (``event_mark``).

Who may see a request (``docs/privacy.md``): on the lake, only requests of the viewer's own tenant
(``TenantScope``); in a replay run, requests whose tenant is not a lake pseudonym (public traces,
scenario tenants) or is the viewer's. A request outside that is reported exactly as one that does
not exist, so the explorer cannot be used to probe other tenants' request ids.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from dashboard.data import BIN_LADDER_S, NS, TimeWindow
from pipelines.tables import locked_connection, readable_dirs
from privacy.sanitize import FIELD_POLICIES
from privacy.views import TenantScope
from schemas.events import LIFECYCLE_RANK
from servelens.sql import parquet_relation, sql_literal

#: How long after a window's end a step that started in it may end (a coalesced run of decode steps).
STEP_MARGIN_NS = 600 * NS
#: Events of one timestamp in lifecycle order (arrival before admission, last delivery before finish).
_LIFECYCLE_ORDER = "CASE event_type " + " ".join(f"WHEN '{name}' THEN {rank}" for name, rank in LIFECYCLE_RANK.items()) + " END"
#: A tenant value that is a lake pseudonym (``tn_`` and hex digits; see privacy.sanitize).
PSEUDONYM_PATTERN = f"{FIELD_POLICIES['tenant'].kind}_[0-9a-f]+"


#: A lake file's partition in its path (``.../dt=2023-11-16/hour=18/part-....parquet``).
_PARTITION = re.compile(r"dt=(\d{4})-(\d{2})-(\d{2})/hour=(\d{1,2})/")
_HOUR_NS = 3600 * NS


def files_between(files: Sequence[str], lo_ns: int, hi_ns: int) -> tuple[str, ...]:
    """The lake files whose dt/hour partition (of the event's ``ts_ns``, UTC) can hold events from
    ``lo_ns`` to ``hi_ns``; a file whose path names no partition is always kept. Choosing files
    here, before DuckDB opens any, keeps one request's view from touching the rest of the lake."""
    lo_hour, hi_hour = lo_ns // _HOUR_NS, hi_ns // _HOUR_NS
    kept = []
    for name in files:
        match = _PARTITION.search(name)
        if match is None:
            kept.append(name)
            continue
        year, month, day, hour = (int(g) for g in match.groups())
        index = (dt.date(year, month, day) - dt.date(1970, 1, 1)).days * 24 + hour
        if lo_hour <= index <= hi_hour:
            kept.append(name)
    return tuple(kept)


def lake_events(files: Sequence[str], lo_ns: int, hi_ns: int) -> str:
    """A ``read_parquet`` relation over the lake files that can hold events from ``lo_ns`` to
    ``hi_ns`` (all files when none can: the queries then find nothing, as they should)."""
    return parquet_relation(files_between(files, lo_ns, hi_ns) or files, hive=True)


@dataclass(frozen=True, slots=True)
class Visibility:
    """Which requests of a source the viewer may open."""

    scope: TenantScope | None
    lake: bool  # True: the lake (scope only); False: a replay run (non-pseudonymous tenants too)

    def predicate(self, column: str = "tenant") -> tuple[str, list[str]]:
        """A SQL predicate (with parameters) selecting the visible requests."""
        scoped, params = self.scope.where(column) if self.scope is not None else ("FALSE", [])
        if self.lake:
            return f"({scoped})", params
        return (f"({column} IS NULL OR NOT regexp_full_match({column}, '{PSEUDONYM_PATTERN}') OR {scoped})", params)


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """The request-table row of one request (what the timeline is drawn from)."""

    request_id: str
    tenant: str | None
    service_class: str | None
    instance_id: str | None
    outcome: str | None
    admission_decision: str | None
    arrival_ns: int
    admission_ns: int | None
    scheduled_ns: int | None
    first_token_ns: int | None
    last_token_ns: int | None
    cancel_ns: int | None
    finish_ns: int | None
    num_prompt_tokens: int | None
    num_cached_prefix_tokens: int | None
    num_output_tokens: int | None
    num_preemptions: int
    num_lost_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    itl_p99_s: float | None
    itl_from_chunks: bool
    busy_accelerator_s: float | None

    @property
    def end_ns(self) -> int:
        """The last moment the request is known to exist."""
        known = [t for t in (self.finish_ns, self.last_token_ns, self.cancel_ns, self.scheduled_ns, self.admission_ns) if t]
        return max([self.arrival_ns, *known])


@dataclass(frozen=True, slots=True)
class RequestLife:
    """A request and what happened to it."""

    summary: RequestSummary
    events: pa.Table  # its own events: ts_ns, event_type, instance_id, decision, reason, mode, lease_generation,
    #                   num_lost_tokens, num_tokens, outcome
    steps: pa.Table  # the batches it was in (see ``request_life``)


def candidate_requests(requests_path: str | Path, visibility: Visibility, *, window: TimeWindow | None,
                       service_class: str | None, order: str = "ttft", limit: int = 200) -> pa.Table:
    """Visible requests worth opening, most interesting first (``order``: ttft, e2e, queue,
    preemptions, latest): request_id, arrival_ns, class, outcome, TTFT, E2E, preemptions."""
    orders = {"ttft": "ttft_s DESC NULLS LAST", "e2e": "e2e_s DESC NULLS LAST", "queue": "queue_s DESC NULLS LAST",
              "preemptions": "num_preemptions DESC, ttft_s DESC NULLS LAST", "latest": "arrival_ns DESC"}
    predicate, params = visibility.predicate()
    clauses = [predicate, "arrival_ns IS NOT NULL"]
    if window is not None:
        clauses += ["arrival_ns >= ?", "arrival_ns < ?"]
        params += [int(window.start_ns), int(window.end_ns)]
    if service_class is not None:
        clauses.append("coalesce(service_class, 'default') = ?")
        params.append(service_class)
    query = (f"SELECT request_id, arrival_ns, coalesce(service_class, 'default') AS service_class, outcome, ttft_s, e2e_s, "
             f"queue_s, num_preemptions FROM read_parquet({sql_literal(str(requests_path))}) "
             f"WHERE {' AND '.join(clauses)} ORDER BY {orders.get(order, orders['ttft'])}, request_id LIMIT {int(limit)}")
    return locked_connection(readable_dirs(requests_path)).sql(query, params=params).to_arrow_table()


def find_request(requests_path: str | Path, request_id: str, visibility: Visibility) -> RequestSummary | None:
    """The request's row, or None when it does not exist or is not visible to this viewer (the two
    are indistinguishable on purpose)."""
    predicate, params = visibility.predicate()
    fields = RequestSummary.__dataclass_fields__
    query = (f"SELECT {', '.join(fields)} FROM read_parquet({sql_literal(str(requests_path))}) "
             f"WHERE request_id = ? AND arrival_ns IS NOT NULL AND {predicate} LIMIT 1")
    rows = locked_connection(readable_dirs(requests_path)).execute(query, [request_id, *params]).fetchall()
    if not rows:
        return None
    return RequestSummary(**dict(zip(fields, rows[0])))


def _time_filter(lo_ns: int, hi_ns: int, hive: bool) -> str:
    """A filter on ts_ns (and, for the lake, on its dt/hour partitions) with literal integers."""
    clause = f"ts_ns BETWEEN {int(lo_ns)} AND {int(hi_ns)}"
    if hive:
        import datetime as dt

        lo = dt.datetime.fromtimestamp(lo_ns / NS, dt.UTC).date().isoformat()
        hi = dt.datetime.fromtimestamp(hi_ns / NS, dt.UTC).date().isoformat()
        clause += f" AND dt BETWEEN DATE '{lo}' AND DATE '{hi}'"
    return clause


def request_life(events_relation: str, summary: RequestSummary, *, hive: bool, memory_limit: str | None = None) -> RequestLife:
    """The request's own events and the batches that held it.

    ``steps`` columns: start_ns, end_ns, duration_s (of the whole event), num_steps (identical steps
    it summarizes), num_members, num_prefill_tokens, num_decode_seqs, own_tokens (this request's
    tokens per step), phase ('prefill' or 'decode'), num_kv_blocks_used.
    """
    con = locked_connection(readable_dirs(events_relation), memory_limit)
    window = _time_filter(summary.arrival_ns, summary.end_ns + 1, hive)
    events = con.sql(
        f"SELECT ts_ns, event_type, instance_id, decision, reason, mode, lease_generation, num_lost_tokens, num_tokens, "
        f"outcome "
        f"FROM {events_relation} WHERE {window} AND request_id = ? AND event_type <> 'step_executed' "
        f"ORDER BY ts_ns, {_LIFECYCLE_ORDER}, event_id", params=[summary.request_id],
    ).to_arrow_table()
    first_token = summary.first_token_ns if summary.first_token_ns is not None else 2**63 - 1
    steps = con.sql(
        f"""SELECT start_ns, end_ns, (end_ns - start_ns) / 1e9 AS duration_s, coalesce(num_steps, 1) AS num_steps,
                   len(request_ids) AS num_members, num_prefill_tokens, num_decode_seqs,
                   request_num_tokens[list_position(request_ids, ?)] AS own_tokens,
                   CASE WHEN request_num_tokens[list_position(request_ids, ?)] > 1 OR end_ns <= {int(first_token)}
                        THEN 'prefill' ELSE 'decode' END AS phase,
                   num_kv_blocks_used
            FROM {events_relation}
            WHERE {window} AND event_type = 'step_executed' AND list_contains(request_ids, ?)
            ORDER BY start_ns""",
        params=[summary.request_id] * 3,
    ).to_arrow_table()
    return RequestLife(summary, events, steps)


def is_preemption(event: dict) -> bool:
    """A ``request_preempted`` that cost the request its batch slot (recompute, swap); one with mode
    ``migrate`` is a move with the KV, not a preemption (``docs/metrics.md``)."""
    return event["event_type"] == "request_preempted" and event.get("mode") != "migrate"


def event_mark(event: dict) -> tuple[str, str] | None:
    """The timeline's label and hover text for one of a request's own events (a row of
    ``RequestLife.events``), or None for events drawn otherwise (deliveries)."""
    kind = event["event_type"]
    if kind == "admission_decided":
        decision = event["decision"]
        target = f" to {event['instance_id']}" if decision == "route" and event.get("instance_id") else ""
        return f"admission: {decision}", f"admission decision {decision}{target} {event['reason'] or ''}"
    if kind == "request_preempted" and not is_preemption(event):
        return "moved", (f"moved to another instance with its KV, nothing to recompute (lease generation "
                         f"{event.get('lease_generation')}; the route that follows names the instance)")
    if kind == "request_preempted":
        return "preempted", f"preempted ({event['mode']}), {event['num_lost_tokens']} tokens to recompute"
    labels = {"first_token": "first token", "request_cancelled": "cancelled", "request_arrived": "arrived",
              "request_finished": f"finished: {event.get('outcome')}"}
    return (labels[kind], labels[kind]) if kind in labels else None


def composition_bin_s(span_s: float, max_points: int) -> float:
    """Bin width for batch composition: the narrowest of ``BIN_LADDER_S`` giving at most ``max_points`` bins."""
    for width in BIN_LADDER_S:
        if span_s / width <= max(1, max_points):
            return float(width)
    return float(math.ceil(span_s / max(1, max_points)))


def batch_composition(events_relation: str, instance_id: str, window: TimeWindow, *, hive: bool, max_points: int,
                      memory_limit: str | None = None) -> tuple[pa.Table, float]:
    """What an instance's batches held over ``window``, aggregated into time bins of steps (by
    their start); (table, bin width in s). Columns: bin_start_ns, num_steps, mean_batch_size
    (members per step), prefill_tokens_per_s, decode_seqs_per_step, busy_share (step time over
    the bin), kv_blocks_used (the most at a step end), mean_step_ms."""
    bin_s = composition_bin_s(window.span_s, max_points)
    bin_ns = max(1, int(round(bin_s * NS)))
    con = locked_connection(readable_dirs(events_relation), memory_limit)
    table = con.sql(
        f"""SELECT (start_ns // {bin_ns}) * {bin_ns} AS bin_start_ns,
                   sum(coalesce(num_steps, 1)) AS num_steps,
                   sum(len(request_ids) * coalesce(num_steps, 1)) / sum(coalesce(num_steps, 1)) AS mean_batch_size,
                   sum(num_prefill_tokens * coalesce(num_steps, 1)) / {bin_s!r} AS prefill_tokens_per_s,
                   sum(num_decode_seqs * coalesce(num_steps, 1)) / sum(coalesce(num_steps, 1)) AS decode_seqs_per_step,
                   least(sum(end_ns - start_ns) / {bin_ns}, 1.0) AS busy_share,
                   max(num_kv_blocks_used) AS kv_blocks_used,
                   sum(end_ns - start_ns) / 1e6 / sum(coalesce(num_steps, 1)) AS mean_step_ms
            FROM {events_relation}
            WHERE {_time_filter(window.start_ns, window.end_ns + STEP_MARGIN_NS, hive)} AND event_type = 'step_executed'
              AND instance_id = ? AND start_ns >= {int(window.start_ns)} AND start_ns < {int(window.end_ns)}
            GROUP BY ALL ORDER BY bin_start_ns""",
        params=[instance_id],
    ).to_arrow_table()
    return table, bin_s
