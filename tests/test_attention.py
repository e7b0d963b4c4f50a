"""The Pallas GPU decode kernel (interpreted on CPU) against the portable jnp path."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import KERNEL_ATOL, rel_err

from omni_jax.models.attention import AttentionMetadata, paged_attention, write_kv


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 32), (2, 2, 16)])
def test_pallas_decode_matches_jnp(heads: int, kv_heads: int, head_dim: int) -> None:
    rng = np.random.RandomState(0)
    num_pages, page_size, pages_per_seq, batch = 24, 4, 8, 3
    k_pages = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, head_dim), jnp.float32)
    v_pages = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, head_dim), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq))
    lens = jnp.array([1, 17, 32], jnp.int32)  # a lone token, a partial page, a full table
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((batch, 1), jnp.int32),
        block_tables=tables.astype(jnp.int32),
        context_lens=lens,
        query_lens=jnp.ones((batch,), jnp.int32),
    )
    q = jnp.asarray(rng.randn(batch, 1, heads, head_dim), jnp.float32)
    scale = head_dim**-0.5
    ref = paged_attention(q, k_pages, v_pages, md, scale=scale, backend="jnp")
    got = paged_attention(q, k_pages, v_pages, md, scale=scale, backend="pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=KERNEL_ATOL)


def test_pallas_refuses_prefill() -> None:
    q = jnp.zeros((1, 4, 2, 16))
    pages = jnp.zeros((2, 4, 4, 16))
    md = AttentionMetadata(
        jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.array([4]), jnp.array([4])
    )
    with pytest.raises(ValueError, match="decode"):
        paged_attention(q, pages, pages, md, scale=1.0, backend="pallas_interpret")


def test_write_kv_drops_padding_slots() -> None:
    pages = jnp.zeros((1, 2, 2, 3))
    k = jnp.ones((1, 3, 1, 3))
    slots = jnp.array([[3, 0, 4]])  # 4 == num_pages * page_size: padding
    new_k, _ = write_kv(pages, pages, k, k, slots)
    flat = np.asarray(new_k).reshape(4, 3)
    assert flat[[0, 3]].sum() == 6 and flat[[1, 2]].sum() == 0
    assert jax.tree.structure(new_k) == jax.tree.structure(pages)


def _ragged_step(rng: np.random.RandomState, batch: int, tokens: int) -> tuple[Any, ...]:
    """``q, k_pages, v_pages, md``: ``batch`` rows of up to ``tokens`` new tokens, shuffled
    6-page tables."""
    kv_heads, heads, d, num_pages, page_size, pps = 2, 4, 16, 80, 4, 6
    k = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    v = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    qlen = rng.randint(1, tokens + 1, batch).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((batch, tokens), jnp.int32),
        block_tables=jnp.asarray(rng.permutation(num_pages)[: batch * pps].reshape(batch, pps), jnp.int32),
        context_lens=jnp.asarray(qlen + rng.randint(0, page_size * pps - tokens + 1, batch), jnp.int32),
        query_lens=jnp.asarray(qlen),
    )
    return jnp.asarray(rng.randn(batch, tokens, heads, d), jnp.float32), k, v, md


def assert_same_rows(got: np.ndarray, want: np.ndarray) -> None:
    """Rows of a chunked step against the whole step's: bit for bit on CPU, where XLA's products
    round alike at any row count. GPU libraries choose a product's reduction order by its shape,
    so there rows of another chunk size differ in the last bits (seen on an H200: 3.6e-7 on values
    of order 1), within :data:`parity.KERNEL_ATOL`; a page read by mistake (NaN) fails both."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=KERNEL_ATOL)


def test_decode_row_chunks_change_no_bit() -> None:
    """The jnp path runs a large decode step in chunks of rows (``AttentionMetadata.chunk_bytes``);
    each row's result must be the one the whole step gives at once (:func:`assert_same_rows`).
    Prompt steps (``t > 1``) are never chunked, nor is a step without a budget."""
    from omni_jax.models import attention

    q, k, v, md = _ragged_step(np.random.RandomState(2), 12, 1)
    attend = jax.jit(lambda *a: paged_attention(*a, scale=0.25, backend="jnp"))
    whole = np.asarray(attend(q, k, v, md))
    per_row = 2 * 2 * 24 * 16 * 4 + 4 * 24 * 4  # K/V gathered + scores, as the chunker counts
    assert attention._rows_per_chunk(12, 1, 4, 2, 24, 16, 4, 4 * per_row) == 4
    assert attention._rows_per_chunk(12, 5, 4, 2, 24, 16, 4, 4 * per_row) == 12
    assert attention._rows_per_chunk(12, 1, 4, 2, 24, 16, 4, None) == 12
    chunked = dataclasses.replace(md, chunk_bytes=4 * per_row)  # static: a program of its own
    assert_same_rows(np.asarray(attend(q, k, v, chunked)), whole)


