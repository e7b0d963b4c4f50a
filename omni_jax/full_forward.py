"""One-shot forward of a whole sequence through an AR model, outside the engine.

Conversion checks (``checkpoints_convert verify``) and parity tests need every position's
logits for one prompt. This runs the model code the engine runs, on a paged cache sized for
the prompt, but as one ``[1, T]`` row through the jnp attention path rather than the engine's
flat steps (:mod:`omni_jax.engine.ar_runner`), with no scheduler, buckets or sampler: a
reference for the model alone, not the serving path. It runs as compiled programs, as the engine
does: called eagerly, JAX would compile each operation of the model as a program of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.engine.kv_cache import init_kv_cache, pages_needed
from omni_jax.jit import compute_dtype, exact_matmuls
from omni_jax.models.attention import AttentionMetadata


@nnx.jit
def _embed(model, token_ids: jax.Array) -> jax.Array:  # noqa: ANN001
    return model.embed(token_ids)


@nnx.jit
def _forward(  # noqa: ANN001
    model, embeds: jax.Array, positions: jax.Array, cache: list, md: AttentionMetadata
) -> tuple[jax.Array, jax.Array]:
    hidden, _ = model(embeds[None], positions, cache, md)
    return model.logits(hidden)[0], hidden[0]


def full_forward(  # noqa: ANN001
    model,
    token_ids: Sequence[int],
    page_size: int = 16,
    *,
    positions: np.ndarray | None = None,
    embeds: jax.Array | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [T, V] float32, final hidden [T, D])`` for one sequence.

    A multimodal prompt's rotary positions (``[3, T]`` for M-RoPE) and embeddings (``[T, D]``,
    placeholders already replaced by encoder rows) are not the plain ``0..T-1`` and
    ``embed(token_ids)``, so they can be given instead.
    """
    layers, kv_heads, head_dim = model.kv_cache_shape()
    t = len(token_ids)
    n_pages = pages_needed(t, page_size)
    dtype = compute_dtype(nnx.state(model))
    cache = init_kv_cache(layers, kv_heads, n_pages, page_size, head_dim, dtype)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(t, dtype=jnp.int32)[None],
        block_tables=jnp.arange(n_pages, dtype=jnp.int32)[None],
        context_lens=jnp.array([t], jnp.int32),
        query_lens=jnp.array([t], jnp.int32),
    )
    if positions is None:
        positions = np.arange(t)
    if embeds is None:
        embeds = _embed(model, jnp.asarray(token_ids, jnp.int32)[None])[0]
    with exact_matmuls(dtype):
        logits, hidden = _forward(model, embeds, jnp.asarray(positions, jnp.int32)[..., None, :], cache, md)
    return np.asarray(logits), np.asarray(hidden)
