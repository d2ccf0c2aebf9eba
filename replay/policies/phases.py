"""Phase-priority policies: which phase, prefill or decode, a step serves first.

``prefill-first`` (prefill-prioritizing, as vLLM v0 and Orca schedule): every scheduling pass
plans the waiting requests' prefills before the running requests, so new requests reach their
first token sooner while running streams get only the token budget the prefills leave (their
inter-token gaps stall behind long prompts).

``decode-first`` (decode-prioritizing, as FasterTransformer's request-level batching; Sarathi-Serve
section 2 contrasts the two): every decode is planned before any prefill chunk (a prefilling
request gets only the budget left after every decode behind it in the batch), and a waiting request
is admitted only while fewer than ``max_prefilling`` admitted requests are still prefilling, so
running streams are never slowed by more than that much prefill work while new requests wait.

Both decide from the batch's composition only; a run of decode steps repeats their decisions
(nothing prefills in it), so neither bounds the fast mode's runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from replay.errors import ReplayError
from replay.policies.base import Policy, register
from replay.policies.batch import BatchSnapshot
from replay.policies.fcfs import FcfsConfig
from replay.policies.limits import check_magnitudes
from replay.views import EngineView, RequestView
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillFirstConfig(FcfsConfig):
    """Settings of the prefill-first policy: FCFS's (the per-request prefill cap)."""


@register
class PrefillFirstPolicy(Policy):
    """Waiting requests' prefills are planned before running requests (prefill-prioritizing)."""

    name = "prefill-first"
    config_type = PrefillFirstConfig

    def schedule_waiting_first(self, view: EngineView) -> bool:
        return True

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_tokens_left:
            num_tokens_left = cap
        return min(num_tokens_left, budget_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeFirstConfig:
    """Settings of the decode-first policy."""

    max_prefilling: int = doc(
        "Admit a waiting request only while fewer running requests than this are still prefilling.", 1
    )

    def __post_init__(self) -> None:
        check_magnitudes("decode-first", self)
        if self.max_prefilling < 1:
            raise ReplayError("decode-first: max_prefilling must be at least 1", "1 admits one prefill at a time")


@register
class DecodeFirstPolicy(Policy):
    """Every decode before any prefill chunk; new requests only while few admitted ones still prefill."""

    name = "decode-first"
    config_type = DecodeFirstConfig

    def __init__(self, config: DecodeFirstConfig | None = None) -> None:
        super().__init__(config)
        self._batch = BatchSnapshot()

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        room = self.config.max_prefilling - self._batch.refresh(view).num_prefilling
        return islice(waiting, max(room, 0))

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        behind = self._batch.refresh(view).behind(request)
        return max(0, min(num_tokens_left, budget_tokens - behind))
