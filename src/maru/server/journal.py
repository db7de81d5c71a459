"""Registry persistence: a checksummed append-only journal plus generation-numbered snapshots.

The snapshot of generation g holds the state before the first record of journal-g.log. The
server's loop only packs the state, fsyncs journal-g.log and sends appends to a new
journal-(g+1).log; a thread writes the snapshot of g+1 (a temporary file, fsync, rename,
directory fsync) and only then removes the journals it covers (`Journal.start_snapshot`). So
the files on disk form a chain: a restart loads the snapshot there, of generation g, and
replays journal-g.log, journal-(g+1).log, ... in order while they exist (the snapshot of g+1
may not have landed, or its write failed: the chain grows until one lands). Journals older
than g are covered by it and removed; a journal missing between two of the chain refuses the
restart (its records are lost). A short or damaged record with no intact record after it in
the chain is a torn tail (a crash in the middle of an append, or unsynced pages lost with the
machine): it is truncated and everything before it replayed. Damage with an intact record
after it, in its journal or a later one, is in the middle: the records after it (deletes among
them) would be lost, so the restart refuses to restore rather than serve the records before
it (`Journal.load`). Each record is written before its request is answered, and fsynced by a
background thread (the syncer) at most every `fsync_interval`. After a failed append every
append raises `JournalWriteError` until a snapshot succeeds (no record may follow a gap); a
failed fsync (the kernel may have dropped the unwritten pages) sets `sync_error`; either way
`needs_snapshot` asks for a snapshot of the in-memory registry, which is complete, written
whole on the loop before any change is accepted again (`Journal.write_snapshot`;
docs/reliability.md, "Server crashes")."""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from maru.server._keyindex import crc32, pack_record

log = logging.getLogger(__name__)

FRAME = struct.Struct("!II")
SNAPSHOT_NAME = "snapshot.msgpack"


class JournalWriteError(RuntimeError):
    """A journal record could not be written completely: the change it records must not be
    acknowledged (nor, where it would be dangerous, applied). Raised by `Journal.append`."""

    def __init__(self, state_dir: Path, cause: OSError):
        self.state_dir = state_dir
        self.cause = cause
        super().__init__(
            f"maru-server cannot write its journal in {state_dir} ({cause.strerror or cause}): "
            "changes are refused until it can; reads go on"
        )


class Packed:
    """A value already in msgpack (a snapshot's "keys" rows: `KeyIndex.pack_rows`), which
    `_frame` splices into the top-level dict holding it: a snapshot of 10^6 keys is then not a
    list per key built on the server's loop first. `len` is its count of items (the log's)."""

    __slots__ = ("count", "data")

    def __init__(self, data: bytes, count: int):
        self.data = data
        self.count = count

    def __len__(self) -> int:
        return self.count


def _frame(record: Any) -> bytes:
    """A record (or snapshot) framed: msgpack, as `msgpack.packb(record, use_bin_type=True)`
    writes it, packed in one C pass (`pack_record`); a dict's `Packed` values as they are."""
    return b"".join(_frame_chunks(record))


def _map_header(n: int) -> bytes:
    """msgpack's header of a map of `n` pairs (fixmap, map 16, map 32)."""
    if n < 16:
        return bytes([0x80 | n])
    return b"\xde" + n.to_bytes(2, "big") if n < 65536 else b"\xdf" + n.to_bytes(4, "big")


def _frame_chunks(record: Any) -> list[bytes]:
    """`_frame` in pieces, header first: a snapshot's packed rows (tens of MiB at 10^6 keys)
    are written as they are rather than copied into one bytes with the rest."""
    if not isinstance(record, dict) or not any(isinstance(v, Packed) for v in record.values()):
        return list(_frame_parts(record))
    chunks = [_map_header(len(record))]
    for key, value in record.items():  # (the order `pack_record` packs a dict in)
        chunks.append(pack_record(key))
        chunks.append(value.data if isinstance(value, Packed) else pack_record(value))
    crc = size = 0
    for chunk in chunks:
        crc = crc32(chunk, crc)
        size += len(chunk)
    return [FRAME.pack(size, crc), *chunks]


