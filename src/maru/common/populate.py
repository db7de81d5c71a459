"""Mapping a file's pages in bulk (MADV_POPULATE_READ / _WRITE, Linux 5.14), for the client's
region mapper and the cluster tier's sidecar: a range is mapped in one call, off the data path,
instead of a fault per first touch, and an error replaces the SIGBUS a touch would get (a pool
truncated under it). Populating a hole allocates memory: readers populate `backed_extents` only.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

log = logging.getLogger(__name__)

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # (Python 3.11's mmap names neither)
POPULATE_STEP = 4 << 20  # bytes per call: whoever unmaps waits for at most one step
MAX_EXTENTS = 256  # ranges of a file looked up per call of `backed_extents`
_libc = ctypes.CDLL(None, use_errno=True)  # (ctypes drops the GIL around the call)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_works: bool | None = None  # MADV_POPULATE_* known to work here (None: not tried)


def populate_works() -> bool:
    """Whether this kernel has MADV_POPULATE_READ (tried once, on a page of anonymous memory);
    else a mapper maps with MAP_POPULATE."""
    global _works
    if _works is None:
        probe = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            probe.madvise(MADV_POPULATE_READ)
            _works = True
        except (OSError, ValueError):
            _works = False
            log.info("this kernel has no MADV_POPULATE_READ: regions are mapped with MAP_POPULATE")
        finally:
            probe.close()
    return _works


def populate(address: int, size: int, advice: int) -> int:
    """Map [address, address + size) of a mapping in (`advice`: MADV_POPULATE_READ or
    MADV_POPULATE_WRITE), without the GIL; 0, or the errno of the refusal."""
    return 0 if _libc.madvise(address, size, advice) == 0 else ctypes.get_errno()


def backed_extents(fd: int, offset: int, length: int) -> list[tuple[int, int]]:
    """The page-aligned (start, end) ranges, relative to `offset`, of the `length` bytes there
    that the file holds pages for: all of them where every page is allocated (a tmpfs's
    SEEK_DATA calls fallocated, unwritten pages holes) or the filesystem cannot say (a device);
    else SEEK_DATA / SEEK_HOLE's, the first `MAX_EXTENTS` only (a bounded cost)."""
    end, extents, pos = offset + length, [], offset
    try:
        st = os.fstat(fd)
        if st.st_size and st.st_blocks * 512 >= st.st_size:
            return [(0, min(length, st.st_size - offset))] if st.st_size > offset else []
        while pos < end and len(extents) < MAX_EXTENTS:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            if start >= end:
                break
            pos = min(os.lseek(fd, start, os.SEEK_HOLE), end)
            extents.append((start - offset, pos - offset))
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # (ENXIO: no data past `pos`)
            return [(0, length)]
    page = mmap.PAGESIZE
    return [(a // page * page, min(-(-b // page) * page, length)) for a, b in extents]
