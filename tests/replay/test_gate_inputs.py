"""Bad inputs to the gate are errors that name the file, the column and the fix, never an internal error."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replay.gate import Run, compare_runs, config_yaml, default_config, load_run
from replay.gate_config import Condition
from replay.request_table import check_request_table
from servelens.errors import ServelensError
from tests.replay.gate_data import synthetic_requests

GATE = dataclasses.replace(default_config(), window_s=10.0)


def _set(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def _corrupt(table: pa.Table, how: str) -> pa.Table:
    if how.startswith("drop "):
        return table.drop_columns(how.split()[1:])
    if how == "only ttft_s":
        return table.select(["ttft_s"])
    if how == "null arrival_ns":
        return _set(table, "arrival_ns", pa.nulls(table.num_rows, pa.int64()))
    if how == "ttft_s as text":
        return _set(table, "ttft_s", pc.cast(table["ttft_s"], pa.string()))
    if how == "negative ttft_s":
        return _set(table, "ttft_s", pc.negate(table["ttft_s"]))
    if how == "nan tpot_s":
        return _set(table, "tpot_s", pc.multiply(table["tpot_s"], float("nan")))
    if how == "inf e2e_s":
        return _set(table, "e2e_s", pc.divide(table["e2e_s"], 0.0))
    if how == "repeated ids":
        return pa.concat_tables([table, table])
    assert how == "no rows"
    return table.slice(0, 0)


@pytest.mark.parametrize(("how", "message"), [
    ("drop arrival_ns", "columns arrival_ns are missing"),
    ("drop service_class", "columns service_class are missing"),
    ("drop outcome", "columns outcome are missing"),
    ("only ttft_s", "columns request_id, outcome, e2e_s"),
    ("null arrival_ns", "no request has an arrival_ns (all 200 are null)"),
    ("ttft_s as text", "ttft_s is string, not double"),
    ("negative ttft_s", "ttft_s is negative in 200 rows"),
    ("nan tpot_s", "tpot_s is NaN or infinite in 200 rows"),
    ("inf e2e_s", "e2e_s is NaN or infinite in 200 rows"),
    ("repeated ids", "200 rows repeat a request id"),
    ("no rows", "the run holds no requests"),
])
def test_a_corrupt_request_table_is_refused_naming_the_file_and_the_column(tmp_path, how, message):
    path = tmp_path / "requests.parquet"
    pq.write_table(_corrupt(synthetic_requests(200, reject_share=0.0), how), path)
    with pytest.raises(ServelensError) as err:
        load_run(path, "candidate")
    assert str(path) in err.value.message and message in err.value.message, err.value.message
    assert err.value.hint


def test_durations_are_checked_only_where_not_null():
    """Null means "not reached" (a rejected request has no TTFT): never refused."""
    table = synthetic_requests(200, reject_share=0.3)
    assert table["ttft_s"].null_count > 0
    assert check_request_table(table, "t.parquet") is table


def test_a_run_is_not_compared_with_itself_through_any_path(tmp_path):
    path = tmp_path / "requests.parquet"
    pq.write_table(synthetic_requests(200), path)
    (tmp_path / "again").symlink_to(tmp_path)
    with pytest.raises(ServelensError, match="are the same run") as err:
        compare_runs(load_run(path, "baseline"), load_run(tmp_path / "again" / "requests.parquet", "candidate"), GATE)
    assert str(path.resolve()) in err.value.message
    shutil.copy(path, tmp_path / "copy.parquet")  # the same traffic in another run's file is judged
    assert compare_runs(load_run(path, "baseline"), load_run(tmp_path / "copy.parquet", "candidate"), GATE).status


def test_a_condition_on_a_class_neither_run_holds_is_named():
    """Named in a note, not refused: a live pool's window may simply hold no request of a class."""
    config = dataclasses.replace(GATE, conditions=(Condition(metric="attainment", service_class="interactiv", at_least=0.9),))
    runs = [Run(label, synthetic_requests(seed=5), None, label, None, None) for label in ("baseline", "candidate")]
    notes = compare_runs(*runs, config).notes
    assert ("conditions on service_class 'interactiv' judge nothing: neither run holds it (they hold 'batch', "
            "'interactive'; a misspelt name?)") in notes


def test_the_gate_command_refuses_a_corrupt_table_without_an_internal_error(tmp_path):
    config = tmp_path / "gate.yaml"
    config.write_text(config_yaml(GATE))
    base, cand = tmp_path / "base.parquet", tmp_path / "cand.parquet"
    pq.write_table(synthetic_requests(200), base)
    pq.write_table(_corrupt(synthetic_requests(200, seed=2), "ttft_s as text"), cand)
    done = subprocess.run([sys.executable, "-m", "servelens", "gate", "--baseline", str(base), "--candidate", str(cand),
                           "--config", str(config), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 3 and "ttft_s is string, not double" in done.stderr and str(cand) in done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
