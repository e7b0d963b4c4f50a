"""The decode kernels (Pallas interpreted, and the CPU kernel) on a sharded mesh run per device
through ``shard_map`` and match the unsharded jnp path, over a cache of replicated KV heads."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parity import KERNEL_ATOL, SPLIT_ROUNDING

from omni_jax.models.attention import AttentionMetadata, paged_attention
from omni_jax.parallel import make_mesh, put


def test_decode_kernels_under_shard_map_match_jnp() -> None:
    rng = np.random.RandomState(1)
    batch, heads, kv_heads, d, num_pages, page_size, pps = 4, 8, 2, 16, 32, 4, 6
    mesh = make_mesh({"data": 2, "model": 4})
    stored = math.lcm(kv_heads, 4)
    k = rng.randn(kv_heads, num_pages, page_size, d).astype(np.float32)
    v = rng.randn(kv_heads, num_pages, page_size, d).astype(np.float32)
    md = AttentionMetadata(
        slot_mapping=np.zeros((batch, 1), np.int32),
        block_tables=rng.permutation(num_pages)[: batch * pps].reshape(batch, pps).astype(np.int32),
        context_lens=np.array([1, 9, 24, 13], np.int32),
        query_lens=np.ones((batch,), np.int32),
    )
    q = rng.randn(batch, 1, heads, d).astype(np.float32)
    attend = functools.partial(paged_attention, scale=d**-0.5)
    want = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), md, backend="jnp")

    rep = stored // kv_heads  # the cache a model=4 mesh holds: each KV head twice, in a row
    kv_sh = NamedSharding(mesh, P("model"))
    k_s, v_s = put(np.repeat(k, rep, axis=0), kv_sh), put(np.repeat(v, rep, axis=0), kv_sh)
    q_s = put(q, NamedSharding(mesh, P("data", None, "model", None)))
    md_s = put(md, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        # the kernels as their unsharded tests hold them; the sharded jnp path within a split's
        # rounding (exact on jax 0.10; jax 0.11's XLA fuses the split program otherwise: 1.8e-7)
        for backend, atol in (
            ("pallas_interpret", KERNEL_ATOL),
            ("cpu", KERNEL_ATOL),
            ("jnp", SPLIT_ROUNDING),
        ):
            got = jax.jit(functools.partial(attend, backend=backend))(q_s, k_s, v_s, md_s)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=atol)


def test_decode_row_chunks_on_a_data_mesh() -> None:
    """Decode rows split over ``data`` and run in chunks (a map over rows) give the unsharded,
    unchunked result bit for bit."""
    from omni_jax.models import attention

    rng = np.random.RandomState(3)
    batch, heads, kv_heads, d, num_pages, page_size, pps = 8, 4, 2, 16, 64, 4, 6
    k = rng.randn(kv_heads, num_pages, page_size, d).astype(np.float32)
    v = rng.randn(kv_heads, num_pages, page_size, d).astype(np.float32)
    md = AttentionMetadata(
        slot_mapping=np.zeros((batch, 1), np.int32),
        block_tables=rng.permutation(num_pages)[: batch * pps].reshape(batch, pps).astype(np.int32),
        context_lens=rng.randint(1, page_size * pps + 1, batch).astype(np.int32),
        query_lens=np.ones((batch,), np.int32),
    )
    q = rng.randn(batch, 1, heads, d).astype(np.float32)
    attend = jax.jit(functools.partial(paged_attention, scale=d**-0.5, backend="jnp"))
    want = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), md))

    keys = pps * page_size
    budget = 2 * (2 * kv_heads * keys * d * 4 + heads * keys * 4)
    assert attention._rows_per_chunk(batch, 1, heads, kv_heads, keys, d, 4, budget) == 2
    md = dataclasses.replace(md, chunk_bytes=budget)
    mesh = make_mesh({"data": 2, "model": 2})
    kv_sh = NamedSharding(mesh, P("model"))
    with jax.set_mesh(mesh):
        attend = jax.jit(functools.partial(paged_attention, scale=d**-0.5, backend="jnp"))
        got = attend(
            put(q, NamedSharding(mesh, P("data", None, "model", None))),
            put(k, kv_sh),
            put(v, kv_sh),
            put(md, NamedSharding(mesh, P("data"))),
        )
    np.testing.assert_array_equal(np.asarray(got), want)
