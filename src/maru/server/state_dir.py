"""The state dir's and the pool's identity across restarts: which pool a state dir serves.

The state dir holds the token secret, the registry's journal and snapshot, and the pool
identity record (`pool-identity.json`). Persisted keys point into the pool's memory, so a
restart must know whether the pool on disk is the very one the state describes (same file or
device, same capacity, and no other server has served it since: the pool's mark), or the
restored keys would point at someone else's bytes. This module holds the first rule at that
boundary (a hit is the bytes written under the key, or a miss): it records and checks the
identity, picks the pool's generation and first region id, claims the pool for this start,
discards or purges what may not be restored, and locks and secures the directory.
`maru.server.cli` only decides, from the flags, when to call it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

from maru.common.config import fmt_bytes, size_arg
from maru.server.journal import SNAPSHOT_NAME, read_records, write_private
from maru.server.localindex import remove_tables
from maru.server.pool import (
    FsDaxPool,
    Pool,
    _flock,
    check_owner,
    check_pool_file,
    lock_with_pid,
    new_generation,
    symlink_refusal,
)
from maru.server.token import CURVE_PUBLIC_FILE, CURVE_SECRET_FILE, SECRET_FILE

log = logging.getLogger("maru.server")

POOL_IDENTITY = "pool-identity.json"


def pool_size_change(args: argparse.Namespace, pool_path: str, state_dir: Path) -> str | None:
    """Why this start must not go on: the saved keys of this very pool were written with
    another --pool-size (serving them would need the old size; starting empty would drop them
    silently). None when there is nothing to lose or --no-restore says to drop it."""
    previous = _read_identity(state_dir)
    if args.no_restore or not isinstance(previous, dict) or previous.get("retired"):
        return None
    old = previous.get("capacity")
    if (
        previous.get("kind") not in ("shm", "fsdax")
        or previous.get("path") != pool_path
        or old == args.pool_bytes
        or not isinstance(old, int)
        or not os.path.exists(pool_path)
        or not _has_state(state_dir)
    ):
        return None
    return (
        f"pool {pool_path} holds keys saved (in {state_dir}) with --pool-size {size_arg(old)} "
        f"({fmt_bytes(old)}), not {args.pool_size}: start with --pool-size {size_arg(old)} to "
        "serve them, or add --no-restore to start empty with the new size"
    )


def purge_pool(
    pool_path: str,
    *,
    capacity: int = 0,
    known: tuple[int, int] | None = None,
    created: tuple[int, int] | None = None,
    dry_run: bool = False,
) -> str | None:
    """Delete a stopped server's pool (a shm file, or an fsdax directory's region files and
    lock); a devdax device stays. What was removed, or None if nothing was there. Raises
    `PoolError` while a server holds it.

    Only a pool is removed: a symbolic link at the path, another user's file or directory (or
    one every user may write), a file that is not a Maru pool (`check_pool_file`; `capacity`
    and `known`: the pool size and the file the server's state recorded) are refused
    (`PoolPathError`) and left. `created`: (st_dev, st_ino) of what a failed start made, the
    one thing then removed (anything else at the path is left). `dry_run`: only those checks."""
    bare = pool_path.rstrip("/") or "/"
    try:
        st = os.lstat(bare)
    except FileNotFoundError:
        return None
    if created is not None and (st.st_dev, st.st_ino) != created:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise symlink_refusal(bare)
    path = Path(bare)
    if stat.S_ISDIR(st.st_mode):
        check_owner(bare, st)
        if dry_run:
            return None
        files = [*path.glob("region-*.mem")]
        lock_fd = lock_with_pid(path / FsDaxPool.LOCK_FILE, f"pool {bare}")
        try:
            size = sum(f.lstat().st_size for f in files)
            for f in files:
                f.unlink()
            (path / FsDaxPool.MARK_FILE).unlink(missing_ok=True)
            (path / FsDaxPool.LOCK_FILE).unlink(missing_ok=True)
        finally:
            os.close(lock_fd)
        with contextlib.suppress(OSError):
            path.rmdir()  # only if nothing else is in it
        return f"pool {bare} ({len(files)} region files, {fmt_bytes(size)})"
    if not stat.S_ISREG(st.st_mode):
        return None
    fd = os.open(bare, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if created is not None and (st.st_dev, st.st_ino) != created:
            return None
        if created is None:
            check_pool_file(bare, fd, st, capacity, known)
        if dry_run:
            return None
        _flock(fd, f"pool {bare}")
        now = os.lstat(bare)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None  # (replaced meanwhile: not the file checked)
        remove_tables("shm", pool_path)
        path.unlink()
        size = st.st_size
    finally:
        os.close(fd)
    return f"pool {bare} ({fmt_bytes(size)})"


STATE_FILES = (SECRET_FILE, CURVE_SECRET_FILE, CURVE_PUBLIC_FILE, SNAPSHOT_NAME, POOL_IDENTITY)


def purge_state(state_dir: Path) -> str | None:
    """Delete the server's files in `state_dir` (secret, journal, snapshot, pool identity,
    lock) and the directory if that empties it; other files are left alone. Raises
    `PoolError` while a server runs on it."""
    if not state_dir.is_dir():
        return None
    lock = state_dir / "server.lock"
    lock_fd = lock_with_pid(lock, f"state dir {state_dir}")
    try:
        names = [*STATE_FILES, *(n + ".tmp" for n in STATE_FILES)]  # (see write_private)
        files = [state_dir / n for n in names] + [*state_dir.glob("journal-*.log")]
        removed = 0
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                removed += 1
        lock.unlink(missing_ok=True)
    finally:
        os.close(lock_fd)
    with contextlib.suppress(OSError):
        state_dir.rmdir()
    return f"state dir {state_dir} ({removed} files)"


def purge(pool_path: str, state_dir: Path, capacity: int = 0) -> int:
    """`maru-server --purge`: the one command that removes a stopped server's pool and state
    (the pool only if it is one: checked before anything is removed)."""
    known = recorded_pool(state_dir, pool_path)
    try:
        purge_pool(pool_path, capacity=capacity, known=known, dry_run=True)
        removed = [
            r
            for r in (
                purge_state(state_dir),
                purge_pool(pool_path, capacity=capacity, known=known),
            )
            if r
        ]
    except (OSError, RuntimeError) as exc:
        print(f"maru-server: cannot purge: {exc}", file=sys.stderr)
        return 1
    print(f"removed {' and '.join(removed)}" if removed else "nothing to purge")
    return 0


def _identity(pool: Pool) -> dict[str, Any]:
    st = os.stat(pool.path)
    return {
        "kind": pool.kind,
        "path": pool.path,
        "dev": st.st_dev,
        "ino": st.st_ino,
        "capacity": pool.capacity,
    }


def recorded_pool(state_dir: Path, pool_path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the shm pool file at `pool_path` as the state in `state_dir`
    recorded it (`_identity`), if it did: that file is this server's pool, even with its mark
    gone (truncated, say)."""
    with contextlib.suppress(OSError):
        record = _read_identity(state_dir)
        if isinstance(record, dict) and (record.get("kind"), record.get("path")) == (
            "shm",
            pool_path,
        ):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                return int(record["dev"]), int(record["ino"])
    return None


