"""Figures of the Load and latency page (``dashboard.analysis``): tables in, plotly figures out, every axis
with its unit, data entity-escaped (``dashboard.charts.plot_text``), suppressed cells left out."""

from __future__ import annotations

import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.compute as pc

from dashboard.charts import PALETTE, _bin_label, _color, _layout, _times, _visible, plot_text


def latency_over_time_figure(table: pa.Table, column: str, label: str, bin_s: float) -> go.Figure:
    """p50 / p90 / p99 of one latency per bin of arrivals."""
    t = _visible(table)
    x = _times(t["bin_start_ns"])
    fig = go.Figure()
    for q, dash in ((50, "solid"), (90, "dash"), (99, "dot")):
        fig.add_trace(go.Scatter(x=x, y=t[f"{column}_p{q}"].to_pylist(), mode="lines", name=f"p{q}",
                                 line={"color": PALETTE[0], "dash": dash}))
    return _layout(fig, f"{label} percentiles over time ({_bin_label(bin_s)} bins, by arrival)",
                   xaxis="arrival time, UTC", yaxis=f"{label}, s")


def queue_figure(queue: pa.Table, kv: pa.Table, bin_s: float) -> go.Figure:
    """Requests waiting and running per bin, and the KV-cache pool in use (right axis)."""
    fig = go.Figure()
    t = _visible(queue)
    for state, color in (("waiting", PALETTE[1]), ("running", PALETTE[0])):
        rows = t.filter(pc.equal(t["state"], state))
        fig.add_trace(go.Scatter(x=_times(rows["bin_start_ns"]), y=rows["num_requests"].to_pylist(), mode="lines",
                                 name=f"requests {state}", line={"color": color}))
    instances = kv["instance_id"].to_pylist() if kv.num_rows else []
    colors = _color(instances)
    for name in sorted(set(instances)):
        rows = kv.filter(pc.equal(kv["instance_id"], name))
        fig.add_trace(go.Scatter(x=_times(rows["bin_start_ns"]), y=rows["kv_usage_mean"].to_pylist(), mode="lines",
                                 name=plot_text(f"KV cache in use, {name}"), yaxis="y2",
                                 line={"color": colors[name], "width": 1}))
    fig.update_layout(yaxis2={"title": "KV cache in use, share of the pool", "overlaying": "y", "side": "right",
                              "tickformat": ".0%", "range": [0, 1]})
    return _layout(fig, f"Queue depth and KV-cache usage ({_bin_label(bin_s)} bins)", xaxis="time, UTC",
                   yaxis="requests (in that state during the bin)")


def length_heatmap_figure(table: pa.Table) -> go.Figure:
    """Requests by prompt and output length (powers of two)."""
    t = _visible(table)
    prompts = sorted(set(t["prompt_bucket"].to_pylist()))
    outputs = sorted(set(t["output_bucket"].to_pylist()))
    z = [[None] * len(prompts) for _ in outputs]
    for p, o, n in zip(t["prompt_bucket"].to_pylist(), t["output_bucket"].to_pylist(), t["num_requests"].to_pylist()):
        z[outputs.index(o)][prompts.index(p)] = n
    fig = go.Figure(go.Heatmap(x=[f"{p:,}" for p in prompts], y=[f"{o:,}" for o in outputs], z=z, colorscale="Blues",
                               colorbar={"title": "requests"}))
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category")
    return _layout(fig, "Prompt and output lengths (each cell: tokens from its label to the next power of two)",
                   height=420, xaxis="prompt length, tokens", yaxis="output length, tokens")


def finish_reasons_figure(table: pa.Table) -> go.Figure:
    """Requests per outcome (and last admission decision), per class."""
    t = _visible(table)
    fig = go.Figure()
    labels = [plot_text(f"{f} ({d})") for f, d in zip(t["finish"].to_pylist(), t["decision"].to_pylist())]
    classes = t["class_name"].to_pylist()
    colors = _color(classes)
    for name in sorted(set(classes)):
        rows = [i for i, c in enumerate(classes) if c == name]
        fig.add_trace(go.Bar(x=[labels[i] for i in rows], y=[t["num_requests"][i].as_py() for i in rows],
                             name=plot_text(name), marker={"color": colors[name]}))
    fig.update_layout(barmode="group")
    return _layout(fig, "Finish reasons: outcome (last admission decision), per class", height=340,
                   xaxis="outcome (admission decision)", yaxis="requests")
