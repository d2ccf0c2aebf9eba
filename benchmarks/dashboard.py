"""Benchmark: how long each dashboard page takes on a lake of 1,000,000 replayed requests.

Set-up (timed, reported, but not the target): the Azure conversation trace tiled to the size asked
(``TiledWorkload``, burst timing kept) is replayed with the sample scenario (tenants, two classes,
cancellations) on a modelled Llama-3-8B/H100 instance, and every chunk of its events is sanitized
and committed to a temporary lake (``dashboard.sample.replay_into_lake``: one Delta commit per
chunk, as ingest commits). Beside it, replay runs of the whole trace at 1x, 1.5x and 2x load under
FCFS and at 1x and 2x with a 256-token prefill cap, and a gate report comparing the two policies at
1x. Then, once per lake version (the dashboard's own cold start), the request table is derived
into the cache (``materialize_requests``) and each run's metrics are computed.

Measured (the target: under 2 s per page):

- **AppTest**: each page's script run in Streamlit's ``AppTest`` with the derived tables on disk,
  first with the in-memory query cache empty (a page's first view after the lake changed: every
  DuckDB aggregate runs), then again (cached);
- **browser**: ``dashboard.serve`` on a free loopback port and Chromium clicking through the
  sidebar, from the click to the page's script finished and its plotly charts drawn: a user's very
  first visit to a fresh server (its modules and plotly.js still to load), a page's first view on a
  running server whose query caches are empty (as after the lake changed), and cached; a full-height screenshot of each page goes to
  ``out/test-artifacts/dashboard-<size>-<page>.png`` (the README's);
- the dashboard process's peak memory (``VmHWM``), which shows that no page holds the lake;
- beside each wall time, the CPU seconds spent meanwhile (the AppTest process, or the dashboard
  server in the browser passes; all threads, DuckDB's included) and the load average: the machine
  is shared, and CPU time is what a page costs whatever else runs.

    python benchmarks/dashboard.py                 # 1,000,000 requests (the README figure)
    python benchmarks/dashboard.py --quick         # 50,000 requests, under a minute on a built lake
    python benchmarks/dashboard.py --keep DIR      # build the lake in DIR once, reuse it afterwards
    python benchmarks/dashboard.py --keep DIR --build-only   # build now, measure when the machine is quiet
    python benchmarks/dashboard.py --keep DIR --keep-derived # pages only: reuse the derived tables of a last run

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGES = ("overview", "traffic", "service_levels", "policies", "gate", "request_explorer", "tenants")
VIEWER = "tenant-0"
#: Charts a page draws on this lake where it differs from the sample's (``tests.dashboard.browse.PAGES``):
#: the lake has no dead letters, so Traffic draws arrivals and tokens only.
CHARTS_DRAWN = {"traffic": 2}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(root: Path, num_requests: int) -> dict:
    """The lake, the runs and the gate report under ``root`` (skipped when already built)."""
    marker = root / "built.json"
    if marker.is_file() and json.loads(marker.read_text()).get("num_requests") == num_requests:
        log(f"reusing the lake built in {root}")
        return json.loads(marker.read_text())
    from dashboard.sample import SAMPLE_GATE_YAML, SAMPLE_SCENARIO, replay_into_lake
    from privacy.keys import generate_keyring, write_keyfile
    from replay.gate import compare_runs, load_config, load_run
    from replay.policies.fcfs import FcfsConfig
    from replay.report import write_reports
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TableWorkload, TiledWorkload, scale_rate
    from servelens.config import load_config as servelens_config
    from servelens.config import shared_dir

    root.mkdir(parents=True, exist_ok=True)
    keyring = generate_keyring("bench")
    write_keyfile(root / "key.toml", keyring)
    (root / "gate.yaml").write_text(SAMPLE_GATE_YAML)
    base = read_trace("azure-conv", shared_dir(servelens_config()))
    figures: dict = {"num_requests": num_requests}

    log(f"replaying {num_requests:,} requests (tiled Azure conversation trace) into the lake ...")
    start = time.perf_counter()
    workload = TiledWorkload(base, -(-num_requests // base.num_rows), num_requests=num_requests, name="azure-conv")
    summary = replay_into_lake(workload, root / "lake", keyring, chunk_rows=200_000)
    figures["lake_build_s"] = round(time.perf_counter() - start, 1)
    figures["lake_events"] = summary.num_events
    log(f"  {summary.num_events:,} events committed in {figures['lake_build_s']} s")

    start = time.perf_counter()
    runs = root / "runs"
    capped = FcfsConfig(long_prefill_token_threshold=256)
    for name, factor, config in (("fcfs", 1.0, None), ("fcfs@1.5x", 1.5, None), ("fcfs@2x", 2.0, None),
                                 ("fcfs-cap256", 1.0, capped), ("fcfs-cap256@2x", 2.0, capped)):
        trace = scale_rate(base, factor) if factor != 1 else base
        run_replay(TableWorkload(trace, name=f"azure-conv@{factor:g}x"), scenario=SAMPLE_SCENARIO, policy_config=config,
                   out_dir=runs / name)
    config = load_config(root / "gate.yaml")
    baseline, candidate = load_run(runs / "fcfs", "baseline"), load_run(runs / "fcfs-cap256", "candidate")
    write_reports(compare_runs(baseline, candidate, config), baseline, candidate, root / "gate")
    figures["runs_and_gate_s"] = round(time.perf_counter() - start, 1)
    marker.write_text(json.dumps(figures))
    return figures


def settings_for(root: Path):
    from dashboard.config import DashboardConfig, Settings
    from pipelines.config import LakeConfig
    from privacy.config import PrivacyConfig

    return Settings(
        dashboard=DashboardConfig(runs_dir=str(root / "runs"), gate_dir=str(root / "gate"), cache_dir=str(root / "cache"),
                                  gate_config_file=str(root / "gate.yaml"), viewer_tenant=VIEWER),
        lake=LakeConfig(root=str(root / "lake")),
        privacy=PrivacyConfig(key_file=str(root / "key.toml")),
    )


def derive(settings) -> dict:
    """The dashboard's once-per-version work: the lake's request file and every run's metrics."""
    from dashboard import data, runs
    from replay.gate import load_config

    figures = {}
    start = time.perf_counter()
    snapshot = data.lake_snapshot(settings.lake.root)
    path = data.lake_requests_path(snapshot, settings.dashboard.cache_dir)
    figures["lake_request_table_s"] = round(time.perf_counter() - start, 2)
    figures["lake_request_rows"] = data.requests_overview(path).num_requests
    start = time.perf_counter()
    config = load_config(settings.dashboard.gate_config_file).metrics_config()
    for run in runs.list_runs(settings.dashboard.runs_dir):
        runs.run_metric_values(run, settings.dashboard.cache_dir, config)
    figures["run_metrics_s"] = round(time.perf_counter() - start, 2)
    return figures


