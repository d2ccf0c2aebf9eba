"""The emitter SDK: an engine hands lifecycle events to Kafka without ever waiting for Kafka.

``Emitter.emit(event)`` puts the event in a bounded in-process buffer and returns (a few hundred
nanoseconds); when the buffer is full the event is dropped and counted, never waited for. One
background thread encodes the buffered events (``schemas.wire.encode_event``) and hands them to a
kafka-python ``KafkaProducer``, which batches (``linger_ms``, ``batch_bytes``), compresses (zstd by
default) and retries. The message key is the event's ``request_id`` (``instance_id``, then
``engine_id``, for engine-level events), so one request's events stay in one partition, in order.

Nothing is lost silently. ``stats()`` returns the counts: every emitted event ends up sent, failed
(a delivery error, or still undelivered at ``close``), or is still pending; events refused because
the buffer was full are ``num_dropped``. A broker that goes away is reconnected to by kafka-python;
events produced meanwhile are retried until ``delivery_timeout_ms`` and then count as failed.

The constructor does no I/O. ``start()`` connects (bounded by ``connect_timeout_s``; an unreachable
broker raises ``BrokerUnreachableError`` with a hint) and starts the background thread; events
emitted before ``start()`` wait in the buffer. In a vLLM-style engine::

    emitter = Emitter.from_config(config.kafka).start()      # once, at engine start-up
    ...
    emitter.emit(RequestArrived(...))                         # frontend received the request
    while engine.has_work():                                  # the step loop
        outputs = engine.step()
        emitter.emit(StepExecuted(...))                       # one emit per lifecycle point,
        for out in outputs:                                   # never flush() inside the loop
            emitter.emit(FirstToken(...) if out.first else TokensDelivered(...))
            if out.finished:
                emitter.emit(RequestFinished(...))
    ...
    emitter.close(timeout_s=10)                               # at shutdown: deliver what is left
    log.info("events: %s", emitter.stats())

Keep event construction cheap in the loop (plain values, ``time.time_ns()``); encoding happens on
the background thread. That thread shares the GIL with the engine: encoding and kafka-python's
``send`` take some 35 us of CPU per event on a slow core (``benchmarks/emit.py``: ~24,000 events/s
end to end), so budget for it, and raise ``max_buffered_events`` for bursts above that rate.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pipelines.kafka_config import COMPRESSION_PACKAGES, BrokerUnreachableError, KafkaConfig
from schemas.events import Event, event_as_dict
from schemas.validate import validate_record
from schemas.wire import encode_event
from servelens.errors import ConfigError, ServelensError

if TYPE_CHECKING:
    import pyarrow as pa

_STOP = object()  # queue sentinel: the background thread exits when it reads it


@dataclass(frozen=True, slots=True)
class EmitterStats:
    """The emitter's counts. ``num_emitted == num_sent + num_failed + num_pending`` always holds."""

    num_emitted: int  # accepted into the buffer
    num_sent: int  # acknowledged by the broker
    num_failed: int  # delivery error, encoding error, or undelivered at close
    num_dropped: int  # refused by emit() because the buffer was full (or the emitter closed)
    num_pending: int  # buffered, or handed to the producer and not yet acknowledged
    last_error: str | None  # the most recent failure, for logs


class InvalidEventError(ServelensError, ValueError):
    """``Emitter(strict=True).emit`` was given an event that ingest would not accept."""


def check_event(event: Event, now_ns: int, max_future_skew_ns: int = 3600 * 10**9) -> list[str]:
    """What ingest would refuse in ``event`` (the contract's types, ranges and rules, as ``schemas.validate``
    checks them, and a timestamp more than ``max_future_skew_ns`` after ``now_ns``), each as a line; empty when
    it is valid."""
    if not isinstance(event, Event):
        return [f"$: not a lifecycle event but a {type(event).__name__}"]
    result = validate_record({k: v for k, v in event_as_dict(event).items() if v is not None})
    problems = [e.render() for e in result.errors]
    ts = getattr(event, "ts_ns", None)
    if isinstance(ts, int) and ts > now_ns + max_future_skew_ns:
        problems.append(f"$.ts_ns: clock skew: {(ts - now_ns) / 1e9:,.0f} s ahead of this clock (ingest accepts at most "
                        f"{max_future_skew_ns / 1e9:,.0f} s: ingest.max_future_skew_s; ts_ns is UTC epoch nanoseconds)")
    return problems


