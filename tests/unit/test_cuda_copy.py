"""The linker's GPU copy kernel (`maru_sglang._triton_copy`, launched by
`maru_sglang.cuda.copy_pieces`): every piece exact, nothing written outside the pieces.

Where torch sees a GPU, the kernel runs there between device memory and pinned host memory
(what a registered region is to the GPU). Without one (CI), the same kernel source runs in
Triton's interpreter (`TRITON_INTERPRET=1`) on host memory: the table, the masks, the grid and
the addresses are the kernel's; only the hardware differs.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from maru_sglang.cuda import ALIGN, copy_pieces, piece_table  # noqa: E402

GPU = torch.cuda.is_available()
POISON = 0xAB


@pytest.fixture(scope="module")
def kernel():
    """The kernel, compiled for the GPU, or else interpreted on the CPU (a fresh import made
    with TRITON_INTERPRET=1, which triton reads when the kernel is defined)."""
    if GPU:
        from maru_sglang._triton_copy import copy_pieces_kernel

        return copy_pieces_kernel
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        sys.modules.pop("maru_sglang._triton_copy", None)
        module = importlib.import_module("maru_sglang._triton_copy")
        return module.copy_pieces_kernel
    finally:
        mp.undo()
        sys.modules.pop("maru_sglang._triton_copy", None)  # later imports compile for a GPU


def _layout(rng: np.random.Generator, sizes: np.ndarray, span: int) -> np.ndarray:
    """Non-overlapping offsets, 16-byte aligned, shuffled, with gaps, for `sizes` in `span`."""
    order = rng.permutation(sizes.size)
    offsets = np.zeros(sizes.size, np.int64)
    at = 0
    for i in order:
        at += int(rng.integers(0, 4)) * ALIGN  # a gap
        offsets[i] = at
        at += int(sizes[i])
    assert at <= span
    return offsets


def _copy(kernel, dst, src, sizes) -> None:
    """`copy_pieces` on a GPU; on CPU its launches, one per row, in the interpreter."""
    if GPU:
        for event in copy_pieces(dst, src, sizes, torch.cuda.Stream()):
            event.synchronize()
        return
    table, block, grid_y = piece_table(dst, src, sizes)
    for row in torch.from_numpy(table):
        kernel[(row.shape[1], grid_y)](row, row.shape[1], BLOCK=block)


@pytest.mark.parametrize("launches", [1, 3])
@pytest.mark.parametrize("direction", ["to_device", "to_host"])
@pytest.mark.parametrize("largest", [2048, 20_000, 70_000])
def test_every_piece_exact_and_nothing_else_written(kernel, direction, largest, launches):
    """Pieces of random 16-byte multiples up to `largest` (70 000: several programs a piece),
    scattered both sides, between 'host' and 'device' memory (on CPU both host), in one
    launch or in rows of three (the linker's layers)."""
    rng = np.random.default_rng(largest)
    sizes = rng.integers(1, largest // ALIGN + 1, 42) * ALIGN
    span = int(sizes.sum()) + 4 * ALIGN * sizes.size
    device = "cuda" if GPU else "cpu"
    host = torch.from_numpy(rng.integers(0, 256, span, dtype=np.uint8))
    if GPU:
        host = host.pin_memory()
    dev = torch.from_numpy(rng.integers(0, 256, span, dtype=np.uint8)).to(device)
    source, target = (host, dev) if direction == "to_device" else (dev, host)
    target.fill_(POISON)
    src_off, dst_off = _layout(rng, sizes, span), _layout(rng, sizes, span)
    rows = (launches, -1) if launches > 1 else (-1,)
    dst, src = target.data_ptr() + dst_off, source.data_ptr() + src_off
    _copy(kernel, dst.reshape(rows), src.reshape(rows), sizes.reshape(rows))
    got, want = target.cpu().numpy(), source.cpu().numpy()
    written = np.zeros(span, bool)
    for d, s, n in zip(dst_off, src_off, sizes):
        assert np.array_equal(got[d : d + n], want[s : s + n])
        written[d : d + n] = True
    assert (got[~written] == POISON).all()


def test_what_the_kernel_cannot_copy_is_a_clear_error():
    a = np.array([4096], np.int64)
    with pytest.raises(ValueError, match="multiples of 16"):
        piece_table(a + 8, a, [64])
    with pytest.raises(ValueError, match="multiples of 16"):
        piece_table(a, a, [24])
    with pytest.raises(ValueError, match="multiples of 16"):
        piece_table(a, a, [0])
    with pytest.raises(ValueError, match="differ in shape"):
        piece_table(a, a, [16, 32])
    with pytest.raises(ValueError, match="too large"):
        piece_table(a, a, [1 << 40])
    table, block, grid_y = piece_table(a, a + 64, [16])
    assert table.tolist() == [[[4096], [4160], [2]]] and (block, grid_y) == (2, 1)
    two = piece_table(np.array([[0, 16], [32, 48]]), np.zeros((2, 2), np.int64), [[16, 32]] * 2)
    assert two[0].shape == (2, 3, 2) and two[0][1, 0].tolist() == [32, 48]
