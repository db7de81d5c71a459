"""`maru.common.memcopy.copy_many`: the one loop over page parts on the data path."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from maru.common import memcopy

from .maru64 import hash64


def _addresses(buf: np.ndarray, offsets: list[int]) -> np.ndarray:
    return np.array(offsets, dtype=np.int64) + buf.ctypes.data


def test_copy_many_moves_each_part_to_its_own_place():
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 64 * 1024, dtype=np.uint8)
    dst = np.zeros_like(src)
    size = 4096
    order = [5, 0, 12, 3, 9]  # scattered, out of order
    memcopy.copy_many(
        _addresses(dst, [i * size for i in range(len(order))]),
        _addresses(src, [i * size for i in order]),
        size,
    )
    for slot, part in enumerate(order):
        assert np.array_equal(
            dst[slot * size : (slot + 1) * size], src[part * size : (part + 1) * size]
        )
    assert not dst[len(order) * size :].any()  # nothing written past the parts


def test_values_of_parts_of_unlike_sizes_are_copied_value_by_value():
    """(values, parts) addresses with one size per part (a Mamba state's temporal and conv
    parts; K and V): every part lands whole at its own place, nothing around it is written."""
    rng = np.random.default_rng(8)
    sizes = [5000, 4096 + 13, 7]
    page = sum(sizes) + 64  # a gap after each page that must stay zero
    src = rng.integers(0, 256, 4 * page, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.cumsum([0, *sizes[:-1]])
    starts = np.arange(4) * page
    memcopy.copy_many(
        _addresses(dst, (starts[:, None] + offsets).ravel().tolist()).reshape(4, 3),
        _addresses(src, (starts[::-1, None] + offsets).ravel().tolist()).reshape(4, 3),
        sizes,
    )
    for i in range(4):
        j = 3 - i  # the pages in reverse
        got, want = dst[i * page : (i + 1) * page], src[j * page : (j + 1) * page]
        assert np.array_equal(got[: sum(sizes)], want[: sum(sizes)])
        assert not got[sum(sizes) :].any()
    with pytest.raises(ValueError, match="sizes"):
        memcopy.copy_many(
            _addresses(dst, [0, 8]).reshape(1, 2), _addresses(src, [0, 8]).reshape(1, 2), [1]
        )


@pytest.mark.parametrize("hashed", [False, True], ids=["plain", "hashed"])
def test_copy_values_stores_and_loads_values_of_parts_and_skips_misses(hashed):
    """`copy_values`: a value is its parts back to back (a page in the pool), each part's other
    side its own buffer (host pool pages, scattered). A store lays the parts end to end; a load
    puts them back; a 0 start is a miss, left alone (hash 0); each hash is the value's maru64."""
    rng = np.random.default_rng(9)
    sizes = [5000, 4096 + 13, 7]
    value = sum(sizes)
    host = rng.integers(0, 256, 12 * 8192, dtype=np.uint8)  # part j of value i: slot 3i + j
    slots = np.array([[3 * i + j for j in range(3)] for i in range(4)])[::-1]  # out of order
    buffers = slots * 8192 + host.ctypes.data
    pool = np.zeros(4 * (value + 64), dtype=np.uint8)  # a gap after each value stays zero
    starts = np.arange(4, dtype=np.int64) * (value + 64) + pool.ctypes.data
    got = memcopy.copy_values(starts, buffers, sizes, to_values=True, hashed=hashed)
    for i in range(4):
        want = b"".join(host[s * 8192 : s * 8192 + n].tobytes() for s, n in zip(slots[i], sizes))
        stored = pool[i * (value + 64) : (i + 1) * (value + 64)]
        assert stored[:value].tobytes() == want and not stored[value:].any()
        if hashed:
            assert got[i] == hash64(want)
    assert got is None or got.shape == (4,)

    before = host.copy()
    host[:] = 0
    skip = starts.copy()
    skip[2] = 0  # a miss
    got = memcopy.copy_values(skip, buffers, sizes, to_values=False, hashed=hashed)
    for i in range(4):
        for s, n in zip(slots[i], sizes):
            part = host[s * 8192 : s * 8192 + n]
            assert np.array_equal(part, before[s * 8192 : s * 8192 + n]) == (i != 2)
            assert i != 2 or not part.any()
    if hashed:
        assert got[2] == 0 and got[0] == hash64(pool[:value].tobytes())
    with pytest.raises(ValueError, match="buffers"):
        memcopy.copy_values(starts, buffers[:, :2], sizes, to_values=False)


