"""Service levels: attainment and SLO goodput over time per class, and latency distributions."""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from dashboard import charts, ui
from dashboard.data import objectives_for

s = ui.page("Service levels", "Attainment and SLO goodput per class over time, with rejections and cancellations beside "
            "them, and latency CDFs per class. A request is good when it completed within every objective of its class.")
k = s.privacy.min_group_size
view, selection = ui.lake_page(s, "service")
config = ui.metrics_config(s)
objectives = objectives_for(config, view.overview.classes)

st.subheader("Objectives")
ui.show_table(pa.table({
    "service_class": [o.service_class for o in objectives],
    "ttft_s_at_most": [o.ttft_s for o in objectives],
    "itl_p99_s_at_most": [o.itl_s for o in objectives],
    "e2e_s_at_most": [o.e2e_s for o in objectives],
    "max_queue_s": [o.max_queue_s for o in objectives],
}))
st.caption("From dashboard.gate_config_file (its classes; 'default' covers classes it does not list)"
           if s.dashboard.gate_config_file else "The gate's built-in objectives (set dashboard.gate_config_file to use yours).")

bin_s = ui.series_bin_s(s, view, selection)
levels = ui.service_levels(view.requests_path, selection, objectives, bin_s, k)  # one connection for the whole page
st.subheader("Per class over the window")
ui.show_table(levels.by_class)
ui.suppressed_note(levels.num_hidden_classes, k, "classes")

series = levels.series
ui.show_figure(charts.service_figure(series, "attainment", "Attainment per class: good requests / arrivals", "attainment", bin_s),
               "attainment")
ui.show_figure(charts.service_figure(series, "goodput_rps", "SLO goodput per class: good requests per second",
                                     "good requests/s", bin_s), "goodput")
ui.show_figure(charts.service_figure(series, "rejected_share", "Rejected share per class (goodput is never shown alone)",
                                     "rejected / arrivals", bin_s), "rejected")
ui.suppressed_note(levels.num_hidden_bins, k, "time bins")

st.subheader("Latency distributions")
limits = {o.service_class: {"ttft_s": o.ttft_s, "itl_s": o.itl_s, "e2e_s": o.e2e_s} for o in objectives}
ui.show_figure(charts.cdf_figure(levels.cdfs, limits), "cdfs")
ui.suppressed_note(levels.num_hidden_classes, k, "classes")
st.caption("TTFT starts at arrival (the frontend received the whole request), not at scheduling as vLLM's per-request "
           "field does. ITL is each request's 99th-percentile gap between consecutive tokens; where an engine delivered "
           "tokens in chunks, a chunk of k tokens after a gap g counts as k gaps of g/k. E2E ends at the last token. "
           "Quantiles from 0.1% to 99.9%: the extremes are single requests. Definitions: docs/metrics.md.")
