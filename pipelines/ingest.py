"""The ingest consumer: Kafka -> decode -> validate -> sanitize -> de-duplicate -> the lake, exactly once.

One loop per process: poll a batch of records, buffer them per partition, and commit when the buffer
holds ``flush_max_events`` records or ``flush_interval_s`` has passed. A batch then goes through two
stages, in batch order, while polling goes on: the *transform*, in the consumer's worker process
(``pipelines.transform``), decodes and checks the whole batch columnar (``pipelines.decode``) and
sanitizes the valid events (``privacy``); the *commit*, on a thread, drops event ids seen recently
(producer retries) and appends events and dead letters to their Delta tables, each commit carrying
the partitions' next offsets (``pipelines.lake``). So batch N+1 is sanitized while batch N is
written (``commits_in_flight`` batches at once). Kafka's own committed offsets are written
afterwards for lag monitoring only: the lake is the truth.

Exactly once, step by step:
- **restart**: each assigned partition resumes at the lower of the two tables' marks; records below
  a table's mark are skipped for that table, so a crash between the dead-letter and the event
  commit stores nothing twice;
- **rebalance**: revoked partitions are committed as soon as the rebalance is known (if the new owner
  committed first, the lake refuses ours); an assigned partition resumes from the lake's marks,
  whoever wrote them;
- **zombies**: a commit whose marks moved since this consumer resumed is refused (``CommitFenced``),
  its records dropped and re-read from the new marks;
- **producer retries** (the same ``event_id`` at a new offset): dropped against fixed-size windows
  of recent ids, the consumer's and one per partition (``pipelines.retries``: a partition read late
  keeps its own), warmed from the lake at start and by reading each partition again below its mark;
  an event that reuses the id of an earlier event of its batch with other content is no retry: it goes to
  dead letters as ``duplicate_event_id`` (``refuse_conflicting_ids``; across batches only ids are remembered);
- **a failed commit** (fenced, or an error) latches the pipeline: the batches behind it commit
  nothing, since their marks would pass records that were never stored; their partitions are read
  again from the lake's marks (after an error the process stops, and a restart does the same);
- **a poison message** (one that crashes the parser in the transform worker): the worker's death
  fails its pending batches; each is transformed again on a fresh worker (``TransformWorker.recover``)
  and, if it kills that one too, bisected until the message is found; it goes to dead letters as
  ``parser_crash``, the crash is logged with its signal and offset, and every other record of the
  batch is stored once. Nesting is bounded before any parser runs (``ingest.max_json_depth``);
- **a topic that was re-created** (the development broker keeps memory only, so a restarted broker
  re-creates it empty): Kafka gives the new incarnation a new topic id; its partitions start a new
  epoch at offset 0, with a clear error in the log. (The log-end offset cannot tell: the
  development broker reports the last batch's first offset as the end.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import re
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipelines.config import IngestConfig, LakeConfig
from pipelines.decode import Decoder
from pipelines.decoded import Rejected
from pipelines.kafka_config import BrokerUnreachableError, KafkaConfig
from pipelines.lake import DEAD_LETTERS, EVENTS, CommitFenced, Lake, OffsetRange
from pipelines.retries import RetryFilter
from pipelines.transform import Transformed, TransformSpec, TransformWorker, TransformWorkerDied
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.sanitize import FIELD_POLICIES, PrivacyReport
from schemas.arrow import arrow_schema
from schemas.duplicates import conflicting_rows
from schemas.records import DeadLetter
from schemas.validate import duplicate_event_id_error
from servelens.errors import ServelensError

log = logging.getLogger("servelens.ingest")

#: A consumer name: it names the status file ``<lake>/_ingest/<name>.json``, so a plain file name
CONSUMER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
CONSUMER_NAME_RULE = "1 to 100 letters, digits, '.', '_' or '-', not starting with '.'"


def check_consumer_name(name: str) -> str:
    """``name`` if it can name a consumer (and its status file), else a clear error."""
    if not CONSUMER_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise ServelensError(f"consumer name {shown!r} is not a plain file name: it names the status file "
                             f"<lake>/_ingest/<name>.json", f"use {CONSUMER_NAME_RULE}")
    return name


def _default_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip(".")[:80] or "ingest"
    return f"{host}-{os.getpid()}"

DEAD_LETTER_SCHEMA = arrow_schema(DeadLetter)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    partition: int
    epoch: int
    committed: int  # next offset the lake expects
    log_end: int

    @property
    def lag(self) -> int:
        return max(0, self.log_end - self.committed)


@dataclass(frozen=True, slots=True)
class IngestStats:
    """Health of one ingest process (also written to ``<lake>/_ingest/<consumer>.json``)."""

    consumer: str
    records_read: int
    events_written: int
    dead_letters: int
    duplicates_dropped: int
    commits: int
    commits_fenced: int
    events_per_s: float  # events written per second since the first record was read
    dead_letter_rate: float  # dead letters per record read
    last_commit_ns: int | None
    lag: tuple[PartitionLag, ...]
    broker_reachable: bool

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.lag)

    def line(self) -> str:
        last = "never" if self.last_commit_ns is None else f"{(time.time_ns() - self.last_commit_ns) / 1e9:.1f} s ago"
        broker = "" if self.broker_reachable else ", BROKER UNREACHABLE"
        return (
            f"{self.consumer}: {self.records_read:,} read, {self.events_written:,} events written "
            f"({self.events_per_s:,.0f}/s), {self.dead_letters:,} dead letters ({self.dead_letter_rate:.2%}), "
            f"{self.duplicates_dropped:,} duplicates dropped, lag {self.total_lag:,}, last commit {last}{broker}"
        )


@dataclass
class _Partition:
    """What this consumer knows of one assigned partition."""

    epoch: int
    events_mark: int | None  # the lake's marks when we resumed / last committed
    dead_mark: int | None
    topic_id: str | None
    records: list = field(default_factory=list)  # kafka-python ConsumerRecords, in offset order


@dataclass(frozen=True, slots=True)
class _Batch:
    """Records taken from the buffer for one commit, parallel arrays in buffer order."""

    values: list[bytes]
    offsets: np.ndarray
    owner: np.ndarray  # partition of each record
    keys: list[bytes | None]
    ranges: list[OffsetRange]
    parts: dict[int, _Partition]  # the partitions' state when taken (the commit moves their marks)
    fresh: np.ndarray  # record i is at or past its partition's events mark: not in the lake yet
    received_ns: int


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one commit did."""

    ranges: list[OffsetRange]
    num_events: int
    num_dead: int
    num_duplicates: int
    fenced: CommitFenced | None
    dropped: bool = False  # behind a failed commit: nothing stored, the partitions are read again


