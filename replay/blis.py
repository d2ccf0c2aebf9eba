"""BLIS (inference-sim) trace v2: import as a workload or as observed events, export from events.

A trace v2 is two files: a YAML header (``trace_version``, ``time_unit``, ``mode``, ``server``,
``goodput_slo_targets``, ...) and a CSV with one row per request (``request_id, client_id,
tenant_id, slo_class, session_id, ..., arrival_time_us, send_time_us, first_chunk_time_us,
last_chunk_time_us, num_chunks, status, error_message, finish_reason`` plus the optional
``vllm_priority``, ``slo_target_us``, ``x_request_id`` and ``adapter`` columns). Timestamps are
integer microseconds on one time origin.

- ``blis_workload``: the requests as a workload table (``schemas.records.WorkloadRequest``), to
  replay a BLIS trace through servelens's policies;
- ``blis_events``: an observed trace (modes ``real`` and ``replayed``) as lifecycle events
  (arrival, first token, the remaining tokens as one chunk, finish), so its request table can be
  judged next to a servelens replay;
- ``to_blis``: any events table (real or replayed) as a trace v2 that ``blis replay`` runs as is
  (times from the first arrival, output lengths, prefix block ids as prefix groups), so BLIS can
  replay a workload that servelens recorded; ``BlisExport`` says what the events did not record.

What maps to what, and the fields servelens does not model, are listed in ``docs/interop.md``.
``BlisTrace.carry`` keeps the unmodelled columns as written; passing it back to ``to_blis``
restores them, so import then export (on the trace's own origin, ``origin_ns=0``) reproduces the
trace file exactly.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import yaml

from schemas.arrow import EVENTS_SCHEMA, arrow_schema, events_to_table
from schemas.events import FirstToken, RequestArrived, RequestFinished, TokensDelivered
from schemas.records import WorkloadRequest
from servelens.errors import ServelensError

WORKLOAD_SCHEMA = arrow_schema(WorkloadRequest)  # as replay.traces builds it (that module reads BLIS CSVs through this one)

#: The base columns, in the order BLIS writes them.
BASE_COLUMNS = (
    "request_id", "client_id", "tenant_id", "slo_class", "session_id", "round_index",
    "prefix_group", "prefix_length", "streaming", "input_tokens", "output_tokens",
    "text_tokens", "image_tokens", "audio_tokens", "video_tokens", "reason_ratio",
    "model", "deadline_us", "server_input_tokens",
    "arrival_time_us", "send_time_us", "first_chunk_time_us", "last_chunk_time_us",
    "num_chunks", "status", "error_message", "finish_reason",
)
OPTIONAL_COLUMNS = ("vllm_priority", "slo_target_us", "x_request_id", "adapter")
#: Columns servelens models (imported into a workload or events, and written back from them).
MODELLED_COLUMNS = (
    "request_id", "tenant_id", "slo_class", "session_id", "prefix_group", "prefix_length", "input_tokens",
    "output_tokens", "model", "deadline_us", "slo_target_us", "arrival_time_us", "first_chunk_time_us",
    "last_chunk_time_us", "status", "adapter",
)
#: Columns servelens does not model: kept as written in ``BlisTrace.carry`` (see docs/interop.md).
UNMODELLED_COLUMNS = tuple(c for c in (*BASE_COLUMNS, *OPTIONAL_COLUMNS) if c not in MODELLED_COLUMNS)
_INT_COLUMNS = ("request_id", "prefix_length", "input_tokens", "output_tokens", "deadline_us", "slo_target_us",
                "arrival_time_us", "first_chunk_time_us", "last_chunk_time_us")
#: How BLIS names the CSV's time unit: ``microseconds`` (blis run and replay write it), ``us`` (blis observe).
TIME_UNITS = ("microseconds", "us")
DEFAULT_BLOCK_TOKENS = 16  # vLLM's default KV block size, for prefix blocks when the header names none
_STATUS_OUTCOME = {"ok": "completed", "timeout": "timed_out", "error": "error"}
_OUTCOME_STATUS = {"completed": "ok", "timed_out": "timeout", "error": "error", "rejected": "error", "cancelled": "error"}


class BlisError(ServelensError):
    """A BLIS trace that cannot be read, or events that cannot be written as one."""


@dataclass(frozen=True, slots=True)
class BlisServer:
    """The header's ``server`` block (what served the trace)."""

    type: str | None = None
    model: str | None = None
    tensor_parallel: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class BlisSloTargets:
    """One SLO class's goodput thresholds, milliseconds (0 or absent: not gated)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None


@dataclass(frozen=True, slots=True)
class BlisHeader:
    """The YAML header of a trace v2 (version 3 adds ``goodput_slo_targets``)."""

    trace_version: int = 2
    time_unit: str = "microseconds"  # or "us": both mean integer microseconds (TIME_UNITS)
    created_at: str | None = None
    mode: str = "real"  # real (blis observe), generated (blis run) or replayed (blis replay)
    warm_up_requests: int = 0
    workload_seed: int | None = None
    workload_spec: str | None = None
    server: BlisServer | None = None
    measured_rtt_ms: float | None = None  # the header's network.measured_rtt_ms
    goodput_slo_targets: tuple[tuple[str, BlisSloTargets], ...] = ()

    @property
    def block_tokens(self) -> int:
        return (self.server.block_size if self.server and self.server.block_size else None) or DEFAULT_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class BlisTrace:
    """A trace v2 as read: its header, its rows (modelled columns typed), the unmodelled columns as text."""

    header: BlisHeader
    records: pa.Table  # every column of the CSV; MODELLED ints as int64, the rest as written (strings)
    columns: tuple[str, ...]  # the CSV's column order
    carry: pa.Table  # as written (text): request_id, prefix_group, prefix_length and the UNMODELLED_COLUMNS present


def _plain(cls, data: object, where: str):
    if data is None:
        return None
    if not isinstance(data, dict):
        raise BlisError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise BlisError(f"{where}: unknown key(s) {', '.join(unknown)}", f"known keys: {', '.join(sorted(known))}")
    return cls(**data)


def parse_header(text: str, where: str = "header") -> BlisHeader:
    """A trace v2 header from its YAML text; unknown keys are errors (as BLIS reads them)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise BlisError(f"{where}: not YAML: {exc}") from None
    return header_from_data(data, where)


