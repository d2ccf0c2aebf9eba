"""Speculative decoding as a step cost: a draft model proposes, the target verifies, tokens are accepted by a rate.

With ``k`` speculative tokens and acceptance rate ``alpha`` (each drafted token accepted with
probability ``alpha``, independently, until the first rejection), one speculative step yields in
expectation ``E = sum_{i=0..k} alpha^i`` tokens per sequence (the accepted draft tokens plus the one
the target samples itself; ``(1 - alpha^(k+1)) / (1 - alpha)``), and costs

    k draft decode passes (each over the batch's sequences, contexts growing by one)
    + one target verification pass (k + 1 tokens per sequence, at its context).

The engine's step stays one token per decoding sequence: ``SpeculativeCostModel`` charges each such
step its expected share, ``(k x draft + verification) / E``, an expected-value model. Throughput,
TTFT and E2E are those of the mean acceptance; inter-token gaps are smoothed (a real engine delivers
about E tokens at once after a longer step, so its ITL is burstier), and acceptance does not vary by
request. In a step with prefill chunks, the chunks are charged in full and the decodes' verification
rides along in the same target pass: ``T(prefill) + (k x draft + T(prefill + verification) -
T(prefill)) / E``. The draft's weights count against the instance's memory (``InstanceConfig``
subtracts them from the KV pool); its own KV cache is not modelled (a small draft's is a few percent
of the target's).

Decode runs (the fast mode) are summed step by step (``CostModelBase.decode_run``), so they equal the
reference exactly, at O(steps) per run.
"""

from __future__ import annotations

from replay.config import SpeculativeConfig
from replay.costmodel import CostModelBase, CostModelInfo, StepCostModel, StepShape

__all__ = ["SpeculativeConfig", "SpeculativeCostModel"]


class SpeculativeCostModel(CostModelBase):
    """A target cost model with speculative decoding by a draft's cost model (see the module docstring)."""

    name = "speculative"

    def __init__(self, target: StepCostModel, draft: StepCostModel, config: SpeculativeConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.k = config.num_speculative_tokens
        self.expected = config.expected_tokens_per_step

    def _verification(self, num_seqs: int, context_tokens: int) -> tuple[tuple[int, int], ...]:
        """``num_seqs`` chunks of k + 1 tokens, at the mean context (the roofline's terms are linear in it)."""
        before = context_tokens // num_seqs - 1  # a decode's context counts its own new position
        return ((self.k + 1, max(0, before)),) * num_seqs

    def _draft_ns(self, num_seqs: int, context_tokens: int) -> int:
        return sum(self.draft.decode_step_ns(num_seqs, context_tokens + num_seqs * i) for i in range(self.k))

    def step_time_ns(self, shape: StepShape) -> int:
        d = shape.num_decode_seqs
        if d == 0:
            return self.target.step_time_ns(shape)
        verify = self._verification(d, shape.decode_context_tokens)
        both = self.target.step_time_ns(StepShape(shape.prefill_chunks + verify, 0, 0))
        prefill = self.target.step_time_ns(StepShape(shape.prefill_chunks, 0, 0)) if shape.prefill_chunks else 0
        return prefill + round((self._draft_ns(d, shape.decode_context_tokens) + both - prefill) / self.expected)

    def info(self) -> CostModelInfo:
        base = self.target.info()
        c = self.config
        return CostModelInfo(
            name=f"{base.name}+speculative",
            description=f"{base.description}; speculative decoding with {c.draft.name} "
                        f"(k={c.num_speculative_tokens}, acceptance {c.acceptance_rate})",
            parameters=base.parameters + (("draft", c.draft.name), ("num_speculative_tokens", str(c.num_speculative_tokens)),
                                          ("acceptance_rate", str(c.acceptance_rate))),
        )
