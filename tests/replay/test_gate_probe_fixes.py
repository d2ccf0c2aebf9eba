"""Hostile inputs to the gate, found by a probe: each is refused with what was wrong and how to fix it (exit 3),
never judged: negative counts and values out of order in a request table, an events file whose first token
precedes its arrival, a configuration that repeats a class or a metric, a condition no value can meet, an
unsupported version, a window of 1e300 s; and reports that are written all together or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.gate_config import config_yaml, default_config
from servelens.cli import cli
from servelens.errors import ServelensError


def _cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {}, catch_exceptions=False)


@pytest.fixture(scope="module")
def replays(tmp_path_factory, shared) -> tuple[Path, Path]:
    """Two real replay output folders of 200 Azure conversation requests (seeds 1 and 2)."""
    root = tmp_path_factory.mktemp("gate-probe")
    for seed in (1, 2):
        done = _cli("replay", "--workload", "azure-conv", "--requests", "200", "--seed", str(seed),
                    "--out", str(root / f"run{seed}"), env={"SERVELENS_SHARED_DIR": str(shared)})
        assert done.exit_code == 0, done.output
    return root / "run1", root / "run2"


def _gate(baseline: Path, candidate: Path, out: Path, *extra: str):
    return _cli("gate", "--baseline", str(baseline), "--candidate", str(candidate), "--out", str(out), *extra)


def _refused(done, *needles: str) -> None:
    """Exit 3 with an error and a hint holding every needle, no traceback or internal error."""
    assert done.exit_code == 3, done.output
    assert "error: " in done.output and "  hint: " in done.output, done.output
    for needle in needles:
        assert needle in done.output, (needle, done.output)
    assert "internal error" not in done.output and "Traceback" not in done.output


def _set(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table[name].to_pylist()
    values[row] = value
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, table.schema.field(name).type))


# ------------------------------------------------------------------ 1. request tables


def _corrupt(table: pa.Table, row: int, how: str) -> pa.Table:
    column, _, value = how.partition("=")
    if column == "num_cached_prefix_tokens":  # more cached than the prompt holds
        return _set(table, column, row, table["num_prompt_tokens"][row].as_py() + 1)
    if column == "first_token_ns":  # a first token a millisecond before the request arrived
        return _set(table, column, row, table["arrival_ns"][row].as_py() - 1_000_000)
    return _set(table, column, row, int(value))


@pytest.mark.parametrize(("how", "message"), [
    ("num_preemptions=-3", "counts must not be negative (null where not known): num_preemptions is negative in 1 row"),
    ("num_output_tokens=-5", "num_output_tokens is negative in 1 row"),
    ("num_prompt_tokens=-5", "num_prompt_tokens is negative in 1 row"),
    ("num_itl_gaps=-1", "num_itl_gaps is negative in 1 row"),
    ("num_cached_prefix_tokens", "values out of order: num_cached_prefix_tokens is above num_prompt_tokens in 1 row"),
    ("first_token_ns", "values out of order: first_token_ns is before arrival_ns (a negative TTFT) in 1 row"),
])
def test_a_request_table_with_a_negative_count_or_values_out_of_order_is_refused_naming_the_request(
        replays, tmp_path, how, message):
    """Before, num_preemptions = -3 passed ("preemptions_per_request fell -3") and the others were judged."""
    baseline, _ = replays
    table = pq.read_table(baseline / "requests.parquet")
    row = next(i for i, t in enumerate(table["first_token_ns"].to_pylist()) if t is not None and i >= 7)
    candidate = tmp_path / "candidate.parquet"
    pq.write_table(_corrupt(table, row, how), candidate)
    done = _gate(baseline, candidate, tmp_path / "out")
    _refused(done, f"error: {candidate}: ", message, f"(the first: request {table['request_id'][row].as_py()!r}, ")
    assert not (tmp_path / "out").exists()  # nothing judged, no report


def test_an_untouched_copy_of_the_table_is_still_judged(replays, tmp_path):
    baseline, _ = replays
    candidate = tmp_path / "candidate.parquet"
    pq.write_table(pq.read_table(baseline / "requests.parquet"), candidate)
    done = _gate(baseline, candidate, tmp_path / "out")
    assert done.exit_code in (0, 1, 2) and done.output.startswith("gate: "), done.output
    assert json.loads((tmp_path / "out" / "gate.json").read_text())["status"]


# ------------------------------------------------------------------ 2. events files


def _first_token_before_arrival(events: pa.Table) -> tuple[list[dict], str]:
    """The events as records, one request's first token moved to a second before its arrival."""
    rows = events.to_pylist()
    first = next(r for r in rows if r["event_type"] == "first_token")
    arrived = next(r for r in rows if r["event_type"] == "request_arrived" and r["request_id"] == first["request_id"])
    first["ts_ns"] = arrived["ts_ns"] - 1_000_000_000
    return rows, first["request_id"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_events_file_whose_first_token_precedes_its_arrival_is_refused_not_judged_without_its_ttft(
        replays, tmp_path, kind):
    """``events validate`` checks records one by one and accepts it; the derivation leaves that TTFT null, and the
    gate judged the run without it."""
    baseline, other = replays
    events = pq.read_table(other / "events.parquet")
    rows, request_id = _first_token_before_arrival(events)
    candidate = tmp_path / f"events.{kind}"
    if kind == "jsonl":
        candidate.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows, schema=events.schema), candidate)
    done = _gate(baseline, candidate, tmp_path / "out")
    _refused(done, f"error: {candidate}: values out of order: first_token_ns is before arrival_ns (a negative TTFT) "
                   f"in 1 row (the first: request {request_id!r}, ", "hint: a request is scheduled and gets its first")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 3, 4. configurations


