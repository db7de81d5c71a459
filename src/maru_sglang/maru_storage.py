"""`MaruStorage`: SGLang's HiCache L3 backend over Maru (its config: docs/sglang.md). A page's
parts in the host pool are copied straight into one shared-memory allocation, back to back,
and back again on a hit; one metadata RPC per batch each way, across every pool of the batch.
v1 serves the KV pool, v2 also the sidecar pools of hybrid models; both share `_write` /
`_read`. `legacy.py` is the interface with `interface_v1` off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from maru import ConfigError, MaruConfig, MaruHandler
from maru.client import PIPELINE_MIN_PAGES, CopyIn, Put, ValuesAt
from maru_sglang.hit_policy import PoolPresence, usable_prefix
from maru_sglang.legacy import LegacyInterface
from maru_sglang.pools import (
    KV_POOL_NAME,
    Batch,
    PoolIO,
    chunk_size_for,
    is_rank_replicated,
    page_namespace,
    sidecar_namespace,
    weight_version,
)
from maru_sglang.storage_stats import StorageStats

__all__ = ["KV_POOL_NAME", "PIPELINE_MIN_PAGES", "MaruStorage", "chunk_size_for", "page_namespace"]

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first_direct", "page_first")


def _query(parts: list[tuple[PoolIO, list[str]]]) -> tuple[list[str], str | list[str]]:
    """Several pools' page hashes as one handler call takes them: the hashes, and their
    pools' key prefixes (one for one pool, else one per hash; no string made per key)."""
    if len(parts) == 1:
        pool, hashes = parts[0]
        return hashes, pool.prefix
    return [h for _, hashes in parts for h in hashes], [p.prefix for p, hs in parts for _ in hs]


def open_handler(
    extra: dict[str, Any], tp_rank: int, tp_size: int, **overrides: Any
) -> tuple[MaruConfig, MaruHandler]:
    """The `maru_*` keys of an SGLang extra config -> a connected handler (MaruStorage and the
    linker both start here). `overrides`: MaruConfig fields the caller derives (a chunk size).
    Not connected -> `RuntimeError: Failed to connect MaruHandler to <url>: <why>`."""
    config = MaruConfig.from_mapping(extra, prefix="maru_")
    # A configured name gets the rank, so ranks stay apart in `maru stats`.
    if "maru_instance_id" in extra and tp_size > 1:
        overrides.setdefault("instance_id", f"{config.instance_id}/tp{tp_rank}")
    if overrides:
        config = dataclasses.replace(config, **overrides)
    handler = MaruHandler(config)
    if not handler.connected:
        error = handler.connect_error
        handler.close()
        reason = f": {error.reason}" if error is not None else ""
        raise RuntimeError(
            f"Failed to connect MaruHandler to {config.server_url}{reason}"
        ) from None
    return config, handler