def test_a_numpy_integer_is_one_size_for_every_buffer():
    src = np.arange(8192, dtype=np.uint8)
    dst = np.zeros_like(src)
    memcopy.copy_many(_addresses(dst, [0, 4096]), _addresses(src, [4096, 0]), np.int64(4096))
    assert np.array_equal(dst[:4096], src[4096:]) and np.array_equal(dst[4096:], src[:4096])


def test_copy_many_refuses_mismatched_or_mistyped_addresses():
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="destinations"):
        memcopy.copy_many(_addresses(buf, [0, 16]), _addresses(buf, [32]), 8)
    from maru.common._memcopy import copy_many

    with pytest.raises(TypeError, match="int64"):
        copy_many(np.zeros(2, dtype=np.int32), np.zeros(2, dtype=np.int32), 8)
    with pytest.raises(ValueError, match="negative"):
        copy_many(_addresses(buf, [0]), _addresses(buf, [8]), -1)
    with pytest.raises(ValueError, match="negative"):
        copy_many(_addresses(buf, [0]), _addresses(buf, [8]), np.array([-1], np.int64))
    with pytest.raises(ValueError, match="sizes"):
        copy_many(_addresses(buf, [0]), _addresses(buf, [8]), np.array([1, 2], np.int64))


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "memmove"])
@pytest.mark.parametrize(
    ("dst_shift", "src_shift", "size"),
    [
        (0, 0, 32 * 1024),  # SGLang's case: aligned parts, whole lines
        (3, 0, 32 * 1024 + 5),  # unaligned destination: a head and a tail around the lines
        (0, 7, 4096),  # unaligned source, the smallest streamed part
        (9, 13, 70_001),
        (1, 1, 4095),  # below the streaming size: plain memmove
        (0, 0, 0),
    ],
)
def test_copy_many_is_exact_at_any_alignment_and_size(streaming, dst_shift, src_shift, size):
    rng = np.random.default_rng(size)
    parts = 3
    src = rng.integers(0, 256, parts * (size + 64) + 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    stride = size + 64
    memcopy.copy_many(
        _addresses(dst, [dst_shift + i * stride for i in range(parts)]),
        _addresses(src, [src_shift + i * stride for i in range(parts)]),
        size,
        streaming=streaming,
    )
    expected = np.zeros_like(src)
    for i in range(parts):
        d, s = dst_shift + i * stride, src_shift + i * stride
        expected[d : d + size] = src[s : s + size]
    assert np.array_equal(dst, expected)  # every byte in place, nothing around it touched


def test_overlapping_ranges_keep_memmove_semantics():
    """Streaming stores would read bytes already overwritten; an overlapping part falls back
    to memmove."""
    buf = np.arange(64 * 1024, dtype=np.uint8)
    reference = buf.copy()
    reference[100 : 100 + 40_000] = buf[0:40_000].copy()
    memcopy.copy_many(_addresses(buf, [100]), _addresses(buf, [0]), 40_000)
    assert np.array_equal(buf, reference)


def test_streaming_is_built_on_x86():
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("not x86: plain memmove")
    assert memcopy.STREAMING == 1


def test_page_pointers_give_each_pages_parts_from_its_first_index():
    page = 4
    indices = np.array([8, 9, 10, 11, 40, 41, 42, 43, 0, 1, 2, 3], np.int64)  # 3 pages
    affine = np.array([[1000, 16], [5000, 32]], np.int64)  # K and V: base, bytes per token
    raw = memcopy.page_pointers(indices.ctypes.data, indices.size, page, affine)
    got = np.frombuffer(raw, np.int64).reshape(-1, 2)  # (the table's bytes, from C)
    assert got.tolist() == [[1128, 5256], [1640, 6280], [1000, 5000]]
    assert memcopy.page_pointers(0, 0, page, affine) == b""
    with pytest.raises(ValueError, match="whole pages"):
        memcopy.page_pointers(indices.ctypes.data, 5, page, affine)


@pytest.mark.parametrize(
    ("indices", "why"),
    [
        ([0, 1, 2, 3, 44, 45, 46, 47], "outside the host pool"),  # past the last page
        ([-4, -3, -2, -1], "outside the host pool"),
        ([2, 3, 4, 5], "not one run"),  # off the page grid
        ([0, 1, 2, 7], "not one run"),  # slots of another page
        ([8, 9, 10, 11, 8, 9, 10, 11], "two keys"),  # one page twice (with distinct)
    ],
)
def test_page_pointers_refuse_indices_that_are_not_whole_pages_of_the_pool(indices, why):
    """With `slots` (a pool of 44 indices: 11 pages of 4), pages outside it, off the grid or
    not consecutive are refused before any pointer is made (a copy would touch memory that is
    not the page's); with `distinct`, a page named twice (a read would report one key's bytes
    for both). Without `slots` nothing is checked, as before."""
    array = np.array(indices, np.int64)
    affine = np.array([[1000, 16]], np.int64)
    with pytest.raises(ValueError, match=why):
        memcopy.page_pointers(array.ctypes.data, array.size, 4, affine, slots=44, distinct=True)
    assert (
        len(memcopy.page_pointers(array.ctypes.data, array.size, 4, affine)) == array.size // 4 * 8
    )


# -- copy_values on several threads (maru_copy_threads) -----------------------------------------


def _split_case(values: int, parts: tuple[int, ...], seed: int = 3):
    """Values of `parts` scattered in a source buffer, to be stored back to back."""
    rng = np.random.default_rng(seed)
    size = sum(parts)
    src = rng.integers(0, 256, values * size + 4096, dtype=np.uint8)
    dst = np.zeros(values * size + 4096, dtype=np.uint8)
    order = rng.permutation(values)
    part_offsets = np.cumsum((0, *parts[:-1]))
    buffers = (src.ctypes.data + order[:, None] * size + part_offsets[None, :]).astype(np.int64)
    starts = dst.ctypes.data + np.arange(values, dtype=np.int64) * size
    expect = np.concatenate([src[v * size : (v + 1) * size] for v in order])
    return src, dst, starts, np.ascontiguousarray(buffers), np.array(parts, np.int64), expect


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("to_values", [True, False], ids=["store", "load"])
@pytest.mark.parametrize(
    "parts", [(160 * 1024, 96 * 1024), (40 * 1024, 24 * 1024)], ids=["256K", "64K"]
)
def test_a_shared_copy_is_the_same_copy_as_one_threads(threads, hashed, to_values, parts):
    """Every byte where one thread puts it, nothing past the values, and with `hashed` the
    same per-value checksums, whatever the blocks the threads took (a value each at 256 KiB,
    four at 64 KiB, 37 values: a short last block), for stores and loads."""
    src, dst, starts, buffers, sizes, expect = _split_case(37, parts)
    n = expect.size
    if not to_values:  # a load: the values (dst) are the source, scattered parts the target
        dst[:n] = expect
        src[:] = 0
    before = memcopy.copier_tasks()
    got = memcopy.copy_values(
        starts, buffers, sizes, to_values=to_values, threads=threads, hashed=hashed
    )
    mib = expect.size >> 20  # (9 or 2: each thread's share at least 1 MiB)
    assert memcopy.copier_tasks() - before == min(threads, mib) - 1
    if to_values:
        assert np.array_equal(dst[:n], expect)
        assert not dst[n:].any()
    else:
        again = memcopy.copy_values(starts, buffers, sizes, to_values=True)  # back: same bytes
        assert again is None and np.array_equal(dst[:n], expect)
        assert not src[-4096:].any()  # nothing past the parts
    if hashed:
        reference = memcopy.copy_values(starts, buffers, sizes, to_values=True, hashed=True)
        assert got is not None and np.array_equal(got, reference)
    else:
        assert got is None


def test_a_copy_too_small_to_share_stays_on_the_calling_thread():
    """Shares under 1 MiB are not handed to a copier (a wake-up would cost more)."""
    _src, dst, starts, buffers, sizes, expect = _split_case(4, (64 * 1024,))
    before = memcopy.copier_tasks()
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=4)
    assert memcopy.copier_tasks() == before
    assert np.array_equal(dst[: expect.size], expect)
    _src, dst, starts, buffers, sizes, expect = _split_case(64, (64 * 1024,))  # 4 MiB
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=4)
    assert memcopy.copier_tasks() - before == 3  # four threads' shares of 1 MiB: three copiers
    assert np.array_equal(dst[: expect.size], expect)


