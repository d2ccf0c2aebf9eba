"""The engine's mutable state of one request (engine-private; policies see ``replay.views.RequestView``).

Token accounting follows vLLM v1: ``num_tokens`` is the prompt plus the output positions sampled so
far, ``num_computed`` the tokens whose KV is computed. A step schedules ``num_tokens - num_computed``
tokens or a chunk of them; when a step computes the last of them, one token is sampled per branch.
A decoding request therefore schedules one position per step, and a request preempted by recompute
(``num_computed`` back to 0, or to its prefix-cache hits) re-prefills prompt and output before it
samples again.

In the fast mode, a decoding request may belong to the engine's *lockstep* set (``lock`` is set):
its progress then advances virtually with the set's decode clock, and ``num_computed``,
``num_output`` and ``num_tokens`` hold their values at ``g0``, the clock's value when it joined; the
live value adds ``lock.ticks - g0`` (``live_*`` below, and the views, do this).

On an instance with speculative decoding, a decoding request with ``num_speculative_tokens`` (k_r) > 0
schedules its position plus k_r drafted ones for verification and advances by the tokens its
deterministic schedule accepts (``replay.speculative``); ``num_computed`` then jumps by that many.

The request's true output length is not here: the engine keeps it apart, so that nothing a policy
can reach through a view reveals it.

In a cluster a request can move between instances (``replay.cluster``): ``owner`` is the engine
holding its lease (None while it moves), ``num_preemptions`` the lease generation (bumped by every
preemption and every move), ``moved_tokens`` the tokens whose KV came with it, placed when it is
admitted to the destination's batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

WAITING = 0
RUNNING = 1
HELD = 2  # admission said "queue": not yet in the engine's waiting queue
FINISHED = 3
MOVING = 4  # between two instances of a cluster (its KV in transfer, or to be recomputed): no engine holds it


class Request:
    """One request inside the engine."""

    __slots__ = (
        "index",
        "request_id",
        "arrival_ns",
        "client_sent_ns",
        "num_prompt_tokens",
        "num_branches",
        "num_branches_requested",
        "unit_keys",
        "tenant",
        "service_class",
        "model",
        "adapter",
        "session_id",
        "prefix_block_ids",
        "ttft_deadline_ns",
        "e2e_deadline_ns",
        "max_output_tokens",
        "cancel_after_ns",
        "failed",
        "num_image_tokens",
        # speculative decoding (replay.speculative)
        "num_speculative_tokens",
        "speculative_cap",
        "num_speculative_steps",
        # progress
        "state",
        "num_tokens",
        "num_computed",
        "num_output",
        "num_cached_prefix_tokens",
        "looks_up_prefix",
        # KV blocks
        "num_blocks",
        "num_anon_blocks",
        "held_units",
        "next_unit",
        "swapped_tokens",
        "moved_tokens",
        # lockstep membership (fast mode)
        "lock",
        "g0",
        "lock_offset",
        "lock_output",
        "g_finish",
        "unit_blocks",
        # history
        "num_preemptions",
        "num_admission_decisions",
        "admitted_ns",
        "scheduled_ns",
        "first_step_ns",
        "first_step_pending",
        "first_token_ns",
        "view",
        # the lease: the engine that may advance it now (its worker), at generation ``num_preemptions``
        "owner",
    )

    def __init__(
        self,
        index: int,
        request_id: str,
        arrival_ns: int,
        num_prompt_tokens: int,
        *,
        num_branches: int = 1,
        unit_keys: Sequence[tuple[Hashable, int, int]] = (),
        tenant: str | None = None,
        service_class: str | None = None,
        model: str | None = None,
        adapter: str | None = None,
        session_id: str | None = None,
        prefix_block_ids: list[int] | None = None,
        ttft_deadline_ns: int | None = None,
        e2e_deadline_ns: int | None = None,
        max_output_tokens: int | None = None,
        cancel_after_ns: int | None = None,
        failed: bool = False,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.arrival_ns = arrival_ns
        self.client_sent_ns: int | None = None  # when the client sent it (a replay with a frontend model)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_branches = num_branches  # may be lowered at admission (a degrade decision's num_branches)
        self.num_branches_requested = num_branches  # what the client asked for (the arrival event's)
        self.unit_keys = list(unit_keys)
        self.looks_up_prefix = bool(unit_keys)  # its prompt's blocks are looked up in the prefix cache
        self.tenant = tenant
        self.service_class = service_class
        self.model = model
        self.adapter = adapter
        self.session_id = session_id
        self.prefix_block_ids = prefix_block_ids
        self.ttft_deadline_ns = ttft_deadline_ns
        self.e2e_deadline_ns = e2e_deadline_ns
        self.max_output_tokens = max_output_tokens
        self.cancel_after_ns = cancel_after_ns
        self.failed = failed
        self.num_image_tokens = 0  # encoder tokens of its images (multimodal; its first prefill step runs the encoder)
        self.num_speculative_tokens = 0  # k_r: tokens it drafts per decode step here (0: it does not speculate)
        self.speculative_cap: int | None = None  # at most this k_r on any instance (a degrade decision's)
        self.num_speculative_steps = 0  # speculative decode steps it completed (its token schedule's n)
        self._init_state()

    def _init_state(self) -> None:
        """Its progress, KV blocks, lockstep membership and history as it arrives: nothing computed, none held."""
        self.state = WAITING
        self.num_tokens = self.num_prompt_tokens
        self.num_computed = 0
        self.num_output = 0
        self.num_cached_prefix_tokens = 0
        self.num_blocks = 0
        self.num_anon_blocks = 0
        self.held_units: list[Hashable] = []
        self.next_unit = 0
        self.swapped_tokens = 0
        self.moved_tokens = 0  # tokens whose KV arrived from another instance (replay.cluster), not yet placed
        self.lock: Any = None  # its replay.lockstep.Lockstep while it decodes in lockstep
        self.g0 = 0
        self.lock_offset = 0
        self.lock_output = 0  # num_output - g0 while in lockstep: output at clock t is lock_output + t
        self.g_finish = 0
        self.unit_blocks = 0
        self.num_preemptions = 0
        self.num_admission_decisions = 0
        self.admitted_ns: int | None = None
        self.scheduled_ns: int | None = None
        self.first_step_ns: int | None = None  # start of the first step event listing it (a step lost to a failure is not)
        self.first_step_pending = False  # in a step in flight that would be its first
        self.first_token_ns: int | None = None
        self.view: Any = None  # its replay.views.RequestView while an engine holds it (policies see only views)
        self.owner: Any = None

    @property
    def is_decoding(self) -> bool:
        """Its next step decodes: one position left to compute, past its prompt (else it prefills or recomputes)."""
        return self.num_tokens - self.num_computed == 1 and self.num_computed >= self.num_prompt_tokens

    def live_ticks(self) -> int:
        """Decode positions gained in lockstep since ``g0`` (0 outside the lockstep set)."""
        lock = self.lock
        return lock.ticks - self.g0 if lock is not None else 0

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, computed={self.num_computed}/{self.num_tokens}, output={self.num_output})"
