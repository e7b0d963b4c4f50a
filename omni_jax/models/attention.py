"""Paged attention behind one function: a portable jnp path, the Pallas GPU kernel and a C++
CPU kernel for decode.

The cache layout is per layer ``[kv_heads, num_pages, page_size, head_dim]`` for K and V,
the layout ``jax.experimental.pallas.ops.gpu.paged_attention`` reads, so the decode hot path
can hand the cache to that kernel untouched.

Queries come as ``[B, T]`` rows: row ``b`` holds ``query_lens[b]`` new tokens that end at
``context_lens[b]``. The engine's steps are flat (:mod:`omni_jax.engine.ar_runner`): every
scheduled token is a row of its own (``T == 1``) with its sequence's block table and its own
causal horizon, so prompt chunks and decode tokens alike go through the decode path and its
kernels. Rows of several tokens (``T > 1``) serve the whole-sequence forward of conversion
checks and parity tests (:func:`omni_jax.full_forward.full_forward`), which take the jnp path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from omni_jax.kernels.cpu import paged_decode_target

Backend = Literal["auto", "jnp", "pallas", "pallas_interpret", "cpu"]

KVCache = list[tuple[jax.Array, jax.Array]]
"""A model's paged KV cache: one ``(K, V)`` per layer, each in the layout above."""

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged cache.

    slot_mapping: ``[B, T]`` flat slot (``page * page_size + offset``) each new token's K/V
        is written to; padding tokens carry an out-of-range slot and are dropped.
    block_tables: ``[B, P]`` page ids of each sequence, in order.
    context_lens: ``[B]`` tokens in the cache for each sequence once this step is written.
    query_lens: ``[B]`` real (non-padding) tokens of each row in this step.
    chunk_bytes: static, not traced: what one chunk of decode rows of the jnp path may gather
        and score (:func:`_rows_per_chunk`); the engine gives its platform's
        (:func:`chunk_bytes`) when it builds a stage. ``None``: every row at once.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_lens: jax.Array
    chunk_bytes: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def query_positions(self, num_tokens: int) -> jax.Array:
        """``[B, T]`` cache index of each query token (its causal horizon)."""
        start = self.context_lens - self.query_lens
        return start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter new ``k, v [B, T, kv_heads, D]`` into their slots; padding slots are dropped.

    A cache with more heads than ``k`` stores each head ``cache heads / kv_heads`` times in a
    row, so a ``model`` mesh axis larger than the KV heads can still split the cache by heads
    (see :func:`omni_jax.parallel.rules.replicated_kv_heads`); the grouped attention reads
    the copies as if they were the original heads.
    """
    kvh, num_pages, page_size, d = k_pages.shape
    if kvh % k.shape[2]:
        raise ValueError(f"cache has {kvh} KV heads, not a multiple of the model's {k.shape[2]}")
    if kvh != k.shape[2]:
        k, v = jnp.repeat(k, kvh // k.shape[2], axis=2), jnp.repeat(v, kvh // k.shape[2], axis=2)
    slots = slot_mapping.reshape(-1)

    def put(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(kvh, num_pages * page_size, d)
        new = new.reshape(-1, kvh, d).transpose(1, 0, 2).astype(pages.dtype)
        return flat.at[:, slots].set(new, mode="drop").reshape(pages.shape)

    return put(k_pages, k), put(v_pages, v)


CPU_CHUNK_BYTES = 4 << 20
"""On CPU, what one chunk of rows of :func:`_attention_jnp` may gather and score at once.

The jnp path materialises each row's keys and values (its whole block table) and its scores;
for a whole step at once that outgrows the CPU's caches and every pass over it goes to memory
(a 32-row decode over 16 pages of 16 tokens already gathers 8 MiB a layer), so rows go in
chunks whose gathered K/V and scores stay within this budget."""


ACCELERATOR_CHUNK_BYTES = 1 << 30
"""Off CPU, what one chunk of decode rows of :func:`_attention_jnp` may gather and score.

