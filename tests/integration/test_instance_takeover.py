"""A process that reuses the instance id of a crashed one (before the reaper ran) adopts its
regions, and must not hand out the pages that the crashed process's keys still occupy."""

from __future__ import annotations

import os

from maru import MaruHandler


def test_takeover_of_an_instance_id_keeps_registered_pages_intact(maru_server):
    iid = "sglang-node-0"
    kw = {
        "server_url": maru_server.url,
        "pool_size": "4M",
        "chunk_size_bytes": "64K",
        "auto_expand": False,
    }
    first = MaruHandler(instance_id=iid, **kw)
    old = {f"old/{i}": os.urandom(40_000 + 1000 * i) for i in range(20)}
    assert first.batch_store(list(old), list(old.values())) == [True] * 20
    # `first` "crashes": it never returns its regions. A new process takes the same id.
    second = MaruHandler(instance_id=iid, **kw)
    assert second.owned_region_ids() == first.owned_region_ids()
    assert second.free_chunks() == 64 - 20  # the 20 registered pages are not free
    new = [os.urandom(65536) for _ in range(44)]
    assert second.batch_store([f"new/{i}" for i in range(44)], new) == [True] * 44
    with MaruHandler(server_url=maru_server.url, pool_size="1M") as reader:
        infos = reader.batch_retrieve(list(old))
        assert [bytes(i.view) for i in infos] == list(old.values())
        infos = reader.batch_retrieve([f"new/{i}" for i in range(44)])
        assert [bytes(i.view) for i in infos] == new
    # deleting an old key frees exactly its page for the new owner
    assert second.delete("old/3")
    assert second.exists("old/4")
    assert second.store("again", os.urandom(1000))
    assert second.free_chunks() == 0
    second.close()
    first._rpc.close()  # the crashed process' socket (no return: it is gone)


def test_takeover_with_smaller_pages_merges_shared_pages(maru_server):
    iid = "sglang-node-1"
    first = MaruHandler(
        instance_id=iid,
        server_url=maru_server.url,
        pool_size="4M",
        chunk_size_bytes="64K",
        auto_expand=False,
    )
    vals = [os.urandom(5000) for _ in range(8)]
    assert first.batch_store([f"k{i}" for i in range(8)], vals) == [True] * 8
    # The successor uses 1 MiB pages: all 8 keys sit in its page 0, which must stay taken.
    second = MaruHandler(
        instance_id=iid,
        server_url=maru_server.url,
        pool_size="4M",
        chunk_size_bytes="1M",
        auto_expand=False,
    )
    assert second.free_chunks() == 3
    assert second.delete("k0")  # freeing one key of a merged run must not free the run
    assert second.free_chunks() == 3
    assert second.store("big", os.urandom(3 << 20))
    with MaruHandler(server_url=maru_server.url, pool_size="1M") as reader:
        assert [
            bytes(i.view) for i in reader.batch_retrieve([f"k{i}" for i in range(1, 8)])
        ] == vals[1:]
    second.close()
    first._rpc.close()


def test_second_server_on_the_same_state_dir_refuses_to_start(maru_server, tmp_path):
    import subprocess
    import sys

    state_dir = maru_server.state_dir
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "maru.server",
            "--port",
            "0",
            "--pool",
            str(tmp_path / "other.pool"),
            "--pool-size",
            "64M",
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert f"state dir {state_dir} is in use by maru-server pid {maru_server.proc.pid}" in (
        proc.stderr
    )
    with MaruHandler(server_url=maru_server.url, pool_size="1M") as h:  # first one unharmed
        assert h.store("still", b"fine")
