"""Read-only views that policies decide over: one of the engine, one per request.

A policy reads the clock, the queues, the KV pool and each request's progress through these views
and never changes them: the views have no setters and the queues come as read-only sequences. A
request's true output length is what a real scheduler cannot know, so it is not reachable from a
view: the engine keeps it apart from the request state (``replay.request``). Policies that predict
output lengths do so from what they can see (class, prompt, history), and report the interval
they used in their admission decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, overload

from replay.request import FINISHED, HELD, RUNNING, WAITING, Request

if TYPE_CHECKING:
    from replay.config import InstanceConfig
    from replay.costmodel import StepCostModel
    from replay.kernel import Kernel
    from replay.kvcache import BlockPool

_STATE_NAMES = {WAITING: "waiting", RUNNING: "running", HELD: "held", FINISHED: "finished"}


class RequestView:
    """What a policy may know about a request (everything but its true output length)."""

    __slots__ = ("_r",)

    def __init__(self, request: Request) -> None:
        self._r = request

    request_id = property(lambda self: self._r.request_id, doc="Request id.")
    arrival_ns = property(lambda self: self._r.arrival_ns, doc="Arrival time, ns.")
    num_prompt_tokens = property(lambda self: self._r.num_prompt_tokens, doc="Prompt length.")
    num_branches = property(lambda self: self._r.num_branches, doc="Parallel samples (n).")
    tenant = property(lambda self: self._r.tenant, doc="Tenant.")
    service_class = property(lambda self: self._r.service_class, doc="Service class.")
    model = property(lambda self: self._r.model, doc="Model.")
    adapter = property(lambda self: self._r.adapter, doc="Adapter.")
    session_id = property(lambda self: self._r.session_id, doc="Session.")
    ttft_deadline_ns = property(lambda self: self._r.ttft_deadline_ns, doc="First-token deadline, ns.")
    e2e_deadline_ns = property(lambda self: self._r.e2e_deadline_ns, doc="Last-token deadline, ns.")
    max_output_tokens = property(lambda self: self._r.max_output_tokens, doc="The request's max_tokens, if set.")
    num_speculative_tokens = property(
        lambda self: self._r.num_speculative_tokens,
        doc="Speculative tokens (k) it drafts per decode step on this instance (0: it does not speculate).",
    )
    num_computed_tokens = property(
        lambda self: self._r.num_computed + self._r.live_ticks(), doc="Tokens whose KV is computed."
    )
    num_tokens = property(lambda self: self._r.num_tokens + self._r.live_ticks(), doc="Prompt plus output positions so far.")
    num_output_tokens = property(
        lambda self: (self._r.num_output + self._r.live_ticks()) * self._r.num_branches,
        doc="Output tokens produced so far (all branches).",
    )
    num_cached_prefix_tokens = property(
        lambda self: self._r.num_cached_prefix_tokens, doc="Prompt tokens found in the prefix cache at admission."
    )
    num_preemptions = property(lambda self: self._r.num_preemptions, doc="Times the request was preempted.")
    num_blocks = property(lambda self: held_blocks(self._r), doc="KV blocks the request holds.")
    admitted_ns = property(lambda self: self._r.admitted_ns, doc="When admission accepted it, ns.")
    scheduled_ns = property(lambda self: self._r.scheduled_ns, doc="First batch membership, ns.")
    first_token_ns = property(lambda self: self._r.first_token_ns, doc="First token, ns.")

    @property
    def is_prefilling(self) -> bool:
        """More than one token left to compute before the next sample (a prompt, or a recomputation)."""
        r = self._r
        return r.lock is None and (r.num_tokens - r.num_computed > 1 or r.num_computed < r.num_prompt_tokens)

    @property
    def state(self) -> str:
        """waiting, running, held or finished."""
        return _STATE_NAMES[self._r.state]

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, {self.state})"


class RequestSequence(Sequence[RequestView]):
    """A read-only sequence of request views over one of the engine's queues (no copy)."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence[Request]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> RequestView: ...
    @overload
    def __getitem__(self, index: slice) -> list[RequestView]: ...
    def __getitem__(self, index: int | slice) -> RequestView | list[RequestView]:
        if isinstance(index, slice):
            return [r.view for r in list(self._items)[index]]
        view: RequestView = self._items[index].view
        return view

    def __iter__(self) -> Iterator[RequestView]:
        return (r.view for r in self._items)


