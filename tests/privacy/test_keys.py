"""Keyed pseudonyms: deterministic per key, unrelated across keys and kinds, secrets never shown."""

from __future__ import annotations

import base64
import hashlib
import stat

import pytest

from privacy.keys import (
    ENV_KEY,
    KeyRing,
    demo_keyring,
    generate_keyring,
    load_keyring,
    new_key_id,
    rotate,
    write_keyfile,
)
from servelens.errors import ConfigError


def test_pseudonyms_are_keyed_deterministic_and_kind_separated(keyring):
    a = keyring.pseudonym("tn", "acme")
    assert a == keyring.pseudonym("tn", "acme") and a.startswith("tn_") and len(a) == 3 + 20
    assert a != keyring.pseudonym("us", "acme")  # a tenant and a user with one name are unrelated
    other = KeyRing("test-2", {"test-2": bytes(range(1, 33))})
    assert other.pseudonym("tn", "acme") != a
    # not an unsalted hash: a dictionary attacker hashing "acme" does not find it
    assert hashlib.sha256(b"acme").hexdigest()[:20] not in a
    assert hashlib.sha256(b"tn\0acme").hexdigest()[:20] not in a


def test_secrets_never_appear_in_repr(keyring):
    text = repr(keyring) + str(keyring)
    assert "test-1" in text and bytes(range(32)).hex() not in text and "secrets" not in text.replace("key_ids", "")


def test_missing_key_is_a_clear_start_up_error():
    with pytest.raises(ConfigError, match="no pseudonym key is configured") as err:
        load_keyring(None, env={})
    assert "servelens privacy keygen" in err.value.hint and ENV_KEY in err.value.hint


def test_key_from_environment_and_short_keys_refused():
    secret = base64.b64encode(bytes(range(32))).decode()
    ring = load_keyring(None, env={ENV_KEY: f"prod-7:{secret}"})
    assert ring.active_id == "prod-7"
    with pytest.raises(ConfigError, match="at least 32"):
        load_keyring(None, env={ENV_KEY: "k:" + base64.b64encode(b"short").decode()})
    with pytest.raises(ConfigError, match="<key id>:<base64"):
        load_keyring(None, env={ENV_KEY: "nocolon"})


def test_key_file_round_trip_rotation_and_permissions(tmp_path):
    path = tmp_path / "keys.toml"
    ring = generate_keyring("k1")
    write_keyfile(path, ring)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_keyring(path, env={})
    assert loaded.pseudonym("tn", "x") == ring.pseudonym("tn", "x")
    rotated = rotate(loaded, "k2")
    assert rotated.active_id == "k2" and set(rotated.secrets) == {"k1", "k2"}
    assert rotated.pseudonym("tn", "x") != ring.pseudonym("tn", "x")  # new key, new pseudonym
    assert ring.pseudonym("tn", "x") in rotated.pseudonyms_everywhere("tn", "x")  # old records still findable
    with pytest.raises(ConfigError, match="already exists"):
        rotate(rotated, "k1")


def test_bad_key_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_keyring(tmp_path / "none.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text('active = "a"\n')
    with pytest.raises(ConfigError, match=r"\[keys\] table"):
        load_keyring(bad, env={})


def test_demo_key_is_generated_once_and_reused(tmp_path):
    path = tmp_path / ".servelens" / "demo.toml"
    first, created = demo_keyring(path)
    again, created_again = demo_keyring(path)
    assert created and not created_again
    assert first.pseudonym("tn", "t") == again.pseudonym("tn", "t")


def test_integer_remap_keeps_equality_and_hides_the_value(keyring):
    assert keyring.remap_int("blk", 7) == keyring.remap_int("blk", 7)
    assert keyring.remap_int("blk", 7) != keyring.remap_int("blk", 8)
    assert 0 <= keyring.remap_int("blk", 7) < 2**63 and keyring.remap_int("blk", 7) != 7


def test_rotations_within_one_second_get_distinct_ids():
    ring = generate_keyring()
    twice = rotate(rotate(ring))  # three keys made within a few microseconds: the same second, mostly
    assert len(twice.secrets) == 3 and twice.active_id not in ring.secrets
    first = new_key_id()
    assert new_key_id({first}) in (f"{first}-2", new_key_id())  # suffixed, unless the second just turned
    assert new_key_id({first, f"{first}-2"}) in (f"{first}-3", new_key_id())


def test_a_rewritten_key_file_replaces_the_old_one_whole(tmp_path):
    path = tmp_path / "keys.toml"
    write_keyfile(path, generate_keyring("k1"))
    write_keyfile(path, rotate(load_keyring(path, env={}), "k2"))
    assert set(load_keyring(path, env={}).secrets) == {"k1", "k2"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["keys.toml"]  # no temporary file left beside it


def test_a_key_file_that_is_not_toml_says_what_one_holds(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\x00\x01 not toml")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_keyring(bad, env={})
    assert "privacy keygen" in err.value.hint and "backup" in err.value.hint
