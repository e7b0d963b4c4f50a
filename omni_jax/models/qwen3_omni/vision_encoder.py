"""Qwen3-Omni thinker vision encoder (``Qwen3OmniMoeVisionEncoder``) as NNX modules.

What differs from Qwen2.5-Omni's ViT: no windows (every layer attends over its whole frame, so
tokens stay in input order and nothing is permuted); a learned position table, bilinearly
resampled to each frame's grid, is added to the patch embedding (which has a bias); LayerNorms
instead of RMSNorms; a GELU MLP (``linear_fc1``/``linear_fc2``) instead of SwiGLU; fused ``qkv``;
and **deepstack**: after each layer of ``deepstack_visual_indexes`` the hidden states also go
through a merger of their own (``merger_list``, normalising after the merge-unit shuffle), and
those rows are what the thinker adds to its first decoder layers' hidden states at the visual
positions.

The call layout is Qwen2.5-Omni's full-attention path: a call of ``N`` tokens (its only free
dimension, a size of Qwen2.5-Omni's ``vision_token_buckets`` from this spec's
:attr:`VisionEncoderSpec.token_unit`) holds frames one after another, each token tagged with
its frame; every layer is :func:`segment_attention` masked to the frame. The rotary (same
axial 2-D form as Qwen2.5-VL), the input checks and call sizes, and the call planning
(``plan_vision_calls``, by this spec's :meth:`VisionEncoderSpec.call_flops`) are
Qwen2.5-Omni's. The position table's taps and weights come from the host
(:func:`position_taps`), computed as the reference computes them.

``prepare_vision_batch`` builds a call's :class:`VisionBatch`; ``VisionEncoder(batch)`` returns
``(rows, deepstack)``: ``[N // merge_unit, out_hidden_size]`` rows in input order and one such
array per deepstack layer, split per item by the :class:`RowSplit`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.param_map import ParamRule, linear_kernel
from omni_jax.models.qwen2_5_omni.audio_encoder import RowSplit, bucket_size, torch_layer_norm
from omni_jax.models.qwen2_5_omni.vision_encoder import (
    PatchGeometry,
    apply_vision_rope,
    call_tokens,
    check_vision_input,
    frame_positions,
    patch_embed_kernel,
    segment_attention,
    vision_rope,
    vit_fields,
)

NORM_EPS = 1e-6
"""The epsilon of the reference's vision LayerNorms (fixed there; the config has no field)."""

UNIT_ROWS = 16
"""Merged rows of the smallest call; call sizes are multiples of it (in tokens, a power of two,
so a full-attention layer's query tiles stay large)."""

GELU_APPROXIMATE = {"gelu": False, "gelu_pytorch_tanh": True}
"""The MLP activations the encoder supports: whether each is the tanh approximation."""

VISION_IGNORE: tuple[str, ...] = ()
"""HF tensors the encoder does not use: none."""


