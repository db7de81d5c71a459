"""Pool kinds: shm (sparse file), devdax (a regular file standing in for the device), fsdax
(a directory, one file per region), and how `open_pool` picks one from the path."""

from __future__ import annotations

import logging
import mmap
import os

import pytest

from maru.common.shmindex import area_bytes
from maru.server.pool import (
    REGION_ALIGNMENT,
    DevDaxPool,
    FsDaxPool,
    PoolFullError,
    ShmPool,
    open_pool,
)

MiB = 1 << 20
PAGE = mmap.ALLOCATIONGRANULARITY


def test_shm_pool_creates_a_sparse_file_and_carves_aligned_regions(shm_name):
    pool = ShmPool(shm_name, 32 * MiB)
    st = os.stat(shm_name)
    assert st.st_size == 32 * MiB + PAGE  # (the last page: the pool's mark)
    assert st.st_blocks == 0  # sparse: no memory used until pages are touched
    assert st.st_mode & 0o777 == 0o600
    assert pool.name == f"shm:{shm_name}"
    assert pool.round_up(1) == REGION_ALIGNMENT
    assert pool.round_up(REGION_ALIGNMENT + 1) == 2 * REGION_ALIGNMENT
    path, off1 = pool.allocate(1, 4 * MiB)
    _, off2 = pool.allocate(2, 2 * MiB)
    assert path == shm_name and (off1, off2) == (0, 4 * MiB)
    assert pool.used == 6 * MiB and pool.free == 26 * MiB
    pool.release(path, off1)
    assert pool.allocate(3, 2 * MiB)[1] == 0  # first fit reuses the hole
    stats = pool.stats()
    assert stats["kind"] == "shm" and stats["used"] == 4 * MiB and stats["capacity"] == 32 * MiB


def test_shm_pool_full_names_the_pool(shm_name):
    pool = ShmPool(shm_name, 4 * MiB)
    pool.allocate(1, 4 * MiB)
    with pytest.raises(PoolFullError, match=f"pool shm:{shm_name} is full"):
        pool.allocate(2, 2 * MiB)


def test_shm_pool_reuses_existing_file_without_truncating(shm_name):
    ShmPool(shm_name, 8 * MiB)
    with open(shm_name, "r+b") as f:
        f.seek(5 * MiB)
        f.write(b"survives")
    ShmPool(shm_name, 4 * MiB)  # smaller capacity: file is neither truncated nor cleared
    assert os.stat(shm_name).st_size == 8 * MiB + PAGE
    with open(shm_name, "rb") as f:
        f.seek(5 * MiB)
        assert f.read(8) == b"survives"


def test_devdax_pool_on_a_regular_file_standing_in_for_the_device(tmp_path, caplog):
    """There is no devdax device on this machine: a regular 16 MiB file stands in for
    /dev/daxX.Y. Its size less its last alignment unit (the pool's mark) is the capacity (a
    larger --pool-size is capped with a warning) and regions are aligned like on the device."""
    dev = tmp_path / "dax0.0"
    with open(dev, "wb") as f:
        f.truncate(16 * MiB)
    with caplog.at_level(logging.WARNING, logger="maru.server.pool"):
        pool = DevDaxPool(str(dev), 1 << 40)
    assert pool.capacity == 14 * MiB
    assert any("exceeds device size" in r.getMessage() for r in caplog.records)
    assert pool.kind == "devdax" and pool.alignment == REGION_ALIGNMENT
    assert DevDaxPool(str(dev), 8 * MiB).capacity == 8 * MiB
    assert DevDaxPool(str(dev)).capacity == 14 * MiB
    offsets = [pool.allocate(i, 4 * MiB)[1] for i in range(3)]
    assert offsets == [0, 4 * MiB, 8 * MiB]
    assert pool.allocate(3, 2 * MiB)[1] == 12 * MiB
    with pytest.raises(PoolFullError, match="devdax:"):
        pool.allocate(5, 2 * MiB)


def test_the_in_pool_index_area_lies_past_the_regions_and_beside_the_mark(tmp_path, shm_name):
    """`--index-slots`: a shm pool's file grows by the area, after the mark's page; a devdax
    pool gives it the alignment units before the mark's last unit (the mark stays put, the
    capacity shrinks); no region is carved there."""
    area = area_bytes(1 << 14)  # 3.2 MiB: two 2 MiB units on a devdax pool
    shm = ShmPool(shm_name, 8 * MiB, index_slots=1 << 14)
    assert shm.index_area == ("", 8 * MiB + PAGE, area, 1 << 14)
    assert os.path.getsize(shm_name) == shm.file_bytes == 8 * MiB + PAGE + area
    dev = tmp_path / "dax0.0"
    with open(dev, "wb") as f:
        f.truncate(16 * MiB)
    pool = DevDaxPool(str(dev), index_slots=1 << 14)
    assert pool.mark_offset == 14 * MiB and pool.capacity == 10 * MiB
    assert pool.index_area == ("", 10 * MiB, 4 * MiB, 1 << 14)
    assert [pool.allocate(i, 2 * MiB)[1] for i in range(5)] == [i * 2 * MiB for i in range(5)]
    with pytest.raises(PoolFullError):
        pool.allocate(5, 2 * MiB)  # (the area is not the regions')


def test_devdax_stand_in_must_not_be_empty(tmp_path):
    """A regular (empty) file standing in for a devdax device is refused."""
    dev = tmp_path / "dax-empty"
    dev.touch()
    with pytest.raises(ValueError, match="empty"):
        DevDaxPool(str(dev))


def test_fsdax_pool_one_file_per_region(tmp_path):
    root = tmp_path / "fsdax"
    pool = FsDaxPool(str(root), 8 * MiB)
    assert root.is_dir()
    p1, o1 = pool.allocate(1, 2 * MiB)
    p2, o2 = pool.allocate(2, 4 * MiB)
    assert (o1, o2) == (0, 0)
    assert p1 == str(root / "region-1.mem") and os.path.getsize(p1) == 2 * MiB
    assert p2 == str(root / "region-2.mem") and os.path.getsize(p2) == 4 * MiB
    assert pool.used == 6 * MiB
    with pytest.raises(PoolFullError, match=f"pool fsdax:{root} is full"):
        pool.allocate(3, 4 * MiB)
    pool.release(p1, 0)
    assert not os.path.exists(p1) and pool.used == 4 * MiB
    assert pool.allocate(3, 4 * MiB)[0] == str(root / "region-3.mem")
    assert sorted(os.listdir(root)) == ["region-2.mem", "region-3.mem"]


def test_open_pool_picks_the_kind_from_the_path(tmp_path, shm_name):
    assert isinstance(open_pool(shm_name, 4 * MiB), ShmPool)
    d = tmp_path / "dir"
    d.mkdir()
    assert isinstance(open_pool(str(d), 4 * MiB), FsDaxPool)
    assert isinstance(open_pool(str(tmp_path / "new-dir") + "/", 4 * MiB), FsDaxPool)
    assert (tmp_path / "new-dir").is_dir()
    with pytest.raises(ValueError, match="pool-size"):
        open_pool(str(d), None)
    with pytest.raises(ValueError, match="pool-size"):
        open_pool(str(tmp_path / "file.pool"), None)
    if os.path.exists("/dev/null"):  # a character device that is not devdax: probed, refused
        with pytest.raises((OSError, ValueError)):
            open_pool("/dev/null", 4 * MiB)
