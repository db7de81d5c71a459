"""SGLang's legacy storage interface (`interface_v1` off: one flat tensor per KV page instead
of host-pool indices), a mixin of `MaruStorage`; the KV pool only, under its keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maru.client import Put, from_pointers
from maru_sglang.pools import KV_POOL_NAME, PoolIO
from maru_sglang.storage_stats import StorageStats

if TYPE_CHECKING:
    from maru import MaruHandler


class LegacyInterface:
    """`get` / `batch_get` / `set` / `batch_set` / `exists` over whole-page tensors. The
    class that mixes it in provides the attributes declared here."""

    handler: MaruHandler
    mem_pool_host: Any
    _stats: StorageStats
    _require_pool: Callable[[], PoolIO]
    confirm_writes: Callable[[], int]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each key's page copied into its target tensor (None: a miss, a page of another
        size, a target that is not contiguous, or a copy not proven)."""
        kv = self._require_pool()
        self.confirm_writes()
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        out: list[torch.Tensor | None] = [None] * len(keys)
        by_size: dict[int, list[int]] = {}
        for i, target in enumerate(target_locations):
            if target.is_contiguous():
                by_size.setdefault(target.numel() * target.element_size(), []).append(i)
        for nbytes, rows in by_size.items():
            buffers = np.array([target_locations[i].data_ptr() for i in rows], np.int64)
            proven = self.handler.read(
                [keys[i] for i in rows],
                buffers[:, None],
                np.array([nbytes], np.int64),
                length=nbytes,
                prefix=kv.prefix,
            )
            for i, ok in zip(rows, proven):
                if ok:
                    out[i] = target_locations[i]
        hits = sum(t is not None for t in out)
        self._stats.count(KV_POOL_NAME, hits=hits, misses=len(keys) - hits)
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Copy each page tensor into the pool and register it; True if all are stored."""
        kv = self._require_pool()
        if values is None or len(values) != len(keys):
            return False
        values = [value.contiguous() for value in values]  # (kept alive through the copy)
        sizes = [value.numel() * value.element_size() for value in values]
        put = Put(kv.keys(keys), sizes, from_pointers([v.data_ptr() for v in values], sizes))
        self.handler.put([put])
        return all(put.results)

    def exists(self, key: str) -> bool:
        self.confirm_writes()
        return self.handler.exists(key, prefix=self._require_pool().prefix)
