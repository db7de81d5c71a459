"""LMCache integration: `CxlMemoryAdapter`, the memory allocator that LMCache's shipped
`MaruBackend` imports (`from maru_lmcache import CxlMemoryAdapter`; docs/lmcache.md)."""

from maru_lmcache.adapter import CxlMemoryAdapter, CxlMemoryObj

__all__ = ["CxlMemoryAdapter", "CxlMemoryObj"]
