"""Qwen2.5-Omni code2wav DiT: codec tokens + speaker -> mel velocity field, as Flax NNX modules.

Layout is channels-last (``[batch, frames, channels]``) throughout. Every module takes per-request
valid lengths so that requests of different lengths can share one padded batch: padded frames
never influence valid ones (reflect padding and statistics pooling use each request's own length,
attention masks padded keys), which makes a batched result equal the unbatched one.

The reference is transformers' ``Qwen2_5OmniToken2WavDiTModel``. The speaker encoder mirrors its
module tree name for name (one generic rule maps it); elsewhere :data:`DIT_RULES` renames.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models import dilated_conv
from omni_jax.models.layers import rope_cos_sin, rope_inv_freq, rotate_half
from omni_jax.models.param_map import ParamRule, conv1d_kernel, linear_kernel
from omni_jax.parallel.rules import ShardRule, splits

TIME_FREQ_DIM = 256
"""Width of the sinusoidal timestep features (fixed in the reference)."""

NORM_EPS = 1e-6


def frame_mask(lengths: jax.Array, num_frames: int) -> jax.Array:
    """``[B, T, 1]`` boolean: which frames are inside each request."""
    return (jnp.arange(num_frames)[None, :] < lengths[:, None])[..., None]


def reflect_pad(x: jax.Array, lengths: jax.Array, left: int, right: int) -> jax.Array:
    """Reflect-pad ``[B, T, C]`` at each request's own edges (torch ``padding_mode="reflect"``).

    Frames past a request's length are replaced by the reflection of its last valid frames, so
    a convolution over the result equals the unbatched one on every valid frame.
    """
    if left == 0 and right == 0:
        return x
    pos = jnp.arange(-left, x.shape[1] + right)[None, :]
    last = (lengths - 1)[:, None]
    idx = jnp.abs(pos)
    idx = jnp.where(idx > last, 2 * last - idx, idx)
    idx = jnp.clip(idx, 0, last)
    return jnp.take_along_axis(x, idx[..., None], axis=1)


def _conv1x1(in_features: int, out_features: int, rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(in_features, out_features, kernel_size=1, padding="VALID", rngs=rngs)


class TimeDelayNetBlock(nnx.Module):
    """Dilated conv with per-request reflect "same" padding, then ReLU."""

    def __init__(
        self, in_features: int, out_features: int, kernel_size: int, dilation: int, *, rngs: nnx.Rngs
    ):
        total = dilation * (kernel_size - 1)
        self.pad = (total // 2, total - total // 2)
        self.conv = nnx.Conv(
            in_features,
            out_features,
            kernel_size,
            padding="VALID",
            kernel_dilation=dilation,
            conv_general_dilated=dilated_conv.conv_general_dilated,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        return jax.nn.relu(self.conv(reflect_pad(x, lengths, *self.pad)))


class Res2NetBlock(nnx.Module):
    """Hierarchical residual convs over channel groups (ECAPA-TDNN)."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int, *, rngs: nnx.Rngs):
        self.scale = scale
        width = channels // scale
        self.blocks = nnx.List(
            [TimeDelayNetBlock(width, width, kernel_size, dilation, rngs=rngs) for _ in range(scale - 1)]
        )

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        parts = jnp.split(x, self.scale, axis=-1)
        outputs = [parts[0]]
        for i, part in enumerate(parts[1:]):
            inp = part if i == 0 else part + outputs[-1]
            outputs.append(self.blocks[i](inp, lengths))
        return jnp.concatenate(outputs, axis=-1)


