"""One handler shared by threads, as the adapters share theirs (SGLang's prefetch and backup
threads, LMCache's store and lookup threads, vLLM's workers): writers through every write
path at a full share (each batch evicts), readers through every read path, and a deleter,
at once. Every value carries a digest of its key and bytes: a read reported a hit whose
bytes are not its key's is a wrong read, the one outcome that must never happen."""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from maru import LeaseExpired, MaruHandler

KiB = 1 << 10
SIZE = 60 * KiB  # one 64 KiB chunk a value
RUN_S = 6.0


def value_of(key: str) -> bytes:
    """The digest of key and body, then the body: it tells its key's bytes from any other's."""
    body = os.urandom(SIZE - 16)
    return hashlib.blake2b(key.encode() + body, digest_size=16).digest() + body


def right(key: str, value: bytes | memoryview) -> bool:
    value = bytes(value)
    return len(value) == SIZE and value[:16] == value_of_digest(key, value[16:])


def value_of_digest(key: str, body: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + body, digest_size=16).digest()


class Run:
    """What the threads share: the keys written so far, the counts, and what went wrong."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[str] = []
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.deadline = time.monotonic() + RUN_S

    def wrote(self, keys: list[str], results: list[bool]) -> None:
        with self.lock:
            self.keys += [k for k, ok in zip(keys, results) if ok]
            self.counts["stored"] += sum(results)
            self.counts["store_failed"] += len(results) - sum(results)

    def some(self, n: int) -> list[str]:
        with self.lock:
            recent = self.keys[-64:]
        return random.sample(recent, min(n, len(recent)))

    def judged(self, keys: list[str], hits: list[bool], good: list[bool]) -> None:
        with self.lock:
            self.counts["hits"] += sum(hits)
            self.counts["misses"] += len(hits) - sum(hits)
            self.counts["wrong"] += sum(h and not g for h, g in zip(hits, good))
            wrong = [k for k, hit, ok in zip(keys, hits, good) if hit and not ok]
            self.errors += [f"wrong bytes under {k}" for k in wrong]


def _loop(run: Run, name: str, step: Callable[[int], None]) -> threading.Thread:
    def body() -> None:
        n = 0
        try:
            while time.monotonic() < run.deadline:
                step(n)
                n += 1
        except Exception as exc:  # (the test reports it)
            with run.lock:
                run.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    return threading.Thread(target=body, name=name, daemon=True)


@pytest.mark.parametrize("fault", ["none", "server_sigkill"])
def test_threads_sharing_a_handler_read_no_wrong_byte(maru_server, fault):
    """`server_sigkill`: the server is SIGKILLed and restarted on its state twice during the
    run: the threads' calls meet the re-handshake (regions reattached, seals in flight)."""
    run = Run()
    with (
        MaruHandler(server_url=maru_server.url, pool_size="2M", chunk_size_bytes="64K") as h,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as other,
    ):

        def batch_store(n: int) -> None:
            keys = [f"batch/{n}/{i}" for i in range(4)]
            run.wrote(keys, h.batch_store(keys, [value_of(k) for k in keys]))

        def store(n: int) -> None:
            key = f"one/{n}"
            run.wrote([key], [h.store(key, value_of(key))])

        def alloc_seal(n: int) -> None:
            keys = [f"run/{n}/{i}" for i in range(3)]
            run_of_3 = h.alloc(SIZE, 3)  # (None where no 3 chunks in a row are free: one by one)
            handles = run_of_3.split() if run_of_3 is not None else h.reserve_values(SIZE, 3)
            if handles is None:
                run.wrote(keys, [False] * 3)
                return
            for handle, key in zip(handles, keys):
                ctypes.memmove(handle.address, value_of(key), SIZE)
            sealed = run_of_3 if run_of_3 is not None else handles
            run.counts["runs" if run_of_3 is not None else "one_by_one"] += 1
            run.wrote(keys, h.seal(keys, sealed, SIZE).wait())

        def read(n: int, handler: MaruHandler = h) -> None:
            keys = run.some(6)
            if not keys:
                return
            dest = np.zeros((len(keys), SIZE), np.uint8)
            rows = dest.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * SIZE
            hits = handler.read(keys, rows, np.array([SIZE], np.int64), length=SIZE)
            good = [right(k, dest[i].tobytes()) for i, k in enumerate(keys)]
            run.judged(keys, hits, good)

        def leased(n: int) -> None:
            keys = run.some(4)
            try:
                with h.leased(keys) as infos:
                    hits = [info is not None for info in infos]
                    good = [
                        info is not None and right(k, info.view) for k, info in zip(keys, infos)
                    ]
            except LeaseExpired:  # (the server restarted under the block: what it read is void)
                run.counts["leases_ended"] += 1
                return
            run.judged(keys, hits, good)

        def delete(n: int) -> None:
            keys = run.some(2)
            if keys:
                run.counts["deleted"] += sum(h.batch_delete(keys))
            time.sleep(0.002)

        threads = [
            _loop(run, "batch_store", batch_store),
            _loop(run, "store", store),
            _loop(run, "alloc_seal", alloc_seal),
            _loop(run, "read", read),
            _loop(run, "read_other", lambda n: read(n, other)),
            _loop(run, "leased", leased),
            _loop(run, "delete", delete),
        ]
        for thread in threads:
            thread.start()
        for _ in range(2 if fault == "server_sigkill" else 0):
            time.sleep(RUN_S / 3)
            os.kill(maru_server.pid, signal.SIGKILL)
            maru_server.proc.wait(10)
            maru_server.restart()
            run.counts["server_kills"] += 1
        for thread in threads:
            thread.join(RUN_S + 30)
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
        stats = h.stats()
    print(dict(run.counts))
    assert run.errors == []
    assert run.counts["wrong"] == 0
    # ... and the run did what it says: stores evicted (a full share), reads hit and missed
    assert run.counts["stored"] > 100 and run.counts["hits"] > 50 and run.counts["misses"] > 0
    assert stats["counters"]["evictions"] > 0 or fault != "none", stats["counters"]
