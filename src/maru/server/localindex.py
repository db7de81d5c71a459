"""The server's side of the local index: its key index in shared memory, for clients to find
keys without a request (docs/architecture.md, "The local index", "The in-pool index").

The registry calls `publish` after a change is journaled, and `remove` *before* the keys' pages
can be reused (before their owner is told they are free or their region is freed): what a
reader validates is then the key's bytes. A table that cannot be made (no room on /dev/shm, or
not beside what the pool may still allocate there) turns the index off: clients use requests.
The in-pool table (`--index-slots`, `_PoolTable`) has a fixed capacity: a key that finds no
room is not published and makes it `incomplete`, so readers ask the server for their misses.

Every write to a table runs under the fault guard (`shmindex.IndexFaultError`): with
`--pool-group` a member of the group may truncate the `.use` file (0660) or the pool file (the
in-pool table's home) under the server, and a store there would kill it with SIGBUS. A fault
turns the index off for this server life (`LocalIndex._fault`): the table is retired before the
call returns, so that the keys a faulted `remove` left in it are never proven to a reader once
the registry lets their pages be reused; the registry goes on, clients use requests.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from maru.common import _shmindex, hugepages, shmindex
from maru.common.config import fmt_bytes
from maru.common.shmindex import (
    HASH_BYTES,
    HEADER_BYTES,
    SLOT_BYTES,
    USE_SUFFIX,
    IndexFaultError,
    area_bytes,
    area_views,
    index_base,
    map_area,
    region_tag,
    table_bytes,
    table_files,
)
from maru.server.pool import INDEX_SLOTS_MAX

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 1 << 16  # slots (12.5 MiB): small deployments pay little; grows by doubling
_HEADER_LINES = 128  # the header's bytes `_current_table` reads: its first two cache lines


class _PoolTable:
    """The table inside the pool (`Pool.index_area`), mapped read-write through the pool's path
    and formatted at every start with a new index id: no reader of an earlier one proves a copy."""

    path = None  # (no file of its own: `offer` names its place)

    def __init__(self, pool: Any, generation: str, software: bool):
        self.place, self.offset, self.length, slots = pool.index_area  # (under the pool's path)
        self.capacity = slots
        self.file = os.path.join(pool.path, self.place) if self.place else pool.path
        self.map = map_area(self.file, self.offset, self.length)
        table, use = area_views(self.map, slots)
        try:
            self.index_id = secrets.randbits(64)
            # (the use bytes zeroed there too: pool memory, written under the fault guard)
            gen = generation.encode()
            shmindex.format_table(table, slots, gen, self.index_id, software, use)
            self.writer = shmindex.Writer(table, use, software)
        except BaseException:
            table.release()
            use.release()
            self.map.close()
            raise

    def offer(self) -> dict[str, Any]:
        """The HANDSHAKE reply's `pool_index`: where the table lies in the pool (the client
        maps it through the path it proved the pool's mark at) and which table it is."""
        return {
            "file": self.place,
            "offset": self.offset,
            "length": self.length,
            "slots": self.capacity,
            "id": self.index_id,
        }

    def retire(self, successor: str = "") -> bool:
        """Readers' copies that end after this are not proven (the area stays the pool's).
        False if the header faulted: the pool file was cut there, so readers fault too."""
        retired = _retire_writer(self.writer, successor)
        self.map.close()
        return retired

    def truncation(self) -> str | None:
        """What a fault of this table's memory came from, if the pool file was cut short."""
        with contextlib.suppress(OSError):
            size = os.stat(self.file).st_size
            if size < self.offset + self.length:
                return (
                    f"the pool file {self.file}, where the in-pool index lies (offset "
                    f"{self.offset}, {self.length} bytes), was truncated under the server to "
                    f"{size} bytes"
                )
        return None


def _retire_writer(writer: Any, successor: str) -> bool:
    """Retire and close `writer`; False if its header faulted (its file cut short)."""
    try:
        writer.retire(successor)
    except IndexFaultError:
        return False
    finally:
        writer.close()
    return True


