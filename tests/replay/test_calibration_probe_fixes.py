"""Calibration files and step fits on hostile input (probe A, 5 and 6): accelerators no preset names, unknown keys,
terms beyond any hardware or API server, errors printed as 300 digits, a number Python will not read, steps recorded
without durations: each a clean error (exit 3) naming the key and the bound, never a silent replay or an internal
error."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.calibration import CALIBRATIONS_DIR, load_calibration
from servelens.cli import cli

SHIPPED = CALIBRATIONS_DIR / "vllm-0.15.1-h100.json"


def _run(*args: str):
    return CliRunner().invoke(cli, list(args), env={}, catch_exceptions=False)


def _calibration(tmp_path: Path, edit=None, text: str | None = None) -> Path:
    """The shipped calibration, edited (``edit`` changes its JSON mapping) or replaced by ``text``."""
    path = tmp_path / "cal.json"
    if text is not None:
        path.write_text(text)
        return path
    doc = json.loads(SHIPPED.read_text())
    if edit is not None:
        edit(doc)
    path.write_text(json.dumps(doc))
    return path


def _replay(tmp_path: Path, calibration: Path):
    return _run("replay", "--workload", "azure-conv", "--requests", "5", "--engine", "llama-3-8b@h100",
                "--calibration", str(calibration), "--out", str(tmp_path / "run"))


@pytest.mark.parametrize(
    ("edit", "message", "hint"),
    [
        (lambda d: d.update(accelerators=["tpu-v5"]), "accelerators: 'tpu-v5' is not an accelerator the replay knows",
         "presets: a100-80g, a100-40g, h100-sxm"),
        (lambda d: d.update(accelerators=[]), "accelerators is empty: a calibration was fitted on some accelerator",
         "name the accelerators its data ran on"),
        (lambda d: d.update(bogus=1), "unknown config key bogus", "valid keys: calibration_version, name, engine"),
        (lambda d: d["held_out_error_pct"].update(foo_mean=3.0), "unknown config key held_out_error_pct.foo_mean",
         "valid keys in held_out_error_pct: the metrics e2e_mean"),
        (lambda d: d["frontend"].update(tokenize_s_per_token=1.0),
         "frontend.tokenize_s_per_token 1 s is more than 0.001 s, beyond any API server's time for a token",
         "give it in seconds: fitted ones are microseconds to milliseconds"),
        (lambda d: d["frontend"].update(request_overhead_s=5.0),
         "frontend.request_overhead_s 5 s is more than 1 s, beyond any API server's time for a request or streamed chunk",
         "fitted ones are microseconds to milliseconds"),
        (lambda d: d["held_out_error_pct"].update(e2e_mean=1e308),
         "held_out_error_pct.e2e_mean is an absolute error in percent, from 0 to 1000, not 1e+308",
         "beyond 1000% the replay is more than 10x off"),
        (lambda d: d["in_sample_error_pct"].update(ttft_mean=-1),
         "in_sample_error_pct.ttft_mean is an absolute error in percent, from 0 to 1000, not -1", "10x off"),
        (lambda d: d["roofline"].update(compute_efficiency=1e-12),
         "roofline.compute_efficiency 1e-12 is below 0.01: a step achieving under 1% of the hardware's peak is no "
         "engine's", "a share of the peak: fitted ones are 0.05 to 1"),
        (lambda d: d["roofline"].update(memory_efficiency=1e-9), "roofline.memory_efficiency 1e-09 is below 0.01",
         "fitted ones are 0.05 to 1"),
        (lambda d: d["roofline"].update(kv_memory_efficiency=0.001), "roofline.kv_memory_efficiency 0.001 is below 0.01",
         "fitted ones are 0.05 to 1"),
    ],
)
def test_a_calibration_beyond_its_bounds_is_refused_naming_the_key(tmp_path, edit, message, hint):
    path = _calibration(tmp_path, edit)
    done = _replay(tmp_path, path)
    assert done.exit_code == 3, done.output
    assert f"error: {path}: {message}" in done.output
    assert "\n  hint: " in done.output and hint in done.output.split("\n  hint: ", 1)[1]
    assert "internal error" not in done.output and not (tmp_path / "run" / "events.parquet").exists()


def test_a_calibration_with_a_number_of_5001_digits_is_a_clean_error(tmp_path):
    path = _calibration(tmp_path, text=SHIPPED.read_text().replace('"step_overhead_ns": 899027',
                                                                    '"step_overhead_ns": ' + "9" * 5001))
    done = _replay(tmp_path, path)
    assert done.exit_code == 3, done.output
    assert f"error: calibration {path} holds a number of more than 4,300 digits, which no setting needs" in done.output
    assert "hint: write one with `servelens calibrate`" in done.output and "internal error" not in done.output


def test_an_accelerator_alias_is_taken_by_its_preset_name_and_the_shipped_calibration_reads(tmp_path):
    """'H100' names the h100-sxm preset: a replay there is no extrapolation."""
    assert load_calibration(SHIPPED).accelerators == ("h100-sxm",)
    cal = load_calibration(_calibration(tmp_path, lambda d: d.update(accelerators=["H100"])))
    assert cal.accelerators == ("h100-sxm",)
    done = _replay(tmp_path, tmp_path / "cal.json")
    assert done.exit_code == 0, done.output
    assert "extrapolated" not in done.output


def test_the_error_metrics_are_those_a_calibration_reports():
    from replay.calibration import ERROR_METRICS
    from replay.fidelity import METRICS

    assert set(METRICS) <= set(ERROR_METRICS)
    assert set(dict(load_calibration(SHIPPED).held_out_error_pct)) <= set(ERROR_METRICS)


# -- steps recorded without durations --------------------------------------------------------------------------------


def test_steps_recorded_without_durations_say_so(tmp_path):
    done = _run("replay", "--workload", "azure-conv", "--requests", "30", "--engine", "llama-3-8b@h100", "--out",
                str(tmp_path / "run"))
    assert done.exit_code == 0, done.output
    events = pq.read_table(tmp_path / "run" / "events.parquet")
    steps = pc.equal(events["event_type"], "step_executed")
    end = pc.if_else(steps, events["start_ns"], events["end_ns"])  # every step's end at its start: no duration
    events = events.set_column(events.schema.get_field_index("end_ns"), "end_ns", end.cast(pa.int64()))
    zero = tmp_path / "zero.parquet"
    pq.write_table(events, zero)
    count = pc.sum(steps.cast(pa.int64())).as_py()
    done = _run("calibrate", "--from", "steps", "--events", str(zero), "--engine", "llama-3-8b@h100",
                "--calibration", "none", "--out", str(tmp_path / "cal.json"))
    assert done.exit_code == 3, done.output
    assert (f"error: {count:,} of the {count:,} recorded steps have no duration (end_ns at or before start_ns), "
            "leaving 0 timed steps, too few to fit 4 terms") in done.output
    assert "hint: the step_executed events must stamp each step's start_ns and end_ns" in done.output
    assert "record more traffic" not in done.output and not (tmp_path / "cal.json").exists()
