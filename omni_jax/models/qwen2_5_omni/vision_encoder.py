"""Qwen2.5-Omni thinker vision encoder (the Qwen2.5-VL ViT) as NNX modules.

The reference permutes tokens into window order and loops over ``cu_seqlens`` segments:
windows of ``window_size`` pixels for most layers, whole frames for ``fullatt_block_indexes``.
Here tokens stay in their input order (merge-block-major, as the processor emits them, so the
patch merger's groups of ``spatial_merge_size**2`` rows are contiguous and the output needs no
un-permuting) and each segment kind becomes a dense ``[blocks, block_len]`` layout: the host
computes, per batch, which token sits in which block slot (:class:`AttentionBlocks`), and the
jitted layer gathers q/k/v into blocks, attends with a key mask and gathers the result back.
That keeps attention cost per block instead of quadratic in the whole batch, and every shape
is a bucket size, so batches of different images and videos share one compilation.

``prepare_vision_batch`` builds the :class:`VisionBatch`; ``VisionEncoder(batch)`` returns
``[tokens // merge_unit, out_hidden_size]`` rows, split per request by :class:`RowSplit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.param_map import ParamRule, linear_kernel
from omni_jax.models.qwen2_5_omni.audio_encoder import RowSplit, block_attention, bucket_size


def patch_embed_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``Conv3d.weight [out, C, T, P, P]`` -> ``nnx.Linear`` kernel ``[C*T*P*P, out]``.

    The conv's stride equals its kernel and each input row is one flattened ``(C, T, P, P)``
    patch, so the conv is exactly a matmul; doing it as one keeps it a plain GEMM.
    """
    return x.reshape(x.shape[0], -1).T