One wide batched product is what an accelerator is good at, so chunks there only bound the
temporaries: a flat step (:mod:`omni_jax.engine.ar_runner`) makes every prompt token a decode
row, and 2048 of them over 4096-token tables would gather 8 GiB at once."""


def chunk_bytes(platform: str) -> int:
    """What one chunk of decode rows of the jnp path may gather and score on ``platform``: the
    budget a stage picks for its devices when it is built (:attr:`AttentionMetadata.chunk_bytes`)."""
    return CPU_CHUNK_BYTES if platform == "cpu" else ACCELERATOR_CHUNK_BYTES


def _rows_per_chunk(
    b: int, t: int, h: int, kvh: int, keys: int, d: int, itemsize: int, budget: int | None
) -> int:
    """Rows per chunk of a ``[b, t]`` step: for decode-shaped steps (``t == 1``), the largest
    divisor of ``b`` whose gathered K/V and scores fit ``budget`` bytes; otherwise (or without a
    budget) all.

    Prompt blocks (``t > 1``, the one-shot :func:`~omni_jax.full_forward.full_forward`) stay
    whole: for ``t > 1`` XLA's CPU products round differently at another row count, so a
    row's result would depend on its chunk (decode rows come out bit for bit the same; tests
    hold both).
    """
    if t > 1 or budget is None:
        return b
    per_row = 2 * kvh * keys * d * itemsize + h * keys * 4
    fit = max(1, budget // per_row)
    return max(c for c in range(1, min(fit, b) + 1) if b % c == 0)


def _chunk_widths(pages: int) -> list[int]:
    """Block-table widths a decode chunk may narrow to: ``pages`` and up to three halvings."""
    widths = [pages]
    while len(widths) < 4 and widths[-1] % 2 == 0:
        widths.append(widths[-1] // 2)
    return widths[::-1]


def _attention_jnp(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """Rows in chunks (:func:`_rows_per_chunk`), a sequential map over chunks of the same
    per-row computation, each chunk over only the pages its longest row needs.

    The step's table is as wide as its longest row, but a row's context can be far shorter
    (short prompts beside long ones, or a prompt chunk's early tokens beside its late ones), and
    gathering every row's full table would read many pages no row uses. So rows are sorted by
    context length, chunks
    take consecutive sorted rows, and each chunk switches to the narrowest of
    :func:`_chunk_widths` that holds its longest row. Keys past a row's context weigh exactly
    zero at any width, so a row's result does not depend on its chunk (tested bit for bit).
    Under a ``data`` mesh the sort moves rows between devices, and the result is the same
    (tested on emulated CPU meshes); off CPU, chunks are large enough that a decode step of
    sequences is one chunk, and only a flat step's many token rows are split.
    """
    b, t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    pages = md.block_tables.shape[1]
    c = _rows_per_chunk(b, t, h, kvh, pages * page_size, d, k_pages.dtype.itemsize, md.chunk_bytes)
    if c == b:
        return _attention_rows(q, k_pages, v_pages, md, scale, sliding_window)
    order = jnp.argsort(md.context_lens)
    chunked = lambda a: a[order].reshape(b // c, c, *a.shape[1:])
    widths = _chunk_widths(pages)

    def narrow(width: int, qc: jax.Array, mdc: AttentionMetadata) -> jax.Array:
        mdc = dataclasses.replace(mdc, block_tables=mdc.block_tables[:, :width])
        return _attention_rows(qc, k_pages, v_pages, mdc, scale, sliding_window)

    def one(rows: tuple[jax.Array, AttentionMetadata]) -> jax.Array:
        qc, mdc = rows
        need = -(-mdc.context_lens.max() // page_size)
        branch = jnp.searchsorted(jnp.asarray(widths, jnp.int32), need)
        return jax.lax.switch(branch, [functools.partial(narrow, w) for w in widths], qc, mdc)

    out = jax.lax.map(one, (chunked(q), jax.tree.map(chunked, md)))
    return jnp.zeros_like(q).at[order].set(out.reshape(q.shape), unique_indices=True)


def _attention_rows(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    b, t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    g = h // kvh
    p = md.block_tables.shape[1]

    def gather(pages: jax.Array) -> jax.Array:
        x = pages[:, md.block_tables]  # [kvh, B, P, S, D]
        return x.reshape(kvh, b, p * page_size, d).transpose(1, 0, 2, 3)

    k, v = gather(k_pages), gather(v_pages)
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bkld->bkgtl", qg, k.astype(q.dtype)) * jnp.asarray(scale, q.dtype)
    key_pos = jnp.arange(p * page_size, dtype=jnp.int32)
    q_pos = md.query_positions(t)
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < md.context_lens[:, None, None]
    )
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores.astype(jnp.float32), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # Contract into [b, k, g, t, d] and transpose after: asking the dot for the
    # [b, t, k, g, d] layout directly makes CPU XLA pick a much slower path.
    out = jnp.einsum("bkgtl,bkld->bkgtd", probs, v.astype(q.dtype))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


PALLAS_PAGES_PER_BLOCK = 8
"""Pages the Pallas kernel loads per compute block (its own default), unless more are needed to
reach :data:`PALLAS_MIN_BLOCK_KEYS` keys."""
PALLAS_MIN_BLOCK_KEYS = 16
"""Keys one Pallas compute block must hold at least: Triton's dot takes no dimension under 16."""
PALLAS_MAX_SPLITS = 16
"""Most partitions the kernel cuts a sequence's pages into (its ``k_splits``), run in parallel."""


def pallas_geometry(pages: int, page_size: int) -> tuple[int, int, int]:
    """``(k_splits, pages_per_compute_block, table width)`` for a block table of ``pages``
    columns: the kernel needs the width to be a multiple of ``k_splits`` and each partition a
    multiple of the compute block, so the table is padded to the next such width (a page count
    like 513 has no usable divisor). Padded columns are never attended: the kernel stops at each
    row's length."""
    per_block = max(-(-PALLAS_MIN_BLOCK_KEYS // page_size), min(PALLAS_PAGES_PER_BLOCK, pages))
    blocks = -(-pages // per_block)
    k_splits = min(PALLAS_MAX_SPLITS, blocks)
    return k_splits, per_block, -(-blocks // k_splits) * k_splits * per_block


def _pallas_decode(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata, scale: float, interpret: bool
) -> jax.Array:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pages = md.block_tables.shape[1]
    k_splits, per_block, width = pallas_geometry(pages, k_pages.shape[2])
    out = paged_attention(
        q[:, 0] * jnp.asarray(scale, q.dtype),  # the kernel does not scale q
        k_pages,
        v_pages,
        jnp.pad(md.block_tables, ((0, 0), (0, width - pages))),
        md.context_lens,
        k_splits=k_splits,
        pages_per_compute_block=per_block,
        interpret=interpret,
    )
    return out[:, None]


def _cpu_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    target: str,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """The C++ kernel (``omni_jax/kernels/paged_decode_cpu.cc``): each row's pages read in
    place, once, where the jnp path gathers a copy and reads it twice; decode attention on CPU
    is bound by that memory traffic."""
    b, _, h, d = q.shape
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, h, d), q.dtype))(
        q[:, 0],
        k_pages,
        v_pages,
        md.block_tables.astype(jnp.int32),
        md.context_lens.astype(jnp.int32),
        scale=np.float32(scale),
        window=np.int64(sliding_window or 0),
    )
    return out[:, None]


def _cpu_kernel_fits(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> bool:
    """The CPU kernel reads float32 and works on head_dim in 16-lane vectors."""
    return all(x.dtype == jnp.float32 for x in (q, k_pages, v_pages)) and q.shape[-1] % 16 == 0


def _per_device(
    kernel: Callable[..., jax.Array],
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
) -> jax.Array:
    """A decode kernel once per device of the current mesh (``jax.set_mesh``), on its shard.

    XLA cannot split a kernel call by itself, so under a mesh each device runs the kernel on
    its rows (``data``) and its query and KV heads (``model``); a head's query group lives
    on the device of its KV head, so no device needs another's cache.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q, k_pages, v_pages, md)
    heads = P("data", None, "model", None)
    return jax.shard_map(
        kernel,
        in_specs=(heads, P("model"), P("model"), P("data")),
        out_specs=heads,
        check_vma=False,
    )(q, k_pages, v_pages, md)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    backend: Backend = "auto",
) -> jax.Array:
    """Attention of ``q [B, T, H, D]`` over the paged cache (which already holds this step).

    ``auto`` takes a kernel for ``T == 1`` decode (Pallas on GPU for narrower dtypes than
    float32: its Triton dots compute float32 in TensorFloat-32, short of float32 parity; on CPU
    the C++ kernel, for float32 with ``head_dim % 16 == 0``, when it could be built) and the
    jnp gather path otherwise; ``pallas_interpret`` runs the Pallas kernel on any backend so tests can hold it
    to the jnp path without a GPU.
    """
    decode = q.shape[1] == 1
    cpu_kernel = decode and jax.default_backend() == "cpu" and _cpu_kernel_fits(q, k_pages, v_pages)
    if backend == "auto":
        if decode and sliding_window is None and jax.default_backend() == "gpu" and q.dtype != jnp.float32:
            backend = "pallas"
        elif cpu_kernel and paged_decode_target():
            backend = "cpu"
        else:
            backend = "jnp"
    if backend in ("pallas", "pallas_interpret"):
        if not decode or sliding_window is not None:
            raise ValueError(
                "the Pallas paged-attention kernel serves decode steps (T == 1) without a window"
            )
        kernel = functools.partial(_pallas_decode, scale=scale, interpret=backend == "pallas_interpret")
        return _per_device(kernel, q, k_pages, v_pages, md)
    if backend == "cpu":
        target = paged_decode_target() if cpu_kernel else None
        if target is None:
            raise ValueError(
                "the CPU paged-attention kernel serves float32 decode steps (T == 1) with head_dim a "
                "multiple of 16 on the CPU backend, and needs a C++ compiler to build"
            )
        kernel = functools.partial(_cpu_decode, target=target, scale=scale, sliding_window=sliding_window)
        return _per_device(kernel, q, k_pages, v_pages, md)
    return _attention_jnp(q, k_pages, v_pages, md, scale, sliding_window)
