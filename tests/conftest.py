"""Shared fixtures: the bundled data folder (read in place, never copied) and hypothesis profiles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from servelens.config import load_config, shared_dir

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def shared() -> Path:
    """The shared data folder (../shared beside the checkout, or $SERVELENS_SHARED_DIR)."""
    return shared_dir(load_config())
