"""Sarathi-Serve: stall-free hybrid batches with the chunk size derived from the ITL objective.

Mechanism (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024): every step carries all running decodes first (a prefilling request
only gets the budget left after the decodes behind it in the batch: no decode ever stalls behind a
prompt), and the prefill tokens the step may add are capped so the whole step still finishes within
the tightest inter-token-latency objective among the classes in the batch (times
``step_time_share``): the largest chunk the cost model prices within that target, given the step's
decodes and the chunk's context (``ChunkSizer``). A step with no prefill yet always takes at least
``min_chunk_tokens`` so prompts keep moving when the decodes alone use up the target. Classes come
from tenant configuration (``Tenancy``), never from the request.

The cap moves with the decodes' context, so while requests wait the fast mode advances one step at
a time (``run_horizon_steps``): a smaller chunk could fit the KV pool a few steps later.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.errors import ReplayError
from replay.policies.base import Policy, register
from replay.policies.batch import BatchSnapshot, ChunkSizer
from replay.policies.limits import check_magnitudes
from replay.policies.tenancy import Tenancy, TenantBook
from replay.views import EngineView, RequestView
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class SarathiConfig:
    """Settings of the Sarathi-Serve policy."""

    tenancy: Tenancy = doc("Classes (their ITL objectives) and the tenants entitled to them.", Tenancy())
    step_time_share: float = doc("The step-time target is this share of the tightest ITL objective in the batch.", 0.9)
    default_itl_objective_s: float | None = doc(
        "ITL objective assumed for classes without one, seconds (None: such classes set no target).", None
    )
    min_chunk_tokens: int = doc("A step with no prefill yet takes at least this many prompt tokens.", 32)

    def __post_init__(self) -> None:
        check_magnitudes("sarathi", self)
        check_chunk_settings("sarathi", self.step_time_share, self.min_chunk_tokens, self.default_itl_objective_s)


def check_chunk_settings(policy: str, step_time_share: float, min_chunk_tokens: int,
                         default_itl_objective_s: float | None = None) -> None:
    """The stall-free chunk rule's settings, as ``sarathi`` and ``deadline`` both take them."""
    if not 0 < step_time_share <= 1:
        raise ReplayError(f"{policy}: step_time_share must be in (0, 1], not {step_time_share}")
    if min_chunk_tokens < 1:
        raise ReplayError(f"{policy}: min_chunk_tokens must be at least 1, not {min_chunk_tokens}")
    if default_itl_objective_s is not None and not default_itl_objective_s > 0:
        raise ReplayError(f"{policy}: default_itl_objective_s must be positive (or absent), not {default_itl_objective_s}")


class StallFreeChunks:
    """The stall-free, ITL-targeted chunk rule (shared by ``sarathi`` and ``deadline``)."""

    __slots__ = ("book", "share", "default_itl_s", "min_chunk", "batch", "sizer", "_itl_of_tenant")

    def __init__(self, book: TenantBook, step_time_share: float, default_itl_s: float | None, min_chunk: int) -> None:
        self.book = book
        self.share = step_time_share
        self.default_itl_s = default_itl_s
        self.min_chunk = min_chunk
        self.batch = BatchSnapshot(self._itl_of_tenant_s)
        self.sizer = ChunkSizer()
        self._itl_of_tenant: dict[str | None, float | None] = {}

    def _itl_s(self, request: RequestView) -> float | None:
        return self._itl_of_tenant_s(request.tenant)

    def _itl_of_tenant_s(self, tenant: str | None) -> float | None:
        try:
            return self._itl_of_tenant[tenant]
        except KeyError:
            itl = self.book.class_of_tenant(tenant).itl_objective_s
            itl = self._itl_of_tenant[tenant] = itl if itl is not None else self.default_itl_s
            return itl

    def target_ns(self, view: EngineView, request: RequestView) -> int | None:
        """The step-time target: ``share`` x the tightest ITL objective among running requests and ``request``."""
        tightest = self.batch.refresh(view).tightest_itl_s
        own = self._itl_s(request)
        if own is not None and (tightest is None or own < tightest):
            tightest = own
        return None if tightest is None else round(tightest * self.share * 1e9)

    def chunk(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        batch = self.batch.refresh(view)
        behind = batch.behind(request)
        room = budget_tokens - behind
        target = self.target_ns(view, request)
        if target is None:
            return max(0, min(num_tokens_left, room))
        # every chunk of the step is priced at the longest context any prefilling request has: a chunk
        # planned before this one may sit after a long prompt, and its attention costs more per token
        prefix = max(request.num_computed_tokens, batch.max_prefill_context_tokens)
        cap = self.sizer.max_chunk_tokens(view, batch.num_decode_seqs, batch.decode_context_tokens, prefix, target,
                                          batch.speculative_decodes)
        before = batch.num_decode_seqs - behind
        used_prefill = max(0, view.instance.engine.max_num_batched_tokens - budget_tokens - before)
        allowance = cap - used_prefill
        if used_prefill == 0:
            allowance = max(allowance, self.min_chunk)
        return max(0, min(num_tokens_left, allowance, room))


@register
class SarathiPolicy(Policy):
    """Stall-free hybrid batches: decodes first, prefill chunks sized to the ITL objective by the cost model."""

    name = "sarathi"
    config_type = SarathiConfig

    def __init__(self, config: SarathiConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.chunks = StallFreeChunks(TenantBook(c.tenancy), c.step_time_share, c.default_itl_objective_s,
                                      c.min_chunk_tokens)

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        return self.chunks.chunk(view, request, num_tokens_left, budget_tokens)

    def run_horizon_steps(self, view: EngineView) -> int | None:
        return 1 if len(view.waiting) else None
