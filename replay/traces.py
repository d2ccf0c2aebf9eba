"""Converters from public LLM-serving trace formats to one workload table.

Each reader returns a table with the ``schemas.records.WorkloadRequest`` schema, in the trace's own
row order, with arrival times converted exactly (decimal arithmetic, never via a float) to
nanoseconds. What a trace records is kept as recorded; what it lacks stays null, for a scenario to
add explicitly. Supported formats:

- Azure LLM inference 2023 and 2024 (``TIMESTAMP, ContextTokens, GeneratedTokens``): wall-clock UTC arrivals
  (2024 writes them with a ``+00:00`` offset).

Any of them may be gzipped (``.gz``): pyarrow decompresses by the file name.
- Mooncake FAST'25 (JSONL ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``):
  arrivals as offsets from the trace start; 512-token prefix blocks.
- BurstGPT (``Timestamp`` s, ``Model``, ``Request tokens``, ``Response tokens``, ..., v2 adds
  ``Session ID`` and ``Elapsed time``): offsets from the trace start; rows with 0 response tokens
  are failed requests. ``Elapsed time`` (a recorded E2E latency) and ``Log Type`` are not carried.
- BLIS (inference-sim) trace v2 (a CSV beginning ``request_id,client_id,tenant_id`` with its YAML
  header beside it): ``replay.blis``, which also imports observed timings and exports traces.
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from replay.blis import read_blis_workload
from replay.errors import ReplayError
from schemas.arrow import arrow_schema
from schemas.records import WorkloadRequest
from schemas.validate import shown_id
from servelens.errors import DataNotFoundError, ServelensError

WORKLOAD_SCHEMA = arrow_schema(WorkloadRequest)
MOONCAKE_BLOCK_TOKENS = 512
#: The most requests a workload built in memory may hold (a spec's stages, superposed copies, bootstrapped
#: windows: about 100 bytes a request, and the replay's state beside them). Tiling (``--requests``) streams
#: its copies and has no such bound.
MAX_WORKLOAD_REQUESTS = 50_000_000
#: The most tokens a trace's prompt or output length may hold: the longest context window any model serves (the
#: same bound as ``replay.inference_perf.MAX_SEQUENCE_TOKENS``, which imports this module). A count beyond it is a
#: broken row, and near 2^63 it would overflow the replay's sums and round in its percentiles.
MAX_TRACE_TOKENS = 10_000_000


def check_workload_size(num_requests: int, what: str, hint: str) -> None:
    """A ``ReplayError`` (``what`` the count's source, then the count) when a workload to be built in
    memory would hold more than ``MAX_WORKLOAD_REQUESTS``."""
    if num_requests > MAX_WORKLOAD_REQUESTS:
        raise ReplayError(f"{what} {num_requests:,} requests, more than the {MAX_WORKLOAD_REQUESTS:,} a workload "
                          "built in memory may hold", hint)


@dataclass(frozen=True, slots=True)
class BundledTrace:
    """A real trace shipped in the shared data folder."""

    name: str
    relative_path: str
    format: str
    description: str
    licence: str


BUNDLED_TRACES: dict[str, BundledTrace] = {
    t.name: t
    for t in (
        BundledTrace(
            "azure-conv",
            "traces/azure2023/AzureLLMInferenceTrace_conv.csv",
            "azure",
            "Azure LLM inference 2023, conversation service (19,366 requests, 58 min)",
            "CC-BY-4.0; Patel et al., Splitwise, ISCA 2024",
        ),
        BundledTrace(
            "mooncake",
            "traces/mooncake/synthetic_trace.jsonl",
            "mooncake",
            "Mooncake FAST'25 synthetic trace with prefix blocks (3,993 requests, 17 min)",
            "Apache-2.0; Qin et al., Mooncake, FAST 2025",
        ),
        BundledTrace(
            "burstgpt-1",
            "traces/burstgpt/BurstGPT_1_first400.csv",
            "burstgpt",
            "BurstGPT v1, first 400 rows (models, failed rows)",
            "CC-BY-4.0; Wang et al., BurstGPT, arXiv:2401.17644",
        ),
        BundledTrace(
            "burstgpt-3",
            "traces/burstgpt/BurstGPT_3_first400.csv",
            "burstgpt",
            "BurstGPT v2 release, first 400 rows (sessions, models, failed rows)",
            "CC-BY-4.0; Wang et al., BurstGPT, arXiv:2401.17644",
        ),
    )
}


#: What the workload's required columns are in a trace's terms.
_MEANING = {"arrival_ns": "arrival time", "num_prompt_tokens": "prompt length", "num_output_tokens": "output length"}


def _seconds_to_ns(values: pa.Array) -> pa.Array:
    """Decimal seconds (as text) to integer nanoseconds, exactly."""
    as_decimal = pc.cast(pc.utf8_trim_whitespace(values), pa.decimal128(20, 9))  # up to 10^11 s
    scaled = pc.multiply(as_decimal, pa.scalar(10**9, pa.decimal128(10, 0)))
    return pc.cast(scaled, pa.int64())


def _workload(path: Path, prefix: str, columns: dict[str, pa.Array]) -> pa.Table:
    """Assemble a workload table: fill absent columns with their defaults, ids from row numbers; a row
    without a value a request must have is an error naming it."""
    for field in WORKLOAD_SCHEMA:
        if not field.nullable and field.name in columns and columns[field.name].null_count:
            row = pc.index(pc.is_null(columns[field.name]), True).as_py()
            raise ServelensError(f"{path}: data row {row + 1} has no {_MEANING.get(field.name, field.name)}",
                                 "fill in the empty cell or drop the row: every request needs it")
    n = len(next(iter(columns.values())))
    width = max(6, len(str(n)))
    ids = [f"{prefix}-{i:0{width}d}" for i in range(n)]
    out = {}
    for field in WORKLOAD_SCHEMA:
        if field.name == "request_id":
            out[field.name] = pa.array(ids, pa.string())
        elif field.name in columns:
            out[field.name] = pc.cast(columns[field.name], field.type)
        elif field.name == "num_branches":
            out[field.name] = pa.array([1] * n, pa.int64())
        elif field.name == "failed":
            out[field.name] = pa.array([False] * n, pa.bool_())
        else:
            out[field.name] = pa.nulls(n, field.type)
    return pa.Table.from_pydict(out, schema=WORKLOAD_SCHEMA)


def _read_csv(path: Path, column_types: dict[str, pa.DataType], hint: str,
              retry_types: dict[str, pa.DataType] | None = None) -> pa.Table:
    """The CSV with ``column_types`` (``retry_types`` instead where a time carries a zone offset those refuse);
    a cell that is not its column's type is an error naming the column, the row and the value, with ``hint``
    (what the format's cells hold), and a column named twice is refused by name."""
    try:
        try:
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=column_types))
        except pa.ArrowInvalid as exc:
            if retry_types is None or "zone offset" not in str(exc):
                raise
            column_types = retry_types
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=column_types))
    except (pa.ArrowInvalid, KeyError) as exc:
        raise _unreadable_csv(path, exc, hint) from None
    _refuse_repeated_columns(path, table.column_names)
    return table


