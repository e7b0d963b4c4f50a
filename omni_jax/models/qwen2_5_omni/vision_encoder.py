"""Qwen2.5-Omni thinker vision encoder (the Qwen2.5-VL ViT) as NNX modules.

The reference permutes tokens into window order and loops over ``cu_seqlens`` segments:
windows of ``window_size`` pixels for most layers, whole frames for ``fullatt_block_indexes``.
Here the host does the same permutation (:func:`prepare_vision_batch`), so every window and
every frame is a contiguous run of tokens, and tags each token with its window and its frame.
Each kind of layer is then one dense computation whose shapes depend on the call's token
count ``N`` alone:

- window layers: banded attention. Queries go in tiles of :attr:`VisionEncoderSpec.band_tile`
  tokens (a power of two holding a whole window); a window never reaches further than one tile
  either side, so each tile attends to its own and its two neighbouring tiles, masked to the
  query's window. Cost: ``3 * band_tile`` keys a query, whatever the images.
- full-attention layers: each query attends to all ``N`` tokens, masked to its frame, in query
  tiles (:func:`query_tile`) so the score memory stays bounded. Cost: ``N`` keys a query, so
  frames sharing a call pay for each other; :func:`plan_vision_calls` weighs that against one
  more call.

So a call's only free dimension is ``N``, padded to a size of a fixed ladder
(:func:`vision_token_buckets`); the encoder compiles one program per ladder size. Frames are
independent in this encoder (rotary positions, windows and full attention all stay inside a
frame), so a video's frames may go to different calls.

:func:`plan_vision_calls` cuts a step's images and videos into calls, ``prepare_vision_batch``
builds each call's :class:`VisionBatch`, and ``VisionEncoder(batch)`` returns
``[N // merge_unit, out_hidden_size]`` rows in input order, split per item by :class:`RowSplit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.layers import RMSNorm, SwiGLU, rotate_half
from omni_jax.models.param_map import ParamRule, linear_kernel
from omni_jax.models.qwen2_5_omni.audio_encoder import RowSplit, bucket_size
from omni_jax.models.qwen2_5_omni.encoder_calls import plan_calls, size_ladder

SCORE_ELEMENTS = 1 << 26
"""Most attention scores (query tile x keys x heads) a full-attention layer holds at once."""


def patch_embed_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``Conv3d.weight [out, C, T, P, P]`` -> ``nnx.Linear`` kernel ``[C*T*P*P, out]``.

    The conv's stride equals its kernel and each input row is one flattened ``(C, T, P, P)``
    patch, so the conv is exactly a matmul; doing it as one keeps it a plain GEMM.
    """
    return x.reshape(x.shape[0], -1).T


