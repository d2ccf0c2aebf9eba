"""A stateful consumer run in a child process, fed in order over a socket, so that its work runs beside the replay.

The replay's thread is the bottleneck of a large replay and Python threads share one interpreter lock, so
work that only needs arrays (building a replay's outputs from its gathered columns: ``replay.outputs``) goes
to another process. ``Offloaded`` starts a fresh interpreter (``python -c``, not ``multiprocessing``'s spawn, which
would run the caller's main script again in the child: a user's script without a ``__main__`` guard
would replay twice), hands it the caller's ``sys.path`` and the consumer's factory over a socket pair,
sends each message as a pickle whose numpy buffers travel out of band (one copy into the socket, none
into the pickle), and returns what the consumer's ``close`` returns. The socket is the queue: a
consumer slower than the replay makes the replay wait, so memory stays flat.

An exception in the child is sent back and raised by the next ``feed`` or by ``close`` (with the child's
traceback as a note); a child that dies is a ``ReplayError`` naming it. The child runs in a session of
its own, so a Ctrl-C reaches only the replay, which aborts it (``abort``); a parent that dies closes the
socket, and the child aborts the consumer and exits.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from replay.errors import ReplayError

_FEED, _CLOSE, _ABORT = "feed", "close", "abort"
_MAX_REPORT_BYTES = 16_384  # an error's pickle and traceback, each: well inside a socket's buffer


class Consumer(Protocol):
    """What runs in the child: fed messages in order, then closed (its result goes back) or aborted."""

    def feed(self, message: Any) -> None: ...

    def close(self) -> Any: ...

    def abort(self) -> None: ...


def _send(conn: Connection, kind: str, message: Any = None) -> None:
    """One message: its buffers' sizes, its pickle, then each buffer as it lies in memory."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps((kind, message), protocol=5, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    conn.send_bytes(pickle.dumps([raw.nbytes for raw in raws]))
    conn.send_bytes(header)
    for raw in raws:
        conn.send_bytes(raw)


def _receive(conn: Connection) -> tuple[str, Any]:
    sizes = pickle.loads(conn.recv_bytes())
    header = conn.recv_bytes()
    buffers = []
    for size in sizes:  # into writable memory: the arrays they become are the consumer's to change
        buffer = bytearray(size)
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    kind, message = pickle.loads(header, buffers=buffers)
    return kind, message


#: The child's program: the caller's import path, then ``serve`` on the socket it inherited.
_CHILD = ("import sys; from multiprocessing.connection import Connection; conn = Connection(int(sys.argv[1])); "
          "sys.path[:0] = conn.recv(); from replay.offload import serve; serve(conn)")


def serve(conn: Connection) -> None:
    """The child: build the consumer and feed it until told to close or abort. After an error (reported once)
    the rest of the feed is drained, so the parent's sends never block on a dead reader."""
    consumer: Consumer | None = None
    try:
        factory, args, kwargs = conn.recv()
        consumer = factory(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _report(conn, exc)
    while True:
        try:
            kind, message = _receive(conn)
        except (EOFError, OSError):  # the parent is gone
            kind, message = _ABORT, None
        if kind == _FEED:
            if consumer is not None:
                try:
                    consumer.feed(message)
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    _failed(conn, consumer, exc)
                    consumer = None
            continue
        if consumer is None or kind == _ABORT:
            if consumer is not None:
                _abort_quietly(consumer)
            if kind == _CLOSE:
                conn.send(("failed", None))
            return
        try:
            result = consumer.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            _failed(conn, consumer, exc)
            conn.send(("failed", None))
            return
        conn.send(("done", result))
        return


def _failed(conn: Connection, consumer: Consumer, exc: BaseException) -> None:
    _report(conn, exc)
    _abort_quietly(consumer)


def _abort_quietly(consumer: Consumer) -> None:
    try:
        consumer.abort()
    except Exception:  # noqa: BLE001 - best effort after the original error
        pass


def _report(conn: Connection, exc: BaseException) -> None:
    """Send ``exc`` back, small enough for the socket's buffer (the parent may be busy sending: the child must
    not block on a reply the parent is not reading yet)."""
    text = "".join(traceback.format_exception(exc))[-_MAX_REPORT_BYTES:]
    try:
        payload = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
        payload = b""
    if not payload or len(payload) > _MAX_REPORT_BYTES:
        payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {str(exc)[:_MAX_REPORT_BYTES // 4]}"))
    try:
        conn.send(("error", (payload, text)))
    except OSError:
        pass


class Offloaded:
    """``factory(*args, **kwargs)`` built and run in a child process; ``feed`` sends it a message, ``close`` returns
    its result."""

    def __init__(self, factory: Callable[..., Consumer], *args: Any, name: str, **kwargs: Any) -> None:
        self.name = name
        mine, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self._conn = Connection(mine.detach())
        self._conn.send(sys.path)
        self._conn.send((factory, args, kwargs))
        self._open = True

    def feed(self, message: Any) -> None:
        """Send ``message`` to the consumer (raises an error the child reported since the last call)."""
        try:
            self._raise_reported()
            _send(self._conn, _FEED, message)
        except (EOFError, OSError) as exc:  # the child is gone (an error it reported was raised above)
            raise self._died() from exc

    def close(self) -> Any:
        """Close the consumer and return what its ``close`` returned."""
        try:
            _send(self._conn, _CLOSE)
            status, value = self._conn.recv()  # an error the consumer reported comes before its "failed"
            if status == "error":
                self._raise_error(value)
            if status != "done":
                raise self._died()
            return value
        except (EOFError, OSError) as exc:
            raise self._died() from exc
        finally:
            self._finish()

    def abort(self) -> None:
        """Abort the consumer (after a failed replay), without raising what it reported."""
        if not self._open:
            return
        try:
            _send(self._conn, _ABORT)
        except OSError:
            pass
        self._finish(timeout_s=30)

    def _finish(self, timeout_s: float | None = None) -> None:
        self._open = False
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()

    def _raise_reported(self) -> None:
        while self._conn.poll():
            status, value = self._conn.recv()
            if status == "error":
                self._raise_error(value)

    def _raise_error(self, value: tuple[bytes, str]) -> None:
        payload, text = value
        self.abort()
        exc = pickle.loads(payload)
        exc.add_note(f"in the {self.name} process:\n{text}")
        raise exc

    def _died(self) -> ReplayError:
        try:
            code: int | None = self._process.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        return ReplayError(f"the {self.name} process exited (exit code {code}): its output is incomplete",
                           "what it printed above says why (killed: memory?); the replay itself can be run again as is")
