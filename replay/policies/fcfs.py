"""First come, first served with vLLM v1 semantics (the default policy).

Every request is accepted; running requests are scheduled first (in the order they joined the
batch), then waiting ones in arrival order, with preempted requests at the front; a prompt longer
than the budget left is chunked (optionally capped per step, vLLM's
``long_prefill_token_threshold``); when KV blocks run out, the newest running request is preempted.
Its decisions depend only on the queues and the pool, so a run of decode steps repeats them
exactly until something changes (unbounded ``run_horizon_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.errors import ReplayError
from replay.policies.base import Policy, register
from replay.policies.limits import check_magnitudes
from replay.views import EngineView, RequestView
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class FcfsConfig:
    """Settings of the FCFS policy."""

    long_prefill_token_threshold: int = doc(
        "Most prompt tokens one request may put into a step (vLLM's long_prefill_token_threshold); 0: no cap.", 0
    )

    def __post_init__(self) -> None:
        check_magnitudes("fcfs", self)
        if self.long_prefill_token_threshold < 0:
            raise ReplayError(f"long_prefill_token_threshold must be >= 0 (0: no cap), not {self.long_prefill_token_threshold}")


@register
class FcfsPolicy(Policy):
    """vLLM v1 FCFS: running first, then waiting in arrival order; preempt the newest."""

    name = "fcfs"
    config_type = FcfsConfig

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_tokens_left:
            num_tokens_left = cap
        return min(num_tokens_left, budget_tokens)
