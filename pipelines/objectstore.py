"""The lake on object storage: where its settings and credentials come from, and how readers reach it.

A lake root is a local folder or an S3 URI (``s3://bucket/prefix``), on AWS S3 or on an
S3-compatible store (MinIO, Ceph, moto's server in the tests). The store's options are the
standard AWS variables (``STORAGE_KEYS``), read from the environment or from a file named by
``lake.storage_options_file`` (``KEY = "value"`` lines, TOML: a mounted secret), the file's values
winning. Nothing else is consulted: no instance metadata service, no ``~/.aws`` profile, so a
process without credentials fails at once with a clear error instead of probing the network.
``StorageOptions`` never shows a value in its ``repr`` or in an error: credentials are not logged.

Writers: delta-rs gets the options explicitly. Several writers of one table (ingest processes on
separate machines) are coordinated by S3's conditional writes: a commit creates
``_delta_log/<version>.json`` with ``If-None-Match: *``, so of two commits racing for one
version exactly one lands and the other is refused and retried against the new snapshot
(``pipelines.lake.Lake.commit``). That is delta-rs's default for S3 since 1.0; a store without
conditional writes must not have concurrent writers.

Readers: every DuckDB connection of ``pipelines.tables.connect`` gets pyarrow's S3 filesystem
registered for ``s3://`` (as an fsspec filesystem whose files are read positionally, thread by thread:
``PositionalReader``), so ``read_parquet`` over a table version's files works unchanged on object
storage. DuckDB's own ``httpfs`` and ``delta`` extensions are not
used: PyPI ships them only up to DuckDB 1.5 (``duckdb-extension-httpfs``), they would otherwise be
downloaded at run time, and DuckDB's automatic extension install is switched off.
"""

from __future__ import annotations

import os
import threading
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from servelens.errors import ConfigError

#: The options servelens passes to the store (the names delta-rs and the AWS tools use).
STORAGE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
                "AWS_ALLOW_HTTP")
SECRET_KEYS = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
#: The environment variable naming the options file (``lake.storage_options_file``).
FILE_ENV = "SERVELENS_LAKE__STORAGE_OPTIONS_FILE"
SCHEMES = ("s3://", "s3a://")


def is_remote(root: str) -> bool:
    """Whether a lake root (or a file URI) is on object storage rather than a local path."""
    return "://" in str(root) and not str(root).startswith("file://")


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """An object store's options; ``repr`` names the keys set, never a value."""

    values: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"StorageOptions(keys={[k for k, _ in self.values]})"

    __str__ = __repr__

    def as_dict(self) -> dict[str, str]:
        """The options as delta-rs takes them (``storage_options=``); pass on, never print."""
        options = dict(self.values)
        if "AWS_REGION" not in options and options:
            options["AWS_REGION"] = "us-east-1"  # S3-compatible stores ignore it; AWS needs one
        endpoint = options.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://") and "AWS_ALLOW_HTTP" not in options:
            options["AWS_ALLOW_HTTP"] = "true"
        return options

    def __bool__(self) -> bool:
        return bool(self.values)


def _read_file(path: str) -> dict[str, str]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"lake.storage_options_file {path} does not exist",
                          "point it at a TOML file of AWS_* keys (a mounted secret), or unset it") from None
    except tomllib.TOMLDecodeError as exc:  # the message quotes no value of the file
        raise ConfigError(f"lake.storage_options_file {path} is not valid TOML (line {exc.lineno})",
                          'write one KEY = "value" line per option') from None
    unknown = sorted(set(data) - set(STORAGE_KEYS))
    if unknown:
        raise ConfigError(f"lake.storage_options_file {path} sets unknown key {unknown[0]}",
                          f"valid keys: {', '.join(STORAGE_KEYS)}")
    return {k: str(v) for k, v in data.items()}


