"""Mappings ready before the first copy (issue 42): a region a handler maps is populated in
bulk on a background thread (its page tables filled), so that the first copy through a new
mapping does not fault once per 4 KiB page: the writer's own region for writing, another
instance's for reading. Only the pages the pool file holds are populated (a hole stays a
hole: populating allocates no memory the pool does not use yet), and a region whose file was
truncated under it fails to populate with a log line, never a SIGBUS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from maru import MaruHandler
from maru.client.mapping import RegionMapper
from maru.common.populate import backed_extents
from maru.common.region import RegionHandle

from .test_capacity import wait_for
from .workers import (
    digest,
    make_value,
    map_and_read,
    populated_mappings,
    resident_bytes,
    run_processes,
)

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("preallocate", [True, False], ids=["preallocated", "sparse"])
def test_the_writers_region_and_a_readers_mapping_of_it_are_populated(
    maru_server_factory, preallocate
):
    """Preallocated pool: the writer's 2 MiB region is mapped in whole after a store of 1 MiB
    (before: only the pages it wrote), and a second process's mapping of it at connect, before
    it reads (before: nothing). Sparse pool: only the pages written, in both."""
    server = maru_server_factory(pool_size="64M", extra_args=["--preallocate"] * preallocate)
    size, n = 256 * KiB, 4
    keys, values = [f"p{i}" for i in range(n)], [make_value(i, size) for i in range(n)]
    with MaruHandler(server_url=server.url, pool_size="8M", chunk_size_bytes=size) as h:
        assert h.batch_store(keys, values) == [True] * n
        [region] = h.owned_region_ids()
        length, resident = populated_mappings(h)[region]
        assert length == 2 * MiB
        assert resident == (length if preallocate else n * size)
        [got] = run_processes([(map_and_read, (server.url, keys, size, 0))], timeout=120)
    assert got["digests"] == [digest(v) for v in values]  # the bytes stored
    length, resident = got["mapped"][str(region)]
    assert resident == (length if preallocate else n * size)
    if preallocate:  # (every region of the pool it maps: all of it is backed)
        assert all(r == length for length, r in got["mapped"].values())


def _owned(h: MaruHandler) -> dict[int, int]:
    """{region id: its length} of the regions `h` owns."""
    return {rid: h._mapper.get(rid).handle.length for rid in h.owned_region_ids()}


def test_ready_at_connect_takes_the_share_and_populates_it_before_the_first_write(
    maru_server_factory,
):
    """`ready_at_connect`: the instance's `pool_size` is taken at connect in the usual steps
    (2, 4, 2 MiB) and mapped in whole, holes too (a sparse pool), before anything is written
    (before: no region until the first store), also when the chunk size is set right after
    connect, as MaruStorage sets it (a re-cut during the taking once stopped it after the
    first region; this does not force that interleaving); what is written there then reads
    back, in a new process, as the bytes written."""
    server = maru_server_factory(pool_size="64M")
    size, n = 256 * KiB, 12
    keys, values = [f"r{i}" for i in range(n)], [make_value(i, size) for i in range(n)]
    with MaruHandler(server_url=server.url, pool_size="8M", ready_at_connect=True) as h:
        h.set_chunk_size(size)
        wait_for(lambda: sum(_owned(h).values()) == 8 * MiB, what="the share taken")
        mapped = populated_mappings(h)
        assert sorted(_owned(h).values()) == [2 * MiB, 2 * MiB, 4 * MiB]
        assert all(mapped[rid] == (length, length) for rid, length in _owned(h).items())
        assert h.batch_store(keys, values) == [True] * n  # (3 MiB: no region taken for it)
        assert sum(_owned(h).values()) == 8 * MiB
        [got] = run_processes([(map_and_read, (server.url, keys, size, 0))], timeout=120)
    assert got["digests"] == [digest(v) for v in values]


def test_a_write_that_leaves_less_free_than_it_took_has_the_next_region_ready(
    maru_server_factory,
):
    """A write of 1.5 MiB into the first region (2 MiB) leaves 0.5 MiB free: the next region
    (4 MiB) is taken and mapped in whole in the background (before: taken by the next write,
    which then faulted in each page it wrote); the next writes go there and read back."""
    server = maru_server_factory(pool_size="64M")
    size, n = 256 * KiB, 6
    kw = {"server_url": server.url, "pool_size": "8M", "chunk_size_bytes": size}
    with MaruHandler(**kw) as h:
        assert h.owned_region_ids() == []
        first = ([f"a{i}" for i in range(n)], [make_value(i, size) for i in range(n)])
        assert h.batch_store(*first) == [True] * n
        wait_for(lambda: len(_owned(h)) == 2, what="the next region taken")
        mapped = populated_mappings(h)
        [ahead] = [rid for rid, length in _owned(h).items() if length == 4 * MiB]
        assert mapped[ahead] == (4 * MiB, 4 * MiB)  # (a sparse pool: holes populated)
        second = ([f"b{i}" for i in range(n)], [make_value(100 + i, size) for i in range(n)])
        assert h.batch_store(*second) == [True] * n
        keys, values = first[0] + second[0], first[1] + second[1]
        [got] = run_processes([(map_and_read, (server.url, keys, size, 0))], timeout=120)
    assert got["digests"] == [digest(v) for v in values]


def test_a_hole_is_not_populated_and_takes_no_memory(shm_name):
    """A region with a hole in its file: only the written range is mapped in, and the file
    holds no more pages after populating than before."""
    with open(shm_name, "wb") as f:  # 8 MiB sparse; written: [1, 2) and [5, 6) MiB
        f.truncate(8 * MiB)
        for at in (1 * MiB, 5 * MiB):
            f.seek(at)
            f.write(b"\x01" * MiB)
    blocks = os.stat(shm_name).st_blocks
    fd = os.open(shm_name, os.O_RDONLY)
    try:
        assert backed_extents(fd, 4 * MiB, 4 * MiB) == [(1 * MiB, 2 * MiB)]
        assert backed_extents(fd, 0, 8 * MiB) == [(1 * MiB, 2 * MiB), (5 * MiB, 6 * MiB)]
    finally:
        os.close(fd)
    mapper = RegionMapper(populate=True)
    try:
        for region_id, writable in ((1, True), (2, False)):
            handle = RegionHandle(region_id, shm_name, 4 * MiB, 4 * MiB, f"{region_id:016x}", "w")
            mapped = mapper.map(handle, writable=writable)
            assert mapper.wait_populated(60)
            assert resident_bytes(mapped.address) == MiB
            mapper.unmap(region_id)
    finally:
        mapper.close()
    assert os.stat(shm_name).st_blocks == blocks


TRUNCATED = textwrap.dedent(
    """
    import logging, os, sys
    from maru.client.mapping import RegionMapper
    from maru.common.region import RegionHandle

    logging.basicConfig(level=logging.WARNING)
    path, MiB = sys.argv[1], 1 << 20
    with open(path, "wb") as f:
        f.write(b"\\x01" * (4 * MiB))
    mapper = RegionMapper()  # (populated below, by hand: after the truncation)
    own = mapper.map(RegionHandle(1, path, 0, 2 * MiB, "1" * 16, "w"), writable=True)
    other = mapper.map(RegionHandle(2, path, 2 * MiB, 2 * MiB, "2" * 16, "x"), writable=False)
    os.truncate(path, 0)
    print(mapper.populate(own), mapper.populate(other))
    mapper.close()
    """
)


def test_populating_a_region_of_a_truncated_pool_logs_and_kills_nothing(shm_name):
    """The pool file truncated after the regions were mapped (the server restarted on a new
    pool, an operator's mistake): populating them fails (EFAULT where a touch would be a
    SIGBUS), is logged, and the process lives on."""
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATED, shm_name], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]  # (before: no populate to call)
    assert done.stdout.split() == ["False", "False"]
    assert done.stderr.count("populating its pages failed") == 2


def test_a_reader_maps_and_populates_another_instances_new_region_before_reading_it(
    maru_server_factory,
):
    """A reader connected before a writer took its region (sparse pool, `eager_map`): it maps
    the region within a heartbeat interval (the local index says a region was made; before:
    at its next heartbeat, 5 s, or by its first read, which then faulted page by page), its
    mapping has the written pages in, and the pages written into the region after that are
    mapped in too, with no read (`follow_backing`); what it then reads is what was written.
    A reader that finds the region at its connect populates what it holds then, once."""
    server = maru_server_factory(pool_size="64M")
    size = 256 * KiB
    keys, values = [f"w{i}" for i in range(7)], [make_value(i, size) for i in range(7)]
    kw = {"server_url": server.url, "chunk_size_bytes": size}
    with MaruHandler(pool_size="4M", **kw) as reader, MaruHandler(pool_size="8M", **kw) as w:
        assert reader.reads_locally and reader._heartbeat.interval >= 5.0
        in_time = 0.8 * reader._heartbeat.interval  # (before the next beat could map it)
        assert w.batch_store(keys[:4], values[:4]) == [True] * 4
        [region] = w.owned_region_ids()

        def resident() -> int:
            mapped = reader._mapper.get(region)
            return resident_bytes(mapped.address) if mapped is not None else -1

        wait_for(lambda: resident() == 4 * size, in_time, "the reader's mapping of it")
        with MaruHandler(pool_size="4M", **kw) as later:  # (found at its connect: any age)
            assert populated_mappings(later)[region] == (2 * MiB, 4 * size)
            assert later._mapper.get(region).followed_from == 0.0  # (not looked at again)
        assert w.batch_store(keys[4:], values[4:]) == [True] * 3  # (same region: 1.75 MiB)
        assert w.owned_region_ids()[0] == region  # (a next one may be taken ahead: `ready`)
        wait_for(lambda: resident() == 7 * size, in_time, "the pages written since")
        out = np.zeros((len(keys), size), np.uint8)
        buffers = out.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * size
        assert reader.read(keys, buffers, np.array([size], np.int64), length=size) == [True] * 7
    assert [digest(row) for row in out] == [digest(v) for v in values]