class SqueezeExcitationBlock(nnx.Module):
    """Channel gating from the mean over each request's valid frames."""

    def __init__(self, channels: int, se_channels: int, *, rngs: nnx.Rngs):
        self.conv1 = _conv1x1(channels, se_channels, rngs)
        self.conv2 = _conv1x1(se_channels, channels, rngs)

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        valid = frame_mask(lengths, x.shape[1])
        mean = jnp.sum(jnp.where(valid, x, 0.0), axis=1, keepdims=True) / lengths[:, None, None].astype(
            x.dtype
        )
        gate = jax.nn.sigmoid(self.conv2(jax.nn.relu(self.conv1(mean))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nnx.Module):
    """TDNN -> Res2Net -> TDNN -> SE, with a residual connection."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        res2net_scale: int,
        se_channels: int,
        kernel_size: int,
        dilation: int,
        *,
        rngs: nnx.Rngs,
    ):
        self.tdnn1 = TimeDelayNetBlock(in_features, out_features, 1, 1, rngs=rngs)
        self.res2net_block = Res2NetBlock(out_features, res2net_scale, kernel_size, dilation, rngs=rngs)
        self.tdnn2 = TimeDelayNetBlock(out_features, out_features, 1, 1, rngs=rngs)
        self.se_block = SqueezeExcitationBlock(out_features, se_channels, rngs=rngs)

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        h = self.tdnn1(x, lengths)
        h = self.res2net_block(h, lengths)
        h = self.tdnn2(h, lengths)
        return self.se_block(h, lengths) + x


def _weighted_statistics(x: jax.Array, weights: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """Weighted mean and std over frames, in the reference's op order (``[B, C]`` each)."""
    mean = jnp.sum(weights * x, axis=1)
    var = jnp.sum(weights * jnp.square(x - mean[:, None]), axis=1)
    return mean, jnp.sqrt(jnp.maximum(var, eps))


class AttentiveStatisticsPooling(nnx.Module):
    """Attention-weighted mean/std over each request's valid frames."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int, *, rngs: nnx.Rngs):
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1, rngs=rngs)
        self.conv = _conv1x1(attention_channels, channels, rngs)

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        num_frames = x.shape[1]
        valid = frame_mask(lengths, num_frames)
        uniform = jnp.where(valid, 1.0 / lengths[:, None, None].astype(x.dtype), 0.0)
        mean, std = _weighted_statistics(x, uniform, self.eps)
        broadcast = lambda s: jnp.broadcast_to(s[:, None], x.shape)
        context = jnp.concatenate([x, broadcast(mean), broadcast(std)], axis=-1)
        logits = self.conv(jnp.tanh(self.tdnn(context, lengths)))
        attention = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=1)
        mean, std = _weighted_statistics(x, attention, self.eps)
        return jnp.concatenate([mean, std], axis=-1)


class EcapaTimeDelayNet(nnx.Module):
    """ECAPA-TDNN speaker encoder: reference mel ``[B, R, mel]`` -> ``[B, enc_dim]``."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        channels = list(config.enc_channels)
        kernels = list(config.enc_kernel_sizes)
        dilations = list(config.enc_dilations)
        if not len(channels) == len(kernels) == len(dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations should have same length")
        blocks: list[nnx.Module] = [
            TimeDelayNetBlock(config.mel_dim, channels[0], kernels[0], dilations[0], rngs=rngs)
        ]
        for i in range(1, len(channels) - 1):
            blocks.append(
                SqueezeExcitationRes2NetBlock(
                    channels[i - 1],
                    channels[i],
                    config.enc_res2net_scale,
                    config.enc_se_channels,
                    kernels[i],
                    dilations[i],
                    rngs=rngs,
                )
            )
        self.blocks = nnx.List(blocks)
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1], rngs=rngs)
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels, rngs=rngs)
        self.fc = _conv1x1(channels[-1] * 2, config.enc_dim, rngs)

    def __call__(self, mel: jax.Array, lengths: jax.Array) -> jax.Array:
        h = jnp.where(frame_mask(lengths, mel.shape[1]), mel, 0.0)
        features = []
        for block in self.blocks:
            h = block(h, lengths)
            features.append(h)
        h = self.mfa(jnp.concatenate(features[1:], axis=-1), lengths)
        pooled = self.asp(h, lengths)
        return self.fc(pooled[:, None])[:, 0]


