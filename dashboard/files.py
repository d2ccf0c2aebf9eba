"""Which files the dashboard may hand to a browser: only regular files inside its own folders.

A path is served only when, resolved (symbolic links and ``..`` followed), it is a regular file
inside one of the configured folders (``dashboard.runs_dir`` for run manifests, ``dashboard.gate_dir``
for gate reports), also resolved. A path read from a report is never trusted as such: the Gate page
offers the manifests of the runs it found itself under ``runs_dir``, and a gate.json that names
``/etc/shadow`` or the pseudonym key file as a manifest gets no download button at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def servable(path: str | Path | None, folders: Sequence[str | Path | None]) -> Path | None:
    """``path`` resolved, if it is a regular file inside one of ``folders`` (resolved); else None."""
    if not path:
        return None
    try:
        resolved = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        return None
    if not resolved.is_file():
        return None
    for folder in folders:
        if not folder:
            continue
        try:
            root = Path(folder).resolve(strict=True)
        except (OSError, RuntimeError):
            continue
        if resolved.is_relative_to(root) and resolved != root:
            return resolved
    return None
