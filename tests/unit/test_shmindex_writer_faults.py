"""The server's side of the local index when its mapped memory is cut short under it: with
`--pool-group` the `.use` file is 0660 and the pool file (the in-pool table's home) is mapped
read-write by the group, so a member may truncate either. Every Writer access runs under the
fault guard: a fault is `IndexFaultError`, never SIGBUS; `LocalIndex` then turns itself off,
its table retired (or its header gone) before the call returns, so that no reader proves a copy
of a key whose remove faulted. Each case runs in a forked child: a SIGBUS fails the case, not
the whole test run."""

from __future__ import annotations

import logging
import mmap
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from maru.client.localindex import _open
from maru.common import shmindex
from maru.common.shmindex import (
    HEADER_BYTES,
    SLOT_BYTES,
    USE_SUFFIX,
    IndexFaultError,
    table_bytes,
    table_files,
)
from maru.server import localindex
from maru.server.localindex import LocalIndex

from .test_shmindex import columns, in_pool_reader, pool_with_area, publish

KEYS = [f"k/{i}" for i in range(32)]


def in_child(case: Callable[[], None]) -> None:
    """Run `case` in a forked child: its death by a signal (SIGBUS) or a failed assert fails
    the test with what happened."""
    pid = os.fork()
    if pid == 0:  # (the child: never back into pytest)
        code = 0
        try:
            case()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"the writer's process died of {signal.Signals(os.WTERMSIG(status)).name}")
    assert os.WEXITSTATUS(status) == 0, "the case failed in the child (its traceback above)"