def _frame_parts(record: Any) -> tuple[bytes, bytes]:
    """`_frame`'s header and payload, apart: `Journal.append` writes them in one `os.writev`
    rather than copying a record of a few dozen KiB into one bytes first."""
    payload = pack_record(record)
    return FRAME.pack(len(payload), crc32(payload)), payload


def read_records(data: bytes) -> tuple[list[Any], int]:
    """Decode records until the end or the first damaged one; returns (records, good bytes)."""
    records: list[Any] = []
    pos = 0
    while pos + FRAME.size <= len(data):
        length, crc = FRAME.unpack_from(data, pos)
        start, end = pos + FRAME.size, pos + FRAME.size + length
        if end > len(data) or crc32(memoryview(data)[start:end]) != crc:
            break
        try:
            records.append(msgpack.unpackb(data[start:end], raw=False, strict_map_key=False))
        except Exception:  # checksum matched but not msgpack: treat as damage too
            break
        pos = end
    return records, pos


# Where a record's payload can begin: every journal record is a list whose first item is its
# kind, one capital letter ("R", "K", "D", ...: `persistence._replay`), so its msgpack starts
# with an array marker (fixarray, array 16 or 32, with their counts), then 0xa1 (a str of one
# byte) and the letter. (A record kind of another form would have to be added here.) A
# lookahead: the matches may overlap (an array 32's count may hold the next record's start).
_RECORD_START = re.compile(rb"(?=(?:[\x91-\x9f]|\xdc[\x00-\xff]{2}|\xdd[\x00-\xff]{4})\xa1[A-Z])")


def next_intact_frame(data: bytes, start: int) -> int | None:
    """The offset of the first intact record frame that begins at or after `start`, or None.

    `Journal.load` asks this about the bytes after the first damaged frame: None is a torn
    tail, an offset is damage in the middle. The damaged frame's length field may itself be
    damaged, so the next frame is not looked for by length but at every offset where one could
    begin: 8 bytes (its header) before the start of a record (`_RECORD_START`, a regex: in C).
    A candidate is an intact frame if its length fits in the file, its payload's CRC32 matches
    and the payload decodes to a list. A run of zeros (pages a crashed machine never wrote) has
    no candidate. Damage is not mistaken for a frame in practice (a CRC over other bytes
    matches once in 2**32; a torn record whose key holds a whole frame could be: that start is
    refused, never served wrong). Cost: one pass of the regex, and a CRC per candidate whose
    length fits, at most a few per record (64 MiB of records with every CRC bad, or of random
    bytes: about a second)."""
    for match in _RECORD_START.finditer(data, start + FRAME.size):
        body = match.start()
        length, crc = FRAME.unpack_from(data, body - FRAME.size)
        end = body + length
        if end > len(data) or crc32(memoryview(data)[body:end]) != crc:
            continue
        try:
            record = msgpack.unpackb(data[body:end], raw=False, strict_map_key=False)
        except Exception:
            continue
        if isinstance(record, list):
            return body - FRAME.size
    return None


