"""The dashboard's configuration section, how it reaches the app, and how the app is started."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard.config import SETTINGS_ENV, DashboardConfig, Settings, settings_from_config, settings_from_env, settings_json
from dashboard.server import resolved, streamlit_command
from pipelines.config import LakeConfig
from privacy.config import PrivacyConfig
from servelens.config import Config, load_config
from servelens.errors import ConfigError


def test_every_field_is_documented_and_the_defaults_are_the_documented_ones():
    fields = dataclasses.fields(DashboardConfig)
    assert all(f.metadata.get("doc") for f in fields)
    d = DashboardConfig()
    assert (d.runs_dir, d.gate_dir, d.cache_dir, d.viewer_tenant, d.host, d.port) == (None, None, None, None, "127.0.0.1", 8501)
    assert d.max_points > 0 and d.refresh_interval_s > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.viewer_tenant = "someone"  # type: ignore[misc]


def test_settings_travel_as_json_and_come_back_checked():
    settings = Settings(DashboardConfig(viewer_tenant="acme", port=9000), LakeConfig(root="/data/lake"),
                        PrivacyConfig(key_file="/keys/ring.toml", min_group_size=7))
    text = settings_json(settings)
    assert settings_from_env({SETTINGS_ENV: text}) == dataclasses.replace(
        settings, dashboard=dataclasses.replace(settings.dashboard, runs_dir="out/replay", gate_dir="out/gate",
                                                cache_dir="out/dashboard-cache"))
    data = json.loads(text)
    data["dashboard"]["viewer_tenant"] = ["a", "list"]
    with pytest.raises(ConfigError, match="dashboard.viewer_tenant"):
        settings_from_env({SETTINGS_ENV: json.dumps(data)})
    data["dashboard"] = {"no_such_key": 1}
    with pytest.raises(ConfigError, match="unknown config key dashboard.no_such_key"):
        settings_from_env({SETTINGS_ENV: json.dumps(data)})


def test_without_serve_the_app_loads_the_configuration_as_the_cli_does(tmp_path):
    toml = tmp_path / "servelens.toml"
    toml.write_text('[lake]\nroot = "/somewhere/lake"\n[privacy]\nmin_group_size = 9\n')
    settings = settings_from_env({"SERVELENS_CONFIG": str(toml)})
    assert settings.lake.root == "/somewhere/lake" and settings.privacy.min_group_size == 9
    assert settings.dashboard == DashboardConfig(runs_dir="out/replay", gate_dir="out/gate", cache_dir="out/dashboard-cache")


def test_the_section_is_mounted_in_the_config_tree_and_its_folders_follow_paths_out_dir(tmp_path):
    toml = tmp_path / "servelens.toml"
    toml.write_text('[paths]\nout_dir = "/data/out"\n[dashboard]\nport = 9000\nviewer_tenant = "acme"\n'
                    'gate_dir = "/reports"\n')
    config = load_config(toml, env={"SERVELENS_DASHBOARD__MAX_POINTS": "800"})
    assert config.dashboard == DashboardConfig(port=9000, viewer_tenant="acme", gate_dir="/reports", max_points=800)
    d = settings_from_config(config).dashboard
    assert (d.runs_dir, d.gate_dir, d.cache_dir) == ("/data/out/replay", "/reports", "/data/out/dashboard-cache")
    toml.write_text("[dashboard]\nprot = 1\n")
    with pytest.raises(ConfigError, match="unknown config key dashboard.prot") as err:
        load_config(toml, env={})
    assert "port" in err.value.hint
    assert load_config(env={}).dashboard == DashboardConfig()


def test_settings_from_a_config_tree_use_its_dashboard_section_when_it_has_one():
    config = Config(lake=LakeConfig(root="x"))
    assert settings_from_config(config).dashboard == DashboardConfig(runs_dir="out/replay", gate_dir="out/gate",
                                                                     cache_dir="out/dashboard-cache")
    assert settings_from_config(config, DashboardConfig(port=1)).dashboard.port == 1

    @dataclasses.dataclass(frozen=True)
    class Mounted:
        lake: LakeConfig = LakeConfig()
        privacy: PrivacyConfig = PrivacyConfig()
        dashboard: DashboardConfig = DashboardConfig(runs_dir="elsewhere")

    assert settings_from_config(Mounted()).dashboard.runs_dir == "elsewhere"


def test_the_server_binds_loopback_headless_and_offline_with_absolute_paths(tmp_path, monkeypatch):
    command = streamlit_command("127.0.0.1", 8765)
    pairs = dict(zip(command, command[1:]))
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4].endswith("dashboard/asgi.py")
    assert pairs["--server.address"] == "127.0.0.1" and pairs["--server.port"] == "8765"
    assert pairs["--server.headless"] == "true" and pairs["--browser.gatherUsageStats"] == "false"
    assert pairs["--client.showErrorDetails"] == "none"  # no tracebacks in the browser
    monkeypatch.chdir(tmp_path)
    settings = resolved(Settings(DashboardConfig(), LakeConfig(root="lake"), PrivacyConfig(key_file="k.toml")))
    assert settings.lake.root == str(tmp_path / "lake") and settings.privacy.key_file == str(tmp_path / "k.toml")
    assert all(Path(p).is_absolute() for p in (settings.dashboard.runs_dir, settings.dashboard.gate_dir, settings.dashboard.cache_dir))
    assert resolved(Settings(DashboardConfig(), LakeConfig(root="s3://bucket/lake"), PrivacyConfig())).lake.root == "s3://bucket/lake"


def test_streamlit_run_serves_the_app_through_st_app():
    """``streamlit run dashboard/asgi.py`` must find ``app = st.App(...)`` there (by reading the source), or it
    would run the launcher itself as the app script, without ``dashboard.known_paths``."""
    from streamlit.web.server.app_discovery import discover_asgi_app

    found = discover_asgi_app(Path(streamlit_command("127.0.0.1", 8765)[4]))
    assert found.is_asgi_app and found.import_string == "asgi:app"


def test_the_server_loads_pandas_and_plotly_before_any_session_and_starts_no_thread():
    """The server's module (what ``streamlit run`` imports before it serves) loads the chart pages' heavy
    modules in its own thread: a background import raced the first page's own import of pandas in CI (2 Dec
    2026) and left that page without charts. In a fresh interpreter, as the server's is."""
    probe = ("import runpy, sys, threading; runpy.run_path(sys.argv[1]); "
             "print(all(m in sys.modules for m in ('pandas', 'plotly.graph_objects')), threading.active_count())")
    done = subprocess.run([sys.executable, "-c", probe, streamlit_command("127.0.0.1", 8765)[4]],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "1"], done.stdout + done.stderr


