"""Traffic: is ingest healthy, and what arrived (by class, with its bursts)."""

from __future__ import annotations

import time

import pyarrow as pa
import streamlit as st

from dashboard import charts, ui
from dashboard.data import NS

s = ui.page("Traffic", "Ingest health, and arrivals and token volume over time by class (by arrival time).")
k = s.privacy.min_group_size

st.subheader("Ingest health")
health = ui.ingest_health(s)
if health:
    now_ns = time.time_ns()
    events_per_s = sum(h.events_per_s for h in health)
    lag = sum(h.total_lag for h in health)
    dead = sum(h.dead_letters for h in health)
    commits = [h.last_commit_ns for h in health if h.last_commit_ns is not None]
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Events written per second", ui.fmt(events_per_s, ",.0f"))
    c2.metric("Consumer lag, records", f"{lag:,}")
    c3.metric("Dead letters", f"{dead:,}")
    c4.metric("Last commit", ui.fmt((now_ns - max(commits)) / NS, ",.0f", " s ago") if commits else "never")
    if not all(h.broker_reachable for h in health):
        st.error("An ingest process reports the broker unreachable.")
    ui.show_table(pa.table({
        "consumer": [h.consumer for h in health],
        "reported_s_ago": [round((now_ns - h.reported_ns) / NS, 1) for h in health],
        "records_read": [h.records_read for h in health],
        "events_written": [h.events_written for h in health],
        "events_per_s": [round(h.events_per_s, 1) for h in health],
        "dead_letters": [h.dead_letters for h in health],
        "dead_letter_rate": [h.dead_letter_rate for h in health],
        "duplicates_dropped": [h.duplicates_dropped for h in health],
        "lag_records": [h.total_lag for h in health],
        "last_commit_s_ago": [None if h.last_commit_ns is None else round((now_ns - h.last_commit_ns) / NS, 1) for h in health],
        "broker_reachable": [h.broker_reachable for h in health],
    }))
else:
    st.caption("No ingest process has reported: `servelens ingest` writes its health beside the lake every "
               "ingest.status_interval_s.")

view = ui.lake_view(s)
snapshot = view.snapshot if view is not None else ui.lake_snapshot(s)
dead_letters = ui.dead_letters(snapshot, s.lake.duckdb_memory_limit)
if dead_letters.num_rows:
    left, right = st.columns([2, 3])
    with left:
        ui.show_figure(charts.dead_letters_figure(dead_letters), "dead-letters")
    with right:
        ui.show_table(dead_letters)
elif snapshot.dead_letter_files:
    st.caption("No dead letters.")

if view is None:
    ui.first_run(s, "the lake holds no events")
    st.stop()

st.subheader("Arrivals and token volume")
ov = view.overview
selection = ui.lake_selection(view, "traffic")
window = selection.window
bin_s = ui.series_bin_s(s, view, selection)
table, hidden = ui.arrivals(view.requests_path, selection, bin_s, k)
totals = ui.totals(view.requests_path, selection, k).to_pylist()[0]
c1, c2, c3, c4 = st.columns(4)
c1.metric("Requests in the window", ui.fmt(totals["num_requests"], ","))
c2.metric("Mean arrivals per second", ui.fmt(totals["num_requests"] / window.span_s if totals["num_requests"] else None, ",.2f"))
visible = [v for v, hide in zip(table["peak_arrivals_per_s"].to_pylist(), table["suppressed"].to_pylist()) if not hide]
c3.metric("Busiest second, requests", ui.fmt(max(visible) if visible else None, ",.0f"))
c4.metric("Prompt / output tokens", f"{ui.compact(totals['num_prompt_tokens'])} / {ui.compact(totals['num_output_tokens'])}")
ui.show_figure(charts.arrivals_figure(table, bin_s), "arrivals")
ui.show_figure(charts.tokens_figure(table, bin_s), "tokens")
ui.suppressed_note(hidden, k, "time bins")
st.caption(f"Lake version v{view.version_shown}; {ov.num_requests:,} requests in the lake. Bins are {bin_s:g} s "
           f"wide: at most dashboard.max_points points a series, and about {8 * k} requests a class per bin, so that few "
           f"cells fall under the k-anonymity threshold (k = {k}). The busiest second is counted within each bin.")
