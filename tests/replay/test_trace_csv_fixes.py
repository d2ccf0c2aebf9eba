"""Trace files a hostile-input probe gave the readers: a column named twice (an internal KeyError), a cell its
column's type cannot hold (named by a column index from 0, no row, no hint) and absurd token counts (accepted,
with percentiles larger than the input). Each is refused with the row and column named, by the readers and by
the commands that use them (`trace stats`, `trace convert`, `replay --workload FILE`)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import pytest

from replay.inference_perf import MAX_SEQUENCE_TOKENS
from replay.traces import MAX_TRACE_TOKENS, read_trace
from servelens.errors import ServelensError

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,374,44\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def servelens(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelens", *args], capture_output=True, text=True,
                          env=dict(os.environ), cwd=cwd, timeout=300)


def _refused(proc: subprocess.CompletedProcess, *texts: str) -> None:
    """Exit 3, an error and a hint, each text in the message, no internal error or traceback."""
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and "\n  hint: " in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for text in texts:
        assert text in proc.stderr, (text, proc.stderr)


def test_the_token_bound_is_the_replays_sequence_bound():
    assert MAX_TRACE_TOKENS == MAX_SEQUENCE_TOKENS == 10_000_000


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_column_named_twice_is_refused_by_name(tmp_path, gzipped):
    """Was "internal error: KeyError: 'Field "ContextTokens" exists 2 times in schema'"."""
    text = "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n2023-11-16 18:15:46.6805900,374,44,1\n"
    path = tmp_path / ("dup.csv.gz" if gzipped else "dup.csv")
    path.write_bytes(gzip.compress(text.encode()) if gzipped else text.encode())
    with pytest.raises(ServelensError, match=re.escape("names a column more than once: 'ContextTokens' (2 times)")) as err:
        read_trace(str(path))
    assert err.value.hint == "write each column once"


def test_a_column_named_twice_is_named_before_a_bad_cell_in_it(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,TIMESTAMP\n2023-11-16 18:15:46.6805900,1,1,x\n")
    with pytest.raises(ServelensError, match=re.escape("names a column more than once: 'TIMESTAMP' (2 times)")):
        read_trace(str(path))


@pytest.mark.parametrize(
    ("cell_row", "message"),
    [
        ("2023-11-16 18:15:47.6805900,1.5,1\n",
         "data row 2, column ContextTokens holds '1.5', which is not a whole number (int64)"),
        ("2023-11-16 18:15:47.6805900,374,inf\n",
         "data row 2, column GeneratedTokens holds 'inf', which is not a whole number (int64)"),
        ("2023-11-16 18:15:47.6805900,99999999999999999999,1\n",
         "data row 2, column ContextTokens holds '99999999999999999999', which is not a whole number (int64)"),
        ("9999-12-31 23:59:59,100,3\n",
         "data row 2, column TIMESTAMP holds '9999-12-31 23:59:59', which is not a date and time up to 2262"),
    ],
)
def test_a_cell_its_column_cannot_hold_is_named_by_column_name_and_row_with_a_hint(tmp_path, cell_row, message):
    """Was "In CSV column #1: CSV conversion error to int64: invalid value '1.5'", with no row and no hint."""
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + ROW + cell_row)
    with pytest.raises(ServelensError, match=re.escape(message)) as err:
        read_trace(str(path))
    assert "column #" not in err.value.message and str(path) in err.value.message
    assert "whole token counts" in err.value.hint and "2023-11-16 18:15:46.6805900" in err.value.hint


def test_a_long_bad_cell_is_shown_cut(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + ROW + f"2023-11-16 18:15:47,{'1' * 300}x,3\n")
    with pytest.raises(ServelensError, match=re.escape("... (301 characters), which is not a whole number")) as err:
        read_trace(str(path))
    assert len(err.value.message) < 300


def test_a_time_without_the_zone_offset_the_others_have_is_named_by_row(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + "2024-05-10 00:00:00+00:00,3,4\n2024-05-10 00:00:01,3,4\n")
    with pytest.raises(ServelensError, match=re.escape(
            "data row 2, column TIMESTAMP holds '2024-05-10 00:00:01', which cannot be read as timestamp[ns, tz=UTC]: "
            "expected a zone offset")):
        read_trace(str(path))
    path.write_text(AZURE_HEADER + "2024-05-10 00:00:00+00:00,3,4\n2024-05-10 00:00:01+00:00,3,4\n")
    assert read_trace(str(path)).num_rows == 2  # Azure 2024's offsets are still read


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("azure.csv", AZURE_HEADER + ROW + "2023-11-16 18:15:47,9223372036854775807,3\n",
         "data row 2 (request azure-000001) has 9,223,372,036,854,775,807 tokens as its prompt length (column "
         "ContextTokens), more than the 10,000,000"),
        ("azure.csv", AZURE_HEADER + "2023-11-16 18:15:47,3,10000001\n",
         "data row 1 (request azure-000000) has 10,000,001 tokens as its output length (column GeneratedTokens)"),
        ("burstgpt.csv", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\n6,ChatGPT,20000000,18,1,x\n",
         "data row 2 (request burstgpt-000001) has 20,000,000 tokens as its prompt length (column Request tokens)"),
        ("mooncake.jsonl", '{"timestamp": 5, "input_length": 10, "output_length": 99999999999, "hash_ids": [0]}\n',
         "data row 1 (request mooncake-000000) has 99,999,999,999 tokens as its output length (column output_length)"),
    ],
)
def test_a_token_count_above_the_longest_context_window_is_refused_naming_row_and_column(tmp_path, name, text,
                                                                                           message):
    """Was accepted: `trace stats` printed a p50 of 9,223,372,036,854,775,808, larger than any input."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ServelensError, match=re.escape(message)) as err:
        read_trace(str(path))
    assert "at most 10,000,000" in err.value.hint


def test_a_token_count_at_the_bound_is_read(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:15:47,10000000,10000000\n")
    assert read_trace(str(path))["num_prompt_tokens"].to_pylist() == [10_000_000]


def test_the_commands_refuse_each_with_exit_3_and_a_hint(tmp_path):
    dup = tmp_path / "dup.csv"
    dup.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n2023-11-16 18:15:46.6805900,374,44,1\n")
    frac = tmp_path / "frac.csv"
    frac.write_text(AZURE_HEADER + ROW + "2023-11-16 18:15:47.6805900,1.5,1\n")
    huge = tmp_path / "huge.csv"
    huge.write_text(AZURE_HEADER + "2023-11-16 18:15:46.6805900,9223372036854775807,9223372036854775807\n")
    duplicate = f"{dup} names a column more than once: 'ContextTokens' (2 times)"
    fraction = f"{frac}: not a readable trace CSV: data row 2, column ContextTokens holds '1.5'"
    too_many = f"{huge}: data row 1 (request huge-000000) has 9,223,372,036,854,775,807 tokens as its prompt length"
    for path, message in ((dup, duplicate), (frac, fraction), (huge, too_many)):
        _refused(servelens("trace", "stats", str(path)), message)
        _refused(servelens("trace", "convert", str(path), "--out", str(tmp_path / "w.parquet")), message)
        _refused(servelens("replay", "--workload", str(path), "--policy", "fcfs", "--out", str(tmp_path / "run")),
                 message)
    assert not (tmp_path / "w.parquet").exists() and not (tmp_path / "run").exists()
