"""Typed configuration of one modelled serving instance: accelerator, model shape, engine settings.

Frozen slotted dataclasses, each field with help text (``schemas.types.doc``), names carrying their
units. Presets by name (``ACCELERATORS``, ``MODELS``) give published figures; ``instance_config``
assembles an instance from them, and an unknown name raises an error listing the valid ones.
Constructors do no I/O.

Published figures used by the presets (NVIDIA data sheets; dense, no sparsity; bf16 / fp8):

- A100 SXM 80 GB: 312 TFLOP/s bf16 (no fp8), 2.039 TB/s HBM2e, NVLink 3 600 GB/s (300 GB/s each way).
- A100 SXM 40 GB: 312 TFLOP/s bf16, 1.555 TB/s HBM2, NVLink 3.
- H100 SXM 80 GB: 989 / 1,979 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 GB/s each way).
- H100 PCIe 80 GB: 756 / 1,513 TFLOP/s, 2.0 TB/s HBM2e, PCIe 5 x16 (64 GB/s each way).
- H200 SXM 141 GB: 989 / 1,979 TFLOP/s, 4.8 TB/s HBM3e, NVLink 4.
- L40S 48 GB: 362 / 733 TFLOP/s, 864 GB/s GDDR6, PCIe 4 x16 (32 GB/s each way), no NVLink.
- B200 180 GB (HGX): 2,250 / 4,500 TFLOP/s, 8 TB/s HBM3e, NVLink 5 1.8 TB/s (900 GB/s each way).
- Llama and Mistral shapes from the models' Hugging Face ``config.json``; any other model through
  ``replay.catalog`` (a ``config.json`` file or folder, or the fidelity data's ``models.csv``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

from replay.errors import ReplayError, unknown_name
from schemas.types import doc

GIB = 2**30

PreemptionMode = Literal["recompute", "swap"]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 < value < math.inf:
            raise ReplayError(f"{type(obj).__name__}.{name} must be positive and finite, not {value!r}")


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 <= value < math.inf:
            raise ReplayError(f"{type(obj).__name__}.{name} must be >= 0 and finite, not {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceleratorConfig:
    """The accelerators of one instance (all ``tensor_parallel_size`` x ``pipeline_parallel_size`` alike)."""

    name: str = doc("Accelerator name, e.g. 'h100-sxm'.")
    memory_bytes: int = doc("Device memory of one accelerator, bytes.")
    peak_bf16_flops: float = doc("Dense bf16 peak of one accelerator, FLOP/s.")
    memory_bandwidth_bytes_per_s: float = doc("Device memory bandwidth of one accelerator, bytes/s.")
    peak_fp8_flops: float | None = doc(
        "Dense fp8 peak of one accelerator, FLOP/s; None where it has no fp8 tensor cores (fp8 weights then "
        "run weight-only: fp8 bytes, bf16 math).", None
    )
    tensor_parallel_size: int = doc("Accelerators the model is sharded over (tensor parallelism).", 1)
    pipeline_parallel_size: int = doc("Pipeline stages the layers are split over (each stage tensor_parallel_size wide).", 1)
    interconnect: str = doc("Interconnect between the instance's accelerators, e.g. 'nvlink4' or 'pcie4'.", "nvlink")
    interconnect_bandwidth_bytes_per_s: float = doc(
        "Per-accelerator interconnect bandwidth in one direction, bytes/s (all-reduce cost).", 300e9
    )
    interconnect_latency_ns: int = doc("Fixed latency of one all-reduce, ns.", 10_000)
    profile_name: str | None = doc(
        "Folder name of this accelerator in the Vidur profiles (profiles/vidur/compute/<name>), if any.", None
    )

    def __post_init__(self) -> None:
        _positive(self, "memory_bytes", "peak_bf16_flops", "memory_bandwidth_bytes_per_s", "tensor_parallel_size",
                  "pipeline_parallel_size")

    @property
    def num_devices(self) -> int:
        """Accelerators of the instance: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def peak_flops(self, dtype: str) -> float:
        """Dense peak of one accelerator for the math in ``dtype`` ('bf16' or 'fp8'; fp8 without fp8 tensor
        cores runs at the bf16 peak)."""
        return self.peak_fp8_flops if dtype == "fp8" and self.peak_fp8_flops else self.peak_bf16_flops


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The shape of a decoder-only transformer, dense or mixture-of-experts (Llama, Mistral, Qwen, Mixtral)."""

    name: str = doc("Model name, e.g. 'llama-3-8b' or a Hugging Face id.")
    num_layers: int = doc("Transformer layers.")
    hidden_size: int = doc("Hidden (embedding) dimension.")
    num_attention_heads: int = doc("Query heads.")
    num_kv_heads: int = doc("Key/value heads (grouped-query attention when fewer than query heads).")
    head_dim: int = doc("Dimension of one attention head.")
    intermediate_size: int = doc("Inner dimension of the gated MLP of a dense layer.")
    vocab_size: int = doc("Vocabulary size (embedding rows, LM-head columns).")
    bytes_per_param: int = doc("Bytes of one weight (2 for bf16/fp16, 1 for fp8).", 2)
    kv_bytes_per_element: int = doc("Bytes of one cached key or value element (2 for bf16, 1 for fp8).", 2)
    compute_dtype: Literal["bf16", "fp8"] = doc(
        "Precision of the linear layers' math: fp8 (W8A8, e.g. fp8-dynamic checkpoints) where the accelerator has "
        "fp8 tensor cores, else bf16.", "bf16"
    )
    num_experts: int = doc("Routed experts of a mixture-of-experts layer (0: a dense model).", 0)
    experts_per_token: int = doc("Routed experts each token uses (top-k).", 0)
    moe_intermediate_size: int | None = doc("Inner dimension of one routed expert (None: intermediate_size).", None)
    num_shared_experts: int = doc("Experts every token uses besides the routed ones (Llama 4, DeepSeek, Qwen-MoE).", 0)
    shared_expert_intermediate_size: int | None = doc(
        "Inner dimension of one shared expert (None: the routed experts').", None
    )
    num_moe_layers: int | None = doc("Layers whose MLP is a mixture of experts (None: all, when num_experts > 0).", None)
    tie_word_embeddings: bool = doc("The LM head is the embedding matrix (stored once).", False)
    sampling_penalties: bool = doc(
        "The model's generation_config.json sets a repetition penalty, which vLLM applies to every request that "
        "sets none of its own (`--generation-config auto`, vLLM's default since 0.8).", False
    )
    profile_name: str | None = doc(
        "Folder of this model in the Vidur profiles (profiles/vidur/compute/<gpu>/<name>), if any.", None
    )

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ReplayError(f"{self.name}: experts_per_token must be in 1..num_experts ({self.num_experts}), "
                              f"not {self.experts_per_token}")
        if self.compute_dtype not in ("bf16", "fp8"):
            raise ReplayError(f"{self.name}: compute_dtype must be bf16 or fp8, not {self.compute_dtype!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention: the Q, K, V and O projections."""
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return 2 * q + kv

    @property
    def num_moe_layers_resolved(self) -> int:
        """Layers with a mixture-of-experts MLP (0 for a dense model)."""
        if not self.num_experts:
            return 0
        return self.num_layers if self.num_moe_layers is None else self.num_moe_layers

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (a gated MLP)."""
        return 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def shared_expert_params(self) -> int:
        """Weights of a layer's shared experts, together."""
        size = self.shared_expert_intermediate_size or self.moe_intermediate_size or self.intermediate_size
        return self.num_shared_experts * 3 * self.hidden_size * size

    @property
    def num_layer_params(self) -> int:
        """Weights of one dense layer: Q, K, V, O projections, the gated MLP, two norms."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def layers_params(self) -> int:
        """Weights of all layers (every expert counted), norms included."""
        moe = self.num_moe_layers_resolved
        per_moe = self.num_experts * (self.expert_params + self.hidden_size) + self.shared_expert_params
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        return (self.num_layers * (self.attention_params + 2 * self.hidden_size)
                + (self.num_layers - moe) * dense_mlp + moe * per_moe)

    @property
    def active_linear_params(self) -> int:
        """Weights one token multiplies through in the layers (its top-k routed and the shared experts)."""
        moe = self.num_moe_layers_resolved
        per_moe = self.experts_per_token * self.expert_params + self.shared_expert_params
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * self.attention_params + (self.num_layers - moe) * dense_mlp + moe * per_moe

    @property
    def num_params(self) -> int:
        """All weights: the layers, the embedding, the LM head (unless tied) and the final norm."""
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return self.layers_params + embeddings + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return self.num_params * self.bytes_per_param

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct routed experts a layer reads for ``num_tokens`` tokens routed uniformly, top-k each:
        E x (1 - (1 - k/E)^tokens) (every expert once the batch is large)."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The serving engine's settings (vLLM v1 names and defaults where vLLM has them)."""

    max_num_batched_tokens: int = doc(
        "Token budget of one step (prefill chunks plus decodes; vLLM's SchedulerConfig default: `vllm serve` picks "
        "by device, replay.vllm.serve_batch_defaults).", 2048
    )
    max_num_seqs: int = doc("Most requests in the running batch (vLLM's SchedulerConfig default; as above).", 128)
    block_size_tokens: int = doc("Tokens per KV cache block.", 16)
    gpu_memory_utilization: float = doc("Share of device memory the engine may use (weights, activations, KV).", 0.9)
    activation_reserve_bytes: int = doc(
        "Device memory kept for activations and other non-KV use per accelerator, bytes.", 2 * GIB
    )
    num_kv_blocks_override: int | None = doc(
        "Use exactly this many KV blocks instead of deriving them from memory (tests, what-ifs).", None
    )
    kv_watermark_fraction: float = doc(
        "Share of KV blocks a new admission must leave free (vLLM v1 has none: 0; v0 used 0.01).", 0.0
    )
    enable_chunked_prefill: bool = doc(
        "Split long prompts into chunks that fit the step budget; off: a prompt is scheduled whole.", True
    )
    enable_prefix_caching: bool = doc("Reuse cached KV blocks of shared prompt prefixes (LRU eviction).", True)
    preemption_mode: PreemptionMode = doc(
        "What preemption does to a victim's KV: recompute (drop it) or swap (copy it to host memory).",
        "recompute",
    )
    swap_bandwidth_bytes_per_s: float = doc("Host<->device copy bandwidth for swap, bytes/s (PCIe 5 x16 ~ 50e9).", 50e9)
    encoder_s_per_image_token: float = doc(
        "Vision encoder time per image token, charged to the step that schedules a multimodal request's first "
        "prefill chunk, seconds.", 0.0
    )
    async_scheduling: bool | None = doc(
        "vLLM's async scheduling: the next step is planned while the current one runs, so a request that arrives "
        "during a busy step joins the step after next. None: the engine version's default (a calibration of vLLM "
        ">= 0.12 turns it on; without a calibration, off).",
        None,
    )
    cpu_kv_offload_bytes: int = doc(
        "Host memory for a CPU tier of the prefix cache (vLLM --kv-offloading-size): cached blocks evicted from the "
        "device are kept there and a later hit copies them back at swap_bandwidth_bytes_per_s instead of "
        "recomputing them; 0: no CPU tier.", 0
    )
    sampling_penalties: bool | None = doc(
        "Requests carry a sampling penalty (vLLM's repetition penalty), so every step runs vLLM's penalty "
        "pass. None: as the model's generation config says (vLLM's --generation-config auto); False: vLLM's own "
        "defaults (--generation-config vllm).", None
    )

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "block_size_tokens", "swap_bandwidth_bytes_per_s")
        _non_negative(self, "cpu_kv_offload_bytes", "activation_reserve_bytes", "encoder_s_per_image_token")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ReplayError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if not 0 <= self.kv_watermark_fraction < 1:
            raise ReplayError(f"kv_watermark_fraction must be in [0, 1), not {self.kv_watermark_fraction}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ReplayError(f"unknown preemption_mode {self.preemption_mode!r}", "valid: recompute, swap")
        if self.num_kv_blocks_override is not None and self.num_kv_blocks_override <= 0:
            raise ReplayError("num_kv_blocks_override must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding on an instance (``InstanceConfig.speculative``; the cost: ``replay.speculative``)."""

    draft: ModelConfig = doc("The draft model (on the same accelerators as the target).")
    num_speculative_tokens: int = doc("Tokens the draft proposes per step (k).", 4)
    acceptance_rate: float = doc("Probability that each drafted token is accepted (alpha), independently.", 0.7)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1 or not 0 <= self.acceptance_rate <= 1:
            raise ReplayError("speculative decoding: num_speculative_tokens >= 1 and acceptance_rate in [0, 1]")

    @property
    def expected_tokens_per_step(self) -> float:
        """E = sum over i = 0..k of alpha^i."""
        return self.expected_tokens(self.num_speculative_tokens)

    def expected_tokens(self, num_speculative_tokens: int) -> float:
        """E_r = sum over i = 0..k_r of alpha^i: a sequence's expected tokens per step when it drafts k_r
        (1 when it does not speculate)."""
        return sum(self.acceptance_rate**i for i in range(num_speculative_tokens + 1))


def standard_exponential(key: str) -> float:
    """A standard exponential variate determined by ``key`` (a request id): -ln(u), u uniform in (0, 1] from
    the key's hash, so a request's draw is the same in every replay and in any order."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return -math.log((int.from_bytes(digest, "big") + 1) / 2**64)


#: The most any one frontend term may be, s (a minute: the fitted ones are microseconds to milliseconds).
MAX_FRONTEND_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """Time outside the engine step that client-side latencies include (the API server and the network).

    A client measures from sending the request to receiving each token (inference-perf, GuideLLM, AIPerf);
    the engine sees the request after ``request_overhead_s`` and tokenization, and the client sees a token
    ``detokenize_s_per_token + stream_delivery_s`` after the step that produced it. With a frontend, a
    replay's arrivals are client send times, its ``request_arrived`` events are stamped when the frontend
    received the request (``client_sent_ns`` beside), and its ``first_byte_ns`` / ``last_byte_ns`` are when
    the client received the first and the last token (docs/calibration.md, Boundaries).
    """

    request_overhead_s: float = doc(
        "Client to engine before tokenization: HTTP round trip, request parsing, the API server's queue, s.", 0.0
    )
    tokenize_s_per_token: float = doc("Prompt tokenization in the API server, s per prompt token.", 0.0)
    detokenize_s_per_token: float = doc("Incremental detokenization of a delivered token, s.", 0.0)
    stream_delivery_s: float = doc(
        "Engine output to the client: the hop to the API server, stream framing and the network, s per chunk.", 0.0
    )
    request_jitter_s: float = doc(
        "Mean of a random wait before the engine (the API server's queue behind other requests' streams): each "
        "request waits this mean times a standard exponential drawn from its id, s.", 0.0
    )

    def __post_init__(self) -> None:
        _non_negative(self, *(f.name for f in dataclasses.fields(self)))
        for f in dataclasses.fields(self):
            if getattr(self, f.name) > MAX_FRONTEND_S:
                raise ReplayError(f"FrontendConfig.{f.name} must be at most {MAX_FRONTEND_S:g} s, not {getattr(self, f.name)}",
                                  "no API server's time per request or per token comes near a minute")

    def in_delay_ns(self, num_prompt_tokens: int, request_id: str = "") -> int:
        """From the client's send to the engine's scheduler: the overhead, the prompt's tokenization and the
        request's wait in the frontend's queue."""
        jitter = self.request_jitter_s * standard_exponential(request_id) if self.request_jitter_s else 0.0
        return round((self.request_overhead_s + self.tokenize_s_per_token * num_prompt_tokens + jitter) * 1e9)

    @property
    def out_delay_ns(self) -> int:
        """From the step that produced a token to the client receiving it."""
        return round((self.detokenize_s_per_token + self.stream_delivery_s) * 1e9)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceConfig:
    """One serving instance: a model on its accelerators, run by an engine."""

    accelerator: AcceleratorConfig = doc("The accelerators.")
    model: ModelConfig = doc("The model.")
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"doc": "Engine settings."})
    speculative: SpeculativeConfig | None = doc("Speculative decoding with a draft model (None: off).", None)
    frontend: FrontendConfig | None = field(
        default=None,
        metadata={"doc": "The API server and network around the engine (None: engine-side timestamps only).",
                  "omit_default": True},
    )

    @property
    def sampling_penalties(self) -> bool:
        """Whether the instance's steps run the penalty pass: the engine's setting, else the model's defaults."""
        setting = self.engine.sampling_penalties
        return self.model.sampling_penalties if setting is None else setting

    @property
    def kv_head_replicas(self) -> int:
        """Copies of each KV head in the tensor-parallel group: vLLM gives every device at least one KV head,
        so with fewer KV heads than devices each head is held by ``tp / kv_heads`` of them."""
        return max(1, self.accelerator.tensor_parallel_size // self.model.num_kv_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies on the instance's devices together (replicated heads counted)."""
        return self.model.kv_bytes_per_token * self.kv_head_replicas

    @property
    def num_kv_blocks(self) -> int:
        """KV cache capacity in blocks: what memory leaves after weights and activations, or the override."""
        if self.engine.num_kv_blocks_override is not None:
            return self.engine.num_kv_blocks_override
        n = self.accelerator.num_devices
        usable = int(self.accelerator.memory_bytes * self.engine.gpu_memory_utilization) * n
        draft = self.speculative.draft.weight_bytes if self.speculative is not None else 0
        reserve = self.engine.activation_reserve_bytes * n
        free = usable - self.model.weight_bytes - draft - reserve
        block_bytes = self.kv_bytes_per_token * self.engine.block_size_tokens
        if free < block_bytes:
            raise ReplayError(
                f"{self.model.name} does not fit on {n} x {self.accelerator.name}: "
                f"{self.model.weight_bytes / GIB:.1f} GiB of weights"
                + (f" + {draft / GIB:.1f} GiB of draft" if draft else "")
                + f" + {reserve / GIB:.1f} GiB of activations, against {usable / GIB:.1f} GiB usable "
                f"({n} x {self.accelerator.memory_bytes / GIB:.1f} GiB x gpu_memory_utilization "
                f"{self.engine.gpu_memory_utilization:g}), leaving no room for KV cache",
                "use more tensor parallelism (or pipeline stages), a larger accelerator, fp8 weights or a higher "
                "gpu_memory_utilization",
            )
        return free // block_bytes


ACCELERATORS: dict[str, AcceleratorConfig] = {
    a.name: a
    for a in (
        AcceleratorConfig(
            name="a100-80g",
            memory_bytes=80 * GIB,
            peak_bf16_flops=312e12,
            memory_bandwidth_bytes_per_s=2.039e12,
            interconnect="nvlink3",
            interconnect_bandwidth_bytes_per_s=300e9,
            profile_name="a100",
        ),
        AcceleratorConfig(
            name="a100-40g",
            memory_bytes=40 * GIB,
            peak_bf16_flops=312e12,
            memory_bandwidth_bytes_per_s=1.555e12,
            interconnect="nvlink3",
            interconnect_bandwidth_bytes_per_s=300e9,
        ),
        AcceleratorConfig(
            name="h100-sxm",
            memory_bytes=80 * GIB,
            peak_bf16_flops=989e12,
            peak_fp8_flops=1979e12,
            memory_bandwidth_bytes_per_s=3.35e12,
            interconnect="nvlink4",
            interconnect_bandwidth_bytes_per_s=450e9,
            profile_name="h100",
        ),
        AcceleratorConfig(
            name="h100-pcie",
            memory_bytes=80 * GIB,
            peak_bf16_flops=756e12,
            peak_fp8_flops=1513e12,
            memory_bandwidth_bytes_per_s=2.0e12,
            interconnect="pcie5",
            interconnect_bandwidth_bytes_per_s=64e9,
            interconnect_latency_ns=25_000,
        ),
        AcceleratorConfig(
            name="h200",
            memory_bytes=141 * 10**9,
            peak_bf16_flops=989e12,
            peak_fp8_flops=1979e12,
            memory_bandwidth_bytes_per_s=4.8e12,
            interconnect="nvlink4",
            interconnect_bandwidth_bytes_per_s=450e9,
        ),
        AcceleratorConfig(
            name="l40s",
            memory_bytes=48 * GIB,
            peak_bf16_flops=362e12,
            peak_fp8_flops=733e12,
            memory_bandwidth_bytes_per_s=864e9,
            interconnect="pcie4",
            interconnect_bandwidth_bytes_per_s=32e9,
            interconnect_latency_ns=25_000,
        ),
        AcceleratorConfig(
            name="b200",
            memory_bytes=180 * 10**9,
            peak_bf16_flops=2250e12,
            peak_fp8_flops=4500e12,
            memory_bandwidth_bytes_per_s=8.0e12,
            interconnect="nvlink5",
            interconnect_bandwidth_bytes_per_s=900e9,
        ),
    )
}

#: Other spellings of the accelerator names (matched case-insensitively): vendor names, memory sizes.
ACCELERATOR_ALIASES: dict[str, str] = {
    "h100": "h100-sxm", "h100-80g": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm",
    "h100-sxm-80gb": "h100-sxm", "h100-pcie-80gb": "h100-pcie", "h200-141gb": "h200", "h200-sxm": "h200",
    "a100": "a100-80g", "a100-80gb": "a100-80g", "a100-sxm-80gb": "a100-80g", "a100-40gb": "a100-40g",
    "a100-sxm-40gb": "a100-40g", "l40s-48gb": "l40s", "b200-180gb": "b200",
}

MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(
            name="llama-3-8b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            profile_name="meta-llama/Meta-Llama-3-8B",
        ),
        ModelConfig(
            name="llama-2-7b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=32,
            head_dim=128,
            intermediate_size=11008,
            vocab_size=32000,
            profile_name="meta-llama/Llama-2-7b-hf",
        ),
        ModelConfig(
            name="mistral-7b",  # Mistral-7B-v0.1: Llama-3-8B's layers, heads and KV bytes per token, a smaller vocabulary
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=32000,
        ),
        ModelConfig(
            name="llama-2-70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=32000,
            profile_name="meta-llama/Llama-2-70b-hf",
        ),
    )
}


def accelerator(name: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> AcceleratorConfig:
    """The named accelerator preset (any case; aliases such as 'H100' or 'A100-80GB'), with the instance's
    tensor- and pipeline-parallel degrees."""
    key = name.lower()
    key = ACCELERATOR_ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise unknown_name("accelerator", name, list(ACCELERATORS))
    return dataclasses.replace(ACCELERATORS[key], tensor_parallel_size=tensor_parallel_size,
                               pipeline_parallel_size=pipeline_parallel_size)


def model(name: str) -> ModelConfig:
    """The named model preset."""
    if name not in MODELS:
        raise unknown_name("model", name, list(MODELS))
    return MODELS[name]


def instance_config(
    model_name: str = "llama-3-8b",
    accelerator_name: str = "h100-sxm",
    *,
    tensor_parallel_size: int = 1,
    engine: EngineConfig | None = None,
) -> InstanceConfig:
    """An instance from presets: ``instance_config("llama-2-70b", "a100-80g", tensor_parallel_size=2)``."""
    return InstanceConfig(
        accelerator=accelerator(accelerator_name, tensor_parallel_size),
        model=model(model_name),
        engine=engine or EngineConfig(),
    )


def parse_instance(spec: str, engine: EngineConfig | None = None) -> InstanceConfig:
    """An instance from ``MODEL@ACCELERATOR[xTP]``, e.g. ``llama-2-70b@a100-80gx2`` (the CLI's ``--engine``)."""
    model_name, sep, rest = spec.partition("@")
    if not sep:
        raise ReplayError(
            f"engine spec {spec!r} is not MODEL@ACCELERATOR",
            f"e.g. llama-3-8b@h100-sxm or llama-2-70b@a100-80gx2; models: {', '.join(MODELS)}; "
            f"accelerators: {', '.join(ACCELERATORS)}",
        )
    accel, _, tp = rest.rpartition("x") if rest.rpartition("x")[2].isdigit() and "x" in rest else (rest, "", "1")
    return instance_config(model_name, accel, tensor_parallel_size=int(tp), engine=engine)
