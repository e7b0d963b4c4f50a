"""Paged KV cache: a host-side page allocator and the device arrays it indexes.

Pages are handed out by the scheduler on demand and returned when a request finishes or is
preempted; the device arrays never change shape, so allocation never recompiles anything.
The scheduler asks only for pages it has seen free (it preempts newer requests to make room),
so the allocator's errors are scheduler bugs, raised as ``RuntimeError`` and never handled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
        """``n`` free pages; ``RuntimeError`` when fewer are free (callers check :attr:`num_free`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return ``pages``; ``RuntimeError`` for a page that is not allocated (a double free)."""
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed but not allocated")
            self._used.remove(p)
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
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
