"""What the server's and the clients' sides of the local index share (docs/architecture.md,
"The local index"): the C table (`maru.common._shmindex`, whose header comment is the layout),
the files' names and the region tag. A table `<base>.<n>` (only the server writes it) and its
use bits `<base>.<n>.use` are named after the pool with `n` growing, so that the next server
finds and retires the earlier tables, and a reader whose table was replaced finds the new one.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from typing import Any

from maru.common._shmindex import (  # (the aliased names: re-exported)
    HASH_BYTES,
    HEADER_BYTES,
    SLOT_BYTES,
)
from maru.common._shmindex import MAX_KEY as MAX_KEY
from maru.common._shmindex import NCOLS as NCOLS
from maru.common._shmindex import IndexFaultError as IndexFaultError
from maru.common._shmindex import Reader as Reader
from maru.common._shmindex import Writer as Writer
from maru.common._shmindex import format_table as format_table
from maru.common._shmindex import hash_generation as hash_generation

SHM_DIR = "/dev/shm"
USE_SUFFIX = ".use"


def index_base(pool_kind: str, pool_path: str) -> str:
    """The files of a pool's index start with this: beside a shm pool file, else in /dev/shm
    under a hash of the pool's path (a device or a DAX directory is no place for them)."""
    if pool_kind == "shm":
        return f"{pool_path}.index"
    digest = hashlib.sha256(os.path.realpath(pool_path).encode()).hexdigest()[:16]
    return os.path.join(SHM_DIR, f"maru-index-{digest}")


def table_files(base: str) -> list[tuple[int, str]]:
    """The tables named `<base>.<n>` that exist now, as (n, path), oldest (lowest n) first."""
    directory, prefix = os.path.split(base)
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)")
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    found = [
        (int(m.group(1)), os.path.join(directory, name))
        for name in names
        if (m := pattern.fullmatch(name))
    ]
    return sorted(found)


def base_of(table_path: str) -> str | None:
    """The base of a table's path (`<base>.<n>` -> `<base>`), None if it is not one."""
    m = re.fullmatch(r"(.+)\.(\d+)", table_path)
    return m.group(1) if m else None


def table_bytes(capacity: int) -> int:
    """A table file's size: the header, the slots, then their hash column."""
    return HEADER_BYTES + capacity * (SLOT_BYTES + HASH_BYTES)


def area_bytes(slots: int) -> int:
    """An in-pool table's area (`maru-server --index-slots`): the table, then its use bytes,
    each starting on a 4 KiB page (0 slots: none)."""
    if slots <= 0:
        return 0
    page = mmap.ALLOCATIONGRANULARITY
    return -(-table_bytes(slots) // page) * page + -(-slots // page) * page


def area_views(area: Any, slots: int) -> tuple[memoryview, memoryview]:
    """The table and the use bytes inside an in-pool table's mapped area (`area_bytes`):
    release both before the mapping is closed."""
    page = mmap.ALLOCATIONGRANULARITY
    table_end = table_bytes(slots)
    use_at = -(-table_end // page) * page
    view = memoryview(area)
    return view[:table_end], view[use_at : use_at + slots]


def map_area(path: str, offset: int, length: int, *, populate: bool = False) -> mmap.mmap:
    """`length` bytes at `offset` of `path` mapped shared, read-write (`populate`: every page
    now, so that no probe pays a page fault)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, length, flags, offset=offset)
    finally:
        os.close(fd)


def region_tag(token: str) -> int:
    """A region's tag in the table: its token's first 8 bytes as a signed int64. The token signs
    the region's pool path, offset, length and pool generation: equal tags, same memory."""
    try:
        value = int(token[:16], 16)
    except (TypeError, ValueError):
        return 0
    return value - (1 << 64) if value >= 1 << 63 else value


def owned_by(fd: int, uid: int | None, *, shared_write: bool = False) -> bool:
    """Whether `fd` is owned by `uid` (the server's) and, unless `shared_write` (the use bits),
    writable by nobody else: a reader trusts only what the server wrote."""
    st = os.fstat(fd)
    return uid is not None and st.st_uid == uid and (shared_write or not st.st_mode & 0o022)
