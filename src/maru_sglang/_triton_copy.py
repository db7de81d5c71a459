"""The kernel of `maru_sglang.cuda.copy_pieces`: the GPU itself copies a whole table of pieces
between device memory and the shared mapping registered with CUDA, one launch instead of a DMA
per piece. Imported only where CUDA is used: triton is SGLang's dependency, not Maru's.
"""

import triton
import triton.language as tl


@triton.jit
def copy_pieces_kernel(table_ptr, pieces, BLOCK: tl.constexpr):
    """Program (i, j) copies words [j * BLOCK, (j + 1) * BLOCK) of piece i. `table_ptr`: int64
    [3, pieces] (destination, source, length in 8-byte words), every address and length a
    multiple of 16 bytes (the caller checks), so the loads and stores are 16 bytes wide."""
    piece = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    words = tl.multiple_of(tl.load(table_ptr + 2 * pieces + piece), 2)
    if start < words:
        dst = tl.load(table_ptr + piece).to(tl.pointer_type(tl.int64))
        src = tl.load(table_ptr + pieces + piece).to(tl.pointer_type(tl.int64))
        dst = tl.multiple_of(dst, 16)
        src = tl.multiple_of(src, 16)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