def _read_identity(state_dir: Path) -> dict[str, Any] | str | None:
    """The pool identity record; None if there is none, "unreadable" if it is damaged."""
    try:
        record = json.loads((state_dir / POOL_IDENTITY).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return "unreadable"
    return record if isinstance(record, dict) else "unreadable"


def _write_identity(state_dir: Path, record: dict[str, Any]) -> None:
    write_private(state_dir / POOL_IDENTITY, json.dumps(record).encode())


def _has_state(state_dir: Path) -> bool:
    """Whether there is a saved registry to restore (an empty journal is none)."""
    journals = state_dir.glob("journal-*.log")
    return (state_dir / SNAPSHOT_NAME).exists() or any(j.stat().st_size for j in journals)


def same_pool_as_before(state_dir: Path, pool: Pool) -> bool:
    """Whether the saved state may be restored: persisted keys point into the pool's memory,
    so they are only valid for the very same pool file or device (a recreated /dev/shm file,
    e.g. after a reboot, has another inode), and only if no other server (another state dir,
    or a copy of this one) has served it since: the pool's mark (`Pool.read_mark`) must be
    the generation and epoch this state last wrote into it (`claim_pool`).

    No record is no: the pool may hold another server's bytes, and is started fresh. On a
    mismatch (or an unreadable or retired record) the old identity is kept, so a server that
    dies before `discard_state` still refuses the old state next time; `discard_state`
    removes it."""
    previous, current = _read_identity(state_dir), _identity(pool)
    if previous is None:
        if _has_state(state_dir):
            log.warning("registry state without a pool identity: starting empty")
        else:
            log.info(
                "pool %s: no record of it in %s (it may hold another server's bytes): "
                "starting it fresh",
                pool.path,
                state_dir,
            )
        return False
    if (
        not isinstance(previous, dict)
        or previous.get("retired")
        or any(previous.get(k) != v for k, v in current.items())
    ):
        log.warning(
            "pool changed since the registry was saved (%s -> %s): starting empty",
            previous,
            current,
        )
        return False
    mark, recorded = pool.read_mark(), (previous.get("generation"), previous.get("epoch"))
    if mark != recorded:
        log.warning(
            "pool %s was served by another maru-server (or another copy of %s) since this "
            "state was saved: the pool's mark is %s, this state's %s: starting empty (its "
            "bytes are not this state's)",
            pool.path,
            state_dir,
            "/".join(mark) if mark else "none",
            "/".join(map(str, recorded)),
        )
        return False
    return True


def region_id_floor(state_dir: Path) -> int:
    """The first region id a new generation may use: above every id the saved state (and the
    identity record) ever named, so that a client that outlived the old pool never confuses
    one of its regions with a new one of the same id."""
    floor = 1
    identity = _read_identity(state_dir)
    if isinstance(identity, dict):
        with contextlib.suppress(TypeError, ValueError):
            floor = max(floor, int(identity.get("next_region_id", 1)))
    for path in [state_dir / SNAPSHOT_NAME, *state_dir.glob("journal-*.log")]:
        try:
            records, _ = read_records(path.read_bytes())
        except OSError:
            continue
        for record in records:
            with contextlib.suppress(TypeError, ValueError, KeyError, IndexError):
                if isinstance(record, dict):  # a snapshot
                    floor = max(floor, int(record["next_region_id"]))
                    floor = max(floor, *(int(r[0]) + 1 for r in record["regions"]))
                elif record[0] == "R":
                    floor = max(floor, int(record[1]) + 1)
    return floor


def pool_generation(state_dir: Path, pool: Pool, *, no_restore: bool = False) -> tuple[str, int]:
    """Which life of the pool this start serves: (generation, lowest region id to hand out).

    The same pool as the saved state keeps its generation (tokens stay valid). Anything else
    (a new, recreated or truncated file, another device or capacity, `--no-restore`) starts
    a new generation: the saved state is discarded, the pool made fresh (`Pool.start_fresh`)
    and region ids continue above all earlier ones."""
    if pool.truncated_from is not None:
        log.warning(
            "pool %s is %d bytes, shorter than its capacity %d (truncated: its bytes are "
            "gone): starting empty",
            pool.path,
            pool.truncated_from,
            pool.capacity,
        )
        same = False
    elif getattr(pool, "created", False):
        # (its inode number may be an old one's, reused: only we know the file is new)
        if _has_state(state_dir):
            log.warning(
                "pool changed: %s was created anew (the old one is gone): starting empty", pool.path
            )
        same = False
    else:
        same = not no_restore and same_pool_as_before(state_dir, pool)
    previous = _read_identity(state_dir)
    if same and isinstance(previous, dict):
        claim_pool(state_dir, pool, previous)
        return str(previous.get("generation", "")), int(previous.get("next_region_id", 1))
    floor = region_id_floor(state_dir)
    pool.start_fresh()
    discard_state(state_dir)
    generation = new_generation()
    claim_pool(
        state_dir, pool, {**_identity(pool), "generation": generation, "next_region_id": floor}
    )
    log.info("pool %s: new generation %s (region ids from %d)", pool.path, generation, floor)
    return generation, floor


def claim_pool(state_dir: Path, pool: Pool, record: dict[str, Any]) -> None:
    """Bind the pool to this state for this start: a new epoch, written into the pool's mark
    and then into the identity record. Any other state that matched the pool before (a state
    dir that served it earlier, a copy of this one) no longer does. A crash between the two
    writes leaves them different: the next start starts fresh, never restores. A record that
    could not be written (the state dir full) gives the pool back the mark of the state still
    on disk, whose start this never became: a start refused for want of room does not cost
    the next one its keys."""
    generation, epoch = str(record.get("generation", "")), new_generation()
    pool.write_mark(generation, epoch)
    try:
        _write_identity(state_dir, {**record, "epoch": epoch})
    except OSError:
        if isinstance(record.get("epoch"), str):  # (the saved state's own claim)
            pool.write_mark(generation, record["epoch"])
        raise


def retire_pool_identity(state_dir: Path, reason: str) -> None:
    """The pool's bytes were lost while serving: the saved state must never be restored."""
    record = _read_identity(state_dir)
    if isinstance(record, dict):
        _write_identity(state_dir, {**record, "retired": reason})


def discard_state(state_dir: Path) -> None:
    for path in [state_dir / SNAPSHOT_NAME, *state_dir.glob("journal-*.log")]:
        path.unlink(missing_ok=True)
    (state_dir / POOL_IDENTITY).unlink(missing_ok=True)  # last: see same_pool_as_before


def lock_state_dir(state_dir: Path) -> int:
    """One server per state dir: a second one (same port by mistake, or a restart while the
    old process still runs) must not replay or rewrite the journal the first one is writing."""
    secure_state_dir(state_dir)
    return lock_with_pid(state_dir / "server.lock", f"state dir {state_dir}")


def secure_state_dir(state_dir: Path) -> None:
    """The state dir holds the secret that signs tokens and sessions, and the registry: only
    the server's user may read it. Created 0700; an existing one, and the files in it, lose
    their group and other permissions (logged)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in [state_dir, *state_dir.iterdir()]:
        st = path.lstat()
        if (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) and st.st_mode & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
            log.warning(
                "%s was mode %o: now %o (state files are for maru-server's user only)",
                path,
                stat.S_IMODE(st.st_mode),
                stat.S_IMODE(st.st_mode) & 0o700,
            )