def event_key(event: Event) -> bytes:
    """The Kafka message key: request id, else instance id, else engine id (UTF-8)."""
    return (event.request_id or event.instance_id or event.engine_id).encode()


def _check_options(compression: str, max_buffered_events: int, acks: str) -> None:
    """Refuse an unknown codec or acks setting, and an empty buffer."""
    if compression not in COMPRESSION_PACKAGES:
        raise ConfigError(
            f"unknown compression {compression!r}", f"valid codecs: {', '.join(COMPRESSION_PACKAGES)}"
        )
    if max_buffered_events < 1:
        raise ConfigError(f"max_buffered_events must be >= 1, got {max_buffered_events}")
    if acks not in ("all", "1", "0", "-1"):
        raise ConfigError(f"unknown acks {acks!r}", "valid values: all, 1, 0")


def _producer_config(bootstrap_servers: str, *, client_id: str, compression: str, linger_ms: int, batch_bytes: int,
                     delivery_timeout_ms: int, max_block_ms: int, reconnect_backoff_ms: int,
                     reconnect_backoff_max_ms: int, acks: str, enable_idempotence: bool,
                     connect_timeout_s: float) -> dict[str, Any]:
    """The Kafka producer's settings for the emitter's options."""
    return {
        "bootstrap_servers": bootstrap_servers,
        "client_id": client_id,
        "compression_type": None if compression == "none" else compression,
        "linger_ms": linger_ms,
        "batch_size": batch_bytes,
        "delivery_timeout_ms": delivery_timeout_ms,
        "request_timeout_ms": min(30_000, max(1, delivery_timeout_ms - linger_ms)),
        "max_block_ms": max_block_ms,
        "reconnect_backoff_ms": reconnect_backoff_ms,
        "reconnect_backoff_max_ms": max(reconnect_backoff_ms, reconnect_backoff_max_ms),
        "acks": "all" if acks in ("all", "-1") else int(acks),
        "enable_idempotence": enable_idempotence,
        # one request in flight per broker: a retried batch cannot overtake a later one, so a
        # request's events stay in order even without the idempotent producer
        "max_in_flight_requests_per_connection": 1,
        "bootstrap_timeout_ms": int(connect_timeout_s * 1000),
    }


