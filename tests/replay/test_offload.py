"""replay.offload: a consumer in a child process gets every message in order, its arrays intact and its own; its
result comes back; its errors, and its death, surface in the parent; the caller's script never runs twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from replay.errors import ReplayError
from replay.offload import Offloaded

ROOT = Path(__file__).resolve().parents[2]


class Summing:
    """Sums what it is fed (changing each array in place first: they must be writable); fails on request."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.total = 0
        self.seen: list[int] = []

    def feed(self, message: dict) -> None:
        if message.get("fail"):
            raise ValueError(f"asked to fail at message {message['n']}")
        values = message["values"]
        values += 1  # in place
        self.total += int(values.sum())
        self.seen.append(message["n"])

    def close(self) -> dict:
        return {"total": self.total, "seen": self.seen, "pid": os.getpid()}

    def abort(self) -> None:
        self.out.write_text("aborted")


def test_messages_arrive_in_order_with_their_arrays_and_the_result_comes_back(tmp_path):
    child = Offloaded(Summing, str(tmp_path / "x"), name="summing")
    expected = 0
    for n in range(50):
        values = np.arange(n * 1000, dtype=np.int64)
        child.feed({"n": n, "values": values, "empty": np.zeros(0), "text": np.array(["a", None], object)})
        expected += int(values.sum()) + len(values)
        assert values[:1].tolist() == ([0] if n else [])  # the parent's array is not the child's
    result = child.close()
    assert result["total"] == expected
    assert result["seen"] == list(range(50))
    assert result["pid"] != os.getpid()


def test_an_error_in_the_child_is_raised_in_the_parent_with_the_childs_traceback(tmp_path):
    child = Offloaded(Summing, str(tmp_path / "x"), name="summing")
    child.feed({"n": 0, "values": np.ones(3, np.int64)})
    child.feed({"n": 1, "fail": True})
    with pytest.raises(ValueError, match="asked to fail at message 1") as caught:
        for n in range(2, 10_000):  # raised by a later feed, or at the latest by close
            child.feed({"n": n, "values": np.ones(3, np.int64)})
        child.close()
    assert any("in the summing process" in note and ", in feed" in note for note in caught.value.__notes__)
    assert (tmp_path / "x").read_text() == "aborted"  # the consumer was aborted


def test_a_consumer_that_cannot_be_built_fails_at_the_first_call(tmp_path):
    child = Offloaded(Summing, str(tmp_path / "x"), "extra", name="summing")
    with pytest.raises(TypeError):
        child.feed({"n": 0, "values": np.ones(1, np.int64)})
        child.close()


def test_a_child_that_dies_is_a_replay_error_naming_it(tmp_path):
    child = Offloaded(Summing, str(tmp_path / "x"), name="summing")
    child.feed({"n": 0, "values": np.ones(1, np.int64)})
    os.kill(child._process.pid, signal.SIGKILL)
    child._process.wait()
    with pytest.raises(ReplayError, match="the summing process exited"):
        for n in range(1, 10_000):
            child.feed({"n": n, "values": np.ones(100_000, np.int64)})
        child.close()


def test_abort_stops_the_child_and_aborts_the_consumer(tmp_path):
    child = Offloaded(Summing, str(tmp_path / "x"), name="summing")
    child.feed({"n": 0, "values": np.ones(1, np.int64)})
    child.abort()
    assert child._process.returncode is not None
    assert (tmp_path / "x").read_text() == "aborted"


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    # multiprocessing's spawn would import the script again in the child, running it twice
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import numpy as np
        from replay.offload import Offloaded
        from tests.replay.test_offload import Summing
        with open({str(tmp_path / "runs")!r}, "a") as fh:
            fh.write("run\\n")
        child = Offloaded(Summing, {str(tmp_path / "x")!r}, name="summing")
        child.feed({{"n": 0, "values": np.arange(4)}})
        print(child.close()["total"])
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "10"
    assert (tmp_path / "runs").read_text() == "run\n"


class Shouting(Summing):
    """Fails with a message far larger than a socket's buffer."""

    def feed(self, message: dict) -> None:
        raise ValueError("x" * 5_000_000)


@pytest.mark.timeout(60)  # unshortened, the child blocks sending it while the parent blocks sending to the child
def test_an_error_with_a_huge_message_comes_back_shortened_while_the_parent_sends(tmp_path):
    child = Offloaded(Shouting, str(tmp_path / "x"), name="shouting")
    big = np.ones(2_000_000, np.int64)  # 16 MB a message: the parent is mid-send when the child reports
    with pytest.raises(RuntimeError, match="ValueError: xxx") as caught:
        for n in range(20):
            child.feed({"n": n, "values": big})
        child.close()
    assert len(str(caught.value)) < 20_000
