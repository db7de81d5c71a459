"""The linker's CUDA side: the shared mapping registered with CUDA, and the one-launch copy of a
table of pieces (apart from the linker so `benchmarks/bench_gpu_copy.py` needs no SGLang).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import torch

from maru import MaruHandler

log = logging.getLogger(__name__)

# CU_MEMHOSTREGISTER_READ_ONLY (CUDA 11.1+): the device only reads the range. Regions of other
# instances are mapped read-only, and CUDA refuses to register them without it.
_READ_ONLY = 0x08
_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # CUdevice_attribute
# What the kernel's 16-byte loads and stores need of every address and length.
ALIGN = 16
_MAX_BLOCK_WORDS = 1024  # 8 KiB per program
_MAX_GRID_Y = 65535


class CudaDriver:
    """The CUDA driver calls registration needs (libcuda via ctypes), in torch's primary
    context. Not the runtime: a failed runtime call leaves its error for torch's next kernel
    launch to raise; a failed driver call is only a logged, refused registration."""

    def __init__(self, device: torch.device):
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check(self._lib.cuInit(0), "cuInit")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(self._device), index), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        self._check(
            self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), self._device),
            "cuDevicePrimaryCtxRetain",
        )
        value = ctypes.c_int()
        attr = _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
        self._check(
            self._lib.cuDeviceGetAttribute(ctypes.byref(value), attr, self._device),
            "cuDeviceGetAttribute",
        )
        self.host_pointers = bool(value.value)  # registered host memory at its host address

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed: {self.error(result)}")

    def error(self, result: int) -> str:
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(result, ctypes.byref(name))
        return f"{(name.value or b'CUDA error').decode()} ({result})"

    def _in_context(self, call: str, *args: object) -> int:
        self._check(self._lib.cuCtxPushCurrent_v2(self._context), "cuCtxPushCurrent")
        try:
            return int(getattr(self._lib, call)(*args))
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def register(self, address: int, length: int, read_only: bool) -> int:
        """cuMemHostRegister: 0, or the driver's error code."""
        flags = ctypes.c_uint(_READ_ONLY if read_only else 0)
        args = (ctypes.c_void_p(address), ctypes.c_size_t(length), flags)
        return self._in_context("cuMemHostRegister_v2", *args)

    def unregister(self, address: int) -> int:
        return self._in_context("cuMemHostUnregister", ctypes.c_void_p(address))


class CudaRegistration:
    """Every region a handler maps, registered with CUDA (`cuMemHostRegister`) while mapped, so
    the GPU reaches the shared bytes at their host addresses. Unregistered just before unmap:
    the address may be mapped again with other memory, and a stale registration would send the
    GPU to the old pages. A region whose registration failed is not `covers`ed, so no kernel
    touches it (touching unregistered memory ends the CUDA context)."""

    def __init__(self, handler: MaruHandler, device: torch.device):
        self.driver = CudaDriver(device)
        if not self.driver.host_pointers:
            raise RuntimeError(
                f"{device}: the GPU cannot use registered host memory at its host address "
                "(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0), which "
                "the linker's copy kernel needs; use HiCache + MaruStorage on this machine"
            )
        self._handler = handler
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # address -> length, registered
        # Sorted starts and ends of the registered ranges, replaced (never changed) on update.
        self._table = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        handler.on_region_closing(self._unregister)
        handler.on_region_added(self._register)

    def _register(self, region_id: int) -> None:
        view = self._handler.get_buffer_view(region_id, 0, 1)
        length = self._handler.get_region_page_count(region_id) * self._handler.get_chunk_size()
        if view is None or not length:
            return
        address = np.frombuffer(view, np.uint8).ctypes.data
        result = self.driver.register(address, length, view.readonly)
        if result != 0:
            log.warning(
                "cuMemHostRegister of region %d (%d bytes) failed: %s; the GPU will not copy "
                "its pages (loads from it are refused)",
                region_id,
                length,
                self.driver.error(result),
            )
            return
        with self._lock:
            self._ranges[address] = length
            self._update()

    def _unregister(self, address: int) -> None:
        with self._lock:
            if self._ranges.pop(address, None) is None:
                return
            self._update()
        result = self.driver.unregister(address)
        if result != 0:
            log.warning("cuMemHostUnregister of %#x failed: %s", address, self.driver.error(result))

    def _update(self) -> None:
        starts = np.array(sorted(self._ranges), np.int64)
        ends = starts + np.array([self._ranges[int(s)] for s in starts], np.int64)
        self._table = (starts, ends)

    def covers(self, addresses: np.ndarray, length: int) -> bool:
        """True when every [address, address + length) lies inside one registered region."""
        starts, ends = self._table
        addresses = np.asarray(addresses, np.int64)
        if not addresses.size:
            return True
        at = np.searchsorted(starts, addresses, side="right") - 1
        if (at < 0).any():
            return False
        return bool((addresses + length <= ends[at]).all())