#: The modes a trace v2 header names: real (blis observe), generated (blis run), replayed (blis replay).
MODES = ("real", "generated", "replayed")


def read_header(header_path: Path) -> BlisHeader:
    """The trace v2 header in the YAML file ``header_path``; a file that is not UTF-8 YAML is an error naming it."""
    from servelens.errors import ConfigError
    from servelens.settings import read_document

    try:
        data = read_document(header_path, "BLIS trace header", "write the header as BLIS does (--trace-header): a "
                             "UTF-8 YAML mapping with trace_version, time_unit and mode")
    except ConfigError as exc:
        raise BlisError(exc.message, exc.hint) from None
    return header_from_data(data or {}, str(header_path))


def header_from_data(data: object, where: str) -> BlisHeader:
    """A trace v2 header from its parsed YAML; unknown keys and bad values are errors naming ``where``."""
    if not isinstance(data, dict):
        raise BlisError(f"{where}: a trace header is a YAML mapping")
    data = dict(data)
    network = data.pop("network", None) or {}
    server = _plain(BlisServer, data.pop("server", None), f"{where}: server")
    targets = data.pop("goodput_slo_targets", None) or {}
    slo = tuple((str(k), _plain(BlisSloTargets, v or {}, f"{where}: goodput_slo_targets.{k}")) for k, v in targets.items())
    if set(network) - {"measured_rtt_ms"}:
        raise BlisError(f"{where}: network: unknown key(s) {', '.join(sorted(set(network) - {'measured_rtt_ms'}))}")
    header = _plain(BlisHeader, data, where)
    header = BlisHeader(**{f.name: getattr(header, f.name) for f in fields(BlisHeader)
                           if f.name not in ("server", "measured_rtt_ms", "goodput_slo_targets")},
                        server=server, measured_rtt_ms=network.get("measured_rtt_ms"), goodput_slo_targets=slo)
    if header.trace_version not in (2, 3):
        raise BlisError(f"{where}: trace_version {header.trace_version} is not supported (2 or 3)")
    if header.time_unit not in TIME_UNITS:
        raise BlisError(f"{where}: time_unit {header.time_unit!r} is not supported",
                        "trace v2 times are microseconds: 'microseconds' (blis run, replay) or 'us' (blis observe)")
    if header.mode not in MODES:
        raise BlisError(f"{where}: mode {header.mode!r} is not a trace v2 mode", f"valid modes: {', '.join(MODES)}")
    warm = header.warm_up_requests
    if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
        raise BlisError(f"{where}: warm_up_requests {warm!r} is not a count",
                        "the number of the trace's first requests that warm the server up: an integer, 0 or more")
    return header


