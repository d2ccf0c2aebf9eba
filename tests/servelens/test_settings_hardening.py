"""Settings a user meant but wrote wrongly: a variable with one '_' after its section, a dashboard.host that is no host.

Each used to pass silently (the variable ignored, the host handed to Streamlit); each is now an error naming the
variable or the key.
"""

from __future__ import annotations

import json

import pytest

from dashboard.config import DashboardConfig, Settings, settings_from_env
from dashboard.server import preflight
from pipelines.config import LakeConfig
from privacy.config import PrivacyConfig
from servelens.config import load_config
from servelens.errors import ConfigError


@pytest.mark.parametrize(("name", "meant", "key"), [
    ("SERVELENS_LAKE_ROOT", "SERVELENS_LAKE__ROOT", "lake.root"),
    ("SERVELENS_lake_root", "SERVELENS_LAKE__ROOT", "lake.root"),
    ("SERVELENS_PRIVACY_KEY_FILE", "SERVELENS_PRIVACY__KEY_FILE", "privacy.key_file"),
    ("SERVELENS_PATHS_SHARED_DIR", "SERVELENS_PATHS__SHARED_DIR", "paths.shared_dir"),
    ("SERVELENS_DASHBOARD_PORT", "SERVELENS_DASHBOARD__PORT", "dashboard.port"),
    ("SERVELENS_LAKE_DUCKDB_MEMORY_LIMIT", "SERVELENS_LAKE__DUCKDB_MEMORY_LIMIT", "lake.duckdb_memory_limit"),
])
def test_a_setting_variable_with_one_underscore_is_refused_naming_it_and_the_name_meant(monkeypatch, name, meant, key):
    monkeypatch.setenv(name, "8502" if key == "dashboard.port" else "/data/x")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert err.value.message.startswith(f"environment variable {name} sets nothing: it has one '_' after ")
    assert err.value.message.endswith(f"it probably means {meant} ({key})")
    assert err.value.hint.startswith(f"rename it {meant} ")


@pytest.mark.parametrize("name", ["SERVELENS_SHARED_DIR", "SERVELENS_SHARED", "SERVELENS_DASHBOARD_SETTINGS",
                                  "SERVELENS_PSEUDONYM_KEY", "SERVELENS_DEBUG", "SERVELENS_ENV", "SERVELENS_IMAGE",
                                  "SERVELENS_VERSION", "SERVELENS_DOCS_IMAGES"])
def test_the_projects_own_variables_are_not_taken_for_misspelled_settings(monkeypatch, name):
    monkeypatch.setenv(name, "1")
    monkeypatch.setenv("SERVELENS_LAKE__ROOT", "/data/lake")
    assert load_config().lake.root == "/data/lake"


def test_the_dashboard_started_by_hand_refuses_one_underscore_too():
    with pytest.raises(ConfigError) as err:
        settings_from_env({"SERVELENS_DASHBOARD_MAX_POINTS": "200"})
    assert err.value.message.startswith("environment variable SERVELENS_DASHBOARD_MAX_POINTS sets nothing: ")
    assert err.value.message.endswith("it probably means SERVELENS_DASHBOARD__MAX_POINTS (dashboard.max_points)")


@pytest.mark.parametrize(("host", "message"), [
    ("", "dashboard.host must not be empty (an empty host listens on every interface)"),
    ("   ", "dashboard.host must not be empty (an empty host listens on every interface)"),
    ("local host", "dashboard.host 'local host' has a blank or control character in it"),
    ("127.0.0.1\n", "dashboard.host '127.0.0.1\\n' has a blank or control character in it"),
    ("a\x00b", "dashboard.host 'a\\x00b' has a blank or control character in it"),
    ("http://127.0.0.1", "dashboard.host 'http://127.0.0.1' is a URL or a path, not a host name or address"),
    ("localhost:8501", "dashboard.host 'localhost:8501' has a port (or brackets) in it: the port is dashboard.port"),
    ("[::1]", "dashboard.host '[::1]' has a port (or brackets) in it: the port is dashboard.port"),
    ("[::1]:8501", "dashboard.host '[::1]:8501' has a port (or brackets) in it: the port is dashboard.port"),
])
def test_a_dashboard_host_in_the_config_file_that_is_no_host_is_refused_naming_the_key(tmp_path, host, message):
    config = tmp_path / "servelens.toml"
    config.write_text(f"[dashboard]\nhost = {json.dumps(host)}\n")  # a TOML basic string: JSON's escapes
    with pytest.raises(ConfigError) as err:
        load_config(config, env={})
    assert err.value.message == message


def test_a_dashboard_host_from_the_environment_is_checked_alike(monkeypatch):
    monkeypatch.setenv("SERVELENS_DASHBOARD__HOST", "")
    with pytest.raises(ConfigError, match=r"^dashboard.host must not be empty"):
        load_config()
    monkeypatch.setenv("SERVELENS_DASHBOARD__HOST", "0.0.0.0:8501")
    with pytest.raises(ConfigError, match=r"^dashboard.host '0.0.0.0:8501' has a port"):
        load_config()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "fe80::1%eth0", "dash.example.com"])
def test_host_names_and_addresses_pass(tmp_path, host):
    config = tmp_path / "servelens.toml"
    config.write_text(f'[dashboard]\nhost = "{host}"\n')
    assert load_config(config, env={}).dashboard.host == host


def test_a_dashboard_host_that_does_not_resolve_is_refused_before_the_app_starts():
    settings = Settings(DashboardConfig(host="no-such-host.invalid", port=0), LakeConfig(), PrivacyConfig())
    with pytest.raises(ConfigError, match=r"^dashboard.host 'no-such-host.invalid' does not resolve to an address \("):
        preflight(settings)
