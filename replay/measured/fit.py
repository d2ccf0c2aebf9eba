"""The profile-table cost model fitted to a servelens profile, its held-out error and roofline share.

A measured profile (``replay.measured.profiler``) is turned into a step-time table over the step's
shape (``StepShape``, exactly what the engine asks the cost model about):

    t = s x ( T(num_tokens) + a_chunk x chunks + a_decode x [decodes > 0]
              + a_pair x attention pairs + a_ctx x prefill context keys + a_key x decode keys )
        + a_row x sampled rows

- ``T`` is a table over the step's token count (the linear layers, norms, embedding and per-step
  host work), read between its knots linearly and extended linearly past the ends, like the Vidur
  operator tables of ``replay.profiles``;
- attention is priced per (query, key) pair inside prefill chunks (quadratic in a chunk), per key of
  the context a chunk extends, and per key a decode sequence reads; each attention call has a fixed
  price (one per chunk, one for the batched decodes);
- ``a_row`` is the LM head per sampled row (one per chunk, one per decode sequence);
- ``s`` is the layer scale: the replayed model's layers over the layers built and timed (a 70B-class
  shape timed on 8 of its 80 layers is scaled by 10; the LM head is not scaled).

Every coefficient is fitted at once by non-negative least squares on *relative* residuals (each
shape's row divided by its measured median), so a 50 us decode weighs as much as a 50 ms prefill.

The error is reported on shapes the fit did not see: a seeded 20% of the profile's shapes are held
out, the table is fitted on the rest, and ``FitReport`` gives the median and p95 of
|predicted - measured| / measured on the held-out shapes (and on the training shapes). The model used
for replay is then fitted on every shape. The roofline fraction is the roofline time of each shape
(``replay.costmodel`` roofline at 100% efficiency against the profile's peaks) over its measured
median: the share of the hardware's limit the executor reached.

Integer arithmetic: the table part is rounded to whole ns once per step; the attention part is kept
in ticks of 1/1024 ns per unit (rounded once per coefficient), so a decode run is a sum of ceilings
of an affine function of the step index: ``decode_run`` sums it in closed form, exactly equal to
stepping ``step_time_ns`` (the contract of ``replay.costmodel``).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replay.config import AcceleratorConfig, EngineConfig, InstanceConfig
from replay.costmodel import (
    TICKS_PER_NS,
    CostModelBase,
    CostModelInfo,
    DecodeRun,
    RooflineConfig,
    RooflineCostModel,
    StepShape,
    single_line_run,
)
from replay.errors import ReplayError
from replay.measured.profiler import Profile, ProfileMeta, ProfileShape, read_profile
from schemas.types import doc

#: Attention and per-call terms, in the order of ``FittedTable.attention``.
ATTENTION_TERMS = ("chunk_call_ns", "decode_call_ns", "pair_ns", "prefill_context_key_ns", "decode_key_ns")
MAX_KNOTS = 16
HELD_OUT_SHARE = 0.2
BYTES_OF_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedProfileConfig:
    """The profile-table cost model from a servelens profile (``servelens profile``)."""

    path: str = doc("Parquet profile written by `servelens profile`.")
    step_overhead_ns: int = doc("Fixed time added to every step (not in the profile), ns.", 0)
    seed: int = doc("Seed of the held-out split.", 0)


@dataclass(frozen=True, slots=True)
class FittedTable:
    """Fitted coefficients: the token-count table, attention terms and the LM head per row (ns)."""

    knots: tuple[int, ...]  # token counts
    table_ns: tuple[float, ...]  # time at each knot
    attention: tuple[float, ...]  # ATTENTION_TERMS
    row_ns: float  # LM head per sampled row

    def table(self, num_tokens: float) -> float:
        xs, ys = self.knots, self.table_ns
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, num_tokens) - 1, 0), len(xs) - 2)
        return ys[i] + (ys[i + 1] - ys[i]) * (num_tokens - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True, slots=True)
class ErrorSummary:
    """Relative errors |predicted - measured| / measured over a set of shapes."""

    num_shapes: int
    median: float
    p95: float
    max: float


@dataclass(frozen=True, slots=True)
class FitReport:
    """How well the table predicts shapes it did not see, and how close the executor came to the roofline."""

    held_out: ErrorSummary  # fitted on the other shapes
    held_out_by_kind: tuple[tuple[str, ErrorSummary], ...]
    train: ErrorSummary  # the same fit, on its own shapes
    all_shapes: ErrorSummary  # the final fit (every shape), in sample
    roofline_fraction: tuple[tuple[str, float], ...]  # median per kind and overall ('all')
    seed: int


# ------------------------------------------------------------------------------------------ features


def _terms(shape: StepShape) -> tuple[int, int, int, int, int, int, int]:
    """(tokens, sampled rows, chunks, has decodes, pairs, prefill context keys, decode keys)."""
    pairs = ctx = tokens = 0
    for c, o in shape.prefill_chunks:
        tokens += c
        pairs += c * o + c * (c + 1) // 2
        ctx += o
    d = shape.num_decode_seqs
    return tokens + d, len(shape.prefill_chunks) + d, len(shape.prefill_chunks), 1 if d else 0, pairs, ctx, shape.decode_context_tokens


def step_shape(shape: ProfileShape) -> StepShape:
    """The engine's view of a profiled shape."""
    return StepShape(shape.prefill_chunks, len(shape.decode_contexts), sum(x + 1 for x in shape.decode_contexts))


