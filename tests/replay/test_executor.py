"""The step executor against a straightforward reference: whole sequences, no cache, explicit softmax."""

from __future__ import annotations

import math

import pytest

try:  # the dev extra pins PyTorch (`make env`): these CPU tests always run, never skip
    import torch
except ImportError as exc:  # pragma: no cover
    raise ImportError("PyTorch is missing: `make env` (pip install -e '.[dev]') installs the pinned torch==2.13.0") from exc

from replay.errors import ReplayError  # noqa: E402
from replay.measured.executor import (  # noqa: E402
    MEMORY_SHARE,
    SeqWork,
    StepExecutor,
    available_bytes,
    check_fits,
    executor_bytes,
)
from replay.measured.shapes import llama_shape  # noqa: E402


def reference_logits(ex: StepExecutor, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence, computed from scratch in float64 with a plain loop."""
    s = ex.shape
    d = lambda t: t.double().cpu()  # noqa: E731
    x = d(ex.embedding)[torch.tensor(tokens)]
    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float64)
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim))
    ang = pos[:, None] * inv[None, :]  # [n, D/2]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope(v: torch.Tensor) -> torch.Tensor:  # v: [n, heads, D], rotate pairs (i, i + D/2)
        half = s.head_dim // 2
        a, b = v[..., :half], v[..., half:]
        c, si = cos[:, None, :], sin[:, None, :]
        return torch.cat((a * c - b * si, b * c + a * si), dim=-1)

    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + s.rms_norm_eps) * d(w)

    qd, kvd = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    group = s.num_attention_heads // s.num_kv_heads
    for layer in ex.layers:
        h = norm(x, layer.input_norm)
        qkv = h @ d(layer.qkv)
        q = rope(qkv[:, :qd].reshape(n, s.num_attention_heads, s.head_dim))
        k = rope(qkv[:, qd:qd + kvd].reshape(n, s.num_kv_heads, s.head_dim))
        v = qkv[:, qd + kvd:].reshape(n, s.num_kv_heads, s.head_dim)
        out = torch.zeros(n, s.num_attention_heads, s.head_dim, dtype=torch.float64)
        for head in range(s.num_attention_heads):
            kv_head = head // group  # grouped-query attention: query head -> its KV head
            for i in range(n):
                scores = [float(q[i, head] @ k[j, kv_head]) / math.sqrt(s.head_dim) for j in range(i + 1)]
                top = max(scores)
                weights = [math.exp(sc - top) for sc in scores]
                total = sum(weights)
                for j, wgt in enumerate(weights):
                    out[i, head] += wgt / total * v[j, kv_head]
        x = x + out.reshape(n, qd) @ d(layer.o)
        h = norm(x, layer.post_norm)
        g, u = (h @ d(layer.gate_up)).chunk(2, dim=-1)
        x = x + (g * torch.sigmoid(g) * u) @ d(layer.down)
    return norm(x, ex.final_norm) @ d(ex.lm_head)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU case runs)")),
]


@pytest.fixture(scope="module", params=DEVICES)
def executor(request: pytest.FixtureRequest) -> StepExecutor:
    # float32 on both devices, so the same tolerance holds (CUDA's default is bf16)
    return StepExecutor(llama_shape("tiny"), device=request.param, num_kv_blocks=64, block_size=4, seed=3, dtype="float32")


def test_chunked_prefill_and_decodes_in_mixed_steps_match_the_reference(executor: StepExecutor) -> None:
    ex = executor
    ex.free_all()
    a = [5, 17, 200, 3, 9, 41, 77, 128, 255, 0, 12]  # 11 tokens: chunks of 6 and 3, then two decodes
    b = [7, 7, 100, 31, 64]  # 5 tokens: one chunk of 4, then a decode
    ref_a, ref_b = reference_logits(ex, a), reference_logits(ex, b)
    tol = dict(rtol=1e-4, atol=1e-5)
    # step 1: a's first chunk alone (no sampled row needed mid-prompt, but ask for it to check the rows)
    tokens = lambda values: torch.tensor(values, device=ex.device)  # noqa: E731
    out = ex.execute([SeqWork("a", 6, 0)], tokens(a[:6])).cpu()
    torch.testing.assert_close(out[0].double(), ref_a[5], **tol)
    # step 2: a's second chunk beside b's whole prompt
    out = ex.execute([SeqWork("a", 3, 6), SeqWork("b", 4, 0)], tokens(a[6:9] + b[:4])).cpu()
    torch.testing.assert_close(out[0].double(), ref_a[8], **tol)
    torch.testing.assert_close(out[1].double(), ref_b[3], **tol)
    # step 3: both decode (contexts of different lengths, batched and masked)
    out = ex.execute([SeqWork("a", 1, 9), SeqWork("b", 1, 4)], tokens([a[9], b[4]])).cpu()
    torch.testing.assert_close(out[0].double(), ref_a[9], **tol)
    torch.testing.assert_close(out[1].double(), ref_b[4], **tol)
    # step 4: a decodes alone; rows that do not sample give no logits
    out = ex.execute([SeqWork("a", 1, 10), SeqWork("c", 2, 0, sample=False)], tokens([a[10], 1, 2])).cpu()
    assert out.shape == (1, ex.shape.vocab_size)
    torch.testing.assert_close(out[0].double(), ref_a[10], **tol)
    ex.free_all()
    assert ex.num_free_blocks == ex.num_kv_blocks


def test_decodes_of_similar_contexts_share_a_masked_call(executor: StepExecutor) -> None:
    ex = executor
    ex.free_all()
    c, d, e = [3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2], [6, 6]
    refs = [reference_logits(ex, t) for t in (c, d, e)]
    tokens = lambda values: torch.tensor(values, device=ex.device)  # noqa: E731
    ex.execute([SeqWork("c", 6, 0), SeqWork("d", 8, 0), SeqWork("e", 1, 0)], tokens(c[:6] + d[:8] + e[:1]))
    # 7, 9 and 2 keys: c and d share one padded call (within 2x), e gets its own
    out = ex.execute([SeqWork("c", 1, 6), SeqWork("d", 1, 8), SeqWork("e", 1, 1)], tokens([c[6], d[8], e[1]])).cpu()
    for i, (ref, tokens) in enumerate(zip(refs, (c, d, e))):
        torch.testing.assert_close(out[i].double(), ref[len(tokens) - 1], rtol=1e-4, atol=1e-5)
    ex.free_all()


def test_grouped_query_heads_and_layers_come_from_the_shape(executor: StepExecutor) -> None:
    s = executor.shape
    assert s.num_attention_heads // s.num_kv_heads == 2
    assert len(executor.layers) == s.num_layers
    assert executor.k_cache[0].shape == (64 * 4, s.num_kv_heads, s.head_dim)
    assert executor.dtype == torch.float32
    default = StepExecutor(llama_shape("tiny"), device="cpu", num_kv_blocks=4)
    assert default.dtype == torch.float32  # the default: float32 on CPU (bf16 on CUDA)


def test_a_full_kv_cache_is_a_clean_error() -> None:
    ex = StepExecutor(llama_shape("tiny"), device="cpu", num_kv_blocks=2, block_size=4)
    with pytest.raises(ReplayError, match="KV cache is full"):
        ex.execute([SeqWork("a", 9, 0)])
    with pytest.raises(ReplayError, match="not a step"):
        ex.execute([SeqWork("b", 0, 0)])


def test_layer_scaling_and_unknown_shapes() -> None:
    scaled = llama_shape("llama-70b", 8)
    assert scaled.layer_scale == 10 and scaled.model_config(2).num_layers == 8
    with pytest.raises(ReplayError, match="valid names"):
        llama_shape("llama-7b")
    with pytest.raises(ReplayError, match="between 1 and 16"):
        llama_shape("llama-1b", 17)


def test_the_memory_estimate_is_what_the_executor_allocates(executor: StepExecutor) -> None:
    s = executor.shape
    tensors = [executor.embedding, executor.lm_head, executor.final_norm, *executor.k_cache, *executor.v_cache]
    tensors += [t for layer in executor.layers for t in layer.tensors()]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    fixed, per_layer = executor_bytes(s, executor.num_kv_blocks, executor.block_size, 4)
    draw = s.vocab_size * s.hidden_size * 4  # the embedding's float32 draw, held while it is converted
    norms = (2 * s.num_layers + 1) * s.hidden_size * 4  # the RMSNorm weights, left out of the estimate
    assert fixed + per_layer * s.num_layers == allocated + draw - norms


def test_an_executor_larger_than_free_memory_is_refused_with_the_layers_that_fit() -> None:
    cpu, shape = torch.device("cpu"), llama_shape("llama-1b")
    fixed, per_layer = executor_bytes(shape, 1024, 16, 4)
    free = int((fixed + 3.5 * per_layer) / MEMORY_SHARE)  # room for three and a half of its sixteen layers
    with pytest.raises(ReplayError, match=r"llama-1b with 16 layers and 1,024 KV blocks needs about 7.6 GiB on cpu, "
                                          r"and 4.4 GiB is free") as err:
        check_fits(shape, 1024, 16, 4, cpu, free=free)
    assert "at most 3 layers (`servelens profile --layers 3`" in err.value.hint
    check_fits(shape.with_layers(3), 1024, 16, 4, cpu, free=free)  # and three do fit
    with pytest.raises(ReplayError) as err:
        check_fits(shape, 1024, 16, 4, cpu, free=fixed)
    assert "smaller model shape" in err.value.hint


def test_the_executor_reads_free_memory_and_refuses_what_no_machine_has() -> None:
    free = available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free < 2**50  # Linux's MemAvailable, in bytes
    with pytest.raises(ReplayError, match="GiB is free"):  # 40 PiB of KV pools, refused before allocating
        StepExecutor(llama_shape("llama-1b"), device="cpu", num_kv_blocks=2**30)
