"""Every page under Streamlit's AppTest: on the sample lake, on an empty one, with filters in the
URL, against a URL that tries to widen the tenant scope, and with hostile text in the data."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dashboard import data
from privacy.views import TenantScope

from .conftest import KEYRING, PAGES, VIEWER


def _clean(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _charts(at) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def _metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _texts(at) -> list[str]:
    return [t.value for t in at.text]


def _lake_requests(sample):
    snapshot = data.lake_snapshot(sample.settings.lake.root)
    return pq.read_table(data.lake_requests_path(snapshot, sample.settings.dashboard.cache_dir))


def _ids_of(requests, tenant: str) -> list[str]:
    scope = TenantScope.for_tenant(KEYRING, tenant)
    return requests.filter(pc.is_in(requests["tenant"], pc.cast(sorted(scope.pseudonyms), "string")))["request_id"].to_pylist()


def test_the_overview_says_what_the_dashboard_holds(sample, app):
    at = app(sample.settings)
    _clean(at)
    metrics = _metrics(at)
    assert metrics["Lake version (events)"].startswith("v") and metrics["Replay runs"] == "4"
    report = json.loads((sample.root / "gate" / "gate.json").read_text())
    assert metrics["Gate reports"] == "1" and metrics["Latest verdict"] == report["status"]
    assert any(sample.settings.lake.root in t for t in _texts(at))


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_the_sample_lake(sample, app, page):
    at = app(sample.settings, page)
    _clean(at)
    charts, metrics = _charts(at), _metrics(at)
    if page == "traffic":
        assert metrics["Requests in the window"] == f"{sample.num_requests:,}"
        assert float(metrics["Busiest second, requests"]) >= float(metrics["Mean arrivals per second"])
        assert {"ingest-test"} <= set(at.dataframe[0].value["consumer"])
        titles = [c["layout"]["title"]["text"] for c in charts]
        assert any("Dead letters" in t for t in titles) and any("busiest second" in t for t in titles)
        assert any("Token volume" in t for t in titles)
    elif page == "service_levels":
        (cdf,) = [c for c in charts if "Latency CDFs" in c["layout"]["title"]["text"]]
        boundaries = [a["text"] for a in cdf["layout"]["annotations"]]
        assert any(b.startswith("TTFT, s: arrival -> first token (user-facing, not vLLM's scheduled-based") for b in boundaries)
        assert any(b.startswith("ITL, s: each request's p99 gap") for b in boundaries)
        assert any(b.startswith("E2E, s: arrival -> last token") for b in boundaries)
        assert {t["name"] for t in cdf["data"]} == {"batch", "interactive"}
        titles = " ".join(c["layout"]["title"]["text"] for c in charts)
        assert "Attainment per class" in titles and "SLO goodput per class" in titles and "Rejected share" in titles
        per_class = at.dataframe[1].value
        assert set(per_class["service_class"]) == {"batch", "interactive"} and per_class["num_requests"].sum() == sample.num_requests
    elif page == "load_latency":
        titles = [c["layout"]["title"]["text"] for c in charts]
        for words in ("TTFT percentiles over time", "ITL (each request's p99 gap) percentiles", "E2E percentiles",
                      "Queue depth and KV-cache usage", "Prompt and output lengths", "Finish reasons"):
            assert any(words in t for t in titles), (words, titles)
        table = at.dataframe[0].value  # the percentile table comes first
        assert set(table["class"]) == {"batch", "interactive"} and (table["p50_s"] <= table["p99_s"]).all()
        (queue,) = [c for c in charts if "Queue depth" in c["layout"]["title"]["text"]]
        names = {t["name"] for t in queue["data"]}
        assert {"requests waiting", "requests running"} <= names and any(n.startswith("KV cache in use") for n in names)
        kv = [v for t in queue["data"] if t["name"].startswith("KV cache") for v in t["y"]]
        assert kv and all(0 <= v <= 1 for v in kv) and max(kv) > 0
        (finish,) = [c for c in charts if "Finish reasons" in c["layout"]["title"]["text"]]
        assert sum(sum(t["y"]) for t in finish["data"]) <= sample.num_requests and finish["data"]
        for chart in charts:  # every axis says its unit or what it counts
            assert chart["layout"]["xaxis"]["title"]["text"] and chart["layout"]["yaxis"]["title"]["text"]
    elif page == "policies":
        table = at.dataframe[0].value
        assert list(table["run"]) == ["fcfs", "fcfs-chunk256", "fcfs@1.5x", "fcfs@2x"]
        titles = [c["layout"]["title"]["text"] for c in charts]
        assert any("Goodput against cost" in t for t in titles) and any("Load sweep" in t for t in titles)
        (sweep,) = [c for c in charts if "Load sweep" in c["layout"]["title"]["text"]]
        assert sorted(len(t["x"]) for t in sweep["data"]) == [1, 3]  # fcfs at 1x, 1.5x, 2x; the other config once
        assert len(at.get("download_button")) == 4
    elif page == "gate":
        report = json.loads((sample.root / "gate" / "gate.json").read_text())
        alert = {"pass": at.success, "fail": at.error, "inconclusive": at.warning}[report["status"]]
        assert alert[0].value == report["headline"]  # the verdict and the action first (offline: no decision)
        assert f"verdict: {report['headline']}" in _texts(at)
        if report["undecided"]:
            assert "Undecided: " + "; ".join(report["undecided"]) in _texts(at)
        assert [t for t in _texts(at) if t.startswith("- ")] == [f"- {r}" for r in report["reasons"]]
        assert len(at.dataframe[0].value) == len(report["metrics"])
        assert len(at.dataframe[1].value) == len(report["conditions"])
        assert len(at.get("download_button")) == 5  # three reports, two manifests
        (effects,) = [c for c in charts if "Bad effect" in c["layout"]["title"]["text"]]
        assert [a["text"] for a in effects["layout"]["annotations"]] == [
            "relative effects, % of the baseline", "absolute effects, in each metric's unit"]
    elif page == "request_explorer":
        assert at.selectbox[0].options[0] == "the lake"
        assert "Queue, s (arrival -> scheduled)" in metrics
        titles = [c["layout"]["title"]["text"] for c in charts]
        assert any("request's life" in t for t in titles) and any("Batch composition" in t for t in titles)
        requested = at.selectbox(key="explorer.request").value
        assert requested in _ids_of(_lake_requests(sample), VIEWER)
    elif page == "tenants":
        assert metrics["Tenants hidden (fewer than k requests)"] == "1"
        tenants = at.dataframe[0].value
        assert len(tenants) == 8 and tenants["suppressed"].sum() == 1
        assert "ttft_p99_s" not in tenants.columns  # no timing across tenants
        assert metrics["Requests"] == f"{len(_ids_of(_lake_requests(sample), VIEWER)):,}"


@pytest.mark.parametrize("page", ("overview", *PAGES))
def test_every_page_on_an_empty_lake_says_how_to_get_data(empty, app, page):
    at = app(empty, None if page == "overview" else page)
    _clean(at)
    commands = "\n".join(c.value for c in at.code)
    assert "servelens ingest" in commands and "servelens replay --workload azure-conv" in commands
    assert "servelens gate --baseline" in commands and "servelens demo" in commands
    assert any("There is no data for this page yet" in i.value for i in at.info)


def test_filters_come_from_the_url_and_go_back_into_it(sample, app):
    requests = _lake_requests(sample)
    first = pc.min(requests["arrival_ns"]).as_py() // 10**9
    start = dt.datetime.fromtimestamp(first + 30, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = dt.datetime.fromtimestamp(first + 90, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    at = app(sample.settings, "service_levels", {"class": "interactive", "from": start, "to": end})
    _clean(at)
    assert at.selectbox(key="service.class").value == "interactive"
    lo, hi = at.slider(key="service.window").value
    grid = data.WINDOW_GRID_S
    snapped = ((first + 30) // grid * grid, -(-(first + 90) // grid) * grid)  # whole cells of the fixed grid
    iso = [dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") for t in snapped]
    assert [lo.strftime("%Y-%m-%dT%H:%M:%SZ"), hi.strftime("%Y-%m-%dT%H:%M:%SZ")] == iso
    per_class = at.dataframe[1].value
    assert list(per_class["service_class"]) == ["interactive"]
    rows = requests.filter(pc.and_(pc.and_(pc.greater_equal(requests["arrival_ns"], snapped[0] * 10**9),
                                           pc.less(requests["arrival_ns"], snapped[1] * 10**9)),
                                   pc.equal(requests["service_class"], "interactive"))).to_pylist()
    cells: dict[int, list] = {}
    for row in rows:
        cells.setdefault(row["arrival_ns"] // (grid * 10**9), []).append(row["tenant"])
    # only grid cells with k tenants and k requests count (docs/privacy.md)
    k = sample.settings.privacy.min_group_size
    assert per_class["num_requests"].iloc[0] == sum(len(t) for t in cells.values() if len(set(t)) >= k and len(t) >= k) > 0
    assert at.query_params["class"] == "interactive" and at.query_params["from"] == iso[0]

    at = app(sample.settings, "policies", {"run": ["fcfs", "fcfs@2x"], "class": "batch"})
    _clean(at)
    assert at.multiselect(key="policies.runs").value == ["fcfs", "fcfs@2x"]
    assert list(at.dataframe[0].value["run"]) == ["fcfs", "fcfs@2x"] and at.query_params["run"] == ["fcfs", "fcfs@2x"]

    run_requests = pq.read_table(sample.root / "runs" / "fcfs@2x" / "events.parquet", columns=["request_id"])
    wanted = run_requests["request_id"][0].as_py()
    at = app(sample.settings, "request_explorer", {"source": "fcfs@2x", "request": wanted})
    _clean(at)
    assert at.selectbox(key="explorer.source").value == "fcfs@2x"
    assert at.selectbox(key="explorer.request").value == wanted
    assert any(t.startswith(f"request {wanted};") for t in _texts(at))


HOSTILE_PARAMS = {"viewer_tenant": "tenant-1", "tenant": None, "scope": "all", "tenants": "*", "k": "1",
                  "min_group_size": "1", "source": "the lake"}


def test_the_url_cannot_widen_the_tenant_scope(sample, app):
    requests = _lake_requests(sample)
    other_id = _ids_of(requests, "tenant-1")[0]
    hostile = dict(HOSTILE_PARAMS, tenant=sorted(TenantScope.for_tenant(KEYRING, "tenant-1").pseudonyms)[0])

    # no viewer configured: a URL naming a tenant shows no tenant detail and opens no lake request
    anonymous = sample.with_dashboard(viewer_tenant=None)
    at = app(anonymous, "tenants", hostile)
    _clean(at)
    assert "Attainment" not in _metrics(at) and any("No viewer tenant is configured" in i.value for i in at.info)
    assert at.dataframe[0].value["suppressed"].sum() == 1  # k from the server, not from the URL
    at = app(anonymous, "request_explorer", dict(hostile, request=other_id))
    _clean(at)
    assert not [c for c in _charts(at) if "request's life" in c["layout"]["title"]["text"]]
    assert any("No request with that id among the requests you may see" in w.value for w in at.warning)

    # a configured viewer stays itself whatever the URL says
    plain = app(sample.settings, "tenants")
    at = app(sample.settings, "tenants", hostile)
    _clean(at)
    assert _metrics(at)["Requests"] == _metrics(plain)["Requests"] == f"{len(_ids_of(requests, VIEWER)):,}"
    assert set(at.dataframe[2].value["request_id"]) <= set(_ids_of(requests, VIEWER))
    at = app(sample.settings, "request_explorer", dict(hostile, request=other_id))
    _clean(at)
    assert not [c for c in _charts(at) if "request's life" in c["layout"]["title"]["text"]]
    assert not any(other_id in t for t in _texts(at) if t.startswith("request "))


PAYLOAD = "[click](javascript:alert(1)) <img src=x onerror=alert(2)> **bold** :red[red] $x^2$"


def test_text_from_data_is_shown_as_text_never_as_markdown(sample, app, tmp_path):
    runs = tmp_path / "runs"
    hostile_run = runs / "[run](javascript:alert(3)) <img src=x onerror=alert(5)>"  # no '/' in a folder name
    shutil.copytree(sample.root / "runs" / "fcfs", hostile_run)
    manifest = json.loads((hostile_run / "manifest.json").read_text())
    manifest["policy"]["name"] = "<script>alert(4)</script>"
    manifest["workload"]["name"] = PAYLOAD
    (hostile_run / "manifest.json").write_text(json.dumps(manifest))
    gate = tmp_path / "gate"
    shutil.copytree(sample.root / "gate", gate)
    report = json.loads((gate / "gate.json").read_text())
    report["reasons"] = [PAYLOAD]
    report["baseline"]["source"] = PAYLOAD
    report["metrics"][0]["reason"] = PAYLOAD
    (gate / "gate.json").write_text(json.dumps(report))
    settings = sample.with_dashboard(runs_dir=str(runs), gate_dir=str(gate), cache_dir=str(tmp_path / "cache"))
    for page in ("policies", "gate", "request_explorer"):
        at = app(settings, page)
        _clean(at)
        rendered = [e.value for kind in ("markdown", "caption", "title", "header", "subheader", "info", "warning",
                                         "success", "error") for e in getattr(at, kind)]
        rendered += [w.label for w in (*at.selectbox, *at.multiselect, *at.slider)] + [m.label for m in at.metric]
        for text in rendered:
            for marker in ("javascript:", "<img", "<script", "<b>", ":red[", "$x^2$"):
                assert marker not in text, (page, text)
        for chart in _charts(at):
            dumped = json.dumps(chart)
            assert "<script" not in dumped and "<img" not in dumped, page
        shown = " ".join(_texts(at)) + " ".join(" ".join(map(str, d.value.to_numpy().ravel())) for d in at.dataframe)
        if page == "gate":
            assert PAYLOAD in shown
        if page == "policies":
            assert "<script>alert(4)</script>" in shown and hostile_run.name in shown


def test_a_new_lake_version_is_derived_in_the_background_while_the_previous_one_is_shown(sample, app, tmp_path):
    from dashboard.sample import LakeSink
    from pipelines.lake import Lake
    from privacy.sanitize import Sanitizer
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TableWorkload
    from servelens.config import load_config, shared_dir

    shutil.copytree(sample.settings.lake.root, tmp_path / "lake")
    settings = sample.with_dashboard(cache_dir=str(tmp_path / "cache"))
    settings = type(settings)(settings.dashboard, type(settings.lake)(root=str(tmp_path / "lake")), settings.privacy)
    first = data.lake_snapshot(settings.lake.root)
    data.lake_requests_path(first, settings.dashboard.cache_dir)
    more = read_trace("azure-conv", shared_dir(load_config())).slice(5000, 50)  # later requests: new ids
    run_replay(TableWorkload(more, name="more"), sink=LakeSink(Lake(settings.lake.root), Sanitizer(KEYRING), "more"))
    second = data.lake_snapshot(settings.lake.root)
    assert second.events_version > first.events_version

    at = app(settings, "traffic")
    _clean(at)
    assert any(f"Showing lake version v{first.events_version}; v{second.events_version} is being derived" in c.value
               for c in at.caption)
    assert _metrics(at)["Requests in the window"] == f"{sample.num_requests:,}"
    from dashboard import ui

    ui._BUILDS[str(data.requests_file(second, settings.dashboard.cache_dir))].join()  # the page's own builder thread
    assert data.requests_file(second, settings.dashboard.cache_dir).is_file()
    at = app(settings, "traffic")
    _clean(at)
    assert not any("is being derived" in c.value for c in at.caption)
    assert any(f"Lake version v{second.events_version};" in c.value for c in at.caption)
    assert _metrics(at)["Requests in the window"] == f"{sample.num_requests + 50:,}"


def test_the_nightly_layout_of_runs_and_gate_reports_is_browsed_by_day(sample, app, tmp_path):
    import os

    runs_dir, gate_dir = tmp_path / "replay", tmp_path / "gate"
    for name in ("fcfs", "fcfs@1.5x", "fcfs@2x"):
        shutil.copytree(sample.root / "runs" / name, runs_dir / "2023-11-16" / name)
    shutil.copytree(sample.root / "gate", gate_dir)
    shutil.copytree(sample.root / "gate", gate_dir / "2023-11-16" / "fcfs-chunk256@1x")
    os.utime(gate_dir / "gate.json", ns=(1, 1))  # the older of the two
    settings = sample.with_dashboard(runs_dir=str(runs_dir), gate_dir=str(gate_dir), cache_dir=str(tmp_path / "cache"))

    at = app(settings)
    _clean(at)
    assert _metrics(at)["Replay runs"] == "3" and _metrics(at)["Gate reports"] == "2"
    at = app(settings, "policies")
    _clean(at)
    assert list(at.dataframe[0].value["run"]) == ["2023-11-16/fcfs", "2023-11-16/fcfs@1.5x", "2023-11-16/fcfs@2x"]
    (sweep,) = [c for c in _charts(at) if "Load sweep" in c["layout"]["title"]["text"]]
    assert [len(t["x"]) for t in sweep["data"]] == [3]  # one line through 1x, 1.5x and 2x
    at = app(settings, "gate")
    _clean(at)
    assert "report: 2023-11-16/fcfs-chunk256@1x" in _texts(at)  # the newest first
    at = app(settings, "gate", {"report": ""})
    at.selectbox(key="gate.report").select(1).run()
    _clean(at)
    assert "report: 2023-11-16/fcfs-chunk256@1x" not in _texts(at) and "report" not in at.query_params


def test_policies_says_which_runs_went_beyond_their_calibration_s_fitted_load(sample, app, tmp_path):
    """A run whose manifest counts minutes beyond its calibration's fitted load (``replay.load``) is counted in a
    warning above the comparison and its minutes shown beside its manifest; runs without a fitted load to
    compare (the sample's: no calibration) show nothing, and no warning appears when none is beyond."""
    runs = tmp_path / "runs"
    for name in ("fcfs", "fcfs@2x"):
        shutil.copytree(sample.root / "runs" / name, runs / name)
    manifest_path = runs / "fcfs@2x" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert "fitted" not in manifest["load"]  # no calibration: nothing to be beyond
    manifest["load"].update(fitted={"batch_share": 0.2, "kv_share": 0.2}, windows_beyond_fitted=3)
    manifest_path.write_text(json.dumps(manifest))
    settings = sample.with_dashboard(runs_dir=str(runs), cache_dir=str(tmp_path / "cache"))
    at = app(settings, "policies")
    _clean(at)
    (warning,) = at.warning
    assert warning.value.startswith("1 of the chosen runs went beyond the load their calibration was fitted on")
    (listed,) = [d.value for d in at.dataframe if "minutes_beyond_fitted_load" in d.value.columns]
    assert dict(zip(listed["run"], listed["minutes_beyond_fitted_load"].fillna(-1))) == {"fcfs": -1, "fcfs@2x": 3}
    at = app(settings, "policies", {"run": ["fcfs"]})
    _clean(at)
    assert not at.warning


def hostile_gate_dir(sample, tmp_path: Path) -> tuple[Path, list[Path]]:
    """A copy of the sample's gate reports whose gate.json names the pseudonym key file and
    /etc/shadow as the runs' manifests, with gate.md a symbolic link to the key file: the issue #22
    attack. Returns the folder and the files that must never be served."""
    gate = tmp_path / "gate"
    shutil.copytree(sample.root / "gate", gate)
    report = json.loads((gate / "gate.json").read_text())
    key = sample.root / "key.toml"
    report["baseline"]["manifest"], report["candidate"]["manifest"] = str(key), "/etc/shadow"
    (gate / "gate.json").write_text(json.dumps(report))
    (gate / "gate.md").unlink()
    (gate / "gate.md").symlink_to(key)
    return gate, [key, Path("/etc/shadow")]


def test_the_gate_page_serves_only_files_inside_its_folders(sample, app, tmp_path):
    gate, secrets = hostile_gate_dir(sample, tmp_path)
    at = app(sample.with_dashboard(gate_dir=str(gate)), "gate")
    assert not at.exception
    buttons = at.get("download_button")
    # gate.json and gate.html of the report folder, and the two runs' own manifests found under runs_dir
    assert len(buttons) == 4
    shown = " ".join(_texts(at))
    assert all(str(secret) not in shown for secret in secrets)
    assert str(sample.root / "runs" / "fcfs" / "manifest.json") in shown


def test_a_run_whose_request_table_is_cut_short_is_named_and_the_others_still_show(sample, app, tmp_path):
    runs_dir = tmp_path / "replay"
    for name in ("fcfs", "fcfs@2x"):
        shutil.copytree(sample.root / "runs" / name, runs_dir / name)
    broken = runs_dir / "fcfs@2x" / "requests.parquet"
    broken.write_bytes(broken.read_bytes()[:200])  # a copy cut short
    at = app(sample.with_dashboard(runs_dir=str(runs_dir), cache_dir=str(tmp_path / "cache")), "policies")
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value.split(";")[0] for e in at.error] == ["1 of the 2 chosen runs cannot be read (a file cut short, or not Parquet)"]
    assert any(t.startswith("fcfs@2x: ArrowInvalid") for t in _texts(at))
    assert list(at.dataframe[0].value["run"]) == ["fcfs"]  # the readable run is still compared
    events = runs_dir / "fcfs@2x" / "events.parquet"  # the explorer derives its table from the run's events
    events.write_bytes(events.read_bytes()[:200])
    at = app(sample.with_dashboard(runs_dir=str(runs_dir), cache_dir=str(tmp_path / "cache2")), "request_explorer",
             {"source": "fcfs@2x"})
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value.split(".")[0] for e in at.error] == ["The chosen run cannot be read (a file cut short, or not Parquet)"]
    assert any(t.startswith("fcfs@2x: ") for t in _texts(at))
