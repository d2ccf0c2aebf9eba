"""servelens replay with vLLM's settings and a calibration, servelens fidelity and servelens calibrate, run as
users run them: real processes, reports on disk, clean errors (exit 3) on bad input."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replay.calibration import calibration_named
from tests.servelens.test_cli import servelens


def test_replay_takes_vllm_settings_an_inference_perf_spec_and_the_shipped_calibration(tmp_path, shared):
    engine_file = tmp_path / "engine.yaml"
    engine_file.write_text("engine: meta-llama/Llama-3.1-8B-Instruct@H100\nmax-num-seqs: 64\nenable_prefix_caching: true\n")
    out = tmp_path / "run"
    done = servelens("replay", "--workload", str(shared / "fidelity/workloads/general-lite.yaml"), "--engine-config",
                     str(engine_file), "--max-num-seqs", "32", "--num-gpu-blocks-override", "20000", "--out", str(out),
                     env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    assert "TTFT (client side: send -> receipt)" in done.stdout and "calibration vllm-0.15.1-h100" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    engine = manifest["instance"]["engine"]
    assert (engine["max_num_seqs"], engine["num_kv_blocks_override"], engine["async_scheduling"]) == (32, 20000, True)
    assert manifest["instance"]["model"]["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert manifest["calibration"]["name"] == "vllm-0.15.1-h100" and not manifest["calibration"]["extrapolated"]
    assert manifest["instance"]["frontend"]["tokenize_s_per_token"] > 0
    events = pq.read_table(out / "events.parquet", columns=["event_type", "client_sent_ns", "first_byte_ns"])
    arrived = events.filter(pc.equal(events["event_type"], "request_arrived"))
    assert arrived["client_sent_ns"].null_count == 0 and arrived.num_rows > 4000
    raw = servelens("replay", "--workload", "general-lite", "--engine", "llama-3-8b@h100", "--calibration", "none",
                    "--requests", "300", "--out", str(tmp_path / "raw"), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert raw.returncode == 0, raw.stderr
    assert "TTFT (engine side)" in raw.stdout and "calibration" not in json.loads((tmp_path / "raw/manifest.json").read_text())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "gpt-5@h100"], "unknown model 'gpt-5'"),
        (["--engine", "llama-3-8b@tpu-v5"], "unknown accelerator 'tpu-v5'"),
        (["--engine", "llama-2-70b@l40s"], "does not fit on 1 x l40s: 128.5 GiB of weights"),
        (["--engine", "{config}@h100"], "missing field 'num_attention_heads'"),
        (["--quantization", "int4"], "quantization 'int4' is not modelled"),
        (["--calibration", "nowhere.json"], "no calibration 'nowhere.json'"),
        (["--cost-model", "constant", "--calibration", "vllm-0.15.1-h100"], "calibrates the roofline cost model"),
        (["--engine", "llama-3-8b@h100", "--tensor-parallel-size", "3"], "32 attention heads, which a tensor-parallel"),
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size must be at least 1, not 0"),
        (["--max-num-batched-tokens", "64", "--max-num-seqs", "128"],
             "--max-num-batched-tokens 64 is below --max-num-seqs 128: vLLM refuses"),
        (["--block-size", "1000000000"], "--block-size 1000000000 is not one of vLLM's block sizes"),
        (["--pipeline-parallel-size", "33"], "llama-3-8b has 32 layers, too few for 33 pipeline stages"),
        (["--requests", "0"], "Invalid value for '--requests': 0 is not in the range 1<=x<=1000000000"),
        (["--workload", "{spec}"], "spec.yaml: the stages ask for 100,000,000,000 requests, more than the 50,000,000"),
    ],
)
def test_bad_engines_are_clean_errors_that_name_the_problem(tmp_path, shared, args, message):
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                                    "vocab_size": 100}))
    spec = tmp_path / "spec.yaml"  # YAML reads 1e5 as text; inference-perf takes it as a number, so does the replay
    spec.write_text("load: {stages: [{rate: 1e5, duration: 1e6}]}\ndata: {type: random, input_distribution: 10, "
                    "output_distribution: 10}\n")
    args = [a.replace("{config}", str(config)).replace("{spec}", str(spec)) for a in args]
    done = servelens("replay", "--workload", "azure-conv", "--requests", "10", *args, "--out", str(tmp_path / "o"),
                     env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 3, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_fidelity_reports_recorded_against_replayed(tmp_path, shared):
    out = tmp_path / "fidelity"
    done = servelens("fidelity", "--experiments", "62,64", "--out", str(out), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "fidelity.json").read_text())
    assert set(report["experiments"]) == {"62", "64"} and report["calibration"] == "vllm-0.15.1-h100"
    row = report["experiments"]["64"]["ttft_mean"]
    assert row["recorded_s"] == pytest.approx(0.026716193809794884)  # experiments.csv, ms -> s
    assert row["signed_error_pct"] == pytest.approx((row["replayed_s"] / row["recorded_s"] - 1) * 100, abs=1e-3)
    assert set(report["median_abs_error_pct"]) == {"e2e_mean", "e2e_p90", "e2e_p99", "ttft_mean", "ttft_p90",
                                                   "ttft_p99", "itl_mean"}
    assert "median absolute error across runs" in done.stdout
    assert "| median abs error |" in (out / "fidelity.md").read_text()
    # each run's replayed load beside its errors; both runs were fitted, so neither is beyond the fitted load
    shipped = calibration_named("vllm-0.15.1-h100").fitted_load  # its fitted runs' busiest minute (test_load.py)
    assert report["fitted_load"] == shipped.as_json()
    assert all(0 < report["experiments"][e]["load"]["batch_share"] < shipped.batch_share for e in ("62", "64"))
    assert not any(report["experiments"][e]["load"]["beyond_fitted"] for e in ("62", "64"))
    assert "plotly" in (out / "fidelity.html").read_text()
    # 62 ran two load stages (stages.csv), 64 one: 62's report has each stage's figures beside the whole run's
    stages = report["experiments"]["62"]["stages"]
    assert set(stages) == {"0", "1"} and "stages" not in report["experiments"]["64"]
    assert stages["0"]["ttft_p99"]["recorded_s"] == pytest.approx(0.036408903356641524)  # stages.csv, ms -> s
    assert stages["1"]["ttft_p99"]["recorded_s"] == pytest.approx(0.025621170159429308)
    # the whole run's mean is its stages' request-weighted mean: strictly between them when they differ
    low, high = sorted(stages[i]["e2e_mean"]["replayed_s"] for i in ("0", "1"))
    assert low < report["experiments"]["62"]["e2e_mean"]["replayed_s"] < high
    markdown = (out / "fidelity.md").read_text()
    assert "Per load stage" in markdown and "Signed error per metric and load stage" in (out / "fidelity.html").read_text()
    assert all(f"| 62 Mistral-Nemo-Instruct-2407 tp2 general-lite | {i} | " in markdown for i in (0, 1))
    bad = servelens("fidelity", "--experiments", "60,nope", "--out", str(out), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert bad.returncode == 3 and "unknown experiment(s) nope" in bad.stderr


def test_calibrate_from_a_recorded_run_s_steps_and_replay_with_it(tmp_path, shared):
    """A run recorded by a synthetic engine (the replay with known terms) is calibrated from its step events;
    the file says what it was fitted on and its held-out error, and replays use it."""
    rec = tmp_path / "recorded"
    done = servelens("replay", "--workload", "azure-conv", "--requests", "1500", "--engine", "llama-3-8b@h100",
                     "--calibration", "none", "--out", str(rec), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    cal = tmp_path / "mine.json"
    done = servelens("calibrate", "--from", "steps", "--events", str(rec / "events.parquet"), "--engine",
                     "llama-3-8b@h100", "--out", str(cal), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    written = json.loads(cal.read_text())
    # the recording engine was the uncalibrated roofline (compute at 0.6 of peak): prefill steps tell it; the
    # steps the fit never saw (the run's second half) are predicted within 1% (the weights' share comes from
    # the shipped calibration, the step overhead takes up the difference: one model cannot separate them)
    assert written["roofline"]["compute_efficiency"] == pytest.approx(0.6, rel=0.02)
    assert written["held_out_error_pct"]["step_time_median"] < 1 and "step times" in written["method"]
    # the load it vouches for is the recorded run's own, as the recording's manifest measured it
    recorded = json.loads((rec / "manifest.json").read_text())["load"]
    assert written["fitted_load"] == {k: recorded[k] for k in ("batch_share", "kv_share", "batch_seqs")}
    assert f"fitted load: its runs' busiest minute {recorded['batch_share']:.0%} of max_num_seqs" in done.stdout
    again = servelens("replay", "--workload", "azure-conv", "--requests", "200", "--calibration", str(cal), "--out",
                      str(tmp_path / "again"), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert again.returncode == 0, again.stderr and "calibration mine" in again.stdout
    missing = servelens("calibrate", "--from", "steps", "--engine", "llama-3-8b@h100", "--out", str(cal))
    assert missing.returncode == 3 and "--from steps needs --events" in missing.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # each was taken and ignored: the experiments replay their recorded settings, --events one recorded run
        (["fidelity", "--experiments", "63", "--max-num-seqs", "-5"], "--max-num-seqs: given with fidelity experiments"),
        (["fidelity", "--experiments", "63", "--gpu-memory-utilization", "0.01", "--tensor-parallel-size", "3"],
         "--tensor-parallel-size, --gpu-memory-utilization: given with fidelity experiments, which replay their own"),
        (["fidelity", "--max-num-seqs", "1", "--no-enable-prefix-caching"],
         "--max-num-seqs, --no-enable-prefix-caching: given with fidelity experiments"),
        (["fidelity", "--engine", "llama-3-8b@h100"], "--engine: given with fidelity experiments"),
        (["fidelity", "--events", "{events}", "--experiments", "63"], "--experiments: given with --events, which replays"),
        (["fidelity", "--events", "{events}", "--data", "{data}", "--experiments", "63"], "--data, --experiments: given"),
        (["calibrate", "--max-num-seqs", "8"], "--max-num-seqs: given with --from experiments, whose runs carry"),
        (["calibrate", "--engine-config", "{engine}"], "--engine-config: given with --from experiments"),
        (["calibrate", "--events", "{events}"], "--events: given with --from experiments"),
        (["calibrate", "--from", "steps", "--events", "{events}", "--experiments", "63"],
         "--experiments: given with --from steps, which fits the run --events recorded"),
        # was the full 13-run fit (",,," was already refused)
        (["calibrate", "--experiments", ""], "--experiments '' names no experiment"),
        (["calibrate", "--experiments", ",,,"], "--experiments ',,,' names no experiment"),
        (["fidelity", "--experiments", " "], "--experiments ' ' names no experiment"),
        (["calibrate", "--from", "steps", "--events", "{events}", "--engine", ""], "--engine: the engine is empty"),
    ],
)
def test_options_the_command_would_ignore_are_refused_by_name(tmp_path, shared, args, message):
    from click.testing import CliRunner

    from servelens.cli import cli

    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "engine.yaml").write_text("max-num-seqs: 8\n")
    fill = {"{events}": str(tmp_path / "events.jsonl"), "{data}": str(shared / "fidelity"),
            "{engine}": str(tmp_path / "engine.yaml")}
    args = [fill.get(a, a) for a in args]
    done = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out.json")], env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.exit_code == 3 and message in done.output and "hint: " in done.output, done.output
    assert not (tmp_path / "out.json").exists()


def test_calibrate_fits_over_the_calibration_given(tmp_path, shared):
    """--calibration was ignored by calibrate (every fit started from the shipped one): --from steps takes the
    terms it does not fit from it, --from experiments searches from its terms too."""
    from unittest import mock

    from click.testing import CliRunner

    from servelens.cli import cli

    rec = tmp_path / "recorded"
    done = servelens("replay", "--workload", "azure-conv", "--requests", "60", "--engine", "llama-3-8b@h100",
                     "--calibration", "none", "--out", str(rec), env={"SERVELENS_SHARED_DIR": str(shared)})
    assert done.returncode == 0, done.stderr
    methods = {}
    for base in ("none", "vllm-0.15.1-h100"):
        out = tmp_path / f"{base}.json"
        done = servelens("calibrate", "--from", "steps", "--events", str(rec / "events.parquet"), "--engine",
                         "llama-3-8b@h100", "--no-held-out", "--calibration", base, "--out", str(out),
                         env={"SERVELENS_SHARED_DIR": str(shared)})
        assert done.returncode == 0, done.stderr
        methods[base] = json.loads(out.read_text())["method"]
    assert methods["none"].endswith("over uncalibrated roofline")
    assert methods["vllm-0.15.1-h100"].endswith("over vllm-0.15.1-h100")
    shipped = calibration_named("vllm-0.15.1-h100")
    with mock.patch("replay.calibrate.calibrate_experiments", return_value=(shipped, [])) as fit:
        done = CliRunner().invoke(cli, ["calibrate", "--experiments", "60,61", "--calibration", "vllm-0.15.1-h100",
                                        "--out", str(tmp_path / "experiments.json")],
                                  env={"SERVELENS_SHARED_DIR": str(shared)})
        assert done.exit_code == 0, done.output
        assert [c.name for c in fit.call_args.kwargs["also_from"]] == ["vllm-0.15.1-h100"]
        done = CliRunner().invoke(cli, ["calibrate", "--experiments", "60,61", "--out", str(tmp_path / "default.json")],
                                  env={"SERVELENS_SHARED_DIR": str(shared)})
        assert done.exit_code == 0 and fit.call_args.kwargs["also_from"] == (), done.output
