"""Paged KV cache: a host-side page allocator and the device arrays it indexes.

Pages are handed out by the scheduler on demand and returned when a request finishes or is
preempted; the device arrays never change shape, so allocation never recompiles anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class OutOfPagesError(RuntimeError):
    """No free page is left; the scheduler answers by preempting a request."""


class PageAllocator:
    """Free list over ``num_pages`` page ids; page 0 upward, lowest ids reused first."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed but not allocated")
            self._used.remove(p)
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def init_kv_cache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed ``[(K, V)] * num_layers``, each ``[kv_heads, num_pages, page_size, head_dim]``.

    With ``sharding`` each device allocates only its own shard (the zeros are made by a
    program whose outputs carry that layout), never the whole cache.
    """
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if sharding is None:
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(num_layers)]


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype: jnp.dtype
) -> int:
    return 2 * num_layers * num_kv_heads * num_pages * page_size * head_dim * jnp.dtype(dtype).itemsize