def test_an_installed_servelens_ships_every_page():
    import tomllib

    from setuptools import find_packages

    from dashboard.app_pages import PAGES

    root = Path(__file__).resolve().parents[2]
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = set(find_packages(str(root), include=include))
    for path, _, _ in PAGES:
        folder = str(Path("dashboard", path).parent).replace("/", ".")
        assert folder in packages, f"{path} would be left out of the wheel (and of the Docker image)"


def test_the_dashboard_reads_the_lake_and_the_batch_outputs_on_loopback():
    import yaml

    from dashboard.config import OUT_SUBFOLDERS

    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    service = compose["services"]["dashboard"]
    assert service["command"] == ["dashboard"] and service["ports"] == ["127.0.0.1:8501:8501"]
    env = service["environment"]
    assert env["SERVELENS_DASHBOARD__PORT"] == "8501"
    mounts = {volume.split(":")[1]: volume for volume in service["volumes"]}
    lake = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", env["SERVELENS_LAKE__ROOT"])  # unless set: /data/lake
    assert mounts[lake].endswith(":ro")  # it only reads the lake
    assert env["SERVELENS_PATHS__OUT_DIR"] in mounts and not mounts[env["SERVELENS_PATHS__OUT_DIR"]].endswith(":ro")
    batch = compose["services"]["dagster-daemon"]["environment"]
    assert env["SERVELENS_PATHS__OUT_DIR"] == batch["SERVELENS_PATHS__OUT_DIR"]  # runs_dir and gate_dir follow it
    assert set(OUT_SUBFOLDERS) == {"runs_dir", "gate_dir", "cache_dir"}
