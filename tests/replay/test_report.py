"""Gate reports: the verdict and action first, JSON and Markdown contents, and the HTML page in a
real headless Chromium."""

from __future__ import annotations

import dataclasses
import json

from replay.gate import Run, compare_runs, decide, default_config
from replay.report import verdict_markdown, write_reports
from tests.browser import open_page, screenshot
from tests.replay.gate_data import synthetic_requests

GATE = dataclasses.replace(default_config(), window_s=10.0)


def _verdict(tmp_path, **candidate):
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"policy": "fcfs"}')
    base = Run("baseline", synthetic_requests(seed=1), None, "runs/fcfs", str(manifest), "ab" * 32)
    cand = Run("candidate", synthetic_requests(seed=1, **(candidate or {"ttft_factor": {"interactive": 1.3}})), None,
               "runs/new", None, None)
    return compare_runs(base, cand, GATE), base, cand


def test_json_and_markdown_lead_with_the_verdict_the_action_and_what_failed(tmp_path):
    verdict, base, cand = _verdict(tmp_path)
    paths = write_reports(verdict, base, cand, tmp_path / "out", decide(verdict, "policy=fcfs@v3"))
    data = json.loads(paths["json"].read_text())
    assert data["status"] == "fail" and data["exit_code"] == 1 and data["headline"] == "FAIL: roll back to policy=fcfs@v3"
    assert data["decision"]["action"] == "rollback" and data["decision"]["restore"] == "policy=fcfs@v3"
    assert data["failed"][0].startswith("ttft_") and "(interactive" in data["failed"][0]
    assert len(data["metrics"]) == len(verdict.metrics) and all(m["reason"] for m in data["metrics"])
    assert all(m["difference"]["num_windows"] == 40 and m["min_windows"] == 30 for m in data["metrics"])
    assert data["baseline"]["manifest"].endswith("manifest.json")
    text = verdict_markdown(verdict).splitlines()
    assert text[0] == "## servelens gate: **FAIL: do not ship the candidate**"
    assert text[2].startswith("- Failed: ttft\\_")
    rows = [line for line in text if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(verdict.metrics) + len(verdict.conditions) + 2  # two header rows
    first_metric = rows[len(verdict.conditions) + 2]
    assert "fail (critical)" in first_metric  # the table starts with the failures


def test_an_undecided_run_says_how_much_more_traffic_and_what_holds_it(tmp_path):
    base = Run("baseline", synthetic_requests(seed=1, num_requests=1200), None, "b", None, None)
    cand = Run("candidate", synthetic_requests(seed=2, num_requests=1200), None, "c", None, None)
    verdict = compare_runs(base, cand, GATE)
    text = verdict_markdown(verdict, decide(verdict, None))
    assert text.startswith(f"## servelens gate: **INCONCLUSIVE: continue {verdict.wait_minutes:.0f} more minutes**")
    assert "- Undecided: goodput\\_rps: not enough data" in text


def test_the_html_report_opens_in_chromium_without_errors_and_shows_its_charts(tmp_path):
    verdict, base, cand = _verdict(tmp_path)
    paths = write_reports(verdict, base, cand, tmp_path / "out")
    with open_page(paths["html"].as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        num_charts = page.locator(".js-plotly-plot").count()
        num_rows = page.locator("table.metrics tr").count()
        title = page.locator("h1").inner_text()
        subplot_titles = page.locator(".js-plotly-plot .annotation-text").all_text_contents()
        shot = screenshot(page, "gate-report.png")
        links = page.locator("a[href$='manifest.json']").count()
    assert errors == []
    assert title == "FAIL: do not ship the candidate"
    assert num_charts == 3 and num_rows == len(verdict.metrics) + 1
    assert any(t.startswith("ITL p99 gap, s") for t in subplot_titles)  # the ITL distribution
    assert "relative effects, % of the baseline" in subplot_titles and "absolute effects, in each metric's unit" in subplot_titles
    assert links == 1  # the baseline's manifest is linked
    assert shot.stat().st_size > 50_000  # a page with charts, not a blank one
