"""Helpers shared by the parity tests (a plain module: import it as ``from parity import ...``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from omni_jax.models.attention import AttentionMetadata


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


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
