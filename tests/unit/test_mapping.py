"""`RegionMapper.copying`: a region unmapped while a copy may be using it (another thread's
re-handshake after a server restart) leaves the lookup tables at once but stays mapped until
the last copy in flight has ended; never closed under a running copy."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from maru.client.mapping import RegionMapper
from maru.common.region import RegionHandle

MiB = 1 << 20


def _regions(tmp_path, n: int = 2, size: int = 2 * MiB) -> list[RegionHandle]:
    path = tmp_path / "pool"
    path.write_bytes(b"\x00" * (n * size))
    return [RegionHandle(i + 1, str(path), i * size, size, f"{i + 1:016x}", "w") for i in range(n)]


def test_a_region_unmapped_during_a_copy_is_closed_after_the_last_copy(tmp_path):
    mapper = RegionMapper(retire_s=0.0)
    one, two = (mapper.map(h, writable=True) for h in _regions(tmp_path))
    with mapper.copying():
        with mapper.copying():  # (nested: a read inside a batch's copy block)
            mapper.unmap(1)
            assert mapper.get(1) is None and mapper.rows[:, 0].tolist() == [2]
            assert not one.mm.closed
            ctypes.memset(one.address, 7, 4096)  # still mapped: a copy's bytes land here
        assert not one.mm.closed  # the outer copy still runs
    assert one.mm.closed
    mapper.unmap(2)  # no copy in flight, no grace: closed at once
    assert two.mm.closed
    mapper.close()


def test_an_unmapped_region_stays_mapped_for_its_grace_then_closes(tmp_path):
    """Addresses taken just before an unmap (an allocation, a lookup) may be copied to right
    after it, outside any copy block yet: the region stays mapped for `retire_s`; closing
    the mapper closes it at once."""
    mapper = RegionMapper(retire_s=60.0)
    one, two = (mapper.map(h, writable=True) for h in _regions(tmp_path))
    mapper.unmap(1)
    with mapper.copying():
        ctypes.memset(one.address, 7, 4096)
    assert mapper.get(1) is None and not one.mm.closed
    mapper.retire_s = 0.0
    with mapper.copying():
        pass
    assert one.mm.closed and not two.mm.closed
    mapper.unmap(2)
    mapper.retire_s = 60.0
    three = mapper.map(_regions(tmp_path, 3)[2], writable=True)
    mapper.unmap(3)
    mapper.close()
    assert two.mm.closed and three.mm.closed


CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    from maru.common import memcopy
    from maru.client.mapping import RegionMapper
    from maru.common.region import RegionHandle

    MiB = 1 << 20
    path, guarded = sys.argv[1], sys.argv[2] == "1"
    mapper = RegionMapper()
    region = mapper.map(RegionHandle(1, path, 0, 64 * MiB, "00000000000000aa", "w"), writable=True)
    src = np.ones(64 * MiB, np.uint8)
    starts = region.address + np.arange(64, dtype=np.int64) * MiB
    buffers = (src.ctypes.data + np.arange(64, dtype=np.int64) * MiB).reshape(64, 1)
    copying = threading.Event()
    if not guarded:
        mapper.retire_s = 0.0

    def copy():  # (its addresses taken before, as an allocation's or a lookup's)
        for _ in range(40):
            if guarded:
                with mapper.copying():
                    copying.set()
                    memcopy.copy_values(starts, buffers, [MiB], to_values=True, threads=2)
            else:
                copying.set()
                try:
                    memcopy.copy_values(starts, buffers, [MiB], to_values=True, threads=2)
                except memcopy.CopyFaultError as exc:  # (the copy loops' guard)
                    print("faulted", int(memcopy.faulted(exc).sum()), flush=True)
                    return

    thread = threading.Thread(target=copy)
    thread.start()
    copying.wait(10)
    time.sleep(0.01)
    mapper.unmap(1)  # as a re-handshake on another thread does
    thread.join(60)
    print("done", flush=True)
    """
)


def test_close_listeners_hear_of_a_region_before_it_is_closed_and_only_then(tmp_path):
    """What undoes a CUDA registration (`maru_sglang.cuda`): told the region's address once,
    while still mapped (bytes still writable there), after the last copy that could use it."""
    mapper = RegionMapper(retire_s=0.0)
    heard: list[tuple[int, bool]] = []
    mapped = {}

    def listener(address: int) -> None:
        region = next(m for m in mapped.values() if m.address == address)
        ctypes.memset(address, 1, 16)  # still mapped: this would crash after the close
        heard.append((address, region.mm.closed))

    mapper.add_close_listener(listener)
    for handle in _regions(tmp_path):
        mapped[handle.region_id] = mapper.map(handle, writable=True)
    with mapper.copying():
        mapper.unmap(1)
        assert heard == []  # a copy may still use it
    assert heard == [(mapped[1].address, False)] and mapped[1].mm.closed
    mapper.close()
    assert heard == [(mapped[1].address, False), (mapped[2].address, False)]


def test_a_region_unmapped_by_another_thread_never_crashes_a_running_copy(tmp_path):
    """A thread copies 64 MiB into a region again and again (no GIL) inside `copying()`,
    with addresses taken before; another unmaps the region meanwhile: the copies run to their
    end. (Without the guard and the grace the same child's copy faults on the closed mapping:
    checked below; the copy loop takes the SIGSEGV as a failed copy, `CopyFaultError`, where it
    used to kill the process.)"""
    path = tmp_path / "pool"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"
    unguarded = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert unguarded.returncode == 0, unguarded.stderr[-2000:]  # (no SIGSEGV: it lives)
    faulted, done_line = unguarded.stdout.split("\n")[:2]
    assert faulted.startswith("faulted ") and int(faulted.split()[1]) > 0  # (the fault is real)
    assert done_line == "done"


def test_the_copy_gate_calls_back_once_the_last_block_closes_and_only_when_wanted():
    """`copying()`'s C block: nested and shared blocks count; the mapper hears of the last
    one's end only while it asked to (a retired region waits), so a copy costs no Python
    call otherwise."""
    from maru.common._memcopy import CopyGate

    calls: list[int] = []
    gate = CopyGate(lambda: calls.append(gate.active))
    with gate, gate:
        assert gate.active == 2
    assert gate.active == 0 and calls == []  # not wanted: no call
    gate.wanted = True
    with gate:
        with gate:
            pass
        assert calls == []  # one block still open
    assert calls == [0]
    with pytest.raises(KeyError), gate:  # an exception in the block goes on
        raise KeyError("x")
    assert gate.active == 0 and calls == [0, 0]
