"""Paged KV cache: its geometry, a host-side page allocator and the device arrays it indexes.

One AR stage's cache has one shape, :class:`CacheGeometry` (layers, stored KV heads, head
size, dtype, page size, the longest sequence), fixed before anything is allocated; the memory
planner counts its bytes, the scheduler pages requests by it, and the runner allocates it
(:class:`CacheConfig`: the geometry and its number of pages) and packs block tables with it.
Page arithmetic goes through :func:`pages_needed`.

Pages are handed out by the scheduler on demand and returned when a request finishes or is
preempted; the device arrays never change shape, so allocation never recompiles anything.
The scheduler asks only for pages it has seen free (it preempts newer requests to make room),
so the allocator's errors are scheduler bugs, raised as ``RuntimeError`` and never handled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.engine.buckets import ceil_div
from omni_jax.models.attention import KVCache

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def pages_needed(num_tokens: IntOrArray, page_size: int) -> IntOrArray:
    """Pages that hold ``num_tokens`` tokens (an int, or an array of counts: each one's)."""
    return ceil_div(num_tokens, page_size)


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """The shape of one AR stage's paged KV cache.

    Every layer holds K and V as ``[num_kv_heads, pages, page_size, head_dim]`` of ``dtype``
    (the layout of :mod:`omni_jax.models.attention`). ``num_kv_heads`` counts the heads stored:
    more than the model's when a ``model`` mesh axis exceeds them
    (:func:`~omni_jax.parallel.rules.replicated_kv_heads`). A sequence holds at most
    ``max_model_len`` tokens, so a block table has :attr:`pages_per_seq` entries.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    page_size: int
    max_model_len: int

    @property
    def pages_per_seq(self) -> int:
        """Pages of one sequence of ``max_model_len`` tokens: a block table's width."""
        return pages_needed(self.max_model_len, self.page_size)

    @property
    def table_tokens(self) -> int:
        """Tokens a full block table reaches (``max_model_len`` rounded up to whole pages)."""
        return self.pages_per_seq * self.page_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer."""
        return self.num_layers * self.page_size * self.token_bytes

    def shard(self, model: int) -> CacheGeometry:
        """One device's part when a ``model`` mesh axis of that size splits the stored heads
        (which it divides)."""
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // model)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """An allocated cache: its geometry and how many pages the allocator hands out."""

    geometry: CacheGeometry
    num_pages: int

    @property
    def null_page(self) -> int:
        """A page past the allocator's, never written: unused block-table entries point here.

        Attention weighs keys past a row's context by exactly zero, but ``0 * NaN`` is NaN, so
        those entries must read finite values whatever another request left in its pages.
        """
        return self.num_pages

    @property
    def dropped_slot(self) -> int:
        """A slot index past the whole cache: writes there are dropped (padding tokens)."""
        return (self.num_pages + 1) * self.geometry.page_size


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


def init_kv_cache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Zeroed ``[(K, V)] * num_layers``, each ``[kv_heads, num_pages, page_size, head_dim]``.

    With ``sharding`` each device allocates only its own shard (the zeros are made by a
    program whose outputs carry that layout), never the whole cache.
    """
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if sharding is None:
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(num_layers)]
