"""The key ring loader against hostile or careless key files: modes, links, deep or odd TOML, weak and copied keys."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from privacy.keys import ENV_KEY, generate_keyring, load_keyring, rotate, write_keyfile
from servelens.errors import ConfigError, ServelensError

SECRET = base64.b64encode(bytes(range(32))).decode()


def _keyfile(path: Path, keys: str, mode: int = 0o600) -> Path:
    path.write_text(f'active = "a"\n[keys]\n{keys}\n')
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("mode", "who"), [(0o620, "group"), (0o602, "others"), (0o666, "group and others"),
                                           (0o622, "group and others")])
def test_a_key_file_others_may_write_is_refused_with_the_fix(tmp_path, mode, who):
    path = _keyfile(tmp_path / "k.toml", f'a = "{SECRET}"', mode)
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={}, warn=lambda message, hint: pytest.fail(message))
    assert err.value.message == (f"pseudonym key file {path} is writable by {who} (mode {mode:04o}): "
                                 "anyone who can replace the key decides the pseudonyms")
    assert err.value.hint == f"chmod 600 {path}, and check that the keys in it are still yours"


@pytest.mark.parametrize(("mode", "who"), [(0o640, "group"), (0o604, "others"), (0o644, "group and others"),
                                           (0o444, "group and others")])
def test_a_key_file_others_may_read_is_used_with_a_warning(tmp_path, mode, who):
    path = _keyfile(tmp_path / "k.toml", f'a = "{SECRET}"', mode)
    warnings: list[tuple[str, str]] = []
    ring = load_keyring(path, env={}, warn=lambda message, hint: warnings.append((message, hint)))
    assert ring.active_id == "a"
    assert warnings == [(f"pseudonym key file {path} is readable by {who} (mode {mode:04o}): whoever reads the key "
                         "can compute the pseudonym of any id they guess", f"chmod 600 {path}")]


def test_a_private_key_file_loads_silently_and_the_default_warning_goes_to_stderr_once(tmp_path, capsys):
    private = _keyfile(tmp_path / "private.toml", f'a = "{SECRET}"', 0o600)
    assert load_keyring(private, env={}).active_id == "a"
    assert capsys.readouterr().err == ""
    shared = _keyfile(tmp_path / "shared key.toml", f'a = "{SECRET}"', 0o644)
    load_keyring(shared, env={})
    load_keyring(shared, env={})  # a dashboard loads its ring on every page: one warning
    assert capsys.readouterr().err == (
        f"warning: pseudonym key file {shared} is readable by group and others (mode 0644): whoever reads the key "
        f"can compute the pseudonym of any id they guess\n  hint: chmod 600 '{shared}'\n")


def test_the_mode_checked_is_the_link_targets(tmp_path):
    target = _keyfile(tmp_path / "target.toml", f'a = "{SECRET}"', 0o666)
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=f"pseudonym key file {link} is writable by group and others"):
        load_keyring(link, env={})


def test_a_rewritten_link_keeps_pointing_at_its_rewritten_target(tmp_path):
    target = tmp_path / "secrets" / "keys.toml"
    write_keyfile(target, generate_keyring("t1"))
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    write_keyfile(link, rotate(load_keyring(link, env={}), "t2"))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_keyring(target, env={}).active_id == "t2" and set(load_keyring(target, env={}).secrets) == {"t1", "t2"}
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["keys.toml"]  # no temporary file left


def test_a_key_file_that_cannot_be_written_is_named_as_given(tmp_path):
    (tmp_path / "plain").write_text("")
    path = tmp_path / "plain" / "keys.toml"
    with pytest.raises(ServelensError) as err:
        write_keyfile(path, generate_keyring("k1"))
    assert err.value.message == f"cannot write the pseudonym key file {path}: File exists"
    assert err.value.hint == "check that its folder can be created and written by you"


def test_a_deeply_nested_key_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a=" + "[" * 10_000 + "]" * 10_000 + "\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={})
    assert err.value.message == f"pseudonym key file {path} is not valid TOML: nested too deeply to read"
    assert "servelens privacy keygen --out FILE" in err.value.hint


def test_a_folder_for_a_key_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_keyring(tmp_path, env={})
    assert err.value.message == f"pseudonym key file {tmp_path} is a folder, not a file"
    assert err.value.hint == ("privacy.key_file (SERVELENS_PRIVACY__KEY_FILE) names the key file itself, "
                              "as `servelens privacy keygen --out FILE` writes it")


@pytest.mark.parametrize(("value", "kind"), [("12345", "number"), ("{x = 1}", "table"), ("true", "boolean"),
                                             ("[1]", "list")])
def test_a_key_that_is_no_string_says_what_it_is_with_a_hint(tmp_path, value, kind):
    path = _keyfile(tmp_path / "k.toml", f"a = {value}")
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={})
    assert err.value.message == f"pseudonym key 'a' in {path} is a {kind}, not a base64 string"
    assert err.value.hint.startswith('a key file is `active = "<id>"` and a [keys] table of "<id>" = "<base64 secret>"')


def test_a_key_that_is_not_base64_has_a_hint(tmp_path):
    path = _keyfile(tmp_path / "k.toml", 'a = "@@@"')
    with pytest.raises(ConfigError, match="is not base64") as err:
        load_keyring(path, env={})
    assert "servelens privacy keygen --out FILE" in err.value.hint
    with pytest.raises(ConfigError, match=r"'e' in \$SERVELENS_PSEUDONYM_KEY is not base64") as err:
        load_keyring(None, env={ENV_KEY: "e:@@@"})
    assert err.value.hint == "set $SERVELENS_PSEUDONYM_KEY=<key id>:<base64 of 32+ random bytes>"


@pytest.mark.parametrize("byte", [0, 0xFF])
def test_a_key_of_one_repeated_byte_is_refused(tmp_path, byte):
    weak = base64.b64encode(bytes([byte]) * 32).decode()
    path = _keyfile(tmp_path / "k.toml", f'a = "{weak}"')
    message = f"pseudonym key 'a' in {path} is one byte repeated ({byte:02x}), not a random secret"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_keyring(path, env={})
    with pytest.raises(ConfigError, match=r"pseudonym key 'z' in \$SERVELENS_PSEUDONYM_KEY is one byte repeated"):
        load_keyring(None, env={ENV_KEY: f"z:{weak}"})


def test_two_key_ids_sharing_one_secret_are_refused(tmp_path):
    path = _keyfile(tmp_path / "k.toml", f'a = "{SECRET}"\nb = "{base64.b64encode(bytes(range(1, 33))).decode()}"\n'
                                         f'c = "{SECRET}"')
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={})
    assert err.value.message == (f"pseudonym keys 'a' and 'c' in {path} have the same secret: "
                                 "a rotation to a copy changes no pseudonym")
    assert err.value.hint == f"restore the file from its backup, or add a fresh key with `servelens privacy rotate {path}`"


def test_an_empty_key_id_is_refused_not_replaced():
    for make in (lambda: generate_keyring(""), lambda: rotate(generate_keyring("k1"), "")):
        with pytest.raises(ConfigError, match="pseudonym key id '' must be 1-64 letters") as err:
            make()
        assert "when --id is left out" in err.value.hint
    assert generate_keyring(None).active_id.startswith("k")  # left out: an id from the time
