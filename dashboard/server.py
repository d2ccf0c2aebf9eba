"""Starting the dashboard: ``streamlit run dashboard/asgi.py`` in its own process, on loopback.

``serve`` resolves the configuration once (relative paths against the caller's working folder),
hands it to the app as JSON in ``$SERVELENS_DASHBOARD_SETTINGS`` and starts Streamlit headless,
without usage statistics or file watching, in a session of its own (so that SIGTERM reaches it
whoever started it). ``dashboard/asgi.py`` serves ``dashboard/app.py`` through ``st.App``, behind
``dashboard.known_paths``: 404 for any URL that is neither a page nor Streamlit's own.
``wait_until_ready`` polls Streamlit's health endpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dashboard.config import HOST_HINT, SETTINGS_ENV, DashboardConfig, Settings, settings_from_config, settings_json, with_defaults
from servelens.errors import ConfigError, ServelensError

APP = Path(__file__).resolve().parent / "asgi.py"  # app.py, behind dashboard.known_paths


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def resolved(settings: Settings) -> Settings:
    """The settings with every local path made absolute (the app may run from another folder)."""
    d = with_defaults(settings.dashboard)
    return Settings(
        dashboard=dataclasses.replace(d, runs_dir=_absolute(d.runs_dir), gate_dir=_absolute(d.gate_dir),
                                      cache_dir=_absolute(d.cache_dir), gate_config_file=_absolute(d.gate_config_file)),
        lake=dataclasses.replace(settings.lake, root=_absolute(settings.lake.root)),
        privacy=dataclasses.replace(settings.privacy, key_file=_absolute(settings.privacy.key_file),
                                    demo_key_file=_absolute(settings.privacy.demo_key_file)),
    )


def streamlit_command(host: str, port: int, *, headless: bool = True) -> list[str]:
    """The ``streamlit run`` command line for the dashboard."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", host, "--server.port", str(port),
        "--server.headless", "true" if headless else "false",
        "--server.fileWatcherType", "none", "--server.runOnSave", "false",
        "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer", "--client.showErrorDetails", "none",
        "--theme.base", "light",
    ]


def serve(config, *, dashboard: DashboardConfig | None = None, port: int | None = None, host: str | None = None,
          headless: bool = True, stdout=None, stderr=None) -> subprocess.Popen:
    """Start the dashboard for ``config`` (a ``servelens.config.Config``; its ``dashboard`` section
    unless ``dashboard`` is given) and return the process; ``port`` 0 picks a free one (the chosen
    port is in ``process.args``, and ``dashboard_url(process)`` gives the URL). The caller stops
    it with ``process.terminate()``."""
    settings = resolved(settings_from_config(config, dashboard))
    host = host or settings.dashboard.host
    port = settings.dashboard.port if port is None else port
    if port == 0:
        port = free_port(host)
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_json(settings)
    if settings.lake.storage_options_file:  # the lake's object store (pipelines.objectstore), for every reader
        env["SERVELENS_LAKE__STORAGE_OPTIONS_FILE"] = settings.lake.storage_options_file
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen(streamlit_command(host, port, headless=headless), env=env, start_new_session=True,
                            stdout=stdout, stderr=stderr)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def preflight(settings: Settings) -> list[str]:
    """Check what would otherwise fail inside the app, before it starts: the gate configuration
    reads, a configured viewer tenant has a key ring to resolve it, the port is free. Raises
    ``ConfigError`` naming the key; returns warnings (a host beyond loopback: there is no login)."""
    d = settings.dashboard
    if d.gate_config_file:
        from replay.gate import load_config

        if not Path(d.gate_config_file).is_file():
            raise ConfigError(f"dashboard.gate_config_file {d.gate_config_file} does not exist",
                              "write one with `servelens gate --write-default-config FILE`, or unset the key")
        load_config(d.gate_config_file)
    if d.viewer_tenant:
        from privacy.keys import load_keyring

        try:
            load_keyring(settings.privacy.key_file)
        except ConfigError as exc:
            raise ConfigError(f"dashboard.viewer_tenant is set but its tenant cannot be resolved: {exc.message}",
                              exc.hint) from None
    _check_resolves(d.host)
    if d.port != 0:
        family = socket.AF_INET6 if ":" in d.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Tornado binds: only a listener blocks
            try:
                probe.bind((d.host, d.port))
            except OSError as exc:
                raise ConfigError(f"cannot listen on {d.host}:{d.port}: {exc.strerror or exc}",
                                  "another dashboard may be running there; choose another port with --port "
                                  "(0 picks a free one) or dashboard.port") from None
    warnings = []
    if d.host not in LOOPBACK:
        warnings.append(f"the dashboard listens on {d.host}, beyond loopback, and has no login of its own: "
                        "put an authenticating proxy in front of it (in a container, publish the port on the host's loopback only)")
    return warnings


def _check_resolves(host: str) -> None:
    """Refuse, naming ``dashboard.host``, a host this machine cannot resolve to an address (as ``--host`` is)."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"dashboard.host {host!r} does not resolve to an address ({reason})", HOST_HINT) from None


def dashboard_url(process: subprocess.Popen) -> str:
    """``http://host:port`` of a process started by ``serve``."""
    args = list(process.args)
    host = args[args.index("--server.address") + 1]
    port = args[args.index("--server.port") + 1]
    return f"http://{host}:{port}"


def wait_until_ready(url: str, timeout_s: float = 60.0, process: subprocess.Popen | None = None) -> None:
    """Block until Streamlit answers its health check at ``url``; raise ``ServelensError`` when it
    does not within ``timeout_s`` or the process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServelensError(f"the dashboard exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise ServelensError(f"the dashboard did not answer at {url} within {timeout_s:.0f} s")
