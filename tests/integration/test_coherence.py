"""Software coherence end to end: `maru-server --coherence`, the mode each client agrees on,
and values written and read back by separate client processes, judged by their bytes.

This machine's caches are coherent, so the bytes cannot show that a line was written back or
invalidated: each process also reports the lines its copies flushed (the extension's count),
which would stay 0 if the copy loops skipped their flushes.
"""

from __future__ import annotations

import pytest

from .workers import copy_coherently, in_place_coherently, run_processes

LINE = 64
SIZE = 100_017  # (not a multiple of 64: each value's last line is written with cached stores)
KEYS = [f"coherent/{i}" for i in range(24)]


@pytest.mark.parametrize(
    ("server", "client", "agreed"),
    [
        ("software", None, "software"),
        ("hardware", None, "hardware"),
        ("hardware", "software", "software"),
        ("software", "hardware", "software"),
    ],
)
def test_writers_and_readers_copy_in_the_agreed_mode_and_read_the_bytes_written(
    maru_server_factory, server, client, agreed
):
    """A writer process stores values; two reader processes (on the local index, and with a
    request per batch as a client on another host does) read them back. Each agreed on
    software where the server or its own `coherence` says so (one WARNING where they
    differ); in software the writer wrote back each value's cached tail line (the rest was
    streamed) and each reader invalidated every line of every value before copying it."""
    url = maru_server_factory(pool_size="256M", extra_args=["--coherence", server]).url
    kw = {} if client is None else {"coherence": client}
    (writer,) = run_processes([(copy_coherently, (url, "write", KEYS, SIZE, 7, kw))], 120)
    readers = run_processes(
        [
            (copy_coherently, (url, "read", KEYS, SIZE, 7, {**kw, "local_index": True})),
            (copy_coherently, (url, "read", KEYS, SIZE, 7, {**kw, "local_index": False})),
        ],
        120,
    )
    assert [r["local"] for r in readers] == [True, False]
    software = agreed == "software"
    assert writer["done"] == [True] * len(KEYS)
    assert writer["lines"] == ([len(KEYS), 0] if software else [0, 0])
    for process in (writer, *readers):
        assert process["mode"] == agreed
        assert len(process["warned"]) == (client not in (None, server)), process["warned"]
    for reader in readers:
        assert reader["done"] == [True] * len(KEYS)  # every value, byte for byte
        assert reader["lines"] == ([0, len(KEYS) * -(-SIZE // LINE)] if software else [0, 0])


@pytest.mark.parametrize("server", ["software", "hardware"])
def test_values_written_and_read_in_place_are_flushed_where_they_are_handed_over(
    maru_server_factory, server
):
    """Bytes no copy loop moves: a writer process fills `alloc` buffers and seals them (in
    software, `seal` writes back every line of every value first), and fills more that it
    frees unsealed (written back too: no dirty line of its may later land on another host's
    value); a reader process takes
    `batch_retrieve`'s views, `get_buffer_view`s and `read_many` with a copy of its own (not
    a copy loop: a device's DMA, say), each invalidated before it is handed out. Hardware:
    nothing flushed. The bytes are the writer's in both."""
    url = maru_server_factory(pool_size="256M", extra_args=["--coherence", server]).url
    size, keys = 3 * 4096 + 100, KEYS[:8]
    lines = len(keys) * -(-size // LINE)  # (every value starts on a chunk: line-aligned)
    (writer,) = run_processes([(in_place_coherently, (url, "write", keys, size, 3))], 120)
    (reader,) = run_processes([(in_place_coherently, (url, "read", keys, size, 3))], 120)
    assert writer["done"] == [True] * len(keys)
    assert reader["done"] == [True] * 3 * len(keys)
    assert writer["mode"] == reader["mode"] == server
    on = server == "software"
    written = [lines if on else 0, 0]
    # the run given back: its whole `buf` (the writer filled the gaps between its values too)
    span = -(-((len(keys) - 1) * 4 * 4096 + size) // LINE)
    assert writer["lines"] == {"seal": written, "free": [span if on else 0, 0]}
    read = [0, lines if on else 0]
    assert reader["lines"] == {"retrieve": read, "view": read, "read_many": read}


def test_a_value_sealed_shorter_than_its_buffer_leaves_no_dirty_line_of_the_buffer(
    maru_server_factory,
):
    """`seal` (`store(key, handle, length=...)`, `batch_store(..., lengths=...)`) may publish
    fewer bytes than the caller wrote into `alloc`'s buffer. In software coherence every line
    the caller could have written (the whole `buf`, a run's gaps between values too) is written
    back, not only the sealed bytes: a dirty line past the value's end, kept in this host's
    cache after the chunks go back, would later be evicted onto the value another host writes
    into the same chunks, under that value's proof. (Before: only the sealed bytes' lines.)"""
    from maru.client.coherence import lines_flushed

    from .workers import _handler

    url = maru_server_factory(pool_size="64M", extra_args=["--coherence", "software"]).url
    h = _handler(url, pool_size="16M", chunk_size_bytes=8192)
    try:
        assert h.coherence == "software"

        def written_back(fn) -> int:
            before = lines_flushed()
            assert fn()
            return lines_flushed()[0] - before[0]

        one = h.alloc(8192)
        one.buf[:] = b"\x5a" * len(one.buf)  # (cached stores: every line of it dirty)
        assert written_back(lambda: h.store("short/one", handle=one, length=100)) == 8192 // LINE
        run = h.alloc(5000, 2)  # value 1 starts a chunk (8192 bytes) after value 0
        assert len(run.buf) == 8192 + 5000
        run.buf[:] = b"\xa5" * len(run.buf)
        lines = written_back(lambda: all(h.seal(["short/a", "short/b"], run, [64, 64]).wait()))
        assert lines == -(-(8192 + 5000) // LINE)
        got = h.retrieve("short/one")
        assert got is not None and bytes(got.view) == b"\x5a" * 100
    finally:
        h.close()


def test_a_copy_that_faulted_leaves_no_dirty_line_on_the_chunks_it_gives_back(
    maru_server_factory,
):
    """A write whose copy faulted part way (its pool memory gone under it) gives its chunks
    back unsealed. In software coherence what it wrote before the fault is written back first:
    a dirty line of ours on chunks another host may write next would be evicted onto its value.
    (Before: no line written back; the copy here writes with cached stores, then faults.)"""
    import ctypes

    import numpy as np

    from maru.client.coherence import lines_flushed
    from maru.client.writes import Put
    from maru.common.memcopy import CopyFaultError

    from .workers import _handler

    url = maru_server_factory(pool_size="64M", extra_args=["--coherence", "software"]).url
    h = _handler(url, pool_size="16M", chunk_size_bytes=8192)
    try:
        assert h.coherence == "software"

        def faulting_copy(targets: np.ndarray, first: int, last: int, hashed: bool, threads: int):
            for address in targets[: last - first].tolist():
                ctypes.memset(address, 0x33, 8192)  # (cached stores)
            raise CopyFaultError(14, "the pool's memory faulted (a test's copy)")

        put = Put(keys=["faulted/0", "faulted/1"], size=8192, copy=faulting_copy)
        before = lines_flushed()
        h.put([put])
        assert put.results == [False, False]
        assert lines_flushed()[0] - before[0] == 2 * 8192 // LINE
        assert h.retrieve("faulted/0") is None
    finally:
        h.close()
