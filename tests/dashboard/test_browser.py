"""The dashboard in a real browser: started by ``dashboard.serve`` on a free loopback port, every
page opened in Chromium, no exception shown, no console error, a screenshot of each kept in
out/test-artifacts."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from dashboard import dashboard_url, serve, wait_until_ready
from servelens.config import Config
from tests.browser import open_page

from .browse import PAGES, visit_pages, wait_rendered

#: Streamlit's frontend, loaded at a page's own URL (a shared link), first probes that path for its
#: server endpoints and falls back to the root: those two 404s are expected, nothing else is.
BASE_PATH_PROBES = ("/_stcore/health", "/_stcore/host-config")
NOT_FOUND = "Failed to load resource: the server responded with a status of 404 (Not Found)"


def test_every_page_in_chromium_without_errors_and_with_screenshots(sample, tmp_path):
    config = Config(lake=sample.settings.lake, privacy=sample.settings.privacy)
    log = (tmp_path / "streamlit.log").open("w")
    process = serve(config, dashboard=sample.settings.dashboard, port=0, stdout=log, stderr=log)
    try:
        url = dashboard_url(process)
        assert url.startswith("http://127.0.0.1:")
        wait_until_ready(url, 90, process)
        with open_page(url) as (page, errors):
            visits = visit_pages(page, "dashboard")
            assert not errors, errors
        for visit, (title, _, min_charts) in zip(visits, PAGES):
            assert visit.num_exceptions == 0, title
            assert visit.num_charts >= min_charts, title
            assert visit.screenshot.is_file() and visit.screenshot.stat().st_size > 20_000
        with open_page(url) as (page, errors):  # then a shared link, loaded directly
            wait_rendered(page, "servelens", 0)
            failed: list[str] = []
            page.on("response", lambda r: failed.append(urlparse(r.url).path) if r.status >= 400 else None)
            page.goto(f"{url}/service-levels?class=interactive")
            wait_rendered(page, "Service levels", 4)
            assert page.locator("[data-testid=stException]").count() == 0
            assert page.get_by_role("combobox", name="Service class").input_value() == "interactive"
            assert "class=interactive" in page.url
        assert all(path in ("/service-levels" + p for p in BASE_PATH_PROBES) for path in failed), failed
        not_found = [e for e in errors if e == "console error: " + NOT_FOUND]
        assert len(not_found) == len(failed) and len(errors) == len(not_found), errors
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
    assert "Traceback" not in Path(tmp_path / "streamlit.log").read_text()
