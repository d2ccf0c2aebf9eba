"""The ``[dashboard]`` section of the configuration tree, and how the app process receives it.

``DashboardConfig`` is a frozen dataclass like every other section (``servelens/config.py`` mounts
it as ``Config.dashboard``). The Streamlit process does not parse command-line options of its own:
``dashboard.serve`` hands it the resolved configuration as JSON in ``$SERVELENS_DASHBOARD_SETTINGS``
(``settings_json`` / ``settings_from_env``), so what the operator configured on the server is
exactly what every page sees. Nothing a browser sends (the URL, its query parameters, widgets) can
change these settings: in particular the viewer's tenant is configuration, never a URL parameter.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipelines.config import LakeConfig
from privacy.config import PrivacyConfig
from schemas.types import doc
from servelens import layout
from servelens.errors import ConfigError
from servelens.settings import build, check_bounds, read_settings

#: Environment variable carrying the resolved settings from ``serve`` to the Streamlit process.
SETTINGS_ENV = "SERVELENS_DASHBOARD_SETTINGS"


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    """The Streamlit dashboard: where it reads runs and reports, who is viewing, where it listens."""

    runs_dir: str | None = doc(
        "Folder of replay runs, searched up to three levels deep for folders holding events.parquet "
        "(and manifest.json): `servelens replay --out` writes one, the nightly Dagster batch writes "
        "<day>/<policy>@<load>/. Unset: <paths.out_dir>/replay.",
        None,
    )
    gate_dir: str | None = doc(
        "Folder of gate reports (gate.json, gate.md, gate.html), searched likewise: `servelens gate` "
        "writes one, the nightly batch one per <day>/<policy>@<load>/. Unset: <paths.out_dir>/gate.",
        None,
    )
    gate_config_file: str | None = doc(
        "Gate configuration (YAML) whose classes, cost and tenant weights define the objectives, prices "
        "and entitlements the dashboard uses; unset: the gate's built-in defaults.",
        None,
    )
    viewer_tenant: str | None = doc(
        "The tenant (its raw id, as engines send it) whose per-request detail this dashboard may show; "
        "resolved to its pseudonyms with the configured key ring (privacy.key_file). Server-side only: "
        "no URL parameter can set or widen it. Unset: k-anonymous aggregates only.",
        None,
    )
    host: str = doc(
        "Address the dashboard binds to. It has no login of its own: keep it on loopback, or put an "
        "authenticating proxy in front.",
        "127.0.0.1",
    )
    port: int = doc("Port the dashboard listens on.", 8501)
    max_points: int = doc(
        "Most points one chart series draws; a longer span is aggregated into wider time bins in "
        "DuckDB before plotting.",
        1500,
    )
    cache_dir: str | None = doc(
        "Where the dashboard keeps derived tables (the lake's request table per Delta version, each "
        "run's request table and metrics); rebuilt when the lake or a run changes, safe to delete. "
        "Unset: <paths.out_dir>/dashboard-cache.",
        None,
    )
    refresh_interval_s: float = doc(
        "How often the dashboard looks for a new lake version or new runs, seconds (derived tables are "
        "rebuilt when it finds one).",
        60.0,
    )

    def __post_init__(self) -> None:
        check_bounds("dashboard", self, at_least={"port": 0, "max_points": 2}, above={"refresh_interval_s": 0})
        if self.port > 65_535:
            raise ConfigError(f"dashboard.port must be a TCP port, 0 to 65535 (0: a free one), not {self.port}")
        check_host(self.host)


#: How ``dashboard.host`` is written, for the errors that refuse one.
HOST_HINT = ("give a host name or an IP address of this machine, e.g. 127.0.0.1 (loopback, the default); "
             "the port is dashboard.port")


def check_host(host: str) -> None:
    """Refuse, naming ``dashboard.host``, a value that is no host name or address: empty or blank (it would listen
    on every interface), with a blank or control character, with a scheme or path (``http://...``) or with a
    port (``localhost:8501``; a bare IPv6 address such as ``::1`` is fine). Whether a name resolves is
    ``dashboard.server.preflight``'s to check: loading the configuration does no I/O."""
    if not host.strip():
        raise ConfigError("dashboard.host must not be empty (an empty host listens on every interface)",
                          "leave it out for the default, '127.0.0.1' (loopback)")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise ConfigError(f"dashboard.host {host!r} has a blank or control character in it", HOST_HINT)
    if "/" in host:
        raise ConfigError(f"dashboard.host {host!r} is a URL or a path, not a host name or address", HOST_HINT)
    if ":" in host and not _is_ipv6(host):
        raise ConfigError(f"dashboard.host {host!r} has a port (or brackets) in it: the port is dashboard.port",
                          HOST_HINT + "; an IPv6 address goes without brackets, e.g. ::1")


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the dashboard process reads: its own section and the sections it shares."""

    dashboard: DashboardConfig
    lake: LakeConfig
    privacy: PrivacyConfig


def _plain(obj: Any) -> Any:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


#: Where the folders the dashboard reads and writes go when unset, below ``paths.out_dir``.
OUT_SUBFOLDERS = {"runs_dir": layout.REPLAY, "gate_dir": layout.GATE, "cache_dir": layout.DASHBOARD_CACHE}


def with_defaults(section: DashboardConfig, out_dir: str = "out") -> DashboardConfig:
    """The section with every unset folder placed under ``out_dir`` (``paths.out_dir``), where
    ``servelens replay``, ``servelens gate`` and the nightly batch write."""
    unset = {name: f"{out_dir.rstrip('/')}/{sub}" for name, sub in OUT_SUBFOLDERS.items() if getattr(section, name) is None}
    return dataclasses.replace(section, **unset) if unset else section


def settings_from_config(config: Any, dashboard: DashboardConfig | None = None) -> Settings:
    """Settings from a ``servelens.config.Config`` (its ``dashboard`` section unless one is given),
    unset folders placed under its ``paths.out_dir``."""
    section = dashboard or getattr(config, "dashboard", None) or DashboardConfig()
    paths = getattr(config, "paths", None)
    section = with_defaults(section, getattr(paths, "out_dir", None) or "out")
    return Settings(dashboard=section, lake=config.lake, privacy=config.privacy)


def settings_json(settings: Settings) -> str:
    """The settings as JSON for ``$SERVELENS_DASHBOARD_SETTINGS`` (paths and values only: the key
    ring itself never travels; the app loads it from ``privacy.key_file`` or its own environment)."""
    return json.dumps({"dashboard": _plain(settings.dashboard), "lake": _plain(settings.lake),
                       "privacy": _plain(settings.privacy)}, sort_keys=True)


def settings_from_env(env: Mapping[str, str] | None = None) -> Settings:
    """The settings ``serve`` passed, or, when the app was started by hand (``streamlit run``),
    its sections of the configuration read as the CLI reads them (TOML file and environment)."""
    env = os.environ if env is None else env
    text = env.get(SETTINGS_ENV)
    if text:
        return _settings(json.loads(text))
    data = read_settings(env=env, tree=Settings)
    return _settings(data, data.get("paths", {}).get("out_dir") or "out")


def _settings(data: Mapping[str, Any], out_dir: str = "out") -> Settings:
    return Settings(
        dashboard=with_defaults(build(DashboardConfig, data.get("dashboard", {}), "dashboard."), out_dir),
        lake=build(LakeConfig, data.get("lake", {}), "lake."),
        privacy=build(PrivacyConfig, data.get("privacy", {}), "privacy."),
    )
