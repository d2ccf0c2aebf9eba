"""Table records derived from or fed to the event stream: workload requests and request-table rows.

Like events, each is a flat frozen dataclass mirrored 1:1 by a generated Arrow schema. Tables are
built columnar (pyarrow, DuckDB); the dataclasses define the columns, document them, and give tests
and small tools a typed row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from schemas.types import doc


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadRequest:
    """One request of a workload: what arrived and how much work it asked for.

    Trace converters fill what their trace records and leave the rest null; whatever a trace lacks
    (tenants, classes, cancellations, models) is added only by an explicit, seeded scenario.
    """

    TABLE: ClassVar[str] = "workload"

    request_id: str = doc("Stable id within the workload (trace name and row number for traces).")
    arrival_ns: int = doc(
        "Arrival time, ns: UTC epoch for wall-clock traces, offset from the trace start otherwise."
    )
    num_prompt_tokens: int = doc("Prompt length in tokens, as recorded.")
    num_output_tokens: int = doc("Output length in tokens, as recorded.")
    prefix_block_ids: list[int] | None = doc(
        "Prefix-cache block hash ids in prompt order, where the trace records them.", None
    )
    prefix_block_size_tokens: int | None = doc("Tokens per prefix block (Mooncake: 512).", None)
    session_id: str | None = doc("Conversation or session id, where recorded.", None)
    tenant: str | None = doc("Tenant pseudonym (added by a scenario for public traces).", None)
    service_class: str | None = doc("Service class (added by a scenario for public traces).", None)
    model: str | None = doc("Model, where recorded (BurstGPT) or assigned by a scenario.", None)
    adapter: str | None = doc("Adapter, when a scenario assigns one.", None)
    num_branches: int = doc("Parallel samples requested (n).", 1)
    cancel_after_ns: int | None = doc(
        "The client cancels this long after arrival, ns (from telemetry or a scenario).", None
    )
    failed: bool = doc("The trace marks the request as failed (e.g. BurstGPT rows with 0 tokens).", False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRow:
    """One row per request, derived from its events (``replay.derive.derive_requests``).

    Timestamps are UTC epoch ns as in the events; durations are seconds and follow
    ``docs/metrics.md``. A request that lacks an event has the matching columns null: a request
    rejected before scheduling has no ``scheduled_ns``, one cancelled before its first token no
    ``first_token_ns``. Those are outcomes, not missing data.
    """

    TABLE: ClassVar[str] = "requests"

    request_id: str = doc("Request id.")
    engine_id: str = doc("Engine that emitted the request's first event.")
    instance_id: str | None = doc("Instance of the request's last event that names one.", None)
    tenant: str | None = doc("Tenant (a pseudonym once sanitized).", None)
    service_class: str | None = doc("Service class.", None)
    model: str | None = doc("Model.", None)
    adapter: str | None = doc("Adapter.", None)
    pool: str | None = doc("Deployment pool label.", None)
    session_id: str | None = doc("Session id.", None)
    arrival_ns: int | None = doc("request_arrived ts_ns.", None)
    admission_ns: int | None = doc("First admission_decided ts_ns.", None)
    scheduled_ns: int | None = doc("Start of the first step whose batch held the request.", None)
    first_token_ns: int | None = doc("first_token ts_ns.", None)
    first_byte_ns: int | None = doc("first_token first_byte_ns, where known.", None)
    last_token_ns: int | None = doc("Latest token delivery (first_token or tokens_delivered).", None)
    cancel_ns: int | None = doc("request_cancelled ts_ns.", None)
    finish_ns: int | None = doc("request_finished ts_ns.", None)
    outcome: str | None = doc("request_finished outcome; null while the request is in flight.", None)
    admission_decision: str | None = doc("The last admission decision.", None)
    num_admission_decisions: int = doc("How many admission decisions the request received.", 0)
    num_prompt_tokens: int | None = doc("Prompt tokens.", None)
    num_cached_prefix_tokens: int | None = doc(
        "Prompt tokens found in the prefix cache: request_finished's (the hit the engine got when it first scheduled "
        "the request), else request_arrived's estimate at arrival.", None
    )
    max_output_tokens: int | None = doc("The request's max_tokens limit.", None)
    num_branches: int | None = doc("Parallel samples requested.", None)
    num_output_tokens: int | None = doc(
        "request_finished num_output_tokens, else the tokens counted in deliveries.", None
    )
    num_preemptions: int = doc("request_preempted events that are preemptions (mode recompute or swap).", 0)
    num_migrations: int = doc(
        "request_preempted events with mode migrate: moves to another instance with the KV (a disaggregated "
        "hand-off, a migration), not preemptions.", 0
    )
    num_lost_tokens: int = doc("Tokens lost to preemption (to recompute).", 0)
    queue_s: float | None = doc("scheduled - arrival.", None)
    ttft_s: float | None = doc("first_token - arrival (user-facing, not vLLM's scheduled-based).", None)
    tpot_s: float | None = doc("(last_token - first_token) / (num_output_tokens - 1).", None)
    e2e_s: float | None = doc("last_token - arrival.", None)
    client_sent_ns: int | None = doc("request_arrived client_sent_ns: when the client sent it, where known.", None)
    last_byte_ns: int | None = doc("request_finished last_byte_ns: when the client received the last token.", None)
    ttft_client_s: float | None = doc(
        "first_byte - client_sent: TTFT as the client measured it (inference-perf, GuideLLM), where known.", None
    )
    e2e_client_s: float | None = doc("last_byte - client_sent: E2E as the client measured it, where known.", None)
    num_itl_gaps: int = doc("Per-token gaps after the first token (a chunk of k tokens counts k).", 0)
    itl_mean_s: float | None = doc("Mean per-token gap.", None)
    itl_p50_s: float | None = doc("Median per-token gap (weighted nearest rank).", None)
    itl_p99_s: float | None = doc("99th percentile per-token gap (weighted nearest rank).", None)
    itl_max_s: float | None = doc("Largest per-token gap.", None)
    itl_from_chunks: bool = doc("Some deliveries were coalesced chunks: ITL gaps are chunk gaps.", False)
    num_events: int = doc("Distinct request-scoped events (de-duplicated by event_id; steps not counted).", 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A message the ingest consumer could not accept, and why; never its content.

    Every text here comes from servelens's own vocabulary (reasons, field paths of the contract,
    type names) or is a keyed pseudonym, so a dead letter holds no tenant data.
    """

    TABLE: ClassVar[str] = "dead_letters"

    topic: str = doc("Kafka topic the message came from.")
    partition: int = doc("Kafka partition.")
    offset: int = doc("Kafka offset (within the partition's epoch).")
    epoch: int = doc("Partition epoch: it advances when the broker's log was reset (offsets restart).", 0)
    key: str | None = doc("The message key (request id) as a keyed pseudonym.", None)
    size_bytes: int = doc("Message size.")
    reason: str = doc("Reason of the first error (schemas.validate reasons, oversized, clock_skew).")
    path: str = doc("Field path of the first error ($ for the whole message).")
    value_type: str | None = doc("JSON type of the offending value.", None)
    expected: str | None = doc("What the contract expects there.", None)
    num_errors: int = doc("How many errors the message had.", 1)
    event_type: str | None = doc("The event type, when it is a known one.", None)
    received_ns: int = doc("When the ingest consumer read the message, UTC epoch ns.")
