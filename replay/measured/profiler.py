"""The profiler: time real engine steps over a sweep of shapes and write them as a Parquet profile.

A *shape* is one step's composition: prefill chunks (tokens, context before the chunk) and decode
sequences (each one's context). The sweep covers what moves a step's time: prefill chunk size and
the context it extends, the number of decode sequences and their contexts, and mixes of a chunk with
decodes (Sarathi-style hybrid steps). Each shape runs ``warmup`` times untimed, then ``repeats``
times timed, round robin within groups of ``INTERLEAVE`` shapes (a burst of outside load then costs
one repeat of several shapes, which their medians discard, instead of every repeat of one shape):
with CUDA events on a GPU (recorded around the call, read after the end event
completes: the step's host-side preparation is inside, as in a serving engine), with
``time.perf_counter_ns`` around the call on a CPU. The profile keeps every repeat, their median
(the figure the fit uses) and spread (min, max, p10, p90, std).

Shapes are swept in a seeded shuffled order, so a sweep stopped by its time box (``max_seconds``,
checked between groups) still covers every kind of shape; the metadata says whether it was cut short.

Parquet layout: one row per shape (``PROFILE_SCHEMA``), the metadata as JSON under the schema
metadata key ``servelens.profile`` (``ProfileMeta``): device kind and name, driver, CUDA and torch
versions, dtype, the model shape, the timer, the peak FLOP/s and bandwidth the roofline fraction is
taken against (and where they came from), the sweep, UTC date and code version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replay.config import ACCELERATORS
from replay.errors import ReplayError
from replay.measured.shapes import LlamaShape
from schemas.types import doc
from servelens.errors import DataNotFoundError
from servelens.provenance import code_version

PROFILE_VERSION = 1
META_KEY = b"servelens.profile"
#: Shapes timed round robin together: each repeat of a group runs every shape of it once
INTERLEAVE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """Which step shapes the profiler times, and how often."""

    prefill_tokens: tuple[int, ...] = doc("Prefill chunk sizes, tokens.")
    prefill_contexts: tuple[int, ...] = doc("Context before a prefill chunk, tokens (0: a prompt's first chunk).")
    decode_seqs: tuple[int, ...] = doc("Decode batch sizes, sequences.")
    decode_contexts: tuple[int, ...] = doc("Mean context of the decode sequences, tokens.")
    mixed_prefill_tokens: tuple[int, ...] = doc("Chunk sizes of hybrid steps (one chunk beside decodes).")
    mixed_decode_seqs: tuple[int, ...] = doc("Decode batch sizes of hybrid steps.")
    max_kv_tokens: int = doc("Skip shapes whose contexts hold more KV tokens than this (device memory).")
    max_step_tokens: int = doc("Skip shapes with more new tokens than this (the engine's step budget).", 8192)
    warmup: int = doc("Untimed runs of each shape before the timed ones.", 2)
    repeats: int = doc("Timed runs of each shape.", 5)
    max_seconds: float | None = doc("Stop sweeping after this long (the profile says it was cut short).", None)
    seed: int = doc("Seed of the weights, the token ids, the shape order and the context spreads.", 0)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ReplayError("a sweep needs at least one timed repeat and no negative warm-up")


def default_sweep(device: str, shape: LlamaShape, **overrides: Any) -> SweepConfig:
    """The sweep for a device and model: the engine's real range on a GPU, a small grid on a CPU."""
    if device == "cuda":
        big = shape.hidden_size >= 8192
        base = SweepConfig(
            prefill_tokens=(16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096),
            prefill_contexts=(0, 512, 2048, 8192),
            decode_seqs=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256),
            decode_contexts=(128, 512, 1024, 2048, 4096, 8192),
            mixed_prefill_tokens=(64, 256, 512, 1024, 2048),
            mixed_decode_seqs=(8, 32, 64, 128),
            max_kv_tokens=131_072 if big else 262_144,
            repeats=7,
            warmup=3,
        )
    elif shape.hidden_size <= 256:  # the test-sized shapes: cheap steps, so the engine's whole range
        base = SweepConfig(
            prefill_tokens=(1, 8, 32, 128, 512, 1024, 2048),
            prefill_contexts=(0, 512, 2048),
            decode_seqs=(1, 4, 16, 64, 128),
            decode_contexts=(32, 256, 1024, 4096),
            mixed_prefill_tokens=(32, 256, 1024),
            mixed_decode_seqs=(4, 32, 96),
            max_kv_tokens=131_072,
            repeats=5,
            warmup=1,
        )
    else:
        base = SweepConfig(
            prefill_tokens=(16, 64, 256, 512),
            prefill_contexts=(0, 512),
            decode_seqs=(1, 4, 16),
            decode_contexts=(128, 1024),
            mixed_prefill_tokens=(64, 256),
            mixed_decode_seqs=(4, 16),
            max_kv_tokens=32_768,
            repeats=3,
            warmup=1,
        )
    return dataclasses.replace(base, **overrides)


