"""The contract checked column by column: the vectorized twin of ``schemas.validate``.

``check_table`` takes events already in Arrow columns (a parsed batch of JSON messages, a Parquet
file from another producer) and returns which rows the contract accepts: a known event type and
major version, every required field present, enum values allowed, numbers non-negative and finite (counts
at most ``schemas.types.MAX_COUNT``), list items present (and distinct in a step's ``request_ids``), the
cross-field rules. It also nulls the fields that belong to another event type (the per-type allowlist)
and counts them. Rows it rejects go to ``schemas.validate``, the reference, for their reasons;
``tests/pipelines/test_decode.py`` proves the two agree on every record. Event ids repeated across rows
are a check of a whole batch or file, not of a row: ``schemas.duplicates``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.arrow import EVENTS_SCHEMA
from schemas.events import EVENT_TYPES, SCHEMA_VERSION_PATTERN
from schemas.types import BAD_IDENTIFIER, INT64_MAX, FieldSpec, field_specs

#: The lake schema with every field nullable: what the JSON parser may produce.
WIRE_SCHEMA = pa.schema(
    [
        pa.field(
            f.name,
            pa.list_(pa.field("item", f.type.value_type, nullable=True)) if pa.types.is_list(f.type) else f.type,
            nullable=True,
        )
        for f in EVENTS_SCHEMA
    ]
)


def _type_masks(event_type: pa.Array) -> dict[str, pa.Array]:
    return {name: pc.fill_null(pc.equal(event_type, name), False) for name in EVENT_TYPES}


def _in_range(values: pa.Array, kind: str, upper: int) -> pa.Array:
    """Per row: the value (or every list item) is a non-negative (finite) number, an integer at most ``upper``."""
    if pa.types.is_list(values.type):
        flat = pc.list_flatten(values)
        ok_items = _in_range(flat, kind, upper)
        parents = pc.list_parent_indices(values)
        bad = np.zeros(len(values), dtype=bool)
        bad_items = ~ok_items.to_numpy(zero_copy_only=False)
        if bad_items.any():
            bad[parents.to_numpy()[bad_items]] = True
        return pa.array(~bad)
    ok = pc.greater_equal(values, 0)
    if kind == "float":
        ok = pc.and_(ok, pc.is_finite(values))
    elif upper < INT64_MAX:  # a count's maximum (schemas.types.MAX_COUNT); int64 holds the rest
        ok = pc.and_(ok, pc.less_equal(values, upper))
    return pc.fill_null(ok, True)  # nulls are judged by the required/nullable checks


def _items_not_null(values: pa.Array) -> pa.Array:
    if not pa.types.is_list(values.type):
        return pa.array(np.ones(len(values), dtype=bool))
    nulls = pc.is_null(pc.list_flatten(values)).to_numpy(zero_copy_only=False)
    bad = np.zeros(len(values), dtype=bool)
    if nulls.any():
        bad[pc.list_parent_indices(values).to_numpy()[nulls]] = True
    return pa.array(~bad)


def _items_unique(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per row: no item of the list appears twice in it (True for a null list)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    flat = pc.list_flatten(values)
    ok = np.ones(len(values), dtype=bool)
    if len(flat) < 2:
        return pa.array(ok)
    parents = pc.list_parent_indices(values).to_numpy()
    codes = pc.dictionary_encode(flat).indices.to_numpy(zero_copy_only=False)  # a null item: judged elsewhere
    order = np.lexsort((codes, parents))
    parents, codes = parents[order], codes[order]
    repeated = (parents[1:] == parents[:-1]) & (codes[1:] == codes[:-1])
    ok[parents[1:][repeated]] = False
    return pa.array(ok)


def _values_allowed(spec: FieldSpec, column: pa.Array) -> np.ndarray:
    """Per row: the value is one the field allows (its enum, non-negative numbers, usable ids, list items
    present, and distinct where the field says so); nulls pass (the required/nullable checks judge them)."""
    ok = np.ones(len(column), dtype=bool)
    if spec.enum:
        # is_in answers False (not null) for a null: a null is judged by the required/nullable checks, not here
        allowed = pc.or_kleene(pc.is_null(column), pc.is_in(column, pa.array(list(spec.enum))))
        ok &= allowed.to_numpy(zero_copy_only=False)
    if spec.kind in ("int", "float"):
        ok &= _in_range(column, spec.kind, spec.upper).to_numpy(zero_copy_only=False)
    if spec.identifier:
        ok &= pc.fill_null(pc.invert(pc.match_substring_regex(column, BAD_IDENTIFIER)), True).to_numpy(zero_copy_only=False)
    if spec.is_list:
        ok &= _items_not_null(column).to_numpy(zero_copy_only=False)
    if spec.unique_items:
        ok &= _items_unique(column).to_numpy(zero_copy_only=False)
    return ok


def _absent(values: Sequence[bytes], rows: np.ndarray, name: str) -> np.ndarray:
    """Of ``rows``, those whose message never mentions the key ``name`` (so the field was omitted,
    not sent as null): a byte search, conservative (a mention anywhere counts as present)."""
    key = b'"' + name.encode() + b'"'
    return np.array([key not in values[i] for i in rows], dtype=bool)


def check_table(table: pa.Table, values: Sequence[bytes] | None = None) -> tuple[np.ndarray, pa.Table, Counter[str]]:
    """(valid mask, table with defaults filled and foreign fields nulled, dropped-field counts).

    ``values`` are the batch's JSON messages, row for row, when it came from JSON: an omitted field
    with a default is filled here, as the reference validator would; one sent as an explicit null is
    left to it. Without ``values`` (columnar input has no "omitted"), a null there is left to it too.
    """
    n = table.num_rows
    valid = np.ones(n, dtype=bool)
    dropped: Counter[str] = Counter()
    readable = pc.match_substring_regex(table["schema_version"], SCHEMA_VERSION_PATTERN)  # the validator's rule
    valid &= pc.fill_null(readable, False).to_numpy(zero_copy_only=False)
    etype = table["event_type"]
    masks = _type_masks(etype)
    known = np.zeros(n, dtype=bool)
    for mask in masks.values():
        known |= mask.to_numpy(zero_copy_only=False)
    valid &= known
    columns = {name: table[name] for name in EVENTS_SCHEMA.names}
    belongs: dict[str, np.ndarray] = {name: np.zeros(n, dtype=bool) for name in EVENTS_SCHEMA.names}
    for type_name, cls in EVENT_TYPES.items():
        rows = masks[type_name].to_numpy(zero_copy_only=False)
        if not rows.any():
            continue
        for spec in field_specs(cls):
            belongs[spec.name] |= rows
            column = columns[spec.name]
            present = pc.is_valid(column).to_numpy(zero_copy_only=False)
            if not spec.nullable:
                missing = np.flatnonzero(rows & ~present)
                if len(missing) and not spec.required and values is not None:
                    omitted = missing[_absent(values, missing, spec.name)]
                    if len(omitted):
                        fill = np.zeros(n, dtype=bool)
                        fill[omitted] = True
                        column = columns[spec.name] = pc.if_else(pa.array(fill), pa.scalar(spec.default, column.type), column)
                        present = present | fill
                # a required field absent, or an explicit null: the reference validator explains it
                valid &= ~rows | present
            valid &= ~rows | _values_allowed(spec, column)
    valid &= _consistency(table, masks)
    # the allowlist per event type: a field of another type is not part of this record
    out = []
    for name in EVENTS_SCHEMA.names:
        column = columns[name]
        foreign = ~belongs[name] & pc.is_valid(column).to_numpy(zero_copy_only=False)
        count = int((foreign & valid).sum())
        if count:
            dropped[name] += count
            column = pc.if_else(pa.array(foreign), pa.nulls(n, column.type), column)
        out.append(column)
    return valid, pa.Table.from_arrays(out, schema=table.select(EVENTS_SCHEMA.names).schema), dropped


def _consistency(table: pa.Table, masks: dict[str, pa.Array]) -> np.ndarray:
    """Cross-field rules of ``schemas.validate`` (True where a row passes or the rule does not apply)."""
    ok = np.ones(table.num_rows, dtype=bool)

    def rule(mask_name: str, predicate: pa.Array) -> None:
        nonlocal ok
        applies = masks[mask_name].to_numpy(zero_copy_only=False)
        ok &= ~applies | pc.fill_null(predicate, True).to_numpy(zero_copy_only=False)

    rule("step_executed", pc.less_equal(table["start_ns"], table["end_ns"]))
    rule(
        "step_executed",
        pc.equal(pc.list_value_length(table["request_ids"]), pc.list_value_length(table["request_num_tokens"])),
    )
    rule("step_executed", pc.greater_equal(table["num_steps"], 1))
    rule("tokens_delivered", pc.greater_equal(table["num_tokens"], 1))
    rule("request_arrived", pc.greater_equal(table["num_branches"], 1))
    rule("request_arrived", pc.less_equal(table["num_cached_prefix_tokens"], table["num_prompt_tokens"]))
    rule("instance_state", pc.greater_equal(table["kv_block_size_tokens"], 1))
    rule(
        "admission_decided",
        pc.less_equal(table["predicted_output_tokens_low"], table["predicted_output_tokens_high"]),
    )
    return ok
