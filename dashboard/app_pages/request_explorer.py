"""Request explorer: one request's life as a timeline, and what an instance's batches held over time."""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from dashboard import charts, ui
from dashboard.data import NS, TimeWindow
from dashboard.explorer import STEP_MARGIN_NS, Visibility, event_mark, is_preemption, lake_events
from servelens.sql import parquet_relation

s = ui.page("Request explorer", "One request's life: queue, admission, prefill chunks, decode, preemptions and the batches "
            "it shared; and the batch composition of an instance over time.")
LAKE = "the lake"
runs = {r.name: r for r in ui.run_list(s)}
snapshot = ui.lake_snapshot(s)
sources = ([] if snapshot.is_empty else [LAKE]) + list(runs)
if not sources:
    ui.first_run(s, "the lake holds no events and there are no replay runs")
    st.stop()
wanted = ui.url_get("source")
source = st.selectbox("Source", sources, index=sources.index(wanted) if wanted in sources else 0, key="explorer.source")
ui.url_set("source", source)

try:
    scope = ui.viewer_scope(s)
except ui.ScopeUnavailable as exc:
    st.error("dashboard.viewer_tenant is set, but the pseudonym key ring to resolve it cannot be loaded.")
    st.text(str(exc))
    scope = None

if source == LAKE:
    view = ui.lake_view(s)
    path, ov = view.requests_path, view.overview
    hive = True

    def relation(lo_ns: int, hi_ns: int) -> str:
        return lake_events(view.snapshot.event_files, lo_ns, hi_ns)
    visibility = Visibility(scope, lake=True)
    if scope is None:
        st.info("Requests in the lake are shown only to their own tenant: this dashboard has no viewer tenant "
                "(dashboard.viewer_tenant, set on the server). Batch composition below needs none.")
else:
    run = runs[source]
    path = ui.readable_run_requests(s, run)
    ov = ui.overview(path)
    hive = False

    def relation(lo_ns: int, hi_ns: int) -> str:
        return parquet_relation([run.events_path])
    visibility = Visibility(scope, lake=False)

left, right = st.columns([3, 1])
with left:
    window = ui.window_filter(ov, "explorer")
with right:
    service_class = ui.class_filter(ov.classes, "explorer")

st.subheader("A request")
orders = {"ttft": "slowest first token", "e2e": "slowest to finish", "queue": "longest queued",
          "preemptions": "most preempted", "latest": "latest arrival"}
wanted_order = ui.url_get("order")
order = st.selectbox("List requests by", list(orders), format_func=orders.get,
                     index=list(orders).index(wanted_order) if wanted_order in orders else 0, key="explorer.order")
ui.url_set("order", order)
candidates = ui.candidate_requests(path, visibility, window, service_class, order)
ids = candidates["request_id"].to_pylist()
wanted_id = ui.url_get("request")
if wanted_id and wanted_id not in ids:
    ids = [wanted_id, *ids]
summary = None
if ids:
    request_id = st.selectbox("Request", ids, index=0, key="explorer.request")
    ui.url_set("request", request_id)
    summary = ui.find_request(path, request_id, visibility)
    if summary is None:
        st.warning("No request with that id among the requests you may see.")
    with st.expander("The listed requests", expanded=False):
        ui.show_table(candidates)
else:
    st.caption("No request you may see in this window and class.")