def register_with_cuda(handler: MaruHandler, device: torch.device) -> CudaRegistration | None:
    """Register every region `handler` maps, now and from now on, with CUDA; None (nothing
    done: copies run on the CPU) when `device` is not CUDA or torch has no CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        log.info("no CUDA registration of the shared mapping (device %s)", device)
        return None
    return CudaRegistration(handler, device)


def piece_table(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, out: np.ndarray | None = None
) -> tuple[np.ndarray, int, int]:
    """The launches for pieces `dst[l, ...] <- src[l, ...]` of `sizes` bytes (broadcast; 1-D:
    one launch): `copy_pieces_kernel`'s int64 [launches, 3, pieces] table (into `out` if given),
    BLOCK and the grid's second dimension. ValueError for what the kernel cannot copy (a
    misaligned address would end the CUDA context)."""
    dst, src, sizes = (np.asarray(a, np.int64) for a in (dst, src, sizes))
    if dst.ndim == 1:
        dst, src = dst[None], src[None]
    if src.shape != dst.shape or np.broadcast_shapes(sizes.shape, dst.shape) != dst.shape:
        raise ValueError("copy_pieces: dst, src and sizes differ in shape")
    words = 2
    if dst.size:
        bits = 0
        for column in (dst, src, sizes):
            bits |= int(np.bitwise_or.reduce(column, axis=None))
        if bits & (ALIGN - 1) or int(sizes.min()) <= 0:
            raise ValueError(
                f"copy_pieces: addresses and sizes must be positive multiples of {ALIGN}"
            )
        words = int(sizes.max()) // 8
    block = min(_MAX_BLOCK_WORDS, 1 << (words - 1).bit_length())
    grid_y = -(-words // block)
    if grid_y > _MAX_GRID_Y:
        raise ValueError(f"copy_pieces: a piece of {words * 8} bytes is too large")
    launches = dst.shape[0]
    table = np.empty((launches, 3, dst.size // max(launches, 1)), np.int64) if out is None else out
    for column, values in enumerate((dst, src, np.right_shift(sizes, 3))):
        view = table[:, column].reshape(dst.shape)  # (splits the last axis: always a view)
        assert np.may_share_memory(view, table)
        np.copyto(view, values)
    return table, block, grid_y


def copy_pieces(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream
) -> list[torch.cuda.Event]:
    """Copy piece (l, i), `sizes[l, i]` bytes from `src[l, i]` to `dst[l, i]` (device or
    registered host memory, multiples of `ALIGN`): one launch per row `l` (1-D: one row),
    queued on `stream` in row order; returns each row's event."""
    from maru_sglang._triton_copy import copy_pieces_kernel

    shape = np.shape(dst) if np.ndim(dst) > 1 else (1, np.size(dst))
    launches, pieces = shape[0], int(np.prod(shape[1:]))
    # Written straight into pinned memory, copied without waiting: the stream may still be
    # copying earlier tables.
    host_table = torch.empty((launches, 3, pieces), dtype=torch.int64, pin_memory=True)
    _, block, grid_y = piece_table(dst, src, sizes, out=host_table.numpy())
    events = [torch.cuda.Event() for _ in range(launches)]
    with torch.cuda.stream(stream):
        device_table = host_table.to(stream.device, non_blocking=True)
        for row, event in zip(device_table, events):
            if pieces:
                copy_pieces_kernel[(pieces, grid_y)](row, pieces, BLOCK=block)
            event.record(stream)
    return events
