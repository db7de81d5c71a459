"""2 MiB pages for the shared mappings where the filesystem allows (docs/operations.md#huge-pages):
in 4 KiB pages every random probe of the local index misses the TLB. Maru asks (MADV_HUGEPAGE,
a hint) on every mapping it makes and allocates the index's pages through its mapping, so that
a tmpfs with `huge=advise` gives them 2 MiB pages as one with `huge=within_size` does.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from maru.common.populate import MADV_POPULATE_WRITE


def advise(mm: mmap.mmap) -> None:
    """Ask for huge pages for `mm` (before its pages are touched); a refusal is fine."""
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(mmap.MADV_HUGEPAGE)


def map_allocated(fd: int, size: int) -> mmap.mmap:
    """Map the file `fd` read-write, `size` bytes, every page allocated now: huge ones where
    the mount allows. Raises OSError (ENOSPC) when the filesystem cannot hold `size` bytes, so
    that no later write through the mapping can die of SIGBUS."""
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        advise(mm)
        # every page allocated through this mapping (so with its MADV_HUGEPAGE); an older
        # kernel (EINVAL) or a full filesystem (EFAULT): posix_fallocate decides
        with contextlib.suppress(OSError):
            mm.madvise(MADV_POPULATE_WRITE)
        os.posix_fallocate(fd, 0, size)  # (allocates what populating left; ENOSPC is raised)
    except BaseException:
        mm.close()
        raise
    return mm


def mount_entry(path: str, mounts: str | None = None) -> list[str] | None:
    """The /proc/mounts line (its fields) of the filesystem that holds `path`; None if none is
    found or /proc/mounts cannot be read. `mounts`: that file's text (tests)."""
    if mounts is None:
        try:
            with open("/proc/mounts") as f:
                mounts = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best, found = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, fields
    return found


def tmpfs_huge_option(path: str, mounts: str | None = None) -> str | None:
    """The `huge=` option of the tmpfs that holds `path` ("never" when its mount names none);
    None when `path` is not on a tmpfs (or the mounts cannot be read)."""
    entry = mount_entry(path, mounts)
    if entry is None or entry[2] != "tmpfs":
        return None
    options = dict(opt.partition("=")[::2] for opt in entry[3].split(","))
    return options.get("huge", "never")


def describe(huge: str | None) -> str:
    """What pages files get on a tmpfs mounted with `huge=<huge>` (None: not a tmpfs), for a
    log line or `maru status`."""
    if huge is None:
        return "not a tmpfs: the device's or filesystem's own pages"
    if huge in ("never", "deny"):
        return (
            f"4 KiB pages (tmpfs huge={huge}; one mounted with huge=within_size gives 2 MiB "
            "pages: docs/operations.md#huge-pages)"
        )
    return f"2 MiB pages where the kernel has them (tmpfs huge={huge})"
