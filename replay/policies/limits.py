"""Sanity bounds on the numbers of policy configs: a type-correct but absurd value (``aging_s: 1e300``,
a count of ``1e29``, a tenant ``weight`` of ``1e-300``) is refused where the config is built, naming the
key and the range, instead of failing deep in a replay as an overflow or a division by zero."""

from __future__ import annotations

import dataclasses
import math

from replay.errors import ReplayError

#: The longest duration (seconds) a setting may give: about 30 years, far beyond any replay, and small
#: enough that it stays exact in integer nanoseconds (1e18 ns, within int64) with room for sums.
MAX_DURATION_S = 1e9
#: The largest count or token number: 2**53, the largest integer a float (and a JSON reader) keeps exactly.
MAX_COUNT = 2**53
#: The largest magnitude of any other number (rates, service units, weights).
MAX_MAGNITUDE = 1e15
#: The smallest entitlement weight: service is divided by it, kept as a fraction of denominator at most 1e6.
MIN_WEIGHT = 1e-6


def check_magnitudes(section: str, config: object) -> None:
    """Refuse, naming ``section.key``, the first numeric setting of the dataclass ``config`` outside
    its sanity bound: NaN or an infinity, durations (``*_s``) above ``MAX_DURATION_S``, integers beyond
    ``MAX_COUNT`` either way, other numbers beyond ``MAX_MAGNITUDE`` either way, a ``weight`` below
    ``MIN_WEIGHT``. (The range checks after it would pass a NaN, and an infinity breaks the arithmetic.)"""
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        key = f"{section}.{field.name}"
        if not math.isfinite(value):
            raise ReplayError(f"{key} must be a finite number, not {value!r}", "leave it out for its default")
        if field.name.endswith("_s"):
            if value > MAX_DURATION_S:
                raise ReplayError(f"{key} must be at most {MAX_DURATION_S:g} s (about 30 years), not {value:.3g}",
                                  "leave it out for the default, or give a duration in seconds")
        elif isinstance(value, int):
            if abs(value) > MAX_COUNT:
                raise ReplayError(f"{key} must be at most 2**53 ({MAX_COUNT:,}) in size, not {value:.3g}",
                                  "leave it out for the default")
        elif abs(value) > MAX_MAGNITUDE:
            raise ReplayError(f"{key} must be at most {MAX_MAGNITUDE:g} in size, not {value:.3g}",
                              "leave it out for the default")
        if field.name == "weight" and 0 < value < MIN_WEIGHT:
            raise ReplayError(f"{key} must be at least {MIN_WEIGHT:g}, not {value:.3g}",
                              "a tenant's service is divided by its weight: give a positive weight such as 1")


__all__ = ["MAX_COUNT", "MAX_DURATION_S", "MAX_MAGNITUDE", "MIN_WEIGHT", "check_magnitudes"]
