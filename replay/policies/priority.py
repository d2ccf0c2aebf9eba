"""Priority scheduling with aging and a maximum queue residence per class.

Mechanism: vLLM v1's priority scheduler (waiting requests ordered by priority, lower first, ties by
arrival; the preemption victim is the lowest-priority, latest-arriving running request), with
the two guards that keep a low class from starving under a busy high class (aging as in
classic multilevel schedulers, e.g. Silberschatz's "aging"; the residence limit as ``docs/design.md``'s
starvation objective):

- **aging**: a waiting request gains one priority level per ``aging_s`` seconds since it arrived
  (effective priority = class priority - floor(waited / aging_s));
- **maximum residence**: once a request has waited ``promote_share`` of its class's
  ``max_queue_s``, it is promoted ahead of every request not promoted (promoted requests among
  themselves: earliest residence deadline first), and it is never chosen as a preemption victim
  while another candidate is not promoted.

A class comes from its tenant's configuration (``Tenancy``), never from the request. Because
the order moves with time, ``run_horizon_steps`` stops a fast-mode run at the step during which
the next waiting request changes level or is promoted (``steps_until``), so the fast and reference
modes decide identically.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from replay.errors import ReplayError
from replay.policies.base import Policy, register
from replay.policies.batch import BatchSnapshot, steps_until
from replay.policies.limits import check_magnitudes
from replay.policies.tenancy import Tenancy, TenantBook
from replay.views import EngineView, RequestView
from schemas.types import doc

NS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class PriorityConfig:
    """Settings of the priority policy."""

    tenancy: Tenancy = doc("Classes (priority, max_queue_s) and the tenants entitled to them.", Tenancy())
    aging_s: float | None = doc("A waiting request gains one priority level per this many seconds; None: no aging.", 5.0)
    promote_share: float | None = doc(
        "Promote a waiting request ahead of all others once it has waited this share of its class's max_queue_s; "
        "None: no promotion.",
        0.5,
    )

    def __post_init__(self) -> None:
        check_magnitudes("priority", self)
        if self.aging_s is not None and not self.aging_s > 0:
            raise ReplayError(f"priority: aging_s must be positive, not {self.aging_s}")
        if self.promote_share is not None and not 0 <= self.promote_share <= 1:
            raise ReplayError(f"priority: promote_share must be in [0, 1], not {self.promote_share}")


@register
class PriorityPolicy(Policy):
    """Lower class priority first, with aging and promotion before a class's maximum queue residence."""

    name = "priority"
    config_type = PriorityConfig

    def __init__(self, config: PriorityConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.book = TenantBook(c.tenancy)
        self._aging_ns = None if c.aging_s is None else round(c.aging_s * NS)
        # per class: (priority, promotion delay ns or None, residence limit ns or None)
        self._class: dict[str, tuple[int, int | None, int | None]] = {}
        for cls in c.tenancy.classes:
            limit = None if cls.max_queue_s is None else round(cls.max_queue_s * NS)
            promote = None if limit is None or c.promote_share is None else round(limit * c.promote_share)
            self._class[cls.name] = (cls.priority, promote, limit)
        self._batch = BatchSnapshot()

    def _key(self, r: RequestView, now: int) -> tuple:
        priority, promote, limit = self._class[self.book.class_of(r).name]
        waited = now - r.arrival_ns
        if promote is not None and waited >= promote:
            return (0, r.arrival_ns + limit, r.arrival_ns, r.request_id)
        level = priority - (waited // self._aging_ns if self._aging_ns else 0)
        return (1, level, r.arrival_ns, r.request_id)

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        now = view.now_ns
        return sorted(waiting, key=lambda r: self._key(r, now))

    def victim(self, view: EngineView, candidates: Sequence[RequestView]) -> RequestView:
        now = view.now_ns

        # the worst: not promoted, highest effective priority value, latest arrival (promoted ones only
        # when every candidate is promoted: the latest residence deadline)
        return max(candidates, key=lambda r: self._key(r, now)[:3])

    def _next_change_ns(self, r: RequestView, now: int) -> int | None:
        """When ``r``'s order key next changes (a new aging level or its promotion), if ever."""
        _, promote, _ = self._class[self.book.class_of(r).name]
        waited = now - r.arrival_ns
        if promote is not None and waited >= promote:
            return None  # promoted: its key is fixed
        times = []
        if self._aging_ns:
            times.append(r.arrival_ns + (waited // self._aging_ns + 1) * self._aging_ns)
        if promote is not None:
            times.append(r.arrival_ns + promote)
        return min(times) if times else None

    def run_horizon_steps(self, view: EngineView) -> int | None:
        waiting = view.waiting
        if not waiting:
            return None
        now = view.now_ns
        changes = [t for t in (self._next_change_ns(r, now) for r in waiting) if t is not None]
        if not changes:
            return None
        return steps_until(view, self._batch, min(changes) - now)
