"""Metrics out: the Prometheus exposition parses with prometheus_client and matches the request table exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from pipelines.exposition import (
    OTEL_TTFT_BUCKETS_S,
    VLLM_TTFT_BUCKETS_S,
    request_metrics,
    to_otlp_json,
    to_prometheus,
    token_buckets,
)
from replay.derive import derive_requests
from replay.run import run_replay
from servelens.errors import ServelensError
from tests.replay.conftest import make_workload

MODELS = ["llama-3-8b"] * 40 + ["qwen-7b"] * 17 + ["rare-model"] * 3  # rare-model: below k = 5, folds


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[pa.Table, pa.Table]:
    """A small replay (60 requests, three models, two classes): its events and request table."""
    rng = np.random.default_rng(7)
    n = len(MODELS)
    arrivals = np.cumsum(rng.exponential(0.05e9, n)).astype(np.int64).tolist()
    workload = make_workload(
        arrivals, rng.integers(20, 900, n).tolist(), rng.integers(1, 120, n).tolist(),
        model=MODELS, service_class=["interactive" if i % 3 else "batch" for i in range(n)],
        tenant=[f"tenant-{i % 7}" for i in range(n)],
    )
    summary = run_replay(workload, out_dir=tmp_path_factory.mktemp("replay"), seed=3)
    import pyarrow.parquet as pq

    events = pq.read_table(summary.events_path)
    return events, derive_requests(events)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def column_values(requests: pa.Table, name: str, rows: np.ndarray | None = None) -> list[float]:
    values = requests[name].to_pylist()
    return [v for i, v in enumerate(values) if v is not None and (rows is None or rows[i])]


def test_histograms_parse_and_match_the_request_table_exactly(replayed):
    events, requests = replayed
    text = to_prometheus(request_metrics(requests, events, labels=()))
    parsed = families(text)
    checks = {
        "vllm:time_to_first_token_seconds": column_values(requests, "ttft_s"),
        "vllm:e2e_request_latency_seconds": column_values(requests, "e2e_s"),
        "vllm:request_queue_time_seconds": column_values(requests, "queue_s"),
        "vllm:request_time_per_output_token_seconds": column_values(requests, "tpot_s"),
        "vllm:request_prompt_tokens": [float(v) for v in column_values(requests, "num_prompt_tokens")],
        "vllm:request_generation_tokens": [float(v) for v in column_values(requests, "num_output_tokens")],
    }
    assert all(len(v) > 30 for v in checks.values())
    for name, values in checks.items():
        family = parsed[name]
        assert family.type == "histogram"
        samples = {s.name[len(name):]: s for s in family.samples if "le" not in s.labels}
        assert samples["_count"].value == len(values), name
        assert samples["_sum"].value == math.fsum(values), name  # exact: floats round-trip through the text
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                assert s.value == sum(1 for v in values if v <= bound), (name, bound)
    bounds = [float(s.labels["le"]) for s in parsed["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert bounds == [*VLLM_TTFT_BUCKETS_S, math.inf]


def test_inter_token_latency_counts_every_gap_of_the_table(replayed):
    events, requests = replayed
    parsed = families(to_prometheus(request_metrics(requests, events, labels=())))
    itl = {s.name: s.value for s in parsed["vllm:inter_token_latency_seconds"].samples if "le" not in s.labels}
    assert itl["vllm:inter_token_latency_seconds_count"] == sum(requests["num_itl_gaps"].to_pylist())
    spans_ns = sum(r["last_token_ns"] - r["first_token_ns"] for r in requests.to_pylist() if r["num_itl_gaps"])
    assert itl["vllm:inter_token_latency_seconds_sum"] == spans_ns / 1e9
    without = request_metrics(requests, None, labels=())
    assert "vllm:inter_token_latency_seconds" not in families(to_prometheus(without))
    assert any("needs the events" in why for why in without.omitted)


def test_labels_are_bounded_and_small_groups_fold_without_losing_observations(replayed):
    events, requests = replayed
    metrics = request_metrics(requests, events, labels=("model",), min_group_size=5)
    parsed = families(to_prometheus(metrics))
    ttft = parsed["vllm:time_to_first_token_seconds"]
    counts = {s.labels["model_name"]: s.value for s in ttft.samples if s.name.endswith("_count")}
    assert set(counts) == {"llama-3-8b", "qwen-7b", "other"}  # rare-model (3 requests) folded
    assert metrics.num_folded_requests == 3
    models = np.array(requests["model"].to_pylist(), dtype=object)
    for label, rows in (("llama-3-8b", models == "llama-3-8b"), ("qwen-7b", models == "qwen-7b"), ("other", models == "rare-model")):
        values = column_values(requests, "ttft_s", rows)
        sums = {s.labels["model_name"]: s.value for s in ttft.samples if s.name.endswith("_sum")}
        assert counts[label] == len(values) and sums[label] == math.fsum(values)
    assert "tenant" not in text_labels(parsed)
    # a budget of one value per dimension: the largest model keeps its name, the rest are "other"
    one = families(to_prometheus(request_metrics(requests, events, labels=("model",), max_label_values=1)))
    assert {s.labels["model_name"] for s in one["vllm:e2e_request_latency_seconds"].samples} == {"llama-3-8b", "other"}


def text_labels(parsed: dict) -> set[str]:
    return {k for f in parsed.values() for s in f.samples for k in s.labels}


def test_identifiers_can_never_be_labels(replayed):
    _, requests = replayed
    for forbidden in ("tenant", "request_id", "session_id"):
        with pytest.raises(ServelensError, match="can never be a metric label"):
            request_metrics(requests, labels=(forbidden,))
    with pytest.raises(ServelensError, match="unknown label"):
        request_metrics(requests, labels=("colour",))
    with pytest.raises(ServelensError, match="not a request table"):
        request_metrics(pa.table({"x": [1]}))


def test_otel_genai_histograms_in_both_formats(replayed):
    events, requests = replayed
    metrics = request_metrics(requests, events, labels=("service_class",), provider_name="vllm")
    parsed = families(to_prometheus(metrics))
    ttft = parsed["gen_ai_server_time_to_first_token_seconds"]
    completed = np.array([o == "completed" for o in requests["outcome"].to_pylist()])
    values = column_values(requests, "ttft_s", completed)
    assert sum(s.value for s in ttft.samples if s.name.endswith("_count")) == len(values)
    assert {s.labels["gen_ai_operation_name"] for s in ttft.samples} == {"chat"}
    duration = parsed["gen_ai_server_request_duration_seconds"]
    assert sum(s.value for s in duration.samples if s.name.endswith("_count")) == requests.num_rows
    otlp = to_otlp_json(metrics)
    json.dumps(otlp)  # serialisable
    by_name = {m["name"]: m for m in otlp["resourceMetrics"][0]["scopeMetrics"][0]["metrics"]}
    point_ttft = by_name["gen_ai.server.time_to_first_token"]["histogram"]
    assert point_ttft["aggregationTemporality"] == 2
    assert point_ttft["dataPoints"][0]["explicitBounds"] == list(OTEL_TTFT_BUCKETS_S)
    assert sum(int(p["count"]) for p in point_ttft["dataPoints"]) == len(values)
    for p in point_ttft["dataPoints"]:
        assert sum(int(n) for n in p["bucketCounts"]) == int(p["count"])
        assert len(p["bucketCounts"]) == len(p["explicitBounds"]) + 1
    assert "vllm:e2e_request_latency_seconds" in by_name


def test_token_buckets_follow_vllms_1_2_5_series():
    assert token_buckets(1000) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
    assert token_buckets(4) == (1.0, 2.0)


def test_the_cli_writes_both_formats(replayed, tmp_path):
    import pyarrow.parquet as pq

    from servelens.cli import cli

    events, requests = replayed
    pq.write_table(requests, tmp_path / "requests.parquet")
    pq.write_table(events, tmp_path / "events.parquet")
    runner = CliRunner()
    result = runner.invoke(cli, ["metrics", "export", str(tmp_path / "requests.parquet"), "--events",
                                 str(tmp_path / "events.parquet"), "--out", str(tmp_path / "m.prom")])
    assert result.exit_code == 0, result.output
    assert "vllm:inter_token_latency_seconds" in families((tmp_path / "m.prom").read_text())
    result = runner.invoke(cli, ["metrics", "export", str(tmp_path / "requests.parquet"), "--format", "otlp-json",
                                 "--out", str(tmp_path / "m.json")])
    assert result.exit_code == 0, result.output
    assert "inter_token_latency" in result.output  # says what it left out
    assert json.loads((tmp_path / "m.json").read_text())["resourceMetrics"]
    result = runner.invoke(cli, ["metrics", "export", str(tmp_path / "events.parquet"), "--format", "openmetrics",
                                 "--interval-s", "1", "--out", str(tmp_path / "m.om")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.om").read_text().endswith("# EOF\n")
    result = runner.invoke(cli, ["metrics", "export", str(tmp_path / "requests.parquet"), "--labels", "tenant"])
    assert result.exit_code == 3 and "can never be a metric label" in result.output
    assert "Example" in runner.invoke(cli, ["metrics", "export", "--help"]).output


def test_the_cli_derives_the_request_table_from_an_events_file(replayed, tmp_path):
    import pyarrow.parquet as pq

    from servelens.cli import cli

    events, requests = replayed
    pq.write_table(events, tmp_path / "events.parquet")
    result = CliRunner().invoke(cli, ["metrics", "export", str(tmp_path / "events.parquet"), "--labels", ""])
    assert result.exit_code == 0, result.output
    parsed = families(result.output)
    count = next(s.value for s in parsed["vllm:inter_token_latency_seconds"].samples if s.name.endswith("_count"))
    assert count == sum(requests["num_itl_gaps"].to_pylist())


def test_a_series_over_time_ends_at_the_table_and_every_point_is_valid_openmetrics(replayed):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics

    from pipelines.exposition import request_metrics_over_time, to_openmetrics

    events, requests = replayed
    points = request_metrics_over_time(requests, events, interval_s=0.5, labels=("model",))
    assert len(points) > 3 and [e for e, _ in points] == sorted(e for e, _ in points)
    whole = request_metrics(requests, events, labels=("model",))
    last = points[-1][1]
    for a, b in zip(whole.histograms, last.histograms, strict=True):
        assert a.name == b.name and {s.labels: (s.count, s.sum) for s in a.series} == {s.labels: (s.count, s.sum) for s in b.series}
    counts = [sum(h.count for h in m.histograms if h.name == "vllm:e2e_request_latency_seconds") for _, m in points]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # cumulative, growing as requests finish
    for end, metrics in points:  # prometheus_client's parser folds repeated points of a series: check each alone
        parsed = {f.name: f for f in openmetrics(to_openmetrics([(end, metrics)]))}
        ttft = parsed["vllm:time_to_first_token_seconds"]
        assert ttft.unit == "seconds" and all(s.timestamp is not None for s in ttft.samples)
    text = to_openmetrics(points)
    assert text.endswith("# EOF\n") and text.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    stamps = [line.rsplit(" ", 1)[1] for line in text.splitlines()
              if line.startswith('vllm:time_to_first_token_seconds_count{model_name="llama-3-8b"}')]
    assert len(stamps) == len(points) and stamps == sorted(stamps, key=float)


def test_the_otlp_json_is_a_valid_export_metrics_request(replayed):
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    events, requests = replayed
    message = json_format.ParseDict(to_otlp_json(request_metrics(requests, events)), ExportMetricsServiceRequest())
    metrics = {m.name: m for m in message.resource_metrics[0].scope_metrics[0].metrics}
    ttft = metrics["vllm:time_to_first_token_seconds"].histogram
    assert ttft.aggregation_temporality == 2  # CUMULATIVE
    assert sum(p.count for p in ttft.data_points) == len(column_values(requests, "ttft_s"))
    assert metrics["vllm:prompt_tokens"].sum.is_monotonic


def test_the_series_carries_running_and_waiting_gauges(replayed):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics

    from pipelines.exposition import request_metrics_over_time, to_openmetrics

    events, requests = replayed
    points = request_metrics_over_time(requests, events, interval_s=0.25, labels=())
    rows = requests.to_pylist()
    for end, metrics in points:
        gauges = {g.name: g.series[0].value for g in metrics.gauges}
        running = sum(1 for r in rows if r["scheduled_ns"] is not None and r["scheduled_ns"] < end
                      and (r["finish_ns"] is None or r["finish_ns"] >= end))
        assert gauges["vllm:num_requests_running"] == running
        parsed = {f.name: f for f in openmetrics(to_openmetrics([(end, metrics)]))}
        assert parsed["vllm:num_requests_waiting"].type == "gauge"
    assert max(m.gauges[0].series[0].value for _, m in points) > 0
    assert points[-1][1].gauges[0].series[0].value == 0  # all finished by the last point
