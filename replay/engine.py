"""One modelled serving instance: iteration-level batching over a KV block pool, on the event kernel.

The engine owns the queues (waiting, running, held by admission), the KV ``BlockPool`` and the
batch; the policy (``replay.policies``) decides admission, order, chunk sizes and preemption
victims through read-only views. Each scheduling pass follows vLLM v1's scheduler:

1. running requests first, in the order they joined the batch: a decode takes one position (one
   token per branch), a prefilling request a chunk of its remaining prompt (``chunk_tokens``);
   when its KV blocks cannot be allocated, the policy's victim (FCFS: the newest not yet scheduled)
   is preempted until they can, or the request itself is;
2. then, only if nothing was preempted, waiting requests in the policy's order while the sequence
   cap, the token budget and the KV pool (less the watermark) allow; the first that does not fit
   stops the pass. A request's prefix-cache hits are looked up as it is admitted.

A step's duration comes from the cost model for its whole composition; its tokens are delivered
at its end.

Two modes. The *reference* mode runs the pass above request by request for every step. The *fast*
mode (the default) computes the same passes with less work:

- Decoding requests form a *lockstep* set advanced by one shared decode clock (``Lockstep``): their
  step composition (sequences, summed context), the blocks they need at each step (a histogram by
  block phase), and the first of them to finish (a heap) are aggregates updated when a request
  joins or leaves, so a pass whose running batch is the lockstep set followed by a few prefilling
  requests costs O(1 + those few) instead of O(batch). Anything irregular (a preemption, a budget
  too small for every decode, a prefilling request between decoders) falls back to the
  request-by-request pass, which is the reference mode's code.
- A decode-only pass whose decisions would repeat (every running request decoding, nothing
  admitted, nothing preempted, the policy's horizon open) advances the whole run of identical steps
  at once: up to the first request's last token, the KV pool's limit, or the step during which the
  next kernel event (arrival, cancellation) happens, whichever comes first. While requests wait, the
  run also stops before it would evict a cached prefix unit (a waiting request's hits could change).
  The cost model sums the run's step times exactly, so every step boundary, and so every timestamp,
  is the reference mode's. An event inside a run first brings the run's progress to where the
  reference has it (all but its last step), so policies observe the same state in both modes.

In a cluster (``replay.cluster``) a request can leave an instance (``release``: its blocks freed,
its lease generation bumped, a ``request_preempted`` event) and join another (``receive``, with the
KV of its computed tokens or none); a prefill instance of a disaggregated cluster releases every
request once it samples a token (``handoff``); ``fail`` releases them all. A step's result is
refused for a request that left during the step (a stale lease, ``stats.num_stale_refused``).

Invariants checked with ``check_invariants``: KV blocks never negative nor above capacity; the
blocks requests hold add up to the pool's used count; every request ends with exactly one
``request_finished``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

from replay.config import InstanceConfig
from replay.costmodel import StepCostModel, StepShape
from replay.emit import NO_MEMBERS, EventWriter, Snapshot
from replay.errors import ReplayError
from replay.kernel import CANCEL, SCHEDULE, STEP_END, Kernel
from replay.kvcache import BlockPool
from replay.lockstep import Lockstep
from replay.policies.base import AdmissionDecision, Policy
from replay.request import FINISHED, HELD, MOVING, RUNNING, WAITING, Request
from replay.speculative import step_advance
from replay.views import EngineView, RequestSequence, RequestView, blocks_for, held_blocks

Mode = Literal["fast", "reference"]
MODES: tuple[str, ...] = ("fast", "reference")


def check_clock(instance: InstanceConfig, mode: str, step_timer: Callable[..., int] | None) -> None:
    """Raise unless ``mode`` is a replay mode and a measured clock (``step_timer``) can time this instance's
    steps (run_replay checks before it opens its outputs)."""
    if mode not in MODES:
        raise ReplayError(f"unknown replay mode {mode!r}", "valid modes: fast, reference")
    if step_timer is not None and mode != "reference":
        raise ReplayError("a measured clock (step_timer) runs every step: use mode='reference'")
    if step_timer is not None and instance.speculative is not None:
        raise ReplayError("a measured clock (step_timer) executes the target model only, not speculative drafts",
                          "replay a speculative instance with a cost model")


class _Flight:
    """The step, or run of identical decode steps, in flight."""

    __slots__ = ("start_ns", "end_ns", "prev_end_ns", "num_steps", "num_applied", "lockstep", "snapshot", "scheduled",
                 "leases")

    def __init__(self, start_ns: int, end_ns: int, prev_end_ns: int, num_steps: int, lockstep: bool,
                 snapshot: Snapshot | None, scheduled: Sequence[tuple[Request, int]]) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.prev_end_ns = prev_end_ns  # end of a run's second-to-last step
        self.num_steps = num_steps
        self.num_applied = 0  # steps of a run whose progress is already applied (see _catch_up)
        self.lockstep = lockstep  # the lockstep set decodes in it (as a whole)
        self.snapshot = snapshot  # the lockstep members at its start (batch membership)
        self.scheduled = scheduled  # [(request, positions)] scheduled one by one
        self.leases: list[int] | None = None  # their lease generations when planned (Engine.track_leases)


class _StepTally:
    """What a step's scheduled requests add up to (``Engine._advance_scheduled``): the step event's
    composition, the tokens served per request (for a policy's ``observe_step``), and the requests
    that hand off (a prefill instance) or join the lockstep set once the step is over."""

    __slots__ = ("handoffs", "ids", "joiners", "num_decode", "num_prefill", "per", "served")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.per: list[int] = []
        self.served: list[int] = []
        self.num_prefill = 0
        self.num_decode = 0  # the lockstep set's sequences and the scheduled decodes'
        self.joiners: list[Request] = []
        self.handoffs: list[Request] = []


class EngineStats:
    """Counters of one instance's replay."""

    __slots__ = (
        "num_submitted", "num_finished", "num_steps", "num_step_events", "num_runs", "num_preemptions",
        "num_prefix_hit_tokens", "num_swapped_bytes", "max_running", "max_waiting", "num_general_passes",
        "num_moved_out", "num_moved_in", "num_stale_refused", "busy_ns",
    )

    num_submitted: int
    num_finished: int
    num_steps: int
    num_step_events: int
    num_runs: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    num_swapped_bytes: int
    max_running: int
    max_waiting: int
    num_general_passes: int
    num_moved_out: int
    num_moved_in: int
    num_stale_refused: int
    busy_ns: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


class Engine:
    """A single serving instance on a kernel, emitting lifecycle events to a writer."""

    def __init__(
        self,
        kernel: Kernel,
        instance: InstanceConfig,
        cost_model: StepCostModel,
        policy: Policy,
        writer: EventWriter,
        *,
        instance_id: str,
        mode: Mode = "fast",
        check_invariants: bool = False,
        step_timer: Callable[[StepShape, list[Any]], int] | None = None,
    ) -> None:
        check_clock(instance, mode, step_timer)
        self.kernel = kernel
        self.instance = instance
        self.cost_model = cost_model
        self.policy = policy
        self.writer = writer
        self.instance_id = instance_id
        spec = instance.speculative
        # lockstep runs advance one token per member per step: an instance with speculation steps one pass
        # at a time in both modes (replay.speculative), so its fast mode is the reference's pass
        self.fast = mode == "fast" and spec is None
        self.spec_k = spec.num_speculative_tokens if spec is not None else 0  # the instance's k (0: no speculation)
        self._spec_expected = tuple(spec.expected_tokens(k) for k in range(self.spec_k + 1)) if spec else (1.0,)
        # the measured replay's clock: each step's time is measured running (shape, [(request, tokens)])
        # on a device (replay.measured); policies still ask the cost model for their predictions
        self.step_timer = step_timer
        self.check = check_invariants
        self._init_limits(instance, writer)
        self._init_queues()
        self._init_policy_flags(policy, check_invariants)
        self._init_hooks(kernel)

    def _init_limits(self, instance: InstanceConfig, writer: EventWriter) -> None:
        """The instance's engine settings, and its KV block pool."""
        e = instance.engine
        self.block_size = e.block_size_tokens
        self.max_batched = e.max_num_batched_tokens
        self.max_seqs = e.max_num_seqs
        self.chunked = e.enable_chunked_prefill
        self.prefix_caching = e.enable_prefix_caching
        self.swap = e.preemption_mode == "swap"
        self.swap_bandwidth = e.swap_bandwidth_bytes_per_s
        self.encoder_ns_per_token = e.encoder_s_per_image_token * 1e9
        # async scheduling (vLLM's default since 0.12): step n+1 is planned when step n starts, so a request
        # admitted after that start waits for step n+2; the start and end of the last step run are kept
        self.async_scheduling = bool(e.async_scheduling)
        if instance.frontend is not None:
            writer.out_delay_ns = instance.frontend.out_delay_ns
        self._last_start_ns = self._last_end_ns = -1
        self.kv_bytes_per_block = instance.kv_bytes_per_token * e.block_size_tokens
        self.pool = BlockPool(instance.num_kv_blocks, e.cpu_kv_offload_bytes // self.kv_bytes_per_block)
        self.watermark_blocks = int(e.kv_watermark_fraction * self.pool.num_total)

    def _init_queues(self) -> None:
        """Empty queues, lockstep set and counters; the policies' view of them."""
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.held: deque[Request] = deque()
        self._targets: dict[Request, int] = {}  # true output length per branch: never reachable from views
        self._budget = [self.max_batched]
        self.view = EngineView(self.kernel, self.pool, self.running, self.waiting, self.held, self._budget,
                               self.instance, self.cost_model, self.instance_id)
        self._waiting_view = RequestSequence(self.waiting)
        self._lock = Lockstep(self.block_size, self.writer.snapshot)
        self._flight: _Flight | None = None
        self._flush_countdown = 64  # steps between checks of the writer's buffer
        self._schedule_pending = False
        self._swap_ns = 0  # extra time of the step being planned: swap copies, vision encoder work
        self._step_index = 0
        self.stats = EngineStats()
        self.num_active = 0  # submitted, not finished

    def _init_policy_flags(self, policy: Policy, check_invariants: bool) -> None:
        """Which of the policy's hooks are overridden (the defaults are skipped on the hot path)."""
        self._report_steps = policy.wants_step_reports()
        self._short_completion = not self._report_steps and not check_invariants
        self._waiting_first = type(policy).schedule_waiting_first is not Policy.schedule_waiting_first
        self._default_order = type(policy).order is Policy.order
        self._horizon = (
            None if type(policy).run_horizon_steps is Policy.run_horizon_steps else policy.run_horizon_steps
        )

    def _init_hooks(self, kernel: Kernel) -> None:
        """The hooks a cluster (``replay.cluster``) and multi-model residency (``replay.residency``) set on the
        engine once it is built; these defaults are a lone instance's."""
        # when the next event that can reach this instance is due (a run stops at the step during which
        # it happens): any kernel action for a lone instance; a cluster narrows it (replay.cluster)
        self.next_event_ns: Callable[[], int | None] = kernel.next_time_ns
        # called with each request as it finishes (a cluster's router counts and draining)
        self.on_finish: Callable[[Request], None] | None = None
        # a cluster may route a request here inside a run its horizon did not stop at (``interrupt_run``):
        # runs then never evict a cached unit beyond their first step, so that cutting one is exact
        self.interruptible = False
        # a disaggregated prefill instance (replay.cluster): called with each request that sampled a token
        # here and must decode elsewhere, once it has left (``release``), with its output target
        self.handoff: Callable[[Request, int], None] | None = None
        # a cancellation due while the request is elsewhere (it moved: replay.cluster)
        self.cancel_elsewhere: Callable[[Request], None] | None = None
        # record each planned step's lease generations, so that a step of a request that moved away
        # during it is refused (set by a cluster whose requests can move mid-step)
        self.track_leases = False
        # set by a cluster (replay.cluster): called with a request its admission answered 'route' or 'downgrade'
        # for (not here), once it has left, with its output target and the downgrade's model (None for a route);
        # the cluster sends it to another instance
        self.reroute: Callable[[Request, int, str | None], None] | None = None
        # multi-model residency (replay.residency): most distinct adapters in one batch (None: no limit),
        # and what the instance_state events report as resident (None: the instance's model, no adapters)
        self.max_adapters_per_batch: int | None = None
        self.resident: Callable[[], tuple[list[str], list[str]]] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        models, adapters = self.resident() if self.resident is not None else ([self.instance.model.name], None)
        self.writer.on_state(self.kernel.now_ns, self.instance_id, "ready", self.pool.num_total, self.block_size, models,
                             adapters=adapters)

    def stop(self) -> None:
        """End of the replay: whatever never ran is finished as an error, then the instance reports stopped."""
        now = self.kernel.now_ns
        for r in list(self.held) + list(self.waiting) + list(self.running):
            self._finish(r, now, "error", "still queued when the replay ended (never scheduled)")
        models, adapters = self.resident() if self.resident is not None else ([self.instance.model.name], None)
        self.writer.on_state(now, self.instance_id, "stopped", self.pool.num_total, self.block_size, models,
                             adapters=adapters)

    # ------------------------------------------------------------------ arrivals and admission

    def check_fits(self, r: Request, num_output_tokens: int) -> None:
        """Raise when a request can never run on this instance, naming it and the capacity."""
        bs, total = self.block_size, self.pool.num_total
        need = blocks_for(r, r.num_prompt_tokens + max(num_output_tokens, 1) - 1, bs)
        if need > total:
            raise ReplayError(
                f"request {r.request_id} can never fit: it needs {need:,} KV blocks "
                f"({r.num_prompt_tokens:,} prompt + {num_output_tokens:,} output tokens x {r.num_branches} branches) "
                f"but {self.instance.model.name} on {self.instance.accelerator.tensor_parallel_size} x "
                f"{self.instance.accelerator.name} holds {total:,} blocks of {bs} tokens ({total * bs:,} tokens)",
                "use a larger accelerator or more tensor parallelism, or trim the workload",
            )
        first = min(r.num_prompt_tokens, self.max_batched) if self.chunked else r.num_prompt_tokens
        if self.watermark_blocks and blocks_for(r, first, bs) > total - self.watermark_blocks:
            raise ReplayError(
                f"request {r.request_id} can never be admitted: its first prefill chunk needs "
                f"{blocks_for(r, first, bs):,} KV blocks, the watermark leaves {total - self.watermark_blocks:,}",
                "lower kv_watermark_fraction",
            )
        if not self.chunked and r.num_prompt_tokens > self.max_batched:
            raise ReplayError(
                f"request {r.request_id} can never be scheduled: {r.num_prompt_tokens:,} prompt tokens exceed "
                f"max_num_batched_tokens {self.max_batched:,} and chunked prefill is off",
                "enable chunked prefill or raise max_num_batched_tokens",
            )

    def submit(self, r: Request, num_output_tokens: int, *, rerouted: bool = False) -> None:
        """A request arrives now: record it, ask admission, queue it (its true length stays private).
        ``rerouted``: another instance of the cluster received it and its admission answered 'route'
        (the arrival event and the cancellation timer are that instance's; this one only admits it)."""
        self._catch_up()
        now = self.kernel.now_ns
        self.check_fits(r, num_output_tokens)
        target = num_output_tokens if r.max_output_tokens is None else min(num_output_tokens, r.max_output_tokens)
        self._targets[r] = 0 if r.failed else target
        r.view = RequestView(r)
        self._grant_speculation(r)
        if not self.writer.labelled and (r.tenant or r.service_class or r.model or r.adapter):
            self.writer.labelled = True
        r.owner = self
        self.num_active += 1
        self.stats.num_submitted += 1
        if rerouted:
            r.state = WAITING
        else:
            cached = sum(self._lookup(r)[1:]) * self.block_size if (self.prefix_caching and r.unit_keys) else None
            self.writer.arrived.append((r, self.instance_id, cached))
            if r.cancel_after_ns is not None:  # after the arrival (a request may reach the engine later: replay.residency)
                self.kernel.schedule(max(now, r.arrival_ns + r.cancel_after_ns), CANCEL, lambda: self.cancel(r))
        self._decide(r, self.policy.admit(self.view, r.view), now)

    def _decide(self, r: Request, d: AdmissionDecision, now: int) -> None:
        kind = d.decision
        was_held = r.state == HELD
        if kind == "queue" and d.retry_after_s is not None:  # offer it again then, even if the engine is idle
            self.kernel.schedule(now + max(1, round(d.retry_after_s * 1e9)), SCHEDULE, self._schedule)
        if was_held and kind == "queue":
            return  # unchanged: no new event
        r.num_admission_decisions += 1
        self.writer.admission.append((r, now, d, r.num_admission_decisions, self.instance_id))
        if kind == "accept" or kind == "degrade":
            if kind == "degrade":  # optional work capped: the request ends at the cap at the latest
                if d.max_output_tokens is not None:
                    self._targets[r] = min(self._targets[r], d.max_output_tokens)
                if d.num_branches is not None:  # fewer parallel samples: it holds nothing yet, so only its shape changes
                    if d.num_branches > r.num_branches:
                        raise ReplayError(
                            f"request {r.request_id}: a degrade decision may reduce its branches "
                            f"({r.num_branches}), not raise them to {d.num_branches}"
                        )
                    r.num_branches = d.num_branches
                if d.num_speculative_tokens is not None:  # drafts capped (0: speculation off)
                    if d.num_speculative_tokens > r.num_speculative_tokens:
                        raise ReplayError(
                            f"request {r.request_id}: a degrade decision may reduce its speculative tokens "
                            f"({r.num_speculative_tokens} on this instance), not raise them to {d.num_speculative_tokens}"
                        )
                    r.speculative_cap = d.num_speculative_tokens
                    r.num_speculative_tokens = d.num_speculative_tokens
            if was_held:
                self.held.remove(r)
            r.state = WAITING
            r.admitted_ns = now
            self.waiting.append(r)
            self._wake()
        elif kind == "queue":
            r.state = HELD
            self.held.append(r)
            self._wake()
        elif kind == "route" or kind == "downgrade":  # not here: it leaves before it held anything, the cluster
            if self.reroute is None:  # sends it on (downgrade: to be served as the model d.target)
                raise ReplayError(f"request {r.request_id}: admission answered 'route' on a lone instance",
                                  "a policy may route only when EngineView.can_route says so")
            if was_held:
                self.held.remove(r)
            r.state = MOVING
            r.owner = None
            self.num_active -= 1
            self.reroute(r, self._targets.pop(r), d.target)
        else:
            if was_held:
                self.held.remove(r)
            self._finish(r, now, "rejected", d.reason)

    def _grant_speculation(self, r: Request) -> None:
        """``r``'s speculative tokens here: the instance's k, at most its cap (0 on an instance without speculation)."""
        cap = r.speculative_cap
        r.num_speculative_tokens = self.spec_k if cap is None else min(cap, self.spec_k)

    def _speculate(self, r: Request) -> tuple[int, int]:
        """(positions it advances, budget tokens it takes) in a speculating decode's next step: its
        deterministic schedule's tokens (``replay.speculative.step_advance``), never past its output
        length; k_r + 1 verification tokens per branch."""
        k = r.num_speculative_tokens
        a = step_advance(self._spec_expected[k], r.num_speculative_steps + 1)
        return max(1, min(a, self._targets[r] - r.num_output)), (k + 1) * r.num_branches

    def _wake(self) -> None:
        """Make sure a scheduling pass runs at the current instant if the engine is idle."""
        if self._flight is None and not self._schedule_pending:
            self._schedule_pending = True
            self.kernel.schedule(self.kernel.now_ns, SCHEDULE, self._schedule)

    # ------------------------------------------------------------------ cancellation

    def _leave_now(self, r: Request) -> int:
        """Bring the state up to now for ``r``, which leaves this instance (cancelled or moved): out
        of the lockstep group, with the tokens of a run's steps that ended before now delivered;
        returns now."""
        self._catch_up()
        f = self._flight
        if r.lock is not None:
            run = f if f is not None and f.lockstep and f.num_steps > 1 else None
            self._lock.leave(r)
            if run is not None:  # the run's steps before its last one ended before now: their tokens were delivered
                k = run.num_steps - 1
                self._deliver(r, run.prev_end_ns, k * r.num_branches, k > 1)
        return self.kernel.now_ns

    def cancel(self, r: Request) -> None:
        """The client cancels ``r`` now: it leaves at once and its KV blocks are freed."""
        if r.state == FINISHED:
            return
        if r.owner is not self:  # it moved to another instance since (replay.cluster)
            assert self.cancel_elsewhere is not None, "a request owned elsewhere implies a cluster"
            self.cancel_elsewhere(r)
            return
        now = self._leave_now(r)
        self.writer.cancelled.append((r, now, self.instance_id))
        if r.state == WAITING:
            self.waiting.remove(r)
        elif r.state == HELD:
            self.held.remove(r)
        self._finish(r, now, "cancelled", None)

    # ------------------------------------------------------------------ moves between instances (replay.cluster)

    def release(self, r: Request, keep_kv: bool) -> int:
        """``r`` leaves this instance now to continue on another (a cluster moves it); returns its output target.

        Its blocks here are freed and its lease generation (``num_preemptions``) is bumped: a
        ``request_preempted`` event, mode ``migrate`` when its KV goes with it (``keep_kv``: its
        computed tokens become ``moved_tokens``), else ``recompute`` (``num_lost_tokens`` = them). A
        step in flight that includes it delivers nothing for it: this engine's lease is stale at the
        step's end. Inside a run (fast mode) the caller cuts the run first (``interrupt_run``).
        """
        now = self._leave_now(r)
        if r.state == RUNNING:
            self.running.remove(r)
        elif r.state == WAITING:
            self.waiting.remove(r)
        elif r.state == HELD:
            self.held.remove(r)
        self._release(r)
        r.next_unit = 0
        r.swapped_tokens = 0  # a swapped-out request's KV leaves from host memory
        lost = 0
        if keep_kv:
            r.moved_tokens = r.num_computed
        else:
            lost = r.num_computed
            r.num_computed = 0
        r.state = MOVING
        r.owner = None
        r.num_preemptions += 1
        self.stats.num_moved_out += 1
        self.num_active -= 1
        self.writer.preempted.append(
            (r, now, "migrate" if keep_kv else "recompute", r.num_preemptions, lost, self.instance_id)
        )
        return self._targets.pop(r)

    def fail(self) -> list[tuple[Request, int]]:
        """The instance fails now (a cluster injects it): every request it holds leaves with its KV lost
        (``release``, recompute), in arrival order, and the step in flight never ends (tokens of a run's
        steps that ended before now were delivered). Returns each request with its output target."""
        self.interrupt_run()
        self._catch_up()
        held = sorted([*self.held, *self.waiting, *self.running], key=lambda r: r.index)
        out = [(r, self.release(r, False)) for r in held]
        if self._flight is not None:  # its step event is never written: no first step there
            for r, _ in self._flight.scheduled:
                r.first_step_pending = False
        self._flight = None  # its pending end finds no flight (``_end_flight``)
        return out

    def receive(self, r: Request, target: int) -> None:
        """``r`` arrives now from another instance (``release``) and waits here for the batch, in arrival
        order; the KV of its ``moved_tokens`` came with it and is placed when it is admitted to the batch
        (no further copy). The admission policy is not asked again: the move was decided."""
        self._catch_up()
        self.check_fits(r, target)
        self._targets[r] = target
        self._grant_speculation(r)
        r.owner = self
        r.state = WAITING
        self.num_active += 1
        self.stats.num_moved_in += 1
        self.waiting.append(r)
        self._wake()

    def interrupt_run(self) -> None:
        """Something reaches this instance now, inside a run planned past now (a cluster routes a request
        here): cut the run at the step during which now falls, as if it had been planned with now as its
        horizon; its later steps' blocks go back to the pool. A step ending exactly now completes now."""
        f = self._flight
        kernel = self.kernel
        now = kernel.now_ns
        if f is None or not f.lockstep or f.scheduled or f.num_steps < 2 or f.num_applied or now >= f.end_ns:
            return
        if not self.interruptible:
            raise AssertionError("interrupt_run on an engine whose runs may evict cached units")
        lock = self._lock
        t0 = lock.ticks
        k = f.num_steps
        j, duration, last = self.cost_model.decode_run(lock.num_seqs, lock.ctx_base + lock.num_seqs * t0, k, now - f.start_ns)
        if j >= k:
            return
        self.pool.unallocate(lock.blocks_needed(t0, k) - lock.blocks_needed(t0, j))
        lock.ahead = j
        self.stats.num_steps -= k - j
        f.num_steps = j
        f.end_ns = f.start_ns + duration
        f.prev_end_ns = f.end_ns - last
        if f.end_ns > now:
            kernel.schedule(f.end_ns, STEP_END, self._end_flight)  # the run's old end is now stale
            return
        self._complete_flight()  # its last step ends now: as in the reference, plan after what is due now
        self._schedule_pending = True
        kernel.schedule(now, SCHEDULE, self._schedule)

    def kv_blocks_used_now(self) -> int:
        """KV blocks in use as the reference mode has them now: inside a run (fast mode), less the blocks
        allocated ahead for its steps after the one during which now falls (what a router may read)."""
        used = self.pool.num_total - self.pool.num_free
        f = self._flight
        if f is None or not f.lockstep or f.scheduled or f.num_steps < 2 or f.num_applied:
            return used
        now = self.kernel.now_ns
        if now >= f.end_ns:
            return used
        lock = self._lock
        t0, k = lock.ticks, f.num_steps
        j = self.cost_model.decode_run(lock.num_seqs, lock.ctx_base + lock.num_seqs * t0, k, now - f.start_ns)[0]
        return used if j >= k else used - (lock.blocks_needed(t0, k) - lock.blocks_needed(t0, j))

    def _catch_up(self) -> None:
        """Inside a run, bring the lockstep progress to the reference's (all but the run's last step)."""
        f = self._flight
        if f is None or not f.lockstep or f.num_applied or f.num_steps < 2:
            return
        k = f.num_steps - 1
        lock = self._lock
        lock.ticks += k
        lock.ahead -= k
        f.num_applied = k
        if self._report_steps and f.snapshot is not None:  # the policy sees those steps now, as the reference's would
            members = [r for r in f.snapshot.requests if r.view is not None]
            self.policy.observe_step(self.view, [r.view for r in members], [r.num_branches for r in members], k)

    # ------------------------------------------------------------------ lockstep set

    def _join(self, r: Request) -> None:
        """``r`` decodes from now on in lockstep (fast mode)."""
        if r.next_unit < len(r.unit_keys):
            raise AssertionError(f"{r} decodes with prompt blocks not yet cached")
        pool = self.pool
        unit_blocks = sum(pool.cached_blocks(k) for k in r.held_units) if r.held_units else 0
        self._lock.join(r, self._targets[r] - r.num_output, unit_blocks)

    def _dissolve(self) -> None:
        """Make every request's state explicit (before a request-by-request pass)."""
        lock = self._lock
        if lock.members:
            for r in list(lock.members):
                lock.leave(r)
            lock.heap.clear()

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> None:
        """Plan the next step; while nothing else is due before it ends, finish it here and plan on.

        Running ahead this way (``Kernel.advance``) is what the kernel would do anyway when no other
        action is pending before the step's end; it saves a heap round trip per step.
        """
        self._schedule_pending = False
        if self._flight is not None:
            return
        kernel = self.kernel
        stats = self.stats
        while True:
            now = kernel.now_ns
            if self.held:
                for r in list(self.held):
                    self._decide(r, self.policy.admit(self.view, r.view), now)
            running = self.running
            if not running and not self.waiting:
                return
            self._swap_ns = 0
            if not (self.fast and self._plan_lockstep(now)):
                self._plan_general(now)
            f = self._flight
            if f is None:
                return  # idle: waiting requests are blocked by the policy until something changes
            if self.track_leases and f.scheduled:
                f.leases = [r.num_preemptions for r, _ in f.scheduled]
            if len(running) > stats.max_running:
                stats.max_running = len(running)
            if len(self.waiting) > stats.max_waiting:
                stats.max_waiting = len(self.waiting)
            if not kernel.try_advance(f.end_ns):  # something else is due before the step ends
                kernel.schedule(f.end_ns, STEP_END, self._end_flight)
                return
            self._complete_flight()

    def _plan_lockstep(self, now: int) -> bool:
        """The pass when the running batch is the lockstep set followed by prefilling requests.

        Returns False, having changed nothing, when the request-by-request pass is needed.
        """
        if self.held or self._waiting_first:
            return False
        lock, running, pool = self._lock, self.running, self.pool
        num_lock = len(lock.members)
        budget = self.max_batched - lock.num_seqs
        if budget < 0:
            return False  # not every decode fits the budget
        need = lock.hist[lock.ticks % self.block_size] if num_lock else 0
        if num_lock and num_lock == len(running) and not self.waiting:
            # the common case, the lockstep set alone, nobody waiting: a run of identical steps (inline: it is
            # the hot path), unless its first step's blocks do not fit (the request-by-request pass preempts)
            if need > pool.num_free:
                return False
            if need:
                pool.allocate(need)
            k, duration, last = self._plan_run(now, lock.num_seqs, lock.ctx_base + lock.num_seqs * lock.ticks, need)
            lock.ahead = k
            end = now + duration
            self._flight = _Flight(now, end, end - last, k, True, lock.snapshot or lock.current_snapshot(), ())
            self.stats.num_steps += k
            return True
        scheduled: list[tuple[Request, int]] = []
        if len(running) > num_lock:
            left = self._plan_prefill_tail(running[num_lock:], budget, need, scheduled)
            if left is None:
                return False
            budget = left
        elif need > pool.num_free:
            return False
        elif need:
            pool.allocate(need)
        if self.waiting:
            self._plan_waiting(now, budget, scheduled)
        return self._launch_lockstep_step(now, need, scheduled)

    def _plan_prefill_tail(self, tail: list[Request], budget: int, need: int,
                           scheduled: list[tuple[Request, int]]) -> int | None:
        """The running requests after the lockstep set, each a prefill chunk (or a lone decode) while the
        budget lasts, their blocks allocated after the decodes' ``need``; returns the budget left, or None,
        having allocated nothing, when the request-by-request pass is needed."""
        for q in tail:
            if q.lock is not None:
                return None  # a prefilling request sits between decoders
        pool, bs = self.pool, self.block_size
        planned: list[tuple[Request, int, int]] = []
        tail_need = 0  # blocks the prefilling requests need
        policy, view = self.policy, self.view
        for q in tail:
            if budget <= 0:
                break
            left = q.num_tokens - q.num_computed
            if left == 1 and q.num_computed >= q.num_prompt_tokens:
                m, cost = 1, q.num_branches
                if cost > budget:
                    continue
            else:
                self._budget[0] = budget
                m = policy.chunk_tokens(view, q.view, left, budget)
                if m <= 0:
                    continue
                m = min(m, left, budget)
                cost = m
            q_need = blocks_for(q, q.num_computed + m, bs) - q.num_blocks
            tail_need += q_need
            planned.append((q, m, q_need))
            budget -= cost
        if need + tail_need > pool.num_free:
            return None  # someone must be preempted: the request-by-request pass decides whom
        # allocate in the request-by-request pass's order: the decodes' blocks, then each request's
        # before its units are cached (an allocation may evict a unit with the key it caches)
        if need:
            pool.allocate(need)
        for q, m, q_need in planned:
            self._place(q, m, q_need, scheduled)
        return budget

    def _place(self, r: Request, m: int, need: int, scheduled: list[tuple[Request, int]]) -> None:
        """``r`` takes its ``need`` new blocks, caches the prompt units its ``m`` tokens complete, and is scheduled."""
        if need > 0:
            self.pool.allocate(need)
            r.num_blocks += need
            r.num_anon_blocks += need
        if r.next_unit < len(r.unit_keys):
            self._register_units(r, r.num_computed + m)
        scheduled.append((r, m))

    def _launch_lockstep_step(self, now: int, need: int, scheduled: list[tuple[Request, int]]) -> bool:
        """The flight of a lockstep pass with prefilling or admitted requests: one step (a run when none
        was scheduled after all); True, as the pass was made (idle when there is nothing to run)."""
        lock = self._lock
        num_lock = len(lock.members)
        decode_ctx = lock.ctx_base + lock.num_seqs * lock.ticks
        if not scheduled:
            if not num_lock:
                if self.running:
                    raise ReplayError("the scheduler found nothing to run while requests are running (a policy bug)")
                return True  # idle: waiting requests are blocked by the policy until something changes
            k, duration, last = self._plan_run(now, lock.num_seqs, decode_ctx, need)
            lock.ahead = k
            snapshot = lock.current_snapshot()
        else:
            shape = _step_shape(scheduled, now, lock.num_seqs, decode_ctx)
            k = 1
            duration = self.cost_model.step_time_ns(shape) + self._swap_ns
            last = duration
            if num_lock:
                lock.ahead = 1
                snapshot = lock.current_snapshot()
            else:
                snapshot = None
        self._launch(now, duration, last, k, True, snapshot, scheduled)
        return True

    def _plan_run(self, now: int, num_decode: int, decode_ctx: int, first_need: int) -> tuple[int, int, int]:
        """How many identical lockstep decode steps to advance at once, their total and last step's time."""
        lock = self._lock
        k_max = lock.first_finish() - lock.ticks
        if self.async_scheduling and self.waiting and self._unseen_waiting(now):
            k_max = 1  # a request the scheduler has not seen yet joins the step after this one
        if self._horizon is not None:
            h = self._horizon(self.view)
            if h is not None:
                k_max = min(k_max, max(1, h))
        nxt = self.next_event_ns()
        horizon_ns = None if nxt is None else nxt - now
        k, duration, last = self.cost_model.decode_run(num_decode, decode_ctx, k_max, horizon_ns)
        if k > 1:
            t = lock.ticks
            pool = self.pool
            free = pool.num_free
            extra = lock.blocks_needed(t, k) - first_need
            if extra and (self.waiting or self.interruptible):
                # a waiting request's prefix hits must not be evicted inside the run: the reference
                # would offer it the batch again after that eviction
                free = min(free, pool.free_before_eviction(extra))
            if extra > free:  # stop before the step that cannot allocate (or would evict)
                lo, hi = 1, k - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if lock.blocks_needed(t, mid) - first_need <= free:
                        lo = mid
                    else:
                        hi = mid - 1
                k, duration, last = self.cost_model.decode_run(num_decode, decode_ctx, lo, horizon_ns)
                extra = lock.blocks_needed(t, k) - first_need
            if extra:
                pool.allocate(extra)
            self.stats.num_runs += 1
        return k, duration, last

    def _plan_general(self, now: int) -> None:
        """The request-by-request pass (the reference mode's, and the fast mode's fallback): running
        requests first, then waiting ones unless something was preempted (or in the other order when
        the policy schedules waiting requests first), then the step's flight."""
        self._dissolve()
        self.stats.num_general_passes += 1
        budget = self.max_batched
        scheduled: list[tuple[Request, int]] = []
        first: list[Request] = []
        waiting_first = self.policy.schedule_waiting_first(self.view)
        if waiting_first:
            budget, first = self._plan_waiting(now, budget, scheduled)
        budget, preempted = self._plan_running(now, budget, scheduled, first)
        if not preempted and not waiting_first:
            budget, first = self._plan_waiting(now, budget, scheduled)
        if not scheduled:
            if self.running:
                raise ReplayError("the scheduler found nothing to run while requests are running (a policy bug)")
            return  # idle until the next arrival: waiting requests are blocked by the policy
        shape = _step_shape(scheduled, now)
        if self.step_timer is None:
            duration = self.cost_model.step_time_ns(shape) + self._swap_ns
        else:
            duration = self.step_timer(shape, scheduled) + self._swap_ns
        self._launch(now, duration, duration, 1, False, None, scheduled)

    def _plan_running(self, now: int, budget: int, scheduled: list[tuple[Request, int]],
                      first: list[Request]) -> tuple[int, bool]:
        """Running requests in batch order (less ``first``, admitted by this pass already): a decode takes
        a position, a prefilling request a chunk; the policy's victims are preempted until its blocks fit.
        Returns (budget left, whether anyone was preempted)."""
        running, pool, policy, view = self.running, self.pool, self.policy, self.view
        bs = self.block_size
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if first and r in first:
                i += 1
                continue
            left = r.num_tokens - r.num_computed
            if left == 1 and r.num_computed >= r.num_prompt_tokens:
                m, cost = self._speculate(r) if r.num_speculative_tokens else (1, r.num_branches)
                if cost > budget:
                    i += 1
                    continue
            else:
                self._budget[0] = budget
                m = policy.chunk_tokens(view, r.view, left, budget)
                if m <= 0:
                    i += 1
                    continue
                m = min(m, left, budget)
                cost = m
            need = blocks_for(r, r.num_computed + m, bs) - r.num_blocks
            while need > pool.num_free:
                candidates = [x for x in running[i:] if not (first and x in first)]
                victim = policy.victim(view, RequestSequence(candidates))._r
                if all(victim is not x for x in candidates):
                    raise ReplayError(f"policy {policy.name!r} chose a preemption victim that is not a candidate")
                self._preempt(victim, now)
                preempted = True
                if victim is r:
                    break
            if r.state != RUNNING:
                continue  # r itself was preempted: running[i] is now the next request
            self._place(r, m, need, scheduled)
            budget -= cost
            i += 1
        return budget, preempted

    def _launch(self, now: int, duration: int, last: int, k: int, lockstep: bool, snapshot: Snapshot | None,
                scheduled: list[tuple[Request, int]]) -> None:
        end = now + duration
        for r, _ in scheduled:  # until the step's event is written (or the step is lost to a failure), the
            if r.first_step_ns is None:  # request table waits for its scheduled_ns (replay.request_table)
                r.first_step_pending = True
        self._flight = _Flight(now, end, end - last, k, lockstep, snapshot, scheduled)
        self.stats.num_steps += k

    def _seen_until_ns(self, now: int) -> int | None:
        """With async scheduling and a step that just ended while requests run, the pass planned now was
        planned when that step started: requests admitted after its start are not in it. None: all are."""
        if self.async_scheduling and self._last_end_ns == now and self.running:
            return self._last_start_ns
        return None

    def _unseen_waiting(self, now: int) -> bool:
        seen = self._seen_until_ns(now)
        return seen is not None and any((r.admitted_ns or 0) > seen for r in self.waiting)

    def _plan_waiting(self, now: int, budget: int, scheduled: list[tuple[Request, int]]) -> tuple[int, list[Request]]:
        """Admit waiting requests into the batch, in the policy's order, while they fit (seats, budget,
        adapter slots, KV blocks); returns (budget left, those admitted)."""
        waiting, running, policy, view = self.waiting, self.running, self.policy, self.view
        if not waiting:
            return budget, []
        seen = self._seen_until_ns(now)
        admitted: list[Request] = []
        self._budget[0] = budget
        seats = self.max_seqs - len(running)
        order = waiting if self._default_order else (rv._r for rv in policy.order(view, self._waiting_view))
        slots = self.max_adapters_per_batch
        adapters = None if slots is None else {x.adapter for x in running if x.adapter is not None}
        for r in order:
            if len(admitted) >= seats or budget <= 0:
                break
            if r.state != WAITING:
                raise ReplayError(f"policy {policy.name!r} ordered a request that is not waiting")
            if seen is not None and (r.admitted_ns or 0) > seen:
                continue  # async scheduling: it arrived after this step was planned
            if adapters is not None and r.adapter is not None and r.adapter not in adapters:
                if slots is not None and len(adapters) >= slots:
                    continue  # no adapter slot left in this batch: later requests may still fit (vLLM's max_loras)
                adapters.add(r.adapter)
            fit = self._fit_waiting(r, budget)
            if fit is None:
                break  # the first that does not fit stops the pass
            m, cost = fit
            r.state = RUNNING
            admitted.append(r)
            scheduled.append((r, m))
            budget -= cost
        for r in admitted:
            if waiting[0] is r:
                waiting.popleft()
            else:
                waiting.remove(r)
            running.append(r)
        return budget, admitted

    def _fit_waiting(self, r: Request, budget: int) -> tuple[int, int] | None:
        """``r``'s first chunk in the batch: its computed tokens (swapped out, moved here, or prefix-cache
        hits), the tokens it schedules, their blocks placed (``_place_admitted``); returns (tokens, budget
        cost), or None, having changed nothing, when it does not fit."""
        pool, bs = self.pool, self.block_size
        hits: list[Hashable] = []
        hit_blocks = loaded = 0
        computed = r.swapped_tokens or r.moved_tokens
        if not computed and self.prefix_caching and r.unit_keys:
            hits, hit_blocks, loaded = self._lookup(r)
            computed = (hit_blocks + loaded) * bs
        left = r.num_tokens - computed
        if left == 1 and computed >= r.num_prompt_tokens:
            m, cost = self._speculate(r) if r.num_speculative_tokens else (1, r.num_branches)
            if cost > budget:
                return None
        else:
            self._budget[0] = budget
            m = min(self.policy.chunk_tokens(self.view, r.view, left, budget), left, budget)
            if m <= 0 or (not self.chunked and m < left):
                return None
            cost = m
        reused = sum(pool.cached_blocks(key) for key in hits if pool.is_free_unit(key)) if hits else 0
        need = blocks_for(r, computed + m, bs) - hit_blocks
        if need + reused > pool.num_free - self.watermark_blocks:
            return None
        self._place_admitted(r, hits, hit_blocks, loaded, computed, m, need)
        return m, cost

    def _place_admitted(self, r: Request, hits: list[Hashable], hit_blocks: int, loaded: int, computed: int, m: int,
                        need: int) -> None:
        """Give an admitted request its blocks: the prefix-cache ``hits`` held, ``need`` new ones allocated;
        charge the copies (CPU-tier prefix blocks, a swapped-out request's KV) and the vision encoder to
        the step; its units cached once the chunk of ``m`` tokens after ``computed`` is."""
        pool = self.pool
        for key in hits:
            pool.hold(key)
        r.held_units = hits
        r.next_unit = len(hits)
        pool.allocate(need)
        r.num_blocks = hit_blocks + need
        r.num_anon_blocks = need
        if loaded:  # prefix blocks found in the CPU tier are copied back, not recomputed
            self._swap_ns += -(-loaded * self.kv_bytes_per_block * 1_000_000_000 // int(self.swap_bandwidth))
        if r.swapped_tokens:
            swap_bytes = need * self.kv_bytes_per_block
            self._swap_ns += -(-swap_bytes * 1_000_000_000 // int(self.swap_bandwidth))
            self.stats.num_swapped_bytes += swap_bytes
            r.next_unit = len(r.unit_keys)
            r.swapped_tokens = 0
        elif r.moved_tokens:  # its KV came from another instance (the transfer was charged there)
            r.next_unit = len(r.unit_keys)
            r.moved_tokens = 0
        elif r.num_preemptions == 0:
            r.num_cached_prefix_tokens = computed
            self.stats.num_prefix_hit_tokens += computed
        if r.num_image_tokens and r.scheduled_ns is None:  # the encoder runs once, in its first prefill step
            self._swap_ns += round(r.num_image_tokens * self.encoder_ns_per_token)
        r.num_computed = computed
        if r.next_unit < len(r.unit_keys):
            self._register_units(r, computed + m)

    # ------------------------------------------------------------------ prefix cache

    def _lookup(self, r: Request) -> tuple[list[Hashable], int, int]:
        """The cached units that cover a prefix of ``r`` (contiguous, exact size), their blocks, and the
        blocks of the units that continue it from the CPU tier (to copy back)."""
        pool, bs = self.pool, self.block_size
        hits: list[Hashable] = []
        covered = loaded = 0
        max_blocks = (r.num_tokens - 1) // bs  # at least one token is computed, as in vLLM
        for key, start, size in r.unit_keys:
            if start != covered + loaded or covered + loaded + size > max_blocks:
                break
            if not loaded and pool.cached_blocks(key) == size:
                hits.append(key)
                covered += size
            elif pool.cpu_blocks and pool.offloaded_blocks(key) == size:
                loaded += size
            else:
                break
        return hits, covered, loaded

    def _register_units(self, r: Request, num_tokens: int) -> None:
        """Cache the units whose blocks are fully computed once ``num_tokens`` are (at allocation, as vLLM v1)."""
        full = num_tokens // self.block_size
        keys = r.unit_keys
        pool = self.pool
        while r.next_unit < len(keys):
            key, start, size = keys[r.next_unit]
            if start + size > full:
                return
            if pool.register(key, size):
                r.held_units.append(key)
                r.num_anon_blocks -= size
            r.next_unit += 1

    def _release(self, r: Request) -> None:
        pool = self.pool
        pool.release(r.num_anon_blocks)
        for key in r.held_units:
            pool.unhold(key)
        r.held_units = []
        r.num_blocks = r.num_anon_blocks = 0

    # ------------------------------------------------------------------ preemption and completion

    def _preempt(self, r: Request, now: int) -> None:
        self.running.remove(r)
        lost = 0
        if self.swap:
            swap_bytes = r.num_blocks * self.kv_bytes_per_block
            self._swap_ns += -(-swap_bytes * 1_000_000_000 // int(self.swap_bandwidth))
            self.stats.num_swapped_bytes += swap_bytes
            r.swapped_tokens = r.num_computed
            mode = "swap"
        else:
            lost = r.num_computed
            mode = "recompute"
            if self.prefix_caching and r.num_branches == 1:
                self._leave_private_unit(r)
            r.num_computed = 0
        self._release(r)
        r.next_unit = 0
        r.state = WAITING
        r.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(r)
        self.writer.preempted.append((r, now, mode, r.num_preemptions, lost, self.instance_id))

    def _leave_private_unit(self, r: Request) -> None:
        """Keep a recomputed request's remaining full blocks cached under a private key (vLLM caches them)."""
        covered = 0
        for key, start, size in r.unit_keys:
            if start != covered or key not in r.held_units:
                break
            covered += size
        if covered != sum(self.pool.cached_blocks(k) for k in r.held_units):
            return  # not a contiguous prefix: leave it
        full = r.num_computed // self.block_size
        size = full - covered
        if size <= 0:
            return
        key = ("private", r.index, r.num_preemptions)
        if self.pool.register(key, size):
            r.held_units.append(key)
            r.num_anon_blocks -= size
            r.unit_keys = [u for u in r.unit_keys if u[1] < covered] + [(key, covered, size)]

    def _finish(self, r: Request, now: int, outcome: str, error: str | None) -> None:
        if r.lock is not None:
            self._lock.leave(r)
        if r.state == RUNNING:
            self.running.remove(r)
        self._release(r)
        r.state = FINISHED
        r.view = None  # breaks the request <-> view cycle, so finished requests are freed by refcount
        self._targets.pop(r, None)
        self.num_active -= 1
        self.stats.num_finished += 1
        self.writer.finished.append((r, now, outcome, r.num_output * r.num_branches, error, self.instance_id))
        if self.on_finish is not None:
            self.on_finish(r)

    def _deliver(self, r: Request, ts: int, num_tokens: int, coalesced: bool) -> None:
        self.writer.tokens.append((r, ts, num_tokens, r.num_output * r.num_branches, coalesced, self.instance_id))

    # ------------------------------------------------------------------ step end

    def _end_flight(self) -> None:
        """Kernel action: the flight ended; then plan the next step (after anything else due now)."""
        f = self._flight
        if f is None or f.end_ns != self.kernel.now_ns:
            return  # the end of a run that was cut (interrupt_run)
        self._complete_flight()
        nxt = self.kernel.next_time_ns()
        if nxt is not None and nxt == self.kernel.now_ns:
            self._schedule_pending = True
            self.kernel.schedule(nxt, SCHEDULE, self._schedule)
        else:
            self._schedule()

    def _complete_flight(self) -> None:
        """Apply the flight's results at its end, in phases (the first and the step event inline: every step
        that is not a lone run passes here): the lockstep set's progress, the scheduled requests' progress and
        tokens, the policy's observation, the finishes, the step event, the handoffs of a prefill instance,
        and the decoders' (re)joining of the lockstep set."""
        f = self._flight
        assert f is not None, "a step ended with no step in flight"
        if f.lockstep and not f.scheduled and self._short_completion:
            self._complete_run(f)
            return
        now = self.kernel.now_ns
        # the lockstep set's clock advances by the flight's steps not yet applied (its run event is written)
        finished: list[tuple[Request, str]] = []
        if f.lockstep and f.snapshot is not None:
            lock = self._lock
            lock.ticks += f.num_steps - f.num_applied
            lock.ahead = 0
            if lock.members:
                self.writer.runs.append((lock.snapshot or lock.current_snapshot(), now, f.num_steps, lock.ticks,
                                         f.num_steps > 1, self.instance_id))
            if lock.heap and lock.heap[0][0] <= lock.ticks:
                finished.extend((r, "completed") for r in lock.pop_finished())
        tally = self._advance_scheduled(f, now, finished)
        if self._report_steps:  # before finishing: finished requests drop their views
            self._observe_step(f, tally.served)
        for r, outcome in finished:
            self._finish(r, now, outcome, "failed in the recorded trace" if outcome == "error" else None)
        # the step event (its composition and the KV pool after it); the flight is over
        pool = self.pool
        self.writer.steps.append(
            (self.instance_id, self._step_index, f.start_ns, now, f.num_steps, tally.num_prefill, tally.num_decode,
             f.snapshot or NO_MEMBERS, tally.ids, tally.per, pool.num_total - pool.num_free, pool.num_free)
        )
        self._step_index += 1
        self.stats.num_step_events += 1
        self.stats.busy_ns += now - f.start_ns  # the step event's end - start
        self._flight = None
        self._last_start_ns, self._last_end_ns = f.prev_end_ns, now
        for r in tally.handoffs:  # after the step: its KV leaves with it (only a prefill instance hands off)
            assert self.handoff is not None
            self.handoff(r, self.release(r, True))
        if self.fast:
            self._rejoin_lockstep(f, tally.joiners)
        if self.check:
            self.check_invariants()
        self._flush_countdown -= 1
        if self._flush_countdown <= 0:
            self._flush_if_full()

    def _advance_scheduled(self, f: _Flight, now: int, finished: list[tuple[Request, str]]) -> _StepTally:
        """Each request scheduled one by one gains its computed tokens and, when it sampled, its
        output tokens (delivered now); those done are added to ``finished``. Returns the step's tally
        (its composition, the requests that hand off or join the lockstep set)."""
        writer, iid, report, targets = self.writer, self.instance_id, self._report_steps, self._targets
        tokens = writer.tokens
        leases = f.leases
        tally = _StepTally()
        ids, per, served, joiners, handoffs = tally.ids, tally.per, tally.served, tally.joiners, tally.handoffs
        num_prefill = 0
        num_decode = f.snapshot.num_seqs if f.snapshot is not None else 0
        for i, (r, m) in enumerate(f.scheduled):
            ids.append(r.request_id)
            if r.first_step_ns is None:  # the first step event that lists it (the request table's scheduled_ns)
                r.first_step_ns = f.start_ns
                r.first_step_pending = False
            left = r.num_tokens - r.num_computed
            decode = left == 1 and r.num_computed >= r.num_prompt_tokens
            spec = decode and r.num_speculative_tokens
            n = r.num_branches if decode else m
            per.append((spec + 1) * n if spec else n)  # a speculating decode processes k_r + 1 tokens per branch
            if report:
                served.append(m * n if spec else n)  # a speculating decode serves its accepted tokens
            if decode:
                num_decode += n
            else:
                num_prefill += m
            if r.owner is not self or (leases is not None and leases[i] != r.num_preemptions):
                self.stats.num_stale_refused += 1  # it moved away during the step: this worker's lease is stale
                continue
            if r.state != RUNNING:
                continue  # cancelled during the step
            r.num_computed += m
            if r.num_computed < r.num_tokens:
                continue  # a chunk of a longer prefill
            if targets[r] == 0:
                finished.append((r, "error" if r.failed else "completed"))
                continue
            if spec:  # its verified positions: the sampled one and the accepted drafts, delivered at once
                gained = r.num_computed + 1 - r.num_tokens
                r.num_speculative_steps += 1
            else:
                gained = 1
            r.num_output += gained
            r.num_tokens += gained
            if r.num_output == 1:
                r.first_token_ns = now
                writer.first_tokens.append((r, now, iid))
            else:
                tokens.append((r, now, r.num_branches * gained, r.num_output * r.num_branches, False, iid))
            if r.num_output >= targets[r]:
                finished.append((r, "completed"))
            elif self.handoff is not None:  # a prefill instance: it decodes elsewhere
                handoffs.append(r)
            elif self.fast and (r.num_branches == 1 or r.num_computed > r.num_prompt_tokens):
                joiners.append(r)
        tally.num_prefill, tally.num_decode = num_prefill, num_decode
        return tally

    def _observe_step(self, f: _Flight, served: list[int]) -> None:
        """A policy that wants step reports: the requests the flight served and their tokens."""
        members = [r for r in f.snapshot.requests if r.view is not None] if f.snapshot is not None else []
        views = [r.view for r in members] + [r.view for r, _ in f.scheduled if r.view is not None]
        counts = [r.num_branches for r in members] + [c for (r, _), c in zip(f.scheduled, served) if r.view is not None]
        self.policy.observe_step(self.view, views, counts, f.num_steps - f.num_applied)

    def _rejoin_lockstep(self, f: _Flight, joiners: list[Request]) -> None:
        """Fast mode: decoders join the lockstep set; after a request-by-request pass, every
        running decoder outside it does."""
        if f.lockstep:
            for r in joiners:
                self._join(r)
            return
        for r in self.running:
            if r.lock is None and r.is_decoding and (r.num_branches == 1 or r.num_computed > r.num_prompt_tokens):
                self._join(r)

    def _flush_if_full(self) -> None:
        """Every 64 steps: hand the buffered events to the writer once they make a chunk."""
        self._flush_countdown = 64
        if self.writer.pending_rows() >= self.writer.chunk_rows:
            self.writer.flush()
            self._lock.snapshot = None  # its members were logged in the chunk just flushed

    def _complete_run(self, f: _Flight) -> None:
        """``_complete_flight`` for a flight of the lockstep set alone (the common case, kept short)."""
        now = self.kernel.now_ns
        writer = self.writer
        lock = self._lock
        k = f.num_steps
        lock.ticks += k - f.num_applied
        lock.ahead = 0
        ticks = lock.ticks
        if lock.members:
            writer.runs.append((lock.snapshot or lock.current_snapshot(), now, k, ticks, k > 1, self.instance_id))
        heap = lock.heap
        if heap and heap[0][0] <= ticks:
            for r in lock.pop_finished():
                self._finish(r, now, "completed", None)
        pool = self.pool
        free = pool.num_free
        assert f.snapshot is not None  # a lockstep flight carries its set's snapshot
        writer.steps.append(
            (self.instance_id, self._step_index, f.start_ns, now, k, 0, f.snapshot.num_seqs, f.snapshot, (), (),
             pool.num_total - free, free)
        )
        self._step_index += 1
        self.stats.num_step_events += 1
        self.stats.busy_ns += now - f.start_ns  # the step event's end - start
        self._flight = None
        self._last_start_ns, self._last_end_ns = f.prev_end_ns, now
        self._flush_countdown -= 1
        if self._flush_countdown <= 0:
            self._flush_if_full()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert the KV accounting, the lockstep aggregates and the queue states (tests: after every step)."""
        pool, bs, lock = self.pool, self.block_size, self._lock
        anon = 0
        for r in self.running:
            assert r.state == RUNNING
            unit_blocks = sum(pool.cached_blocks(k) for k in r.held_units)
            blocks = held_blocks(r)
            if r.lock is not None:
                assert r in lock.members
                anon += blocks - r.unit_blocks
                assert r.unit_blocks == unit_blocks
            else:
                assert r.num_blocks == r.num_anon_blocks + unit_blocks, (r, r.num_blocks, r.num_anon_blocks, unit_blocks)
                anon += r.num_anon_blocks
            assert blocks - unit_blocks >= 0
            assert blocks == blocks_for(r, r.num_computed + r.live_ticks(), bs), (r, blocks)
        assert len(lock.members) == sum(1 for r in self.running if r.lock is not None)
        assert lock.num_seqs == sum(r.num_branches for r in lock.members)
        assert lock.ctx_base + lock.num_seqs * lock.ticks == sum(
            r.num_branches * (r.num_computed + r.live_ticks() + 1) for r in lock.members
        )
        assert sum(lock.hist) == lock.num_seqs and min(lock.hist, default=0) >= 0
        for r in self.waiting:
            assert r.state == WAITING and r.num_blocks == 0 and not r.held_units and r.lock is None
        pool.check(anon)
        assert 0 <= pool.num_used <= pool.num_total
        assert len(self.running) <= self.max_seqs


def _step_shape(scheduled: list[tuple[Request, int]], now: int, num_decode: int = 0, decode_ctx: int = 0) -> StepShape:
    """The cost model's view of a step: ``scheduled`` (request, tokens) split into prefill chunks and
    decode sequences, on top of ``num_decode`` sequences with ``decode_ctx`` summed context (the
    lockstep set's), speculating decodes apart; stamps each request's first schedule time."""
    chunks: list[tuple[int, int]] = []
    spec: list[tuple[int, int, int]] = []
    for r, m in scheduled:
        if r.scheduled_ns is None:
            r.scheduled_ns = now
        if r.num_tokens - r.num_computed == 1 and r.num_computed >= r.num_prompt_tokens:
            if r.num_speculative_tokens:  # it verifies k_r + 1 tokens per branch (replay.speculative)
                spec.append((r.num_speculative_tokens, r.num_branches, r.num_branches * (r.num_computed + 1)))
            else:
                num_decode += r.num_branches
                decode_ctx += r.num_branches * (r.num_computed + 1)
        else:
            chunks.append((m, r.num_computed))
    return StepShape(tuple(chunks), num_decode, decode_ctx, tuple(spec))
