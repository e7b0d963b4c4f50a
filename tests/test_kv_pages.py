"""The KV page allocator and the cache's reserved page, without a model.

The scheduler asks only for pages it has seen free and frees only pages a request holds, so the
allocator's errors are scheduler bugs (``omni_jax.engine.kv_cache``): they must be loud, never
absorbed into a free list that then hands one page to two requests.
"""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.engine.kv_cache import CacheConfig, CacheGeometry, PageAllocator


@pytest.mark.parametrize("page", [0, 2, 3])
def test_freeing_a_page_not_allocated_raises(page: int) -> None:
    """A double free (page 0, freed already) or a free of a page never handed out (2, 3) is a
    ``RuntimeError`` that leaves the free list as it was. Absorbed, the page would enter the free
    list twice and be handed to two requests, each reading the other's keys and values."""
    alloc = PageAllocator(4)
    first = alloc.allocate(2)
    assert first == [0, 1]
    alloc.free([0])
    with pytest.raises(RuntimeError, match=f"page {page} freed but not allocated"):
        alloc.free([page])
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == [0, 2, 3]  # each free page once; page 1 still held
    with pytest.raises(RuntimeError, match="asked for 1 pages, 0 free"):
        alloc.allocate(1)


@pytest.mark.parametrize("num_pages", [1, 2, 7])
def test_the_null_page_is_never_handed_out(num_pages: int) -> None:
    """Unused block-table entries point at the null page, which must read finite values whatever a
    request left in its pages (attention weighs keys past a row's context by zero, and 0 * NaN is
    NaN). A page the allocator hands out holds whatever its owner wrote, NaN included, so the null
    page is the one past them, which the runner allocates and nothing writes."""
    geometry = CacheGeometry(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype=np.float32, page_size=4, max_model_len=16
    )
    cache = CacheConfig(geometry, num_pages)
    handed_out = PageAllocator(num_pages).allocate(num_pages)
    assert sorted(handed_out) == list(range(num_pages))
    assert cache.null_page not in handed_out
    assert cache.null_page == num_pages  # the one page the runner allocates past the allocator's
