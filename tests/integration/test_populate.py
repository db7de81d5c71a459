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

import pytest

from maru import MaruHandler
from maru.client.mapping import RegionMapper, backed_extents
from maru.common.region import RegionHandle

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
