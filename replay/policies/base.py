"""The policy seam: what a scheduling policy decides, and the registry that names policies.

The engine owns the clock, the queues, the KV pool and the batch; a policy only decides, through
read-only views (``replay.views``):

``admit(view, request)``           accept into the waiting queue, queue (hold it: it is offered
                                   again at every scheduling point, and ``retry_after_s`` after this
                                   decision at the latest, even if the engine is idle), degrade
                                   (accept with optional work reduced: its output capped at
                                   ``max_output_tokens``, its parallel samples cut to ``num_branches``,
                                   its speculative drafts cut to ``num_speculative_tokens``),
                                   route (not here: only when ``view.can_route(request)``, i.e. a
                                   cluster offers another instance; the cluster's router picks it),
                                   downgrade (not here, and served as the smaller model ``target``:
                                   only when ``view.can_downgrade(request, target)``, i.e. a cluster
                                   with multi-model residency has an instance serving it),
                                   or reject (with retry-after); the decision may
                                   carry the predicted output interval it used.
``order(view, waiting)``           which waiting requests to try this step, in order (an iterable:
                                   the engine stops at the first that does not fit, as vLLM does).
``victim(view, candidates)``       which request to preempt when KV blocks run out; ``candidates``
                                   are the running requests not yet scheduled in this step,
                                   the one being scheduled last.
``chunk_tokens(view, request, num_tokens_left, budget)``
                                   how many of a prefilling request's tokens go into this step.
``schedule_waiting_first(view)``   plan waiting requests before running ones (prefill-first).
``run_horizon_steps(view)``        how many identical decode steps its decisions are sure to repeat
                                   for when nothing else happens (None: as long as the state holds).
                                   The fast mode never advances further than this; a policy whose
                                   decisions move with time or with tokens served must bound it.
``observe_step(view, request_views, tokens, num_steps)``
                                   optional feedback after each step (or run of steps), for
                                   policies that keep counters (e.g. served tokens per tenant).

A policy class registers under a name with a typed, frozen config class; ``make_policy`` builds one
by name and an unknown name raises an error listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar, Literal

from replay.errors import ReplayError, unknown_name
from replay.views import EngineView, RequestView
from schemas.types import doc
from servelens.settings import build, read_document

AdmissionKind = Literal["accept", "queue", "degrade", "route", "downgrade", "reject"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionDecision:
    """An admission decision, as the ``admission_decided`` event records it."""

    decision: AdmissionKind = doc(
        "accept (into the waiting queue), queue (hold, offer again later), degrade (accept with optional work "
        "capped: ``max_output_tokens``, ``num_branches``, ``num_speculative_tokens``), route (not here: the cluster sends it to another "
        "instance, which its router picks; only when ``EngineView.can_route`` says so), downgrade (not here: served "
        "as the smaller model ``target`` on an instance serving it, which the router picks; only when "
        "``EngineView.can_downgrade`` says so) or reject."
    )
    reason: str | None = doc("Why, in a few words.", None)
    retry_after_s: float | None = doc(
        "reject: the retry-after sent to the client; queue: offer the request again this long after, seconds.", None
    )
    predicted_output_tokens_low: int | None = doc("Low end of the predicted output interval used.", None)
    predicted_output_tokens_high: int | None = doc("High end of the predicted output interval used.", None)
    max_output_tokens: int | None = doc(
        "degrade: the output cap imposed (tokens per branch); the request finishes there at the latest.", None
    )
    num_branches: int | None = doc(
        "degrade: the parallel samples (n) the request runs with, fewer than it asked for (at least 1).", None
    )
    num_speculative_tokens: int | None = doc(
        "degrade: the speculative tokens (k) the request drafts per decode step, fewer than the instance's "
        "(0: speculation off for it); the engine refuses more than the instance's k.", None
    )

    target: str | None = doc("downgrade: the smaller qualified model the request is served as.", None)

    def __post_init__(self) -> None:
        if self.decision not in ("accept", "queue", "degrade", "route", "downgrade", "reject"):
            raise ReplayError(
                f"admission decision {self.decision!r} is not supported by an instance's admission policy",
                "accept, queue, degrade, route, downgrade or reject",
            )
        if (self.decision == "downgrade") != (self.target is not None):
            raise ReplayError("a downgrade decision names its target model, and only a downgrade decision does")
        capped = (self.max_output_tokens, self.num_branches, self.num_speculative_tokens)
        if (self.decision == "degrade") != any(x is not None for x in capped):
            raise ReplayError(
                "a degrade decision carries max_output_tokens or num_branches or num_speculative_tokens (one or "
                "more), and only a degrade decision does"
            )
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ReplayError(f"max_output_tokens must be at least 1, not {self.max_output_tokens}")
        if self.num_branches is not None and self.num_branches < 1:
            raise ReplayError(f"num_branches must be at least 1, not {self.num_branches}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ReplayError(f"num_speculative_tokens must be at least 0, not {self.num_speculative_tokens}")


ACCEPT = AdmissionDecision(decision="accept")


@dataclass(frozen=True, slots=True, kw_only=True)
class NoConfig:
    """Settings of a policy that has none (an empty config, so every manifest serializes alike)."""


class Policy:
    """Base class with vLLM v1 FCFS behaviour for every decision; policies override what they change."""

    name: ClassVar[str] = ""
    config_type: ClassVar[type] = NoConfig

    def __init__(self, config: object | None = None) -> None:
        self.config = config if config is not None else self.config_type()

    def admit(self, view: EngineView, request: RequestView) -> AdmissionDecision:
        return ACCEPT

    def order(self, view: EngineView, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        return waiting

    def victim(self, view: EngineView, candidates: Sequence[RequestView]) -> RequestView:
        return candidates[-1]

    def chunk_tokens(self, view: EngineView, request: RequestView, num_tokens_left: int, budget_tokens: int) -> int:
        return min(num_tokens_left, budget_tokens)

    def schedule_waiting_first(self, view: EngineView) -> bool:
        return False

    def run_horizon_steps(self, view: EngineView) -> int | None:
        return None

    def observe_step(
        self, view: EngineView, requests: Sequence[RequestView], num_tokens: Sequence[int], num_steps: int
    ) -> None:
        """Called after each step only when a subclass overrides it."""

    @classmethod
    def wants_step_reports(cls) -> bool:
        return cls.observe_step is not Policy.observe_step


class Registry(dict):
    """The registered classes of one kind (policies, routers, autoscalers) by name. Each class has a
    ``name`` and a ``config_type``; ``register`` is its class decorator."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cls: type) -> type:
        """Class decorator: make ``cls`` available by its ``name``."""
        if not cls.name:
            raise TypeError(f"{self.kind} {cls.__name__} needs a name")
        if self.setdefault(cls.name, cls) is not cls:
            raise TypeError(f"{self.kind} name {cls.name!r} is taken by {self[cls.name].__name__}")
        return cls

    def lookup(self, name: str) -> type:
        """The class of that name; a clear error naming the valid ones."""
        if name not in self:
            raise unknown_name(self.kind, name, list(self))
        return self[name]

    def checked(self, name: str, config: object | None) -> type:
        """The class of that name, once ``config`` (None: its defaults) is of its config type."""
        cls = self.lookup(name)
        if config is not None and not isinstance(config, cls.config_type):
            raise ReplayError(f"{self.kind} {name!r} takes a {cls.config_type.__name__}, not a {type(config).__name__}")
        return cls