def _copier_tids(at_least: int = 1) -> list[int]:
    """This process's `maru-copier` threads, waiting (10 s at most) until `at_least` are
    named: a copier called off before it first ran names itself only when it runs."""
    deadline = time.monotonic() + 10
    while True:
        tids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    if f.read().strip() == "maru-copier":
                        tids.append(int(task))
            except FileNotFoundError:
                continue
        if len(tids) >= at_least or time.monotonic() > deadline:
            return tids
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "SCHED_FIFO"), reason="needs Linux scheduling policies")
def test_a_copier_that_cannot_run_does_not_hold_the_copy_up():
    """A copier that gets no CPU (as a copier behind a busy server on a small machine) is
    called off once the caller has taken every block itself: the copy returns complete
    without it, and the copier serves the next copy as usual. The copier is kept off the CPU
    for certain: pinned to the caller's CPU while the caller runs real-time there (which it
    does not leave during the copy: it never sleeps). An idle-policy copier was not enough:
    under the suite's load a switch away from the caller could still pick it."""
    _src, dst, starts, buffers, sizes, expect = _split_case(64, (64 * 1024,))  # 4 MiB
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)  # (started)
    tids = _copier_tids()
    assert tids
    cpu = min(os.sched_getaffinity(0))
    mine, theirs = os.sched_getaffinity(0), {t: os.sched_getaffinity(t) for t in tids}
    policy = os.sched_getscheduler(0)
    try:
        os.sched_setaffinity(0, {cpu})
        for tid in tids:
            os.sched_setaffinity(tid, {cpu})
        dst[:] = 0
        asked, called_off = memcopy.copier_tasks(), memcopy.copiers_called_off()
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except PermissionError:
            pytest.skip("this user may not take SCHED_FIFO (root or CAP_SYS_NICE)")
        memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)
        assert memcopy.copier_tasks() - asked == 1
        assert memcopy.copiers_called_off() - called_off == 1
        assert np.array_equal(dst[: expect.size], expect)
    finally:
        os.sched_setscheduler(0, policy, os.sched_param(0))
        for tid, cpus in theirs.items():
            os.sched_setaffinity(tid, cpus)
        os.sched_setaffinity(0, mine)
    dst[:] = 0
    asked = memcopy.copier_tasks()
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)
    assert memcopy.copier_tasks() - asked == 1
    assert np.array_equal(dst[: expect.size], expect)