def vit_fields(cfg: Any) -> dict[str, Any]:
    """The spec fields a Qwen ViT config (this family's, Qwen3-Omni's) names alike."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    return dict(
        depth=cfg.depth,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        in_channels=cfg.in_channels,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        spatial_merge_size=cfg.spatial_merge_size,
        out_hidden_size=cfg.out_hidden_size,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


class PatchGeometry:
    """Sizes derived from a vision spec's patch fields (a mixin of this family's and Qwen3-Omni's
    :class:`VisionEncoderSpec`)."""

    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Width of one flattened ``(C, T, P, P)`` patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class VisionEncoderSpec(PatchGeometry):
    """The fields of ``Qwen2_5OmniVisionEncoderConfig`` the encoder needs, hashable for jit."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: Any) -> VisionEncoderSpec:
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision encoder supports hidden_act 'silu', not {cfg.hidden_act!r}")
        return cls(
            **vit_fields(cfg),
            window_size=cfg.window_size,
            fullatt_block_indexes=tuple(cfg.fullatt_block_indexes),
        )

    @property
    def window_units(self) -> int:
        """Window side in merged units (the reference's ``vit_merger_window_size``)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def band_tile(self) -> int:
        """Query tile of the window layers: whole merge units (a power of two of them) holding a
        whole window, so that a window starting or ending in a tile lies within that tile and its
        two neighbours."""
        return self.merge_unit * bucket_size(self.window_units**2)

    @property
    def token_unit(self) -> int:
        """Tokens of the smallest call, and the step of the call sizes: the band tile."""
        return self.band_tile

    def token_flops(self) -> int:
        """Multiply-adds x 2 per token of everything but attention scores (patch embedding,
        every layer's projections and MLP, the merger's share)."""
        d, m = self.hidden_size, self.merge_unit
        layer = 4 * d * d + 3 * d * self.intermediate_size
        merger = (d * m * d * m + d * m * self.out_hidden_size) // m
        return 2 * (self.patch_dim * d + self.depth * layer + merger)

    def call_flops(self, tokens: int) -> int:
        """FLOPs of one call of ``tokens`` tokens: :meth:`token_flops` per token, plus the scores
        and weighted sums of ``3 * band_tile`` keys a query in window layers and ``tokens`` keys
        in full-attention layers."""
        full = len(self.fullatt_block_indexes)
        pair = 4 * self.hidden_size
        window_keys = (self.depth - full) * 3 * self.band_tile
        return tokens * self.token_flops() + pair * tokens * (window_keys + full * tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """Device inputs of one encoder call of ``N`` tokens (its only free dimension).

    patches: ``[N, C * T * P * P]`` flattened patches in window order (frames one after the
        other, each frame's windows in the reference's order), then zero rows.
    positions: ``[N, 2]`` (row, column) of each patch in its frame, for the 2-D rotary.
    windows: ``[N]`` window of each token (numbered across the call; -1 for padding).
    frames: ``[N]`` frame of each token (likewise).
    rows: ``[N // merge_unit]`` merged row (window order) of each output row (input order:
        item after item, each in the processor's merge-block order), then the padding rows.
    """

    patches: jax.Array
    positions: jax.Array
    windows: jax.Array
    frames: jax.Array
    rows: jax.Array

    @classmethod
    def shapes(cls, spec: VisionEncoderSpec, tokens: int) -> VisionBatch:
        """The ``jax.ShapeDtypeStruct`` of each field for a call of ``tokens`` tokens (to compile
        a program without building its inputs)."""
        leaf = jax.ShapeDtypeStruct
        return cls(
            patches=leaf((tokens, spec.patch_dim), jnp.float32),
            positions=leaf((tokens, 2), jnp.int32),
            windows=leaf((tokens,), jnp.int32),
            frames=leaf((tokens,), jnp.int32),
            rows=leaf((tokens // spec.merge_unit,), jnp.int32),
        )


def _frame_windows(grid_h: int, grid_w: int, spec: VisionEncoderSpec) -> list[np.ndarray]:
    """Token ids (frame-local) of each window, in the reference's window order.

    Windows tile the merged grid from the top-left; those on the bottom/right edge are cut
    short. Inside a window, merged units go row-major and each unit's tokens stay together.
    """
    m, ws = spec.spatial_merge_size, spec.window_units
    units_h, units_w = grid_h // m, grid_w // m
    units = np.arange(units_h * units_w).reshape(units_h, units_w)
    out = []
    for r in range(0, units_h, ws):
        for c in range(0, units_w, ws):
            window = units[r : r + ws, c : c + ws].reshape(-1)
            out.append((window[:, None] * spec.merge_unit + np.arange(spec.merge_unit)).reshape(-1))
    return out


def frame_positions(grid_h: int, grid_w: int, m: int) -> np.ndarray:
    """``[h * w, 2]`` (row, column) of each patch in merge-block-major order."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    grid = np.stack([rows, cols], axis=-1).reshape(grid_h // m, m, grid_w // m, m, 2)
    return grid.transpose(0, 2, 1, 3, 4).reshape(-1, 2)


class CallUnit(Protocol):
    """What the call sizing reads of a spec (this family's and Qwen3-Omni's)."""

    @property
    def token_unit(self) -> int: ...

    @property
    def spatial_merge_size(self) -> int: ...

    @property
    def patch_dim(self) -> int: ...


def check_vision_input(i: int, x: np.ndarray, thw: Sequence[int], spec: CallUnit) -> tuple[int, int, int]:
    """``(t, h, w)`` of vision input ``i`` (``x`` its patches), checked: at least a frame, whole
    merge units, one row of ``patch_dim`` a patch."""
    m = spec.spatial_merge_size
    t, h, w = (int(v) for v in thw)
    if t < 1 or h < m or w < m or h % m or w % m:
        raise ValueError(
            f"vision input {i}: grid_thw {tuple(thw)} must have t >= 1 and h, w multiples of {m}"
        )
    if x.shape != (t * h * w, spec.patch_dim):
        raise ValueError(f"vision input {i}: patches shape {x.shape}, expected {(t * h * w, spec.patch_dim)}")
    return t, h, w


def default_tokens(total: int, spec: CallUnit) -> int:
    """The call size for ``total`` tokens when the caller names none: the spec's token unit
    times a power of two."""
    return bucket_size(-(-max(total, 1) // spec.token_unit)) * spec.token_unit


def call_tokens(total: int, tokens: int | None, spec: CallUnit, multiple: int) -> int:
    """The size of a call holding ``total`` tokens: ``tokens``, checked to hold them and to be a
    multiple of ``multiple``, or :func:`default_tokens` when None."""
    n = default_tokens(total, spec) if tokens is None else tokens
    if n < total or n % multiple:
        raise ValueError(f"a call of {n} tokens cannot hold {total} (it must be a multiple of {multiple})")
    return n


def prepare_vision_batch(
    patches: Sequence[np.ndarray],
    grid_thw: Sequence[tuple[int, int, int]],
    spec: VisionEncoderSpec,
    *,
    tokens: int | None = None,
) -> tuple[VisionBatch, RowSplit]:
    """Pack images/videos (``patches[i]`` is ``[t*h*w, patch_dim]`` for ``grid_thw[i]``) into one
    call of ``tokens`` tokens (a multiple of :attr:`VisionEncoderSpec.band_tile`; default
    :func:`default_tokens`) on the host. The returned :class:`RowSplit` says which output rows
    are whose.
    """
    m, unit = spec.spatial_merge_size, spec.merge_unit
    order: list[np.ndarray] = []  # per frame: its tokens in window order (call-wide ids)
    positions: list[np.ndarray] = []
    windows: list[np.ndarray] = []
    unit_order: list[np.ndarray] = []  # per frame: the merged row (window order) of each input unit
    counts: list[int] = []
    start = num_windows = 0
    for i, (x, thw) in enumerate(zip(patches, grid_thw, strict=True)):
        t, h, w = check_vision_input(i, x, thw, spec)
        frame_windows = _frame_windows(h, w, spec)
        perm = np.concatenate(frame_windows)
        local_rows = np.argsort(perm[::unit] // unit)
        lengths = [len(win) for win in frame_windows]
        frame_pos = frame_positions(h, w, m)[perm]
        for f in range(t):
            offset = start + f * h * w
            order.append(offset + perm)
            positions.append(frame_pos)
            windows.append(num_windows + np.repeat(np.arange(len(lengths)), lengths))
            unit_order.append(offset // unit + local_rows)
            num_windows += len(lengths)
        counts.append(t * h * w)
        start += t * h * w
    n = call_tokens(start, tokens, spec, spec.band_tile)
    flat = np.zeros((n, spec.patch_dim), np.float32)
    pos = np.zeros((n, 2), np.int32)
    window_ids = np.full((n,), -1, np.int32)
    frame_ids = np.full((n,), -1, np.int32)
    rows = np.arange(n // unit, dtype=np.int32)
    if counts:
        flat[:start] = np.concatenate(patches)[np.concatenate(order)]
        pos[:start] = np.concatenate(positions)
        window_ids[:start] = np.concatenate(windows)
        frame_ids[:start] = np.repeat(np.arange(len(order)), [len(o) for o in order])
        rows[: start // unit] = np.concatenate(unit_order)
    batch = VisionBatch(flat, pos, window_ids, frame_ids, rows)
    return batch, RowSplit.from_lengths([c // unit for c in counts])


PER_OCTAVE = 2
"""Call sizes per doubling of the vision ladder (:func:`vision_token_buckets`): with two, past
the smallest sizes a lone frame's call is at most a third padding (half with one), for twice
the programs."""


def vision_token_buckets(spec: CallUnit, largest_frame: int, smallest: int = 1) -> tuple[int, ...]:
    """The call sizes (tokens) of the vision encoder: a ladder of :data:`PER_OCTAVE` sizes a
    doubling from one token unit (this family's band tile) up to the first size that holds a
    frame of ``largest_frame`` patches, without the sizes under ``smallest`` (the last size is
    kept whatever it is)."""
    sizes = size_ladder(spec.token_unit, max(largest_frame, 1), PER_OCTAVE)
    return tuple(s for s in sizes if s >= min(smallest, sizes[-1]))


@dataclasses.dataclass(frozen=True)
class VisionPiece:
    """Frames ``first : first + frames`` of item ``item`` (an image is one frame)."""

    item: int
    first: int
    frames: int


@dataclasses.dataclass(frozen=True)
class VisionCall:
    """One encoder call: ``tokens`` (a bucket) and the pieces it holds, in order."""

    tokens: int
    pieces: tuple[VisionPiece, ...]


class CallCost(Protocol):
    """What :func:`plan_vision_calls` reads of a spec (this family's and Qwen3-Omni's)."""

    def call_flops(self, tokens: int) -> int: ...


def plan_vision_calls(
    grid_thw: Sequence[tuple[int, int, int]], spec: CallCost, buckets: Sequence[int]
) -> list[VisionCall]:
    """Cut items (their frames in order) into calls of ``buckets`` sizes at the least cost
    (``spec.call_flops`` of each call's size, plus that of the smallest size
    for each call, what one more call is taken to cost). A frame larger than the largest
    bucket raises ``ValueError``; callers refuse such inputs at validation."""
    frames = [(i, f, h * w) for i, (t, h, w) in enumerate(grid_thw) for f in range(t)]
    overhead = spec.call_flops(buckets[0])
    plans = plan_calls([n for _, _, n in frames], buckets, lambda size: spec.call_flops(size) + overhead)
    calls = []
    for plan in plans:
        pieces: list[VisionPiece] = []
        for item, frame, _ in frames[plan.start : plan.stop]:
            if pieces and pieces[-1].item == item:
                pieces[-1] = dataclasses.replace(pieces[-1], frames=pieces[-1].frames + 1)
            else:
                pieces.append(VisionPiece(item, frame, 1))
        calls.append(VisionCall(plan.size, tuple(pieces)))
    return calls


NORM_EPS = 1e-6
"""The epsilon of the reference's vision RMSNorms (fixed there; the vision config has no field)."""


def vision_rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[N, head_dim]`` of the axial 2-D rotary: ``[rows | cols]`` twice over.

    Rows and columns each rotate a quarter of the frequencies; the halves repeat so the
    standard ``rotate_half`` pairing (``i`` with ``i + head_dim/2``) applies.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)
    freqs = freqs.reshape(positions.shape[0], half)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_vision_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [N, heads, D]`` by per-token ``cos/sin [N, D]`` in float32 and cast back, as the
    reference does whatever the model's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * cos[:, None, :] + rotate_half(x32) * sin[:, None, :]).astype(x.dtype)


def query_tile(tokens: int, heads: int) -> int:
    """Query tile of a full-attention layer over ``tokens`` keys: the largest power of two that
    divides ``tokens`` and keeps a tile's scores within :data:`SCORE_ELEMENTS`."""
    tile = tokens & -tokens
    while tile > 1 and tile * tokens * heads > SCORE_ELEMENTS:
        tile //= 2
    return tile


def banded_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, tile: int) -> jax.Array:
    """``[N, heads, D]`` attention of each token over the tokens of its segment, segments being
    contiguous runs of at most ``tile`` tokens (``N`` a multiple of ``tile``).

    Query tile ``b`` attends to key tiles ``b - 1 .. b + 1``, which hold every segment that
    reaches into it; keys beyond the ends are padding of segment ``-2``, which no token has.
    """
    n = q.shape[0]
    blocks = n // tile

    def band(x: jax.Array, fill: int) -> jax.Array:
        pad = [(tile, tile)] + [(0, 0)] * (x.ndim - 1)
        x = jnp.pad(x, pad, constant_values=fill)
        views = [x[i * tile : i * tile + n].reshape(blocks, tile, *x.shape[1:]) for i in range(3)]
        return jnp.concatenate(views, axis=1)

    mask = segment.reshape(blocks, tile)[:, :, None] == band(segment, -2)[:, None, :]
    out = jax.nn.dot_product_attention(
        q.reshape(blocks, tile, *q.shape[1:]), band(k, 0), band(v, 0), mask=mask[:, None]
    )
    return out.reshape(q.shape)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array) -> jax.Array:
    """``[N, heads, D]`` attention of each token over all tokens of its segment, anywhere in the
    call, in query tiles of :func:`query_tile`."""
    n, heads, d = q.shape
    tile = query_tile(n, heads)

    def attend(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        q_tile, seg_tile = args
        mask = seg_tile[:, None] == segment[None, :]
        return jax.nn.dot_product_attention(q_tile[None], k[None], v[None], mask=mask[None, None])[0]

    if tile == n:
        return attend((q, segment))
    out = jax.lax.map(attend, (q.reshape(n // tile, tile, heads, d), segment.reshape(n // tile, tile)))
    return out.reshape(n, heads, d)


class VisionAttention(nnx.Module):
    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.num_heads = spec.num_heads
        self.q = nnx.Linear(d, d, **kw)
        self.k = nnx.Linear(d, d, **kw)
        self.v = nnx.Linear(d, d, **kw)
        self.proj = nnx.Linear(d, d, **kw)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment: jax.Array, band: int | None
    ) -> jax.Array:
        """Attention inside each ``segment`` (windows: contiguous within ``band`` tokens, see
        :func:`banded_attention`; ``band=None``: frames, see :func:`segment_attention`)."""
        n, d = x.shape
        heads = (n, self.num_heads, d // self.num_heads)
        q = apply_vision_rope(self.q(x).reshape(heads), cos, sin)
        k = apply_vision_rope(self.k(x).reshape(heads), cos, sin)
        v = self.v(x).reshape(heads)
        if band is None:
            out = segment_attention(q, k, v, segment)
        else:
            out = banded_attention(q, k, v, segment, band)
        return self.proj(out.reshape(n, d))


class VisionBlock(nnx.Module):
    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(spec.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(spec.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.attn = VisionAttention(spec, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size, use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment: jax.Array, band: int | None
    ) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, segment, band)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """RMSNorm, then each merge unit's tokens concatenated and mapped to the thinker width."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        merged = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(merged, merged, **kw)
        self.fc2 = nnx.Linear(merged, spec.out_hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.ln_q(x).reshape(-1, self.fc1.in_features)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionEncoder(nnx.Module):
    """``Qwen2_5OmniVisionEncoder``: flattened patches -> merged thinker-width embeddings."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.spec = spec
        self.patch_embed = nnx.Linear(
            spec.patch_dim, spec.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.blocks = nnx.List([VisionBlock(spec, dtype=dtype, rngs=rngs) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec, dtype=dtype, rngs=rngs)

    def __call__(self, batch: VisionBatch) -> jax.Array:
        """``[N // merge_unit, out_hidden_size]`` embeddings in input order; see :class:`RowSplit`."""
        spec = self.spec
        x = self.patch_embed(batch.patches.astype(self.patch_embed.kernel.dtype))
        cos, sin = vision_rope(batch.positions, spec.hidden_size // spec.num_heads, spec.rope_theta)
        for i, block in enumerate(self.blocks):
            if i in spec.fullatt_block_indexes:
                x = block(x, cos, sin, batch.frames, None)
            else:
                x = block(x, cos, sin, batch.windows, spec.band_tile)
        return self.merger(x)[batch.rows]


VISION_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"patch_embed\.proj\.weight", "patch_embed.kernel", patch_embed_kernel),
    ParamRule(r"blocks\.(\d+)\.(norm[12])\.weight", r"blocks.\1.\2.weight"),
    ParamRule(r"blocks\.(\d+)\.attn\.(q|k|v|proj)\.weight", r"blocks.\1.attn.\2.kernel", linear_kernel),
    ParamRule(r"blocks\.(\d+)\.attn\.(q|k|v|proj)\.bias", r"blocks.\1.attn.\2.bias"),
    ParamRule(
        r"blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight",
        r"blocks.\1.mlp.\2.kernel",
        linear_kernel,
    ),
    ParamRule(r"blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.bias", r"blocks.\1.mlp.\2.bias"),
    ParamRule(r"merger\.ln_q\.weight", "merger.ln_q.weight"),
    ParamRule(r"merger\.mlp\.0\.weight", "merger.fc1.kernel", linear_kernel),
    ParamRule(r"merger\.mlp\.0\.bias", "merger.fc1.bias"),
    ParamRule(r"merger\.mlp\.2\.weight", "merger.fc2.kernel", linear_kernel),
    ParamRule(r"merger\.mlp\.2\.bias", "merger.fc2.bias"),
)
"""``Qwen2_5OmniVisionEncoder.state_dict()`` names -> :class:`VisionEncoder` paths."""
