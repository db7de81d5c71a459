"""Server-side pool kinds: a byte range every client can mmap, regions carved from it. The path
of `maru-server --pool` tells the kind (`open_pool`): a directory is an `FsDaxPool` (a file per
region), `/dev/dax*` or a char device a `DevDaxPool` (size and alignment from sysfs), any other
path a `ShmPool` (one sparse file, by default under /dev/shm).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hmac
import logging
import mmap
import os
import pwd
import secrets
import stat
import threading
from abc import ABC, abstractmethod
from pathlib import Path

from maru.common import hugepages
from maru.common.config import fmt_bytes
from maru.common.extents import ExtentAllocator
from maru.common.poolmark import (
    MARK_BYTES,
    MARK_MAGIC,
    POOL_KEY_BYTES,
    decode_mark,
    encode_mark,
    pool_proof,
    read_mark_window,
    server_proof,
    write_live_window,
    write_mark_window,
)
from maru.common.shmindex import area_bytes
from maru.server.journal import write_private

log = logging.getLogger(__name__)

REGION_ALIGNMENT = 2 << 20  # 2 MiB: huge-page friendly, and what devdax devices align to
INDEX_SLOTS_MIN, INDEX_SLOTS_MAX = 1 << 10, 1 << 24  # `--index-slots auto`'s bounds
AUTO_SLOT_BYTES = 64 << 10  # `auto`: two slots per 64 KiB of pool (a table at most half full)


def auto_index_slots(capacity: int) -> int:
    """`--index-slots auto`: room for a key per 64 KiB of pool (SGLang's pages are smaller
    than a MiB chunk), the table at most half full: a power of two in the bounds."""
    want = max(INDEX_SLOTS_MIN, min(INDEX_SLOTS_MAX, 2 * capacity // AUTO_SLOT_BYTES))
    return 1 << (want - 1).bit_length()


class PoolFullError(Exception):
    """No free extent in the pool is large enough for the requested region."""


class PoolError(RuntimeError):
    """The pool cannot be used: in use by another server, or not enough memory behind it."""


class PoolPathError(PoolError):
    """What the pool path names is not this server's to use, change or remove (a symbolic
    link, another user's file or directory, one every user may write, a file that is not a
    Maru pool): refused, and left as it is."""


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def symlink_refusal(path: str) -> PoolPathError:
    """The refusal of a symbolic link at the pool path: the server creates, grows, reuses and
    removes the pool at its path, and a link there (planted, in a shared /dev/shm) could make
    that any file the server's user may write."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return PoolPathError(
        f"--pool {path} is a symbolic link (to {target}): refused, left as it is; name the "
        "pool itself, not a link to it"
    )