def header_yaml(header: BlisHeader) -> str:
    """The header as YAML, keys in BLIS's order, empty fields omitted."""
    data: dict = {"trace_version": header.trace_version, "time_unit": header.time_unit}
    if header.created_at:
        data["created_at"] = header.created_at
    data["mode"] = header.mode
    data["warm_up_requests"] = header.warm_up_requests
    if header.workload_seed is not None:
        data["workload_seed"] = header.workload_seed
    if header.workload_spec:
        data["workload_spec"] = header.workload_spec
    if header.server is not None:
        data["server"] = {f.name: getattr(header.server, f.name) for f in fields(BlisServer) if getattr(header.server, f.name)}
    if header.measured_rtt_ms:
        data["network"] = {"measured_rtt_ms": header.measured_rtt_ms}
    if header.goodput_slo_targets:
        data["goodput_slo_targets"] = {
            name: {f.name: getattr(t, f.name) for f in fields(BlisSloTargets) if getattr(t, f.name)}
            for name, t in header.goodput_slo_targets
        }
    return yaml.safe_dump(data, sort_keys=False)


def read_blis(header_path: Path, data_path: Path) -> BlisTrace:
    """Read a trace v2 (header YAML, data CSV); bad values are errors that name the row and column."""
    header = read_header(header_path)
    try:
        with Path(data_path).open("rb") as fh:
            columns = next(csv.reader(io.TextIOWrapper(fh, "utf-8", newline="")))
        table = pacsv.read_csv(data_path, parse_options=pacsv.ParseOptions(newlines_in_values=True),
                               convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in columns},
                                                                    strings_can_be_null=False))
    except (StopIteration, pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise BlisError(f"{data_path}: not a readable trace v2 CSV: {exc}", "a trace v2 CSV is UTF-8 text") from None
    missing = [c for c in BASE_COLUMNS if c not in columns]
    if missing:
        raise BlisError(f"{data_path}: missing trace v2 column(s) {', '.join(missing)}")
    if table.num_rows == 0:
        raise BlisError(f"{data_path}: the trace holds no requests (a header line only)", "give a trace with at least one row")
    if header.warm_up_requests > table.num_rows:
        raise BlisError(f"{header_path}: warm_up_requests {header.warm_up_requests:,} is more than the trace's "
                        f"{table.num_rows:,} requests", "count only the trace's first requests that warm the server up")
    typed = {}
    for name in table.column_names:
        if name in _INT_COLUMNS:
            values = table[name].to_pylist()
            bad = next((i for i, v in enumerate(values) if not re.fullmatch(r"-?\d+", v.strip())), None)
            if bad is not None:
                raise BlisError(f"{data_path}: row {bad + 1}, column {name}: {values[bad]!r} is not an integer")
            typed[name] = pa.array([int(v) for v in values], pa.int64())
        else:
            typed[name] = table[name]
    records = pa.table(typed)
    for name in ("prefix_length", "input_tokens", "output_tokens", "deadline_us", "arrival_time_us"):
        negative = pc.less(records[name], 0)
        if pc.any(negative).as_py():
            row = pc.index(negative, True).as_py()
            raise BlisError(f"{data_path}: row {row + 1}, column {name}: {records[name][row].as_py()} is negative",
                            "fix or drop the row: a replay cannot run a negative count or time")
    kept = ["request_id", "prefix_group"] + [c for c in UNMODELLED_COLUMNS if c in columns]
    carry = table.select(kept).append_column("prefix_length", table["prefix_length"])
    return BlisTrace(header, records, tuple(columns), carry)


def _text_or_null(column: pa.ChunkedArray) -> pa.Array:
    return pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)