@dataclass(frozen=True, slots=True)
class ProfileShape:
    """One step's composition, as the profiler runs it."""

    prefill_chunks: tuple[tuple[int, int], ...]  # (tokens, context before the chunk)
    decode_contexts: tuple[int, ...]  # each decode sequence's context before its new token

    @property
    def kind(self) -> str:
        if self.prefill_chunks and self.decode_contexts:
            return "mixed"
        return "prefill" if self.prefill_chunks else "decode"

    @property
    def num_tokens(self) -> int:
        return sum(c for c, _ in self.prefill_chunks) + len(self.decode_contexts)

    @property
    def kv_tokens(self) -> int:
        return sum(c + o for c, o in self.prefill_chunks) + sum(x + 1 for x in self.decode_contexts)


def sweep_shapes(sweep: SweepConfig) -> list[ProfileShape]:
    """The sweep's shapes, deduplicated, within its limits, in a seeded shuffled order."""
    rng = random.Random(sweep.seed)

    def spread(n: int, mean: int) -> tuple[int, ...]:  # contexts around the mean (real batches vary)
        if n == 1:
            return (mean,)
        return tuple(max(1, round(mean * (0.5 + i / (n - 1)))) for i in range(n))

    shapes: list[ProfileShape] = []
    for c in sweep.prefill_tokens:
        for o in sweep.prefill_contexts:
            shapes.append(ProfileShape(((c, o),), ()))
    for d in sweep.decode_seqs:
        for ctx in sweep.decode_contexts:
            shapes.append(ProfileShape((), (ctx,) * d))
            if d >= 4:
                shapes.append(ProfileShape((), spread(d, ctx)))
    for c in sweep.mixed_prefill_tokens:
        for d in sweep.mixed_decode_seqs:
            for ctx in sweep.decode_contexts:
                shapes.append(ProfileShape(((c, 0),), spread(d, ctx)))
    seen: set[ProfileShape] = set()
    kept = []
    for s in shapes:
        if s in seen or s.kv_tokens > sweep.max_kv_tokens or s.num_tokens > sweep.max_step_tokens:
            continue
        seen.add(s)
        kept.append(s)
    rng.shuffle(kept)
    return kept


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileMeta:
    """What a profile was measured on (the Parquet file's metadata)."""

    profile_version: int = doc("Layout version of the profile file.", PROFILE_VERSION)
    measured: bool = doc("True: every time in the file was measured on the device named here.", True)
    device: str = doc("Device kind: cpu or cuda.")
    device_name: str = doc("GPU name (torch.cuda.get_device_name) or the CPU's model name.")
    driver: str | None = doc("NVIDIA driver version (nvidia-smi), when on CUDA.", None)
    cuda: str | None = doc("CUDA version torch was built with, when on CUDA.", None)
    torch: str = doc("PyTorch version.")
    num_threads: int = doc("torch intra-op threads (CPU).")
    dtype: str = doc("Weights, activations and KV cache dtype.")
    model: LlamaShape = doc("The model shape: the layers built and the real model's.")
    block_size: int = doc("KV cache block size, tokens.")
    timer: str = doc("cuda-events or perf_counter.")
    peak_flops: float = doc("Peak FLOP/s the roofline fraction is taken against.")
    peak_bytes_per_s: float = doc("Peak memory bandwidth the roofline fraction is taken against, bytes/s.")
    peak_source: str = doc("Where the peaks come from: a published preset or a measurement here.")
    memory_bytes: int = doc("Device memory (GPU) or host memory (CPU), bytes.")
    sweep: SweepConfig = doc("The sweep configuration.")
    num_shapes_planned: int = doc("Shapes in the sweep.")
    truncated: bool = doc("The time box stopped the sweep before every shape was timed.")
    wall_s: float = doc("How long the sweep took, seconds.")
    date_utc: str = doc("When the sweep ran (ISO 8601, UTC).")
    host: str = doc("Host name.")
    servelens_version: str = doc("servelens version that measured it.")
    git_commit: str | None = doc("Git commit it ran from, when known.")

    @property
    def shape(self) -> LlamaShape:
        return self.model


