"""Registry persistence: a checksummed append-only journal plus generation-numbered snapshots.

Why: the pool memory (a /dev/shm file, a devdax device) outlives a `maru-server` process, so
after a crash the pages are still there; only the registry that says where they are is lost.
The journal records every change to regions and keys; a restart loads the newest snapshot and
replays the journal of the same generation.

Durability: each record is written with `os.write` before the request is answered, so a killed
*process* loses nothing (the kernel has the bytes). `fsync` runs at most every
`fsync_interval` seconds (batching), which bounds what a *machine* crash can lose; on a machine
crash a /dev/shm pool is gone anyway, a devdax/fsdax pool is not.

Framing: `[length u32][crc32 u32][msgpack record]`. Replay stops at the first record that is
short or fails its checksum (a torn write at the moment of the crash) and truncates it away.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger(__name__)

FRAME = struct.Struct("!II")
SNAPSHOT_NAME = "snapshot.msgpack"


def _frame(record: Any) -> bytes:
    payload = msgpack.packb(record, use_bin_type=True)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _read_records(data: bytes) -> tuple[list[Any], int]:
    """Decode records until the end or the first damaged one; returns (records, good bytes)."""
    records: list[Any] = []
    pos = 0
    while pos + FRAME.size <= len(data):
        length, crc = FRAME.unpack_from(data, pos)
        start, end = pos + FRAME.size, pos + FRAME.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        try:
            records.append(msgpack.unpackb(data[start:end], raw=False, strict_map_key=False))
        except Exception:  # checksum matched but not msgpack: treat as damage too
            break
        pos = end
    return records, pos


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    def __init__(
        self, state_dir: Path, *, fsync_interval: float = 0.05, snapshot_bytes: int = 64 << 20
    ):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.fsync_interval = fsync_interval
        self.snapshot_bytes = snapshot_bytes
        self.generation = 0
        self._fd = -1
        self._size = 0
        self._dirty = False
        self._last_sync = time.monotonic()
        self.records_written = 0
        self.damaged_bytes_dropped = 0

    def _journal_path(self, generation: int) -> Path:
        return self.state_dir / f"journal-{generation}.log"

    def load(self) -> tuple[dict[str, Any] | None, list[Any]]:
        """Read the snapshot and the journal records after it; open the journal for appends."""
        snapshot = None
        snap_path = self.state_dir / SNAPSHOT_NAME
        if snap_path.exists():
            records, _ = _read_records(snap_path.read_bytes())
            if not records:
                raise RuntimeError(f"snapshot {snap_path} is damaged; refusing to start")
            snapshot = records[0]
            self.generation = int(snapshot["generation"])
        path = self._journal_path(self.generation)
        records: list[Any] = []
        if path.exists():
            data = path.read_bytes()
            records, good = _read_records(data)
            if good < len(data):
                self.damaged_bytes_dropped = len(data) - good
                log.warning(
                    "journal %s: ignoring %d damaged bytes at its tail", path, len(data) - good
                )
                with open(path, "r+b") as f:
                    f.truncate(good)
                    f.flush()
                    os.fsync(f.fileno())
        self._open(path)
        for stale in self.state_dir.glob("journal-*.log"):
            if stale != path:
                stale.unlink(missing_ok=True)
        return snapshot, records

    def _open(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size

    def append(self, record: Any) -> None:
        frame = _frame(record)
        os.write(self._fd, frame)
        self._size += len(frame)
        self._dirty = True
        self.records_written += 1

    def sync(self, force: bool = False) -> None:
        """fsync if there is unsynced data and the batching window has passed (or `force`)."""
        if not self._dirty or self._fd < 0:
            return
        now = time.monotonic()
        if force or now - self._last_sync >= self.fsync_interval:
            os.fsync(self._fd)
            self._dirty = False
            self._last_sync = now

    @property
    def needs_snapshot(self) -> bool:
        return self._size >= self.snapshot_bytes

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Persist the full state as generation N+1 and start an empty journal for it."""
        generation = self.generation + 1
        state = dict(state, generation=generation)
        tmp = self.state_dir / (SNAPSHOT_NAME + ".tmp")
        new_journal = self._journal_path(generation)
        new_journal.unlink(missing_ok=True)
        with open(tmp, "wb") as f:
            f.write(_frame(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_dir / SNAPSHOT_NAME)
        _fsync_dir(self.state_dir)
        old_fd, old_path = self._fd, self._journal_path(self.generation)
        self.generation = generation
        self._open(new_journal)
        os.close(old_fd)
        old_path.unlink(missing_ok=True)
        self._dirty = False
        log.info("snapshot generation %d written (%d keys)", generation, len(state.get("keys", ())))

    def close(self) -> None:
        if self._fd >= 0:
            self.sync(force=True)
            os.close(self._fd)
            self._fd = -1
