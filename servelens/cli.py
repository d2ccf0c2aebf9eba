"""The ``servelens`` command: a thin click layer over the library packages.

Every command is a few lines that parse options, call one library function and print its result.
Exit codes: 0 success, 1 a check failed (invalid events, a failed gate), 2 an inconclusive gate,
3 the command could not run (usage, configuration and input errors: a clean message with a hint).
Nothing prints a traceback unless ``SERVELENS_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from replay.cluster import MAX_INSTANCES, MAX_RANDOM_FAILURES, MAX_SCHEDULE_S, MIN_AUTOSCALE_S, MIN_LINK_GBPS
from schemas.validate import InvalidEventsError, UnreadableFileError, read_parquet_table
from servelens import __version__, layout
from servelens.click_types import (
    KEY_ID_CHARS,
    OUT_FILE,
    OUT_FOLDER,
    SEED,
    SHOWN_PATH_CHARS,
    Count,
    Duration,
    Finite,
    at_most_chars,
    refuse_overwriting,
    shown,
)
from servelens.config import Config, load_config, shared_dir
from servelens.engine_options import DEFAULT_ENGINE, ENGINE_HELP, check_engine, engine_instance, vllm_options
from servelens.errors import ServelensError
from servelens.fidelity_cli import COMMANDS as FIDELITY_COMMANDS
from servelens.replay_options import echo_summary, prepare, scenario_options

EXIT_INVALID = 1  # a check failed (invalid events; a failed gate)
EXIT_ERROR = 3  # the command could not run: usage, configuration or input errors (gate: 2 is inconclusive)


class _Group(click.Group):
    """A click group that turns domain and OS errors into one clean message."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ServelensError as exc:
            _fail(str(exc))
        except UnreadableFileError as exc:
            _fail(str(exc), exc.hint or "check that the file is complete (a copy cut short, or not Parquet at all)")
        except InvalidEventsError as exc:  # where only valid events are accepted: the first bad one, and how to see all
            _fail(str(exc), f"run `servelens events validate {exc.path}` to see every error")
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            _fail(f"{exc.strerror or type(exc).__name__}{where or f': {exc}'}", "check the path and its permissions")
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug: say so plainly, keep the traceback for those who ask
            if os.environ.get("SERVELENS_DEBUG"):
                raise
            _fail(
                f"internal error: {type(exc).__name__}: {exc}",
                "rerun with SERVELENS_DEBUG=1 for the traceback and report it",
            )


def _fail(message: str, hint: str | None = None) -> None:
    click.secho(f"error: {message}", err=True, fg="red")
    if hint:
        click.echo(f"  hint: {hint}", err=True)
    sys.exit(EXIT_ERROR)


def _config(ctx: click.Context) -> Config:
    return ctx.find_root().obj["config"]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="SERVELENS_CONFIG",
    help="TOML configuration file (default: none; environment SERVELENS_<SECTION>__<KEY> overrides).",
)
@click.option("--lake", "lake_root", default=None, metavar="DIR",
              help="The lake to read and write (overrides lake.root), e.g. out/demo/lake.")
@click.option("--bootstrap-server", "bootstrap_servers", default=None, metavar="HOST:PORT",
              help="Kafka bootstrap servers (overrides kafka.bootstrap_servers).")
@click.version_option(__version__, prog_name="servelens")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, lake_root: str | None, bootstrap_servers: str | None) -> None:
    """servelens: see, replay and gate LLM-serving scheduler changes.

    \b
    Example:
      servelens demo                       # the end-to-end path on a bundled real trace
      servelens events validate out/demo/engine/events.parquet
      servelens --lake out/demo/lake lake sql "SELECT count(*) FROM requests"
    """
    import dataclasses

    config = load_config(config_path)
    if lake_root is not None:
        config = dataclasses.replace(config, lake=dataclasses.replace(config.lake, root=lake_root))
    if bootstrap_servers is not None:
        config = dataclasses.replace(config, kafka=dataclasses.replace(config.kafka, bootstrap_servers=bootstrap_servers))
    ctx.obj = {"config": config}


# ---------------------------------------------------------------------------------------------- events


@cli.group()
def events() -> None:
    """Work with lifecycle event files (JSONL or Parquet)."""


@events.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--max-errors", type=click.IntRange(min=0), default=50, show_default=True,
              help="Print at most this many errors (all are counted; 0: only the summary).")
def events_validate(file: Path, max_errors: int) -> None:
    """Check every record of FILE against the event contract.

    Reports each error with its line (JSONL) or row (Parquet) number, the field path, the value's
    type and what was expected; exits 1 if any record is invalid, 0 otherwise. The file is
    streamed, never loaded whole.

    \b
    Example:
      servelens events validate out/demo/engine/events.parquet
      servelens events validate mooncake.events.jsonl      # from `servelens trace convert mooncake --to events`
    """
    from privacy.sanitize import UNKNOWN_FIELD, printable_field_name
    from schemas.validate import ValidationSummary, iter_file

    summary = ValidationSummary()
    for result in iter_file(file):
        summary.add(result)
        if result.errors and summary.num_invalid <= max_errors:
            for error in result.errors:
                click.echo(f"{file}:{result.number}: {error.render()}")
    total = summary.num_valid + summary.num_invalid
    click.echo(f"{total:,} records: {summary.num_valid:,} valid, {summary.num_invalid:,} invalid")
    if not total:  # not invalid (exit 0), but likely not what was meant: say so, as `privacy sanitize` does
        click.echo(f"warning: {file} holds no records (an empty file, or only blank lines)", err=True)
    for reason, count in summary.by_reason.most_common():
        click.echo(f"  invalid, {reason.replace('_', ' ')}: {count:,}")
    ignored: dict[str, int] = {}
    for name, count in summary.ignored_fields.items():  # only contract names are printed: a name is input too
        ignored[printable_field_name(name)] = ignored.get(printable_field_name(name), 0) + count
    for name, count in sorted(ignored.items(), key=lambda item: -item[1])[:10]:
        if name == UNKNOWN_FIELD:
            click.echo(f"  ignored {count:,} values of fields that are not contract names (not stored: allowlist; "
                       "their names are not printed)")
        else:
            click.echo(f"  ignored field {name!r} (of another event type) in {count:,} records (not stored: allowlist)")
    if summary.num_invalid:
        sys.exit(EXIT_INVALID)


@events.command("schema")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json-schema", "arrow"]),
    default="json-schema",
    show_default=True,
    help="Which generated view of the contract to print.",
)
def events_schema(fmt: str) -> None:
    """Print the event contract as JSON Schema or as the Arrow lake schema.

    \b
    Example:
      servelens events schema --format arrow
    """
    if fmt == "arrow":
        from schemas.arrow import EVENTS_SCHEMA

        click.echo(EVENTS_SCHEMA.to_string(show_field_metadata=False))
    else:
        from schemas.json_schema import events_json_schema

        click.echo(json.dumps(events_json_schema(), indent=2))


# ---------------------------------------------------------------------------------------------- traces


@cli.group()
def trace() -> None:
    """Read real LLM-serving traces (Azure 2023, Mooncake, BurstGPT)."""


@trace.command("list")
@click.pass_context
def trace_list(ctx: click.Context) -> None:
    """List the bundled traces and where they are found.

    \b
    Example:
      servelens trace list
    """
    from replay.traces import BUNDLED_TRACES

    try:
        shared: Path | None = shared_dir(_config(ctx))
    except ServelensError:
        shared = None
    for t in BUNDLED_TRACES.values():
        where = shared / t.relative_path if shared else "(shared data folder not found: set SERVELENS_SHARED_DIR)"
        click.echo(f"{t.name:<12} {t.description}\n{'':<12} {t.licence}\n{'':<12} {where}")


#: The file names each `trace convert --to` writes: the format follows the suffix, and a reader goes by it too.
_CONVERT_SUFFIXES = {"workload": (".parquet",), "events": (".jsonl", ".parquet")}


def _check_convert_suffix(out: Path, kind: str) -> None:
    """Refuse an --out whose suffix names another format than --to writes (a Parquet file named .jsonl)."""
    accepted = _CONVERT_SUFFIXES[kind]
    if out.suffix.lower() not in accepted:
        formats = " or ".join(accepted)
        raise click.BadParameter(f"{out} does not end in {formats}, the file --to {kind} writes",
                                 param_hint="'--out'")


@trace.command("convert")
@click.argument("trace_name", metavar="TRACE")
@click.option("--out", type=OUT_FILE, required=True, help="Output file.")
@click.option(
    "--to",
    "kind",
    type=click.Choice(["workload", "events"]),
    default="workload",
    show_default=True,
    help="workload: one row per request (Parquet); events: request_arrived events (JSONL or .parquet).",
)
@click.pass_context
def trace_convert(ctx: click.Context, trace_name: str, out: Path, kind: str) -> None:
    """Convert TRACE (a bundled name or a file) to a workload table or to arrival events.

    A trace whose rows are not in arrival order is refused, as `servelens replay` refuses it. --out must
    end in .parquet (--to workload) or in .jsonl or .parquet (--to events: the suffix picks the format).

    \b
    Example:
      servelens trace convert azure-conv --out azure.workload.parquet
      servelens trace convert mooncake --to events --out mooncake.events.jsonl
    """
    refuse_overwriting(out, trace_name)
    _check_convert_suffix(out, kind)
    import pyarrow.parquet as pq

    from replay.traces import read_trace
    from replay.workload import TableWorkload, arrival_events
    from schemas.wire import iter_table_json, write_jsonl

    # checked as a replay checks it (arrival order, unique ids): a workload written is one a replay takes
    workload = TableWorkload(read_trace(trace_name, _shared_or_none(ctx, trace_name)), name=trace_name).table
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "workload":
        pq.write_table(workload, out, compression="zstd")
    else:
        table = arrival_events(workload, engine_id=f"trace:{trace_name}")
        if out.suffix == ".parquet":
            pq.write_table(table, out, compression="zstd")
        else:
            write_jsonl(iter_table_json(table), out)
    click.echo(f"wrote {workload.num_rows:,} {'requests' if kind == 'workload' else 'events'} to {out}")


