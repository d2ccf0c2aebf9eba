"""One flush of the replay's events as columns: what the event writer gathers on the replay's thread and the
output builders turn into tables, here or in a process of their own (``replay.outputs``).

The records hold numpy and Arrow arrays (and a few plain tuples), never the engine's objects, so a flush
pickles cheaply. Requests are named by their index (arrival order); their ids and labels travel once, when
the workload feeds them in (``NewRequests``), and the builders look them up by index
(``replay.event_tables``). Lockstep runs travel compact: one row per run and per snapshot of the lockstep
set (``Members``), expanded to one delivery per member by the builders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

#: The label columns of request-scoped events, in the envelope's order.
LABELS = ("tenant", "service_class", "model", "adapter")


@dataclass(frozen=True, slots=True)
class Members:
    """The member log: one row per member of each lockstep snapshot taken during the flush."""

    idx: np.ndarray  # request index
    offsets: np.ndarray  # output position of the member at lockstep clock t: offset + t
    tokens: np.ndarray  # tokens it decodes per step: its branches


@dataclass(frozen=True, slots=True)
class NewRequests:
    """The requests the workload fed in during the flush: their ids and labels, which later events name by index
    (a request's first event may come in a later flush: an arrival waiting for its model's weights)."""

    idx: np.ndarray
    request_id: pa.Array
    labels: dict[str, pa.Array]  # LABELS


@dataclass(frozen=True, slots=True)
class Arrivals:
    """``request_arrived`` events."""

    idx: np.ndarray
    ts: np.ndarray
    instance: pa.Array
    cached: pa.Array  # prefix tokens found cached at arrival (null: not looked up)
    prompt: np.ndarray
    max_output: pa.Array
    branches: np.ndarray
    ttft_deadline: pa.Array
    e2e_deadline: pa.Array
    session: pa.Array
    block_ids: pa.Array
    sent: pa.Array | None  # when the client sent it (None: no client modelled)


@dataclass(frozen=True, slots=True)
class Admissions:
    """``admission_decided`` events."""

    idx: np.ndarray
    ts: np.ndarray
    instance: pa.Array
    number: np.ndarray
    decision: pa.Array
    reason: pa.Array
    retry_after: pa.Array
    low: pa.Array
    high: pa.Array
    target: pa.Array | None  # a cluster's route decisions name their instance (None: not a cluster)


@dataclass(frozen=True, slots=True)
class Steps:
    """``step_executed`` events: members are their snapshot's rows of the member log, then those scheduled one
    by one (``own_*``, by id: a request cancelled in its first step is listed after its finish)."""

    instance: pa.Array
    step_index: np.ndarray
    start: np.ndarray
    end: np.ndarray
    num_steps: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    snap_starts: np.ndarray
    snap_lengths: np.ndarray
    own_ids: pa.Array
    own_lengths: np.ndarray
    own_tokens: np.ndarray
    used: np.ndarray
    free: np.ndarray


@dataclass(frozen=True, slots=True)
class Preemptions:
    """``request_preempted`` events."""

    idx: np.ndarray
    ts: np.ndarray
    instance: pa.Array
    mode: pa.Array
    number: np.ndarray
    lost: np.ndarray


@dataclass(frozen=True, slots=True)
class Tokens:
    """``first_token`` events, or ``tokens_delivered`` events outside lockstep runs."""

    idx: np.ndarray
    ts: np.ndarray
    instance: pa.Array
    num: np.ndarray  # tokens delivered (first token: 1)
    upto: np.ndarray  # tokens delivered in total after it (its event id's number; first token: 0)
    coalesced: np.ndarray


@dataclass(frozen=True, slots=True)
class Runs:
    """Lockstep runs: one ``tokens_delivered`` per member of the run's snapshot."""

    snap_starts: np.ndarray
    snap_lengths: np.ndarray
    ts: np.ndarray  # the run's last step end
    num_steps: np.ndarray
    clock: np.ndarray  # the lockstep clock after it
    coalesced: np.ndarray
    instance: tuple[str | None, ...]  # per run


@dataclass(frozen=True, slots=True)
class Ends:
    """``request_cancelled`` (no ``outcome``) or ``request_finished`` events."""

    idx: np.ndarray
    ts: np.ndarray
    instance: pa.Array
    outcome: pa.Array | None = None
    num_output: np.ndarray | None = None
    error: pa.Array | None = None
    hits: pa.Array | None = None  # prefix tokens found cached when first scheduled (null: not looked up)


@dataclass(frozen=True, slots=True)
class Done:
    """The requests whose request-table rows are complete (sorted by index): finished, and in no step in flight
    that would be their first (``replay.request_table``)."""

    idx: np.ndarray
    scheduled_ns: np.ndarray  # the start of their first step event (request_table._MISSING: none)
    labels: dict[str, np.ndarray] | None


@dataclass(frozen=True, slots=True)
class Gathered:
    """One flush: each event type's columns (None: none of that type), in the order their rows are written."""

    members: Members
    new: NewRequests | None
    arrived: Arrivals | None
    admission: Admissions | None
    steps: Steps | None
    preempted: Preemptions | None
    first: Tokens | None
    tokens: Tokens | None
    runs: Runs | None
    cancelled: Ends | None
    finished: Ends | None
    states: list[tuple[Any, ...]]  # ``replay.emit.StateRow``s (plain values)
    done: Done | None  # for the run's request table (None: not written)
    labelled: bool  # some request carries a label: request events carry the label columns
    out_delay_ns: int | None  # a token reaches the client this long after its step (None: no client modelled)

    @property
    def num_rows(self) -> int:
        """The events this flush holds (a run counts as its members)."""
        parts = (self.arrived, self.admission, self.steps, self.preempted, self.first, self.tokens, self.cancelled,
                 self.finished)
        return (sum(len(p.ts if not isinstance(p, Steps) else p.end) for p in parts if p is not None)
                + (int(self.runs.snap_lengths.sum()) if self.runs is not None else 0) + len(self.states))