class Errors(logging.Handler):
    """The ERROR records of `maru.server.localindex` (caplog does not cross a fork)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []
        localindex.log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def raw_table(tmp_path: Path, capacity: int = 1024) -> tuple[str, mmap.mmap, mmap.mmap]:
    """A table file and its use file, mapped as the server maps them, formatted empty."""
    path = str(tmp_path / "t.index.1")
    maps = []
    for file, size in ((path, table_bytes(capacity)), (path + USE_SUFFIX, capacity)):
        with open(file, "w+b") as f:
            f.truncate(size)
            maps.append(mmap.mmap(f.fileno(), size))
    shmindex.format_table(maps[0], capacity, b"gen-1", 42)
    return path, maps[0], maps[1]


def columns_of(keys: list[str]) -> tuple:
    n = len(keys)
    return keys, [1] * n, [4096 * i for i in range(n)], [100] * n, None, {1: 7}


def test_every_writer_access_to_a_truncated_use_file_is_a_fault_not_sigbus(tmp_path):
    def case() -> None:
        path, table, use = raw_table(tmp_path)
        writer = shmindex.Writer(table, use)
        assert writer.publish(*columns_of(KEYS)) == 0 and writer.count == len(KEYS)
        os.truncate(path + USE_SUFFIX, 0)
        for call in (
            lambda: writer.publish(*columns_of(["new"])),
            lambda: writer.remove(KEYS[:4]),
            writer.harvest,
        ):
            with pytest.raises(IndexFaultError) as fault:
                call()
            assert isinstance(fault.value, OSError) and "faulted" in str(fault.value)
        writer.note_regions(5)  # (the header: its file is whole)
        writer.retire("")
        reader = shmindex.Reader(table, bytearray(1024))
        assert reader.retired

    in_child(case)


def test_a_truncated_table_file_faults_every_writer_call_and_the_format(tmp_path):
    def case() -> None:
        path, table, use = raw_table(tmp_path)
        writer = shmindex.Writer(table, use)
        writer.publish(*columns_of(KEYS))
        os.truncate(path, 0)
        for call in (
            lambda: writer.publish(*columns_of(["new"])),
            lambda: writer.remove(KEYS),
            lambda: writer.note_regions(3),
            writer.mark_incomplete,
            lambda: writer.retire(""),
            lambda: shmindex.format_table(table, 1024, b"gen-2", 43),
        ):
            with pytest.raises(IndexFaultError):
                call()
        assert writer.count == 0  # (the getter is guarded too)
        with pytest.raises(IndexFaultError):
            shmindex.Writer(table, use)  # (its header checked under the guard)

    in_child(case)


def test_a_remove_that_faults_retires_the_table_before_it_returns(tmp_path):
    """The first rule: the keys a faulted remove may have left in the table are proven to no
    reader once `remove` returns (the registry frees their pages right after)."""

    def case() -> None:
        errors = Errors()
        index = LocalIndex("shm", str(tmp_path / "pool"), "gen-1")
        publish(index, KEYS)
        path = index.path
        reader = _open(path, os.getuid())
        assert reader is not None
        cols = columns(reader, KEYS)
        slots, seqs = cols[5].tobytes(), cols[6].tobytes()
        assert reader.changed(slots, seqs) is None  # proven while the table is current
        os.truncate(path + USE_SUFFIX, 100)

        index.remove(KEYS[:8])  # (no exception: the registry goes on)

        assert reader.retired and reader.changed(slots, seqs) == b"\x01" * len(KEYS)
        assert index.table is None and index.path is None and index.count == 0
        assert not table_files(index.base)  # its files went: no reader opens it again
        assert len(errors.lines) == 1
        line = errors.lines[0]
        assert path + USE_SUFFIX in line and "truncated" in line and "during a remove" in line
        assert "clients use requests" in line
        publish(index, ["later"])  # off: every call is a no-op now
        index.remove(["later"])
        index.note_regions(9)
        assert index.harvest_into({}) == 0
        index.close()
        assert len(errors.lines) == 1

    in_child(case)


def test_a_harvest_or_a_growth_that_faults_turns_the_index_off(tmp_path, monkeypatch):
    def case() -> None:
        errors = Errors()
        index = LocalIndex("shm", str(tmp_path / "a"), "gen-1")
        publish(index, KEYS)
        os.truncate(index.path + USE_SUFFIX, 0)
        assert index.harvest_into({}) == 0 and index.table is None
        assert "during a harvest" in errors.lines[-1]

        monkeypatch.setattr(localindex, "INITIAL_CAPACITY", 64)
        grown = LocalIndex("shm", str(tmp_path / "b"), "gen-1")
        publish(grown, KEYS)  # (half of 64)
        os.truncate(grown.path + USE_SUFFIX, 0)
        publish(grown, ["one more"], base=1 << 20)  # past half: the copy into a bigger one
        assert grown.table is None and not table_files(grown.base)  # both retired, gone
        assert "during growing it" in errors.lines[-1] and len(errors.lines) == 2

    in_child(case)


@pytest.mark.parametrize("cut", ["area", "use"])
def test_an_in_pool_table_cut_off_the_pool_file_turns_the_index_off(tmp_path, cut):
    """`area`: the pool file cut where the table begins (the header too: the retire faults,
    and readers fault on the header the same way, also once the file is grown back: the
    zeros there are another index id); `use`: its use bytes alone (retired)."""

    def case() -> None:
        errors = Errors()
        pool = pool_with_area(tmp_path, 1024)
        index = LocalIndex("shm", pool.path, "gen-1", in_pool=pool)
        publish(index, KEYS)
        reader = in_pool_reader(pool, index)._reader
        cols = columns(reader, KEYS)
        slots, seqs = cols[5].tobytes(), cols[6].tobytes()
        size = os.stat(pool.path).st_size
        os.truncate(pool.path, 4096 if cut == "area" else size - 4096)

        index.remove(KEYS[:8])

        assert index.table is None and index.offer() is None
        assert reader.retired and reader.changed(slots, seqs) == b"\x01" * len(KEYS)
        os.truncate(pool.path, size)  # (grown back: zeros where the table was cut)
        assert reader.retired and reader.changed(slots, seqs) == b"\x01" * len(KEYS)
        (line,) = errors.lines
        assert pool.path in line and "truncated" in line
        assert ("header is gone" in line) == (cut == "area")

    in_child(case)


def test_a_table_whose_every_slot_was_made_live_holds_no_writer_call(tmp_path):
    """The in-pool table lies in memory the group may write: one that made every slot live
    (here: a live slot copied over all of them) must not hold the server in a probe loop. A
    publish finds no empty slot and is a fault (the index then goes off); a remove walks one
    lap at most."""

    def case() -> None:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler is Python:
        signal.alarm(20)  # it never runs inside a C loop) a loop that never ends fails the case
        capacity = 64
        _, table, use = raw_table(tmp_path, capacity)
        writer = shmindex.Writer(table, use)
        assert writer.publish(*columns_of(["k/0"])) == 0
        slots = memoryview(table)[HEADER_BYTES : HEADER_BYTES + capacity * SLOT_BYTES]
        live = next(
            bytes(slots[i * SLOT_BYTES : (i + 1) * SLOT_BYTES])
            for i in range(capacity)
            if slots[i * SLOT_BYTES + 16] == 1  # (the slot's meta: its state, LIVE)
        )
        slots[:] = live * capacity
        with pytest.raises(IndexFaultError, match="no empty slot"):
            writer.publish(*columns_of(["k/new"]))
        assert writer.remove(["k/absent"]) == 0
        assert writer.remove(["k/0"]) == 1  # (the first copy: its shifts stop after a lap)
        slots.release()
        signal.alarm(0)

    in_child(case)


def _scribble_key_length(path: str, slot: int) -> None:
    """Slot `slot`'s key length field (bits 16-31 of its meta) set to 0xffff, past the 128
    bytes a slot holds: what a writer of the table's memory could leave there."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = HEADER_BYTES + slot * SLOT_BYTES + 16
        meta = int.from_bytes(mm[at : at + 8], "little")
        mm[at : at + 8] = (meta | (0xFFFF << 16)).to_bytes(8, "little")


