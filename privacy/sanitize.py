"""The sanitizer: every field of every event gets an explicit policy before anything is stored.

``Sanitizer.sanitize(table)`` takes validated events (``EVENTS_SCHEMA`` columns) and returns the same
schema with:

- **pseudonyms** for identifiers (event, request, tenant, user, API key, session, adapter ids): keyed
  HMAC-SHA256 (``privacy.keys``), so joins and de-duplication still work and nothing is reversible;
- **bounded dimensions** (tenant, model, adapter, engine, instance, class, pool, reason, user agent,
  routing target): the heaviest values keep their identity, the rest fold into ``other``
  (``privacy.sketch``). Clear-text labels are allowlisted first (``privacy.labels``: a value
  without the shape of a system name folds into ``other``, user agents keep their product tokens
  only), then scrubbed by the pattern recognizers (anything found: the value folds) and made inert
  (``privacy.scrub``); reasons are free text: scrubbed with the NER model, then made inert;
- **free text** (error messages): scrubbed for PII and secrets, with a per-batch budget;
- **prefix block ids** replaced by keyed ids that keep equality (prefix sharing) but not the
  prompt-derived hash;
- **enums** (event type, decision, outcome, ...) and numbers unchanged: the validator already
  restricted them to known values;
- the active key's id in ``pseudonym_key_id``.

Columns outside the schema are dropped and counted (the allowlist); prompt or completion text an
engine might send is never in the schema, so it is never stored. The report names a dropped field
only when it is a contract field name (of another event type); any other name is counted under
``(unknown field)``, since a name is attacker-controlled text too. Work is columnar: each batch maps
its distinct values once (``dictionary_encode``), not each event.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.labels import label_shape_ok, reduce_user_agent
from privacy.scrub import REDACTED, Scrubber, clean_text, inert_label
from privacy.sketch import OTHER, BoundedDimension
from schemas.arrow import EVENTS_SCHEMA
from schemas.events import EVENT_TYPES
from schemas.types import field_specs


@dataclass(frozen=True, slots=True)
class Pseudonym:
    """Replace by a keyed pseudonym ``<kind>_<hex>``; optionally bounded as a dimension."""

    kind: str
    dimension: str | None = None
    hex_chars: int = 20


@dataclass(frozen=True, slots=True)
class Dimension:
    """Keep in clear if heavy enough (allowlisted, scrubbed and inert), else fold into ``other``.

    ``rule``: ``label`` (the shape of a system name, ``privacy.labels``), ``user_agent`` (product
    tokens only) or ``text`` (free text: scrubbed with the NER model, partly redacted)."""

    dimension: str
    rule: str = "label"


@dataclass(frozen=True, slots=True)
class FreeText:
    """Scrub PII and secrets; keep the rest."""


@dataclass(frozen=True, slots=True)
class Unchanged:
    """Enums the validator checked, and numbers: nothing to hide."""


@dataclass(frozen=True, slots=True)
class KeyedInts:
    """Integer ids derived from content (prefix-block hashes): keyed remap that keeps equality."""

    kind: str


@dataclass(frozen=True, slots=True)
class KeyId:
    """Set to the active pseudonym key's id."""


Policy = Pseudonym | Dimension | FreeText | Unchanged | KeyedInts | KeyId
#: Maps a column's distinct values (and how often each occurs) to their stored values, in order.
ColumnMapper = Callable[[list[Any], np.ndarray], list[Any]]

#: The policy of every text-bearing field of the lake schema; numbers and booleans are unchanged.
#: A string field without an entry here fails at import (see ``_POLICIES`` below).
FIELD_POLICIES: dict[str, Policy] = {
    "event_id": Pseudonym("ev", hex_chars=32),
    "schema_version": Unchanged(),
    "event_type": Unchanged(),
    "ts_ns": Unchanged(),
    "engine_id": Dimension("engine"),
    "instance_id": Dimension("instance"),
    "request_id": Pseudonym("rq"),
    "tenant": Pseudonym("tn", dimension="tenant"),
    "service_class": Dimension("service_class"),
    "model": Dimension("model"),
    "adapter": Pseudonym("ad", dimension="adapter"),
    "pool": Dimension("pool"),
    "pseudonym_key_id": KeyId(),
    "session_id": Pseudonym("se"),
    "user": Pseudonym("us"),
    "api_key_id": Pseudonym("ak"),
    "user_agent": Dimension("user_agent", rule="user_agent"),
    "prefix_block_ids": KeyedInts("blk"),
    "decision": Unchanged(),
    "reason": Dimension("reason", rule="text"),
    "target": Dimension("target"),
    "request_ids": Pseudonym("rq"),
    "mode": Unchanged(),
    "outcome": Unchanged(),
    "error_message": FreeText(),
    "state": Unchanged(),
    "resident_models": Dimension("model"),
    "resident_adapters": Pseudonym("ad", dimension="adapter"),
    "scale_action": Unchanged(),
}

