"""Client-side mapping of regions: mmap on first use, cached for the handler's lifetime.

Copies into and out of mapped regions run without the GIL (`maru.client.memcopy`), so another
thread may unmap a region meanwhile: a re-handshake after a server restart drops the regions
the server forgot. Closing the mapping under a running copy, or before a copy of addresses
taken from it just before, would crash the process, or, once the address is reused by the
next mmap, put the copy's bytes into another region. So an unmapped region leaves the lookup
tables at once but is closed only once no copy is in flight (`RegionMapper.copying()`, around
every copy) and `retire_s` have passed (addresses taken before the unmap are used within
milliseconds: an allocation's copy, a lookup's read). `close()` (the handler closes) waits,
a bounded time, for the copies in flight, and leaves what they still use mapped for the last
of them to close; a copy of stale addresses after that faults, which the copy loops take as
a failed copy (`maru.client.memcopy`), not a crash.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from maru.common import hugepages
from maru.common.region import RegionHandle
from maru.common.shmindex import region_tag

log = logging.getLogger(__name__)


@dataclass
class MappedRegion:
    handle: RegionHandle
    mm: mmap.mmap
    view: memoryview  # whole region; writable only for regions this instance owns
    address: int  # virtual address of the region's first byte in this process
    writable: bool


class _Copying(contextlib.AbstractContextManager):
    """`RegionMapper.copying()`'s block: a plain class, not a generator (it runs around every
    copy of the data path); reentrant and shared by threads (it only counts)."""

    __slots__ = ("_mapper",)

    def __init__(self, mapper: RegionMapper):
        self._mapper = mapper

    def __enter__(self) -> None:
        self._mapper._copy_began()

    def __exit__(self, *exc: object) -> None:
        self._mapper._copy_ended()


class RegionMapper:
    """Maps region handles into this process. Regions owned by others are mapped read-only,
    so a bug in one instance cannot scribble over another instance's pages."""

    def __init__(self, retire_s: float = 5.0, close_wait_s: float = 5.0) -> None:
        self._regions: dict[int, MappedRegion] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no copy is in flight
        self.retire_s = retire_s
        self.close_wait_s = close_wait_s  # how long `close()` waits for copies in flight
        self._closing = False  # `close()` was called: retired regions need no grace
        self._copies = 0  # copies in flight in `copying()` blocks
        self._retired: list[tuple[float, MappedRegion]] = []  # (unmapped at, region): see module
        self._copying = _Copying(self)
        self._listeners: list[Callable[[int], None]] = []
        self._close_listeners: list[Callable[[int], None]] = []
        # What the local index's probe translates locations with (`maru.common._shmindex`):
        # per mapped region (id, address, length, tag), sorted by id; replaced, never changed.
        self.rows = np.zeros((0, 4), np.int64)

    def add_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(region_id)` for every region mapped from now on, and now for those
        mapped already."""
        self._listeners.append(listener)
        for region_id in self.region_ids():
            listener(region_id)

    def add_close_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(address)` just before a region mapped at `address` is closed (no
        copy can still be using it then: see the module)."""
        self._close_listeners.append(listener)

    def view(self, region_id: int, offset: int, size: int) -> memoryview | None:
        """Bytes [offset, offset + size) of a mapped region; None if it is not mapped or the
        range is outside it."""
        mapped = self._regions.get(region_id)
        if mapped is None or offset < 0 or size < 0 or offset + size > mapped.handle.length:
            return None
        return mapped.view[offset : offset + size]

    def get(self, region_id: int) -> MappedRegion | None:
        return self._regions.get(region_id)

    def copying(self) -> _Copying:
        """Around a copy into or out of mapped regions, from before its addresses are taken
        (an allocation, a lookup) to its end: no region is closed until every such block has
        ended (see the module)."""
        return self._copying

    def _copy_began(self) -> None:
        with self._lock:
            self._copies += 1

    def _copy_ended(self) -> None:
        with self._lock:
            self._copies -= 1
            if not self._copies:
                self._idle.notify_all()
            self._close_retired_locked()

    def _close_retired_locked(self) -> None:
        """Close the unmapped regions that no copy can still be using (see the module)."""
        if self._copies or not self._retired:
            return
        cutoff = time.monotonic() - (0.0 if self._closing else self.retire_s)
        keep: list[tuple[float, MappedRegion]] = []
        for at, mapped in self._retired:
            if at > cutoff:
                keep.append((at, mapped))
            else:
                self._close(mapped)
        self._retired = keep

    def region_ids(self) -> list[int]:
        return list(self._regions)

    def map(self, handle: RegionHandle, *, writable: bool) -> MappedRegion:
        with self._lock:
            mapped = self._regions.get(handle.region_id)
            if mapped is not None and mapped.handle == handle and (mapped.writable or not writable):
                return mapped
            self._close_retired_locked()
            if mapped is not None:
                self._unmap_locked(handle.region_id)
            flags = os.O_RDWR if writable else os.O_RDONLY
            fd = os.open(handle.path, flags)
            try:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                mm = mmap.mmap(fd, handle.length, mmap.MAP_SHARED, prot, offset=handle.offset)
            finally:
                os.close(fd)
            hugepages.advise(mm)  # before the first touch: 2 MiB pages on a huge=advise tmpfs
            address = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
            view = memoryview(mm) if writable else memoryview(mm).toreadonly()
            mapped = MappedRegion(handle, mm, view, address, writable)
            self._regions[handle.region_id] = mapped
            self._update_rows()
        for listener in self._listeners:
            try:
                listener(handle.region_id)
            except Exception:
                log.exception("region listener failed for region %d", handle.region_id)
        return mapped

    def unmap(self, region_id: int) -> None:
        with self._lock:
            self._unmap_locked(region_id)

    def _unmap_locked(self, region_id: int) -> None:
        mapped = self._regions.pop(region_id, None)
        if mapped is None:
            return
        self._update_rows()
        self._retired.append((time.monotonic(), mapped))  # closed later (see the module)
        self._close_retired_locked()

    def _close(self, mapped: MappedRegion) -> None:
        region_id = mapped.handle.region_id
        for listener in self._close_listeners:
            try:
                listener(mapped.address)
            except Exception:
                log.exception("region close listener failed for region %d", region_id)
        try:
            mapped.view.release()
            mapped.mm.close()
        except BufferError:
            # A caller still holds a view into the region; the mapping is closed when the
            # last view is garbage collected.
            log.debug("region %d still has live views; deferring unmap", region_id)

    def _update_rows(self) -> None:
        rows = [
            (m.handle.region_id, m.address, m.handle.length, region_tag(m.handle.token))
            for _, m in sorted(self._regions.items())
        ]
        self.rows = np.array(rows, np.int64).reshape(len(rows), 4)

    def close(self) -> None:
        """Unmap every region, and close them once the copies in flight have ended (the
        handler is closing; another thread may still copy, e.g. a read that began before):
        waits up to `close_wait_s` for them, then leaves the regions they may use for the
        last of them to close (logged), never closing a mapping under a running copy."""
        with self._lock:
            self._closing = True
            for region_id in list(self._regions):
                self._unmap_locked(region_id)
            if not self._idle.wait_for(lambda: not self._copies, self.close_wait_s):
                log.warning(
                    "closing with %d copies still in flight after %.1f s: their %d regions "
                    "are closed when the last of them ends",
                    self._copies,
                    self.close_wait_s,
                    len(self._retired),
                )
                return
            retired, self._retired = self._retired, []
        for _, mapped in retired:
            self._close(mapped)
