"""Keyed pseudonyms: HMAC-SHA256 under a rotatable key ring.

An identifier becomes ``<kind>_<hex>``, the first bytes of ``HMAC-SHA256(key, kind || 0 || value)``.
Unsalted hashes fall to a dictionary attack (anyone can hash every plausible tenant name); a keyed
hash does not, as long as the key stays secret. The kind is mixed in so that a tenant and a user
with the same name get unrelated pseudonyms.

The key ring is a TOML file (``servelens privacy keygen``)::

    active = "k2026-11"
    [keys]
    k2026-11 = "<base64, 32 bytes or more>"
    k2026-05 = "<base64>"   # retired: kept so a tenant can still find its older records

or one key in ``$SERVELENS_PSEUDONYM_KEY`` as ``<key id>:<base64>``. A key file that group or others
may write is refused, one they may read is used with a warning (both say ``chmod 600 FILE``, or, in a
Kubernetes Secret volume, its ``defaultMode``); a key file over ``MAX_KEY_FILE_BYTES``, a key of one
repeated byte, and one secret under two ids, are refused. Every sanitized record carries
the id of the key that produced it. Rotation starts a new pseudonym for every identifier: records
before and after cannot be linked by pseudonym alone, which is the point of rotating.
"""

from __future__ import annotations

import base64
import hmac
import os
import re
import secrets
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from servelens.errors import ConfigError, ServelensError
from servelens.settings import read_toml

ENV_KEY = "SERVELENS_PSEUDONYM_KEY"
MIN_KEY_BYTES = 32
#: The largest key file read, bytes (1 MiB). `servelens privacy keygen` writes about 100 bytes and each rotation
#: adds about 70: thousands of rotations fit; a larger file is not a key ring and is refused before it is read.
MAX_KEY_FILE_BYTES = 1024 * 1024
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _decode_secret(key_id: str, text: object, where: str, hint: str) -> bytes:
    if not isinstance(text, str):
        raise ConfigError(f"pseudonym key {key_id!r} in {where} is a {_toml_type(text)}, not a base64 string", hint)
    try:
        secret = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ConfigError(f"pseudonym key {key_id!r} in {where} is not base64", hint) from None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(
            f"pseudonym key {key_id!r} in {where} has {len(secret)} bytes; at least {MIN_KEY_BYTES} are required",
            "create a key with `servelens privacy keygen --out FILE`",
        )
    if len(set(secret)) == 1:
        raise ConfigError(f"pseudonym key {key_id!r} in {where} is one byte repeated ({secret[:1].hex()}), not a "
                          "random secret: anyone can compute its pseudonyms",
                          "create a key with `servelens privacy keygen --out FILE`")
    return secret


