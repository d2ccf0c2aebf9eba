"""Shared fixtures: the bundled data folder (read in place, never copied) and hypothesis profiles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from servelens.config import load_config, shared_dir

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: Test files that share one pytest-xdist worker, in collection order: the readers of the session's demo run
#: (``demo_output``), so that the demo runs once and the help examples, which write beside it, run after the
#: browser has read it.
SAME_WORKER = {"tests/dashboard/test_demo_browser.py": "demo", "tests/servelens/test_help_examples.py": "demo"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``make test``) sends a whole test file to a worker at a time, so each module fixture
    (a broker's topic, an ingested lake, a served dashboard) is set up once, and the files of ``SAME_WORKER``
    go together. (xdist's own ``xdist_group`` mark cannot do it: it gives unmarked tests out one by one.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ByFile(config, log)


def worker_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or its file's ``SAME_WORKER`` group."""
    path = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(path, path)


@pytest.fixture(scope="session")
def shared() -> Path:
    """The shared data folder (../shared beside the checkout, or $SERVELENS_SHARED_DIR)."""
    return shared_dir(load_config())


#: The small demo the help-example and browser tests read (``demo_output``): enough requests for every
#: dashboard page to draw at k = 5 with the demo's 20 tenants.
DEMO_REQUESTS = 2000


@pytest.fixture(scope="session")
def demo_output(tmp_path_factory, shared) -> Path:
    """A folder where `servelens demo --no-serve` has run, as `make demo` leaves a checkout: ``out/demo`` under it
    (its own demo key in ``.servelens/``). Run once per test session."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("after-demo")
    env = {**os.environ, "SERVELENS_SHARED_DIR": str(shared)}
    done = subprocess.run([sys.executable, "-m", "servelens", "demo", "--requests", str(DEMO_REQUESTS), "--speedup", "1000",
                           "--no-serve"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    (root / "demo-summary.txt").write_text(done.stdout)
    return root
