"""The replay's domain errors: a configuration or workload that cannot be replayed, said plainly."""

from __future__ import annotations

from servelens.errors import ServelensError


class ReplayError(ServelensError):
    """A replay cannot proceed: a request that can never fit, an unsorted workload, a bad setting."""


def unknown_name(kind: str, name: str, valid: list[str] | tuple[str, ...]) -> ReplayError:
    """The error for a name that is not registered, listing the valid ones."""
    return ReplayError(f"unknown {kind} {name!r}", f"valid names: {', '.join(sorted(valid))}")
