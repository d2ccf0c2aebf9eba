"""`profile-info`, `compare-measured` and `events validate --max-errors` on hostile input: a clean error
(exit 3, a hint, no traceback) naming the file and the field, and no output folder left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.measured.measured import _removed_on_failure
from replay.measured.profiler import META_KEY
from servelens.cli import cli

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "llama-1b-h200.parquet"
HINT = "  hint: profile again with `servelens profile` (this file was changed since, or not written by it)"


def servelens(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelens", *args], capture_output=True, text=True, timeout=120)


def broken_profile(tmp_path: Path, *, raw: bytes | None = None, median_ns: int | None = None) -> Path:
    table = pq.read_table(SHIPPED)
    if median_ns is not None:
        i = table.column_names.index("median_ns")
        table = table.set_column(i, "median_ns", pa.array([median_ns] * table.num_rows, pa.int64()))
    path = tmp_path / "broken.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: raw or table.schema.metadata[META_KEY]}), path)
    return path


def test_profile_info_on_metadata_that_is_not_json(tmp_path: Path) -> None:
    path = broken_profile(tmp_path, raw=b"{not json")
    done = servelens("profile-info", str(path))
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: {path}: its servelens.profile metadata is not JSON (Expecting property name enclosed in double "
        "quotes at character 1)", HINT,
    ]


def test_profile_info_on_a_model_that_is_a_string(tmp_path: Path) -> None:
    meta = json.loads(pq.read_schema(SHIPPED).metadata[META_KEY])
    path = broken_profile(tmp_path, raw=json.dumps(meta | {"model": "llama"}).encode())
    out = CliRunner().invoke(cli, ["profile-info", str(path)])
    assert out.exit_code == 3 and "Traceback" not in out.output
    assert out.output.splitlines() == [
        f"error: {path}: its servelens.profile metadata, field 'model', is \"llama\" (a JSON str), not an object of fields",
        HINT,
    ]


def test_profile_info_on_zero_times_prints_no_numpy_warning(tmp_path: Path) -> None:
    path = broken_profile(tmp_path, median_ns=0)
    done = servelens("profile-info", str(path))
    first_id = pq.read_table(SHIPPED)["shape_id"][0].as_py()
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: {path}: profile column 'median_ns' holds 0 at shape_id {first_id}: step times are positive, "
        "finite nanoseconds", HINT,
    ]


def test_compare_measured_refuses_a_broken_profile_before_making_its_output(tmp_path: Path) -> None:
    path = broken_profile(tmp_path, median_ns=-5)
    out = CliRunner().invoke(cli, ["compare-measured", "--workload", "azure-conv", "--profile", str(path),
                                   "--requests", "5", "--out", str(tmp_path / "cmp")])
    assert out.exit_code == 3 and "profile column 'median_ns' holds -5" in out.output
    assert not (tmp_path / "cmp").exists()


def test_compare_measured_without_the_profiles_gpu_leaves_no_folder(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():  # the GPU is there: the measured replay would run; the folder rule is tested below
        return
    out = CliRunner().invoke(cli, ["compare-measured", "--workload", "azure-conv", "--profile", str(SHIPPED),
                                   "--requests", "5", "--out", str(tmp_path / "cmp")])
    assert out.exit_code == 3
    assert out.output.splitlines() == [
        f"error: {SHIPPED} was measured on cuda, and no CUDA device is visible to PyTorch here: the measured replay "
        "runs on the profile's device",
        "  hint: run it where a GPU is (a CUDA build of torch), or use a CPU profile (servelens profile --device cpu)",
    ]
    assert not (tmp_path / "cmp").exists()


def test_a_failed_comparison_removes_only_the_folders_it_made(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError), _removed_on_failure(fresh):
        (fresh / "modelled").mkdir(parents=True)
        raise RuntimeError("the measured replay failed")
    assert not fresh.exists()
    kept = tmp_path / "kept"
    (kept / "modelled").mkdir(parents=True)
    (kept / "modelled" / "events.parquet").write_text("an earlier run")
    with pytest.raises(RuntimeError), _removed_on_failure(kept):
        (kept / "measured").mkdir()
        raise RuntimeError("the measured replay failed")
    assert sorted(p.name for p in kept.iterdir()) == ["modelled"]
    assert (kept / "modelled" / "events.parquet").read_text() == "an earlier run"


def test_events_validate_max_errors_has_a_range(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event_type": "nope"}\n' * 3)
    out = CliRunner().invoke(cli, ["events", "validate", "--max-errors", "-1", str(bad)])
    assert out.exit_code == 2
    assert "Invalid value for '--max-errors': -1 is not in the range x>=0." in out.output
    out = CliRunner().invoke(cli, ["events", "validate", "--max-errors", "0", str(bad)])
    assert out.exit_code == 1
    assert out.output.splitlines()[0] == "3 records: 0 valid, 3 invalid"