def test_a_forked_child_starts_copiers_of_its_own():
    """A child forked after the parent's copiers started (SGLang forks its workers) copies
    with copiers of its own; the parent's go on serving the parent."""
    _src, dst, starts, buffers, sizes, expect = _split_case(48, (128 * 1024,))
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)  # (started)
    dst[:] = 0
    pid = os.fork()
    if pid == 0:  # (no pytest in here: only the exit status)
        try:
            before = memcopy.copier_tasks()
            memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=3)
            handed = memcopy.copier_tasks() - before == 2
            os._exit(0 if handed and np.array_equal(dst[: expect.size], expect) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert not dst.any()  # the child's copy was the child's
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)
    assert np.array_equal(dst[: expect.size], expect)


@pytest.mark.parametrize("hashed", [False, True])
def test_a_started_copy_is_complete_once_finished(hashed):
    """`copy_values_start`: the copiers start at once, `finish()` takes the rest and gives
    what `copy_values` gives (a second `finish()` the same); dropped unfinished, the copy
    still completes before its arrays can go (the copiers never outlive it)."""
    _src, dst, starts, buffers, sizes, expect = _split_case(64, (64 * 1024,))  # 4 MiB
    reference = memcopy.copy_values(starts, buffers, sizes, to_values=True, hashed=hashed)
    dst[:] = 0
    asked = memcopy.copier_tasks()
    started = memcopy.copy_values_start(
        starts, buffers, sizes, to_values=True, hashed=hashed, threads=2
    )
    assert memcopy.copier_tasks() - asked == 1  # (asked at the start)
    got = started.finish()
    assert np.array_equal(dst[: expect.size], expect)
    if hashed:
        assert got is not None and np.array_equal(got, reference)
        assert started.finish() is got
    else:
        assert got is None and started.finish() is None
    dst[:] = 0
    started = memcopy.copy_values_start(starts, buffers, sizes, to_values=True, threads=2)
    del started
    assert np.array_equal(dst[: expect.size], expect)