def _prefix_blocks(groups: list[str], lengths: list[int], block_tokens: int) -> list[list[int] | None]:
    """Full prefix blocks of each request, ids stable per (group, position): requests of a group share them."""
    out = []
    for group, length in zip(groups, lengths):
        num_blocks = length // block_tokens
        if not group or num_blocks == 0:
            out.append(None)
            continue
        base = int.from_bytes(hashlib.blake2b(group.encode(), digest_size=6).digest(), "big") << 14
        out.append([base + i for i in range(num_blocks)])
    return out


def blis_workload(trace: BlisTrace) -> pa.Table:
    """The trace's requests as a workload table (``WorkloadRequest``), arrivals in ns on the trace's origin.

    The prompt is ``prefix_length + input_tokens`` (BLIS writes the suffix only); a named prefix
    group becomes shared prefix blocks of the header's block size (full blocks only: vLLM caches
    no partial block). Tenants, classes and models are kept as recorded.
    """
    r = trace.records
    n = r.num_rows
    blocks = _prefix_blocks(r["prefix_group"].to_pylist(), r["prefix_length"].to_pylist(), trace.header.block_tokens)
    adapter = _text_or_null(r["adapter"]) if "adapter" in r.column_names else pa.nulls(n, pa.string())
    columns = {
        "request_id": pc.cast(r["request_id"], pa.string()),
        "arrival_ns": pc.multiply(r["arrival_time_us"], 1000),
        "num_prompt_tokens": pc.add(r["prefix_length"], r["input_tokens"]),
        "num_output_tokens": r["output_tokens"],
        "prefix_block_ids": pa.array(blocks, pa.list_(pa.int64())),
        "prefix_block_size_tokens": pa.array([trace.header.block_tokens if b else None for b in blocks], pa.int64()),
        "session_id": _text_or_null(r["session_id"]),
        "tenant": _text_or_null(r["tenant_id"]),
        "service_class": _text_or_null(r["slo_class"]),
        "model": _text_or_null(r["model"]),
        "adapter": adapter,
        "num_branches": pa.array([1] * n, pa.int64()),
        "failed": pc.equal(r["status"], "error"),
    }
    return pa.Table.from_pydict({f.name: columns.get(f.name, pa.nulls(n, f.type)) for f in WORKLOAD_SCHEMA},
                                schema=WORKLOAD_SCHEMA)


def blis_events(trace: BlisTrace, engine_id: str = "blis") -> pa.Table:
    """An observed trace as lifecycle events (``EVENTS_SCHEMA``).

    Per request: ``request_arrived`` at ``arrival_time_us`` (deadlines from ``deadline_us`` and
    ``slo_target_us``), ``first_token`` at ``first_chunk_time_us``, the other output tokens as one
    coalesced delivery at ``last_chunk_time_us`` (per-token gaps are not in the trace), and
    ``request_finished`` with the status's outcome (``incomplete``: still in flight, no finish).
    Event ids are derived from the request id, so importing twice de-duplicates.
    """
    r = trace.records.to_pylist()
    events = []
    for row in r:
        rid = str(row["request_id"])
        arrival = row["arrival_time_us"] * 1000
        common = {"engine_id": engine_id, "request_id": rid, "tenant": row["tenant_id"] or None,
                  "service_class": row["slo_class"] or None, "model": row["model"] or None,
                  "adapter": row.get("adapter") or None}
        target = row.get("slo_target_us") or 0
        events.append(RequestArrived(
            event_id=f"{engine_id}:{rid}:arrived", ts_ns=arrival,
            num_prompt_tokens=row["prefix_length"] + row["input_tokens"], max_output_tokens=row["output_tokens"],
            prefix_block_ids=_prefix_blocks([row["prefix_group"]], [row["prefix_length"]], trace.header.block_tokens)[0],
            session_id=row["session_id"] or None,
            e2e_deadline_ns=row["deadline_us"] * 1000 if row["deadline_us"] > 0 else None,
            ttft_deadline_ns=arrival + target * 1000 if target > 0 else None, **common,
        ))
        first, last, out = row["first_chunk_time_us"], row["last_chunk_time_us"], row["output_tokens"]
        if first > 0:
            events.append(FirstToken(event_id=f"{engine_id}:{rid}:first", ts_ns=first * 1000, **common))
            if out > 1:
                events.append(TokensDelivered(event_id=f"{engine_id}:{rid}:rest", ts_ns=last * 1000, num_tokens=out - 1,
                                              coalesced=True, **common))
        status = row["status"]
        if status == "incomplete":
            continue
        outcome = _STATUS_OUTCOME.get(status)
        if outcome is None:
            raise BlisError(f"request {rid}: unknown status {status!r}", "trace v2 statuses: ok, error, timeout, incomplete")
        if status == "error" and row["error_message"] in ("rejected", "cancelled"):  # servelens's own outcomes
            outcome = row["error_message"]
        finish_us = max(last, first, row["arrival_time_us"])
        events.append(RequestFinished(event_id=f"{engine_id}:{rid}:finished", ts_ns=finish_us * 1000, outcome=outcome,
                                      num_output_tokens=out if first > 0 else 0, **common))
    return events_to_table(events) if events else EVENTS_SCHEMA.empty_table()