def _knots(token_counts: list[int]) -> tuple[int, ...]:
    """Knots of the token-count table: every measured count, or (with few shapes per count, or more
    than ``MAX_KNOTS``) log-spaced picks among them, the smallest and largest always included."""
    distinct = sorted(set(token_counts))
    most = min(MAX_KNOTS, max(2, len(token_counts) // 4))
    if len(distinct) <= most:
        return tuple(distinct)
    picks = np.unique(np.round(np.geomspace(1, len(distinct), most)).astype(int) - 1)
    return tuple(distinct[i] for i in picks)


def _design(shapes: list[StepShape], knots: tuple[int, ...]) -> np.ndarray:
    k = len(knots)
    a = np.zeros((len(shapes), k + len(ATTENTION_TERMS) + 1))
    for r, s in enumerate(shapes):
        tokens, rows, chunks, has_decode, pairs, ctx, keys = _terms(s)
        if k == 1:
            a[r, 0] = 1.0
        else:
            i = min(max(bisect.bisect_right(knots, tokens) - 1, 0), k - 2)
            u = (tokens - knots[i]) / (knots[i + 1] - knots[i])
            a[r, i] = 1 - u
            a[r, i + 1] = u
        a[r, k:k + 5] = (chunks, has_decode, pairs, ctx, keys)
        a[r, -1] = rows
    return a


def fit_table(shapes: list[StepShape], measured_ns: list[float]) -> FittedTable:
    """Non-negative least squares on relative residuals (see the module docstring)."""
    from scipy.optimize import nnls

    if not shapes:
        raise ReplayError("nothing to fit: the profile has no shapes")
    knots = _knots([_terms(s)[0] for s in shapes])
    a = _design(shapes, knots)
    y = np.asarray(measured_ns, dtype=float)
    coef, _ = nnls(a / y[:, None], np.ones(len(y)), maxiter=50 * a.shape[1])
    k = len(knots)
    return FittedTable(knots, tuple(float(v) for v in coef[:k]), tuple(float(v) for v in coef[k:k + 5]), float(coef[-1]))


def _errors(table: FittedTable, shapes: list[StepShape], measured_ns: list[float]) -> np.ndarray:
    model = FittedProfileCostModel(table, layer_scale=1.0)
    pred = np.array([model.step_time_ns(s) for s in shapes], dtype=float)
    y = np.asarray(measured_ns, dtype=float)
    return np.abs(pred - y) / y


def _summary(errors: np.ndarray) -> ErrorSummary:
    if errors.size == 0:
        return ErrorSummary(0, float("nan"), float("nan"), float("nan"))
    return ErrorSummary(int(errors.size), float(np.median(errors)), float(np.quantile(errors, 0.95)), float(errors.max()))


def evaluate_profile(profile: Profile, seed: int = 0) -> tuple[FittedTable, FitReport]:
    """Fit on a seeded 80% and report on the held-out 20%, then fit the table used for replay on every shape."""
    shapes = [step_shape(s) for s in profile.shapes()]
    kinds = profile.table["kind"].to_pylist()
    y = [float(v) for v in profile.table["median_ns"].to_pylist()]
    if len(shapes) < 5:
        raise ReplayError(
            f"the profile has {len(shapes)} shapes: too few to hold any out",
            "profile at least 5 shapes (a longer --max-seconds, or the default sweep)",
        )
    order = list(range(len(shapes)))
    random.Random(seed).shuffle(order)
    num_held = max(1, round(HELD_OUT_SHARE * len(shapes)))
    held, train = sorted(order[:num_held]), sorted(order[num_held:])
    pick = lambda idx, values: [values[i] for i in idx]  # noqa: E731
    partial = fit_table(pick(train, shapes), pick(train, y))
    held_err = _errors(partial, pick(held, shapes), pick(held, y))
    train_err = _errors(partial, pick(train, shapes), pick(train, y))
    by_kind = tuple(
        (kind, _summary(np.array([e for e, i in zip(held_err, held) if kinds[i] == kind])))
        for kind in ("prefill", "decode", "mixed")
        if any(kinds[i] == kind for i in held)
    )
    final = fit_table(shapes, y)
    all_err = _errors(final, shapes, y)
    report = FitReport(
        held_out=_summary(held_err),
        held_out_by_kind=by_kind,
        train=_summary(train_err),
        all_shapes=_summary(all_err),
        roofline_fraction=roofline_fractions(profile),
        seed=seed,
    )
    return final, report


def roofline_fractions(profile: Profile) -> tuple[tuple[str, float], ...]:
    """Median of (roofline time / measured time) per kind of shape, and over all shapes."""
    instance = profile_instance(profile.meta, full_layers=False)
    roof = RooflineCostModel(instance, RooflineConfig(compute_efficiency=1.0, memory_efficiency=1.0))
    kinds = profile.table["kind"].to_pylist()
    fractions = [
        roof.step_time_ns(step_shape(s)) / m for s, m in zip(profile.shapes(), profile.table["median_ns"].to_pylist())
    ]
    out = [
        (kind, float(np.median([f for f, k in zip(fractions, kinds) if k == kind])))
        for kind in ("prefill", "decode", "mixed")
        if kind in kinds
    ]
    out.append(("all", float(np.median(fractions))))
    return tuple(out)


def fit_report_lines(report: FitReport) -> list[str]:
    """The report as plain text (the CLI prints it)."""
    h, t = report.held_out, report.train
    lines = [
        f"fit: held-out relative error median {h.median:.1%}, p95 {h.p95:.1%}, max {h.max:.1%} on {h.num_shapes} shapes "
        f"(training shapes: median {t.median:.1%}, p95 {t.p95:.1%})",
    ]
    if report.held_out_by_kind:
        lines.append("     held out by kind: " + ", ".join(
            f"{kind} {s.median:.1%} median / {s.p95:.1%} p95 ({s.num_shapes})" for kind, s in report.held_out_by_kind
        ))
    lines.append("roofline fraction (median): " + ", ".join(f"{k} {v:.1%}" for k, v in report.roofline_fraction))
    return lines


def write_fit_report(report: FitReport, profile: Profile, profile_path: str | Path) -> Path:
    """Write the report as JSON beside the profile (``<profile>.fit.json``); return its path."""
    path = Path(str(profile_path) + ".fit.json")
    data = {
        "profile": Path(profile_path).name,
        "device": profile.meta.device,
        "device_name": profile.meta.device_name,
        "model": profile.meta.model.as_dict(),
        "held_out_share": HELD_OUT_SHARE,
        **dataclasses.asdict(report),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------------ the instance


def profile_instance(meta: ProfileMeta, engine: EngineConfig | None = None, *, full_layers: bool = True) -> InstanceConfig:
    """The instance a profile describes: its model shape (all real layers, or those built) on its device."""
    shape = meta.shape
    if full_layers:
        shape = shape.with_layers(shape.full_num_layers)
    bytes_per = BYTES_OF_DTYPE.get(meta.dtype, 2)
    accelerator = AcceleratorConfig(
        name=f"{meta.device}: {meta.device_name}",
        memory_bytes=meta.memory_bytes,
        peak_bf16_flops=meta.peak_flops,
        memory_bandwidth_bytes_per_s=meta.peak_bytes_per_s,
    )
    return InstanceConfig(
        accelerator=accelerator,
        model=shape.model_config(bytes_per),
        engine=engine or EngineConfig(block_size_tokens=meta.block_size),
    )


# ------------------------------------------------------------------------------------------ the model


class FittedProfileCostModel(CostModelBase):
    """Step times from a fitted profile table (see the module docstring); exact closed-form decode runs."""

    name = "profile"

    def __init__(
        self,
        table: FittedTable,
        *,
        layer_scale: float = 1.0,
        step_overhead_ns: int = 0,
        source: str = "",
        report: FitReport | None = None,
    ) -> None:
        if layer_scale <= 0:
            raise ReplayError(f"the layer scale must be positive, not {layer_scale}")
        self.table = table
        self.layer_scale = layer_scale
        self.step_overhead_ns = step_overhead_ns
        self.source = source
        self.report = report
        s = layer_scale
        chunk, decode, pair, ctx, key = table.attention
        self._chunk_ns, self._decode_ns, self._row_ns = chunk * s, decode * s, table.row_ns
        self._pair_ticks = round(pair * s * TICKS_PER_NS)
        self._ctx_ticks = round(ctx * s * TICKS_PER_NS)
        self._key_ticks = round(key * s * TICKS_PER_NS)
        self._fixed_cache: dict[tuple[int, int, int], int] = {}

    def _fixed_ns(self, tokens: int, rows: int, chunks: int, has_decode: int) -> int:
        key = (tokens, rows, chunks * 2 + has_decode)
        value = self._fixed_cache.get(key)
        if value is None:
            t = self.layer_scale * self.table.table(tokens) + chunks * self._chunk_ns + has_decode * self._decode_ns
            value = self._fixed_cache[key] = self.step_overhead_ns + max(1, round(t + rows * self._row_ns))
        return value

    def step_time_ns(self, shape: StepShape) -> int:
        tokens, rows, chunks, has_decode, pairs, ctx, keys = _terms(shape)
        ticks = pairs * self._pair_ticks + ctx * self._ctx_ticks + keys * self._key_ticks
        return self._fixed_ns(tokens, rows, chunks, has_decode) + -(-ticks // TICKS_PER_NS)

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun:
        d = num_decode_seqs
        const = self._fixed_ns(d, d, 0, 1 if d else 0)
        return single_line_run(const, context_tokens * self._key_ticks, d * self._key_ticks, max_steps, horizon_ns)

    def info(self) -> CostModelInfo:
        t = self.table
        params = [
            ("source", self.source),
            ("layer_scale", repr(self.layer_scale)),
            ("step_overhead_ns", str(self.step_overhead_ns)),
            ("knots", ",".join(map(str, t.knots))),
            ("table_ns", ",".join(f"{v:.1f}" for v in t.table_ns)),
            *((name, f"{v:.6g}") for name, v in zip(ATTENTION_TERMS, t.attention)),
            ("row_ns", f"{t.row_ns:.6g}"),
        ]
        if self.report is not None:
            params.append(("held_out_median_rel_error", f"{self.report.held_out.median:.4f}"))
            params.append(("held_out_p95_rel_error", f"{self.report.held_out.p95:.4f}"))
        return CostModelInfo(
            self.name, "step-time table fitted to a servelens profile (servelens profile); layers scaled", tuple(params)
        )


def load_fitted_model(instance: InstanceConfig, config: FittedProfileConfig) -> FittedProfileCostModel:
    """Read a profile, fit it, and scale it to the instance's layer count (the only I/O of this model)."""
    profile = read_profile(config.path)
    shape = profile.meta.shape
    m = instance.model
    mine = (m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim, m.intermediate_size)
    theirs = (shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size)
    if mine != theirs:
        raise ReplayError(
            f"the profile measured {shape.name} (hidden, heads, KV heads, head dim, MLP = {theirs}); "
            f"the replayed model {m.name} has {mine}",
            "replay with the profile's own model (servelens replay --profile FILE without --engine), or profile this model",
        )
    table, report = evaluate_profile(profile, config.seed)
    digest = hashlib.sha256(Path(config.path).read_bytes()).hexdigest()[:16]
    return FittedProfileCostModel(
        table,
        layer_scale=m.num_layers / shape.num_layers,
        step_overhead_ns=config.step_overhead_ns,
        source=f"{Path(config.path).name} (sha256 {digest}, {profile.meta.device}: {profile.meta.device_name})",
        report=report,
    )
