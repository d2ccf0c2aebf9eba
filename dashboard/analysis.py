"""The views analysts bring from vLLM's Grafana dashboard, GuideLLM and AIPerf, over the lake's request file.

Every figure about requests is a k-anonymous aggregate (``privacy.views.k_anonymous``: a cell of fewer
than k tenants or requests is suppressed and counted), as on the other lake pages:

- ``percentile_table``: p50 / p90 / p99 of TTFT, TPOT, each request's p99 inter-token gap, E2E and queue
  time, per class (GuideLLM's and AIPerf's first table);
- ``latency_over_time``: the same percentiles of TTFT, ITL and E2E per time bin;
- ``queue_over_time``: requests waiting (arrived, not yet scheduled) and running (scheduled, not yet
  finished) during each bin, vLLM's ``num_requests_waiting`` / ``num_requests_running``;
- ``length_heatmap``: requests by prompt and output length (powers of two);
- ``finish_reasons``: requests by outcome and last admission decision, per class.

``kv_usage_over_time`` reads the engines' step events (capacity, not tenant data): the KV-cache blocks in
use as a share of each instance's pool (vLLM's ``kv_cache_usage_perc``) and the requests per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from dashboard.data import NS, REQUEST_SEQ, Selection, _selected, query_connection
from privacy.views import KAnonymousResult, k_anonymous
from servelens.sql import parquet_relation

#: (column, its label) of the latency columns, in the order tables show them.
LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_p99_s", "ITL p99"), ("e2e_s", "E2E"), ("queue_s", "queue"))
QUANTILES = (50, 90, 99)


def _quantiles(columns: Sequence[str]) -> dict[str, str]:
    return {f"{c}_p{q}": f"quantile_cont({c}, {q / 100})" for c in columns for q in QUANTILES}


def percentile_table(requests_path: str | Path, selection: Selection, k: int) -> tuple[pa.Table, int]:
    """Per class: requests and the p50 / p90 / p99 of each latency (seconds); (table, classes suppressed)."""
    relation, params = _selected(requests_path, selection)
    result = _per_request(requests_path, relation, ["class_name"], _quantiles([c for c, _ in LATENCIES]), params, k)
    return result.table.sort_by("class_name"), result.num_suppressed


def _per_request(requests_path: str | Path, relation: str, groups: list[str], aggregates: dict[str, str],
                 params: list[object], k: int) -> KAnonymousResult:
    """k-anonymous groups of a relation with one row per request of the request table."""
    return k_anonymous(query_connection(requests_path), relation, groups, aggregates, k=k, tenant_column="crowd_member",
                       request_column=REQUEST_SEQ, params=params, one_row_per_request=True)


def latency_over_time(requests_path: str | Path, selection: Selection, bin_s: float, k: int) -> tuple[pa.Table, int]:
    """Per bin of arrivals: p50 / p90 / p99 of TTFT, ITL p99 and E2E (seconds); (table, bins suppressed)."""
    bin_ns = max(1, round(bin_s * NS))
    relation, params = _selected(requests_path, selection)
    binned = f"(SELECT *, (arrival_ns // {bin_ns}) * {bin_ns} AS bin_start_ns FROM {relation})"
    result = _per_request(requests_path, binned, ["bin_start_ns"], _quantiles(["ttft_s", "itl_p99_s", "e2e_s"]), params, k)
    return result.table.sort_by("bin_start_ns"), result.num_suppressed


def queue_over_time(requests_path: str | Path, selection: Selection, bin_s: float, k: int) -> tuple[pa.Table, int]:
    """Per bin and state (``waiting``: arrived, not scheduled; ``running``: scheduled, not finished): the
    requests in that state at some point of the bin; (table, cells suppressed)."""
    bin_ns = max(1, round(bin_s * NS))
    relation, params = _selected(requests_path, selection)
    # each request's waiting and running intervals, expanded to the bins they touch (a request is in a few)
    spans = (
        f"(SELECT crowd_member, {REQUEST_SEQ}, 'waiting' AS state, arrival_ns AS lo, "
        f"coalesce(scheduled_ns, finish_ns, arrival_ns) AS hi FROM {relation} "
        f"UNION ALL SELECT crowd_member, {REQUEST_SEQ}, 'running', scheduled_ns, coalesce(finish_ns, last_token_ns, scheduled_ns) "
        f"FROM {relation} WHERE scheduled_ns IS NOT NULL)"
    )
    expanded = (f"(SELECT crowd_member, {REQUEST_SEQ}, state, unnest(range(lo // {bin_ns}, hi // {bin_ns} + 1)) * {bin_ns} "
                f"AS bin_start_ns FROM {spans})")
    result = k_anonymous(query_connection(requests_path), expanded, ["bin_start_ns", "state"], {}, k=k,
                         tenant_column="crowd_member", request_column=REQUEST_SEQ, params=[*params, *params])
    return result.table.sort_by([("bin_start_ns", "ascending"), ("state", "ascending")]), result.num_suppressed


def length_heatmap(requests_path: str | Path, selection: Selection, k: int) -> tuple[pa.Table, int]:
    """Requests per (prompt length, output length) cell, both bucketed by powers of two (the bucket's lower
    bound, tokens); (table, cells suppressed)."""
    relation, params = _selected(requests_path, selection)

    def bucket(column: str) -> str:
        return f"CASE WHEN coalesce({column}, 0) < 1 THEN 0 ELSE 2 ** floor(log2({column}))::BIGINT END"

    cells = f"(SELECT *, {bucket('num_prompt_tokens')} AS prompt_bucket, {bucket('num_output_tokens')} AS output_bucket FROM {relation})"
    result = _per_request(requests_path, cells, ["prompt_bucket", "output_bucket"], {}, params, k)
    return result.table, result.num_suppressed


def finish_reasons(requests_path: str | Path, selection: Selection, k: int) -> tuple[pa.Table, int]:
    """Requests per class, outcome and last admission decision; (table, cells suppressed)."""
    relation, params = _selected(requests_path, selection)
    cells = (f"(SELECT *, coalesce(outcome, 'in flight') AS finish, coalesce(admission_decision, 'none') AS decision "
             f"FROM {relation})")
    result = _per_request(requests_path, cells, ["class_name", "finish", "decision"], {}, params, k)
    return result.table.sort_by([("class_name", "ascending"), ("num_requests", "descending")]), result.num_suppressed


def kv_usage_over_time(event_files: Sequence[str], selection: Selection, bin_s: float) -> pa.Table:
    """Per bin of step ends and instance: the mean and peak share of the KV-cache pool in use, and the mean
    requests per batch (engine capacity from ``step_executed``: no tenant data)."""
    if not event_files:
        return pa.table({"bin_start_ns": pa.array([], pa.int64())})
    bin_ns = max(1, round(bin_s * NS))
    clauses = ["event_type = 'step_executed'", "num_kv_blocks_used IS NOT NULL"]
    if selection.window is not None:
        clauses.append(f"ts_ns >= {int(selection.window.start_ns)} AND ts_ns < {int(selection.window.end_ns)}")
    query = (
        f"SELECT (ts_ns // {bin_ns}) * {bin_ns} AS bin_start_ns, coalesce(instance_id, 'engine') AS instance_id, "
        "avg(num_kv_blocks_used / greatest(num_kv_blocks_used + num_kv_blocks_free, 1)) AS kv_usage_mean, "
        "max(num_kv_blocks_used / greatest(num_kv_blocks_used + num_kv_blocks_free, 1)) AS kv_usage_peak, "
        "avg(len(request_ids)) AS batch_requests_mean "
        f"FROM {parquet_relation(event_files, hive=True)} WHERE {' AND '.join(clauses)} GROUP BY ALL ORDER BY 1, 2"
    )
    return query_connection(*event_files).sql(query).to_arrow_table()