def _policy(f: pa.Field) -> Policy:
    if f.name in FIELD_POLICIES:
        return FIELD_POLICIES[f.name]
    base = f.type.value_type if pa.types.is_list(f.type) else f.type
    if pa.types.is_string(base):
        raise TypeError(f"lake field {f.name!r} carries text but has no privacy policy in FIELD_POLICIES")
    return Unchanged()


#: Every lake field's policy, resolved once.
_POLICIES: dict[str, Policy] = {f.name: _policy(f) for f in EVENTS_SCHEMA}

#: The names a report may print: the contract's own field names. Any other name a producer sent is
#: attacker-controlled text (a secret can be sent as a field name), counted under this label.
CONTRACT_NAMES = frozenset(EVENTS_SCHEMA.names)
UNKNOWN_FIELD = "(unknown field)"
_REFUSED = "\x00refused"  # a label cache entry: the scrubber found something (no inert label has a NUL)


def printable_field_name(name: str) -> str:
    """``name`` if it is a contract field name, else ``(unknown field)`` (reports never echo input)."""
    return name if name in CONTRACT_NAMES else UNKNOWN_FIELD


def dimension_budgets(config: PrivacyConfig) -> dict[str, int]:
    return {
        "tenant": config.tenant_budget,
        "model": config.model_budget,
        "adapter": config.adapter_budget,
        "engine": config.instance_budget,
        "instance": config.instance_budget,
        "target": config.instance_budget,
        "service_class": config.label_budget,
        "pool": config.label_budget,
        "reason": config.label_budget,
        "user_agent": config.label_budget,
    }


def bounded_columns(config: PrivacyConfig) -> dict[str, int]:
    """Each scalar lake column whose values form a bounded dimension, with its budget."""
    budgets = dimension_budgets(config)
    return {name: budgets[policy.dimension] for name, policy in FIELD_POLICIES.items()
            if isinstance(policy, (Pseudonym, Dimension)) and policy.dimension and not pa.types.is_list(EVENTS_SCHEMA.field(name).type)}


@dataclass(frozen=True, slots=True)
class PrivacyReport:
    """What sanitization removed or coarsened in a run (counts only, never values)."""

    num_events: int = 0
    fields_dropped: Mapping[str, int] = field(default_factory=dict)
    redactions: Mapping[str, int] = field(default_factory=dict)
    folded_into_other: Mapping[str, int] = field(default_factory=dict)
    texts_over_budget: int = 0
    cells_suppressed: int = 0
    labels_refused: Mapping[str, int] = field(default_factory=dict)  # per dimension: not a label's shape, or PII found

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_events": self.num_events,
            "fields_dropped": dict(self.fields_dropped),
            "redactions": dict(self.redactions),
            "folded_into_other": dict(self.folded_into_other),
            "labels_refused": dict(self.labels_refused),
            "texts_over_budget": self.texts_over_budget,
            "cells_suppressed": self.cells_suppressed,
        }


class _BoundedCache(OrderedDict[Any, Any]):
    """A small LRU map (pseudonyms of recently seen ids, shown labels)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: str, make: Callable[[str], str]) -> str:
        value = self.get(key)
        if value is None:
            value = self[key] = make(key)
            self.trim()
        return value

    def trim(self) -> None:
        while len(self) > self.size:
            self.popitem(last=False)


def _as_array(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _map_distinct(values: pa.Array, mapper: ColumnMapper) -> pa.Array:
    """Apply ``mapper(distinct values, their counts) -> new values`` and spread the result back."""
    encoded = pc.dictionary_encode(values)
    uniques = encoded.dictionary.to_pylist()
    indices = encoded.indices
    counts = np.bincount(indices.drop_null().to_numpy(zero_copy_only=False), minlength=len(uniques))
    new_dictionary = pa.array(mapper(uniques, counts), type=values.type)
    return pc.take(new_dictionary, indices)


def _map_column(column: pa.ChunkedArray | pa.Array, mapper: ColumnMapper) -> pa.Array:
    """``_map_distinct`` over a scalar column or over the items of a list column."""
    array = _as_array(column)
    if not pa.types.is_list(array.type):
        return _map_distinct(array, mapper)
    items = pc.list_flatten(array)
    new_items = _map_distinct(items, mapper) if len(items) else items
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, new_items, type=array.type, mask=pc.is_null(array))


_ENUMS = {s.name: s.enum for cls in EVENT_TYPES.values() for s in field_specs(cls) if s.enum}


def _check_validated(f: pa.Field, column: pa.ChunkedArray | pa.Array) -> None:
    """Unchanged strings must be what the validator admits; anything else is a caller's bug."""
    if f.name == "schema_version":
        ok = pc.all(pc.match_substring_regex(column, r"^[0-9]+\.[0-9]+$")).as_py()
    elif f.name == "event_type":
        ok = pc.all(pc.is_in(column, pa.array(list(EVENT_TYPES)))).as_py()
    elif f.name in _ENUMS:
        ok = pc.all(pc.is_in(pc.drop_null(column), pa.array(list(_ENUMS[f.name])))).as_py()
    else:
        return
    if ok is False:
        raise ValueError(f"column {f.name} holds values the validator would reject: validate before sanitizing")


