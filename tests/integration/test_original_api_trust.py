"""The original Maru API and `CxlMemoryAdapter` against callers that get a call slightly wrong:
a mistake must fail before any chunk changes hands (the caller can still `free` its handle), and
a read by page index must never land on another value's bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from maru import MaruHandler

CHUNK = 64 << 10


def _handler(url: str, **overrides) -> MaruHandler:
    return MaruHandler(server_url=url, pool_size="4M", chunk_size_bytes=CHUNK, **overrides)


def _baseline(h: MaruHandler) -> int:
    """Free chunks once the handler owns a region (the first `alloc` takes one)."""
    h.free(h.alloc(CHUNK))
    return h.free_chunks()


def test_a_seal_of_a_run_with_lengths_for_other_keys_fails_before_taking_its_chunks(maru_server):
    """`seal(keys, run, lengths)` with a list of lengths not one per key: the server refused the
    registration as malformed, but the run's chunks had already been claimed as written, so
    neither the seal nor a later `free` returned them (3 chunks lost per call until close).
    Now a ValueError, as for a list of handles, and the handle is still the caller's to free."""
    with _handler(maru_server.url) as h:
        free = _baseline(h)
        for lengths in ([10, 10], [10, 10, 10, 10]):
            run = h.alloc(1000, 3)
            run.buf[:] = b"\x07" * len(run.buf)
            with pytest.raises(ValueError, match="lengths"):
                h.seal(["s1", "s2", "s3"], run, lengths)
            h.free(run)
            assert h.free_chunks() == free
        assert h.batch_exists(["s1", "s2", "s3"]) == [False] * 3


def test_a_seal_with_checksums_for_other_keys_fails_before_taking_its_chunks(maru_server):
    """`seal(..., checksums=)` with a count other than one per key raised its ValueError after
    the handles were claimed as written: a later `free` found them spent and they stayed
    reserved until close. Now it is refused before, and `free` returns them."""
    with _handler(maru_server.url, checksums=True) as h:
        free = _baseline(h)
        a, b = h.alloc(100), h.alloc(100)
        a.buf[:] = b"\x01" * 100
        b.buf[:] = b"\x02" * 100
        with pytest.raises(ValueError, match="checksums"):
            h.seal(["c1", "c2"], [a, b], checksums=np.array([1], np.int64))
        h.free(a)
        h.free(b)
        assert h.free_chunks() == free
        assert h.batch_exists(["c1", "c2"]) == [False, False]


def test_store_given_a_handle_and_a_handle_keyword_raises(maru_server):
    """`store(key, h1, handle=h2)` gives two values: it stored h1 and silently dropped h2 (the
    caller may think h2's bytes are under the key). Now the ValueError `store` documents for
    a call with two values, and neither handle is taken."""
    with _handler(maru_server.url) as h:
        free = _baseline(h)
        h1, h2 = h.alloc(100), h.alloc(100)
        h1.buf[:] = b"1" * 100
        h2.buf[:] = b"2" * 100
        with pytest.raises(ValueError):
            h.store("two", h1, handle=h2)
        with pytest.raises(ValueError):
            h.store("two", b"bytes", handle=h2)
        assert not h.exists("two")
        h.free(h1)
        h.free(h2)
        assert h.free_chunks() == free


# -- CxlMemoryAdapter -----------------------------------------------------------------------------


def _lmcache():
    """tests/lmcache_cpu's geometry (LMCache's real classes); skipped without LMCache."""
    pytest.importorskip("lmcache")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lmcache_cpu import engine

    return engine


def test_an_adapter_with_another_chunk_size_than_its_handler_is_refused(maru_server):
    """`get_by_location` turns a page index into an offset with the adapter's `chunk_size`: one
    unlike the handler's (whose page indices `retrieve` gives) read another value's bytes as a
    hit. Now a ValueError at construction."""
    from maru_lmcache import CxlMemoryAdapter

    E = _lmcache()
    meta = E.metadata()
    shapes, dtypes = meta.get_shapes(), meta.get_dtypes()
    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes=E.GEOMETRY.chunk_bytes
    ) as h:
        wrong = 2 * h.get_chunk_size()
        with pytest.raises(ValueError, match="chunk_size"):
            CxlMemoryAdapter(h, shapes, dtypes, E.FMT, wrong)
        assert CxlMemoryAdapter(h, shapes, dtypes, E.FMT, h.get_chunk_size()) is not None


def test_get_by_location_follows_the_handlers_chunk_size(maru_server):
    """The handler's chunk size may change before its first reservation (`set_chunk_size`,
    as SGLang does after connecting); an adapter made before kept the old one and read page 1
    at the old offset: the middle of page 0's value, served as page 1's."""
    from maru_lmcache import CxlMemoryAdapter

    E = _lmcache()
    G = E.GEOMETRY
    meta = E.metadata()
    with MaruHandler(
        server_url=maru_server.url, pool_size="8M", chunk_size_bytes=G.chunk_bytes
    ) as h:
        adapter = CxlMemoryAdapter(
            h, meta.get_shapes(), meta.get_dtypes(), E.FMT, h.get_chunk_size()
        )
        h.set_chunk_size(2 * G.chunk_bytes)
        run = h.alloc(G.chunk_bytes, 2)
        first, second = run.split()
        first.buf[:] = b"\x11" * G.chunk_bytes
        second.buf[:] = b"\x22" * G.chunk_bytes
        assert h.batch_store(["p0", "p1"], [first, second]) == [True, True]
        info = h.retrieve("p1")
        assert info is not None and info.page_index == 1
        obj = adapter.get_by_location(info.region_id, info.page_index, info.length, G.token_bytes)
        assert obj is not None
        assert bytes(obj.byte_array) == b"\x22" * G.chunk_bytes
