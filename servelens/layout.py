"""Where outputs go under ``paths.out_dir`` (a base module): one spelling of the folder layout that the
replay and gate commands, the nightly batch, the dashboard and the demo share.

    <out>/replay/<day>/<policy>@<load>/   a replay (events.parquet, requests.parquet, manifest.json)
    <out>/gate/<day>/<policy>@<load>/     its verdict against production (gate.md, gate.html, gate.json)
    <out>/gate/                           a verdict of `servelens gate` without --out
    <out>/dashboard-cache/                the dashboard's derived tables
"""

from __future__ import annotations

from pathlib import Path

REPLAY = "replay"
GATE = "gate"
DASHBOARD_CACHE = "dashboard-cache"


def replay_dir(out_dir: str | Path, day: str, case_key: str) -> Path:
    """The folder of one nightly replay: a day's case, ``<policy>@<load>``."""
    return Path(out_dir) / REPLAY / day / case_key


def gate_dir(out_dir: str | Path, day: str | None = None, case_key: str | None = None) -> Path:
    """The gate's reports: all of them, a day's, or one case's."""
    path = Path(out_dir) / GATE
    path = path / day if day is not None else path
    return path / case_key if case_key is not None else path


def replay_manifests(out_dir: str | Path) -> list[Path]:
    """Every nightly replay's manifest, by day then case."""
    return sorted((Path(out_dir) / REPLAY).glob("*/*/manifest.json"))
