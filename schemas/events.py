"""Lifecycle event records: one envelope, one flat frozen dataclass per event type.

Measurement boundaries follow ``docs/design.md`` (Measurement boundaries): one clock per engine, UTC epoch
nanoseconds. ``ts_ns`` is the moment the event happened at the engine:

========================  ==========================================================================
event type                ``ts_ns`` means
========================  ==========================================================================
``request_arrived``       the serving frontend received the complete request (before tokenization);
                          ``client_sent_ns``: when the client sent it
``admission_decided``     the admission controller decided (accept/queue/route/downgrade/degrade/reject)
``step_executed``         the engine step ended (``end_ns``); ``start_ns`` is when it started
``request_preempted``     the request was preempted (recompute, swap or migrate)
``first_token``           the first output token was produced (``first_byte_ns``: delivered)
``tokens_delivered``      further output tokens were produced
``request_cancelled``     the client cancelled
``request_finished``      the request left the engine, with its outcome (``last_byte_ns``: its last
                          token reached the client; ``num_cached_prefix_tokens``: its prefix-cache hit)
``instance_state``        an instance reported its state (capacity, residency, scaling)
========================  ==========================================================================

A request is *scheduled* at its first batch membership: the ``start_ns`` of the first
``step_executed`` whose ``request_ids`` contain it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from schemas.types import MAX_COUNT, doc

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 2
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
#: A readable ``schema_version``: this major, a dot, a minor of ASCII digits (any minor: a newer one is read, its
#: unknown fields ignored). One pattern for the JSON Schema, the columnar check (RE2) and the row validator (``re``,
#: whole string), so the three agree; "01.2" or "1.²" (str.isdigit's digits) is none.
SCHEMA_VERSION_PATTERN = rf"^{SCHEMA_MAJOR}\.[0-9]+$"

Decision = Literal["accept", "queue", "route", "downgrade", "degrade", "reject"]
PreemptionMode = Literal["recompute", "swap", "migrate"]
Outcome = Literal["completed", "cancelled", "rejected", "timed_out", "error"]
InstanceLifecycle = Literal["starting", "ready", "draining", "stopped"]
ScaleAction = Literal["scale_up", "scale_down"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """The envelope every event carries. Concrete events subclass it and set ``event_type``."""

    EVENT_TYPE: ClassVar[str] = ""
    #: Event types whose ``request_id`` may be null (engine-level events).
    REQUEST_SCOPED: ClassVar[bool] = True

    event_id: str = doc("Unique id of this event; consumers de-duplicate on it (producer retries).", identifier=True)
    schema_version: str = doc(
        "MAJOR.MINOR of the contract the producer wrote; see docs/schema.md.",
        SCHEMA_VERSION,
        wire_required=True,
    )
    event_type: str = doc(
        "Discriminator naming the event type.", "", wire_required=True, init=False
    )
    ts_ns: int = doc("When the event happened at the engine, UTC epoch nanoseconds.")
    engine_id: str = doc("The engine (process or replay run) that emitted the event.", identifier=True)
    instance_id: str | None = doc("Serving instance the event concerns, when known.", None, identifier=True)
    request_id: str | None = doc("Request the event concerns; null only for engine-level events.", None, identifier=True)
    tenant: str | None = doc("Tenant identifier (pseudonymized by privacy/ before storage).", None)
    service_class: str | None = doc(
        "Service class assigned from authenticated tenant configuration, never a client field.", None
    )
    model: str | None = doc("Base model serving the request.", None)
    adapter: str | None = doc("LoRA or other adapter, when one is used.", None)
    pool: str | None = doc("Deployment pool label, e.g. 'baseline' or 'canary'.", None)
    pseudonym_key_id: str | None = doc(
        "Id of the key that pseudonymized this record; set by privacy/ (null before sanitization).", None
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "event_type", self.EVENT_TYPE)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived(Event):
    """The serving frontend received the complete request."""

    EVENT_TYPE: ClassVar[str] = "request_arrived"

    request_id: str = doc("Request the event concerns.", identifier=True)
    num_prompt_tokens: int = doc("Prompt length in tokens.", maximum=MAX_COUNT)
    num_cached_prefix_tokens: int | None = doc(
        "Prompt tokens already in the prefix cache at arrival, when the engine knows (an estimate: the cache "
        "changes while the request waits; request_finished carries the hit the engine got).", None, maximum=MAX_COUNT
    )
    max_output_tokens: int | None = doc("The request's max_tokens limit, if any.", None, maximum=MAX_COUNT)
    num_branches: int = doc("Parallel samples requested (n); branches share the prompt's KV.", 1, maximum=MAX_COUNT)
    ttft_deadline_ns: int | None = doc("Deadline hint for the first token, UTC epoch ns.", None)
    e2e_deadline_ns: int | None = doc("Deadline hint for the last token, UTC epoch ns.", None)
    session_id: str | None = doc("Conversation or session the request belongs to.", None)
    user: str | None = doc("End-user identifier (pseudonymized by privacy/).", None)
    api_key_id: str | None = doc("API key identifier (pseudonymized by privacy/).", None)
    user_agent: str | None = doc("Client user agent (free text, scrubbed by privacy/).", None)
    prefix_block_ids: list[int] | None = doc(
        "Hash ids of the prompt's prefix-cache blocks in order; equal ids at equal positions "
        "mean a shared prefix.",
        None,
    )
    client_sent_ns: int | None = doc(
        "When the client sent the request, where known (client-side latencies start here; since 1.1).", None
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionDecided(Event):
    """The admission controller decided what to do with the request."""

    EVENT_TYPE: ClassVar[str] = "admission_decided"

    request_id: str = doc("Request the event concerns.", identifier=True)
    decision: Decision = doc("accept, queue, route, downgrade, degrade or reject.")
    reason: str | None = doc("Why, in a few words (free text, scrubbed by privacy/).", None)
    retry_after_s: float | None = doc("Retry-after signal sent with a rejection, seconds.", None)
    predicted_output_tokens_low: int | None = doc(
        "Lower end of the predicted output length interval that drove the decision.", None, maximum=MAX_COUNT
    )
    predicted_output_tokens_high: int | None = doc(
        "Upper end of the predicted output length interval that drove the decision.", None, maximum=MAX_COUNT
    )
    target: str | None = doc(
        "Where the request goes: the instance for 'route', the model for 'downgrade'.", None
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepExecuted(Event):
    """One engine iteration (a batch) ran, or ``num_steps`` identical ones; ``ts_ns`` equals ``end_ns``."""

    EVENT_TYPE: ClassVar[str] = "step_executed"
    REQUEST_SCOPED: ClassVar[bool] = False

    step_index: int = doc("Monotonic step counter of the instance.")
    start_ns: int = doc("Step start, UTC epoch ns.")
    end_ns: int = doc("Step end, UTC epoch ns.")
    num_prefill_tokens: int = doc("Prompt tokens processed in the step (all prefill chunks).", maximum=MAX_COUNT)
    num_decode_seqs: int = doc("Sequences that decoded one token in the step.", maximum=MAX_COUNT)
    request_ids: list[str] = doc("Requests that were members of the batch, each once.", unique_items=True)
    request_num_tokens: list[int] = doc(
        "Tokens each member processed in the step, parallel to request_ids.", maximum=MAX_COUNT
    )
    num_kv_blocks_used: int = doc("KV cache blocks in use after the step.", maximum=MAX_COUNT)
    num_kv_blocks_free: int = doc("KV cache blocks free after the step.", maximum=MAX_COUNT)
    num_steps: int = doc(
        "Consecutive steps of this same composition that the event summarizes (a fast replay "
        "coalesces runs of decode steps); start_ns/end_ns span them all, counts are per step.",
        1, maximum=MAX_COUNT
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPreempted(Event):
    """The request lost its place in the running batch."""

    EVENT_TYPE: ClassVar[str] = "request_preempted"

    request_id: str = doc("Request the event concerns.", identifier=True)
    mode: PreemptionMode = doc("recompute (KV dropped), swap (KV to host) or migrate (KV moved).")
    lease_generation: int = doc("The request's lease generation after preemption.")
    num_lost_tokens: int = doc("Computed tokens that must be recomputed (0 for swap/migrate).", 0, maximum=MAX_COUNT)


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstToken(Event):
    """The first output token was produced (``ts_ns``)."""

    EVENT_TYPE: ClassVar[str] = "first_token"

    request_id: str = doc("Request the event concerns.", identifier=True)
    first_byte_ns: int | None = doc("When its first byte reached the client, if known.", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokensDelivered(Event):
    """Output tokens after the first were produced (``ts_ns``)."""

    EVENT_TYPE: ClassVar[str] = "tokens_delivered"

    request_id: str = doc("Request the event concerns.", identifier=True)
    num_tokens: int = doc("Output tokens in this delivery (>= 1).", maximum=MAX_COUNT)
    coalesced: bool = doc(
        "True when the tokens came as one stream chunk, so per-token gaps are not observable "
        "and ITL is a chunk gap.",
        False,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestCancelled(Event):
    """The client cancelled the request (``ts_ns``)."""

    EVENT_TYPE: ClassVar[str] = "request_cancelled"

    request_id: str = doc("Request the event concerns.", identifier=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    """The request left the engine."""

    EVENT_TYPE: ClassVar[str] = "request_finished"

    request_id: str = doc("Request the event concerns.", identifier=True)
    outcome: Outcome = doc("completed, cancelled, rejected, timed_out or error.")
    num_output_tokens: int = doc("Output tokens delivered to the client in total.", maximum=MAX_COUNT)
    error_message: str | None = doc("Error text for outcome 'error' (scrubbed by privacy/).", None)
    last_byte_ns: int | None = doc(
        "When the last output token reached the client, where known (client-side E2E ends here; since 1.1).", None
    )
    num_cached_prefix_tokens: int | None = doc(
        "Prompt tokens the engine found in its prefix cache when it first scheduled the request (vLLM's "
        "num_cached_tokens; 0 when it never ran), where known (since 1.2).", None, maximum=MAX_COUNT
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceState(Event):
    """An instance reported its capacity, residency or a scaling transition."""

    EVENT_TYPE: ClassVar[str] = "instance_state"
    REQUEST_SCOPED: ClassVar[bool] = False

    instance_id: str = doc("Serving instance the event concerns.", identifier=True)
    state: InstanceLifecycle = doc("starting, ready, draining or stopped.")
    num_kv_blocks_total: int = doc("KV cache capacity in blocks.", maximum=MAX_COUNT)
    kv_block_size_tokens: int = doc("Tokens per KV block.", maximum=MAX_COUNT)
    resident_models: list[str] = doc("Base models resident in memory.")
    resident_adapters: list[str] = doc("Adapters resident in memory.")
    scale_action: ScaleAction | None = doc("Set when the state change is a scaling action.", None)


EVENT_CLASSES: tuple[type[Event], ...] = (
    RequestArrived,
    AdmissionDecided,
    StepExecuted,
    RequestPreempted,
    FirstToken,
    TokensDelivered,
    RequestCancelled,
    RequestFinished,
    InstanceState,
)
#: event_type -> record class, in lifecycle order (the order breaks timestamp ties).
EVENT_TYPES: dict[str, type[Event]] = {cls.EVENT_TYPE: cls for cls in EVENT_CLASSES}

#: Lifecycle rank of each event type, used to order events that share a timestamp.
LIFECYCLE_RANK: dict[str, int] = {name: rank for rank, name in enumerate(EVENT_TYPES)}


def event_as_dict(event: Event) -> dict[str, Any]:
    """The event's fields as a flat dict, in declaration order (the JSON wire form)."""
    return {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
