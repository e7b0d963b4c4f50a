"""Host copies of array views into C order, tile by tile.

A checkpoint's tensors reach their parameters as views of the memory-mapped file: torch's
``[out, in]`` linear weights transposed to Flax's ``[in, out]``, convolution kernels permuted,
experts' weights swapped per expert. numpy copies such a view in the destination's order, so it
reads the source a whole row apart for each element it writes and uses little of every cache line
it fetches; those copies were most of loading a checkpoint. Here the view is copied in square
tiles, each tile in two steps: first into a small buffer in the source's own order (a read of
whole source rows), then from that buffer, which stays in cache, into the destination. The
buffer matters where the source's rows are a power of two bytes apart (Qwen3-Omni's experts):
every row of a tile then falls in the same cache sets, and a tile read in place evicts itself.
``benchmarks/host_copy.py`` times the copies (figures in ``benchmarks/RESULTS.md``). The same
holds on any host: a GPU's checkpoint is laid out on its host too.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

TILE = 256
"""Elements of a tile's side along the two axes it blocks: a 256 x 256 tile of bfloat16 is a 128
KiB buffer, within a core's L2 cache."""


def _source_fast_axis(x: np.ndarray) -> int | None:
    """The axis along which ``x`` steps through memory by the least (of those longer than one)."""
    axes = [i for i in range(x.ndim) if x.shape[i] > 1]
    return min(axes, key=lambda i: abs(x.strides[i]), default=None)


def copy_into(out: np.ndarray, x: np.ndarray) -> None:
    """``out[...] = x`` (C-ordered ``out`` of ``x``'s shape, any dtype numpy casts to), blocked
    over the axis ``x`` is contiguous along and ``out``'s last axis when they differ, each tile
    through a buffer in ``x``'s order (``copy(order="K")``)."""
    fast, last = _source_fast_axis(x), x.ndim - 1
    if fast is None or fast == last:
        out[...] = x
        return
    if out.dtype == x.dtype and out.dtype.itemsize in (1, 2, 4, 8):
        # The bits alone: a plain unsigned copy, whatever the dtype (ml_dtypes' included).
        bits = np.dtype(f"u{out.dtype.itemsize}")
        out, x = out.view(bits), x.view(bits)
    index: list[slice] = [slice(None)] * x.ndim
    for i in range(0, x.shape[fast], TILE):
        index[fast] = slice(i, i + TILE)
        for j in range(0, x.shape[last], TILE):
            index[last] = slice(j, j + TILE)
            out[tuple(index)] = x[tuple(index)].copy(order="K")


def contiguous(x: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """``x`` as a C-ordered array of ``dtype``: ``x`` itself when it already is one (a memory map
    stays mapped), else a copy made by :func:`copy_into`. What is not an ``np.ndarray`` (a lazily
    stacked tensor) is made one first, by its own ``__array__``."""
    dtype = np.dtype(dtype)
    x = x if isinstance(x, np.ndarray) else np.asarray(x)
    if x.flags.c_contiguous:
        return np.asarray(x, dtype=dtype, order="C")
    out = np.empty(x.shape, dtype)
    copy_into(out, x)
    return out
