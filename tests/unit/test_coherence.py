"""Software coherence in the C copy loops, and the mode a handler agrees on.

This machine's caches are coherent, so the bytes read back cannot show that a line was
written back or invalidated: these tests read the extension's own count of the lines it
flushed (`lines_flushed`), which a copy loop that skipped its flushes would leave unchanged,
and check the bytes besides.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform

import numpy as np
import pytest

from maru.client.coherence import Coherence, lines_flushed, process_mode
from maru.common import _memcopy
from maru.common.config import ConfigError, MaruConfig
from maru.common.memcopy import CopyFaultError, copy_many, copy_many_hashed, copy_values, faulted

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="software coherence is x86-64's"
)

LINE = 64


def flushed_by(fn) -> tuple[int, int]:
    """(written back, invalidated) lines while `fn()` ran."""
    before = lines_flushed()
    fn()
    after = lines_flushed()
    return after[0] - before[0], after[1] - before[1]


def lines(address: int, size: int) -> int:
    return (address + size - 1) // LINE - address // LINE + 1


def aligned(size: int) -> np.ndarray:
    raw = np.zeros(size + LINE, np.uint8)
    return raw[-raw.ctypes.data % LINE :][:size]


def test_a_store_writes_back_exactly_what_it_wrote_with_cached_stores(software):
    """A value of three parts into a 64-byte aligned 'pool': a 1000-byte part (memmove: all
    its 16 lines cached), then a 64 KiB part and an 8 KiB + 40 part, each starting 40 bytes
    into a line: streamed, but the bytes before their first aligned address and after their
    last whole 64 bytes are cached stores, one line each (SSE2 or AVX-512 stores alike: the
    streamed body starts at a 64-byte boundary). The streamed lines (1150 of them) are not
    flushed."""
    sizes = [1000, 64 << 10, (8 << 10) + 40]
    src = np.random.default_rng(1).integers(0, 256, sum(sizes), dtype=np.uint8)
    pool = aligned(sum(sizes) + 4096)
    firsts = src.ctypes.data + np.cumsum([0, *sizes[:-1]])
    stored = flushed_by(
        lambda: copy_values(np.array([pool.ctypes.data]), firsts[None, :], sizes, to_values=True)
    )
    assert bytes(pool[: sum(sizes)]) == bytes(src)
    assert stored == (16 + 2 + 2, 0)


def test_a_plain_copy_into_the_pool_writes_back_every_line_it_wrote(software):
    size = 10_000
    src = np.arange(size, dtype=np.uint8)
    pool = aligned(size + 128)
    at = pool.ctypes.data + 8
    stored = flushed_by(
        lambda: copy_values(
            np.array([at]), np.array([[src.ctypes.data]]), [size], to_values=True, streaming=False
        )
    )
    assert bytes(pool[8 : 8 + size]) == bytes(src)
    assert stored == (lines(at, size), 0)


@pytest.mark.parametrize("hashed", [False, True])
def test_a_read_invalidates_every_line_of_the_value_before_it_copies(software, hashed):
    sizes = [3000, 70_000]
    pool = aligned(sum(sizes) + 64)
    pool[:] = np.random.default_rng(2).integers(0, 256, pool.size, dtype=np.uint8)
    out = np.zeros(sum(sizes), np.uint8)
    at = pool.ctypes.data + 32
    buffers = np.array([[out.ctypes.data, out.ctypes.data + sizes[0]]])
    read = flushed_by(
        lambda: copy_values(
            np.array([at, 0]), np.vstack([buffers, [[0, 0]]]), sizes, to_values=False, hashed=hashed
        )
    )
    assert bytes(out) == bytes(pool[32 : 32 + sum(sizes)])
    assert read == (0, lines(at, sum(sizes)))  # the miss (0) flushes nothing


def test_a_copy_that_cannot_tell_the_pool_side_invalidates_its_source_and_writes_back(software):
    size = 1000  # (under 4 KiB: a cached copy)
    src, dst = aligned(size), aligned(size)
    src[:] = 7
    both = flushed_by(
        lambda: copy_many(np.array([dst.ctypes.data]), np.array([src.ctypes.data]), size)
    )
    assert both == (lines(dst.ctypes.data, size), lines(src.ctypes.data, size))
    assert (dst == 7).all()
    hashed = flushed_by(
        lambda: copy_many_hashed(
            np.array([[dst.ctypes.data]]), np.array([[src.ctypes.data]]), [size]
        )
    )
    assert hashed == both


def test_in_hardware_mode_nothing_is_flushed():
    assert process_mode() == "hardware"
    size = 100_000
    src, pool = np.ones(size, np.uint8), aligned(size)
    none = flushed_by(
        lambda: copy_values(
            np.array([pool.ctypes.data]), np.array([[src.ctypes.data]]), [size], to_values=True
        )
    )
    assert none == (0, 0) and (pool == 1).all()


def test_a_flush_that_faults_is_a_failed_value_and_the_others_are_copied(software, tmp_path):
    """The pool's file truncated under a reader: its invalidation (which comes before its
    copy) touches the pages first and faults; the fault guard makes that value a miss."""
    path = tmp_path / "pool"
    path.write_bytes(b"\x5a" * (2 * mmap.PAGESIZE))
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 2 * mmap.PAGESIZE)
    try:
        base = np.frombuffer(mm, np.uint8).ctypes.data
        os.truncate(path, mmap.PAGESIZE)  # (the second page is gone: SIGBUS)
        out = np.zeros((2, 1000), np.uint8)
        starts = np.array([base, base + mmap.PAGESIZE])
        buffers = out.ctypes.data + np.arange(2)[:, None] * 1000
        before = lines_flushed()
        with pytest.raises(CopyFaultError) as caught:
            copy_values(starts, buffers, [1000], to_values=False)
        assert faulted(caught.value).tolist() == [False, True]
        assert (out[0] == 0x5A).all() and (out[1] == 0).all()
        # the first value's lines counted; the second's flush faulted before its count
        assert lines_flushed()[1] - before[1] == lines(base, 1000)
    finally:
        mm.close()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'hardware' or 'software'"):
        _memcopy.coherence("sometimes")
    assert process_mode() == "hardware"


def test_the_config_key_takes_either_mode_and_refuses_others():
    assert MaruConfig(coherence=" Software ").coherence == "software"
    assert MaruConfig().coherence is None
    assert (
        MaruConfig.from_mapping({"maru_coherence": "hardware"}, prefix="maru_").coherence
        == "hardware"
    )
    with pytest.raises(ConfigError, match="maru_coherence: expected 'hardware' or 'software'"):
        MaruConfig.from_mapping({"maru_coherence": "off"}, prefix="maru_")


@pytest.mark.parametrize(
    ("configured", "server", "agreed", "warned"),
    [
        (None, "hardware", "hardware", False),
        (None, "software", "software", False),
        (None, None, "hardware", False),  # a server older than the field
        ("software", "software", "software", False),
        ("hardware", "hardware", "hardware", False),
        ("software", "hardware", "software", True),
        ("hardware", "software", "software", True),
    ],
)
def test_the_mode_agreed_is_software_where_either_side_says_so(
    configured, server, agreed, warned, caplog
):
    mine = Coherence(configured)
    with caplog.at_level(logging.WARNING, logger="maru.client.coherence"):
        for _ in range(3):  # (a re-handshake with the same server says nothing again)
            assert mine.agree(server, "tcp://127.0.0.1:1") == agreed
    try:
        assert mine.mode == agreed and process_mode() == agreed
        said = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == (1 if warned else 0), said
        if warned:
            assert f"configured for {configured}" in said[0].getMessage()
            assert "software coherence is used" in said[0].getMessage()
    finally:
        mine.release()
    assert process_mode() == "hardware"


def test_the_process_stays_in_software_while_any_handler_agreed_on_it():
    a, b = Coherence(None), Coherence("software")
    a.agree("hardware", "tcp://a")
    b.agree("hardware", "tcp://b")
    assert (a.mode, b.mode, process_mode()) == ("hardware", "software", "software")
    a.release()
    assert process_mode() == "software"
    b.release()
    assert process_mode() == "hardware"
