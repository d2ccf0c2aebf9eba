"""The layout: each top-level package opens with a docstring that says its job."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["schemas", "privacy", "pipelines", "replay", "dashboard", "servelens"])
def test_package_says_its_job(name):
    module = importlib.import_module(name)
    assert module.__doc__ and len(module.__doc__.split()) >= 10, name


def test_importing_pipelines_does_not_import_dagster():
    import subprocess
    import sys

    code = "import sys, pipelines, pipelines.tables, pipelines.lake; print('dagster' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
