"""The configuration tree: defaults, TOML, environment, and errors that name the key."""

from __future__ import annotations

import pytest

from servelens.config import Config, PathsConfig, load_config, shared_dir
from servelens.errors import ConfigError, DataNotFoundError


def test_defaults_need_no_file_and_no_environment():
    assert load_config(env={}) == Config(paths=PathsConfig(shared_dir=None, out_dir="out"))


def test_file_then_environment_take_precedence(tmp_path):
    path = tmp_path / "servelens.toml"
    path.write_text('[paths]\nout_dir = "from-file"\nshared_dir = "/data/a"\n')
    config = load_config(path, env={"SERVELENS_PATHS__OUT_DIR": "from-env"})
    assert config.paths == PathsConfig(shared_dir="/data/a", out_dir="from-env")
    assert load_config(path, env={"SERVELENS_SHARED_DIR": "/data/b"}).paths.shared_dir == "/data/b"


def test_unknown_keys_list_the_valid_ones(tmp_path):
    path = tmp_path / "servelens.toml"
    path.write_text('[paths]\nshared_dri = "/x"\n')
    with pytest.raises(ConfigError, match=r"unknown config key paths\.shared_dri") as err:
        load_config(path, env={})
    assert "shared_dir" in err.value.hint and "out_dir" in err.value.hint


def test_wrong_types_and_bad_files_are_named(tmp_path):
    path = tmp_path / "servelens.toml"
    path.write_text("[paths]\nout_dir = 3\n")
    with pytest.raises(ConfigError, match=r"paths\.out_dir has value 3"):
        load_config(path, env={})
    path.write_text("[paths\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})


def test_settings_that_are_not_finite_or_not_whole_or_missing_are_named():
    from dataclasses import dataclass

    from servelens.settings import build

    @dataclass(frozen=True)
    class Section:
        count: int
        share: float = 0.5

    assert build(Section, {"count": 3.0, "share": "0.25"}) == Section(count=3, share=0.25)  # a whole float, text
    for data, message in [({"count": 3, "share": float("nan")}, "share must be a finite number, not nan"),
                          ({"count": 3, "share": "inf"}, "share must be a finite number, not 'inf'"),  # the environment's text
                          ({"count": float("inf")}, "count must be a finite number"),
                          ({"count": 2.5}, "count must be a whole number, not 2.5"),
                          ({"count": 10**400}, "count must be a finite number"),
                          ({"share": 0.1}, "config key count is required")]:
        with pytest.raises(ConfigError, match=message):
            build(Section, data)


@pytest.mark.parametrize(("env", "message"), [
    ({"SERVELENS_INGEST__DEDUP_WINDOW_EVENTS": "0"}, "ingest.dedup_window_events must be at least 1"),  # retries stored twice
    ({"SERVELENS_INGEST__MAX_MESSAGE_BYTES": "-1"}, "ingest.max_message_bytes must be at least 1"),
    ({"SERVELENS_INGEST__FLUSH_INTERVAL_S": "0"}, "ingest.flush_interval_s must be above 0"),
    ({"SERVELENS_INGEST__HEARTBEAT_INTERVAL_MS": "20000"}, "must be below ingest.session_timeout_ms"),
    ({"SERVELENS_KAFKA__NUM_PARTITIONS": "0"}, "kafka.num_partitions must be at least 1"),
    ({"SERVELENS_KAFKA__CONNECT_TIMEOUT_S": "-5"}, "kafka.connect_timeout_s must be above 0"),
    ({"SERVELENS_LAKE__COMPACT_MIN_FILES": "1"}, "lake.compact_min_files must be at least 2"),
    ({"SERVELENS_DASHBOARD__PORT": "70000"}, "dashboard.port must be a TCP port"),
    ({"SERVELENS_DAGSTER__MAX_CONCURRENT_STEPS": "-1"}, "dagster.max_concurrent_steps must be at least 0"),
])
def test_out_of_range_settings_are_refused_where_they_are_set(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_missing_shared_data_says_where_it_looked_and_where_to_get_it(tmp_path):
    config = load_config(env={"SERVELENS_SHARED_DIR": str(tmp_path / "nowhere")})
    with pytest.raises(DataNotFoundError, match="shared data not found") as err:
        shared_dir(config)
    assert "SERVELENS_SHARED_DIR" in err.value.hint and "github.com/Azure/AzurePublicDataset" in err.value.hint


def test_the_bundled_data_is_found_in_place(shared):
    assert (shared / "traces" / "azure2023").is_dir() and (shared / "profiles").is_dir()
