"""One-shot forward of a whole sequence through an AR model, outside the scheduler.

Conversion checks and parity tests need every position's logits for one prompt; this runs
the same paged-cache model code the engine runs, with a cache sized for the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from omni_jax.engine.kv_cache import init_kv_cache, pages_needed
from omni_jax.models.attention import AttentionMetadata


def full_forward(model, token_ids: Sequence[int], page_size: int = 16) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """``(logits [T, V] float32, final hidden [T, D])`` for one sequence."""
    layers, kv_heads, head_dim = model.kv_cache_shape()
    t = len(token_ids)
    n_pages = pages_needed(t, page_size)
    dtype = model.embed(jnp.zeros((1, 1), jnp.int32)).dtype
    cache = init_kv_cache(layers, kv_heads, n_pages, page_size, head_dim, dtype)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(t, dtype=jnp.int32)[None],
        block_tables=jnp.arange(n_pages, dtype=jnp.int32)[None],
        context_lens=jnp.array([t], jnp.int32),
        query_lens=jnp.array([t], jnp.int32),
    )
    tokens = jnp.asarray(token_ids, jnp.int32)[None]
    hidden, _ = model(model.embed(tokens), jnp.arange(t, dtype=jnp.int32)[None], cache, md)
    return np.asarray(model.logits(hidden)[0]), np.asarray(hidden[0])