def write_private(path: Path, data: bytes | list[bytes]) -> None:
    """Replace `path` (mode 0600) with `data` (or its chunks, in order) whole, or leave it as it
    was: written beside it (`<name>.tmp`), fsynced, then renamed over it (the directory is not
    fsynced)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A background snapshot leaves this much of the file system free for the journal's appends
# while it is written (a quarter of the snapshot, at most 16 MiB): a snapshot that would take the
# last of it waits for room instead, so that appends, which must succeed, never fail for it.
JOURNAL_ROOM_MAX = 16 << 20


def _check_room(state_dir: Path, nbytes: int) -> None:
    """Raise ENOSPC unless `state_dir`'s file system holds `nbytes` and the journal's room
    beside them (what an unprivileged writer may use: `f_bavail`)."""
    st = os.statvfs(state_dir)
    free = st.f_bavail * st.f_frsize
    needed = nbytes + min(JOURNAL_ROOM_MAX, nbytes // 4)
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{free} bytes free, a snapshot of {nbytes} bytes and the journal's room need "
            f"{needed} (not written, so that appends keep their room)",
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journal_generation(path: Path) -> int | None:
    """N of a `journal-N.log`, or None for another name."""
    match = re.fullmatch(r"journal-(\d+)\.log", path.name)
    return int(match.group(1)) if match else None


def _first_intact(data: bytes) -> int | None:
    """The offset of the first intact frame in `data` (a later journal of the chain), or None."""
    records, _ = read_records(data)
    return 0 if records else next_intact_frame(data, 0)


def _truncate(path: Path, size: int) -> None:
    """Cut `path` to `size` bytes, durably (a torn tail, before appends go on after it)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse(message: str, short: str) -> None:
    """Refuse to load: log why at ERROR (with the way out), raise RuntimeError."""
    log.error(
        "%s: refusing to start. Start with --no-restore to start empty (a new pool generation; "
        "it discards the journal and snapshot: copy them first to examine them)",
        message,
    )
    raise RuntimeError(f"{short}: refusing to start; --no-restore starts empty")


def _read_chain(chain: list[Path]) -> tuple[list[Any], list[int]]:
    """The chain's records up to its first damage, and how many bytes of each journal to
    keep (less than all: a torn tail). Damage with an intact record after it, in its
    journal or a later one, refuses (`_refuse_damaged_middle`)."""
    datas = [path.read_bytes() if path.exists() else b"" for path in chain]
    records: list[Any] = []
    kept = [len(data) for data in datas]
    for i, (path, data) in enumerate(zip(chain, datas)):
        got, good = read_records(data)
        records += got
        if good == len(data):
            continue
        after = next_intact_frame(data, good + 1)
        if after is not None:
            _refuse_damaged_middle(path, data, good, data[after:], f"from byte {after}")
        for j in range(i + 1, len(chain)):
            at = _first_intact(datas[j])
            if at is not None:
                _refuse_damaged_middle(path, data, good, datas[j][at:], f"in {chain[j]}")
        kept[i:] = [good] + [0] * (len(chain) - i - 1)  # a torn tail: the chain ends here
        break
    return records, kept


def _refuse_damaged_middle(path: Path, data: bytes, bad: int, later: bytes, at: str) -> None:
    """Refuse damage at byte `bad` of journal `path` with intact records (`later`, `at`)
    after it."""
    count = len(read_records(later)[0])
    _refuse(
        f"journal {path} is damaged in its middle: the record at byte {bad} of {len(data)} "
        f"is bad and intact records follow it (at least {count}, {at}); the changes they "
        "record (deletes, registrations) would be lost, and replaying only the records "
        "before the damage could serve a deleted key over another key's bytes",
        f"journal {path} is damaged in its middle (byte {bad} of {len(data)})",
    )


