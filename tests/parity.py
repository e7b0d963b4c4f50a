"""Helpers shared by the parity tests (a plain module: import it as ``from parity import ...``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from omni_jax.models.attention import AttentionMetadata


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude (``ours`` may be
    a jax array)."""
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


SPLIT_ROUNDING = 2e-6
"""Largest :func:`rel_err` of a result computed on a split mesh (or across processes) against
one device. Not 0: a split changes each device's shapes (rows, heads), and so XLA's fusions and
summation order, and a ``model`` split adds all-reduces. Measured, float32 rounding: waveforms
at most 5.8e-7 on the data 2, model 2 and 2x2 meshes; an AR step's final hidden states at most
1.1e-6 (3.9e-6 on values up to 3.7) on the 2x4, 1x8 and 2x2 meshes, over 10 random steps."""


KERNEL_ATOL = 2e-6
"""A decode kernel (the C++ CPU kernel, Pallas interpreted) against the jnp path, on outputs of
order 1: they differ only in summation order and in their float32 ``exp``, a few ulps. Worst
measured: 9.5e-7 for the CPU kernel (200 random steps), 4.8e-7 for Pallas (60 steps alone, 30
on a 2x4 mesh)."""


def chunk_metadata(pages: np.ndarray, page_size: int, start: int, end: int) -> AttentionMetadata:
    """One sequence's tokens ``[start, end)`` after ``start`` cached ones, its KV in ``pages`` (in
    that order; scattered over the pool, a wrong block-table or slot computation shows)."""
    idx = np.arange(start, end)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(pages[idx // page_size] * page_size + idx % page_size)[None],
        block_tables=jnp.asarray(pages)[None],
        context_lens=jnp.array([end]),
        query_lens=jnp.array([end - start]),
    )