POLICIES = Registry("policy")
register = POLICIES.register
policy_class = POLICIES.lookup


def make_policy(name: str, config: object | None = None) -> Policy:
    """A policy by name, with its typed config (defaults when None)."""
    return POLICIES.checked(name, config)(config)


def load_policy_config(name: str, path: str | Path, tenancy: object | None = None) -> object:
    """The named policy's config from a YAML (or JSON) mapping of its fields, types checked and unknown
    keys refused (nested sections, e.g. ``tenancy: {classes: [...], tenants: [...]}``, as lists of tables).
    ``tenancy`` (the scenario's) is the one a class-aware policy keeps when the file gives no ``tenancy:``
    of its own, so a file setting other keys does not silently drop the scenario's classes and tenants."""
    cls = policy_class(name)
    data = read_settings("policy", path, cls.config_type)
    config = build(cls.config_type, data)
    if tenancy is not None and "tenancy" not in data and "tenancy" in {f.name for f in fields(cls.config_type)}:
        config = replace(config, tenancy=tenancy)
    return config


def read_settings(kind: str, path: str | Path, config_type: type) -> dict:
    """The YAML (or JSON) mapping of a ``kind`` (policy, router, autoscaler) configuration file, with
    a clear error for a missing file, invalid YAML or anything but a mapping."""
    data = read_document(path, f"{kind} configuration") or {}
    if not isinstance(data, dict):
        raise ReplayError(f"{kind} configuration {path} must be a mapping of {config_type.__name__} settings")
    return data