class EngineView:
    """What a policy may know about the instance: clock, queues, KV pool, settings, cost model."""

    __slots__ = ("_kernel", "_pool", "_running", "_waiting", "_held", "_budget", "instance", "cost_model", "instance_id",
                 "route_check", "downgrade_check")

    def __init__(
        self,
        kernel: Kernel,
        pool: BlockPool,
        running: list[Request],
        waiting: Sequence[Request],
        held: Sequence[Request],
        budget: list[int],
        instance: InstanceConfig,
        cost_model: StepCostModel,
        instance_id: str,
    ) -> None:
        self._kernel = kernel
        self._pool = pool
        self._running = RequestSequence(running)
        self._waiting = RequestSequence(waiting)
        self._held = RequestSequence(held)
        self._budget = budget  # [token budget left] of the step being planned
        self.instance = instance
        self.cost_model = cost_model
        self.instance_id = instance_id
        # set by a cluster (replay.cluster): whether a request may be sent to another instance now
        self.route_check: Callable[[Request], bool] | None = None
        # set by a cluster with multi-model residency: whether a request may be served as another model now
        self.downgrade_check: Callable[[Request, str], bool] | None = None

    @property
    def now_ns(self) -> int:
        return self._kernel.now_ns

    @property
    def num_kv_blocks_total(self) -> int:
        return self._pool.num_total

    @property
    def num_kv_blocks_free(self) -> int:
        return self._pool.num_free

    @property
    def num_kv_blocks_used(self) -> int:
        return self._pool.num_used

    @property
    def kv_block_size_tokens(self) -> int:
        return self.instance.engine.block_size_tokens

    @property
    def running(self) -> RequestSequence:
        return self._running

    @property
    def waiting(self) -> RequestSequence:
        return self._waiting

    @property
    def held(self) -> RequestSequence:
        return self._held

    def batch_composition(self) -> BatchComposition:
        """The running batch as one walk over it sees it (what a step-shaping policy reads once per
        pass; the same figures as reading every running request's view, without a call per field)."""
        seqs = ctx = left = max_context = 0
        prefilling: list[tuple[str, int]] = []
        tenants: set[str | None] = set()
        spec: dict[int, tuple[int, int]] = {}  # k -> (speculating sequences, their context)
        speculative = self.instance.speculative is not None
        for r in self._running._items:
            tenants.add(r.tenant)
            lock = r.lock
            computed = r.num_computed
            if lock is None and (r.num_tokens - computed > 1 or computed < r.num_prompt_tokens):
                prefilling.append((r.request_id, seqs))
                left += r.num_tokens - computed
                if computed > max_context:
                    max_context = computed
            else:
                n = r.num_branches
                if lock is not None:
                    computed += lock.ticks - r.g0
                seqs += n
                ctx += n * (computed + 1)
                if speculative and r.num_speculative_tokens:
                    k = r.num_speculative_tokens
                    s, c = spec.get(k, (0, 0))
                    spec[k] = (s + n, c + n * (computed + 1))
        return BatchComposition(seqs, ctx, prefilling, left, max_context, tenants,
                                tuple((k, s, c) for k, (s, c) in sorted(spec.items())) if spec else ())

    def can_route(self, request: RequestView) -> bool:
        """Whether admission may answer ``route`` for ``request`` now ("not here"): a cluster has another
        instance taking traffic that it has not tried, and its re-route budget is not spent. Always False
        on a lone instance. It says nothing about the other instances: the cluster's router picks one."""
        check = self.route_check
        return check is not None and check(request._r)

    def can_downgrade(self, request: RequestView, model: str) -> bool:
        """Whether admission may answer ``downgrade`` to ``model`` for ``request`` now: a cluster with
        multi-model residency routes it on arrival, has not downgraded it yet, and another instance taking
        traffic serves ``model`` now (holds it resident). Always False on a lone instance. It says nothing
        about that instance's load: the cluster's router picks one, and its admission decides."""
        check = self.downgrade_check
        return check is not None and check(request._r, model)

    @property
    def token_budget_left(self) -> int:
        """Tokens still unassigned in the step being planned (max_num_batched_tokens between steps)."""
        return self._budget[0]

    def blocks_for_tokens(self, request: RequestView, num_tokens: int, num_branches: int | None = None) -> int:
        """KV blocks a request holds once ``num_tokens`` of its positions are computed (branches included;
        ``num_branches``: as if it had that many, e.g. after a degrade decision reduced them)."""
        return blocks_for(request._r, num_tokens, self.instance.engine.block_size_tokens, num_branches)

    def cached_prefix_blocks(self, request: RequestView) -> tuple[int, int]:
        """(blocks of the request's prompt prefix the prefix cache holds now, how many of them running
        requests hold): what admitting it now would share rather than allocate (the engine's lookup:
        contiguous cached units from the prompt's start, at least one prompt token left to compute)."""
        r = request._r
        if not r.unit_keys:
            return 0, 0
        pool = self._pool
        covered = 0
        sizes: list[tuple[int, bool]] = []
        for key, start, size in r.unit_keys:
            if start != covered or pool.cached_blocks(key) != size:
                break
            held = not pool.is_free_unit(key)
            sizes.append((size, held))
            covered += size
        max_blocks = (r.num_tokens - 1) // self.instance.engine.block_size_tokens
        while covered > max_blocks:
            covered -= sizes.pop()[0]
        shared = sum(size for size, held in sizes if held)
        return covered, shared