def check_owner(path: str, st: os.stat_result) -> None:
    """PoolPathError unless an existing pool file or directory (`st`, not followed) is the
    server's user's and not writable by every user: another user's may be a trap (a file
    planted at the predictable default path), and one every user may write holds nothing
    the server can trust."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PoolPathError(
            f"--pool {path} is owned by {_user(st.st_uid)}, not by maru-server's user "
            f"({_user(uid)}): refused, left as it is; remove it or choose another path"
        )
    if st.st_mode & stat.S_IWOTH:
        raise PoolPathError(
            f"--pool {path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): "
            "refused, left as it is; `chmod o-w` it, or choose another path"
        )


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def mark_offsets(size: int, capacity: int = 0) -> list[int]:
    """Where a shm pool file of `size` bytes may hold its mark (`ShmPool`): past `capacity`
    (this start's), or a page before the file's end less an in-pool index's area of any
    size an earlier start may have had (`--index-slots`)."""
    page = mmap.ALLOCATIONGRANULARITY
    offsets = {-(-capacity // page) * page} if capacity > 0 else set()
    for slots in (0, *(1 << k for k in range(3, INDEX_SLOTS_MAX.bit_length()))):
        offsets.add(size - page - area_bytes(slots))
    return sorted(o for o in offsets if o >= 0 and o + MARK_BYTES <= size)


def carries_mark(fd: int, size: int, capacity: int = 0) -> bool:
    """Whether the file open at `fd` carries a Maru pool mark where one may lie
    (`mark_offsets`): valid, another state's, or damaged past its magic (a torn write) alike:
    the file is a Maru pool, whichever server or state served it last."""
    return any(
        os.pread(fd, len(MARK_MAGIC), offset) == MARK_MAGIC
        for offset in mark_offsets(size, capacity)
    )


def check_pool_entry(path: str, st: os.stat_result) -> None:
    """PoolPathError unless `st` (of an existing pool file, not followed) is a regular file
    of the server's user (`check_owner`)."""
    if not stat.S_ISREG(st.st_mode):
        raise PoolPathError(
            f"--pool {path} is {_file_kind(st.st_mode)}, not a pool file: refused, left as it "
            "is; choose another path"
        )
    check_owner(path, st)


def check_pool_file(
    path: str,
    fd: int,
    st: os.stat_result,
    capacity: int = 0,
    known: tuple[int, int] | None = None,
) -> None:
    """PoolPathError unless the existing file open at `fd` (`st`: its fstat) may be reused,
    truncated or removed as a pool: a regular file of the server's user (`check_pool_entry`)
    that is empty, is the very file this server's state recorded (`known`: (st_dev,
    st_ino); its mark may be gone, e.g. truncated), or carries a pool mark (`carries_mark`).
    Anything else may be anybody's data: never touched."""
    check_pool_entry(path, st)
    if st.st_size == 0 or (st.st_dev, st.st_ino) == known:
        return
    if not carries_mark(fd, st.st_size, capacity):
        raise PoolPathError(
            f"--pool {path} exists and is not a Maru pool (no pool mark); remove it or choose "
            "another path"
        )


def new_generation() -> str:
    """A random 64-bit name for one life of a pool's bytes (see `maru.server.state_dir`)."""
    return secrets.token_hex(8)


def check_free_space(pool_path: str, directory: str, need: int) -> None:
    """Raise PoolError unless `directory`'s filesystem has the `need` bytes the pool may still
    allocate there: a tmpfs out of room kills the client that touches a page (SIGBUS)."""
    if need <= 0:
        return
    vfs = os.statvfs(directory)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise PoolError(
            f"pool {pool_path} needs {fmt_bytes(need)} but {directory} has {fmt_bytes(free)} "
            "free; use a smaller --pool-size or free space there (--preallocate then reserves "
            "the whole pool at start, so nothing else can take it later)"
        )


def _flock(fd: int, what: str, holder: str = "") -> None:
    """Hold an exclusive lock on `fd` for the server's life: one server per pool (or state
    dir). `what` names the thing locked ("pool X") in the refusal."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PoolError(
            f"{what} is in use by another maru-server{f' (pid {holder})' if holder else ''}"
        ) from None


def lock_with_pid(lock_path: str | Path, what: str) -> int:
    """`_flock` a lock file (made 0600 if missing) that holds the holder's pid: ours once we
    have it, the other server's in the refusal. The fd stays open for the process's life."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _flock(fd, what, os.pread(fd, 32, 0).decode(errors="replace").strip())
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class Pool(ABC):
    kind: str

    def __init__(self, path: str, capacity: int, alignment: int):
        self.path = path
        self.capacity = capacity
        self.alignment = alignment
        self.generation = ""  # set by the server once it knows which life of the pool this is
        self.mark: tuple[str, str] | None = None  # (generation, epoch) this process wrote
        self._key = b""  # the pool key in that mark (`proven`): never sent, read from the pool
        # the live count in the pool (`handshake_fields`), raised and written under the lock:
        # the pool's word only grows within a mark, so no reply says more than the pool holds
        self._live, self._live_lock = 0, threading.Lock()
        # bytes the pool file had when opened, if fewer than its capacity (shm): bytes lost
        self.truncated_from: int | None = None
        self._lock_fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) when opened
        self.huge = hugepages.tmpfs_huge_option(path)  # its tmpfs's huge= (None: no tmpfs)
        # the in-pool key index's area: (file relative to the path, "" for the pool file
        # itself; offset; bytes; slots), kept out of the regions; None: no in-pool index
        self.index_area: tuple[str, int, int, int] | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.path}"

    @property
    def identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the pool file or directory when opened (None: not checked)."""
        return self._identity

    def round_up(self, length: int) -> int:
        return -(-length // self.alignment) * self.alignment

    @abstractmethod
    def allocate(self, region_id: int, length: int) -> tuple[str, int]:
        """Reserve `length` bytes (already rounded); return (file to mmap, offset in it)."""

    @abstractmethod
    def release(self, path: str, offset: int) -> None: ...

    @abstractmethod
    def reserve(self, path: str, offset: int, length: int) -> bool:
        """Re-mark an extent as in use when restoring persisted state; False (nothing marked)
        if its bytes are gone: the region is not restored, nor its keys."""
        return True

    @property
    @abstractmethod
    def used(self) -> int: ...

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def unallocated_on(self, directory: str) -> int:
        """Bytes the pool may still allocate on `directory`'s filesystem (0 on another one, or
        for a device): what the local index must leave free there (see `check_free_space`)."""
        try:
            if os.stat(self.path).st_dev != os.stat(directory).st_dev:
                return 0
        except OSError:
            return 0
        return max(0, self.capacity - self._allocated())

    def _allocated(self) -> int:
        """Bytes the pool has allocated on its filesystem (a device: all of them)."""
        return self.capacity

    def fragmentation(self) -> float:
        return 0.0

    def stats(self) -> dict:
        """Read by the metrics thread while the loop allocates: `used` is read once, so that
        used + free is the capacity in every document (reading it twice could tear)."""
        used = self.used
        return {
            "kind": self.kind,
            "path": self.path,
            "capacity": self.capacity,
            "used": used,
            "free": self.capacity - used,
            "fragmentation": round(self.fragmentation(), 4),
            "generation": self.generation,
            "huge": self.huge,
        }

    def start_fresh(self) -> None:  # noqa: B027 - optional hook
        """The server starts a new generation: make sure no earlier mapping sees its bytes."""

    @property
    def file_bytes(self) -> int:
        """Bytes the pool file must have: the regions' capacity, and the mark if it is there."""
        return self.capacity

    def read_mark(self) -> tuple[str, str] | None:
        """The (generation, epoch) the last server start wrote into the pool; None if none."""
        try:
            return decode_mark(self._read_mark_bytes())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("pool %s: cannot read its mark (%s): taken as none", self.path, exc)
            return None

    def write_mark(self, generation: str, epoch: str) -> None:
        """Bind the pool to the state that serves it now (see `maru.server.state_dir.claim_pool`),
        under a new pool key: a proof made for an earlier start proves nothing now."""
        key = secrets.token_bytes(POOL_KEY_BYTES)
        with self._live_lock:
            self._write_mark_bytes(encode_mark(generation, epoch, key))
            self.mark, self._key = (generation, epoch), key
            self._live = 0
            self._write_live(0)  # (a count an earlier start left there says nothing now)

    def proven(self, instance_id: str, proof: object) -> bool:
        """Whether `proof` is instance `instance_id`'s `pool_proof` under this start's mark:
        whether the instance has read the pool (a region is only for one that can)."""
        if not self._key or not isinstance(proof, str) or not proof.isascii():
            return False
        return hmac.compare_digest(proof, pool_proof(self._key, instance_id))

    def ensure_mark(self) -> None:
        """A pool served without a mark of this process's (an embedded service, which
        claims no state) gets one: clients prove their mapping by it (`handshake_fields`)."""
        if self.mark is None:
            self.write_mark(self.generation, new_generation())

    def handshake_fields(self, nonce: object = None) -> dict:
        """The HANDSHAKE reply's `pool` map: `stats()`, and the `mark` a client reads through the
        path it maps before using it (`maru.client.poolpath`): what it holds, where it lies,
        and the proof of the client's `nonce` that this server holds its pool key."""
        generation, epoch = self.mark if self.mark is not None else ("", "")
        mark = {"generation": generation, "epoch": epoch, **self._mark_place()}
        if self._key and isinstance(nonce, str) and nonce.isascii() and 0 < len(nonce) <= 64:
            mark["proof"] = server_proof(self._key, nonce)
            live = self._raise_live()
            if live:
                mark["live"] = live
        return {**self.stats(), "mark": mark}

    def _raise_live(self) -> int:
        """The live count raised and written into the pool for a client's HANDSHAKE, which
        must read at least that through its mapping (`maru.client.poolpath.prove`): a copy of
        the pool holds the mark and its key but a count frozen when it was copied. 0: this
        pool has no room for it (a directory pool), or it could not be written (not checked)."""
        with self._live_lock:
            try:
                if not self._write_live(self._live + 1):
                    return 0
            except (OSError, ValueError) as exc:
                log.warning("pool %s: cannot write its live count (%s)", self.path, exc)
                return 0
            self._live += 1
            return self._live

    def _write_live(self, count: int) -> bool:
        """Write the live `count` beside the mark; False where there is no room for it."""
        return False

    @abstractmethod
    def _mark_place(self) -> dict:
        """{"file", "offset", "span"}: where the mark lies (see `handshake_fields`)."""

    @abstractmethod
    def _read_mark_bytes(self) -> bytes: ...

    @abstractmethod
    def _write_mark_bytes(self, mark: bytes) -> None: ...

    def changed(self) -> str | None:
        """Why the pool is no longer the one opened (deleted, replaced, shrunk), or None.
        One stat of the path: cheap enough for the server's housekeeping once a second."""
        if self._identity is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "was deleted"
        except OSError as exc:
            return f"cannot be checked ({exc})"
        if (st.st_dev, st.st_ino) != self._identity:
            return "was replaced by another file"
        if stat.S_ISREG(st.st_mode) and self.kind != "fsdax" and st.st_size < self.file_bytes:
            return f"shrank to {st.st_size} bytes (capacity {self.capacity})"
        return None

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _apply_group(fd: int, group: str | None) -> None:
    """Give the open file to `group` (mode 0660): through its fd, never a path a link may
    have replaced since."""
    if group:
        os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
        os.fchmod(fd, 0o660)


