"""Click parameter types the commands share (a base module of the CLI)."""

from __future__ import annotations

import math
from typing import Any

import click


class Finite(click.FloatRange):
    """A float option (optionally within a range, as ``click.FloatRange``) that refuses nan and inf:
    click's FLOAT parses them, and no duration, rate or bandwidth means them."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
