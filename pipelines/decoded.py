"""What decoding a batch of raw messages gives: the valid events and the rejected messages.

Shared by the decoders of every message format (``pipelines.decode`` for servelens JSON events,
``pipelines.otlp`` for OpenTelemetry spans), so neither imports the other's records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from schemas.validate import FieldError


@dataclass(frozen=True, slots=True)
class Rejected:
    """One message that is not a valid event: where it came from and why (never its content)."""

    index: int  # position in the decoded batch
    size_bytes: int
    errors: tuple[FieldError, ...]
    event_type: str | None = None  # the event type it names, when a known one


@dataclass
class DecodedBatch:
    """The valid events of a batch (``EVENTS_SCHEMA``, in message order) and the rejected messages."""

    events: pa.Table
    indices: np.ndarray  # message index of each event row
    rejected: list[Rejected]
    dropped_fields: Counter[str] = field(default_factory=Counter)
    num_slow: int = 0  # messages that took the slow path