class Journal:
    def __init__(
        self, state_dir: Path, *, fsync_interval: float = 0.05, snapshot_bytes: int = 64 << 20
    ):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.fsync_interval = fsync_interval
        self.snapshot_bytes = snapshot_bytes
        self.snapshot_size = 0  # bytes of the snapshot file on disk (0: none)
        self.generation = 0  # of the journal appends go to
        self._fd = -1
        self._size = 0
        # bytes of the chain's journals before this one: a restart replays them too, until a
        # snapshot of this generation lands (`needs_snapshot` counts them)
        self._chain_bytes = 0
        self.damaged_bytes_dropped = 0
        self.fsyncs = 0  # successful fsyncs of the journal (syncer, rotation, close)
        self.fsync_errors = 0
        self.sync_error: OSError | None = None  # set by a failed fsync until the next snapshot
        self.write_errors = 0  # appends that failed (each refused its request)
        # set by a failed append until the next snapshot; appends raise while it is set
        self.write_error: OSError | None = None
        self.snapshot_errors = 0  # background snapshot writes that failed
        # the last one's error, until a snapshot lands (the chain on disk stays as it was)
        self.snapshot_error: Exception | None = None
        # Appends run on the request thread and take no lock: they only set `_dirty` (and wake
        # the syncer when it was clear). `_lock` is held while the fd is fsynced and while it is
        # replaced or closed, so the syncer never fsyncs a closed (or reused) fd number.
        self._lock = threading.Lock()
        self._dirty = False
        self._wake = threading.Event()  # set when the journal became dirty, or to stop
        self._closing = threading.Event()
        self._last_sync = time.monotonic()
        self._syncer: threading.Thread | None = None
        self._writer: threading.Thread | None = None  # the background snapshot write

    def _journal_path(self, generation: int) -> Path:
        return self.state_dir / f"journal-{generation}.log"

    def load(self) -> tuple[dict[str, Any] | None, list[Any]]:
        """Read the snapshot and the records of its chain of journals (the module docstring);
        open the chain's last journal for appends and start the syncer thread.

        Damage is told apart by what follows it in the chain (`next_intact_frame`, then the
        later journals): with no intact frame after it, it is a torn tail, truncated (WARNING;
        so are the later journals, which hold none), and the records before it are returned.
        With one, it is in the middle: the records after it are lost, and the ones before it
        are not the registry's state (a key deleted later, its chunk reused by another key,
        would come back over that key's bytes). As for a damaged snapshot, or a journal missing
        from the chain, this raises RuntimeError (logged at ERROR, naming the damage and
        `--no-restore`) and changes nothing on disk."""
        snapshot = None
        snap_path = self.state_dir / SNAPSHOT_NAME
        if snap_path.exists():
            data = snap_path.read_bytes()
            self.snapshot_size = len(data)
            records, _ = read_records(data)
            if not records:
                raise RuntimeError(f"snapshot {snap_path} is damaged; refusing to start")
            snapshot = records[0]
            self.generation = int(snapshot["generation"])
        chain = self._chain()
        records, kept = _read_chain(chain)
        for path, keep in zip(chain, kept):
            size = path.stat().st_size if path.exists() else 0
            if keep < size:
                self.damaged_bytes_dropped += size - keep
                log.warning("journal %s: ignoring %d damaged bytes at its tail", path, size - keep)
                _truncate(path, keep)
        self._remove_before(self.generation)  # (left by a crash after a snapshot's rename)
        self.generation += len(chain) - 1
        self._fd, self._size = self._open(chain[-1])
        self._chain_bytes = sum(kept[:-1])
        if self._syncer is None:
            self._syncer = threading.Thread(
                target=self._sync_loop, name="maru-journal-fsync", daemon=True
            )
            self._syncer.start()
        return snapshot, records

    def _journals(self) -> dict[int, Path]:
        """The state dir's journals by generation."""
        found = ((_journal_generation(p), p) for p in self.state_dir.glob("journal-*.log"))
        return {g: p for g, p in found if g is not None}

    def _remove_before(self, generation: int) -> None:
        """Remove the journals a snapshot of `generation` covers (its rename on disk)."""
        for g, path in self._journals().items():
            if g < generation:
                path.unlink(missing_ok=True)

    def _chain(self) -> list[Path]:
        """The snapshot's journal and the ones after it, in order while they exist (the first,
        even if it does not: appends go there). A journal after a missing one refuses: the
        changes the missing one held would be lost (a gap is damage in the middle)."""
        first, journals = self.generation, self._journals()
        chain = [self._journal_path(first)]
        if first in journals:
            while first + len(chain) in journals:
                chain.append(journals[first + len(chain)])
        later = sorted(g for g in journals if g >= first + len(chain))
        if later:
            missing = self._journal_path(first + len(chain) - (first not in journals))
            _refuse(
                f"journal {missing} is missing from the chain after snapshot generation {first}"
                f" while {journals[later[0]]} follows it: the changes it recorded (deletes, "
                "registrations) would be lost",
                f"journal {missing} is missing",
            )
        return chain

    @staticmethod
    def _open(path: Path) -> tuple[int, int]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return fd, os.fstat(fd).st_size

    def append(self, record: Any) -> None:
        """Write one record, whole, or raise `JournalWriteError` (see the module docstring)."""
        if self.write_error is not None:
            raise JournalWriteError(self.state_dir, self.write_error)
        parts = _frame_parts(record)
        size = len(parts[0]) + len(parts[1])
        try:
            written = os.writev(self._fd, parts)
            if written != size:  # short: the file system is full or at its size limit
                self._write_rest(b"".join(parts), written)
        except OSError as exc:
            self._write_failed(exc)
            raise JournalWriteError(self.state_dir, exc) from exc
        self._size += size
        # After the write: a syncer that clears `_dirty` after this point fsyncs after the
        # write; one that cleared it before will see it set again and come back.
        if not self._dirty:
            self._dirty = True
            self._wake.set()

    def _write_rest(self, frame: bytes, written: int) -> None:
        """Finish a short write; OSError when it cannot (the next write usually says why)."""
        view = memoryview(frame)
        while written < len(frame):
            n = os.write(self._fd, view[written:])
            if n <= 0:
                raise OSError(errno.EIO, "journal write made no progress")
            written += n

    def _write_failed(self, exc: OSError) -> None:
        """Cut the torn record away (best effort: replay would stop there anyway, and no record
        follows it while `write_error` is set) and refuse appends until the next snapshot."""
        self.write_errors += 1
        self.write_error = exc
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as trunc_exc:
            log.error("journal: cannot truncate the torn record away: %s", trunc_exc)
        log.error(
            "journal write to %s failed: %s; changes are refused until a snapshot can be written",
            self._journal_path(self.generation),
            exc,
        )

    @property
    def writable(self) -> bool:
        """False while appends are refused (a write failed and no snapshot has succeeded)."""
        return self.write_error is None

    # -- fsync -----------------------------------------------------------------------------

    def _sync_loop(self) -> None:
        """The syncer: fsync the journal when dirty, at most every `fsync_interval` (start to
        start). `os.fsync` releases the GIL, so the request thread carries on meanwhile."""
        while True:
            self._wake.wait()
            if self._closing.is_set():
                return
            delay = self._last_sync + self.fsync_interval - time.monotonic()
            if delay > 0 and self._closing.wait(delay):
                return  # close() does the final fsync
            self.sync(clear_wake=True)

    def sync(self, clear_wake: bool = False) -> bool:
        """fsync now, on the calling thread, if there is unsynced data. Never raises: a failure
        is logged and recorded in `sync_error`, and returns False."""
        with self._lock:
            if clear_wake and not self._closing.is_set():  # (close() sets both under the lock)
                self._wake.clear()
            if self._fd < 0 or not self._dirty:
                return True
            self._dirty = False  # before the fsync: a write during it sets it again
            start = time.monotonic()
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self.fsync_errors += 1
                self.sync_error = exc
                log.error(
                    "journal fsync of %s failed: %s; recent changes may not be on disk, "
                    "writing a new snapshot",
                    self._journal_path(self.generation),
                    exc,
                )
                return False
            finally:
                self._last_sync = start
            self.fsyncs += 1
            return True

    @property
    def snapshot_threshold(self) -> int:
        """The chain's size that asks for a snapshot: `snapshot_bytes`, or the snapshot file's
        size when larger. A snapshot costs what the registry holds, so with a fixed
        threshold a registry of 10^7 keys would write one as often as an empty one; this way
        the snapshots' bytes stay at most about the journal's (a snapshot per journal of its
        own size: Redis's auto-aof-rewrite-percentage 100), and a restart replays at most about
        as much journal as the snapshot holds."""
        return max(self.snapshot_bytes, self.snapshot_size)

    @property
    def recovering(self) -> bool:
        """A failed append or fsync left a gap: changes wait on a whole snapshot on disk."""
        return self.write_error is not None or self.sync_error is not None

    @property
    def snapshot_in_flight(self) -> bool:
        """A background snapshot write (`start_snapshot`) has not ended yet."""
        return self._writer is not None and self._writer.is_alive()

    @property
    def needs_snapshot(self) -> bool:
        """The journals a restart would replay (the chain: the current one, and those before
        it while no later snapshot has landed) have grown past `snapshot_threshold`, or an
        fsync or a write failed (a fresh snapshot makes the state on disk whole again). Never
        while a background write is in flight: one at a time."""
        if self.snapshot_in_flight:
            return False
        return self._chain_bytes + self._size >= self.snapshot_threshold or self.recovering

    def start_snapshot(self, state: dict[str, Any]) -> bool:
        """Persist the full state (packed already: immutable bytes and lists of its own) as
        generation N+1 with the write in the background: here only the old journal's fsync
        and the switch of appends to the new one. True: handed to the writer thread (its
        outcome: `snapshot_error`, `snapshot_errors`); False: written here, as `write_snapshot`
        (raises OSError as it does), for a recovery (`recovering`: no change may be accepted
        before the state is whole on disk) or when the old journal's fsync fails."""
        self.wait_snapshot()  # (`needs_snapshot` does not ask while one is in flight)
        synced = not self.recovering and self.sync()
        if not synced or self.recovering:  # (again: the syncer's fsync may have failed)
            self.write_snapshot(state)
            return False
        generation, chunks, fd = self._next_generation(state)
        self._switch(generation, fd, None)  # the old journal stays in the chain until it lands
        land = (generation, chunks, len(state.get("keys", ())))
        writer = threading.Thread(target=self._land, args=land, name="maru-snapshot", daemon=True)
        try:
            writer.start()
        except RuntimeError:  # no thread to be had: the same steps here
            self._land(*land)
        else:
            self._writer = writer
        return True

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Persist the full state as generation N+1 and start an empty journal for it, on this
        thread, the snapshot on disk before appends go to the new journal: the way back after
        a failed append or fsync (they are cleared here), and the start-up's and the tests'.
        A background write in flight is waited for first."""
        self.wait_snapshot()
        # The old journal's tail first: until the new snapshot's rename is on disk, a machine
        # crash replays this journal (a failure is logged: the snapshot covers it anyway).
        self.sync()
        generation, chunks, fd = self._next_generation(state)  # (before the directory fsync)
        try:
            write_private(self.state_dir / SNAPSHOT_NAME, chunks)
        except BaseException:
            # Nothing changed: the old snapshot and journal stay current. Give the space back.
            os.close(fd)
            self._journal_path(generation).unlink(missing_ok=True)
            raise
        # The new snapshot is in place: from here on a restart reads it and the new journal,
        # so appends must go there even if the directory fsync below fails.
        resumed = self._switch(generation, fd, chunks)
        try:
            self._covered(generation)
        except OSError as exc:  # the rename may not survive a machine crash: snapshot again
            self.fsync_errors += 1
            self.sync_error = exc
            log.error("fsync of %s failed: %s; writing a new snapshot", self.state_dir, exc)
        if resumed is not None:
            log.warning(
                "journal in %s writable again (after: %s): changes are accepted",
                self.state_dir,
                resumed,
            )
        log.info("snapshot generation %d written (%d keys)", generation, len(state.get("keys", ())))

    def compact(self, state: dict[str, Any]) -> None:
        """The start-up's snapshot of the replayed chain (`write_snapshot`). A state dir with
        no room for it (or failing to write) leaves the chain as it is, which is whole: the
        server starts on what it restored and serves it, its changes going to the chain's last
        journal while that has room, and the housekeeping tries the snapshot again
        (`snapshot_errors`), as after a failed background write. Refusing to start would take
        every instance's hits away with the changes."""
        try:
            self.write_snapshot(state)
        except OSError as exc:
            self._snapshot_failed(exc)
            log.error(
                "cannot write the start-up snapshot in %s: %s; serving what was restored from "
                "the last snapshot and the journals after it, which stay (a later snapshot "
                "retries); free space there",
                self.state_dir,
                exc,
            )

    def _snapshot_failed(self, exc: Exception) -> None:
        """A snapshot was not written, the chain kept: the housekeeping's retry counts it."""
        self.snapshot_error = exc
        self.snapshot_errors += 1

    def _next_generation(self, state: dict[str, Any]) -> tuple[int, list[bytes], int]:
        """Generation N+1: its number, `state`'s snapshot of it framed, and the fd of its new,
        empty journal (one a crash left is replaced)."""
        generation = self.generation + 1
        chunks = _frame_chunks(dict(state, generation=generation))
        path = self._journal_path(generation)
        path.unlink(missing_ok=True)
        return generation, chunks, self._open(path)[0]

    def _switch(self, generation: int, fd: int, landed: list[bytes] | None) -> OSError | None:
        """Send appends to `fd`, the empty journal of `generation`, and close the old one (whose
        tail the caller fsynced). `landed`: its snapshot, on disk already, so the state there
        is whole (the errors clear; returns the write error that refused appends, or None).
        None: the old journal stays in the chain until the snapshot lands."""
        with self._lock:  # not while the syncer fsyncs the old fd
            old_fd = self._fd
            self._chain_bytes += self._size
            self.generation = generation
            self._fd, self._size = fd, 0
            self._dirty = False
            resumed = None
            if landed is not None:
                self._landed(landed)
                self.sync_error = None
                resumed, self.write_error = self.write_error, None
            if old_fd >= 0:
                os.close(old_fd)
        return resumed

    def _landed(self, chunks: list[bytes]) -> None:
        """The snapshot of the current generation (`chunks`) is on disk: the chain is its
        journal alone, and its size is the threshold's (`snapshot_threshold`)."""
        self._chain_bytes = 0
        self.snapshot_size = sum(len(chunk) for chunk in chunks)
        self.snapshot_error = None

    def _covered(self, generation: int) -> None:
        """The snapshot of `generation` is renamed into place: fsync the directory (the rename,
        and the name of the journal appends go to), then remove the journals it covers. An
        OSError removes nothing: the chain stays whole whether the rename survives or not."""
        _fsync_dir(self.state_dir)
        self._remove_before(generation)

    def _land(self, generation: int, chunks: list[bytes], keys: int) -> None:
        """The writer thread: the snapshot of `generation` on disk, then the journals it covers
        removed. It touches no registry and no journal fd. A failure is logged and counted and
        leaves the chain as it was (the old snapshot and every journal after it)."""
        try:
            _fsync_dir(self.state_dir)  # the new journal's name: appends go there already
            _check_room(self.state_dir, sum(len(chunk) for chunk in chunks))
            write_private(self.state_dir / SNAPSHOT_NAME, chunks)
            self._covered(generation)
        except Exception as exc:  # (the loop sees it in `snapshot_errors`)
            self._snapshot_failed(exc)
            log.error(
                "background snapshot generation %d in %s failed: %s; the last snapshot and the "
                "journals after it stay (a restart replays them all); a later snapshot retries",
                generation,
                self.state_dir,
                exc,
            )
            return
        self._landed(chunks)  # (no switch meanwhile: one write in flight)
        log.info("snapshot generation %d written (%d keys)", generation, keys)

    def wait_snapshot(self) -> None:
        """Wait until the background write in flight, if any, has landed or failed."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()

    def close(self) -> None:
        """Wait for a background snapshot write, stop the syncer, fsync what is left and close
        the file."""
        self.wait_snapshot()
        with self._lock:  # not between the syncer's look at `_closing` and its clearing the wake
            self._closing.set()
            self._wake.set()
        if self._syncer is not None:
            self._syncer.join()
            self._syncer = None
        if self._fd >= 0:
            self.sync()
            with self._lock:
                os.close(self._fd)
                self._fd = -1