def _home(path: str, slot: int, capacity: int) -> int:
    """The slot a slot's key hashes to (its hash field, offset 8)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        at = HEADER_BYTES + slot * SLOT_BYTES + 8
        return int.from_bytes(mm[at : at + 8], "little") & (capacity - 1)


def _scribbled_slots(path: str, capacity: int) -> list[int]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        metas = [
            int.from_bytes(mm[at : at + 8], "little")
            for at in (HEADER_BYTES + i * SLOT_BYTES + 16 for i in range(capacity))
        ]
    return [i for i, meta in enumerate(metas) if (meta & 0xFF) and (meta >> 16) & 0xFFFF > 128]


def test_a_key_length_scribbled_in_a_slot_is_never_copied_past_its_slot(tmp_path, monkeypatch):
    """The writer reads a slot back when a delete shifts its probe chain and when the table
    grows; a key length there past what a slot holds (128 bytes) is not believed: the shift
    copies at most a slot's key (before: 65,535 bytes over the slots after it, and the stack
    read past the slot's copy), the growth leaves the slot behind. Every other key is found
    where it was published, in the table after each step."""

    def case() -> None:
        monkeypatch.setattr(localindex, "INITIAL_CAPACITY", 64)
        index = LocalIndex("shm", str(tmp_path / "p"), "gen-1")
        keys = [f"k/{i}" for i in range(31)]  # (under half of 64: no growth yet)
        publish(index, keys)
        reader = _open(index.path, os.getuid())
        slots = [int(slot) for slot in columns(reader, keys)[5]]
        homes = [_home(index.path, slot, 64) for slot in slots]
        # a key displaced from its home slot: a delete there shifts it back
        victim = next(i for i, (slot, home) in enumerate(zip(slots, homes)) if slot != home)
        _scribble_key_length(index.path, slots[victim])
        assert _scribbled_slots(index.path, 64) == [slots[victim]]
        others = [k for i, k in enumerate(keys) if i != victim]
        at_home = slots.index(homes[victim])  # (the key in the victim's home slot)
        index.remove([keys[at_home]])
        after = _scribbled_slots(index.path, 64)
        assert len(after) == 1 and after != [slots[victim]]  # shifted back, still one slot
        others.remove(keys[at_home])
        for gone in others[:10]:
            index.remove([gone])
            assert len(_scribbled_slots(index.path, 64)) == 1
        kept = others[10:]
        found = columns(_open(index.path, os.getuid()), kept)
        assert found is not None and list(found[4]) == [4096 * keys.index(k) for k in kept]
        # the growth: the scribbled slot is left behind, every other key copied
        publish(index, [f"more/{i}" for i in range(40)], base=1 << 20)
        assert index.table is not None and index.table.capacity > 64
        bigger = _open(index.path, os.getuid())
        found = columns(bigger, kept)
        assert found is not None and list(found[4]) == [4096 * keys.index(k) for k in kept]
        assert _scribbled_slots(index.path, index.table.capacity) == []

    in_child(case)
