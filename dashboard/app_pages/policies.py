"""Policies: replay runs side by side, goodput against cost, and the load sweep."""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from dashboard import charts, ui
from dashboard.files import servable
from dashboard.runs import POLICY_METRICS, comparison_table

s = ui.page("Policies", "Replay runs side by side: goodput with rejections, fairness, starvation, preemptions and cost "
            "beside it; goodput against cost; and each policy's metrics as the load rises.")
runs = ui.run_list(s)
if not runs:
    ui.first_run(s, f"no replay runs in {s.dashboard.runs_dir}")
    st.stop()

names = [r.name for r in runs]
wanted = [n for n in ui.url_get_all("run") if n in names]
chosen = st.multiselect("Runs", names, default=wanted or names[:12], key="policies.runs")
ui.url_set("run", chosen)
selected = tuple(r for r in runs if r.name in chosen)
if not selected:
    st.info("Choose at least one run.")
    st.stop()

config = ui.metrics_config(s)
selected, values = ui.readable_run_metrics(s, selected, config)
if not selected:
    st.stop()
classes = sorted({g for v in values for g, scope in zip(v["group"].to_pylist(), v["scope"].to_pylist()) if scope == "class"})
service_class = ui.class_filter(tuple(classes), "policies")
table = comparison_table(selected, values, service_class or "")

beyond = sum(1 for r in selected if r.minutes_beyond_fitted)
if beyond:  # a count only: run names are data, and an alert renders Markdown
    st.warning(f"{beyond} of the chosen runs went beyond the load their calibration was fitted on "
               "(`minutes_beyond_fitted_load` under Runs and their manifests): their absolute figures are extrapolations, "
               "with errors that can be several times the calibration's held-out figures (docs/calibration.md, "
               "\"The load a calibration vouches for\").")

st.subheader("Side by side" + (" (one class)" if service_class else ""))
if service_class:
    st.text(f"class: {service_class}")
ui.show_table(table)
st.caption("Goodput counts requests that met every objective of their class; rejections and cancellations stand beside "
           "it because dropping work can raise goodput. Fairness gap: the largest difference in service per entitlement "
           "weight between tenants backlogged in the same window. Starvation: the longest queue residence and the share "
           "queued past the class's limit. Cost: accelerator-seconds at the configured price per 1,000 goodput tokens "
           "(whole runs only). Definitions: docs/metrics.md.")

left, right = st.columns(2)
with left:
    ui.show_figure(charts.policy_scatter(table, config.cost.currency), "scatter")
with right:
    series = [r.series for r in selected]
    load = [r.load_factor for r in selected]
    metric = st.selectbox("Load sweep metric", [m for m, _ in POLICY_METRICS[:5]], index=0, key="policies.sweep")
    label = dict(POLICY_METRICS)[metric]
    ui.show_figure(charts.sweep_figure(series, load, table[metric].to_pylist(), label), "sweep")
    st.caption("Load factor of a run: its manifest's `workload.load_factor`, else a `@<k>x` suffix of the workload name "
               "(`azure-conv@1.5x`), else 1. Lines join runs that differ only in load.")

st.subheader("Runs and their manifests")
ui.show_table(pa.table({
    "run": [r.name for r in selected], "policy": [r.policy for r in selected], "policy_config": [r.policy_config for r in selected],
    "engine": [r.engine for r in selected], "cost_model": [r.cost_model for r in selected],
    "workload": [r.workload for r in selected], "load_factor": [r.load_factor for r in selected],
    "scenario": [r.scenario for r in selected], "seed": [r.seed for r in selected],
    "requests": [r.num_requests for r in selected],
    "minutes_beyond_fitted_load": pa.array([r.minutes_beyond_fitted for r in selected], pa.int64()),
    "folder": [r.folder for r in selected],
}))
for i, run in enumerate(selected):
    manifest = servable(run.manifest_path, [s.dashboard.runs_dir])  # a regular file inside runs_dir, resolved
    if manifest is not None:
        st.download_button("Download manifest.json", manifest.read_bytes(), file_name="manifest.json",
                           mime="application/json", key=f"manifest-{i}")
        st.text(f"{run.name}: {run.manifest_path}")
