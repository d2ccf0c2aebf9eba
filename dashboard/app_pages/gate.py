"""Gate: the canary verdict, each metric's reason and statistics, the reports and the run manifests."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import streamlit as st

from dashboard import charts, ui
from dashboard.files import servable
from dashboard.runs import GateReportError, gate_conditions_table, gate_metrics_table
from replay.judge import action_words

s = ui.page("Gate", "The verdicts of `servelens gate` and of the nightly comparisons: pass, fail or inconclusive, with "
            "the reason and the statistics of every metric (inconclusive is never a pass).")
reports = ui.gate_reports(s)
if not reports:
    ui.first_run(s, f"no gate report in {s.dashboard.gate_dir}")
    st.stop()
names = [r.name or "(the latest `servelens gate` report)" for r in reports]
wanted = ui.url_get("report")
index = next((i for i, r in enumerate(reports) if r.name == wanted), 0)
if len(reports) > 1:
    chosen = st.selectbox("Report (newest first)", range(len(reports)), index=index, format_func=names.__getitem__,
                          key="gate.report")
else:
    chosen = 0
ref = reports[chosen]
ui.url_set("report", ref.name or None)
gate_json = Path(ref.folder) / "gate.json"
try:
    report = ui.gate_report(ref.folder, gate_json.stat().st_mtime_ns if gate_json.is_file() else 0)
except GateReportError as exc:
    st.error("The gate report cannot be read.")
    st.text(str(exc))
    st.stop()
if report is None:
    ui.first_run(s, f"no gate report in {s.dashboard.gate_dir}")
    st.stop()
if ref.name:
    st.text(f"report: {ref.name}")

alert = {"pass": st.success, "fail": st.error, "inconclusive": st.warning}.get(report.status, st.info)
decision = report.decision if report.decision in ("promote", "continue", "rollback") else None
wait = report.wait_minutes if report.wait_minutes is not None and report.wait_minutes >= 0 else None
# the alert carries only the dashboard's own words; the report's own headline (it may name a configuration) is text
alert(f"{report.status.upper()}: {action_words(report.status, decision, wait, report.rollback_on)}")
st.text(f"verdict: {report.headline}")
if report.failed:
    st.text("Failed: " + "; ".join(report.failed))
if report.undecided:
    st.text("Undecided: " + "; ".join(report.undecided))
if any(note.startswith("baseline itself out of SLO") for note in report.notes):
    st.warning("The baseline itself is out of SLO: the candidate is judged on its own against the absolute conditions.")
for note in report.notes:
    st.text(note)
if report.decision in ("promote", "continue", "rollback"):
    st.info(f"Live canary decision: {report.decision}")
    if report.decision_restore:
        st.text(f"restore: {report.decision_restore}")
    if report.decision_reason:
        st.text(report.decision_reason)
st.subheader("Why")
for reason in report.reasons:
    st.text(f"- {reason}")
if report.score is not None:
    st.caption(f"Score {report.score:.0f}: Kayenta's share of decided metrics that passed (undecided and informative "
               "metrics not counted). The verdict's rule is above: any critical failure or missed condition fails the run.")
st.caption("Written " + dt.datetime.fromtimestamp(report.written_ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))

st.subheader("Runs compared")
st.text(f"baseline:  {report.baseline}")
st.text(f"candidate: {report.candidate}")
columns = st.columns(5)
# only files inside the dashboard's own folders, resolved; the manifests are those of the runs found under
# dashboard.runs_dir (never a path the report names: dashboard/files.py)
runs_by_folder = {str(Path(r.folder).resolve()): r for r in ui.run_list(s)}
downloads = [(served, served.name) for served in (servable(p, [s.dashboard.gate_dir]) for p in report.report_files) if served]
compared = []
for side, source in (("baseline", report.baseline), ("candidate", report.candidate)):
    folder = Path(source).parent if Path(source).name in ("events.parquet", "requests.parquet") else Path(source)
    run = runs_by_folder.get(str(folder.resolve()))
    compared.append(run.name if run is not None else None)
    manifest = servable(run.manifest_path, [s.dashboard.runs_dir]) if run is not None else None
    if manifest is not None:
        downloads.append((manifest, f"{side} manifest.json"))
labels = {"gate.html": "Report (HTML, charts)", "gate.md": "Report (Markdown)", "gate.json": "Report (JSON)",
          "baseline manifest.json": "Baseline manifest", "candidate manifest.json": "Candidate manifest"}
mimes = {".html": "text/html", ".md": "text/markdown", ".json": "application/json"}
for i, (path, name) in enumerate(downloads):
    columns[i % 5].download_button(labels.get(name, "Download"), path.read_bytes(), file_name=path.name,
                                   mime=mimes.get(path.suffix, "application/octet-stream"), key=f"gate-file-{i}")
for path, name in downloads:
    st.text(f"{labels.get(name, name)}: {path}")
if all(compared):
    ui.link_to("app_pages/policies.py", "Open both runs side by side on the Policies page", {"run": compared})

st.subheader("Every metric")
table = gate_metrics_table(report)
statuses = st.multiselect("Status", ["fail", "inconclusive", "pass", "skipped"], default=["fail", "inconclusive", "pass", "skipped"],
                          key="gate.status")
if table.num_rows:
    table = table.filter(pc.is_in(table["status"], pa.array(statuses)))
ui.show_figure(charts.effects_figure(table), "effects")
ui.show_table(table.select(["metric", "group", "status", "critical", "undecided", "informative", "baseline", "candidate",
                            "effect_kind", "effect", "effect_low", "effect_high", "allowed", "critical_effect",
                            "model_error", "num_windows_used", "num_windows", "min_windows", "num_baseline",
                            "num_candidate", "num_resamples", "mann_whitney_u", "mann_whitney_p", "hodges_lehmann_s",
                            "brown_forsythe_stat", "brown_forsythe_p", "reason"]) if table.num_rows else table)
st.caption("Effects are bad effects (positive is worse), relative or absolute as configured, with their block-bootstrap "
           "interval over num_windows windows (num_windows_used of them hold enough requests on both sides; min_windows "
           "are needed before a metric is decided). Mann-Whitney U, the Hodges-Lehmann shift and Brown-Forsythe treat "
           "requests as independent: they describe, the bootstrap decides. See docs/gate.md.")
st.subheader("Absolute conditions (the candidate alone)")
conditions = gate_conditions_table(report)
if conditions.num_rows:
    ui.show_table(conditions)
else:
    st.text("none configured")