@dataclasses.dataclass(frozen=True)
class VisionEncoderSpec(PatchGeometry):
    """The fields of ``Qwen3OmniMoeVisionEncoderConfig`` the encoder needs, hashable for jit."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    approximate_gelu: bool
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: Any) -> VisionEncoderSpec:
        if cfg.hidden_act not in GELU_APPROXIMATE:
            raise ValueError(
                f"vision encoder supports hidden_act {sorted(GELU_APPROXIMATE)}, not {cfg.hidden_act!r}"
            )
        return cls(
            **vit_fields(cfg),
            num_position_embeddings=cfg.num_position_embeddings,
            deepstack_visual_indexes=tuple(cfg.deepstack_visual_indexes),
            approximate_gelu=GELU_APPROXIMATE[cfg.hidden_act],
        )

    @property
    def grid_side(self) -> int:
        """Side of the square learned position grid (the reference's ``num_grid_per_side``)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def token_unit(self) -> int:
        """Tokens of the smallest call, and the step of the call sizes: whole merge units (a
        ``spatial_merge_size`` of 3 makes units of 9 tokens, which no power of two holds)."""
        return self.merge_unit * bucket_size(UNIT_ROWS)

    def token_flops(self) -> int:
        """Multiply-adds x 2 per token of everything but attention scores (patch embedding,
        every layer's projections and MLP, the mergers' share)."""
        d, m = self.hidden_size, self.merge_unit
        layer = 4 * d * d + 2 * d * self.intermediate_size
        merger = (d * m * d * m + d * m * self.out_hidden_size) // m
        return 2 * (
            self.patch_dim * d + self.depth * layer + (1 + len(self.deepstack_visual_indexes)) * merger
        )

    def call_flops(self, tokens: int) -> int:
        """FLOPs of one call of ``tokens`` tokens: :meth:`token_flops` per token, plus, in every
        layer, the scores and weighted sums of all ``tokens`` keys a query."""
        return tokens * self.token_flops() + 4 * self.hidden_size * self.depth * tokens * tokens


def position_taps(grid_h: int, grid_w: int, spec: VisionEncoderSpec) -> tuple[np.ndarray, np.ndarray]:
    """``([h * w, 4] indices, [h * w, 4] weights)`` that resample the learned position grid to an
    ``h x w`` frame (bilinear, corners aligned), patches in merge-block order.

    The reference's arithmetic (``get_vision_interpolation_indices_and_weights``), in float32.
    """
    side = spec.grid_side

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
        return taps, np.maximum(np.float32(1) - distance, np.float32(0))

    positions = frame_positions(grid_h, grid_w, spec.spatial_merge_size)
    h_taps, h_weights = axis(positions[:, 0], grid_h)
    w_taps, w_weights = axis(positions[:, 1], grid_w)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return taps.astype(np.int32), weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """Device inputs of one encoder call of ``N`` tokens (its only free dimension).

    patches: ``[N, C * T * P * P]`` flattened patches in input order (item after item, frame
        after frame, each frame in the processor's merge-block order), then zero rows.
    positions: ``[N, 2]`` (row, column) of each patch in its frame, for the 2-D rotary.
    frames: ``[N]`` frame of each token (numbered across the call; -1 for padding).
    pos_taps: ``[N, 4]`` rows of the learned position table each token mixes.
    pos_weights: ``[N, 4]`` their bilinear weights (0 for padding).
    """

    patches: jax.Array
    positions: jax.Array
    frames: jax.Array
    pos_taps: jax.Array
    pos_weights: jax.Array

    @classmethod
    def shapes(cls, spec: VisionEncoderSpec, tokens: int) -> VisionBatch:
        """The ``jax.ShapeDtypeStruct`` of each field for a call of ``tokens`` tokens (to compile
        a program without building its inputs)."""
        leaf = jax.ShapeDtypeStruct
        return cls(
            patches=leaf((tokens, spec.patch_dim), jnp.float32),
            positions=leaf((tokens, 2), jnp.int32),
            frames=leaf((tokens,), jnp.int32),
            pos_taps=leaf((tokens, 4), jnp.int32),
            pos_weights=leaf((tokens, 4), jnp.float32),
        )


def prepare_vision_batch(
    patches: Sequence[np.ndarray],
    grid_thw: Sequence[tuple[int, int, int]],
    spec: VisionEncoderSpec,
    *,
    tokens: int | None = None,
) -> tuple[VisionBatch, RowSplit]:
    """Pack images/videos (``patches[i]`` is ``[t*h*w, patch_dim]`` for ``grid_thw[i]``) into one
    call of ``tokens`` tokens (a multiple of the merge unit; default Qwen2.5-Omni's
    ``default_tokens``: the token unit times a power of two) on the host. The returned
    :class:`RowSplit` says which output rows are whose.
    """
    m = spec.spatial_merge_size
    positions: list[np.ndarray] = []
    taps: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    frame_sizes: list[int] = []
    counts: list[int] = []
    for i, (x, thw) in enumerate(zip(patches, grid_thw, strict=True)):
        t, h, w = check_vision_input(i, x, thw, spec)
        frame_taps, frame_weights = position_taps(h, w, spec)
        positions += [frame_positions(h, w, m)] * t
        taps += [frame_taps] * t
        weights += [frame_weights] * t
        frame_sizes += [h * w] * t
        counts.append(t * h * w)
    total = sum(counts)
    n = call_tokens(total, tokens, spec, spec.merge_unit)
    flat = np.zeros((n, spec.patch_dim), np.float32)
    pos = np.zeros((n, 2), np.int32)
    frame_ids = np.full((n,), -1, np.int32)
    tap_ids = np.zeros((n, 4), np.int32)
    tap_weights = np.zeros((n, 4), np.float32)
    if counts:
        flat[:total] = np.concatenate(patches)
        pos[:total] = np.concatenate(positions)
        frame_ids[:total] = np.repeat(np.arange(len(frame_sizes)), frame_sizes)
        tap_ids[:total] = np.concatenate(taps)
        tap_weights[:total] = np.concatenate(weights)
    batch = VisionBatch(flat, pos, frame_ids, tap_ids, tap_weights)
    return batch, RowSplit.from_lengths([c // spec.merge_unit for c in counts])


class VisionAttention(nnx.Module):
    """Self-attention over each token's frame, with the 2-D rotary on ``q`` and ``k``."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.num_heads = spec.num_heads
        self.qkv = nnx.Linear(d, 3 * d, **kw)
        self.proj = nnx.Linear(d, d, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, frames: jax.Array) -> jax.Array:
        n, d = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, -1)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        out = segment_attention(apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin), v, frames)
        return self.proj(out.reshape(n, d))


class VisionBlock(nnx.Module):
    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.approximate_gelu = spec.approximate_gelu
        self.norm1 = torch_layer_norm(spec.hidden_size, dtype, rngs, NORM_EPS)
        self.norm2 = torch_layer_norm(spec.hidden_size, dtype, rngs, NORM_EPS)
        self.attn = VisionAttention(spec, dtype=dtype, rngs=rngs)
        self.linear_fc1 = nnx.Linear(spec.hidden_size, spec.intermediate_size, **kw)
        self.linear_fc2 = nnx.Linear(spec.intermediate_size, spec.hidden_size, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, frames: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        h = jax.nn.gelu(self.linear_fc1(self.norm2(x)), approximate=self.approximate_gelu)
        return x + self.linear_fc2(h)


class PatchMerger(nnx.Module):
    """Each merge unit's tokens concatenated and mapped to the thinker width; LayerNorm before
    the concatenation (the main merger) or after it (``postshuffle``: the deepstack mergers)."""

    def __init__(self, spec: VisionEncoderSpec, *, postshuffle: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        merged = spec.hidden_size * spec.merge_unit
        self.postshuffle = postshuffle
        self.ln_q = torch_layer_norm(merged if postshuffle else spec.hidden_size, dtype, rngs, NORM_EPS)
        self.fc1 = nnx.Linear(merged, merged, **kw)
        self.fc2 = nnx.Linear(merged, spec.out_hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        merged = self.fc1.in_features
        x = self.ln_q(x.reshape(-1, merged)) if self.postshuffle else self.ln_q(x).reshape(-1, merged)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionEncoder(nnx.Module):
    """``Qwen3OmniMoeVisionEncoder``: flattened patches -> merged thinker-width embeddings and
    the deepstack features."""

    def __init__(self, spec: VisionEncoderSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.spec = spec
        self.patch_embed = nnx.Linear(spec.patch_dim, spec.hidden_size, **kw)
        self.pos_embed = nnx.Embed(spec.num_position_embeddings, spec.hidden_size, **kw)
        self.blocks = nnx.List([VisionBlock(spec, dtype=dtype, rngs=rngs) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec, postshuffle=False, dtype=dtype, rngs=rngs)
        self.merger_list = nnx.List(
            [
                PatchMerger(spec, postshuffle=True, dtype=dtype, rngs=rngs)
                for _ in spec.deepstack_visual_indexes
            ]
        )

    def __call__(self, batch: VisionBatch) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """``(rows, deepstack)``: ``[N // merge_unit, out_hidden_size]`` embeddings in input order
        and, for each of ``deepstack_visual_indexes`` in order, its merger's rows (same shape);
        see :class:`RowSplit` for the rows."""
        spec = self.spec
        x = self.patch_embed(batch.patches.astype(self.patch_embed.kernel.dtype))
        table = self.pos_embed(batch.pos_taps)  # [N, 4, hidden]
        x = x + jnp.sum(table * batch.pos_weights[..., None], axis=1).astype(x.dtype)
        cos, sin = vision_rope(batch.positions, spec.hidden_size // spec.num_heads, spec.rope_theta)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, batch.frames)
            if i in spec.deepstack_visual_indexes:
                deepstack.append(self.merger_list[spec.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), tuple(deepstack)


_MERGERS = r"(merger|merger_list\.\d+)"

VISION_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"patch_embed\.proj\.weight", "patch_embed.kernel", patch_embed_kernel),
    ParamRule(r"patch_embed\.proj\.bias", "patch_embed.bias"),
    ParamRule(r"pos_embed\.weight", "pos_embed.embedding"),
    ParamRule(r"blocks\.(\d+)\.(norm[12])\.weight", r"blocks.\1.\2.scale"),
    ParamRule(r"blocks\.(\d+)\.(norm[12])\.bias", r"blocks.\1.\2.bias"),
    ParamRule(r"blocks\.(\d+)\.attn\.(qkv|proj)\.weight", r"blocks.\1.attn.\2.kernel", linear_kernel),
    ParamRule(r"blocks\.(\d+)\.attn\.(qkv|proj)\.bias", r"blocks.\1.attn.\2.bias"),
    ParamRule(r"blocks\.(\d+)\.mlp\.(linear_fc[12])\.weight", r"blocks.\1.\2.kernel", linear_kernel),
    ParamRule(r"blocks\.(\d+)\.mlp\.(linear_fc[12])\.bias", r"blocks.\1.\2.bias"),
    ParamRule(_MERGERS + r"\.ln_q\.weight", r"\1.ln_q.scale"),
    ParamRule(_MERGERS + r"\.ln_q\.bias", r"\1.ln_q.bias"),
    ParamRule(_MERGERS + r"\.mlp\.0\.weight", r"\1.fc1.kernel", linear_kernel),
    ParamRule(_MERGERS + r"\.mlp\.0\.bias", r"\1.fc1.bias"),
    ParamRule(_MERGERS + r"\.mlp\.2\.weight", r"\1.fc2.kernel", linear_kernel),
    ParamRule(_MERGERS + r"\.mlp\.2\.bias", r"\1.fc2.bias"),
)
"""``Qwen3OmniMoeVisionEncoder.state_dict()`` names -> :class:`VisionEncoder` paths."""