def apptest_times(settings) -> dict:
    """Each page's AppTest run time: with the query cache empty, then warm."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from dashboard.config import SETTINGS_ENV, settings_json

    os.environ[SETTINGS_ENV] = settings_json(settings)
    app = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
    AppTest.from_file(app, default_timeout=600).run()  # imports (plotly, pandas) outside the timings
    out: dict = {}
    for page in PAGES:
        st.cache_data.clear()
        at = AppTest.from_file(app, default_timeout=600)
        if page != "overview":
            at.run()
            at.switch_page(f"app_pages/{page}.py")
        start, cpu = time.perf_counter(), time.process_time()
        at.run()
        cold, cold_cpu = time.perf_counter() - start, time.process_time() - cpu
        start = time.perf_counter()
        at.run()
        warm = time.perf_counter() - start
        if at.exception:
            raise SystemExit(f"{page}: {at.exception[0].value}")
        out[page] = {"first_view_s": round(cold, 3), "first_view_cpu_s": round(cold_cpu, 3), "cached_s": round(warm, 3),
                     "load_average_1m": round(os.getloadavg()[0], 2)}
        log(f"  AppTest {page}: {cold:.2f} s first view ({cold_cpu:.2f} s CPU, all threads), {warm:.2f} s cached")
    return out


def browser_times(settings, prefix: str) -> dict:
    """Each page in Chromium through the sidebar, in three passes of one browser: a fresh server and
    a fresh browser (the server's Python modules, plotly.js and the app's code not yet loaded: a
    user's very first visit); a restarted server once its modules are imported (the Gate page,
    which reads no lake, is opened first), with empty query caches and the browser's static files
    cached: a page's first view after the lake changed; the same again (cached). Screenshots from the last pass; the dashboard
    process's peak memory."""
    from playwright.sync_api import sync_playwright

    from dashboard import dashboard_url, serve, wait_until_ready
    from servelens.config import Config
    from tests.browser import CHROMIUM_ARGS, chromium_path
    from tests.dashboard.browse import visit_pages, wait_rendered

    config = Config(lake=settings.lake, privacy=settings.privacy)
    logfile = open(Path(tempfile.gettempdir()) / "servelens-dashboard-bench.log", "w")
    passes: dict[str, list] = {}
    errors: list[str] = []
    peak_kib = 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            for server_pass in ("cold", "warm"):
                process = serve(config, dashboard=settings.dashboard, port=0, stdout=logfile, stderr=logfile)
                try:
                    url = dashboard_url(process)
                    wait_until_ready(url, 120, process)
                    page = context.new_page()
                    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    page.goto(url)
                    wait_rendered(page, "servelens", 0)
                    if server_pass == "cold":
                        passes["first_visit"] = visit_pages(page, prefix + "-cold", process.pid, CHARTS_DRAWN)
                    else:
                        # a running server: its modules (plotly, pandas) imported, as after the Gate page,
                        # which queries no lake; the lake pages' query caches are still empty
                        page.locator("[data-testid=stSidebarNav] a", has_text="Gate").first.click()
                        wait_rendered(page, "Gate", 1)
                        passes["first_view"] = visit_pages(page, prefix, process.pid, CHARTS_DRAWN)
                        passes["cached"] = visit_pages(page, prefix, process.pid, CHARTS_DRAWN)
                    page.close()
                    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak_kib = max(peak_kib, int(line.split()[1]))
                finally:
                    process.terminate()
                    process.wait(timeout=30)
        finally:
            browser.close()
            logfile.close()
    for shot in passes["first_visit"]:
        shot.screenshot.unlink(missing_ok=True)
    if errors or any(v.num_exceptions for visits in passes.values() for v in visits):
        raise SystemExit(f"the browser saw errors: {errors}")
    out = {}
    for i, visit in enumerate(passes["first_view"]):
        name = visit.path or "overview"
        out[name] = {kind: round(passes[kind][i].seconds, 3) for kind in ("first_visit", "first_view", "cached")}
        out[name] |= {f"{kind}_server_cpu_s": round(passes[kind][i].server_cpu_s, 2) for kind in ("first_view", "cached")}
        out[name]["screenshot"] = str(visit.screenshot)
        log(f"  browser {name}: {out[name]['first_visit']:.2f} s first visit (plotly.js loading), "
            f"{out[name]['first_view']:.2f} s first view ({out[name]['first_view_server_cpu_s']:.2f} s server CPU), "
            f"{out[name]['cached']:.2f} s cached")
    return {"pages": out, "dashboard_peak_rss_mb": round(peak_kib / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50,000 requests (under a minute once built)")
    parser.add_argument("--requests", type=int, default=None, help="lake size [default: 1,000,000; 50,000 with --quick]")
    parser.add_argument("--keep", type=Path, default=None, help="build the lake here once and reuse it")
    parser.add_argument("--no-browser", action="store_true", help="AppTest timings only")
    parser.add_argument("--build-only", action="store_true", help="with --keep: build the lake and stop (measure later)")
    parser.add_argument("--keep-derived", action="store_true",
                        help="with --keep: reuse the derived request table and run metrics in its cache (pages only)")
    args = parser.parse_args()
    num_requests = args.requests or (50_000 if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory(prefix="servelens-dashboard-bench-") as tmp:
        root = args.keep or Path(tmp)
        figures = {"benchmark": "dashboard", "num_requests": num_requests, "cpus": os.cpu_count(),
                   "load_average_1m": round(os.getloadavg()[0], 2)}
        figures |= build(root, num_requests)
        if args.build_only:
            print(json.dumps(figures))
            return
        settings = settings_for(root)
        if not args.keep_derived:
            shutil.rmtree(root / "cache", ignore_errors=True)  # the derivation is measured unless told otherwise
        log("deriving the request table and run metrics (once per lake version) ...")
        derived = derive(settings)
        figures |= derived if not args.keep_derived else {"derived_tables": "reused", **{
            k: v for k, v in derived.items() if k == "lake_request_rows"}}
        log("AppTest page runs ...")
        figures["apptest"] = apptest_times(settings)
        if not args.no_browser:
            log("browser page views ...")
            prefix = f"dashboard-{num_requests // 1000}k" if num_requests < 1_000_000 else f"dashboard-{num_requests // 1_000_000}m"
            figures["browser"] = browser_times(settings, prefix)
        slowest = max(v["first_view_s"] for v in figures["apptest"].values())
        figures["slowest_page_first_view_s"] = slowest
        figures["target_met"] = slowest < 2.0 and all(
            v["first_view"] < 2.0 for v in figures.get("browser", {}).get("pages", {}).values())
        figures["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
