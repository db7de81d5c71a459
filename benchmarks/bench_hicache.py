"""HiCache data-path benchmark (issues 5 and 17): Maru through SGLang's real storage interface.

    .venv/bin/python benchmarks/bench_hicache.py --quick              # about a minute
    .venv/bin/python benchmarks/bench_hicache.py --wait-load 1.0      # full, a few minutes

Needs the real SGLang (the venv `scripts/install_sglang_cpu.sh` / `make install` builds) and runs
on CPU through the shims in tests/sglang_cpu. One command does everything in one run, so every
figure saw the same machine state:

- Workload: real SGLang host pools (MHA `page_first_direct` at 64 KiB, 1 MiB and 4 MiB pages,
  and an MLA pool with DeepSeek-V3's geometry, ~1.07 MiB pages). A writer process fills its
  pool and calls `MaruStorage.batch_set_v1` in batches of up to 128 pages; a *second process*,
  with its own host pool, calls `batch_get_v1` for the same keys and checks every page's CRC.
- Baselines in the same run on the same page bytes (the pointers `get_page_buffer_meta`
  gives): a plain single-thread memcpy (one memmove per page part to / from a warm private
  buffer, all of a batch's parts in one `maru.common.memcopy.copy_values(...,
  streaming=False)` call, so the baseline carries no Python per part either), the same into
  a warm /dev/shm mapping
  (the limit of a repetition is the faster of the two), Maru's own copy loop alone
  (`copy_values` with its default non-temporal stores, into the /dev/shm mapping: the floor
  under Maru, whose copies can beat a plain memcpy), Maru with `maru_checksums` on (another
  MaruStorage of the same process: writer and reader hash every page as they copy it, maru64
  in the copy loop; issue 13, P8: its cost is the ratio to plain Maru in the same repetition), and
  SGLang's
  built-in file backend (`HiCacheFile`) on a /dev/shm directory driven the way the
  controller drives it without `interface_v1` (`get_data_page` + `batch_set`; `batch_get`
  into dummy pages + `set_from_flat_data_page`). Methods alternate within each repetition,
  in an order shuffled per repetition (no method always follows the same one); ratios are
  medians of per-repetition ratios. The limit of issue 17's targets is the fastest of the
  three plain copies (memcpy, shm, stream) in the same repetition: one thread's. `stream2`,
  the same loop shared by two threads (as MaruStorage copies with the default
  `maru_copy_threads` 2), is printed beside it, not part of it.
- Before / after of issue 17's shared-memory index: where `MaruConfig` has `local_index`
  (config key `maru_local_index`), every Maru measurement is also made with it off
  ("request": the request path), alternating with the default; where it has not, the one
  path there is is measured and labelled "maru".
- Hybrid (Mamba) case: Qwen3-Next-80B-A3B's pools on one rank of TP 8: the KV host pool of
  its full-attention layers and SGLang's real `MambaPoolHost` (Gated DeltaNet temporal and
  conv state, 9.4 MiB per state), registered through the v2 interface as
  `HybridCacheController` registers them; 128 KV pages and a state per 32 pages move in one
  `batch_set_v2` / `batch_get_v2` (both pools in one call), against the same memcpy baselines
  and `HiCacheFile`'s own v2 on the same bytes (CRC of every part checked).
- Per-page latency: many one-page `batch_set_v1` / `batch_get_v1` calls, median and p99.
- Metadata: `batch_exists` of 128 keys per key and one key's `exists`, each through
  `MaruStorage` (SGLang's calls, the targets) and through the handler (which of the two goes
  first alternates: the second finds the first's cache lines), `batch_exists` of 128 keys
  never stored through `MaruStorage` (a new prompt: the answer is 0), with the read requests
  each call sent (0: the index); the leased lookup of 128 keys per key; one single-key lookup
  round trip (`retrieve`, a request on every path), over the real socket; and the transport
  alone (a 200-byte echo to another process over pyzmq, TCP and a Unix socket).
- Scaling: 1, 2 and 4 concurrent writer/reader pairs (aggregate GB/s, lookup latency under
  load), and 10^3 .. 10^6 keys registered (one dedicated server per count, the keys registered
  in batches of 16384 tiny values): `exists`, 128-key `batch_exists` of random registered keys
  and `batch_get_v1` of a working set of 128 64 KiB pages among them, on every path, and the
  lookup round trip; round robin over the servers so that every count sees the same machine
  state.

Prints a table and each target with PASS/MISS, and writes CSV, PNG (matplotlib) and a Markdown
summary under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import hashlib
import mmap
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from report import finish  # (same dir)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

KiB, MiB = 1 << 10, 1 << 20
_memmove, _memset = ctypes.memmove, ctypes.memset

# -- what is measured --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # where the geometry comes from
    attn: str
    page_size: int  # tokens per page
    layers: int
    heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0

    @property
    def page_bytes(self) -> int:  # bf16
        if self.attn == "mha":
            return 2 * self.layers * self.page_size * self.heads * self.head_dim * 2
        return self.layers * self.page_size * (self.kv_lora_rank + self.rope_dim) * 2

    def geometry(self):
        import torch

        from sglang_cpu.host_pools import Geometry

        if self.attn == "mha":
            return Geometry(
                attn="mha",
                layout="page_first_direct",
                page_size=self.page_size,
                layers=self.layers,
                heads=self.heads,
                head_dim=self.head_dim,
                dtype=torch.bfloat16,
            )
        return Geometry(
            attn="mla",
            layout="page_first_direct",
            page_size=self.page_size,
            layers=self.layers,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            dtype=torch.bfloat16,
        )


CASES = [
    Case("mha-64K", "16 layers, 2 KV heads x 64, page 8", "mha", 8, 16, 2, 64),
    Case("mha-1M", "Llama-3-8B (32 layers, 8 KV heads x 128), page 8", "mha", 8, 32, 8, 128),
    Case("mha-4M", "Llama-3-8B, page 32", "mha", 32, 32, 8, 128),
    Case("mla-1M", "DeepSeek-V3 (61 layers, MLA 512+64), page 16", "mla", 16, 61, 0, 0, 512, 64),
]
SCALE_CASE = CASES[1]
KEYS_CASE = CASES[0]  # the working set read among 10^3 .. 10^6 registered keys
SCALE_CHUNK = 4096  # a registered key's chunk in the keys scaling: a page (one key a page)
SERVER_POOL = 256 << 20  # the keys scaling's servers: the working set's room


def scale_pool_bytes(n: int) -> int:
    """What `n` scale keys take of a pool, a 4 KiB chunk each, with room for region rounding."""
    return n * SCALE_CHUNK * 5 // 4 + (64 << 20)


@dataclass(frozen=True)
class HybridCase:
    """A Mamba hybrid: KV pages of the full-attention layers plus the Mamba state of the
    linear-attention layers (SGLang's `MambaPoolHost`, one state per page slot), moved
    together through `batch_set_v2` / `batch_get_v2` (one transfer per pool)."""

    name: str
    model: str
    kv: Case  # the full-attention layers' KV pool
    mamba_layers: int
    temporal: tuple[int, ...]  # float32 state per layer
    conv: tuple[int, int]  # bf16 (rows, dim) per layer
    state_every: int  # KV pages per Mamba state (a radix node's end)

    @property
    def attn(self) -> str:
        return "hybrid"

    @property
    def state_bytes(self) -> int:
        temporal = 4 * int(np.prod(self.temporal))
        return self.mamba_layers * (temporal + 2 * self.conv[0] * self.conv[1])

    def mamba_pool(self, states: int):
        from sglang_cpu.hybrid_pools import _mamba_pool

        return _mamba_pool(
            self.conv[1],
            layers=self.mamba_layers,
            temporal=self.temporal,
            conv_rows=self.conv[0],
            slots=states,
            host_ratio=1,
            shared_device_slot=True,
        )


# Qwen3-Next-80B-A3B on one rank of TP 8: 12 of 48 layers full attention (2 KV heads x 256,
# one per rank), 36 Gated DeltaNet layers (32 value heads / 8 x 128 x 128 fp32 state, conv
# kernel 4 over 8192 / 8 channels); page 64; a state every 32 pages (2048 tokens).
HYBRID = HybridCase(
    "hybrid",
    "Qwen3-Next-80B-A3B, one rank of TP 8, page 64",
    Case("hybrid", "", "mha", 64, 12, 1, 256),
    mamba_layers=36,
    temporal=(4, 128, 128),
    conv=(3, 1024),
    state_every=32,
)
# Issue 17's targets (the shortest path) and issue 5's >= 3x HiCacheFile. Throughput is a share
# of the limit: the fastest of the three plain copies (memcpy, shm, stream) in the same
# repetition, which in practice is Maru's own streaming copy loop.
TARGETS = {
    "get_big": 0.97,  # batch_get_v1 / limit, pages >= 1 MiB
    "get_small": 0.95,  # batch_get_v1 / limit, smaller pages (64 KiB)
    "set": 0.90,  # batch_set_v1 / limit, every page size
    "file": 3.0,  # Maru / HiCacheFile on /dev/shm
    "exists_us": 0.05,  # MaruStorage.batch_exists, us per key in 128-key batches
    "single_us": 2.0,  # MaruStorage.exists of one key, median us
    "keys": 1.2,  # at the most keys / at 10^3 keys: batch_exists, exists, batch_get_v1
}


def local_index_supported() -> bool:
    """Whether this Maru has issue 17's shared-memory index switch (`MaruConfig.local_index`,
    config key `maru_local_index`, default on): then every Maru measurement is made a second
    time with it off ("request": the request path), alternating, for the before/after."""
    import dataclasses

    from maru import MaruConfig

    return "local_index" in {f.name for f in dataclasses.fields(MaruConfig)}


# Where the pools, the file backend's directory and the shm baseline live (`--pool-dir`): one
# mount for all, so that the limits are measured in the memory the stores use.
SHM_DIR = "/dev/shm"
REQUEST_PATH = {"maru_local_index": "false"}  # the "request" backend's extra config


@dataclass
class Plan:
    quick: bool
    reps: int
    lat_samples: int
    meta_rounds: int
    rtt_samples: int
    scale_pages: int
    scale_reps: int
    scale_lookups: int
    key_counts: tuple[int, ...]
    ab: bool = False  # the index can be turned off: measure the request path beside it

    @classmethod
    def make(cls, quick: bool, ab: bool = False) -> Plan:
        if quick:
            return cls(True, 3, 48, 40, 300, 32, 2, 200, (10**3, 10**4, 10**5, 10**6), ab)
        return cls(False, 11, 256, 200, 2000, 128, 5, 1000, (10**3, 10**4, 10**5, 10**6), ab)

    @property
    def paths(self) -> tuple[str, ...]:
        """The Maru read paths measured: "maru" (the default configuration) and, with the
        A/B, "request" (`maru_local_index` false)."""
        return ("maru", "request") if self.ab else ("maru",)

    @property
    def backends(self) -> list[str]:
        return BACKENDS if self.ab else [b for b in BACKENDS if b != "request"]

    def pages_for(self, page_bytes: int) -> tuple[int, int]:
        """(pages per batch_*_v1 call, calls per repetition): up to 128 pages per call (SGLang's
        STORAGE_BATCH_SIZE), 32-512 MiB per repetition."""
        if self.quick:
            return (32 if page_bytes >= 4 * MiB else 128), 1
        return 128, (1 if page_bytes >= 4 * MiB else 2 if page_bytes >= MiB else 4)


def page_key(tag: str, i: int) -> str:
    """SGLang's page keys are hex SHA-256 digests; use keys of the same length."""
    return hashlib.sha256(f"{tag}/{i}".encode()).hexdigest()


