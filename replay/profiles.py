"""The profile-table cost model: measured GPU operator timings, interpolated over the step's shape.

Reads Vidur's operator profiles (``<shared>/profiles/vidur``, MIT; read in place, never copied):

- ``compute/<gpu>/<model>/mlp.csv``: per layer, every non-attention operator (layernorms, QKV and
  output projections, rotary embedding, gated MLP, residual add) by the step's token count and
  tensor-parallel degree; summed as Vidur's ``ExecutionTime`` does (embedding excluded) and
  interpolated linearly between measured token counts (extrapolated beyond the ends);
- ``attention_tp<N>.csv`` where it exists: FlashAttention prefill by chunk and KV size, decode by
  batch size and mean KV size (bilinear inside the measured grid);
- ``network/<gpu>_dgx/all_reduce.csv``: all-reduce time by message size, for TP > 1.

Attention outside what was measured is the roofline's attention term (``replay.costmodel``). Only
``load_profile_tables`` reads files; the model's constructor does no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

from replay.config import InstanceConfig
from replay.costmodel import (
    TICKS_PER_NS,
    AffineDecode,
    CostModelBase,
    CostModelInfo,
    DecodeRun,
    RooflineConfig,
    StepShape,
    UnitCosts,
)
from schemas.types import doc
from servelens.errors import DataNotFoundError

#: Per-layer non-attention operators of a Vidur ``mlp.csv``, summed like Vidur's ExecutionTime
#: (embedding excluded, as Vidur's model_time does; the residual add counted once per layer).
LAYER_OPERATORS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileCostConfig:
    """Where the measured profiles are and what is added to them."""

    profile_dir: str | None = doc(
        "Folder holding compute/ and network/ (Vidur layout). Unset: <shared>/profiles/vidur.", None
    )
    step_overhead_ns: int = doc("Fixed CPU time per step (not in the operator profiles), ns.", 0)
    roofline: RooflineConfig = doc("Efficiencies of the roofline terms that fill in attention.", RooflineConfig())


@dataclass(frozen=True, slots=True)
class Curve:
    """A measured time (ns) as a function of one size, interpolated linearly, extrapolated from the ends."""

    xs: tuple[int, ...]
    ys_ns: tuple[float, ...]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys_ns
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class AttentionTable:
    """Measured per-layer attention kernel times (ns) over batch shapes (Vidur ``attention*.csv``)."""

    decode_batch_sizes: tuple[int, ...]
    decode_kv_sizes: tuple[int, ...]
    decode_ns: tuple[tuple[float, ...], ...]  # [batch index][kv index]
    prefill_chunks: tuple[int, ...]
    prefill_by_chunk: tuple[Curve, ...]  # time by kv size, for each measured chunk size

    def decode(self, batch_size: int, mean_kv: float) -> float | None:
        bs, kv = self.decode_batch_sizes, self.decode_kv_sizes
        if not (bs[0] <= batch_size <= bs[-1] and kv[0] <= mean_kv <= kv[-1]):
            return None
        i = min(bisect.bisect_right(bs, batch_size) - 1, len(bs) - 2)
        j = min(bisect.bisect_right(kv, mean_kv) - 1, len(kv) - 2)
        u = (batch_size - bs[i]) / (bs[i + 1] - bs[i])
        v = (mean_kv - kv[j]) / (kv[j + 1] - kv[j])
        t = self.decode_ns
        return (
            t[i][j] * (1 - u) * (1 - v) + t[i + 1][j] * u * (1 - v) + t[i][j + 1] * (1 - u) * v + t[i + 1][j + 1] * u * v
        )

    def prefill(self, chunk: int, context: int) -> float | None:
        cs = self.prefill_chunks
        if not cs[0] <= chunk <= cs[-1]:
            return None
        i = min(bisect.bisect_right(cs, chunk) - 1, len(cs) - 2)
        lo, hi = self.prefill_by_chunk[i], self.prefill_by_chunk[i + 1]
        if not (lo.xs[0] <= context <= lo.xs[-1] and hi.xs[0] <= context <= hi.xs[-1]):
            return None
        u = (chunk - cs[i]) / (cs[i + 1] - cs[i])
        return lo(context) * (1 - u) + hi(context) * u


@dataclass(frozen=True, slots=True)
class ProfileTables:
    """The measured profiles for one model, accelerator and tensor-parallel degree."""

    layer: Curve  # non-attention operators of one layer, by tokens in the step
    attention: AttentionTable | None
    all_reduce: Curve | None  # by message bytes
    sources: tuple[str, ...]  # files read, relative to the profile folder


class ProfileCostModel(CostModelBase):
    """Measured operator times interpolated over the step's shape; roofline attention where unmeasured.

    step = overhead + layers x (non-attention ops at the step's token count + attention
    + 2 all-reduces of the step's activations). Attention per layer comes from the measured table
    when the shape lies inside it, otherwise from the roofline (max of its FLOPs and KV-bytes terms).
    """

    name = "profile"

    def __init__(self, instance: InstanceConfig, tables: ProfileTables, config: ProfileCostConfig | None = None) -> None:
        self.instance = instance
        self.tables = tables
        self.config = config or ProfileCostConfig()
        self.units = UnitCosts(instance, self.config.roofline)
        self._layers = instance.model.num_layers
        self._fixed_cache: dict[int, int] = {}  # bounded by the step token budget

    def _fixed_ns(self, num_tokens: int) -> int:
        """Overhead + all layers' non-attention operators + all-reduces at this token count, integer ns."""
        cached = self._fixed_cache.get(num_tokens)
        if cached is not None:
            return cached
        t = self.tables
        per_layer = t.layer(num_tokens)
        if t.all_reduce is not None and self.instance.accelerator.tensor_parallel_size > 1:
            per_layer += 2 * t.all_reduce(num_tokens * self.instance.model.hidden_size * 2)
        value = self.config.step_overhead_ns + round(self._layers * per_layer)
        self._fixed_cache[num_tokens] = value
        return value

    def _roofline_attention_ticks(self, pairs: int, kv_tokens: int) -> int:
        u = self.units
        return max(pairs * u.attention_pair, kv_tokens * u.kv_token)

    def step_time_ns(self, shape: StepShape) -> int:
        att = self.tables.attention
        measured_ns = 0.0
        pairs = kv_tokens = num_prefill = 0
        for c, o in shape.prefill_chunks:
            num_prefill += c
            t = att.prefill(c, o) if att is not None else None
            if t is None:
                pairs += c * o + c * (c + 1) // 2
                kv_tokens += o + c
            else:
                measured_ns += t * self._layers
        d, ctx = shape.num_decode_seqs, shape.decode_context_tokens
        if d:
            t = att.decode(d, ctx / d) if att is not None else None
            if t is None:
                pairs += ctx
                kv_tokens += ctx
            else:
                measured_ns += t * self._layers
        modelled = -(-self._roofline_attention_ticks(pairs, kv_tokens) // TICKS_PER_NS)
        return self._fixed_ns(num_prefill + d) + round(measured_ns) + modelled

    def decode_run(
        self, num_decode_seqs: int, context_tokens: int, max_steps: int, horizon_ns: int | None
    ) -> DecodeRun:
        if self.tables.attention is not None:  # measured attention is piecewise: step one by one
            return CostModelBase.decode_run(self, num_decode_seqs, context_tokens, max_steps, horizon_ns)
        u, d = self.units, num_decode_seqs
        f = AffineDecode(
            self._fixed_ns(d),
            context_tokens * u.attention_pair,
            d * u.attention_pair,
            context_tokens * u.kv_token,
            d * u.kv_token,
        )
        return f.run(max_steps, horizon_ns)

    def info(self) -> CostModelInfo:
        return CostModelInfo(
            self.name,
            "Vidur operator profiles interpolated by token count; attention measured where profiled, else roofline",
            (
                ("sources", ";".join(self.tables.sources)),
                ("step_overhead_ns", str(self.config.step_overhead_ns)),
                ("roofline_compute_efficiency", repr(self.config.roofline.compute_efficiency)),
                ("roofline_memory_efficiency", repr(self.config.roofline.memory_efficiency)),
            ),
        )


def load_profile_tables(instance: InstanceConfig, profile_dir: Path) -> ProfileTables:
    """Read and reduce the Vidur profiles that match the instance (the only I/O of the profile model)."""
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    acc, m = instance.accelerator, instance.model
    tp = acc.tensor_parallel_size
    if acc.profile_name is None or m.profile_name is None:
        raise DataNotFoundError(
            f"no measured profile for {m.name} on {acc.name}",
            "profiles exist for a100-80g (llama-3-8b, llama-2-7b, llama-2-70b) and h100-sxm (llama-2-7b, "
            "llama-2-70b); use --cost-model roofline otherwise",
        )
    folder = profile_dir / "compute" / acc.profile_name / m.profile_name
    mlp_path = folder / "mlp.csv"
    if not mlp_path.is_file():
        raise DataNotFoundError(
            f"no measured profile for {m.name} on {acc.name}: {mlp_path} does not exist",
            "profiles exist for a100-80g (llama-3-8b, llama-2-7b, llama-2-70b) and h100-sxm (llama-2-7b, "
            "llama-2-70b); use --cost-model roofline otherwise",
        )
    t = pacsv.read_csv(mlp_path)
    mask = pc.and_(pc.equal(t["num_tensor_parallel_workers"], tp), pc.equal(t["n_embd"], m.hidden_size))
    t = t.filter(mask).sort_by("num_tokens")
    if t.num_rows == 0:
        raise DataNotFoundError(f"{mlp_path} has no rows for tensor-parallel degree {tp}")
    total = None
    for op in LAYER_OPERATORS:
        col = pc.fill_null(t[f"time_stats.{op}.median"], 0.0)
        total = col if total is None else pc.add(total, col)
    by_tokens: dict[int, list[float]] = {}
    for n, ms in zip(t["num_tokens"].to_pylist(), total.to_pylist()):
        by_tokens.setdefault(n, []).append(ms * 1e6)
    xs = tuple(sorted(by_tokens))
    layer = Curve(xs, tuple(sum(by_tokens[x]) / len(by_tokens[x]) for x in xs))
    sources = [str(mlp_path.relative_to(profile_dir))]

    attention = None
    att_path = folder / f"attention_tp{tp}.csv"
    if att_path.is_file():
        attention = _attention_table(pacsv.read_csv(att_path), m.num_attention_heads, m.num_kv_heads, instance)
        sources.append(str(att_path.relative_to(profile_dir)))

    all_reduce = None
    if tp > 1:
        ar_path = profile_dir / "network" / f"{acc.profile_name}_dgx" / "all_reduce.csv"
        if ar_path.is_file():
            ar = pacsv.read_csv(ar_path)
            ar = ar.filter(pc.and_(pc.equal(ar["num_workers"], tp), pc.equal(ar["devices_per_node"], tp)))
            pts = sorted(zip(ar["size"].to_pylist(), ar["time_stats.all_reduce.median"].to_pylist()))
            if pts:
                all_reduce = Curve(tuple(p[0] for p in pts), tuple(p[1] * 1e6 for p in pts))
                sources.append(str(ar_path.relative_to(profile_dir)))
    return ProfileTables(layer, attention, all_reduce, tuple(sources))


def _attention_table(t, num_q_heads: int, num_kv_heads: int, instance: InstanceConfig) -> AttentionTable | None:
    import pyarrow.compute as pc

    t = t.filter(
        pc.and_(
            pc.equal(t["n_q_head"], num_q_heads),
            pc.and_(pc.equal(t["n_kv_head"], num_kv_heads), pc.equal(t["block_size"], instance.engine.block_size_tokens)),
        )
    )
    if t.num_rows == 0:
        return None
    rows = t.select(
        ["is_prefill", "batch_size", "prefill_chunk_size", "kv_cache_size", "time_stats.attn_decode.median",
         "time_stats.attn_prefill.median", "time_stats.attn_input_reshape.median", "time_stats.attn_output_reshape.median"]
    ).to_pylist()
    decode: dict[tuple[int, int], list[float]] = {}
    prefill: dict[int, dict[int, list[float]]] = {}
    for r in rows:
        reshape = (r["time_stats.attn_input_reshape.median"] or 0.0) + (r["time_stats.attn_output_reshape.median"] or 0.0)
        if r["is_prefill"]:
            ms = r["time_stats.attn_prefill.median"]
            if ms is not None:
                prefill.setdefault(r["prefill_chunk_size"], {}).setdefault(r["kv_cache_size"], []).append((ms + reshape) * 1e6)
        else:
            ms = r["time_stats.attn_decode.median"]
            if ms is not None:
                decode.setdefault((r["batch_size"], r["kv_cache_size"]), []).append((ms + reshape) * 1e6)
    bs = tuple(sorted({b for b, _ in decode}))
    kv = tuple(sorted({k for _, k in decode}))
    if len(bs) < 2 or len(kv) < 2 or any((b, k) not in decode for b in bs for k in kv):
        return None  # not a full grid: leave decode attention to the roofline
    grid = tuple(tuple(sum(decode[b, k]) / len(decode[b, k]) for k in kv) for b in bs)
    chunks = tuple(c for c in sorted(prefill) if len(prefill[c]) >= 2)
    curves = tuple(
        Curve(tuple(sorted(prefill[c])), tuple(sum(prefill[c][k]) / len(prefill[c][k]) for k in sorted(prefill[c])))
        for c in chunks
    )
    return AttentionTable(bs, kv, grid, chunks, curves)
