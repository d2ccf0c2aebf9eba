"""Shapes of the Llama-architecture decoder the step executor builds (no weights: those are random).

Shapes follow the models' Hugging Face ``config.json``: Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B
(RMSNorm, rotary attention with grouped KV heads, gated SiLU MLP, untied LM head). A model too large
for the device is *scaled by layer count*: ``num_layers`` layers are built and timed, and the fitted
cost model multiplies its per-layer terms by ``full_num_layers / num_layers`` (docs/calibration.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from replay.config import ModelConfig
from replay.errors import ReplayError, unknown_name
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaShape:
    """The shape of one Llama-architecture decoder, and how many of its layers are built."""

    name: str = doc("Shape name, e.g. 'llama-8b'.")
    num_layers: int = doc("Layers built and timed (fewer than full_num_layers when scaled down).")
    full_num_layers: int = doc("Layers of the real model (the fitted model scales per-layer terms to it).")
    hidden_size: int = doc("Hidden (embedding) dimension.")
    num_attention_heads: int = doc("Query heads.")
    num_kv_heads: int = doc("Key/value heads (grouped-query attention when fewer than query heads).")
    head_dim: int = doc("Dimension of one attention head.")
    intermediate_size: int = doc("Inner dimension of the gated MLP.")
    vocab_size: int = doc("Vocabulary size (embedding rows, LM-head columns).")
    rope_theta: float = doc("Rotary embedding base.", 500_000.0)
    rms_norm_eps: float = doc("RMSNorm epsilon.", 1e-5)

    def __post_init__(self) -> None:
        for name in ("num_layers", "full_num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ReplayError(f"LlamaShape.{name} must be positive, not {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ReplayError(
                f"{self.num_attention_heads} query heads do not split into groups of {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ReplayError("head_dim must be even (rotary embedding rotates pairs)")

    @property
    def layer_scale(self) -> float:
        """How many real layers one built layer stands for."""
        return self.full_num_layers / self.num_layers

    def with_layers(self, num_layers: int) -> LlamaShape:
        """The same shape with ``num_layers`` layers built (at most the real model's)."""
        if not 1 <= num_layers <= self.full_num_layers:
            raise ReplayError(
                f"{self.name} has {self.full_num_layers} layers: build between 1 and {self.full_num_layers}, "
                f"not {num_layers}"
            )
        return dataclasses.replace(self, num_layers=num_layers)

    def model_config(self, bytes_per_param: int) -> ModelConfig:
        """The replay's ``ModelConfig`` of the layers built (for the roofline and the KV pool)."""
        return ModelConfig(
            name=self.name if self.num_layers == self.full_num_layers else f"{self.name}-{self.num_layers}l",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            bytes_per_param=bytes_per_param,
            kv_bytes_per_element=bytes_per_param,
        )

    def as_dict(self) -> dict[str, int | float | str]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


SHAPES: dict[str, LlamaShape] = {
    s.name: s
    for s in (
        # a test-sized decoder: two layers, GQA with 2 query heads per KV head
        LlamaShape(name="tiny", num_layers=2, full_num_layers=2, hidden_size=64, num_attention_heads=4,
                   num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256, rope_theta=10_000.0),
        LlamaShape(name="llama-1b", num_layers=16, full_num_layers=16, hidden_size=2048, num_attention_heads=32,
                   num_kv_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256),
        LlamaShape(name="llama-8b", num_layers=32, full_num_layers=32, hidden_size=4096, num_attention_heads=32,
                   num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
        LlamaShape(name="llama-70b", num_layers=80, full_num_layers=80, hidden_size=8192, num_attention_heads=64,
                   num_kv_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256),
    )
}


def llama_shape(name: str, num_layers: int | None = None) -> LlamaShape:
    """The named shape, with ``num_layers`` layers built when given (scaled by layer count)."""
    if name not in SHAPES:
        raise unknown_name("model shape", name, list(SHAPES))
    shape = SHAPES[name]
    return shape if num_layers is None else shape.with_layers(num_layers)
