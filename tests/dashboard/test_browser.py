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


def _files_outside_are_never_served(url: str, page, secrets: list[Path]) -> None:
    """Issue #22: the Gate page of a hostile report offers no button for the key file or /etc/shadow,
    and every URL outside the app (traversal through Streamlit's file routes included) gets 404."""
    import urllib.error
    import urllib.request

    page.goto(f"{url}/gate")
    wait_rendered(page, "Gate", 1)
    labels = [b.inner_text() for b in page.get_by_test_id("stDownloadButton").all()]
    assert len(labels) == 4 and not any("Markdown" in label for label in labels), labels
    assert not any(str(secret) in page.content() for secret in secrets)
    key = secrets[0]
    for path in (f"/media/../../..{key}", f"/media/%2e%2e/%2e%2e{key}", f"/app/static/../../..{key}", f"/app/static{key}",
                 f"/component/..%2f..{key}", "/media/" + "a" * 64 + ".toml", key.as_posix(), "/etc/shadow",
                 "/etc/passwd", "/gate/../../etc/passwd", "/nope"):
        try:
            with urllib.request.urlopen(url + path, timeout=10) as response:
                body, status = response.read(), response.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
        assert key.read_bytes() not in body, path
        # neither a page nor Streamlit's own: 404 (dashboard.known_paths), never the app shell, never a file
        assert status == 404 and b'<div id="root">' not in body, (path, status)
    for path in ("/nope", "/etc/shadow", key.as_posix(), "/gate/../../etc/passwd"):  # the browser normalizes the '..'
        response = page.goto(url + path)
        assert response is not None and response.status == 404, (path, response and response.status)


def test_every_page_in_chromium_without_errors_and_with_screenshots(sample, tmp_path):
    from tests.dashboard.test_app import hostile_gate_dir

    config = Config(lake=sample.settings.lake, privacy=sample.settings.privacy)
    gate, secrets = hostile_gate_dir(sample, tmp_path)
    log = (tmp_path / "streamlit.log").open("w")
    process = serve(config, dashboard=sample.with_dashboard(gate_dir=str(gate)).dashboard, port=0, stdout=log, stderr=log)
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
        with open_page(url) as (page, _):
            _files_outside_are_never_served(url, page, secrets)
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
    assert "Traceback" not in Path(tmp_path / "streamlit.log").read_text()
