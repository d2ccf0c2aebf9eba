"""Plotly figures from the dashboard's aggregates (pure functions: tables in, figures out).

Every string that came from data (classes, tenants, runs, reasons) passes through ``plot_text``
before it reaches a figure: plotly renders a subset of HTML in trace names, tick labels and hover
text (``<a href>`` included), so data is entity-escaped to show as the characters it is. Each
latency chart states its measurement boundary (``docs/metrics.md``).
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.compute as pc
from plotly.subplots import make_subplots

PALETTE = ("#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7480", "#6e7781", "#953800", "#116329")
STATUS_COLOR = {"pass": "#1a7f37", "fail": "#cf222e", "inconclusive": "#9a6700", "skipped": "#6e7781"}

#: The measurement boundary of each latency, as every chart states it.
BOUNDARIES = {
    "ttft_s": "TTFT, s: arrival -> first token (user-facing, not vLLM's scheduled-based per-request field)",
    "itl_p99_s": "ITL, s: each request's p99 gap between consecutive tokens (a chunk of k tokens: k gaps of g/k)",
    "e2e_s": "E2E, s: arrival -> last token",
}
#: Longest series drawn with a marker per point (beyond it, lines only: thousands of SVG markers
#: take the browser longer to draw than the page's queries take to run).
MAX_MARKERS = 150
_OBJECTIVE_OF = {"ttft_s": "ttft_s", "itl_p99_s": "itl_s", "e2e_s": "e2e_s"}


def plot_text(value: object) -> str:
    """Data made inert for plotly's pseudo-HTML (``<b>``, ``<a href>``): entities show as text."""
    return html.escape("" if value is None else str(value), quote=False)


def _times(ns: pa.ChunkedArray | Sequence[int]) -> np.ndarray:
    values = ns.to_pylist() if hasattr(ns, "to_pylist") else list(ns)
    return np.asarray(values, dtype="datetime64[ns]")


def _color(names: Sequence[str]) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(set(names)))}


def _layout(fig: go.Figure, title: str, *, height: int = 360, **axes: str) -> go.Figure:
    fig.update_layout(title=title, height=height, margin={"l": 60, "r": 20, "t": 90, "b": 40},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
                      **{k: {"title": v} for k, v in axes.items()})
    return fig


def _bin_label(bin_s: float) -> str:
    if bin_s < 1:
        return f"{bin_s * 1000:g} ms"
    if bin_s < 60:
        return f"{bin_s:g} s"
    if bin_s < 3600:
        return f"{bin_s / 60:g} min"
    return f"{bin_s / 3600:g} h"


def _visible(table: pa.Table) -> pa.Table:
    if not table.num_rows or "suppressed" not in table.column_names:
        return table
    return table.filter(pc.invert(pc.fill_null(table["suppressed"], False)))


def arrivals_figure(table: pa.Table, bin_s: float) -> go.Figure:
    """Arrivals per second by class: the bin mean (solid) and the busiest second of each bin (dotted)."""
    t = _visible(table)
    fig = go.Figure()
    classes = t["service_class"].to_pylist()
    colors = _color(classes)
    for name in sorted(set(classes)):
        rows = t.filter(pc.equal(t["service_class"], name))
        x = _times(rows["bin_start_ns"])
        fig.add_trace(go.Scatter(x=x, y=rows["arrivals_per_s"].to_pylist(), mode="lines", name=plot_text(name),
                                 line={"color": colors[name]}))
        fig.add_trace(go.Scatter(x=x, y=rows["peak_arrivals_per_s"].to_pylist(), mode="lines",
                                 name=plot_text(f"{name}: busiest 1 s"), line={"color": colors[name], "dash": "dot", "width": 1}))
    return _layout(fig, f"Arrivals per second by class (mean per {_bin_label(bin_s)}; dotted: the busiest second)",
                   xaxis="arrival time, UTC", yaxis="requests/s")


def tokens_figure(table: pa.Table, bin_s: float) -> go.Figure:
    """Prompt and output tokens per second by class."""
    t = _visible(table)
    fig = go.Figure()
    classes = t["service_class"].to_pylist()
    colors = _color(classes)
    for name in sorted(set(classes)):
        rows = t.filter(pc.equal(t["service_class"], name))
        x = _times(rows["bin_start_ns"])
        fig.add_trace(go.Scatter(x=x, y=rows["prompt_tokens_per_s"].to_pylist(), mode="lines",
                                 name=plot_text(f"{name}: prompt"), line={"color": colors[name]}))
        fig.add_trace(go.Scatter(x=x, y=rows["output_tokens_per_s"].to_pylist(), mode="lines",
                                 name=plot_text(f"{name}: output"), line={"color": colors[name], "dash": "dash"}))
    return _layout(fig, f"Token volume by class (per second, {_bin_label(bin_s)} bins, by arrival)",
                   xaxis="arrival time, UTC", yaxis="tokens/s")


