"""Walk every page of a running dashboard in Chromium (``tests/browser.py``): click each page in
the sidebar, wait until its script finished and its charts are drawn, look for exceptions shown in
the page, and keep a full-height screenshot. Shared by the browser test and benchmarks/dashboard.py."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tests.browser import screenshot

#: (sidebar title, URL path, plotly charts the page draws on the sample data at least)
PAGES = (
    ("Overview", "", 0),
    ("Traffic", "traffic", 3),
    ("Service levels", "service-levels", 4),
    ("Load and latency", "load-latency", 6),
    ("Policies", "policies", 2),
    ("Gate", "gate", 1),
    ("Request explorer", "request-explorer", 2),
    ("Tenants", "tenants", 1),
)
IDLE = "[data-testid=stApp][data-test-script-state=notRunning]"
TIMEOUT_MS = 120_000


@dataclass(frozen=True, slots=True)
class PageVisit:
    """What one page did in the browser."""

    title: str
    path: str
    seconds: float  # from the click (or load) to the script finished and the charts drawn
    num_exceptions: int  # stException elements shown in the page
    num_charts: int
    screenshot: Path
    server_cpu_s: float | None = None  # CPU time the dashboard process spent meanwhile (with ``server_pid``)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_rendered(page, title: str, min_charts: int) -> int:
    """Wait until ``title``'s script finished and at least ``min_charts`` plotly charts are drawn."""
    page.get_by_role("heading", name=title, exact=True).first.wait_for(timeout=TIMEOUT_MS)
    page.wait_for_selector(IDLE, timeout=TIMEOUT_MS)
    if min_charts:  # charts drawn: plots holding their svg layers (two or more per chart, so count plots)
        page.wait_for_function("Array.from(document.querySelectorAll('.js-plotly-plot'))"
                               f".filter(p => p.querySelector('.main-svg')).length >= {min_charts}", timeout=TIMEOUT_MS)
    page.wait_for_selector(IDLE, timeout=TIMEOUT_MS)
    return page.locator(".js-plotly-plot").count()


def full_height_screenshot(page, name: str, width: int = 1400) -> Path:
    """Grow the viewport to the page's content (Streamlit scrolls inside its main block), then shoot."""
    height = page.evaluate("() => { const m = document.querySelector('[data-testid=stMain]');"
                           " return Math.max(document.body.scrollHeight, m ? m.scrollHeight : 0); }")
    page.set_viewport_size({"width": width, "height": int(min(max(height + 40, 800), 12_000))})
    page.wait_for_timeout(400)  # plotly re-lays out to the new viewport
    return screenshot(page, name)


def visit_pages(page, prefix: str, server_pid: int | None = None, charts_drawn: dict[str, int] | None = None,
                page_done=None) -> list[PageVisit]:
    """Starting on the Overview page, open every page from the sidebar (no reload, as a user does);
    with ``server_pid``, also the dashboard process's CPU time per page; ``charts_drawn`` (by URL
    path) replaces ``PAGES``' chart counts for data other than the sample's; ``page_done(title)`` is
    called once each page is drawn, before its screenshot."""
    visits = []
    for title, path, charts in PAGES:
        charts = (charts_drawn or {}).get(path, charts)
        cpu = process_cpu_s(server_pid) if server_pid else None
        start = time.perf_counter()
        page.locator("[data-testid=stSidebarNav] a", has_text=title).first.click()
        if path:
            page.wait_for_url(f"**/{path}*", timeout=TIMEOUT_MS)
        heading = "servelens" if not path else title
        num_charts = wait_rendered(page, heading, charts)
        seconds = time.perf_counter() - start
        server_cpu_s = process_cpu_s(server_pid) - cpu if server_pid else None
        exceptions = page.locator("[data-testid=stException]").count()
        if page_done is not None:
            page_done(title)
        shot = full_height_screenshot(page, f"{prefix}-{path or 'overview'}.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
        visits.append(PageVisit(title, path, seconds, exceptions, num_charts, shot, server_cpu_s))
    return visits
