"""`CxlMemoryAdapter`: LMCache's memory allocator over a `MaruHandler`, zero-copy; the contract
is LMCache 0.5.6's shipped `MaruBackend` (docs/lmcache.md). Nothing raises into LMCache on a
store-side failure: a full pool -> `allocate` / `batched_allocate` return None.

Who owns a reservation's chunks, so that a page is never handed out twice: until
`create_store_handle` the adapter (`free`, through LMCache's ref counting, returns them); from
then on the store (`MaruHandler.seal` returns them when the key is refused or already there,
the server when it is deleted or evicted), and the object no longer names the adapter as its
parent, so a later `ref_count_down` or garbage collection cannot free them again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import warnings
from collections.abc import Sequence

import torch
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from maru import AllocHandle, MaruError, MaruHandler

log = logging.getLogger(__name__)

_PAGE_BITS = 32
_PAGE_MASK = (1 << _PAGE_BITS) - 1


class CxlMemoryObj(TensorMemoryObj):
    """A `TensorMemoryObj` whose flat uint8 `raw_data` lies in Maru's shared pool; `reservation`:
    the chunks this process reserved and has not handed to the store yet (else None)."""

    def __init__(
        self,
        raw_data: torch.Tensor,
        metadata: MemoryObjMetadata,
        parent_allocator: MemoryAllocatorInterface | None,
        reservation: AllocHandle | None,
    ):
        super().__init__(raw_data, metadata, parent_allocator)
        self.reservation = reservation


def _nbytes(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> int:
    return sum(shape.numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes))


def layout_scope(
    shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], fmt: MemoryFormat
) -> str:
    """The key scope of a chunk's layout: its format (MLA or not), and per group its shape
    but for the tokens (layers, KV width) and dtype. Two engines that serve one model name
    with other layers, widths or formats get other scopes, so miss each other's chunks
    (other chunk sizes do not: a token's bytes are laid out alike). A split of one KV width
    into other heads is the same layout (LMCache's shapes flatten it): the model name must
    tell such checkpoints apart (docs/lmcache.md, Keys)."""
    return _scope_of(_layout(shapes, dtypes, fmt))


def _scope_of(layout: str) -> str:
    return f"#kv:{hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()}"


def _layout(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], fmt: MemoryFormat) -> str:
    """What `layout_scope` digests: the format, and per group the shape (tokens as T) and dtype."""
    token_dim = fmt.token_dim()
    named = [fmt.name] + [
        f"{[n if i != token_dim else 'T' for i, n in enumerate(s)]}:{d}"
        for s, d in zip(shapes, dtypes)
    ]
    return "|".join(named)


_readonly_seen = False


def _byte_tensor(view: memoryview) -> torch.Tensor:
    """A flat uint8 tensor over `view`'s bytes (no copy). torch warns once that a read-only
    buffer (another instance's pages) could be written; it cannot (PROT_READ), so it is silenced."""
    global _readonly_seen
    if view.readonly and not _readonly_seen:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        _readonly_seen = True
        return tensor
    return torch.frombuffer(view, dtype=torch.uint8)


class CxlMemoryAdapter(MemoryAllocatorInterface):
    """LMCache `MemoryAllocatorInterface` whose memory objects are pages of a `MaruHandler`.
    `shapes` / `dtypes` / `fmt`: one full chunk's layout; `chunk_size`: the handler's allocation
    unit, its `get_chunk_size()` (`MaruBackend` sets it to one full chunk; another is a
    ValueError). `metadata.address` encodes (region id, index of the first chunk):
    `decode_address`. The handler's keys are scoped by the layout (`layout_scope`): LMCache's
    keys name the model, world size, worker and KV dtype, not the layout."""

    def __init__(
        self,
        handler: MaruHandler,
        shapes: Sequence[torch.Size],
        dtypes: Sequence[torch.dtype],
        fmt: MemoryFormat,
        chunk_size: int,
    ):
        self._handler = handler
        self._shapes, self._dtypes = self._adapt_shapes_and_dtypes(list(shapes), list(dtypes))
        self._fmt = fmt
        self._chunk_size = int(chunk_size)
        self._token_dim = fmt.token_dim()
        if not self._shapes or len(self._shapes[0]) <= self._token_dim:
            raise ValueError(
                f"CxlMemoryAdapter: shape {list(map(tuple, self._shapes))} has no token "
                f"dimension {self._token_dim} of format {fmt.name}"
            )
        self._full_tokens = int(self._shapes[0][self._token_dim])
        if self._chunk_size != handler.get_chunk_size():  # (`get_by_location`'s page offsets)
            raise ValueError(
                f"CxlMemoryAdapter: chunk_size {self._chunk_size} is not the handler's "
                f"{handler.get_chunk_size()} (its page indices would read other values' bytes)"
            )
        self._layout = _layout(self._shapes, self._dtypes, fmt)
        handler.set_key_scope(_scope_of(self._layout))
        self._refused_layouts: set[str] = set()
        self._lock = threading.Lock()  # reservations change hands under it
        self._closed = False

    # -- addresses -----------------------------------------------------------------------------

    @staticmethod
    def encode_address(region_id: int, page_index: int) -> int:
        """`metadata.address` of a value whose first chunk is `page_index` of `region_id`."""
        return (region_id << _PAGE_BITS) | page_index

    @staticmethod
    def decode_address(address: int) -> tuple[int, int]:
        """(region id, page index) from a memory object's `metadata.address`."""
        return address >> _PAGE_BITS, address & _PAGE_MASK

    # -- MemoryAllocatorInterface --------------------------------------------------------------

    def allocate(
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: str | None = None,
    ) -> MemoryObj | None:
        """One memory object over freshly reserved chunks of the shared pool (its true size,
        a partial chunk included); None when the pool has no room."""
        objs = self.batched_allocate(shapes, dtypes, 1, fmt, allocator_type)
        return objs[0] if objs else None

    def batched_allocate(
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: str | None = None,
    ) -> list[MemoryObj] | None:
        """`batch_size` memory objects of one layout (`MaruHandler.reserve_values`: one
        contiguous run of chunks if the pool has one, else value by value); None (nothing
        kept) if any is missing, or for a layout other than this adapter's (its key scope's)."""
        shapes, dtypes = self._adapt_shapes_and_dtypes(shapes, dtypes)
        size = _nbytes(shapes, dtypes)
        if self._closed or size <= 0 or batch_size <= 0:
            log.debug("allocate refused: %d x %d bytes, closed %s", batch_size, size, self._closed)
            return None
        fmt = self._fmt if fmt == MemoryFormat.UNDEFINED else fmt
        layout = _layout(shapes, dtypes, self._fmt if fmt is None else fmt)  # (LMCache's None)
        if layout != self._layout:
            # (stored in this layout's key scope, its bytes would be read as this layout's:
            # e.g. layer groups LMCache's connector set up after the backend was made)
            level = logging.DEBUG if layout in self._refused_layouts else logging.WARNING
            self._refused_layouts.add(layout)  # (one WARNING per layout, not one per chunk)
            log.log(level, "allocate refused: layout %s, this store's %s", layout, self._layout)
            return None
        try:
            handles = self._handler.reserve_values(size, batch_size)
        except MaruError as exc:
            log.warning("reserving %d values of %d bytes failed: %s", batch_size, size, exc)
            return None
        if handles is None:
            log.debug("no room in the pool for %d values of %d bytes", batch_size, size)
            return None
        return [
            self._memory_obj(h.buf, h.region_id, h.page_index, h.stride, shapes, dtypes, fmt, h)
            for h in handles
        ]

    def _memory_obj(
        self,
        view: memoryview,
        region_id: int,
        page_index: int,
        phy_size: int,
        shapes: list[torch.Size],
        dtypes: list[torch.dtype],
        fmt: MemoryFormat,
        reservation: AllocHandle | None,
    ) -> CxlMemoryObj:
        """A memory object over `view`. Only a reservation has this adapter as its parent: a
        view of a stored value has none, so LMCache's ref counting of it frees nothing."""
        meta = MemoryObjMetadata(
            shape=shapes[0],
            dtype=dtypes[0],
            address=self.encode_address(region_id, page_index),
            phy_size=phy_size,
            ref_count=1,
            pin_count=0,
            fmt=fmt,
            shapes=shapes,
            dtypes=dtypes,
        )
        parent = self if reservation is not None else None
        return CxlMemoryObj(_byte_tensor(view), meta, parent, reservation)

    def free(self, memory_obj: MemoryObj, allocator_type: str | None = None) -> None:
        """Return a reservation's chunks (LMCache calls this when its last reference goes).
        A published value's chunks belong to the store, a view's to its writer: no-op."""
        if not isinstance(memory_obj, CxlMemoryObj):
            return
        # (LMCache calls this while holding the object's own lock: never take it here)
        with self._lock:
            handle, memory_obj.reservation = memory_obj.reservation, None
        if handle is not None:
            memory_obj.invalidate()
            self._handler.free(handle)

    def batched_free(
        self,
        memory_objs: list[MemoryObj],
        allocator_type: str | None = None,
        update_stats: bool = True,
    ) -> None:
        for memory_obj in memory_objs:
            self.free(memory_obj, allocator_type)

    def close(self) -> None:
        """Refuse further allocations. The handler (closed by the backend right after) ends
        the instance on the server, which releases its pins and leases."""
        self._closed = True

    # -- what MaruBackend calls besides the interface ------------------------------------------

    def create_store_handle(self, memory_obj: MemoryObj) -> AllocHandle:
        """The handle `MaruHandler.store(key, handle)` publishes `memory_obj` with, sized to its
        bytes; hands the chunks to the store (module docstring). ValueError for a second call or
        an object this adapter did not reserve (the same chunks under two keys would alias)."""
        with self._lock:
            handle = getattr(memory_obj, "reservation", None)
            if handle is None:
                raise ValueError(
                    "create_store_handle: not an unpublished reservation of this adapter "
                    f"(address {memory_obj.meta.address:#x})"
                )
            memory_obj.reservation = None  # type: ignore[attr-defined]
            memory_obj.parent_allocator = None  # type: ignore[attr-defined]
        used = memory_obj.get_size()
        if 0 < used < handle.size:  # narrowed after the write (`set_used_size`)
            handle.size = used
        return handle

    def get_by_location(
        self, region_id: int, page_index: int, actual_size: int, single_token_size: int
    ) -> MemoryObj | None:
        """A view of the stored value of `actual_size` bytes (`actual_size / single_token_size`
        tokens) from chunk `page_index` of `region_id`, read in place; None (a miss, never other
        bytes) when not mapped here, out of its region, or not whole tokens of this layout."""
        if page_index < 0:  # (a value off this handler's chunk grid: `MemoryInfo`)
            return None
        if actual_size <= 0 or single_token_size <= 0 or actual_size % single_token_size:
            log.debug("value of %d bytes is not whole tokens of %d", actual_size, single_token_size)
            return None
        tokens = actual_size // single_token_size
        if tokens > self._full_tokens:
            log.debug("value of %d tokens is more than a chunk (%d)", tokens, self._full_tokens)
            return None
        shapes = [self._with_tokens(shape, tokens) for shape in self._shapes]
        if _nbytes(shapes, self._dtypes) != actual_size:
            log.debug("value of %d bytes does not match this layout", actual_size)
            return None
        # (the handler's chunk size now, as `retrieve` counted the page index: it may have
        # changed since this adapter was made, before the first reservation)
        offset = page_index * self._handler.get_chunk_size()
        view = self._handler.get_buffer_view(region_id, offset, actual_size)
        if view is None:
            log.debug("region %d page %d is not mapped here", region_id, page_index)
            return None
        return self._memory_obj(
            view, region_id, page_index, actual_size, shapes, list(self._dtypes), self._fmt, None
        )

    def _with_tokens(self, shape: torch.Size, tokens: int) -> torch.Size:
        dims = list(shape)
        dims[self._token_dim] = tokens
        return torch.Size(dims)