def dead_letters_figure(table: pa.Table) -> go.Figure:
    """Dead letters per reason."""
    reasons = [plot_text(r) for r in table["reason"].to_pylist()]
    counts = table["num_dead_letters"].to_pylist()
    totals: dict[str, int] = {}
    for r, c in zip(reasons, counts):
        totals[r] = totals.get(r, 0) + int(c)
    fig = go.Figure(go.Bar(x=list(totals), y=list(totals.values()), marker={"color": "#cf222e"}))
    return _layout(fig, "Dead letters by reason", height=300, xaxis="reason", yaxis="messages")


def service_figure(table: pa.Table, column: str, title: str, yaxis: str, bin_s: float) -> go.Figure:
    """One service-level series per class over time (attainment, goodput, rejections)."""
    t = _visible(table)
    fig = go.Figure()
    classes = t["service_class"].to_pylist()
    colors = _color(classes)
    for name in sorted(set(classes)):
        rows = t.filter(pc.equal(t["service_class"], name))
        # markers only where a series is short enough to read them: each is an SVG node to draw
        mode = "lines+markers" if rows.num_rows <= MAX_MARKERS else "lines"
        fig.add_trace(go.Scatter(x=_times(rows["bin_start_ns"]), y=rows[column].to_pylist(), mode=mode,
                                 marker={"size": 3}, name=plot_text(name), line={"color": colors[name]}))
    values = [v for v in t[column].to_pylist() if v is not None] if t.num_rows else []
    if column.startswith("attainment"):  # down to 90% at least, so that small dips stay readable
        fig.update_yaxes(tickformat=".0%", range=[min([*values, 0.9]) - 0.02, 1.02])
    elif column.endswith("_share"):
        fig.update_yaxes(tickformat=".0%", range=[0, max([*values, 0.05]) * 1.08])
    else:
        fig.update_yaxes(rangemode="tozero")
    return _layout(fig, f"{title} ({_bin_label(bin_s)} bins, by arrival)", xaxis="arrival time, UTC", yaxis=yaxis)


def cdf_figure(cdfs: pa.Table, objectives: dict[str, dict[str, float | None]]) -> go.Figure:
    """Latency CDFs per class, one panel per metric, each titled with its measurement boundary;
    dashed lines mark each class's objective where it has one."""
    metrics = list(BOUNDARIES)
    fig = make_subplots(rows=len(metrics), cols=1, subplot_titles=[BOUNDARIES[m] for m in metrics], vertical_spacing=0.09)
    classes = sorted(set(cdfs["service_class"].to_pylist()))
    colors = _color(classes)
    for row, metric in enumerate(metrics, start=1):
        for name in classes:
            rows = cdfs.filter(pc.and_(pc.equal(cdfs["service_class"], name), pc.equal(cdfs["metric"], metric)))
            if not rows.num_rows:
                continue
            values = np.maximum(np.asarray(rows["value_s"].to_pylist(), dtype=float), 1e-6)
            n = rows["num_points"][0].as_py()
            fig.add_trace(go.Scatter(x=values, y=rows["probability"].to_pylist(), mode="lines", name=plot_text(name),
                                     legendgroup=plot_text(name), showlegend=row == 1, line={"color": colors[name]},
                                     hovertemplate="%{x:.4g} s: %{y:.1%} of " + f"{n:,} requests<extra>" + plot_text(name) + "</extra>"),
                          row=row, col=1)
            limit = (objectives.get(name) or {}).get(_OBJECTIVE_OF[metric])
            if limit:
                fig.add_vline(x=limit, line={"color": colors[name], "dash": "dash", "width": 1}, row=row, col=1)
        fig.update_xaxes(type="log", title_text="seconds (log)", row=row, col=1)
        fig.update_yaxes(tickformat=".0%", range=[0, 1], row=row, col=1)
    fig.update_layout(height=300 * len(metrics) + 80, margin={"l": 60, "r": 20, "t": 60, "b": 40},
                      title="Latency CDFs per class (dashed: the class's objective)",
                      legend={"orientation": "h", "y": -0.06})
    for annotation in fig.layout.annotations:
        annotation.font = {"size": 12}
    return fig


