"""Figures are built from any aggregate, empty or fully suppressed included, and data stays inert."""

from __future__ import annotations

import pyarrow as pa

from dashboard import charts


def test_plot_text_makes_plotly_pseudo_html_inert():
    assert charts.plot_text('<a href="javascript:x">y</a> & <br>') == '&lt;a href="javascript:x"&gt;y&lt;/a&gt; &amp; &lt;br&gt;'
    assert charts.plot_text(None) == ""


def test_every_figure_accepts_an_empty_or_fully_suppressed_aggregate():
    empty_series = pa.table({"bin_start_ns": pa.array([], pa.int64()), "service_class": pa.array([], pa.string()),
                             "arrivals_per_s": pa.array([], pa.float64()), "peak_arrivals_per_s": pa.array([], pa.float64()),
                             "prompt_tokens_per_s": pa.array([], pa.float64()), "output_tokens_per_s": pa.array([], pa.float64()),
                             "attainment": pa.array([], pa.float64()), "suppressed": pa.array([], pa.bool_())})
    hidden = pa.table({"bin_start_ns": [0], "service_class": ["batch"], "arrivals_per_s": pa.array([None], pa.float64()),
                       "peak_arrivals_per_s": pa.array([None], pa.float64()), "prompt_tokens_per_s": pa.array([None], pa.float64()),
                       "output_tokens_per_s": pa.array([None], pa.float64()), "attainment": pa.array([None], pa.float64()),
                       "suppressed": [True]})
    for table in (empty_series, hidden):
        assert not charts.arrivals_figure(table, 60).data
        assert not charts.tokens_figure(table, 60).data
        assert not charts.service_figure(table, "attainment", "Attainment", "attainment", 60).data
    cdfs = pa.table({"service_class": pa.array([], pa.string()), "metric": pa.array([], pa.string()),
                     "probability": pa.array([], pa.float64()), "value_s": pa.array([], pa.float64()),
                     "num_points": pa.array([], pa.int64())})
    figure = charts.cdf_figure(cdfs, {})
    assert [a.text for a in figure.layout.annotations] == list(charts.BOUNDARIES.values())
    tenants = pa.table({"tenant": ["tn_1"], "service": pa.array([None], pa.int64()), "entitlement_weight": pa.array([None], pa.float64()),
                        "suppressed": [True]})
    assert not charts.tenant_figure(tenants).data
    assert not charts.timeline_figure(0, [], []).data


def test_long_series_are_drawn_as_lines_short_ones_with_a_marker_per_point():
    def series(n: int) -> pa.Table:
        return pa.table({"bin_start_ns": [i * 10**9 for i in range(n)], "service_class": ["batch"] * n,
                         "attainment": [1.0] * n, "suppressed": [False] * n})

    short = charts.service_figure(series(charts.MAX_MARKERS), "attainment", "A", "attainment", 1)
    long = charts.service_figure(series(charts.MAX_MARKERS + 1), "attainment", "A", "attainment", 1)
    assert short.data[0].mode == "lines+markers" and long.data[0].mode == "lines"
