"""Hypothesis strategies for records, derived from the same field specs as every schema view."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from schemas.events import EVENT_TYPES, Event
from schemas.types import FieldSpec, field_specs

INT64_MAX = 2**63 - 1


#: Ids: a visible character, no control characters (``schemas.types.BAD_IDENTIFIER``)
IDENTIFIERS = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12).filter(
    lambda s: s.strip(" "))


def _scalar(spec: FieldSpec) -> st.SearchStrategy:
    if spec.enum:
        return st.sampled_from(spec.enum)
    if spec.identifier:
        return IDENTIFIERS
    return {
        "string": st.text(max_size=12),
        "int": st.integers(0, spec.upper),  # int64, or a count's maximum (schemas.types.MAX_COUNT)
        "float": st.floats(0, 1e12, allow_nan=False, allow_infinity=False),
        "bool": st.booleans(),
    }[spec.kind]


def value_strategy(spec: FieldSpec) -> st.SearchStrategy:
    base = _scalar(spec)
    if spec.is_list:
        base = st.lists(base, max_size=4)
    return st.one_of(st.none(), base) if spec.nullable else base


def _make_consistent(event: Event) -> Event:
    """Repair the cross-field rules the validator checks beyond types."""
    fix: dict = {}
    etype = event.event_type
    if etype == "step_executed":
        start, end = sorted((event.start_ns, event.end_ns))
        members = list(dict.fromkeys(event.request_ids))  # each request a member once
        n = len(members)
        fix = {
            "start_ns": start,
            "end_ns": end,
            "request_ids": members,
            "request_num_tokens": (event.request_num_tokens + [1] * n)[:n],
            "num_steps": max(1, event.num_steps),
        }
    elif etype == "tokens_delivered":
        fix = {"num_tokens": max(1, event.num_tokens)}
    elif etype == "request_arrived":
        cached = event.num_cached_prefix_tokens
        fix = {"num_branches": max(1, event.num_branches),
               "num_cached_prefix_tokens": None if cached is None else min(cached, event.num_prompt_tokens)}
    elif etype == "instance_state":
        fix = {"kv_block_size_tokens": max(1, event.kv_block_size_tokens)}
    elif etype == "admission_decided":
        low, high = event.predicted_output_tokens_low, event.predicted_output_tokens_high
        if low is not None and high is not None:
            fix = {"predicted_output_tokens_low": min(low, high), "predicted_output_tokens_high": max(low, high)}
    return dataclasses.replace(event, **fix) if fix else event


def event_strategy(cls: type[Event]) -> st.SearchStrategy[Event]:
    kwargs = {
        s.name: value_strategy(s) for s in field_specs(cls) if s.name not in ("event_type", "schema_version")
    }
    return st.builds(cls, **kwargs).map(_make_consistent)


any_event = st.one_of([event_strategy(cls) for cls in EVENT_TYPES.values()])
