"""LMCache integration: `CxlMemoryAdapter`, the memory allocator that LMCache's shipped
`MaruBackend` (`lmcache/v1/storage_backend/maru_backend.py`, switched on by `maru_path` in
LMCache's config) builds over its `MaruHandler`.

Imported by that backend as `from maru_lmcache import CxlMemoryAdapter`; needs `lmcache` and
`torch` (which LMCache brings)."""

from maru_lmcache.adapter import CxlMemoryAdapter, CxlMemoryObj

__all__ = ["CxlMemoryAdapter", "CxlMemoryObj"]
