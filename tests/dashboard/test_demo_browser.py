"""The demo's dashboard in Chromium: every page of the demo's output draws every chart with data, shows no
"n/a" where a figure belongs, and its screenshot is kept (in docs/images with SERVELENS_DOCS_IMAGES=1, which
is how the README's pictures are made; else in out/test-artifacts)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from servelens.config import load_config
from servelens.demo import serve_demo
from tests.browser import ARTIFACTS, open_page

from .browse import PAGES, visit_pages

DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
#: Each chart's traces, and how many points they hold (plotly keeps them on the plot's element).
CHART_POINTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(p => ({
    title: (p.layout && p.layout.title && (p.layout.title.text || p.layout.title)) || '',
    points: (p.data || []).reduce((n, t) => n + [t.x, t.y, t.z].filter(Boolean)
        .map(a => a.flat ? a.flat().filter(v => v !== null && v !== undefined).length : 0)
        .reduce((m, k) => Math.max(m, k), 0), 0)}))"""
#: The demo has no dead letters: Traffic draws its two arrival charts, not the dead-letter one.
DEMO_CHARTS = {"traffic": 2}
METRICS = "() => Array.from(document.querySelectorAll('[data-testid=stMetricValue]')).map(m => m.innerText)"


def test_every_page_of_the_demo_draws_its_charts_with_data(demo_output, monkeypatch):
    monkeypatch.chdir(demo_output)  # the demo's relative paths (its key, out/demo), as after `make demo`
    process, url = serve_demo(load_config(), demo_output / "out" / "demo", port=0)
    found: dict[str, tuple[list[dict], list[str]]] = {}
    try:
        with open_page(url) as (page, errors):
            original = page.evaluate

            def charts_of(title: str) -> None:
                found[title] = (original(CHART_POINTS), original(METRICS))

            visits = visit_pages(page, "demo", charts_drawn=DEMO_CHARTS, page_done=charts_of)
            assert not [e for e in errors if "404" not in e], errors
    finally:
        process.terminate()
        process.wait(timeout=20)
    for visit, (title, path, min_charts) in zip(visits, PAGES):
        charts, metrics = found[title]
        assert visit.num_exceptions == 0, title
        assert len(charts) >= DEMO_CHARTS.get(path, min_charts), (title, charts)
        empty = [c["title"] for c in charts if c["points"] == 0]
        assert not empty, f"{title}: charts without data: {empty}"
        assert not [m for m in metrics if "n/a" in m.lower()], (title, metrics)
        if os.environ.get("SERVELENS_DOCS_IMAGES"):
            shutil.copyfile(visit.screenshot, DOCS_IMAGES / f"dashboard-{visit.path or 'overview'}.png")
    assert all((ARTIFACTS / f"demo-{path or 'overview'}.png").is_file() for _, path, _ in PAGES)