class MaruStorage(LegacyInterface, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, args: Any = None):
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        if not isinstance(extra, Mapping):  # (a JSON list or string: dict() would take it apart)
            raise ConfigError(
                f"extra config: expected a JSON object of maru_* keys, got {type(extra).__name__}"
            )
        extra = dict(extra)
        # Unless the user chose one, the chunk size follows the page sizes (`_fit_chunk_size`).
        self._chunk_from_page = "maru_chunk_size_bytes" not in extra
        self.config, self.handler = open_handler(
            extra, storage_config.tp_rank, storage_config.tp_size
        )
        self.mem_pool_host: Any = None
        self.namespace = ""  # the KV pool's
        self._weights = weight_version()  # what the pools' namespaces name (`_follow_weights`)
        self._rekeying = threading.Lock()
        self._kv: PoolIO | None = None
        self.pools: dict[str, PoolIO] = {}
        self._stats = StorageStats(bool(storage_config.enable_storage_metrics))
        log.info(
            "MaruStorage connected to %s as instance %s",
            self.config.server_url,
            self.handler.instance_id,
        )

    # -- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV pool (the anchor of a hybrid model's pool group)."""
        layout = getattr(mem_pool_host, "layout", None)
        logical = getattr(mem_pool_host, "kv_buffer", True) is None
        if layout not in SUPPORTED_LAYOUTS and not logical:
            raise ValueError(
                f"MaruStorage does not support host memory layout {layout!r}: "
                "use --hicache-mem-layout page_first_direct (or page_first)"
            )
        super().register_mem_pool_host(mem_pool_host)
        replicated = bool(self.storage_config.is_mla_model)
        self._weights = weight_version()
        namespace = "" if logical else page_namespace(self.storage_config, mem_pool_host)
        self._kv = PoolIO(KV_POOL_NAME, mem_pool_host, namespace, replicated)
        if logical and not self._kv.logical:  # (no namespace: every model's pages would meet)
            raise ValueError(
                f"MaruStorage: host pool {type(mem_pool_host).__name__} has no kv_buffer but "
                f"{self._kv.page_bytes}-byte pages: their format cannot be named, not stored"
            )
        self.pools[KV_POOL_NAME] = self._kv
        self.namespace = namespace
        self._fit_chunk_size()
        log.info(
            "MaruStorage: KV namespace %s, %d-byte pages in %d part(s), layout %s",
            namespace or "(logical pool: nothing stored)",
            self._kv.page_bytes,
            self._kv.parts,
            layout,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (SGLang registers the KV anchor here too)."""
        name = str(host_pool_name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if name == KV_POOL_NAME:
            if host_pool is not self.mem_pool_host:
                self.register_mem_pool_host(host_pool)
            return
        pool = PoolIO(name, host_pool, "", is_rank_replicated(self.storage_config, host_pool))
        pool.set_namespace(self._sidecar_namespace(pool))
        self.pools[name] = pool
        log.info(
            "MaruStorage: pool %s namespace %s, %d-byte pages in %d part(s)%s%s",
            name,
            pool.namespace,
            pool.page_bytes,
            pool.parts,
            ", rank-replicated" if pool.replicated else "",
            ", whole-page copies" if pool.whole_page else "",
        )

    def on_host_pools_registered(self) -> None:
        """Every pool of this attach is known: size the chunks for all of them."""
        self._fit_chunk_size()
        log.info("MaruStorage: pools %s", ", ".join(sorted(self.pools)))

    def _fit_chunk_size(self) -> None:
        """One chunk per page of the smallest pool: a larger pool's page takes a run of chunks,
        wasting less than one chunk; only before any chunk is used."""
        sizes = [p.page_bytes for p in self.pools.values() if p.page_bytes]
        if not self._chunk_from_page or not sizes:
            return
        chunk = min(chunk_size_for(size) for size in sizes)
        if chunk > self.config.pool_size or chunk == self.handler.get_chunk_size():
            return
        try:
            self.handler.set_chunk_size(chunk)
        except RuntimeError as exc:  # chunks in use (a pool registered after the first write)
            log.info("MaruStorage: chunk size stays %d: %s", self.handler.get_chunk_size(), exc)
            return
        self.config = self.handler.config
        log.info("MaruStorage: chunk size %d bytes", chunk)

    def _sidecar_namespace(self, pool: PoolIO) -> str:
        return sidecar_namespace(
            self.storage_config, pool.name, pool.pool, pool.part_sizes, pool.replicated
        )

    def _require_pool(self) -> PoolIO:
        if self._kv is None:
            raise RuntimeError("MaruStorage: register_mem_pool_host() was not called")
        self._follow_weights()
        return self._kv

    def _follow_weights(self) -> None:
        """Key every pool anew once SGLang's weight version changed (an update that names one):
        pages of the old weights are misses from then on, still hits for instances on them.
        Every data call asks first (a read of SGLang's published setting)."""
        version = weight_version()
        if version == self._weights:
            return
        with self._rekeying:
            if version == self._weights:
                return
            for pool in self.pools.values():
                if pool is self._kv:
                    if pool.namespace:  # (a logical anchor has none: it stores nothing)
                        pool.set_namespace(page_namespace(self.storage_config, pool.pool))
                else:
                    pool.set_namespace(self._sidecar_namespace(pool))
            self.namespace = self._kv.namespace if self._kv is not None else ""
            log.warning(
                "MaruStorage: SGLang's weight version is %r (was %r): pages are keyed under "
                "KV namespace %s from now on, the old weights' pages are misses",
                version,
                self._weights,
                self.namespace,
            )
            self._weights = version

    # -- the data path, shared by v1 and v2 --------------------------------------------------

    def _prepare(
        self, batch: Batch, host_indices: torch.Tensor | None, op: str, reading: bool = False
    ) -> bool:
        """Host pointers for `batch`; False (the batch fails, nothing copied) if the indices
        are not its pages in the host pool, or name a page twice in a read (`PoolIO.pointers`:
        why, logged)."""
        try:
            batch.buffers = batch.pool.pointers(host_indices, len(batch.keys), reading)
        except ValueError as exc:
            log.error("%s: pool %s: %s", op, batch.pool.name, exc)
            batch.results = [False] * len(batch.keys)
            return False
        return True

    def _write(self, batches: list[Batch]) -> None:
        """Write every batch's pages (`MaruHandler.put`) and fill its `results`. With
        `maru_use_async_rpc` it returns once every page is copied and its key sent: a page is
        in the pool before its key is sent, so a registration that fails later only reads as
        a miss (logged and counted then as `late_write_failures`)."""
        start = time.perf_counter()
        puts = [self._put_of(batch) for batch in batches]
        self.handler.put(puts, behind=self.config.use_async_rpc)
        for batch, put in zip(batches, puts):
            batch.results = put.results
        self._account(batches, start, False)

    def _account(self, batches: list[Batch], start: float, reading: bool) -> None:
        """Record a call for the statistics (folded when they are read)."""
        self._stats.record(batches, time.perf_counter() - start, reading)

    def _put_of(self, batch: Batch) -> Put:
        """`batch` as the write verb takes it."""
        pool, buffers = batch.pool, batch.buffers
        copy: CopyIn = ValuesAt(buffers, pool.sizes)  # (the verb begins it in C itself)
        if pool.whole_page:

            def through_pool(targets: np.ndarray, first: int, last: int, hashed: bool, n: int):
                return pool.copy_in(targets, buffers, first, last, hashed, n)

            copy = through_pool

        def late(lost: int) -> None:
            self._stats.count(pool.name, late_write_failures=lost)

        return Put(batch.keys, pool.page_bytes, copy, pool.name, late, prefix=pool.prefix)

    def confirm_writes(self, wait: bool = True) -> int:
        """Wait until the server has registered every page this thread's writes returned for
        (`_write`), so every instance finds them; the number whose registration failed."""
        return self.handler.confirm_writes(wait)

    def _read(self, batches: list[Batch], host_indices: list[torch.Tensor | None]) -> None:
        """Copy every batch's hits into its host pool and fill its `results`: True only for a
        page proven (of the right length, unchanged during the copy). A lone batch, or any with
        a local index, is one `MaruHandler.read`; the rest and whole-page pools `_read_pools`."""
        start = time.perf_counter()
        handler = self.handler
        one_by_one = len(batches) == 1 or handler.reads_locally
        rest: list[tuple[Batch, torch.Tensor | None]] = []
        for batch, indices in zip(batches, host_indices):
            pool = batch.pool
            if pool.whole_page or not one_by_one:
                rest.append((batch, indices))
            elif self._prepare(batch, indices, "read", reading=True):
                assert batch.buffers is not None
                hashed = self.config.checksums  # (only then can a hit mismatch)
                mismatches = handler.checksum_mismatches if hashed else 0
                batch.results = handler.read(
                    batch.keys,
                    batch.buffers,
                    pool.sizes,
                    length=pool.page_bytes,
                    prefix=pool.prefix,
                )
                if hashed and handler.checksum_mismatches != mismatches:
                    self._stats.count(
                        pool.name, checksum_mismatches=handler.checksum_mismatches - mismatches
                    )
        if rest:
            self._read_pools([b for b, _ in rest], [i for _, i in rest])
        self._account(batches, start, True)

    def _read_pools(self, batches: list[Batch], host_indices: list[torch.Tensor | None]) -> None:
        """`_read` of several pools (v2), or of a pool copied through its API: one
        `MaruHandler.read_many`, each pool's hits copied by `PoolIO.copy_out`."""
        keys, prefix = _query([(b.pool, b.keys) for b in batches])
        hashed, threads = self.handler.config.checksums, self.config.copy_threads

        def segments() -> list[tuple[int, int, Any]]:
            out = []
            for batch, indices in zip(batches, host_indices):
                copy = None
                if self._prepare(batch, indices, "read", reading=True):
                    copy = functools.partial(
                        batch.pool.copy_out, buffers=batch.buffers, hashed=hashed, threads=threads
                    )
                out.append((len(batch.keys), batch.pool.page_bytes, copy))
            return out

        proven, mismatched = self.handler.read_many(keys, segments, prefix=prefix)
        offset = 0
        for batch in batches:
            seg = slice(offset, offset + len(batch.keys))
            offset = seg.stop
            if batch.buffers is not None:
                batch.results = proven[seg].tolist()
                bad = int(np.count_nonzero(mismatched[seg]))
                if bad:
                    self._stats.count(batch.pool.name, checksum_mismatches=bad)

    # -- v1: the KV pool ---------------------------------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each KV page into the pool and register the batch (write-behind, `_write`)."""
        kv = self._require_pool()
        if kv.logical or not keys:
            return [True] * len(keys)
        batch = Batch(kv, list(keys))
        if self._prepare(batch, host_indices, "batch_set_v1"):
            self._write([batch])
        return batch.results

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each stored page into the host pool and prove it; True per page proven."""
        kv = self._require_pool()
        if kv.logical or not keys:
            return [True] * len(keys)
        batch = Batch(kv, list(keys))
        self._read([batch], [host_indices])
        # (the examples and the P2P test look for this line in the second instance's log)
        log.info("batch_get_v1 result: %d/%d hits", sum(batch.results), len(keys))
        return batch.results

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of consecutive stored KV pages from the start. A logical anchor stores
        nothing, so it proves nothing: 0 (SGLang asks this only when a request has no pool
        transfers, that is no pool with bytes to load)."""
        kv = self._require_pool()
        if kv.logical:
            return 0
        self.confirm_writes()
        return self.handler.leading_hits(keys, prefix=kv.prefix)

    # -- v2: every pool ----------------------------------------------------------------------

    def _pool_for(self, transfer: PoolTransfer) -> PoolIO | None:
        pool = self.pools.get(str(transfer.name))
        if pool is None:
            log.error("pool %s was never registered: its pages are misses", transfer.name)
        return pool

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of `keys` (KV page hashes) given every pool's hit policy
        (`hit_policy.usable_prefix`), from one existence query over every pool. Under a
        logical anchor, none unless a pool with bytes gates it (ALL_PAGES, TRAILING_PAGES)."""
        kv = self._require_pool()
        n = len(keys)
        transfers = list(pool_transfers or [])
        own_keys = [  # per transfer: the page hashes to look up
            list(t.keys or []) if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS else list(keys)
            for t in transfers
        ]
        parts = [] if kv.logical else [(kv, keys)]
        pools = [self.pools.get(str(t.name)) for t in transfers]
        if kv.logical and not any(
            p is not None and not p.logical and t.hit_policy != PoolHitPolicy.BLOCK_GROUPS
            for t, p in zip(transfers, pools)
        ):  # nothing with bytes gates the prefix: a logical anchor alone proves nothing
            return PoolTransferResult(0, {}, [])
        parts += [(p, hs) for p, hs in zip(pools, own_keys) if p is not None and not p.logical]
        query, prefix = _query(parts)
        self.confirm_writes()
        found = self.handler.batch_exists(query, prefix=prefix) if query else []
        present = np.array(found, dtype=bool)
        offset = 0 if kv.logical else n
        answers: list[PoolPresence] = []
        for t, pool, hashes in zip(transfers, pools, own_keys):
            mine: np.ndarray | None = None  # never registered
            if pool is not None and pool.logical:
                mine = np.ones(len(hashes), dtype=bool)
            elif pool is not None:
                mine = present[offset : offset + len(hashes)]
                offset += len(hashes)
            window = max(1, len(t.keys or ()))
            answers.append(
                PoolPresence(str(t.name), t.hit_policy, mine, window, t.group_pages, t.block_pages)
            )
        kv_present = np.ones(n, dtype=bool) if kv.logical else present[:n]
        return PoolTransferResult(*usable_prefix(kv_present, answers, KV_POOL_NAME))

    def _v2_batches(self, transfers: list[PoolTransfer], op: str, writing: bool):
        """Split a v2 call into per-pool batches, settling here the results of pools that
        need no IO (unregistered, logical, bad indices, replicated on a non-writer rank)."""
        self._follow_weights()
        results: dict[str, list[bool]] = {}
        batches: list[Batch] = []
        indices: list[torch.Tensor | None] = []
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            pool = self._pool_for(t)
            if pool is None:
                results[name] = [False] * len(keys)
            elif not keys or pool.logical:
                results[name] = [True] * len(keys)
            elif writing and pool.replicated and not self.storage_config.is_storage_writer:
                # the writer rank stores them (SGLang counts a non-writer's backup as done)
                results[name] = [True] * len(keys)
            else:
                batch = Batch(pool, keys)
                if writing and not self._prepare(batch, t.host_indices, op):
                    results[name] = batch.results
                    continue
                batches.append(batch)
                indices.append(t.host_indices)
        return results, batches, indices

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read every transfer's pages into its host pool; per pool, a result per key."""
        results, batches, indices = self._v2_batches(transfers, "batch_get_v2", writing=False)
        if batches:
            self._read(batches, indices)
        for batch in batches:
            results[batch.pool.name] = batch.results
        log.info(
            "batch_get_v2 result: %s",
            ", ".join(f"{name} {sum(r)}/{len(r)}" for name, r in results.items()),
        )
        return results

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Write every transfer's pages from its host pool (`_write`)."""
        results, batches, _ = self._v2_batches(transfers, "batch_set_v2", writing=True)
        if batches:
            self._write(batches)
        for batch in batches:
            results[batch.pool.name] = batch.results
        return results

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every page of this instance's namespaces (other models, ranks and
        geometries are untouched), from the server's cluster tier too (`cluster=True`):
        SGLang's own Mooncake backend's clear removes its objects from Mooncake (its
        `remove_all`), and a cleared L3 must miss; without it the next lookup on any node
        would pull the same pages back from the cluster. A server without a tier has only
        its pool."""
        self.confirm_writes()
        for namespace in sorted({p.namespace for p in self.pools.values() if p.namespace}):
            removed = self.handler.delete_prefix(namespace + ":", cluster=True)
            log.info("MaruStorage: cleared %d pages of namespace %s", removed, namespace)

    @property
    def counters(self) -> dict[str, Any]:
        """Cumulative counters over every pool, and per pool under `pools`."""
        return self._stats.counters

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (drained on each call), the counters attached as `.maru`."""
        return self._stats.get_stats()

    def close(self) -> None:
        """Detach: end this instance on the server (its leases, pins and regions go at once;
        the pages it stored stay readable by others until evicted)."""
        self.confirm_writes()
        self.handler.close()