def policy_scatter(comparison: pa.Table, currency: str) -> go.Figure:
    """Goodput against cost, one point per run (the run's name on hover; labelled only when few)."""
    runs = [plot_text(r) for r in comparison["run"].to_pylist()]
    cost = comparison["cost_per_1k_goodput_tokens"].to_pylist()
    goodput = comparison["goodput_rps"].to_pylist()
    policies = comparison["policy"].to_pylist()
    colors = _color(policies)
    labelled = len(runs) <= 6  # more labels than that pile up on each other
    fig = go.Figure()
    for policy in sorted(set(policies)):
        idx = [i for i, p in enumerate(policies) if p == policy]
        fig.add_trace(go.Scatter(x=[cost[i] for i in idx], y=[goodput[i] for i in idx],
                                 mode="markers+text" if labelled else "markers",
                                 text=[runs[i] for i in idx], textposition="top center", hovertemplate=
                                 "%{text}<br>%{x:.4f} " + plot_text(currency) + " / 1k tokens, %{y:.2f} req/s<extra></extra>",
                                 name=plot_text(policy), marker={"size": 12, "color": colors[policy]}))
    fig.update_xaxes(exponentformat="none", tickformat=".4~f")  # plain currency: never "300µ"
    return _layout(fig, "Goodput against cost (up and to the left is better)",
                   xaxis=f"cost per 1k goodput tokens, {plot_text(currency)}", yaxis="SLO goodput, requests/s")


_CONFIG = re.compile(r" \{.*\}(?= on )")


def _series_name(series: str) -> str:
    """A load-sweep series without its configuration's JSON (a short digest of it instead)."""
    match = _CONFIG.search(series)
    if not match:
        return series
    digest = hashlib.sha256(match.group(0).encode()).hexdigest()[:6]
    return series[:match.start()] + f" (config {digest})" + series[match.end():]


def sweep_figure(series: Sequence[str], load: Sequence[float], values: Sequence[float | None], metric_label: str) -> go.Figure:
    """A metric against load factor, one line per series (policy, config, engine, workload); the legend below."""
    fig = go.Figure()
    colors = _color(series)
    for name in sorted(set(series)):
        points = sorted((lf, v) for s, lf, v in zip(series, load, values) if s == name and v is not None)
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                                 name=plot_text(_series_name(name)), line={"color": colors[name]}))
    fig.update_xaxes(tickformat=".2~f", ticksuffix="x")
    if metric_label.startswith("attainment"):
        fig.update_yaxes(tickformat=".0%")
    fig = _layout(fig, f"Load sweep: {metric_label} against load", xaxis="load factor (x the recorded rate)",
                  yaxis=metric_label, height=420)
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.2, "x": 0}, margin={"t": 60, "b": 120})
    return fig


def _effect_traces(fig: go.Figure, rows: list[dict], col: int, scale: float) -> None:
    labels = [plot_text(r["metric"] + (f" ({r['group']})" if r["group"] else "")) for r in rows]
    plus = [((r["effect_high"] - r["effect"]) * scale) if r["effect_high"] is not None else 0 for r in rows]
    minus = [((r["effect"] - r["effect_low"]) * scale) if r["effect_low"] is not None else 0 for r in rows]
    fig.add_trace(go.Scatter(x=[r["effect"] * scale for r in rows], y=labels, mode="markers", name="bad effect",
                             showlegend=col == 1,
                             marker={"size": 10, "color": [STATUS_COLOR.get(r["status"], "#6e7781") for r in rows]},
                             error_x={"type": "data", "symmetric": False, "array": plus, "arrayminus": minus}), row=1, col=col)
    for name, key, symbol in (("allowed", "allowed", "line-ns-open"), ("critical", "critical_effect", "x-thin-open")):
        fig.add_trace(go.Scatter(x=[(r[key] or 0) * scale for r in rows], y=labels, mode="markers", name=name,
                                 showlegend=col == 1, marker={"symbol": symbol, "size": 14, "color": "#6e7781"}),
                      row=1, col=col)


def effects_figure(metrics: pa.Table) -> go.Figure:
    """Each judged metric's bad effect with its interval, against its allowed and critical effects,
    coloured by status: relative effects (percent) and absolute ones (each metric's unit) on
    separate axes."""
    rows = [r for r in metrics.to_pylist() if r["effect"] is not None]
    relative = [r for r in rows if r["effect_kind"] == "relative"]
    absolute = [r for r in rows if r["effect_kind"] != "relative"]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.3,
                        subplot_titles=("relative effects, % of the baseline", "absolute effects, in each metric's unit"))
    _effect_traces(fig, relative, 1, 100.0)
    _effect_traces(fig, absolute, 2, 1.0)
    fig.update_xaxes(title_text="bad effect, % (positive is worse)", row=1, col=1)
    fig.update_xaxes(title_text="bad effect (positive is worse)", row=1, col=2)
    return _layout(fig, "Bad effect of each metric with its interval against its allowed and critical effects",
                   height=max(300, 26 * max(len(relative), len(absolute), 1) + 140))


