"""Qwen2.5-Omni BigVGAN vocoder (mel -> 24 kHz waveform) as Flax NNX modules.

Channels-last (``[batch, time, channels]``). Every stage carries per-request valid lengths: the
anti-aliased activations replicate-pad at each request's own edge and every zero-padded
convolution sees zeros past it, so a request in a padded batch gets its unbatched waveform.

The reference is transformers' ``Qwen2_5OmniToken2WavBigVGANModel``; attribute names mirror it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models import dilated_conv
from omni_jax.models.formulation import formulation
from omni_jax.models.param_map import ParamRule, conv1d_kernel, conv_transpose1d_kernel

RESAMPLE_RATIO = 2
RESAMPLE_KERNEL = 12


@functools.cache
def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> np.ndarray:
    """Kaiser-windowed sinc low-pass taps ``[kernel_size]`` (float32), as the reference builds them.

    The reference keeps these as non-persistent buffers, so checkpoints do not carry them; they
    are recomputed here with the same formula (window in float64, rounded once to float32).
    """
    half_size = kernel_size // 2
    delta_f = 4 * half_width
    attenuation = 2.285 * (half_size - 1) * math.pi * delta_f + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel_size, beta).astype(np.float32)
    if kernel_size % 2 == 0:
        time = np.arange(-half_size, half_size, dtype=np.float32) + np.float32(0.5)
    else:
        time = np.arange(kernel_size, dtype=np.float32) - np.float32(half_size)
    if cutoff == 0:
        return np.zeros(kernel_size, np.float32)
    two_cutoff = np.float32(2 * cutoff)
    taps = two_cutoff * window * np.sinc(two_cutoff * time).astype(np.float32)
    return (taps / taps.sum(dtype=np.float32)).astype(np.float32)


def valid_mask(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Zero the frames of ``[B, T, C]`` past each request's length (what a lone request pads with)."""
    keep = jnp.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
    return jnp.where(keep, x, 0.0)


def pad_edges(
    x: jax.Array, lengths: jax.Array, left: int, right: int, first: jax.Array, last: jax.Array
) -> jax.Array:
    """Pad ``[B, T, C]`` with ``first [B, C]`` before frame 0 and ``last [B, C]`` from each length on."""
    padded = jnp.pad(x, ((0, 0), (left, right), (0, 0)))
    pos = jnp.arange(-left, x.shape[1] + right)[None, :, None]
    padded = jnp.where(pos < 0, first[:, None], padded)
    return jnp.where(pos >= lengths[:, None, None], last[:, None], padded)


