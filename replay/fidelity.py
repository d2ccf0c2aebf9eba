"""How faithful the replay is: recorded runs replayed under their recorded settings, latencies compared.

A *fidelity experiment* is a real run with what is needed to replay it: the model, accelerators and
engine settings, the workload (an inference-perf spec, ``replay.inference_perf``) and the measured
client-side latencies. ``read_experiments`` reads the fidelity data's ``experiments.csv`` (vLLM
v0.15.1 on H100, measured with inference-perf: ``../shared/fidelity/README.md``);
``replay_experiment`` replays one and measures the replay the way the client measured the run:

- TTFT: first byte received - request sent; E2E: last byte received - request sent (client side,
  ``replay.config.FrontendConfig``), over completed requests;
- ITL as the fidelity data defines it: (mean E2E - mean TTFT) / (mean output tokens - 1), a ratio of
  means (the fidelity data has no per-token gaps), over the output tokens as the client counted them
  (``output_count_ratio``);
- mean, p50, p90 and p99 (numpy's linear interpolation, as inference-perf).

``compare`` turns recorded and replayed figures into signed and absolute percentage errors per
experiment and the median absolute error across experiments per metric, the field's summary
(``docs/calibration.md``, Fidelity). Reports: ``fidelity_report_*`` (JSON, Markdown, HTML).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replay.catalog import resolve_instance
from replay.config import EngineConfig, InstanceConfig, accelerator
from replay.errors import ReplayError
from replay.inference_perf import InferencePerfSpec, LoadStage, inference_perf_workload, read_inference_perf
from replay.load import Load
from replay.metrics import itl_ratio_of_means
from schemas.validate import read_parquet_schema, read_parquet_table
from servelens.errors import DataNotFoundError, ServelensError

#: The metrics the fidelity data records (whole-run values), in its order.
RECORDED_METRICS = ("e2e_mean", "e2e_p90", "e2e_p99", "ttft_mean", "ttft_p90", "ttft_p99", "itl_mean")
#: Every metric a replay reports (the recorded ones and the medians).
METRICS = ("e2e_mean", "e2e_p50", "e2e_p90", "e2e_p99", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "itl_mean")
FIDELITY_DIR = Path("fidelity")


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelityExperiment:
    """A recorded run and the settings to replay it (one row of the fidelity data's experiments.csv)."""

    id: str
    model: str  # a Hugging Face id of the model table, a preset, or a config.json path
    accelerator: str
    tensor_parallel_size: int
    precision: str  # FP16 / FP8 as recorded
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int | None
    cpu_kv_blocks: int
    profile: str
    workload_path: Path
    #: the mean output length as the client counted it (the fidelity data's ``derived_mean_output_tokens``): the
    #: denominator of its recorded ITL; None: the length the engine generated (``output_count_ratio``)
    counted_output_tokens: float | None
    recorded: tuple[tuple[str, float], ...]  # metric -> seconds
    #: per load stage of a run of several (stages.csv): (stage index, its metric -> seconds)
    recorded_stages: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = ()
    source: Path | None = None  # the experiments.csv it was read from

    @property
    def recorded_s(self) -> dict[str, float]:
        return dict(self.recorded)

    @property
    def where(self) -> str:
        """Where it was recorded, for an error: its experiments.csv and id."""
        return f"{self.source} row {self.id}" if self.source is not None else f"experiment {self.id}"

    def label(self) -> str:
        return f"{self.id} {self.model.rsplit('/', 1)[-1]} tp{self.tensor_parallel_size} {self.profile}"


#: The precisions the fidelity data records (its README): FP8 serves the weights in fp8 (vLLM's --quantization
#: fp8), FP16 in the checkpoint's own 16-bit dtype. A table without the column is FP16.
PRECISIONS = ("FP16", "FP8")
#: The fidelity data's GPU labels (its README: H100 is H100 80GB SXM); any accelerator preset is also taken.
GPU_LABELS = {"H100": "h100-sxm", "A100": "a100-80g", "L40S": "l40s"}
#: The columns every experiments.csv row needs. Not read (and so not checked): folder, split, vllm_version,
#: cpu_offload (cpu_kv_blocks is its capacity), gpu_mem_util (total_kv_blocks is the pool it gave), prefix_caching,
#: num_stages (the workload's stages are), spec_output_len (the workload's output_len is), notes.
_EXPERIMENT_COLUMNS = ("id", "model", "gpu", "tp", "max_num_seqs", "max_num_batched_tokens", "profile")
_EXPERIMENTS_HINT = "the fidelity data's experiments.csv: a header line, then one row per run (see its README)"
_STAGES_HINT = ("stages.csv: a header with id, stage_index and the metrics' _ms columns, then one row per run and "
                "stage; remove the file when no run was recorded stage by stage")


def read_experiments(folder: Path) -> list[FidelityExperiment]:
    """The measured experiments of a fidelity folder (``experiments.csv``, ``workloads/<profile>.yaml`` and,
    optional, ``stages.csv``). Every cell the replay reads is checked: an error names the file, the run's id
    (or the line) and the column. The models are those of the folder's ``models.csv`` where it has one, else of
    the shared data's ``fidelity/models.csv`` (``experiment_instance``)."""
    path = folder / "experiments.csv"
    if not path.is_file():
        raise DataNotFoundError(f"no fidelity experiments at {path}",
                                "set the shared data folder (SERVELENS_SHARED_DIR) or give --data FOLDER")
    stages_path = folder / "stages.csv"
    stages = _stages(stages_path) if stages_path.exists() else {}
    seen: dict[Any, int] = {}
    out = []
    for line, row in _csv_rows(path, _EXPERIMENT_COLUMNS, _EXPERIMENTS_HINT):
        where = f"{path} row {row['id']}" if row["id"].strip() else f"{path} line {line}"
        _once(seen, _text(row, "id", where), f"id {row['id']!r}", path, line)
        if _measured(row, where):
            exp = _experiment(row, folder, where)
            out.append(_with_stages(exp, stages.get(exp.id, []), stages_path))
    if not out:
        raise ReplayError(f"{path} records no measured run (no row has has_measurements yes)",
                          "add the measured runs, with has_measurements yes and their _ms columns")
    return out


def _csv_rows(path: Path, required: tuple[str, ...], hint: str) -> list[tuple[int, dict[str, str]]]:
    """The rows of the CSV file ``path`` with their line numbers (a UTF-8 byte-order mark, as spreadsheets write,
    is taken); an error naming the file when it is not UTF-8 CSV text, is empty, lacks a ``required`` column or
    every metric column, gives a column twice, has no rows, or has a row of more or fewer cells than its header."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            rows = [(reader.line_num, row) for row in reader]
            columns = list(reader.fieldnames or ())
    except UnicodeDecodeError as exc:
        raise ReplayError(f"{path} is not a CSV file: not UTF-8 text (byte {exc.start})", hint) from None
    except (csv.Error, OSError) as exc:
        raise ReplayError(f"{path} is not a readable CSV file: {exc}", hint) from None
    if not columns:
        raise ReplayError(f"{path} is empty", hint)
    missing = [c for c in required if c not in columns]
    if missing or not any(f"{m}_ms" in columns for m in RECORDED_METRICS):
        absent = ", ".join(map(repr, missing)) or "of the metrics (" + ", ".join(f"{m}_ms" for m in RECORDED_METRICS) + ")"
        raise ReplayError(f"{path}: no column {absent}", hint)
    twice = next((c for c in columns if columns.count(c) > 1), None)
    if twice is not None:
        raise ReplayError(f"{path}: the header gives column {twice!r} twice", hint)
    if not rows:
        raise ReplayError(f"{path} has a header but no rows", hint)
    for line, row in rows:
        if None in row or None in row.values():
            cells = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or ())
            raise ReplayError(f"{path} line {line} (id {row.get('id')!r}): {cells} cells, but the header has "
                              f"{len(columns)}",
                              "give every row one cell per column (quote a cell that holds a comma)")
    return rows


def _once(seen: dict[Any, int], key: Any, what: str, path: Path, line: int) -> None:
    """An error when ``key`` was seen on an earlier line of ``path`` (``seen``: key -> line)."""
    if key in seen:
        raise ReplayError(f"{path} line {line}: {what} is given twice (also line {seen[key]})",
                          "keep one of the two rows, or give the other its own id")
    seen[key] = line


def _text(row: dict[str, str], column: str, where: str) -> str:
    """The row's ``column``, stripped; an error when it is empty."""
    text = row[column].strip()
    if not text:
        raise ReplayError(f"{where}: the {column} column is empty",
                          f"fill in the run's {column} (the fidelity data's README describes each column)")
    return text


def _read_cell(row: dict[str, str], column: str, where: str, kind: type[int] | type[float] = int, *,
               required: bool = True) -> Any:
    """The row's ``column`` as ``kind`` (int: a whole number); None when empty and not ``required``; an error
    naming the column otherwise."""
    text = (row.get(column) or "").strip()
    if not text and not required:
        return None
    try:
        return kind(_text(row, column, where))
    except ValueError:
        expected = "a whole number" if kind is int else "a number"
        raise ReplayError(f"{where}: {column} {text!r} is not {expected}",
                          f"write {column} as {expected}, as the run's server log or client report gives it") from None


def _measured(row: dict[str, str], where: str) -> bool:
    """Whether the row has measurements (``has_measurements`` yes; a table without the column: every row)."""
    value = row.get("has_measurements", "yes").strip()
    if value not in ("yes", "no"):
        raise ReplayError(f"{where}: has_measurements {value!r} is not yes or no",
                          "yes: the run's _ms columns are its measured latencies; no: the row is not replayed")
    return value == "yes"


def _stages(path: Path) -> dict[str, list[tuple[int, int, tuple[tuple[str, float], ...]]]]:
    """Per run id, its stages.csv rows of load stages: (line, stage index, recorded metrics in seconds); the
    whole run's rows (stage_index -1) are checked and left out."""
    by_id: dict[str, list[tuple[int, int, tuple[tuple[str, float], ...]]]] = {}
    seen: dict[Any, int] = {}
    for line, row in _csv_rows(path, ("id", "stage_index"), _STAGES_HINT):
        where = f"{path} line {line}"
        run, index = _text(row, "id", where), _read_cell(row, "stage_index", where)
        if index < -1:
            raise ReplayError(f"{where}: stage_index {index} is not a stage",
                              "-1 is the whole run, 0, 1, ... its load stages in order")
        _once(seen, (run, index), f"run {run!r} stage_index {index}", path, line)
        values = _recorded(row, where)
        if index >= 0:
            by_id.setdefault(run, []).append((line, index, values))
    return by_id


def _with_stages(exp: FidelityExperiment, stages: list[tuple[int, int, tuple[tuple[str, float], ...]]],
                 path: Path) -> FidelityExperiment:
    """``exp`` with its recorded load stages when it ran several; a stage its workload does not have is an error."""
    if not stages:
        return exp
    count = len(_spec(exp).stages)
    for line, index, _ in stages:
        if index >= count:
            raise ReplayError(f"{path} line {line}: stage_index {index} of run {exp.id}, whose workload "
                              f"{exp.workload_path} has {count} load stage(s)",
                              f"its stages are 0 to {count - 1} (-1: the whole run); check the id and the run's profile")
    if len(stages) < 2:
        return exp
    return dataclasses.replace(exp, recorded_stages=tuple(sorted((index, values) for _, index, values in stages)))


#: How far a counted mean output length may exceed the generated one (a fraction): the client counts by tokenizing
#: the streamed text again, which can split a piece the engine generated whole; the fidelity data's run 65 counts
#: 248.2 tokens of 248 generated (+0.08%). A column of another quantity (characters, a total) is off by far more.
COUNTED_OUTPUT_TOLERANCE = 0.02
#: A measured latency above this many milliseconds (about 11.6 days) is not one.
_MAX_MS = 1e9


def _recorded(row: dict[str, str], where: str) -> tuple[tuple[str, float], ...]:
    """The row's measured metrics, seconds: each a finite latency above zero (a NaN or a negative mean was
    taken and reported as a 'nan%' or 92,404% error)."""
    out = []
    for m in RECORDED_METRICS:
        value = _read_cell(row, f"{m}_ms", where, float, required=False)
        if value is None:
            continue
        if not 0 < value < _MAX_MS:
            raise ReplayError(f"{where}: {m}_ms {row[f'{m}_ms']!r} is not a measured latency",
                              f"a latency is a finite number of milliseconds above 0 (below {_MAX_MS:g}); "
                              "leave the cell empty where it was not measured")
        out.append((m, value / 1e3))
    _check_e2e_after_ttft(dict(out), where)
    return tuple(out)


def _check_e2e_after_ttft(recorded: dict[str, float], where: str) -> None:
    """E2E is at least TTFT: per request the last byte comes no sooner than the first, and so does every mean
    and percentile of them (a percentile of values each no smaller is no smaller)."""
    for stat in ("mean", "p90", "p99"):
        e2e, ttft = recorded.get(f"e2e_{stat}"), recorded.get(f"ttft_{stat}")
        if e2e is not None and ttft is not None and e2e < ttft:
            raise ReplayError(f"{where}: e2e_{stat}_ms {e2e * 1e3:g} is below ttft_{stat}_ms {ttft * 1e3:g}, but a "
                              "response's last byte comes no sooner than its first",
                              f"check the two columns (swapped, or in other units?): E2E {stat} is at least TTFT {stat}")


def _experiment(row: dict[str, str], folder: Path, where: str) -> FidelityExperiment:
    """The experiment of a measured experiments.csv row, every cell it reads checked."""
    profile = _text(row, "profile", where)
    exp = FidelityExperiment(
        id=_text(row, "id", where),
        model=_text(row, "model", where),
        accelerator=_accelerator_name(_text(row, "gpu", where), where),
        tensor_parallel_size=_read_cell(row, "tp", where),
        precision=_precision(row, where),
        max_num_seqs=_read_cell(row, "max_num_seqs", where),
        max_num_batched_tokens=_read_cell(row, "max_num_batched_tokens", where),
        num_gpu_blocks=_read_cell(row, "total_kv_blocks", where, required=False),
        cpu_kv_blocks=_read_cell(row, "cpu_kv_blocks", where, required=False) or 0,
        profile=profile,
        workload_path=folder / "workloads" / f"{profile}.yaml",
        counted_output_tokens=_read_cell(row, "derived_mean_output_tokens", where, float, required=False),
        recorded=_recorded(row, where),
        source=folder / "experiments.csv",
    )
    _check_settings(exp, where)
    return exp


def _precision(row: dict[str, str], where: str) -> str:
    """The row's precision, one of ``PRECISIONS`` (upper case); FP16 in a table without the column."""
    if "precision" not in row:
        return "FP16"
    precision = _text(row, "precision", where).upper()
    if precision not in PRECISIONS:
        raise ReplayError(f"{where}: precision {row['precision']!r} is not one the replay models",
                          f"valid: {', '.join(PRECISIONS)} (FP8: fp8 weights, FP16: the checkpoint's 16-bit dtype)")
    return precision


def _check_settings(exp: FidelityExperiment, where: str) -> None:
    """A recorded run's settings are ones vLLM started with: counts of at least one, a step budget no
    smaller than the batch, a counted output length above zero, and at least one measured latency."""
    counts = [("tp", exp.tensor_parallel_size, 1), ("max_num_seqs", exp.max_num_seqs, 1),
              ("max_num_batched_tokens", exp.max_num_batched_tokens, 1), ("cpu_kv_blocks", exp.cpu_kv_blocks, 0)]
    if exp.num_gpu_blocks is not None:
        counts.append(("total_kv_blocks", exp.num_gpu_blocks, 1))
    for column, value, least in counts:
        if value < least:
            raise ReplayError(f"{where}: {column} must be at least {least}, not {value}",
                              "copy the run's settings from its server log (vLLM starts with none smaller)")
    if exp.max_num_batched_tokens < exp.max_num_seqs:
        raise ReplayError(f"{where}: max_num_batched_tokens {exp.max_num_batched_tokens} is below max_num_seqs "
                          f"{exp.max_num_seqs}, which vLLM refuses to start with",
                          "copy the run's settings from its server log")
    counted = exp.counted_output_tokens
    if counted is not None and not 1 <= counted < float("inf"):
        raise ReplayError(f"{where}: derived_mean_output_tokens {counted} is not a mean output length",
                          "a response the client timed has at least one token: give a finite mean of at least 1 "
                          "token, or leave the cell empty (the engine's own count)")
    if not exp.recorded:
        raise ReplayError(f"{where}: has_measurements is yes, but no _ms column has a latency",
                          "fill in the run's measured latencies, or set has_measurements to no")


def _accelerator_name(gpu: str, where: str) -> str:
    """The row's GPU label as an accelerator preset (``GPU_LABELS``, else a preset's own name)."""
    name = GPU_LABELS.get(gpu, gpu.lower())
    try:
        accelerator(name)
    except ReplayError as exc:
        raise ReplayError(f"{where}: gpu {gpu!r} is not an accelerator the replay knows",
                          f"the fidelity data's labels: {', '.join(GPU_LABELS)}; or a preset's name ({exc.hint})") from None
    return name


def _spec(exp: FidelityExperiment) -> InferencePerfSpec:
    """The experiment's workload spec as written; an error names the experiment's row and its profile."""
    with _located(f"{exp.where} (profile {exp.profile!r})"):
        return read_inference_perf(exp.workload_path)


@contextmanager
def _located(where: str) -> Iterator[None]:
    """A ``ServelensError`` raised inside, with ``where`` (the row it concerns) before its message."""
    try:
        yield
    except ServelensError as exc:
        raise type(exc)(f"{where}: {exc.message}", exc.hint) from None


def experiment_instance(exp: FidelityExperiment, shared: Path | None, engine: EngineConfig | None = None,
                        **engine_changes: Any) -> InstanceConfig:
    """The instance the experiment ran: its model, accelerators and recorded vLLM settings (KV blocks as
    measured, CPU KV offload capacity as configured); ``engine`` gives the other engine settings."""
    base = engine or EngineConfig()
    engine = dataclasses.replace(
        base,
        max_num_seqs=exp.max_num_seqs,
        max_num_batched_tokens=exp.max_num_batched_tokens,
        num_kv_blocks_override=exp.num_gpu_blocks,
        **engine_changes,
    )
    table = exp.source.parent / "models.csv" if exp.source is not None else None
    with _located(exp.where):
        instance = resolve_instance(f"{exp.model}@{exp.accelerator}x{exp.tensor_parallel_size}", engine, shared,
                                    weight_dtype="fp8" if exp.precision.upper() == "FP8" else None,
                                    models_table=table if table is not None and table.is_file() else None)
    if exp.cpu_kv_blocks:  # recorded in blocks of the model's size
        kv_block = instance.model.kv_bytes_per_token * instance.engine.block_size_tokens
        instance = dataclasses.replace(
            instance, engine=dataclasses.replace(instance.engine, cpu_kv_offload_bytes=exp.cpu_kv_blocks * kv_block)
        )
    return instance


def stage_starts_s(spec: InferencePerfSpec) -> list[float]:
    """When each load stage of ``spec`` begins, seconds from the first arrival's stage start."""
    starts, t = [], 0.0
    for stage in spec.stages:
        starts.append(t)
        t += stage.duration_s
    return starts


def experiment_spec(exp: FidelityExperiment, max_stage_s: float | None = None) -> InferencePerfSpec:
    """The experiment's workload spec; ``max_stage_s`` shortens each stage (a faster, noisier replay)."""
    spec = _spec(exp)
    if max_stage_s is None:
        return spec
    stages = tuple(LoadStage(s.rate_per_s, min(s.duration_s, max(max_stage_s, 600 / s.rate_per_s))) for s in spec.stages)
    return dataclasses.replace(spec, stages=stages)


def experiment_workload(exp: FidelityExperiment, seed: int = 0, max_stage_s: float | None = None) -> pa.Table:
    """The experiment's workload: its spec's arrivals and prompts, and outputs of the spec's length.

    inference-perf asks the engine to ignore end-of-sequence tokens (``ignore_eos``, its default), so every
    request generates its ``max_tokens``, whatever the model would have said; what the client *counts* is
    another matter (``output_count_ratio``).
    """
    return inference_perf_workload(experiment_spec(exp, max_stage_s), seed)


def output_count_ratio(exp: FidelityExperiment) -> float:
    """Output tokens the client counted per token the engine generated.

    inference-perf counts a response's tokens by tokenizing its streamed text again, not by the engine's
    count, and the recorded ITL divides by that count: (mean E2E - mean TTFT) / (mean counted tokens - 1).
    Text does not always tokenize back to the tokens it was decoded from (special tokens are dropped from the
    text, byte pieces merge): the fidelity data's Llama-2-7B (a base model, generating past its end of
    sequence) counts 0.79 of the tokens it generated on codegen and 0.77 on reasoning-lite, the instruct
    models 0.98-1.0. A replay's ITL is computed over its generated tokens times this ratio, as the client's.
    """
    if exp.counted_output_tokens is None:
        return 1.0
    generated = _spec(exp).output_tokens.mean
    if exp.counted_output_tokens > generated * (1 + COUNTED_OUTPUT_TOLERANCE):
        raise ReplayError(
            f"{exp.where}: derived_mean_output_tokens {exp.counted_output_tokens:g} is more than the "
            f"{generated:g} output tokens its workload {exp.workload_path} asks for (output_len): the client counts "
            "what it received, which cannot exceed what the engine generated",
            f"give the mean output tokens the client counted (at most {generated:g}), or check the run's profile")
    return exp.counted_output_tokens / generated


# ---------------------------------------------------------------------------------------------- measuring


class RequestTimes:
    """A replay sink that keeps each request's client- and engine-side times (the events are not kept)."""

    _COLUMNS = ("event_type", "request_id", "ts_ns", "client_sent_ns", "first_byte_ns", "last_byte_ns", "outcome",
                "num_output_tokens", "num_prompt_tokens")
    _TYPES = pa.array(["request_arrived", "first_token", "request_finished"])
    digest = False  # the replay need not hash events it only hands here

    def __init__(self) -> None:
        self._parts: list[pa.Table] = []

    def __call__(self, table: pa.Table) -> None:
        keep = pc.is_in(table["event_type"], self._TYPES)
        self._parts.append(table.filter(keep).select(list(self._COLUMNS)))

    def latencies(self) -> dict[str, np.ndarray]:
        """Per completed request (in request-id order): ``ttft_s``, ``e2e_s`` (client side where the replay
        modelled the client, else engine side), ``num_output_tokens`` and ``num_prompt_tokens``."""
        t = pa.concat_tables(self._parts)
        arrived = _by_request(t, "request_arrived", ("ts_ns", "client_sent_ns", "num_prompt_tokens"))
        first = _by_request(t, "first_token", ("ts_ns", "first_byte_ns"))
        done = _by_request(t, "request_finished", ("ts_ns", "last_byte_ns", "outcome", "num_output_tokens"))
        done = done.filter(pc.equal(done["outcome"], "completed"))
        joined = done.join(first, "request_id", right_suffix="_first").join(arrived, "request_id", right_suffix="_arr")
        joined = joined.sort_by("request_id")
        client = joined["client_sent_ns"].null_count == 0 and joined["first_byte_ns"].null_count == 0
        start = joined["client_sent_ns" if client else "ts_ns_arr"].to_numpy()
        first_ns = joined["first_byte_ns" if client else "ts_ns_first"].to_numpy()
        last_ns = joined["last_byte_ns" if client else "ts_ns"].to_numpy()
        return {
            "start_s": start / 1e9,
            "ttft_s": (first_ns - start) / 1e9,
            "e2e_s": (last_ns - start) / 1e9,
            "num_output_tokens": joined["num_output_tokens"].to_numpy().astype(np.float64),
            "num_prompt_tokens": joined["num_prompt_tokens"].to_numpy().astype(np.float64),
            "request_id": np.array(joined["request_id"].to_pylist(), dtype=object),
            "client_side": np.array(client),
        }


def latencies_of_events(path: str | Path) -> dict[str, np.ndarray]:
    """``RequestTimes.latencies`` of an events Parquet file (only the columns it needs are read)."""
    times = RequestTimes()
    columns = [c for c in RequestTimes._COLUMNS if c in read_parquet_schema(path).names]
    table = read_parquet_table(path, columns=columns, filters=[("event_type", "in", list(RequestTimes._TYPES.to_pylist()))])
    for c in RequestTimes._COLUMNS:
        if c not in table.column_names:
            table = table.append_column(c, pa.nulls(table.num_rows, pa.int64()))
    times(table)
    return times.latencies()


def _by_request(t: pa.Table, event_type: str, columns: tuple[str, ...]) -> pa.Table:
    return t.filter(pc.equal(t["event_type"], event_type)).select(["request_id", *columns])


def summarize(ttft_s: np.ndarray, e2e_s: np.ndarray, num_output_tokens: np.ndarray) -> dict[str, float]:
    """Mean and percentiles of TTFT and E2E, and ITL as a ratio of means (the fidelity data's definition)."""
    if len(ttft_s) == 0:
        raise ReplayError("no request completed in the replay: there is nothing to compare")
    out = {}
    for name, values in (("ttft", ttft_s), ("e2e", e2e_s)):
        out[f"{name}_mean"] = float(values.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(values, q))
    out["itl_mean"] = itl_ratio_of_means(out["ttft_mean"], out["e2e_mean"], float(num_output_tokens.mean()))
    return out


# ---------------------------------------------------------------------------------------------- comparing


@dataclass(frozen=True, slots=True)
class MetricError:
    """One metric of one experiment: recorded and replayed (seconds) and the error of the replay."""

    experiment: str
    metric: str
    recorded_s: float
    replayed_s: float

    @property
    def signed_pct(self) -> float:
        return (self.replayed_s - self.recorded_s) / abs(self.recorded_s) * 100.0

    @property
    def abs_pct(self) -> float:
        return abs(self.signed_pct)


def compare(experiment: str, recorded: dict[str, float], replayed: dict[str, float]) -> list[MetricError]:
    """The errors of every metric both sides have."""
    return [MetricError(experiment, m, recorded[m], replayed[m]) for m in METRICS if m in recorded and m in replayed]


def median_abs_error(errors: Sequence[MetricError]) -> dict[str, float]:
    """Per metric, the median across experiments of the absolute percentage error (the field's metric)."""
    by_metric: dict[str, list[float]] = {}
    for e in errors:
        by_metric.setdefault(e.metric, []).append(e.abs_pct)
    return {m: float(np.median(v)) for m, v in by_metric.items() if v}


def median_signed_error(errors: Sequence[MetricError]) -> dict[str, float]:
    """Per metric, the median signed percentage error (the bias)."""
    by_metric: dict[str, list[float]] = {}
    for e in errors:
        by_metric.setdefault(e.metric, []).append(e.signed_pct)
    return {m: float(np.median(v)) for m, v in by_metric.items() if v}


# ---------------------------------------------------------------------------------------------- reports


@dataclass(frozen=True, slots=True)
class FidelityReport:
    """Recorded against replayed, per experiment, and the medians across experiments."""

    calibration: str  # what the replay's cost model was (a calibration name, or a cost model)
    errors: tuple[MetricError, ...]
    labels: tuple[tuple[str, str], ...]  # experiment id -> label
    notes: tuple[str, ...] = ()
    loads: tuple[tuple[str, Load], ...] = ()  # experiment id -> the replay's busiest minute (replay.load)
    fitted_load: Load | None = None  # the calibration's: a replay beyond it extrapolates
    #: per load stage of the runs recorded stage by stage (stage index, error): not in the medians (the field's
    #: metric is the whole run's), they show where in a run the replay departs from it
    stage_errors: tuple[tuple[int, MetricError], ...] = ()

    def beyond_fitted(self, load: Load) -> bool:
        """``load`` lies beyond the calibration's fitted load (never, when it records none)."""
        return self.fitted_load is not None and load.beyond(self.fitted_load)

    def load_cell(self, experiment: str) -> str:
        """An experiment's replayed load in words (decode batch / KV pool), marked where beyond the fitted load."""
        load = dict(self.loads).get(experiment)
        if load is None:
            return ""
        return f"{load.batch_share:.0%} / {load.kv_share:.0%}" + (" beyond fitted" if self.beyond_fitted(load) else "")

    @property
    def median_abs_error_pct(self) -> dict[str, float]:
        return median_abs_error(self.errors)

    @property
    def median_signed_error_pct(self) -> dict[str, float]:
        return median_signed_error(self.errors)

    def experiments(self) -> list[str]:
        return list(dict.fromkeys(e.experiment for e in self.errors))

    def as_json(self) -> dict[str, Any]:
        rows: dict[str, dict[str, Any]] = {}
        for e in self.errors:
            row = rows.setdefault(e.experiment, {"label": dict(self.labels).get(e.experiment, e.experiment)})
            row[e.metric] = _error_json(e)
        for experiment, load in self.loads:
            rows.setdefault(experiment, {})["load"] = {
                **load.as_json(), "beyond_fitted": self.beyond_fitted(load)}
        for index, e in self.stage_errors:
            stage = rows.setdefault(e.experiment, {}).setdefault("stages", {}).setdefault(str(index), {})
            stage[e.metric] = _error_json(e)
        return {
            "calibration": self.calibration,
            "median_abs_error_pct": {k: round(v, 3) for k, v in self.median_abs_error_pct.items()},
            "median_signed_error_pct": {k: round(v, 3) for k, v in self.median_signed_error_pct.items()},
            "experiments": rows,
            "fitted_load": self.fitted_load.as_json() if self.fitted_load is not None else None,
            "notes": list(self.notes),
        }


def _error_json(e: MetricError) -> dict[str, float]:
    return {"recorded_s": e.recorded_s, "replayed_s": e.replayed_s, "signed_error_pct": round(e.signed_pct, 3),
            "abs_error_pct": round(e.abs_pct, 3)}


def stage_errors(experiment: str, recorded_stages: Sequence[tuple[int, Sequence[tuple[str, float]]]],
                 replayed_stages: dict[int, dict[str, float]]) -> list[tuple[int, MetricError]]:
    """The errors of each load stage both sides have (``FidelityReport.stage_errors``)."""
    return [(index, e) for index, recorded in recorded_stages if index in replayed_stages
            for e in compare(experiment, dict(recorded), replayed_stages[index])]


def _cell(e: MetricError | None) -> str:
    """Replayed / recorded (ms) and the signed error."""
    return "" if e is None else f"{e.replayed_s * 1e3:,.1f} / {e.recorded_s * 1e3:,.1f} ({e.signed_pct:+.1f}%)"


def report_markdown(report: FidelityReport) -> str:
    """The report as Markdown: the medians first, then one row per experiment (signed errors)."""
    metrics = [m for m in METRICS if m in report.median_abs_error_pct]
    lines = [f"# servelens fidelity: replay against recorded runs ({report.calibration})", ""]
    lines += ["Median absolute error across experiments (signed median, the bias, in brackets):", ""]
    lines += ["| metric | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)]
    mae, bias = report.median_abs_error_pct, report.median_signed_error_pct
    lines.append("| median abs error | " + " | ".join(f"{mae[m]:.1f}% ({bias[m]:+.1f}%)" for m in metrics) + " |")
    lines += ["", "Per experiment, replayed vs recorded (ms) and the signed error; the replay's busiest minute (share of "
              "max_num_seqs decoding / of the KV pool in use"
              + (f"; the calibration's fitted runs reached {report.fitted_load.batch_share:.0%} / "
                 f"{report.fitted_load.kv_share:.0%}" if report.fitted_load is not None else "") + "):", ""]
    lines += ["| experiment | " + " | ".join(metrics) + " | load |", "|---|" + "---:|" * (len(metrics) + 1)]
    labels = dict(report.labels)
    cells: dict[str, dict[str, MetricError]] = {}
    for e in report.errors:
        cells.setdefault(e.experiment, {})[e.metric] = e
    for exp, row in cells.items():
        values = [_cell(row.get(m)) for m in metrics]
        lines.append(f"| {labels.get(exp, exp)} | " + " | ".join(values) + f" | {report.load_cell(exp)} |")
    lines += _stage_lines(report, metrics)
    lines += [""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def _stage_lines(report: FidelityReport, metrics: list[str]) -> list[str]:
    """The per-stage table of the runs recorded stage by stage (none without them)."""
    if not report.stage_errors:
        return []
    lines = ["", "Per load stage, of the runs recorded stage by stage (not in the medians: where in a run the replay "
             "departs from it), replayed vs recorded (ms) and the signed error:", ""]
    lines += ["| experiment | stage | " + " | ".join(metrics) + " |", "|---|---:|" + "---:|" * len(metrics)]
    cells: dict[tuple[str, int], dict[str, MetricError]] = {}
    for index, e in report.stage_errors:
        cells.setdefault((e.experiment, index), {})[e.metric] = e
    labels = dict(report.labels)
    for (exp, index), row in cells.items():
        lines.append(f"| {labels.get(exp, exp)} | {index} | " + " | ".join(_cell(row.get(m)) for m in metrics) + " |")
    return lines


def report_html(report: FidelityReport) -> str:
    """The report as one HTML page: the Markdown tables and two charts (errors per metric, replayed vs recorded)."""
    import html

    import plotly.graph_objects as go

    metrics = [m for m in METRICS if m in report.median_abs_error_pct]
    by_metric = go.Figure()
    for m in metrics:
        errs = [e for e in report.errors if e.metric == m]
        by_metric.add_trace(go.Box(y=[e.signed_pct for e in errs], name=m, boxpoints="all",
                                   text=[dict(report.labels).get(e.experiment, e.experiment) for e in errs]))
    by_metric.update_layout(title="Signed error per metric, replay vs recorded (%)", yaxis_title="error (%)",
                            showlegend=False, height=420)
    scatter = go.Figure()
    for m in metrics:
        errs = [e for e in report.errors if e.metric == m]
        scatter.add_trace(go.Scatter(x=[e.recorded_s * 1e3 for e in errs], y=[e.replayed_s * 1e3 for e in errs],
                                     mode="markers", name=m))
    top = max((max(e.recorded_s, e.replayed_s) * 1e3 for e in report.errors), default=1.0)
    scatter.add_trace(go.Scatter(x=[1, top], y=[1, top], mode="lines", name="equal", line={"dash": "dot"}))
    scatter.update_layout(title="Replayed against recorded (ms, log scales)", xaxis_type="log", yaxis_type="log",
                          xaxis_title="recorded (ms)", yaxis_title="replayed (ms)", height=480)
    body = "\n".join([
        f"<h1>servelens fidelity ({html.escape(report.calibration)})</h1>",
        by_metric.to_html(full_html=False, include_plotlyjs="cdn"),
        *([_by_stage_figure(report, metrics).to_html(full_html=False, include_plotlyjs=False)]
          if report.stage_errors else []),
        scatter.to_html(full_html=False, include_plotlyjs=False),
        f"<pre>{html.escape(report_markdown(report))}</pre>",
    ])
    return f"<!doctype html><html><head><meta charset='utf-8'><title>servelens fidelity</title></head><body>{body}</body></html>\n"


def _by_stage_figure(report: FidelityReport, metrics: list[str]) -> Any:
    """Signed errors per metric, grouped by load stage (the runs recorded stage by stage)."""
    import plotly.graph_objects as go

    labels = dict(report.labels)
    figure = go.Figure()
    for index in sorted({i for i, _ in report.stage_errors}):
        errs = [e for i, e in report.stage_errors if i == index and e.metric in metrics]
        figure.add_trace(go.Box(x=[e.metric for e in errs], y=[e.signed_pct for e in errs], name=f"stage {index}",
                                boxpoints="all", text=[labels.get(e.experiment, e.experiment) for e in errs]))
    figure.update_layout(title="Signed error per metric and load stage, replay vs recorded (%)", boxmode="group",
                         yaxis_title="error (%)", height=420)
    return figure


def write_report(report: FidelityReport, out_dir: Path) -> dict[str, Path]:
    """fidelity.json, fidelity.md and fidelity.html under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "fidelity.json", "md": out_dir / "fidelity.md", "html": out_dir / "fidelity.html"}
    paths["json"].write_text(json.dumps(report.as_json(), indent=2, sort_keys=True) + "\n")
    paths["md"].write_text(report_markdown(report))
    paths["html"].write_text(report_html(report))
    return paths


__all__ = [
    "FIDELITY_DIR",
    "FidelityExperiment",
    "FidelityReport",
    "GPU_LABELS",
    "METRICS",
    "MetricError",
    "PRECISIONS",
    "RECORDED_METRICS",
    "RequestTimes",
    "compare",
    "experiment_instance",
    "experiment_spec",
    "experiment_workload",
    "output_count_ratio",
    "latencies_of_events",
    "median_abs_error",
    "median_signed_error",
    "read_experiments",
    "stage_errors",
    "stage_starts_s",
    "report_html",
    "report_markdown",
    "summarize",
    "write_report",
]
