"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def software():
    """The process's copies in software coherence for the test, hardware again after it."""
    from maru.common import _memcopy

    before = _memcopy.coherence("software")
    try:
        yield
    finally:
        _memcopy.coherence(before)