def last_frame(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Each request's last valid frame of ``[B, T, C]``: ``[B, C]``.

    A one-hot product rather than a gather or a masked sum: XLA fuses a gather, and redoes it
    per element, into every tap of the filters that read the padded signal, and it runs the
    masked sum as a slow strided reduction whose result it broadcasts in memory; a dot is
    computed once. Exact: one product by 1, the rest by 0.
    """
    one_hot = (jnp.arange(x.shape[1])[None, :] == (lengths - 1)[:, None]).astype(x.dtype)
    return jnp.einsum("bt,btc->bc", one_hot, x, precision=jax.lax.Precision.HIGHEST)


def replicate_pad(x: jax.Array, lengths: jax.Array, left: int, right: int) -> jax.Array:
    """Pad ``[B, T, C]`` by repeating each request's own first and last valid frame."""
    return pad_edges(x, lengths, left, right, x[:, 0], last_frame(x, lengths))


def _correlate(x: jax.Array, taps: np.ndarray, start: int, length: int) -> jax.Array:
    """``sum_q taps[q] * x[:, start + q : start + q + length]``: a short FIR as shifted slices.

    Six taps on channels-last data: written as elementwise multiply-adds, XLA fuses the whole
    filter (and what feeds it) into one pass, where a depthwise (grouped) convolution runs as a
    slow generic loop on CPU.
    """
    out = None
    for q, w in enumerate(taps):
        term = jnp.float32(w) * x[:, start + q : start + q + length]
        out = term if out is None else out + term
    return out


def _resample_taps() -> np.ndarray:
    return kaiser_sinc_filter(0.5 / RESAMPLE_RATIO, 0.6 / RESAMPLE_RATIO, RESAMPLE_KERNEL)


def upsample(x: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """2x low-pass upsampling (reference ``Qwen2_5OmniUpSample1d``) as two phases ``[B, T, C]``.

    The reference zero-stuffs, filters with 12 taps and crops; output sample ``2p`` only meets
    the odd taps and ``2p + 1`` only the even ones, so each phase is a 6-tap filter of the
    (replicate-padded) input: ``even[p] = 2 sum_q f[2q+1] x[p+2-q]``,
    ``odd[p] = 2 sum_q f[2q] x[p+3-q]``. The interleaved ``[B, 2T, C]`` signal is never formed.
    """
    taps = RESAMPLE_RATIO * _resample_taps()  # the ratio gain is a power of two: exact either way
    padded = replicate_pad(x, lengths, 3, 3)
    num_frames = x.shape[1]
    even = _correlate(padded, taps[1::2][::-1], 0, num_frames)
    odd = _correlate(padded, taps[0::2][::-1], 1, num_frames)
    return even, odd


def downsample(
    even: jax.Array, odd: jax.Array, lengths: jax.Array, first: jax.Array, last: jax.Array
) -> jax.Array:
    """2x low-pass decimation (reference ``Qwen2_5OmniDownSample1d``) of the phases of a signal.

    ``even``/``odd`` ``[B, T, C]`` are samples ``2p``/``2p + 1`` of a signal valid up to
    ``2 * lengths``; ``first`` (``even[:, 0]``) and ``last`` (``odd`` at ``lengths - 1``),
    ``[B, C]``, are the edge samples the reference's replicate padding repeats. It pads by 5 / 6
    and keeps every second output of a 12-tap filter:
    ``out[n] = sum_q f[2q] odd[n+q-3] + sum_q f[2q+1] even[n+q-2]``.
    """
    taps = _resample_taps()
    num_frames = even.shape[1]
    odd_part = _correlate(pad_edges(odd, lengths, 3, 2, first, last), taps[0::2], 0, num_frames)
    even_part = _correlate(pad_edges(even, lengths, 2, 3, first, last), taps[1::2], 0, num_frames)
    return odd_part + even_part


_PI_HI = np.float32(3.140625)  # 8 significant bits: k * _PI_HI is exact for |k| < 2**16
_PI_MID = np.float32(math.pi - 3.140625)
_PI_LO = np.float32(math.pi - 3.140625 - float(_PI_MID))
_SIN_TAYLOR = tuple(np.float32((-1) ** n / math.factorial(2 * n + 1)) for n in range(6, 0, -1))


def sin_squared(u: jax.Array) -> jax.Array:
    """``sin(u) ** 2`` to about 2 float32 ulps, as plain multiply-adds that vectorise.

    XLA on CPU evaluates ``sin`` one element at a time, not vectorised, and the vocoder takes
    ~10^8 of them per second of audio. ``sin^2`` has period pi, so ``u`` is reduced to
    ``r`` in [-pi/2, pi/2] (pi split in three for an exact product) and ``sin r`` is its Taylor
    series to ``r^13``, whose truncation error at pi/2 is below one ulp.
    """
    k = jnp.round(u * np.float32(1 / math.pi))
    r = ((u - k * _PI_HI) - k * _PI_MID) - k * _PI_LO
    r2 = r * r
    poly = _SIN_TAYLOR[0]
    for c in _SIN_TAYLOR[1:]:
        poly = poly * r2 + c
    sin = r + r * r2 * poly
    return sin * sin


SIN_SWITCH = "OMNI_JAX_SNAKE_SIN"
"""Environment variable naming how SnakeBeta's ``sin^2`` is written, read when the vocoder is
traced: ``series``, ``native`` or ``auto`` (unset: ``auto``, :func:`sin_form`)."""


def sin_form() -> str:
    """How SnakeBeta's ``sin^2`` is written: ``OMNI_JAX_SNAKE_SIN`` when it names a form, else
    ``series`` (:func:`sin_squared`) on CPUs, whose XLA ``sin`` does not vectorise, and
    ``native`` (``jnp.sin``) elsewhere: the series is 39% of the vocoder program's operations
    (17,888 of 45,863 at Qwen2.5-Omni-7B's widths), which every program's lowering and compilation
    pays, and a GPU's ``sin`` is one vectorised instruction. ``ValueError`` on another value."""
    default = "series" if jax.default_backend() == "cpu" else "native"
    return formulation(SIN_SWITCH, ("series", "native"), default)


def snake_sin_squared(u: jax.Array) -> jax.Array:
    """``sin(u) ** 2`` in the form :func:`sin_form` picks."""
    return sin_squared(u) if sin_form() == "series" else jnp.square(jnp.sin(u))


class SnakeBeta(nnx.Module):
    """``x + 1/exp(beta) * sin^2(x * exp(alpha))`` with per-channel log-scale alpha, beta."""

    def __init__(self, channels: int):
        self.alpha = nnx.Param(jnp.zeros((channels,), jnp.float32))
        self.beta = nnx.Param(jnp.zeros((channels,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        alpha = jnp.exp(self.alpha[...])
        beta = jnp.exp(self.beta[...])
        return x + (1.0 / (beta + 1e-9)) * snake_sin_squared(x * alpha)


class AntiAliasedActivation(nnx.Module):
    """SnakeBeta at twice the rate (upsample, act, downsample); output zeroed past each length."""

    def __init__(self, channels: int):
        self.act = SnakeBeta(channels)

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        even, odd = upsample(x, lengths)
        # The edges are activated on their own: read off the activated phases, they would make
        # XLA fuse (and so recompute) the whole activation into the edge lookup.
        first, last = self.act(even[:, 0]), self.act(last_frame(odd, lengths))
        y = downsample(self.act(even), self.act(odd), lengths, first, last)
        return valid_mask(y, lengths)


def _same_conv(channels: int, kernel_size: int, dilation: int, rngs: nnx.Rngs) -> nnx.Conv:
    pad = (kernel_size * dilation - dilation) // 2
    return nnx.Conv(
        channels,
        channels,
        kernel_size,
        padding=((pad, pad),),
        kernel_dilation=dilation,
        conv_general_dilated=dilated_conv.conv_general_dilated,
        rngs=rngs,
    )


class AMPBlock(nnx.Module):
    """Three (act, dilated conv, act, conv) residual units."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], *, rngs: nnx.Rngs):
        self.convs1 = nnx.List([_same_conv(channels, kernel_size, d, rngs) for d in dilations])
        self.convs2 = nnx.List([_same_conv(channels, kernel_size, 1, rngs) for _ in dilations])
        self.activations = nnx.List([AntiAliasedActivation(channels) for _ in range(2 * len(dilations))])

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            h = conv1(self.activations[2 * i](x, lengths))
            h = conv2(self.activations[2 * i + 1](h, lengths))
            x = x + h
        return x


def process_mel(mel: jax.Array) -> jax.Array:
    """Log-mel -> dB -> [-1, 1], the vocoder's input normalisation (reference op order)."""
    min_level = jnp.exp(jnp.asarray(-115 / 20.0 * np.log(10), mel.dtype))
    db = 20 * jnp.log10(jnp.maximum(jnp.exp(mel), min_level)) - 20
    return jnp.clip(2 * ((db - (-115)) / 115) - 1, -1, 1)


def _transposed_length(length: jax.Array, stride: int, kernel: int, pad: int) -> jax.Array:
    """Output length of torch ``ConvTranspose1d(stride, kernel, padding=pad)``."""
    return (length - 1) * stride - 2 * pad + kernel


class BigVGAN(nnx.Module):
    """Mel ``[B, T, mel_dim]`` -> waveform ``[B, T * prod(upsample_rates)]`` in [-1, 1]."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        rates = list(config.upsample_rates)
        kernels = list(config.upsample_kernel_sizes)
        ch0 = config.upsample_initial_channel
        resblocks, dilations = (
            list(config.resblock_kernel_sizes),
            [list(d) for d in config.resblock_dilation_sizes],
        )
        if len(dilations) != len(resblocks) or any(len(d) != 3 for d in dilations):
            raise ValueError(  # transformers' AMP blocks read three dilations each, zipped with the kernels
                f"BigVGAN takes one list of 3 dilations per resblock kernel size, got resblock_kernel_sizes="
                f"{resblocks} and resblock_dilation_sizes={dilations}"
            )
        self.upsample_geometry = tuple((s, k, (k - s) // 2) for s, k in zip(rates, kernels, strict=True))
        self.num_kernels = len(config.resblock_kernel_sizes)
        self.conv_pre = nnx.Conv(config.mel_dim, ch0, 7, padding=((3, 3),), rngs=rngs)
        self.ups = nnx.List(
            [
                nnx.ConvTranspose(
                    ch0 // 2**i, ch0 // 2 ** (i + 1), k, s, padding=((k - 1 - p, k - 1 - p),), rngs=rngs
                )
                for i, (s, k, p) in enumerate(self.upsample_geometry)
            ]
        )
        self.resblocks = nnx.List(
            [
                AMPBlock(ch0 // 2 ** (i + 1), k, tuple(d), rngs=rngs)
                for i in range(len(rates))
                for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True)
            ]
        )
        out_ch = ch0 // 2 ** len(rates)
        self.activation_post = AntiAliasedActivation(out_ch)
        self.conv_post = nnx.Conv(out_ch, 1, 7, padding=((3, 3),), use_bias=False, rngs=rngs)

    def output_lengths(self, frames: jax.Array) -> jax.Array:
        """Waveform samples produced from ``frames`` mel frames (works on ints and arrays)."""
        for geometry in self.upsample_geometry:
            frames = _transposed_length(frames, *geometry)
        return frames

    def stage_blocks(self, stage: int) -> list[AMPBlock]:
        """The AMP blocks that follow upsampling stage ``stage`` (one a resblock kernel size; the
        forward averages their outputs)."""
        return list(self.resblocks[stage * self.num_kernels : (stage + 1) * self.num_kernels])

    def __call__(self, mel: jax.Array, lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(waveform [B, S], valid samples [B])``; samples past a request's count are zero.

        ``lengths [B]`` are valid mel frames (default: all ``T``).
        """
        if lengths is None:
            lengths = jnp.full((mel.shape[0],), mel.shape[1], jnp.int32)
        x = self.conv_pre(valid_mask(process_mel(mel), lengths))
        for i, (up, geometry) in enumerate(zip(self.ups, self.upsample_geometry, strict=True)):
            x = up(valid_mask(x, lengths))
            lengths = _transposed_length(lengths, *geometry)
            x = sum(block(x, lengths) for block in self.stage_blocks(i)) / self.num_kernels
        x = self.conv_post(self.activation_post(x, lengths))
        wave = valid_mask(jnp.clip(x, -1.0, 1.0), lengths)[..., 0]
        return wave, lengths


BIGVGAN_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"(conv_pre|conv_post)\.weight", r"\1.kernel", conv1d_kernel),
    ParamRule(r"conv_pre\.bias", "conv_pre.bias"),
    ParamRule(r"ups\.(\d+)\.0\.weight", r"ups.\1.kernel", conv_transpose1d_kernel),
    ParamRule(r"ups\.(\d+)\.0\.bias", r"ups.\1.bias"),
    ParamRule(r"resblocks\.(\d+)\.(convs[12])\.(\d+)\.weight", r"resblocks.\1.\2.\3.kernel", conv1d_kernel),
    ParamRule(r"resblocks\.(\d+)\.(convs[12])\.(\d+)\.bias", r"resblocks.\1.\2.\3.bias"),
    ParamRule(r"(resblocks\.\d+\.activations\.\d+|activation_post)\.act\.(alpha|beta)", r"\1.act.\2"),
)
"""HF names relative to ``Qwen2_5OmniToken2WavBigVGANModel`` -> paths in :class:`BigVGAN`."""

BIGVGAN_IGNORE: tuple[str, ...] = (r".*\.(upsample|downsample)(\.lowpass)?\.filter",)
"""Resampling-filter buffers some checkpoints carry; :func:`kaiser_sinc_filter` recomputes them."""