def refuse_conflicting_ids(clean: pa.Table, messages: np.ndarray, values: list[bytes]) -> tuple[pa.Table, np.ndarray, list[Rejected]]:
    """A batch's events less those that reuse an earlier event's id of the batch with other content (``clean``:
    sanitized events, ``messages``: the message index of each), and those as rejections (``duplicate_event_id``:
    dead letters, one per message). An exact repeat stays, for the retry filter to drop."""
    conflicts = conflicting_rows(clean)
    if not conflicts:
        return clean, messages, []
    rows = sorted(conflicts)
    rejected: dict[int, Rejected] = {}
    picked = clean.select(["event_id", "event_type"]).take(rows)
    for row, event_id, event_type in zip(rows, picked["event_id"].to_pylist(), picked["event_type"].to_pylist()):
        error = duplicate_event_id_error(event_id, "an earlier message of its batch")
        rejected.setdefault(int(messages[row]), Rejected(int(messages[row]), len(values[messages[row]]), (error,), event_type))
    keep = np.ones(clean.num_rows, dtype=bool)
    keep[rows] = False
    return clean.filter(pa.array(keep)), messages[keep], list(rejected.values())


class IngestConsumer:
    """Consumes the event topic into the lake. ``run()`` until stopped; ``close()`` commits the rest."""

    def __init__(
        self,
        kafka: KafkaConfig,
        ingest: IngestConfig,
        lake: LakeConfig,
        privacy: PrivacyConfig,
        keyring: KeyRing,
        *,
        consumer_name: str | None = None,
    ) -> None:
        self.kafka_config = kafka
        self.config = ingest
        self.topic = kafka.topic
        named = consumer_name if consumer_name is not None else ingest.consumer_name
        self.name = _default_name() if named is None else check_consumer_name(named)
        self.lake = Lake(lake.root, lake)
        self.keyring = keyring
        Decoder(message_format=ingest.message_format)  # a clear error for an unknown format, now
        spec = TransformSpec(
            max_message_bytes=ingest.max_message_bytes, max_future_skew_ns=int(ingest.max_future_skew_s * 1e9),
            message_format=ingest.message_format, privacy=privacy, active_key_id=keyring.active_id,
            secrets=dict(keyring.secrets), max_json_depth=ingest.max_json_depth,
        )
        self.transform = TransformWorker(spec, in_process=not ingest.transform_process)
        self._privacy = PrivacyReport()
        self.recent = RetryFilter(ingest.dedup_window_events)
        self.partitions: dict[int, _Partition] = {}
        self._unresolved: set[int] = set()
        self._announced_epoch: int | None = None
        self._rebalance_news: queue.SimpleQueue[tuple[str, list[int]]] = queue.SimpleQueue()
        self._consumer = None
        self._dead_producer = None  # publishes committed dead letters to kafka.dead_letter_topic
        if ingest.commits_in_flight < 1:
            raise ServelensError(f"ingest.commits_in_flight must be at least 1, not {ingest.commits_in_flight}",
                                 "set it to 1 (one batch at a time) or more")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelens-ingest-commit")
        self._inflight: deque[Future] = deque()  # the commits of batches in the pipeline, oldest first
        self._latched = False  # a commit failed: the ones behind it store nothing (see _store)
        self._stop = False
        self._first_record_s: float | None = None
        self._last_compact_s = time.monotonic()
        self._last_flush_s = time.monotonic()
        self._last_status_s = 0.0
        self._unreachable_since: float | None = None
        #: each partition's log end as the broker last reported it (``_refresh_log_ends``, on the consumer's thread)
        self._log_ends: dict[int, int] = {}
        self._counts = {"read": 0, "events": 0, "dead": 0, "dups": 0, "commits": 0, "fenced": 0}
        self._last_commit_ns: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> IngestConsumer:
        """Connect (a clear error if no broker answers), create missing topics, join the group."""
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.errors import KafkaError

        from pipelines.broker import ensure_topics

        timeout_s = self.kafka_config.connect_timeout_s
        ensure_topics(self.kafka_config.bootstrap_servers,
                      {self.topic: self.kafka_config.num_partitions, self.kafka_config.dead_letter_topic: 1}, timeout_s=timeout_s)
        self.lake.ensure_tables()
        self.transform.start()  # decoder and sanitizer (Presidio takes seconds): before the first batch
        self.recent.warm(self.lake.recent_event_ids(self.config.dedup_window_events // 2))
        try:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.kafka_config.bootstrap_servers,
                client_id=f"{self.kafka_config.client_id}-ingest-{self.name}",
                group_id=self.config.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=self.config.poll_max_records,
                session_timeout_ms=self.config.session_timeout_ms,
                heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                reconnect_backoff_ms=self.kafka_config.reconnect_backoff_ms,
                reconnect_backoff_max_ms=self.kafka_config.reconnect_backoff_max_ms,
            )
            self._dead_producer = KafkaProducer(
                bootstrap_servers=self.kafka_config.bootstrap_servers, client_id=f"{self.kafka_config.client_id}-dead-letters",
                linger_ms=self.kafka_config.linger_ms, retries=5,
            )
        except KafkaError as exc:
            raise BrokerUnreachableError(self.kafka_config.bootstrap_servers, timeout_s, str(exc)) from None
        self._consumer.subscribe([self.topic], listener=_Rebalance(self))
        log.info("%s: consuming %s into %s", self.name, self.topic, self.lake.root)
        return self

    def stop(self) -> None:
        """Ask ``run()`` to return after its current poll (safe from a signal handler)."""
        self._stop = True

    def close(self) -> IngestStats:
        """Commit what is buffered and leave the group."""
        if self._consumer is not None:
            try:
                self.flush()
            finally:
                self._consumer.close()
                self._consumer = None
                self._committer.shutdown(wait=True)
                self.transform.close()
                if self._dead_producer is not None:
                    self._dead_producer.close(timeout=10)
                    self._dead_producer = None
        return self.stats()

    def run(
        self,
        *,
        max_records: int | None = None,
        idle_exit_s: float | None = None,
        on_status: Callable[[IngestStats], None] | None = None,
    ) -> IngestStats:
        """Consume until stopped (``stop()``, SIGTERM or SIGINT), ``max_records`` records have been
        read, or nothing arrived for ``idle_exit_s`` seconds; then commit and return the stats.

        Idle time counts from the start, from the last record read and from each assignment of
        partitions; while none are assigned (the group still forming, or every partition held by other
        members) the limit is ``idle_exit_s`` plus the group's session timeout, the time the broker
        gives a dead member before its partitions move."""
        if self._consumer is None:
            self.start()
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if _main_thread() else {}
        for sig in previous:
            signal.signal(sig, lambda *_: self.stop())
        switch_interval_s = sys.getswitchinterval()
        if self.config.switch_interval_ms > 0:
            sys.setswitchinterval(self.config.switch_interval_ms / 1000)
        last_data = time.monotonic()
        try:
            while not self._stop:
                assigned = bool(self.partitions)
                polled = self._consumer.poll(timeout_ms=200, max_records=self.config.poll_max_records)
                got = self._buffer(polled)
                self._reap()
                self._rebalanced()
                now = time.monotonic()
                if got or (self.partitions and not assigned):  # data, or partitions just assigned
                    last_data = now
                if got:
                    self._broker_back()
                else:
                    self._check_broker()
                if self._buffered() >= self.config.flush_max_events or now - self._last_flush_s >= self.config.flush_interval_s:
                    self.flush(wait=False)
                if now - self._last_status_s >= self.config.status_interval_s:
                    self._report(on_status)
                if max_records is not None and self._counts["read"] >= max_records:
                    break
                if idle_exit_s is not None and now - last_data >= self._idle_limit_s(idle_exit_s) and not self._buffered() \
                        and not self._inflight:
                    break
            return self.close()
        finally:
            sys.setswitchinterval(switch_interval_s)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _idle_limit_s(self, idle_exit_s: float) -> float:
        """Idle time before ``run`` stops: with no partition assigned, the group's session timeout more
        (a member that died holds its partitions that long: the group is still forming, not idle)."""
        return idle_exit_s if self.partitions else idle_exit_s + self.config.session_timeout_ms / 1000

    # -- buffering and committing ---------------------------------------------------------------

    def _buffered(self) -> int:
        return sum(len(p.records) for p in self.partitions.values())

    def _buffer(self, polled) -> int:
        """Buffer what was polled; return how many records are new (at or past the lake's marks:
        records read again only to warm de-duplication do not count as data for idleness)."""
        got = new = 0
        for tp, records in polled.items():
            part = self.partitions.get(tp.partition)
            if part is None:  # not (or no longer) resolved: read again after the seek
                continue
            part.records.extend(records)
            got += len(records)
            mark = min(part.events_mark or 0, part.dead_mark or 0)
            new += len(records) if records[0].offset >= mark else sum(r.offset >= mark for r in records)
        self._counts["read"] += got
        if got and self._first_record_s is None:
            self._first_record_s = time.monotonic()
        return new

    def flush(self, partitions: list[int] | None = None, *, wait: bool = True) -> None:
        """Commit the buffered records of ``partitions`` (default: all) to the lake.

        The batch is transformed and committed on the pipeline's threads while this thread keeps
        polling; ``wait=False`` returns once it is handed over (after the oldest batch's commit, if
        ``commits_in_flight`` are in the pipeline already), ``wait=True`` once every batch is committed.
        """
        self._drain(keep=0 if wait else self.config.commits_in_flight - 1)
        self._last_flush_s = time.monotonic()
        batch = self._take(partitions)
        if batch is not None:
            transformed = self.transform.submit(batch.values, batch.fresh, batch.received_ns)
            self._inflight.append(self._committer.submit(self._store, batch, transformed))
        if wait:
            self._drain()

    def _drain(self, keep: int = 0) -> None:
        """Wait for the oldest commits in the pipeline until ``keep`` remain, applying their outcomes."""
        while len(self._inflight) > keep:
            self._apply(self._inflight.popleft().result())

    def _reap(self) -> None:
        """Apply the outcomes of the commits that are done, oldest first, without waiting."""
        while self._inflight and self._inflight[0].done():
            self._apply(self._inflight.popleft().result())

    def _take(self, partitions: list[int] | None) -> _Batch | None:
        """Move the buffered records of ``partitions`` out of the buffer into a batch."""
        chosen = sorted(p for p in (partitions or list(self.partitions)) if self.partitions.get(p) and self.partitions[p].records)
        if not chosen:
            return None
        parts = [self.partitions[p] for p in chosen]
        records = [r for part in parts for r in part.records]
        owner = np.repeat(np.array(chosen, dtype=np.int64), [len(part.records) for part in parts])
        offsets = np.fromiter((r.offset for r in records), dtype=np.int64, count=len(records))
        # records the lake holds already (read again below its events mark) are not written again;
        # a batch still in the pipeline moves marks only below this batch's records
        marks = np.array([part.events_mark or 0 for part in parts], dtype=np.int64)
        batch = _Batch(
            values=[r.value if r.value is not None else b"" for r in records],
            offsets=offsets,
            owner=owner,
            keys=[r.key for r in records],
            ranges=[
                OffsetRange(self.topic, p, part.epoch, part.records[0].offset, part.records[-1].offset + 1, part.topic_id)
                for p, part in zip(chosen, parts)
            ],
            parts=dict(zip(chosen, parts)),
            fresh=offsets >= marks[np.searchsorted(np.array(chosen, dtype=np.int64), owner)],
            received_ns=time.time_ns(),
        )
        for part in parts:
            part.records = []
        return batch

    def _store(self, batch: _Batch, transformed: Future) -> _Outcome:
        """Commit one transformed batch (the commit thread's job, batches in order).

        A failed commit (fenced, or an error) latches the pipeline: the batches behind it store
        nothing, since their marks would pass records that were never stored. The polling thread
        reads their partitions again from the lake's marks, then lifts the latch (``_apply``).
        """
        if self._latched:
            return _Outcome(batch.ranges, 0, 0, 0, None, dropped=True)
        try:
            outcome = self._commit(batch, self._transformed(batch, transformed))
        except BaseException:
            self._latched = True
            raise
        if outcome.fenced is not None:
            self._latched = True
        return outcome

    def _transformed(self, batch: _Batch, transformed: Future) -> Transformed:
        """The batch's result; if the worker died, the batch transformed again on a fresh one, and the
        messages that kill a worker on their own found and turned into ``parser_crash`` rejections."""
        try:
            return transformed.result()
        except TransformWorkerDied as exc:
            log.error("%s: %s", self.name, exc.message)
        done, crashes = self.transform.recover(batch.values, batch.fresh, batch.received_ns)
        for crash in crashes:
            log.error("%s: the message at partition %d offset %d (%d bytes) alone %s: stored as a dead letter "
                      "(parser_crash), the rest of its batch goes on", self.name, int(batch.owner[crash.index]),
                      int(batch.offsets[crash.index]), len(batch.values[crash.index]), crash.how)
        if not crashes:
            log.warning("%s: a fresh transform worker took the batch (partitions %s) without dying: nothing was lost",
                        self.name, sorted(batch.parts))
        return done

    def _commit(self, batch: _Batch, done: Transformed) -> _Outcome:
        """De-duplicate a transformed batch and commit its dead letters, then its events."""
        parts, now_ns = batch.parts, batch.received_ns
        dead_marks = {p: part.dead_mark for p, part in parts.items()}
        event_marks = {p: part.events_mark for p, part in parts.items()}
        self._privacy = done.report
        clean, messages, conflicts = refuse_conflicting_ids(done.clean, done.clean_messages, batch.values)
        dead_rows = self._dead_letters(sorted([*done.rejected, *conflicts], key=lambda r: r.index), batch, dead_marks, now_ns)
        if done.stored_ids:  # re-read below the mark (see _resolve): stored already, remembered now
            self.recent.add(done.stored_ids, batch.owner[done.stored_messages])
        owners = batch.owner[messages]
        first = self.recent.first_sightings(clean["event_id"], owners)
        duplicates = int((~first).sum())
        if duplicates:
            clean, owners = clean.filter(pa.array(first)), owners[first]
        expected = lambda marks: {(self.topic, r.partition, r.epoch): marks[r.partition] for r in batch.ranges}  # noqa: E731
        try:
            dead_ranges = _not_before(batch.ranges, dead_marks)
            self.lake.commit(DEAD_LETTERS, dead_rows, dead_ranges, expected(dead_marks), writer=self.name)
            for r in dead_ranges:
                parts[r.partition].dead_mark = r.end
            event_ranges = _not_before(batch.ranges, event_marks)
            self.lake.commit(EVENTS, clean, event_ranges, expected(event_marks), writer=self.name)
        except CommitFenced as exc:
            return _Outcome(batch.ranges, 0, 0, 0, exc)
        self.recent.add(clean["event_id"], owners)  # seen, now that they are stored
        for r in event_ranges:
            parts[r.partition].events_mark = r.end
        self._publish_dead_letters(dead_rows)
        log.debug("%s: committed %s", self.name, [(r.partition, r.start, r.end) for r in event_ranges])
        self._maybe_compact()
        return _Outcome(event_ranges, clean.num_rows, dead_rows.num_rows, duplicates, None)

    def _maybe_compact(self) -> None:
        """Now and then, merge the small files of closed hours (on the commit thread, between commits)."""
        interval = self.config.compact_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_compact_s < interval:
            return
        self._last_compact_s = now
        stamp = time.gmtime()
        current = (time.strftime("%Y-%m-%d", stamp), stamp.tm_hour)
        try:
            merged = self.lake.compact(before=current)
        except Exception as exc:  # a concurrent compaction, say: the next interval tries again
            log.warning("%s: compaction skipped: %s", self.name, exc)
            return
        if any(merged.values()):
            log.info("%s: compacted %s small files of closed hours", self.name, merged)

    def _apply(self, outcome: _Outcome) -> None:
        """Account for a committed (or refused) batch; re-read fenced partitions from the lake, and
        those of the batches behind a fenced one (they stored nothing), then lift the latch."""
        if outcome.fenced is not None or outcome.dropped:
            self._resume([r.partition for r in outcome.ranges])
            if outcome.fenced is not None:
                self._counts["fenced"] += 1
                log.warning("%s: %s; re-reading from the lake's marks", self.name, outcome.fenced.message)
                self._drain()  # the batches behind it come back dropped
                self._latched = False
            return
        self._counts["events"] += outcome.num_events
        self._counts["dead"] += outcome.num_dead
        self._counts["dups"] += outcome.num_duplicates
        self._counts["commits"] += 1
        self._last_commit_ns = time.time_ns()
        self._commit_kafka(outcome.ranges)

    def _dead_letters(self, rejected: list[Rejected], batch: _Batch, marks: dict[int, int | None], now_ns: int) -> pa.Table:
        rows = []
        kind = FIELD_POLICIES["request_id"].kind
        epochs = {r.partition: r.epoch for r in batch.ranges}
        for r in rejected:
            p, offset = int(batch.owner[r.index]), int(batch.offsets[r.index])
            if offset < (marks[p] or 0):
                continue  # already in the lake
            first = r.errors[0]
            key = batch.keys[r.index]
            rows.append(
                {
                    "topic": self.topic,
                    "partition": p,
                    "offset": offset,
                    "epoch": epochs[p],
                    "key": None if key is None else self.keyring.pseudonym(kind, key.decode("utf-8", "replace")),
                    "size_bytes": r.size_bytes,
                    "reason": first.reason,
                    "path": first.path,
                    "value_type": first.value_type,
                    "expected": first.expected,
                    "num_errors": len(r.errors),
                    "event_type": r.event_type,
                    "received_ns": now_ns,
                }
            )
        return pa.Table.from_pylist(rows, schema=DEAD_LETTER_SCHEMA)

    def _publish_dead_letters(self, rows: pa.Table) -> None:
        """Dead letters committed to the lake, also on ``kafka.dead_letter_topic`` as JSON (the same
        fields: reasons, contract paths, pseudonymized keys, never content), keyed by the pseudonymized
        key. At least once: a crash between the lake commit and this send loses none from the lake,
        and a batch read again after a fence publishes nothing (only commits that land publish)."""
        if self._dead_producer is None or not rows.num_rows:
            return
        topic = self.kafka_config.dead_letter_topic
        try:
            for row in rows.to_pylist():
                key = row["key"].encode() if row["key"] else None
                self._dead_producer.send(topic, key=key, value=json.dumps(row, separators=(",", ":")).encode())
        except Exception as exc:  # the lake holds the truth: a broker hiccup must not stop the ingest
            log.warning("%s: dead letters not published to %s: %s", self.name, topic, exc)

    def _commit_kafka(self, ranges: list[OffsetRange]) -> None:
        """Advisory: Kafka's committed offsets make lag visible to standard tools."""
        from kafka import TopicPartition
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata

        try:
            self._consumer.commit(
                {TopicPartition(self.topic, r.partition): OffsetAndMetadata(r.end, "", -1) for r in ranges},
                timeout_ms=_ADVISORY_TIMEOUT_MS,
            )
        except (KafkaError, AssertionError, ValueError) as exc:  # the lake holds the truth
            log.debug("advisory Kafka offset commit failed: %s", exc)

    # -- assignment -----------------------------------------------------------------------------

    def _resume(self, partitions: list[int]) -> None:
        """Forget ``partitions`` until ``_resolve`` has read the lake's marks for them and seeked;
        records polled for them meanwhile are dropped (they will be read again after the seek)."""
        for p in partitions:
            self.partitions.pop(p, None)
            self._unresolved.add(p)

    def _resolve(self) -> None:
        """Seek each unresolved partition to the lake's marks for the topic's current incarnation."""
        from kafka import TopicPartition

        assigned = {tp.partition for tp in self._consumer.assignment() if tp.topic == self.topic}
        self._unresolved &= assigned
        if not self._unresolved:
            return
        topic_id = _topic_id(self._consumer, self.topic)
        epoch, recreated = self.lake.epoch(self.topic, topic_id)
        if recreated and epoch != self._announced_epoch:
            self._announced_epoch = epoch
            log.error(
                "%s: topic %s was re-created (new topic id %s): the broker lost its log (the development "
                "broker keeps memory only). Its offsets restart at 0 in epoch %d; records before the loss "
                "are safe in the lake.",
                self.name, self.topic, topic_id, epoch,
            )
        # A producer retry sits in the same partition as its original (same key), a little later.
        # So each partition is read again from a little before its mark: those records are not
        # stored twice (the marks filter them), but their ids warm de-duplication exactly.
        reread = self.config.dedup_window_events // (2 * max(1, len(assigned)))
        self.recent.assign(assigned)
        for p in sorted(self._unresolved):
            tp = TopicPartition(self.topic, p)
            events_mark = self.lake.high_water_mark(EVENTS, self.topic, p, epoch)
            dead_mark = self.lake.high_water_mark(DEAD_LETTERS, self.topic, p, epoch)
            start = max(0, min(m or 0 for m in (events_mark, dead_mark)) - reread)
            log.debug("%s: partition %d resumes at offset %d (epoch %d)", self.name, p, start, epoch)
            self._consumer.seek(tp, start)
            self.partitions[p] = _Partition(epoch, events_mark, dead_mark, topic_id)
        self._unresolved.clear()

    def _rebalanced(self) -> None:
        """Act on the rebalance callbacks' news, on the polling thread (callbacks only queue it).

        Revoked partitions are committed now: if their new owner committed first, the lake refuses
        ours (fenced) and nothing is stored twice. Assigned ones resume from the lake's marks.
        """
        while not self._rebalance_news.empty():
            kind, partitions = self._rebalance_news.get()
            if kind == "revoked":
                self.flush([p for p in partitions if p in self.partitions])
                for p in partitions:
                    self.partitions.pop(p, None)
                    self._unresolved.discard(p)
            else:
                log.info("%s: assigned partitions %s", self.name, partitions)
                self._drain()  # nothing in the pipeline may move the marks we resume from
                self._resume(partitions)
        if self._unresolved:
            self._resolve()

    def _on_assigned(self, assigned) -> None:  # kafka-python's IO thread: queue, never block
        self._rebalance_news.put(("assigned", sorted(tp.partition for tp in assigned if tp.topic == self.topic)))

    def _on_revoked(self, revoked) -> None:  # kafka-python's IO thread: queue, never block
        self._rebalance_news.put(("revoked", sorted(tp.partition for tp in revoked if tp.topic == self.topic)))

    # -- health ---------------------------------------------------------------------------------

    def _check_broker(self) -> None:
        if self._consumer is None or _any_broker_connected(self._consumer):
            self._broker_back()
            return
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
            self._log_ends = {}  # it may come back empty (a re-created topic's offsets start again)
            log.error(
                "%s: the Kafka broker at %s is unreachable; buffered records are committed as usual and "
                "consumption resumes when it returns",
                self.name, self.kafka_config.bootstrap_servers,
            )

    def _broker_back(self) -> None:
        if self._unreachable_since is not None:
            log.warning("%s: the broker is reachable again after %.1f s", self.name, time.monotonic() - self._unreachable_since)
            self._unreachable_since = None

    def privacy_report(self) -> PrivacyReport:
        """What sanitization removed or coarsened since the start (counts only, never values)."""
        return self._privacy

    def stats(self) -> IngestStats:
        """The consumer's counters and lag. No I/O, so any thread may ask, as often as it likes: the log ends
        are those the consumer's own thread last fetched (each status line; kafka-python's consumer is not
        thread-safe, and a broker that has just vanished would hold a fetch for a minute)."""
        elapsed = max(time.monotonic() - (self._first_record_s or time.monotonic()), 1e-9)
        read = self._counts["read"]
        lag = tuple(
            PartitionLag(p, part.epoch, part.events_mark or 0, (part.events_mark or 0) + len(part.records))
            for p, part in sorted(self.partitions.items())
        )
        return IngestStats(
            consumer=self.name,
            records_read=read,
            events_written=self._counts["events"],
            dead_letters=self._counts["dead"],
            duplicates_dropped=self._counts["dups"],
            commits=self._counts["commits"],
            commits_fenced=self._counts["fenced"],
            events_per_s=self._counts["events"] / elapsed,
            dead_letter_rate=self._counts["dead"] / read if read else 0.0,
            last_commit_ns=self._last_commit_ns,
            lag=self._log_lag(lag),
            broker_reachable=self._unreachable_since is None,
        )

    def _log_lag(self, lag: tuple[PartitionLag, ...]) -> tuple[PartitionLag, ...]:
        """``lag`` with the log ends the broker last reported, while it is reachable."""
        if self._consumer is None or self._unreachable_since is not None:
            return lag
        ends = self._log_ends
        return tuple(PartitionLag(p.partition, p.epoch, p.committed, ends.get(p.partition, p.log_end)) for p in lag)

    def _refresh_log_ends(self) -> None:
        """Ask the broker for the assigned partitions' log ends (the consumer's thread only)."""
        from kafka import TopicPartition

        if self._consumer is None or not self.partitions or self._unreachable_since is not None:
            return
        try:
            ends = self._consumer.end_offsets([TopicPartition(self.topic, p) for p in self.partitions],
                                              timeout_ms=_ADVISORY_TIMEOUT_MS)
        except Exception:  # a slow or vanished broker: the last ends stand (the loop must not wait on it)
            return
        self._log_ends = {tp.partition: end for tp, end in ends.items() if tp.topic == self.topic}

    def _report(self, on_status: Callable[[IngestStats], None] | None) -> None:
        self._last_status_s = time.monotonic()
        self._refresh_log_ends()
        stats = self.stats()
        log.info("%s", stats.line())
        write_status(self.lake.root, stats)
        if on_status is not None:
            on_status(stats)


#: How long the consume loop waits on an advisory call to the broker (the partitions' log ends for the status line,
#: Kafka's committed offsets): kafka-python's default is its request timeout, 30 s, which a broker that vanished
#: just then would hold the loop for.
_ADVISORY_TIMEOUT_MS = 2_000


def _not_before(ranges: list[OffsetRange], marks: dict[int, int | None]) -> list[OffsetRange]:
    """``ranges`` as one table commits them: a batch of records read again from below a table's
    mark (after a restart, or a crash between the two tables' commits) never moves the mark back."""
    return [r if r.end >= (marks[r.partition] or 0) else dataclasses.replace(r, end=marks[r.partition]) for r in ranges]


def _Rebalance(owner: IngestConsumer):
    """kafka-python's rebalance callbacks, forwarded to the consumer."""
    from kafka import ConsumerRebalanceListener

    class Listener(ConsumerRebalanceListener):
        def on_partitions_revoked(self, revoked) -> None:
            owner._on_revoked(revoked)

        def on_partitions_assigned(self, assigned) -> None:
            owner._on_assigned(assigned)

    return Listener()


def _topic_id(consumer, topic: str) -> str | None:
    """Kafka's id of the topic's current incarnation (KIP-516), if the broker reports one."""
    try:
        topic_id = consumer._client.cluster.topic_id(topic)
    except Exception:
        return None
    return None if topic_id is None else str(topic_id)


def _any_broker_connected(consumer) -> bool:
    """Whether the consumer holds a live connection to any broker (kafka-python's client state)."""
    client = getattr(consumer, "_client", None)
    if client is None:
        return True
    try:
        return any(client.connected(b.node_id) for b in client.cluster.brokers()) or consumer.bootstrap_connected()
    except Exception:
        return True


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def status_dir(root: str) -> Path:
    return Path(root) / "_ingest"


def write_status(root: str, stats: IngestStats) -> None:
    """The consumer's health as JSON beside the lake (read by ``servelens ingest status``)."""
    if "://" in root:
        return  # object stores: the log line is the health signal
    check_consumer_name(stats.consumer)  # never a path: the file stays in <lake>/_ingest
    folder = status_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    data = asdict(stats) | {"total_lag": stats.total_lag, "written_ns": time.time_ns()}
    tmp = folder / f".{stats.consumer}.json.tmp"
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(folder / f"{stats.consumer}.json")


def read_statuses(root: str) -> list[dict]:
    """The readable status files under ``<lake>/_ingest``, by file name (``read_status_files`` also names the others)."""
    return read_status_files(root)[0]


#: What ``servelens ingest status`` reads of a status file: the field and the JSON types it may have
STATUS_FIELDS: dict[str, tuple[type, ...]] = {
    "consumer": (str,), "written_ns": (int,), "last_commit_ns": (int, type(None)), "records_read": (int,),
    "events_written": (int,), "events_per_s": (int, float), "dead_letters": (int,), "dead_letter_rate": (int, float),
    "total_lag": (int,), "broker_reachable": (bool,),
}
MAX_STATUS_BYTES = 1 << 20
_JSON_TYPE = {str: "a string", int: "an integer", float: "a number", bool: "true or false", type(None): "null",
              list: "a list", dict: "an object"}


def read_status_files(root: str) -> tuple[list[dict], list[tuple[Path, str]]]:
    """(each readable status file's health, by file name; each unreadable one with why): one corrupt file
    (a crash while it was copied, an edit) hides nothing else."""
    folder = status_dir(root)
    statuses: list[dict] = []
    unreadable: list[tuple[Path, str]] = []
    if not folder.is_dir():
        return statuses, unreadable
    for path in sorted(folder.glob("*.json")):
        try:
            statuses.append(_status(path))
        except OSError as exc:
            unreadable.append((path, exc.strerror or type(exc).__name__))
        except ValueError as exc:
            unreadable.append((path, str(exc)))
    return statuses, unreadable


def _status(path: Path) -> dict:
    """One status file's health (``ValueError`` saying why it is not one)."""
    if path.stat().st_size > MAX_STATUS_BYTES:
        raise ValueError(f"larger than {MAX_STATUS_BYTES:,} bytes")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise ValueError("not a status: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object of fields")
    for name, types in STATUS_FIELDS.items():
        if name not in data:
            raise ValueError(f"lacks the field {name!r}")
        value = data[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"field {name!r} is {_JSON_TYPE[type(value)]}, not {' or '.join(_JSON_TYPE[t] for t in types)}")
    return data


def topic_backlog(kafka: KafkaConfig, lake: Lake, timeout_s: float = 5.0) -> tuple[PartitionLag, ...]:
    """Per partition of the event topic: the broker's log end against the lake's committed mark.

    Read-only (a consumer that joins no group); raises ``BrokerUnreachableError`` if no broker
    answers. The development broker reports the last batch's first offset as the log end, so there
    the backlog reads low by up to one batch.
    """
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError

    try:
        consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers.split(","), client_id=kafka.client_id,
                                 request_timeout_ms=int(timeout_s * 1000))
    except KafkaError as exc:
        raise BrokerUnreachableError(kafka.bootstrap_servers, timeout_s, str(exc)) from None
    try:
        partitions = sorted(consumer.partitions_for_topic(kafka.topic) or ())
        ends = consumer.end_offsets([TopicPartition(kafka.topic, p) for p in partitions]) if partitions else {}
        epoch, _ = lake.epoch(kafka.topic, _topic_id(consumer, kafka.topic))
    except KafkaError as exc:
        raise BrokerUnreachableError(kafka.bootstrap_servers, timeout_s, str(exc)) from None
    finally:
        consumer.close()
    return tuple(
        PartitionLag(p, epoch, lake.high_water_mark(EVENTS, kafka.topic, p, epoch) or 0, ends[TopicPartition(kafka.topic, p)])
        for p in partitions
    )


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # its connection noise; ours says what matters

