"""Click parameter types and checks the commands share (a base module of the CLI)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click

from servelens.errors import ServelensError

#: The most characters of a value a message shows: a 400-digit number or a 100,000-character id is cut to this,
#: with its length (``shown``).
SHOWN_CHARS = 64
#: A path is shown whole up to the longest path a system takes (PATH_MAX), and cut beyond it.
SHOWN_PATH_CHARS = 4_096


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` for a message: as given where it is short, else its first ``limit`` characters, an ellipsis
    and its length (a message stays readable whatever was typed)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class _ShortEcho(click.ParamType):
    """A parameter type whose errors show a long value cut (``shown``), not in full as click's own do (around
    every ``convert`` of the type, a subclass's included)."""

    def __call__(self, value: Any, param: click.Parameter | None = None, ctx: click.Context | None = None) -> Any:
        try:
            return super().__call__(value, param, ctx)
        except click.BadParameter as exc:
            for text in (str(value), exc.message.partition(" ")[0]):  # as given, else as click parsed it
                if len(text) > SHOWN_CHARS and text in exc.message:
                    exc.message = exc.message.replace(text, shown(text))
                    break
            raise


class Count(_ShortEcho, click.IntRange):
    """A whole-number option within a range (as ``click.IntRange``), whose errors show a long value cut."""


class Finite(_ShortEcho, click.FloatRange):
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


def at_most_chars(most: int, what: str) -> Any:
    """An option callback refusing a text longer than ``most`` characters (``what`` it is), before any check that
    would show it whole; the message shows it cut."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None and len(value) > most:
            raise click.BadParameter(f"{shown(value)} is longer than the {most} characters {what} may have", ctx, param)
        return value

    return check


#: The longest pseudonym key id (``privacy.keys``: 1-64 letters, digits, '.', '_' or '-').
KEY_ID_CHARS = 64


#: The largest seed: what a manifest's readers take back as written (JSON numbers read into DuckDB or pandas
#: are signed 64-bit integers).
MAX_SEED = 2**63 - 1
#: Every ``--seed``: a non-negative integer (numpy's generators refuse a negative one).
SEED = Count(0, MAX_SEED)


class OutputPath(click.Path):
    """An ``--out`` path, checked before any work: a folder output refuses a path that exists and is no folder (a
    file, or a device such as /dev/null, found only after a replay); a file output refuses a name ending in
    ``/`` (a folder meant) and a path that exists and is no regular file (a device: a writer's side files,
    such as a BLIS trace's header, would land beside it, in /dev). Either refuses a path inside a file (the
    nearest part of it that exists is no folder): a ``ServelensError`` naming that file."""

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
        above = next((p for p in path.parents if os.path.lexists(p)), None)  # the nearest folder above that exists
        if above is not None and not above.is_dir():  # mkdir would say "File exists", naming neither path nor cause
            what = "a file, not a folder" if above.is_file() else "not a folder"
            flag = param.opts[0] if param is not None and param.opts else "--out"
            raise ServelensError(f"cannot write {shown(str(path), SHOWN_PATH_CHARS)}: {shown(str(above), SHOWN_PATH_CHARS)} "
                                 f"is {what}, so nothing can be created inside it",
                                 f"give {flag} a path in a folder (or in one still to be made)")
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
