"""Qwen3-Omni code2wav: codec codes ``[B, num_quantizers, T]`` -> 24 kHz waveform, whole or chunked.

The codebook embeddings of a frame are averaged, a causal sliding-window transformer mixes the
frames, two transposed-conv + ConvNeXt stages upsample them, and a SnakeBeta ConvNet decoder turns
them into samples clamped to [-1, 1]. Every stage is causal (see ``code2wav_layers``), so a batch
right-pads its rows: a row's samples are the ones it gets alone, whatever the other rows or the
padding hold. Streaming decodes a window of ``context + new`` frames per row and keeps only the new
frames' samples, as transformers' ``chunked_decode``; rows of different requests and chunk kinds
share one program per ``(rows, window frames)`` shape.

The reference is transformers' ``Qwen3OmniMoeCode2Wav.forward`` and ``chunked_decode``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.jit import StaticGraph, compute_dtype, exact_matmuls
from omni_jax.models.param_map import ParamRule, conv1d_kernel, conv_transpose1d_kernel, linear_kernel
from omni_jax.models.qwen2_5_omni.bigvgan import SnakeBeta
from omni_jax.models.qwen3_omni.code2wav_layers import (
    CausalConv,
    CausalTransConv,
    Code2WavSpec,
    Code2WavTransformer,
    ConvNeXtBlock,
    DecoderBlock,
)

DEFAULT_CHUNK_FRAMES = 300
"""``chunked_decode``'s default ``chunk_size``: new code frames per chunk."""

DEFAULT_LEFT_CONTEXT = 25
"""``chunked_decode``'s default ``left_context_size``: earlier frames decoded again before a chunk."""


