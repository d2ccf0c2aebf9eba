"""How the suite is shared among pytest-xdist workers (``tests/conftest.py``): a file is one unit of work, and
every reader of the session's demo run is in the one group that runs it once."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SAME_WORKER, worker_scope

ROOT = Path(__file__).resolve().parents[1]


def _readers_of(fixture: str) -> set[str]:
    """The test files with a function that takes ``fixture`` as an argument."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and fixture in {a.arg for a in node.args.args}:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_a_file_is_one_unit_of_work_and_the_demo_s_readers_are_one():
    assert worker_scope("tests/replay/test_fit.py::test_x[a::b]") == "tests/replay/test_fit.py"
    assert worker_scope("tests/replay/test_fit.py::TestX::test_y") == "tests/replay/test_fit.py"
    readers = _readers_of("demo_output")
    assert len(readers) >= 2  # the help examples and the demo's browser test
    assert {worker_scope(f"{path}::test") for path in readers} == {"demo"}


def test_every_file_named_to_share_a_worker_exists():
    missing = [path for path in SAME_WORKER if not (ROOT / path).is_file()]
    assert not missing, f"renamed or removed: {missing} (tests/conftest.py, SAME_WORKER)"
