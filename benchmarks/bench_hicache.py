"""HiCache data-path benchmark (issue 5): Maru through SGLang's real storage interface.

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
  buffer, all of a batch's parts in one `maru.client.memcopy.copy_many(..., streaming=False)` call,
  so the baseline carries no Python per part either), the same into a warm /dev/shm mapping
  (the limit of a repetition is the faster of the two), Maru's own copy loop alone
  (`copy_many` with its default non-temporal stores, into the /dev/shm mapping: the floor
  under Maru, whose copies can beat a plain memcpy), Maru with `maru_checksums` on (another
  MaruStorage of the same process: writer and reader hash every page as they copy it, maru64
  in the copy loop; issue 13, P8: its cost is the ratio to plain Maru in the same repetition), and
  SGLang's
  built-in file backend (`HiCacheFile`) on a /dev/shm directory driven the way the
  controller drives it without `interface_v1` (`get_data_page` + `batch_set`; `batch_get`
  into dummy pages + `set_from_flat_data_page`). Methods alternate within each repetition;
  ratios are medians of per-repetition ratios.
- Hybrid (Mamba) case: Qwen3-Next-80B-A3B's pools on one rank of TP 8: the KV host pool of
  its full-attention layers and SGLang's real `MambaPoolHost` (Gated DeltaNet temporal and
  conv state, 9.4 MiB per state), registered through the v2 interface as
  `HybridCacheController` registers them; 128 KV pages and a state per 32 pages move in one
  `batch_set_v2` / `batch_get_v2` (both pools in one call), against the same memcpy baselines
  and `HiCacheFile`'s own v2 on the same bytes (CRC of every part checked).
- Per-page latency: many one-page `batch_set_v1` / `batch_get_v1` calls, median and p99.
- Metadata: `batch_exists` and the leased lookup of 128 keys, per key; one single-key lookup
  round trip (`retrieve`), over the real socket; and the transport alone (a 200-byte echo to
  another process over pyzmq and over a plain TCP socket).
- Scaling: 1, 2 and 4 concurrent writer/reader pairs (aggregate GB/s, lookup latency under
  load), and lookups with 10^3 .. 10^6 keys registered (one dedicated server per count, the
  keys registered in batches of 16384 tiny values; lookups over the socket, round robin over
  the servers so that every count sees the same machine state).

Prints a table and each target with PASS/MISS, and writes CSV, PNG (matplotlib) and a Markdown
summary under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import hashlib
import json
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
TARGETS = {"big": 0.90, "small": 0.70, "file": 3.0, "meta_us": 5.0, "rtt_us": 100.0, "keys": 1.5}


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

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, 3, 48, 40, 300, 32, 2, 200, (10**3, 10**4, 10**5, 10**6))
        return cls(False, 11, 256, 200, 2000, 128, 5, 1000, (10**3, 10**4, 10**5, 10**6))

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


def _warm_shm(nbytes: int) -> tuple[mmap.mmap, int]:
    path = f"/dev/shm/maru-bench-memcpy-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    mm.write(b"\x01" * nbytes)  # fault every page in
    return mm, _addr(np.frombuffer(mm, dtype=np.uint8, count=1))


def _copy_pages(part_ptrs, sizes, base, to_pool, s, n, streaming) -> None:
    """Pages [s, s + n) of a pool (its parts' pointer columns and sizes) to or from `base`,
    where the pages lie back to back, each page's parts back to back: one `copy_many` per
    part, like MaruStorage."""
    from maru.client.memcopy import copy_many

    page_bytes = sum(sizes)
    starts = base + np.arange(s, s + n, dtype=np.int64) * page_bytes
    off = 0
    for ptrs, size in zip(part_ptrs, sizes):
        pool, here = ptrs[s : s + n], starts + off
        dst, src = (pool, here) if to_pool else (here, pool)
        copy_many(dst, src, size, streaming=streaming)
        off += size


class Instance:
    """One SGLang "instance": a real host pool, MaruStorage (through SGLang's dynamic backend
    factory) and HiCacheFile (through its built-in one) on the same pool."""

    def __init__(self, url: str, case: Case, pages: int, file_dir: str, role: str):
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
        self._setup(url, case, file_dir, role, g.attn == "mla", [self.page_bytes] * pages)

    def _setup(
        self, url: str, case, file_dir: str, role: str, is_mla: bool, page_sizes: list[int]
    ) -> None:
        """MaruStorage and HiCacheFile on `self.pool` (through SGLang's backend factories),
        and the warm memory of the memcpy baselines (`self.total` bytes)."""
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
        cfg = hp.storage_config(model=f"bench/{case.name}", is_mla=is_mla, extra=extra)
        self.maru = StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        self.maru.register_mem_pool_host(self.pool)
        extra = {**extra, "maru_checksums": "true"}  # the same, with every page checksummed
        checked_cfg = hp.storage_config(model=f"bench/{case.name}", is_mla=is_mla, extra=extra)
        self.checked = StorageBackendFactory.create_backend("dynamic", checked_cfg, self.pool)
        self.checked.register_mem_pool_host(self.pool)
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
        self.shm, self.shm_addr = _warm_shm(self.total)
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
        return times, ok, start, time.monotonic()

    def _maru_set(self, keys, idx, s, n) -> int:
        return sum(self.maru.batch_set_v1(keys, idx))

    def _maru_get(self, keys, idx, s, n) -> int:
        return sum(self.maru.batch_get_v1(keys, idx))

    def _checked_set(self, keys, idx, s, n) -> int:
        return sum(self.checked.batch_set_v1(keys, idx))

    def _checked_get(self, keys, idx, s, n) -> int:
        return sum(self.checked.batch_get_v1(keys, idx))

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

    def _copy(self, base: int, to_pool: bool, s: int, n: int, streaming: bool = False) -> int:
        """Pages [s, s + n) between the host pool and `base` (pages back to back, each page's
        parts back to back): one `copy_many` per part, like MaruStorage. Plain memmove unless
        `streaming` (the non-temporal stores MaruStorage's copies use)."""
        _copy_pages(self.part_ptrs, self.sizes[: self.parts], base, to_pool, s, n, streaming)
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

    def stored_keys(self, tag: str, count: int) -> list[str]:
        """The Maru keys (namespaced) that storing pages [0, count) of `tag` wrote."""
        return self.maru.pools["kv"].keys([page_key(tag, i) for i in range(count)])

    def maru_delete(self, tag: str, count: int | None = None, backend: str = "maru") -> int:
        """Delete the pages of `tag` (not timed) that `backend` ("maru" or "checked": the same
        keys) stored. The reader releases its lease without waiting, so a delete can arrive
        first and find a key leased: try those again."""
        handler = getattr(self, backend).handler
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

    def meta(self, tag: str, rounds: int, singles: int) -> dict[str, list[float]]:
        """Per-key cost of 128-key batch_exists and lookups, and single-key round trips."""
        h = self.maru.handler
        keys = [page_key(tag, i) for i in range(128)]
        ns_keys = [f"{self.maru.namespace}:{k}" for k in keys]
        lookup = _batch_lookup(h)
        names = ("exists", "lookup", "rtt", "rtt_exists", "rtt_sleep")
        out: dict[str, list[float]] = {k: [] for k in names}
        assert self.maru.batch_exists(keys) == 128, "metadata keys are missing"
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.maru.batch_exists(keys)
            t1 = time.perf_counter()
            lookup(ns_keys)
            t2 = time.perf_counter()
            out["exists"].append((t1 - t0) / 128)
            out["lookup"].append((t2 - t1) / 128)
        # Single-key round trips with the default busy polling, alternating in runs of 100
        # with the baseline of the client sleeping for each reply (busy_poll_us 0).
        spin = h._rpc.busy_poll_ns
        try:
            for start in range(0, singles, 100):
                for sleeping in (False, True):
                    h._rpc.busy_poll_ns = 0 if sleeping else spin
                    for i in range(start, min(singles, start + 100)):
                        k = ns_keys[i % 128]
                        t0 = time.perf_counter()
                        info = h.retrieve(k)
                        t1 = time.perf_counter()
                        assert info is not None
                        if sleeping:
                            out["rtt_sleep"].append(t1 - t0)
                            continue
                        h.batch_exists([k])
                        t2 = time.perf_counter()
                        out["rtt"].append(t1 - t0)
                        out["rtt_exists"].append(t2 - t1)
        finally:
            h._rpc.busy_poll_ns = spin
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
            self.maru.close()
            self.checked.close()
        finally:
            self.shm.close()


class HybridInstance(Instance):
    """A Mamba hybrid "instance": the KV host pool and SGLang's `MambaPoolHost`, both
    registered through the v2 interface with MaruStorage and with HiCacheFile, as
    `HybridCacheController` registers them. A call over KV pages [s, s + n) carries one
    state per `state_every` pages, stored under the hash of the page it ends (as SGLang keys
    a node's state); Maru and the file backend move both pools in one `batch_set_v2` /
    `batch_get_v2`, the memcpy baselines copy the same bytes."""

    def __init__(self, url: str, case: HybridCase, pages: int, file_dir: str, role: str):
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
        self._setup(url, case, file_dir, role, False, sizes)
        for backend in (self.maru, self.checked, self.file):
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

    def _maru_set(self, keys, idx, s, n) -> int:
        return self._done(self.maru.batch_set_v2(self._transfers(keys, idx, s, n)), n)

    def _maru_get(self, keys, idx, s, n) -> int:
        return self._done(self.maru.batch_get_v2(self._transfers(keys, idx, s, n)), n)

    def _checked_set(self, keys, idx, s, n) -> int:
        return self._done(self.checked.batch_set_v2(self._transfers(keys, idx, s, n)), n)

    def _checked_get(self, keys, idx, s, n) -> int:
        return self._done(self.checked.batch_get_v2(self._transfers(keys, idx, s, n)), n)

    def _file_set(self, keys, idx, s, n) -> int:
        return self._done(self.file.batch_set_v2(self._transfers(keys, idx, s, n)), n)

    def _file_get(self, keys, idx, s, n) -> int:
        return self._done(self.file.batch_get_v2(self._transfers(keys, idx, s, n)), n)

    def _copy(self, base: int, to_pool: bool, s: int, n: int, streaming: bool = False) -> int:
        _copy_pages(self.part_ptrs, self.sizes[: self.parts], base, to_pool, s, n, streaming)
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
        )
        return n

    def stored_keys(self, tag: str, count: int) -> list[str]:
        hashes = [page_key(tag, i) for i in range(count)]
        ends = [hashes[(st + 1) * self.every - 1] for st in self._state_range(0, count)]
        return self.maru.pools["kv"].keys(hashes) + self.maru.pools["mamba"].keys(ends)


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


class KeyFiller:
    """Plain MaruHandlers, one per server, that register many tiny values and probe lookups
    (keys scaling)."""

    def __init__(self, urls: list[str], cpu: int | None = None):
        from maru import MaruHandler

        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

        self.hs = [
            MaruHandler(server_url=u, pool_size="8M", chunk_size_bytes="4K", timeout_ms=60000)
            for u in urls
        ]
        self.handles = [h.alloc(4096) for h in self.hs]

    def register(self, i: int, n: int) -> float:
        """Register keys [0, n) on server i in batches of 16384, all pointing at one 64-byte
        value (the server keeps one entry per key either way). Returns seconds."""
        h, handle = self.hs[i], self.handles[i]
        t0 = time.perf_counter()
        for start in range(0, n, 16384):
            keys = [page_key("scale", k) for k in range(start, min(n, start + 16384))]
            m = len(keys)
            ok = h.batch_store(keys, handles=[handle] * m, lengths=[64] * m)
            assert all(ok), "registering scale keys failed"
        return time.perf_counter() - t0

    def probe(self, counts: list[int], rounds: int, singles: int) -> list[dict[str, list[float]]]:
        """Round robin over the servers: each round makes `singles` single-key lookups and a
        few 128-key (leased) lookups of random registered keys on every server in turn, so
        that all servers see the same machine state; a pause before each server's turn, so that
        the one before has gone back to sleep."""
        rng = random.Random(7)
        lookups = [_batch_lookup(h) for h in self.hs]
        out: list[dict[str, list[float]]] = [{"rtt": [], "lookup": []} for _ in self.hs]
        for h in self.hs:  # warm up
            for _ in range(20):
                h.retrieve(page_key("scale", 0))
        for _ in range(rounds):
            for h, lookup, n, res in zip(self.hs, lookups, counts, out):
                # Let the server probed last stop polling (`--busy-poll-us`, 1 ms) first: one
                # server per node is what is measured, not four competing for their CPU.
                time.sleep(0.003)
                for _ in range(singles):
                    key = page_key("scale", rng.randrange(n))
                    t0 = time.perf_counter()
                    info = h.retrieve(key)
                    res["rtt"].append(time.perf_counter() - t0)
                    assert info is not None, key
                for _ in range(max(2, singles // 10)):
                    keys = [page_key("scale", rng.randrange(n)) for _ in range(128)]
                    t0 = time.perf_counter()
                    lookup(keys)
                    res["lookup"].append((time.perf_counter() - t0) / 128)
        return out

    def close(self) -> None:
        for h in self.hs:
            h.close()


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

# memcpy: plain copies to a private buffer; shm: the same to a /dev/shm mapping (the limit is
# the faster of these two); stream: Maru's own copy loop alone (streaming stores) to /dev/shm;
# checked: Maru with maru_checksums on.
BACKENDS = ["memcpy", "shm", "stream", "maru", "checked", "file"]
STORES = ("maru", "checked", "file")  # what stores under keys (read back and checked)


def _throughput(writer, reader, name, plan, batch, pages, crcs, prog) -> dict[str, list[float]]:
    """GB/s of every method, per repetition (after a warm-up round whose reads are checked
    against the writer's CRCs), methods alternating within each repetition."""
    nbytes = writer.call("info")["bytes"]
    sec: dict[str, list[float]] = {f"{b}_{op}": [] for b in BACKENDS for op in ("set", "get")}
    for rep in range(plan.reps + 1):  # rep 0 warms pages, mappings and files up
        tag = f"{name}/r{rep}"
        for b in BACKENDS:
            w = writer.call("run", f"{b}_set", tag, batch, 0, pages)
            if b in STORES:
                reader.call("wipe")
            r = reader.call("run", f"{b}_get", tag, batch, 0, pages)
            if b in STORES:
                assert w[1] == pages and r[1] == pages, (b, w[1], r[1])
                if rep == 0:
                    assert reader.call("crcs") == crcs, f"{name}: pages read by {b} differ"
            if rep:
                sec[f"{b}_set"].append(sum(w[0]))
                sec[f"{b}_get"].append(sum(r[0]))
            if b in ("maru", "checked"):
                writer.call("maru_delete", tag, pages, b)
            elif b == "file":
                writer.call("file_clear")
        prog.step(f"{name}: rep {rep}")
    return {k: [nbytes / s / 1e9 for s in v] for k, v in sec.items()}


def bench_hybrid(url, case: HybridCase, plan, prog) -> dict:
    """KV + Mamba state through `batch_set_v2` / `batch_get_v2` in a writer and a reader
    process, against the memcpy baselines and HiCacheFile's v2 on the same bytes: one call
    of 128 KV pages (SGLang's STORAGE_BATCH_SIZE) and their states per repetition."""
    file_dir = tempfile.mkdtemp(prefix=f"hicache-file-{case.name}-", dir="/dev/shm")
    pages = 128
    writer = Worker(HybridInstance, url, case, pages, file_dir, "writer")
    reader = Worker(HybridInstance, url, case, pages, file_dir, "reader")
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
    file_dir = tempfile.mkdtemp(prefix=f"hicache-file-{case.name}-", dir="/dev/shm")
    batch, batches = plan.pages_for(case.page_bytes)
    pages = batch * batches
    writer = Worker(Instance, url, case, pages, file_dir, "writer")
    reader = Worker(Instance, url, case, pages, file_dir, "reader")
    try:
        info = writer.call("info")
        page_bytes = info["page_bytes"]
        assert page_bytes == case.page_bytes, (page_bytes, case.page_bytes)
        crcs = writer.call("fill", 1)
        prog.step(f"{case.name}: setup")
        gbps = _throughput(writer, reader, case.name, plan, batch, pages, crcs, prog)
        # Per-page latency: one-page calls, in rounds of at most `pages` pages.
        lat: dict[str, list[float]] = {f"{b}_{op}": [] for b in BACKENDS for op in ("set", "get")}
        done, rnd = 0, 0
        while done < plan.lat_samples:
            n = min(pages, plan.lat_samples - done)
            tag = f"{case.name}/lat{rnd}"
            for b in ("memcpy", "maru", "checked", "file"):
                w = writer.call("run", f"{b}_set", tag, 1, 0, n)
                r = reader.call("run", f"{b}_get", tag, 1, 0, n)
                assert w[1] == n and r[1] == n, (b, w[1], r[1])
                lat[f"{b}_set"] += w[0]
                lat[f"{b}_get"] += r[0]
                if b in ("maru", "checked"):
                    writer.call("maru_delete", tag, n, b)
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
    file_dir = tempfile.mkdtemp(prefix="hicache-file-meta-", dir="/dev/shm")
    writer = Worker(Instance, url, case, 128, file_dir, "writer")
    reader = Worker(Instance, url, case, 128, file_dir, "reader")
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
        file_dir = tempfile.mkdtemp(prefix="hicache-file-scale-", dir="/dev/shm")
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
    """One dedicated server per key count, probed in turn (see `KeyFiller.probe`). The
    servers share one CPU and the prober has the other: where the scheduler put a server
    that polls after each request (`--busy-poll-us`) beside its client, a round trip took
    ~60 us instead of ~30, at random, which drowned what the key count changes."""
    counts = list(plan.key_counts)
    rounds = 10 if plan.quick else 20
    cpus = split_cpus()
    client_cpu, server_cpu = cpus if cpus is not None else (None, None)
    with ExitStack() as stack:
        # 256M: 10^6 keys of 64 bytes stay far below the eviction watermark.
        urls = [stack.enter_context(maru_server("256M", server_cpu)) for _ in counts]
        filler = Worker(KeyFiller, urls, client_cpu)
        try:
            reg_s = []
            for i, n in enumerate(counts):
                reg_s.append(filler.call("register", i, n))
                prog.step(f"keys: {n:.0e}")
            probes = filler.call("probe", counts, rounds, max(1, plan.scale_lookups // rounds))
        finally:
            filler.close()
    return [
        {
            "keys": n,
            "register_s": r,
            "rtt_med_us": med(p["rtt"]) * 1e6,
            "rtt_p99_us": pct(p["rtt"], 0.99) * 1e6,
            "lookup128_us_per_key": med(p["lookup"]) * 1e6,
        }
        for n, r, p in zip(counts, reg_s, probes)
    ]


# -- report ------------------------------------------------------------------------------------


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
    }


def build_rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        case = res["case"]
        for op in ("set", "get"):
            # Ratios per repetition (the methods of one repetition ran seconds apart), then
            # their median: steadier than a ratio of medians on a machine whose speed drifts.
            # The limit is the faster of the two plain copies (private or /dev/shm memory).
            base = [
                max(a, b) for a, b in zip(res["gbps"][f"memcpy_{op}"], res["gbps"][f"shm_{op}"])
            ]
            file = res["gbps"][f"file_{op}"]
            maru = res["gbps"][f"maru_{op}"]
            for b in BACKENDS:
                g = res["gbps"][f"{b}_{op}"]
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
                        "vs_memcpy": med([x / y for x, y in zip(g, base)]),
                        "vs_file": med([x / y for x, y in zip(g, file)]),
                        "vs_maru": med([x / y for x, y in zip(g, maru)]),
                        "lat_med_us": med(lat) * 1e6 if lat else float("nan"),
                        "lat_p99_us": pct(lat, 0.99) * 1e6 if lat else float("nan"),
                    }
                )
    return rows


_CHECKED = {"maru": "", "checked": " (checksums)"}


def evaluate(rows, meta, keys) -> list[tuple[str, float, str, bool]]:
    """(target, measured, goal, passed) for every target of issue 5."""
    out = []
    for r in rows:
        if r["backend"] not in _CHECKED:
            continue
        big = r["page_bytes"] >= MiB
        goal = TARGETS["big"] if big else TARGETS["small"]
        out.append(
            (
                f"{r['case']} batch_{r['op']}_{r['api']}{_CHECKED[r['backend']]} / memcpy limit",
                r["vs_memcpy"],
                f">= {goal:.0%}",
                r["vs_memcpy"] >= goal,
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
    for name, key in (("batch_exists", "exists"), ("lookup (leased)", "lookup")):
        v = med(meta[key]) * 1e6
        out.append((f"{name}, 128 keys: us/key", v, f"<= {TARGETS['meta_us']:g}", v <= 5.0))
    v = med(meta["rtt"]) * 1e6
    out.append(("single-key lookup RTT (median): us", v, f"<= {TARGETS['rtt_us']:g}", v <= 100))
    if keys and len(keys) > 1:
        lo, hi = keys[0], keys[-1]
        for metric, label in (("rtt_med_us", "single-key RTT"), ("lookup128_us_per_key", "128")):
            ratio = hi[metric] / lo[metric]
            out.append(
                (
                    f"lookup {label} at {hi['keys']:.0e} / at {lo['keys']:.0e} keys",
                    ratio,
                    f"<= {TARGETS['keys']:g}x",
                    ratio <= TARGETS["keys"],
                )
            )
    return out


def fmt(v: float, nd: int = 2) -> str:
    return "-" if v != v else f"{v:.{nd}f}"


def render(machine, plan, results, rows, meta, inst, keys, targets, cmd) -> str:
    lines = []
    lines.append(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB, "
        f"Linux {machine['kernel']}; Python {machine['python']}, torch {machine['torch']}, "
        f"SGLang {machine['sglang']}; 1-min load at start {machine['load_before']:.2f}"
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
        f"| {'/limit':>7} | {'1-page med us':>13} | {'p99 us':>8} |"
    )
    lines.append(head)
    lines.append("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        lines.append(
            f"| {r['case']:8} | {r['page']:9} | {r['op']} | {r['backend']:7} | "
            f"{fmt(r['gbps']):>6} | {fmt(r['gbps_min'], 1) + '-' + fmt(r['gbps_max'], 1):>11} | "
            f"{r['vs_memcpy']:>7.0%} | {fmt(r['lat_med_us'], 1):>13} | "
            f"{fmt(r['lat_p99_us'], 1):>8} |"
        )
    lines.append("")
    lines.append("memcpy: one memmove per page part (copy_many, in C) to/from a warm private")
    lines.append("buffer; shm: the same into a warm /dev/shm mapping; stream: Maru's copy loop")
    lines.append("alone (non-temporal stores) into that mapping, the floor under Maru; file:")
    lines.append("HiCacheFile on /dev/shm (legacy path; hybrid: its batch_set_v2 / batch_get_v2).")
    lines.append("/limit: median over repetitions of GB/s / the faster of memcpy and shm in the")
    lines.append("same repetition.")
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
    lines.append("")
    lines.append(
        f"Metadata (128-key batches, median of {plan.meta_rounds}; single-key: median/p99 of "
        f"{plan.rtt_samples}):"
    )
    lines.append(
        f"  batch_exists {med(meta['exists']) * 1e6:.2f} us/key, leased lookup "
        f"{med(meta['lookup']) * 1e6:.2f} us/key, HiCacheFile batch_exists "
        f"{med(meta['file_exists']) * 1e6:.2f} us/key"
    )
    lines.append(
        f"  single-key lookup RTT {med(meta['rtt']) * 1e6:.1f} / "
        f"{pct(meta['rtt'], 0.99) * 1e6:.1f} us; single-key exists RTT "
        f"{med(meta['rtt_exists']) * 1e6:.1f} / {pct(meta['rtt_exists'], 0.99) * 1e6:.1f} us"
    )
    lines.append(
        f"  single-key lookup RTT with the client sleeping for replies (maru_busy_poll_us "
        f"0), alternating with the default: {med(meta['rtt_sleep']) * 1e6:.1f} / "
        f"{pct(meta['rtt_sleep'], 0.99) * 1e6:.1f} us"
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
            "Registered keys (one server per count, probed round robin; random present keys):"
        )
        lines.append("| keys | register s | lookup RTT med us | p99 us | 128-key lookup us/key |")
        lines.append("|---:|---:|---:|---:|---:|")
        for r in keys:
            lines.append(
                f"| {r['keys']:.0e} | {r['register_s']:.2f} | {r['rtt_med_us']:.1f} | "
                f"{r['rtt_p99_us']:.1f} | {r['lookup128_us_per_key']:.2f} |"
            )
    lines.append("")
    lines.append("Targets:")
    lines.append("| target | measured | goal | result |")
    lines.append("|---|---:|---:|---|")
    for name, v, goal, ok in targets:
        shown = f"{v:.0%}" if "memcpy" in name else f"{v:.2f}"
        lines.append(f"| {name} | {shown} | {goal} | {'PASS' if ok else 'MISS'} |")
    return "\n".join(lines)


def write_csv(path, rows, meta, inst, keys) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "case", "op", "backend", "metric", "value", "unit"])
        for r in rows:
            for metric, unit in (
                ("gbps", "GB/s"),
                ("gbps_min", "GB/s"),
                ("gbps_max", "GB/s"),
                ("vs_memcpy", "ratio"),
                ("vs_file", "ratio"),
                ("vs_maru", "ratio"),
                ("lat_med_us", "us"),
                ("lat_p99_us", "us"),
            ):
                w.writerow(["workload", r["case"], r["op"], r["backend"], metric, r[metric], unit])
        for key in ("exists", "lookup", "file_exists"):
            w.writerow(["metadata", "128 keys", key, "", "us_per_key", med(meta[key]) * 1e6, "us"])
        for key in ("rtt", "rtt_exists", "rtt_sleep", "floor_zmq", "floor_tcp", "floor_unix"):
            for q, name in ((0.5, "med"), (0.99, "p99")):
                w.writerow(["metadata", "1 key", key, "", name, pct(meta[key], q) * 1e6, "us"])
        for r in inst:
            for metric, value in r.items():
                w.writerow(["instances", r["instances"], "", "maru", metric, value, ""])
        for r in keys:
            for metric, value in r.items():
                w.writerow(["keys", r["keys"], "", "maru", metric, value, ""])


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
        "maru": "#1f77b4",
        "checked": "#9467bd",
        "file": "#d62728",
    }
    by = {(r["case"], r["op"], r["backend"]): r for r in rows}
    ax = axes[0][0]
    for k, (op, b) in enumerate((op, b) for op in ("set", "get") for b in BACKENDS):
        xs = [i + (k - (len(BACKENDS) - 0.5)) * 0.08 for i in range(len(cases))]
        vals = [by[(c, op, b)]["gbps"] for c in cases]
        hatch = "//" if op == "get" else None
        ax.bar(xs, vals, 0.08, color=colors[b], hatch=hatch, edgecolor="black", linewidth=0.3,
               label=f"{b} {op}")  # fmt: skip
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("Throughput, batches of up to 128 pages (hatched: get)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[0][1]
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
        ks = [r["keys"] for r in keys]
        ax.plot(ks, [r["rtt_med_us"] for r in keys], "o-", label="single-key RTT median")
        ax.plot(ks, [r["rtt_p99_us"] for r in keys], "o:", label="single-key RTT p99")
        ax.plot(ks, [r["lookup128_us_per_key"] for r in keys], "s-", label="128-key lookup, /key")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("registered keys")
        ax.set_ylabel("us")
        ax.legend(fontsize=8)
        ax.set_title("Lookup latency vs registered keys")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main --------------------------------------------------------------------------------------


def wait_for_quiet(limit: float, max_wait: float) -> None:
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        print(f"1-min load {os.getloadavg()[0]:.2f} > {limit}: waiting 30 s", file=sys.stderr)
        time.sleep(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer reps and samples")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument(
        "--cases", default=",".join(c.name for c in [*CASES, HYBRID]), help="workload cases"
    )
    ap.add_argument("--skip-scaling", action="store_true", help="no instances/keys scaling")
    ap.add_argument("--max-keys", type=float, default=1e6, help="largest registered-key count")
    ap.add_argument("--wait-load", type=float, default=0, help="wait until the 1-min load < this")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--label", default="", help="added to the result file names")
    args = ap.parse_args()
    plan = Plan.make(args.quick)
    plan.key_counts = tuple(k for k in plan.key_counts if k <= args.max_keys)
    cases = [c for c in CASES if c.name in args.cases.split(",")]
    if args.wait_load:
        wait_for_quiet(args.wait_load, 1200)

    t_start = time.monotonic()
    hybrid = HYBRID.name in args.cases.split(",")
    steps = (
        (len(cases) + hybrid) * (plan.reps + 3)
        + 1
        + (0 if args.skip_scaling else 3 + len(plan.key_counts))
    )
    prog = Progress(steps + 1, enabled=not args.no_progress)
    import sglang_cpu

    sglang_cpu.apply()  # before SGLang is imported
    # Import once, before forking the workers.

    import maru_sglang.maru_storage  # noqa: F401

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
    machine["load_after"] = os.getloadavg()[0]
    rows = build_rows(results)
    targets = evaluate(rows, meta, keys)
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_hicache.py", *sys.argv[1:]])
    text = render(machine, plan, results, rows, meta, inst, keys, targets, cmd)
    text += (
        f"\n\n1-min load at end {machine['load_after']:.2f}; "
        f"run took {time.monotonic() - t_start:.0f} s"
    )
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{args.label}" if args.label else "")
    base = out / f"hicache-{stamp}{'-quick' if args.quick else ''}"
    write_csv(base.with_suffix(".csv"), rows, meta, inst, keys)
    base.with_suffix(".md").write_text(text + "\n")
    (base.parent / (base.name + ".json")).write_text(
        json.dumps(
            {
                "machine": machine,
                "rows": rows,
                "per_rep_gbps": {r["case"].name: r["gbps"] for r in results},
                "instances": inst,
                "keys": keys,
            },
            indent=1,
        )
    )
    plotted = plot(base.with_suffix(".png"), rows, inst, keys)
    print(f"\nwrote {base}.csv, .md, .json" + (", .png" if plotted else " (no matplotlib: no PNG)"))
    missed = sum(not ok for *_, ok in targets)
    print(f"{len(targets) - missed} of {len(targets)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
