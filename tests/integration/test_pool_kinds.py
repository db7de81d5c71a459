"""End to end on each pool kind, and two servers side by side."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from maru import MaruHandler
from maru.server.pool import REGION_ALIGNMENT, DevDaxPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

from .workers import MiB, digest, make_value, retrieve_keys, run_processes, store_keys


@pytest.fixture
def devdax_stand_in_server(tmp_path):
    """A MaruService (in a thread of this process) over a DevDaxPool whose "device" is a
    regular 64 MiB file: there is no devdax device on this machine."""
    dev = tmp_path / "dax0.0"
    with open(dev, "wb") as f:
        f.truncate(64 * MiB)
    pool = DevDaxPool(str(dev))
    service = MaruService(Registry(pool, TokenSigner(os.urandom(32))), "tcp://127.0.0.1:0")
    thread = threading.Thread(target=service.serve_forever, kwargs={"poll_ms": 50}, daemon=True)
    thread.start()
    try:
        yield service, dev
    finally:
        service.stop()
        thread.join(10)
        service.close()
        pool.close()


def test_devdax_pool_with_a_regular_file_standing_in_for_the_device(devdax_stand_in_server):
    """devdax, with a regular file standing in for /dev/daxX.Y (no device here): this process
    stores through its mapping of the "device", another process reads through its own."""
    service, dev = devdax_stand_in_server
    with MaruHandler(server_url=service.endpoint, pool_size="64M") as h:  # up to all of it
        stats = h.stats()["pool"]
        assert stats["kind"] == "devdax" and stats["path"] == str(dev)
        assert stats["capacity"] == 62 * MiB  # (the device's last 2 MiB: the pool's mark)
        keys = [f"dax/{i}" for i in range(40)]
        sizes = [4096 + 9_999 * i for i in range(40)]
        values = [make_value(500 + i, size) for i, size in enumerate(sizes)]
        assert h.batch_store(keys, values) == [True] * 40
        regions = h.list_allocations()
        assert all(r.path == str(dev) and r.offset % REGION_ALIGNMENT == 0 for r in regions)
        (b,) = run_processes([(retrieve_keys, (service.endpoint, keys, 16))], 60)
        assert b["digests"] == [digest(v) for v in values]
        assert b["lengths"] == sizes and b["readonly"] and b["foreign"]
    # the bytes really are in the stand-in file, at the registered offsets
    with MaruHandler(server_url=service.endpoint, pool_size="2M") as h:
        info = h.retrieve(keys[7])
        region = next(
            r for r in h.list_allocations(all_instances=True) if r.region_id == info.region_id
        )
        with open(dev, "rb") as f:
            f.seek(region.offset + info.offset)
            assert f.read(info.length) == bytes(values[7])


def test_fsdax_pool_one_file_per_region(maru_server_factory, tmp_path):
    root = tmp_path / "fsdax"
    server = maru_server_factory(pool_size="256M", pool=str(root) + "/")
    keys = [f"fs/{i}" for i in range(30)]
    sizes = [1000 + 77_777 * i for i in range(30)]
    kw = {"pool_size": "64M", "auto_expand": True}  # regions of 4, 8, 16... MiB
    (a,) = run_processes([(store_keys, (server.url, keys, sizes, 77, 8, kw))], 60)
    assert a["ok"] == [True] * 30 and len(a["regions"]) >= 2  # needed more than one region
    files = sorted(p.name for p in root.glob("region-*.mem"))  # (and the server's lock file)
    assert files == sorted(f"region-{r}.mem" for r in a["regions"])
    (b,) = run_processes([(retrieve_keys, (server.url, keys, 10))], 60)
    assert b["digests"] == a["digests"] and b["lengths"] == sizes
    with MaruHandler(server_url=server.url, pool_size="2M") as h:
        stats = h.stats()["pool"]
        assert stats["kind"] == "fsdax" and stats["used"] >= 16 * MiB
        for r in h.list_allocations(all_instances=True):
            assert r.offset == 0 and Path(r.path).parent == root
            assert os.path.getsize(r.path) == r.length
        # the writer has exited and closed: once its keys go, its region files go too
        assert h.batch_delete(keys) == [True] * 30
        assert sorted(p.name for p in root.glob("region-*.mem")) == [
            f"region-{r}.mem" for r in h.owned_region_ids()
        ]


def deleted_files_mapped(root: Path) -> list[str]:
    """The files under `root` this process maps that are deleted."""
    with open("/proc/self/maps") as maps:
        lines = [line.split(None, 5)[-1].strip() for line in maps]
    return sorted({line for line in lines if line.startswith(str(root)) and "(deleted)" in line})


def test_a_reader_lets_go_of_the_fsdax_regions_the_server_freed(maru_server_factory, tmp_path):
    """An fsdax region is a file the server unlinks when it frees the region: a reader that
    mapped it would keep its blocks allocated on the pool's filesystem for as long as it
    lives (the pool's space leaking with every instance that comes and goes). A reader's
    heartbeat lets go of others' regions whose file is gone; what is written next reads
    back as written."""
    root = tmp_path / "fsdax"
    beat = ["--heartbeat-timeout", "1.5"]  # (a beat every 0.5 s)
    server = maru_server_factory(pool_size="256M", extra_args=beat, pool=str(root) + "/")
    keys = [f"gone/{i}" for i in range(8)]
    sizes = [100_000] * 8
    with MaruHandler(server_url=server.url, pool_size="2M") as reader:
        (a,) = run_processes([(store_keys, (server.url, keys, sizes, 5, 8, {}))], 60)
        assert a["ok"] == [True] * 8  # (the writer has exited: its regions were returned)
        with reader.leased(keys) as infos:
            assert [digest(info.view) for info in infos] == a["digests"]
        del infos  # (a view held keeps its mapping, as long as it is held)
        assert reader.batch_delete(keys) == [True] * 8  # the writer's regions are freed
        assert not any((root / f"region-{r}.mem").exists() for r in a["regions"])
        deadline = time.monotonic() + 30  # (a bound: the beat, then the mappings' retire_s)
        while deleted_files_mapped(root) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert deleted_files_mapped(root) == []
        more = [f"more/{i}" for i in range(8)]
        (b,) = run_processes([(store_keys, (server.url, more, sizes, 6, 8, {}))], 60)
        with reader.leased(more) as infos:
            assert [digest(info.view) for info in infos] == b["digests"]


def test_two_servers_side_by_side(maru_server_factory):
    one = maru_server_factory(pool_size="128M")
    two = maru_server_factory(pool_size="64M")
    assert one.port != two.port and one.pool_path != two.pool_path
    with (
        MaruHandler(server_url=one.url, pool_size="8M", timeout_ms=300) as h1,
        MaruHandler(server_url=two.url, pool_size="8M") as h2,
    ):
        assert h1.store("same-key", b"one" * 1000)
        assert h2.store("same-key", b"two" * 1000)
        assert h1.store("only-one", b"1")
        assert bytes(h1.retrieve("same-key").view) == b"one" * 1000
        assert bytes(h2.retrieve("same-key").view) == b"two" * 1000
        assert h2.retrieve("only-one") is None
        s1, s2 = h1.stats(), h2.stats()
        assert s1["pool"]["path"] == one.pool_path and s1["pool"]["capacity"] == 128 * MiB
        assert s2["pool"]["path"] == two.pool_path and s2["pool"]["capacity"] == 64 * MiB
        assert (s1["keys"], s2["keys"]) == (2, 1)
        assert {r.path for r in h1.list_allocations(all_instances=True)} == {one.pool_path}
        one.stop()  # stopping one leaves the other serving
        assert bytes(h2.retrieve("same-key").view) == b"two" * 1000
        assert h2.store("after", b"a")


def test_an_fsdax_region_file_is_made_anew_never_through_a_link(maru_server_factory, tmp_path):
    """A link planted at the name of a region the server is about to make (region-N.mem in
    its pool directory) is not followed: the region is a new file of the server's, the link's
    target untouched. Before, the server opened it with O_CREAT alone and grew the target to
    the region's length."""
    pool = tmp_path / "fsdax"
    pool.mkdir()
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", pool=str(pool))
    target = tmp_path / "target"
    target.write_text("not a region\n")
    links = [pool / f"region-{i}.mem" for i in range(1, 5)]
    for link in links:
        link.symlink_to(target)
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.store("k", b"v" * 100_000)
        made = {Path(r.path) for r in h.list_allocations()}
        assert bytes(h.retrieve("k").view) == b"v" * 100_000
    assert made and made <= set(links)
    assert all(p.is_file() and not p.is_symlink() for p in made)
    assert target.read_text() == "not a region\n"