class Emitter:
    """Non-blocking producer of lifecycle events to one Kafka topic (see the module docstring)."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        client_id: str = "servelens",
        max_buffered_events: int = 100_000,
        compression: str = "zstd",
        linger_ms: int = 10,
        batch_bytes: int = 262_144,
        connect_timeout_s: float = 5.0,
        delivery_timeout_ms: int = 30_000,
        max_block_ms: int = 5_000,
        reconnect_backoff_ms: int = 50,
        reconnect_backoff_max_ms: int = 1_000,
        acks: str = "all",
        enable_idempotence: bool = False,
        strict: bool = False,
        max_future_skew_s: float = 3600.0,
    ) -> None:
        _check_options(compression, max_buffered_events, acks)
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.max_buffered_events = max_buffered_events
        self.connect_timeout_s = connect_timeout_s
        self._producer_config: dict[str, Any] = _producer_config(
            bootstrap_servers, client_id=client_id, compression=compression, linger_ms=linger_ms,
            batch_bytes=batch_bytes, delivery_timeout_ms=delivery_timeout_ms, max_block_ms=max_block_ms,
            reconnect_backoff_ms=reconnect_backoff_ms, reconnect_backoff_max_ms=reconnect_backoff_max_ms, acks=acks,
            enable_idempotence=enable_idempotence, connect_timeout_s=connect_timeout_s,
        )
        self._buffer: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._producer: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Counters written by engine threads are itertools.count objects: next() is one atomic C call,
        # so emit() needs no lock. The others are written by one thread each, or under the lock.
        self._emitted = itertools.count()
        self._dropped = itertools.count()
        self._lock = threading.Lock()
        self._num_handed = 0  # taken from the buffer (background thread only)
        self._num_sent = 0
        self._num_failed = 0
        self._last_error: str | None = None
        self._qsize, self._put = self._buffer.qsize, self._buffer.put
        #: check every event at ``emit()`` (``check_event``) and raise ``InvalidEventError`` there, instead of its
        #: reaching the dead letters after ingest (development and tests; it costs microseconds per call)
        self.strict = strict
        self.max_future_skew_ns = int(max_future_skew_s * 1e9)

    @classmethod
    def from_config(cls, config: KafkaConfig, *, strict: bool = False) -> Emitter:
        """An emitter for the event topic of a ``kafka`` configuration section (``strict``: check every event)."""
        return cls(
            config.bootstrap_servers,
            config.topic,
            client_id=config.client_id,
            max_buffered_events=config.max_buffered_events,
            compression=config.compression,
            linger_ms=config.linger_ms,
            batch_bytes=config.batch_bytes,
            connect_timeout_s=config.connect_timeout_s,
            delivery_timeout_ms=config.delivery_timeout_ms,
            max_block_ms=config.max_block_ms,
            reconnect_backoff_ms=config.reconnect_backoff_ms,
            reconnect_backoff_max_ms=config.reconnect_backoff_max_ms,
            acks=config.acks,
            enable_idempotence=config.enable_idempotence,
            strict=strict,
        )

    # ------------------------------------------------------------------------------ engine side

    def emit(self, event: Event) -> bool:
        """Buffer one event for sending; never blocks. False when it was dropped (buffer full). With ``strict``,
        an event that ingest would send to the dead letters raises ``InvalidEventError`` here instead."""
        if self.strict:
            problems = check_event(event, time.time_ns(), self.max_future_skew_ns)
            if problems:
                raise InvalidEventError(f"invalid {getattr(event, 'EVENT_TYPE', type(event).__name__)} event: "
                                        + "; ".join(problems),
                                        "fix the field named; ingest would store it as a dead letter")
        if self._closed or self._qsize() >= self.max_buffered_events:
            next(self._dropped)
            return False
        next(self._emitted)
        self._put(event)
        return True

    def emit_table(self, table: pa.Table, *, timeout_s: float = 30.0) -> int:
        """Emit every row of an events table (``EVENTS_SCHEMA``); return how many were accepted.

        For tools (backfills, replays), not engine loops: it waits for buffer room, up to
        ``timeout_s`` in all; rows that find none are dropped and counted.
        """
        from schemas.wire import iter_table_json

        keys = _table_keys(table)
        deadline = time.monotonic() + timeout_s
        num_accepted = 0
        for key, value in zip(keys, iter_table_json(table)):
            while not self._closed and self._buffer.qsize() >= self.max_buffered_events:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
            if self._closed or self._buffer.qsize() >= self.max_buffered_events:
                next(self._dropped)
                continue
            next(self._emitted)
            self._put((key, value))
            num_accepted += 1
        return num_accepted

    def stats(self) -> EmitterStats:
        """A consistent snapshot of the counts."""
        with self._lock:
            emitted, sent, failed = _count_value(self._emitted), self._num_sent, self._num_failed
            return EmitterStats(
                num_emitted=emitted,
                num_sent=sent,
                num_failed=failed,
                num_dropped=_count_value(self._dropped),
                num_pending=emitted - sent - failed,
                last_error=self._last_error,
            )

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> Emitter:
        """Connect to the broker and start the background thread; returns self.

        Raises ``BrokerUnreachableError`` when no broker answers within ``connect_timeout_s``.
        """
        if self._thread is not None:
            return self
        if self._closed:
            raise ConfigError("this emitter is closed", "create a new Emitter")
        from kafka import KafkaProducer
        from kafka.errors import KafkaConnectionError, KafkaTimeoutError

        try:
            self._producer = KafkaProducer(**self._producer_config)
        except (KafkaTimeoutError, KafkaConnectionError) as exc:
            raise BrokerUnreachableError(
                self.bootstrap_servers, self.connect_timeout_s, f"{type(exc).__name__}: {exc}"
            ) from None
        except RuntimeError as exc:  # kafka-python: "Libraries for zstd compression codec not found"
            codec = self._producer_config["compression_type"]
            raise ConfigError(
                f"compression {codec!r} is not available: {exc}",
                f"install the Python package {COMPRESSION_PACKAGES.get(codec)} or choose another codec",
            ) from None
        self._thread = threading.Thread(target=self._run, name=f"servelens-emitter-{self.topic}", daemon=True)
        self._thread.start()
        return self

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event emitted before this call is sent or failed; False on timeout.

        For shutdown and tests; an engine's step loop never calls it.
        """
        deadline = time.monotonic() + timeout_s
        target = _count_value(self._emitted)
        while self._num_handed < target:  # the background thread is still draining the buffer
            if self._thread is None or not self._thread.is_alive() or time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        if self._producer is not None:
            from kafka.errors import KafkaTimeoutError

            try:
                self._producer.flush(timeout=max(0.0, deadline - time.monotonic()))
            except KafkaTimeoutError:
                return False
        while self._num_sent + self._num_failed < target:  # delivery callbacks run on kafka-python's thread
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self, timeout_s: float = 10.0) -> EmitterStats:
        """Deliver what is buffered (up to ``timeout_s``), then stop; return the final counts.

        Events still undelivered at the deadline count as failed. Idempotent.
        """
        if self._closed:
            return self.stats()
        deadline = time.monotonic() + timeout_s
        self._closed = True  # emit() refuses from now on
        if self._thread is not None:
            self._buffer.put(_STOP)
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._producer is not None:
            _close_producer(self._producer, max(0.0, deadline - time.monotonic()))
        self._abandon_buffer()
        return self.stats()

    def __enter__(self) -> Emitter:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------ background thread

    def _run(self) -> None:
        buffer, producer, topic = self._buffer, self._producer, self.topic
        on_sent, on_error = self._on_sent, self._on_error
        while True:
            item = buffer.get()
            if item is _STOP:
                return
            try:
                if type(item) is tuple:  # pre-encoded by emit_table
                    key, value = item
                else:
                    key, value = event_key(item), encode_event(item)
                future = producer.send(topic, value=value, key=key)
            except Exception as exc:  # encoding error, metadata or memory wait past max_block_ms
                self._num_handed += 1
                on_error(exc)
                continue
            self._num_handed += 1
            future.add_callback(on_sent)
            future.add_errback(on_error)

    def _on_sent(self, _metadata: Any) -> None:
        with self._lock:
            self._num_sent += 1

    def _on_error(self, exc: BaseException) -> None:
        with self._lock:
            self._num_failed += 1
            self._last_error = f"{type(exc).__name__}: {exc}"

    def _abandon_buffer(self) -> None:
        """Count events left in the buffer after close as failed (never silently lost)."""
        num_left = 0
        while True:
            try:
                item = self._buffer.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                num_left += 1
        if num_left:
            with self._lock:
                self._num_failed += num_left
                self._last_error = f"{num_left} events were still buffered at close"


def _close_producer(producer: Any, timeout_s: float) -> None:
    """Close a KafkaProducer within ``timeout_s``, failing the records it could not deliver.

    kafka-python's ``close(timeout)`` raises from its flush when records are still undelivered and
    leaves its sender running; so flush first, then force the sender closed, which fails the
    remaining batches (their errbacks count the events as failed), then close what is left.
    """
    from kafka.errors import KafkaTimeoutError

    try:
        producer.flush(timeout=timeout_s)
    except KafkaTimeoutError:
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(1.0)
    try:
        producer.close(timeout=0)
    except KafkaTimeoutError:  # a batch that even the forced close could not fail; its events stay pending
        pass


def _table_keys(table: pa.Table) -> list[bytes]:
    """Message keys for the rows of an events table, in row order (see ``event_key``)."""
    import pyarrow.compute as pc

    key = pc.coalesce(table["request_id"], table["instance_id"], table["engine_id"])
    return [k.encode() for k in key.to_pylist()]



def _count_value(counter: itertools.count) -> int:
    """The next value of an ``itertools.count`` without advancing it (its repr is 'count(N)')."""
    return int(repr(counter)[6:-1])