def test_a_copy_started_with_one_thread_is_done_at_once():
    _src, dst, starts, buffers, sizes, expect = _split_case(8, (64 * 1024,))
    started = memcopy.copy_values_start(starts, buffers, sizes, to_values=True, threads=1)
    assert np.array_equal(dst[: expect.size], expect)
    assert started.finish() is None
    with pytest.raises(ValueError, match="buffers"):
        memcopy.copy_values_start(starts, buffers[:4], sizes, to_values=True, threads=2)


def test_a_child_forked_during_a_started_copy_finishes_all_of_it_itself():
    """The parent's copiers are not in a child forked while a copy is in flight: the child's
    `finish()` copies every value itself (whatever the parent's copier had taken)."""
    _src, dst, starts, buffers, sizes, expect = _split_case(64, (64 * 1024,))
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=2)  # (started)
    dst[:] = 0
    started = memcopy.copy_values_start(starts, buffers, sizes, to_values=True, threads=2)
    pid = os.fork()
    if pid == 0:  # (no pytest in here: only the exit status)
        try:
            started.finish()
            os._exit(0 if np.array_equal(dst[: expect.size], expect) else 1)
        except BaseException:
            os._exit(2)
    started.finish()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert np.array_equal(dst[: expect.size], expect)


def test_threads_share_only_streaming_copies():
    """A plain memmove (the benchmarks' baseline, `streaming=False`) stays one thread's."""
    _src, dst, starts, buffers, sizes, expect = _split_case(16, (512 * 1024,))
    before = memcopy.copier_tasks()
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=4, streaming=False)
    assert memcopy.copier_tasks() == before
    assert np.array_equal(dst[: expect.size], expect)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux scheduling policies")
def test_copiers_run_as_batch_threads_and_leave_the_callers_policy_alone():
    """A copier's wake-up must not preempt the thread that asked it (on a small VM that put
    the caller's Python behind the copier's time slice): copiers run under SCHED_BATCH; the
    calling thread keeps its own policy."""
    _src, dst, starts, buffers, sizes, expect = _split_case(64, (64 * 1024,))  # 4 MiB
    caller = os.sched_getscheduler(0)
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=3)  # (started)
    tids = _copier_tids(2)
    assert len(tids) >= 2
    assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == caller
    assert np.array_equal(dst[: expect.size], expect)


def _copier_policies_under_fifo(conn) -> None:
    """In a forked child: take SCHED_FIFO, copy on three threads, send the copiers' policies
    (None: this user may not take a real-time policy)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        conn.send(None)
        return
    _src, _dst, starts, buffers, sizes, _expect = _split_case(64, (64 * 1024,))
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=3)
    conn.send(sorted(os.sched_getscheduler(t) for t in _copier_tids(2)))


@pytest.mark.skipif(not hasattr(os, "SCHED_FIFO"), reason="needs Linux scheduling policies")
def test_copiers_of_a_real_time_process_keep_its_policy():
    """Only a copier at the normal policy moves to SCHED_BATCH: one that inherited a
    real-time policy keeps it (an operator's `chrt` is not undone)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_copier_policies_under_fifo, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the child did not answer"
        policies = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if policies is None:
        pytest.skip("this user may not take SCHED_FIFO")
    assert len(policies) >= 2
    assert set(policies) == {os.SCHED_FIFO}


def test_copier_threads_are_named_and_leave_signals_to_the_process():
    """The copiers show as `maru-copier` (top -H, /proc) and block SIGINT and SIGTERM: a
    signal meant for the process interrupts its own threads' waits, not a copier's loop."""
    import signal

    _src, _dst, starts, buffers, sizes, _expect = _split_case(48, (128 * 1024,))
    memcopy.copy_values(starts, buffers, sizes, to_values=True, threads=3)  # (started)
    masks = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{task}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # (a thread that ended meanwhile)
            continue
        if name == "maru-copier":
            masks.append(int(status["SigBlk"].strip(), 16))
    assert len(masks) >= 2
    for mask in masks:
        for sig in (signal.SIGINT, signal.SIGTERM):
            assert mask & (1 << (sig - 1)), f"{sig!r} not blocked in a copier"