class Sanitizer:
    """Sanitizes event tables batch by batch; keeps bounded state (sketches, caches) between batches."""

    def __init__(self, keyring: KeyRing, config: PrivacyConfig | None = None) -> None:
        self.keyring = keyring
        self.config = config or PrivacyConfig()
        budgets = dimension_budgets(self.config)
        self.dimensions = {
            name: BoundedDimension(name, budget, sketch_factor=self.config.sketch_factor, margin=self.config.hysteresis_margin)
            for name, budget in budgets.items()
        }
        self.scrubber = Scrubber(score_threshold=self.config.score_threshold, ner_model=self.config.ner_model)
        self.label_scrubber = self.scrubber.for_labels()
        self._pseudonyms: dict[str, _BoundedCache] = {}
        self._labels = _BoundedCache(20_000)
        self._refused: Counter[str] = Counter()
        self._num_events = 0
        self._dropped: Counter[str] = Counter()

    # -- policies -------------------------------------------------------------------------------

    def _pseudonymize(self, policy: Pseudonym) -> ColumnMapper:
        ring, kind, width = self.keyring, policy.kind, policy.hex_chars
        cache = None if kind == "ev" else self._pseudonyms.setdefault(kind, _BoundedCache(200_000))
        dimension = self.dimensions.get(policy.dimension) if policy.dimension else None

        def mapper(uniques: list[Any], counts: np.ndarray) -> list[Any]:
            if cache is None:  # event ids are unique: caching them would only churn
                out = ring.pseudonyms(kind, uniques, hex_chars=width)
            else:
                missing = [v for v in uniques if v is not None and v not in cache]
                cache.update(zip(missing, ring.pseudonyms(kind, missing, hex_chars=width)))
                out = [None if v is None else cache[v] for v in uniques]
                cache.trim()
            return out if dimension is None else self._fold(dimension, out, counts)

        return mapper

    def _fold(self, dimension: BoundedDimension, values: list[Any], counts: np.ndarray) -> list[Any]:
        weights: dict[str, int] = {}
        for value, count in zip(values, counts):
            if value is not None and count:
                weights[value] = weights.get(value, 0) + int(count)
        dimension.observe(weights)
        mapping = dimension.fold_all(weights, weights)
        return [None if v is None else mapping.get(v, OTHER) for v in values]

    def load(self) -> Sanitizer:
        """Build the scrubbers' analyzer now (seconds), not at the first batch."""
        self.scrubber.load()
        return self

    def _label(self, value: str, budget: list[int], policy: Dimension) -> str:
        """A kept dimension value as shown: scrubbed, then inert (cached unless the budget ran out).
        A label (not free text) in which the scrubber finds anything is refused whole: ``other``."""
        key = f"{policy.rule}\x00{value}"
        shown = self._labels.get(key)
        if shown is None:
            scrubber = self.scrubber if policy.rule == "text" else self.label_scrubber
            before = sum(scrubber.redactions.values())
            scrubbed = scrubber.scrub_within(value, budget)
            if scrubbed is None:
                return inert_label(REDACTED)
            refused = policy.rule != "text" and sum(scrubber.redactions.values()) > before
            shown = self._labels.get_or(key, lambda _: _REFUSED if refused else inert_label(scrubbed, self.config.label_max_chars))
        if shown == _REFUSED:
            self._refused[policy.dimension] += 1
            return OTHER
        return shown

    def _shape(self, policy: Dimension, value: str | None) -> str | None:
        """The value a label may keep (``privacy.labels``), ``other`` when it has not a label's shape."""
        if value is None or policy.rule == "text":
            return value
        kept = reduce_user_agent(value) if policy.rule == "user_agent" else value if label_shape_ok(value) else None
        if kept is None:
            self._refused[policy.dimension] += 1
            return OTHER
        return kept

    def _dimension(self, policy: Dimension, budget: list[int]) -> ColumnMapper:
        dimension = self.dimensions[policy.dimension]
        max_chars = self.config.label_max_chars

        def mapper(uniques: list[Any], counts: np.ndarray) -> list[Any]:
            cut = [None if v is None else self._shape(policy, v[: max_chars * 4]) for v in uniques]
            folded = self._fold(dimension, cut, counts)
            return [None if v is None else OTHER if v == OTHER else self._label(v, budget, policy) for v in folded]

        return mapper

    def _free_text(self, budget: list[int]) -> ColumnMapper:
        max_chars = self.config.text_max_chars
        return lambda uniques, counts: [
            None if v is None else self.scrubber.scrub(clean_text(v, max_chars), budget) for v in uniques
        ]

    def _keyed_ints(self, policy: KeyedInts) -> ColumnMapper:
        ring = self.keyring
        return lambda uniques, counts: [None if v is None else ring.remap_int(policy.kind, v) for v in uniques]

    # -- the batch ------------------------------------------------------------------------------

    def sanitize(self, table: pa.Table, dropped_fields: Mapping[str, int] | None = None) -> pa.Table:
        """Sanitize one batch of validated events; the result has exactly ``EVENTS_SCHEMA``."""
        extra = [name for name in table.column_names if name not in _POLICIES]
        for name in extra:  # the allowlist: unknown columns never pass
            self._count_dropped(name, len(table[name]) - table[name].null_count)
        for name, count in (dropped_fields or {}).items():
            self._count_dropped(name, count)
        budget = [self.config.scrub_budget_per_batch]
        n = table.num_rows
        columns = []
        for f in EVENTS_SCHEMA:
            policy = _POLICIES[f.name]
            if isinstance(policy, KeyId):
                columns.append(pa.array([self.keyring.active_id] * n, f.type))
                continue
            column = table[f.name] if f.name in table.column_names else pa.nulls(n, f.type)
            if isinstance(policy, Unchanged) or n == 0:
                _check_validated(f, column)
                columns.append(_as_array(column).cast(f.type))
                continue
            if isinstance(policy, Pseudonym):
                mapper = self._pseudonymize(policy)
            elif isinstance(policy, Dimension):
                mapper = self._dimension(policy, budget)
            elif isinstance(policy, FreeText):
                mapper = self._free_text(budget)
            else:
                mapper = self._keyed_ints(policy)
            columns.append(_map_column(column, mapper).cast(f.type))
        self._num_events += n
        return pa.Table.from_arrays(columns, schema=EVENTS_SCHEMA)

    def _count_dropped(self, name: str, count: int) -> None:
        if count > 0:
            self._dropped[printable_field_name(name)] += count

    def report(self) -> PrivacyReport:
        """Cumulative counts since this sanitizer was created."""
        return PrivacyReport(
            num_events=self._num_events,
            fields_dropped=dict(self._dropped),
            redactions=dict(self.scrubber.redactions + self.label_scrubber.redactions),
            folded_into_other={name: d.num_folded for name, d in self.dimensions.items() if d.num_folded},
            texts_over_budget=self.scrubber.num_over_budget + self.label_scrubber.num_over_budget,
            labels_refused=dict(self._refused),
        )

    def sketch_sizes(self) -> dict[str, int]:
        """Entries held by each dimension's sketch (fixed by its capacity, whatever the input)."""
        return {name: len(d.sketch) for name, d in self.dimensions.items()}


def sanitize_records(
    sanitizer: Sanitizer, records: Iterable[dict[str, Any]]
) -> tuple[pa.Table, list[int]]:
    """Validate raw wire records, sanitize the valid ones; return (table, numbers of invalid records)."""
    from schemas.arrow import events_to_table
    from schemas.validate import validate_record

    events, invalid, dropped = [], [], Counter[str]()
    for number, record in enumerate(records, start=1):
        result = validate_record(record, number)
        if result.event is None:
            invalid.append(number)
            continue
        events.append(result.event)
        dropped.update(result.ignored_fields)
    return sanitizer.sanitize(events_to_table(events), dropped), invalid
