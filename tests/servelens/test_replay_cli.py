"""`servelens replay` expresses the documented scenarios: loads, superpositions, block bootstraps, the two-class
scenario with every policy's defaults, and replays exactly what the README's policy table was made from."""

from __future__ import annotations

import dataclasses
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


def test_a_calibration_fitted_on_another_engine_is_used_with_a_warning(azure_slice, tmp_path):
    from replay.calibration import default_calibration, write_calibration

    cal = default_calibration()
    path = write_calibration(dataclasses.replace(cal, engine="SGLang 0.4"), tmp_path / "sglang.json")
    done = servelens("replay", "--workload", str(azure_slice), "--requests", "20", "--calibration", str(path),
                     "--out", str(tmp_path / "x"))
    assert done.returncode == 0, done.stderr
    assert (f"warning: calibration {cal.name}: fitted on SGLang 0.4, not vLLM: the replay schedules as vLLM v1 does, "
            "so its terms may not carry over") in done.stderr
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["calibration"]["other_engine"].startswith("fitted on SGLang 0.4, not vLLM")


def test_as_recorded_warns_of_recorded_classes_it_does_not_define(azure_slice, tmp_path):
    # 20 requests of two tenants: rows 0-4 record "platinum", rows 5-7 "gold", 8-19 "batch"; the scenario
    # defines interactive and batch, so the eight others are served as their tenant's class
    import pyarrow as pa

    def replay(classes: list[str], out: str):
        table = pq.read_table(azure_slice).slice(0, 20)
        for name, values in (("tenant", ["t-a", "t-b"] * 10), ("service_class", classes)):
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pa.array(values, pa.string()))
        pq.write_table(table, tmp_path / f"{out}.parquet")
        done = servelens("replay", "--workload", str(tmp_path / f"{out}.parquet"), "--scenario", "as-recorded",
                         "--out", str(tmp_path / out))
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert ("warning: 8 requests record a class the as-recorded scenario does not define ('gold', 'platinum'): "
            "each is served and judged under its tenant's class (interactive, batch; docs/replay.md)"
            ) in replay(["platinum"] * 5 + ["gold"] * 3 + ["batch"] * 12, "other")
    assert "does not define" not in replay(["interactive"] * 8 + ["batch"] * 12, "defined")


def test_zero_token_lengths_are_served_as_one_token_with_a_warning(azure_slice, tmp_path):
    # rows 0-2 record an empty prompt, rows 3-4 an empty output: vLLM serves neither, so each gets one token
    import pyarrow as pa

    table = pq.read_table(azure_slice).slice(0, 10)
    for name, values in (("num_prompt_tokens", [0, 0, 0] + [100] * 7), ("num_output_tokens", [5] * 3 + [0, 0] + [5] * 5)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
    pq.write_table(table, tmp_path / "zeros.parquet")
    done = servelens("replay", "--workload", str(tmp_path / "zeros.parquet"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "warning: 3 requests record a prompt of 0 tokens: each is served with 1 token" in done.stderr
    assert "warning: 2 requests record an output of 0 tokens: each is served with 1 token" in done.stderr
    served = pq.read_table(tmp_path / "out" / "requests.parquet")
    assert served["num_prompt_tokens"].to_pylist()[:3] == [1, 1, 1]
    assert served["num_output_tokens"].to_pylist()[3:5] == [1, 1]
    assert all(t is not None for t in served["ttft_s"].to_pylist())  # each has a first token, so a TTFT to judge
    # BurstGPT's failed rows record 0 response tokens and are marked failed: served as failures, no warning
    bursty = servelens("replay", "--workload", "burstgpt-1", "--out", str(tmp_path / "b"))
    assert bursty.returncode == 0, bursty.stderr
    assert "of 0 tokens" not in bursty.stderr and "warning: 17 of 400 requests ended in error (failed in the recorded" in bursty.stderr


def test_scenario_options_fail_cleanly(azure_slice, tmp_path):
    from click.testing import CliRunner

    from servelens.cli import cli

    for flags, code, message in ((["--shift", "10s"], 3, "--shift needs --superpose"),
                                 (["--load", "fast"], 2, "not a positive rate multiplier"),
                                 (["--block-bootstrap", "soon"], 2, "is not a duration"),
                                 (["--scenario", "three-class"], 2, "three-class")):
        done = CliRunner().invoke(cli, ["replay", "--workload", str(azure_slice), *flags, "--out", str(tmp_path / "x")])
        assert done.exit_code == code and message in done.output and "Traceback" not in done.output, done.output


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        # each was taken (a 300-digit rate; a CPU tier or a KV pool no machine has; the default engine for an empty
        # name), an internal OverflowError, a message naming a library field, or a 100,000-character file name
        (["--load", "1e308x"], 2, "load '1e308x' is more than 1,000,000x the recorded rate"),
        (["--shift", "99999999999999h", "--superpose", "2"], 2, "'--shift': 99999999999999h is 3.6e+17 s"),
        (["--shift", "100000h", "--superpose", "1000"], 3,
         "--superpose 1000 --shift 3.6e+08s: the copies must number at least 1 and the last start within 1e+09 s"),
        (["--block-bootstrap", "0s"], 2, "'--block-bootstrap': 0s is 0 s: 0.0 is not in the range 0<x"),
        (["--kv-offload", "1e30"], 3, "--kv-offloading-size must be between 0 and 65,536 GiB, not 1e+30"),
        (["--num-gpu-blocks-override", "99999999999"], 3, "--num-gpu-blocks-override 99,999,999,999: 99,999,999,999 KV "
                                                          "blocks of 2 MiB are 195,312,500.0 GiB, more than the 80.0 GiB"),
        (["--engine", ""], 3, "--engine: the engine is empty"),
        (["--engine", "llama-3-8b@h100-sxmx0"], 3, "--engine: engine 'llama-3-8b@h100-sxmx0' asks for 0 accelerators"),
        (["--engine", "a" * 100_000 + "@h100"], 3, "unknown model '" + "a" * 100 + "... (100,000 characters)'"),
    ],
)
def test_out_of_range_replay_options_are_refused_by_their_flag(azure_slice, tmp_path, flags, code, message):
    from click.testing import CliRunner

    from servelens.cli import cli

    done = CliRunner().invoke(cli, ["replay", "--workload", str(azure_slice), *flags, "--out", str(tmp_path / "x")])
    assert done.exit_code == code and message in done.output, done.output
    assert "internal error" not in done.output and "Traceback" not in done.output and len(done.output) < 1000
    assert code == 2 or "hint: " in done.output


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
