"""Fixtures shared by the unit tests."""

from __future__ import annotations

import time
import types

import pytest

from maru.server import instances

from .service_calls import make_service


@pytest.fixture
def software():
    """The process's copies in software coherence for the test, hardware again after it."""
    from maru.common import _memcopy

    before = _memcopy.coherence("software")
    try:
        yield
    finally:
        _memcopy.coherence(before)


@pytest.fixture
def service(tmp_path):
    """An in-process service on a 64 MiB pool (`service_calls.make_service`); a module that
    needs another defines its own."""
    svc = make_service(tmp_path, pool_mib=64)
    yield svc
    svc.close()


@pytest.fixture
def clock(monkeypatch):
    """The instance table's clock, moved by the test (no wall time in a test): `clock(s)`
    lets `s` seconds pass."""
    now = [time.monotonic()]
    fake = types.SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    monkeypatch.setattr(instances, "time", fake)

    def advance(seconds: float) -> None:
        now[0] += seconds

    return advance
