"""Virtual Token Counter fair share, and per-tenant quotas on service rate and concurrency.

Fair share (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, VTC): each tenant
has a counter of the service it received, input tokens x ``input_token_weight`` (1) plus output
tokens x ``output_token_weight`` (2), divided by its entitlement weight. Waiting requests are
served tenant by tenant, the tenant with the smallest counter first (its requests in queue order;
ties by who queued first). Counters grow from ``observe_step``: the tokens each request processed
in each step (a prefill chunk counts as input, a decode as output). A tenant that returns after
having nothing queued or running has its counter lifted to the smallest counter among the
active tenants (max(own, min active)), so idle time is not banked as credit. Counters are exact
rationals, so the fast and reference modes break ties identically; while requests wait, the fast
mode's runs stop at the step at which two waiting tenants' counters would cross.

Quotas (token buckets, as API gateways enforce rate limits): a tenant with ``max_service_per_s``
has a bucket of that refill rate and ``burst_service`` depth; a request starts only if the bucket
holds its predicted service (prompt x 1 + expected output x 2, per branch), which it then takes; a
tenant with ``max_concurrent_requests`` has at most that many requests admitted at once. Over quota,
the request is rejected with the retry-after that the bucket (or a slot) needs.

Classes, weights and quotas come from tenant configuration (``Tenancy``), never from the request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from replay.errors import ReplayError
from replay.policies.base import AdmissionDecision, Policy, register
from replay.policies.limits import check_magnitudes
from replay.policies.tenancy import Tenancy, TenantBook
from replay.views import EngineView, RequestView
from schemas.types import doc

NS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class VtcConfig:
    """Settings of the VTC fair-share policy and its quotas."""

    tenancy: Tenancy = doc("Tenants (weights, quotas) and their classes.", Tenancy())
    input_token_weight: int = doc("Service per input (prefill) token.", 1)
    output_token_weight: int = doc("Service per output (decode) token.", 2)
    quota_output_tokens: int = doc(
        "Output tokens per branch a quota charges for a request without max_tokens (its expected output).", 256
    )
    quota_retry_after_min_s: float = doc("Shortest retry-after a quota rejection sends, seconds.", 1.0)

    def __post_init__(self) -> None:
        check_magnitudes("vtc", self)
        check_token_weights("vtc", self.input_token_weight, self.output_token_weight)
        if self.quota_output_tokens < 0 or self.quota_retry_after_min_s < 0:
            raise ReplayError("vtc: quota_output_tokens and quota_retry_after_min_s must be non-negative")


def check_token_weights(policy: str, input_token_weight: int, output_token_weight: int) -> None:
    """Service per token must count up: a negative weight would rank the heaviest tenant first."""
    if input_token_weight < 0 or output_token_weight < 0:
        raise ReplayError(f"{policy}: token weights must be non-negative integers, not {input_token_weight} and "
                          f"{output_token_weight}")


class FairShare:
    """VTC's counters, the active-tenant tracking that lifts returning tenants, and the fair order."""

    __slots__ = ("book", "w_in", "w_out", "counters", "_members", "_weights", "_compact_at")

    def __init__(self, book: TenantBook, input_token_weight: int, output_token_weight: int) -> None:
        self.book = book
        self.w_in = input_token_weight
        self.w_out = output_token_weight
        self.counters: dict[str | None, Fraction] = {}
        self._members: dict[str | None, deque[RequestView]] = {}  # admitted requests, oldest first
        self._weights: dict[str | None, Fraction] = {}
        self._compact_at: dict[str | None, int] = {}

    def _weight(self, tenant: str | None) -> Fraction:
        w = self._weights.get(tenant)
        if w is None:
            w = self._weights[tenant] = Fraction(self.book.weight(tenant)).limit_denominator(1_000_000)
        return w

    def _active(self, tenant: str | None) -> bool:
        members = self._members.get(tenant)
        while members and members[0].state == "finished":
            members.popleft()
        return bool(members)

    def num_admitted(self, tenant: str | None) -> int:
        """The tenant's requests admitted and not finished (held ones excluded)."""
        members = self._members.get(tenant)
        if not members:
            return 0
        live = [m for m in members if m.state != "finished"]
        self._members[tenant] = deque(live)
        return sum(1 for m in live if m.state != "held")

    def lifted(self, tenant: str | None) -> Fraction:
        """The tenant's counter as it would be if a request of it were admitted now: an idle tenant
        is lifted to the smallest counter among the active tenants."""
        own = self.counters.get(tenant, Fraction(0))
        if not self._active(tenant):
            active = [self.counters.get(t, Fraction(0)) for t in self._members if t != tenant and self._active(t)]
            if active:
                own = max(own, min(active))
        return own

    def weight(self, tenant: str | None) -> Fraction:
        """The tenant's entitlement weight, exactly."""
        return self._weight(tenant)

    def arrive(self, request: RequestView) -> None:
        """``request`` is admitted: lift its tenant's counter if the tenant was idle, then track it."""
        tenant = request.tenant
        self.counters[tenant] = self.lifted(tenant)
        members = self._members.setdefault(tenant, deque())
        members.append(request)
        if len(members) > self._compact_at.get(tenant, 256):  # finished ones behind a long-lived head
            live = deque(m for m in members if m.state != "finished")
            self._members[tenant] = live
            self._compact_at[tenant] = 2 * len(live) + 256

    def observe(self, requests: Sequence[RequestView], num_tokens: Sequence[int], num_steps: int) -> None:
        """Charge each request's tokens of the step(s) to its tenant."""
        raw: dict[str | None, int] = {}
        w_in, w_out = self.w_in, self.w_out
        for r, n in zip(requests, num_tokens):
            decode = r.num_computed_tokens > r.num_prompt_tokens
            raw[r.tenant] = raw.get(r.tenant, 0) + n * num_steps * (w_out if decode else w_in)
        counters = self.counters
        for tenant, units in raw.items():
            counters[tenant] = counters.get(tenant, Fraction(0)) + Fraction(units) / self._weight(tenant)

    def order(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        """Waiting requests tenant by tenant, smallest counter first (ties: the tenant queued first)."""
        groups: dict[str | None, list[RequestView]] = {}
        for r in waiting:
            g = groups.get(r.tenant)
            if g is None:
                groups[r.tenant] = [r]
            else:
                g.append(r)
        if len(groups) == 1:
            return list(waiting)
        counters = self.counters
        out: list[RequestView] = []
        for t in sorted(groups, key=lambda t: counters.get(t, Fraction(0))):  # stable: ties keep queue order
            out.extend(groups[t])
        return out

    def horizon(self, view: EngineView, waiting: Sequence[RequestView]) -> int | None:
        """Decode steps until two waiting tenants' order would swap (None: never, during this run)."""
        firsts: list[str | None] = []
        seen: set[str | None] = set()
        for r in waiting:
            if r.tenant not in seen:
                seen.add(r.tenant)
                firsts.append(r.tenant)
        if len(firsts) < 2:
            return None
        per_step: dict[str | None, int] = {}
        for r in view.running:
            if not r.is_prefilling and r.tenant in seen:
                per_step[r.tenant] = per_step.get(r.tenant, 0) + r.num_branches * self.w_out
        if not per_step:
            return None
        counters = self.counters
        ranked = sorted(firsts, key=lambda t: counters.get(t, Fraction(0)))
        best: int | None = None
        for a, b in zip(ranked, ranked[1:]):
            ia = Fraction(per_step.get(a, 0)) / self._weight(a)
            ib = Fraction(per_step.get(b, 0)) / self._weight(b)
            if ia <= ib:
                continue
            gap = counters.get(b, Fraction(0)) - counters.get(a, Fraction(0))
            k = gap // (ia - ib) + 1  # first k with c_a + k ia > c_b + k ib
            best = int(k) if best is None else min(best, int(k))
        return best


class Quotas:
    """Per-tenant token buckets of service per second and caps on admitted requests."""

    __slots__ = ("book", "_level", "_stamp_ns")

    def __init__(self, book: TenantBook) -> None:
        self.book = book
        self._level: dict[str, float] = {}
        self._stamp_ns: dict[str, int] = {}

    def _refill(self, tenant: str, rate: float, depth: float, now_ns: int) -> float:
        level = self._level.get(tenant, depth)
        last = self._stamp_ns.get(tenant, now_ns)
        level = min(depth, level + rate * (now_ns - last) / NS)
        self._level[tenant] = level
        self._stamp_ns[tenant] = now_ns
        return level

    def wait_s(self, tenant: str | None, service: float, now_ns: int,
               num_admitted: Callable[[str | None], int]) -> tuple[float, str] | None:
        """None when the tenant may start a request of ``service`` units now; else (seconds until it
        could, and which quota binds). ``num_admitted`` counts the tenant's admitted requests."""
        spec = self.book.tenant(tenant)
        if spec is None:
            return None
        if spec.max_concurrent_requests is not None and num_admitted(tenant) >= spec.max_concurrent_requests:
            return 0.0, f"tenant over its concurrency quota ({spec.max_concurrent_requests} requests)"
        if spec.max_service_per_s is None:
            return None
        depth = spec.bucket_depth
        level = self._refill(spec.name, spec.max_service_per_s, depth, now_ns)
        need = min(service, depth)  # a request larger than the bucket waits for a full bucket
        if level >= need:
            return None
        return (need - level) / spec.max_service_per_s, "tenant over its service-rate quota"

    def take(self, tenant: str | None, service: float, now_ns: int) -> None:
        """Debit an admitted request's service from its tenant's bucket."""
        spec = self.book.tenant(tenant)
        if spec is None or spec.max_service_per_s is None:
            return
        level = self._refill(spec.name, spec.max_service_per_s, spec.bucket_depth, now_ns)
        self._level[spec.name] = level - min(service, spec.bucket_depth)


@register
class VtcPolicy(Policy):
    """Fair share by virtual token counters (input x 1 + output x 2 over weight), with per-tenant quotas."""

    name = "vtc"
    config_type = VtcConfig

    def __init__(self, config: VtcConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.book = TenantBook(c.tenancy)
        self.fair = FairShare(self.book, c.input_token_weight, c.output_token_weight)
        self.quotas = Quotas(self.book)

    def service_estimate(self, request: RequestView) -> float:
        """Service a quota charges: prompt x input weight + expected output x output weight x branches."""
        c = self.config
        out = c.quota_output_tokens if request.max_output_tokens is None else min(c.quota_output_tokens, request.max_output_tokens)
        return request.num_prompt_tokens * c.input_token_weight + out * request.num_branches * c.output_token_weight

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        service = self.service_estimate(request)
        over = self.quotas.wait_s(request.tenant, service, view.now_ns, self.fair.num_admitted)
        if over is not None:
            wait, why = over
            return AdmissionDecision(
                decision="reject", reason=why, retry_after_s=max(wait, self.config.quota_retry_after_min_s)
            )
        self.quotas.take(request.tenant, service, view.now_ns)
        self.fair.arrive(request)
        return AdmissionDecision(decision="accept")

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        return self.fair.order(waiting)

    def observe_step(self, view: EngineView, requests: Sequence[RequestView], num_tokens: Sequence[int],
                     num_steps: int) -> None:
        self.fair.observe(requests, num_tokens, num_steps)

    def run_horizon_steps(self, view: EngineView) -> int | None:
        waiting = view.waiting
        return self.fair.horizon(view, waiting) if waiting else None
