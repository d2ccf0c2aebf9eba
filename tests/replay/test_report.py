"""Gate reports: JSON and Markdown contents, and the HTML page in a real headless Chromium."""

from __future__ import annotations

import json

from replay.gate import Run, compare_runs, decide, default_config
from replay.report import verdict_markdown, write_reports
from tests.browser import open_page, screenshot
from tests.replay.gate_data import synthetic_requests


def _verdict(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"policy": "fcfs"}')
    base = Run("baseline", synthetic_requests(seed=1), None, "runs/fcfs", str(manifest), "ab" * 32)
    cand = Run("candidate", synthetic_requests(seed=1, ttft_factor={"interactive": 1.3}), None, "runs/new", None, None)
    verdict = compare_runs(base, cand, default_config())
    return verdict, base, cand


def test_json_and_markdown_carry_every_metric_and_its_reason(tmp_path):
    verdict, base, cand = _verdict(tmp_path)
    paths = write_reports(verdict, base, cand, tmp_path / "out", decide(verdict, "policy=fcfs@v3"))
    data = json.loads(paths["json"].read_text())
    assert data["status"] == "fail" and data["exit_code"] == 1
    assert data["decision"] == {"action": "rollback", "restore": "policy=fcfs@v3", "reason": data["decision"]["reason"]}
    assert len(data["metrics"]) == len(verdict.metrics) and all(m["reason"] for m in data["metrics"])
    assert data["baseline"]["manifest"].endswith("manifest.json")
    text = verdict_markdown(verdict)
    assert text.startswith("## servelens gate: **FAIL**")
    assert text.count("\n| ") == len(verdict.metrics) + 1  # the header row and one row per metric


def test_the_html_report_opens_in_chromium_without_errors_and_shows_its_charts(tmp_path):
    verdict, base, cand = _verdict(tmp_path)
    paths = write_reports(verdict, base, cand, tmp_path / "out")
    with open_page(paths["html"].as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        num_charts = page.locator(".js-plotly-plot").count()
        num_rows = page.locator("table tr").count()
        shot = screenshot(page, "gate-report.png")
        links = page.locator("a[href$='manifest.json']").count()
    assert errors == []
    assert num_charts == 3 and num_rows == len(verdict.metrics) + 1
    assert links == 1  # the baseline's manifest is linked
    assert shot.stat().st_size > 50_000  # a page with charts, not a blank one