@trace.command("stats")
@click.argument("trace_name", metavar="TRACE")
@click.pass_context
def trace_stats(ctx: click.Context, trace_name: str) -> None:
    """Print a trace's size, rate, token percentiles and burstiness.

    A trace whose rows are not in arrival order is refused, as `servelens replay` refuses it.

    \b
    Example:
      servelens trace stats azure-conv
    """
    from replay.traces import read_trace
    from replay.workload import TableWorkload, workload_stats

    table = TableWorkload(read_trace(trace_name, _shared_or_none(ctx, trace_name)), name=trace_name).table  # order checked
    s = workload_stats(table)
    click.echo(
        f"{s.num_requests:,} requests ({s.num_failed:,} failed) over {s.span_s:,.1f} s, "
        f"{_figure(s.mean_rate_per_s, '.3f', ' req/s', 'no rate (every arrival at one instant)')}\n"
        f"prompt tokens p50 {s.prompt_tokens_p50:,.0f} p99 {s.prompt_tokens_p99:,.0f}; "
        f"output tokens p50 {s.output_tokens_p50:,.0f} p99 {s.output_tokens_p99:,.0f}\n"
        f"inter-arrival CV {_figure(s.burst.interarrival_cv, '.3f', '', 'n/a (fewer than two gaps)')}; "
        f"peak/mean {s.burst.peak_to_mean_1s:.2f} per 1 s, "
        f"{s.burst.peak_to_mean_10s:.2f} per 10 s"
    )


def _figure(value: float | None, spec: str, unit: str, missing: str) -> str:
    """``value`` formatted with its unit, or ``missing`` where it is undefined (None or NaN)."""
    return f"{value:{spec}}{unit}" if value is not None and value == value else missing


@trace.command("to-blis")
@click.argument("source", metavar="INPUT")
@click.option("--out", type=OUT_FILE, required=True,
              help="The trace's CSV; its YAML header is written beside it (.yaml).")
@click.option("--mode", type=click.Choice(["real", "replayed", "generated"]), default="real", show_default=True,
              help="The header's mode: real for recorded production traffic, replayed for a servelens replay.")
@click.option("--model", help="The header's server.model.")
@click.option("--block-tokens", type=click.IntRange(min=1),
              help="Tokens per prefix block id. Default: a workload's or trace's own (Mooncake: 512); for events, "
                   "which do not record it, 16 (vLLM's).")
@click.option("--time-quantum-ms", type=click.IntRange(min=0), metavar="MS",
              help="With --mode real, round an events input's times down to this quantum (default "
                   "privacy.export_time_quantum_ms, 100): a shareable trace hides the sub-quantum timing where "
                   "prefix-cache hits show (docs/privacy.md). 0 keeps exact times.")
@click.pass_context
def trace_to_blis(ctx: click.Context, source: str, out: Path, mode: str, model: str | None,
                  block_tokens: int | None, time_quantum_ms: int | None) -> None:
    """Export INPUT as a BLIS (inference-sim) trace v2 that `blis replay` runs as is (docs/interop.md).

    INPUT is events (JSONL or Parquet; real or replayed), a workload (Parquet), or a trace: a
    bundled name (mooncake, ...) or an Azure, Mooncake, BurstGPT or BLIS file. Times start at the
    first arrival; prefix block ids become BLIS prefix groups. Requests whose output length the
    input does not record are counted in a warning (stderr and the header). Recorded events
    exported as --mode real have their times rounded down to 100 ms (--time-quantum-ms).

    \b
    Example:
      servelens trace to-blis out/demo/engine/events.parquet --out blis/trace.csv --mode replayed
      servelens trace to-blis mooncake --out blis/mooncake.csv
      blis replay --trace-header blis/trace.yaml --trace-data blis/trace.csv ...
    """
    refuse_overwriting([out, out.with_suffix(".yaml")], source)
    from pipelines.blis_export import export_blis
    from replay.blis import BlisHeader, BlisServer, write_blis

    header = BlisHeader(mode=mode, created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        server=BlisServer(model=model) if model else None)
    if time_quantum_ms is None:
        time_quantum_ms = _config(ctx).privacy.export_time_quantum_ms
    export = export_blis(source, _shared_or_none(ctx, source), header=header, block_tokens=block_tokens,
                         time_quantum_ns=time_quantum_ms * 1_000_000 if mode == "real" else 0)
    write_blis(export.header, export.rows, out.with_suffix(".yaml"), out, export.comments)
    for warning in export.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {export.rows.num_rows:,} requests to {out} (header {out.with_suffix('.yaml')})")
    for note in export.notes:
        click.echo(f"  {note}")


@trace.command("from-blis")
@click.argument("data_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=OUT_FILE, required=True,
              help="Events (Parquet) of the trace's observed timings, to derive and judge its request table.")
