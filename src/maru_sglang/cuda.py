"""The shared mapping registered with CUDA, so that copies between device memory and Maru's
pool can be DMA (issue 17, part 2). Apart from the linker so that a benchmark can use it
without importing SGLang (`benchmarks/bench_gpu_copy.py`)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from maru import MaruHandler

log = logging.getLogger(__name__)

# cudaHostRegisterReadOnly (CUDA 11.1+): the device only reads the range. Regions of other
# instances are mapped read-only, and CUDA refuses to register them without it.
_READ_ONLY = 0x08


def register_with_cuda(handler: MaruHandler, device: torch.device) -> bool:
    """Register every region `handler` maps (now and from now on) with CUDA
    (`cudaHostRegister`, what pinning host memory does), so that copies between `device` and
    the shared mapping are DMA. Returns False, and does nothing, when `device` is not CUDA or
    torch has no CUDA (a CPU build): copies then run on the CPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        log.info("no CUDA registration of the shared mapping (device %s)", device)
        return False
    cudart = torch.cuda.cudart()

    def register(region_id: int) -> None:
        view = handler.get_buffer_view(region_id, 0, 1)
        length = handler.get_region_page_count(region_id) * handler.get_chunk_size()
        if view is None or not length:
            return
        address = np.frombuffer(view, np.uint8).ctypes.data
        err = cudart.cudaHostRegister(address, length, _READ_ONLY if view.readonly else 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of region %d failed: %s", region_id, err)

    handler.on_region_added(register)
    return True