def _retire(table: Any, use: Any, software: bool = False) -> None:
    writer = shmindex.Writer(table, use, software)
    writer.retire("")
    writer.close()


_MAGIC = b"MARUIDX1"
_RETIRED_AT = 48  # the header's `retired` word (the layout comment in _shmindex.c)


def _retire_header(table: Any) -> bool:
    """Retire a table no Writer of this build opens (another layout version: a server
    upgraded while readers of the old one run; a header it does not take): its header's
    `retired` word set, where the magic says it is a Maru index (magic, version and `retired`
    have kept their places), and written back to memory. A reader still mapping it then
    proves no copy from it; left current, its hits would stay proven while this server reuses
    their pages. False if it is not an index (nothing written)."""
    with memoryview(table) as whole:
        if len(whole) < HEADER_BYTES or bytes(whole[:8]) != _MAGIC:
            return False
        whole[_RETIRED_AT : _RETIRED_AT + 8] = (1).to_bytes(8, "little")
        with whole[:_HEADER_LINES] as lines:
            _shmindex.flush_lines(lines)
    return True


def _earlier_places(pool: Any) -> list[tuple[int, int, int, bool]]:
    """Where an earlier start's in-pool table may lie, whatever this start's `--index-slots`
    (`Pool.index_area`): (offset, bytes there, the unit it is mapped in, whether its area
    must be exactly those bytes) in the pool's file or device. A shm pool's area starts at
    the page after the mark's, whatever its slots; a devdax pool's ends at the mark's unit
    and takes as many units before it as its slots needed: one place per unit count. A
    directory (fsdax) pool has none."""
    kind, mark = getattr(pool, "kind", ""), getattr(pool, "mark_offset", None)
    if mark is None:
        return []
    if kind == "shm":
        start = mark + pool.mark_span
        try:
            rest = os.stat(pool.path).st_size - start
        except OSError:
            return []
        page = mmap.ALLOCATIONGRANULARITY
        return [(start, rest, page, False)] if rest >= page else []
    if kind == "devdax":  # (a device maps in units of its alignment)
        unit = pool.alignment
        counts = (1 << k for k in range(3, INDEX_SLOTS_MAX.bit_length()))  # 8 slots and up
        sizes = {-(-area_bytes(slots) // unit) * unit for slots in counts}
        return [(mark - size, size, unit, True) for size in sorted(sizes) if size <= mark]
    return []


def _current_table(path: str, place: tuple[int, int, int, bool], generation: int | None) -> int:
    """The slots of the table whose header is at `place` (`_earlier_places`) of `path` if it
    is a current one (not retired) whose area is there, of the pool generation `generation`
    hashes unless None; else 0. `shmindex.Writer` checks the rest of the header."""
    offset, length, unit, exact = place
    try:
        header = map_area(path, offset, unit)
    except (OSError, ValueError):
        return 0
    try:
        # From memory, not this host's cache: a host of the pod whose readers loaded these
        # lines before (software coherence) may hold them stale (`retired` of an older table
        # there, another generation), which would leave a current table current.
        with memoryview(header) as whole, whole[:_HEADER_LINES] as lines:
            _shmindex.flush_lines(lines, True)
        magic = header[:8]  # (offsets of `Header` in _shmindex.c: capacity, generation, retired)
        slots, gen, retired = (int.from_bytes(header[at : at + 8], "little") for at in (16, 40, 48))
    finally:
        header.close()
    ok = (
        magic == b"MARUIDX1"
        and 0 < slots <= INDEX_SLOTS_MAX
        and slots & (slots - 1) == 0
        and (-(-area_bytes(slots) // unit) * unit == length or not exact)
        and area_bytes(slots) <= length
        and not retired
        and generation in (None, gen)
    )
    return slots if ok else 0


def retire_in_pool(pool: Any) -> int:
    """`retire_earlier` for the in-pool table: retire the table an earlier start left in the
    pool, whatever this start's flags (one without `--index-slots`, or with another count,
    formats none over it: its readers would go on proving copies from it until their next
    HANDSHAKE). Call it with the pool locked, before the pool can change. The retire is
    written back to memory where the CPU can (another host may read the table). Returns how
    many it retired.

    Where a devdax pool's area could lie may now be region memory (this start has fewer
    slots): a table there is retired only if current and of the generation in the pool's
    mark. That is the one a reader may still hold (each start retires it before it writes its
    own mark), and the state of that generation never had a region there (its regions lay
    before its table): no restored bytes are written."""
    places = _earlier_places(pool)
    generation = None
    if places and pool.kind == "devdax":
        mark = pool.read_mark()
        generation = shmindex.hash_generation(mark[0].encode()) if mark else None
    count = 0
    for place in places:
        slots = _current_table(pool.path, place, generation)
        if not slots:
            continue
        offset, _, unit, _ = place
        try:
            area = map_area(pool.path, offset, -(-area_bytes(slots) // unit) * unit)
        except (OSError, ValueError):
            continue
        table, use = area_views(area, slots)
        try:
            try:
                _retire(table, use, software=True)
            except ValueError:  # (no cache-line flushes here: a plain store)
                try:
                    _retire(table, use)
                except ValueError as exc:  # (another layout: its header alone)
                    if not _retire_header(table):
                        raise
                    log.warning("in-pool index at offset %d of %s: %s", offset, pool.path, exc)
            count += 1
            log.info("retired the in-pool index (%d slots) of an earlier server", slots)
        except (ValueError, IndexFaultError) as exc:  # (the file cut there)
            log.warning("in-pool index at offset %d of %s left as is (%s)", offset, pool.path, exc)
        finally:
            table.release()
            use.release()
            area.close()
    return count


class _Table:
    """One table file and its use-bits file, mapped read-write."""

    def __init__(self, path: str, capacity: int, generation: str, group: str | None):
        self.path, self.capacity = path, capacity
        self.files: list[str] = []
        self.maps: list[mmap.mmap] = []
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
            for file, size, mode in (
                (path, table_bytes(capacity), 0o640 if group else 0o600),
                (path + USE_SUFFIX, capacity, 0o660 if group else 0o600),
            ):
                fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.files.append(file)
                try:
                    if group:
                        os.fchown(fd, -1, gid)
                    os.fchmod(fd, mode)
                    self.maps.append(hugepages.map_allocated(fd, size))
                finally:
                    os.close(fd)
            shmindex.format_table(self.maps[0], capacity, generation.encode(), secrets.randbits(64))
            self.writer = shmindex.Writer(self.maps[0], self.maps[1])
        except BaseException:
            _remove(self.files)
            raise

    def retire(self, successor: str = "") -> bool:
        """Readers' copies that end after this are not proven; the files go (a reader keeps
        its mapping). False if the header faulted (the table file cut short: only this
        user may), which readers then meet too."""
        retired = _retire_writer(self.writer, successor)
        _remove(self.files)
        for m in self.maps:
            m.close()
        return retired

    def truncation(self) -> str | None:
        """What a fault of this table's memory came from, if one of its files was cut short
        (the `.use` file is 0660 with `--pool-group`: any member of the group may)."""
        for file, size, what in (
            (self.path + USE_SUFFIX, self.capacity, "use file"),
            (self.path, table_bytes(self.capacity), "table"),
        ):
            with contextlib.suppress(OSError):
                now = os.stat(file).st_size
                if now < size:
                    return (
                        f"the local index's {what} {file} was truncated under the server "
                        f"({now} bytes, {size} expected)"
                    )
        return None


def _remove(files: list[str]) -> None:
    for file in files:
        with contextlib.suppress(OSError):  # (gone, or another user's)
            os.unlink(file)


def _use_bits_of(path: str, table: mmap.mmap) -> Any:
    """The use bits to open the table at `path` with for its retire, which writes its header
    alone: its `.use` file, or zeros where that is gone or shorter than the table's capacity
    (0660 with `--pool-group`: a member may truncate it), so that the table is retired all
    the same."""
    capacity = max(0, len(table) - HEADER_BYTES) // (SLOT_BYTES + HASH_BYTES)  # (`table_bytes`)
    with contextlib.suppress(OSError, ValueError), open(path + USE_SUFFIX, "r+b") as u:
        use = mmap.mmap(u.fileno(), 0)
        if len(use) >= capacity:
            return use
        use.close()
    return bytearray(capacity)


def retire_earlier(pool_kind: str, pool_path: str) -> int:
    """Retire and remove every table of the pool's index left by an earlier server (killed,
    or stopped before it could): readers that still map one take their copies as misses from
    now on. Call it with the pool locked, before the pool can change. Returns how many."""
    count = 0
    for _, path in table_files(index_base(pool_kind, pool_path)):
        try:
            with open(path, "r+b") as f:
                table = mmap.mmap(f.fileno(), 0)
            try:
                use = _use_bits_of(path, table)
                try:
                    _retire(table, use)
                except ValueError as exc:  # (another layout: its header alone, if an index)
                    if not _retire_header(table):
                        raise
                    log.warning("earlier local index %s: %s: its header retired", path, exc)
                finally:
                    if isinstance(use, mmap.mmap):
                        use.close()
            finally:
                table.close()
        except (OSError, ValueError) as exc:  # not a table of ours, or damaged: just remove it
            log.warning("earlier local index %s could not be retired (%s): removing it", path, exc)
        _remove([path, path + USE_SUFFIX])
        count += 1
    if count:
        log.info("retired %d local index table(s) of an earlier server", count)
    return count


def remove_tables(pool_kind: str, pool_path: str) -> int:
    """Remove the pool's index files (`maru-server --purge`). Returns how many tables."""
    tables = table_files(index_base(pool_kind, pool_path))
    for _, path in tables:
        _remove([path, path + USE_SUFFIX])
    return len(tables)


class LocalIndex:
    """The published index of one server. `path` is what the HANDSHAKE reply names to clients
    on the local socket (None once the index is off)."""

    def __init__(
        self,
        pool_kind: str,
        pool_path: str,
        generation: str,
        group: str | None = None,
        pool_unallocated: Callable[[str], int] | None = None,
        in_pool: Any = None,
        software: bool = False,
    ):
        """`in_pool`: the pool, whose `index_area` holds the table (else /dev/shm files);
        `software`: software coherence (`--coherence software`)."""
        self.base = index_base(pool_kind, pool_path)
        # bytes the pool may still allocate on a directory's filesystem (`Pool.unallocated_on`)
        self._pool_unallocated = pool_unallocated or (lambda directory: 0)
        self.generation = generation
        self.group = group
        self.grown = 0  # tables replaced by bigger ones
        self.huge = hugepages.tmpfs_huge_option(self.base)  # its tmpfs's huge= option
        self.unpublished = 0  # keys an in-pool table had no room for
        self.next_region = 0  # the id the server's next region gets (`note_regions`)
        self.table: _Table | _PoolTable | None = (
            _PoolTable(in_pool, generation, software)
            if in_pool is not None
            else self._new_table(INITIAL_CAPACITY)
        )

    @property
    def path(self) -> str | None:
        """The /dev/shm table's file, which the HANDSHAKE reply names on the Unix socket."""
        return self.table.path if self.table is not None else None

    def offer(self) -> dict[str, Any] | None:
        """`_PoolTable.offer`, for every HANDSHAKE reply; None if the table is not in the pool."""
        table = self.table
        return table.offer() if isinstance(table, _PoolTable) else None

    @property
    def count(self) -> int:
        return self.table.writer.count if self.table is not None else 0

    def stats(self) -> dict[str, Any]:
        """For the server's STATS (`maru status`): where the table is, how full, which pages."""
        table = self.table
        in_pool = isinstance(table, _PoolTable)
        return {
            "path": f"{table.file} at offset {table.offset}" if in_pool else self.path,
            "in_pool": in_pool,
            "keys": self.count,
            "slots": table.capacity if table is not None else 0,
            "unpublished": self.unpublished,
            "grown": self.grown,
            "huge": self.huge,
        }

    def _check_room(self, capacity: int) -> None:
        """Raise ENOSPC unless a table of `capacity` slots (its two files, each rounded up to
        2 MiB pages) fits beside what the pool may still allocate on the same filesystem."""
        directory = os.path.dirname(self.base) or "."
        huge = 2 << 20
        need = sum(-(-size // huge) * huge for size in (table_bytes(capacity), capacity))
        pool = self._pool_unallocated(directory)
        vfs = os.statvfs(directory)
        free = vfs.f_bavail * vfs.f_frsize
        if need + pool > free:
            raise OSError(
                errno.ENOSPC,
                f"a table of {capacity} slots needs {fmt_bytes(need)} on {directory} beside "
                f"the {fmt_bytes(pool)} the pool may still allocate there, and "
                f"{fmt_bytes(free)} are free",
            )

    def _new_table(self, capacity: int) -> _Table:
        self._check_room(capacity)
        # Names only grow, across restarts too (the earlier server's tables are gone by now):
        # a reader that looks for the current table takes the newest.
        tables = table_files(self.base)
        n = max(tables[-1][0] + 1 if tables else 0, time.time_ns() // 1000)
        while True:  # a name someone else took meanwhile: the next one
            try:
                return _Table(f"{self.base}.{n}", capacity, self.generation, self.group)
            except FileExistsError:
                n += 1

    def _room_for(self, more: int) -> bool:
        """Grow when `more` keys would pass half the capacity; False if the index is off."""
        table = self.table
        if table is None:
            return False
        if isinstance(table, _PoolTable):
            return True  # (a fixed capacity: `publish` leaves out what finds no room)
        need = table.writer.count + more
        if need <= table.capacity // 2:
            return True
        capacity = table.capacity * 2
        while need > capacity // 2:
            capacity *= 2
        try:
            bigger = self._new_table(capacity)
        except OSError as exc:
            log.error(
                "cannot grow the local index to %d slots (%s): it is off; clients on this "
                "node use the request path",
                capacity,
                exc,
            )
            self.close()
            return False
        try:
            table.writer.copy_into(bigger.writer)
            bigger.writer.note_regions(self.next_region)
        except IndexFaultError as exc:
            self._fault(exc, "growing it", bigger)
            return False
        self.table = bigger
        table.retire(bigger.path)
        self.grown += 1
        log.info("local index grown to %d slots (%s)", capacity, bigger.path)
        return True

    def publish(
        self,
        keys: list[Any],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int] | None = None,
        *,
        regions: Mapping[int, Any],
    ) -> None:
        """Keys just registered (and journaled), in `regions` (id -> Region: their tokens give
        the tags). Keys longer than the table holds are left out: clients ask the server."""
        if not keys or not self._room_for(len(keys)):
            return
        assert self.table is not None
        room = self.table.capacity // 2 - self.table.writer.count
        if len(keys) > room:  # (an in-pool table: the rest are the server's alone)
            self._no_room(keys[room:])
            keys, region_ids, offsets, lengths = (
                column[:room] for column in (keys, region_ids, offsets, lengths)
            )
            checksums = checksums[:room] if checksums is not None else None
        tags = {r: region_tag(regions[r].token) for r in set(region_ids)}
        try:
            self.table.writer.publish(keys, region_ids, offsets, lengths, checksums, tags)
        except IndexFaultError as exc:
            self._fault(exc, "a publish")

    def note_regions(self, next_id: int) -> None:
        """A region was made (or the registry was restored): `next_id` is the id the next one
        gets. Readers on the node that map every region map the new ones when they see it."""
        self.next_region = next_id
        if self.table is not None:
            try:
                self.table.writer.note_regions(next_id)
            except IndexFaultError as exc:
                self._fault(exc, "noting a new region")

    def _no_room(self, keys: list[Any]) -> None:
        """Keys the in-pool table has no room for: an earlier slot of theirs goes (it names
        the location they replace), and readers ask the server for misses from now on."""
        assert self.table is not None
        try:
            self.table.writer.remove(keys)
            if not self.unpublished:
                self.table.writer.mark_incomplete()
        except IndexFaultError as exc:
            self._fault(exc, "a publish (keys without room)")
            return
        if not self.unpublished:
            log.warning(
                "the in-pool index is full (%d slots, at most half used): keys beyond it are "
                "read through requests, and readers ask the server for every miss; start "
                "with a larger --index-slots",
                self.table.capacity,
            )
        self.unpublished += len(keys)

    def remove(self, keys: list[Any]) -> None:
        """Keys that go (journaled): their slots change before their pages can be reused. If
        the table faults, it is retired before this returns (`_fault`): a slot the remove
        could not change is then proven to no reader."""
        if self.table is not None and keys:
            try:
                self.table.writer.remove(keys)
            except IndexFaultError as exc:
                self._fault(exc, "a remove")

    def harvest_into(self, key_index: Any) -> int:
        """Set the CLOCK bit of the keys readers marked used since the last harvest, clearing
        the marks; returns how many."""
        if self.table is None:
            return 0
        try:
            used = self.table.writer.harvest()
        except IndexFaultError as exc:
            self._fault(exc, "a harvest of the use marks")
            return 0
        for entry in key_index.get_many(used):
            if entry is not None:
                entry.referenced = True
        return len(used)

    def _fault(self, exc: OSError, doing: str, *others: _Table | _PoolTable) -> None:
        """A table's memory faulted under `doing` (a file cut short under the server): the
        index is off for this server life. The table (and `others`: a bigger one being
        filled) is retired first, under the guard: from then on no reader proves a copy from
        it, so the caller may let the keys' pages be reused once this returns. Where even
        the header is gone the retire faults too, and readers fault on it the same way (or,
        the file grown back, read another index id): never a proven copy either."""
        table, self.table = self.table, None
        tables = [t for t in (table, *others) if t is not None]
        reason = next((r for t in tables if (r := t.truncation()) is not None), None)
        retired = [t.retire("") for t in tables]
        log.error(
            "%s during %s: the index is off, clients use requests (%s)%s",
            reason or f"the local index {tables[0].path or tables[0].file} faulted",
            doing,
            exc.strerror or exc,
            "" if all(retired) else "; its header is gone too: readers fault on it and miss",
        )

    def close(self) -> None:
        """Retire the table (the server stops, or the index is off)."""
        table, self.table = self.table, None
        if table is not None and not table.retire(""):
            log.error(
                "%s: the local index could not be retired at the stop; its header is gone, "
                "so readers fault on it and miss",
                table.truncation() or "its memory faulted",
            )


def open_local_index(
    pool: Any,
    registry: Any,
    group: str | None = None,
    enabled: bool = True,
    software: bool = False,
) -> LocalIndex | None:
    """The server's index, filled from the restored registry and attached to it: in the pool
    where it has an index area (`--index-slots`), else in /dev/shm; None when off
    (`--no-local-index`, or no room on /dev/shm). `software`: `--coherence software`."""
    if not enabled:
        return None
    try:
        index = LocalIndex(
            pool.kind,
            pool.path,
            pool.generation,
            group,
            pool_unallocated=pool.unallocated_on,
            in_pool=pool if pool.index_area is not None else None,
            software=software,
        )
    except OSError as exc:
        log.error("no local index (%s): clients on this node use the request path", exc)
        return None
    entries = list(registry.keys.values())
    names = ("region_id", "offset", "length", "checksum")  # `publish`'s columns
    columns = ([getattr(e, name) for e in entries] for name in names)
    index.publish(list(registry.keys), *columns, regions=registry.regions)
    registry.local_index = index
    index.note_regions(registry.regions.next_id)
    registry.regions.on_allocated = index.note_regions
    if index.table is not None:  # (else a fault turned it off: logged)
        pages = hugepages.describe(index.huge)
        log.info("local index %s (%d keys; %s)", index.stats()["path"], index.count, pages)
    return index