class FilePool(Pool):
    """One file or device, regions carved first-fit at `alignment`. Past the last region lie the
    mark, in a window of `mark_span` bytes at `mark_offset` (mapped: a devdax device has no read
    or write), and with `index` (offset, bytes, slots) the in-pool key index."""

    def __init__(
        self,
        path: str,
        capacity: int,
        alignment: int,
        mark_offset: int,
        mark_span: int,
        index: tuple[int, int, int] | None = None,
    ):
        super().__init__(path, capacity, alignment)
        self._extents = ExtentAllocator(capacity, alignment)
        self.mark_offset, self.mark_span = mark_offset, mark_span
        if index is not None:
            self.index_area = ("", *index)

    @property
    def file_bytes(self) -> int:
        end = self.mark_offset + self.mark_span
        return max(end, self.index_area[1] + self.index_area[2]) if self.index_area else end

    def _mark_place(self) -> dict:
        return {"file": "", "offset": self.mark_offset, "span": self.mark_span}

    def _read_mark_bytes(self) -> bytes:
        return read_mark_window(self.path, self.mark_offset, self.mark_span)

    def _write_mark_bytes(self, mark: bytes) -> None:
        write_mark_window(self.path, self.mark_offset, self.mark_span, mark)

    def _write_live(self, count: int) -> bool:
        return write_live_window(self.path, self.mark_offset, self.mark_span, count)

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

    def reserve(self, path: str, offset: int, length: int) -> bool:
        self._extents.reserve(offset, length)
        return True

    @property
    def used(self) -> int:
        return self._extents.used

    def fragmentation(self) -> float:
        return self._extents.fragmentation()


