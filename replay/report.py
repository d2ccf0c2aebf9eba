"""Gate reports, read in ten seconds: the verdict and the action first ("FAIL: roll back", "PASS:
promote", "INCONCLUSIVE: continue 12 more minutes", or the offline equivalents), what failed and what
is undecided next, then the notes (a baseline out of SLO), the absolute conditions and every metric
with the evidence behind its interval.

JSON for machines, Markdown for a pull-request comment, and a self-contained HTML page with plotly
charts (TTFT, ITL and E2E distributions per class, goodput over time, each metric's effect against
its thresholds, percent and absolute effects on separate axes). Every figure names the runs and
the manifests it came from; the HTML embeds plotly.js, so it opens offline.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

import numpy as np

from replay.gate import FAIL, INCONCLUSIVE, Decision, MetricVerdict, Run, Verdict, headline
from replay.judge import failed_names
from replay.metrics import load_requests
from servelens.errors import ServelensError

STATUS_COLOR = {"pass": "#1a7f37", "fail": "#cf222e", "inconclusive": "#9a6700", "skipped": "#6e7781"}
_CDF_POINTS = 400


def _plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_plain(o) for o in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def undecided_names(verdict: Verdict) -> list[str]:
    """The undecided metrics and conditions that hold the run (not informative), each with why."""
    held = [f"{_label(m)}: {m.undecided}" for m in verdict.metrics
            if m.status == INCONCLUSIVE and not m.informative and (m.critical_possible or m.undecided == "not enough data")]
    return held + [f"condition {_label(c)} {c.bound}: {c.undecided}" for c in verdict.conditions if c.status == INCONCLUSIVE]


def _label(m) -> str:
    return m.metric + (f" ({m.group})" if m.group else "")


def status_text(m: MetricVerdict) -> str:
    """'fail (critical)', 'undecided: not enough data', 'pass (informative)'..."""
    text = {"inconclusive": f"undecided: {m.undecided}"}.get(m.status, m.status)
    return text + (" (critical)" if m.critical else "") + (" (informative)" if m.informative else "")


def verdict_dict(verdict: Verdict, decision: Decision | None = None) -> dict:
    """Everything the gate decided and why, as plain data (the JSON report)."""
    return {
        "status": verdict.status,
        "exit_code": verdict.exit_code,
        "headline": headline(verdict, decision),
        "wait_minutes": verdict.wait_minutes,
        "failed": failed_names(verdict),
        "undecided": undecided_names(verdict),
        "notes": list(verdict.notes),
        "score": verdict.score,
        "reasons": list(verdict.reasons),
        "baseline": {"source": verdict.baseline, "manifest": verdict.baseline_manifest},
        "candidate": {"source": verdict.candidate, "manifest": verdict.candidate_manifest},
        "decision": _plain(decision) if decision else None,
        "conditions": [_plain(c) for c in verdict.conditions],
        "metrics": [_plain(m) for m in verdict.metrics],
        "config": _plain(verdict.config),
    }


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _effect(m: MetricVerdict) -> str:
    if m.effect is None:
        return "n/a"
    fmt = (lambda x: f"{x + 0.0:+.1%}") if m.effect_kind == "relative" else (lambda x: f"{x + 0.0:+.4g}")
    ci = f" [{fmt(m.effect_ci[0])}, {fmt(m.effect_ci[1])}]" if m.effect_ci else ""
    return fmt(m.effect) + ci


def _evidence(m: MetricVerdict) -> str:
    d = m.difference
    return (f"{m.num_windows_used}/{d.num_windows} windows (min {m.min_windows}), "
            f"{d.num_baseline:,}/{d.num_candidate:,} requests, {d.num_resamples:,} resamples of {d.num_blocks} blocks")


def _limits(m: MetricVerdict) -> str:
    fmt = (lambda x: f"{x:.0%}") if m.effect_kind == "relative" else (lambda x: f"{x:g}")
    return f"{fmt(m.allowed)} / {fmt(m.critical_effect)}" + (f" (model error {m.model_error:.0%})" if m.model_error else "")


def summary_lines(verdict: Verdict, decision: Decision | None = None) -> list[str]:
    """The top of every report: failed and undecided, then the notes, then the score explained."""
    lines = []
    failed, undecided = failed_names(verdict), undecided_names(verdict)
    missed = [f"{_label(c)} {c.bound}" for c in verdict.conditions if c.status == FAIL]
    if failed or missed:
        lines.append("Failed: " + "; ".join(failed + [f"condition {m}" for m in missed]))
    if undecided:
        lines.append("Undecided: " + "; ".join(undecided))
    lines += list(verdict.notes)
    if decision is not None and decision.action == "rollback":
        lines.append(f"Restore: {decision.restore or 'the previous configuration (pass --previous-config to name it)'}")
    if verdict.score is not None:
        decisive = any(m.critical for m in verdict.metrics) or missed
        lines.append(f"Score {verdict.score:.0f}: Kayenta's share of decided metrics that passed (undecided and informative "
                     "metrics not counted; " + ("not what decided this run: a critical failure or a missed condition "
                                                "fails it whatever the score)" if decisive else
                                                f"marginal {verdict.config.score.marginal:.0f}, pass "
                                                f"{verdict.config.score.pass_:.0f})"))
    return lines


def verdict_markdown(verdict: Verdict, decision: Decision | None = None) -> str:
    """A pull-request comment: verdict and action, failed and undecided, conditions, every metric."""
    lines = [f"## servelens gate: **{_md(headline(verdict, decision))}**", ""]
    lines += [f"- {_md(line)}" for line in summary_lines(verdict, decision)] + [""]
    lines += [
        f"Baseline `{verdict.baseline}`" + (f" (manifest `{verdict.baseline_manifest}`)" if verdict.baseline_manifest else ""),
        f"vs candidate `{verdict.candidate}`" + (f" (manifest `{verdict.candidate_manifest}`)" if verdict.candidate_manifest else ""),
        "",
    ]
    if verdict.conditions:
        lines += ["### Absolute conditions (the candidate alone)", "",
                  "| condition | class | candidate | baseline |", "|---|---|---|---|"]
        lines += [f"| {_md(c.metric)} {_md(c.bound)} | {_md(c.group or 'all')} | {c.status}: {_md(c.reason)} | "
                  f"{c.baseline_status}: {_md(c.baseline_reason)} |" for c in verdict.conditions]
        lines.append("")
    lines += [
        "### Metrics", "",
        "| metric | class | baseline | candidate | bad effect [interval] | allowed / critical | evidence | status |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for m in _ordered(verdict.metrics):
        d = m.difference
        lines.append(f"| {_md(m.metric)} | {_md(m.group or 'all')} | {_num(d.baseline)} | {_num(d.candidate)} | "
                     f"{_effect(m)} | {_md(_limits(m))} {m.effect_kind} | {_evidence(m)} | {_md(status_text(m))} |")
    lines += ["", "<details><summary>Reasons</summary>", ""]
    lines += [f"- {_md(r)}" for r in verdict.reasons]
    lines += [f"- **{m.status}**: {_md(m.reason)}" for m in verdict.metrics]
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def _ordered(metrics: tuple[MetricVerdict, ...]) -> list[MetricVerdict]:
    """Failures first (critical ones first), then undecided, then the rest; informative last."""
    rank = {"fail": 0, "inconclusive": 1, "pass": 2, "skipped": 3}
    return sorted(metrics, key=lambda m: (m.informative, not m.critical, rank[m.status]))


def _md(text: str) -> str:
    """Text made inert in Markdown (and in the HTML a renderer may pass through)."""
    out = html.escape(text, quote=False)
    for ch in "\\`*_[]|#":
        out = out.replace(ch, "\\" + ch)
    return out


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.sort(values[~np.isnan(values)])
    if not len(values):
        return values, values
    q = np.linspace(0, 1, min(_CDF_POINTS, len(values)))
    return np.quantile(values, q), q


_SIDES = (("baseline", "#0969da"), ("candidate", "#cf222e"))
#: The distributions drawn per class: TTFT, ITL (each request's p99 gap, and its mean gap), E2E.
_LATENCIES = (("ttft_s", "TTFT, s"), ("itl_p99_s", "ITL p99 gap, s"), ("tpot_s", "ITL mean gap (TPOT), s"),
              ("e2e_s", "E2E, s"))


def _latency_figure(rb, rc):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    classes = sorted(set(rb.service_class.tolist()) | set(rc.service_class.tolist())) or ["no requests"]
    fig = make_subplots(rows=len(classes), cols=len(_LATENCIES), subplot_titles=[
        f"{title} ({name})" for name in classes for _, title in _LATENCIES])
    for row, name in enumerate(classes, start=1):
        for col, (column, _) in enumerate(_LATENCIES, start=1):
            for (run, color), r in zip(_SIDES, (rb, rc)):
                x, y = _cdf(getattr(r, column)[r.service_class == name])
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=run, line={"color": color},
                                         showlegend=row == 1 and col == 1), row=row, col=col)
            fig.update_xaxes(type="log", row=row, col=col)
    fig.update_annotations(font_size=12)
    fig.update_layout(height=320 * len(classes), title="Latency CDFs per class. TTFT: arrival -> first token; ITL: each "
                      "request's gaps between tokens (its p99, its mean); E2E: arrival -> last token (user-facing)")
    return fig


def _goodput_figure(rb, rc, window: float):
    import plotly.graph_objects as go

    fig = go.Figure()
    for (run, color), r in zip(_SIDES, (rb, rc)):
        if not r.size:
            continue
        w = np.floor(r.arrival_s / window).astype(int)
        covered = np.full(w.max() + 1, window)
        covered[-1] = max(float(r.arrival_s.max()) - w.max() * window, 1e-9)  # the last window is partial
        per = np.bincount(w, weights=r.good.astype(float)) / covered
        fig.add_trace(go.Scatter(x=np.arange(len(per)) * window, y=per, mode="lines+markers", name=run, line={"color": color}))
    fig.update_layout(title=f"SLO goodput over time (requests/s meeting every objective, {window:g} s windows)",
                      xaxis_title="seconds since the first arrival", yaxis_title="good requests/s")
    return fig


def _effect_traces(fig, judged: list[MetricVerdict], col: int, scale: float) -> None:
    import plotly.graph_objects as go

    labels = [_label(m) for m in judged]
    fig.add_trace(go.Scatter(
        x=[m.effect * scale for m in judged], y=labels, mode="markers", name="bad effect", showlegend=col == 1,
        marker={"color": [STATUS_COLOR[m.status] for m in judged], "size": 10},
        error_x={"type": "data", "symmetric": False,
                 "array": [((m.effect_ci[1] - m.effect) * scale) if m.effect_ci else 0 for m in judged],
                 "arrayminus": [((m.effect - m.effect_ci[0]) * scale) if m.effect_ci else 0 for m in judged]}), row=1, col=col)
    for name, key, symbol in (("allowed", "allowed", "line-ns-open"), ("critical", "critical_effect", "x-thin-open")):
        fig.add_trace(go.Scatter(x=[getattr(m, key) * scale for m in judged], y=labels, mode="markers", name=name,
                                 showlegend=col == 1, marker={"symbol": symbol, "size": 14, "color": "#6e7781"}), row=1, col=col)


def _effects_figure(verdict: Verdict):
    from plotly.subplots import make_subplots

    judged = [m for m in verdict.metrics if m.effect is not None]
    relative = [m for m in judged if m.effect_kind == "relative"]
    absolute = [m for m in judged if m.effect_kind == "absolute"]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.25, subplot_titles=(
        "relative effects, % of the baseline", "absolute effects, in each metric's unit"))
    _effect_traces(fig, relative, 1, 100.0)
    _effect_traces(fig, absolute, 2, 1.0)
    fig.update_xaxes(title_text="bad effect, % (positive is worse)", row=1, col=1)
    fig.update_xaxes(title_text="bad effect (positive is worse)", row=1, col=2)
    fig.update_layout(title="Bad effect of each metric with its interval, against its allowed and critical effects",
                      height=max(300, 24 * max(len(relative), len(absolute), 1) + 140))
    return fig


def _figures(verdict: Verdict, baseline: Run, candidate: Run) -> list[tuple[str, object]]:
    config = verdict.config.metrics_config()
    starts = [int(r.requests["arrival_ns"].to_numpy().min()) for r in (baseline, candidate) if r.requests.num_rows]
    origin = min(starts) if starts else 0
    rb, rc = load_requests(baseline.requests, config, origin), load_requests(candidate.requests, config, origin)
    return [("Latency distributions", _latency_figure(rb, rc)), ("Goodput over time", _goodput_figure(rb, rc, config.window_s)),
            ("Effects against thresholds", _effects_figure(verdict))]


def _html_rows(verdict: Verdict) -> tuple[str, str]:
    """The conditions' and the metrics' table rows."""
    conditions = "".join(
        f"<tr><td>{html.escape(c.metric)} {html.escape(c.bound)}</td><td>{html.escape(c.group or 'all')}</td>"
        f"<td style='color:{STATUS_COLOR[c.status]};font-weight:bold'>{c.status}</td><td>{html.escape(c.reason)}</td>"
        f"<td>{c.baseline_status}: {html.escape(c.baseline_reason)}</td></tr>" for c in verdict.conditions)
    rows = []
    for m in _ordered(verdict.metrics):
        d, tests = m.difference, m.difference.rank_tests
        stats = (f"U={tests.mann_whitney_u:.4g}, p={tests.mann_whitney_p:.3g}; HL shift {tests.hodges_lehmann_s:+.4g} s; "
                 f"Brown-Forsythe {tests.brown_forsythe_stat:.3g} (p={tests.brown_forsythe_p:.3g})") if tests else ""
        rows.append(
            f"<tr><td>{html.escape(m.metric)}</td><td>{html.escape(m.group or 'all')}</td><td>{_num(d.baseline)}</td>"
            f"<td>{_num(d.candidate)}</td><td>{html.escape(_effect(m))}</td><td>{html.escape(_limits(m))} {m.effect_kind}</td>"
            f"<td style='color:{STATUS_COLOR[m.status]};font-weight:bold'>{html.escape(status_text(m))}</td>"
            f"<td>{html.escape(m.reason)}<br><small>{html.escape(_evidence(m))}. {html.escape(stats)}</small></td></tr>")
    return conditions, "".join(rows)


def verdict_html(verdict: Verdict, baseline: Run, candidate: Run, decision: Decision | None = None) -> str:
    """A self-contained page: verdict and action, failed and undecided, charts, the tables, the manifests."""
    from plotly.offline import get_plotlyjs

    def link(path: str | None, sha: str | None) -> str:
        if not path:
            return "no manifest"
        uri = Path(path).resolve().as_uri()
        return f'<a href="{html.escape(uri)}">{html.escape(path)}</a>' + (f" (sha256 {sha[:12]})" if sha else "")

    sources = (
        f"<p>Baseline: <code>{html.escape(verdict.baseline)}</code>, manifest {link(baseline.manifest_path, baseline.manifest_sha256)}<br>"
        f"Candidate: <code>{html.escape(verdict.candidate)}</code>, manifest {link(candidate.manifest_path, candidate.manifest_sha256)}</p>"
    )
    charts = "".join(f"<h2>{html.escape(title)}</h2>{fig.to_html(full_html=False, include_plotlyjs=False)}"
                     f"<p class='src'>From the runs above: {html.escape(verdict.baseline)} and {html.escape(verdict.candidate)}.</p>"
                     for title, fig in _figures(verdict, baseline, candidate))
    conditions, rows = _html_rows(verdict)
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(verdict, decision))
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in verdict.reasons)
    title = headline(verdict, decision)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>servelens gate: {html.escape(title)}</title>
<script type="text/javascript">{get_plotlyjs()}</script>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;font-size:13px}}.src{{color:#6e7781;font-size:12px}}</style>
</head><body>
<h1 style="color:{STATUS_COLOR[verdict.status]}">{html.escape(title)}</h1>
<ul class="summary">{summary}</ul>
{sources}
<details><summary>Every reason</summary><ul>{reasons}</ul></details>
<h2>Absolute conditions (the candidate alone)</h2>
<table><tr><th>condition</th><th>class</th><th>candidate</th><th>why</th><th>baseline</th></tr>{conditions}</table>
{charts}
<h2>Every metric</h2>
<table class="metrics"><tr><th>metric</th><th>class</th><th>baseline</th><th>candidate</th><th>bad effect [interval]</th>
<th>allowed / critical</th><th>status</th><th>reason, evidence and statistics</th></tr>
{rows}</table>
</body></html>
"""


