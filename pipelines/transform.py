"""The ingest's CPU-heavy middle step: decode, validate and sanitize a batch, in a worker process.

The ingest process polls Kafka and commits to the lake; kafka-python parses every record in Python,
holding the interpreter's lock most of the time. Decoding (``pipelines.decode``) and sanitizing
(``privacy.sanitize``) cost about as much CPU again, and in a thread of the same process they would
wait for that lock. So they run in one child process with an interpreter of its own
(``TransformWorker``: ``python -m pipelines.transform``, spoken to in pickles over two pipes). Batches
queue in order (``submit``: a future of the result): a thread writes each batch to the worker while the
worker still works on the one before, another reads the results, so the worker never waits for the
ingest's interpreter lock between batches. The ingest hands it the raw values and which messages are
fresh, then de-duplicates and commits the results in order.

The step keeps no state the lake relies on: the sanitizer's sketches and caches shape only which
labels fold into "other" and what is cached, so a restarted worker starts them anew, as a restarted
ingest process always has. The worker dies with its parent (``PR_SET_PDEATHSIG``; elsewhere, at the
closed pipe), so a SIGKILLed ingest leaves no process behind; a worker that dies alone fails the
commit with a clear error (``TransformWorkerDied``) and nothing of that batch is stored.

``IngestConfig.transform_process = false`` runs the same step in the ingest process's commit thread.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import queue
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipelines.decode import Decoder, Rejected
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.sanitize import FIELD_POLICIES, PrivacyReport, Sanitizer
from servelens.errors import ServelensError

EVENT_ID = FIELD_POLICIES["event_id"]  # how the sanitizer pseudonymizes event ids
_ROOT = Path(__file__).resolve().parents[1]  # the project root: the worker imports from it
PIPE_BUFFER_BYTES = 1 << 20


class TransformWorkerDied(ServelensError):
    """The transform worker process ended while the ingest needed it."""


@dataclass(frozen=True, slots=True)
class TransformSpec:
    """Everything a worker needs to build its decoder and sanitizer (picklable: keys as bytes)."""

    max_message_bytes: int
    max_future_skew_ns: int | None
    message_format: str
    privacy: PrivacyConfig
    active_key_id: str
    secrets: Mapping[str, bytes]

    def build(self) -> Transform:
        decoder = Decoder(max_message_bytes=self.max_message_bytes, max_future_skew_ns=self.max_future_skew_ns,
                          message_format=self.message_format)
        return Transform(decoder, Sanitizer(KeyRing(self.active_key_id, dict(self.secrets)), self.privacy))


@dataclass(frozen=True, slots=True)
class Transformed:
    """One batch, decoded and sanitized."""

    clean: pa.Table  # the sanitized events of fresh messages (EVENTS_SCHEMA), in message order
    rejected: list[Rejected]  # messages that are not valid events (fresh or not: the caller filters)
    stored_ids: list[str]  # pseudonymized event ids of the valid events of messages not fresh
    report: PrivacyReport  # the sanitizer's cumulative counts


class Transform:
    """Decode, validate and sanitize one batch (where it runs is ``TransformWorker``'s business)."""

    def __init__(self, decoder: Decoder, sanitizer: Sanitizer) -> None:
        self.decoder = decoder
        self.sanitizer = sanitizer

    def __call__(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> Transformed:
        """``fresh[i]``: message i is past the lake's events mark (messages below it were stored
        already: their event ids come back, pseudonymized, to warm de-duplication)."""
        decoded = self.decoder.decode(values, now_ns=now_ns)
        keep = fresh[decoded.indices]
        events = decoded.events if keep.all() else decoded.events.filter(pa.array(keep))
        stored: list[str] = []
        if not keep.all():
            ids = decoded.events.filter(pa.array(~keep))["event_id"].to_pylist()
            stored = self.sanitizer.keyring.pseudonyms(EVENT_ID.kind, ids, hex_chars=EVENT_ID.hex_chars)
        clean = self.sanitizer.sanitize(events, decoded.dropped_fields)
        return Transformed(clean, decoded.rejected, stored, self.sanitizer.report())


# -- the worker process ---------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False if the parent is gone already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the closed pipe ends the worker instead
    return os.getppid() == parent_pid


def _widen(pipe_fd: int) -> None:
    """Give a pipe Linux's largest unprivileged buffer (1 MiB, not 64 KiB): a batch crosses in a few
    dozen writes, and a thread writing it waits for the interpreter lock after each one."""
    try:
        import fcntl

        fcntl.fcntl(pipe_fd, fcntl.F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or a lower limit: the default works too
        pass


def _send(stream, message: object) -> None:
    pickle.dump(message, stream, protocol=pickle.HIGHEST_PROTOCOL)
    stream.flush()


def _serve(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """The worker's loop: a spec, then (values, fresh, now_ns) batches until the parent closes the pipe."""
    if not _die_with_parent(parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent: it stops, then closes us
    with os.fdopen(read_fd, "rb") as rx, os.fdopen(write_fd, "wb") as tx:
        try:
            transform = pickle.load(rx).build()
            transform.sanitizer.load()
            _send(tx, ("ok", None))
        except EOFError:
            return
        except Exception as exc:  # a bad configuration: the parent raises it
            _send(tx, ("error", exc))
            return
        while True:
            try:
                args = pickle.load(rx)
            except EOFError:
                return
            try:
                reply = ("ok", transform(*args))
            except Exception as exc:
                reply = ("error", exc)
            _send(tx, reply)


class TransformWorker:
    """Runs ``Transform`` in a child process (``python -m pipelines.transform``, spoken to over two
    pipes), or (``in_process=True``) on a thread of this process. Batches are done in the order
    submitted."""

    def __init__(self, spec: TransformSpec, *, in_process: bool = False) -> None:
        self.spec = spec
        self.in_process = in_process
        self._local: ThreadPoolExecutor | None = None  # in process: the thread, and its transform
        self._transform: Transform | None = None
        self._process: subprocess.Popen | None = None
        self._tx = self._rx = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # batches for the sender thread; None: close
        self._pending: deque[Future] = deque()  # one per batch sent, oldest first: the receiver resolves them
        self._lock = threading.Lock()
        self._dead: TransformWorkerDied | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> TransformWorker:
        """Start the worker and wait until its sanitizer is built (Presidio takes seconds): a bad
        configuration fails here, and the first batch does not wait."""
        if self.in_process:
            transform = self.spec.build()
            transform.sanitizer.load()
            self._local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelens-transform")
            self._transform = transform
            return self
        to_child, from_parent = os.pipe()[::-1]
        to_parent, from_child = os.pipe()[::-1]
        for fd in (to_child, to_parent):
            _widen(fd)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pipelines.transform", str(from_parent), str(to_parent), str(os.getpid())],
            pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(from_parent)
        os.close(to_parent)
        self._tx, self._rx = os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb")
        try:
            _send(self._tx, self.spec)
            status, value = pickle.load(self._rx)
        except (BrokenPipeError, EOFError, OSError):
            raise self._died() from None
        if status == "error":
            raise value
        self._threads = [threading.Thread(target=loop, name=f"servelens-transform-{loop.__name__[1:]}", daemon=True)
                         for loop in (self._sender, self._receiver)]
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> Future[Transformed]:
        """Queue a batch; its result (or the error that ended it) comes in the future."""
        if self._local is not None:
            return self._local.submit(self._transform, values, fresh, now_ns)
        if self._process is None:
            raise RuntimeError("TransformWorker used before start()")
        future: Future[Transformed] = Future()
        with self._lock:
            if self._dead is not None:
                future.set_exception(self._dead)
                return future
            self._pending.append(future)
            self._outbox.put((values, fresh, now_ns))
        return future

    def __call__(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> Transformed:
        return self.submit(values, fresh, now_ns).result()

    def _sender(self) -> None:
        """Write queued batches to the worker, in order (blocks while the worker is busy: the pipe is full)."""
        while (message := self._outbox.get()) is not None:
            try:
                _send(self._tx, message)
            except (BrokenPipeError, OSError):
                return  # the worker ended: the receiver fails the pending batches
        self._tx.close()  # closing: the worker ends at the closed pipe

    def _receiver(self) -> None:
        """Read the worker's results, in order, into the oldest pending futures."""
        while True:
            try:
                status, value = pickle.load(self._rx)
            except Exception:  # EOF, or a reply cut short: the worker ended
                break
            with self._lock:
                future = self._pending.popleft()
            if status == "error":
                future.set_exception(value)
            else:
                future.set_result(value)
        with self._lock:  # the worker ended: every batch still pending fails, and every later one
            self._dead = self._died()
            while self._pending:
                self._pending.popleft().set_exception(self._dead)

    def _died(self) -> TransformWorkerDied:
        try:
            code = self._process.wait(timeout=5) if self._process is not None else None
        except subprocess.TimeoutExpired:  # its pipe closed, the process not ended yet
            code = None
        return TransformWorkerDied(
            f"the ingest's transform worker process ended (exit status {code}: killed, or out of memory); "
            "nothing of the batch was stored",
            "restart the ingest: it resumes from the lake's marks",
        )

    def close(self) -> None:
        """Finish the batches queued, then end the worker."""
        if self._local is not None:
            self._local.shutdown(wait=True)
            self._local = None
        process = self._process
        if self._threads:
            self._outbox.put(None)  # the sender writes what is queued, then closes the pipe: the worker ends
            self._threads[0].join(timeout=60)
        if process is not None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for thread in self._threads:  # both end now that the worker has
            thread.join()
        self._threads = []
        self._process = None
        for stream in (self._tx, self._rx):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # the worker ended with a batch half written
                    pass
        self._tx = self._rx = None


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
