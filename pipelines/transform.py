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
closed pipe), so a SIGKILLed ingest leaves no process behind.

**Poison isolation.** A worker that dies (a parser's crash on one message, a signal from outside)
fails its pending batches with ``TransformWorkerDied``, which says how it ended (the signal, or the
exit status). The ingest then calls ``recover`` for each failed batch, in order: a fresh worker
transforms the batch again; if that one dies too, the batch is bisected in short-lived probe
processes (``python -m pipelines.transform --probe``: the same transform, one sub-batch, then exit)
until each message that kills a process on its own is found; those become ``parser_crash`` rejections
(dead letters) and the rest is transformed by a fresh worker. So a message that crashes the parser
costs about two probes per halving, and every other message of its batch is stored exactly once.

``IngestConfig.transform_process = false`` runs the same step in the ingest process's commit thread:
there a crash of the parser ends the ingest process (no isolation), so keep the byte-scan guards
(``ingest.max_json_depth``) on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipelines.decode import Decoder, sniff_event_type
from pipelines.decoded import Rejected
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.sanitize import FIELD_POLICIES, PrivacyReport, Sanitizer
from schemas.validate import FieldError
from servelens.errors import ServelensError

EVENT_ID = FIELD_POLICIES["event_id"]  # how the sanitizer pseudonymizes event ids
_ROOT = Path(__file__).resolve().parents[1]  # the project root: the worker imports from it
PIPE_BUFFER_BYTES = 1 << 20


PARSER_CRASH = "parser_crash"
PROBE_TIMEOUT_S = 120.0


class TransformWorkerDied(ServelensError):
    """The transform worker process ended while the ingest needed it (``signal``: the signal that
    ended it, when one did; ``exit_status`` otherwise)."""

    def __init__(self, message: str, hint: str | None = None, *, signal_name: str | None = None,
                 exit_status: int | None = None) -> None:
        super().__init__(message, hint)
        self.signal_name = signal_name
        self.exit_status = exit_status


def _ended(code: int | None) -> tuple[str, str | None]:
    """How a process with return code ``code`` ended, in words, and the signal's name."""
    if code is None:
        return "its pipe closed while it was still running", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        cause = {"SIGSEGV": "a crash in native code, e.g. a parser's on a malformed message",
                 "SIGKILL": "killed from outside the ingest: an operator, a supervisor or the kernel",
                 "SIGABRT": "an abort in native code"}.get(name, "a signal")
        return f"killed by {name} ({cause})", name
    return f"exited with status {code}", None


@dataclass(frozen=True, slots=True)
class TransformSpec:
    """Everything a worker needs to build its decoder and sanitizer (picklable: keys as bytes)."""

    max_message_bytes: int
    max_future_skew_ns: int | None
    message_format: str
    privacy: PrivacyConfig
    active_key_id: str
    secrets: Mapping[str, bytes]
    max_json_depth: int = 32

    def build(self) -> Transform:
        decoder = Decoder(max_message_bytes=self.max_message_bytes, max_future_skew_ns=self.max_future_skew_ns,
                          message_format=self.message_format, max_json_depth=self.max_json_depth)
        return Transform(decoder, Sanitizer(KeyRing(self.active_key_id, dict(self.secrets)), self.privacy))


@dataclass(frozen=True, slots=True)
class Transformed:
    """One batch, decoded and sanitized."""

    clean: pa.Table  # the sanitized events of fresh messages (EVENTS_SCHEMA), in message order
    rejected: list[Rejected]  # messages that are not valid events (fresh or not: the caller filters)
    stored_ids: list[str]  # pseudonymized event ids of the valid events of messages not fresh
    report: PrivacyReport  # the sanitizer's cumulative counts
    clean_messages: np.ndarray  # the message index of each row of ``clean``
    stored_messages: np.ndarray  # the message index of each of ``stored_ids``


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
        return Transformed(clean, decoded.rejected, stored, self.sanitizer.report(),
                           clean_messages=decoded.indices[keep], stored_messages=decoded.indices[~keep])


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


@dataclass(frozen=True, slots=True)
class Crash:
    """A message that killed a transform process on its own."""

    index: int  # position in the batch
    how: str  # how the process ended, in words
    signal_name: str | None


@dataclass
class _Generation:
    """One worker process, its pipes, its threads and the batches sent to it."""

    process: subprocess.Popen
    tx: object
    rx: object
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # batches for the sender; None: close
    pending: deque = field(default_factory=deque)  # one future per batch sent, oldest first
    dead: TransformWorkerDied | None = None
    threads: list = field(default_factory=list)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    return env


def probe(spec: TransformSpec, values: list[bytes], fresh: np.ndarray, now_ns: int, *, decode_only: bool = False) -> int | None:
    """Transform ``values`` (``decode_only``: decode them, the parsers' part, without the sanitizer's
    seconds of start-up) in a short-lived process of its own; its return code (0: it survived;
    negative: the signal that killed it; None: it ran past ``PROBE_TIMEOUT_S``)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pipelines.transform", "--probe-decode" if decode_only else "--probe"],
                              input=pickle.dumps((spec, values, fresh, now_ns), protocol=pickle.HIGHEST_PROTOCOL),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_child_env(),
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    return done.returncode


def find_crashes(spec: TransformSpec, values: list[bytes], fresh: np.ndarray, now_ns: int,
                 lo: int = 0, hi: int | None = None, *, known_bad: bool = False, decode_only: bool = False) -> list[Crash]:
    """Bisect ``values[lo:hi]`` in probe processes down to the messages that kill one on their own."""
    hi = len(values) if hi is None else hi
    if hi <= lo:
        return []
    known = known_bad and hi - lo > 1  # a crash known to be in here: split without a probe
    code = None if known else probe(spec, values[lo:hi], fresh[lo:hi], now_ns, decode_only=decode_only)
    if code is not None and code >= 0:  # it survived (an exception is an answer, as in the worker, not a death)
        return []
    if hi - lo == 1:
        how, name = _ended(code) if code is not None else (f"stalled past {PROBE_TIMEOUT_S:.0f} s", None)
        return [Crash(lo, how, name)]
    mid = (lo + hi) // 2
    left = find_crashes(spec, values, fresh, now_ns, lo, mid, decode_only=decode_only)
    # a deterministic crash in the whole and none on the left: the right half holds it (no probe needed)
    return left + find_crashes(spec, values, fresh, now_ns, mid, hi, known_bad=not left and (known or code is not None),
                               decode_only=decode_only)


def without_crashes(done: Transformed, keep: list[int], crashes: list[Crash], values: list[bytes]) -> Transformed:
    """A sub-batch's result (of messages ``keep``) as the whole batch's: indices mapped back, and each
    crash a ``parser_crash`` rejection."""
    rejected = [dataclasses.replace(r, index=keep[r.index]) for r in done.rejected]
    for crash in crashes:
        error = FieldError(PARSER_CRASH, "$", f"the message alone {crash.how}")
        rejected.append(Rejected(crash.index, len(values[crash.index]), (error,), sniff_event_type(values[crash.index])))
    kept = np.asarray(keep, dtype=np.int64)
    return Transformed(done.clean, sorted(rejected, key=lambda r: r.index), done.stored_ids, done.report,
                       clean_messages=kept[done.clean_messages], stored_messages=kept[done.stored_messages])


class TransformWorker:
    """Runs ``Transform`` in a child process (``python -m pipelines.transform``, spoken to over two
    pipes), or (``in_process=True``) on a thread of this process. Batches are done in the order
    submitted; a worker that died is replaced by ``recover``."""

    def __init__(self, spec: TransformSpec, *, in_process: bool = False) -> None:
        self.spec = spec
        self.in_process = in_process
        self._local: ThreadPoolExecutor | None = None  # in process: the thread, and its transform
        self._transform: Transform | None = None
        self._gen: _Generation | None = None
        self._lock = threading.Lock()
        self.num_restarts = 0

    @property
    def pid(self) -> int | None:
        """The worker process's id (None in process)."""
        return self._gen.process.pid if self._gen is not None else None

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
        process = subprocess.Popen(
            [sys.executable, "-m", "pipelines.transform", str(from_parent), str(to_parent), str(os.getpid())],
            pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=_child_env(),
        )
        os.close(from_parent)
        os.close(to_parent)
        gen = _Generation(process, os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb"))
        try:
            _send(gen.tx, self.spec)
            status, value = pickle.load(gen.rx)
        except (BrokenPipeError, EOFError, OSError):
            raise _died(gen) from None
        if status == "error":
            raise value
        gen.threads = [threading.Thread(target=loop, args=(gen,), name=f"servelens-transform-{loop.__name__[1:]}", daemon=True)
                       for loop in (self._sender, self._receiver)]
        for thread in gen.threads:
            thread.start()
        with self._lock:
            self._gen = gen
        return self

    def submit(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> Future[Transformed]:
        """Queue a batch; its result (or the error that ended it) comes in the future."""
        if self._local is not None:
            return self._local.submit(self._transform, values, fresh, now_ns)
        if self._gen is None:
            raise RuntimeError("TransformWorker used before start()")
        future: Future[Transformed] = Future()
        with self._lock:
            gen = self._gen
            if gen.dead is not None:
                future.set_exception(gen.dead)
                return future
            gen.pending.append(future)
            gen.outbox.put((values, fresh, now_ns))
        return future

    def __call__(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> Transformed:
        return self.submit(values, fresh, now_ns).result()

    def recover(self, values: list[bytes], fresh: np.ndarray, now_ns: int) -> tuple[Transformed, list[Crash]]:
        """Transform a batch whose worker died: again on a fresh worker; if that one dies too, find
        the messages that kill a process on their own (``find_crashes``) and transform the rest.
        Returns the result (crashes as ``parser_crash`` rejections) and the crashes."""
        self._restart()
        try:
            return self.submit(values, fresh, now_ns).result(), []
        except TransformWorkerDied:
            pass
        # the parsers first (probes start in a fraction of a second), then the whole transform
        crashes = (find_crashes(self.spec, values, fresh, now_ns, decode_only=True)
                   or find_crashes(self.spec, values, fresh, now_ns, known_bad=True))
        bad = {c.index for c in crashes}
        keep = [i for i in range(len(values)) if i not in bad]
        self._restart()
        done = self.submit([values[i] for i in keep], fresh[keep], now_ns).result()
        return without_crashes(done, keep, crashes, values), crashes

    def _restart(self) -> None:
        """Replace a dead worker by a fresh one (a live one is kept)."""
        gen = self._gen
        if gen is None or gen.dead is None:
            return
        self._end(gen)
        self.num_restarts += 1
        self.start()

    def _sender(self, gen: _Generation) -> None:
        """Write queued batches to the worker, in order (blocks while the worker is busy: the pipe is full)."""
        while (message := gen.outbox.get()) is not None:
            try:
                _send(gen.tx, message)
            except (BrokenPipeError, OSError, ValueError):
                return  # the worker ended: the receiver fails the pending batches
        try:
            gen.tx.close()  # closing: the worker ends at the closed pipe
        except OSError:
            pass

    def _receiver(self, gen: _Generation) -> None:
        """Read the worker's results, in order, into the oldest pending futures."""
        while True:
            try:
                status, value = pickle.load(gen.rx)
            except Exception:  # EOF, or a reply cut short: the worker ended
                break
            with self._lock:
                future = gen.pending.popleft()
            if status == "error":
                future.set_exception(value)
            else:
                future.set_result(value)
        dead = _died(gen)
        with self._lock:  # the worker ended: every batch still pending fails, and every later one
            gen.dead = dead
            while gen.pending:
                gen.pending.popleft().set_exception(dead)
        gen.outbox.put(None)  # the sender stops too

    def _end(self, gen: _Generation) -> None:
        """Finish the batches queued to ``gen``, then end its process and threads."""
        if gen.threads:
            gen.outbox.put(None)  # the sender writes what is queued, then closes the pipe: the worker ends
            gen.threads[0].join(timeout=60)
        try:
            gen.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            gen.process.kill()
            gen.process.wait()
        for thread in gen.threads:  # both end now that the worker has
            thread.join()
        for stream in (gen.tx, gen.rx):
            try:
                stream.close()
            except OSError:  # the worker ended with a batch half written
                pass

    def close(self) -> None:
        """Finish the batches queued, then end the worker."""
        if self._local is not None:
            self._local.shutdown(wait=True)
            self._local = None
        if self._gen is not None:
            self._end(self._gen)
            self._gen = None


def _died(gen: _Generation) -> TransformWorkerDied:
    try:
        code = gen.process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # its pipe closed, the process not ended yet
        code = None
    how, name = _ended(code)
    return TransformWorkerDied(
        f"the ingest's transform worker process {how}; its pending batches are transformed again by a fresh "
        "worker, and a message that kills it on its own goes to dead letters as parser_crash",
        "if it recurs without a parser_crash dead letter, look for what kills the process from outside",
        signal_name=name, exit_status=code,
    )


def _probe_main(decode_only: bool) -> None:
    """``--probe``: one batch from stdin, transformed (``--probe-decode``: decoded); the exit status is the answer."""
    spec, values, fresh, now_ns = pickle.load(sys.stdin.buffer)
    transform = spec.build()
    if decode_only:
        transform.decoder.decode(values, now_ns=now_ns)
    else:
        transform(values, fresh, now_ns)


if __name__ == "__main__":
    if sys.argv[1] in ("--probe", "--probe-decode"):
        _probe_main(sys.argv[1] == "--probe-decode")
    else:
        _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