def _toml_type(value: object) -> str:
    return {bool: "boolean", int: "number", float: "number", dict: "table", list: "list"}.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The pseudonym keys: one active key that signs new records, older ones kept for lookups."""

    active_id: str
    secrets: Mapping[str, bytes] = field(repr=False)
    _macs: dict[str, hmac.HMAC] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        # a keyed HMAC state per key, copied per message: half the cost of a fresh HMAC each time
        # (OpenSSL's state object itself where the hmac module exposes it: no Python wrapper per call)
        for key_id, secret in self.secrets.items():
            mac = hmac.new(secret, digestmod="sha256")
            self._macs[key_id] = getattr(mac, "_hmac", None) or mac
        if self.active_id not in self.secrets:
            raise ConfigError(f"the active pseudonym key {self.active_id!r} is not among the keys {sorted(self.secrets)}",
                              "`active` names the key that signs new records: one of the ids in [keys]")
        for key_id in self.secrets:
            if not _KEY_ID.match(key_id):
                raise ConfigError(f"pseudonym key id {key_id!r} must be 1-64 letters, digits, '.', '_' or '-'",
                                  "e.g. k2026-11; `servelens privacy keygen` and `rotate` make one from the time "
                                  "when --id is left out")

    def __repr__(self) -> str:  # secrets never appear in logs or reports
        return f"KeyRing(active_id={self.active_id!r}, key_ids={sorted(self.secrets)!r})"

    def digest(self, kind: str, value: str, key_id: str | None = None) -> bytes:
        """HMAC-SHA256 of ``kind || 0 || value`` under the active (or the named) key."""
        mac = self._macs[key_id or self.active_id].copy()
        mac.update(kind.encode() + b"\0" + value.encode("utf-8", "surrogatepass"))
        return mac.digest()

    def pseudonym(self, kind: str, value: str, *, hex_chars: int = 20, key_id: str | None = None) -> str:
        """``<kind>_<hex>``: a stable, keyed, non-reversible stand-in for ``value``."""
        return f"{kind}_{self.digest(kind, value, key_id).hex()[:hex_chars]}"

    def pseudonyms(self, kind: str, values: list[str | None], *, hex_chars: int = 20) -> list[str | None]:
        """``pseudonym`` over many values under the active key (the sanitizer's hot loop)."""
        base, prefix, tag = self._macs[self.active_id], kind.encode() + b"\0", kind + "_"
        out: list[str | None] = []
        for value in values:
            if value is None:
                out.append(None)
                continue
            mac = base.copy()
            mac.update(prefix + value.encode("utf-8", "surrogatepass"))
            out.append(tag + mac.hexdigest()[:hex_chars])
        return out

    def pseudonyms_everywhere(self, kind: str, value: str, *, hex_chars: int = 20) -> frozenset[str]:
        """``value``'s pseudonym under every key of the ring (to find one tenant's records across rotations)."""
        return frozenset(self.pseudonym(kind, value, hex_chars=hex_chars, key_id=k) for k in self.secrets)

    def remap_int(self, kind: str, value: int) -> int:
        """A keyed, equality-preserving replacement for an integer id (a 63-bit non-negative int)."""
        mac = self._macs[self.active_id].copy()
        mac.update(kind.encode() + b"\0" + value.to_bytes(8, "big", signed=True))
        return int.from_bytes(mac.digest()[:8], "big") >> 1


def load_keyring(path: str | Path | None = None, env: Mapping[str, str] | None = None, *,
                 warn: Callable[[str, str], None] | None = None) -> KeyRing:
    """The key ring from a TOML key file or ``$SERVELENS_PSEUDONYM_KEY``; a clear error if neither. A key
    file writable by group or others is refused; one readable by them is used after a ``warn(message,
    hint)`` (by default a ``warning:`` line on stderr, once per file and mode)."""
    env = os.environ if env is None else env
    if path:
        return _load_keyfile(Path(path), warn or _warn_on_stderr)
    if env.get(ENV_KEY):
        key_id, sep, text = env[ENV_KEY].partition(":")
        if not sep:
            raise ConfigError(f"${ENV_KEY} must look like <key id>:<base64 secret>", _ENV_HINT)
        return KeyRing(key_id, {key_id: _decode_secret(key_id, text, f"${ENV_KEY}", _ENV_HINT)})
    raise ConfigError(
        "no pseudonym key is configured: servelens will not store tenant data without one",
        f"set privacy.key_file (SERVELENS_PRIVACY__KEY_FILE) to a key file made by `servelens privacy keygen --out FILE`, "
        f"or {_ENV_HINT}",
    )


def _load_keyfile(path: Path, warn: Callable[[str, str], None]) -> KeyRing:
    data = read_toml(path, "pseudonym key file", _KEY_FILE_HINT,
                     missing_hint=f"create it with `servelens privacy keygen --out {path}`",
                     folder_hint="privacy.key_file (SERVELENS_PRIVACY__KEY_FILE) names the key file itself, "
                                 "as `servelens privacy keygen --out FILE` writes it",
                     max_bytes=MAX_KEY_FILE_BYTES,
                     size_hint="a key ring from `servelens privacy keygen` is about 100 bytes, plus about 70 a "
                               "rotation: check that privacy.key_file (SERVELENS_PRIVACY__KEY_FILE) names the key file")
    _check_mode(path, warn)
    keys = data.get("keys")
    if not isinstance(keys, dict) or not keys or not isinstance(data.get("active"), str):
        raise ConfigError(f"pseudonym key file {path} needs `active = \"<id>\"` and a [keys] table", _KEY_FILE_HINT)
    ring = KeyRing(data["active"], {k: _decode_secret(k, v, str(path), _KEY_FILE_HINT) for k, v in keys.items()})
    by_secret: dict[bytes, str] = {}
    for key_id, secret in ring.secrets.items():
        if secret in by_secret:
            raise ConfigError(f"pseudonym keys {by_secret[secret]!r} and {key_id!r} in {path} have the same secret: "
                              "a rotation to a copy changes no pseudonym",
                              f"restore the file from its backup, or add a fresh key with `servelens privacy rotate {path}`")
        by_secret[secret] = key_id
    return ring


def _check_mode(path: Path, warn: Callable[[str, str], None]) -> None:
    """Refuse a key file that group or others may write (whoever replaces the key decides the pseudonyms); warn
    of one they may read (whoever reads the key can compute the pseudonym of any guessed id)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    fix = _KUBERNETES_FIX if _in_kubernetes_volume(path) else f"chmod 600 {shlex.quote(str(path))}"
    if mode & 0o022:
        raise ConfigError(f"pseudonym key file {path} is writable by {_who(mode & 0o022)} (mode {mode:04o}): "
                          "anyone who can replace the key decides the pseudonyms",
                          f"{fix}, and check that the keys in it are still yours")
    if mode & 0o044:
        warn(f"pseudonym key file {path} is readable by {_who(mode & 0o044)} (mode {mode:04o}): whoever reads the "
             "key can compute the pseudonym of any id they guess", fix)


#: The fix for a key file's mode in a Kubernetes Secret volume, where chmod cannot change it (docs/operations.md).
_KUBERNETES_FIX = ("in a Kubernetes Secret volume, set defaultMode: 0400 (a non-root container needs fsGroup, "
                   "which leaves 0440: docs/operations.md)")


def _in_kubernetes_volume(path: Path) -> bool:
    """Whether ``path`` lies in a volume Kubernetes writes (a Secret, a ConfigMap, a projected volume): its files
    are links through a ``..data`` link at the volume's top, and their mode is the volume's ``defaultMode``."""
    folder = path.absolute().parent
    return "..data" in path.parts or any((d / "..data").is_symlink() for d in (folder, *folder.parents))


def _who(bits: int) -> str:
    """``group``, ``others`` or ``group and others``, for the group and other bits of a mode (read or write)."""
    return " and ".join(who for who, mask in (("group", 0o070), ("others", 0o007)) if bits & mask)


_warned: set[tuple[str, str]] = set()


def _warn_on_stderr(message: str, hint: str) -> None:
    """A warning line and its hint on stderr, once per message (a dashboard loads its ring on every page)."""
    if (message, hint) not in _warned:
        _warned.add((message, hint))
        print(f"warning: {message}\n  hint: {hint}", file=sys.stderr)


#: How ``$SERVELENS_PSEUDONYM_KEY`` is written.
_ENV_HINT = f"set ${ENV_KEY}=<key id>:<base64 of {MIN_KEY_BYTES}+ random bytes>"

#: What a key file holds, for the errors that find it malformed.
_KEY_FILE_HINT = ('a key file is `active = "<id>"` and a [keys] table of "<id>" = "<base64 secret>", as '
                  "`servelens privacy keygen --out FILE` writes; restore the file from its backup rather than "
                  "making a new key, or the lake's pseudonyms can no longer be looked up")


def new_key_id(taken: Collection[str] = ()) -> str:
    """A key id from the current UTC second; ``-2``, ``-3``, ... appended while it is in ``taken``
    (two rotations within one second)."""
    base = "k" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    key_id, n = base, 1
    while key_id in taken:
        n += 1
        key_id = f"{base}-{n}"
    return key_id


def write_keyfile(path: str | Path, ring: KeyRing) -> None:
    """Write a key ring as TOML, readable by its owner only. The ring goes to a temporary file beside
    ``path`` that then replaces it, so a crash mid-write (a rotation) leaves the old ring whole. A
    symbolic link (a mounted secret) keeps pointing at its target, which is what is rewritten."""
    target = Path(path).resolve()
    lines = [f'active = "{ring.active_id}"', "", "[keys]"]
    lines += [f'"{k}" = "{base64.b64encode(v).decode()}"' for k, v in ring.secrets.items()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _replace(target, "\n".join(lines) + "\n")
    except OSError as exc:
        raise ServelensError(f"cannot write the pseudonym key file {path}: {exc.strerror or exc}",
                             "check that its folder can be created and written by you") from None


def _replace(target: Path, text: str) -> None:
    """Replace ``target`` whole by a file of ``text``, mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def generate_keyring(key_id: str | None = None) -> KeyRing:
    """One fresh key; ``key_id`` None for one from the current time (an empty id is refused, not replaced)."""
    key_id = new_key_id() if key_id is None else key_id
    return KeyRing(key_id, {key_id: secrets.token_bytes(MIN_KEY_BYTES)})


def rotate(ring: KeyRing, key_id: str | None = None) -> KeyRing:
    """A ring with a fresh active key; the old keys stay for lookups."""
    key_id = new_key_id(ring.secrets) if key_id is None else key_id
    if key_id in ring.secrets:
        raise ConfigError(f"pseudonym key id {key_id!r} already exists", "choose another --id, or leave it out for a fresh one")
    return KeyRing(key_id, {**ring.secrets, key_id: secrets.token_bytes(MIN_KEY_BYTES)})


def demo_keyring(path: Path) -> tuple[KeyRing, bool]:
    """The embedded demo's local key: loaded if present, else generated and stored. (ring, created)"""
    if path.is_file():
        return load_keyring(path), False
    ring = generate_keyring("demo")
    write_keyfile(path, ring)
    return ring, True
