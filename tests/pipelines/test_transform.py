"""The ingest's transform worker: the same results as in process, a clear error when it dies, and no
process left behind when the ingest is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pipelines.transform import EVENT_ID, TransformSpec, TransformWorker, TransformWorkerDied
from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from schemas.events import RequestArrived, RequestFinished
from schemas.wire import encode_event
from servelens.errors import ConfigError

SPEC = TransformSpec(max_message_bytes=4096, max_future_skew_ns=None, message_format="servelens", privacy=PrivacyConfig(),
                     active_key_id="test", secrets={"test": bytes(range(32))})


def messages() -> list[bytes]:
    t0 = 1_764_000_000_000_000_000
    out = []
    for i in range(40):
        out.append(encode_event(RequestArrived(event_id=f"e{i}", ts_ns=t0 + i, engine_id="eng", request_id=f"r{i}",
                                               num_prompt_tokens=10 + i, tenant=f"tenant-{i % 3}")))
        out.append(encode_event(RequestFinished(event_id=f"f{i}", ts_ns=t0 + 10 + i, engine_id="eng", request_id=f"r{i}",
                                                outcome="error", num_output_tokens=1,
                                                error_message=f"failed for alice{i}@example.com")))
    out[5] = b"not json"  # a poison message
    out[6] = b"x" * 5000  # oversized
    return out


def test_the_worker_process_gives_what_the_in_process_transform_gives() -> None:
    values = messages()
    fresh = np.arange(len(values)) >= 10  # the first ten were stored before a crash
    local = TransformWorker(SPEC, in_process=True).start()
    worker = TransformWorker(SPEC).start()
    try:
        a, b = local(values, fresh, 1_764_000_000_000_000_000), worker(values, fresh, 1_764_000_000_000_000_000)
    finally:
        worker.close()
    assert b.clean.equals(a.clean) and b.clean.num_rows == len(values) - 10  # 5 and 6 are below the mark
    assert [r.index for r in b.rejected] == [r.index for r in a.rejected] == [5, 6]
    assert b.stored_ids == a.stored_ids and len(b.stored_ids) == 8
    ids = ["e0", "f0", "e1", "f1", "e2", "f3", "e4", "f4"]  # messages 0-9 but 5 and 6, in order
    assert b.stored_ids == KeyRing("test", SPEC.secrets).pseudonyms(EVENT_ID.kind, ids, hex_chars=EVENT_ID.hex_chars)
    # the message behind each event (ingest finds its partition by it): one event per message here
    assert b.stored_messages.tolist() == a.stored_messages.tolist() == [0, 1, 2, 3, 4, 7, 8, 9]
    assert b.clean_messages.tolist() == a.clean_messages.tolist() == list(range(10, len(values)))
    assert b.report == a.report and b.report.redactions.get("EMAIL_ADDRESS", 0) >= 1
    assert "alice" not in str(b.clean.column("error_message").to_pylist())


def test_batches_queued_together_come_back_in_order_as_in_process() -> None:
    """The ingest queues the next batch while the worker still works on one: results keep their order."""
    batches = [messages()[i::3] for i in range(3)]
    local = TransformWorker(SPEC, in_process=True).start()
    worker = TransformWorker(SPEC).start()
    try:
        futures = [worker.submit(b, np.ones(len(b), dtype=bool), 1_764_000_000_000_000_000) for b in batches]
        results = [f.result(timeout=60) for f in futures]
        expected = [local(b, np.ones(len(b), dtype=bool), 1_764_000_000_000_000_000) for b in batches]
    finally:
        worker.close()
        local.close()
    for got, want in zip(results, expected):
        assert got.clean.equals(want.clean) and got.clean.num_rows > 0
        assert [r.index for r in got.rejected] == [r.index for r in want.rejected]
    ids = [r.clean["event_id"].to_pylist() for r in results]
    assert len(set(ids[0]) | set(ids[1]) | set(ids[2])) == sum(map(len, ids))  # three different batches


def test_a_worker_killed_by_a_signal_says_so_and_recover_transforms_the_batch_again() -> None:
    """Killed from outside (SIGKILL): every queued batch fails naming the signal (never 'out of memory');
    ``recover`` transforms it on a fresh worker, with the same result and no parser_crash."""
    values, fresh = messages(), np.ones(80, dtype=bool)
    worker = TransformWorker(SPEC).start()
    try:
        expected = worker(values, fresh, 0)
        os.kill(worker.pid, signal.SIGKILL)
        futures = [worker.submit(values, fresh, 0) for _ in range(3)]
        for future in futures:
            with pytest.raises(TransformWorkerDied) as err:
                future.result(timeout=30)
            assert "killed by SIGKILL" in str(err.value) and "memory" not in str(err.value)
            assert err.value.signal_name == "SIGKILL"
        first_pid = worker.pid
        done, crashes = worker.recover(values, fresh, 0)
        assert crashes == [] and worker.pid != first_pid and worker.num_restarts == 1
        assert done.clean.equals(expected.clean)
        assert [(r.index, r.errors[0].reason) for r in done.rejected] == [(r.index, r.errors[0].reason) for r in expected.rejected]
    finally:
        worker.close()


def test_a_deeply_nested_message_is_refused_before_any_parser() -> None:
    """The depth guard (on by default): too_deep, decided by a byte scan; brackets inside strings do not count."""
    from pipelines.decode import Decoder, json_depth

    deep = b'{"event_type":"request_arrived","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert json_depth(deep) == 100_001
    text = encode_event(RequestFinished(event_id="f", ts_ns=1, engine_id="eng", request_id="r", outcome="error",
                                        num_output_tokens=1, error_message="[" * 500 + "{" * 500))
    assert json_depth(text) == 1 and json_depth(b'{"a":"\\\"[[[","b":[[1]]}') == 3
    values = messages()
    values[5], values[7] = deep, text
    batch = Decoder(max_message_bytes=1 << 20).decode(values, now_ns=0)
    reasons = {r.index: (r.errors[0].reason, r.event_type) for r in batch.rejected}
    assert reasons == {5: ("too_deep", "request_arrived"), 6: ("invalid_json", None)}
    assert 7 in batch.indices.tolist()  # the brackets of an error message are text, not nesting


def test_a_bad_configuration_fails_at_start() -> None:
    spec = TransformSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__},
                            "privacy": PrivacyConfig(ner_model="no_such_spacy_model")})
    with pytest.raises(ConfigError, match="no_such_spacy_model"):
        TransformWorker(spec).start()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_dies_with_a_killed_ingest(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from tests.pipelines.test_transform import SPEC
        from pipelines.transform import TransformWorker
        worker = TransformWorker(SPEC).start()
        print(worker.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60  # a cap, not the expected wait (a loaded machine runs other test workers)
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        if _alive(child):
            os.kill(child, signal.SIGKILL)
            pytest.fail("the transform worker outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