def _config_with(tmp_path: Path, edit) -> Path:
    import yaml

    data = yaml.safe_load(config_yaml(default_config()))
    edit(data)
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _edit(key: str):
    edits = {
        "classes dup": lambda d: d["classes"].append({**d["classes"][0], "ttft_s": 0.001}),
        "metric dup": lambda d: d["metrics"].append({**d["metrics"][2], "allowed": 0.0, "critical": 0.0}),
        "tenant dup": lambda d: d.update(tenant_weights=[{"tenant": "t1", "weight": 1}, {"tenant": "t1", "weight": 3}]),
        "attainment 1.5": lambda d: d["conditions"].append({"metric": "attainment", "service_class": "*", "at_least": 1.5}),
        "ttft -1": lambda d: d["conditions"].append({"metric": "ttft_p99_s", "service_class": "*", "at_most": -1}),
        "share at_most 5": lambda d: d["conditions"].append({"metric": "rejected_share", "service_class": "", "at_most": 5}),
        "version 3": lambda d: d.update(version=3),
        "version '2'": lambda d: d.update(version="2"),
        "window 1e300": lambda d: d.update(window_s=1e300),
    }
    return edits[key]


@pytest.mark.parametrize(("edit", "message", "hint"), [
    ("classes dup", "classes[1] names 'default' again (classes[0] names it first)", "a class has one set of objectives"),
    ("metric dup", "metrics[18] names 'ttft_p50_s' again (metrics[2] names it first)", "keep one entry per metric"),
    ("tenant dup", "tenant_weights[1] names 't1' again (tenant_weights[0] names it first)", "one weight per tenant"),
    ("attainment 1.5", "conditions[1].at_least 1.5 on attainment can never be met: attainment is a share from 0 to 1",
     "{metric: attainment, at_least: 0.9}"),
    ("ttft -1", "conditions[1].at_most -1 on ttft_p99_s can never be met: ttft_p99_s is in s, never negative",
     "{metric: ttft_p99_s, at_most: 2.0}"),
    ("share at_most 5", "conditions[1].at_most 5 on rejected_share is always met: rejected_share is a share from 0 to 1",
     "give a bound it can take"),
    ("version 3", "version 3 is not supported: this servelens reads version 2", "set version: 2"),
    ("version '2'", "version '2' is text, not a number", "write version: 2, unquoted"),
    ("window 1e300", "window_s must be at most 86,400 s (a day), not 1e+300", "60 s (the default)"),
])
def test_a_configuration_that_repeats_a_name_or_cannot_be_met_is_refused_naming_the_key(
        replays, tmp_path, edit, message, hint):
    """Before: the last class won silently, the metric was judged twice, an impossible condition failed every run,
    any version was read, and window_s 1e300 was 'internal error: ValueError: Maximum allowed dimension exceeded'."""
    config = _config_with(tmp_path, _edit(edit))
    done = _gate(*replays, tmp_path / "out", "--config", str(config))
    _refused(done, f"error: gate configuration {config}", message, hint)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", [2, 1])
