"""A client's side of the local index: keys found in the table its server publishes in shared
memory, without a request (docs/architecture.md "The local index").

The /dev/shm table is offered only on the Unix socket. The in-pool table (`--index-slots`) is
offered over TCP too: mapped through the path the client proved the pool's mark at, read with
this process's coherence, never replaced (once retired, requests serve until the next
HANDSHAKE offers the new one).

A copying read takes the locations from the table, no lease: after the copy every hit's slot
must still have the seq it was read with, in a table still current, or the key is a miss,
whatever was copied. The server changes a key's slot before its pages can be reused, so an
unchanged slot proves the copy read the key's bytes. Requests serve the rest: a key longer
than the table holds, a region not mapped here or of another pool life, no current table.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from maru.client.coherence import software
from maru.client.requests import Lookup, checksum_mismatches, other_lengths
from maru.common import _keys, shmindex
from maru.common.errors import MaruError
from maru.common.memcopy import COPY_VALUES
from maru.common.protocol import MsgType
from maru.common.shmindex import (
    NCOLS,
    USE_SUFFIX,
    area_bytes,
    area_views,
    base_of,
    map_area,
    owned_by,
    table_files,
)

if TYPE_CHECKING:
    from maru.client.poolpath import PoolPlace
    from maru.client.session import Session

log = logging.getLogger(__name__)

Key = str | bytes
Prefix = Key | Sequence[Key]  # before every key, or one per key ("": none)
FIND_EVERY_S = 0.5  # with no current table, look for one at most this often
# Mapped in whole at once: a probe of a page not yet mapped in this process costs a page
# fault, which at 10^6 keys would be most probes of a new reader.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _open(path: str, uid: int | None) -> Any | None:
    """A `Reader` of the table at `path` if the server's user owns it (and it alone may write
    it) and it is not retired; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if not owned_by(fd, uid):
                log.warning("local index %s is not the server's (uid %s): not used", path, uid)
                return None
            table = mmap.mmap(fd, 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        fd = os.open(path + USE_SUFFIX, os.O_RDWR)
        try:
            if not owned_by(fd, uid, shared_write=True):
                return None
            use = mmap.mmap(fd, 0, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        reader = shmindex.Reader(table, use)  # (holds both mappings)
    except (OSError, ValueError) as exc:
        log.debug("local index %s not usable: %s", path, exc)
        return None
    return None if reader.retired else reader


def _open_in_pool(place: PoolPlace, offer: dict[str, Any]) -> Any | None:
    """A `Reader` of the in-pool table a HANDSHAKE reply offers (`offer`: its `pool_index`),
    mapped through this host's proven `place` of the pool; None if it is not that table."""
    file, offset, slots = offer.get("file", ""), offer.get("offset"), offer.get("slots")
    if not isinstance(file, str) or type(offset) is not int or type(slots) is not int:
        log.warning("the server offers an in-pool index of no place (%r): not used", offer)
        return None
    path = os.path.join(place.local, file) if file else place.local
    try:
        area = map_area(path, offset, area_bytes(slots), populate=True)
    except (OSError, ValueError) as exc:
        log.warning("the in-pool index at %s offset %s cannot be mapped: %s", path, offset, exc)
        return None
    table, use = area_views(area, slots)
    try:
        reader = shmindex.Reader(table, use, software())  # (holds the views and the mapping)
    except ValueError as exc:
        log.warning("the in-pool index at %s offset %s is not usable: %s", path, offset, exc)
        table.release()
        use.release()
        area.close()
        return None
    if reader.retired or reader.index_id != offer.get("id"):
        return None  # (the server formatted another since its reply)
    return reader


def offered_index(
    session: Session,
    local_address: str | None,
    current: LocalIndexClient | None,
    reply: dict[str, Any],
    body: dict[str, Any],
) -> LocalIndexClient | None:
    """The index a HANDSHAKE reply names, if `maru_local_index` is on (`current`, if the same).
    The /dev/shm table is named only on the Unix socket: a reply that came over TCP is asked
    again there when the handler has it (`local_address`)."""
    if not session.config.local_index:
        return None
    offer, place = reply.get("pool_index"), session.mapper.place
    if isinstance(offer, dict) and place is not None:
        return LocalIndexClient.in_pool(place, offer, current)
    path = reply.get("local_index")
    if path is None and local_address is not None:
        try:
            path = session.request(MsgType.HANDSHAKE, dict(body)).result().get("local_index")
        except MaruError as exc:
            log.debug("no local index: %s", exc)
            return None
    if isinstance(path, str) and place is not None:
        path = place.local_index_path(path)
    return LocalIndexClient.open(path, reply.get("uid"), current)


def joined(keys: Sequence[Key], prefix: Prefix) -> Sequence[Key]:
    """`prefix + key` per key: what the request path sends, and the keys' names in logs (the
    index reads the two parts where they lie; both raise TypeError on a prefix of another type)."""
    if isinstance(prefix, (str, bytes)):
        if not prefix:
            return keys
        fast = _keys.join(prefix, keys)  # (None: a key of another type, which raises here)
        return fast if fast is not None else [prefix + k for k in keys]  # type: ignore[operator]
    if len(prefix) != len(keys):
        raise ValueError(f"prefix: {len(prefix)} prefixes for {len(keys)} keys")
    return [p + k for p, k in zip(prefix, keys)]  # type: ignore[operator]


class LocalIndexClient:
    """The table a handler reads, and the way to the current one when it is replaced."""

    def __init__(self, path: str | None, server_uid: int | None, reader: Any):
        """`path`: the /dev/shm table's (None: the in-pool table, which has no successor)."""
        self.path, self.uid = path, server_uid
        self.base = base_of(path) if path is not None else None
        self._reader = reader
        self._next_find = 0.0
        # Since the last `take_reads`: [lookups, hits, exists, exists hits]; in all: `stale`,
        # hits found changed after the copy, and `fallbacks`, batches sent to the server.
        self.reads = [0, 0, 0, 0]
        self.stale = self.fallbacks = 0

    @classmethod
    def open(cls, path: Any, server_uid: Any, current: LocalIndexClient | None = None):
        """The index the HANDSHAKE reply named (`current` if it is that one), or None."""
        if not isinstance(path, str) or not isinstance(server_uid, int):
            return None
        same = current is not None and (current.path, current.uid) == (path, server_uid)
        if same and current._reader is not None and not current._reader.retired:
            return current
        reader = _open(path, server_uid)
        if reader is None:
            return None
        log.debug("local index %s (%d keys)", path, reader.count)
        return cls(path, server_uid, reader)

    @classmethod
    def in_pool(
        cls, place: PoolPlace, offer: dict[str, Any], current: LocalIndexClient | None = None
    ) -> LocalIndexClient | None:
        """The in-pool table a HANDSHAKE reply offers (`current` if it is that one), or None."""
        reader = current._reader if current is not None else None
        if reader is not None and reader.index_id == offer.get("id") and not reader.retired:
            return current
        reader = _open_in_pool(place, offer)
        if reader is None:
            return None
        log.debug("in-pool index at %s (%d keys)", place.local, reader.count)
        return cls(None, None, reader)

    def reader(self) -> Any | None:
        """The current table: this one, its successor, or the newest table of the server's
        pool (looked for at most every FIND_EVERY_S); None if there is none."""
        reader = self._reader
        if reader is not None and not reader.retired:
            return reader
        successor = reader.successor if reader is not None else ""
        found = _open(successor, self.uid) if successor else None
        if found is None and self.base and time.monotonic() >= self._next_find:
            self._next_find = time.monotonic() + FIND_EVERY_S
            for _, path in reversed(table_files(self.base)):
                found = _open(path, self.uid)
                if found is not None:
                    successor = path
                    break
        if found is not None:
            self.path, self._reader = successor, found
        elif reader is not None:
            self._reader = None
        return found

    def regions_made(self) -> int:
        """The id the server's next region gets, as its table says (0: not said: an older
        server, or no table now). A region id above what we have seen: one was made."""
        reader = self.reader()
        return reader.regions if reader is not None else 0

    def exists(self, keys: Sequence[Key], prefix: Prefix = "") -> list[bool] | None:
        """Whether each key (`prefix + key`, see `MaruHandler.lookup`) is registered (a hit
        marks it used, as an EXISTS request does); None: ask the server."""
        reader = self.reader()
        found = reader.contains(keys, prefix=prefix) if reader is not None else None
        if found is None:
            self.fallbacks += 1
        else:
            self.reads[2] += len(found)
            self.reads[3] += found.count(True)
        return found

    def leading(self, keys: Sequence[Key], prefix: Prefix = "") -> int | None:
        """How many of `keys` from the start are registered (probed up to the first miss; the
        hits mark use); None: ask the server."""
        reader = self.reader()
        counted = reader.leading(keys, prefix=prefix) if reader is not None else None
        if counted is None:
            self.fallbacks += 1
        else:
            self.reads[2] += min(counted + 1, len(keys))
            self.reads[3] += counted
        return counted

    def take_reads(self) -> list[int] | None:
        """The reads answered here since the last call, [lookups, hits, exists, exists hits],
        for the server's statistics (sent with the heartbeat); None if there were none."""
        reads, self.reads = self.reads, [0, 0, 0, 0]
        reads[1] = min(max(reads[1], 0), reads[0])  # (a hit found stale after a report)
        return reads if reads[0] or reads[2] else None

    def lookup(
        self, session: Session, keys: Sequence[Key], prefix: Prefix = ""
    ) -> IndexLookup | None:
        """An `IndexLookup` of `keys` (each `prefix + key`); None when the server must be asked.
        A location outside its region (`RegionMapper.rows`) is a miss."""
        reader = self.reader()
        raw = reader.probe(keys, session.mapper.rows, prefix=prefix) if reader else None
        if raw is None:
            self.fallbacks += 1
            return None
        columns = np.frombuffer(raw, np.int64).reshape(NCOLS, len(keys))
        found = IndexLookup(session, keys, self, reader, columns)
        self.reads[0] += found.n
        self.reads[1] += int(np.count_nonzero(found.lengths))
        return found

    def read(
        self,
        session: Session,
        keys: Sequence[Key],
        prefix: Prefix,
        buffers: np.ndarray,
        sizes: np.ndarray,
        length: int,
        hashed: bool,
    ) -> list[bool] | None:
        """`MaruHandler.read` on the index: probe, copy and check in one C call, so that no
        Python runs between them; per key True where its value was copied and proven. None
        when the server must be asked (nothing was copied)."""
        reader = self.reader()
        out = None
        if reader is not None:
            rows = session.mapper.rows
            threads = session.config.copy_threads
            out = reader.read(
                keys, rows, buffers, sizes, length, COPY_VALUES, hashed, threads, prefix=prefix
            )
        if out is None:
            return None  # (`lookup` counts the fallback)
        proven, raw = out
        hits = proven.count(True)
        self.reads[0] += len(keys)
        self.reads[1] += hits
        if hits < len(keys):  # misses, or (rarely) hits that are not proven: say why
            self._not_proven(session, keys, prefix, raw, length)
        return proven

    def _not_proven(self, session: Session, keys, prefix, raw: bytes, length: int) -> None:
        """After `Reader.read`: count and log its hits that are not proven (statuses 2-5)."""
        columns = np.frombuffer(raw, np.int64).reshape(NCOLS + 2, len(keys))
        _, lengths, sums, region_ids, offsets = columns[:5]  # (`IndexLookup`'s columns)
        status = columns[NCOLS + 1]
        lost = int(np.count_nonzero(status == 5))
        if lost:  # (`maru.common.memcopy`: the pool's file truncated under the copy, say)
            log.warning("the copy of %d of %d keys faulted: misses", lost, len(keys))
        stale = int(np.count_nonzero(status == 3))
        if stale:
            self.stale += stale
            log.debug("%d of %d keys changed during the copy: misses", stale, len(keys))
        other, corrupt = np.flatnonzero(status == 2), np.flatnonzero(status == 4)
        if not len(other) and not len(corrupt):
            return
        names = joined(keys, prefix)  # (as the request path names them)
        if len(other):
            other_lengths([names[i] for i in other.tolist()], lengths[other].tolist(), length)
        if len(corrupt):
            checksum_mismatches(
                session,
                [names[i] for i in corrupt.tolist()],
                region_ids[corrupt],
                offsets[corrupt],
                lengths[corrupt],
                sums[corrupt],
            )


class IndexLookup(Lookup):
    """A `Lookup` answered by the local index: no request, no lease. Copy the hits out, then
    call `corrupt()` (per key) or `release(confirm=True)` (the batch): a hit whose slot changed
    or whose table was retired since the probe is a miss."""

    def __init__(
        self,
        session: Session,
        keys: Sequence[Key],
        index: LocalIndexClient,
        reader: Any,
        columns: np.ndarray,
    ):
        """`columns`: what `Reader.probe` gave (address, length, checksum, region id, offset,
        slot, seq per key)."""
        super().__init__(session, keys, lease=False, send=False)
        (
            self.addresses,
            self.lengths,
            self._checksums,
            self._region_ids,
            self._offsets,
            self._slots,
            self._seqs,
        ) = columns
        self._index, self._reader = index, reader

    def _validate(self) -> int:
        """After the copy, each time it is asked (views taken by `infos()` before the copy are
        checked again after it): the hits whose entries changed since the probe (or whose
        table was retired) become misses; returns how many became so now."""
        changed = self._reader.changed(self._slots, self._seqs)
        if changed is None:  # (the usual case: no array work)
            return 0
        stale = np.frombuffer(changed, bool)
        if self._corrupt is None:
            self._corrupt = np.zeros(self.n, bool)
        new = stale & ~self._corrupt
        count = int(np.count_nonzero(new))
        if count:
            self._corrupt |= new
            self._index.stale += count
            self._index.reads[1] -= count
            log.debug("%d of %d keys changed during the copy: misses", count, self.n)
        return count

    def corrupt(self, computed: np.ndarray | None = None) -> np.ndarray:
        """After the copy: per key, True where the hit is not proven, a miss (its entry changed
        since the probe, or, with `maru_checksums`, its bytes unlike its writer's checksum)."""
        self._validate()
        return super().corrupt(computed)

    def release(self, confirm: bool = False) -> bool:
        """Nothing is leased. With `confirm` (after the copy): True unless a hit not already
        reported by `corrupt()` changed since the probe."""
        return not confirm or self._validate() == 0
