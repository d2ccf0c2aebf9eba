"""The servelens data contract: per-request lifecycle events and the tables derived from them.

Every engine (vLLM, SGLang, TRT-LLM or servelens's own replay engine) speaks this contract, so one
metrics path serves real and replayed data. The records here are flat, frozen, slotted dataclasses;
the Arrow schema and the JSON Schema are generated from them (``schemas.arrow``,
``schemas.jsonschema``) and a test proves the three views agree field by field. ``schemas.validate``
checks untrusted records and explains every error; ``docs/schema.md`` holds the evolution rules.
"""

from schemas.events import (
    EVENT_TYPES,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    SCHEMA_VERSION,
    AdmissionDecided,
    Event,
    FirstToken,
    InstanceState,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    RequestPreempted,
    StepExecuted,
    TokensDelivered,
)
from schemas.records import RequestRow, WorkloadRequest

__all__ = [
    "EVENT_TYPES",
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "SCHEMA_VERSION",
    "AdmissionDecided",
    "Event",
    "FirstToken",
    "InstanceState",
    "RequestArrived",
    "RequestCancelled",
    "RequestFinished",
    "RequestPreempted",
    "RequestRow",
    "StepExecuted",
    "TokensDelivered",
    "WorkloadRequest",
]
