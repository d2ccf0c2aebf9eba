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


class Duration(Finite):
    """A duration option in seconds from ``90``, ``90s``, ``10m``, ``1h``, ``1d`` or ``250ms``
    (``replay.presets.parse_duration_s``), optionally within a range of seconds (as ``Finite``)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, (int, float)):  # a default, or seconds already
            return super().convert(value, param, ctx)
        from replay.presets import parse_duration_s

        try:
            seconds = parse_duration_s(value)
        except ServelensError as exc:
            self.fail(exc.message + " (write it like 30s, 10m, 1h or 1d)", param, ctx)
        try:
            return super().convert(seconds, param, ctx)
        except click.BadParameter as exc:
            self.fail(f"{value} is {seconds:g} s: {exc.message}", param, ctx)


#: The largest seed: what a manifest's readers take back as written (JSON numbers read into DuckDB or pandas
#: are signed 64-bit integers).
MAX_SEED = 2**63 - 1
#: Every ``--seed``: a non-negative integer (numpy's generators refuse a negative one).
SEED = click.IntRange(0, MAX_SEED)


class OutputPath(click.Path):
    """An ``--out`` path, checked before any work: a folder output refuses a path that exists and is no folder (a
    file, or a device such as /dev/null, found only after a replay); a file output refuses a name ending in
    ``/`` (a folder meant) and a path that exists and is no regular file (a device: a writer's side files,
    such as a BLIS trace's header, would land beside it, in /dev)."""

    def __init__(self, *, folder: bool) -> None:
        super().__init__(file_okay=not folder, dir_okay=folder, path_type=Path)
        self.folder = folder

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail(f"must not be empty; give the {'folder' if self.folder else 'file'}'s name", param, ctx)
        if not self.folder and isinstance(value, str) and value.endswith(("/", os.sep)):
            self.fail(f"{value} names a folder (it ends in /); give the file's name", param, ctx)
        path = super().convert(value, param, ctx)
        if path.exists() and not (path.is_dir() if self.folder else path.is_file()):
            self.fail(f"{path} exists and is not a {'folder' if self.folder else 'regular file'}", param, ctx)
        return path


#: ``--out`` of a command that writes one file, and of one that writes a folder.
OUT_FILE = OutputPath(folder=False)
OUT_FOLDER = OutputPath(folder=True)


def refuse_overwriting(outputs: Path | list[Path], *inputs: str | Path | None) -> None:
    """Refuse an output that is one of the command's inputs (the same file, through any path or link): the
    writer would truncate what is still to be read, and the input would be gone either way."""
    for out in outputs if isinstance(outputs, list) else [outputs]:
        for source in inputs:
            if source is not None and out.exists() and Path(source).exists() and os.path.samefile(out, source):
                raise ServelensError(f"{out} is also an input of this command: writing it would destroy {source}",
                                     "write the output elsewhere")
