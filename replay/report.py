"""Gate reports: JSON for machines, Markdown for a pull-request comment, and a self-contained HTML
page with plotly charts (latency CDFs per class, goodput over time, the effect of every metric
against its thresholds) and the per-metric verdict table. Every figure names the runs and the
manifests it came from; the HTML embeds plotly.js, so it opens offline.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

import numpy as np

from replay.gate import Decision, MetricVerdict, Run, Verdict
from replay.metrics import load_requests

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


def verdict_dict(verdict: Verdict, decision: Decision | None = None) -> dict:
    """Everything the gate decided and why, as plain data (the JSON report)."""
    return {
        "status": verdict.status,
        "exit_code": verdict.exit_code,
        "score": verdict.score,
        "reasons": list(verdict.reasons),
        "baseline": {"source": verdict.baseline, "manifest": verdict.baseline_manifest},
        "candidate": {"source": verdict.candidate, "manifest": verdict.candidate_manifest},
        "decision": _plain(decision) if decision else None,
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


def verdict_markdown(verdict: Verdict, decision: Decision | None = None) -> str:
    """A pull-request comment: the verdict, its reasons, and one table row per metric."""
    lines = [
        f"## servelens gate: **{verdict.status.upper()}**"
        + (f" (score {verdict.score:.0f})" if verdict.score is not None else ""),
        "",
        f"Baseline `{verdict.baseline}`" + (f" (manifest `{verdict.baseline_manifest}`)" if verdict.baseline_manifest else ""),
        f"vs candidate `{verdict.candidate}`" + (f" (manifest `{verdict.candidate_manifest}`)" if verdict.candidate_manifest else ""),
        "",
    ]
    if decision is not None:
        lines += [f"**Decision: {decision.action}**" + (f", restore `{decision.restore}`" if decision.restore else ""), ""]
    lines += [f"- {_md(r)}" for r in verdict.reasons] + [""]
    lines += [
        "| metric | class | baseline | candidate | bad effect [interval] | allowed / critical | status |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for m in verdict.metrics:
        d = m.difference
        limits = f"{m.allowed:g} / {m.critical_effect:g} ({m.effect_kind})"
        lines.append(f"| {_md(m.metric)} | {_md(m.group or 'all')} | {_num(d.baseline)} | {_num(d.candidate)} | "
                     f"{_effect(m)} | {limits} | {m.status}{' (critical)' if m.critical else ''} |")
    lines += ["", "<details><summary>Reasons per metric</summary>", ""]
    lines += [f"- **{m.status}**: {_md(m.reason)}" for m in verdict.metrics]
    lines += ["", "</details>", ""]
    return "\n".join(lines)


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


def _figures(verdict: Verdict, baseline: Run, candidate: Run) -> list[tuple[str, object]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    config = verdict.config.metrics_config()
    origin = min(int(r.requests["arrival_ns"].to_numpy().min()) for r in (baseline, candidate) if r.requests.num_rows)
    rb, rc = load_requests(baseline.requests, config, origin), load_requests(candidate.requests, config, origin)
    figures = []
    classes = sorted(set(rb.service_class.tolist()) | set(rc.service_class.tolist()))
    cdf = make_subplots(rows=len(classes), cols=2, subplot_titles=[
        f"{title} ({name})" for name in classes
        for title in ("TTFT, s: arrival -> first token", "E2E, s: arrival -> last token")])
    for row, name in enumerate(classes, start=1):
        for col, column in enumerate(("ttft_s", "e2e_s"), start=1):
            for run, r, color in (("baseline", rb, "#0969da"), ("candidate", rc, "#cf222e")):
                x, y = _cdf(getattr(r, column)[r.service_class == name])
                cdf.add_trace(go.Scatter(x=x, y=y, mode="lines", name=run, line={"color": color},
                                         showlegend=row == 1 and col == 1), row=row, col=col)
            cdf.update_xaxes(type="log", row=row, col=col)
    cdf.update_layout(height=320 * len(classes), title="Latency CDFs per class (user-facing: from arrival)")
    figures.append(("Latency distributions", cdf))
    window = config.window_s
    good = go.Figure()
    for run, r, color in (("baseline", rb, "#0969da"), ("candidate", rc, "#cf222e")):
        if not r.size:
            continue
        w = np.floor(r.arrival_s / window).astype(int)
        covered = np.full(w.max() + 1, window)
        covered[-1] = max(float(r.arrival_s.max()) - w.max() * window, 1e-9)  # the last window is partial
        per = np.bincount(w, weights=r.good.astype(float)) / covered
        good.add_trace(go.Scatter(x=np.arange(len(per)) * window, y=per, mode="lines+markers", name=run, line={"color": color}))
    good.update_layout(title=f"SLO goodput over time (requests/s meeting every objective, {window:g} s windows)",
                       xaxis_title="seconds since the first arrival", yaxis_title="good requests/s")
    figures.append(("Goodput over time", good))
    judged = [m for m in verdict.metrics if m.effect is not None]
    effects = go.Figure()
    labels = [f"{m.metric}{' (' + m.group + ')' if m.group else ''}" for m in judged]
    scale = [100.0 if m.effect_kind == "relative" else 1.0 for m in judged]
    effects.add_trace(go.Scatter(
        x=[m.effect * s for m, s in zip(judged, scale)], y=labels, mode="markers",
        marker={"color": [STATUS_COLOR[m.status] for m in judged], "size": 10},
        error_x={"type": "data", "symmetric": False,
                 "array": [((m.effect_ci[1] - m.effect) * s) if m.effect_ci else 0 for m, s in zip(judged, scale)],
                 "arrayminus": [((m.effect - m.effect_ci[0]) * s) if m.effect_ci else 0 for m, s in zip(judged, scale)]},
        name="bad effect"))
    effects.add_trace(go.Scatter(x=[m.allowed * s for m, s in zip(judged, scale)], y=labels, mode="markers",
                                 marker={"symbol": "line-ns-open", "size": 14, "color": "#6e7781"}, name="allowed"))
    effects.update_layout(title="Bad effect of each metric with its interval (percent for relative metrics) against the allowed effect",
                          height=max(300, 24 * len(judged) + 120), xaxis_title="bad effect")
    figures.append(("Effects against thresholds", effects))
    return figures


def verdict_html(verdict: Verdict, baseline: Run, candidate: Run, decision: Decision | None = None) -> str:
    """A self-contained page: charts, the verdict table and links to the run manifests."""
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
    charts = []
    for title, fig in _figures(verdict, baseline, candidate):
        charts.append(f"<h2>{html.escape(title)}</h2>{fig.to_html(full_html=False, include_plotlyjs=False)}"
                      f"<p class='src'>From the runs above: {html.escape(verdict.baseline)} and {html.escape(verdict.candidate)}.</p>")
    rows = []
    for m in verdict.metrics:
        d = m.difference
        tests = d.rank_tests
        stats = (f"U={tests.mann_whitney_u:.4g}, p={tests.mann_whitney_p:.3g}; HL shift {tests.hodges_lehmann_s:+.4g} s; "
                 f"Brown-Forsythe {tests.brown_forsythe_stat:.3g} (p={tests.brown_forsythe_p:.3g})") if tests else ""
        rows.append(
            f"<tr><td>{html.escape(m.metric)}</td><td>{html.escape(m.group or 'all')}</td><td>{_num(d.baseline)}</td>"
            f"<td>{_num(d.candidate)}</td><td>{html.escape(_effect(m))}</td><td>{m.allowed:g} / {m.critical_effect:g} {m.effect_kind}</td>"
            f"<td style='color:{STATUS_COLOR[m.status]};font-weight:bold'>{m.status}{' (critical)' if m.critical else ''}</td>"
            f"<td>{html.escape(m.reason)}<br><small>{html.escape(stats)} n={d.num_baseline:,}/{d.num_candidate:,}</small></td></tr>"
        )
    decided = ""
    if decision is not None:
        decided = f"<p><b>Decision: {html.escape(decision.action)}</b>" + (
            f", restore <code>{html.escape(decision.restore)}</code>" if decision.restore else "") + f". {html.escape(decision.reason)}</p>"
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in verdict.reasons)
    score = f" (score {verdict.score:.0f})" if verdict.score is not None else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>servelens gate: {verdict.status}</title>
<script type="text/javascript">{get_plotlyjs()}</script>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;font-size:13px}}.src{{color:#6e7781;font-size:12px}}</style>
</head><body>
<h1>servelens gate: <span style="color:{STATUS_COLOR[verdict.status]}">{verdict.status.upper()}</span>{score}</h1>
{sources}{decided}<ul>{reasons}</ul>
{''.join(charts)}
<h2>Every metric</h2>
<table><tr><th>metric</th><th>class</th><th>baseline</th><th>candidate</th><th>bad effect [interval]</th><th>allowed / critical</th><th>status</th><th>reason and statistics</th></tr>
{''.join(rows)}</table>
</body></html>
"""


def write_reports(verdict: Verdict, baseline: Run, candidate: Run, out_dir: str | Path,
                  decision: Decision | None = None) -> dict[str, Path]:
    """gate.json, gate.md and gate.html in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "gate.json", "markdown": out / "gate.md", "html": out / "gate.html"}
    paths["json"].write_text(json.dumps(verdict_dict(verdict, decision), indent=2, default=str) + "\n")
    paths["markdown"].write_text(verdict_markdown(verdict, decision))
    paths["html"].write_text(verdict_html(verdict, baseline, candidate, decision))
    return paths
