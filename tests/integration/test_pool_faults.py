"""No fault in the pool kills an inference process (issue 40, case 6). Each case runs a real
client process (`pool_faults_child.py`) against a real `maru-server` and checks first that
the process lives (before: SIGBUS or SIGSEGV), then that every hit it read is the bytes that
were stored and that what faulted came back as a failed store or a miss:

- the pool file truncated under a reader (the ~1 s before the server notices), also with the
  key index inside the pool (`--index-slots auto`: the probe meets the fault first);
- a 32 MiB pool on a 40 MiB tmpfs: the server makes no local index there (its table would
  take the pages the pool still needs), so a writer fills the whole pool;
- the pool's tmpfs filled by another file after start: stores into pages that cannot be
  allocated any more fail, the process lives;
- `close()` while another thread copies from a lookup's addresses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .tmpfs import can_mount_tmpfs, run_on_tmpfs

CHILD = Path(__file__).with_name("pool_faults_child.py")

needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a tmpfs (root)")


def report(done: subprocess.CompletedProcess) -> dict:
    """The child's JSON line, once it is clear that it lived."""
    if done.returncode < 0 or done.returncode > 128:  # (sh's 128 + n for a signal n)
        number = -done.returncode if done.returncode < 0 else done.returncode - 128
        pytest.fail(f"the client died of {signal.Signals(number).name}: {done.stderr[-2000:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=300
    )
    return report(done)


@pytest.mark.parametrize("coherence", ["hardware", "software"])
@pytest.mark.parametrize(
    "local, in_pool",
    [("1", False), ("1", True), ("0", False)],
    ids=["local-index", "in-pool-index", "requests"],
)
def test_a_pool_truncated_under_a_reader_gives_misses_not_a_dead_reader(
    maru_server_factory, local, in_pool, coherence
):
    """(With software coherence a reader's first touch of a value is its invalidation of
    the value's lines: the fault comes in a flush, and is a miss all the same. With the
    index inside the pool, `--index-slots auto`, the truncation takes the table too: the
    probe itself faults, and the batch goes the request way, which misses.)"""
    index = ["--index-slots", "auto"] if in_pool else []
    server = maru_server_factory(extra_args=["--coherence", coherence, *index])
    got = run_child("truncate", server.url, server.pool_path, local)
    assert got["coherence"] == coherence
    assert got["stored"] == 16 and got["local"] == (local == "1")
    assert got["in_pool"] == in_pool
    assert got["wrong"] == 0  # every hit, before and after, was the bytes stored
    assert got["after"] == [0] * 5  # every read after the truncation: misses


@needs_tmpfs
def test_a_pool_on_a_tmpfs_without_room_for_the_index_fills_without_a_fault(tmp_path):
    """32 MiB pool, 40 MiB tmpfs: before, the 12.5 MiB index table made after the pool's
    free-space check left the pool's last pages unbacked and the writer died of SIGBUS."""
    got = report(run_on_tmpfs(tmp_path, "size=40M", CHILD, "small", str(tmp_path / "srv")))
    assert not got["local_index"]  # (no room beside the pool: reads go through requests)
    assert len(got["stored"]) == 128 and all(got["stored"])  # the whole pool, 256 KiB each
    assert got["hits"] > 0 and got["wrong"] == 0  # (the oldest were evicted for the newest)


@needs_tmpfs
def test_stores_into_a_tmpfs_filled_by_another_file_fail_and_the_writer_lives(tmp_path):
    got = report(run_on_tmpfs(tmp_path, "size=64M", CHILD, "fill", str(tmp_path / "srv")))
    stored = got["stored"]
    assert all(stored[:8])  # before the tmpfs was filled
    assert not all(stored[8:])  # the fault is real: pages that could not be allocated
    assert got["hits"] == sum(stored) and got["wrong"] == 0  # a failed store is a miss


def test_close_while_another_thread_copies_from_a_lookup_kills_nothing(maru_server):
    got = run_child("close", maru_server.url)
    assert got["copies"] >= 1 and got["wrong"] == 0
    assert got["faulted"] == 1 or got["copies"] == 2000  # a copy after close: failed, no crash
