"""Tenants: delivered service against entitlement (k-anonymous), and the viewer's own tenant in full."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, ui

s = ui.page("Tenants", "Each tenant's delivered service against its entitlement and what it cost, through the k-anonymous "
            "helper (no timing across tenants); full detail only for this dashboard's own tenant.")
k = s.privacy.min_group_size
view, selection = ui.lake_page(s, "tenants")
config = ui.metrics_config(s)

st.subheader("Service against entitlement, every tenant")
table, hidden = ui.tenant_service(view.requests_path, selection, config, k)
fair = ui.fairness(view.requests_path, selection, config, k)
c1, c2, c3 = st.columns(3)
c1.metric("Tenants", ui.fmt(fair.num_tenants, ",") if not fair.suppressed else f"fewer than {k}")
c2.metric("Jain's index of service / entitlement", ui.fmt(fair.jain_index, ".3f"))
c3.metric("Tenants hidden (fewer than k requests)", f"{hidden:,}")
ui.show_figure(charts.tenant_figure(table), "tenants")
ui.show_table(table)
st.caption(f"Service counts input tokens x 1 + output tokens x 2 (as VTC does), over the tenant's entitlement weight "
           f"(from dashboard.gate_config_file's tenant_weights; default 1). Cost charges each engine step's time to its "
           f"members by the tokens each processed, at {config.cost.accelerator_hour_price:g} {config.cost.currency} per "
           f"accelerator-hour. Tenants with fewer than {k} requests are suppressed (privacy.min_group_size); 'other' "
           "holds the tenants beyond privacy.tenant_budget; no latency figure is shown across tenants.")

st.subheader("Your tenant")
try:
    scope = ui.viewer_scope(s)
except ui.ScopeUnavailable as exc:
    st.error("dashboard.viewer_tenant is set, but the pseudonym key ring to resolve it cannot be loaded.")
    st.text(str(exc))
    st.stop()
if scope is None:
    st.info("No viewer tenant is configured for this dashboard (dashboard.viewer_tenant, set on the server), so only the "
            "k-anonymous view above is shown. Per-tenant timing is shown only to that tenant.")
    st.stop()
detail = ui.tenant_detail(view.requests_path, selection, config, scope)
summary = detail.summary.to_pylist()[0] if detail.summary.num_rows else {}
if not summary.get("num_requests"):
    st.info("Your tenant has no requests in this window (or it is folded into 'other': raise privacy.tenant_budget).")
    st.stop()
c1, c2, c3, c4, c5 = st.columns(5)
c1.metric("Requests", ui.fmt(summary["num_requests"], ","))
c2.metric("Attainment", ui.fmt(summary["attainment"], ".1%"))
c3.metric("TTFT p99, s (from arrival)", ui.fmt(summary["ttft_p99_s"], ",.3f"))
c4.metric("Queue p99, s", ui.fmt(summary["queue_p99_s"], ",.3f"))
c5.metric("Cached prefix share", ui.fmt(summary["cached_prefix_share"], ".1%"))
ui.show_table(detail.by_class)
st.caption("Your slowest requests by TTFT (open one in the Request explorer):")
ui.show_table(detail.slowest)
ids = detail.slowest["request_id"].to_pylist()
if ids:
    chosen = st.selectbox("Request to open", ids, key="tenants.request")
    ui.link_to("app_pages/request_explorer.py", "Open it in the Request explorer", {"source": "the lake", "request": chosen})
