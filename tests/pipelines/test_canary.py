"""The live gate: two pools read from the lake by their pool label, a canary with doubled ITL rolled
back by the command, and a lake without pool labels refused with a message that names the label."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from dashboard.sample import LakeSink
from pipelines.canary import lake_pools
from pipelines.lake import EVENTS, Lake, OffsetRange
from privacy.keys import KeyRing
from privacy.sanitize import Sanitizer
from replay.gate import FAIL, compare_runs, default_config
from schemas.arrow import events_to_table
from schemas.events import FirstToken, RequestArrived, RequestFinished
from servelens.errors import DataNotFoundError

KEYS = KeyRing("k", {"k": bytes(32)})


def _tiny_lake(root, pools: tuple[str | None, str | None] = ("baseline", "canary"), n: int = 300) -> None:
    """``n`` single-token requests, 10 per second, alternating between two pools; the second pool
    is 3x slower to its first token."""
    events = []
    for i in range(n):
        pool = pools[i % 2]
        env = {"engine_id": f"eng-{pool}", "request_id": f"r{i}", "pool": pool, "service_class": "interactive"}
        t = 1_764_000_000_000_000_000 + i * 100_000_000
        ttft = 200_000_000 if i % 2 == 0 else 600_000_000
        events += [RequestArrived(event_id=f"a{i}", ts_ns=t, num_prompt_tokens=10, **env),
                   FirstToken(event_id=f"f{i}", ts_ns=t + ttft, **env),
                   RequestFinished(event_id=f"z{i}", ts_ns=t + ttft, outcome="completed", num_output_tokens=1, **env)]
    Lake(root).commit(EVENTS, Sanitizer(KEYS).sanitize(events_to_table(events)), [OffsetRange("t", 0, 0, 0, 1)],
                      {("t", 0, 0): None})


def test_live_pools_are_read_from_the_lake_and_judged_as_measurements(tmp_path):
    _tiny_lake(tmp_path / "lake")
    base, cand = lake_pools(str(tmp_path / "lake"), "baseline", "canary", None, None)
    assert base.requests.num_rows == cand.requests.num_rows == 150 and base.measured and cand.measured
    config = dataclasses.replace(default_config(), window_s=0.5, min_windows=20, min_window_requests=2, min_points=20)
    verdict = compare_runs(base, cand, config)
    (ttft,) = [m for m in verdict.metrics if m.metric == "ttft_p99_s" and m.group == ""]
    assert ttft.status == FAIL and ttft.critical and verdict.status == FAIL


def test_a_lake_without_pool_labels_or_without_a_pool_is_refused_with_what_it_holds(tmp_path):
    _tiny_lake(tmp_path / "unlabelled", pools=(None, None), n=10)
    with pytest.raises(DataNotFoundError, match="needs the `pool` label, and none of the 10 requests") as err:
        lake_pools(str(tmp_path / "unlabelled"), "baseline", "canary", None, None)
    assert "pool='canary'" in err.value.hint
    _tiny_lake(tmp_path / "other", pools=("baseline", "blue"), n=10)
    with pytest.raises(DataNotFoundError, match=r"pool 'canary' has no requests .* pools found: 'baseline' \(5 requests\), "
                                                r"'blue' \(5 requests\)"):
        lake_pools(str(tmp_path / "other"), "baseline", "canary", None, None)
    with pytest.raises(DataNotFoundError, match="holds no requests"):
        lake_pools(str(tmp_path / "empty"), "baseline", "canary", None, None)


def _gate(lake, *args):
    return subprocess.run([sys.executable, "-m", "servelens", "gate", "--live", *args], capture_output=True, text=True,
                          env={**os.environ, "SERVELENS_LAKE__ROOT": str(lake)})


def test_the_live_gate_on_a_lake_without_pool_labels_exits_3_naming_the_label(tmp_path):
    _tiny_lake(tmp_path / "lake", pools=(None, None), n=10)
    proc = _gate(tmp_path / "lake", "--out", str(tmp_path / "gate"))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "the live gate needs the `pool` label" in proc.stderr
    assert "hint: set the `pool` field of every event the engines emit" in proc.stderr


class _PoolSink(LakeSink):
    """Replay events committed to the lake as one pool's engines would send them."""

    def __init__(self, lake: Lake, pool: str) -> None:
        super().__init__(lake, Sanitizer(KEYS), pool)
        self.pool = pool

    def __call__(self, table: pa.Table) -> None:
        i = table.schema.get_field_index("pool")
        super().__call__(table.set_column(i, table.schema.field(i), pa.array([self.pool] * table.num_rows, pa.string())))


def test_a_live_canary_with_doubled_itl_rolls_back(tmp_path):
    """The Azure trace's first 31 minutes split at random between a baseline pool (llama-3-8b on an
    H100) and a canary whose accelerator has half the memory bandwidth: every decode step, hence
    every inter-token gap of a decoding request, takes twice as long."""
    from replay.config import parse_instance
    from replay.presets import THREE_TENANT_SCENARIO
    from replay.run import run_replay
    from replay.traces import read_trace
    from replay.workload import TableWorkload, trim
    from servelens.config import load_config, shared_dir

    trace = read_trace("azure-conv", shared_dir(load_config()))
    t0 = int(trace["arrival_ns"][0].as_py())
    workload = trim(trace, t0, t0 + 31 * 60 * 10**9)
    h100 = parse_instance("llama-3-8b@h100-sxm")
    accel = h100.accelerator
    slow = dataclasses.replace(h100, accelerator=dataclasses.replace(
        accel, memory_bandwidth_bytes_per_s=accel.memory_bandwidth_bytes_per_s / 2))
    to_canary = np.random.default_rng(0).random(workload.num_rows) < 0.5
    lake = Lake(tmp_path / "lake")
    for pool, instance, rows in (("baseline", h100, ~to_canary), ("canary", slow, to_canary)):
        run_replay(TableWorkload(workload.filter(pa.array(rows)), name=pool), scenario=THREE_TENANT_SCENARIO, instance=instance,
                   sink=_PoolSink(lake, pool))
    proc = _gate(tmp_path / "lake", "--previous-config", "policy=fcfs@v12", "--out", str(tmp_path / "gate"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "gate: FAIL: roll back to policy=fcfs@v12"
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert report["decision"]["action"] == "rollback" and report["decision"]["restore"] == "policy=fcfs@v12"
    (tpot,) = [m for m in report["metrics"] if m["metric"] == "tpot_p50_s" and m["group"] == ""]
    assert tpot["critical"] and 0.9 < tpot["effect"] < 1.2  # the mean inter-token gap doubled
    assert report["failed"][0].startswith("tpot_p50_s")