@dataclasses.dataclass(frozen=True)
class VisionEncoderSpec:
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
        rope = getattr(cfg, "rope_parameters", None) or {}
        return cls(
            depth=cfg.depth,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            in_channels=cfg.in_channels,
            patch_size=cfg.patch_size,
            temporal_patch_size=cfg.temporal_patch_size,
            spatial_merge_size=cfg.spatial_merge_size,
            window_size=cfg.window_size,
            out_hidden_size=cfg.out_hidden_size,
            fullatt_block_indexes=tuple(cfg.fullatt_block_indexes),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_units(self) -> int:
        """Window side in merged units (the reference's ``vit_merger_window_size``)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_tokens(self) -> int:
        return self.window_units**2 * self.merge_unit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Attention segments of a flat token sequence, laid out as dense blocks.

    index: ``[B, L]`` token of each block slot; a block's tokens come first, then padding
        slots pointing at token 0.
    lengths: ``[B]`` tokens in each block (the key mask).
    slot: ``[N]`` where each token sits in the flattened ``[B * L]`` layout (padding tokens
        point at slot 0 and read garbage nobody uses).
    """

    index: jax.Array
    lengths: jax.Array
    slot: jax.Array

    @classmethod
    def build(
        cls, segments: Sequence[np.ndarray], num_tokens: int, num_blocks: int, block_len: int
    ) -> AttentionBlocks:
        """Blocks from ``segments`` (token ids, each at most ``block_len``) on the host."""
        index = np.zeros((num_blocks, block_len), np.int32)
        lengths = np.zeros((num_blocks,), np.int32)
        slot = np.zeros((num_tokens,), np.int32)
        for b, seg in enumerate(segments):
            index[b, : len(seg)] = seg
            lengths[b] = len(seg)
            slot[seg] = b * block_len + np.arange(len(seg))
        return cls(index, lengths, slot)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """Device inputs of one encoder call; every shape is a bucket size.

    patches: ``[N, C * T * P * P]`` flattened patches of all requests, then zero rows.
    positions: ``[N, 2]`` (row, column) of each patch in its frame, for the 2-D rotary.
    windows: segments of the window-attention layers (one per window, in window order).
    frames: segments of the full-attention layers (one per frame).
    """

    patches: jax.Array
    positions: jax.Array
    windows: AttentionBlocks
    frames: AttentionBlocks


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


def _frame_positions(grid_h: int, grid_w: int, m: int) -> np.ndarray:
    """``[h * w, 2]`` (row, column) of each patch in merge-block-major order."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    grid = np.stack([rows, cols], axis=-1).reshape(grid_h // m, m, grid_w // m, m, 2)
    return grid.transpose(0, 2, 1, 3, 4).reshape(-1, 2)


def prepare_vision_batch(
    patches: Sequence[np.ndarray],
    grid_thw: Sequence[tuple[int, int, int]],
    spec: VisionEncoderSpec,
    *,
    min_tokens: int = 1,
    min_windows: int = 1,
    min_frames: int = 1,
    min_frame_tokens: int = 1,
) -> tuple[VisionBatch, RowSplit]:
    """Pack images/videos (``patches[i]`` is ``[t*h*w, patch_dim]`` for ``grid_thw[i]``) on the host.

    Output rows (``tokens // merge_unit``), window and frame counts and the frame block
    length are padded to powers of two (at least the given minimums); the window block length
    is fixed by the config. The returned :class:`RowSplit` says which output rows are whose.
    """
    m = spec.spatial_merge_size
    windows: list[np.ndarray] = []
    frames: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    counts: list[int] = []
    start = 0
    for i, (x, thw) in enumerate(zip(patches, grid_thw, strict=True)):
        t, h, w = (int(v) for v in thw)
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(
                f"vision input {i}: grid_thw {tuple(thw)} must have t >= 1 and h, w multiples of {m}"
            )
        if x.shape != (t * h * w, spec.patch_dim):
            raise ValueError(
                f"vision input {i}: patches shape {x.shape}, expected {(t * h * w, spec.patch_dim)}"
            )
        frame_windows = _frame_windows(h, w, spec)
        for f in range(t):
            offset = start + f * h * w
            windows += [offset + win for win in frame_windows]
            frames.append(offset + np.concatenate(frame_windows))
        positions.append(np.tile(_frame_positions(h, w, m), (t, 1)))
        counts.append(t * h * w)
        start += t * h * w
    unit = spec.merge_unit
    num_tokens = bucket_size(-(-max(start, min_tokens) // unit)) * unit
    flat = np.zeros((num_tokens, spec.patch_dim), np.float32)
    pos = np.zeros((num_tokens, 2), np.int32)
    if counts:
        flat[:start] = np.concatenate(patches)
        pos[:start] = np.concatenate(positions)
    frame_len = bucket_size(max((len(f) for f in frames), default=1), min_frame_tokens)
    batch = VisionBatch(
        patches=flat,
        positions=pos,
        windows=AttentionBlocks.build(
            windows, num_tokens, bucket_size(len(windows), min_windows), spec.window_tokens
        ),
        frames=AttentionBlocks.build(frames, num_tokens, bucket_size(len(frames), min_frames), frame_len),
    )
    return batch, RowSplit.from_lengths([n // unit for n in counts])


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)`` in float32, cast back before the scale (as the reference)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype: jnp.dtype, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


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


class VisionAttention(nnx.Module):
    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.num_heads = spec.num_heads
        self.q = nnx.Linear(d, d, **kw)
        self.k = nnx.Linear(d, d, **kw)
        self.v = nnx.Linear(d, d, **kw)
        self.proj = nnx.Linear(d, d, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, blocks: AttentionBlocks) -> jax.Array:
        n, d = x.shape
        heads = (n, self.num_heads, d // self.num_heads)
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rotate(y: jax.Array) -> jax.Array:
            y32 = y.astype(jnp.float32)
            return (y32 * cos + _rotate_half(y32) * sin).astype(y.dtype)

        q = rotate(self.q(x).reshape(heads))[blocks.index]
        k = rotate(self.k(x).reshape(heads))[blocks.index]
        v = self.v(x).reshape(heads)[blocks.index]
        out = block_attention(q, k, v, blocks.lengths)
        return self.proj(out.reshape(-1, d)[blocks.slot])


class VisionMLP(nnx.Module):
    """SwiGLU with biases."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(spec.hidden_size, spec.intermediate_size, **kw)
        self.up_proj = nnx.Linear(spec.hidden_size, spec.intermediate_size, **kw)
        self.down_proj = nnx.Linear(spec.intermediate_size, spec.hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(spec.hidden_size, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(spec.hidden_size, dtype=dtype, rngs=rngs)
        self.attn = VisionAttention(spec, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(spec, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, blocks: AttentionBlocks) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, blocks)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """RMSNorm, then each merge unit's tokens concatenated and mapped to the thinker width."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        merged = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, dtype=dtype, rngs=rngs)
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
        """``[N // merge_unit, out_hidden_size]`` embeddings; see :class:`RowSplit` for the rows."""
        spec = self.spec
        x = self.patch_embed(batch.patches.astype(self.patch_embed.kernel.dtype))
        cos, sin = vision_rope(batch.positions, spec.hidden_size // spec.num_heads, spec.rope_theta)
        for i, block in enumerate(self.blocks):
            segments = batch.frames if i in spec.fullatt_block_indexes else batch.windows
            x = block(x, cos, sin, segments)
        return self.merger(x)


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
