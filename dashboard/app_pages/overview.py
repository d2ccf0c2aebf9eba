"""Overview: what the dashboard holds (lake version, runs, gate report) and where to start."""

from __future__ import annotations

import datetime as dt

import streamlit as st

from dashboard import ui
from dashboard.runs import GateReportError

s = ui.page("servelens", "See what your LLM-serving scheduler did, replay it through candidate policies, and gate the canary.")
snapshot = ui.lake_snapshot(s)
runs = ui.run_list(s)
reports = ui.gate_reports(s)
report_dir = s.dashboard.gate_dir

left, middle, right, last = st.columns(4)
left.metric("Lake version (events)", "empty" if snapshot.is_empty else f"v{snapshot.events_version}")
middle.metric("Replay runs", f"{len(runs):,}")
right.metric("Gate reports", f"{len(reports):,}")
latest = None
if reports:
    try:
        latest = ui.gate_report(reports[0].folder, reports[0].written_ns)
    except GateReportError:
        latest = None
last.metric("Latest verdict", latest.status if latest is not None else "none")
if latest is not None:  # which comparison it judged: the report's folder (<day>/<candidate>@<load> for the nightly)
    last.text(f"{reports[0].name or '(gate_dir)'}: {latest.headline}")

st.subheader("Where the data comes from")
st.text(f"lake (lake.root): {s.lake.root}")
if snapshot.last_commit_ms is not None:
    st.text("last commit to the events table: "
            + dt.datetime.fromtimestamp(snapshot.last_commit_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))
st.text(f"replay runs (dashboard.runs_dir): {s.dashboard.runs_dir}")
st.text(f"gate reports (dashboard.gate_dir): {report_dir}")
st.text(f"derived tables (dashboard.cache_dir): {s.dashboard.cache_dir}")
st.text("viewer tenant: " + ("configured (dashboard.viewer_tenant): its own detail is shown on Tenants and in the Request explorer"
                             if s.dashboard.viewer_tenant else "none: tenant views show k-anonymous aggregates only"))

if snapshot.is_empty and not runs:
    ui.first_run(s, "the lake holds no events and there are no replay runs")
else:
    st.subheader("Pages")
    st.page_link("app_pages/traffic.py", label="Traffic: ingest health, arrivals and token volume by class")
    st.page_link("app_pages/service_levels.py", label="Service levels: attainment, SLO goodput and latency CDFs by class")
    st.page_link("app_pages/policies.py", label="Policies: replay runs side by side, goodput against cost, the load sweep")
    st.page_link("app_pages/gate.py", label="Gate: the verdict, each metric's reason and statistics")
    st.page_link("app_pages/request_explorer.py", label="Request explorer: one request's life, an instance's batches")
    st.page_link("app_pages/tenants.py", label="Tenants: service against entitlement (k-anonymous)")
    if snapshot.is_empty:
        ui.first_run(s, "the lake holds no events (replay runs are there)")