def trace_from_blis(data_file: Path, out: Path) -> None:
    """Import a BLIS trace v2 (DATA_FILE, header beside it) as observed lifecycle events.

    To replay its workload instead, give the CSV to `servelens replay` or `trace convert`.

    \b
    Example:
      servelens trace from-blis blis/trace.csv --out blis.events.parquet
      SERVELENS_PRIVACY__KEY_FILE=.servelens/demo-pseudonym-key.toml servelens requests derive blis.events.parquet --out blis.req.parquet
    """
    import pyarrow.parquet as pq

    from replay.blis import blis_events, header_path_for, read_blis

    refuse_overwriting(out, data_file, header_path_for(data_file))

    events = blis_events(read_blis(header_path_for(data_file), data_file), engine_id=f"blis:{data_file.stem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(events, out, compression="zstd")
    click.echo(f"wrote {events.num_rows:,} events to {out}")


def _shared_or_none(ctx: click.Context, trace_name: str) -> Path | None:
    """The shared data folder, required when TRACE names a bundled trace; else wherever it is found (it
    holds the bundled inference-perf specs)."""
    from replay.traces import BUNDLED_TRACES

    try:
        return shared_dir(_config(ctx))
    except ServelensError:
        if trace_name in BUNDLED_TRACES:
            raise
        return None


# ---------------------------------------------------------------------------------------------- requests


@cli.group()
def requests() -> None:
    """Derive and inspect the request table (one row per request)."""


@requests.command("derive")
@click.argument("events_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=OUT_FILE, required=True, help="Output Parquet file.")
@click.pass_context
def requests_derive(ctx: click.Context, events_file: Path, out: Path) -> None:
    """Derive one row per request from EVENTS_FILE (JSONL or Parquet), for engine telemetry.

    A replay writes its own request table beside its events (OUT/requests.parquet, the same rows this
    command derives): for a replay's events.parquet whose manifest names it (a file in the same folder),
    that table is copied. Other input is validated (and refused if any record is invalid: run `servelens
    events validate` to see every error) and sanitized with the configured pseudonym key before anything
    is written; input that is sanitized already (every event carries a pseudonym key id) is validated too
    and its key ids must be ones of the configured key ring. Events may arrive in any order and
    duplicated. Progress goes to stderr. `--out` is replaced only when the run succeeds (work files go to
    a temporary folder beside it, removed afterwards). DuckDB's memory is capped by
    `lake.duckdb_memory_limit` (at least 16MB; it spills beyond; "600MB" keeps the process under 1 GB
    on a 1,000,000-request replay).

    \b
    Example:
      servelens requests derive out/demo/engine/events.parquet --out out/requests.parquet
    """
    refuse_overwriting(out, events_file)
    from replay.derive import BACKWARDS_SQL, connect, count_backwards, count_repeated_arrivals, write_requests

    started = time.monotonic()
    with _staging_folder(out) as work:
        if _copy_own_table(events_file, out, work):
            return
        con = connect(_config(ctx).lake.duckdb_memory_limit)  # a bad limit is refused before the long part
        staged = _staged_events(ctx, events_file, work, started)
        count = write_requests(staged, work / out.name, con=con)
        repeated = count_repeated_arrivals(con, staged)
        os.replace(work / out.name, out)
    if repeated:
        click.echo(f"warning: {repeated:,} requests arrived more than once (distinct request_arrived events): each row "
                   "takes every arrival field from the first, by ts_ns then event_id (docs/schema.md)", err=True)
    click.echo(f"wrote {count:,} requests to {out} in {time.monotonic() - started:,.1f} s")
    if not count:
        click.echo(f"warning: {events_file} holds no request's events: {out} has no rows", err=True)
    backwards = count_backwards(con, out)
    if backwards:
        click.echo(f"warning: {backwards:,} requests have a timestamp before the one their latency is measured from "
                   "(e.g. a first token before the arrival: clocks that disagree, or a broken emitter); those "
                   f"latencies are left null, the timestamps kept (the rows: WHERE {BACKWARDS_SQL})", err=True)


@contextlib.contextmanager
def _staging_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` (the same file system: a finished file is renamed into place at once),
    removed afterwards, on success or failure: a failed run leaves no partial file, and ``out`` as it was."""
    import tempfile

    try:  # an error names the user's --out, not the temporary folder's name beside it
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name[:64]}.", suffix=".tmp")
    except OSError as exc:
        raise ServelensError(f"cannot write {out}: creating a file in {out.parent} failed ({exc.strerror or exc})",
                             "give --out a path in a folder you can write") from None
    with staging as work:
        yield Path(work)


def _copy_own_table(events_file: Path, out: Path, work: Path) -> bool:
    """Put the replay's own request table beside ``events_file`` at ``out`` (through ``work``), if there is one;
    one that is not a readable request table is warned of, and the events are derived instead."""
    import shutil

    from replay.request_table import REQUIRED_COLUMNS, read_request_table

    own = _replays_own_table(events_file)
    if own is None:
        return False
    try:
        read_request_table(own, REQUIRED_COLUMNS)
    except (ServelensError, UnreadableFileError) as exc:
        click.echo(f"warning: the replay's own request table is unusable: {getattr(exc, 'message', exc)}; "
                   "deriving it from the events instead", err=True)
        return False
    shutil.copyfile(own, work / out.name)
    os.replace(work / out.name, out)
    click.echo(f"copied the replay's own request table {own} to {out} "
               f"({pq_rows(out):,} requests; the replay wrote it: nothing to derive)")
    return True


def _staged_events(ctx: click.Context, events_file: Path, work: Path, started: float) -> Path:
    """``events_file`` validated and sanitized into ``work`` (``pipelines.lake.staged_parquet``), with progress."""
    from pipelines.lake import is_sanitized, staged_parquet
    from schemas.validate import detect_format

    claimed = detect_format(events_file) == "parquet" and is_sanitized(events_file)
    verb = "validated" if claimed else "sanitized"
    click.echo(f"{events_file} claims to be sanitized (every event carries a pseudonym key id): validating it and "
               "checking its key ids against the configured key ring ..." if claimed else
               f"validating and sanitizing {events_file} with the configured pseudonym key ...", err=True)
    staged = staged_parquet(events_file, work, _sanitizer(ctx), progress=_event_progress(verb))
    click.echo(f"  {verb} in {time.monotonic() - started:,.1f} s; deriving the request table ...", err=True)
    return staged


def _event_progress(verb: str):
    """A progress callback: a stderr line every 5 s with the events done so far and their rate."""
    started = last = time.monotonic()

    def report(count: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= 5:
            last = now
            click.echo(f"  {verb} {count:,} events ({count / (now - started):,.0f}/s)", err=True)

    return report


def _replays_own_table(events_file: Path) -> Path | None:
    """The request table a replay wrote beside ``events_file`` when its manifest names both (``replay.run``): a plain
    file name in the same folder. A manifest that is not a JSON object, or names anything else (a path, ``..``, a
    link out of the folder), names none."""
    manifest = events_file.parent / "manifest.json"
    if events_file.name != "events.parquet" or not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    output = data.get("output") if isinstance(data, dict) else None
    name = output.get("requests_file") if isinstance(output, dict) else None
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return None
    own = events_file.parent / name
    try:
        beside = own.is_file() and own.resolve().parent == events_file.parent.resolve()
    except OSError:
        return None
    return own if beside else None


def _manifest_model(path: Path) -> str | None:
    """The model of the replay whose manifest sits beside ``path`` (None: no manifest)."""
    manifest = path.parent / "manifest.json"
    try:
        return json.loads(manifest.read_text())["instance"]["model"]["name"] if manifest.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows


def _sanitizer(ctx: click.Context):
    from privacy.keys import load_keyring
    from privacy.sanitize import Sanitizer

    privacy = _config(ctx).privacy
    return Sanitizer(load_keyring(privacy.key_file), privacy)


# ---------------------------------------------------------------------------------------------- metrics


@cli.group()
def metrics() -> None:
    """Export a request table's metrics in standard formats (Prometheus, OpenTelemetry)."""


@metrics.command("export")
@click.argument("requests_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--events", "events_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The table's events (Parquet): adds vllm:inter_token_latency_seconds (per-token gaps).")
@click.option("--format", "fmt", type=click.Choice(["prometheus", "otlp-json", "openmetrics"]), default="prometheus",
              show_default=True, help="Prometheus text exposition (one snapshot), an OTLP ExportMetricsServiceRequest "
              "in JSON, or an OpenMetrics time series for `promtool tsdb create-blocks-from openmetrics`.")
@click.option("--interval-s", type=Finite(min=0, min_open=True), default=15.0, show_default=True,
              help="openmetrics: one cumulative point per interval (requests observed when they finish).")
@click.option("--out", type=OUT_FILE, help="Output file; default: standard output.")
@click.option("--labels", default="model", show_default=True,
              help="Comma-separated label dimensions among model, service_class, pool ('' for none); never ids.")
@click.option("--max-label-values", type=click.IntRange(min=1), default=10, show_default=True,
              help="Values kept per label dimension; the rest fold into 'other'.")
@click.option("--min-group-size", type=click.IntRange(min=1), help="Label combinations with fewer requests fold into 'other' "
              "(default: privacy.min_group_size).")
@click.option("--max-model-len", type=click.IntRange(min=1), help="Upper end of the 1-2-5 token buckets (default: the largest count).")
@click.option("--provider", help="gen_ai.provider.name of the OTel GenAI series (e.g. vllm); default: omitted.")
@click.option("--model", default=None,
              help="Model label of requests whose events name none [default: the replay manifest's model beside the "
                   "file, else 'unknown'].")
@click.pass_context
def metrics_export(ctx: click.Context, requests_file: Path, events_file: Path | None, fmt: str, interval_s: float,
                   out: Path | None, labels: str, max_label_values: int, min_group_size: int | None,
                   max_model_len: int | None, provider: str | None, model: str | None) -> None:
    """Export REQUESTS_FILE (a request table, real or replayed, or the events to derive it from) as
    histograms with vLLM's and the OTel GenAI conventions' names and buckets (docs/interop.md).

    Requests whose events name no model (a replay of a trace that records none) are labelled with
    --model, by default the model of the replay's manifest beside the file.

    \b
    Example:
      servelens metrics export out/demo/engine/requests.parquet --events out/demo/engine/events.parquet --out demo.prom
      servelens metrics export out/demo/engine/events.parquet --labels model,service_class
      servelens metrics export out/demo/engine/requests.parquet --format otlp-json --labels model,service_class --out m.json
      servelens metrics export out/demo/engine/events.parquet --format openmetrics --out run.om
      promtool tsdb create-blocks-from openmetrics run.om /prometheus/data   # (Prometheus's tool, not servelens)
    """
    if out is not None:
        refuse_overwriting(out, requests_file, events_file)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipelines.exposition import request_metrics, request_metrics_over_time, to_openmetrics, to_otlp_json, to_prometheus

    table = read_parquet_table(requests_file)
    events = read_parquet_table(events_file) if events_file else None
    if "event_type" in table.column_names:  # an events file: the replay's own table beside it, else derived
        from replay.derive import derive_requests

        own = _replays_own_table(requests_file)
        table, events = (pq.read_table(own) if own else derive_requests(table)), events if events is not None else table
    model = model or _manifest_model(requests_file)
    if model and table["model"].null_count:
        table = table.set_column(table.schema.get_field_index("model"), "model", pc.fill_null(table["model"], model))
    options = {"labels": _names(labels), "max_label_values": max_label_values,
               "min_group_size": min_group_size or _config(ctx).privacy.min_group_size, "max_model_len": max_model_len,
               "provider_name": provider}
    from replay.request_table import check_request_table

    check_request_table(table, requests_file)  # durations NaN, infinite or negative: refused, not exported as +Inf
    result = request_metrics(table, events, **options)
    if fmt == "openmetrics":
        text = to_openmetrics(request_metrics_over_time(table, events, interval_s=interval_s, **options))
    elif fmt == "prometheus":
        text = to_prometheus(result)
    else:
        text = json.dumps(to_otlp_json(result, scope_version=__version__), indent=1)
    for why in result.omitted:
        click.echo(f"left out {why}", err=True)
    if out is None:
        click.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    click.echo(f"wrote {len(result.histograms)} histograms of {result.num_requests:,} requests to {out}"
               f" ({result.num_folded_requests:,} in small label groups folded into 'other')")


# ---------------------------------------------------------------------------------------------- privacy


@cli.group()
def privacy() -> None:
    """Pseudonym keys and sanitization (nothing is stored un-sanitized)."""


@privacy.command("keygen")
@click.option("--out", type=OUT_FILE, required=True, help="Key file to create.")
@click.option("--id", "key_id", default=None, callback=at_most_chars(KEY_ID_CHARS, "a key id"),
              help="Key id [default: k<UTC timestamp>].")
def privacy_keygen(out: Path, key_id: str | None) -> None:
    """Create a key file with one fresh 32-byte pseudonym key (mode 0600).

    \b
    Example:
      servelens privacy keygen --out out/keys/pseudonym-keys.toml
      export SERVELENS_PRIVACY__KEY_FILE=out/keys/pseudonym-keys.toml
    """
    from privacy.keys import generate_keyring, write_keyfile

    if out.exists():
        raise ServelensError(f"{out} already exists", f"rotate it with `servelens privacy rotate {out}`, or choose another path")
    ring = generate_keyring(key_id)
    write_keyfile(out, ring)
    click.echo(f"wrote pseudonym key {ring.active_id} to {out}")


@privacy.command("rotate")
@click.argument("key_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "key_id", default=None, callback=at_most_chars(KEY_ID_CHARS, "a key id"),
              help="New key id [default: k<UTC timestamp>].")
def privacy_rotate(key_file: Path, key_id: str | None) -> None:
    """Add a fresh key to KEY_FILE and make it active; older keys stay for tenant lookups.

    KEY_FILE is replaced whole (mode 0600); a symbolic link (a mounted secret) keeps its place and
    its target is rewritten.

    \b
    Example:
      servelens privacy rotate out/keys/pseudonym-keys.toml
    """
    from privacy.keys import load_keyring, rotate, write_keyfile

    ring = rotate(load_keyring(key_file), key_id)
    write_keyfile(key_file, ring)
    target = f", a link to {key_file.resolve()}" if key_file.is_symlink() else ""
    click.echo(f"active pseudonym key is now {ring.active_id} ({len(ring.secrets)} keys in {key_file}{target})")


@privacy.command("lookup")
@click.argument("value", metavar="ID")
@click.option("--field", default="request_id", show_default=True,
              type=click.Choice(["request_id", "tenant", "session_id", "user", "api_key_id", "adapter", "event_id"]),
              help="Which field ID is (each field has its own pseudonym kind).")
@click.option("--all-keys", is_flag=True, help="Its pseudonym under every key of the ring (records from before a rotation).")
@click.pass_context
def privacy_lookup(ctx: click.Context, value: str, field: str, all_keys: bool) -> None:
    """Print the pseudonym the lake stores for a raw ID, with the configured key ring.

    The sanitizer replaces identifiers by keyed pseudonyms (docs/privacy.md); this computes one, so
    an engine team can find its own requests in the lake. A tenant beyond privacy.tenant_budget is
    stored as `other`, not as its pseudonym.

    \b
    Example:
      SERVELENS_PRIVACY__KEY_FILE=.servelens/demo-pseudonym-key.toml servelens privacy lookup azure-conv-000042
      SERVELENS_PRIVACY__KEY_FILE=.servelens/demo-pseudonym-key.toml servelens privacy lookup acme --field tenant
    """
    from privacy.keys import load_keyring
    from privacy.sanitize import FIELD_POLICIES
    from schemas.validate import identifier_problem

    if problem := identifier_problem(field, value):  # no such id can be in the lake: its events were refused
        _fail(f"{field} {problem}", "give the id as the events carry it")
    ring = load_keyring(_config(ctx).privacy.key_file)
    policy = FIELD_POLICIES[field]
    keys = sorted(ring.secrets) if all_keys else [ring.active_id]
    for key_id in keys:
        pseudonym = ring.pseudonym(policy.kind, value, hex_chars=policy.hex_chars, key_id=key_id)
        click.echo(f"{pseudonym}" + (f"  (key {key_id}{', active' if key_id == ring.active_id else ''})" if all_keys else ""))
    sql = f"SELECT * FROM requests WHERE {field} = '{ring.pseudonym(policy.kind, value, hex_chars=policy.hex_chars)}'"
    click.echo(f'  e.g. servelens lake sql "{sql}"', err=True)


@privacy.command("sanitize")
@click.argument("events_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=OUT_FILE, required=True, help="Sanitized Parquet file.")
@click.pass_context
def privacy_sanitize(ctx: click.Context, events_file: Path, out: Path) -> None:
    """Validate and sanitize EVENTS_FILE (JSONL or Parquet) into Parquet, with a privacy report.

    The report (counts of dropped fields, redactions by entity type, values folded into 'other')
    is printed and written next to the output as <out>.privacy.json. Both are written to a temporary
    folder beside `--out` and renamed into place only when the run succeeds: a failed run leaves no
    partial file, and an earlier output and its report as they were.

    \b
    Example:
      servelens trace convert mooncake --to events --out mooncake.events.jsonl
      SERVELENS_PRIVACY__KEY_FILE=.servelens/demo-pseudonym-key.toml servelens privacy sanitize mooncake.events.jsonl --out mooncake.parquet
    """
    from pipelines.lake import events_to_parquet

    refuse_overwriting(out, events_file)
    sanitizer = _sanitizer(ctx)
    report_file = out.with_name(out.name + ".privacy.json")
    with _staging_folder(out) as work:
        count = events_to_parquet(events_file, work / out.name, sanitizer, progress=_event_progress("sanitized"))
        report = sanitizer.report().as_dict()
        (work / report_file.name).write_text(json.dumps(report, indent=2) + "\n")
        os.replace(work / out.name, out)
        os.replace(work / report_file.name, report_file)
    click.echo(f"wrote {count:,} sanitized events to {out}")
    if not count:
        click.echo(f"warning: {events_file} holds no events (an empty file, or only blank lines): {out} is empty", err=True)
    click.echo(json.dumps(report, indent=2))


# ---------------------------------------------------------------------------------------------- kafka


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Loopback port; 0 picks a free one [default: the port of kafka.bootstrap_servers].")
@click.pass_context
def broker(ctx: click.Context, port: int | None) -> None:
    """Run a local Kafka-compatible broker (Tansu, memory storage) for development and tests.

    The event and dead-letter topics of the configuration are created at start. It binds to
    127.0.0.1 only and keeps no events on disk: a restart starts empty (its log goes to
    <temp dir>/servelens-tansu-<port>.log, appended to by each start on that port). Production and
    docker-compose.yml use Apache Kafka in KRaft mode. Stop it with Ctrl-C.

    \b
    Example:
      servelens broker                 # 127.0.0.1:9092, topic servelens.events.v1
      servelens broker --port 19092
    """

    from pipelines.broker import LocalBroker

    kafka = _config(ctx).kafka
    if port is None:
        port = int(kafka.bootstrap_servers.split(",")[0].rsplit(":", 1)[1])
    topics = {kafka.topic: kafka.num_partitions, kafka.dead_letter_topic: 1}
    local = LocalBroker(port or None, topics=topics)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        local.start()
        click.echo(f"Kafka-compatible broker (Tansu, memory storage) at {local.bootstrap}; log {local.log_path}", err=True)
        click.echo("  topics: " + ", ".join(f"{t} ({n} partitions)" for t, n in topics.items()), err=True)
        local.wait()
    except KeyboardInterrupt:
        pass
    finally:
        local.stop()


def _consumer_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`ingest --name`: a plain file name (it names <lake>/_ingest/<name>.json), checked before anything runs."""
    from pipelines.ingest import check_consumer_name

    try:
        return None if value is None else check_consumer_name(value)
    except ServelensError as exc:
        raise click.BadParameter(f"{exc.message}; {exc.hint}", ctx, param) from None


@cli.group(invoke_without_command=True)
@click.option("--max-records", type=click.IntRange(min=1), default=None, help="Stop after reading this many records.")
@click.option("--idle-exit-s", type=Finite(min=0), default=None,
              help="Stop after this long with nothing to read: counted from the start, the last record and each "
                   "assignment of partitions; while none is assigned, ingest.session_timeout_ms longer.")
@click.option("--name", "consumer_name", default=None, callback=_consumer_name,
              help="This process's name in logs and status files: 1 to 100 letters, digits, '.', '_' or '-', "
                   "not starting with '.' [default: ingest.consumer_name, else host-pid].")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.pass_context
def ingest(ctx: click.Context, max_records: int | None, idle_exit_s: float | None, consumer_name: str | None, verbose: bool) -> None:
    """Consume the event topic into the lake: decode, validate, sanitize, commit exactly once.

    Runs until Ctrl-C or SIGTERM (then commits what it holds). Several processes with the same
    ingest.group_id split the partitions. Invalid records go to the dead_letters table with
    their reason. Health is logged every ingest.status_interval_s and written for `ingest status`.

    \b
    Example:
      servelens ingest
      servelens ingest --idle-exit-s 10      # drain the topic, then stop
      servelens ingest status
    """
    if ctx.invoked_subcommand is not None:
        return
    from pipelines.ingest import IngestConsumer, configure_logging
    from privacy.keys import load_keyring

    configure_logging(verbose)
    config = _config(ctx)
    consumer = IngestConsumer(
        config.kafka, config.ingest, config.lake, config.privacy, load_keyring(config.privacy.key_file),
        consumer_name=consumer_name,
    )
    live = sys.stderr.isatty()

    def show(stats) -> None:
        if live:
            click.echo("\r" + stats.line()[:160].ljust(160), err=True, nl=False)

    stats = consumer.run(max_records=max_records, idle_exit_s=idle_exit_s, on_status=show)
    if live:
        click.echo("", err=True)
    click.echo(stats.line())
    report = consumer.privacy_report().as_dict()
    click.echo(f"privacy: {json.dumps(report)}")


@ingest.command("status")
@click.pass_context
def ingest_status(ctx: click.Context) -> None:
    """Show each ingest process's last health line and the lake's committed offsets.

    A status file that cannot be read (not JSON, or lacking a field) is named as unreadable; the
    others are still shown.

    \b
    Example:
      servelens ingest status
    """
    from pipelines.ingest import read_status_files
    from pipelines.lake import DEAD_LETTERS, EVENTS, Lake

    config = _config(ctx)
    statuses, unreadable = read_status_files(config.lake.root)
    for path, why in unreadable:
        click.echo(f"{ascii(str(path))[1:-1]}: unreadable status file ({why}); remove it (a running ingest "
                   "rewrites its own every ingest.status_interval_s)")
    if not statuses:
        click.echo(f"no ingest process has reported into {config.lake.root} yet (start one: servelens ingest)")
    for s in statuses:
        age_s = (time.time_ns() - s["written_ns"]) / 1e9
        last = "never" if s["last_commit_ns"] is None else f"{(time.time_ns() - s['last_commit_ns']) / 1e9:.0f} s ago"
        click.echo(
            f"{s['consumer']}: reported {age_s:.0f} s ago; {s['records_read']:,} read, {s['events_written']:,} written "
            f"({s['events_per_s']:,.0f}/s), {s['dead_letters']:,} dead letters ({s['dead_letter_rate']:.2%}), "
            f"lag {s['total_lag']:,}, last commit {last}{'' if s['broker_reachable'] else ', BROKER UNREACHABLE'}"
        )
    lake = Lake(config.lake.root, config.lake)
    con = lake.connect()
    (num_events,) = con.execute("SELECT count(*) FROM events").fetchone()
    dead = con.execute("SELECT reason, count(*) FROM dead_letters GROUP BY 1 ORDER BY 2 DESC").fetchall()
    click.echo(f"lake {config.lake.root}: {num_events:,} events in {len(lake.files(EVENTS)):,} files; "
               f"{sum(n for _, n in dead):,} dead letters in {len(lake.files(DEAD_LETTERS)):,} files")
    for reason, count in dead:
        click.echo(f"  dead letters, {reason.replace('_', ' ')}: {count:,}")


# ---------------------------------------------------------------------------------------------- lake


@cli.group()
def lake() -> None:
    """Maintain and query the lake (Delta tables events/ and dead_letters/)."""


@lake.command("compact")
@click.option(
    "--vacuum-hours", type=click.IntRange(min=0), default=None,
    help="Then delete replaced files older than this [default: lake.vacuum_retention_hours]."
)
@click.pass_context
def lake_compact(ctx: click.Context, vacuum_hours: int | None) -> None:
    """Merge the small files of crowded dt/hour partitions, then vacuum replaced files.

    \b
    Example:
      servelens --lake out/demo/lake lake compact    # the lake `make demo` leaves
    """

    store = _existing_lake(_config(ctx))
    merged = store.compact()
    deleted = store.vacuum(retention_hours=vacuum_hours)
    click.echo(f"compacted {sum(merged.values()):,} files ({merged}); vacuumed {deleted:,} files")


def _existing_lake(config: Config) -> Any:
    """The configured lake, refused where its root is a local path that is no folder (a typo would otherwise
    read as an empty lake: 0 rows, 0 files compacted)."""
    from pipelines.lake import Lake

    store = Lake(config.lake.root, config.lake)
    if not store.is_remote and not Path(store.root).is_dir():
        what = "a file, not a lake folder" if Path(store.root).exists() else "not there"
        raise ServelensError(f"no lake at {store.root}: {what}",
                             "give the lake's folder with --lake (or [lake] root, SERVELENS_LAKE__ROOT); "
                             "`servelens ingest` creates one")
    return store


#: How long `lake sql` lets a query run before it is stopped, seconds (a recursive query can run forever), and the
#: longest --timeout-s (a day: beyond it Python's timer overflows, and no query over a lake needs more).
LAKE_SQL_TIMEOUT_S = 300.0
MAX_LAKE_SQL_TIMEOUT_S = 86_400.0
#: The most rows `lake sql` prints (an aggregate in SQL says more than a million printed rows).
MAX_LAKE_SQL_LIMIT = 1_000_000


@lake.command("sql")
@click.argument("query")
@click.option("--limit", type=Count(1, MAX_LAKE_SQL_LIMIT), default=50, show_default=True,
              help="Rows to print (at most 1,000,000).")
@click.option("--timeout-s", type=Finite(0, MAX_LAKE_SQL_TIMEOUT_S, min_open=True), default=LAKE_SQL_TIMEOUT_S,
              show_default=True, help="Stop the query after this many seconds (at most 86,400, a day).")
@click.pass_context
def lake_sql(ctx: click.Context, query: str, limit: int, timeout_s: float) -> None:
    """Run a read-only SQL QUERY over the views events, dead_letters and requests.

    Only queries (SELECT, several separated by ;) run, on a connection that reads files under the
    lake's folder alone: no other file (read_text, read_csv of a path elsewhere), no COPY, ATTACH,
    INSTALL, LOAD, SET or PRAGMA, no network, and its configuration locked (exit 3 with the reason).

    \b
    Example:
      servelens --lake out/demo/lake lake sql "SELECT outcome, count(*) FROM requests GROUP BY 1"
    """
    import tempfile
    import threading

    import duckdb

    from pipelines.tables import ReadOnlyViolation, check_query
    from servelens.sql import sql_literal

    store = _existing_lake(_config(ctx))
    hint = "lake sql runs queries only, over the views events, dead_letters and requests (docs/operations.md)"
    # DuckDB lets a locked connection read its temp_directory (default: ./.tmp under the current folder) besides
    # the lake: a fresh private folder of its own, removed afterwards, holds nothing but its spill files
    with tempfile.TemporaryDirectory(prefix="servelens-lake-sql-", ignore_cleanup_errors=True) as spill:
        con = store.duckdb()
        con.execute(f"SET temp_directory = {sql_literal(spill)}")
        con = store.connect(con, read_only=True)
        watchdog = threading.Timer(timeout_s, con.interrupt)
        watchdog.start()
        try:
            check_query(con, query)
            result = con.sql(query)
            table = None if result is None else result.limit(limit).to_arrow_table()
        except ReadOnlyViolation as exc:  # named by its own text (DuckDB's type of INSTALL is LOAD)
            given = next((" ".join(s.query.split()).rstrip(";") for s in con.extract_statements(query)
                          if s.type != duckdb.StatementType.SELECT), None)
            why = f"only queries (SELECT) may run here, not {shown(given)}" if given else str(exc)
            raise ServelensError(f"refused: {why}", hint) from None
        except duckdb.PermissionException as exc:
            raise ServelensError(f"refused: {exc}", hint) from None
        except duckdb.InterruptException:
            raise ServelensError(f"the query ran past --timeout-s ({timeout_s:g} s) and was stopped",
                                 "narrow it (a WHERE on dt, a LIMIT), or give a longer --timeout-s") from None
        except duckdb.Error as exc:
            raise ServelensError(f"the query failed: {exc}", "the views are events, dead_letters and requests") from None
        finally:
            watchdog.cancel()
            con.close()
    if table is not None:
        click.echo(table.to_pandas().to_string(index=False))


# ---------------------------------------------------------------------------------------------- replay


def _stash(name: str):
    """An option callback that keeps the value in ctx.meta (cluster options reach the command without
    widening its signature)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value not in (None, ()):
            ctx.meta[f"cluster.{name}"] = value

    return callback


#: The most requests one replay tiles the workload to: a billion is days of wall time and terabytes of events
#: already; more is a typo, not a replay.
MAX_REPLAY_REQUESTS = 1_000_000_000

#: The cluster options' ranges (replay.cluster says why): delays and latencies, link bandwidths, autoscaler periods.
_DELAY = Finite(0, MAX_SCHEDULE_S)
_LINK_GBPS = Finite(MIN_LINK_GBPS)
_AUTOSCALE_S = Finite(MIN_AUTOSCALE_S, MAX_SCHEDULE_S)


def _cluster_options(command):
    """`servelens replay`'s cluster options: --instances, --router, --scale and the scaling delays,
    disaggregated pools, failures and an autoscaler."""
    options = [
        click.option("--instances", type=click.IntRange(1, MAX_INSTANCES), expose_value=False, callback=_stash("instances"),
                     help="Replay a cluster of this many alike instances behind a router (docs/replay.md, Cluster)."),
        click.option("--router", expose_value=False, callback=_stash("router"),
                     help="Cluster router: round-robin (default), least-outstanding-tokens, least-load, gie."),
        click.option("--router-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     expose_value=False, callback=_stash("router_config_file"),
                     help="YAML file of the router's settings, e.g. shedding: {sheddable_classes: [batch]}."),
        click.option("--scale", multiple=True, expose_value=False, callback=_stash("scale"),
                     help="Scaling step AT_S:+N or AT_S:-N (seconds after the first arrival; repeatable), e.g. 120:+2."),
        click.option("--startup-s", type=_DELAY, expose_value=False, callback=_stash("startup_s"),
                     help="An added instance's start-up delay, seconds (default 30)."),
        click.option("--weight-load-s", type=_DELAY, expose_value=False, callback=_stash("weight_load_s"),
                     help="Its weight-loading delay, seconds (default: weight bytes / --weight-load-gbps)."),
        click.option("--weight-load-gbps", type=_LINK_GBPS, expose_value=False, callback=_stash("weight_load_gbps"),
                     help="Bandwidth weights load at, GB/s (default 2)."),
        click.option("--cache-warm-s", type=_DELAY, expose_value=False, callback=_stash("cache_warm_s"),
                     help="Its cache warm-up delay after loading, seconds (default 10)."),
        click.option("--decode-instances", type=click.IntRange(1, MAX_INSTANCES), expose_value=False, callback=_stash("decode_instances"),
                     help="Disaggregated serving: this many decode instances; --instances is then the prefill pool."),
        click.option("--decode-router", expose_value=False, callback=_stash("decode_router"),
                     help="Router of the decode pool (default least-outstanding-tokens)."),
        click.option("--kv-transfer-gbps", type=_LINK_GBPS, expose_value=False, callback=_stash("kv_transfer_gbps"),
                     help="Bandwidth of an instance's link for KV leaving it, GB/s (default 50)."),
        click.option("--kv-transfer-latency-s", type=_DELAY, expose_value=False, callback=_stash("kv_transfer_latency_s"),
                     help="Latency added to every KV transfer, seconds (default 0.00002)."),
        click.option("--fail", multiple=True, expose_value=False, callback=_stash("fail"),
                     help="Instance failure AT_S:INDEX (seconds after the first arrival, instance by creation index; "
                          "repeatable), e.g. 300:1."),
        click.option("--failure-rate-per-hour", type=Finite(0, MAX_RANDOM_FAILURES), expose_value=False,
                     callback=_stash("failure_rate_per_hour"),
                     help="Random instance failures per hour over the cluster (seeded by --seed), within the first hour."),
        click.option("--autoscaler", expose_value=False, callback=_stash("autoscaler"),
                     help="Autoscaler that sizes an aggregated cluster as it runs: request-rate, workload-aware "
                          "(docs/policies.md); --instances is then the start."),
        click.option("--autoscaler-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     expose_value=False, callback=_stash("autoscaler_config_file"),
                     help="YAML file of the autoscaler's settings, e.g. {target_requests_per_s: 4, max_instances: 16}."),
        click.option("--autoscale-interval-s", type=_AUTOSCALE_S, expose_value=False,
                     callback=_stash("autoscale_interval_s"), help="Seconds between the autoscaler's decisions (default 15)."),
        click.option("--autoscale-window-s", type=_AUTOSCALE_S, expose_value=False, callback=_stash("autoscale_window_s"),
                     help="Seconds of arrivals each decision measures (default 60)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _replay_cluster(ctx: click.Context, workload_name: str, policy_name: str, policy_config: Path | None,
                    engine_spec: str, cost_model: str, profile_path: Path | None, mode: str,
                    num_requests: int | None, seed: int, out: Path) -> None:
    """`servelens replay` with cluster options: the cluster replay (replay.cluster; the options'
    assembly: replay.cluster.cluster_from_options)."""
    from replay.cluster import cluster_from_options, run_cluster_replay

    options = {k.removeprefix("cluster."): v for k, v in ctx.meta.items() if k.startswith("cluster.")}
    if ctx.params.get("measured"):
        raise ServelensError("--measured replays one instance", "drop --instances, --router and --scale")
    instance, calibration, model_arg = _instance_and_model(ctx, engine_spec, cost_model, profile_path)
    config = cluster_from_options(instance, failure_seed=seed, **options)
    workload, preset, policy_cfg = prepare(ctx, workload_name, _shared_or_none(ctx, workload_name), num_requests, seed,
                                           policy_name, policy_config)
    shared = shared_dir(_config(ctx)) if cost_model == "profile" and profile_path is None else None
    with _replay_progress(workload.num_requests) as progress:
        summary = run_cluster_replay(workload, config, scenario=preset.scenario, policy_name=policy_name,
                                     policy_config=policy_cfg, cost_model=model_arg, shared=shared, seed=seed,
                                     out_dir=out, mode=mode, progress=progress,
                                     progress_every=max(1, (workload.num_requests or 100_000) // 200),
                                     calibration=calibration)
    click.echo(
        f"replayed {summary.num_requests:,} requests ({summary.simulated_s:,.1f} s simulated) on "
        f"{len(summary.instances)} instances ({summary.router}) in {summary.wall_s:,.1f} s "
        f"({summary.requests_per_wall_s:,.0f} requests/s): {summary.num_events:,} events, {summary.num_steps:,} engine steps, "
        f"{summary.num_preemptions:,} preemptions, {summary.num_shed:,} shed"
    )
    if summary.num_kv_transfers or summary.num_failures:
        click.echo(f"  {summary.num_kv_transfers:,} KV transfers ({summary.kv_transfer_bytes / 1e9:,.1f} GB), "
                   f"{summary.num_failures} instance failures")
    for x in summary.instances:
        ready = "never ready" if x.ready_s is None else f"ready at {x.ready_s:,.1f} s"
        role = "" if x.role == "serve" else f" ({x.role})"
        click.echo(f"  {x.instance_id}{role}: {x.num_routed:,} requests routed, {ready}")
    echo_summary(summary, preset, calibration, instance)
    _echo_outputs(summary)


def _instance_and_model(ctx: click.Context, engine_spec: str, cost_model: str, profile_path: Path | None, *,
                        full_layers: bool = True) -> tuple:
    """(instance, calibration or None, cost model) of `servelens replay`: a fitted profile's, or the engine's."""
    if profile_path is not None:
        instance, model_arg = _fitted_profile(ctx, profile_path, full_layers=full_layers)
        return instance, None, model_arg
    instance, calibration = engine_instance(ctx, _config(ctx), engine_spec, cost_model)
    return instance, calibration, cost_model


@contextlib.contextmanager
def _replay_progress(num_requests: int | None) -> Iterator[Callable]:
    """A progress bar on stderr (simulated against wall time) while a replay runs; yields its progress callback."""
    with click.progressbar(length=num_requests or 0, label="replaying", file=sys.stderr,
                           item_show_func=lambda p: f"{p.simulated_ns / 1e9:,.0f} s simulated in {p.wall_s:,.1f} s" if p else None) as bar:
        done = [0]

        def progress(p) -> None:
            bar.update(p.num_arrived - done[0], p)
            done[0] = p.num_arrived

        yield progress


def _echo_outputs(summary) -> None:
    click.echo(f"events:   {summary.events_path}\nrequests: {summary.requests_path}\n"
               f"manifest: {summary.manifest_path} (run {summary.run_id})")


@cli.command("replay")
@click.option("--workload", "workload_name", required=True,
              help="Bundled trace name, trace file, workload Parquet file (from `servelens trace convert`), or an "
                   "inference-perf config (a YAML file, or a bundled spec: general, general-lite, codegen, roleplay, "
                   "reasoning-lite).")
@click.option("--policy", "policy_name", default="fcfs", show_default=True,
              help="Registered scheduling policy: fcfs, priority, decode-first, prefill-first, sarathi, vtc, deadline, "
                   "deadline-vtc (docs/policies.md).")
@click.option("--policy-config", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="YAML file of the policy's settings (its config's fields; classes and tenants under `tenancy`).")
@click.option("--engine", "engine_spec", default=None, callback=check_engine,
              help=ENGINE_HELP + f" [default: {DEFAULT_ENGINE}]")
@click.option("--cost-model", type=click.Choice(["roofline", "profile", "constant"]), default="roofline",
              show_default=True, help="Step cost model (profile: measured Vidur operator timings from the shared data folder).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A profile from `servelens profile`: its fitted step-time table is the cost model, its model "
                   "(all real layers) on its device the instance (implies --cost-model profile; no --engine).")
@click.option("--measured", is_flag=True,
              help="With --profile: execute every step on the profile's device (the layers it built) and use the "
                   "measured step times as the clock; small workloads, reference mode (docs/calibration.md).")
@click.option("--mode", type=click.Choice(["fast", "reference"]), default="fast", show_default=True,
              help="fast coalesces runs of identical decode steps (same timestamps); reference simulates every step.")
@click.option("--requests", "num_requests", type=Count(1, MAX_REPLAY_REQUESTS), default=None,
              help="Tile the workload to this many requests (at most 1,000,000,000).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of every random choice (scenario draws).")
@click.option("--out", type=OUT_FOLDER, required=True, help="Output folder.")
@scenario_options
@vllm_options
@_cluster_options
@click.pass_context
def replay_command(ctx: click.Context, workload_name: str, policy_name: str, policy_config: Path | None,
                   engine_spec: str, cost_model: str, profile_path: Path | None, measured: bool, mode: str,
                   num_requests: int | None, seed: int, out: Path) -> None:
    """Replay a workload through a modelled serving instance; write events.parquet and manifest.json.

    The events follow the lifecycle contract, so `servelens requests derive OUT/events.parquet`
    and `servelens gate` read them as they read a real engine's. Progress (simulated against wall
    time) goes to stderr, the summary to stdout.

    \b
    Example:
      servelens replay --workload azure-conv --policy fcfs --engine llama-3-8b@h100-sxm --out out/replay/fcfs
      servelens replay --workload azure-conv --engine llama-2-70b@a100-80gx2 --cost-model profile --out out/70b
      servelens replay --workload azure-conv --policy deadline --policy-config out/demo/deadline.yaml --out out/deadline
      servelens replay --workload azure-conv --load 2x --policy deadline --engine llama-2-7b@a100-80gx2 --gpu-memory-utilization 0.5 --out out/deadline-2x
      servelens replay --workload azure-conv --superpose 4 --shift 10m --block-bootstrap 5m --seed 7 --out out/bursty
      servelens replay --workload azure-conv --profile profiles/llama-8b-h200.parquet --out out/8b-fitted
      servelens replay --workload azure-conv --instances 8 --router least-outstanding-tokens --scale 600:+2 --out out/cluster
      servelens replay --workload azure-conv --instances 2 --decode-instances 2 --kv-transfer-gbps 50 --fail 300:1 --out out/disagg
      servelens replay --workload azure-conv --instances 2 --autoscaler workload-aware --autoscale-interval-s 15 --out out/autoscaled
      servelens replay --workload azure-conv --requests 40 --profile out/profiles/tiny-cpu.parquet --measured --out out/measured
    """  # noqa: E501 (help examples run as written: one command per line)
    refuse_overwriting([out / "events.parquet", out / "requests.parquet"], workload_name)
    if any(key.startswith("cluster.") for key in ctx.meta):
        return _replay_cluster(ctx, workload_name, policy_name, policy_config, engine_spec, cost_model, profile_path,
                               mode, num_requests, seed, out)
    from replay.run import run_replay

    if measured and profile_path is None:
        raise ServelensError("--measured needs --profile", "profile the model first: servelens profile --model tiny --out FILE")
    if measured and mode == "fast" and ctx.get_parameter_source("mode") == click.core.ParameterSource.COMMANDLINE:
        raise ServelensError("--measured runs every step (reference mode): drop --mode fast")
    instance, calibration, model_arg = _instance_and_model(ctx, engine_spec, cost_model, profile_path,
                                                           full_layers=not measured)
    workload, preset, config = prepare(ctx, workload_name, _shared_or_none(ctx, workload_name), num_requests, seed,
                                       policy_name, policy_config)
    shared = shared_dir(_config(ctx)) if cost_model == "profile" and profile_path is None else None
    if measured:
        return _replay_measured(workload, preset, profile_path, instance, model_arg, policy_name, config, seed, out)
    with _replay_progress(workload.num_requests) as progress:
        summary = run_replay(workload, scenario=preset.scenario, policy_name=policy_name, policy_config=config,
                             instance=instance, cost_model=model_arg, shared=shared, seed=seed, out_dir=out, mode=mode,
                             progress=progress, progress_every=max(1, (workload.num_requests or 100_000) // 200),
                             calibration=calibration)
    click.echo(
        f"replayed {summary.num_requests:,} requests ({summary.simulated_s:,.1f} s simulated) in {summary.wall_s:,.1f} s "
        f"({summary.requests_per_wall_s:,.0f} requests/s): {summary.num_events:,} events, "
        f"{summary.num_steps:,} engine steps, {summary.num_preemptions:,} preemptions"
    )
    echo_summary(summary, preset, calibration, instance)
    _echo_outputs(summary)


def _replay_measured(workload, preset, profile_path: Path, instance, model_arg, policy_name: str,
                     policy_config: object, seed: int, out: Path) -> None:
    """`servelens replay --measured`: every step executed on the profile's device (replay.measured)."""
    from replay.measured.measured import run_measured_replay
    from replay.measured.profiler import read_profile

    meta = read_profile(profile_path).meta
    click.echo(f"executing every step of {meta.shape.name} on {meta.device} ({meta.device_name})", err=True)
    summary, timer = run_measured_replay(workload, meta.shape, device=meta.device, instance=instance,
                                         cost_model=model_arg, policy_name=policy_name, policy_config=policy_config,
                                         seed=seed, out_dir=out, scenario=preset.scenario)
    click.echo(
        f"replayed {summary.num_requests:,} requests ({summary.simulated_s:,.1f} s of trace time on the measured clock) in "
        f"{summary.wall_s:,.1f} s: {len(timer.steps):,} steps executed, {summary.num_events:,} events\n"
        f"events:   {summary.events_path}\nmanifest: {summary.manifest_path} (run {summary.run_id})"
    )


def _fitted_profile(ctx: click.Context, profile_path: Path, *, full_layers: bool = True):
    """(instance, fitted cost model) of a profile from `servelens profile` (replay --profile): the real
    model's layers, or (measured replay) the layers the profile built."""
    from click.core import ParameterSource

    from replay.cost_models import make_cost_model
    from replay.measured.fit import FittedProfileConfig, profile_instance
    from replay.measured.profiler import read_profile

    for name, flag in (("engine_spec", "--engine"), ("cost_model", "--cost-model")):
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            raise ServelensError(
                f"{flag} and --profile both given: a profile fixes the cost model, the model and the device",
                "drop one of them (docs/calibration.md)",
            )
    instance = profile_instance(read_profile(profile_path).meta, full_layers=full_layers)
    return instance, make_cost_model("profile", instance, config=FittedProfileConfig(path=str(profile_path)))


# ---------------------------------------------------------------------------------------------- calibration


@cli.command("profile")
@click.option("--model", "model_name", required=True,
              help="Model shape: tiny, llama-1b, llama-8b, llama-70b (Llama architecture, random weights).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the forward passes run (cuda: bf16, timed with CUDA events; cpu: float32, perf_counter).")
@click.option("--layers", "num_layers", type=click.IntRange(min=1), default=None,
              help="Build only this many layers (scaled by layer count: the fitted model multiplies per-layer "
                   "terms back to the real model) [default: all].")
@click.option("--out", type=OUT_FILE, required=True,
              help="Profile to write (Parquet); the fit report goes beside it as <out>.fit.json.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Timed runs per shape [default: 7 on cuda, 5 (tiny) or 3 on cpu].")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="Untimed runs per shape first [default: 3 on cuda, 1 on cpu].")
@click.option("--max-seconds", type=Finite(min=0, min_open=True), default=None,
              help="Time box: stop sweeping after this long (the profile says so).")
@click.option("--threads", "num_threads", type=click.IntRange(min=1), default=None, help="torch CPU threads [default: torch's].")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of weights, tokens, shape order and the held-out split.")
def profile_command(model_name: str, device: str, num_layers: int | None, out: Path, repeats: int | None,
                    warmup: int | None, max_seconds: float | None, num_threads: int | None, seed: int) -> None:
    """Time real forward passes over a sweep of step shapes; write a profile and fit the cost model.

    Each shape (prefill chunk sizes and contexts, decode batch sizes and contexts, and their mixes)
    runs warm-up times untimed, then repeats timed; the profile keeps every repeat, the median and the
    spread, with metadata (device and driver, torch, dtype, model shape, date). The step-time table
    fitted to it is reported on held-out shapes (median and p95 relative error) with the roofline
    fraction reached. Needs the optional PyTorch extra (pip install 'servelens[gpu]').

    \b
    Example:
      servelens profile --model tiny --device cpu --out out/profiles/tiny-cpu.parquet
      servelens profile --model llama-8b --device cuda --out profiles/llama-8b-h200.parquet --max-seconds 240
      servelens profile --model llama-70b --layers 8 --device cuda --out profiles/llama-70b-8l-h200.parquet
    """
    from replay.measured.executor import resolve_device
    from replay.measured.fit import evaluate_profile, fit_report_lines, write_fit_report
    from replay.measured.profiler import default_sweep, run_profile
    from replay.measured.shapes import llama_shape

    shape = llama_shape(model_name, num_layers)
    resolve_device(device)  # a missing torch or CUDA is said before anything runs
    overrides = {k: v for k, v in (("repeats", repeats), ("warmup", warmup), ("max_seconds", max_seconds)) if v is not None}
    sweep = default_sweep(device, shape, seed=seed, **overrides)
    with click.progressbar(length=1, label=f"profiling {shape.name} on {device}", file=sys.stderr,
                           item_show_func=lambda text: text) as bar:
        def progress(done: int, total: int, s, median_ns: int) -> None:
            bar.length = total
            bar.update(1, f"{s.kind} {s.num_tokens} tokens: {median_ns / 1e6:,.2f} ms")

        profile = run_profile(shape, device=device, sweep=sweep, out=out, progress=progress, num_threads=num_threads)
    m = profile.meta
    click.echo(
        f"profiled {profile.table.num_rows} of {m.num_shapes_planned} shapes of {shape.name} "
        f"({shape.num_layers}/{shape.full_num_layers} layers, {m.dtype}) on {m.device_name} in {m.wall_s:,.1f} s"
        + (" (time box reached)" if m.truncated else "")
        + f"\nprofile: {out}"
    )
    _, report = evaluate_profile(profile, seed)
    report_path = write_fit_report(report, profile, out)
    for line in fit_report_lines(report):
        click.echo(line)
    click.echo(f"fit:     {report_path}")


@cli.command("profile-info")
@click.argument("profile_path", type=click.Path(dir_okay=False, path_type=Path))
def profile_info_command(profile_path: Path) -> None:
    """Say what a profile was measured on and how closely its fitted step-time table predicts it.

    Prints the model shape, the device (GPU, driver, CUDA, torch), the timer and sweep, the peaks the
    roofline fraction is taken against, when and from which commit it was measured; then the fitted
    table's held-out error and roofline fraction, refitted here.

    \b
    Example:
      servelens profile-info profiles/llama-8b-h200.parquet
    """
    from replay.measured.fit import evaluate_profile, fit_report_lines
    from replay.measured.profiler import profile_lines, read_profile

    profile = read_profile(profile_path)
    for line in profile_lines(profile):
        click.echo(line)
    _, report = evaluate_profile(profile)
    for line in fit_report_lines(report):
        click.echo(line)


@cli.command("compare-measured")
@click.option("--workload", "workload_name", required=True,
              help="Bundled trace name, trace file, or workload Parquet file; sliced by --requests.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="A profile from `servelens profile`: its model runs measured, its fitted table runs modelled.")
@click.option("--policy", "policy_name", default="fcfs", show_default=True, help="Registered scheduling policy.")
@click.option("--policy-config", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="YAML file of the policy's settings (as for `servelens replay`).")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=50, show_default=True,
              help="Replay the workload's first this many requests (every step is a real forward pass).")
@click.option("--threads", "num_threads", type=click.IntRange(min=1), default=None, help="torch CPU threads [default: torch's].")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--out", type=OUT_FOLDER, required=True,
              help="Output folder: modelled/ and measured/ replays (events + manifest) and comparison.json.")
@click.pass_context
def compare_measured_command(ctx: click.Context, workload_name: str, profile_path: Path, policy_name: str,
                             policy_config: Path | None, num_requests: int, num_threads: int | None, seed: int,
                             out: Path) -> None:
    """Replay a small workload modelled and measured; compare TTFT, ITL and E2E percentiles.

    The measured replay executes every step the engine composes on the profile's device (its model,
    random weights) and uses the measured step times as the clock; the modelled replay uses the
    profile's fitted step-time table. Same workload, policy, instance and seed. Prints each metric's
    p50/p90/p99 with the relative error (modelled - measured) / measured, and the fitted model's error
    on the measured run's own steps.

    \b
    Example:
      servelens profile --model tiny --device cpu --out out/profiles/tiny-cpu.parquet
      servelens compare-measured --workload azure-conv --profile out/profiles/tiny-cpu.parquet --requests 30 --out out/measured
    """
    from replay.measured.measured import compare_measured, comparison_lines
    from replay.policies import load_policy_config
    from replay.workload import load_workload

    if num_requests < 1:
        raise ServelensError(f"--requests must be at least 1, not {num_requests}")
    config = load_policy_config(policy_name, policy_config) if policy_config is not None else None
    workload = load_workload(workload_name, _shared_or_none(ctx, workload_name), num_requests)
    result = compare_measured(workload, profile_path, policy_name=policy_name, policy_config=config, seed=seed,
                              out_dir=out, num_threads=num_threads)
    for line in comparison_lines(result):
        click.echo(line)
    click.echo(f"outputs: {out}/modelled, {out}/measured, {out}/comparison.json")


# ---------------------------------------------------------------------------------------------- gate


@cli.command()
@click.option(
    "--baseline",
    type=click.Path(exists=True, path_type=Path),
    help="Baseline run: a replay output folder, an events file or a request table.",
)
@click.option("--candidate", type=click.Path(exists=True, path_type=Path), help="Candidate run, likewise.")
@click.option(
    "--config",
    "gate_config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Gate configuration (YAML) [default: the built-in one].",
)
@click.option("--out", type=OUT_FOLDER, default=None, help="Report folder [default: <out_dir>/gate].")
@click.option("--live", is_flag=True, help="Judge two live pools from the lake (by the events' pool label) instead of two runs.")
@click.option("--baseline-pool", default="baseline", show_default=True, help="With --live: the baseline pool label.")
@click.option("--candidate-pool", default="canary", show_default=True, help="With --live: the canary (or shadow) pool label.")
@click.option("--since", "since_s", type=Duration(), default=None, metavar="DURATION",
              help="With --live: only requests from the last DURATION (90s, 30m, 1h, 2d; a plain number is seconds).")
@click.option("--previous-config", default=None, help="With --live: the configuration to restore on rollback (named in the decision).")
@click.option("--model-error", "model_error", multiple=True, metavar="NAME=FRACTION",
              help="The replay model's known error on a metric or fidelity figure (e.g. itl_mean=0.05): a pass by "
                   "a smaller margin is undecided. Repeatable; adds to the configuration's model_error; replays only.")
@click.option(
    "--write-default-config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the built-in configuration as YAML and stop.",
)
@click.option("--list-metrics", is_flag=True, help="List every metric: unit, worse direction, thresholds, meaning; then stop.")
@click.pass_context
def gate(ctx: click.Context, baseline: Path | None, candidate: Path | None, gate_config: Path | None, out: Path | None,
         live: bool, baseline_pool: str, candidate_pool: str, since_s: float | None, previous_config: str | None,
         model_error: tuple[str, ...], write_default_config: Path | None, list_metrics: bool) -> None:
    """Judge a candidate against a baseline: pass (exit 0), fail (1) or inconclusive (2).

    Prints the verdict and the action first (FAIL: roll back / PASS: promote / INCONCLUSIVE:
    continue N more minutes, or the offline equivalents), then what failed and what is undecided.
    Any metric not marked informative that fails critically fails the run, and so does a candidate
    that misses an absolute condition (attainment per class, by default); a metric with too few
    windows of data is "not enough data". Writes gate.json, gate.md and gate.html. With --live the
    two pools come from the lake (the events' pool label) and the verdict becomes a decision:
    promote, continue, or roll back to --previous-config. Errors exit 3 (docs/gate.md).

    \b
    Example:
      servelens gate --baseline out/demo/out/replay/2023-11-16/fcfs@2x --candidate out/demo/out/replay/2023-11-16/deadline@2x --config out/demo/gate.yaml
      servelens gate --live --candidate-pool canary --since 1h --previous-config policy=fcfs@v12
      servelens gate --baseline out/demo/out/replay/2023-11-16/fcfs@1x --candidate out/demo/out/replay/2023-11-16/vtc@1x --model-error itl_mean=0.05
      servelens gate --list-metrics
    """  # noqa: E501 (help examples run as written: one command per line)
    from replay.gate import compare_runs, config_yaml, decide, default_config, headline, load_config, parse_model_error
    from replay.gate_config import describe_metrics, with_model_error
    from replay.report import report_paths, write_reports

    if write_default_config is not None:
        write_default_config.write_text(config_yaml(default_config()))
        click.echo(f"wrote the default gate configuration to {write_default_config}")
        return
    config = load_config(gate_config)
    if model_error:
        config = with_model_error(config, {e.metric: e.error for e in map(parse_model_error, model_error)})
    if list_metrics:
        click.echo("\n".join(describe_metrics(config)))
        return
    out = out or layout.gate_dir(_config(ctx).paths.out_dir)
    report_paths(out)  # a report's name held by a folder: refused before anything is judged
    base_run, cand_run = _gate_runs(ctx, baseline, candidate, live, baseline_pool, candidate_pool, since_s)
    verdict = compare_runs(base_run, cand_run, config)
    decision = decide(verdict, previous_config) if live else None
    paths = write_reports(verdict, base_run, cand_run, out, decision)
    click.echo(f"gate: {headline(verdict, decision)}")
    for line in (*verdict.notes, *verdict.reasons):
        click.echo(f"  - {line}")
    click.echo(f"reports: {paths['json']}, {paths['markdown']}, {paths['html']}")
    sys.exit(verdict.exit_code)


def _gate_runs(ctx: click.Context, baseline: Path | None, candidate: Path | None, live: bool, baseline_pool: str,
               candidate_pool: str, since_s: float | None):
    """The two sides: live pools from the lake, or two runs from files."""
    from replay.gate import load_run

    if live:
        from pipelines.canary import lake_pools

        since_ns = None if since_s is None else time.time_ns() - int(since_s * 1e9)
        return lake_pools(_config(ctx).lake.root, baseline_pool, candidate_pool, since_ns, None, _config(ctx).lake)
    if baseline is None or candidate is None:
        raise ServelensError("--baseline and --candidate are both needed", "or use --live to judge two pools of the lake")
    limit = _config(ctx).lake.duckdb_memory_limit
    return load_run(baseline, "baseline", memory_limit=limit), load_run(candidate, "candidate", memory_limit=limit)


# ---------------------------------------------------------------------------------------------- demo


@cli.command()
@click.option("--trace", "trace_name", default="azure-conv", show_default=True, help="Bundled trace name or trace file.")
@click.option(
    "--out", type=OUT_FOLDER, default=None,
    help="Demo folder, emptied first (the demo key is kept); a folder with files that is not a demo's is refused "
         "[default: <out_dir>/demo].",
)
@click.option("--candidates", default=None,
              help="Comma-separated candidate policies judged against nightly.production [default: sarathi,vtc,deadline].")
@click.option("--loads", default=None, help="Comma-separated load scenarios [default: 1x,2x].")
@click.option("--speedup", type=Finite(min=0, min_open=True), default=100.0, show_default=True,
              help="Emit the engine fleet's events this many times faster than recorded (bursts kept).")
@click.option("--requests", "num_requests", type=Count(100, MAX_REPLAY_REQUESTS), default=None,
              help="Only the trace's first N requests (a quicker look; at most 1,000,000,000) [default: all].")
@click.option("--serve/--no-serve", default=True, show_default=True,
              help="Serve the dashboard after the summary until Ctrl-C (--no-serve: print the summary and exit).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Dashboard port [default: dashboard.port if free, else any free one].")
@click.pass_context
def demo(ctx: click.Context, trace_name: str, out: Path | None, candidates: str | None, loads: str | None, speedup: float,
         num_requests: int | None, serve: bool, port: int | None) -> None:
    """The whole path on this machine, offline: engine events to a canary verdict and the dashboard.

    A local broker; a replay of the trace under the production policy plays the engine fleet and
    emits its events through the emitter SDK (time-accelerated, bursts kept); the ingest consumer
    sanitizes and stores them; the Dagster asset graph derives the tables and replays each candidate
    at each load; the gate judges each against production; the dashboard serves the results. Ctrl-C
    stops everything; running it again starts from an empty demo folder.

    \b
    Example:
      servelens demo                                  # then open the printed URL
      servelens demo --requests 2000 --candidates sarathi,vtc --loads 1x --no-serve
    """
    from servelens.demo import DEMO_CANDIDATES, DEMO_LOADS, render_summary, run_demo, serve_demo

    if speedup <= 0:
        raise ServelensError(f"--speedup must be positive, got {speedup:g}", "for example --speedup 100")
    config = _config(ctx)
    out = out or Path(config.paths.out_dir) / "demo"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds: the local broker and the ingest stop with it
    result = run_demo(
        trace_name,
        _shared_or_none(ctx, trace_name),
        out,
        config,
        candidates=_names(candidates) if candidates else DEMO_CANDIDATES,
        loads=_names(loads) if loads else DEMO_LOADS,
        speedup=speedup,
        num_requests=num_requests,
        progress=lambda line: click.echo(line, err=True),
    )
    if not serve:
        click.echo(render_summary(result))
        return
    click.echo("starting the dashboard", err=True)
    process, url = serve_demo(config, out, port)
    try:
        click.echo(render_summary(result, url))
        click.echo(f"the dashboard serves at {url} until Ctrl-C")
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        _stop(process)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _stop(process) -> None:
    """Terminate a child server and wait for it (kill it if it does not go within 20 s)."""
    import subprocess

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


# ---------------------------------------------------------------------------------------------- dashboard


def _dashboard_host(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--host as given, once it is a name or address this machine resolves (an empty one would listen on
    every interface)."""
    import socket

    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("must not be empty (an empty host listens on every interface)",
                                 ctx, param)
    try:
        socket.getaddrinfo(value, None)
    except (socket.gaierror, UnicodeError) as exc:
        message = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise click.BadParameter(f"{value!r} does not resolve to an address ({message}); give a host name or "
                                 "an IP address of this machine, e.g. 127.0.0.1 (loopback, the default)",
                                 ctx, param) from None
    return value


@cli.command("dashboard")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port to listen on; 0 picks a free one [default: dashboard.port, 8501].")
@click.option("--host", default=None, callback=_dashboard_host,
              help="Address to bind [default: dashboard.host, 127.0.0.1]. There is no login: keep it on loopback.")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
              help="Replay runs, searched three levels deep [default: dashboard.runs_dir, else <out_dir>/replay].")
@click.option("--gate-dir", type=click.Path(file_okay=False), default=None,
              help="Gate reports, likewise [default: dashboard.gate_dir, else <out_dir>/gate].")
@click.pass_context
def dashboard_command(ctx: click.Context, port: int | None, host: str | None, runs_dir: str | None,
                      gate_dir: str | None) -> None:
    """Serve the dashboard (Streamlit + plotly) over the lake, replay runs and gate reports.

    It reads only the lake (lake.root), run folders and gate reports; the viewer's tenant is
    dashboard.viewer_tenant, never the URL (docs/dashboard.md). It prints its URL and runs until
    Ctrl-C. With an empty lake every page says which commands fill it.

    \b
    Example:
      servelens dashboard                          # http://127.0.0.1:8501
      servelens dashboard --port 0 --runs-dir out/demo/out/replay   # a free port; the demo's replays
    """
    import dataclasses
    import subprocess

    from dashboard.config import settings_from_config
    from dashboard.server import dashboard_url, preflight, resolved, serve, wait_until_ready

    for flag, folder, writer in (("--runs-dir", runs_dir, "replay"), ("--gate-dir", gate_dir, "gate")):
        if folder is not None and not os.path.isdir(folder):  # a typo would show no runs, as if none were made
            raise ServelensError(f"{flag} {shown(folder, SHOWN_PATH_CHARS)} does not exist",
                                 f"give the folder `servelens {writer} --out` wrote (or one above it: it is searched "
                                 f"three levels deep), or leave {flag} out for dashboard.{flag[2:].replace('-', '_')}")
    config = _config(ctx)
    overrides = {"port": port, "host": host, "runs_dir": runs_dir, "gate_dir": gate_dir}
    section = dataclasses.replace(config.dashboard, **{k: v for k, v in overrides.items() if v is not None})
    for warning in preflight(resolved(settings_from_config(config, section))):
        click.secho(f"warning: {warning}", err=True, fg="yellow")
    process = serve(config, dashboard=section, stdout=subprocess.DEVNULL)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        url = dashboard_url(process)
        wait_until_ready(url, 120, process)
        click.echo(f"servelens dashboard at {url} (Ctrl-C stops it)")
        status = process.wait()
        if status not in (0, -signal.SIGTERM, -signal.SIGINT):  # uvicorn stops gracefully, then re-raises the signal
            _fail(f"the dashboard exited with status {status}", "its messages are above")
    except KeyboardInterrupt:
        pass
    finally:
        _stop(process)


for _command in FIDELITY_COMMANDS:  # servelens fidelity, servelens calibrate (servelens/fidelity_cli.py)
    cli.add_command(_command)


def main() -> None:
    """Console-script entry point (usage errors exit 3, like every error, so that 2 stays the gate's
    "inconclusive")."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_ERROR)