PROFILE_SCHEMA = pa.schema(
    [
        pa.field("shape_id", pa.int64(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("prefill_chunk_tokens", pa.list_(pa.int64()), nullable=False),
        pa.field("prefill_chunk_context", pa.list_(pa.int64()), nullable=False),
        pa.field("decode_context", pa.list_(pa.int64()), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("num_decode_seqs", pa.int64(), nullable=False),
        pa.field("decode_context_tokens", pa.int64(), nullable=False),  # sum of (context + 1), as StepShape
        pa.field("median_ns", pa.int64(), nullable=False),
        pa.field("mean_ns", pa.float64(), nullable=False),
        pa.field("min_ns", pa.int64(), nullable=False),
        pa.field("max_ns", pa.int64(), nullable=False),
        pa.field("p10_ns", pa.float64(), nullable=False),
        pa.field("p90_ns", pa.float64(), nullable=False),
        pa.field("std_ns", pa.float64(), nullable=False),
        pa.field("times_ns", pa.list_(pa.int64()), nullable=False),
    ]
)


@dataclass(frozen=True, slots=True)
class Profile:
    """A profile read back: its rows (``PROFILE_SCHEMA``) and metadata."""

    table: pa.Table
    meta: ProfileMeta

    def shapes(self) -> list[ProfileShape]:
        t = self.table
        return [
            ProfileShape(tuple(zip(ct, cc)), tuple(dc))
            for ct, cc, dc in zip(
                t["prefill_chunk_tokens"].to_pylist(), t["prefill_chunk_context"].to_pylist(), t["decode_context"].to_pylist()
            )
        ]


def _quantile(sorted_values: list[int], q: float) -> float:
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _add_row(rows: dict[str, list], shape_id: int, s: ProfileShape, times: list[int]) -> int:
    """Append one shape's row; return its median, ns."""
    ordered = sorted(times)
    median = round(statistics.median(ordered))
    rows["shape_id"].append(shape_id)
    rows["kind"].append(s.kind)
    rows["prefill_chunk_tokens"].append([c for c, _ in s.prefill_chunks])
    rows["prefill_chunk_context"].append([o for _, o in s.prefill_chunks])
    rows["decode_context"].append(list(s.decode_contexts))
    rows["num_tokens"].append(s.num_tokens)
    rows["num_decode_seqs"].append(len(s.decode_contexts))
    rows["decode_context_tokens"].append(sum(x + 1 for x in s.decode_contexts))
    rows["median_ns"].append(median)
    rows["mean_ns"].append(statistics.fmean(ordered))
    rows["min_ns"].append(ordered[0])
    rows["max_ns"].append(ordered[-1])
    rows["p10_ns"].append(_quantile(ordered, 0.1))
    rows["p90_ns"].append(_quantile(ordered, 0.9))
    rows["std_ns"].append(statistics.pstdev(ordered))
    rows["times_ns"].append(times)
    return median


def step_timer(executor) -> Callable[[list], int]:
    """A function that runs one step's work on the executor and returns its time, ns."""
    torch = executor.torch
    if executor.device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        def timed(work: list) -> int:
            start.record()
            executor.execute(work)
            end.record()
            end.synchronize()
            return round(start.elapsed_time(end) * 1e6)
    else:

        def timed(work: list) -> int:
            t0 = time.perf_counter_ns()
            executor.execute(work)
            return time.perf_counter_ns() - t0

    return timed


def shape_work(shape: ProfileShape) -> list:
    from replay.measured.executor import SeqWork

    work = [SeqWork(("p", i), c, o) for i, (c, o) in enumerate(shape.prefill_chunks)]
    work.extend(SeqWork(("d", i), 1, ctx) for i, ctx in enumerate(shape.decode_contexts))
    return work


def run_profile(
    shape: LlamaShape,
    *,
    device: str = "cpu",
    sweep: SweepConfig | None = None,
    out: str | Path | None = None,
    progress: Callable[[int, int, ProfileShape, int], None] | None = None,
    block_size: int = 16,
    num_threads: int | None = None,
) -> Profile:
    """Build the executor, time every shape of the sweep, and write the profile to ``out`` (Parquet).

    ``num_threads`` sets torch's intra-op threads for the sweep (CPU; restored after): on a shared
    machine one thread gives steadier times than contending for every core.
    """
    from replay.measured.executor import require_torch

    torch = require_torch()
    before = torch.get_num_threads()
    if num_threads is not None:
        if num_threads < 1:
            raise ReplayError(f"--threads must be at least 1, not {num_threads}")
        torch.set_num_threads(num_threads)
    try:
        return _run_profile(torch, shape, device, sweep, out, progress, block_size)
    finally:
        torch.set_num_threads(before)


def _run_profile(torch, shape: LlamaShape, device: str, sweep: SweepConfig | None, out: str | Path | None,
                 progress: Callable[[int, int, ProfileShape, int], None] | None, block_size: int) -> Profile:
    from replay.measured.executor import StepExecutor

    sweep = sweep or default_sweep(device, shape)
    shapes = sweep_shapes(sweep)
    if not shapes:
        raise ReplayError("the sweep has no shape within its limits", "raise max_kv_tokens or max_step_tokens")
    # blocks for the largest shape: its tokens, plus at most one partly filled block per sequence
    blocks = max(-(-s.kv_tokens // block_size) + len(s.prefill_chunks) + len(s.decode_contexts) for s in shapes)
    executor = StepExecutor(shape, device=device, num_kv_blocks=blocks, block_size=block_size, seed=sweep.seed)
    rows, truncated, wall_s = _sweep(torch, executor, sweep, shapes, progress)
    meta = _profile_meta(torch, executor, shape, block_size, sweep, num_shapes_planned=len(shapes),
                         truncated=truncated, wall_s=wall_s)
    profile = Profile(pa.Table.from_pydict(rows, schema=PROFILE_SCHEMA), meta)
    if out is not None:
        write_profile(profile, out)
    return profile


def _sweep(torch, executor, sweep: SweepConfig, shapes: list[ProfileShape],
           progress: Callable[[int, int, ProfileShape, int], None] | None) -> tuple[dict[str, list], bool, float]:
    """Time ``shapes`` in interleaved groups: the profile's rows, whether ``max_seconds`` cut the sweep short,
    and its wall time, seconds."""
    timed = step_timer(executor)
    rows: dict[str, list] = {f.name: [] for f in PROFILE_SCHEMA}
    wall0 = time.perf_counter()
    truncated = False
    with torch.inference_mode():
        for first in range(0, len(shapes), INTERLEAVE):
            if sweep.max_seconds is not None and time.perf_counter() - wall0 > sweep.max_seconds:
                truncated = True
                break
            group = shapes[first:first + INTERLEAVE]
            times = _time_group(executor, timed, sweep, [shape_work(s) for s in group])
            for j, s in enumerate(group):
                i = first + j
                median = _add_row(rows, i, s, times[j])
                if progress is not None:
                    progress(i + 1, len(shapes), s, median)
    return rows, truncated, time.perf_counter() - wall0


def _time_group(executor, timed: Callable[[list], int], sweep: SweepConfig, works: list[list]) -> list[list[int]]:
    """Warm up on each step's work, then time each ``sweep.repeats`` times, round robin; ns per work."""
    for work in works:
        for _ in range(sweep.warmup):
            executor.execute(work)
        executor.free_all()
    executor.synchronize()
    times: list[list[int]] = [[] for _ in works]
    for _ in range(sweep.repeats):  # round robin: a burst of outside load hits one repeat of many shapes
        for j, work in enumerate(works):
            times[j].append(timed(work))
            executor.free_all()
    return times


def _profile_meta(torch, executor, shape: LlamaShape, block_size: int, sweep: SweepConfig, *,
                  num_shapes_planned: int, truncated: bool, wall_s: float) -> ProfileMeta:
    """Where, how and with what the profile was measured."""
    cuda = executor.device.type == "cuda"
    peak_flops, peak_bw, source = device_peaks(executor)
    return ProfileMeta(
        device=executor.device.type,
        device_name=device_name(executor),
        driver=nvidia_driver() if cuda else None,
        cuda=torch.version.cuda if cuda else None,
        torch=torch.__version__,
        num_threads=torch.get_num_threads(),
        dtype=executor.dtype_name,
        model=shape,
        block_size=block_size,
        timer="cuda-events" if cuda else "perf_counter",
        peak_flops=peak_flops,
        peak_bytes_per_s=peak_bw,
        peak_source=source,
        memory_bytes=device_memory_bytes(executor),
        sweep=sweep,
        num_shapes_planned=num_shapes_planned,
        truncated=truncated,
        wall_s=round(wall_s, 3),
        date_utc=datetime.now(UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        **_code_version(),
    )


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_plain(v) for v in obj]
    return obj


def _code_version() -> dict[str, str | None]:
    v = code_version()
    return {"servelens_version": v["servelens"], "git_commit": v["git_commit"]}


def write_profile(profile: Profile, out: str | Path) -> Path:
    """Write a profile as Parquet (zstd) with its metadata; return the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(_plain(profile.meta), sort_keys=True).encode()
    table = profile.table.replace_schema_metadata({META_KEY: meta})
    pq.write_table(table, out, compression="zstd")
    return out


def profile_lines(profile: Profile) -> list[str]:
    """What a profile was measured on and how, as plain text (``servelens profile-info`` prints it)."""
    m, s = profile.meta, profile.meta.model
    gpu = f", driver {m.driver}, CUDA {m.cuda}" if m.device == "cuda" else ""
    box = " (the time box stopped the sweep)" if m.truncated else ""
    return [
        f"model:    {s.name}, {s.num_layers} of its {s.full_num_layers} layers built, {m.dtype}, KV blocks of {m.block_size} tokens",
        f"device:   {m.device} {m.device_name}{gpu}; torch {m.torch}",
        f"timing:   {m.timer}; {profile.table.num_rows} of {m.num_shapes_planned} shapes{box}, {m.sweep.warmup} warm-ups "
        f"and {m.sweep.repeats} timed runs each, {m.wall_s:,.0f} s",
        f"peaks:    {m.peak_flops / 1e12:,.0f} TFLOP/s, {m.peak_bytes_per_s / 1e12:,.2f} TB/s, {m.peak_source}",
        f"measured: {m.date_utc} on {m.host}, servelens {m.servelens_version}, commit {(m.git_commit or 'unknown')[:12]}",
    ]


def read_profile(path: str | Path) -> Profile:
    """Read a profile written by ``write_profile``: a clean error naming the file and the field for anything
    else (metadata that is not a JSON object of the declared fields, unknown kinds, repeated shapes, step
    times that are not positive and finite)."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"no profile at {path}", "write one with `servelens profile --model tiny --device cpu --out FILE`")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataNotFoundError(f"{path} is not a Parquet profile: {exc}") from exc
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise DataNotFoundError(
            f"{path} has no servelens profile metadata",
            "profiles come from `servelens profile`; Vidur's CSV tables are read by --cost-model profile without --profile",
        )
    values = _meta_object(path, raw)
    version = values.get("profile_version")
    if version != PROFILE_VERSION:
        raise DataNotFoundError(f"{path} is profile version {version}, this servelens reads version {PROFILE_VERSION}")
    missing = [f.name for f in PROFILE_SCHEMA if f.name not in table.column_names]
    if missing:
        raise DataNotFoundError(f"{path} lacks profile columns {missing}")
    meta = _profile_meta_from(path, values)
    return Profile(_checked_rows(path, table), meta)


#: The hint of every unreadable profile: it was not written by ``servelens profile``, or changed since
_REPROFILE = "profile again with `servelens profile` (this file was changed since, or not written by it)"
_META = "its servelens.profile metadata"
#: Declared field types (``dataclasses.Field.type``) of the metadata: what a value must be, and the check
_VALUE_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", lambda v: type(v) is int),
    "float": ("a finite number", lambda v: type(v) in (int, float) and math.isfinite(v)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "tuple[int, ...]": ("a list of integers", lambda v: isinstance(v, list) and all(type(x) is int for x in v)),
}
DTYPES = ("float32", "bfloat16", "float16")
TIMERS = ("cuda-events", "perf_counter")


def _meta_error(path: Path, field: str, problem: str) -> DataNotFoundError:
    return DataNotFoundError(f"{path}: {_META}, field {field!r}, {problem}", _REPROFILE)


def _meta_object(path: Path, raw: bytes) -> dict:
    """The metadata's JSON object (a clean error for bytes that are not one)."""
    try:
        values = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataNotFoundError(f"{path}: {_META} is not UTF-8 text (byte {exc.start})", _REPROFILE) from None
    except json.JSONDecodeError as exc:
        raise DataNotFoundError(f"{path}: {_META} is not JSON ({exc.msg} at character {exc.pos})", _REPROFILE) from None
    except RecursionError:
        raise DataNotFoundError(f"{path}: {_META} is nested too deeply to be a profile's", _REPROFILE) from None
    if not isinstance(values, dict):
        raise DataNotFoundError(f"{path}: {_META} is a JSON {type(values).__name__}, not an object of fields", _REPROFILE)
    return values


def _fields_of(path: Path, cls: type, values: Any, prefix: str = "") -> dict[str, Any]:
    """The fields of dataclass ``cls`` in ``values``, each checked against its declared type; nested
    dataclasses (the model shape, the sweep) are built here. Unknown keys are ignored, but not in the model shape."""
    where = prefix.rstrip(".") or "(the whole)"
    if not isinstance(values, dict):
        raise _meta_error(path, where, f"is {_shown(values)}, not an object of fields")
    declared = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(declared))
    if cls is LlamaShape and unknown:
        raise _meta_error(path, where, f"has unknown fields {unknown[:5]} (valid: {', '.join(declared)})")
    out: dict[str, Any] = {}
    for name, f in declared.items():
        if name not in values:
            if f.default is dataclasses.MISSING:
                raise _meta_error(path, prefix + name, "is missing")
            continue
        out[name] = _field_value(path, prefix + name, str(f.type), values[name])
    return out


def _field_value(path: Path, field: str, declared: str, value: Any) -> Any:
    if value is None and declared.endswith(" | None"):
        return None
    declared = declared.removesuffix(" | None")
    nested = {"LlamaShape": LlamaShape, "SweepConfig": SweepConfig}.get(declared)
    if nested is not None:
        try:
            return nested(**_fields_of(path, nested, value, field + "."))
        except ReplayError as exc:
            raise _meta_error(path, field, exc.message) from None
    what, ok = _VALUE_KINDS[declared]
    if not ok(value):
        raise _meta_error(path, field, f"is {_shown(value)}, not {what}")
    return tuple(value) if isinstance(value, list) else value


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return f"{text[:40]}{'...' if len(text) > 40 else ''} (a JSON {type(value).__name__})"


def _profile_meta_from(path: Path, values: dict) -> ProfileMeta:
    """The metadata, every field of its declared type and within what a profile can hold."""
    meta = ProfileMeta(**_fields_of(path, ProfileMeta, values))
    checks = (
        ("device", meta.device in ("cpu", "cuda"), "cpu or cuda"),
        ("dtype", meta.dtype in DTYPES, " or ".join(DTYPES)),
        ("timer", meta.timer in TIMERS, " or ".join(TIMERS)),
        ("block_size", meta.block_size >= 1, "a positive number of tokens"),
        ("num_threads", meta.num_threads >= 1, "at least 1"),
        ("peak_flops", meta.peak_flops > 0, "a positive FLOP/s"),
        ("peak_bytes_per_s", meta.peak_bytes_per_s > 0, "a positive bytes/s"),
        ("memory_bytes", meta.memory_bytes > 0, "a positive number of bytes"),
        ("num_shapes_planned", meta.num_shapes_planned >= 0, "not negative"),
        ("wall_s", meta.wall_s >= 0, "not negative"),
        ("date_utc", _iso_date(meta.date_utc), "an ISO 8601 date"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise _meta_error(path, name, f"is {_shown(getattr(meta, name))}, not {expected}")
    return meta


def _iso_date(text: str) -> bool:
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


KINDS = ("prefill", "decode", "mixed")
_TIMES = ("median_ns", "mean_ns", "min_ns", "max_ns", "p10_ns", "p90_ns", "std_ns")
_LISTS = ("prefill_chunk_tokens", "prefill_chunk_context", "decode_context", "times_ns")


def _checked_rows(path: Path, table: pa.Table) -> pa.Table:
    """The profile's columns as ``PROFILE_SCHEMA``, refusing nulls, step times that are not positive and
    finite, unknown or wrong kinds, and malformed or repeated shapes."""
    try:
        table = table.select([f.name for f in PROFILE_SCHEMA]).cast(PROFILE_SCHEMA).replace_schema_metadata(None)
    except (ValueError, TypeError, pa.ArrowNotImplementedError) as exc:
        raise DataNotFoundError(f"{path}: the profile's columns do not have their types: {exc}", _REPROFILE) from None
    for name in _LISTS:
        if pc.list_flatten(table[name]).null_count:
            raise DataNotFoundError(f"{path}: profile column {name!r} holds null items", _REPROFILE)
    ids = table["shape_id"].to_pylist()
    _check_times(path, table, ids)
    _check_shapes(path, table, ids)
    return table


def _check_times(path: Path, table: pa.Table, ids: list[int]) -> None:
    """Every step time positive and finite, ns (the fit divides by them; a spread may be 0)."""
    for name in _TIMES:
        for sid, value in zip(ids, table[name].to_pylist()):
            if not (math.isfinite(value) and (value >= 0 if name == "std_ns" else value > 0)):
                raise DataNotFoundError(f"{path}: profile column {name!r} holds {value} at shape_id {sid}: "
                                        "step times are positive, finite nanoseconds", _REPROFILE)
    for sid, times in zip(ids, table["times_ns"].to_pylist()):
        if not times or min(times) <= 0:
            raise DataNotFoundError(f"{path}: profile column 'times_ns' holds {times[:5]} at shape_id {sid}: "
                                    "each shape has its timed runs, each positive nanoseconds", _REPROFILE)


def _check_shapes(path: Path, table: pa.Table, ids: list[int]) -> None:
    """Every row a well-formed step of a known kind (its counts those of its shape), no step shape timed twice."""
    kinds = table["kind"].to_pylist()
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise DataNotFoundError(f"{path}: profile column 'kind' holds unknown kinds {[k[:20] for k in unknown[:5]]} "
                                f"(valid: {', '.join(KINDS)})", _REPROFILE)
    seen: dict[ProfileShape, int] = {}
    for row, values in enumerate(table.drop_columns(["times_ns"]).to_pylist(), start=1):
        shape = _row_shape(path, values)
        if shape in seen:
            raise DataNotFoundError(
                f"{path}: rows {seen[shape]} and {row} hold the same step shape ({shape.kind}, {shape.num_tokens} tokens): "
                "a profile times each shape once (a repeated one would be held out against its own copy, and the "
                "fit's error would read too low)", _REPROFILE)
        seen[shape] = row


def _row_shape(path: Path, row: dict[str, Any]) -> ProfileShape:
    """The step shape of one profile row, which must be well formed and agree with the row's kind and counts."""
    tokens, contexts, decodes = row["prefill_chunk_tokens"], row["prefill_chunk_context"], row["decode_context"]
    at = f"at shape_id {row['shape_id']}"
    if len(tokens) != len(contexts) or not (tokens or decodes) or min(tokens, default=1) < 1 or min(contexts + decodes, default=0) < 0:
        raise DataNotFoundError(f"{path}: the step shape {at} is malformed (chunk sizes {tokens[:4]}, chunk contexts "
                                f"{contexts[:4]}, {len(decodes)} decode contexts)", _REPROFILE)
    shape = ProfileShape(tuple(zip(tokens, contexts)), tuple(decodes))
    expected = {"kind": shape.kind, "num_tokens": shape.num_tokens, "num_decode_seqs": len(decodes),
                "decode_context_tokens": sum(x + 1 for x in decodes)}
    for name, value in expected.items():
        if row[name] != value:
            raise DataNotFoundError(f"{path}: profile column {name!r} holds {row[name]!r:.40} {at}, but its step shape "
                                    f"has {value!r}", _REPROFILE)
    return shape


# ------------------------------------------------------------------------------ the device


def device_name(executor) -> str:
    if executor.device.type == "cuda":
        return executor.torch.cuda.get_device_name(executor.device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def device_memory_bytes(executor) -> int:
    if executor.device.type == "cuda":
        return int(executor.torch.cuda.get_device_properties(executor.device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * 2**30


#: Published dense bf16 peaks by GPU name fragment (the accelerator presets of replay.config).
_GPU_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g"))


def device_peaks(executor) -> tuple[float, float, str]:
    """(peak FLOP/s, peak bytes/s, source): a published preset for a known GPU, else measured here."""
    if executor.device.type == "cuda":
        name = device_name(executor)
        for fragment, preset in _GPU_PRESETS:
            if fragment in name:
                a = ACCELERATORS[preset]
                return a.peak_bf16_flops, a.memory_bandwidth_bytes_per_s, f"published ({preset} preset)"
    return (*measure_peaks(executor), "measured here (best of a matmul and a copy loop)")


def measure_peaks(executor, seconds: float = 0.5) -> tuple[float, float]:
    """Best achieved FLOP/s of a square matmul and bytes/s of a large copy on the executor's device."""
    torch = executor.torch
    dev, dt = executor.device, executor.dtype
    n = 2048 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=dt)
    b = torch.randn(n, n, device=dev, dtype=dt)
    src = torch.empty(64 * 2**20 // executor.bytes_per_element, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    best_flops = best_bw = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        executor.synchronize()
        t0 = time.perf_counter()
        a @ b
        executor.synchronize()
        t1 = time.perf_counter()
        dst.copy_(src)
        executor.synchronize()
        t2 = time.perf_counter()
        best_flops = max(best_flops, 2 * n**3 / max(t1 - t0, 1e-9))
        best_bw = max(best_bw, 2 * src.numel() * executor.bytes_per_element / max(t2 - t1, 1e-9))
        if time.perf_counter() > deadline:
            return best_flops, best_bw
