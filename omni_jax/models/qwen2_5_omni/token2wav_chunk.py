"""One streamed code2wav chunk per row: DiT solve of its window, kept frames, vocoder.

Each row is one chunk of some request (:class:`~omni_jax.models.qwen2_5_omni.chunk_plan.Chunk`
says which frames): its window's codes and noise are solved with :func:`sample_mel`, the kept
frames are gathered and put after the row's vocoder prefix (the previous chunk's last kept
frames), and BigVGAN runs on each row's own length. Rows of every chunk kind (little, first,
middle, final) share one program: their differences are per-row lengths and offsets, traced, so
one program per row count and window serves them all.

The reference is transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` and
``Qwen2_5OmniToken2WavBigVGANModel`` called chunk by chunk with the same windows and noise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.jit import StaticGraph, compute_dtype, exact_matmuls
from omni_jax.models.qwen2_5_omni.token2wav import ArrayLike, Token2Wav, sample_mel


def vocoder_input(
    mel: jax.Array, prev_tail: jax.Array, prefix_len: jax.Array, keep_lo: jax.Array, frames: int
) -> jax.Array:
    """``[B, frames, mel_dim]``: the last ``prefix_len`` frames of ``prev_tail [B, 2V, mel_dim]``,
    then ``mel [B, W, mel_dim]`` from frame ``keep_lo`` on, per row; the tail past what a row
    keeps is finite filler the vocoder's lengths mask."""
    overlap2 = prev_tail.shape[1]
    source = jnp.concatenate([prev_tail, mel], axis=1)
    j = jnp.arange(frames)[None, :]
    prefix_len, keep_lo = prefix_len[:, None], keep_lo[:, None]
    index = jnp.where(j < prefix_len, overlap2 - prefix_len, overlap2 + keep_lo - prefix_len) + j
    index = jnp.clip(index, 0, source.shape[1] - 1)
    return jnp.take_along_axis(source, index[..., None], axis=1)


def token2wav_chunk(
    model: Token2Wav,
    codes: jax.Array,
    code_lengths: jax.Array,
    speaker_embedding: jax.Array,
    reference_mel: jax.Array,
    reference_lengths: jax.Array | None,
    initial_noise: jax.Array,
    prev_tail: jax.Array,
    prefix_len: jax.Array,
    keep_lo: jax.Array,
    keep_len: jax.Array,
    num_steps: ArrayLike = 10,
    guidance_scale: ArrayLike = 0.5,
    sway_coefficient: ArrayLike = -1.0,
    *,
    keep_frames: int,
    guided: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chunks -> ``(waveform [B, S], valid samples [B], tail [B, 2V, mel_dim])``.

    ``codes [B, Wc]`` are each row's window codes (valid up to ``code_lengths``) and
    ``initial_noise [B, Wc * repeats, mel_dim]`` its window's noise; speaker, reference mel and
    step knobs as :func:`~omni_jax.models.qwen2_5_omni.token2wav.sample_mel`.
    ``prev_tail [B, 2V, mel_dim]``: the previous chunk's last kept frames, of which the last
    ``prefix_len [B]`` (0 or ``2V``) go before the ``keep_len [B]`` frames kept from window
    frame ``keep_lo [B]`` on. ``keep_frames`` (static): the most a row keeps, so
    ``S = (2V + keep_frames) * hop``. ``tail``: the last ``2V`` frames of each row's vocoder
    input, the next chunk's prefix.
    """
    with jax.named_scope("dit_solve"):
        mel, _ = sample_mel(
            model.dit,
            codes,
            code_lengths,
            speaker_embedding,
            reference_mel,
            reference_lengths,
            initial_noise,
            num_steps,
            guidance_scale,
            sway_coefficient,
            guided,
        )
    overlap2 = prev_tail.shape[1]
    voc_in = vocoder_input(mel, prev_tail, prefix_len, keep_lo, overlap2 + keep_frames)
    voc_len = prefix_len + keep_len
    last = jnp.clip(voc_len[:, None] - overlap2 + jnp.arange(overlap2)[None, :], 0, voc_in.shape[1] - 1)
    tail = jnp.take_along_axis(voc_in, last[..., None], axis=1)
    with jax.named_scope("vocoder"):
        wave, lengths = model.bigvgan(voc_in, voc_len)
    return wave, lengths, tail


@functools.partial(jax.jit, static_argnums=0, static_argnames=("keep_frames", "guided"))
def token2wav_chunk_compiled(
    graph: StaticGraph,
    state: nnx.State,
    codes: jax.Array,
    code_lengths: jax.Array,
    speaker_embedding: jax.Array,
    reference_mel: jax.Array,
    reference_lengths: jax.Array,
    initial_noise: jax.Array,
    prev_tail: jax.Array,
    prefix_len: jax.Array,
    keep_lo: jax.Array,
    keep_len: jax.Array,
    num_steps: jax.Array,
    guidance_scale: jax.Array,
    sway_coefficient: jax.Array,
    *,
    keep_frames: int,
    guided: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`token2wav_chunk` as one compiled program over ``nnx.split(model)``.

    Compiles once per input shape (rows, window, reference length, overlap), ``keep_frames``
    and ``guided``: chunk kinds, offsets, lengths and step knobs are traced.
    """
    with exact_matmuls(compute_dtype(state)):
        return token2wav_chunk(
            nnx.merge(graph.graphdef, state),
            codes,
            code_lengths,
            speaker_embedding,
            reference_mel,
            reference_lengths,
            initial_noise,
            prev_tail,
            prefix_len,
            keep_lo,
            keep_len,
            num_steps,
            guidance_scale,
            sway_coefficient,
            keep_frames=keep_frames,
            guided=guided,
        )