#: The report files of a gate, by kind, in the report folder.
REPORT_FILES = {"json": "gate.json", "markdown": "gate.md", "html": "gate.html"}


def report_paths(out_dir: str | Path) -> dict[str, Path]:
    """Where ``write_reports`` puts the reports, refused (before anything is judged) when one of them cannot be
    written: ``out_dir`` is no folder, or something other than a file (a folder) holds a report's name."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ServelensError(f"the gate's report folder {out} exists and is not a folder",
                             "give --out a folder (new, or one holding an earlier gate's reports)")
    paths = {kind: out / name for kind, name in REPORT_FILES.items()}
    blocked = [str(p) for p in paths.values() if p.exists() and not p.is_file()]
    if blocked:
        raise ServelensError(f"the gate cannot write its reports in {out}: {', '.join(blocked)} exists and is not a "
                             "regular file", "move it away, or give --out another folder")
    return paths


def write_reports(verdict: Verdict, baseline: Run, candidate: Run, out_dir: str | Path,
                  decision: Decision | None = None) -> dict[str, Path]:
    """gate.json, gate.md and gate.html in ``out_dir``, all or none: each is rendered and written under a temporary
    name first, and renamed into place only when all three are written (a failure leaves earlier reports intact)."""
    import os
    import tempfile

    paths = report_paths(out_dir)
    texts = {"json": json.dumps(verdict_dict(verdict, decision), indent=2, default=str) + "\n",
             "markdown": verdict_markdown(verdict, decision), "html": verdict_html(verdict, baseline, candidate, decision)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a folder of its own beside the reports (the same file system: each is renamed into place at once), removed after
    with tempfile.TemporaryDirectory(dir=out, prefix=".gate.", suffix=".tmp") as work:
        staged = {kind: Path(work) / path.name for kind, path in paths.items()}
        for kind, text in texts.items():
            staged[kind].write_text(text, encoding="utf-8")
        for kind, path in staged.items():
            os.replace(path, paths[kind])
    return paths
