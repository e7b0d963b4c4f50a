"""XLA's own time for the dense products of a Qwen2.5-Omni code2wav solve, and nothing else.

The code2wav suite's floor prices every FLOP of a solve at the measured square-matmul ceiling
(:func:`benchmarks.roofline.matmul_flops`). The DiT's products of a few hundred rows and the
vocoder's convolutions may run below that ceiling in any engine built on XLA's kernels, so the
floor alone cannot say whether a target is out of reach for such an engine. This times those products
at one request's shapes, as the ``ar`` suite times a decode step's weight matmuls alone
(:func:`benchmarks.roofline.decoder_matmuls_s`):

- the DiT: every weight matmul of one evaluation of the CFG pair (the input projection of the
  noisy mel, each block's q, k, v, output and feed-forward products, the output projection),
  chained, times the solve's evaluations (4 RK4 stages per step);
- the vocoder: every convolution, chained at its own shapes (the input and output convolutions,
  the transposed upsamplings, each AMP block's dilated and plain convolutions).

Left out, so the sum is what an engine running XLA's kernels at these shapes would take with
nothing else to do: block-local attention (under 1% of the DiT's FLOPs at Qwen2.5-Omni-7B's
widths), the AdaLN modulation and timestep MLP (one row each), the speaker encoder and codec
embedding (once per solve), the vocoder's anti-aliasing filters and SnakeBeta activations,
normalisation, masking and the RK4 updates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.roofline import best_of, decoder_matmuls_s

RK4_STAGES = 4
CFG_ROWS = 2
"""Rows per request in a guided DiT evaluation: the conditional input and the null one."""


@dataclasses.dataclass(frozen=True)
class OpsAlone:
    """Seconds of one request's solve products alone in XLA: the DiT's over the whole ODE solve,
    the vocoder's over its waveform."""

    dit_s: float
    vocoder_s: float

    @property
    def solve_s(self) -> float:
        return self.dit_s + self.vocoder_s


def dit_matmul_shapes(cfg: Any) -> tuple[tuple[int, int], ...]:
    """``(in, out)`` of each per-frame weight matmul of one DiT evaluation, in order."""
    h, inner, ff = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, int(cfg.hidden_size * cfg.ff_mult)
    block = ((h, inner), (h, inner), (h, inner), (inner, h), (h, ff), (ff, h))
    return ((cfg.mel_dim, h), *block * cfg.num_hidden_layers, (h, cfg.mel_dim))


@dataclasses.dataclass(frozen=True)
class ConvChain:
    """BigVGAN's convolutions, each with its own kernel, in order: ``steps`` holds each one's
    kind (``conv`` or transposed ``up``), dilation or stride, and left and right padding."""

    kernels: tuple[jax.Array, ...]
    steps: tuple[tuple[str, int, int, int], ...]

    def __call__(self, x: jax.Array, kernels: tuple[jax.Array, ...]) -> jax.Array:
        """Each convolution of ``x [B, T, C]`` (channels-last) in turn, its input the previous
        output cut or zero-padded to its channels."""
        dims = ("NWC", "WIO", "NWC")
        for w, (kind, step, left, right) in zip(kernels, self.steps, strict=True):
            missing = w.shape[1] - x.shape[-1]
            x = jnp.pad(x, ((0, 0), (0, 0), (0, missing))) if missing > 0 else x[..., : w.shape[1]]
            if kind == "up":
                x = jax.lax.conv_transpose(x, w, (step,), [(left, right)], dimension_numbers=dims)
            else:
                x = jax.lax.conv_general_dilated(
                    x, w, (1,), [(left, right)], rhs_dilation=(step,), dimension_numbers=dims
                )
        return x


def vocoder_convs(cfg: Any, dtype: str) -> ConvChain:
    """The convolutions of :class:`omni_jax.models.qwen2_5_omni.bigvgan.BigVGAN` for ``cfg`` (its
    ``BigVGANConfig``), at its shapes and paddings, with random kernels."""
    key = jax.random.PRNGKey(0)
    kernels: list[jax.Array] = []
    steps: list[tuple[str, int, int, int]] = []

    def add(kind: str, size: int, c_in: int, c_out: int, step: int, pad: int) -> None:
        shape = (size, c_in, c_out)
        kernels.append(
            jax.random.normal(jax.random.fold_in(key, len(kernels)), shape, jnp.dtype(dtype)) * 0.02
        )
        steps.append((kind, step, pad, pad))

    channels = cfg.upsample_initial_channel
    add("conv", 7, cfg.mel_dim, channels, 1, 3)
    for rate, size in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True):
        add("up", size, channels, channels // 2, rate, size - 1 - (size - rate) // 2)
        channels //= 2
        for kernel, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True):
            for d in dilations:
                add("conv", kernel, channels, channels, d, (kernel * d - d) // 2)
                add("conv", kernel, channels, channels, 1, (kernel - 1) // 2)
    add("conv", 7, channels, 1, 1, 3)
    return ConvChain(tuple(kernels), tuple(steps))


def vocoder_convs_s(cfg: Any, mel_frames: int, dtype: str, repeats: int) -> float:
    """Seconds of :func:`vocoder_convs` over ``mel_frames`` frames of one request."""
    chain = vocoder_convs(cfg, dtype)
    mel = jnp.ones((1, mel_frames, cfg.mel_dim), jnp.dtype(dtype))
    run = jax.jit(chain.__call__)
    return best_of(lambda: run(mel, chain.kernels), repeats)


def ops_alone(
    dit_cfg: Any, bigvgan_cfg: Any, codes: int, num_steps: int, guided: bool, dtype: str, repeats: int
) -> OpsAlone:
    """One request of ``codes`` codes: its DiT weight matmuls over ``num_steps`` grid points
    (``num_steps - 1`` RK4 steps of the CFG pair when ``guided``) and its vocoder convolutions,
    each timed alone in XLA on the default device."""
    frames = codes * dit_cfg.repeats
    rows = frames * (CFG_ROWS if guided else 1)
    evaluation = decoder_matmuls_s(dit_matmul_shapes(dit_cfg), rows, dtype)
    return OpsAlone(
        dit_s=RK4_STAGES * (num_steps - 1) * evaluation,
        vocoder_s=vocoder_convs_s(bigvgan_cfg, frames, dtype, repeats),
    )
