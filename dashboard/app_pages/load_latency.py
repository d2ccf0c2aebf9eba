"""Load and latency: percentile tables first, latency percentiles over time, queue depth and KV-cache usage,
prompt/output lengths and finish reasons (the views of vLLM's Grafana dashboard, GuideLLM and AIPerf)."""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from dashboard import analysis, analysis_charts, ui

s = ui.page("Load and latency", "Latency percentiles per class and over time, the engines' queues and KV cache, request "
            "lengths and how requests ended. Figures over requests are k-anonymous aggregates.")
k = s.privacy.min_group_size
view, selection = ui.lake_page(s, "load")
bin_s = ui.series_bin_s(s, view, selection)

st.subheader("Percentiles per class (seconds)")
table, hidden = analysis.percentile_table(view.requests_path, selection, k)
visible = table.filter(pa.compute.invert(table["suppressed"])) if table.num_rows else table
rows = []
for row in visible.to_pylist():
    for column, label in analysis.LATENCIES:
        rows.append({"class": row["class_name"], "latency": label, "requests": row["num_requests"],
                     **{f"p{q}_s": row[f"{column}_p{q}"] for q in analysis.QUANTILES}})
ui.show_table(pa.Table.from_pylist(rows) if rows else pa.table({"class": pa.array([], pa.string())}))
ui.suppressed_note(hidden, k, "classes")
st.caption("TTFT: arrival -> first token; TPOT: (last token - first token) / (output tokens - 1); ITL p99: each "
           "request's 99th-percentile gap between tokens; E2E: arrival -> last token; queue: arrival -> first batch "
           "(engine side; docs/metrics.md). Interpolated percentiles over the requests of the window.")

over_time, hidden_bins = analysis.latency_over_time(view.requests_path, selection, bin_s, k)
for column, label in (("ttft_s", "TTFT"), ("itl_p99_s", "ITL (each request's p99 gap)"), ("e2e_s", "E2E")):
    ui.show_figure(analysis_charts.latency_over_time_figure(over_time, column, label, bin_s), f"latency-{column}")
ui.suppressed_note(hidden_bins, k, "time bins")

st.subheader("Queues and KV cache")
queue, hidden_queue = analysis.queue_over_time(view.requests_path, selection, bin_s, k)
kv = analysis.kv_usage_over_time(view.snapshot.event_files, selection, bin_s)
ui.show_figure(analysis_charts.queue_figure(queue, kv, bin_s), "queue")
ui.suppressed_note(hidden_queue, k, "time bins")
st.caption("Waiting: arrived, not yet in a batch; running: in a batch until it finished (vLLM's num_requests_waiting "
           "and num_requests_running), counted over each bin. KV cache: blocks in use over the instance's pool, the "
           "mean of the bin's steps (vLLM's kv_cache_usage_perc).")

left, right = st.columns(2)
with left:
    lengths, hidden_cells = analysis.length_heatmap(view.requests_path, selection, k)
    ui.show_figure(analysis_charts.length_heatmap_figure(lengths), "lengths")
    ui.suppressed_note(hidden_cells, k, "length cells")
with right:
    reasons, hidden_reasons = analysis.finish_reasons(view.requests_path, selection, k)
    ui.show_figure(analysis_charts.finish_reasons_figure(reasons), "finish")
    ui.suppressed_note(hidden_reasons, k, "outcomes")
