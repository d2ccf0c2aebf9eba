"""Configuration and key-file input that used to crash, pass silently or mislead: each now a named error."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from click.testing import CliRunner

from privacy.config import MAX_BOUNDS, PrivacyConfig
from privacy.keys import generate_keyring, load_keyring, write_keyfile
from servelens.cli import cli
from servelens.config import load_config
from servelens.errors import ConfigError

CONFLICT = ("environment variables SERVELENS_LAKE__ROOT and SERVELENS_LAKE__ROOT__X conflict: they set lake.root and "
            "lake.root.x, and one setting cannot be both a value and a table holding another")


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env={"SERVELENS_PSEUDONYM_KEY": None, **(env or {})})


@pytest.mark.parametrize("env", [{"SERVELENS_LAKE__ROOT": "a", "SERVELENS_LAKE__ROOT__X": "1"},
                                 {"SERVELENS_LAKE__ROOT__X": "1", "SERVELENS_LAKE__ROOT": "a"}])
def test_a_variable_setting_a_key_inside_another_ones_value_is_refused_naming_both(env):
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert err.value.message == CONFLICT and err.value.hint == "unset one of them"


def test_two_spellings_of_one_variable_are_refused():
    with pytest.raises(ConfigError) as err:
        load_config(env={"SERVELENS_lake__root": "a", "SERVELENS_LAKE__ROOT": "b"})
    assert err.value.message == ("environment variables SERVELENS_LAKE__ROOT and SERVELENS_lake__root conflict: "
                                 "they both set lake.root")


@pytest.mark.parametrize("name", ["SERVELENS___X", "SERVELENS_LAKE__", "SERVELENS_LAKE____ROOT"])
def test_a_malformed_variable_name_is_named(name):
    with pytest.raises(ConfigError) as err:
        load_config(env={name: "1"})
    assert err.value.message == f"environment variable {name} is malformed: it has an empty name around '__'"
    assert err.value.hint == "a setting's variable is SERVELENS_<SECTION>__<KEY>, e.g. SERVELENS_LAKE__ROOT"


@pytest.mark.parametrize(("text", "kind"), [("5_0", "whole number"), (" 5 ", "whole number"), ("\u0665", "whole number"),
                                            ("5.0", "whole number"), ("1e3", "whole number")])
def test_a_whole_number_from_text_is_plain_decimal_digits(text, kind):
    with pytest.raises(ConfigError) as err:
        load_config(env={"SERVELENS_LAKE__COMPACT_MIN_FILES": text})
    assert err.value.message == f"config key lake.compact_min_files must be a {kind} in plain decimal digits, not {text!r}"
    assert err.value.hint == "write it like 50 or -3: no '_' and no blanks"


def test_plain_numbers_from_text_are_read():
    assert load_config(env={"SERVELENS_LAKE__COMPACT_MIN_FILES": "+50"}).lake.compact_min_files == 50
    assert load_config(env={"SERVELENS_PRIVACY__HYSTERESIS_MARGIN": "1e-1"}).privacy.hysteresis_margin == 0.1
    assert load_config(env={"SERVELENS_PRIVACY__HYSTERESIS_MARGIN": ".5"}).privacy.hysteresis_margin == 0.5
    with pytest.raises(ConfigError, match=r"privacy.hysteresis_margin must be a number in plain decimal digits, "
                                          r"not '0_5'") as err:
        load_config(env={"SERVELENS_PRIVACY__HYSTERESIS_MARGIN": "0_5"})
    assert err.value.hint == "write it like 0.25, -3 or 1e-3: no '_' and no blanks"


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("tenant_budget", "99999999999999999999999999999", "1e+29"),
    ("sketch_factor", "100000000000", "100000000000"),
    ("label_max_chars", "99999999999999999999999", "1e+23"),
    ("model_budget", "10001", "10001"),
])
def test_a_privacy_bound_beyond_its_limit_is_refused_by_name(key, value, shown):
    with pytest.raises(ConfigError) as err:
        load_config(env={f"SERVELENS_PRIVACY__{key.upper()}": value})
    assert err.value.message == f"privacy.{key} must be at most {MAX_BOUNDS[key]:,}, not {shown}"
    assert err.value.hint == f"leave it out for the default, {getattr(PrivacyConfig(), key)}"


def test_a_float_budget_from_toml_is_refused_and_the_limits_themselves_accepted(tmp_path):
    path = tmp_path / "servelens.toml"
    path.write_text("[privacy]\ntenant_budget = 1e300\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.message == "privacy.tenant_budget must be at most 100,000, not 1e+300"
    at_limits = PrivacyConfig(**MAX_BOUNDS)
    assert {key: getattr(at_limits, key) for key in MAX_BOUNDS} == MAX_BOUNDS


@pytest.mark.parametrize(("name", "key", "default"), [("SERVELENS_KAFKA__BOOTSTRAP_SERVERS", "kafka.bootstrap_servers",
                                                       "127.0.0.1:9092"), ("SERVELENS_PATHS__OUT_DIR", "paths.out_dir", "out")])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_broker_list_or_output_folder_is_refused_by_name(name, key, default, value):
    with pytest.raises(ConfigError) as err:
        load_config(env={name: value})
    assert err.value.message == f"{key} must not be empty" and err.value.hint == f"leave it out for the default, {default!r}"


def test_a_deeply_nested_config_file_and_a_folder_are_named(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a=" + "[" * 10_000 + "]" * 10_000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.message == f"config file {path} is not valid TOML: nested too deeply to read"
    with pytest.raises(ConfigError, match=f"^config file {tmp_path} is a folder, not a file"):
        load_config(tmp_path, env={})


# ------------------------------------------------------------------------------------ privacy commands


def _key(path: Path, mode: int) -> Path:
    write_keyfile(path, generate_keyring("k1"))
    path.chmod(mode)
    return path


def test_lookup_refuses_a_key_file_others_may_write(tmp_path):
    key = _key(tmp_path / "k.toml", 0o666)
    result = _run("privacy", "lookup", "abc", env={"SERVELENS_PRIVACY__KEY_FILE": str(key)})
    assert result.exit_code == 3 and result.stdout == ""
    assert result.stderr == (f"error: pseudonym key file {key} is writable by group and others (mode 0666): anyone who "
                             f"can replace the key decides the pseudonyms\n  hint: chmod 600 {key}, and check that the "
                             "keys in it are still yours\n")


def test_lookup_warns_of_a_key_file_others_may_read(tmp_path):
    key = _key(tmp_path / "k.toml", 0o644)
    result = _run("privacy", "lookup", "abc", env={"SERVELENS_PRIVACY__KEY_FILE": str(key)})
    expected = load_keyring(key, env={}, warn=lambda *_: None).pseudonym("rq", "abc")
    assert result.exit_code == 0 and result.stdout == f"{expected}\n"
    assert result.stderr.startswith(f"warning: pseudonym key file {key} is readable by group and others (mode 0644): "
                                    f"whoever reads the key can compute the pseudonym of any id they guess\n"
                                    f"  hint: chmod 600 {key}\n")


def test_rotate_through_a_link_rewrites_its_target(tmp_path):
    target = _key(tmp_path / "target.toml", 0o600)
    link = tmp_path / "link.toml"
    link.symlink_to(target.name)
    result = _run("privacy", "rotate", str(link), "--id", "k2")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"active pseudonym key is now k2 (2 keys in {link}, a link to {target})\n"
    assert link.is_symlink() and load_keyring(target, env={}).active_id == "k2"


@pytest.mark.parametrize("command", [["privacy", "keygen", "--out", "{dir}/new.toml", "--id", ""],
                                     ["privacy", "rotate", "{dir}/k.toml", "--id", ""]])
def test_an_empty_key_id_is_refused(tmp_path, command):
    key = _key(tmp_path / "k.toml", 0o600)
    before = key.read_bytes()
    result = _run(*[part.format(dir=tmp_path) for part in command])
    assert result.exit_code == 3 and result.stderr.startswith(
        "error: pseudonym key id '' must be 1-64 letters, digits, '.', '_' or '-'\n  hint: e.g. k2026-11;")
    assert key.read_bytes() == before and not (tmp_path / "new.toml").exists()


def test_keygen_names_the_path_it_could_not_write(tmp_path):
    (tmp_path / "plain").write_text("")
    result = _run("privacy", "keygen", "--out", str(tmp_path / "plain" / "k.toml"))
    assert result.exit_code == 3
    assert result.stderr == (f"error: cannot write {tmp_path}/plain/k.toml: {tmp_path}/plain is a file, not a folder, "
                             "so nothing can be created inside it\n"
                             "  hint: give --out a path in a folder (or in one still to be made)\n")


@pytest.mark.parametrize("command", [["privacy", "lookup", "abc"], ["privacy", "rotate", "{key}"]])
def test_a_deeply_nested_key_file_is_a_clear_error(tmp_path, command):
    key = tmp_path / "deep.toml"
    key.write_text("a=" + "[" * 10_000 + "]" * 10_000 + "\n")
    key.chmod(0o600)
    result = _run(*[part.format(key=key) for part in command], env={"SERVELENS_PRIVACY__KEY_FILE": str(key)})
    assert result.exit_code == 3
    assert result.stderr.startswith(f"error: pseudonym key file {key} is not valid TOML: nested too deeply to read\n"
                                    "  hint: a key file is")


def test_a_key_file_setting_naming_a_folder_says_so(tmp_path):
    result = _run("privacy", "lookup", "abc", env={"SERVELENS_PRIVACY__KEY_FILE": str(tmp_path)})
    assert result.exit_code == 3 and result.stderr == (
        f"error: pseudonym key file {tmp_path} is a folder, not a file\n  hint: privacy.key_file "
        "(SERVELENS_PRIVACY__KEY_FILE) names the key file itself, as `servelens privacy keygen --out FILE` writes it\n")


def test_an_env_conflict_is_a_clear_error_in_any_command(tmp_path):
    key = base64.b64encode(bytes(range(32))).decode()
    result = _run("privacy", "lookup", "abc", env={"SERVELENS_PSEUDONYM_KEY": f"k:{key}", "SERVELENS_LAKE__ROOT": "a",
                                                   "SERVELENS_LAKE__ROOT__X": "1"})
    assert result.exit_code == 3 and result.stderr == f"error: {CONFLICT}\n  hint: unset one of them\n"


@pytest.mark.parametrize("value", ["notaport:99999", "host", "broker:0", "a:1, :2", "a:９"])
def test_a_bootstrap_address_that_is_not_host_and_port_is_refused_before_any_connection(value):
    with pytest.raises(ConfigError) as err:
        load_config(env={"SERVELENS_KAFKA__BOOTSTRAP_SERVERS": value})
    assert err.value.message.startswith("kafka.bootstrap_servers: ") and "is not HOST:PORT with a port in 1-65535" in err.value.message


@pytest.mark.parametrize("value", ["127.0.0.1:9092", "broker-1:9092,broker-2:9093", "[::1]:9092", "kafka:65535"])
def test_host_and_port_lists_are_taken(value):
    assert load_config(env={"SERVELENS_KAFKA__BOOTSTRAP_SERVERS": value}).kafka.bootstrap_servers == value
