"""Click parameter types and checks the commands share (a base module of the CLI)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click

from servelens.errors import ServelensError


class Finite(click.FloatRange):
    """A float option (optionally within a range, as ``click.FloatRange``) that refuses nan and inf:
    click's FLOAT parses them, and no duration, rate or bandwidth means them."""

    name = "number"

    def _describe_range(self) -> str:
        """No range for an unbounded number (click's own would print ``[x<=None]`` in --help)."""
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def refuse_overwriting(outputs: Path | list[Path], *inputs: str | Path | None) -> None:
    """Refuse an output that is one of the command's inputs (the same file, through any path or link): the
    writer would truncate what is still to be read, and the input would be gone either way."""
    for out in outputs if isinstance(outputs, list) else [outputs]:
        for source in inputs:
            if source is not None and out.exists() and Path(source).exists() and os.path.samefile(out, source):
                raise ServelensError(f"{out} is also an input of this command: writing it would destroy {source}",
                                     "write the output elsewhere")