@dataclass(frozen=True, slots=True)
class BlisExport:
    """A trace v2 to write (``write_blis``), and what the events did not say."""

    header: BlisHeader
    rows: pa.Table  # the CSV's rows, every column as text, in BLIS's order
    origin_ns: int  # the events' time written as 0 (the first arrival unless given)
    horizon_us: int  # a blis replay horizon that holds every recorded request: its default, or later
    default_horizon_us: int  # what blis replay takes without --horizon: 2 x the last arrival (600 s if 0)
    unknown_output_ids: tuple[str, ...] = ()  # requests with no recorded output length (as exported)
    num_without_arrival: int = 0  # requests left out: no request_arrived event
    assumed_block_tokens: int | None = None  # set when prefix block ids were taken to be this size, unsaid
    time_quantum_ns: int = 0  # the events' times were rounded down to this quantum before the export (0: exact)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What BLIS will replay differently from the events, one sentence each."""
        out = []
        if self.unknown_output_ids:
            ids = self.unknown_output_ids
            shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
            out.append(f"{len(ids):,} of {self.rows.num_rows:,} requests have no recorded output length (no "
                       f"request_finished count, no max_output_tokens): their output_tokens is the tokens delivered "
                       f"so far, 0 if none, so BLIS generates too few for them (request_id {shown})")
        if self.num_without_arrival:
            out.append(f"{self.num_without_arrival:,} requests have no request_arrived event: left out (BLIS needs "
                       "their arrival and prompt)")
        return tuple(out)

    @property
    def notes(self) -> tuple[str, ...]:
        """What the export took as given, and how BLIS is to run it."""
        first = pc.min(pc.cast(self.rows["arrival_time_us"], pa.int64())).as_py()
        out = [f"times are microseconds from {'the first arrival, ' if first == 0 else ''}{self.origin_ns} ns on the "
               "events' clock"]
        if self.horizon_us == self.default_horizon_us:
            out.append(f"blis replay's default horizon ({self.default_horizon_us} us, 2 x the last arrival) holds every "
                       "recorded request: run it without --horizon")
        else:
            out.append(f"the recorded requests end after blis replay's default horizon ({self.default_horizon_us} us, "
                       f"2 x the last arrival): run it with --horizon {self.horizon_us}")
        if self.time_quantum_ns:
            out.append(f"every time was rounded down to {self.time_quantum_ns / 1e6:g} ms (privacy.export_time_quantum_ms): "
                       "the order and the bursts are kept, sub-quantum timing (where prefix-cache hits show) is not; "
                       "--time-quantum-ms 0 keeps exact times, for a trace that stays in-house")
        if self.assumed_block_tokens:
            out.append(f"prefix block ids taken as {self.assumed_block_tokens} tokens each (vLLM's default): give the "
                       "block size (--block-tokens) when they name larger blocks (Mooncake: 512)")
        return tuple(out)

    @property
    def comments(self) -> tuple[str, ...]:
        """The header's comment lines (BLIS reads the header strictly: no field can say this)."""
        return tuple(f"servelens: warning: {w}" for w in self.warnings) + tuple(f"servelens: {n}" for n in self.notes)


