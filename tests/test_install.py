"""`make demo` installs what the demo needs and nothing it does not: the runtime environment, built from the
project's own files as the Makefile builds it, runs the demo; the test and GPU extras are absent there, and a
command that needs one says which extra to install (exit 3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def runtime_env(tmp_path_factory) -> Path:
    """A fresh venv with the package alone (pip's configured wheel directory and index: no extras)."""
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", str(ROOT)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no path back to the checkout
    return {**env, "SERVELENS_PRIVACY__DEMO_KEY_FILE": str(tmp / "demo-key.toml")}


@pytest.mark.slow
def test_the_runtime_environment_runs_the_demo_without_the_extras(runtime_env, tmp_path, shared):
    python = runtime_env / "bin/python"
    for module in ("torch", "playwright", "hypothesis", "pytest", "confluent_kafka"):
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
        assert probe.returncode != 0 and "No module named" in probe.stderr, module
    env = {**_env(tmp_path), "SERVELENS_SHARED_DIR": str(shared)}
    demo = subprocess.run([str(runtime_env / "bin/servelens"), "demo", "--requests", "300", "--no-serve", "--out",
                           str(tmp_path / "demo")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert re.search(r"kafka\s+[\d,]+ events emitted", demo.stdout) and "verdicts" in demo.stdout
    profile = subprocess.run([str(runtime_env / "bin/servelens"), "profile", "--model", "tiny", "--out",
                              str(tmp_path / "p.parquet")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert profile.returncode == 3 and "pip install 'servelens[gpu]'" in profile.stderr
    assert "Traceback" not in profile.stderr
