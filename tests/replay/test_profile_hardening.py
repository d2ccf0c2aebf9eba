"""A profile that is not what `servelens profile` writes is refused with the file and the field named.

Each case rewrites a real shipped profile (profiles/llama-1b-h200.parquet) with one thing broken: its
``servelens.profile`` metadata, or one of its columns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replay.measured.fit import evaluate_profile
from replay.measured.profiler import META_KEY, read_profile
from servelens.errors import DataNotFoundError

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "llama-1b-h200.parquet"
HINT = "profile again with `servelens profile` (this file was changed since, or not written by it)"
META = "its servelens.profile metadata"


def shipped() -> tuple[pa.Table, dict]:
    table = pq.read_table(SHIPPED)
    return table, json.loads(table.schema.metadata[META_KEY])


def write(path: Path, table: pa.Table, raw: bytes) -> Path:
    pq.write_table(table.replace_schema_metadata({META_KEY: raw}), path)
    return path


def with_meta(tmp_path: Path, change: Callable[[dict], object]) -> Path:
    table, meta = shipped()
    change(meta)  # in place
    return write(tmp_path / "p.parquet", table, json.dumps(meta).encode())


def with_column(tmp_path: Path, name: str, values: list | pa.Array) -> Path:
    table, meta = shipped()
    column = values if isinstance(values, pa.Array) else pa.array(values, table.schema.field(name).type)
    table = table.set_column(table.column_names.index(name), name, column)
    return write(tmp_path / "p.parquet", table, json.dumps(meta).encode())


def refused(path: Path) -> str:
    with pytest.raises(DataNotFoundError) as caught:
        read_profile(path)
    assert caught.value.hint == HINT
    return caught.value.message


def test_the_shipped_profile_still_reads() -> None:
    profile = read_profile(SHIPPED)
    assert profile.table.num_rows == 254 and profile.meta.block_size == 16


@pytest.mark.parametrize(("raw", "problem"), [
    (b"{not json", "is not JSON (Expecting property name enclosed in double quotes at character 1)"),
    (b'{"a":"\xff"}', "is not UTF-8 text (byte 6)"),
    (b"[1,2]", "is a JSON list, not an object of fields"),
    (b"[" * 100_000, "is nested too deeply to be a profile's"),
])
def test_metadata_that_is_not_a_json_object_is_refused(tmp_path: Path, raw: bytes, problem: str) -> None:
    table, _ = shipped()
    path = write(tmp_path / "p.parquet", table, raw)
    assert refused(path) == f"{path}: {META} {problem}"


@pytest.mark.parametrize(("change", "field", "problem"), [
    (lambda m: m.update(block_size="16"), "block_size", 'is "16" (a JSON str), not an integer'),
    (lambda m: m.pop("model"), "model", "is missing"),
    (lambda m: m.update(model="llama"), "model", 'is "llama" (a JSON str), not an object of fields'),
    (lambda m: m["model"].update(hidden_size="2048"), "model.hidden_size", 'is "2048" (a JSON str), not an integer'),
    (lambda m: m["model"].update(num_layers=0), "model", "LlamaShape.num_layers must be positive, not 0"),
    (lambda m: m["model"].update(extra=1), "model", "has unknown fields ['extra'] (valid: name, num_layers, "
     "full_num_layers, hidden_size, num_attention_heads, num_kv_heads, head_dim, intermediate_size, vocab_size, "
     "rope_theta, rms_norm_eps)"),
    (lambda m: m["sweep"].update(decode_seqs=[1, "2"]), "sweep.decode_seqs", 'is [1, "2"] (a JSON list), not a list of integers'),
    (lambda m: m.update(measured="yes"), "measured", 'is "yes" (a JSON str), not true or false'),
    (lambda m: m.update(dtype="float128"), "dtype", 'is "float128" (a JSON str), not float32 or bfloat16 or float16'),
    (lambda m: m.update(date_utc="yesterday"), "date_utc", 'is "yesterday" (a JSON str), not an ISO 8601 date'),
    (lambda m: m.update(block_size=0), "block_size", "is 0 (a JSON int), not a positive number of tokens"),
    (lambda m: m.update(peak_flops=float("nan")), "peak_flops", "is NaN (a JSON float), not a finite number"),
    (lambda m: m.update(memory_bytes=-1), "memory_bytes", "is -1 (a JSON int), not a positive number of bytes"),
    (lambda m: m.update(device="tpu"), "device", 'is "tpu" (a JSON str), not cpu or cuda'),
])
def test_malformed_metadata_names_the_field(tmp_path: Path, change, field: str, problem: str) -> None:
    path = with_meta(tmp_path, change)
    assert refused(path) == f"{path}: {META}, field {field!r}, {problem}"


def test_unknown_top_level_metadata_is_ignored(tmp_path: Path) -> None:
    path = with_meta(tmp_path, lambda m: m.update(written_by_a_later_version=True))
    assert read_profile(path).meta.model.name == "llama-1b"


@pytest.mark.parametrize(("column", "value", "shown"), [("median_ns", 0, "0"), ("median_ns", -5, "-5"),
                                                        ("mean_ns", float("nan"), "nan"), ("p90_ns", float("inf"), "inf")])
def test_step_times_must_be_positive_and_finite(tmp_path: Path, column: str, value: float, shown: str) -> None:
    path = with_column(tmp_path, column, [value] * 254)
    first_id = pq.read_table(SHIPPED)["shape_id"][0].as_py()
    assert refused(path) == (f"{path}: profile column {column!r} holds {shown} at shape_id {first_id}: "
                             "step times are positive, finite nanoseconds")


def test_a_profile_of_zero_times_never_reaches_the_fit(tmp_path: Path) -> None:
    """The fit divides by the medians: before this check, numpy warned and then failed on infinities."""
    path = with_column(tmp_path, "median_ns", [0] * 254)
    with pytest.raises(DataNotFoundError):
        evaluate_profile(read_profile(path))


def test_unknown_kinds_are_refused(tmp_path: Path) -> None:
    path = with_column(tmp_path, "kind", ["bogus"] * 254)
    assert refused(path) == f"{path}: profile column 'kind' holds unknown kinds ['bogus'] (valid: prefill, decode, mixed)"


def test_a_kind_that_is_not_its_shapes_is_refused(tmp_path: Path) -> None:
    table, _ = shipped()
    kinds = table["kind"].to_pylist()
    i = kinds.index("prefill")
    kinds[i] = "decode"
    path = with_column(tmp_path, "kind", kinds)
    sid = table["shape_id"][i].as_py()
    assert refused(path) == f"{path}: profile column 'kind' holds 'decode' at shape_id {sid}, but its step shape has 'prefill'"


def test_repeated_shapes_are_refused(tmp_path: Path) -> None:
    """20 copies of 5 rows: held-out rows equal training rows, and the error read 0.0% before."""
    table, meta = shipped()
    path = write(tmp_path / "p.parquet", pa.concat_tables([table.slice(0, 5)] * 20), json.dumps(meta).encode())
    first = table.slice(0, 1)
    kind, tokens = first["kind"][0].as_py(), first["num_tokens"][0].as_py()
    assert refused(path) == (
        f"{path}: rows 1 and 6 hold the same step shape ({kind}, {tokens} tokens): a profile times each shape once "
        "(a repeated one would be held out against its own copy, and the fit's error would read too low)"
    )


def test_derived_counts_must_agree_with_the_shape(tmp_path: Path) -> None:
    table, _ = shipped()
    path = with_column(tmp_path, "num_tokens", pc.negate(table["num_tokens"]).combine_chunks())
    sid, tokens = table["shape_id"][0].as_py(), table["num_tokens"][0].as_py()
    assert refused(path) == f"{path}: profile column 'num_tokens' holds {-tokens} at shape_id {sid}, but its step shape has {tokens}"


def test_null_times_and_wrong_types_are_refused(tmp_path: Path) -> None:
    path = with_column(tmp_path, "median_ns", pa.array([1.5] * 254))
    assert refused(path).startswith(f"{path}: the profile's columns do not have their types: ")
    table, _ = shipped()
    times = table["times_ns"].to_pylist()
    times[3] = [None, 5]
    path = with_column(tmp_path, "times_ns", times)
    assert refused(path) == f"{path}: profile column 'times_ns' holds null items"