def to_blis(events: pa.Table, requests: pa.Table, *, header: BlisHeader | None = None, carry: pa.Table | None = None,
            block_tokens: int | None = None, origin_ns: int | None = None) -> BlisExport:
    """Any events table as a trace v2: the header, the CSV rows and what the events did not say.

    ``requests`` is the events' request table (``replay.derive.derive_requests(events)``: the
    caller derives it, as the replay layer does not import the pipelines). Output lengths: a
    completed request's ``request_finished`` count, else its ``max_output_tokens`` (BLIS's intended
    length: a workload's arrival events carry its lengths there); where the events hold neither,
    the tokens delivered so far, and the request is named in ``unknown_output_ids``.

    Prefix block ids become BLIS prefix groups (``_shared_prefixes``) of ``block_tokens`` tokens per
    id (Mooncake: 512; default the header's ``server.block_size``, else 16), written to the header's
    ``server.block_size`` so that importing the trace gives the same blocks back.

    Times are microseconds from ``origin_ns`` (default: the first arrival, so that ``blis replay``'s
    default horizon, 2 x the last arrival, spans the trace and no empty time), floored; deadlines
    and carried send times move with them. ``horizon_us`` is that default, or the end of the last
    recorded request where it comes later. Requests without an arrival are left out (counted).
    Request ids stay when they are all integers, else requests are numbered in arrival order;
    ``round_index`` numbers each session's requests in arrival order.
    ``carry`` (``BlisTrace.carry``) restores the unmodelled columns of an imported trace and its
    prefix group names; without it they get BLIS's "not recorded" values.
    """
    header = _with_block_size(header or BlisHeader(), block_tokens)
    extra = {}
    for row in events.filter(pc.equal(events["event_type"], "request_arrived")).select(
            ["request_id", "prefix_block_ids", "e2e_deadline_ns", "ttft_deadline_ns"]).to_pylist():
        extra.setdefault(row["request_id"], row)
    carried = {str(c["request_id"]): c for c in carry.to_pylist()} if carry is not None else {}
    rows = [r for r in requests.to_pylist() if r["arrival_ns"] is not None]
    if not rows:
        raise BlisError("no request to export: the events hold no request_arrived", "BLIS replays a trace's arrivals")
    origin = origin_ns if origin_ns is not None else min(r["arrival_ns"] for r in rows)
    blocks = [extra.get(r["request_id"], {}).get("prefix_block_ids") or [] for r in rows]
    groups = _shared_prefixes(blocks, [r["num_prompt_tokens"] or 0 for r in rows], header.block_tokens)
    numbered = all(re.fullmatch(r"\d+", r["request_id"]) for r in rows)
    rounds = _session_rounds([r["session_id"] for r in rows])
    out, unknown = [], []
    for index, r in enumerate(rows):
        rid = r["request_id"] if numbered else str(index)
        output = _output_tokens(r)
        if output is None:
            unknown.append(rid)
        record = _record(r, extra.get(r["request_id"], {}), groups[index], rid, output, origin)
        record["round_index"] = str(rounds[index])
        _restore(record, carried.get(r["request_id"], {}), len(blocks[index]), r, header.block_tokens, origin)
        out.append(record)
    columns = _columns(out, header, carry)
    table = pa.table({name: pa.array([rec[name] for rec in out], pa.string()) for name in columns})
    assumed = block_tokens is None and not (header.server and header.server.block_size) and any(blocks)
    return BlisExport(header, table, origin, *_horizons_us(rows, origin), unknown_output_ids=tuple(unknown),
                      num_without_arrival=requests.num_rows - len(rows),
                      assumed_block_tokens=header.block_tokens if assumed else None)


def _session_rounds(sessions: list[str | None]) -> list[int]:
    """Each request's round in its session, in arrival order: 0, 1, 2, ... as BLIS's closed-loop
    replay requires them (0 outside a session)."""
    seen: dict[str, int] = {}
    out = []
    for session in sessions:
        out.append(seen.get(session, 0) if session else 0)
        if session:
            seen[session] = out[-1] + 1
    return out


