"""Issue 43, a CXL pod (first slice): a client maps the pool where its host sees it
(`pool_path`, `MARU_POOL_PATH`) and proves, by the pool's mark, that what it maps is the
server's pool before it reads or writes anything.

Real `maru-server` processes and real handlers. Another path to the same pool is a hard link
(shm) or a symlink to the directory (fsdax); values are checked by their bytes (`make_value`
binds them to their key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from maru import MaruHandler
from maru.common.config import MaruConfig
from maru.common.errors import MaruConnectRefused, MaruNotConnected

from .test_crash_safety import handler, make_value, sigkill_server
from .test_pool_kinds import devdax_stand_in_server  # noqa: F401 - a fixture
from .test_pool_trust import read_counts, store
from .tmpfs import can_mount_tmpfs, run_on_tmpfs

POD_CHILD = Path(__file__).with_name("pod_child.py")


def other_path(pool: str, tmp_path: Path) -> str:
    """Another path to the very same pool: a hard link beside a pool file (same tmpfs), a
    symlink to an fsdax directory."""
    if os.path.isdir(pool):
        link = tmp_path / "pool-elsewhere"
        link.symlink_to(pool, target_is_directory=True)
        return str(link)
    link = pool + ".elsewhere"
    os.link(pool, link)
    return link


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def instances(h: MaruHandler) -> int:
    return len(h.stats()["instances"])


def mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("kind", ["shm", "fsdax"])
def test_a_client_maps_the_pool_at_its_pool_path_and_reads_by_bytes(
    maru_server_factory, tmp_path, kind
):
    pool = str(tmp_path / "fsdax") if kind == "fsdax" else None
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", pool=pool)
    elsewhere = other_path(server.pool_path, tmp_path)
    try:
        here = handler(server.url, pool_size="4M")  # the server's path
        there = handler(server.url, pool_size="4M", pool_path=elsewhere)
        here_keys = [f"here/{i}" for i in range(12)]
        there_keys = [f"there/{i}" for i in range(12)]
        store(here, here_keys)
        store(there, there_keys)
        assert read_counts(there, here_keys) == (12, 0, 0)  # the other's region, read in place
        assert read_counts(here, there_keys) == (12, 0, 0)  # what it wrote through its path
        assert read_counts(there, there_keys) == (12, 0, 0)
        assert elsewhere in mapped_paths()  # (it really mapped its own path)
        there.close()
        here.close()
    finally:
        if kind == "shm":
            os.unlink(elsewhere)


def test_a_devdax_pool_is_proven_by_the_mark_in_its_last_unit(
    devdax_stand_in_server,  # noqa: F811 - the fixture imported above
    tmp_path,
):
    """devdax (a regular file stands in for the device; an embedded service marks the pool
    when it starts): the mark lies in the device's last alignment unit, read through a
    mapping; another path to the device reads by bytes, a device of zeros is refused."""
    service, dev = devdax_stand_in_server
    elsewhere = str(tmp_path / "dax1.0")
    os.link(dev, elsewhere)
    zeros = tmp_path / "dax2.0"
    zeros.write_bytes(b"")
    os.truncate(zeros, os.path.getsize(dev))
    here = handler(service.endpoint, pool_size="4M")
    there = handler(service.endpoint, pool_size="4M", pool_path=elsewhere)
    keys = [f"dax/{i}" for i in range(8)]
    store(there, keys)
    assert read_counts(here, keys) == (8, 0, 0)
    refused = MaruHandler(server_url=service.endpoint, pool_size="4M", pool_path=str(zeros))
    assert not refused.connected and f"pool_path {zeros} holds no pool mark" in str(
        refused.connect_error
    )
    for h in (refused, there, here):
        h.close()


def test_maru_pool_path_is_read_when_the_key_is_unset_and_the_key_wins(
    maru_server, tmp_path, monkeypatch
):
    elsewhere = other_path(maru_server.pool_path, tmp_path)
    zeros = tmp_path / "zeros.pool"
    zeros.write_bytes(b"")
    os.truncate(zeros, os.path.getsize(maru_server.pool_path))
    try:
        monkeypatch.setenv("MARU_POOL_PATH", elsewhere)
        assert MaruConfig().pool_path == elsewhere
        with MaruHandler(server_url=maru_server.url, pool_size="4M") as h:
            key = "from-the-environment"
            assert h.store(key, make_value(key, 40_000))
            assert read_counts(h, [key]) == (1, 0, 0)
            assert elsewhere in mapped_paths()
        # The key wins: the zeros it names are refused, though the variable names the pool.
        h = MaruHandler(server_url=maru_server.url, pool_size="4M", pool_path=str(zeros))
        assert not h.connected
        assert str(zeros) in str(h.connect_error)
        h.close()
    finally:
        os.unlink(elsewhere)


@pytest.mark.parametrize("impostor", ["zeros", "another-servers-pool", "stale-copy"])
def test_a_pool_path_naming_another_file_is_refused_and_left_untouched(
    maru_server_factory, tmp_path, impostor, caplog
):
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    size = os.path.getsize(server.pool_path)
    if impostor == "zeros":
        path = str(tmp_path / "zeros.pool")
        Path(path).write_bytes(b"")
        os.truncate(path, size)
    elif impostor == "another-servers-pool":
        other = maru_server_factory(tmp_path / "other", pool_size="64M")
        path = other.pool_path
        assert os.path.getsize(path) == size
    else:  # the server's pool as it was before a restart (a file left from an earlier run)
        path = str(tmp_path / "stale.pool")
        Path(path).write_bytes(Path(server.pool_path).read_bytes())
        server.restart()  # (a new epoch in the pool's mark: the copy holds the old one)
    before = digest(path)
    with MaruHandler(server_url=server.url, pool_size="4M") as watcher:
        assert watcher.store("watch", make_value("watch", 40_000))
        caplog.set_level(logging.WARNING, logger="maru.client.handler")
        h = MaruHandler(server_url=server.url, pool_size="4M", pool_path=path)
        assert not h.connected
        assert isinstance(h.connect_error, MaruConnectRefused)
        message = str(h.connect_error)
        assert path in message and "mark" in message
        assert path in caplog.text  # (one WARNING says it too)
        with pytest.raises(MaruConnectRefused, match="mark"), h:
            pass
        assert instances(watcher) == 1  # the refused instance was ended at once
        assert read_counts(watcher, ["watch"]) == (1, 0, 0)
    assert digest(path) == before  # nothing written through it


def test_a_missing_pool_path_is_a_failed_connect_with_the_reason(maru_server, tmp_path):
    missing = str(tmp_path / "no-such-pool")
    h = MaruHandler(server_url=maru_server.url, pool_size="4M", pool_path=missing)  # no raise
    assert not h.connected
    assert isinstance(h.connect_error, MaruConnectRefused)
    assert f"pool_path {missing} does not exist" in str(h.connect_error)
    h.close()


def test_a_restart_on_a_recreated_pool_is_proven_again(maru_server_factory, tmp_path):
    """A host whose `pool_path` still names the old pool (a bind-mounted file keeps its old
    inode when the server's host recreates the pool) is refused at its re-handshake: it never
    reads the new pool's keys, nor the old pool's bytes, as hits; one with the server's path
    goes on."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    elsewhere = other_path(server.pool_path, tmp_path)
    try:
        here = handler(server.url, pool_size="4M", timeout_ms=1000)
        there = handler(server.url, pool_size="4M", timeout_ms=1000, pool_path=elsewhere)
        old = [f"old/{i}" for i in range(8)]
        store(here, old)
        assert read_counts(there, old) == (8, 0, 0)
        sigkill_server(server)
        os.unlink(server.pool_path)  # recreated at the next start; the link keeps the old one
        server.start(server.port)
        new = [f"new/{i}" for i in range(8)]
        for key in new:  # (the first store after the restart may fail: RegionsLost)
            here.store(key, make_value(key, 60_000))
        assert read_counts(here, new) == (8, 0, 0)
        assert not there.healthcheck()  # its re-handshake finds the old mark at its path
        assert not there.connected and elsewhere in str(there.connect_error)
        with pytest.raises(MaruNotConnected):
            read_counts(there, new + old)  # no read at all, hit or not
        assert not there.connect()  # and stays refused
        assert elsewhere in str(there.connect_error)
        there.close()
        here.close()
    finally:
        os.unlink(elsewhere)


def hosts_missing() -> str:
    """Why this machine cannot simulate hosts (namespaces, veth; root), or ""."""
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)}"
    if not can_mount_tmpfs():
        return "cannot make a mount namespace with a tmpfs (needs root)"
    probe = ["unshare", "--net", "sh", "-c", "ip link add probe-a type veth peer name probe-b"]
    if subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
        return "cannot make a network namespace with a veth pair (needs root)"
    return ""


@pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing() or "-")
def test_a_second_host_maps_the_pool_at_its_own_path(tmp_path):
    """Two hosts of a pod (`pod_child.py`): each its own network and mount namespace with a
    private /dev/shm, joined by a veth pair; the pool in a tmpfs host A sees as a directory
    and host B as one bind-mounted file at another path; `maru-server --curve` on host A. A
    client on B with `pool_path` reads A's values and A reads B's, by their bytes; one on B
    without it (the server's path does not exist there) is refused, naming the path."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    done = run_on_tmpfs(tmp_path, "size=256M", POD_CHILD, str(workdir), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    pod = json.loads(done.stdout.strip().splitlines()[-1])
    assert pod["url"].startswith("tcp://10.43.0.1:")
    assert pod["a_writes"]["stored"] == 16, pod
    assert pod["b_writes_reads_a"] == {"stored": 16, "right": 16, "missing": 0, "wrong": 0}, pod
    assert pod["a_reads_b"] == {"stored": 0, "right": 16, "missing": 0, "wrong": 0}, pod
    refused = pod["b_unset"]["refused"]
    assert "pool path" in refused and "does not exist on this host" in refused, pod