class ShmPool(FilePool):
    """A sparse file (tmpfs under /dev/shm): the embedded default, no hardware needed. An
    existing file is reused, never truncated, so pages outlive a server restart; a shorter one
    lost bytes (`truncated_from`: the server starts a new generation). With `lock` (the server)
    it is flocked, and its filesystem must have room for what it may still allocate
    (`preallocate`: all of it now). The page past the capacity holds the mark, then comes the
    in-pool index (`index_slots`).

    The path is never followed if it is a symbolic link. With `guard` (the server) an existing
    file is used only if it may be (`check_pool_file`; `known`: the file the server's state
    recorded): anything else is refused (`PoolPathError`) and left as it is."""

    kind = "shm"

    def __init__(
        self,
        path: str,
        capacity: int,
        group: str | None = None,
        *,
        lock: bool = False,
        preallocate: bool = False,
        index_slots: int = 0,
        guard: bool = False,
        known: tuple[int, int] | None = None,
    ):
        page = mmap.ALLOCATIONGRANULARITY
        mark = -(-capacity // page) * page
        area = area_bytes(index_slots)
        index = (mark + page, area, index_slots) if area else None
        super().__init__(path, capacity, REGION_ALIGNMENT, mark, page, index)
        self._group, self._lock, self._preallocate = group, lock, preallocate
        self._guard, self._known = guard, known
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.created = self._open(exclusive=False)
        mount = hugepages.mount_entry(os.path.dirname(os.path.abspath(path)))
        fs = mount[2] if mount is not None else None
        if lock and fs not in (None, "tmpfs"):
            log.warning(
                "pool %s is on %s, not tmpfs: its pages may be written back to storage", path, fs
            )
        if lock and self.huge is not None:
            log.info("pool %s: %s", path, hugepages.describe(self.huge))

    def _open(self, exclusive: bool) -> bool:
        """Open (or create) the file, lock it, check it and size it; True if it was created.
        A symbolic link at the path is refused, never followed (O_EXCL, O_NOFOLLOW)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            created = True
        except FileExistsError:
            if exclusive:
                raise
            fd, created = self._open_existing(), False
        try:
            st = os.fstat(fd)
            if not created and self._guard:
                check_pool_entry(self.path, st)  # (no lock taken on what is not ours)
            if self._lock:
                _flock(fd, f"pool {self.path}")
            if not created and self._guard:  # (its mark, now that no server writes it)
                check_pool_file(self.path, fd, st, self.capacity, self._known)
            if not created and st.st_size < self.capacity:
                if st.st_size == 0 and (st.st_dev, st.st_ino) != self._known:
                    log.info("pool %s: an empty file: used as a new pool", self.path)
                else:
                    self.truncated_from = st.st_size
            directory = os.path.dirname(os.path.abspath(self.path))
            check_free_space(self.path, directory, self.file_bytes - st.st_blocks * 512)
            if st.st_size < self.file_bytes:
                os.ftruncate(fd, self.file_bytes)
            if self._preallocate:
                try:
                    os.posix_fallocate(fd, 0, self.file_bytes)
                except OSError as exc:
                    raise PoolError(
                        f"cannot preallocate pool {self.path} ({fmt_bytes(self.capacity)}): "
                        f"{exc.strerror}; use a smaller --pool-size or free space"
                    ) from None
        except BaseException:
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        try:
            _apply_group(fd, self._group)
        except BaseException:
            os.close(fd)
            raise
        if self._lock:
            self._lock_fd = fd
        else:
            os.close(fd)
        self._identity = (st.st_dev, st.st_ino)
        return created

    def _open_existing(self) -> int:
        """The existing file at the path, opened without following a link; another user's
        that this user may not open is named as such (`check_owner`), not as EACCES."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if stat.S_ISLNK(st.st_mode):
                    raise symlink_refusal(self.path) from None
                if self._guard:
                    check_owner(self.path, st)
            raise exc from None

    def start_fresh(self) -> None:
        """A new generation is a new file: clients still mapping the old one (they outlived a
        server restart) read and write the old inode, never the pages handed out now."""
        if self.created:
            return
        self.close()
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if self._identity is not None and (st.st_dev, st.st_ino) != self._identity:
                raise PoolError(
                    f"pool {self.path} was replaced by another file while the server started: "
                    "left as it is; start again"
                )
            os.unlink(self.path)
        self.truncated_from = None
        self.created = self._open(exclusive=True)

    def _allocated(self) -> int:
        try:
            return os.stat(self.path).st_blocks * 512
        except OSError:
            return 0


class DevDaxPool(FilePool):
    """A devdax character device (CXL memory, PMEM), size and alignment from sysfs (a regular
    file stands in for one in tests). Its last alignment unit holds the mark, the units before
    it the in-pool index (`index_slots`): the capacity is at most the rest."""

    kind = "devdax"

    def __init__(
        self, path: str, capacity: int | None = None, *, lock: bool = False, index_slots: int = 0
    ):
        size, align = self._probe(path)
        align = max(align, REGION_ALIGNMENT)
        mark = (size // align - 1) * align  # (the last unit: the mark)
        area = -(-area_bytes(index_slots) // align) * align
        room = mark - area
        if room <= 0:
            raise ValueError(f"devdax {path} is too small: {size} bytes (alignment {align})")
        if capacity is None or capacity > room:
            if capacity is not None:
                log.warning(
                    "pool %s: --pool-size %d exceeds device size %d less the mark's %d",
                    path,
                    capacity,
                    size,
                    align,
                )
            capacity = room
        super().__init__(
            path, capacity, align, mark, align, (room, area, index_slots) if area else None
        )
        if lock:
            fd = os.open(path, os.O_RDONLY)
            try:
                _flock(fd, f"pool {path}")
            except BaseException:
                os.close(fd)
                raise
            self._lock_fd = fd
            st = os.fstat(fd)
            self._identity = (st.st_dev, st.st_ino)

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
    """A directory; each region is its own file `region-<id>.mem` (fsdax in production). The
    pool's mark is the file `MARK_FILE` beside them. A symbolic link at the path is refused,
    never followed, and region files are made anew (O_EXCL, O_NOFOLLOW); with `guard` (the
    server) an existing directory must be the server's user's, not writable by every user
    (`check_owner`). `created`: this object made the directory."""

    kind = "fsdax"

    LOCK_FILE = ".maru-server.lock"
    MARK_FILE = ".maru-pool.mark"

    def __init__(
        self,
        path: str,
        capacity: int,
        group: str | None = None,
        *,
        lock: bool = False,
        guard: bool = False,
    ):
        super().__init__(path, capacity, REGION_ALIGNMENT)
        self._group = group
        self._files: dict[str, int] = {}
        self.created = False
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o755)  # (FileExistsError if something came there meanwhile)
            self.created = True
        else:
            if stat.S_ISLNK(st.st_mode):
                raise symlink_refusal(path)
            if not stat.S_ISDIR(st.st_mode):
                raise PoolPathError(
                    f"--pool {path}/ names {_file_kind(st.st_mode)}, not a directory: "
                    "refused, left as it is"
                )
            if guard:
                check_owner(path, st)
        try:
            if lock:
                self._lock_fd = lock_with_pid(os.path.join(path, self.LOCK_FILE), f"pool {path}")
                st = os.stat(path)
                self._identity = (st.st_dev, st.st_ino)
                check_free_space(path, path, capacity - self._allocated())
        except BaseException:
            self.close()
            if self.created:  # (what this start made, it removes again)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, self.LOCK_FILE))
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise

    def _region_files(self) -> list[Path]:
        return list(Path(self.path).glob("region-*.mem"))

    def _mark_place(self) -> dict:
        return {"file": self.MARK_FILE, "offset": 0, "span": MARK_BYTES}

    def _read_mark_bytes(self) -> bytes:
        try:
            return (Path(self.path) / self.MARK_FILE).read_bytes()
        except FileNotFoundError:
            return b""

    def _write_mark_bytes(self, mark: bytes) -> None:
        write_private(Path(self.path) / self.MARK_FILE, mark)

    def _allocated(self) -> int:
        total = 0
        for file in self._region_files():
            with contextlib.suppress(FileNotFoundError):
                total += file.stat().st_blocks * 512
        return total

    def start_fresh(self) -> None:
        """Region files of an earlier generation are nobody's now: remove them (a client that
        still maps one keeps its inode, never a new region's)."""
        for file in self._region_files():
            with contextlib.suppress(FileNotFoundError):
                file.unlink()

    def allocate(self, region_id: int, length: int) -> tuple[str, int]:
        if self.used + length > self.capacity:
            raise PoolFullError(
                f"pool {self.name} is full: cannot fit a region of {length} bytes "
                f"({self.free} of {self.capacity} bytes free)"
            )
        file = os.path.join(self.path, f"region-{region_id}.mem")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(file, flags, 0o600)
        except FileExistsError:
            # (region ids only go up, and a new generation removes the old files: a name
            # taken is no live region's; a link there is removed, never followed)
            os.unlink(file)
            fd = os.open(file, flags, 0o600)
        try:
            os.ftruncate(fd, length)
            _apply_group(fd, self._group)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(file)
            raise
        os.close(fd)
        self._files[file] = length
        return file, 0

    def release(self, path: str, offset: int) -> None:
        self._files.pop(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def reserve(self, path: str, offset: int, length: int) -> bool:
        """False if the region's file went, or was cut shorter than the region, while
        the server was down (`rm pool/*` spares the pool's mark, a dot file, so the pool still
        matches): restored, its keys would be hits on no bytes (a reader's mmap fails) or on
        bytes that are not theirs. What is left of such a file is removed."""
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except FileNotFoundError:
            size = -1
        except OSError:
            size = offset + length  # (unreadable here: left to the readers)
        if size < offset + length:
            if size >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return False
        self._files[path] = length
        return True

    @property
    def used(self) -> int:
        return sum(self._files.values())


def open_pool(
    path: str,
    capacity: int | None,
    group: str | None = None,
    *,
    lock: bool = False,
    preallocate: bool = False,
    index_slots: int = 0,
    guard: bool = False,
    known: tuple[int, int] | None = None,
) -> Pool:
    """The pool at `path`, of the kind it names (module docstring). `lock`: held for this
    process's life (the server), refused if another server holds it. `index_slots`: the
    in-pool key index's (`--index-slots`; 0 and a directory pool: none). A symbolic link at
    the path is refused (`PoolPathError`), but under /dev/dax; `guard` and `known`: the
    server's checks of what it finds there (`ShmPool`, `FsDaxPool`)."""
    p = Path(path)
    bare = path.rstrip("/") or "/"
    if not path.startswith("/dev/dax") and os.path.islink(bare):
        raise symlink_refusal(bare)
    if path.endswith("/") or p.is_dir():
        if capacity is None:
            raise ValueError("--pool-size is required for an fsdax directory pool")
        return FsDaxPool(bare, capacity, group, lock=lock, guard=guard)
    if path.startswith("/dev/dax") or (p.exists() and stat.S_ISCHR(p.stat().st_mode)):
        return DevDaxPool(path, capacity, lock=lock, index_slots=index_slots)
    if capacity is None:
        raise ValueError("--pool-size is required for a shm pool")
    return ShmPool(
        path,
        capacity,
        group,
        lock=lock,
        preallocate=preallocate,
        index_slots=index_slots,
        guard=guard,
        known=known,
    )