def _horizons_us(rows: list[dict], origin_ns: int) -> tuple[int, int]:
    """(a horizon that holds every recorded request, blis replay's default: 2 x the last arrival)."""
    last_arrival = max(_us(r["arrival_ns"], origin_ns) for r in rows)
    default = 2 * last_arrival if last_arrival > 0 else 600_000_000  # cmd/replay.go, computeHorizonFromMaxArrival
    ends = [_us(t, origin_ns) + 1 for r in rows for t in (r["last_token_ns"], r["finish_ns"]) if t is not None]
    return max([default, *ends]), default


def _us(ns: int | None, origin_ns: int) -> int:
    """Microseconds from the origin, floored; 0 (BLIS's "none") for an absent time."""
    return (ns - origin_ns) // 1000 if ns is not None else 0


def _with_block_size(header: BlisHeader, block_tokens: int | None) -> BlisHeader:
    if block_tokens is None:
        return header
    return replace(header, server=replace(header.server or BlisServer(), block_size=block_tokens))


def _shared_prefixes(blocks: list[list[int]], prompts: list[int], block_tokens: int) -> list[tuple[str, int]]:
    """Each request's BLIS prefix group and prefix length in tokens (``("", 0)``: none).

    BLIS gives a group one prefix, shared whole by its members, so groups are flat where block ids
    form a tree: a request's group is the longest run of its leading blocks that another request
    shares too. A shorter prefix shared only with members of a longer group is not expressed, and
    a group of one request is no group. The length is the group's blocks in tokens, at most its
    shortest member's prompt (a last block may be partial). Names: ``p`` and a hash of the blocks.
    """
    trie: dict = {}  # block id -> [requests whose blocks start with the path to it, children]
    for ids in blocks:
        node = trie
        for block in ids:
            entry = node.setdefault(block, [0, {}])
            entry[0] += 1
            node = entry[1]
    members: dict[tuple[int, ...], list[int]] = {}
    for index, ids in enumerate(blocks):
        node, depth = trie, 0
        while depth < len(ids) and node[ids[depth]][0] > 1:
            node, depth = node[ids[depth]][1], depth + 1
        if depth:
            members.setdefault(tuple(ids[:depth]), []).append(index)
    out = [("", 0)] * len(blocks)
    for key, indices in members.items():
        if len(indices) > 1:
            name = "p" + hashlib.blake2b(",".join(map(str, key)).encode(), digest_size=6).hexdigest()
            length = min(len(key) * block_tokens, *(prompts[i] for i in indices))
            for i in indices:
                out[i] = (name, length)
    return out


def _record(r: dict, more: dict, group: tuple[str, int], rid: str, output: int | None, origin_ns: int) -> dict:
    """One CSV row (text) of a request-table row, its prefix group and its arrival's deadlines."""
    arrival_us = _us(r["arrival_ns"], origin_ns)
    prompt = r["num_prompt_tokens"] or 0
    outcome = r["outcome"]
    e2e_deadline, ttft_deadline = more.get("e2e_deadline_ns"), more.get("ttft_deadline_ns")
    return {
        "request_id": rid, "client_id": "", "tenant_id": r["tenant"] or "", "slo_class": r["service_class"] or "",
        "vllm_priority": "0", "session_id": r["session_id"] or "", "round_index": "0",
        "prefix_group": group[0], "prefix_length": str(group[1]),
        "streaming": "true", "input_tokens": str(prompt - group[1]),
        "output_tokens": str(output if output is not None else r["num_output_tokens"] or 0),
        "text_tokens": "0", "image_tokens": "0", "audio_tokens": "0", "video_tokens": "0", "reason_ratio": "0",
        "model": r["model"] or "", "deadline_us": str(_us(e2e_deadline, origin_ns)),
        "slo_target_us": str(_us(ttft_deadline, r["arrival_ns"])),
        "server_input_tokens": "0", "arrival_time_us": str(arrival_us), "send_time_us": str(arrival_us),
        "first_chunk_time_us": str(_us(r["first_token_ns"], origin_ns)),
        "last_chunk_time_us": str(_us(r["last_token_ns"], origin_ns)),
        "num_chunks": "0", "status": "incomplete" if outcome is None else _OUTCOME_STATUS[outcome],
        "error_message": outcome if outcome in ("rejected", "cancelled") else "", "finish_reason": "",
        "x_request_id": "", "adapter": r["adapter"] or "",
    }


