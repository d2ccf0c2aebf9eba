"""`servelens replay` expresses the documented scenarios: loads, superpositions, block bootstraps, the two-class
scenario with every policy's defaults, and replays exactly what the README's policy table was made from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replay.presets import LoadShape, prepared_workload
from replay.traces import read_trace
from replay.workload import block_bootstrap
from tests.servelens.test_cli import servelens

README = Path(__file__).resolve().parents[2] / "README.md"
ENGINE = ["--engine", "llama-2-7b@a100-80gx2", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "128"]


@pytest.fixture(scope="module")
def azure_slice(shared, tmp_path_factory) -> Path:
    """The first 1,200 requests of the Azure conversation trace as a workload file."""
    path = tmp_path_factory.mktemp("workload") / "azure-1200.parquet"
    pq.write_table(read_trace("azure-conv", shared).slice(0, 1200), path)
    return path


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_the_command_line_replays_what_the_policy_table_replays(azure_slice, tmp_path):
    """`replay --load 2x --policy deadline --engine ... --gpu-memory-utilization 0.5 --max-num-seqs 128` and benchmarks/policies.py's run
    of the same workload give byte-identical events and the same request table."""
    from benchmarks.policies import replay_run

    done = servelens("replay", "--workload", str(azure_slice), "--load", "2x", "--policy", "deadline", *ENGINE,
                     "--out", str(tmp_path / "cli"))
    assert done.returncode == 0, done.stderr
    workload, _ = prepared_workload(pq.read_table(azure_slice), str(azure_slice), preset="two-class",
                                    shape=LoadShape(load=2))
    bench = replay_run(workload, "deadline", tmp_path / "bench")
    assert _manifest(tmp_path / "cli")["output"]["events_sha256"] == bench.output_sha256
    assert pq.read_table(tmp_path / "cli" / "requests.parquet").equals(pq.read_table(bench.requests_path))
    assert "scenario two-class" in done.stderr and "goodput" in done.stdout and "attainment" in done.stdout


def test_deadline_without_a_config_differs_from_fcfs_on_an_overloaded_run(azure_slice, tmp_path):
    figures = {}
    for policy in ("fcfs", "deadline"):
        out = tmp_path / policy
        # 3x: the slice's first 1,200 requests at 2x are served within the objectives (8.7 req/s either way)
        done = servelens("replay", "--workload", str(azure_slice), "--load", "3x", "--policy", policy, *ENGINE,
                         "--out", str(out))
        assert done.returncode == 0, done.stderr
        requests = pq.read_table(out / "requests.parquet")
        goodput = float(re.search(r"goodput ([\d.]+) req/s", done.stdout).group(1))
        figures[policy] = (goodput, pc.sum(pc.equal(requests["outcome"], "rejected")).as_py())
        config = _manifest(out)["policy"]["config"]
        if policy == "deadline":  # the documented classes and objectives, not the one objective-less default class
            assert {c["name"] for c in config["tenancy"]["classes"]} == {"interactive", "batch"}
    assert figures["fcfs"][1] == 0 < figures["deadline"][1]  # deadline sheds what it cannot serve in time ...
    assert figures["deadline"][0] > 1.5 * figures["fcfs"][0]  # ... and serves far more within the objectives


def test_load_superpose_and_block_bootstrap_reshape_the_workload(azure_slice, tmp_path):
    base = pq.read_table(azure_slice)
    span = pc.max(base["arrival_ns"]).as_py() - pc.min(base["arrival_ns"]).as_py()
    cases = {
        "load": (["--load", "2x"], base.num_rows, span // 2),
        "superpose": (["--superpose", "3", "--shift", "30s"], 3 * base.num_rows, span + 2 * 30 * 10**9),
        "bootstrap": (["--block-bootstrap", "60s", "--windows", "4", "--seed", "5"], None, None),
    }
    for name, (flags, num_requests, new_span) in cases.items():
        out = tmp_path / name
        done = servelens("replay", "--workload", str(azure_slice), *flags, "--policy", "fcfs", "--out", str(out),
                         "--calibration", "none")
        assert done.returncode == 0, done.stderr
        requests = pq.read_table(out / "requests.parquet")
        arrivals = requests["arrival_ns"]
        manifest = _manifest(out)["workload"]
        assert manifest["transforms"] and manifest["load_factor"] == (2.0 if name == "load" else 1.0)
        if num_requests is not None:
            assert requests.num_rows == num_requests
            assert pc.max(arrivals).as_py() - pc.min(arrivals).as_py() == new_span
        else:  # four one-minute windows, each a copy of one drawn from the trace (seeded): at most four minutes
            drawn = block_bootstrap(base, 60 * 10**9, 4, 5)
            assert requests.num_rows == drawn.num_rows and 0 < drawn.num_rows
            assert pc.max(arrivals).as_py() - pc.min(arrivals).as_py() < 4 * 60 * 10**9
    assert _manifest(tmp_path / "load")["workload"]["name"].endswith("@2x")


def test_the_summary_prints_the_prefix_hit_rate_the_table_records(shared, tmp_path):
    done = servelens("replay", "--workload", "mooncake", "--requests", "300", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    requests = pq.read_table(tmp_path / "requests.parquet")
    share = pc.sum(requests["num_cached_prefix_tokens"]).as_py() / pc.sum(requests["num_prompt_tokens"]).as_py()
    assert f"prefix cache: {100 * share:.1f}% of prompt tokens found cached when first scheduled" in done.stdout
    assert "TTFT (engine side) p50 / p90 / p99" in done.stdout and "E2E (client side" in done.stdout


def test_scenario_options_fail_cleanly(azure_slice, tmp_path):
    from click.testing import CliRunner

    from servelens.cli import cli

    for flags, code, message in ((["--shift", "10s"], 3, "--shift needs --superpose"),
                                 (["--load", "fast"], 2, "not a positive rate multiplier"),
                                 (["--block-bootstrap", "soon"], 2, "is not a duration"),
                                 (["--scenario", "three-class"], 2, "three-class")):
        done = CliRunner().invoke(cli, ["replay", "--workload", str(azure_slice), *flags, "--out", str(tmp_path / "x")])
        assert done.exit_code == code and message in done.output and "Traceback" not in done.output, done.output


def test_the_readme_2x_deadline_row_is_what_the_command_prints(shared, tmp_path):
    """The acceptance: the README's command reproduces the policy table's 2x deadline row (the whole trace)."""
    row = next(line for line in README.read_text().splitlines() if line.startswith("| 2x | `deadline` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    goodput, attainment, ttft_p99, rejected = cells[2], cells[3], cells[4], cells[7]
    done = servelens("replay", "--workload", "azure-conv", "--load", "2x", "--policy", "deadline", *ENGINE,
                     "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    interactive, batch = (a.strip().rstrip("%") for a in attainment.split("/"))
    assert f"goodput {goodput} req/s" in done.stdout
    assert f"batch {batch}%, interactive {interactive}%" in done.stdout
    assert f"rejected {rejected.split(' (')[0]} ({rejected.split('(')[1].rstrip(')')})" in done.stdout
    p99_ms = float(re.search(r"TTFT \(engine side\) p50 / p90 / p99: [\d,.]+ / [\d,.]+ / ([\d,.]+) ms",
                             done.stdout).group(1).replace(",", ""))
    assert f"{p99_ms / 1000:.2f}" == ttft_p99
