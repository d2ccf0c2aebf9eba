"""The headline figures a replay prints (replay.figures): the client-side means beside the percentiles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from replay.config import EngineConfig, FrontendConfig, instance_config
from replay.costmodel import ConstantCostConfig
from replay.figures import format_figures, run_figures
from replay.metrics import MetricsConfig
from tests.replay.conftest import make_workload

MS = 1_000_000
CONSTANT = {"cost_model": "constant", "cost_model_config": ConstantCostConfig(step_time_ns=10 * MS)}


def test_client_side_means_are_those_inference_perf_reports(run):
    # the timeline of tests/replay/test_engine.py's frontend case (every step 10 ms; the frontend 3 ms + 1 us
    # per prompt token in, 1 ms per token out): r0 sent at 0, first byte 14.016 ms, last (20th token) 204.016;
    # r1 sent at 25, first byte 54.016, last (5th) 94.016. Client TTFTs 14.016 and 29.016 ms (mean 21.516),
    # E2Es 204.016 and 69.016 (mean 136.516); ITL as a ratio of means: (136.516 - 21.516) / (12.5 - 1) = 10.0 ms.
    frontend = FrontendConfig(request_overhead_s=0.003, tokenize_s_per_token=1e-6, stream_delivery_s=0.001)
    instance = replace(instance_config(engine=EngineConfig(async_scheduling=True)), frontend=frontend)
    out = run(make_workload([0, 25 * MS], [16, 16], [20, 5]), instance=instance, **CONSTANT)
    figures = run_figures(out.requests, None, MetricsConfig())
    assert figures.client_means_s == pytest.approx((0.021516, 0.136516, 0.010))
    lines = format_figures(figures)
    assert ("client-side means, as inference-perf reports them: TTFT 21.5 ms, E2E 136.5 ms, ITL 10.0 ms "
            "(ITL: (E2E - TTFT) / (generated tokens - 1), a ratio of means)") in lines


def test_without_a_modelled_client_there_are_no_client_means(run):
    out = run(make_workload([0, 25 * MS], [16, 16], [20, 5]), **CONSTANT)
    figures = run_figures(out.requests, None, MetricsConfig())
    assert figures.client_means_s is None
    assert not any(line.startswith("client-side means") for line in format_figures(figures))
