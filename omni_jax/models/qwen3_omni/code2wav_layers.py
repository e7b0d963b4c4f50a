"""Building blocks of Qwen3-Omni's code2wav: its sliding-window transformer and its causal ConvNet.

Channels-last (``[batch, time, channels]``). Every block is causal or per-frame: a frame's output
reads its own and earlier inputs only (the transposed convolutions read one frame ahead, but only
for outputs that the shorter input still produces in full), so frames appended on the right never
change the outputs of the frames before them. That is what lets a batch right-pad its rows.

The reference is transformers' ``modeling_qwen3_omni_moe.py`` (``Qwen3OmniMoeCausalConvNet`` to
``Qwen3OmniMoeCode2WavDecoderBlock``); attribute names mirror it, so the parameter map stays short.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models import dilated_conv
from omni_jax.models.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin, rope_inv_freq
from omni_jax.models.qwen2 import GQAProjections
from omni_jax.models.qwen2_5_omni.audio_encoder import torch_layer_norm
from omni_jax.models.qwen2_5_omni.bigvgan import SnakeBeta


@dataclasses.dataclass(frozen=True)
class Code2WavSpec:
    """The fields of ``Qwen3OmniMoeCode2WavConfig`` the model needs, hashable for jit."""

    codebook_size: int
    num_quantizers: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    rms_norm_eps: float
    attention_bias: bool
    rope_parameters: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int

    @classmethod
    def from_hf(cls, cfg: Any) -> Code2WavSpec:
        """From a ``Qwen3OmniMoeCode2WavConfig`` (the ``code2wav_config`` of a Qwen3-Omni checkpoint)."""
        if cfg.hidden_act != "silu":
            raise ValueError(f"code2wav supports hidden_act 'silu', not {cfg.hidden_act!r}")
        if any(t != "sliding_attention" for t in cfg.layer_types):
            raise ValueError(f"code2wav supports sliding-attention layers only, not {cfg.layer_types}")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = cfg.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        rope_inv_freq(rope, head_dim, cfg.max_position_embeddings)  # refuses a rotary it cannot compute
        return cls(
            codebook_size=cfg.codebook_size,
            num_quantizers=cfg.num_quantizers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            sliding_window=cfg.sliding_window,
            rms_norm_eps=cfg.rms_norm_eps,
            attention_bias=bool(cfg.attention_bias),
            rope_parameters=tuple(sorted(dict(rope).items())),
            max_position_embeddings=cfg.max_position_embeddings,
            upsampling_ratios=tuple(cfg.upsampling_ratios),
            upsample_rates=tuple(cfg.upsample_rates),
            decoder_dim=cfg.decoder_dim,
        )

    @property
    def total_upsample(self) -> int:
        """Waveform samples per code frame, the hop ``chunked_decode`` trims its left context by."""
        return math.prod(self.upsampling_ratios + self.upsample_rates)

    @property
    def sample_shortfall(self) -> int:
        """How many samples short of ``frames * total_upsample`` a decode comes out.

        Each trimmed transposed convolution turns ``L`` frames into ``L * s + s - k``; the
        decoder blocks' (``k = 2 s``) lose ``s`` at their rate, so ``frames`` frames give
        ``frames * total_upsample - sample_shortfall`` samples (transformers' own lengths, also
        per ``chunked_decode`` chunk, which trims whole frames of context only).
        """
        samples = 0
        for rate in self.upsampling_ratios:
            samples = samples * rate
        for rate in self.upsample_rates:
            samples = samples * rate - rate
        return -samples


def sliding_window_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None) -> jax.Array:
    """Causal attention of ``q [B, T, heads, D]`` over ``k, v [B, T, kv_heads, D]``: query ``t``
    reads keys ``(t - window, t]`` (all of ``[0, t]`` when ``window`` is None).

    The reference's ``create_sliding_window_causal_mask`` (``kv > q - window`` and ``kv <= q``):
    the transformer is causal, so right padding never reaches a real frame. Scores and softmax
    in float32, as its eager attention; the mask is built from iotas, so any length works.
    """
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)


class Code2WavAttention(GQAProjections):
    """``Qwen3OmniMoeCode2WavAttention``: GQA with rotary positions over a sliding window."""

    def __init__(self, spec: Code2WavSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(spec, o_bias=spec.attention_bias, dtype=dtype, rngs=rngs)
        self.sliding_window = spec.sliding_window

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(sliding_window_attention(q, k, v, self.sliding_window).reshape(b, t, -1))


class Code2WavTransformerLayer(nnx.Module):
    """Pre-norm attention and SwiGLU blocks, each residual branch scaled per channel (LayerScale)."""

    def __init__(self, spec: Code2WavSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        self.input_layernorm = RMSNorm(d, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = Code2WavAttention(spec, dtype=dtype, rngs=rngs)
        self.self_attn_layer_scale = nnx.Param(jnp.ones((d,), dtype))
        self.post_attention_layernorm = RMSNorm(d, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(d, spec.intermediate_size, dtype=dtype, rngs=rngs)
        self.mlp_layer_scale = nnx.Param(jnp.ones((d,), dtype))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.self_attn_layer_scale[...] * self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp_layer_scale[...] * self.mlp(self.post_attention_layernorm(x))


class Code2WavTransformer(nnx.Module):
    """``Qwen3OmniMoeCode2WavTransformerModel`` on embeddings: positions ``0..T-1`` per row."""

    def __init__(self, spec: Code2WavSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.spec = spec
        self.layers = nnx.List(
            [Code2WavTransformerLayer(spec, dtype=dtype, rngs=rngs) for _ in range(spec.num_layers)]
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        spec = self.spec
        # A trace-time numpy constant, not a variable: checkpoints do not carry it.
        inv_freq, scaling = rope_inv_freq(
            dict(spec.rope_parameters), spec.head_dim, spec.max_position_embeddings
        )
        cos, sin = rope_cos_sin(jnp.arange(x.shape[1])[None], inv_freq, scaling, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class CausalConv(nnx.Module):
    """``Qwen3OmniMoeCausalConvNet`` at stride 1 (the only stride the model uses): zeros on the
    left, ``(kernel - 1) * dilation`` of them, and none on the right, so ``T`` frames give ``T``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        dilation: int = 1,
        groups: int = 1,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.conv = nnx.Conv(
            in_channels,
            out_channels,
            kernel_size,
            padding=(((kernel_size - 1) * dilation, 0),),
            kernel_dilation=dilation,
            feature_group_count=groups,
            conv_general_dilated=dilated_conv.conv_general_dilated,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class CausalTransConv(nnx.Module):
    """``Qwen3OmniMoeCausalTransConvNet``: a transposed convolution with ``kernel - stride``
    outputs cut from each end, i.e. torch's ``ConvTranspose1d(padding=kernel - stride)``.

    ``L`` frames give ``L * stride + stride - kernel``; output ``n`` reads inputs
    ``n // stride`` and, when ``kernel > stride``, the next one, which a row of ``L`` real
    frames has for every output it produces.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        edge = stride - 1  # (kernel - 1) - (kernel - stride): lax's padding for torch's crop
        self.conv = nnx.ConvTranspose(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding=((edge, edge),),
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class ConvNeXtBlock(nnx.Module):
    """``Qwen3OmniMoeConvNeXtBlock``: causal depthwise conv (7 taps), LayerNorm, 4x MLP with exact
    GELU, per-channel ``gamma``, residual."""

    def __init__(self, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.dwconv = CausalConv(dim, dim, 7, groups=dim, dtype=dtype, rngs=rngs)
        self.norm = torch_layer_norm(dim, dtype, rngs, eps=1e-6)
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.pwconv1 = nnx.Linear(dim, 4 * dim, **kw)
        self.pwconv2 = nnx.Linear(4 * dim, dim, **kw)
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.gelu(self.pwconv1(self.norm(self.dwconv(x))), approximate=False)
        return x + self.gamma[...] * self.pwconv2(h)


class DecoderResidualUnit(nnx.Module):
    """SnakeBeta, dilated causal conv (7 taps), SnakeBeta, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation, dtype=dtype, rngs=rngs)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nnx.Module):
    """``Qwen3OmniMoeCode2WavDecoderBlock``: SnakeBeta, ``rate``-fold transposed conv halving the
    channels, then residual units at dilations 1, 3, 9 (``block`` keeps the reference's order)."""

    def __init__(self, in_dim: int, rate: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        out_dim = in_dim // 2
        kw: dict[str, Any] = dict(dtype=dtype, rngs=rngs)
        self.block = nnx.List(
            [SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate, **kw)]
            + [DecoderResidualUnit(out_dim, d, **kw) for d in (1, 3, 9)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.block:
            x = layer(x)
        return x