def storage_options(options_file: str | None = None, environ: Mapping[str, str] | None = None) -> StorageOptions:
    """The store's options: ``STORAGE_KEYS`` from the environment (``AWS_DEFAULT_REGION`` as the
    region when ``AWS_REGION`` is unset), overlaid by ``options_file`` (default: the file named by
    ``$SERVELENS_LAKE__STORAGE_OPTIONS_FILE``)."""
    environ = os.environ if environ is None else environ
    values = {k: environ[k] for k in STORAGE_KEYS if environ.get(k)}
    if "AWS_REGION" not in values and environ.get("AWS_DEFAULT_REGION"):
        values["AWS_REGION"] = environ["AWS_DEFAULT_REGION"]
    options_file = options_file or environ.get(FILE_ENV)
    if options_file:
        values.update(_read_file(options_file))
    return StorageOptions(tuple(sorted(values.items())))


def check_root(root: str, options: StorageOptions) -> None:
    """A clear error for a lake root no reader can reach: another scheme, or S3 without credentials."""
    if not is_remote(root):
        return
    if not root.startswith(SCHEMES):
        raise ConfigError(f"lake.root {root} is on a store servelens cannot read",
                          "use a local folder or an S3-compatible store: s3://bucket/prefix")
    if "AWS_ACCESS_KEY_ID" not in dict(options.values):
        raise ConfigError(f"lake.root {root} is on S3 but no credentials are configured",
                          "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for MinIO or "
                          f"another S3-compatible store) in the environment or in the file named by {FILE_ENV}")


def arrow_filesystem(options: StorageOptions):
    """pyarrow's S3 filesystem with these options (paths are ``bucket/key``)."""
    import pyarrow.fs as pafs

    values = options.as_dict()
    return pafs.S3FileSystem(
        access_key=values.get("AWS_ACCESS_KEY_ID"), secret_key=values.get("AWS_SECRET_ACCESS_KEY"),
        session_token=values.get("AWS_SESSION_TOKEN"), region=values.get("AWS_REGION"),
        endpoint_override=values.get("AWS_ENDPOINT_URL"),
        scheme="http" if values.get("AWS_ENDPOINT_URL", "").startswith("http://") else "https",
    )


class PositionalReader:
    """A file several threads read at once: each thread's position is its own and every read is positional
    (pyarrow's ``read_at``, a ranged GET on S3), so one thread's seek never moves another's read.

    DuckDB reads a Parquet file's row groups on several threads through one handle of a registered Python
    filesystem, each read a ``seek`` then a ``read``; pyarrow lets go of the GIL while it reads, so on a shared
    position another thread's seek could land in between and the read return another part of the file (seen
    7 Dec 2026 on moto's S3 server: 12 of 30 four-thread scans failed to decode, ``TProtocolException``,
    ``Variable-length int over 10 bytes``; ``tests/pipelines/test_objectstore.py``)."""

    def __init__(self, file) -> None:
        self._file = file
        self._size = file.size()
        self._local = threading.local()
        self.closed = False

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.tell(), os.SEEK_END: self._size}[whence]
        self._local.position = base + offset
        return self._local.position

    def tell(self) -> int:
        return getattr(self._local, "position", 0)

    def read(self, size: int | None = -1) -> bytes:
        position = self.tell()
        left = max(0, self._size - position)
        size = left if size is None or size < 0 else min(size, left)
        data = self._file.read_at(size, position) if size else b""
        self._local.position = position + len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        self._file.close()
        self.closed = True

    def __enter__(self) -> PositionalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsspec_filesystem(options: StorageOptions):
    """``arrow_filesystem`` as an fsspec filesystem answering for ``s3://`` (what DuckDB registers); its files
    opened for reading are ``PositionalReader``s."""
    from fsspec.implementations.arrow import ArrowFSWrapper

    class S3(ArrowFSWrapper):
        protocol = ("s3", "s3a")
        root_marker = ""

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            if mode != "rb":
                return super()._open(path, mode, block_size, **kwargs)
            return PositionalReader(self.fs.open_input_file(self._strip_protocol(path)))

    return S3(arrow_filesystem(options))


def register(con, options: StorageOptions) -> None:
    """Let a DuckDB connection read ``s3://`` through pyarrow (nothing to do without options)."""
    if options:
        con.register_filesystem(fsspec_filesystem(options))


def open_input(path: str, options: StorageOptions):
    """``(filesystem, path)`` for pyarrow readers: the local path as is, an S3 URI through pyarrow's S3."""
    if not is_remote(path):
        return None, path
    return arrow_filesystem(options), path.split("://", 1)[1]