if summary is not None:
    life = ui.request_life(relation(summary.arrival_ns, summary.end_ns + 1), summary, hive, s.lake.duckdb_memory_limit)
    c1, c2, c3, c4, c5 = st.columns(5)
    c1.metric("Queue, s (arrival -> scheduled)", ui.fmt(summary.queue_s, ",.3f"))
    c2.metric("TTFT, s (arrival -> first token)", ui.fmt(summary.ttft_s, ",.3f"))
    c3.metric("E2E, s (arrival -> last token)", ui.fmt(summary.e2e_s, ",.3f"))
    c4.metric("Preemptions", f"{summary.num_preemptions:,}")
    c5.metric("Output tokens", ui.fmt(summary.num_output_tokens, ","))
    st.text(f"request {summary.request_id}; class {summary.service_class or 'default'}; outcome {summary.outcome or 'in flight'}; "
            f"instance {summary.instance_id or 'unknown'}; prompt {summary.num_prompt_tokens} tokens "
            f"({summary.num_cached_prefix_tokens or 0} cached); last admission decision {summary.admission_decision or 'none'}")
    lanes: list[tuple[str, int, int, str, str]] = []
    queue_end = summary.scheduled_ns or summary.finish_ns or summary.end_ns
    lanes.append(("queue", summary.arrival_ns, queue_end, "#9a6700", f"queued {(queue_end - summary.arrival_ns) / 1e6:,.1f} ms"))
    for row in life.steps.to_pylist():
        lane = "prefill chunk" if row["phase"] == "prefill" else "decode"
        hover = (f"{lane}: {row['num_steps']} step(s) of {row['duration_s'] * 1e3 / row['num_steps']:,.2f} ms; batch of "
                 f"{row['num_members']} requests, {row['num_prefill_tokens']} prefill tokens, {row['num_decode_seqs']} decoding; "
                 f"this request {row['own_tokens']} token(s) per step")
        lanes.append((lane, row["start_ns"], row["end_ns"], "#0969da" if lane == "prefill chunk" else "#1a7f37", hover))
    marks: list[tuple[str, int, str]] = []
    for row in life.events.to_pylist():
        mark = event_mark(row)  # a migrate event is a move (hand-off, migration), not a preemption
        if mark is not None:
            marks.append((mark[0], row["ts_ns"], mark[1]))
        if is_preemption(row):
            lanes.append(("preempted", row["ts_ns"], row["ts_ns"] + 1_000_000, "#cf222e", "preempted"))
    if summary.last_token_ns:
        marks.append(("last token", summary.last_token_ns, "last token"))
    ui.show_figure(charts.timeline_figure(summary.arrival_ns, lanes, marks), "timeline")
    st.caption("Bars are engine steps whose batch held the request (a fast replay summarizes runs of identical decode "
               "steps as one bar). Prefill chunk: the request processed more than one token, or the step ended before "
               "its first token; after a preemption that is recomputation.")
    steps = life.steps
    if steps.num_rows:
        ui.show_table(pa.table({
            "start_ms_after_arrival": [(t - summary.arrival_ns) / 1e6 for t in steps["start_ns"].to_pylist()],
            "phase": steps["phase"], "num_steps": steps["num_steps"],
            "step_ms": [d * 1e3 / n for d, n in zip(steps["duration_s"].to_pylist(), steps["num_steps"].to_pylist())],
            "batch_requests": steps["num_members"], "batch_prefill_tokens": steps["num_prefill_tokens"],
            "batch_decoding": steps["num_decode_seqs"], "own_tokens_per_step": steps["own_tokens"],
            "kv_blocks_used": steps["num_kv_blocks_used"],
        }), height=260)

st.subheader("Batch composition of an instance")
instances = list(ov.instances)
if not instances:
    st.caption("No instance recorded in this source.")
    st.stop()
wanted_instance = ui.url_get("instance") or (summary.instance_id if summary is not None else None)
instance = st.selectbox("Instance", instances, index=instances.index(wanted_instance) if wanted_instance in instances else 0,
                        key="explorer.instance")
ui.url_set("instance", instance)
spans = {"around the request": None, "1 minute": 60, "10 minutes": 600, "1 hour": 3600, "the whole window": -1}
span_names = list(spans) if summary is not None else list(spans)[1:]
span = st.selectbox("Span", span_names, index=0, key="explorer.span")
if spans[span] is None:
    composition_window = TimeWindow(summary.arrival_ns - 30 * NS, summary.end_ns + 30 * NS)
elif spans[span] == -1:
    composition_window = window
else:
    end = min(window.end_ns, window.start_ns + spans[span] * NS)
    composition_window = TimeWindow(window.start_ns, end)
composition, bin_s = ui.batch_composition(relation(composition_window.start_ns, composition_window.end_ns + STEP_MARGIN_NS),
                                          instance, composition_window, hive, min(s.dashboard.max_points, 400),
                                          s.lake.duckdb_memory_limit)
if composition.num_rows:
    ui.show_figure(charts.composition_figure(composition, bin_s), "composition")
else:
    st.caption("No engine step of this instance in that span.")
