"""Kafka settings shared by the emitter SDK, the local broker and the ingest consumer.

``KafkaConfig`` is one frozen section of the configuration tree (``servelens/config.py`` mounts it as
``kafka``), every field with its help text. ``BrokerUnreachableError`` is the one error for "no Kafka
broker answered at this address", raised with a hint by every client that connects at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.types import doc
from servelens.errors import ServelensError
from servelens.settings import ConfigError, check_bounds

#: Compression codecs the emitter accepts, each with the Python package kafka-python needs for it.
COMPRESSION_PACKAGES: dict[str, str | None] = {
    "zstd": "zstandard",
    "lz4": "lz4",
    "gzip": None,
    "snappy": "python-snappy",
    "none": None,
}


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """Where the event stream lives in Kafka and how the emitter SDK produces to it."""

    bootstrap_servers: str = doc(
        "Comma-separated host:port list of Kafka brokers ('servelens broker' runs one on 127.0.0.1:9092).",
        "127.0.0.1:9092",
    )
    topic: str = doc("Topic of lifecycle events; the message key is the request id.", "servelens.events.v1")
    num_partitions: int = doc(
        "Partitions of the event topic when servelens creates it; one request's events share one.", 8
    )
    dead_letter_topic: str = doc(
        "Topic for records the ingest consumer rejected, each with its reason.", "servelens.dead_letters.v1"
    )
    client_id: str = doc("Client id the producer and consumer report to the broker (shows in its logs).", "servelens")
    compression: str = doc("Producer compression codec: zstd, lz4, gzip, snappy or none.", "zstd")
    linger_ms: int = doc(
        "How long the producer waits to fill a batch before sending it; more batching, more latency.", 10
    )
    batch_bytes: int = doc("Largest producer batch per partition, bytes (before compression).", 262_144)
    max_buffered_events: int = doc(
        "Capacity of the emitter's in-process buffer, events; when it is full, emit() drops the event "
        "and counts it instead of blocking the engine.",
        100_000,
    )
    connect_timeout_s: float = doc(
        "How long the emitter's start() waits for a broker before failing with a clear error, seconds.", 5.0
    )
    delivery_timeout_ms: int = doc(
        "How long the producer keeps retrying an event (for example while the broker restarts) before "
        "counting it as failed, milliseconds.",
        30_000,
    )
    max_block_ms: int = doc(
        "How long the emitter's background thread may wait for topic metadata or producer memory before "
        "counting an event as failed, milliseconds (the engine's emit() never waits).",
        5_000,
    )
    reconnect_backoff_ms: int = doc(
        "First pause before reconnecting to a broker that went away, milliseconds; it doubles per "
        "failed attempt up to reconnect_backoff_max_ms.",
        50,
    )
    reconnect_backoff_max_ms: int = doc(
        "Longest pause between reconnection attempts to a broker that went away, milliseconds.", 1_000
    )
    acks: str = doc("Broker acknowledgements a send waits for: all, 1 or 0.", "all")
    enable_idempotence: bool = doc(
        "Kafka idempotent producer. Off by default: the development broker (Tansu) forgets producer ids "
        "on restart, and consumers de-duplicate retried events by event_id anyway.",
        False,
    )

    def __post_init__(self) -> None:
        check_bounds("kafka", self, at_least={
            "num_partitions": 1, "linger_ms": 0, "batch_bytes": 1, "max_buffered_events": 1, "delivery_timeout_ms": 1,
            "max_block_ms": 0, "reconnect_backoff_ms": 0, "reconnect_backoff_max_ms": 0},
            above={"connect_timeout_s": 0}, non_empty=("bootstrap_servers",))
        for address in self.bootstrap_servers.split(","):
            _check_address(address.strip())


def _check_address(address: str) -> None:
    """One bootstrap address: HOST:PORT (an IPv6 host in brackets), the port in 1-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or host == "[]" or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"kafka.bootstrap_servers: {address!r} is not HOST:PORT with a port in 1-65535",
                          "e.g. 127.0.0.1:9092 or broker-1:9092,broker-2:9092 (--bootstrap-server, "
                          "SERVELENS_KAFKA__BOOTSTRAP_SERVERS)")


class BrokerUnreachableError(ServelensError):
    """No Kafka broker answered at the configured bootstrap address."""

    def __init__(self, bootstrap_servers: str, timeout_s: float, cause: str) -> None:
        super().__init__(
            f"no Kafka broker reachable at {bootstrap_servers} within {timeout_s:g} s ({cause})",
            "start one with 'servelens broker' (a local Tansu broker) or point kafka.bootstrap_servers "
            "(SERVELENS_KAFKA__BOOTSTRAP_SERVERS) at a running Kafka cluster",
        )
        self.bootstrap_servers = bootstrap_servers