class BatchComposition(NamedTuple):
    """The running batch's decode composition and prefill work (``EngineView.batch_composition``)."""

    num_decode_seqs: int  # decoding sequences (branches count one each)
    decode_context_tokens: int  # their summed context at the next decode (computed tokens + 1 each)
    prefilling: list[tuple[str, int]]  # (request id, decode sequences before it in batch order), in batch order
    prefill_tokens_left: int  # tokens the prefilling requests still have to compute
    max_prefill_context_tokens: int  # the longest computed context among them
    tenants: set[str | None]  # the tenants with a request in the batch
    # of the decoding sequences, those that speculate: (k, sequences, their summed context) per k, as in
    # ``StepShape.speculative_decodes`` (empty on an instance without speculation)
    speculative_decodes: tuple[tuple[int, int, int], ...] = ()


def held_blocks(r: Request) -> int:
    """Blocks ``r`` holds now (derived from its progress while it is in the lockstep set)."""
    lock = r.lock
    if lock is None:
        return r.num_blocks
    return blocks_for(r, r.num_computed + lock.ticks - r.g0 + lock.ahead, lock.block_size)


def blocks_for(r: Request, num_tokens: int, block_size: int, num_branches: int | None = None) -> int:
    """Blocks that hold ``num_tokens`` computed positions of ``r``: the prompt's blocks are shared by its
    branches; from the first decode on, each branch owns a copy of the prompt's last partial block and
    the blocks of its own output (``num_branches``: as if ``r`` had that many)."""
    n = r.num_branches if num_branches is None else num_branches
    p = r.num_prompt_tokens
    if n == 1 or num_tokens <= p:
        return -(-num_tokens // block_size)
    return p // block_size + n * -(-(p % block_size + num_tokens - p) // block_size)
