"""Privacy fixtures: a fixed test key ring (never a production key)."""

from __future__ import annotations

import pytest

from privacy.keys import KeyRing


@pytest.fixture
def keyring() -> KeyRing:
    return KeyRing("test-1", {"test-1": bytes(range(32))})
