"""P7 in process: the pool generation in tokens and the identity record, region ids that go on
upward across pool lives, truncation at start, the runtime pool check, and client remapping
on a changed token."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from maru.client.mapping import RegionMapper
from maru.common.region import RegionHandle
from maru.server import state_dir
from maru.server.pool import DevDaxPool, ShmPool
from maru.server.token import TokenSigner

MiB = 1 << 20


def test_tokens_sign_the_generation():
    fields = (1, "/dev/shm/p", 0, 2 * MiB)
    legacy = TokenSigner(b"k" * 32)
    first, second = TokenSigner(b"k" * 32, "a" * 16), TokenSigner(b"k" * 32, "b" * 16)
    assert len({legacy.sign(*fields), first.sign(*fields), second.sign(*fields)}) == 3
    assert first.verify(first.sign(*fields), *fields)
    assert not second.verify(first.sign(*fields), *fields)


def test_generation_is_kept_for_the_same_pool_and_new_otherwise(tmp_path):
    state, path = tmp_path / "state", str(tmp_path / "pool")
    state.mkdir()
    gen, first_id = state_dir.pool_generation(state, ShmPool(path, 8 * MiB))
    assert len(gen) == 16 and first_id == 1
    assert state_dir.pool_generation(state, ShmPool(path, 8 * MiB)) == (gen, 1)  # same file
    (state / "journal-0.log").write_bytes(
        b"".join(_frames([["R", 41, "i", path, 0, 2 * MiB, "t"]]))
    )
    again, first_id = state_dir.pool_generation(state, ShmPool(path, 8 * MiB), no_restore=True)
    assert again != gen and first_id == 42  # above every id the old state named
    assert not list(state.glob("journal-*.log"))
    record = json.loads((state / state_dir.POOL_IDENTITY).read_text())
    assert record["generation"] == again and record["next_region_id"] == 42
    os.unlink(path)  # recreated: the id floor survives in the identity record
    third, first_id = state_dir.pool_generation(state, ShmPool(path, 8 * MiB))
    assert third not in (gen, again) and first_id == 42


def test_a_truncated_file_is_a_new_generation_in_a_new_file(tmp_path):
    state, path = tmp_path / "state", str(tmp_path / "pool")
    state.mkdir()
    gen, _ = state_dir.pool_generation(state, ShmPool(path, 8 * MiB))
    os.truncate(path, 3 * MiB)
    pool = ShmPool(path, 8 * MiB)
    assert pool.truncated_from == 3 * MiB
    old_fd = os.open(path, os.O_RDONLY)  # as a client that still maps the old file
    try:
        new, _ = state_dir.pool_generation(state, pool)
        assert new != gen
        assert os.fstat(old_fd).st_nlink == 0  # the old file is gone, the path is a new one
        assert os.stat(path).st_ino != os.fstat(old_fd).st_ino
        assert os.stat(path).st_size == pool.file_bytes  # (capacity and the mark's page)
    finally:
        os.close(old_fd)
    assert ShmPool(path, 8 * MiB).truncated_from is None


def test_the_runtime_check_sees_a_deleted_replaced_or_shrunk_pool(tmp_path):
    path = str(tmp_path / "pool")
    pool = ShmPool(path, 8 * MiB, lock=True)  # (its open fd keeps the inode from reuse)
    assert pool.changed() is None
    os.truncate(path, 4 * MiB)
    assert pool.changed() == f"shrank to {4 * MiB} bytes (capacity {8 * MiB})"
    os.unlink(path)
    assert pool.changed() == "was deleted"
    ShmPool(path, 8 * MiB)
    assert pool.changed() == "was replaced by another file"
    pool.close()


def test_the_client_remaps_a_region_whose_token_changed(tmp_path):
    """Same region id, path, offset and length, another token (another pool generation): the
    mapping is made again, so it shows the file now at that path."""
    path = tmp_path / "pool"
    path.write_bytes(b"old!" * MiB)
    mapper = RegionMapper()
    old = RegionHandle(1, str(path), 0, 2 * MiB, "token-of-gen-1", "w")
    assert bytes(mapper.map(old, writable=False).view[:4]) == b"old!"
    os.unlink(path)
    path.write_bytes(b"new!" * MiB)
    assert bytes(mapper.map(old, writable=False).view[:4]) == b"old!"  # an equal handle
    new = RegionHandle(1, str(path), 0, 2 * MiB, "token-of-gen-2", "w")
    assert bytes(mapper.map(new, writable=False).view[:4]) == b"new!"
    assert mapper.view(1, 0, 4) is not None and bytes(mapper.view(1, 0, 4)) == b"new!"
    mapper.close()


def _frames(records: list) -> list[bytes]:
    from maru.server.journal import _frame

    return [_frame(r) for r in records]


def test_saved_state_without_a_pool_identity_is_not_restored(tmp_path):
    """Nothing says which pool it points into: a miss is safer than a guess."""
    state, path = tmp_path / "state", str(tmp_path / "pool")
    state.mkdir()
    ShmPool(path, 8 * MiB)
    (state / "journal-0.log").write_bytes(b"".join(_frames([["D", ["k"]]])))
    assert not state_dir.same_pool_as_before(state, ShmPool(path, 8 * MiB))


def _pools(tmp_path, kind: str):
    """A new pool object on the same file each call, as each server start opens it."""
    if kind == "shm":
        return lambda: ShmPool(str(tmp_path / "pool"), 8 * MiB)
    dev = tmp_path / "dax0.0"  # a devdax stand-in: no new file, no new inode, ever
    with open(dev, "wb") as f:
        f.truncate(16 * MiB)
    return lambda: DevDaxPool(str(dev))


@pytest.mark.parametrize("kind", ["shm", "devdax"])
def test_a_pool_served_from_another_state_since_is_not_restored(tmp_path, kind):
    """Issue 40, case 1, in process: a state with no record of the pool starts it fresh,
    never adopts it; the state that served it before then finds the pool's mark not its own.
    A copy of a state dir that served the pool since counts as another state too."""
    pool, one, two = _pools(tmp_path, kind), tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    first, _ = state_dir.pool_generation(one, pool())
    assert state_dir.pool_generation(one, pool())[0] == first  # restarts keep it
    assert not state_dir.same_pool_as_before(two, pool())  # no record: not adopted
    second, _ = state_dir.pool_generation(two, pool())
    assert second != first and pool().read_mark()[0] == second
    assert not state_dir.same_pool_as_before(one, pool())  # (for devdax only the mark tells)
    third, _ = state_dir.pool_generation(one, pool())
    assert third not in (first, second)
    shutil.copytree(one, tmp_path / "copy")
    assert state_dir.pool_generation(tmp_path / "copy", pool())[0] == third  # the copy restores
    assert not state_dir.same_pool_as_before(one, pool())  # and the original no longer matches


@pytest.mark.parametrize("kind", ["shm", "devdax"])
def test_a_start_killed_between_the_marks_two_writes_starts_fresh_next(tmp_path, kind, monkeypatch):
    """The pool's mark is written before the state's record: a crash in between leaves them
    different, and the next start is fresh, not a restore."""
    pool, state = _pools(tmp_path, kind), tmp_path / "state"
    state.mkdir()
    first, _ = state_dir.pool_generation(state, pool())

    def killed(*_args: object) -> None:
        raise KeyboardInterrupt  # (stands in for SIGKILL after the mark was written)

    with monkeypatch.context() as m:
        m.setattr(state_dir, "_write_identity", killed)
        with pytest.raises(KeyboardInterrupt):
            state_dir.pool_generation(state, pool())
    assert (
        pool().read_mark()[1] != json.loads((state / state_dir.POOL_IDENTITY).read_text())["epoch"]
    )
    assert not state_dir.same_pool_as_before(state, pool())
    assert state_dir.pool_generation(state, pool())[0] != first


@pytest.mark.parametrize("kind", ["shm", "devdax"])
def test_a_start_refused_for_want_of_room_keeps_the_state_for_the_next(tmp_path, kind, monkeypatch):
    """The state dir full when the record is written (ENOSPC): that start fails, and the pool
    gets the mark of the state still on disk back, so the next start restores it."""
    pool, state = _pools(tmp_path, kind), tmp_path / "state"
    state.mkdir()
    first, _ = state_dir.pool_generation(state, pool())

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(state_dir, "_write_identity", full)
        with pytest.raises(OSError):
            state_dir.pool_generation(state, pool())
    assert state_dir.same_pool_as_before(state, pool())
    assert state_dir.pool_generation(state, pool())[0] == first


def test_a_damaged_mark_is_none(tmp_path):
    pool = ShmPool(str(tmp_path / "pool"), 8 * MiB)
    assert pool.read_mark() is None  # a new file: zeros
    pool.write_mark("a" * 16, "b" * 16)
    assert pool.read_mark() == ("a" * 16, "b" * 16)
    with open(pool.path, "r+b") as f:
        f.seek(pool.mark_offset + 12)
        f.write(b"X")  # a torn or stray write
    assert pool.read_mark() is None
