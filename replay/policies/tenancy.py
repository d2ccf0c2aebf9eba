"""Service classes and tenants as policies see them: a request's class comes from its tenant's configuration.

A class is what a tenant is entitled to, looked up by the authenticated tenant pseudonym the
request carries (``RequestView.tenant``) in ``Tenancy.tenants``; tenants not listed get
``default_class``. The class a client wrote into its request (``RequestView.service_class``) is
never consulted, so no client can promote itself (``docs/design.md``, Objectives and service classes). A class carries its scheduling
priority, its objectives and its starvation limit; a tenant carries its entitlement weight (VTC
divides service by it) and optional quotas (token rate, concurrency).

``TenantBook`` is the lookup the policies share (memoized per tenant); ``Tenancy`` is the typed
configuration every class-aware policy config embeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.errors import ReplayError
from replay.policies.limits import check_magnitudes
from replay.views import RequestView
from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassConfig:
    """A service class: its priority, objectives and starvation limit."""

    name: str = doc("Class name, e.g. 'interactive'.")
    priority: int = doc("Scheduling priority: lower values run first (vLLM's convention).", 0)
    ttft_objective_s: float | None = doc("Time-to-first-token objective, seconds (None: none).", None)
    itl_objective_s: float | None = doc("Objective for every inter-token gap, seconds (None: none).", None)
    e2e_objective_s: float | None = doc("End-to-end objective (arrival to last token), seconds (None: none).", None)
    max_queue_s: float | None = doc("Longest queue residence the class tolerates (starvation limit), seconds.", None)
    sheddable: bool = doc(
        "May be shed when the pool saturates (the Gateway API Inference Extension's 'sheddable' criticality).", False
    )

    def __post_init__(self) -> None:
        check_magnitudes(f"tenancy class {self.name!r}", self)
        for name in ("ttft_objective_s", "itl_objective_s", "e2e_objective_s", "max_queue_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ReplayError(f"class {self.name!r}: {name} must be positive, not {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    """A tenant: the class it is authenticated for, its entitlement and its quotas."""

    name: str = doc("Tenant pseudonym (as requests carry it).")
    service_class: str = doc("The class this tenant's requests are served under (never the client's own claim).")
    weight: float = doc("Entitlement weight: fair-share policies divide the tenant's service by it.", 1.0)
    max_service_per_s: float | None = doc(
        "Token-bucket rate of service (input tokens x 1 + output tokens x 2) the tenant may start per second; "
        "None: no rate quota.",
        None,
    )
    burst_service: float | None = doc(
        "Token-bucket depth, service units (default: 10 s of max_service_per_s).", None
    )
    max_concurrent_requests: int | None = doc("Most requests of the tenant admitted at once; None: no cap.", None)

    def __post_init__(self) -> None:
        check_magnitudes(f"tenancy tenant {self.name!r}", self)
        if not self.weight > 0:
            raise ReplayError(f"tenant {self.name!r}: weight must be positive, not {self.weight}")
        if self.max_service_per_s is not None and not self.max_service_per_s > 0:
            raise ReplayError(f"tenant {self.name!r}: max_service_per_s must be positive")
        if self.burst_service is not None and (self.max_service_per_s is None or not self.burst_service > 0):
            raise ReplayError(f"tenant {self.name!r}: burst_service needs a positive value and a max_service_per_s")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ReplayError(f"tenant {self.name!r}: max_concurrent_requests must be at least 1")

    @property
    def bucket_depth(self) -> float | None:
        """The token bucket's depth, service units (None without a rate quota)."""
        if self.max_service_per_s is None:
            return None
        return self.burst_service if self.burst_service is not None else 10.0 * self.max_service_per_s


DEFAULT_CLASS = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class Tenancy:
    """Classes and tenants: the authenticated configuration class-aware policies decide from."""

    classes: tuple[ClassConfig, ...] = doc("Service classes.", (ClassConfig(name=DEFAULT_CLASS),))
    tenants: tuple[TenantConfig, ...] = doc("Tenants and the class each is entitled to.", ())
    default_class: str = doc("Class of requests whose tenant is not listed (or carries no tenant).", DEFAULT_CLASS)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ReplayError(f"tenancy: class names repeat: {names}")
        if self.default_class not in names:
            raise ReplayError(
                f"tenancy: the default class {self.default_class!r} is not among the classes",
                f"set tenancy.default_class (the class of tenants not listed) to one of: {', '.join(names)}",
            )
        seen: set[str] = set()
        for t in self.tenants:
            if t.name in seen:
                raise ReplayError(f"tenancy: tenant {t.name!r} is listed twice")
            seen.add(t.name)
            if t.service_class not in names:
                raise ReplayError(
                    f"tenancy: tenant {t.name!r} is entitled to class {t.service_class!r}, which is not defined",
                    f"classes: {', '.join(names)}",
                )

    def class_named(self, name: str) -> ClassConfig:
        for c in self.classes:
            if c.name == name:
                return c
        raise ReplayError(f"tenancy: no class {name!r}", f"classes: {', '.join(c.name for c in self.classes)}")


class TenantBook:
    """Per-tenant lookups for a policy: class, weight, quotas (memoized; unknown tenants get the defaults)."""

    __slots__ = ("tenancy", "_class_of", "_tenant", "_default_class", "_classes")

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self._classes = {c.name: c for c in tenancy.classes}
        self._default_class = self._classes[tenancy.default_class]
        self._tenant = {t.name: t for t in tenancy.tenants}
        self._class_of: dict[str | None, ClassConfig] = {}

    def class_of(self, request: RequestView) -> ClassConfig:
        """The request's class, from its tenant's configuration (never from the request's own class field)."""
        return self.class_of_tenant(request.tenant)

    def class_of_tenant(self, tenant: str | None) -> ClassConfig:
        c = self._class_of.get(tenant)
        if c is None:
            spec = self._tenant.get(tenant) if tenant is not None else None
            c = self._classes[spec.service_class] if spec is not None else self._default_class
            self._class_of[tenant] = c
        return c

    def tenant(self, tenant: str | None) -> TenantConfig | None:
        """The tenant's configuration, or None when it is not listed."""
        return self._tenant.get(tenant) if tenant is not None else None

    def weight(self, tenant: str | None) -> float:
        spec = self._tenant.get(tenant) if tenant is not None else None
        return spec.weight if spec is not None else 1.0

    @property
    def classes(self) -> dict[str, ClassConfig]:
        return self._classes
