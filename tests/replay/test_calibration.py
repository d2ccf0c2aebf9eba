"""Profiles written and read back, the fitted model's held-out error, and measured against modelled replay.

Everything runs on the CPU with the tiny shape (one torch thread: steadier on a shared machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

try:  # the dev extra pins PyTorch (`make env`): these CPU tests always run, never skip
    import torch
except ImportError as exc:  # pragma: no cover
    raise ImportError("PyTorch is missing: `make env` (pip install -e '.[dev]') installs the pinned torch==2.13.0") from exc

from replay.config import EngineConfig  # noqa: E402
from replay.cost_models import make_cost_model  # noqa: E402
from replay.costmodel import StepShape  # noqa: E402
from replay.derive import derive_requests  # noqa: E402
from replay.errors import ReplayError  # noqa: E402
from replay.measured.executor import StepExecutor  # noqa: E402
from replay.measured.fit import (  # noqa: E402
    FittedProfileConfig,
    FittedProfileCostModel,
    evaluate_profile,
    fit_table,
    profile_instance,
)
from replay.measured.measured import (  # noqa: E402
    MeasuredStepTimer,
    compare_measured,
    comparison_lines,
    latency_samples,
)
from replay.measured.profiler import (  # noqa: E402
    PROFILE_SCHEMA,
    Profile,
    default_sweep,
    read_profile,
    run_profile,
    sweep_shapes,
)
from replay.measured.shapes import llama_shape  # noqa: E402
from replay.run import run_replay  # noqa: E402
from servelens.errors import DataNotFoundError  # noqa: E402
from tests.replay.conftest import make_workload  # noqa: E402

#: A sweep small enough for the test suite (the default tiny sweep covers the engine's whole range)
QUICK = dict(
    prefill_tokens=(2, 8, 24, 48), prefill_contexts=(0, 32), decode_seqs=(1, 3, 8), decode_contexts=(8, 48),
    mixed_prefill_tokens=(8, 32), mixed_decode_seqs=(2, 6), max_kv_tokens=4096, repeats=3, warmup=1,
)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "tiny-cpu.parquet"
    shape = llama_shape("tiny")
    run_profile(shape, device="cpu", sweep=default_sweep("cpu", shape, **QUICK), out=out, num_threads=1)
    return out


def small_workload(n: int = 10) -> pa.Table:
    return make_workload(
        [i * 2_000_000 for i in range(n)], [16 + (i * 7) % 40 for i in range(n)], [4 + (i * 5) % 9 for i in range(n)]
    )


def test_a_profile_is_written_with_its_metadata_and_read_back(profile_path: Path) -> None:
    profile = read_profile(profile_path)
    sweep = default_sweep("cpu", llama_shape("tiny"), **QUICK)
    assert profile.table.schema.equals(PROFILE_SCHEMA)
    assert profile.table.num_rows == len(sweep_shapes(sweep)) == profile.meta.num_shapes_planned
    assert sorted(set(profile.table["kind"].to_pylist())) == ["decode", "mixed", "prefill"]
    m = profile.meta
    assert (m.device, m.dtype, m.timer, m.torch, m.measured) == ("cpu", "float32", "perf_counter", torch.__version__, True)
    assert m.model == m.shape == llama_shape("tiny") and m.sweep == default_sweep("cpu", llama_shape("tiny"), **QUICK)
    assert m.servelens_version and m.num_threads == 1
    assert m.date_utc.endswith("+00:00") and m.peak_flops > 0 and m.peak_bytes_per_s > 0 and not m.truncated
    raw = json.loads(pq.read_schema(profile_path).metadata[b"servelens.profile"])
    assert raw["sweep"]["repeats"] == 3 and raw["model"]["hidden_size"] == 64  # plain JSON in the file
    for row in profile.table.to_pylist():  # every repeat kept; median and spread consistent with them
        times = sorted(row["times_ns"])
        assert len(times) == 3 and row["median_ns"] == times[1]
        assert row["min_ns"] == times[0] <= row["p10_ns"] <= row["median_ns"] <= row["p90_ns"] <= row["max_ns"] == times[-1]
        assert row["num_tokens"] == sum(row["prefill_chunk_tokens"]) + len(row["decode_context"])
        assert row["decode_context_tokens"] == sum(c + 1 for c in row["decode_context"])


def test_reading_something_else_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="no profile at"):
        read_profile(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(DataNotFoundError, match="no servelens profile metadata"):
        read_profile(tmp_path / "other.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataNotFoundError, match="not a Parquet profile"):
        read_profile(tmp_path / "text.parquet")


def test_the_fit_reports_held_out_error_and_roofline_fraction(profile_path: Path) -> None:
    table, report = evaluate_profile(read_profile(profile_path))
    n = read_profile(profile_path).table.num_rows
    assert report.held_out.num_shapes == round(0.2 * n) and report.train.num_shapes == n - round(0.2 * n)
    for s in (report.held_out, report.train, report.all_shapes):
        assert 0 <= s.median <= s.p95 <= s.max and np.isfinite(s.max)
    assert report.held_out.median < 1.0  # CPU times on a shared machine are noisy; the table is not useless
    kinds = dict(report.roofline_fraction)
    assert set(kinds) <= {"prefill", "decode", "mixed", "all"} and "all" in kinds
    assert all(0 < f < 2 for f in kinds.values())
    assert all(v >= 0 for v in table.table_ns + table.attention) and table.row_ns >= 0


def synthetic_profile(shapes: list, times_ns: list[int]) -> Profile:
    rows = {f.name: [] for f in PROFILE_SCHEMA}
    for i, (s, t) in enumerate(zip(shapes, times_ns)):
        rows["shape_id"].append(i)
        rows["kind"].append("mixed" if s.prefill_chunks and s.num_decode_seqs else "prefill" if s.prefill_chunks else "decode")
        rows["prefill_chunk_tokens"].append([c for c, _ in s.prefill_chunks])
        rows["prefill_chunk_context"].append([o for _, o in s.prefill_chunks])
        per = s.decode_context_tokens // max(1, s.num_decode_seqs) - 1
        rows["decode_context"].append([per] * s.num_decode_seqs)
        rows["num_tokens"].append(s.num_tokens)
        rows["num_decode_seqs"].append(s.num_decode_seqs)
        rows["decode_context_tokens"].append(s.decode_context_tokens)
        for key in ("median_ns", "min_ns", "max_ns"):
            rows[key].append(t)
        for key in ("mean_ns", "p10_ns", "p90_ns"):
            rows[key].append(float(t))
        rows["std_ns"].append(0.0)
        rows["times_ns"].append([t])
    return pa.Table.from_pydict(rows, schema=PROFILE_SCHEMA)


def test_a_profile_that_follows_the_table_form_is_fitted_closely_on_held_out_shapes(profile_path: Path) -> None:
    """Times made by a known table (piecewise in tokens, linear attention): held-out error ~ 0."""
    def truth(s: StepShape) -> int:
        tokens = s.num_tokens
        base = 50_000 + 900 * tokens if tokens <= 64 else 50_000 + 900 * 64 + 400 * (tokens - 64)
        pairs = sum(c * o + c * (c + 1) // 2 for c, o in s.prefill_chunks)
        return round(base + 3 * pairs + 20 * s.decode_context_tokens + 7_000 * len(s.prefill_chunks))

    shapes = []
    for c in (4, 16, 64, 128, 256):
        for o in (0, 100, 400):
            shapes.append(StepShape(((c, o),), 0, 0))
    for d in (1, 4, 16, 64):
        for ctx in (50, 200, 800):
            shapes.append(StepShape((), d, d * (ctx + 1)))
    for c in (16, 128):
        for d in (4, 16):
            shapes.append(StepShape(((c, 0),), d, d * 301))
    table = synthetic_profile(shapes, [truth(s) for s in shapes])
    profile = Profile(table, read_profile(profile_path).meta)
    fitted, report = evaluate_profile(profile, seed=1)
    assert report.held_out.num_shapes == round(0.2 * len(shapes)) == 6
    # the table's knots are a subset of the token counts (the true kink at 64 falls between two)
    assert report.held_out.median < 0.02 and report.held_out.p95 < 0.08
    model = FittedProfileCostModel(fitted)
    assert abs(model.step_time_ns(StepShape(((100, 50),), 8, 8 * 400)) / truth(StepShape(((100, 50),), 8, 8 * 400)) - 1) < 0.02


def test_fitted_decode_runs_equal_stepping_and_layers_scale(profile_path: Path) -> None:
    profile = read_profile(profile_path)
    table, _ = evaluate_profile(profile)
    one = FittedProfileCostModel(table)
    assert fit_table([StepShape(((8, 0),), 0, 0)] * 3, [1e6] * 3).knots == (8,)
    for scale in (1.0, 10.0):
        m = FittedProfileCostModel(table, layer_scale=scale)
        for d, ctx, k, horizon in ((1, 40, 50, None), (6, 300, 200, 3_000_000), (3, 9, 1, 5)):
            run = m.decode_run(d, ctx, k, horizon)
            total = 0
            for i in range(run.num_steps):
                step = m.step_time_ns(StepShape((), d, ctx + d * i))
                total += step
            assert (run.duration_ns, run.last_step_ns) == (total, step)
            if horizon is not None and run.num_steps < k:
                assert total >= horizon > total - step
    big = FittedProfileCostModel(table, layer_scale=10.0)
    shape = StepShape(((32, 16),), 4, 4 * 30)
    assert big.step_time_ns(shape) > 5 * one.step_time_ns(shape)


def test_the_profile_cost_model_reads_our_profiles_and_replays(profile_path: Path) -> None:
    meta = read_profile(profile_path).meta
    instance = profile_instance(meta)
    model = make_cost_model("profile", instance, config=FittedProfileConfig(path=str(profile_path)))
    assert isinstance(model, FittedProfileCostModel) and model.layer_scale == 1.0
    assert dict(model.info().parameters)["held_out_median_rel_error"]
    tables: dict[str, list] = {"fast": [], "reference": []}
    for mode, sink in tables.items():
        run_replay(small_workload(), instance=instance, cost_model=model, mode=mode, sink=sink.append)
    fast, ref = (derive_requests(pa.concat_tables(t)).sort_by("request_id") for t in tables.values())
    for column in ("first_token_ns", "last_token_ns", "finish_ns"):  # closed-form decode runs equal stepping
        assert fast[column].to_pylist() == ref[column].to_pylist()
    other = profile_instance(meta)
    wrong = type(other)(accelerator=other.accelerator, model=llama_shape("llama-1b").model_config(2), engine=other.engine)
    with pytest.raises(ReplayError, match="profile measured tiny"):
        make_cost_model("profile", wrong, config=FittedProfileConfig(path=str(profile_path)))


def test_measured_and_modelled_replays_compare_on_cpu(profile_path: Path, tmp_path: Path) -> None:
    result = compare_measured(
        small_workload(), profile_path, out_dir=tmp_path, num_threads=1, engine=EngineConfig(block_size_tokens=16)
    )
    assert [(r.metric, r.quantile) for r in result.rows] == [
        (m, q) for m in ("ttft_s", "itl_s", "e2e_s") for q in ("p50", "p90", "p99")
    ]
    assert all(r.modelled_s > 0 and r.measured_s > 0 and r.relative_error is not None for r in result.rows)
    assert result.measured.num_requests == result.modelled.num_requests == 10
    assert result.num_steps == result.measured.num_steps > 0 and result.measured_busy_s > 0
    assert result.step_error.num_shapes == result.num_steps
    manifest = json.loads((tmp_path / "measured" / "manifest.json").read_text())
    assert manifest["clock"]["measured"] is True and manifest["mode"] == "reference"
    assert "clock" not in json.loads((tmp_path / "modelled" / "manifest.json").read_text())
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert len(saved["rows"]) == 9 and saved["fit"]["held_out"]["num_shapes"] > 0
    # the measured run's events carry the measured step times: busy time = the executed steps' sum
    events = pq.read_table(tmp_path / "measured" / "events.parquet")
    steps = events.filter(pa.compute.equal(events["event_type"], "step_executed"))
    assert steps.num_rows == result.num_steps
    samples = latency_samples(events)
    assert samples["itl_s"].size == sum(max(0, n - 1) for n in small_workload()["num_output_tokens"].to_pylist())
    assert any("held-out" in line for line in comparison_lines(result))


def test_each_measured_step_is_warmed_up_on_its_own_work_first(profile_path: Path) -> None:
    """The timed run of a step follows one untimed run of the same work, as each profile shape is warmed."""
    profile = read_profile(profile_path)
    table, report = evaluate_profile(profile)
    instance = profile_instance(profile.meta, EngineConfig(block_size_tokens=16), full_layers=False)
    for warm in (True, False):
        ex = StepExecutor(profile.meta.shape, num_kv_blocks=256)
        calls: list[tuple] = []  # (the step's work, free KV blocks after the call)
        execute = ex.execute

        def counting(work, token_ids=None, ex=ex, calls=calls, execute=execute):
            logits = execute(work, token_ids)
            calls.append((tuple(work), ex.num_free_blocks))
            return logits

        ex.execute = counting
        timer = MeasuredStepTimer(ex, warmup_steps=0, warm_each_step=warm)
        with torch.inference_mode():
            run_replay(small_workload(), instance=instance, cost_model=FittedProfileCostModel(table, source="t", report=report),
                       mode="reference", step_timer=timer)
        assert len(timer.steps) > 0
        if warm:  # each step's work twice, untimed then timed; the second call allocates no KV block
            assert len(calls) == 2 * len(timer.steps) and calls[0::2] == calls[1::2]
        else:
            assert len(calls) == len(timer.steps)


def test_a_measured_replay_refuses_a_large_workload(profile_path: Path) -> None:
    with pytest.raises(ReplayError, match="at most 5 requests"):
        compare_measured(small_workload(), profile_path, max_requests=5)
    with pytest.raises(ReplayError, match="the profile was measured on cpu"):
        compare_measured(small_workload(), profile_path, device="cuda")


def test_the_default_sweeps_stay_within_their_limits() -> None:
    for device, name in (("cpu", "tiny"), ("cpu", "llama-1b"), ("cuda", "llama-8b"), ("cuda", "llama-70b")):
        sweep = default_sweep(device, llama_shape(name))
        shapes = sweep_shapes(sweep)
        assert {s.kind for s in shapes} == {"prefill", "decode", "mixed"}
        assert all(s.kv_tokens <= sweep.max_kv_tokens and s.num_tokens <= sweep.max_step_tokens for s in shapes)
        assert len(set(shapes)) == len(shapes)
    assert sweep_shapes(default_sweep("cpu", llama_shape("tiny"), seed=1)) != sweep_shapes(default_sweep("cpu", llama_shape("tiny")))


# ------------------------------------------------------------------------------------------ the CLI


def cli_run(*args: str):
    from click.testing import CliRunner

    from servelens.cli import cli

    return CliRunner().invoke(cli, list(args))


def test_cli_profile_and_compare_measured(tmp_path: Path, profile_path: Path) -> None:
    workload = tmp_path / "w.parquet"
    pq.write_table(small_workload(8), workload)
    out = cli_run("compare-measured", "--workload", str(workload), "--profile", str(profile_path), "--requests", "6",
                  "--threads", "1", "--out", str(tmp_path / "cmp"))
    assert out.exit_code == 0, out.output
    assert "ttft_s" in out.output and "held-out" in out.output and "6 requests" in out.output
    assert (tmp_path / "cmp" / "comparison.json").is_file()
    out = cli_run("replay", "--workload", str(workload), "--profile", str(profile_path), "--out", str(tmp_path / "rp"))
    assert out.exit_code == 0, out.output
    manifest = json.loads((tmp_path / "rp" / "manifest.json").read_text())
    assert manifest["cost_model"]["name"] == "profile" and "held_out_p95_rel_error" in manifest["cost_model"]["parameters"]
    out = cli_run("replay", "--workload", str(workload), "--profile", str(profile_path), "--measured", "--requests", "4",
                  "--out", str(tmp_path / "measured"))
    assert out.exit_code == 0, out.output
    assert "steps executed" in out.output
    assert json.loads((tmp_path / "measured" / "manifest.json").read_text())["clock"]["device"] == "cpu"


def test_cli_errors_are_clean(tmp_path: Path, profile_path: Path) -> None:
    cases = [
        (("profile", "--model", "llama-7b", "--out", str(tmp_path / "p.parquet")), "valid names: llama-1b"),
        (("profile", "--model", "llama-1b", "--layers", "40", "--out", str(tmp_path / "p.parquet")), "between 1 and 16"),
        (("replay", "--workload", "x", "--profile", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "r")), None),
        (("replay", "--workload", "x", "--measured", "--out", str(tmp_path / "r")), "--measured needs --profile"),
        (("profile-info", str(tmp_path / "none.parquet")), "no profile at"),
        (("profile-info", __file__), "is not a Parquet profile"),
        (("replay", "--workload", str(profile_path), "--profile", str(profile_path), "--engine", "llama-3-8b@h100-sxm",
          "--out", str(tmp_path / "r")), "--engine and --profile both given"),
    ]
    if not torch.cuda.is_available():
        cases.append((("profile", "--model", "tiny", "--device", "cuda", "--out", str(tmp_path / "p.parquet")),
                      "no CUDA device"))
    for args, message in cases:
        out = cli_run(*args)
        assert out.exit_code != 0 and "Traceback" not in out.output, out.output
        assert out.exception is None or isinstance(out.exception, SystemExit)
        if message:
            assert message in out.output, out.output


def test_cli_help_has_examples() -> None:
    for command in ("profile", "profile-info", "compare-measured"):
        out = cli_run(command, "--help")
        assert out.exit_code == 0 and "Example:" in out.output and "servelens " + command in out.output


#: GPU profiles committed under profiles/ (benchmarks/calibrate_gpu.py on an NVIDIA H200, 2026-11-29)
SHIPPED = sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.parquet"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_the_shipped_gpu_profiles_read_back_and_refit_to_their_reports(path: Path) -> None:
    """Their fit reports were written on the GPU machine; refitting here must give the same figures."""
    profile = read_profile(path)
    meta = profile.meta
    assert (meta.device, meta.device_name, meta.dtype, meta.timer) == ("cuda", "NVIDIA H200", "bfloat16", "cuda-events")
    assert not meta.truncated and profile.table.num_rows == meta.num_shapes_planned
    _, report = evaluate_profile(profile)
    saved = json.loads(path.with_name(path.name + ".fit.json").read_text())
    assert saved["model"]["name"] == meta.shape.name and saved["device_name"] == meta.device_name
    for part in ("held_out", "train", "all_shapes"):
        ours = getattr(report, part)
        assert ours.num_shapes == saved[part]["num_shapes"]
        assert ours.median == pytest.approx(saved[part]["median"], rel=1e-9)
        assert ours.p95 == pytest.approx(saved[part]["p95"], rel=1e-9)
    # one step-time check against the measurements themselves: the fitted table's median error over
    # every measured shape is the report's, and it is small
    assert report.all_shapes.median < 0.2


def test_profile_info_says_where_a_shipped_profile_was_measured() -> None:
    path = next(p for p in SHIPPED if p.stem == "llama-8b-h200")
    saved = json.loads(path.with_name(path.name + ".fit.json").read_text())
    out = cli_run("profile-info", str(path))
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "model:    llama-8b, 32 of its 32 layers built, bfloat16, KV blocks of 16 tokens"
    assert lines[1] == "device:   cuda NVIDIA H200, driver 580.159.04, CUDA 13.0; torch 2.11.0+cu130"
    assert lines[2].startswith("timing:   cuda-events; 254 of 254 shapes, 3 warm-ups and 7 timed runs each")
    held = saved["held_out"]
    assert f"held-out relative error median {held['median']:.1%}, p95 {held['p95']:.1%}" in out.output


def test_three_gpu_profiles_are_shipped() -> None:
    assert [p.stem for p in SHIPPED] == ["llama-1b-h200", "llama-70b-8l-h200", "llama-8b-h200"]