#: pyarrow's message for a cell it cannot convert: the column's index (from 0), the type, why, the cell's text.
_CONVERSION = re.compile(r"In CSV column #(\d+): CSV conversion error to ([^:]+): (.*?) ?'(.*)'(?:\. [^']*)?$", re.DOTALL)
#: What a type's cells hold, in words.
_TYPE_WORDS = {"int64": "a whole number", "string": "text"}


def _unreadable_csv(path: Path, exc: Exception, hint: str) -> ServelensError:
    """``exc`` (pyarrow's) as an error naming the column by its header name, the data row (numbered from 1)
    and the cell's text, where pyarrow's message gives the column."""
    names = _csv_header(path)
    _refuse_repeated_columns(path, names)
    match = _CONVERSION.match(str(exc))
    if match is None or int(match[1]) >= len(names):
        return ServelensError(f"{path}: not a readable trace CSV: {exc}", hint)
    name, target, why, value = names[int(match[1])], match[2], match[3], match[4]
    row = _row_holding(path, name, value)
    where = f"data row {row}, " if row is not None else ""
    if why == "invalid value":
        kind = _TYPE_WORDS.get(target, "a date and time up to 2262" if target.startswith("timestamp") else target)
        what = f"which is not {kind} ({target})"
    else:  # e.g. "expected no zone offset in": a time with an offset where earlier ones have none
        what = f"which cannot be read as {target}: {why.removesuffix(' in')}"
    return ServelensError(f"{path}: not a readable trace CSV: {where}column {name} holds {shown_id(value)}, {what}",
                          hint)


def _csv_header(path: Path) -> list[str]:
    """The column names of a CSV's first line (read through the compression its name says, as pyarrow reads it)."""
    head = b""
    try:
        with pa.input_stream(str(path)) as stream:
            while b"\n" not in head and len(head) < 1 << 20:
                chunk = stream.read(1 << 16)
                if not chunk:
                    break
                head += chunk
    except (pa.ArrowException, OSError):
        return []
    line = head.split(b"\n", 1)[0].decode("utf-8-sig", "replace")
    return next(csv.reader([line]), [])


