"""Huge pages: on a tmpfs mounted with `huge=within_size` or `huge=advise`, the local index of
a real `maru-server` and the pool pages a client writes are mapped in 2 MiB pages, in the
server and in the client (`maru.common.hugepages`); on `huge=never` (the usual /dev/shm) they
are not, and either way every value reads back as stored. Each case mounts its tmpfs in a
mount namespace of its own (`unshare -m`: root or CAP_SYS_ADMIN, skipped without), which the
kernel tears down when the case's processes end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maru.common import hugepages

from .tmpfs import can_mount_tmpfs
from .tmpfs import run_on_tmpfs as run_child_on_tmpfs

CHILD = Path(__file__).with_name("huge_pages_child.py")


def _huge_pages_exist() -> bool:
    return (
        Path("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB").exists()
        or Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").exists()
    )


pytestmark = [
    pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a tmpfs (needs root)"),
    pytest.mark.skipif(not _huge_pages_exist(), reason="kernel without transparent huge pages"),
]


def run_on_tmpfs(
    tmp_path: Path, huge: str, size: str = "512M", pool_size: str = "256M", values: int = 32
) -> dict:
    """The child's report, run with its pool on a fresh tmpfs of `size` mounted with
    `huge=<huge>`."""
    done = run_child_on_tmpfs(tmp_path, f"huge={huge},size={size}", CHILD, pool_size, str(values))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("huge", ["within_size", "advise"])
def test_the_index_and_the_pages_use_2_mib_pages_where_the_mount_allows(tmp_path, huge):
    got = run_on_tmpfs(tmp_path, huge)
    assert got["local_index"] and got["stored"] == got["right"] == 32
    assert got["huge"] == [huge, huge]  # what `maru status` shows for the pool and the index
    # the whole first table (12.5 MiB) but its unaligned tail, in both processes
    assert got["server_index_kib"] >= 8 * 1024
    assert got["client_index_kib"] >= 8 * 1024
    assert got["client_pool_kib"] >= 4 * 1024  # the 8 MiB the values filled


def test_no_huge_pages_on_a_mount_without_them(tmp_path):
    got = run_on_tmpfs(tmp_path, "never")
    assert got["local_index"] and got["stored"] == got["right"] == 32
    assert got["server_index_kib"] == got["client_index_kib"] == got["client_pool_kib"] == 0


def test_a_tmpfs_with_no_room_for_the_index_leaves_the_reads_to_requests(tmp_path):
    """The index's pages are allocated before any use (an error then, never a SIGBUS later):
    a tmpfs that holds the pool but not the 12.5 MiB first table gives a server without an
    index, whose clients read through requests."""
    got = run_on_tmpfs(tmp_path, "advise", size="10M", pool_size="8M", values=8)
    assert not got["local_index"] and got["huge"] == ["advise", None]  # (stats: index off)
    assert got["stored"] == got["right"] == 8


MOUNTS = """\
sysfs /sys sysfs rw,nosuid 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /dev/shm/huge tmpfs rw,relatime,size=1048576k,huge=within_size 0 0
/dev/vda / ext4 rw,relatime 0 0
"""


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/dev/shm/maru.pool", "never"),
        ("/dev/shm/huge/maru.pool", "within_size"),
        ("/dev/shm/hugelike/maru.pool", "never"),  # a prefix of a name is not a mount point
        ("/var/lib/maru.pool", None),  # not a tmpfs
    ],
)
def test_the_huge_option_of_the_tmpfs_under_a_path(path, expected):
    assert hugepages.tmpfs_huge_option(path, MOUNTS) == expected
