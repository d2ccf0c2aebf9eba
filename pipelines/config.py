"""The ``[lake]``, ``[ingest]``, ``[nightly]`` and ``[dagster]`` sections of the configuration tree."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.types import doc
from servelens.errors import ConfigError
from servelens.settings import check_bounds


@dataclass(frozen=True, slots=True)
class LakeConfig:
    """Where sanitized events land: Delta Lake tables of zstd Parquet, hive-partitioned by dt/hour."""

    root: str = doc(
        "Lake folder, or an S3 URI (s3://bucket/lake, AWS or an S3-compatible store such as MinIO; credentials "
        "from the environment or storage_options_file). Holds the Delta tables events/ and dead_letters/.",
        "lake",
    )
    target_file_bytes: int = doc("Compaction merges small files of a partition up to about this size.", 128 * 1024 * 1024)
    compact_min_files: int = doc("A dt/hour partition is compacted once it holds at least this many files.", 8)
    vacuum_retention_hours: int = doc(
        "Files replaced by compaction are deleted after this long (readers of older versions keep working).", 24
    )
    duckdb_memory_limit: str | None = doc("DuckDB memory limit for lake queries (e.g. '2GB'); unset: DuckDB's default.", None)
    storage_options_file: str | None = doc(
        "For a lake on S3 or an S3-compatible store: a TOML file of the store's options (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP), e.g. a mounted "
        "secret; its values win over the same variables in the environment. Never logged.",
        None,
    )

    def __post_init__(self) -> None:
        check_bounds("lake", self, at_least={"target_file_bytes": 1, "compact_min_files": 2, "vacuum_retention_hours": 0})


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """How the ingest consumer batches, checks and commits."""

    group_id: str = doc("Kafka consumer group; ingest processes in one group split the partitions.", "servelens-ingest")
    consumer_name: str | None = doc("Name of this ingest process in logs and status files; unset: host-pid.", None)
    message_format: str = doc(
        "What the topic carries: servelens (our JSON events), or OTLP spans as the OpenTelemetry Collector's "
        "Kafka exporter writes them (otlp_json, otlp_proto, or otlp for either; vLLM request spans, "
        "docs/interop.md).",
        "servelens",
    )
    poll_max_records: int = doc("Records fetched per poll.", 10_000)
    transform_process: bool = doc(
        "Decode, validate and sanitize in a child process with its own interpreter (kafka-python's record "
        "parsing holds this process's interpreter lock most of the time); false: in this process.",
        True,
    )
    switch_interval_ms: float = doc(
        "CPython's thread switch interval while the consumer runs, ms (0: leave the interpreter's 5 ms). "
        "Polling holds the interpreter lock; a short interval lets the threads that hand batches to the "
        "worker process and commit them take it in time, so the worker is not left waiting.",
        0.2,
    )
    flush_max_events: int = doc("Buffered records that trigger a commit to the lake (bounds memory).", 100_000)
    flush_interval_s: float = doc("Longest time records wait in the buffer before a commit, seconds.", 5.0)
    commits_in_flight: int = doc(
        "Batches in the commit pipeline at once: while one is written to the lake, the next is decoded and "
        "sanitized, and polling goes on (1: one batch at a time). Each holds up to flush_max_events records.",
        2,
    )
    max_message_bytes: int = doc("Larger messages go to dead letters as 'oversized' without being parsed.", 1_048_576)
    max_json_depth: int = doc(
        "JSON messages nested deeper than this go to dead letters as 'too_deep' before any parser sees them (a "
        "byte scan; the contract's events are 2 deep: an object of lists). 0 turns the guard off (only to test "
        "the worker's crash isolation: a 100,000-deep message crashes pyarrow's JSON reader).",
        32,
    )
    max_future_skew_s: float = doc(
        "Events stamped further than this ahead of the ingest clock go to dead letters as 'clock_skew'.", 3600.0
    )
    dedup_window_events: int = doc(
        "Recent event ids remembered to drop producer retries: the consumer's last ids, and each assigned "
        "partition's last window / (assigned partitions) ids, so a partition read late keeps its own window "
        "(memory, 8 bytes per id, is fixed by twice this window). After a restart or rebalance each partition "
        "is read again from window / (2 x assigned partitions) records before its mark: stored already, their "
        "ids warm the windows.", 1_000_000
    )
    session_timeout_ms: int = doc("Kafka group session timeout; a dead consumer's partitions move after it.", 10_000)
    heartbeat_interval_ms: int = doc("Kafka group heartbeat interval.", 3_000)
    status_interval_s: float = doc("How often the consumer logs and writes its health line, seconds.", 10.0)
    compact_interval_s: float = doc(
        "How often the consumer compacts closed dt/hour partitions of the lake, seconds (0: never; "
        "`servelens lake compact` does it on demand).",
        600.0,
    )

    def __post_init__(self) -> None:
        check_bounds("ingest", self, at_least={
            "poll_max_records": 1, "switch_interval_ms": 0, "flush_max_events": 1, "commits_in_flight": 1,
            "max_message_bytes": 1, "max_json_depth": 0, "max_future_skew_s": 0, "dedup_window_events": 1,
            "session_timeout_ms": 1, "heartbeat_interval_ms": 1, "compact_interval_s": 0},
            above={"flush_interval_s": 0, "status_interval_s": 0})
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ConfigError(f"ingest.heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below "
                              f"ingest.session_timeout_ms ({self.session_timeout_ms})",
                              "Kafka's rule: a third of it or less (the defaults: 3,000 and 10,000)")


@dataclass(frozen=True, slots=True)
class NightlyConfig:
    """What the nightly replay compares (the Dagster schedule, the comparisons and the verdicts)."""

    production: str = doc("The production policy every candidate is judged against.", "fcfs")
    candidates: str = doc("Comma-separated candidate policies; empty: every registered policy besides production.", "")
    loads: str = doc("Comma-separated load scenarios, multiples of the recorded arrival rate.", "1x,2x")
    engine: str = doc("The modelled instance of the replays, MODEL@GPU[xTP].", "llama-3-8b@h100-sxm")
    engine_config: str = doc(
        "YAML file of vllm serve settings for that instance (as `servelens replay --engine-config`, e.g. "
        "gpu_memory_utilization: 0.5); empty: what vllm serve picks (as `servelens replay` without settings).", "")
    calibration: str = doc(
        "Calibration of the replays' roofline model: auto (the shipped one, as `servelens replay` uses), none, "
        "a shipped name or a file.", "auto")
    seed: int = doc("Seed of every replay.", 0)


@dataclass(frozen=True, slots=True)
class DagsterConfig:
    """Where Dagster executes the steps of a run (``pipelines/definitions.py``); where runs execute and
    how many at once is the instance's ``dagster.yaml`` (``deploy/``, ``docs/pipelines.md``)."""

    executor: str = doc(
        "multiprocess (each step a process beside the run worker), in_process, k8s (each step a Kubernetes Job: "
        "dagster-k8s) or celery (steps on Celery workers: dagster-celery). k8s and celery need the scaleout extra.",
        "multiprocess",
    )
    max_concurrent_steps: int = doc("Steps of one run at once (multiprocess, k8s); 0: one per CPU.", 0)
    celery_broker: str = doc("The Celery executor's broker URL (e.g. a Redis or RabbitMQ service).",
                             "pyamqp://guest@localhost//")
    celery_backend: str = doc("The Celery executor's result backend.", "rpc://")
    k8s_namespace: str | None = doc("Namespace of the k8s executor's step Jobs; unset: the run's own.", None)
    k8s_image: str | None = doc("Image of the k8s executor's step Jobs; unset: the run's own (the servelens image).", None)

    def __post_init__(self) -> None:
        check_bounds("dagster", self, at_least={"max_concurrent_steps": 0})