# -- worker processes (forked from the parent once SGLang is imported) ------------------------


def _addr(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


def warm_shm(nbytes: int) -> tuple[mmap.mmap, int]:
    path = f"{SHM_DIR}/maru-bench-memcpy-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    mm.write(b"\x01" * nbytes)  # fault every page in
    return mm, _addr(np.frombuffer(mm, dtype=np.uint8, count=1))


def _copy_pages(part_ptrs, sizes, base, to_pool, s, n, streaming, threads=1) -> None:
    """Pages [s, s + n) of a pool (its parts' pointer columns and sizes) to or from `base`,
    where the pages lie back to back, each page's parts back to back: one `copy_values` call,
    page by page (each page's parts in order), like MaruStorage; `threads` > 1: shared
    between threads as MaruStorage shares its copies (`maru_copy_threads`)."""
    try:
        from maru.common import memcopy
    except ImportError:  # (a checkout before 2026-12-06, run for a baseline: the client's)
        from maru.client import memcopy  # type: ignore[no-redef]

    starts = base + np.arange(s, s + n, dtype=np.int64) * sum(sizes)
    pool = np.stack([ptrs[s : s + n] for ptrs in part_ptrs], axis=1)
    memcopy.copy_values(
        starts, pool, sizes, to_values=not to_pool, streaming=streaming, threads=threads
    )


class Instance:
    """One SGLang "instance": a real host pool, MaruStorage (through SGLang's dynamic backend
    factory: plain, with checksums, and with `ab` one with the index off) and HiCacheFile
    (through its built-in one) on the same pool."""

    def __init__(
        self, url: str, case: Case, pages: int, file_dir: str, role: str, ab: bool = False
    ):
        import torch

        import sglang_cpu.host_pools as hp

        torch.set_num_threads(1)
        g = case.geometry()
        hp.TOKENS = g.page_size * (pages // 2 + 2)  # the host pool gets 2x: pages + 4
        self.pool = pool = hp.make_host_pool(g)
        self.P = pool.page_size
        self.pages = pages
        self.idx = hp.page_indices(0, pages, self.P)
        ptrs, sizes = pool.get_page_buffer_meta(self.idx)
        self.parts = len(ptrs) // pages
        self.ptrs, self.sizes = ptrs, sizes
        self.part_ptrs = [np.array(ptrs[j :: self.parts], np.int64) for j in range(self.parts)]
        self.page_bytes = sum(sizes[: self.parts])
        self.total = pages * self.page_bytes
        self._setup(url, case, file_dir, role, g.attn == "mla", [self.page_bytes] * pages, ab)

    def _setup(
        self,
        url: str,
        case,
        file_dir: str,
        role: str,
        is_mla: bool,
        page_sizes: list[int],
        ab: bool,
    ) -> None:
        """The MaruStorages and HiCacheFile on `self.pool` (through SGLang's backend
        factories), and the warm memory of the memcpy baselines (`self.total` bytes)."""
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        import sglang_cpu.host_pools as hp
        from sglang_cpu.p2p import MARU_BACKEND

        chunk = -(-min(page_sizes) // 4096) * 4096
        pages = sum(-(-size // chunk) for size in page_sizes)  # chunks a round stores
        region = chunk * (pages + 2) if role == "writer" else chunk
        extra = {
            **MARU_BACKEND,
            "maru_server_url": url,
            "maru_pool_size": str(region),
            "maru_chunk_size_bytes": str(chunk),
            "maru_timeout_ms": "60000",
        }
        variants = {"maru": {}, "checked": {"maru_checksums": "true"}}
        if ab and role == "reader":  # (writes take no index)
            variants["request"] = REQUEST_PATH
        self.stores: dict[str, Any] = {}  # MaruStorage by backend name (MARUS)
        for name, more in variants.items():
            config = hp.storage_config(
                model=f"bench/{case.name}", is_mla=is_mla, extra={**extra, **more}
            )
            store = StorageBackendFactory.create_backend("dynamic", config, self.pool)
            store.register_mem_pool_host(self.pool)
            self.stores[name] = store
        self.maru = self.stores["maru"]
        cfg = hp.storage_config(model=f"bench/{case.name}", is_mla=is_mla, extra=extra)
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = file_dir
        self.file = StorageBackendFactory.create_backend("file", cfg, self.pool)
        self.file.register_mem_pool_host(self.pool)
        # Warm private memory for the memcpy baseline, page-aligned like the pool's pages (a
        # numpy buffer starts 16 bytes into a page, and copies between addresses a few bytes
        # apart modulo 4 KiB run at half speed here: that would flatter Maru).
        raw = np.ones(self.total + 4096, dtype=np.uint8)
        skip = -_addr(raw) % 4096
        self.buf = raw[skip : skip + self.total]
        self.buf_addr = _addr(self.buf)
        self.shm, self.shm_addr = warm_shm(self.total)
        self.role = role

    def info(self) -> dict:
        return {
            "page_bytes": self.page_bytes,
            "parts": self.parts,
            "pages": self.pages,
            "bytes": self.total,
        }

    # page contents ---------------------------------------------------------------------------

    def fill(self, seed: int) -> list[int]:
        data = np.frombuffer(np.random.default_rng(seed).bytes(self.total), np.uint8)
        off, src = 0, _addr(data)
        for ptr, size in zip(self.ptrs, self.sizes):
            _memmove(ptr, src + off, size)
            off += size
        self.buf[:] = data  # the memcpy baselines move the same bytes
        return self.crcs()

    def crcs(self) -> list[int]:
        out = []
        for p in range(self.pages):
            crc = 0
            for j in range(p * self.parts, (p + 1) * self.parts):
                crc = zlib.crc32((ctypes.c_char * self.sizes[j]).from_address(self.ptrs[j]), crc)
            out.append(crc)
        return out

    def wipe(self) -> None:
        for ptr, size in zip(self.ptrs, self.sizes):
            _memset(ptr, 0, size)

    # timed operations ------------------------------------------------------------------------

    def run(self, op: str, tag: str, batch: int, first: int = 0, count: int | None = None):
        """Time `op` over pages [first, first + count) in calls of `batch` pages. Returns
        (seconds per call, pages ok, start, end) with monotonic (system-wide) timestamps."""
        count = self.pages - first if count is None else count
        backend, direction = op.rsplit("_", 1)
        if backend in self.stores:
            store = self.stores[backend]
            move = self._store_set if direction == "set" else self._store_get

            def fn(keys, idx, s, n):
                return move(store, keys, idx, s, n)
        else:
            fn = getattr(self, "_" + op)
        times, ok = [], 0
        start = time.monotonic()
        for s in range(first, first + count, batch):
            n = min(batch, first + count - s)
            keys = [page_key(tag, i) for i in range(s, s + n)]
            idx = self.idx[s * self.P : (s + n) * self.P]
            t0 = time.perf_counter()
            ok += fn(keys, idx, s, n)
            times.append(time.perf_counter() - t0)
        if backend in self.stores and direction == "set" and times:
            # write-behind: the last call's registrations are confirmed before the reader
            # starts, and charged to that call (the earlier ones' to the call after them)
            t0 = time.perf_counter()
            self.stores[backend].confirm_writes()
            times[-1] += time.perf_counter() - t0
        return times, ok, start, time.monotonic()

    def run_back_to_back(self, op: str, tag: str, batch: int):
        """`run(op, tag)` twice in a row in this process, the second timed: nothing idle
        before the timed calls (a write's first pass is deleted in between: the writer's
        pool holds one pass). Returns the second `run`'s result."""
        self.run(op, tag, batch)
        if op == "maru_set":
            self.maru_delete(tag)
        return self.run(op, tag, batch)

    def _store_set(self, store, keys, idx, s, n) -> int:
        return sum(store.batch_set_v1(keys, idx))

    def _store_get(self, store, keys, idx, s, n) -> int:
        return sum(store.batch_get_v1(keys, idx))

    def _file_set(self, keys, idx, s, n) -> int:  # the controller's _generic_page_set
        data = [self.pool.get_data_page(idx[i * self.P]) for i in range(n)]
        return n if self.file.batch_set(keys, data) else 0

    def _file_get(self, keys, idx, s, n) -> int:  # the controller's _generic_page_get
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        page_data = self.file.batch_get(keys, dummy)
        count = 0
        for i in range(n):
            if page_data[i] is None:
                break
            self.pool.set_from_flat_data_page(idx[i * self.P], page_data[i])
            count += 1
        return count

    def _copy(
        self, base: int, to_pool: bool, s: int, n: int, streaming: bool = False, threads: int = 1
    ) -> int:
        """Pages [s, s + n) between the host pool and `base` (pages back to back, each page's
        parts back to back): one `copy_values`, page by page, like MaruStorage. Plain memmove unless
        `streaming` (the non-temporal stores MaruStorage's copies use); `threads`: shared."""
        _copy_pages(
            self.part_ptrs, self.sizes[: self.parts], base, to_pool, s, n, streaming, threads
        )
        return n

    def _memcpy_set(self, keys, idx, s, n) -> int:
        return self._copy(self.buf_addr, False, s, n)

    def _memcpy_get(self, keys, idx, s, n) -> int:
        return self._copy(self.buf_addr, True, s, n)

    def _shm_set(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, False, s, n)

    def _shm_get(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, True, s, n)

    def _stream_set(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, False, s, n, streaming=True)

    def _stream_get(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, True, s, n, streaming=True)

    def _stream2_set(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, False, s, n, streaming=True, threads=STREAM2_THREADS)

    def _stream2_get(self, keys, idx, s, n) -> int:
        return self._copy(self.shm_addr, True, s, n, streaming=True, threads=STREAM2_THREADS)

    def stored_keys(self, tag: str, count: int) -> list[str]:
        """The Maru keys (namespaced) that storing pages [0, count) of `tag` wrote."""
        return self.maru.pools["kv"].keys([page_key(tag, i) for i in range(count)])

    def maru_delete(self, tag: str, count: int | None = None, backend: str = "maru") -> int:
        """Delete the pages of `tag` (not timed) that `backend` (one of MARUS: the same keys)
        stored. The reader releases its lease without waiting, so a delete can arrive first
        and find a key leased: try those again."""
        handler = self.stores[backend].handler
        keys = self.stored_keys(tag, self.pages if count is None else count)
        deleted = 0
        for _ in range(200):
            ok = handler.batch_delete(keys)
            deleted += sum(ok)
            keys = [k for k, gone in zip(keys, ok) if not gone]
            if not keys or not handler.batch_exists(keys[:1])[0]:
                return deleted
            time.sleep(0.005)
        raise RuntimeError(f"{len(keys)} keys of {tag} could not be deleted")

    def file_clear(self) -> None:
        self.file.clear()

    # metadata --------------------------------------------------------------------------------

    def meta(self, tag: str, rounds: int, singles: int) -> dict[str, Any]:
        """Per Maru path ("maru", and "request" with the A/B; alternating within each round):
        128-key `batch_exists` per key through MaruStorage (SGLang's call) and through the
        handler, through MaruStorage for 128 keys never stored (a new prompt), and single-key
        `exists` through both; the requests each call sent. Then the
        leased 128-key lookup and the single-key lookup round trip (`retrieve`: a request on
        every path, it hands out a view), alternating in runs of 100 with the baseline of the
        client sleeping for each reply (busy_poll_us 0)."""
        keys = [page_key(tag, i) for i in range(128)]
        ns_keys = self.maru.pools["kv"].keys(keys)
        new_keys = [page_key(f"{tag}/never-stored", i) for i in range(128)]
        paths = [p for p in ("maru", "request") if p in self.stores]
        out: dict[str, Any] = {f"{p}/{m}": [] for p in paths for m in PATH_META}
        out.update({k: [] for k in ("lookup", "rtt", "rtt_sleep")})
        for p in paths:
            assert self.stores[p].batch_exists(keys) == 128, f"{p}: metadata keys are missing"
            assert self.stores[p].batch_exists(new_keys) == 0, f"{p}: a key never stored is there"
        # MaruStorage's call and the handler's alternate which goes first: the second finds
        # the first's lines in the cache
        for r in range(rounds):
            for p in paths:
                store = self.stores[p]
                calls = [("exists128", store.batch_exists, keys)]
                calls.append(("exists128_h", store.handler.batch_exists, ns_keys))
                calls.append(("exists128_new", store.batch_exists, new_keys))
                for name, call, arg in calls[:: 1 if r % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    call(arg)
                    out[f"{p}/{name}"].append((time.perf_counter() - t0) / 128)
        for i in range(singles):
            key, ns_key = keys[i % 128], ns_keys[i % 128]
            for p in paths:
                store = self.stores[p]
                calls = [
                    ("exists1", store.exists, key),
                    ("exists1_h", store.handler.exists, ns_key),
                ]
                for name, call, arg in calls[:: 1 if i % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    found = call(arg)
                    out[f"{p}/{name}"].append(time.perf_counter() - t0)
                    assert found, arg
        h = self.maru.handler
        lookup = _batch_lookup(h)
        for _ in range(rounds):
            t0 = time.perf_counter()
            lookup(ns_keys)
            out["lookup"].append((time.perf_counter() - t0) / 128)
        spin = h._rpc.busy_poll_ns
        try:
            for start in range(0, singles, 100):
                for sleeping in (False, True):
                    h._rpc.busy_poll_ns = 0 if sleeping else spin
                    for i in range(start, min(singles, start + 100)):
                        t0 = time.perf_counter()
                        info = h.retrieve(ns_keys[i % 128])
                        t1 = time.perf_counter()
                        assert info is not None
                        out["rtt_sleep" if sleeping else "rtt"].append(t1 - t0)
        finally:
            h._rpc.busy_poll_ns = spin
        out["requests"] = {p: self.requests_per_call(p, keys) for p in paths}
        return out

    def requests_per_call(self, path: str, keys: list[str], calls: int = 10) -> dict[str, float]:
        """Read requests (EXISTS, LOOKUP_KV, RELEASE, as the server counts them) that one
        call of each read op sent on `path`: 0 is the shared-memory index, 1-2 a round trip.
        Nothing else reads from this server meanwhile."""
        store = self.stores[path]
        n = len(keys)
        idx = self.idx[: n * self.P]
        ops = {
            "batch_exists": lambda: store.batch_exists(keys),
            "exists": lambda: store.exists(keys[0]),
            "batch_get_v1": lambda: store.batch_get_v1(keys, idx),
        }
        out = {}
        for name, call in ops.items():
            call()  # maps what it needs first
            before = _read_requests(store.handler)
            for _ in range(calls):
                call()
            # RELEASE is sent without waiting: let it arrive before counting
            time.sleep(0.05)
            out[name] = (_read_requests(store.handler) - before) / calls
        return out

    def file_exists(self, tag: str, rounds: int) -> list[float]:
        keys = [page_key(tag, i) for i in range(128)]
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            found = self.file.batch_exists(keys)
            out.append((time.perf_counter() - t0) / 128)
        assert found == 128, found
        return out

    def lookup_load(self, tag: str, n_keys: int, count: int) -> dict[str, list[float]]:
        """Single-key lookups and 128-key lookups of present keys, as fast as possible."""
        return _lookup_probe(self.maru.handler, f"{self.maru.namespace}:", tag, n_keys, count)

    def close(self) -> None:
        try:
            for store in self.stores.values():
                store.close()
        finally:
            self.shm.close()


class HybridInstance(Instance):
    """A Mamba hybrid "instance": the KV host pool and SGLang's `MambaPoolHost`, both
    registered through the v2 interface with MaruStorage and with HiCacheFile, as
    `HybridCacheController` registers them. A call over KV pages [s, s + n) carries one
    state per `state_every` pages, stored under the hash of the page it ends (as SGLang keys
    a node's state); Maru and the file backend move both pools in one `batch_set_v2` /
    `batch_get_v2`, the memcpy baselines copy the same bytes."""

    def __init__(
        self, url: str, case: HybridCase, pages: int, file_dir: str, role: str, ab: bool = False
    ):
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolName

        import sglang_cpu.host_pools as hp

        torch.set_num_threads(1)
        g = case.kv.geometry()
        hp.TOKENS = g.page_size * (pages // 2 + 2)
        self.pool = kv = hp.make_host_pool(g)
        self.P, self.pages, self.every = kv.page_size, pages, case.state_every
        self.states = pages // case.state_every
        self.mamba = case.mamba_pool(self.states)
        self.idx = hp.page_indices(0, pages, self.P)
        self.state_idx = torch.arange(self.states, dtype=torch.int64)
        kv_ptrs, kv_sizes = kv.get_page_buffer_meta(self.idx)
        st_ptrs, st_sizes = self.mamba.get_page_buffer_meta(self.state_idx)
        self.parts = len(kv_ptrs) // pages
        self.st_parts = len(st_ptrs) // self.states
        self.part_ptrs = [np.array(kv_ptrs[j :: self.parts], np.int64) for j in range(self.parts)]
        self.st_part_ptrs = [
            np.array(st_ptrs[j :: self.st_parts], np.int64) for j in range(self.st_parts)
        ]
        self.page_bytes = sum(kv_sizes[: self.parts])
        self.state_bytes = sum(st_sizes[: self.st_parts])
        assert self.state_bytes == case.state_bytes, (self.state_bytes, case.state_bytes)
        self.ptrs, self.sizes = list(kv_ptrs) + list(st_ptrs), list(kv_sizes) + list(st_sizes)
        self.kv_total = pages * self.page_bytes
        self.total = self.kv_total + self.states * self.state_bytes
        sizes = [self.page_bytes] * pages + [self.state_bytes] * self.states
        self._setup(url, case, file_dir, role, False, sizes, ab)
        for backend in (*self.stores.values(), self.file):
            backend.register_mem_host_pool_v2(kv, PoolName.KV)
            backend.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
            backend.on_host_pools_registered()

    def info(self) -> dict:
        return {
            "page_bytes": self.page_bytes,
            "parts": self.parts,
            "pages": self.pages,
            "states": self.states,
            "state_bytes": self.state_bytes,
            "state_parts": self.st_parts,
            "bytes": self.total,
        }

    def crcs(self) -> list[int]:
        return [
            zlib.crc32((ctypes.c_char * size).from_address(ptr))
            for ptr, size in zip(self.ptrs, self.sizes)
        ]

    def _state_range(self, s: int, n: int) -> range:
        """The states of KV pages [s, s + n): one at the end of each `every` pages."""
        return range(-(-s // self.every), (s + n) // self.every)

    def _transfers(self, keys, idx, s, n):
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        states = self._state_range(s, n)
        return [
            PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=self.state_idx[states.start : states.stop],
                keys=[keys[(st + 1) * self.every - 1 - s] for st in states],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]

    @staticmethod
    def _done(results: dict, n: int) -> int:
        """KV pages stored or loaded, counted only if every state was too."""
        ok = {str(name): r for name, r in results.items()}
        return sum(ok.get("kv", [])) if all(ok.get("mamba", [False])) else 0

    def _store_set(self, store, keys, idx, s, n) -> int:
        return self._done(store.batch_set_v2(self._transfers(keys, idx, s, n)), n)

    def _store_get(self, store, keys, idx, s, n) -> int:
        return self._done(store.batch_get_v2(self._transfers(keys, idx, s, n)), n)

    def _file_set(self, keys, idx, s, n) -> int:
        return self._done(self.file.batch_set_v2(self._transfers(keys, idx, s, n)), n)

    def _file_get(self, keys, idx, s, n) -> int:
        return self._done(self.file.batch_get_v2(self._transfers(keys, idx, s, n)), n)

    def _copy(
        self, base: int, to_pool: bool, s: int, n: int, streaming: bool = False, threads: int = 1
    ) -> int:
        _copy_pages(
            self.part_ptrs, self.sizes[: self.parts], base, to_pool, s, n, streaming, threads
        )
        states = self._state_range(s, n)
        st_sizes = self.sizes[len(self.sizes) - self.states * self.st_parts :][: self.st_parts]
        _copy_pages(
            self.st_part_ptrs,
            st_sizes,
            base + self.kv_total,
            to_pool,
            states.start,
            len(states),
            streaming,
            threads,
        )
        return n

    def stored_keys(self, tag: str, count: int) -> list[str]:
        hashes = [page_key(tag, i) for i in range(count)]
        ends = [hashes[(st + 1) * self.every - 1] for st in self._state_range(0, count)]
        return self.maru.pools["kv"].keys(hashes) + self.maru.pools["mamba"].keys(ends)


# Per-path metadata samples of `Instance.meta`, as "<path>/<name>": 128-key batch_exists per
# key through MaruStorage and through the handler, and through MaruStorage for 128 keys never
# stored (a new prompt: SGLang's commonest batch_exists); single-key exists through both.
PATH_META = ("exists128", "exists128_h", "exists128_new", "exists1", "exists1_h")
READ_OPS = ("exists", "lookup_kv", "release")


def _read_requests(h) -> int:
    """The read requests the server has served so far (all clients)."""
    ops = h.stats().get("operations", {})
    return sum(ops.get(name, {}).get("count", 0) for name in READ_OPS)


def _batch_lookup(h):
    """The metadata RPC of `batch_get_v1`: a leased lookup (and its release)."""

    def lookup(keys):
        with h.lookup(keys, lease=True) as found:
            return found.addresses

    return lookup


def _lookup_probe(h, prefix: str, tag: str, n_keys: int, count: int) -> dict[str, list[float]]:
    rng = random.Random(n_keys)
    lookup = _batch_lookup(h)
    singles = [prefix + page_key(tag, rng.randrange(n_keys)) for _ in range(count)]
    batches = [
        [prefix + page_key(tag, rng.randrange(n_keys)) for _ in range(128)]
        for _ in range(max(4, count // 16))
    ]
    rtt, per_key = [], []
    for _ in range(3):  # warm up
        h.retrieve(singles[0])
    for k in singles:
        t0 = time.perf_counter()
        info = h.retrieve(k)
        rtt.append(time.perf_counter() - t0)
        assert info is not None, k
    for keys in batches:
        t0 = time.perf_counter()
        lookup(keys)
        per_key.append((time.perf_counter() - t0) / 128)
    return {"rtt": rtt, "lookup": per_key}


class KeysSide:
    """One process's side of the keys scaling: an `Instance` (mha-64K, 128 pages) per server.
    The writer registers n tiny values under keys of its KV namespace (so that MaruStorage's
    calls find them), each in a 4 KiB chunk of its own (the server holds at most one key a
    page) that nothing writes: the pool's file stays sparse there, 4 GiB of it at 10^6 keys
    taking no memory; and it stores a working set of 128 real pages. The reader looks keys up
    and reads the working set, on every path."""

    def __init__(self, urls: list[str], role: str, ab: bool, cpu: int | None, file_dir: str):
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        self.inst = [Instance(u, KEYS_CASE, 128, file_dir, role, ab) for u in urls]
        self.registrars: list[Any] = []  # MaruHandlers (`register`)

    def fill(self, seed: int) -> list[int]:
        """The same pages in every instance; their CRCs."""
        crcs = [inst.fill(seed) for inst in self.inst]
        return crcs[-1]

    def store_working_set(self) -> None:
        for inst in self.inst:
            assert inst.run("maru_set", "ws", 128)[1] == 128, "storing the working set failed"

    def register(self, i: int, n: int) -> float:
        """Register keys [0, n) of tag "scale" on server i in batches of 16384, each key a 64
        byte value in a 4 KiB chunk of its own, through a handler of 4 KiB chunks that maps
        nothing in bulk (`eager_map` off: its regions stay holes). Returns seconds."""
        from maru import MaruConfig, MaruHandler

        store = self.inst[i].maru
        config = MaruConfig(
            server_url=store.config.server_url,
            pool_size=str(scale_pool_bytes(n)),
            chunk_size_bytes=SCALE_CHUNK,
            eager_map=False,
        )
        # (kept connected while the probes run: a departed instance's keys are orphans)
        registrar = MaruHandler(config)
        self.registrars.append(registrar)
        t0 = time.perf_counter()
        for start in range(0, n, 16384):
            keys = store.pools["kv"].keys(
                [page_key("scale", k) for k in range(start, min(n, start + 16384))]
            )
            m = len(keys)
            handles = registrar.reserve_values(SCALE_CHUNK, m)
            assert handles is not None, "no room for the scale keys"
            ok = registrar.batch_store(keys, handles=handles, lengths=[64] * m)
            assert all(ok), "registering scale keys failed"
        return time.perf_counter() - t0

    def probe(
        self, counts: list[int], rounds: int, singles: int, crcs: list[int]
    ) -> list[dict[str, list[float]]]:
        """Round robin over the servers: each round makes, per path, `singles` single-key
        `exists` and a few 128-key `batch_exists` of random registered keys and four
        `batch_get_v1` of the working set, then `singles` lookup round trips (`retrieve`), on
        every server in turn, so that all see the same machine state; a pause before each
        server's turn, so that the one before has gone back to sleep."""
        rng = random.Random(7)
        paths = [p for p in ("maru", "request") if p in self.inst[0].stores]
        names = [f"{p}/{m}" for p in paths for m in ("exists1", "exists128", "get")]
        out: list[dict[str, list[float]]] = [{k: [] for k in [*names, "rtt"]} for _ in self.inst]
        for inst in self.inst:  # warm up; the working set's bytes checked once per path
            for p in paths:
                inst.wipe()
                assert inst.run(f"{p}_get", "ws", 128)[1] == 128
                assert inst.crcs() == crcs, f"{p}: working set pages differ"
                for _ in range(20):
                    inst.stores[p].exists(page_key("scale", 0))
                    inst.maru.handler.retrieve(inst.stored_keys("scale", 1)[0])
        for _ in range(rounds):
            for inst, n, res in zip(self.inst, counts, out):
                # Let the server probed last stop polling (`--busy-poll-us`, 1 ms) first: one
                # server per node is what is measured, not four competing for their CPU.
                time.sleep(0.003)
                for p in paths:
                    store = inst.stores[p]
                    for _ in range(singles):
                        key = page_key("scale", rng.randrange(n))
                        t0 = time.perf_counter()
                        found = store.exists(key)
                        res[f"{p}/exists1"].append(time.perf_counter() - t0)
                        assert found, key
                    for _ in range(max(2, singles // 10)):
                        keys = [page_key("scale", rng.randrange(n)) for _ in range(128)]
                        t0 = time.perf_counter()
                        found = store.batch_exists(keys)
                        res[f"{p}/exists128"].append((time.perf_counter() - t0) / 128)
                        assert found == 128, found
                    for _ in range(4):
                        times, ok, *_ = inst.run(f"{p}_get", "ws", 128, 0, 128)
                        assert ok == 128, ok
                        res[f"{p}/get"] += times
                h, kv = inst.maru.handler, inst.maru.pools["kv"]
                for _ in range(singles):
                    key = kv.keys([page_key("scale", rng.randrange(n))])[0]
                    t0 = time.perf_counter()
                    info = h.retrieve(key)
                    res["rtt"].append(time.perf_counter() - t0)
                    assert info is not None, key
        return out

    def close(self) -> None:
        for inst in self.inst:
            inst.close()


def _serve(conn, factory, args) -> None:
    obj = None
    try:
        obj = factory(*args)
        conn.send(("ok", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            name, call_args = msg
            try:
                conn.send(("ok", getattr(obj, name)(*call_args)))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    except Exception:
        conn.send(("err", traceback.format_exc()))
    finally:
        if obj is not None:
            obj.close()
        conn.close()


class Worker:
    """A forked process serving calls on one object; `call` waits, `send`/`recv` overlap."""

    def __init__(self, factory, *args):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self.proc.start()
        child.close()
        self._pending = True  # the constructor's reply

    def send(self, name: str, *args) -> None:
        if self._pending:
            self.recv()
        self.conn.send((name, args))
        self._pending = True

    def recv(self) -> Any:
        status, value = self.conn.recv()
        self._pending = False
        if status != "ok":
            raise RuntimeError(f"worker {self.proc.pid} failed:\n{value}")
        return value

    def call(self, name: str, *args) -> Any:
        self.send(name, *args)
        return self.recv()

    def close(self) -> None:
        try:
            if self._pending:
                self.recv()
            self.conn.send(None)
        except (OSError, EOFError, RuntimeError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def call_all(workers: list[Worker], name: str, *args_per) -> list[Any]:
    """The same call on every worker at once (args_per[i] are worker i's arguments)."""
    for w, args in zip(workers, args_per):
        w.send(name, *args)
    return [w.recv() for w in workers]


# -- server ------------------------------------------------------------------------------------


def maru_server(pool_size: str, cpu: int | None = None):
    """A `maru-server` subprocess (`tests/sglang_cpu/p2p.py`'s launcher), run as
    `python -m maru.server` so that PYTHONPATH picks the code (before/after comparisons);
    on CPU `cpu` alone if given (`taskset`)."""
    from sglang_cpu.p2p import maru_server as launch

    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return launch(
        pool_size,
        command=[*pin, sys.executable, "-m", "maru.server"],
        extra_args=["--heartbeat-timeout", "120", "--lease-timeout", "120"],
        pool_dir=SHM_DIR,
    )


def split_cpus() -> tuple[int, int] | None:
    """(a CPU for a client, another for the servers), when there are two and `taskset`."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None
    return cpus[0], cpus[-1]


# -- progress ----------------------------------------------------------------------------------


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                import tqdm

                tqdm.tqdm.monitor_interval = 0  # no monitor thread: we fork afterwards
                self._bar = tqdm.tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass
        self.t0 = time.monotonic()

    def step(self, what: str, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(what[:40])
            self._bar.update(n)
            return
        width = 30
        done = min(width, width * self.n // max(1, self.total))
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} "
            f"{time.monotonic() - self.t0:5.0f}s {what[:40]:<40}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


# -- statistics --------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def size_label(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n // KiB} KiB"


# -- phases ------------------------------------------------------------------------------------

# memcpy: plain copies to a private buffer; shm: the same to a /dev/shm mapping; stream: Maru's
# own copy loop alone (streaming stores) to /dev/shm (the limit is the fastest of these three);
# request: Maru with the shared-memory index off (only where it exists: `Plan.ab`); checked:
# Maru with maru_checksums on.
COPIES = ("memcpy", "shm", "stream")
# stream2: the same loop on two threads, as MaruStorage copies with the default
# `maru_copy_threads`; printed beside the limit, not part of it.
STREAM2_THREADS = 2
BACKENDS = [*COPIES, "stream2", "maru", "request", "checked", "file"]
MARUS = ("maru", "request", "checked")  # MaruStorage backends of an Instance
STORES = (*MARUS, "file")  # what stores under keys (read back and checked)
# Writes take no index (registering stays a request): "request" only reads, what "maru" wrote.
NO_OP = ("request", "set")


def writes_with(backend: str) -> str:
    """The backend whose writes give `backend` its pages to read."""
    return "maru" if backend == "request" else backend


def _throughput(writer, reader, name, plan, batch, pages, crcs, prog) -> dict[str, list[float]]:
    """GB/s of every method, per repetition (after a warm-up round whose reads are checked
    against the writer's CRCs), methods alternating within each repetition in an order
    shuffled per repetition (seeded): a copy runs measurably faster or slower depending on
    which method ran just before it, so no method always follows the same one."""
    nbytes = writer.call("info")["bytes"]
    sec: dict[str, list[float]] = {
        f"{b}_{op}": [] for b in plan.backends for op in ("set", "get") if (b, op) != NO_OP
    }
    for rep in range(plan.reps + 1):  # rep 0 warms pages, mappings and files up
        tag = f"{name}/r{rep}"
        for b in random.Random(rep).sample(plan.backends, len(plan.backends)):
            w = writer.call("run", f"{writes_with(b)}_set", tag, batch, 0, pages)
            if b in STORES:
                reader.call("wipe")
            r = reader.call("run", f"{b}_get", tag, batch, 0, pages)
            if b in STORES:
                assert w[1] == pages and r[1] == pages, (b, w[1], r[1])
                if rep == 0:
                    assert reader.call("crcs") == crcs, f"{name}: pages read by {b} differ"
            if rep:
                if (b, "set") != NO_OP:
                    sec[f"{b}_set"].append(sum(w[0]))
                sec[f"{b}_get"].append(sum(r[0]))
            if b in MARUS:
                writer.call("maru_delete", tag, pages, writes_with(b))
            elif b == "file":
                writer.call("file_clear")
        prog.step(f"{name}: rep {rep}")
    return {k: [nbytes / s / 1e9 for s in v] for k, v in sec.items()}


BACK_TO_BACK = ("stream", "maru")  # the small-page case's second measurement


def _back_to_back(writer, reader, name, plan, batch, pages) -> dict[str, list[float]]:
    """GB/s of Maru and the `stream` copy with no idle before each timed burst (each right
    after an untimed one of the same method in the same process), per repetition. Not a
    target: it shows what the small-page case loses to the idle before a burst (threads and
    the server asleep, caches cold), which `_throughput` keeps as SGLang meets it."""
    nbytes = writer.call("info")["bytes"]
    sec: dict[str, list[float]] = {f"{b}_{op}": [] for b in BACK_TO_BACK for op in ("set", "get")}
    for rep in range(plan.reps + 1):  # rep 0 warms up
        tag = f"{name}/b2b{rep}"
        for b in random.Random(rep).sample(BACK_TO_BACK, len(BACK_TO_BACK)):
            w = writer.call("run_back_to_back", f"{b}_set", tag, batch)
            r = reader.call("run_back_to_back", f"{b}_get", tag, batch)
            if b == "maru":
                assert w[1] == pages and r[1] == pages, (b, w[1], r[1])
                writer.call("maru_delete", tag, pages)
            if rep:
                sec[f"{b}_set"].append(sum(w[0]))
                sec[f"{b}_get"].append(sum(r[0]))
    return {k: [nbytes / s / 1e9 for s in v] for k, v in sec.items()}


def bench_hybrid(url, case: HybridCase, plan, prog) -> dict:
    """KV + Mamba state through `batch_set_v2` / `batch_get_v2` in a writer and a reader
    process, against the memcpy baselines and HiCacheFile's v2 on the same bytes: one call
    of 128 KV pages (SGLang's STORAGE_BATCH_SIZE) and their states per repetition."""
    file_dir = tempfile.mkdtemp(prefix=f"hicache-file-{case.name}-", dir=SHM_DIR)
    pages = 128
    writer = Worker(HybridInstance, url, case, pages, file_dir, "writer", plan.ab)
    reader = Worker(HybridInstance, url, case, pages, file_dir, "reader", plan.ab)
    try:
        info = writer.call("info")
        crcs = writer.call("fill", 3)
        prog.step(f"{case.name}: setup")
        gbps = _throughput(writer, reader, case.name, plan, pages, pages, crcs, prog)
        prog.step(f"{case.name}: done")
        return {
            "case": case,
            "page_bytes": info["page_bytes"],
            "parts": info["parts"],
            "pages": pages,
            "batch": pages,
            "gbps": gbps,
            "lat": {},
            "api": "v2",
            "workload": (
                f"{case.name}: {case.model}; per call {pages} KV pages of {info['page_bytes']} B "
                f"({info['parts']} parts) + {info['states']} Mamba states of "
                f"{info['state_bytes']} B ({info['state_parts']} parts: temporal, conv; one per "
                f"{case.state_every} pages), {info['bytes'] / MiB:.0f} MiB, both pools in one "
                f"batch_set_v2 / batch_get_v2 (file: HiCacheFile's v2), median of {plan.reps} reps"
            ),
        }
    finally:
        writer.close()
        reader.close()
        shutil.rmtree(file_dir, ignore_errors=True)


def bench_case(url, case, plan, tmp, prog) -> dict:
    """Writer and reader processes for one geometry: every method, alternating per rep."""
    file_dir = tempfile.mkdtemp(prefix=f"hicache-file-{case.name}-", dir=SHM_DIR)
    batch, batches = plan.pages_for(case.page_bytes)
    pages = batch * batches
    writer = Worker(Instance, url, case, pages, file_dir, "writer", plan.ab)
    reader = Worker(Instance, url, case, pages, file_dir, "reader", plan.ab)
    try:
        info = writer.call("info")
        page_bytes = info["page_bytes"]
        assert page_bytes == case.page_bytes, (page_bytes, case.page_bytes)
        crcs = writer.call("fill", 1)
        prog.step(f"{case.name}: setup")
        gbps = _throughput(writer, reader, case.name, plan, batch, pages, crcs, prog)
        back_to_back = {}
        if page_bytes < MiB and "maru" in plan.backends:
            back_to_back = _back_to_back(writer, reader, case.name, plan, batch, pages)
            prog.step(f"{case.name}: back to back")
        # Per-page latency: one-page calls, in rounds of at most `pages` pages.
        lat: dict[str, list[float]] = {f"{b}_{op}": [] for b in BACKENDS for op in ("set", "get")}
        done, rnd = 0, 0
        while done < plan.lat_samples:
            n = min(pages, plan.lat_samples - done)
            tag = f"{case.name}/lat{rnd}"
            for b in ("memcpy", *(m for m in MARUS if m in plan.backends), "file"):
                w = writer.call("run", f"{writes_with(b)}_set", tag, 1, 0, n)
                r = reader.call("run", f"{b}_get", tag, 1, 0, n)
                assert w[1] == n and r[1] == n, (b, w[1], r[1])
                if (b, "set") != NO_OP:
                    lat[f"{b}_set"] += w[0]
                lat[f"{b}_get"] += r[0]
                if b in MARUS:
                    writer.call("maru_delete", tag, n, writes_with(b))
                elif b == "file":
                    writer.call("file_clear")
            done += n
            rnd += 1
        prog.step(f"{case.name}: latency")
        return {
            "case": case,
            "page_bytes": page_bytes,
            "parts": info["parts"],
            "pages": pages,
            "batch": batch,
            "gbps": gbps,
            "lat": lat,
            "back_to_back": back_to_back,
        }
    finally:
        writer.close()
        reader.close()
        shutil.rmtree(file_dir, ignore_errors=True)


def _echo_zmq(conn) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        parts = sock.recv_multipart()
        if parts[1] == b"stop":
            break
        sock.send_multipart(parts)


def _echo_tcp(conn) -> None:
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := peer.recv(65536)) and data != b"stop":
        peer.sendall(data)


def _echo_unix(conn) -> None:
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0maru-bench-echo-{os.getpid()}")
    listener.listen()
    conn.send(listener.getsockname())
    peer, _ = listener.accept()
    while (data := peer.recv(65536)) and data != b"stop":
        peer.sendall(data)


def _transport_floor(count: int) -> dict[str, list[float]]:
    """Round trips of a 200-byte message to an echo process, with pyzmq DEALER/ROUTER (Maru's
    TCP transport), a plain TCP socket and a plain Unix socket (what Maru's local socket
    rides on): what the transports alone cost here."""
    import socket

    import zmq

    out: dict[str, list[float]] = {}
    for name, target in (("zmq", _echo_zmq), ("tcp", _echo_tcp), ("unix", _echo_unix)):
        parent, child = mp.Pipe()
        pid = os.fork()  # (a daemonic worker may not start multiprocessing children)
        if pid == 0:
            try:
                target(child)
            finally:
                os._exit(0)
        port = parent.recv()
        if name == "zmq":
            zsock = zmq.Context.instance().socket(zmq.DEALER)
            zsock.connect(f"tcp://127.0.0.1:{port}")

            def send(data, zsock=zsock):
                zsock.send(data)

            def recv(zsock=zsock):
                return zsock.recv()
        else:
            if name == "unix":
                tsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                tsock.connect(port)  # the echo's address
            else:
                tsock = socket.create_connection(("127.0.0.1", port))
                tsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send, recv = tsock.sendall, (lambda tsock=tsock: tsock.recv(65536))
        msg, times = b"x" * 200, []
        for i in range(count + 20):
            t0 = time.perf_counter()
            send(msg)
            recv()
            if i >= 20:
                times.append(time.perf_counter() - t0)
        send(b"stop")
        os.waitpid(pid, 0)
        out[name] = times
    return out


class _Floor:
    """Runs `_transport_floor` in a fresh forked process (its own zmq context)."""

    def run(self, count: int) -> dict[str, list[float]]:
        return _transport_floor(count)

    def close(self) -> None:
        pass


def bench_meta(url, plan, prog) -> dict:
    case = CASES[0]
    file_dir = tempfile.mkdtemp(prefix="hicache-file-meta-", dir=SHM_DIR)
    writer = Worker(Instance, url, case, 128, file_dir, "writer", plan.ab)
    reader = Worker(Instance, url, case, 128, file_dir, "reader", plan.ab)
    try:
        writer.call("fill", 2)
        assert writer.call("run", "maru_set", "meta", 128)[1] == 128
        assert writer.call("run", "file_set", "meta", 128)[1] == 128
        reader.call("meta", "meta", 5, 20)  # warm-up
        out = reader.call("meta", "meta", plan.meta_rounds, plan.rtt_samples)
        out["file_exists"] = reader.call("file_exists", "meta", plan.meta_rounds)
        floor = Worker(_Floor)
        try:
            floors = floor.call("run", plan.rtt_samples)
        finally:
            floor.close()
        out["floor_zmq"], out["floor_tcp"] = floors["zmq"], floors["tcp"]
        out["floor_unix"] = floors["unix"]
        prog.step("metadata")
        return out
    finally:
        writer.close()
        reader.close()
        shutil.rmtree(file_dir, ignore_errors=True)


def bench_instances(url, plan, prog) -> list[dict]:
    rows = []
    case = SCALE_CASE
    for n in (1, 2, 4):
        file_dir = tempfile.mkdtemp(prefix="hicache-file-scale-", dir=SHM_DIR)
        pages = plan.scale_pages
        writers = [Worker(Instance, url, case, pages, file_dir, "writer") for _ in range(n)]
        readers = [Worker(Instance, url, case, pages, file_dir, "reader") for _ in range(n)]
        try:
            call_all(writers, "fill", *[(10 + i,) for i in range(n)])
            page_bytes = writers[0].call("info")["page_bytes"]
            set_gbps, get_gbps = [], []
            for rep in range(plan.scale_reps + 1):
                tags = [(f"scale{n}/w{i}/r{rep}", 128, 0, pages) for i in range(n)]
                w = call_all(writers, "run", *[("maru_set", *t) for t in tags])
                r = call_all(readers, "run", *[("maru_get", *t) for t in tags])
                total = n * pages * page_bytes
                assert all(x[1] == pages for x in w + r)
                if rep:
                    set_gbps.append(total / (max(x[3] for x in w) - min(x[2] for x in w)) / 1e9)
                    get_gbps.append(total / (max(x[3] for x in r) - min(x[2] for x in r)) / 1e9)
                if rep < plan.scale_reps:
                    call_all(writers, "maru_delete", *[(t[0], pages) for t in tags])
            tags = [f"scale{n}/w{i}/r{plan.scale_reps}" for i in range(n)]
            probes = call_all(
                readers, "lookup_load", *[(t, pages, plan.scale_lookups) for t in tags]
            )
            call_all(writers, "maru_delete", *[(t, pages) for t in tags])
            rtt = [x for p in probes for x in p["rtt"]]
            per_key = [x for p in probes for x in p["lookup"]]
            rows.append(
                {
                    "instances": n,
                    "set_gbps": med(set_gbps),
                    "get_gbps": med(get_gbps),
                    "rtt_med_us": med(rtt) * 1e6,
                    "rtt_p99_us": pct(rtt, 0.99) * 1e6,
                    "lookup128_us_per_key": med(per_key) * 1e6,
                }
            )
            prog.step(f"scaling: {n} instance(s)")
        finally:
            for w in writers + readers:
                w.close()
            shutil.rmtree(file_dir, ignore_errors=True)
    return rows


def bench_keys(plan, prog) -> list[dict]:
    """One dedicated server per key count, probed in turn (see `KeysSide.probe`). The
    servers share one CPU and the prober has the other: where the scheduler put a server
    that polls after each request (`--busy-poll-us`) beside its client, a round trip took
    ~60 us instead of ~30, at random, which drowned what the key count changes."""
    counts = list(plan.key_counts)
    rounds = 10 if plan.quick else 20
    cpus = split_cpus()
    client_cpu, server_cpu = cpus if cpus is not None else (None, None)
    file_dir = tempfile.mkdtemp(prefix="hicache-file-keys-", dir=SHM_DIR)
    try:
        with ExitStack() as stack:
            # a pool of holes but for the working set (`KeysSide`): its keys' 64 bytes stay far
            # below the eviction watermark
            urls = [
                stack.enter_context(maru_server(str(SERVER_POOL + scale_pool_bytes(n)), server_cpu))
                for n in counts
            ]
            writer = Worker(KeysSide, urls, "writer", False, client_cpu, file_dir)
            reader = Worker(KeysSide, urls, "reader", plan.ab, client_cpu, file_dir)
            try:
                crcs = writer.call("fill", 4)
                writer.call("store_working_set")
                reg_s = []
                for i, n in enumerate(counts):
                    reg_s.append(writer.call("register", i, n))
                    prog.step(f"keys: {n:.0e}")
                singles = max(1, plan.scale_lookups // rounds)
                probes = reader.call("probe", counts, rounds, singles, crcs)
            finally:
                writer.close()
                reader.close()
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)
    batch_bytes = 128 * KEYS_CASE.page_bytes
    rows = []
    for n, r, p in zip(counts, reg_s, probes):
        for path in plan.paths:
            default = path == "maru"  # the round trips were measured once, on its handler
            rows.append(
                {
                    "keys": n,
                    "path": path,
                    "register_s": r,
                    "exists_med_us": med(p[f"{path}/exists1"]) * 1e6,
                    "exists128_us_per_key": med(p[f"{path}/exists128"]) * 1e6,
                    "get_ms": med(p[f"{path}/get"]) * 1e3,
                    "get_gbps": batch_bytes / med(p[f"{path}/get"]) / 1e9,
                    "rtt_med_us": med(p["rtt"]) * 1e6 if default else float("nan"),
                    "rtt_p99_us": pct(p["rtt"], 0.99) * 1e6 if default else float("nan"),
                }
            )
    return rows


# -- report ------------------------------------------------------------------------------------


def scheduler_settings() -> str:
    """The kernel command line's `sched*` settings: a VM's vCPU packing shows here (it puts a
    woken server on its writer's vCPU after idle: benchmarks/results/history.md, issue 17,
    sessions 26-27)."""
    try:
        words = Path("/proc/cmdline").read_text().split()
    except OSError:
        return "unknown"
    return " ".join(w for w in words if w.startswith("sched")) or "none"


def machine_info() -> dict:
    model = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import msgpack
    import torch
    import zmq

    from maru.common import hugepages

    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:
        sglang_version = "?"
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sglang": sglang_version,
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "load_before": os.getloadavg()[0],
        "pool_dir": SHM_DIR,
        "huge": hugepages.tmpfs_huge_option(SHM_DIR) or "not a tmpfs",
        "scheduler": scheduler_settings(),
    }


def build_rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        case = res["case"]
        for op in ("set", "get"):
            backends = [b for b in BACKENDS if f"{b}_{op}" in res["gbps"]]
            # Ratios per repetition (the methods of one repetition ran seconds apart), then
            # their median: steadier than a ratio of medians on a machine whose speed drifts.
            # vs_memcpy: to the faster plain copy (private or /dev/shm memory), issue 5's
            # yardstick; vs_limit: to the fastest of the three copies (with Maru's streaming
            # loop), issue 17's.
            gbps = res["gbps"]
            memcpy = [max(a, b) for a, b in zip(gbps[f"memcpy_{op}"], gbps[f"shm_{op}"])]
            limit = [max(a, b) for a, b in zip(memcpy, gbps[f"stream_{op}"])]
            file = gbps[f"file_{op}"]
            maru = gbps[f"maru_{op}"]
            for b in backends:
                g = gbps[f"{b}_{op}"]
                lat = res["lat"].get(f"{b}_{op}", [])
                rows.append(
                    {
                        "case": case.name,
                        "page": size_label(res["page_bytes"]),
                        "page_bytes": res["page_bytes"],
                        "op": op,
                        "api": res.get("api", "v1"),
                        "backend": b,
                        "gbps": med(g),
                        "gbps_min": min(g),
                        "gbps_max": max(g),
                        "vs_limit": med([x / y for x, y in zip(g, limit)]),
                        "vs_memcpy": med([x / y for x, y in zip(g, memcpy)]),
                        "vs_file": med([x / y for x, y in zip(g, file)]),
                        "vs_maru": med([x / y for x, y in zip(g, maru)]),
                        "lat_med_us": med(lat) * 1e6 if lat else float("nan"),
                        "lat_p99_us": pct(lat, 0.99) * 1e6 if lat else float("nan"),
                    }
                )
    return rows


_CHECKED = {"maru": "", "checked": " (checksums)"}  # the backends with targets


def throughput_goal(op: str, page_bytes: int) -> float:
    if op == "set":
        return TARGETS["set"]
    return TARGETS["get_big"] if page_bytes >= MiB else TARGETS["get_small"]


def evaluate(rows, meta, keys) -> list[tuple[str, float, str, bool]]:
    """(target, measured, goal, passed) for every target (issues 5 and 17). The "request"
    rows (the index off) are the before: shown, not judged."""
    out = []
    for r in rows:
        if r["backend"] not in _CHECKED:
            continue
        goal = throughput_goal(r["op"], r["page_bytes"])
        out.append(
            (
                f"{r['case']} batch_{r['op']}_{r['api']}{_CHECKED[r['backend']]} / limit",
                r["vs_limit"],
                f">= {goal:.0%}",
                r["vs_limit"] >= goal,
            )
        )
    for r in rows:
        if r["backend"] not in _CHECKED:
            continue
        ratio = r["vs_file"]
        out.append(
            (
                f"{r['case']} batch_{r['op']}_{r['api']}{_CHECKED[r['backend']]} / HiCacheFile",
                ratio,
                f">= {TARGETS['file']:.0f}x",
                ratio >= TARGETS["file"],
            )
        )
    v = med(meta["maru/exists128"]) * 1e6
    goal = TARGETS["exists_us"]
    out.append(("MaruStorage.batch_exists, 128 keys: us/key", v, f"<= {goal:g}", v <= goal))
    v = med(meta["maru/exists1"]) * 1e6
    goal = TARGETS["single_us"]
    out.append(("MaruStorage.exists, one key (median): us", v, f"<= {goal:g}", v <= goal))
    default = [r for r in keys if r["path"] == "maru"]
    if len(default) > 1:
        lo, hi = default[0], default[-1]
        for metric, label in (
            ("exists128_us_per_key", "batch_exists per key"),
            ("exists_med_us", "single-key exists"),
            ("get_ms", f"batch_get_v1 time ({KEYS_CASE.name} x 128)"),
        ):
            ratio = hi[metric] / lo[metric]
            out.append(
                (
                    f"{label} at {hi['keys']:.0e} / at {lo['keys']:.0e} keys",
                    ratio,
                    f"<= {TARGETS['keys']:g}x",
                    ratio <= TARGETS["keys"],
                )
            )
    return out


def fmt(v: float, nd: int = 2) -> str:
    return "-" if v != v else f"{v:.{nd}f}"


def _maru_vs_stream(gbps: dict[str, list[float]], op: str) -> float:
    """Median over repetitions of Maru's GB/s / the `stream` copy's."""
    return med([m / s for m, s in zip(gbps[f"maru_{op}"], gbps[f"stream_{op}"])])


def back_to_back_ratios(res: dict) -> dict[str, tuple[float, float]]:
    """Per op, Maru / `stream` with no idle before the burst (`_back_to_back`) and in the
    main measurement (after idle); empty where the first was not measured."""
    b2b = res.get("back_to_back") or {}
    return {
        op: (_maru_vs_stream(b2b, op), _maru_vs_stream(res["gbps"], op))
        for op in ("set", "get")
        if b2b.get(f"maru_{op}")
    }


def render_back_to_back(results: list[dict]) -> list[str]:
    """The small-page case without idle before a burst, beside the same run's after-idle
    ratio: not a target, the share of a miss that is the idle."""
    measured = [(res["case"].name, back_to_back_ratios(res)) for res in results]
    if not any(ratios for _, ratios in measured):
        return []
    lines = [
        "",
        "Back to back (not a target): each burst right after an untimed one of the same",
        "method in the same process, no idle before it, beside the table's bursts (the writer",
        "and the reader wait while the other works, as SGLang's calls come); Maru / stream,",
        "median of per-repetition ratios:",
        "| case | op | back to back | after idle |",
        "|---|---|---:|---:|",
    ]
    for name, ratios in measured:
        for op, (b2b, idle) in ratios.items():
            lines.append(f"| {name} | {op} | {b2b:.0%} | {idle:.0%} |")
    return lines


def render(machine, plan, results, rows, meta, inst, keys, targets, cmd) -> str:
    lines = []
    lines.append(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB, "
        f"Linux {machine['kernel']}; Python {machine['python']}, torch {machine['torch']}, "
        f"SGLang {machine['sglang']}; 1-min load at start {machine['load_before']:.2f}; "
        f"pools in {machine['pool_dir']} (huge={machine['huge']}); kernel scheduler "
        f"settings: {machine['scheduler']}"
    )
    lines.append(f"command: {cmd}")
    lines.append("")
    lines.append("Workload (batch_set_v1 in one process, batch_get_v1 in another):")
    for res in results:
        c = res["case"]
        if "workload" in res:
            lines.append(f"  {res['workload']}")
            continue
        lines.append(
            f"  {c.name}: {c.model}; {res['page_bytes']} B/page in {res['parts']} part(s), "
            f"{res['pages']} pages in batches of {res['batch']}, median of {plan.reps} reps"
        )
    lines.append("")
    head = (
        f"| {'case':8} | {'page':9} | op  | {'backend':7} | {'GB/s':>6} | {'min-max':>11} "
        f"| {'/limit':>6} | {'/memcpy':>7} | {'1-page med us':>13} | {'p99 us':>8} |"
    )
    lines.append(head)
    lines.append("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        lines.append(
            f"| {r['case']:8} | {r['page']:9} | {r['op']} | {r['backend']:7} | "
            f"{fmt(r['gbps']):>6} | {fmt(r['gbps_min'], 1) + '-' + fmt(r['gbps_max'], 1):>11} | "
            f"{r['vs_limit']:>6.0%} | {r['vs_memcpy']:>7.0%} | {fmt(r['lat_med_us'], 1):>13} | "
            f"{fmt(r['lat_p99_us'], 1):>8} |"
        )
    lines.append("")
    lines.append("memcpy: a memmove per page part, page by page (copy_values, in C), to/from")
    lines.append("a warm private buffer; shm: the same into a warm /dev/shm mapping; stream:")
    lines.append("Maru's copy loop alone (non-temporal stores) into that mapping, the floor")
    lines.append("under Maru; file:")
    lines.append("HiCacheFile on /dev/shm (legacy path; hybrid: its batch_set_v2 / batch_get_v2).")
    if plan.ab:
        lines.append("maru: the default configuration (the shared-memory index where the server")
        lines.append("offers it: see requests per call below); request: the same with")
        lines.append("maru_local_index false (round trips), alternating with it; it reads what")
        lines.append("maru wrote (writes take no index).")
    lines.append("/limit: median over repetitions of GB/s / the fastest of memcpy, shm and stream")
    lines.append("in the same repetition (issue 17's targets); /memcpy: the same against the")
    lines.append("faster of memcpy and shm. stream2: stream on two threads, as Maru copies")
    lines.append("(maru_copy_threads 2); not part of the limit.")
    lines.append("1-page: latency of one call moving one page (file: batch_set/get of one page).")
    lines.append("")
    lines.append("Checksums (maru_checksums: maru64 of every page, hashed in the copy loop by the")
    lines.append("writer and the reader): checked / plain Maru, median of per-repetition ratios")
    lines.append("| case | op | checked / maru | cost | 1-page med us: maru, checked |")
    lines.append("|---|---|---:|---:|---:|")
    by = {(r["case"], r["op"], r["backend"]): r for r in rows}
    for r in rows:
        if r["backend"] == "checked":
            plain = by[(r["case"], r["op"], "maru")]
            lines.append(
                f"| {r['case']} | {r['op']} | {r['vs_maru']:.0%} | {1 - r['vs_maru']:.0%} | "
                f"{fmt(plain['lat_med_us'], 1)}, {fmt(r['lat_med_us'], 1)} |"
            )
    lines += render_back_to_back(results)
    lines.append("")
    lines.append(
        f"Metadata ({KEYS_CASE.name} keys; 128-key batches: median of {plan.meta_rounds}; "
        f"single key: median / p99 of {plan.rtt_samples}):"
    )
    lines.append(
        "| path | batch_exists us/key: MaruStorage, handler, MaruStorage on a new prompt | "
        "exists us, median / p99: "
        "MaruStorage, handler | requests per call: batch_exists, exists, batch_get_v1 |"
    )
    lines.append("|---|---:|---:|---:|")
    for p in plan.paths:
        req = meta["requests"][p]
        lines.append(
            f"| {p} | {med(meta[f'{p}/exists128']) * 1e6:.3f}, "
            f"{med(meta[f'{p}/exists128_h']) * 1e6:.3f}, "
            f"{med(meta[f'{p}/exists128_new']) * 1e6:.3f} | "
            f"{med(meta[f'{p}/exists1']) * 1e6:.2f} / {pct(meta[f'{p}/exists1'], 0.99) * 1e6:.1f}, "
            f"{med(meta[f'{p}/exists1_h']) * 1e6:.2f} / "
            f"{pct(meta[f'{p}/exists1_h'], 0.99) * 1e6:.1f} | "
            f"{req['batch_exists']:.2f}, {req['exists']:.2f}, {req['batch_get_v1']:.2f} |"
        )
    if not plan.ab:
        lines.append("(this Maru has no maru_local_index: its one read path is measured)")
    lines.append(
        "requests per call: read requests (EXISTS, LOOKUP_KV, RELEASE) the server counted per "
        "call; 0 is the shared-memory index."
    )
    lines.append(
        f"  leased lookup (the request path of batch_get_v1) {med(meta['lookup']) * 1e6:.2f} "
        f"us/key; HiCacheFile batch_exists {med(meta['file_exists']) * 1e6:.2f} us/key"
    )
    lines.append(
        f"  single-key lookup round trip (retrieve: a request on every path) "
        f"{med(meta['rtt']) * 1e6:.1f} / {pct(meta['rtt'], 0.99) * 1e6:.1f} us; with the "
        f"client sleeping for replies (maru_busy_poll_us 0), alternating with the default: "
        f"{med(meta['rtt_sleep']) * 1e6:.1f} / {pct(meta['rtt_sleep'], 0.99) * 1e6:.1f} us"
    )
    lines.append(
        f"  transport alone (200-byte echo to another process): pyzmq DEALER/ROUTER "
        f"{med(meta['floor_zmq']) * 1e6:.1f} / {pct(meta['floor_zmq'], 0.99) * 1e6:.1f} us, "
        f"plain TCP socket {med(meta['floor_tcp']) * 1e6:.1f} / "
        f"{pct(meta['floor_tcp'], 0.99) * 1e6:.1f} us, plain Unix socket "
        f"{med(meta['floor_unix']) * 1e6:.1f} / {pct(meta['floor_unix'], 0.99) * 1e6:.1f} us"
    )
    if inst:
        lines.append("")
        lines.append(
            f"Concurrent instances ({SCALE_CASE.name}: N writer + N reader processes, "
            f"{plan.scale_pages} pages each; lookups from all N readers at once):"
        )
        lines.append(
            "| instances | set GB/s (sum) | get GB/s (sum) | lookup RTT med us | p99 us "
            "| 128-key lookup us/key |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for r in inst:
            lines.append(
                f"| {r['instances']} | {r['set_gbps']:.2f} | {r['get_gbps']:.2f} | "
                f"{r['rtt_med_us']:.1f} | {r['rtt_p99_us']:.1f} | "
                f"{r['lookup128_us_per_key']:.2f} |"
            )
    if keys:
        lines.append("")
        lines.append(
            "Registered keys (one server per count, probed round robin; random present keys; "
            f"batch_get_v1: a working set of 128 {KEYS_CASE.name} pages among them):"
        )
        lines.append(
            "| keys | path | register s | exists med us | batch_exists us/key "
            "| batch_get_v1 GB/s | lookup RTT med us | p99 us |"
        )
        lines.append("|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in keys:
            lines.append(
                f"| {r['keys']:.0e} | {r['path']} | {r['register_s']:.2f} | "
                f"{r['exists_med_us']:.2f} | {r['exists128_us_per_key']:.3f} | "
                f"{r['get_gbps']:.2f} | {fmt(r['rtt_med_us'], 1)} | {fmt(r['rtt_p99_us'], 1)} |"
            )
    lines.append("")
    lines.append("Targets:")
    lines.append("| target | measured | goal | result |")
    lines.append("|---|---:|---:|---|")
    for name, v, goal, ok in targets:
        shown = f"{v:.0%}" if name.endswith("/ limit") else f"{v:.3f}" if v < 1 else f"{v:.2f}"
        lines.append(f"| {name} | {shown} | {goal} | {'PASS' if ok else 'MISS'} |")
    return "\n".join(lines)


def write_csv(path, rows, meta, inst, keys, paths) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "case", "op", "backend", "metric", "value", "unit"])
        for r in rows:
            for metric, unit in (
                ("gbps", "GB/s"),
                ("gbps_min", "GB/s"),
                ("gbps_max", "GB/s"),
                ("vs_limit", "ratio"),
                ("vs_memcpy", "ratio"),
                ("vs_file", "ratio"),
                ("vs_maru", "ratio"),
                ("lat_med_us", "us"),
                ("lat_p99_us", "us"),
            ):
                w.writerow(["workload", r["case"], r["op"], r["backend"], metric, r[metric], unit])
        for p in paths:
            for key, how in (
                ("exists128", "storage"),
                ("exists128_h", "handler"),
                ("exists128_new", "storage, keys never stored"),
            ):
                value = med(meta[f"{p}/{key}"]) * 1e6
                w.writerow(["metadata", "128 keys", f"batch_exists ({how})", p, "us_per_key",
                            value, "us"])  # fmt: skip
            for key, how in (("exists1", "storage"), ("exists1_h", "handler")):
                for q, name in ((0.5, "med"), (0.99, "p99")):
                    value = pct(meta[f"{p}/{key}"], q) * 1e6
                    w.writerow(["metadata", "1 key", f"exists ({how})", p, name, value, "us"])
            for op, n in meta["requests"][p].items():
                w.writerow(["metadata", "requests", op, p, "per_call", n, "requests"])
        for key in ("lookup", "file_exists"):
            w.writerow(["metadata", "128 keys", key, "", "us_per_key", med(meta[key]) * 1e6, "us"])
        for key in ("rtt", "rtt_sleep", "floor_zmq", "floor_tcp", "floor_unix"):
            for q, name in ((0.5, "med"), (0.99, "p99")):
                w.writerow(["metadata", "1 key", key, "", name, pct(meta[key], q) * 1e6, "us"])
        for r in inst:
            for metric, value in r.items():
                w.writerow(["instances", r["instances"], "", "maru", metric, value, ""])
        for r in keys:
            for metric, value in r.items():
                if metric not in ("keys", "path"):
                    w.writerow(["keys", r["keys"], "", r["path"], metric, value, ""])


def plot(path, rows, inst, keys) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    colors = {
        "memcpy": "#888888",
        "shm": "#bbbbbb",
        "stream": "#2ca02c",
        "stream2": "#98df8a",
        "maru": "#1f77b4",
        "request": "#17becf",
        "checked": "#9467bd",
        "file": "#d62728",
    }
    if cases:  # (none with --cases none)
        plot_cases(axes[0], rows, cases, colors)
    ax = axes[1][0]
    if inst:
        ns = [r["instances"] for r in inst]
        ax.plot(ns, [r["set_gbps"] for r in inst], "o-", label="set GB/s (sum)")
        ax.plot(ns, [r["get_gbps"] for r in inst], "s-", label="get GB/s (sum)")
        ax.set_xlabel("concurrent writer/reader pairs")
        ax.set_ylabel("GB/s")
        ax.set_xticks(ns)
        ax2 = ax.twinx()
        ax2.plot(ns, [r["rtt_med_us"] for r in inst], "^--", color="#2ca02c", label="lookup RTT")
        ax2.set_ylabel("single-key lookup RTT, us (median)")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
        ax.set_title(f"Concurrent instances ({SCALE_CASE.name})")
    ax = axes[1][1]
    if keys:
        for way, style in (("maru", "-"), ("request", "--")):
            rs = [r for r in keys if r["path"] == way]
            if not rs:
                continue
            ks = [r["keys"] for r in rs]
            ax.plot(ks, [r["exists_med_us"] for r in rs], "o" + style, color="#1f77b4",
                    label=f"{way}: exists, median")  # fmt: skip
            ax.plot(ks, [r["exists128_us_per_key"] for r in rs], "s" + style, color="#2ca02c",
                    label=f"{way}: batch_exists of 128, /key")  # fmt: skip
            ax.plot(ks, [r["get_ms"] * 1e3 / 128 for r in rs], "^" + style, color="#9467bd",
                    label=f"{way}: batch_get_v1 of 128, /page")  # fmt: skip
            if way == "maru":
                ax.plot(ks, [r["rtt_med_us"] for r in rs], "o:", color="#d62728",
                        label="lookup round trip, median")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("registered keys")
        ax.set_ylabel("us")
        ax.legend(fontsize=7)
        ax.set_title("Lookups and reads vs registered keys")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_cases(axes, rows: list[dict], cases: list[str], colors: dict[str, str]) -> None:
    """The top panels: throughput and one-page latency per case."""
    by = {(r["case"], r["op"], r["backend"]): r for r in rows}
    bars = [(op, b) for op in ("set", "get") for b in BACKENDS if (cases[0], op, b) in by]
    ax = axes[0]
    width = 0.96 / len(bars)
    for k, (op, b) in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(cases))]
        vals = [by[(c, op, b)]["gbps"] for c in cases]
        hatch = "//" if op == "get" else None
        ax.bar(xs, vals, width, color=colors[b], hatch=hatch, edgecolor="black", linewidth=0.3,
               label=f"{b} {op}")  # fmt: skip
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("Throughput, batches of up to 128 pages (hatched: get)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    pairs = [(op, b) for op in ("set", "get") for b in ("memcpy", "maru", "file")]
    for k, (op, b) in enumerate(pairs):
        xs = [i + (k - 2.5) * 0.13 for i in range(len(cases))]
        meds = [by[(c, op, b)]["lat_med_us"] for c in cases]
        p99 = [by[(c, op, b)]["lat_p99_us"] for c in cases]
        hatch = "//" if op == "get" else None
        ax.bar(xs, meds, 0.13, color=colors[b], hatch=hatch, edgecolor="black", linewidth=0.3,
               label=f"{b} {op}")  # fmt: skip
        ax.scatter(xs, p99, marker="_", color="black", s=60)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("us per one-page call (bar: median, tick: p99)")
    ax.set_title("Per-page latency")
    ax.legend(fontsize=7, ncol=2)


# -- main --------------------------------------------------------------------------------------


def preload_sglang() -> None:
    """Import what the workers use (MaruStorage, SGLang's host pools, its backend factory and
    HiCacheFile) once, before forking them: otherwise each of the ~25 workers imports SGLang's
    model layers again, ~3 s apiece on this machine."""
    import sglang.srt.mem_cache.memory_pool
    import sglang.srt.mem_cache.pool_host.mamba
    import sglang.srt.mem_cache.pool_host.mha
    import sglang.srt.mem_cache.pool_host.mla
    import sglang.srt.mem_cache.storage.backend_factory
    import sglang.srt.mem_cache.storage.file  # noqa: F401
    from sglang.srt.mem_cache.pool_host import base

    import maru_sglang.maru_storage  # noqa: F401

    # A host pool refuses to be built unless 10 GiB of RAM stay free besides it: a server
    # sizing its HiCache to the machine. These pools take at most ~300 MiB each and the
    # machine is shared: other jobs' RAM must not fail the run, so keep 1 GiB free instead.
    reserve = getattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(reserve, 1 << 30)


def wait_for_quiet(limit: float, max_wait: float) -> None:
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        print(f"1-min load {os.getloadavg()[0]:.2f} > {limit}: waiting 30 s", file=sys.stderr)
        time.sleep(30)


def main() -> int:
    global SHM_DIR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer reps and samples")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    names = [c.name for c in [*CASES, HYBRID]]
    ap.add_argument(
        "--cases",
        default=",".join(names),
        help=f"workload cases, comma-separated ({', '.join(names)}), or none: only the "
        "metadata and scaling parts",
    )
    ap.add_argument("--skip-scaling", action="store_true", help="no instances/keys scaling")
    ap.add_argument("--max-keys", type=float, default=1e6, help="largest registered-key count")
    ap.add_argument("--wait-load", type=float, default=0, help="wait until the 1-min load < this")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--label", default="", help="added to the result file names")
    ap.add_argument(
        "--pool-dir",
        default=SHM_DIR,
        help="a tmpfs for the pools and the shm baselines (one with huge=within_size: 2 MiB pages)",
    )
    args = ap.parse_args()
    chosen = [] if args.cases == "none" else args.cases.split(",")
    if unknown := sorted(set(chosen) - set(names)):
        ap.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(names)}, or none)")
    SHM_DIR = args.pool_dir
    plan = Plan.make(args.quick, local_index_supported())
    plan.key_counts = tuple(k for k in plan.key_counts if k <= args.max_keys)
    cases = [c for c in CASES if c.name in chosen]
    if args.wait_load:
        wait_for_quiet(args.wait_load, 1200)

    t_start = time.monotonic()
    hybrid = HYBRID.name in chosen
    steps = (
        (len(cases) + hybrid) * (plan.reps + 3)
        + 1
        + (0 if args.skip_scaling else 3 + len(plan.key_counts))
    )
    prog = Progress(steps + 1, enabled=not args.no_progress)
    import sglang_cpu

    sglang_cpu.apply()  # before SGLang is imported
    preload_sglang()
    prog.step("SGLang imported")
    machine = machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="maru-bench-hicache-"))
    try:
        with maru_server("2G") as url:
            results = [bench_case(url, c, plan, tmp, prog) for c in cases]
            if hybrid:
                results.append(bench_hybrid(url, HYBRID, plan, prog))
            meta = bench_meta(url, plan, prog)
            inst = [] if args.skip_scaling else bench_instances(url, plan, prog)
        keys = [] if args.skip_scaling else bench_keys(plan, prog)
    finally:
        prog.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = build_rows(results)
    targets = evaluate(rows, meta, keys)
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_hicache.py", *sys.argv[1:]])
    text = render(machine, plan, results, rows, meta, inst, keys, targets, cmd)
    doc = {
        "machine": machine,
        "rows": rows,
        "per_rep_gbps": {r["case"].name: r["gbps"] for r in results},
        "back_to_back": {
            r["case"].name: {
                "per_rep_gbps": r["back_to_back"],
                "maru_vs_stream": {op: b2b for op, (b2b, _) in ratios.items()},
            }
            for r in results
            if (ratios := back_to_back_ratios(r))
        },
        "metadata": {
            "requests_per_call": meta["requests"],
            **{
                k: {"med_us": med(v) * 1e6, "p99_us": pct(v, 0.99) * 1e6}
                for k, v in meta.items()
                if k != "requests"
            },
        },
        "instances": inst,
        "keys": keys,
        "targets": [{"target": n, "measured": v, "goal": g, "met": ok} for n, v, g, ok in targets],
    }
    finish(
        "hicache",
        args.out,
        text,
        doc,
        machine,
        t_start,
        write_csv=lambda path: write_csv(path, rows, meta, inst, keys, plan.paths),
        plot=lambda path: plot(path, rows, inst, keys),
        quick=args.quick,
        label=args.label,
    )
    missed = sum(not ok for *_, ok in targets)
    print(f"{len(targets) - missed} of {len(targets)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
