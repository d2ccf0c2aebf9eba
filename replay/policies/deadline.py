"""Deadline-aware admission control: admit a request only if it is safe for its whole service horizon.

Mechanism (``docs/design.md``, Deadline-aware admission; in the spirit of SLO-aware admission such as
Llumnix's and DistServe's capacity planning, and of QLM's waiting-time estimation):

1. **Predict the work as a conservative interval.** Output tokens per branch are the
   ``output_quantile_low`` .. ``output_quantile_high`` quantiles of the requests of the same class
   and tenant that already finished in this replay (``OutputLengthPredictor``; class, then all,
   then a prior while too few have finished), capped by the request's max_tokens. The policy never
   reads the true length: the views do not expose it.
2. **Check the whole horizon.** The request's KV at completion (prompt + high output, branches
   included, less prefix blocks that running requests already hold: prefix sharing) joins a
   ledger of every admitted request's completion KV. The batch may only hold what the KV pool
   holds less a recovery reserve (for requests that outrun their prediction) and an overload
   margin. The step-time slack the request takes from active streams is checked too: the decode
   step of every admitted stream at completion context must stay within the tightest ITL
   objective (times ``step_time_share``) among them. Requests whose completion KV does not fit
   wait in the engine queue, ordered by deadline (EDF), and enter the batch only when it does;
   so an admitted request is never preempted unless it outruns its interval.
3. **Answer.** The time to first token is predicted from the KV that must drain first (at the
   measured drain rate of the ledger), the prefill work queued ahead under the queue's order and
   the prefill rate the cost model gives for chunks beside the current decodes. ``accept`` when it
   meets the class's TTFT objective (and its E2E objective with the high output) less the
   overload margin; ``degrade`` when the first token is in time but the last would not be: the
   output is capped at the tokens that fit before the E2E deadline (at least
   ``min_degraded_output_tokens``; optional work reduced rather than the request refused), or
   when a request with parallel samples would miss its deadline with all of them but not with
   fewer: it runs with the most branches that fit (at least ``min_branches``);
   ``queue`` (held by admission control) when only a tenant quota stands in the way and its refill
   leaves the deadline reachable; otherwise, in a cluster that re-routes (``ClusterConfig.max_reroutes``)
   while ``EngineView.can_route`` allows it, ``route``: "not here", the cluster's router sends it to an
   instance it has not tried, whose own admission decides (the policy knows nothing of the others);
   otherwise, in a cluster with multi-model residency, ``downgrade`` to the first smaller model that
   ``qualified_downgrades`` lists for the request's model and ``EngineView.can_downgrade`` allows (another
   instance holds it resident): the cluster's router sends it to one of those, where it is served as that
   model and whose own admission decides;
   otherwise ``reject`` with a retry-after: how much later the same request would have met its objective.

Chunks follow Sarathi-Serve's stall-free rule sized to the ITL objective (``chunk_from_itl``).
Classes, weights and quotas come from tenant configuration. ``deadline-vtc`` orders the queue by
each tenant's VTC start tag (its counter, lifted if it was idle, plus the service it already has
queued, over its weight: fair share across every tenant, as VTC serves them regardless of class;
``replay.policies.vtc``), then deadline, and learns the counters from ``observe_step``. A tenant
that floods the instance sees its tag run ahead of everyone's, so its requests are predicted to
wait behind the others' and are the ones rejected (with retry-after), while the well-behaved
tenants' predictions, and so their admissions, barely move.

Of the optional work, speculative drafts, branches (a request with n > 1 that would miss its deadline
runs with the most branches that fit, at least ``min_branches``) and max tokens (E2E) are capped here,
in that order, before the request is routed elsewhere, downgraded or rejected. Drafts
(``cap_speculative_drafts``, on an instance with speculative decoding, ``replay.speculative``): when
the request's horizon does not fit with them (late, or in time only with its output capped) and
speculation does not pay at the predicted batch (every admitted stream and this one at completion
context: a step with all of them drafting k tokens, over the E tokens it yields, is not shorter than a
plain step), its drafts are turned off (``AdmissionDecision.num_speculative_tokens`` 0) and the rest
is decided from there; where speculation pays they stay, since turning them off would only lengthen
its own horizon. The predictions price speculation per request: the ledger counts each admitted
request's drafts, a speculating stream's output time is the step over E and its worst inter-token gap
the step over floor(E) (the engine's deterministic schedule), and prefill chunks are sized and priced
beside the running decodes' drafts and verification tokens. Draft KV is not modelled (``replay.speculative``),
so the cap acts on step time and token rate, not on the KV ledger. See ``docs/policies.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from replay.costmodel import StepShape
from replay.errors import ReplayError
from replay.policies.base import AdmissionDecision, Policy, register
from replay.policies.limits import check_magnitudes
from replay.policies.predict import OutputLengthPredictor
from replay.policies.sarathi import StallFreeChunks, check_chunk_settings
from replay.policies.tenancy import ClassConfig, Tenancy, TenantBook
from replay.policies.vtc import FairShare, Quotas, check_token_weights
from replay.views import EngineView, RequestView
from schemas.types import doc

NS = 1_000_000_000
NEVER = 1 << 62


@dataclass(frozen=True, slots=True, kw_only=True)
class QualifiedDowngrade:
    """A smaller model qualified to serve the requests of a model (``DeadlineConfig.qualified_downgrades``)."""

    model: str = doc("The model requests name (Request.model).")
    to: str = doc("A smaller model that may serve them.")

    def __post_init__(self) -> None:
        if self.to == self.model:
            raise ReplayError(f"a qualified downgrade of {self.model!r} must name another model")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlineConfig:
    """Settings of deadline-aware admission."""

    tenancy: Tenancy = doc("Classes (objectives, priority) and tenants (weights, quotas).", Tenancy())
    output_quantile_low: float = doc("Low end of the predicted output interval: this quantile of finished lengths.", 0.1)
    output_quantile_high: float = doc("High end (what KV is reserved for): this quantile of finished lengths.", 0.9)
    history_requests: int = doc("Finished requests remembered per (class, tenant) for the quantiles.", 512)
    min_history: int = doc("Finished requests needed before a (class, tenant) window is trusted.", 20)
    prior_output_tokens_low: int = doc("Predicted low output per branch before anything finished.", 16)
    prior_output_tokens_high: int = doc("Predicted high output per branch before anything finished.", 512)
    recovery_reserve_share: float = doc(
        "Share of the KV pool kept out of reservations for requests that outrun their prediction.", 0.05
    )
    overload_margin: float = doc(
        "Share of capacity and of every objective held back: the controller plans to (1 - margin).", 0.1
    )
    drain_window_s: float = doc("Time constant of the measured KV drain rate, seconds.", 30.0)
    retry_after_min_s: float = doc("Shortest retry-after a rejection sends, seconds.", 1.0)
    degrade_to_meet_e2e: bool = doc(
        "When only the E2E objective would be missed, accept with the output capped where it is still met "
        "(a 'degrade' decision: optional work reduced) instead of rejecting.", True
    )
    min_degraded_output_tokens: int = doc("Never cap a request's output below this many tokens per branch.", 64)
    min_branches: int = doc(
        "When a request with parallel samples (n > 1) would miss its deadline, accept it with fewer branches, the "
        "most that make its horizon fit but never fewer than this (a 'degrade' decision); n <= this: never reduced.", 1
    )
    cap_speculative_drafts: bool = field(default=True, metadata={
        "doc": "On an instance with speculative decoding: when a request's horizon does not fit with its drafts (or "
               "fits only with its output capped) and speculation does not pay at the predicted batch (a step of "
               "every admitted stream drafting, over the tokens it yields, is not shorter than a plain step), turn "
               "its drafts off first (a 'degrade' decision with num_speculative_tokens 0), before branches are "
               "reduced, its output capped or it is sent elsewhere or rejected.",
        "omit_default": True,  # absent from the manifest while on: run ids stay as they were
    })
    chunk_from_itl: bool = doc("Size prefill chunks to the ITL objective, stall-free (Sarathi-Serve).", True)
    step_time_share: float = doc("Step-time target as a share of the tightest ITL objective.", 0.9)
    min_chunk_tokens: int = doc("A step with no prefill yet takes at least this many prompt tokens.", 32)
    input_token_weight: int = doc("Service per input token (quotas, and VTC in deadline-vtc).", 1)
    output_token_weight: int = doc("Service per output token (quotas, and VTC in deadline-vtc).", 2)
    qualified_downgrades: tuple[QualifiedDowngrade, ...] = field(default=(), metadata={
        "doc": "Smaller models qualified to serve a model's requests, in order of preference: a request that "
               "would miss its deadline here is answered 'downgrade' to the first of its model's that "
               "EngineView.can_downgrade allows (a cluster with multi-model residency where another instance "
               "holds it). Empty (the default): never downgrade.",
        "omit_empty": True,  # absent from the manifest while empty: run ids stay as they were
    })

    def __post_init__(self) -> None:
        check_magnitudes("deadline", self)
        if not 0 <= self.output_quantile_low <= self.output_quantile_high <= 1:
            raise ReplayError("deadline: need 0 <= output_quantile_low <= output_quantile_high <= 1")
        if not 0 <= self.recovery_reserve_share + self.overload_margin < 1 or min(
            self.recovery_reserve_share, self.overload_margin
        ) < 0:
            raise ReplayError(
                "deadline: recovery_reserve_share and overload_margin must be non-negative and add up to less than 1"
            )
        if self.history_requests < 1 or self.min_history < 1 or self.prior_output_tokens_high < 1:
            raise ReplayError("deadline: history_requests, min_history and prior_output_tokens_high must be >= 1")
        if not 0 <= self.prior_output_tokens_low <= self.prior_output_tokens_high:
            raise ReplayError("deadline: need 0 <= prior_output_tokens_low <= prior_output_tokens_high, not "
                              f"{self.prior_output_tokens_low} and {self.prior_output_tokens_high}")
        check_chunk_settings("deadline", self.step_time_share, self.min_chunk_tokens)
        check_token_weights("deadline", self.input_token_weight, self.output_token_weight)
        if not self.drain_window_s > 0 or self.retry_after_min_s < 0:
            raise ReplayError("deadline: drain_window_s must be positive and retry_after_min_s non-negative")
        if self.min_degraded_output_tokens < 1 or self.min_branches < 1:
            raise ReplayError("deadline: min_degraded_output_tokens and min_branches must be at least 1")
        pairs = [(d.model, d.to) for d in self.qualified_downgrades]
        if len(set(pairs)) != len(pairs):
            raise ReplayError("deadline: qualified_downgrades lists a downgrade twice")


class _Entry:
    """An admitted request in the ledger: what it was promised and what it may still take."""

    __slots__ = ("view", "service_class", "tenant", "branches", "prompt", "high", "blocks", "ctx", "service", "key",
                 "cap", "spec")

    def __init__(self, view: RequestView, cls: ClassConfig, high: int, blocks: int, service: float, key: tuple,
                 cap: int | None = None, branches: int | None = None, spec: int = 0) -> None:
        self.view = view
        self.spec = spec  # speculative tokens (k) it drafts per step (0: none)
        self.cap = cap  # the output cap a degrade decision imposed (its length is then censored)
        self.service_class = cls.name
        self.tenant = view.tenant
        self.branches = view.num_branches if branches is None else branches  # after a degrade's reduction
        self.prompt = view.num_prompt_tokens
        self.high = high  # output tokens per branch reserved for
        self.blocks = blocks  # KV blocks at completion, less prefix blocks shared with running requests
        self.ctx = self.branches * (self.prompt + high)  # decode context at completion (all branches)
        self.service = service  # input x w_in + high output x w_out (quotas, VTC tags)
        self.key = key  # its place in the queue, fixed at admission


class _Drain:
    """Exponentially weighted rate of a quantity released over time (KV blocks, requests)."""

    __slots__ = ("tau_ns", "amount", "start_ns", "last_ns")

    def __init__(self, tau_s: float) -> None:
        self.tau_ns = tau_s * NS
        self.amount = 0.0
        self.start_ns: int | None = None
        self.last_ns = 0

    def add(self, amount: float, now_ns: int) -> None:
        if self.start_ns is None:
            self.start_ns = self.last_ns = now_ns
        self.amount = self.amount * math.exp(-(now_ns - self.last_ns) / self.tau_ns) + amount
        self.last_ns = now_ns

    def rate_per_s(self, now_ns: int) -> float:
        if self.start_ns is None or now_ns <= self.start_ns or self.amount <= 0:
            return 0.0
        decayed = self.amount * math.exp(-(now_ns - self.last_ns) / self.tau_ns)
        window_s = self.tau_ns * (1 - math.exp(-(now_ns - self.start_ns) / self.tau_ns)) / NS
        return decayed / window_s if window_s > 0 else 0.0


@register
class DeadlinePolicy(Policy):
    """Admit only what is safe for its whole horizon (predicted KV to completion, step-time slack,
    TTFT); EDF queue gated by the reserved KV; reject early with retry-after."""

    name = "deadline"
    config_type = DeadlineConfig
    fair_share = False

    def __init__(self, config: DeadlineConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.book = TenantBook(c.tenancy)
        self.predictor = OutputLengthPredictor(
            window=c.history_requests, min_samples=c.min_history, q_low=c.output_quantile_low,
            q_high=c.output_quantile_high, prior_low=c.prior_output_tokens_low, prior_high=c.prior_output_tokens_high,
        )
        self.chunks = StallFreeChunks(self.book, c.step_time_share, None, c.min_chunk_tokens)
        self.fair = FairShare(self.book, c.input_token_weight, c.output_token_weight) if self.fair_share else None
        self.quotas = Quotas(self.book)
        self.ledger: dict[str, _Entry] = {}
        self.reserved_blocks = 0
        self.reserved_seqs = 0
        self.reserved_ctx = 0
        self.reserved_spec_seqs = 0  # of the reserved sequences, those that speculate (and their context)
        self.reserved_spec_ctx = 0
        self.kv_drain = _Drain(c.drain_window_s)
        self.request_drain = _Drain(c.drain_window_s)
        self._retry_at: dict[str, int] = {}  # held request -> when its re-offer is already scheduled
        self._gate_open_ns = -1
        self._step_cache: dict[tuple[int, int, int], int] = {}
        self._class_counts: dict[str, int] = {}  # admitted requests per class
        # admitted prompt tokens and KV blocks per second, per (class, tenant)
        self._inflow: dict[tuple[str, str | None], tuple[_Drain, _Drain]] = {}
        self._headroom: dict[str, int] = {}  # per class: KV kept for classes that overtake it
        # the classes are fixed by the tenancy: each one's deadline offset, and which classes overtake it
        self._offsets: dict[str, int] = {c.name: self._class_offset_ns(c) for c in self.book.classes.values()}
        self._overtaken_by: dict[str, frozenset[str]] = {
            c.name: frozenset(o.name for o in self.book.classes.values() if self._overtakes(o, c))
            for c in self.book.classes.values()
        }
        self._overtaking = frozenset().union(*self._overtaken_by.values())  # classes that overtake some class
        self.num_learned = 0
        self._downgrades: dict[str, list[str]] = {}  # model -> the smaller ones, in order of preference
        for d in c.qualified_downgrades:
            self._downgrades.setdefault(d.model, []).append(d.to)

    # ---------------------------------------------------------------------------- ledger upkeep

    def _sync(self, view: EngineView) -> None:
        """Release what departed (finished or cancelled) and learn its length; widen the reservation
        of running requests that outran their prediction. Runs only after a departure, so its effect
        does not depend on how often the policy is asked (fast and reference modes agree)."""
        ledger = self.ledger
        if len(view.running) + len(view.waiting) >= len(ledger):
            return
        now = view.now_ns
        freed = departed = 0
        finished: list[_Entry] = []
        running: list[_Entry] = []
        for e in ledger.values():  # one walk; each state read once
            state = e.view.state
            if state == "finished":
                finished.append(e)
            elif state == "running":
                running.append(e)
        for e in finished:
            del ledger[e.view.request_id]
            self.reserved_blocks -= e.blocks
            self.reserved_seqs -= e.branches
            self.reserved_ctx -= e.ctx
            if e.spec:
                self.reserved_spec_seqs -= e.branches
                self.reserved_spec_ctx -= e.ctx
            self._class_counts[e.service_class] -= 1
            freed += e.blocks
            departed += 1
            if e.cap is None:  # a capped request's length says nothing about what it would have produced
                self.predictor.observe(e.service_class, e.tenant, e.view.num_output_tokens // e.branches)
                self.num_learned += 1
            # what it never used (cancelled early) was not load after all: take it back from its flow's
            # inflow, so a tenant that submits and cancels does not look like one that is served
            computed = e.view.num_computed_tokens
            unserved = e.prompt - computed
            unused = e.blocks - view.blocks_for_tokens(e.view, computed)
            if unserved > 0 or unused > 0:
                tokens, blocks = self._inflow[(e.service_class, e.tenant)]
                tokens.add(-max(0, unserved), now)
                blocks.add(-max(0, unused), now)
        self.kv_drain.add(freed, now)
        self.request_drain.add(departed, now)
        for e in running:
            v = e.view
            produced = v.num_output_tokens // e.branches
            if produced >= e.high and e.cap is None:
                high = produced + max(1, self.predictor.remaining_high(e.service_class, e.tenant, produced,
                                                                       v.max_output_tokens))
                blocks = view.blocks_for_tokens(v, e.prompt + high)
                self.reserved_blocks += blocks - e.blocks
                self.reserved_ctx += e.branches * (high - e.high)
                if e.spec:
                    self.reserved_spec_ctx += e.branches * (high - e.high)
                e.blocks, e.ctx, e.high = blocks, e.ctx + e.branches * (high - e.high), high

    def _admit_to_ledger(self, request: RequestView, cls: ClassConfig, high: int, blocks: int, service: float,
                         key: tuple, now_ns: int, cap: int | None = None, branches: int | None = None,
                         spec: int = 0) -> None:
        e = _Entry(request, cls, high, blocks, service, key, cap, branches, spec)
        self.ledger[request.request_id] = e
        self.reserved_blocks += e.blocks
        self.reserved_seqs += e.branches
        self.reserved_ctx += e.ctx
        if spec:
            self.reserved_spec_seqs += e.branches
            self.reserved_spec_ctx += e.ctx
        self._class_counts[e.service_class] = self._class_counts.get(e.service_class, 0) + 1
        flow = self._inflow.get((cls.name, e.tenant))
        if flow is None:
            flow = self._inflow[(cls.name, e.tenant)] = (_Drain(self.config.drain_window_s),
                                                         _Drain(self.config.drain_window_s))
        flow[0].add(request.num_prompt_tokens, now_ns)
        flow[1].add(e.blocks, now_ns)
        self._update_headroom(now_ns)

    def _update_headroom(self, now_ns: int) -> None:
        """Per class, the KV that the classes overtaking it need within their own deadline (their KV
        inflow x their deadline): a class may not fill it, or a tighter request arriving would have
        to wait for the pool to drain. Updated at admissions only, so the queue gate does not move
        between events."""
        classes = self.book.classes.values()
        overtaking = self._overtaking
        rate = {c.name: 0.0 for c in classes}
        for (name, _), (_, blocks) in self._inflow.items():
            if name in overtaking:  # only the rates of classes that overtake another are ever summed
                rate[name] += blocks.rate_per_s(now_ns)
        offsets = self._offsets
        for c in classes:
            by = self._overtaken_by[c.name]
            self._headroom[c.name] = int(sum(rate[o.name] * offsets[o.name] / NS for o in classes if o.name in by))

    # ---------------------------------------------------------------------------- predictions

    def capacity_blocks(self, view: EngineView) -> int:
        c = self.config
        return int(view.num_kv_blocks_total * (1 - c.recovery_reserve_share - c.overload_margin))

    def _step_ns(self, view: EngineView, chunk: int, num_decode_seqs: int, decode_ctx: int, spec_seqs: int = 0,
                 spec_ctx: int = 0) -> int:
        """A step's time: a prefill chunk, ``num_decode_seqs`` decodes with ``decode_ctx`` summed context, of which
        ``spec_seqs`` (with ``spec_ctx``) speculate with the instance's k (contexts in units of 4,096 tokens)."""
        if not spec_seqs:
            key: tuple = (chunk, num_decode_seqs, -(-decode_ctx // 4096))
            spec: tuple = ()
        else:
            units = -(-spec_ctx // 4096)
            key = (chunk, num_decode_seqs, -(-(decode_ctx - spec_ctx) // 4096), spec_seqs, units)
            spec = ((view.instance.speculative.num_speculative_tokens, spec_seqs, units * 4096),)
        t = self._step_cache.get(key)
        if t is None:
            t = self._step_cache[key] = view.cost_model.step_time_ns(
                StepShape(((chunk, 0),) if chunk else (), num_decode_seqs - spec_seqs, key[2] * 4096, spec)
            )
        return t

    @staticmethod
    def _tokens_per_step(view: EngineView, spec: int) -> float:
        """A sequence's expected tokens per decode step with ``spec`` speculative tokens (1 without)."""
        return view.instance.speculative.expected_tokens(spec) if spec else 1.0

    def _speculation_pays(self, view: EngineView, request: RequestView, high: int, branches: int, spec: int) -> bool:
        """Whether speculation pays at the batch predicted with the request admitted (every admitted stream and
        its ``branches`` at completion context): a decode step with every sequence speculating ``spec``
        tokens, over the E tokens it yields, is shorter than a step with none speculating."""
        seqs = self.reserved_seqs + branches
        ctx = self.reserved_ctx + branches * (request.num_prompt_tokens + high)
        return self._step_ns(view, 0, seqs, ctx, seqs, ctx) / self._tokens_per_step(view, spec) < self._step_ns(
            view, 0, seqs, ctx)

    def _gap_ns(self, view: EngineView, seqs: int, ctx: int, spec_seqs: int, spec_ctx: int) -> int:
        """The worst inter-token gap of a decode batch's streams: the step time, over the fewest tokens a
        step delivers when every stream speculates (``floor(E)``, the deterministic schedule's least)."""
        if not spec_seqs:
            return self._step_ns(view, 0, seqs, ctx)
        step = self._step_ns(view, 0, seqs, ctx, spec_seqs, spec_ctx)
        if spec_seqs == seqs:
            return step // math.floor(self._tokens_per_step(view, view.instance.speculative.num_speculative_tokens))
        return step

    def _itl_target_ns(self, cls: ClassConfig | None) -> int | None:
        """The tightest ITL target among the admitted requests' classes and ``cls`` (x step_time_share)."""
        tightest = cls.itl_objective_s if cls is not None else None
        classes = self.book.classes
        for name, count in self._class_counts.items():
            itl = classes[name].itl_objective_s
            if count and itl is not None and (tightest is None or itl < tightest):
                tightest = itl
        return None if tightest is None else round(tightest * self.config.step_time_share * NS)

    def _offset_ns(self, cls: ClassConfig) -> int:
        """A class's deadline after arrival: its TTFT objective, else its residence limit, else none."""
        return self._offsets[cls.name]

    @staticmethod
    def _class_offset_ns(cls: ClassConfig) -> int:
        if cls.ttft_objective_s is not None:
            return round(cls.ttft_objective_s * NS)
        if cls.max_queue_s is not None:
            return round(cls.max_queue_s * NS)
        return NEVER

    def _overtakes(self, other: ClassConfig, cls: ClassConfig) -> bool:
        """Whether later arrivals of ``other`` go ahead of a waiting request of ``cls`` under EDF: when
        their deadline is shorter (deadline-vtc decides by tenant counters instead: ``_overtaking_load``)."""
        return self._class_offset_ns(other) < self._class_offset_ns(cls)

    def _overtaking_load(self, request: RequestView, cls: ClassConfig, key: tuple, now_ns: int) -> tuple[float, float]:
        """(prompt tokens, KV blocks) per second of the admitted flows whose later arrivals go ahead of
        this request: with EDF, the classes with shorter deadlines; in deadline-vtc, the other tenants
        whose counters are below this request's start tag."""
        fair = self.fair
        by = self._overtaken_by[cls.name]
        tokens_per_s = blocks_per_s = 0.0
        for (name, tenant), (tokens, blocks) in self._inflow.items():
            if (fair is None and name in by) or (
                fair is not None and tenant != request.tenant and fair.lifted(tenant) < key[0]
            ):
                tokens_per_s += tokens.rate_per_s(now_ns)
                blocks_per_s += blocks.rate_per_s(now_ns)
        return tokens_per_s, blocks_per_s

    def work(self, view: EngineView, request: RequestView) -> tuple[ClassConfig, int, int, int]:
        """(class, low and high output tokens per branch, KV blocks at completion less shared prefix)."""
        cls = self.book.class_of(request)
        lo, hi = self.predictor.interval(cls.name, request.tenant, request.max_output_tokens)
        _, shared = view.cached_prefix_blocks(request)
        blocks = view.blocks_for_tokens(request, request.num_prompt_tokens + hi) - shared
        return cls, lo, hi, blocks

    def queue_key(self, view: EngineView, request: RequestView, cls: ClassConfig, deadline_ns: int) -> tuple:
        """Where the request would wait: by deadline (EDF); deadline-vtc: by the tenant's VTC start tag
        (its counter plus the service it already has queued, over its weight: start-time fair
        queuing), then deadline. Fixed at admission, so predictions stay valid."""
        if self.fair is None:
            return (deadline_ns, request.arrival_ns, request.request_id)
        tenant = request.tenant
        queued = 0
        for w in view.waiting:
            e = self.ledger.get(w.request_id)
            if e is not None and e.tenant == tenant and w.num_computed_tokens == 0:
                queued += e.service
        tag = self.fair.lifted(tenant) + Fraction(queued) / self.fair.weight(tenant)
        return (tag, deadline_ns, request.arrival_ns, request.request_id)

    def predicted_ttft_s(self, view: EngineView, request: RequestView, cls: ClassConfig, high: int, blocks: int,
                         key: tuple, branches: int | None = None, spec: int = 0) -> float:
        """Seconds to the first token if admitted now: the KV that must drain before it fits and the
        prefill work ahead of it in the queue, stretched by the load of later arrivals that will
        overtake it (a priority queue's waiting time, W / (1 - rho)), plus its own prefill, at the
        rate the cost model gives for chunks beside the current decodes (``branches``: as if it ran
        with that many parallel samples; ``spec``: drafting that many speculative tokens per step)."""
        ledger = self.ledger
        waiting_blocks = ahead_blocks = ahead_tokens = waiting_seqs = waiting_ctx = 0
        waiting_spec_seqs = waiting_spec_ctx = 0
        for w in view.waiting:
            e = ledger.get(w.request_id)
            if e is None:
                continue
            waiting_blocks += e.blocks
            waiting_seqs += e.branches
            waiting_ctx += e.ctx
            if e.spec:
                waiting_spec_seqs += e.branches
                waiting_spec_ctx += e.ctx
            if e.key <= key:
                ahead_blocks += e.blocks
                ahead_tokens += w.num_tokens - w.num_computed_tokens
        now = view.now_ns
        tokens_per_s, blocks_per_s = self._overtaking_load(request, cls, key, now)
        kv_wait_s = 0.0
        deficit = (self.reserved_blocks - waiting_blocks + ahead_blocks + blocks
                   - self.capacity_blocks(view) + self._headroom.get(cls.name, 0))
        if deficit > 0:
            # the pool drains at the measured rate, but overtaking arrivals take their share of it
            rate = self.kv_drain.rate_per_s(now) - blocks_per_s
            kv_wait_s = deficit / rate if rate > 0 else math.inf
        target = self._itl_target_ns(cls)
        if target is not None and kv_wait_s < math.inf:
            n = request.num_branches if branches is None else branches
            seqs = self.reserved_seqs - waiting_seqs + n
            own_ctx = n * (request.num_prompt_tokens + high)
            ctx = self.reserved_ctx - waiting_ctx + own_ctx
            spec_seqs = self.reserved_spec_seqs - waiting_spec_seqs + (n if spec else 0)
            spec_ctx = self.reserved_spec_ctx - waiting_spec_ctx + (own_ctx if spec else 0)
            if self._gap_ns(view, seqs, ctx, spec_seqs, spec_ctx) > target:  # the active streams' step-time slack is used up
                rate = self.request_drain.rate_per_s(now)
                kv_wait_s = max(kv_wait_s, 1 / rate if rate > 0 else math.inf)
        if kv_wait_s == math.inf:
            return math.inf
        return self._prefill_wait_s(view, request, kv_wait_s, ahead_tokens, tokens_per_s, target)

    def _prefill_wait_s(self, view: EngineView, request: RequestView, kv_wait_s: float, ahead_tokens: int,
                        tokens_per_s: float, target: int | None) -> float:
        """``predicted_ttft_s`` once the KV wait is known: the prefill backlog ahead of the request (its
        ``ahead_tokens`` and the running chunks' rest), stretched by the overtaking arrivals' load, then its
        own prefill, in chunks beside the current decodes (``target``: the ITL objective sizing them)."""
        batch = self.chunks.batch.refresh(view)
        d, ctx, spec_decodes = batch.num_decode_seqs, batch.decode_context_tokens, batch.speculative_decodes
        chunk = max(1, view.instance.engine.max_num_batched_tokens - d)
        if self.config.chunk_from_itl and target is not None:
            chunk = max(self.config.min_chunk_tokens,
                        min(chunk, self.chunks.sizer.max_chunk_tokens(view, d, ctx, 0, target, spec_decodes)))
        spec_seqs = spec_ctx = 0  # the running decodes that speculate (their drafts, their verification)
        for _, n, c in spec_decodes:  # slow every prefill step
            spec_seqs += n
            spec_ctx += c
        step_s = self._step_ns(view, chunk, d, ctx, spec_seqs, spec_ctx) / NS
        backlog_s = math.ceil((ahead_tokens + batch.prefill_tokens_left) / chunk) * step_s
        rho = tokens_per_s * step_s / chunk  # the prefill time overtaking arrivals take
        if rho >= 1:
            return math.inf
        cached, _ = view.cached_prefix_blocks(request)
        own = max(1, request.num_prompt_tokens - cached * view.kv_block_size_tokens)
        return max(kv_wait_s, backlog_s / (1 - rho)) + math.ceil(own / chunk) * step_s

    # ---------------------------------------------------------------------------- decisions

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        self._sync(view)
        c = self.config
        now = view.now_ns
        due = self._retry_at.get(request.request_id)
        if due is not None and now < due:
            return AdmissionDecision(decision="queue")  # held for a quota: unchanged until its re-offer is due
        cls, lo, hi, blocks = self.work(view, request)
        offset = self._offset_ns(cls)
        deadline_ns = NEVER if offset == NEVER else request.arrival_ns + offset
        key = self.queue_key(view, request, cls, deadline_ns)
        interval = {"predicted_output_tokens_low": lo, "predicted_output_tokens_high": hi}
        waited_s = (now - request.arrival_ns) / NS
        budget_s = math.inf if offset == NEVER else offset / NS * (1 - c.overload_margin) - waited_s
        branches, blocks, spec, late_s, cap = self._fit(view, request, cls, hi, blocks, key, waited_s, budget_s)
        if late_s > 0:
            return self._late(view, request, late_s, interval)
        service = request.num_prompt_tokens * c.input_token_weight + hi * branches * c.output_token_weight
        over = self.quotas.wait_s(request.tenant, service, now, self._num_admitted)
        if over is not None:
            return self._over_quota(request, over, late_s, now, interval)
        self._retry_at.pop(request.request_id, None)
        self.quotas.take(request.tenant, service, now)
        if self.fair is not None:
            self.fair.arrive(request)
        if cap is not None or branches != request.num_branches or spec != request.num_speculative_tokens:
            return self._degraded(view, request, cls, hi, blocks, service, key, cap, branches, spec, interval)
        self._admit_to_ledger(request, cls, hi, blocks, service, key, now, spec=spec)
        return AdmissionDecision(decision="accept", **interval)

    def _fit(self, view: EngineView, request: RequestView, cls: ClassConfig, hi: int, blocks: int, key: tuple,
             waited_s: float, budget_s: float) -> tuple[int, int, int, float, int | None]:
        """(branches, KV blocks, speculative tokens, seconds late, output cap) of the request admitted now,
        dropping optional work to fit its horizon, the cheapest first: its speculative drafts when
        speculation does not pay, then parallel samples."""
        c = self.config
        branches = request.num_branches
        spec = request.num_speculative_tokens  # the engine's grant here: the instance's k (0: none)
        late_s, cap = self._lateness(view, request, cls, hi, blocks, branches, key, waited_s, budget_s, spec)
        if (spec and c.cap_speculative_drafts and (late_s > 0 or cap is not None)
                and not self._speculation_pays(view, request, hi, branches, spec)):
            # optional work, the cheapest first: its drafts, when speculation does not pay at the predicted
            # batch (they cost the batch more step time than the tokens they add); then the rest, from there
            spec = 0
            late_s, cap = self._lateness(view, request, cls, hi, blocks, branches, key, waited_s, budget_s)
        if late_s > 0 and branches > c.min_branches:
            # optional work: fewer parallel samples, the most that make the horizon fit
            _, shared = view.cached_prefix_blocks(request)
            for k in range(branches - 1, c.min_branches - 1, -1):
                k_blocks = view.blocks_for_tokens(request, request.num_prompt_tokens + hi, k) - shared
                k_late_s, k_cap = self._lateness(view, request, cls, hi, k_blocks, k, key, waited_s, budget_s, spec)
                if k_late_s <= 0:
                    branches, blocks, late_s, cap = k, k_blocks, k_late_s, k_cap
                    break
        return branches, blocks, spec, late_s, cap

    def _late(self, view: EngineView, request: RequestView, late_s: float, interval: dict) -> AdmissionDecision:
        """The decision for a request that would miss its deadline here: another instance (route), a smaller
        model elsewhere (downgrade), else reject with when to retry."""
        c = self.config
        self._retry_at.pop(request.request_id, None)
        if view.can_route(request):  # a cluster offers another instance: say "not here", it picks where
            return AdmissionDecision(decision="route", reason="would miss its deadline here", **interval)
        if request.model is not None:
            for smaller in self._downgrades.get(request.model, ()):
                if view.can_downgrade(request, smaller):  # another instance serves it: there, as that model
                    return AdmissionDecision(decision="downgrade", target=smaller, **interval,
                                             reason=f"would miss its deadline here as {request.model}")
        retry = late_s if late_s < math.inf else c.drain_window_s
        return AdmissionDecision(decision="reject", reason="would miss its deadline",
                                 retry_after_s=max(c.retry_after_min_s, retry), **interval)

    def _over_quota(self, request: RequestView, over: tuple[float, str], late_s: float, now: int,
                    interval: dict) -> AdmissionDecision:
        """The decision for a request in time but over its tenant's quota (``over``: the wait until the quota
        frees, and why): queue it when the quota frees in time, else reject."""
        wait_s, why = over
        if wait_s <= -late_s:  # the quota frees in time: hold it until then
            if wait_s == 0:  # a concurrency slot: it frees when one of the tenant's requests leaves
                retry = None
            elif self._retry_at.get(request.request_id, -1) >= now:
                retry = None  # its re-offer is already due
            else:
                retry = wait_s
                self._retry_at[request.request_id] = now + max(1, round(wait_s * NS))
            return AdmissionDecision(decision="queue", reason=why, retry_after_s=retry, **interval)
        self._retry_at.pop(request.request_id, None)
        return AdmissionDecision(decision="reject", reason=why,
                                 retry_after_s=max(self.config.retry_after_min_s, wait_s), **interval)

    def _degraded(self, view: EngineView, request: RequestView, cls: ClassConfig, hi: int, blocks: int,
                  service: float, key: tuple, cap: int | None, branches: int, spec: int,
                  interval: dict) -> AdmissionDecision:
        """Admit the request with less work than it asked (drafts off, fewer branches, a capped output)."""
        granted = request.num_speculative_tokens
        drafts_off = spec != granted
        reasons = []
        if drafts_off:
            reasons.append(f"speculative drafts off (k {granted} to {spec}): "
                           "speculation does not pay at its predicted batch")
        if branches != request.num_branches:
            reasons.append(f"branches reduced from {request.num_branches} to {branches} to fit its horizon")
        if cap is not None:
            _, shared = view.cached_prefix_blocks(request)
            blocks = view.blocks_for_tokens(request, request.num_prompt_tokens + cap, branches) - shared
            reasons.append(f"output capped at {cap} tokens to meet its E2E objective")
        self._admit_to_ledger(request, cls, cap if cap is not None else hi, blocks, service, key, view.now_ns, cap,
                              branches, spec)
        return AdmissionDecision(
            decision="degrade", reason="; ".join(reasons), max_output_tokens=cap,
            num_branches=branches if branches != request.num_branches else None,
            num_speculative_tokens=spec if drafts_off else None, **interval,
        )

    def _lateness(self, view: EngineView, request: RequestView, cls: ClassConfig, hi: int, blocks: int, branches: int,
                  key: tuple, waited_s: float, budget_s: float, spec: int = 0) -> tuple[float, int | None]:
        """(seconds it would be late, <= 0 when in time; the output cap that keeps its E2E objective, or
        None) if admitted now with ``branches`` parallel samples holding ``blocks`` at completion, drafting
        ``spec`` speculative tokens per step (its decode then yields E tokens per step, at that step's cost)."""
        c = self.config
        ttft_s = self.predicted_ttft_s(view, request, cls, hi, blocks, key, branches, spec)
        late_s = ttft_s - budget_s
        cap = None
        if cls.e2e_objective_s is not None and ttft_s < math.inf:
            spec_seqs = self.reserved_spec_seqs + (branches if spec else 0)
            step_ns = self._step_ns(view, 0, self.reserved_seqs + branches, self.reserved_ctx, spec_seqs,
                                    self.reserved_spec_ctx)
            e2e_left_s = cls.e2e_objective_s * (1 - c.overload_margin) - waited_s
            per_step = self._tokens_per_step(view, spec) if spec else 1  # E tokens per step when it speculates
            e2e_late_s = ttft_s + hi * step_ns / per_step / NS - e2e_left_s
            if e2e_late_s > 0 and late_s <= 0 and c.degrade_to_meet_e2e:
                # the first token is in time, the last is not: how many tokens fit before the E2E deadline
                fit = int((round(e2e_left_s * NS) - round(ttft_s * NS)) * per_step // step_ns)
                if c.min_degraded_output_tokens <= fit < hi:
                    cap = int(fit)
            if cap is None:
                late_s = max(late_s, e2e_late_s)
        return late_s, cap

    def _num_admitted(self, tenant: str | None) -> int:
        return sum(1 for e in self.ledger.values() if e.tenant == tenant)

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        """Waiting requests by their queue key, entering the batch only while the batch's completion
        KV and its decode step time stay within capacity."""
        self._sync(view)
        ledger = self.ledger
        keyed = []
        waiting_blocks = waiting_seqs = waiting_ctx = waiting_spec_seqs = waiting_spec_ctx = 0
        for w in waiting:
            e = ledger.get(w.request_id)
            if e is None:  # not admitted through this policy (not expected): ahead of all, as it came
                keyed.append(((), w, None))
                continue
            waiting_blocks += e.blocks
            waiting_seqs += e.branches
            waiting_ctx += e.ctx
            if e.spec:
                waiting_spec_seqs += e.branches
                waiting_spec_ctx += e.ctx
            keyed.append((e.key, w, e))
        keyed.sort(key=lambda k: k[0])
        used = self.reserved_blocks - waiting_blocks
        capacity = self.capacity_blocks(view)
        headroom = self._headroom
        seqs = self.reserved_seqs - waiting_seqs
        ctx = self.reserved_ctx - waiting_ctx
        spec_seqs = self.reserved_spec_seqs - waiting_spec_seqs
        spec_ctx = self.reserved_spec_ctx - waiting_spec_ctx
        target = self._itl_target_ns(None)
        out: list[RequestView] = []
        for _, w, e in keyed:
            if e is not None:
                if used + e.blocks > capacity - headroom.get(e.service_class, 0) and (seqs or out):
                    break  # its whole horizon does not fit yet (alone in an empty batch, it runs anyway)
                s_seqs, s_ctx = (spec_seqs + e.branches, spec_ctx + e.ctx) if e.spec else (spec_seqs, spec_ctx)
                if target is not None and seqs and self._gap_ns(view, seqs + e.branches, ctx + e.ctx, s_seqs,
                                                                s_ctx) > target:
                    break  # it would take more step time than the active streams' ITL objectives leave
                used += e.blocks
                seqs += e.branches
                ctx += e.ctx
                spec_seqs, spec_ctx = s_seqs, s_ctx
            out.append(w)
        if out:
            self._gate_open_ns = view.now_ns
        return out

    def victim(self, view: EngineView, candidates: Sequence[RequestView]) -> RequestView:
        """The candidate with the most slack: the latest queue key."""
        ledger = self.ledger
        return max(candidates, key=lambda r: (1, ledger[r.request_id].key) if r.request_id in ledger else (0, ()))

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        if self.config.chunk_from_itl:
            return self.chunks.chunk(view, request, num_tokens_left, budget_tokens)
        return min(num_tokens_left, budget_tokens)

    def run_horizon_steps(self, view: EngineView) -> int | None:
        # a request passed the KV gate but the engine could not place it: its ITL-sized chunk (hence
        # its first allocation) changes with the decodes' context, so decide again every step
        if self.config.chunk_from_itl and self._gate_open_ns == view.now_ns:
            return 1
        return None


@register
class DeadlineVtcPolicy(DeadlinePolicy):
    """Deadline-aware admission with VTC fair share among tenants: queue by VTC start tag, then
    deadline (counters from observe_step)."""

    name = "deadline-vtc"
    config_type = DeadlineConfig
    fair_share = True

    def observe_step(self, view: EngineView, requests: Sequence[RequestView], num_tokens: Sequence[int],
                     num_steps: int) -> None:
        self.fair.observe(requests, num_tokens, num_steps)
