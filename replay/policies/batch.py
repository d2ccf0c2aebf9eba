"""What policies read about the running batch, computed once per scheduling pass, and shared helpers.

``BatchSnapshot`` reads the running batch once per pass (``EngineView.batch_composition``: one walk;
a pass is recognized by the clock, the batch size and the free KV blocks, which every change inside
a pass moves) and answers: the decode sequences and their summed context (a decode step's
composition), the requests still prefilling, and for each of those how many decode sequences sit
after it in batch order (so a chunk can leave them their budget: the stall-free rule of
Sarathi-Serve).

``steps_until`` converts a time horizon into decode steps with the cost model's own run arithmetic,
for policies whose decisions change with time (``run_horizon_steps``): the fast mode then stops a
run at exactly the step the reference mode would first decide differently at.

``max_chunk_tokens`` is Sarathi-Serve's chunk size: the most prefill tokens a step may carry beside
its decodes and still finish within a step-time target, from the cost model.
"""

from __future__ import annotations

from collections.abc import Callable

from replay.costmodel import StepShape
from replay.views import EngineView, RequestView

#: A horizon no run reaches (the fast mode's runs also end at the first finish and at kernel events).
FAR_STEPS = 1 << 40


class BatchSnapshot:
    """The running batch's decode composition and prefill work, for one scheduling pass."""

    __slots__ = ("key", "num_decode_seqs", "decode_context_tokens", "num_prefilling", "prefill_tokens_left",
                 "max_prefill_context_tokens", "decodes_behind", "speculative_decodes", "_tightest", "_tenants",
                 "_itl_of")

    def __init__(self, itl_of_tenant: Callable[[str | None], float | None] | None = None) -> None:
        """``itl_of_tenant``: the ITL objective of a tenant's requests, seconds (classes come from the
        tenant); the snapshot then also answers the tightest among the running requests."""
        self._itl_of = itl_of_tenant
        self._tightest: float | None | bool = False  # False: not computed for this pass yet
        self._tenants: set[str | None] = set()
        self.key: tuple[int, int, int] | None = None
        self.num_decode_seqs = 0
        self.decode_context_tokens = 0
        self.num_prefilling = 0
        self.prefill_tokens_left = 0
        self.max_prefill_context_tokens = 0
        self.decodes_behind: dict[str, int] = {}
        self.speculative_decodes: tuple[tuple[int, int, int], ...] = ()  # of the decodes, the speculating ones

    def refresh(self, view: EngineView) -> BatchSnapshot:
        """Recompute if the pass changed (clock, batch size or free blocks); returns self."""
        key = (view.now_ns, len(view.running), view.num_kv_blocks_free)
        if key == self.key:
            return self
        self.key = key
        self._tightest = False
        b = view.batch_composition()
        seqs = self.num_decode_seqs = b.num_decode_seqs
        self.decode_context_tokens = b.decode_context_tokens
        self.num_prefilling = len(b.prefilling)
        self.prefill_tokens_left = b.prefill_tokens_left
        self.max_prefill_context_tokens = b.max_prefill_context_tokens
        self.decodes_behind = {rid: seqs - before for rid, before in b.prefilling} if b.prefilling else {}
        self._tenants = b.tenants
        self.speculative_decodes = b.speculative_decodes
        return self

    @property
    def tightest_itl_s(self) -> float | None:
        """The tightest ITL objective among the running requests (computed once per pass, when asked)."""
        if self._tightest is False:
            tightest = None
            itl_of = self._itl_of
            if itl_of is not None:
                for tenant in self._tenants:
                    itl = itl_of(tenant)
                    if itl is not None and (tightest is None or itl < tightest):
                        tightest = itl
            self._tightest = tightest
        return self._tightest

    def behind(self, request: RequestView) -> int:
        """Decode sequences after ``request`` in batch order (0 for a request not yet running)."""
        return self.decodes_behind.get(request.request_id, 0)


def steps_until(view: EngineView, snapshot: BatchSnapshot, delta_ns: int) -> int:
    """Decode steps of the current batch until ``delta_ns`` have elapsed (the step in which it happens)."""
    if delta_ns <= 0:
        return 1
    snapshot.refresh(view)
    if snapshot.num_decode_seqs == 0:
        return 1
    run = view.cost_model.decode_run(snapshot.num_decode_seqs, snapshot.decode_context_tokens, FAR_STEPS, delta_ns)
    return max(1, run.num_steps)


class ChunkSizer:
    """Sarathi-Serve's chunk size: the most prefill tokens that keep a step within a time target.

    Answers are cached by (decode sequences, decode context and prefix context rounded up to
    ``bucket_tokens``, target), rounding up so the cached chunk is never too large.
    """

    __slots__ = ("bucket_tokens", "_cache")

    def __init__(self, bucket_tokens: int = 1024) -> None:
        self.bucket_tokens = bucket_tokens
        self._cache: dict[tuple[int, int, int, int, int], int] = {}

    def max_chunk_tokens(self, view: EngineView, num_decode_seqs: int, decode_context_tokens: int,
                         prefix_tokens: int, target_ns: int,
                         speculative_decodes: tuple[tuple[int, int, int], ...] = ()) -> int:
        """Largest chunk c (at most the step budget left beside the decodes) such that a step with a
        chunk of c tokens after ``prefix_tokens`` of context, plus the decodes, takes at most
        ``target_ns``; 0 when even the decodes alone exceed it. ``speculative_decodes``: of the decodes,
        those that speculate (``BatchComposition``): their drafts and verification tokens are priced,
        and take k + 1 tokens of the budget each."""
        b = self.bucket_tokens
        pre = -(-prefix_tokens // b) * b
        seqs, ctx = num_decode_seqs, decode_context_tokens
        spec: tuple[tuple[int, int, int], ...] = ()
        verify = 0
        if speculative_decodes:
            spec = tuple((k, n, -(-c // b) * b) for k, n, c in speculative_decodes)
            seqs -= sum(n for _, n, _ in speculative_decodes)
            ctx -= sum(c for _, _, c in speculative_decodes)
            verify = sum(k * n for k, n, _ in speculative_decodes)  # budget beyond one token per sequence
        ctx = -(-ctx // b) * b
        limit = max(0, view.instance.engine.max_num_batched_tokens - num_decode_seqs - verify)
        key = (num_decode_seqs, ctx, pre, target_ns, limit, spec) if spec else (num_decode_seqs, ctx, pre, target_ns, limit)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        model = view.cost_model

        def fits(c: int) -> bool:
            return model.step_time_ns(StepShape(((c, pre),) if c else (), seqs, ctx, spec)) <= target_ns

        if not fits(0):
            best = 0
        elif fits(limit):
            best = limit
        else:
            lo, hi = 0, limit  # fits(lo), not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
            best = lo
        self._cache[key] = best
        return best
