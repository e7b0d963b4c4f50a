"""Helpers shared by the parity tests (a plain module: import it as ``from parity import ...``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from omni_jax.models.attention import AttentionMetadata


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


SPLIT_ROUNDING = 2e-6
"""Largest :func:`rel_err` of a waveform solved on a split mesh (or across processes) against
one device. Not 0: a split changes each device's shapes (rows, heads), and so XLA's fusions and
summation order, and a ``model`` split adds all-reduces; measured at most 5.8e-7 on the data 2,
model 2 and 2x2 meshes, float32 rounding."""


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
