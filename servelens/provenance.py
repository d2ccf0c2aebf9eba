"""Which code produced an output: the package version and, in a git checkout, the commit.

A base module (errors, settings and provenance sit under every library package): manifests of replays
and measured profiles record it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from servelens import __version__


def code_version() -> dict[str, str | None]:
    """The package version and, in a git checkout, the commit it runs from."""
    commit = None
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            commit = head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"servelens": __version__, "git_commit": commit}
