"""Client-side mapping of regions: mmap on first use, cached for the handler's lifetime.

Copies run without the GIL, so another thread may unmap a region meanwhile (a re-handshake
drops the regions a restarted server forgot). Closing a mapping under a copy, or before a copy
of addresses just taken from it, would crash the process or, once the next mmap reuses the
address, copy into another region. So an unmapped region leaves the lookup tables at once but
is closed only when no `copying()` block is open and `retire_s` have passed (addresses taken
before the unmap are used within milliseconds). `close()` waits a bounded time for the copies
in flight, leaving what they use for the last of them to close; a later copy of stale
addresses faults, which the copy loops take as a failed copy.

A region of ours leaves the tables when we stop owning it (`close`, a region the server
forgot or lists differently, one given back or taken back), and the server may hand its pages
to another instance at once. A caller may still hold a view or an address in it (an
`AllocHandle`, LMCache's memory objects; a view keeps the mapping alive): a write through it
would land in the new owner's pages, under its registered key. So it is fenced at once
(`_fence`): the same file range mapped again over it, at the same address, private
(copy-on-write): reads still see the pool, writes land in this process's memory only.

With `populate=True` (`eager_map`) a background thread maps each new region's pages in bulk
(MADV_POPULATE_WRITE / _READ; MAP_POPULATE before Linux 5.14), so that a first copy does not
fault once per 4 KiB page. Only pages the file holds are populated (SEEK_DATA): a hole would
take memory; a region taken ahead of our writes (`RegionSupply.ready`) is populated whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from maru.client.coherence import SOFTWARE, process_mode
from maru.client.poolpath import PoolPlace
from maru.common import hugepages
from maru.common._memcopy import CopyGate
from maru.common._memcopy import flush_ranges as _flush_ranges
from maru.common.memcopy import CopyFaultError
from maru.common.populate import (
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    POPULATE_STEP,
    backed_extents,
    populate,
    populate_works,
)
from maru.common.region import RegionHandle
from maru.common.shmindex import region_tag

log = logging.getLogger(__name__)

# How long after a region of another instance is mapped `follow_backing` looks again for the
# pages its writer backed since (a writer readies a new region's pages in well under a second)
FOLLOW_S = 5.0

# mmap(2) flags the mmap module does not export (Linux; the same on x86-64 and arm64)
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGEMAP_STEP = 1 << 16  # pagemap entries read at a time (256 MiB of 4 KiB pages)


@dataclass
class MappedRegion:
    handle: RegionHandle
    mm: mmap.mmap
    view: memoryview  # whole region; writable only for regions this instance owns
    address: int  # virtual address of the region's first byte in this process
    writable: bool
    # what `populate` maps in: what the file held when mapped (`backed_extents`; None: not
    # looked up yet, `populate` does), or all of it
    backed: tuple[tuple[int, int], ...] | None = ()
    followed_from: float = 0.0  # (monotonic; 0: never) `follow_backing` looks for FOLLOW_S
    populated: tuple[tuple[int, int], ...] = ()  # the extents `populate` has mapped in
    file: tuple[int, int] = (0, 0)  # the mapped file's (device, inode): `let_go_removed`
    fenced: bool = False  # writes through it no longer reach the pool (`RegionMapper._fence`)

    @property
    def whole(self) -> bool:
        return self.backed == ((0, self.handle.length),)


class RegionMapper:
    """Maps region handles into this process. Regions owned by others are mapped read-only,
    so a bug in one instance cannot scribble over another instance's pages."""

    def __init__(
        self, retire_s: float = 5.0, close_wait_s: float = 5.0, *, populate: bool = False
    ) -> None:
        """`populate`: map each region's pages in bulk, in the background (see the module)."""
        self._regions: dict[int, MappedRegion] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no copy is in flight
        self.retire_s = retire_s
        self.close_wait_s = close_wait_s  # how long `close()` waits for copies in flight
        self._closing = False  # `close()` was called: retired regions need no grace
        self._retired: list[tuple[float, MappedRegion]] = []  # (unmapped at, region): see module
        # `copying()`'s block, in C (two C calls per copy, no lock): `_copies_ended` is called
        # when the last open block closes while the gate is `wanted` (a retired region, a close)
        self._gate = CopyGate(self._copies_ended)
        self._listeners: list[Callable[[int], None]] = []
        self._close_listeners: list[Callable[[int], None]] = []
        self.populate_regions = populate
        self._to_populate: list[MappedRegion] = []
        self._populator: threading.Thread | None = None
        # What the local index's probe translates locations with (`maru.common._shmindex`):
        # per mapped region (id, address, length, tag), sorted by id; replaced, never changed.
        self.rows = np.zeros((0, 4), np.int64)
        self.place: PoolPlace | None = None  # where this host maps the pool (the handshake)

    def add_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(region_id)` for every region mapped, those mapped already included."""
        self._listeners.append(listener)
        for region_id in self.region_ids():
            listener(region_id)

    def add_close_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(address)` just before the region mapped there is closed."""
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

    def copying(self) -> CopyGate:
        """Around a copy from before its addresses are taken to its end: no region is closed
        until every such block has ended. Reentrant, shared by threads; always the same object."""
        return self._gate

    def wait_copies(self, timeout: float) -> bool:
        """Wait up to `timeout` s until no `copying()` block is open: another thread's copy
        into our regions must end before DISCONNECT lets the server hand them to another
        instance (`MaruHandler.close`). False if one is still open then."""
        with self._lock:
            return self._wait_copies_locked(timeout)

    def _wait_copies_locked(self, timeout: float) -> bool:
        """`wait_copies` with `_lock` held (`close` too). The gate is wanted again before each
        wait: `_copies_ended` may have let it go for a copy that began since."""
        deadline = time.monotonic() + timeout
        while self._gate.active:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._gate.wanted = True  # (`_copies_ended` notifies `_idle`)
            self._idle.wait(left)
        self._gate.wanted = bool(self._retired) or self._closing
        return not self._gate.active

    def _copies_ended(self) -> None:
        """The last open `copying()` block closed while the gate was wanted."""
        with self._lock:
            if self._gate.active:  # (another began meanwhile: its end calls again)
                return
            self._idle.notify_all()
            self._close_retired_locked()

    def _close_retired_locked(self) -> None:
        """Close the unmapped regions that no copy can still be using (see the module)."""
        self._gate.wanted = bool(self._retired) or self._closing
        if self._gate.active or not self._retired:
            return
        cutoff = time.monotonic() - (0.0 if self._closing else self.retire_s)
        keep: list[tuple[float, MappedRegion]] = []
        for at, mapped in self._retired:
            if at > cutoff:
                keep.append((at, mapped))
            else:
                self._close(mapped)
        self._retired = keep
        self._gate.wanted = bool(keep) or self._closing

    def region_ids(self) -> list[int]:
        return list(self._regions)

    def map(
        self, handle: RegionHandle, *, writable: bool, whole: bool = False, follow: bool = False
    ) -> MappedRegion:
        """`whole`: populate all of it, holes too (a region of ours taken ahead of our
        writes, `RegionSupply.ready`: its pages are about to be written anyway). `follow`: a
        region just made, whose writer is backing its pages (`follow_backing`)."""
        with self._lock:
            mapped = self._regions.get(handle.region_id)
            if mapped is not None and mapped.handle == handle and (mapped.writable or not writable):
                return mapped
            self._close_retired_locked()
            if mapped is not None:
                self._unmap_locked(handle.region_id)
            fd = os.open(self._path(handle), os.O_RDWR if writable else os.O_RDONLY)
            try:
                st = os.fstat(fd)
                background = self.populate_regions and populate_works()
                if whole:
                    backed: list[tuple[int, int]] | None = [(0, handle.length)]
                elif background:  # (looked up by the populate thread: a tmpfs walks its
                    backed = None  # pages, 0.05 ms per MiB held, not on a connect's path)
                else:
                    backed = backed_extents(fd, handle.offset, handle.length)
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                map_flags = mmap.MAP_SHARED
                all_of_it = backed == [(0, handle.length)]  # (MAP_POPULATE fills holes)
                if self.populate_regions and all_of_it and not populate_works():
                    map_flags |= getattr(mmap, "MAP_POPULATE", 0)  # (no MADV_HUGEPAGE first)
                mm = mmap.mmap(fd, handle.length, map_flags, prot, offset=handle.offset)
            finally:
                os.close(fd)
            hugepages.advise(mm)  # before the first touch: 2 MiB pages on a huge=advise tmpfs
            address = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
            view = memoryview(mm) if writable else memoryview(mm).toreadonly()
            extents = None if backed is None else tuple(backed)
            since = time.monotonic() if follow else 0.0
            mapped = MappedRegion(handle, mm, view, address, writable, extents, since)
            mapped.file = st.st_dev, st.st_ino
            self._regions[handle.region_id] = mapped
            self._update_rows()
            if background and backed != []:
                self._populate_later_locked(mapped)
        for listener in self._listeners:
            try:
                listener(handle.region_id)
            except Exception:
                log.exception("region listener failed for region %d", handle.region_id)
        return mapped

    def _populate_later_locked(self, mapped: MappedRegion) -> None:
        """Queue `mapped` for the populate thread (started if none runs)."""
        if any(m is mapped for m in self._to_populate):  # (not `in`: dataclass equality)
            return
        self._to_populate.append(mapped)
        if self._populator is None or not self._populator.is_alive():  # (or forked)
            self._populator = threading.Thread(
                target=self._populate_pending, name="maru-populate", daemon=True
            )
            self._populator.start()

    def follow_backing(self) -> None:
        """Look again at the regions just made by others (mapped with `follow` in the last
        FOLLOW_S) whose file held only part of their pages: their writers back pages as they
        write (or ready them), and the pages backed since are populated here too, in the
        background, before a read faults on them. (The watch calls this between heartbeats;
        regions found at connect, of any age, are populated once.)"""
        if not (self.populate_regions and populate_works()):
            return
        since = time.monotonic() - FOLLOW_S
        with self._lock:
            for mapped in self._regions.values():
                young = mapped.followed_from >= since and not mapped.writable
                if young and mapped.backed is not None and not mapped.whole:
                    mapped.backed = None  # (`populate` looks it up again)
                    self._populate_later_locked(mapped)

    def _populate_pending(self) -> None:
        """The populate thread; ends when no region is left (the next `map` starts another)."""
        with contextlib.suppress(OSError):  # (the copies, on the same cores, come first)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._lock:
                if not self._to_populate or self._closing:
                    self._to_populate.clear()
                    self._populator = None
                    return
                mapped = self._to_populate.pop(0)
            self.populate(mapped)

    def wait_populated(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the regions mapped so far to be populated; False if not."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._populator
            if thread is None or not thread.is_alive() or thread is threading.current_thread():
                return True
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False

    def populate(self, mapped: MappedRegion) -> bool:
        """Map in the `backed` pages of `mapped`, step by step, each in a `copying()` block and
        only while it is still mapped here. False (logged) when the kernel refused, e.g. a pool
        truncated under it (EFAULT, where a touch would SIGBUS); the region stays usable."""
        advice = MADV_POPULATE_WRITE if mapped.writable else MADV_POPULATE_READ
        region_id = mapped.handle.region_id
        backed = mapped.backed
        if backed is None:
            backed = mapped.backed = self._backed(mapped.handle)
        done = mapped.populated  # (`follow_backing` again: only what was backed since)
        steps = [
            (at, min(POPULATE_STEP, end - at))
            for start, end in backed
            for at in range(start, end, POPULATE_STEP)
            if not _within(at, min(at + POPULATE_STEP, end), done)
        ]
        if mapped.writable:  # (our writes take a region's chunks from its start: meet them
            steps.reverse()  # last, not page by page: a page both fault waits on the other)
        for at, size in steps:
            with self.copying():
                if self._closing or self._regions.get(region_id) is not mapped:
                    return True  # (unmapped meanwhile: nothing left to do)
                code = populate(mapped.address + at, size, advice)
                if code == 0:
                    continue
            log.warning(
                "region %d (%s at %d): populating its pages failed at offset %d: %s; "
                "its copies map what they touch (a truncated pool fails them)",
                region_id,
                mapped.handle.path,
                mapped.handle.offset,
                at,
                os.strerror(code),
            )
            mapped.followed_from = 0.0  # (not followed again)
            return False
        mapped.populated = backed
        return True

    @property
    def pool_proof(self) -> str:
        """This instance's proof that it reads the pool (`PoolPlace.proof`): REQUEST_REGION's."""
        return self.place.proof if self.place else ""

    def _path(self, handle: RegionHandle) -> str:
        """Where this host opens `handle`'s file (the handshake's `place`)."""
        return self.place.local_path(handle.path) if self.place else handle.path

    def _backed(self, handle: RegionHandle) -> tuple[tuple[int, int], ...]:
        """`backed_extents` of `handle`'s range now (none if the pool cannot be opened)."""
        try:
            fd = os.open(self._path(handle), os.O_RDONLY)
        except OSError as exc:
            log.debug("region %d: cannot look up its pages: %s", handle.region_id, exc)
            return ()
        try:
            return tuple(backed_extents(fd, handle.offset, handle.length))
        finally:
            os.close(fd)

    def let_go_removed(self) -> list[int]:
        """Unmap other instances' regions whose file is no longer at its path (an fsdax
        region the server freed: its file unlinked, whose blocks a mapping would keep
        allocated on the pool's filesystem; or a pool file made anew). Each path is looked
        at once (a shm pool: one file for every region). The region ids let go. Also closes
        the mappings let go earlier that no copy can be using any more (see the module)."""
        with self._lock:
            self._close_retired_locked()  # (those let go before, an idle reader's too)
            theirs = [m for m in self._regions.values() if not m.writable]
        now: dict[str, tuple[int, int] | None] = {}
        gone = []
        for mapped in theirs:
            path = self._path(mapped.handle)
            if path not in now:
                try:
                    st = os.stat(path)
                    now[path] = st.st_dev, st.st_ino
                except FileNotFoundError:
                    now[path] = None
                except OSError:  # (cannot tell: kept)
                    continue
            if now.get(path, mapped.file) != mapped.file:
                gone.append(mapped)
        with self._lock:
            for mapped in gone:
                if self._regions.get(mapped.handle.region_id) is mapped:
                    self._unmap_locked(mapped.handle.region_id)
        for mapped in gone:
            region_id, path = mapped.handle.region_id, self._path(mapped.handle)
            log.info("region %d: its file %s is gone; unmapped", region_id, path)
        return [mapped.handle.region_id for mapped in gone]

    def unmap(self, region_id: int) -> None:
        with self._lock:
            self._unmap_locked(region_id)

    def _unmap_locked(self, region_id: int) -> None:
        mapped = self._regions.pop(region_id, None)
        if mapped is None:
            return
        self._update_rows()
        if mapped.writable:  # (no longer ours, or closing: the server may hand it out)
            self._fence(mapped)
        self._retired.append((time.monotonic(), mapped))  # closed later (see the module)
        self._close_retired_locked()

    def _fence(self, mapped: MappedRegion) -> None:
        """Make writes through `mapped` (kept views, addresses) land in private memory, never
        in the pool: its file range mapped over it again, MAP_PRIVATE, so that reads (a copy
        in flight, a leased view of our key) still see the pool's bytes. Only where its path
        still names the mapped file: a pool file made anew, or an fsdax region file unlinked,
        holds nobody's pages now. A devdax device cannot be mapped private: left shared
        (docs/reliability.md, "Stale writers on a device"). In software coherence the lines
        we dirtied are written back first (`_write_back`), devdax too."""
        _write_back(mapped)
        try:
            fd = os.open(self._path(mapped.handle), os.O_RDONLY)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != mapped.file:
                return
            code = _map_private(mapped.address, mapped.handle.length, fd, mapped.handle.offset)
        finally:
            os.close(fd)
        if code:  # (the kernel may have unmapped the range: a late write faults, never lands)
            log.error(
                "region %d: cannot fence its mapping (%s): a write through a view kept from "
                "before may fault",
                mapped.handle.region_id,
                os.strerror(code),
            )
            return
        mapped.fenced = True

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
        """Unmap every region and close them once the copies in flight have ended: waits up to
        `close_wait_s`, then leaves them (logged) for the last copy to close."""
        with self._lock:
            self._closing = True
            for region_id in list(self._regions):
                self._unmap_locked(region_id)
            if not self._wait_copies_locked(self.close_wait_s):
                log.warning(
                    "closing with %d copies still in flight after %.1f s: their %d regions "
                    "are closed when the last of them ends",
                    self._gate.active,
                    self.close_wait_s,
                    len(self._retired),
                )
                return
            retired, self._retired = self._retired, []
        for _, mapped in retired:
            self._close(mapped)