def test_decode_chunks_narrow_their_tables() -> None:
    """Decode chunks take length-sorted rows and read only the pages their longest row needs.

    Rows in shuffled order whose sorted chunks of 4 need 1, 2, 4 and 8 of 8 pages: every table
    entry past its chunk's width points at a page of NaN, which a gather at full width would
    carry into the row (``0 * NaN``). The result must be the clean whole step's, bit for bit,
    in the rows' own order.
    """
    from omni_jax.models import attention

    assert attention._chunk_widths(8) == [1, 2, 4, 8]
    assert attention._chunk_widths(24) == [3, 6, 12, 24]
    assert attention._chunk_widths(6) == [3, 6]
    rng = np.random.RandomState(4)
    kv_heads, heads, d, num_pages, page_size, pps, batch = 2, 4, 16, 160, 4, 8, 16
    lens = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 25, 30, 32], np.int32)
    width = np.repeat([1, 2, 4, 8], 4)  # pages of each sorted chunk of 4 rows
    shuffle = rng.permutation(batch)
    tables = rng.permutation(num_pages)[: batch * pps].reshape(batch, pps).astype(np.int32)
    q = jnp.asarray(rng.randn(batch, 1, heads, d), jnp.float32)
    k, v = (rng.randn(kv_heads, num_pages + 1, page_size, d).astype(np.float32) for _ in range(2))
    k[:, num_pages] = v[:, num_pages] = np.nan
    poisoned = tables.copy()
    for row, w in zip(shuffle, width, strict=True):
        poisoned[row, w:] = num_pages
    lens_in_order = np.empty_like(lens)
    lens_in_order[shuffle] = lens

    def md(block_tables: np.ndarray, chunk_bytes: int | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=jnp.zeros((batch, 1), jnp.int32),
            block_tables=jnp.asarray(block_tables),
            context_lens=jnp.asarray(lens_in_order),
            query_lens=jnp.ones((batch,), jnp.int32),
            chunk_bytes=chunk_bytes,
        )

    attend = jax.jit(lambda *a: paged_attention(*a, scale=0.25, backend="jnp"))
    whole = np.asarray(attend(q, jnp.asarray(k), jnp.asarray(v), md(tables)))
    assert np.isfinite(whole).all()
    keys = pps * page_size
    budget = 4 * (2 * kv_heads * keys * d * 4 + heads * keys * 4)
    assert attention._rows_per_chunk(batch, 1, heads, kv_heads, keys, d, 4, budget) == 4
    got = np.asarray(attend(q, jnp.asarray(k), jnp.asarray(v), md(poisoned, budget)))
    assert_same_rows(got, whole)


def _decode_case(
    rng: np.random.RandomState,
    lens: list[int],
    pages_per_seq: int,
    page_size: int,
    heads: int,
    kv_heads: int,
    d: int,
):
    """A decode step over scattered pages: ``(q, k_pages, v_pages, metadata)`` in float32."""
    batch = len(lens)
    num_pages = batch * pages_per_seq + 3
    k_pages = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    v_pages = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    tables = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((batch, 1), jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
        context_lens=jnp.asarray(lens, jnp.int32),
        query_lens=jnp.ones((batch,), jnp.int32),
    )
    return jnp.asarray(rng.randn(batch, 1, heads, d), jnp.float32), k_pages, v_pages, md


@pytest.mark.parametrize("pages_per_seq,page_size", [(13, 4), (33, 16), (1, 16)])
def test_pallas_pads_tables_it_cannot_divide(pages_per_seq: int, page_size: int) -> None:
    """Table widths with no divisor the kernel can use (odd page counts, as ``max_model_len``
    gives: 8208 tokens are 513 pages of 16) are padded; the padding is never attended."""
    rng = np.random.RandomState(1)
    full = pages_per_seq * page_size
    q, k_pages, v_pages, md = _decode_case(rng, [1, full // 2 + 1, full], pages_per_seq, page_size, 4, 2, 16)
    ref = paged_attention(q, k_pages, v_pages, md, scale=0.25, backend="jnp")
    got = paged_attention(q, k_pages, v_pages, md, scale=0.25, backend="pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=KERNEL_ATOL)


BF16_KERNEL_RTOL = 1e-2
"""The compiled Pallas kernel on bfloat16 against the jnp path in float32 on the same bfloat16
values, by :func:`parity.rel_err`: the kernel rounds its probabilities and its output to
bfloat16 (8 significant bits, 2**-8 = 3.9e-3 relative each), the reference rounds nothing."""


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel runs on GPUs only")
@pytest.mark.parametrize("page_size,pages_per_seq", [(16, 513), (16, 8), (4, 8)])
def test_compiled_pallas_kernel_on_bfloat16(page_size: int, pages_per_seq: int) -> None:
    """The compiled kernel (``auto``'s choice for bfloat16 decode on a GPU), at Qwen2.5-7B's head layout (28
    query heads over 4 KV heads of 128), scattered pages and the odd table width a
    ``max_model_len`` of 8208 gives."""
    rng = np.random.RandomState(2)
    full = pages_per_seq * page_size
    lens = [1, 17, full // 3 + 5, full]
    q, k_pages, v_pages, md = _decode_case(rng, lens, pages_per_seq, page_size, 28, 4, 128)
    q, k_pages, v_pages = (x.astype(jnp.bfloat16) for x in (q, k_pages, v_pages))
    scale = 128**-0.5
    ref = paged_attention(
        *(x.astype(jnp.float32) for x in (q, k_pages, v_pages)), md, scale=scale, backend="jnp"
    )
    got = paged_attention(q, k_pages, v_pages, md, scale=scale, backend="pallas")
    assert got.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), ref) < BF16_KERNEL_RTOL