def test_the_default_configuration_written_out_is_still_read_and_so_is_a_version_1_file(replays, tmp_path, version):
    """A version 1 file without critical_flag is read by version 2's rule (the dashboard's sample is one)."""
    config = _config_with(tmp_path, lambda d: d.update(version=version))
    done = _gate(*replays, tmp_path / "out", "--config", str(config))
    assert done.exit_code in (0, 1, 2) and (tmp_path / "out" / "gate.json").is_file(), done.output


# ------------------------------------------------------------------ 5. reports


def test_a_report_name_held_by_a_folder_is_refused_before_judging_and_the_earlier_reports_stay(replays, tmp_path):
    """Before: 'Is a directory: gout2/gate.html' after gate.json and gate.md had been replaced."""
    out = tmp_path / "out"
    first = _gate(*replays, out)
    assert first.exit_code in (0, 1, 2), first.output
    before = {name: (out / name).read_bytes() for name in ("gate.json", "gate.md")}
    (out / "gate.html").unlink()
    (out / "gate.html").mkdir()
    other = replays[0].parent / "other.parquet"  # another candidate: a report that would differ
    pq.write_table(pq.read_table(replays[0] / "requests.parquet"), other)
    done = _gate(replays[0], other, out)
    _refused(done, f"error: the gate cannot write its reports in {out}: {out / 'gate.html'} exists and is not a "
                   "regular file", "hint: move it away, or give --out another folder")
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in out.iterdir()) == ["gate.html", "gate.json", "gate.md"]  # no temporary left


def test_reports_are_written_all_together_and_leave_no_temporary_files(replays, tmp_path):
    from replay.gate import compare_runs, load_run
    from replay.report import write_reports

    config = default_config()
    base, cand = load_run(replays[0], "baseline"), load_run(replays[1], "candidate")
    verdict = compare_runs(base, cand, config)
    out = tmp_path / "out"
    paths = write_reports(verdict, base, cand, out)
    assert sorted(p.name for p in out.iterdir()) == ["gate.html", "gate.json", "gate.md"]
    assert json.loads(paths["json"].read_text())["status"] == verdict.status
    (out / "gate.md").unlink()
    (out / "gate.md").mkdir()  # the library call refuses it too, before touching the others
    json_before = paths["json"].read_bytes()
    with pytest.raises(ServelensError, match="gate.md exists and is not a regular file"):
        write_reports(verdict, base, cand, out)
    assert paths["json"].read_bytes() == json_before
    assert sorted(p.name for p in out.iterdir()) == ["gate.html", "gate.json", "gate.md"]


def test_a_window_of_1e300_s_built_in_code_is_refused_by_the_span_it_would_cover():
    """A configuration built in code skips the file's checks: the judgement refuses the span instead of numpy's
    'Maximum allowed dimension exceeded'."""
    import dataclasses

    from replay.gate import Run, compare_runs
    from tests.replay.gate_data import synthetic_requests

    runs = [Run(label, synthetic_requests(200, seed=seed), None, label, None, None) for label, seed in (("b", 1), ("c", 2))]
    with pytest.raises(ServelensError, match=r"the runs' 1 windows of 1e\+300 s span .* the gate judges at most "
                                             r"31,622,400 s \(366 days\)") as err:
        compare_runs(*runs, dataclasses.replace(default_config(), window_s=1e300))
    assert "shorter windows (window_s)" in err.value.hint


@pytest.mark.parametrize(("key", "value", "shown"), [("calibration", 5, "int"), ("load", [1], "list")])
def test_a_manifest_whose_calibration_or_load_is_no_object_is_refused_by_name(replays, tmp_path, key, value, shown):
    import shutil

    baseline, candidate = replays
    copy = tmp_path / "candidate"
    shutil.copytree(candidate, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    if key == "load" and not manifest.get("calibration"):
        pytest.skip("the run records no calibration, so its load is not read")
    manifest[key] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    _refused(_gate(baseline, copy, tmp_path / "out"), f"its {key} is a JSON {shown}, not an object of fields")