def _write_back(mapped: MappedRegion) -> None:
    """In software coherence, write back every line of `mapped`'s pages mapped in this process
    before it stops being ours. Caches are tagged by physical address: the fence's remap
    leaves dirty lines of the pool in this host's cache (values written in place through
    `alloc`, neither sealed nor freed: a close, a region the server forgot, a reap after a
    cut), and a later eviction would land them on what the region's next owner, on another
    host, wrote and sealed there. Only pages mapped here can hold our stores (others' pages
    are not faulted in: a tmpfs hole would be allocated); /proc/self/pagemap unreadable: all
    of it. A flush that faults (the pool's file truncated) leaves nothing of ours to lose."""
    if process_mode() != SOFTWARE:
        return
    ranges = _mapped_here(mapped.address, mapped.handle.length)
    if ranges is None:
        ranges = np.array([[mapped.address, mapped.handle.length]], np.int64)
    with contextlib.suppress(CopyFaultError):
        _flush_ranges(np.ascontiguousarray(ranges[:, 0]), np.ascontiguousarray(ranges[:, 1]), False)


def _mapped_here(address: int, length: int) -> np.ndarray | None:
    """The (address, length) runs of whole pages of [address, address + length) mapped in
    this process now (/proc/self/pagemap's present bit), or None if it cannot be read."""
    page = mmap.PAGESIZE
    first, pages = address // page, -(-(address + length) // page) - address // page
    runs: list[np.ndarray] = []
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            for at in range(0, pages, _PAGEMAP_STEP):
                n = min(_PAGEMAP_STEP, pages - at)
                raw = os.pread(f.fileno(), n * 8, (first + at) * 8)
                if len(raw) != n * 8:
                    return None
                present = (np.frombuffer(raw, "<u8") >> np.uint64(63)).astype(np.int8)
                edges = np.flatnonzero(np.diff(np.concatenate(([0], present, [0]))))
                runs.append((edges.reshape(-1, 2) + first + at) * page)
    except OSError:
        return None
    if not runs:
        return np.zeros((0, 2), np.int64)
    starts_ends = np.concatenate(runs).astype(np.int64)
    starts_ends[:, 1] -= starts_ends[:, 0]
    return starts_ends


def _map_private(address: int, length: int, fd: int, offset: int) -> int:
    """Map `length` bytes of `fd` at `offset` over [address, address + length), private and
    writable (MAP_FIXED: one step, never unmapped between); 0, or the errno. NORESERVE: a
    page takes memory only once written."""
    flags = mmap.MAP_PRIVATE | _MAP_FIXED | _MAP_NORESERVE
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _libc.mmap(address, length, prot, flags, fd, offset)
    if got == _MAP_FAILED or got != address:
        return ctypes.get_errno() or errno.ENOMEM
    return 0


def _within(start: int, end: int, extents: tuple[tuple[int, int], ...]) -> bool:
    """Whether [start, end) lies inside one of `extents`."""
    return any(s <= start and end <= e for s, e in extents)