class TimestepEmbedding(nnx.Module):
    """Sinusoidal features of the flow time (scaled by 1000) through a SiLU MLP."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear_1 = nnx.Linear(TIME_FREQ_DIM, dim, rngs=rngs)
        self.linear_2 = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, t: jax.Array) -> jax.Array:
        half = TIME_FREQ_DIM // 2
        freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000) / (half - 1)))
        angles = (1000 * t.astype(jnp.float32))[:, None] * freqs[None, :]
        features = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1).astype(t.dtype)
        return self.linear_2(jax.nn.silu(self.linear_1(features)))


def layer_norm(x: jax.Array) -> jax.Array:
    """LayerNorm without affine (eps 1e-6), variance as the mean of squared deviations like torch."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + NORM_EPS)


def modulate(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    """AdaLN: ``norm(x) * (1 + scale) + shift`` with per-request ``[B, D]`` modulation."""
    return layer_norm(x) * (1 + scale[:, None]) + shift[:, None]


def _shift_blocks(a: jax.Array, offset: int, axis: int) -> jax.Array:
    """Block ``n`` of the result holds block ``n + offset`` of ``a`` along ``axis`` (zeros past the ends)."""
    if offset == 0:
        return a
    n = a.shape[axis]
    kept = jax.lax.slice_in_dim(a, max(offset, 0), n + min(offset, 0), axis=axis)
    edge = jnp.zeros_like(jax.lax.slice_in_dim(a, 0, abs(offset), axis=axis))
    return jnp.concatenate([kept, edge] if offset > 0 else [edge, kept], axis=axis)


def block_window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array,
    block_size: int,
    look_backward: int,
    look_ahead: int,
) -> jax.Array:
    """Attention of each frame to the keys of blocks ``-look_backward .. +look_ahead`` of its own.

    ``q, k, v [B, H, T, D]`` -> ``[B, H, T, D]``; ``key_valid [B, T]``. The reference computes
    all ``T x T`` scores and masks those outside the window; here each block of queries only
    meets its window's ``(look_backward + 1 + look_ahead) * block_size`` keys, so the cost grows
    linearly in ``T`` (a window is at most 3 blocks of 24 frames against mels of hundreds of
    frames). Masked keys get exactly zero weight either way, so the result is the same up to
    summation order. Heads lead so that both products are plain batched matmuls for XLA's CPU
    backend, which runs frames-before-heads layouts much slower.
    """
    b, h, t, d = q.shape
    num_blocks = -(-t // block_size)
    pad = num_blocks * block_size - t
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        key_valid = jnp.pad(key_valid, ((0, 0), (0, pad)))
    blocks = lambda a: a.reshape(b, h, num_blocks, block_size, d)
    offsets = range(-look_backward, look_ahead + 1)
    window = lambda a, axis: jnp.concatenate([_shift_blocks(a, o, axis) for o in offsets], axis=axis + 1)
    keys, values = window(blocks(k), 2), window(blocks(v), 2)
    valid = window(key_valid.reshape(b, num_blocks, block_size), 1)
    scores = jnp.einsum("bhnqd,bhnkd->bhnqk", blocks(q), keys) * (1.0 / math.sqrt(d))
    # A finite floor, not -inf: a padded query whose whole window is padding then gets
    # finite (ignored) values instead of NaN, which would leak through 0 * NaN in probs @ v.
    scores = jnp.where(valid[:, None, :, None, :], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhnqk,bhnkd->bhnqd", probs, values)
    return out.reshape(b, h, num_blocks * block_size, d)[:, :, :t]


class DiTAttention(nnx.Module):
    """Multi-head block-local attention; RoPE on the first head only (as the checkpoint was trained)."""

    def __init__(self, config: Any, look_backward_block: int, look_ahead_block: int, *, rngs: nnx.Rngs):
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.look_backward_block = look_backward_block
        self.look_ahead_block = look_ahead_block
        inner = config.head_dim * config.num_attention_heads
        self.to_q = nnx.Linear(config.hidden_size, inner, rngs=rngs)
        self.to_k = nnx.Linear(config.hidden_size, inner, rngs=rngs)
        self.to_v = nnx.Linear(config.hidden_size, inner, rngs=rngs)
        self.to_out = nnx.Linear(inner, config.hidden_size, rngs=rngs)

    def _rope_first_head(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Interleaved RoPE on head 0, left in the de-interleaved order as the reference does.

        q and k share the permutation, so scores are unchanged by it; v is not touched.
        """
        head = x[:, :, 0]
        head = jnp.concatenate([head[..., 0::2], head[..., 1::2]], axis=-1)
        head = head * cos + rotate_half(head) * sin
        return jnp.concatenate([head[:, :, None], x[:, :, 1:]], axis=2)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], key_valid: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.heads, self.head_dim)
        heads_first = lambda y: y.transpose(0, 2, 1, 3)
        cos, sin = rope
        q = heads_first(self._rope_first_head(split(self.to_q(x)), cos, sin))
        k = heads_first(self._rope_first_head(split(self.to_k(x)), cos, sin))
        v = heads_first(split(self.to_v(x)))
        out = block_window_attention(
            q, k, v, key_valid, self.block_size, self.look_backward_block, self.look_ahead_block
        )
        return self.to_out(heads_first(out).reshape(b, t, self.heads * self.head_dim))


class DiTMLP(nnx.Module):
    """Linear -> tanh-approximate GELU -> Linear (the reference's ``nn.GELU(approximate="tanh")``)."""

    def __init__(self, dim: int, mult: float, *, rngs: nnx.Rngs):
        inner = int(dim * mult)
        self.ff_in = nnx.Linear(dim, inner, rngs=rngs)
        self.ff_out = nnx.Linear(inner, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.ff_out(jax.nn.gelu(self.ff_in(x), approximate=True))


class DiTDecoderLayer(nnx.Module):
    """AdaLN-Zero DiT block with block-local attention."""

    def __init__(self, config: Any, look_ahead_block: int, look_backward_block: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.Linear(config.hidden_size, config.hidden_size * 6, rngs=rngs)
        self.attn = DiTAttention(config, look_backward_block, look_ahead_block, rngs=rngs)
        self.ff = DiTMLP(config.hidden_size, config.ff_mult, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        t_emb: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        key_valid: jax.Array,
    ) -> jax.Array:
        mod = self.attn_norm(jax.nn.silu(t_emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
        x = x + gate_msa[:, None] * self.attn(modulate(x, scale_msa, shift_msa), rope, key_valid)
        return x + gate_mlp[:, None] * self.ff(modulate(x, scale_mlp, shift_mlp))


class DiT(nnx.Module):
    """Flow-matching velocity model: ``(x_t, conditioning, t) -> v`` over mel frames.

    Conditioning (speaker encoder, codec embedding, speaker vector) does not depend on ``x_t`` or
    ``t``, so :meth:`conditioning` computes it once per solve and :meth:`__call__` only runs the
    per-step part. ``__call__(x, conditioning(...), t, lengths)`` equals the reference's forward.
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        self.mel_dim = config.mel_dim
        self.repeats = config.repeats
        # The reference refuses mels longer than this; callers validate against it.
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq, scaling = rope_inv_freq(
            dict(config.rope_parameters), config.head_dim, config.max_position_embeddings
        )
        # Hashable trace-time constants (the graphdef is a jit static argument), not variables.
        self.rope_inv_freq = tuple(float(f) for f in inv_freq)
        self.rope_scaling = float(scaling)
        self.time_embed = TimestepEmbedding(config.hidden_size, rngs=rngs)
        self.codec_embed = nnx.Embed(config.num_embeds + 1, config.emb_dim, rngs=rngs)
        self.spk_encoder = EcapaTimeDelayNet(config, rngs=rngs)
        in_dim = config.mel_dim + config.enc_dim + config.enc_emb_dim + config.emb_dim
        self.input_proj = nnx.Linear(in_dim, config.hidden_size, rngs=rngs)
        self.transformer_blocks = nnx.List(
            [
                DiTDecoderLayer(
                    config,
                    look_ahead_block=1 if i in config.look_ahead_layers else 0,
                    look_backward_block=1 if i in config.look_backward_layers else 0,
                    rngs=rngs,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm_out = nnx.Linear(config.hidden_size, config.hidden_size * 2, rngs=rngs)
        self.proj_out = nnx.Linear(config.hidden_size, config.mel_dim, rngs=rngs)

    def conditioning(
        self,
        codes: jax.Array,
        reference_mel: jax.Array,
        reference_lengths: jax.Array,
        speaker_embedding: jax.Array,
    ) -> jax.Array:
        """Per-frame conditioning ``[B, T * repeats, hidden]``, already through the input projection.

        ``codes [B, T]`` int; ``reference_mel [B, R, mel_dim]`` padded, valid up to
        ``reference_lengths [B]`` (fed to the ECAPA speaker encoder); ``speaker_embedding
        [B, enc_emb_dim]`` (the speaker's ``cond`` vector), concatenated in the reference's order.
        The reference projects ``[x, conditioning]`` in one matmul at every evaluation; the
        conditioning's share of it (and the bias) is the same at every step, so it is done here.
        """
        frames = codes.shape[1] * self.repeats
        code_embed = jnp.repeat(self.codec_embed(codes), self.repeats, axis=1)
        speaker_code = self.spk_encoder(reference_mel, reference_lengths)
        per_frame = lambda v: jnp.broadcast_to(v[:, None], (v.shape[0], frames, v.shape[-1]))
        features = jnp.concatenate(
            [per_frame(speaker_code), code_embed, per_frame(speaker_embedding)], axis=-1
        )
        return features @ self.input_proj.kernel[self.mel_dim :] + self.input_proj.bias

    def rope(self, num_frames: int) -> tuple[jax.Array, jax.Array]:
        """``cos, sin`` ``[T, head_dim]`` for frames ``0..T-1`` in the half-split layout."""
        inv_freq = jnp.asarray(self.rope_inv_freq, jnp.float32)
        return rope_cos_sin(jnp.arange(num_frames), inv_freq, self.rope_scaling, jnp.float32)

    def __call__(self, x: jax.Array, conditioning: jax.Array, t: jax.Array, lengths: jax.Array) -> jax.Array:
        """Velocity ``[B, T, mel_dim]`` for ``x [B, T, mel_dim]`` at times ``t [B]``.

        ``lengths [B]`` are valid mel frames; padded frames are masked as attention keys and
        their outputs are meaningless.
        """
        num_frames = x.shape[1]
        t_emb = self.time_embed(t)
        h = x @ self.input_proj.kernel[: self.mel_dim] + conditioning
        rope = self.rope(num_frames)
        key_valid = jnp.arange(num_frames)[None, :] < lengths[:, None]
        for layer in self.transformer_blocks:
            h = layer(h, t_emb, rope, key_valid)
        scale, shift = jnp.split(self.norm_out(jax.nn.silu(t_emb)), 2, axis=-1)
        return self.proj_out(modulate(h, scale, shift))


_ECAPA = r"input_embed\.spk_encoder\."
_BLOCK = r"transformer_blocks\.(\d+)\."

DIT_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"time_embed\.time_mlp\.0\.weight", "time_embed.linear_1.kernel", linear_kernel),
    ParamRule(r"time_embed\.time_mlp\.0\.bias", "time_embed.linear_1.bias"),
    ParamRule(r"time_embed\.time_mlp\.2\.weight", "time_embed.linear_2.kernel", linear_kernel),
    ParamRule(r"time_embed\.time_mlp\.2\.bias", "time_embed.linear_2.bias"),
    ParamRule(r"text_embed\.codec_embed\.weight", "codec_embed.embedding"),
    ParamRule(r"input_embed\.proj\.weight", "input_proj.kernel", linear_kernel),
    ParamRule(r"input_embed\.proj\.bias", "input_proj.bias"),
    # The speaker encoder mirrors the reference's module tree; every parameter is a Conv1d.
    ParamRule(_ECAPA + r"(.+)\.weight", r"spk_encoder.\1.kernel", conv1d_kernel),
    ParamRule(_ECAPA + r"(.+)\.bias", r"spk_encoder.\1.bias"),
    ParamRule(
        _BLOCK + r"attn_norm\.linear\.weight", r"transformer_blocks.\1.attn_norm.kernel", linear_kernel
    ),
    ParamRule(_BLOCK + r"attn_norm\.linear\.bias", r"transformer_blocks.\1.attn_norm.bias"),
    ParamRule(
        _BLOCK + r"attn\.(to_q|to_k|to_v)\.weight", r"transformer_blocks.\1.attn.\2.kernel", linear_kernel
    ),
    ParamRule(_BLOCK + r"attn\.(to_q|to_k|to_v)\.bias", r"transformer_blocks.\1.attn.\2.bias"),
    ParamRule(
        _BLOCK + r"attn\.to_out\.0\.weight", r"transformer_blocks.\1.attn.to_out.kernel", linear_kernel
    ),
    ParamRule(_BLOCK + r"attn\.to_out\.0\.bias", r"transformer_blocks.\1.attn.to_out.bias"),
    ParamRule(_BLOCK + r"ff\.ff\.0\.weight", r"transformer_blocks.\1.ff.ff_in.kernel", linear_kernel),
    ParamRule(_BLOCK + r"ff\.ff\.0\.bias", r"transformer_blocks.\1.ff.ff_in.bias"),
    ParamRule(_BLOCK + r"ff\.ff\.3\.weight", r"transformer_blocks.\1.ff.ff_out.kernel", linear_kernel),
    ParamRule(_BLOCK + r"ff\.ff\.3\.bias", r"transformer_blocks.\1.ff.ff_out.bias"),
    ParamRule(r"norm_out\.linear\.weight", "norm_out.kernel", linear_kernel),
    ParamRule(r"norm_out\.linear\.bias", "norm_out.bias"),
    ParamRule(r"proj_out\.weight", "proj_out.kernel", linear_kernel),
    ParamRule(r"proj_out\.bias", "proj_out.bias"),
)
"""HF names relative to ``Qwen2_5OmniToken2WavDiTModel`` -> paths in :class:`DiT`."""

DIT_IGNORE: tuple[str, ...] = (r"rotary_embed\.(original_)?inv_freq",)
"""Buffers a checkpoint may carry that :class:`DiT` recomputes."""


def dit_partition_rules(config: Any, model: int) -> tuple[ShardRule, ...]:
    """Tensor-parallel layout of the DiT's blocks over ``model`` (``config``: its ``DiTConfig``).

    Megatron-style per block: q/k/v and the feed-forward's input split their output columns
    (whole heads per device), the attention output and the feed-forward's output split their
    input rows, so each block needs one all-reduce after attention and one after the
    feed-forward. The AdaLN modulation (``attn_norm``, ``hidden x 6 hidden``: the largest weight
    of a block, applied to one time vector per row) splits its columns. The speaker encoder,
    embeddings and projections are small and stay whole. ``ValueError`` when ``model`` does not
    divide the heads.
    """
    if config.num_attention_heads % model:
        heads = config.num_attention_heads
        raise ValueError(f"model={model} does not divide the DiT's {heads} attention heads{splits(heads)}")
    col, row = (None, "model"), ("model", None)
    block = r"dit\.transformer_blocks\.\d+\."
    return (
        ShardRule(block + r"attn\.to_[qkv]\.kernel", col),
        ShardRule(block + r"attn\.to_[qkv]\.bias", ("model",)),
        ShardRule(block + r"attn\.to_out\.kernel", row),
        ShardRule(block + r"ff\.ff_in\.kernel", col),
        ShardRule(block + r"ff\.ff_in\.bias", ("model",)),
        ShardRule(block + r"ff\.ff_out\.kernel", row),
        ShardRule(block + r"attn_norm\.kernel", col),
        ShardRule(block + r"attn_norm\.bias", ("model",)),
    )
