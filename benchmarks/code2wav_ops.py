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
from flax import nnx

from benchmarks.roofline import best_of, decoder_matmuls_s
from omni_jax.models.qwen2_5_omni.bigvgan import BigVGAN

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
    """BigVGAN's convolutions, in the order its forward runs them (each stage's transposed
    upsampling, then each AMP block's dilated and plain convolutions), as ``nnx.split`` parts:
    each one's output has the next one's input channels, so they chain as they are."""

    graph: nnx.GraphDef
    state: nnx.State

    @property
    def kernels(self) -> tuple[jax.Array, ...]:
        return tuple(conv.kernel[...] for conv in nnx.merge(self.graph, self.state))

    def __call__(self, x: jax.Array, state: nnx.State) -> jax.Array:
        """Each convolution of ``x [B, T, C]`` (channels-last) in turn, biases included."""
        for conv in nnx.merge(self.graph, state):
            x = conv(x)
        return x


def vocoder_convs(cfg: Any, dtype: str) -> ConvChain:
    """The convolutions of :class:`omni_jax.models.qwen2_5_omni.bigvgan.BigVGAN` for ``cfg`` (its
    ``BigVGANConfig``), taken from a randomly initialised one (its shapes, paddings, dilations
    and strides), cast to ``dtype``."""
    model = BigVGAN(cfg, rngs=nnx.Rngs(0))
    convs: list[nnx.Module] = [model.conv_pre]
    for i, up in enumerate(model.ups):
        convs.append(up)
        for block in model.stage_blocks(i):
            for dilated, plain in zip(block.convs1, block.convs2, strict=True):
                convs += [dilated, plain]
    convs.append(model.conv_post)
    graph, state = nnx.split(nnx.List(convs))
    return ConvChain(graph, jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), state))


def vocoder_convs_s(cfg: Any, mel_frames: int, dtype: str, repeats: int) -> float:
    """Seconds of :func:`vocoder_convs` over ``mel_frames`` frames of one request."""
    chain = vocoder_convs(cfg, dtype)
    mel = jnp.ones((1, mel_frames, cfg.mel_dim), jnp.dtype(dtype))
    run = jax.jit(chain.__call__)
    return best_of(lambda: run(mel, chain.state), repeats)


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