def _row_holding(path: Path, name: str, value: str) -> int | None:
    """The data row (from 1) where column ``name`` first holds the text ``value``; None if not found."""
    try:
        column = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
            include_columns=[name], column_types={name: pa.string()}, strings_can_be_null=False))[name]
    except (pa.ArrowException, OSError, KeyError):
        return None
    index = pc.index(column, value).as_py()
    return None if index < 0 else index + 1


def _refuse_repeated_columns(path: Path, names: list[str]) -> None:
    """A column named twice is ambiguous (which one holds the field?): refused by name, as the Parquet reader does."""
    counts = Counter(names)
    twice = sorted(name for name, count in counts.items() if count > 1)
    if twice:
        shown = ", ".join(f"{shown_id(name)} ({counts[name]} times)" for name in twice)
        raise ServelensError(f"{path} names a column more than once: {shown}; which one holds the field is "
                             "ambiguous, so the file is refused", "write each column once")


_AZURE_HINT = ("ContextTokens and GeneratedTokens are whole token counts; TIMESTAMP is a UTC date and time as the "
               "Azure trace writes it, e.g. 2023-11-16 18:15:46.6805900 (2024: with +00:00)")


def read_azure(path: Path, prefix: str = "azure") -> pa.Table:
    """Azure LLM inference trace 2023 or 2024 (conversation or code); timestamps are UTC wall clock, without a
    zone (2023) or with an offset such as ``+00:00`` (2024)."""
    tokens = {"ContextTokens": pa.int64(), "GeneratedTokens": pa.int64()}
    t = _read_csv(path, {"TIMESTAMP": pa.timestamp("ns"), **tokens}, _AZURE_HINT,
                  {"TIMESTAMP": pa.timestamp("ns", tz="UTC"), **tokens})
    _require(path, t, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    return _workload(
        path,
        prefix,
        {
            "arrival_ns": pc.cast(t["TIMESTAMP"], pa.int64()),
            "num_prompt_tokens": t["ContextTokens"],
            "num_output_tokens": t["GeneratedTokens"],
        },
    )


def read_mooncake(path: Path, prefix: str = "mooncake") -> pa.Table:
    """Mooncake FAST'25 trace (JSONL with prefix-block hash ids)."""
    schema = pa.schema(
        [
            ("timestamp", pa.int64()),
            ("input_length", pa.int64()),
            ("output_length", pa.int64()),
            ("hash_ids", pa.list_(pa.int64())),
        ]
    )
    try:
        t = pajson.read_json(path, parse_options=pajson.ParseOptions(explicit_schema=schema))
    except pa.ArrowInvalid as exc:
        raise ServelensError(f"{path}: not a readable Mooncake JSONL trace: {exc}") from None
    n = t.num_rows
    return _workload(
        path,
        prefix,
        {
            "arrival_ns": pc.multiply(t["timestamp"], 1_000_000),
            "num_prompt_tokens": t["input_length"],
            "num_output_tokens": t["output_length"],
            "prefix_block_ids": t["hash_ids"],
            "prefix_block_size_tokens": pa.array([MOONCAKE_BLOCK_TOKENS] * n, pa.int64()),
        },
    )


def read_burstgpt(path: Path, prefix: str = "burstgpt") -> pa.Table:
    """BurstGPT trace (v1 columns, or the v2 release with sessions)."""
    t = _read_csv(path, {"Timestamp": pa.string(), "Session ID": pa.string(), "Model": pa.string()},
                  "Request tokens and Response tokens are whole token counts; Timestamp is seconds from the trace's "
                  "start, e.g. 5 or 12.25")
    _require(path, t, ["Timestamp", "Model", "Request tokens", "Response tokens"])
    response = pc.cast(t["Response tokens"], pa.int64())
    columns = {
        "arrival_ns": _seconds_to_ns(t["Timestamp"]),
        "num_prompt_tokens": t["Request tokens"],
        "num_output_tokens": response,
        "model": t["Model"],
        "failed": pc.equal(response, 0),
    }
    if "Session ID" in t.column_names:
        session = t["Session ID"]
        columns["session_id"] = pc.if_else(pc.equal(session, ""), pa.scalar(None, pa.string()), session)
    return _workload(path, prefix, columns)


def _require(path: Path, table: pa.Table, names: list[str]) -> None:
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ServelensError(
            f"{path}: missing column(s) {', '.join(missing)}",
            f"this reader expects the columns {', '.join(names)}",
        )


def read_blis(path: Path, prefix: str = "blis") -> pa.Table:
    """BLIS (inference-sim) trace v2: this CSV and its YAML header beside it (``replay.blis``)."""
    return read_blis_workload(path, prefix)


READERS = {"azure": read_azure, "mooncake": read_mooncake, "burstgpt": read_burstgpt, "blis": read_blis}


def detect_format(path: Path) -> str:
    """Guess a trace file's format from its first line (a ``.gz`` file is read through gzip, as the readers do)."""
    import gzip

    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as fh:
        head = fh.readline().decode("utf-8", "replace")
    if head.lstrip().startswith("{") and "input_length" in head:
        return "mooncake"
    if head.startswith("TIMESTAMP"):
        return "azure"
    if head.startswith("Timestamp"):
        return "burstgpt"
    if head.startswith("request_id,client_id,tenant_id"):
        return "blis"
    raise ServelensError(
        f"{path}: unknown trace format (first line {head.strip()[:80]!r})",
        f"supported formats: {', '.join(READERS)}; or name a bundled trace: {', '.join(BUNDLED_TRACES)}",
    )


def resolve_trace(name_or_path: str, shared: Path | None) -> tuple[Path, str, str]:
    """(file, format, id prefix) of a bundled trace name or a trace file path."""
    if name_or_path in BUNDLED_TRACES:
        trace = BUNDLED_TRACES[name_or_path]
        if shared is None:
            raise DataNotFoundError(f"bundled trace {name_or_path} needs the shared data folder")
        path = shared / trace.relative_path
        if not path.is_file():
            raise DataNotFoundError(f"bundled trace {name_or_path} is missing: {path} does not exist")
        return path, trace.format, trace.name
    path = Path(name_or_path)
    if not path.is_file():
        raise DataNotFoundError(
            f"trace {name_or_path!r} is neither a bundled trace nor a file",
            f"bundled traces: {', '.join(BUNDLED_TRACES)}; or give the path of an Azure, Mooncake or BurstGPT file",
        )
    return path, detect_format(path), Path(path.stem).stem if path.suffix == ".gz" else path.stem


def read_trace(name_or_path: str, shared: Path | None = None) -> pa.Table:
    """The workload table of a bundled trace (by name) or a trace file (format detected)."""
    path, fmt, prefix = resolve_trace(name_or_path, shared)
    try:
        table = READERS[fmt](path, prefix)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:  # a column's text that is not its type's
        raise ServelensError(f"{path}: not a readable {fmt} trace: {exc}",
                             "check the file's columns hold what this format holds (numbers where counts are)") from None
    if table.num_rows == 0:
        raise ServelensError(f"{path}: the trace holds no requests", "give a trace with at least one row")
    _check_not_negative(path, table)
    _check_token_counts(path, fmt, table)
    return table


def first_below(table: pa.Table, column: str, least: int) -> tuple[int, int] | None:
    """(row, value) of the first row holding ``column``'s smallest value when that is below ``least``; else None."""
    low = pc.min(table[column]).as_py()
    if low is None or low >= least:
        return None
    return pc.index(table[column], low).as_py(), low


def _check_not_negative(path: Path, table: pa.Table) -> None:
    for column, what in _MEANING.items():
        found = first_below(table, column, 0)
        if found is not None:
            row, low = found
            where = " (before 1970, or before 0 in a trace of relative times)" if column == "arrival_ns" else ""
            raise ServelensError(f"{path}: data row {row + 1} (request {table['request_id'][row]}) has a negative "
                                 f"{what}{where}: {column} {low}",
                                 "fix or drop the row: a replay cannot run a negative count or time")


#: Each format's columns of the prompt and output lengths, as a message names them.
_TOKEN_COLUMNS = {
    "azure": {"num_prompt_tokens": "ContextTokens", "num_output_tokens": "GeneratedTokens"},
    "mooncake": {"num_prompt_tokens": "input_length", "num_output_tokens": "output_length"},
    "burstgpt": {"num_prompt_tokens": "Request tokens", "num_output_tokens": "Response tokens"},
    "blis": {"num_prompt_tokens": "prefix_length + input_tokens", "num_output_tokens": "output_tokens"},
}


def _check_token_counts(path: Path, fmt: str, table: pa.Table) -> None:
    """A prompt or output length above ``MAX_TRACE_TOKENS`` is an error naming its row and column."""
    for column in ("num_prompt_tokens", "num_output_tokens"):
        high = pc.max(table[column]).as_py()
        if high is not None and high > MAX_TRACE_TOKENS:
            row = pc.index(table[column], high).as_py()
            name = _TOKEN_COLUMNS.get(fmt, {}).get(column, column)
            raise ServelensError(f"{path}: data row {row + 1} (request {table['request_id'][row]}) has {high:,} tokens "
                                 f"as its {_MEANING[column]} (column {name}), more than the {MAX_TRACE_TOKENS:,} of "
                                 "the longest context window any model serves",
                                 f"fix or drop the row: a token count is at most {MAX_TRACE_TOKENS:,}")
