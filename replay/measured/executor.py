"""The step executor: one engine step as one real forward pass of a Llama-architecture decoder.

``StepExecutor.execute(work)`` runs exactly what one engine step composed: every sequence in
``work`` brings ``num_new_tokens`` tokens (a prefill chunk, or 1 for a decode) on top of
``num_context_tokens`` already in its KV cache. All the step's tokens go through the linear layers
together (one matrix product per weight, as a serving engine batches them); attention is per
sequence over its own context, causal inside a chunk:

- decode tokens (one new token each) batched by context length: sequences whose contexts are
  within a factor of two share one call over keys gathered to the group's longest (shorter ones
  masked), so the work stays within 2x of the keys actually read (paged attention reads exactly
  those) in a handful of calls;
- each prefill chunk in its own call over its context plus the chunk.

Grouped KV heads are handled without any backend's GQA support: the query heads that share a KV
head are laid out as that head's query rows (a decode's group of heads as a group of queries), and
every call takes an explicit boolean mask, so CPU and CUDA run the same formulation.

The model: token embedding, per layer RMSNorm -> fused QKV projection -> rotary embedding (the
rotate-half form of Hugging Face Llama) -> attention with grouped KV heads -> output projection and
residual -> RMSNorm -> gated SiLU MLP and residual; a final RMSNorm and an untied LM head over the
rows that sample (the last new token of each sequence that asks for it). Weights are random
(seeded normal, std 0.02; norms ones): timing needs the shapes, never the values, and nothing is
downloaded. bf16 on CUDA, float32 on CPU.

The KV cache is paged (vLLM-style): per layer one pool of ``num_kv_blocks`` blocks of
``block_size`` tokens, and a block table per sequence, grown as its context grows and returned with
``free``. Writing a step's keys and values is one scatter per layer; reading them one gather.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from replay.errors import ReplayError
from replay.measured.shapes import LlamaShape
from servelens.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICES = ("cpu", "cuda")


def require_torch():
    """The ``torch`` module, or a clean error saying how to install the optional extra."""
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(
            "PyTorch is not installed: the step executor, the profiler and the measured replay need it",
            "pip install 'servelens[gpu]' (pins torch==2.13.0; `make env` installs it with the dev extra)",
        ) from exc
    return torch


def resolve_device(device: str):
    """The torch device for ``cpu`` or ``cuda`` (a clean error when CUDA is not there)."""
    torch = require_torch()
    if device not in DEVICES:
        raise ReplayError(f"unknown device {device!r}", f"valid devices: {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ReplayError(
            "--device cuda: no CUDA device is visible to PyTorch",
            f"torch {torch.__version__} (a CPU build has no CUDA); use --device cpu, or install a CUDA build of torch",
        )
    return torch.device(device)


def executor_bytes(shape: LlamaShape, num_kv_blocks: int, block_size: int, element_bytes: int) -> tuple[int, int]:
    """What a ``StepExecutor`` allocates, bytes: (the part that does not grow with the layers built,
    the part each built layer adds). The first holds the embedding, the LM head and, while a weight is
    drawn, its float32 draw (the largest: the embedding's); the second a layer's weights and KV pools."""
    s = shape
    q_dim, kv_dim = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer_weights = s.hidden_size * (q_dim + 2 * kv_dim) + q_dim * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    kv_pools = 2 * num_kv_blocks * block_size * kv_dim
    fixed = 2 * s.vocab_size * s.hidden_size * element_bytes + s.vocab_size * s.hidden_size * 4
    return fixed, (layer_weights + kv_pools) * element_bytes


def available_bytes(device) -> int | None:
    """Memory free for new tensors on ``device`` (CUDA: the driver's free memory; CPU: Linux's
    MemAvailable), or None where it cannot be read."""
    torch = require_torch()
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: The share of free memory the executor's tensors may take: the rest is the steps' activations.
MEMORY_SHARE = 0.9


def check_fits(shape: LlamaShape, num_kv_blocks: int, block_size: int, element_bytes: int, device,
               free: int | None = None) -> None:
    """Refuse, before allocating, an executor that would not fit ``free`` bytes (default: the device's
    free memory now), where the kernel would kill the process or CUDA fail part way; the error names
    the sizes and the layers that fit."""
    free = available_bytes(device) if free is None else free
    if free is None:
        return
    fixed, per_layer = executor_bytes(shape, num_kv_blocks, block_size, element_bytes)
    need, room = fixed + per_layer * shape.num_layers, MEMORY_SHARE * free
    if need <= room:
        return
    fits = int((room - fixed) // per_layer)
    hint = (f"build at most {fits} layers (`servelens profile --layers {fits}`: the fitted model scales them to all "
            f"{shape.full_num_layers})"
            if fits >= 1 else "profile a smaller model shape, or on a device with more memory")
    raise ReplayError(
        f"{shape.name} with {shape.num_layers} layers and {num_kv_blocks:,} KV blocks needs about "
        f"{need / 2**30:,.1f} GiB on {device.type}, and {free / 2**30:,.1f} GiB is free", hint
    )


class SeqWork(NamedTuple):
    """One sequence's part of a step."""

    seq_id: Hashable  # names the sequence's KV cache across steps
    num_new_tokens: int  # the chunk's tokens (1 for a decode)
    num_context_tokens: int  # tokens already in the sequence's KV cache before this step
    sample: bool = True  # compute logits for the last new token


class _StepPlan(NamedTuple):
    """A step's tokens laid out (``StepExecutor._plan``)."""

    positions: list[int]
    slots: list[int]  # cache slots of the new tokens
    decode_rows: list[int]  # token rows of one-token sequences
    decode_tables: list[list[int]]  # their block tables
    decode_lengths: list[int]  # their keys: context + the new token
    chunks: list[tuple[int, int, int, list[int]]]  # (first row, tokens, context, block table)
    sample_rows: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights (matrices as [in, out])."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # fused query, key and value projections
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # fused gate and up projections of the MLP
    down: torch.Tensor

    def tensors(self) -> tuple:
        return (self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down)


class StepExecutor:
    """A random-weight Llama decoder with a paged KV cache; ``execute`` runs one step."""

    def __init__(
        self,
        shape: LlamaShape,
        *,
        device: str = "cpu",
        num_kv_blocks: int = 1024,
        block_size: int = 16,
        seed: int = 0,
        dtype: str | None = None,
    ) -> None:
        torch = require_torch()
        self.torch = torch
        self.shape = shape
        self.device = resolve_device(device)
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
            dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        ]
        if num_kv_blocks < 1 or block_size < 1:
            raise ReplayError("the KV cache needs at least one block of at least one token")
        check_fits(shape, num_kv_blocks, block_size, torch.finfo(self.dtype).bits // 8, self.device)
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        s = shape
        gen = torch.Generator(device=self.device).manual_seed(seed)
        dev, dt = self.device, self.dtype

        def normal(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)

        q_dim, kv_dim = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embedding = normal(s.vocab_size, s.hidden_size)
        self.layers = [
            LayerWeights(
                input_norm=torch.ones(s.hidden_size, device=dev, dtype=dt),
                qkv=normal(s.hidden_size, q_dim + 2 * kv_dim),
                o=normal(q_dim, s.hidden_size),
                post_norm=torch.ones(s.hidden_size, device=dev, dtype=dt),
                gate_up=normal(s.hidden_size, 2 * s.intermediate_size),
                down=normal(s.intermediate_size, s.hidden_size),
            )
            for _ in range(s.num_layers)
        ]
        self.final_norm = torch.ones(s.hidden_size, device=dev, dtype=dt)
        self.lm_head = normal(s.hidden_size, s.vocab_size)
        self.inv_freq = 1.0 / (
            s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=dev, dtype=torch.float32) / s.head_dim)
        )
        cache_shape = (num_kv_blocks * block_size, s.num_kv_heads, s.head_dim)
        self.k_cache = [torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(s.num_layers)]
        self._free_blocks = list(range(num_kv_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._token_gen = torch.Generator(device=self.device).manual_seed(seed + 1)

    # ------------------------------------------------------------------ the KV block tables

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def _ensure(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        table = self._tables.setdefault(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free_blocks):
            raise ReplayError(
                f"the executor's KV cache is full: {self.num_kv_blocks} blocks of {self.block_size} tokens",
                "give the executor more KV blocks (num_kv_blocks), or replay fewer or shorter requests",
            )
        for _ in range(need):
            table.append(self._free_blocks.pop())
        return table

    def free(self, seq_id: Hashable) -> None:
        """Return a sequence's KV blocks to the pool (a no-op for an unknown sequence)."""
        table = self._tables.pop(seq_id, None)
        if table:
            self._free_blocks.extend(reversed(table))

    def free_all(self) -> None:
        for seq_id in list(self._tables):
            self.free(seq_id)

    # ------------------------------------------------------------------ the step

    def random_tokens(self, num_tokens: int):
        return self.torch.randint(
            0, self.shape.vocab_size, (num_tokens,), generator=self._token_gen, device=self.device
        )

    def execute(self, work: Sequence[SeqWork], token_ids=None):
        """Run one step; return the logits of the sampling rows (float32, one row per sampling sequence).

        ``token_ids`` (one per new token, in ``work`` order) default to random tokens. The call returns
        when the work is queued on the device: ``synchronize`` before reading a clock.
        """
        torch = self.torch
        if not work:
            raise ReplayError("a step has at least one sequence")
        s = self.shape
        plan = self._plan(work)
        num_tokens = plan.num_tokens
        if token_ids is None:
            token_ids = self.random_tokens(num_tokens)
        elif len(token_ids) != num_tokens:
            raise ReplayError(f"{len(token_ids)} token ids for a step of {num_tokens} tokens")
        pos_t = self._as_long(plan.positions)
        slot_t = self._as_long(plan.slots)
        freqs = pos_t.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cos(freqs).repeat(1, 2)[:, None, :].to(self.dtype)  # [T, 1, D]
        sin = torch.sin(freqs).repeat(1, 2)[:, None, :].to(self.dtype)
        decode_buckets = self._decode_buckets(plan)
        chunk_views = self._chunk_views(plan.chunks)
        x = self.embedding[token_ids]
        for i, layer in enumerate(self.layers):
            x = self._layer(x, layer, self.k_cache[i], self.v_cache[i], cos, sin, slot_t, decode_buckets, chunk_views)
        if not plan.sample_rows:
            return torch.empty((0, s.vocab_size), device=self.device, dtype=torch.float32)
        last = self._rms_norm(x[self._as_long(plan.sample_rows)], self.final_norm)
        return (last @ self.lm_head).float()

    def _as_long(self, values):
        return self.torch.tensor(values, dtype=self.torch.long, device=self.device)

    def _plan(self, work: Sequence[SeqWork]) -> _StepPlan:
        """Lay out a step's tokens: their positions and cache slots (growing the block tables), the decode
        rows and the prefill chunks, the rows that sample."""
        bs = self.block_size
        plan = _StepPlan([], [], [], [], [], [], [], 0)
        row = 0
        for w in work:
            n, ctx = w.num_new_tokens, w.num_context_tokens
            if n < 1 or ctx < 0:
                raise ReplayError(f"sequence {w.seq_id!r}: {n} new tokens over {ctx} context tokens is not a step")
            table = self._ensure(w.seq_id, ctx + n)
            plan.slots.extend(table[p // bs] * bs + p % bs for p in range(ctx, ctx + n))
            plan.positions.extend(range(ctx, ctx + n))
            if n == 1:
                plan.decode_rows.append(row)
                plan.decode_tables.append(table)
                plan.decode_lengths.append(ctx + 1)
            else:
                plan.chunks.append((row, n, ctx, table))
            row += n
            if w.sample:
                plan.sample_rows.append(row - 1)
        return plan._replace(num_tokens=row)

    def _decode_buckets(self, plan: _StepPlan) -> list:
        """(rows, key slots, mask) of each group of decode sequences that share one attention call."""
        if not plan.decode_rows:
            return []
        torch, bs, as_long = self.torch, self.block_size, self._as_long
        lengths_of, tables_of = plan.decode_lengths, plan.decode_tables
        # sequences of similar context (the longest at most twice the shortest) share one padded
        # call: work stays within 2x of the keys read (as in paged attention), in a few calls
        order = sorted(range(len(plan.decode_rows)), key=lambda i: -lengths_of[i])
        groups: list[list[int]] = []
        for i in order:
            if not groups or lengths_of[i] * 2 <= lengths_of[groups[-1][0]]:
                groups.append([])
            groups[-1].append(i)
        buckets = []
        for members in groups:
            longest = lengths_of[members[0]]
            widest = -(-longest // bs)
            tables = as_long([tables_of[i][:widest] + [0] * (widest - min(widest, len(tables_of[i])))
                              for i in members])  # [b, blocks]
            pos = torch.arange(longest, device=self.device)
            keys_t = tables[:, pos // bs] * bs + pos % bs  # [b, longest]
            lengths = as_long([lengths_of[i] for i in members])
            mask = (pos[None, :] < lengths[:, None])[:, None, None, :]
            buckets.append((as_long([plan.decode_rows[i] for i in members]), keys_t, mask))
        return buckets

    def _chunk_views(self, chunks: list[tuple[int, int, int, list[int]]]) -> list:
        """(first row, tokens, key slots, causal mask) of each prefill chunk."""
        torch, bs, dev = self.torch, self.block_size, self.device
        group = self.shape.num_attention_heads // self.shape.num_kv_heads
        views = []
        for first, n, ctx, table in chunks:
            pos = torch.arange(ctx + n, device=dev)
            keys_t = self._as_long(table)[pos // bs] * bs + pos % bs
            mask = pos[None, :] <= (ctx + torch.arange(n, device=dev))[:, None]  # [n, ctx + n], causal
            # rows are (token, query head of the group): each token's row repeated once per group member
            views.append((first, n, keys_t, mask.repeat_interleave(group, dim=0)[None, None]))
        return views

    def _layer(self, x, layer: LayerWeights, kc, vc, cos, sin, slot_t, decode_buckets, chunk_views):
        """One decoder layer over the step's tokens ``x``, writing their keys and values to the cache (kc, vc)."""
        s = self.shape
        num_tokens = x.shape[0]
        q_dim, kv_dim = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
        h = self._rms_norm(x, layer.input_norm)
        qkv = h @ layer.qkv
        q = qkv[:, :q_dim].view(num_tokens, s.num_attention_heads, s.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].view(num_tokens, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_dim + kv_dim:].view(num_tokens, s.num_kv_heads, s.head_dim)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        kc[slot_t] = k
        vc[slot_t] = v
        attn = self._attention(q, kc, vc, decode_buckets, chunk_views)
        x = x + attn.reshape(num_tokens, q_dim) @ layer.o
        h = self._rms_norm(x, layer.post_norm)
        gate, up = (h @ layer.gate_up).chunk(2, dim=-1)
        return x + (self.torch.nn.functional.silu(gate) * up) @ layer.down

    def _attention(self, q, kc, vc, decode_buckets, chunk_views):
        """Attention of the step's queries ``q`` over the cached keys and values."""
        s = self.shape
        group = s.num_attention_heads // s.num_kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        attn = self.torch.empty_like(q)
        # grouped-query attention as plain attention per KV head: the query heads sharing a KV head
        # (h = kv_head * group + g) are that head's query rows, so no backend needs GQA support
        for rows_t, keys_t, mask in decode_buckets:
            b = rows_t.numel()
            qd = q[rows_t].view(b, s.num_kv_heads, group, s.head_dim)  # [b, Hkv, G, D]
            kd = kc[keys_t].transpose(1, 2)  # [b, Hkv, L, D]
            vd = vc[keys_t].transpose(1, 2)
            attn[rows_t] = sdpa(qd, kd, vd, attn_mask=mask, scale=scale).reshape(b, s.num_attention_heads, s.head_dim)
        for first, n, keys_t, mask in chunk_views:
            qc = q[first:first + n].view(n, s.num_kv_heads, group, s.head_dim).transpose(0, 1)
            qc = qc.reshape(1, s.num_kv_heads, n * group, s.head_dim)  # rows (token, g)
            kk = kc[keys_t].transpose(0, 1)[None]  # [1, Hkv, ctx + n, D]
            vv = vc[keys_t].transpose(0, 1)[None]
            out = sdpa(qc, kk, vv, attn_mask=mask, scale=scale).view(s.num_kv_heads, n, group, s.head_dim)
            attn[first:first + n] = out.transpose(0, 1).reshape(n, s.num_attention_heads, s.head_dim)
        return attn

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _rms_norm(self, x, weight):
        torch = self.torch
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return xf.to(x.dtype) * weight

    def _rotate_half(self, x):
        half = x.shape[-1] // 2
        return self.torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    # ------------------------------------------------------------------ what it occupies

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embedding, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors.extend(layer.tensors())
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_element(self) -> int:
        return self.torch.empty((), dtype=self.dtype).element_size()
