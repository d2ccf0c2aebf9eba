"""Field introspection shared by the Arrow and JSON Schema generators and the validator.

One place turns a dataclass annotation into a ``FieldSpec``: its scalar kind, whether it is a list,
whether it is nullable, its allowed values and its help text. Every generated view starts here, so
the views cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

#: Scalar kinds a record field may have.
Kind = Literal["string", "int", "float", "bool"]

_KIND_OF: dict[Any, Kind] = {str: "string", int: "int", float: "float", bool: "bool"}


#: What makes an identifier unusable: empty or only spaces, or a control character anywhere (U+0000-U+001F,
#: U+007F). The same pattern in Python's ``re`` and RE2 (pyarrow's), so both validators agree.
BAD_IDENTIFIER = r"^ *$|[\x00-\x1f\x7f]"

#: The largest value a count field may hold (``doc(maximum=MAX_COUNT)``): tokens (a prompt, a delivery, a step's
#: prefill, tokens lost to a preemption) or items (KV blocks, sequences, steps, branches). 2**31 - 1 is far above
#: any real value (a million-token context is 2**20) and low enough that the derivations' sums stay exact in int64:
#: a request's deliveries or preemptions summed over 2**32 events (4.3 billion) stay below 2**63 - 1, where counts
#: up to int64 overflowed the first sum of two (``requests derive`` failed on two deliveries of 2**63 - 1 tokens).
MAX_COUNT = 2**31 - 1

#: The largest integer any field holds (int64: the lake's column type).
INT64_MAX = 2**63 - 1


def doc(text: str, default: Any = dataclasses.MISSING, *, wire_required: bool = False, identifier: bool = False,
        unique_items: bool = False, maximum: int | None = None, **kwargs: Any) -> Any:
    """A dataclass field carrying its help text (it becomes the Arrow and JSON Schema description).

    A field without a default is required on the wire; ``wire_required`` makes a defaulted field
    required there too (the envelope's version and type must always be written). An ``identifier``
    (an id events are joined or de-duplicated on) must hold a visible character and no control character.
    A list with ``unique_items`` holds each value at most once (JSON Schema's ``uniqueItems``). An integer field
    (or list of integers) with a ``maximum`` holds values up to it (JSON Schema's ``maximum``; ``MAX_COUNT`` for
    counts); without one, up to ``INT64_MAX``.
    """
    metadata = {"doc": text, "wire_required": wire_required, "identifier": identifier, "unique_items": unique_items,
                "maximum": maximum}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """What one record field holds."""

    name: str
    kind: Kind
    is_list: bool
    nullable: bool
    required: bool  # on the wire: must be present (it may still be null when nullable)
    enum: tuple[str, ...] | None
    doc: str
    default: Any
    identifier: bool = False  # an id: not blank, no control characters (``BAD_IDENTIFIER``)
    unique_items: bool = False  # a list that holds each value at most once
    maximum: int | None = None  # an int field's (or list item's) largest value; None: INT64_MAX

    @property
    def upper(self) -> int:
        """The largest value an int field (or each item of an int list) may hold."""
        return INT64_MAX if self.maximum is None else self.maximum

    def describe(self) -> str:
        """Human wording of the expected value, for error messages."""
        if self.identifier:
            return "a string with a visible character and no control characters" + (" or null" if self.nullable else "")
        if self.enum:
            base = "one of " + ", ".join(repr(v) for v in self.enum)
        else:
            base = {"string": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}[
                self.kind
            ]
        if self.is_list:
            base = f"a list of {'distinct ' if self.unique_items else ''}{base.removeprefix('a ').removeprefix('an ')}s"
        return f"{base} or null" if self.nullable else base


_T = TypeVar("_T")


def cached_by_class(fn: Callable[[type], _T]) -> Callable[[type], _T]:
    """``functools.cache`` for a function of a record class (the type checker does not see classes as
    hashable)."""
    return cast(Callable[[type], _T], functools.cache(fn))


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """Strip ``X | None``; return (inner annotation, nullable)."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {annotation!r}: records are flat, use X | None")
        return inner[0], True
    return annotation, False


def _spec(f: dataclasses.Field[Any], annotation: Any) -> FieldSpec:
    inner, nullable = _unwrap(annotation)
    is_list = typing.get_origin(inner) is list
    if is_list:
        (inner,) = typing.get_args(inner)
    enum: tuple[str, ...] | None = None
    if typing.get_origin(inner) is Literal:
        enum = tuple(typing.get_args(inner))
        inner = type(enum[0])
    if inner not in _KIND_OF:
        raise TypeError(f"field {f.name}: unsupported type {inner!r}; records hold flat scalars and lists")
    has_default = f.default is not dataclasses.MISSING
    return FieldSpec(
        name=f.name,
        kind=_KIND_OF[inner],
        is_list=is_list,
        nullable=nullable,
        required=not has_default or bool(f.metadata.get("wire_required")),
        enum=enum,
        doc=f.metadata.get("doc", ""),
        default=f.default if has_default else None,
        identifier=bool(f.metadata.get("identifier")),
        unique_items=bool(f.metadata.get("unique_items")),
        maximum=f.metadata.get("maximum"),
    )


@cached_by_class
def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The record's fields, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(_spec(f, hints[f.name]) for f in dataclasses.fields(cls))