def timeline_figure(arrival_ns: int, lanes: Sequence[tuple[str, int, int, str, str]],
                    marks: Sequence[tuple[str, int, str]]) -> go.Figure:
    """A request's life against milliseconds since its arrival: bars per lane (``lanes``: lane,
    start_ns, end_ns, colour, hover text) and markers (``marks``: label, ts_ns, hover text)."""
    fig = go.Figure()
    order = ["queue", "prefill chunk", "decode", "preempted"]
    seen = sorted({lane for lane, *_ in lanes}, key=lambda x: order.index(x) if x in order else len(order))
    for lane in seen:
        items = [(s, e, c, h) for name, s, e, c, h in lanes if name == lane]
        fig.add_trace(go.Bar(
            y=[lane] * len(items), x=[max((e - s) / 1e6, 0.01) for s, e, _, _ in items],
            base=[(s - arrival_ns) / 1e6 for s, _, _, _ in items], orientation="h", name=lane,
            marker={"color": [c for _, _, c, _ in items]}, hovertext=[plot_text(h) for *_, h in items],
            hoverinfo="text",
        ))
    if marks:
        fig.add_trace(go.Scatter(
            x=[(ts - arrival_ns) / 1e6 for _, ts, _ in marks], y=["events"] * len(marks), mode="markers+text",
            text=[plot_text(label) for label, _, _ in marks], name="events",
            textposition=["top center" if i % 2 == 0 else "bottom center" for i in range(len(marks))],
            hovertext=[plot_text(h) for *_, h in marks], hoverinfo="text", marker={"size": 10, "symbol": "diamond", "color": "#24292f"},
        ))
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(categoryorder="array", categoryarray=["events", *reversed(seen)][::-1])
    return _layout(fig, "The request's life (milliseconds since its arrival)", height=380, xaxis="ms since arrival")


def composition_figure(table: pa.Table, bin_s: float) -> go.Figure:
    """An instance's batches over time: members per step, prefill tokens per second, KV blocks in
    use, busy share."""
    x = _times(table["bin_start_ns"])
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.05, subplot_titles=[
        "requests per batch (mean per step)", "prefill tokens per second", "KV blocks in use (most at a step end)",
        "busy share (step time / wall time)"])
    for row, (column, color) in enumerate((("mean_batch_size", "#0969da"), ("prefill_tokens_per_s", "#9a6700"),
                                           ("kv_blocks_used", "#8250df"), ("busy_share", "#1a7f37")), start=1):
        fig.add_trace(go.Scatter(x=x, y=table[column].to_pylist(), mode="lines", line={"color": color},
                                 name=column, showlegend=False), row=row, col=1)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=4, col=1)
    fig.update_layout(height=700, title=f"Batch composition over time ({_bin_label(bin_s)} bins of steps, by step start)",
                      margin={"l": 60, "r": 20, "t": 60, "b": 40})
    return fig


def tenant_figure(table: pa.Table) -> go.Figure:
    """Each shown tenant's share of delivered service against its share of entitlement (among the
    tenants shown: suppressed ones are left out of both)."""
    t = _visible(table)
    tenants = [plot_text(x) for x in t["tenant"].to_pylist()]
    service = np.asarray(t["service"].to_pylist(), dtype=float) if t.num_rows else np.zeros(0)
    weight = np.asarray(t["entitlement_weight"].to_pylist(), dtype=float) if t.num_rows else np.zeros(0)
    fig = go.Figure()
    if t.num_rows and service.sum() > 0 and weight.sum() > 0:
        fig.add_trace(go.Bar(x=tenants, y=service / service.sum(), name="share of delivered service", marker={"color": "#0969da"}))
        fig.add_trace(go.Bar(x=tenants, y=weight / weight.sum(), name="share of entitlement", marker={"color": "#6e7781"}))
    fig.update_yaxes(tickformat=".0%")
    return _layout(fig, "Delivered service (input + 2 x output tokens) against entitlement, per tenant shown",
                   xaxis="tenant (pseudonym)", yaxis="share")
