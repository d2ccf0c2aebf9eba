"""``servelens demo`` stopped by SIGTERM (a ``timeout``, a supervisor) stops its local broker with it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_sigterm_stops_the_demos_broker(tmp_path):
    env = dict(os.environ, SERVELENS_PATHS__OUT_DIR=str(tmp_path / "out"), SERVELENS_LAKE__ROOT=str(tmp_path / "lake"))
    proc = subprocess.Popen([sys.executable, "-m", "servelens", "demo", "--requests", "200", "--no-serve",
                             "--out", str(tmp_path / "demo")], stderr=subprocess.PIPE, text=True, env=env)
    port = None
    assert proc.stderr is not None
    for line in proc.stderr:  # "[2/6] local Kafka-compatible broker on 127.0.0.1:PORT"
        if found := re.search(r"broker on 127\.0\.0\.1:(\d+)", line):
            port = int(found.group(1))
            break
    assert port is not None, "the demo never said where its broker listens"
    assert _listening(port)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _listening(port), f"the demo's broker still listens on {port} after the demo ended"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