class Code2Wav(nnx.Module):
    """``Qwen3OmniMoeCode2Wav`` (attribute names mirror it, ``upsample`` and ``decoder`` included)."""

    def __init__(self, spec: Code2WavSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        d = spec.hidden_size
        kw = dict(dtype=dtype, rngs=rngs)
        self.spec = spec
        self.code_embedding = nnx.Embed(
            spec.codebook_size * spec.num_quantizers, d, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.pre_transformer = Code2WavTransformer(spec, **kw)
        self.upsample = nnx.List(
            [
                nnx.List([CausalTransConv(d, d, f, f, **kw), ConvNeXtBlock(d, **kw)])
                for f in spec.upsampling_ratios
            ]
        )
        rates = spec.upsample_rates
        out_dim = spec.decoder_dim // 2 ** len(rates)
        self.decoder = nnx.List(
            [CausalConv(d, spec.decoder_dim, 7, **kw)]
            + [DecoderBlock(spec.decoder_dim // 2**i, r, **kw) for i, r in enumerate(rates)]
            + [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7, **kw)]
        )

    def output_samples(self, frames: jax.Array) -> jax.Array:
        """Samples that ``frames [B]`` code frames decode to (0 for an empty row)."""
        spec = self.spec
        return jnp.maximum(frames * spec.total_upsample - spec.sample_shortfall, 0)

    def __call__(self, codes: jax.Array, frames: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``codes [B, num_quantizers, T]`` valid up to ``frames [B]`` -> ``(waveform [B, S] float32,
        valid samples [B])``, ``S = T * total_upsample - sample_shortfall``; zero past each count.

        Codes past a row's frames are replaced by 0 before anything reads them, so whatever a
        caller pads with, every intermediate stays finite (attention multiplies the masked keys'
        values by an exact 0) and the program is a function of the valid codes alone.
        """
        return self.decode(self.upsampled(codes, frames), frames)

    def upsampled(self, codes: jax.Array, frames: jax.Array) -> jax.Array:
        """The first half of :meth:`__call__`: embeddings, transformer and upsampling, ``[B, T *
        prod(upsampling_ratios), hidden]``, the ConvNet decoder's input. Apart from
        :meth:`decode` so that each half can be compiled alone (``benchmarks.compile_time``)."""
        spec = self.spec
        num_frames = codes.shape[2]
        valid = jnp.arange(num_frames)[None, None, :] < frames[:, None, None]
        offsets = jnp.arange(spec.num_quantizers)[None, :, None] * spec.codebook_size
        x = self.code_embedding(jnp.where(valid, codes, 0) + offsets).mean(axis=1)
        x = self.pre_transformer(x)
        for stage in self.upsample:
            for layer in stage:
                x = layer(x)
        return x

    def decode(self, x: jax.Array, frames: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The second half of :meth:`__call__`: the ConvNet decoder on :meth:`upsampled`'s output
        of rows of ``frames [B]`` code frames, as :meth:`__call__` returns it."""
        for layer in self.decoder:
            x = layer(x)
        samples = self.output_samples(frames)
        keep = jnp.arange(x.shape[1])[None, :] < samples[:, None]
        wave = jnp.where(keep, jnp.clip(x[..., 0], -1.0, 1.0), 0.0)
        return wave.astype(jnp.float32), samples


def decode_chunk(
    model: Code2Wav, codes: jax.Array, context: jax.Array, frames: jax.Array, join: bool
) -> tuple[jax.Array, jax.Array]:
    """One streamed chunk per row: ``(new samples [B, S] float32, their count [B])``.

    Row ``b`` of ``codes [B, num_quantizers, W]`` is a window of ``frames[b]`` code frames (right
    padded to ``W``) whose first ``context[b]`` were decoded by an earlier chunk; the row's
    waveform from sample ``context * total_upsample`` on is kept, moved to the row's start, and
    zeroed past its count, as transformers' ``chunked_decode`` keeps it (``join`` false). That
    earlier chunk, decoded without this window's frames, came out ``sample_shortfall`` samples
    short of its frames (:attr:`~omni_jax.models.qwen3_omni.code2wav_layers.Code2WavSpec.sample_shortfall`):
    ``chunked_decode`` skips them, a gap at every join. With ``join`` a row with context keeps them too,
    from ``context * total_upsample - sample_shortfall`` on (decoded here with the frames they
    needed), so consecutive chunks join without a gap and a request's chunks add up to its whole
    decode's length. ``S = W * total_upsample - sample_shortfall``, the most a row without
    context can keep. An empty row (``frames == context``, e.g. batch padding) keeps nothing.
    """
    wave, samples = model(codes, frames)
    spec = model.spec
    start = context * spec.total_upsample
    if join:
        start = jnp.where(context > 0, jnp.maximum(start - spec.sample_shortfall, 0), start)
    kept = jnp.maximum(samples - start, 0)
    j = jnp.arange(wave.shape[1])[None, :]
    index = jnp.minimum(j + start[:, None], wave.shape[1] - 1)
    moved = jnp.take_along_axis(wave, index, axis=1)
    return jnp.where(j < kept[:, None], moved, 0.0), kept


@functools.partial(jax.jit, static_argnums=0)
def code2wav_compiled(
    graph: StaticGraph, state: nnx.State, codes: jax.Array, frames: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:meth:`Code2Wav.__call__` (whole utterances) as one program over ``nnx.split(model)``;
    compiles once per ``codes`` shape."""
    with exact_matmuls(compute_dtype(state)):
        return nnx.merge(graph.graphdef, state)(codes, frames)


@functools.partial(jax.jit, static_argnums=0, static_argnames="join")
def code2wav_chunk_compiled(
    graph: StaticGraph,
    state: nnx.State,
    codes: jax.Array,
    context: jax.Array,
    frames: jax.Array,
    *,
    join: bool,
) -> tuple[jax.Array, jax.Array]:
    """:func:`decode_chunk` as one program over ``nnx.split(model)``; compiles once per
    ``(rows, window frames)`` and ``join`` (streamed chunks join, ``chunked_decode``'s do not):
    contexts and lengths are traced, so first, middle, last and padding rows share it."""
    with exact_matmuls(compute_dtype(state)):
        return decode_chunk(nnx.merge(graph.graphdef, state), codes, context, frames, join)


@dataclasses.dataclass(frozen=True)
class ChunkWindow:
    """One ``chunked_decode`` step: code frames ``[start - context, end)`` decoded, the samples of
    ``[start, end)`` kept."""

    start: int
    context: int
    end: int

    @property
    def frames(self) -> int:
        """Frames in the window, context included."""
        return self.context + self.end - self.start


def chunk_windows(
    num_frames: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES, left_context: int = DEFAULT_LEFT_CONTEXT
) -> list[ChunkWindow]:
    """The windows transformers' ``chunked_decode(codes, chunk_frames, left_context)`` decodes for
    ``num_frames`` codes: chunks of ``chunk_frames`` (the last may be shorter), each after as much
    of ``left_context`` as precedes it. Windows hold at most ``left_context + chunk_frames``."""
    if chunk_frames < 1 or left_context < 0:
        raise ValueError(f"need chunk_frames >= 1 and left_context >= 0, got {chunk_frames}, {left_context}")
    windows = []
    for start in range(0, num_frames, chunk_frames):
        windows.append(ChunkWindow(start, min(left_context, start), min(start + chunk_frames, num_frames)))
    return windows


def chunked_decode(
    graph: StaticGraph,
    state: nnx.State,
    codes: np.ndarray,
    chunk_frames: int = DEFAULT_CHUNK_FRAMES,
    left_context: int = DEFAULT_LEFT_CONTEXT,
) -> np.ndarray:
    """transformers' ``chunked_decode`` for ``codes [B, num_quantizers, T]`` (rows of equal
    length): ``[B, samples]`` float32, each chunk decoded by :func:`code2wav_chunk_compiled` in a
    window of ``left_context + chunk_frames`` frames (one program for every chunk)."""
    rows, _, num_frames = codes.shape
    width = left_context + chunk_frames
    pieces = []
    for w in chunk_windows(num_frames, chunk_frames, left_context):
        window = np.zeros((rows, codes.shape[1], width), np.int32)
        window[..., : w.frames] = codes[..., w.start - w.context : w.end]
        wave, kept = code2wav_chunk_compiled(
            graph,
            state,
            jnp.asarray(window),
            jnp.full((rows,), w.context, jnp.int32),
            jnp.full((rows,), w.frames, jnp.int32),
            join=False,  # transformers' trim: each chunk short at its end
        )
        pieces.append(np.asarray(wave)[:, : int(kept[0])])
    return np.concatenate(pieces, axis=1)


CODE2WAV_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"code_embedding\.weight", "code_embedding.embedding"),
    ParamRule(
        r"pre_transformer\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight",
        r"pre_transformer.layers.\1.\2.kernel",
        linear_kernel,
    ),
    ParamRule(
        r"pre_transformer\.layers\.(\d+)\.self_attn\.([qkvo]_proj)\.bias",
        r"pre_transformer.layers.\1.self_attn.\2.bias",
    ),
    ParamRule(
        r"pre_transformer\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight",
        r"pre_transformer.layers.\1.\2.weight",
    ),
    ParamRule(
        r"pre_transformer\.layers\.(\d+)\.(self_attn|mlp)_layer_scale\.scale",
        r"pre_transformer.layers.\1.\2_layer_scale",
    ),
    ParamRule(r"pre_transformer\.norm\.weight", "pre_transformer.norm.weight"),
    ParamRule(
        r"(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight", r"\1.conv.kernel", conv_transpose1d_kernel
    ),
    ParamRule(
        r"(upsample\.\d+\.1\.dwconv|decoder\.\d+|decoder\.\d+\.block\.\d+\.conv[12])\.conv\.weight",
        r"\1.conv.kernel",
        conv1d_kernel,
    ),
    ParamRule(r"((?:upsample|decoder)\.[\w.]+)\.conv\.bias", r"\1.conv.bias"),
    ParamRule(r"(upsample\.\d+\.1)\.norm\.weight", r"\1.norm.scale"),
    ParamRule(r"(upsample\.\d+\.1)\.norm\.bias", r"\1.norm.bias"),
    ParamRule(r"(upsample\.\d+\.1)\.(pwconv[12])\.weight", r"\1.\2.kernel", linear_kernel),
    ParamRule(r"(upsample\.\d+\.1)\.(pwconv[12])\.bias", r"\1.\2.bias"),
    ParamRule(r"(upsample\.\d+\.1)\.gamma", r"\1.gamma"),
    ParamRule(r"(decoder\.\d+(?:\.block\.\d+(?:\.act[12])?)?)\.(alpha|beta)", r"\1.\2"),
)
"""``Qwen3OmniMoeCode2Wav.state_dict()`` names (``code2wav.`` in a full checkpoint) -> :class:`Code2Wav`."""

CODE2WAV_IGNORE: tuple[str, ...] = (r"code_offset", r"pre_transformer\.rotary_emb\.(original_)?inv_freq")
"""Non-persistent buffers a checkpoint may still carry; the model recomputes them."""
