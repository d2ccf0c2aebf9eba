"""The Streamlit + plotly dashboard that analysts and release managers open every day.

It reads only DuckDB and Parquet (the lake and the replay reports), never the live stream, and
shows tenant data only through the k-anonymous helpers of ``privacy/``.

Pages: Overview, Traffic (ingest health; arrivals and token volume by class, bursts visible),
Service levels (attainment and SLO goodput over time, latency CDFs with their measurement
boundaries), Policies (replay runs side by side, goodput against cost, the load sweep), Gate (the
verdict with each metric's reason and statistics), Request explorer (one request's life; an
instance's batches over time) and Tenants (service against entitlement; the viewer's own tenant
in full). ``docs/dashboard.md`` describes them.

Layout:

- ``config``: ``DashboardConfig`` (the ``[dashboard]`` section) and how settings reach the app;
- ``data``, ``runs``, ``explorer``: the queries, plain functions over DuckDB that return frozen
  records and small Arrow tables (unit-tested without Streamlit);
- ``charts``: plotly figures from those tables;
- ``ui``, ``app.py``, ``app_pages/``: the Streamlit layer, thin: caching, URL filters, layout;
- ``server``: ``serve(config)`` starts ``streamlit run dashboard/asgi.py`` on loopback: ``app.py``
  through ``st.App``, behind ``known_paths`` (404 for any URL but a page or Streamlit's own);
- ``sample``: a replay committed to a lake, for tests, benchmarks and screenshots.

Privacy: the viewer's tenant is server configuration (``dashboard.viewer_tenant``), never a URL
parameter; every figure across tenants goes through ``privacy.views.k_anonymous``; per-request
detail of the lake is shown only within the viewer's ``TenantScope``; data is shown as text, never
as Markdown or HTML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

__all__ = ["serve", "wait_until_ready", "dashboard_url"]


def serve(config, **kwargs) -> subprocess.Popen:
    """Start the dashboard (``dashboard.server.serve``): ``streamlit run dashboard/asgi.py`` on
    loopback with ``config`` passed through the environment; returns the process."""
    from dashboard.server import serve as _serve

    return _serve(config, **kwargs)


def wait_until_ready(url: str, timeout_s: float = 60.0, process=None) -> None:
    """Block until the dashboard at ``url`` answers (``dashboard.server.wait_until_ready``)."""
    from dashboard.server import wait_until_ready as _wait

    _wait(url, timeout_s, process)


def dashboard_url(process) -> str:
    """The URL of a dashboard process started by ``serve``."""
    from dashboard.server import dashboard_url as _url

    return _url(process)