def _restore(record: dict, c: dict, num_blocks: int, r: dict, block_tokens: int, origin_ns: int) -> None:
    """Put back an imported trace's unmodelled columns as they were written (a send time moved with
    the origin), and its prefix group's name and length where the request's blocks still agree."""
    for name, value in c.items():
        if name in UNMODELLED_COLUMNS:
            record[name] = value
    if int(c.get("send_time_us") or 0) > 0:  # 0: not recorded (BLIS injects at the arrival)
        record["send_time_us"] = str(max(0, int(c["send_time_us"]) - origin_ns // 1000))
    if "prefix_group" not in c:
        return
    prompt, length = r["num_prompt_tokens"] or 0, int(c["prefix_length"])
    if (length // block_tokens if c["prefix_group"] else 0) == num_blocks and length <= prompt:
        record["prefix_group"], record["prefix_length"] = c["prefix_group"], str(length)
        record["input_tokens"] = str(prompt - length)


def _output_tokens(r: dict) -> int | None:
    """What BLIS should generate: the tokens a completed request produced; for one that did not
    complete, its max_tokens limit (BLIS traces set it to the intended length); None if unknown."""
    if r["outcome"] == "completed" and r["num_output_tokens"] is not None:
        return r["num_output_tokens"]
    return r["max_output_tokens"]


def _columns(records: list[dict], header: BlisHeader, carry: pa.Table | None) -> list[str]:
    """BLIS's column set: the base columns, plus each optional one where a row needs it."""
    present = set(carry.column_names) if carry is not None else set()
    columns = []
    for name in BASE_COLUMNS:
        columns.append(name)
        if name == "slo_class" and ("vllm_priority" in present or any(r["vllm_priority"] != "0" for r in records)):
            columns.append("vllm_priority")
        if name == "deadline_us" and any(r["slo_target_us"] != "0" for r in records):
            columns.append("slo_target_us")
    if "x_request_id" in present or (header.mode == "real" and any(r["x_request_id"] for r in records)):
        columns.append("x_request_id")
    if any(r["adapter"] for r in records):
        columns.append("adapter")
    return columns


def write_blis(header: BlisHeader, rows: pa.Table, header_path: Path, data_path: Path,
               comments: tuple[str, ...] = ()) -> None:
    """Write a trace v2: the header YAML (``comments`` as ``#`` lines above it) and the CSV
    (minimal quoting, ``\\n`` line ends, as Go writes)."""
    Path(header_path).parent.mkdir(parents=True, exist_ok=True)
    Path(header_path).write_text("".join(f"# {line}\n" for line in comments) + header_yaml(header))
    with Path(data_path).open("w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(rows.column_names)
        for row in zip(*(rows[c].to_pylist() for c in rows.column_names)):
            writer.writerow(row)


def trace_rows(trace: BlisTrace) -> pa.Table:
    """The trace's rows as text in its column order (what ``write_blis`` writes back)."""
    return pa.table({c: pc.cast(trace.records[c], pa.string()) for c in trace.columns})


__all__ = [
    "BASE_COLUMNS", "BlisError", "BlisExport", "BlisHeader", "BlisServer", "BlisSloTargets", "BlisTrace",
    "MODELLED_COLUMNS", "TIME_UNITS", "UNMODELLED_COLUMNS",
    "blis_events", "blis_workload", "header_yaml", "parse_header", "read_blis", "to_blis", "trace_rows", "write_blis",
]


def header_path_for(data_path: Path) -> Path:
    """The header beside a trace's CSV: ``trace.csv`` -> ``trace.yaml`` (or .yml, _header.yaml, .header.yaml)."""
    data_path = Path(data_path)
    candidates = [data_path.with_suffix(s) for s in (".yaml", ".yml")]
    candidates += [data_path.with_name(data_path.stem + s) for s in ("_header.yaml", ".header.yaml")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise BlisError(f"{data_path}: no trace v2 header beside it",
                         f"put the YAML header at {candidates[0]} (BLIS writes it with --trace-header)")


def read_blis_workload(data_path: Path, prefix: str = "blis") -> pa.Table:
    """The workload of the trace v2 whose CSV is ``data_path`` (its header beside it); ids as in the trace."""
    return blis_workload(read_blis(header_path_for(data_path), data_path))
