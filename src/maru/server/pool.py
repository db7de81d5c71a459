"""Server-side pool kinds. A pool is a byte range every client can mmap; regions are carved from it.

The kind is told by the path given to `maru-server --pool`:
- a directory                   -> `FsDaxPool`: one file per region (DAX-mounted fs in production)
- `/dev/dax*` or a char device  -> `DevDaxPool`: a CXL/PMEM device, size/alignment from sysfs
- any other path                -> `ShmPool`: one sparse file, by default under /dev/shm
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from abc import ABC, abstractmethod
from pathlib import Path

from maru.common.extents import ExtentAllocator

log = logging.getLogger(__name__)

REGION_ALIGNMENT = 2 << 20  # 2 MiB: huge-page friendly, and what devdax devices align to


class PoolFullError(Exception):
    """No free extent in the pool is large enough for the requested region."""


class Pool(ABC):
    kind: str

    def __init__(self, path: str, capacity: int, alignment: int):
        self.path = path
        self.capacity = capacity
        self.alignment = alignment

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.path}"

    def round_up(self, length: int) -> int:
        return -(-length // self.alignment) * self.alignment

    @abstractmethod
    def allocate(self, region_id: int, length: int) -> tuple[str, int]:
        """Reserve `length` bytes (already rounded); return (file to mmap, offset in it)."""

    @abstractmethod
    def release(self, path: str, offset: int) -> None: ...

    @abstractmethod
    def reserve(self, path: str, offset: int, length: int) -> None:
        """Re-mark an extent as in use when restoring persisted state."""

    @property
    @abstractmethod
    def used(self) -> int: ...

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def fragmentation(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return {
            "kind": self.kind,
            "path": self.path,
            "capacity": self.capacity,
            "used": self.used,
            "free": self.free,
            "fragmentation": round(self.fragmentation(), 4),
        }

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _apply_group(path: str, group: str | None) -> None:
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
        os.chmod(path, 0o660)


class FilePool(Pool):
    """One file or device, regions carved first-fit at `alignment`."""

    def __init__(self, path: str, capacity: int, alignment: int):
        super().__init__(path, capacity, alignment)
        self._extents = ExtentAllocator(capacity, alignment)

    def allocate(self, region_id: int, length: int) -> tuple[str, int]:
        offset = self._extents.allocate(length)
        if offset is None:
            raise PoolFullError(
                f"pool {self.name} is full: cannot fit a region of {length} bytes "
                f"({self.free} of {self.capacity} bytes free, largest free extent "
                f"{self._extents.largest_free})"
            )
        return self.path, offset

    def release(self, path: str, offset: int) -> None:
        self._extents.free_extent(offset)

    def reserve(self, path: str, offset: int, length: int) -> None:
        self._extents.reserve(offset, length)

    @property
    def used(self) -> int:
        return self._extents.used

    def fragmentation(self) -> float:
        return self._extents.fragmentation()


class ShmPool(FilePool):
    """A sparse file (tmpfs under /dev/shm): the embedded default, no hardware needed.

    An existing file is reused, never truncated, so pages outlive a server restart.
    """

    kind = "shm"

    def __init__(self, path: str, capacity: int, group: str | None = None):
        super().__init__(path, capacity, REGION_ALIGNMENT)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < capacity:
                os.ftruncate(fd, capacity)
        finally:
            os.close(fd)
        _apply_group(path, group)


class DevDaxPool(FilePool):
    """A devdax character device (CXL memory, PMEM). Size and alignment come from sysfs.

    A regular file may stand in for the device (tests do this: there is no device here); then
    its size is the capacity and alignment is REGION_ALIGNMENT.
    """

    kind = "devdax"

    def __init__(self, path: str, capacity: int | None = None):
        size, align = self._probe(path)
        if capacity is None or capacity > size:
            if capacity is not None:
                log.warning("pool %s: --pool-size %d exceeds device size %d", path, capacity, size)
            capacity = size
        super().__init__(path, capacity, max(align, REGION_ALIGNMENT))

    @staticmethod
    def _probe(path: str) -> tuple[int, int]:
        st = os.stat(path)
        if stat.S_ISCHR(st.st_mode):
            sysfs = Path("/sys/dev/char") / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            size = int((sysfs / "size").read_text())
            try:
                align = int((sysfs / "align").read_text())
            except (FileNotFoundError, ValueError):
                align = REGION_ALIGNMENT
            return size, align
        if st.st_size <= 0:
            raise ValueError(f"devdax stand-in {path} is empty")
        return st.st_size, REGION_ALIGNMENT


class FsDaxPool(Pool):
    """A directory; each region is its own file `region-<id>.mem` (fsdax in production)."""

    kind = "fsdax"

    def __init__(self, path: str, capacity: int, group: str | None = None):
        super().__init__(path, capacity, REGION_ALIGNMENT)
        self._group = group
        Path(path).mkdir(parents=True, exist_ok=True)
        self._files: dict[str, int] = {}

    def allocate(self, region_id: int, length: int) -> tuple[str, int]:
        if self.used + length > self.capacity:
            raise PoolFullError(
                f"pool {self.name} is full: cannot fit a region of {length} bytes "
                f"({self.free} of {self.capacity} bytes free)"
            )
        file = os.path.join(self.path, f"region-{region_id}.mem")
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)
        _apply_group(file, self._group)
        self._files[file] = length
        return file, 0

    def release(self, path: str, offset: int) -> None:
        self._files.pop(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def reserve(self, path: str, offset: int, length: int) -> None:
        self._files[path] = length

    @property
    def used(self) -> int:
        return sum(self._files.values())


def open_pool(path: str, capacity: int | None, group: str | None = None) -> Pool:
    """Pick the pool kind from the path (see module docstring)."""
    p = Path(path)
    if path.endswith("/") or p.is_dir():
        if capacity is None:
            raise ValueError("--pool-size is required for an fsdax directory pool")
        return FsDaxPool(path.rstrip("/") or "/", capacity, group)
    if path.startswith("/dev/dax") or (p.exists() and stat.S_ISCHR(p.stat().st_mode)):
        return DevDaxPool(path, capacity)
    if capacity is None:
        raise ValueError("--pool-size is required for a shm pool")
    return ShmPool(path, capacity, group)
