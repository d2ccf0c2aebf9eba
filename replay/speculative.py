"""Speculative decoding per request: a draft model proposes, the target verifies, tokens are accepted by a rate.

On an instance with ``InstanceConfig.speculative`` each request has its own number of speculative
tokens ``k_r`` (``Request.num_speculative_tokens``): the instance's ``k`` by default, lower (0:
speculation off) when its admission decision says so (``AdmissionDecision.num_speculative_tokens``,
the deadline policy's draft cap). With acceptance rate ``alpha`` (each drafted token accepted with
probability ``alpha``, independently, until the first rejection), one speculative step yields in
expectation ``E_r = sum_{i=0..k_r} alpha^i`` tokens for that sequence (the accepted draft tokens plus
the one the target samples itself; ``SpeculativeConfig.expected_tokens``).

**Tokens: a deterministic expected-value schedule.** Replays must be reproducible, so acceptance is
not drawn: after its n-th speculative step a request has advanced ``floor(n x E_r)`` tokens in total
(``tokens_after_steps``), so step n delivers ``floor(n x E_r) - floor((n - 1) x E_r)`` tokens at once
(``step_advance``: ``floor(E_r)`` or ``floor(E_r) + 1``, at least 1), never past its output length.
Over many steps the rate is ``E_r`` tokens per step; deliveries are bursty as in a real engine (a
delivery of ``a`` tokens after a step of ``T`` counts ``a`` inter-token gaps of ``T / a``, so the worst
gap is ``T / floor(E_r)``). The count n runs over the request's speculative steps
(``Request.num_speculative_steps``; it survives preemption and moves between instances). Every branch of a request with parallel
samples advances alike. A sequence with ``k_r = 0``, and every decode on an instance without
speculation, advances one token per step.

**Cost: one step, its real composition.** The engine's step shape lists the speculating sequences
apart (``StepShape.speculative_decodes``: (k, sequences, summed context) per request), and a step costs

    max k_r draft decode passes, each over all the speculating sequences (contexts growing by one)
    + one target pass: the prefill chunks, each speculating sequence's k_r + 1 verification tokens
      (a chunk at its context) and each plain decode's one token,

with the draft and the target priced by the instance's cost model of that kind
(``make_cost_model``). A step without speculating sequences costs the target's step exactly, so an
instance whose requests all run with ``k_r = 0`` costs what an instance without speculation does. A
speculating sequence takes ``k_r + 1`` tokens of the step's token budget, and its KV blocks grow by
the tokens it keeps (the rejected verification slots are dropped at the step's end).

**Memory.** The draft's weights count against the instance's memory (``InstanceConfig`` subtracts
them from the KV pool). The draft's own KV cache is **not modelled**: counting it per request would need
a second block ledger beside the target's through the engine (allocation, preemption, moves), the
views and every policy's KV predictions. It is not negligible (Llama-3.2-1B beside Llama-3.1-8B: 32
KiB against 128 KiB per token, a quarter more KV per speculating request), so a speculative replay
overstates the KV pool's room by up to that much, and turning a request's speculation off frees no
KV here: the draft cap acts on step time and token rate only.

**Modes.** The fast mode's lockstep decode runs assume one token per member per step, so an instance
with speculation steps one pass at a time in both modes (the request-by-request pass): the fast mode
equals the reference there by construction, and runs at the reference's speed. A measured clock
(``step_timer``, ``replay.measured``) is refused on such an instance: its executor runs the target only.
"""

from __future__ import annotations

import math

from replay.config import SpeculativeConfig
from replay.costmodel import CostModelBase, CostModelInfo, StepCostModel, StepShape

__all__ = ["SpeculativeConfig", "SpeculativeCostModel", "step_advance", "tokens_after_steps"]


def tokens_after_steps(expected_tokens: float, num_steps: int) -> int:
    """Tokens a speculating sequence has advanced after ``num_steps`` speculative steps: floor(n x E_r)."""
    return math.floor(num_steps * expected_tokens)


def step_advance(expected_tokens: float, step: int) -> int:
    """Tokens a speculating sequence advances in its ``step``-th speculative step (1-based): at least 1."""
    return max(1, tokens_after_steps(expected_tokens, step) - tokens_after_steps(expected_tokens, step - 1))


class SpeculativeCostModel(CostModelBase):
    """A target cost model with per-request speculative decoding by a draft's cost model (module docstring)."""

    name = "speculative"

    def __init__(self, target: StepCostModel, draft: StepCostModel, config: SpeculativeConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.k = config.num_speculative_tokens

    @staticmethod
    def _verification(k: int, num_seqs: int, context_tokens: int) -> tuple[tuple[int, int], ...]:
        """``num_seqs`` chunks of k + 1 tokens, at the group's mean context (a request's branches share it)."""
        before = context_tokens // num_seqs - 1  # a decode's context counts its own new position
        return ((k + 1, max(0, before)),) * num_seqs

    def draft_ns(self, num_passes: int, num_seqs: int, context_tokens: int) -> int:
        """``num_passes`` draft decode passes over ``num_seqs`` sequences, contexts growing by one each pass."""
        return sum(self.draft.decode_step_ns(num_seqs, context_tokens + num_seqs * i) for i in range(num_passes))

    def step_time_ns(self, shape: StepShape) -> int:
        spec = shape.speculative_decodes
        if not spec:
            return self.target.step_time_ns(shape)
        seqs = sum(n for _, n, _ in spec)
        ctx = sum(c for _, _, c in spec)
        verify = tuple(chunk for k, n, c in spec for chunk in self._verification(k, n, c))
        target = self.target.step_time_ns(
            StepShape(shape.prefill_chunks + verify, shape.num_decode_seqs, shape.decode_context_tokens)
        )
        return self.draft_ns(max(k for k, _, _ in spec), seqs, ctx) + target

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
