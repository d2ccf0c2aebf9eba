"""Key files that are no key ring by their size, and key files in a Kubernetes Secret volume."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from privacy.keys import MAX_KEY_FILE_BYTES, load_keyring
from servelens.errors import ConfigError

SECRET = base64.b64encode(bytes(range(32))).decode()
RING = f'active = "a"\n[keys]\na = "{SECRET}"\n'


def _padded(path: Path, size: int) -> Path:
    """A valid key ring padded with a comment to exactly ``size`` bytes, mode 0600."""
    path.write_text(RING + "#" + "x" * (size - len(RING) - 2) + "\n")
    path.chmod(0o600)
    assert path.stat().st_size == size
    return path


def test_the_bound_is_one_mebibyte():
    assert MAX_KEY_FILE_BYTES == 1024 * 1024


def test_a_key_file_of_ten_megabytes_is_refused_with_its_size_and_the_bound(tmp_path):
    path = _padded(tmp_path / "keys.toml", 10_000_000)
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={}, warn=lambda message, hint: pytest.fail(message))
    assert err.value.message == (f"pseudonym key file {path} is 10,000,000 bytes, above the bound of 1,048,576 bytes "
                                 "(1 MiB)")
    assert "privacy.key_file" in err.value.hint and "servelens privacy keygen" in err.value.hint


def test_a_huge_key_file_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "sparse.toml"
    with path.open("wb") as fh:
        fh.truncate(64 * 1024**3)  # 64 GiB, sparse: reading it whole would never end
    path.chmod(0o600)
    with pytest.raises(ConfigError) as err:
        load_keyring(path, env={})
    assert err.value.message == f"pseudonym key file {path} is 68,719,476,736 bytes, above the bound of 1,048,576 bytes (1 MiB)"


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_an_endless_stream_is_refused_as_no_regular_file():
    with pytest.raises(ConfigError, match=r"^pseudonym key file /dev/zero is not a regular file \(a pipe, a device"):
        load_keyring("/dev/zero", env={}, warn=lambda message, hint: None)


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    # opening a pipe with no writer blocks: the key file is refused from its type before it is opened
    import os

    fifo = tmp_path / "keys.toml"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match=r"is not a regular file \(a pipe, a device or a socket\)"):
        load_keyring(str(fifo), env={}, warn=lambda message, hint: None)


def test_a_key_file_at_the_bound_loads(tmp_path):
    assert load_keyring(_padded(tmp_path / "keys.toml", MAX_KEY_FILE_BYTES), env={}).active_id == "a"


def _secret_volume(root: Path, mode: int) -> Path:
    """A key file laid out as the kubelet writes a Secret volume: ``keys.toml -> ..data/keys.toml``,
    ``..data -> ..<timestamp>``."""
    stamped = root / "..2026_12_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    (stamped / "keys.toml").write_text(RING)
    (stamped / "keys.toml").chmod(mode)
    (root / "..data").symlink_to(stamped.name)
    (root / "keys.toml").symlink_to("..data/keys.toml")
    return root / "keys.toml"


def test_a_secret_volumes_default_mode_warns_with_the_kubernetes_fix(tmp_path):
    path = _secret_volume(tmp_path / "secrets", 0o644)
    warnings: list[tuple[str, str]] = []
    assert load_keyring(path, env={}, warn=lambda message, hint: warnings.append((message, hint))).active_id == "a"
    assert warnings == [(f"pseudonym key file {path} is readable by group and others (mode 0644): whoever reads the "
                         "key can compute the pseudonym of any id they guess",
                         "in a Kubernetes Secret volume, set defaultMode: 0400 (a non-root container needs fsGroup, "
                         "which leaves 0440: docs/operations.md)")]


def test_a_file_below_a_secret_volume_folder_gets_the_kubernetes_fix_too(tmp_path):
    path = _secret_volume(tmp_path / "secrets", 0o666)
    with pytest.raises(ConfigError) as err:
        load_keyring(tmp_path / "secrets" / "..data" / "keys.toml", env={})
    assert err.value.hint.startswith("in a Kubernetes Secret volume, set defaultMode: 0400")
    assert path.exists()


def test_a_secret_volume_mounted_0400_loads_silently(tmp_path):
    path = _secret_volume(tmp_path / "secrets", 0o400)
    assert load_keyring(path, env={}, warn=lambda message, hint: pytest.fail(message)).active_id == "a"


def test_a_key_file_outside_a_secret_volume_keeps_the_chmod_fix(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(RING)
    os.chmod(path, 0o640)
    hints: list[str] = []
    load_keyring(path, env={}, warn=lambda message, hint: hints.append(hint))
    assert hints == [f"chmod 600 {path}"]
