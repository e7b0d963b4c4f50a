"""Qwen3-Omni thinker audio encoder (``Qwen3OmniMoeAudioEncoder``) as NNX modules.

What differs from Qwen2.5-Omni's Whisper-style encoder: the front end is three stride-2 3x3
``Conv2d`` over (mel, time) and a linear map of (channels x mel) to the model width, so a chunk
of ``2 * n_window`` mel frames becomes 13 tokens (not ``n_window``); the padding between the
convolutions is not masked (below); attention runs in windows of ``n_window_infer // (2 *
n_window)`` chunks of one clip (not inside a chunk); ``k_proj`` has a bias; there is no pooling,
and the head is ``proj2(gelu(proj1(ln_post(x))))``.

The layout follows the Qwen2.5-Omni encoder: the host cuts every clip into fixed chunks (the
call's chunk count, a bucket, is its only free dimension), the convolutions run per chunk, and
each chunk's ``13`` token slots line up after one another, so a clip's tokens are one contiguous
run of slots (only its last chunk has empty slots, at its end) and a window is a contiguous run
of at most ``window_chunks * 13`` slots. The layers attend in those windows with the banded
attention of the vision encoder (a query sees its own and its neighbouring tiles of one window's
size, masked to its window). A gather then packs each clip's rows one after another.

One numerical trait of the reference is kept on purpose: it pads every chunk of a call to that
call's longest chunk and does not mask the padding between the convolutions, so a clip's last
tokens depend on how far its chunks were padded. Each chunk carries the length the reference
would pad it to (:func:`reference_chunk_pad`), and the padding beyond that length is zeroed
after each convolution, which reproduces the reference's result for any such length within the
one fixed chunk shape.

Nothing crosses a window's edge: the convolutions and the position embedding work per chunk
(every chunk's positions start at 0), attention stays in a window, and the rest works per row.
So a clip cut at window edges into pieces (:func:`window_pieces`), each encoded as a clip of its
own, gives the clip's rows piece by piece, and a clip longer than the largest call (Qwen3-Omni's
processor takes clips past the extractor's window) is encoded across calls of the usual sizes.

Qwen2.5-Omni's ``audio_chunk_buckets`` and ``plan_audio_calls`` (the work is linear in the chunk
count here too) give the call sizes and cut clips (or pieces) into calls, ``prepare_audio_batch``
builds each call's :class:`AudioBatch`, ``AudioEncoder(batch)`` returns ``[chunks * 13,
output_dim]`` rows and the :class:`RowSplit` says which rows are whose.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.param_map import ParamRule, conv2d_kernel, linear_kernel
from omni_jax.models.qwen2_5_omni.audio_encoder import (
    AudioEncoderLayer,
    RowSplit,
    bucket_size,
    check_audio_features,
    encoder_layer_rules,
    sinusoid_positions,
    torch_layer_norm,
    whisper_fields,
)
from omni_jax.models.qwen2_5_omni.vision_encoder import banded_attention

REFERENCE_CHUNK_TOKENS = 13
"""Tokens of a full chunk as transformers counts them (``_get_feat_extract_output_lengths``, and
the processor's placeholder count, hard-code 13: three stride-2 convolutions of 100 frames)."""

AUDIO_IGNORE: tuple[str, ...] = ()
"""HF tensors the encoder does not use: none (the sinusoid table is a non-persistent buffer)."""


def downsampled(n: int) -> int:
    """Length after one stride-2, kernel-3, padding-1 convolution (0 stays 0)."""
    return (n - 1) // 2 + 1


def conv_stack_length(n: int) -> int:
    """Length after the front end's three stride-2 convolutions."""
    return downsampled(downsampled(downsampled(n)))


@dataclasses.dataclass(frozen=True)
class AudioEncoderSpec:
    """The fields of ``Qwen3OmniMoeAudioEncoderConfig`` the encoder needs, hashable for jit."""

    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    n_window: int
    n_window_infer: int
    downsample_hidden_size: int
    output_dim: int

    @classmethod
    def from_hf(cls, cfg: Any) -> AudioEncoderSpec:
        spec = cls(
            **whisper_fields(cfg),
            n_window_infer=cfg.n_window_infer,
            downsample_hidden_size=cfg.downsample_hidden_size,
        )
        if spec.chunk_tokens != REFERENCE_CHUNK_TOKENS:
            raise ValueError(
                f"n_window {spec.n_window}: a chunk of {spec.chunk_frames} frames gives {spec.chunk_tokens} "
                f"tokens, but transformers counts {REFERENCE_CHUNK_TOKENS} (n_window must be 49 to 52)"
            )
        if spec.window_chunks < 1:
            raise ValueError(
                f"n_window_infer {spec.n_window_infer} must be at least a chunk ({spec.chunk_frames} frames)"
            )
        return spec

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Tokens of a full chunk (slots per chunk in a call)."""
        return conv_stack_length(self.chunk_frames)

    @property
    def window_chunks(self) -> int:
        """Chunks of one attention window (the reference's ``n_window_infer // (2 * n_window)``)."""
        return self.n_window_infer // self.chunk_frames

    @property
    def conv_features(self) -> int:
        """Width the front end flattens (channels x downsampled mel bins) before ``conv_out``."""
        return self.downsample_hidden_size * conv_stack_length(self.num_mel_bins)

    def window_tile(self, chunks: int) -> int:
        """Token tile of the banded window attention in a call of ``chunks`` chunks: a window's
        most tokens (no window is longer than the call)."""
        return min(self.window_chunks, chunks) * self.chunk_tokens

    def token_slots(self, chunks: int) -> int:
        """Token slots of a call of ``chunks`` chunks: ``chunk_tokens`` a chunk, rounded up to a
        whole number of :meth:`window_tile`."""
        tile = self.window_tile(chunks)
        return -(-chunks * self.chunk_tokens // tile) * tile


def audio_output_rows(frames: int, spec: AudioEncoderSpec) -> int:
    """Rows the encoder gives a clip of ``frames`` mel frames (the thinker's placeholder count)."""
    full, tail = divmod(frames, spec.chunk_frames)
    return full * spec.chunk_tokens + conv_stack_length(tail)


def window_pieces(frames: int, spec: AudioEncoderSpec, most_chunks: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` mel frames of the pieces a clip of ``frames`` frames is encoded in,
    in order: each the most whole attention windows ``most_chunks`` chunks hold (the last piece
    the rest), so that each piece's rows, encoded as a clip of its own with the clip's chunk pad
    (:func:`reference_chunk_pad` of its reference call), are the clip's rows there (module
    docstring). Where ``most_chunks`` holds no whole window the clip stays whole."""
    step = most_chunks // spec.window_chunks * spec.window_chunks * spec.chunk_frames
    if step == 0:
        return [(0, frames)]
    return [(start, min(start + step, frames)) for start in range(0, frames, step)]


def reference_chunk_pad(frames: Sequence[int], spec: AudioEncoderSpec) -> int:
    """The length the reference pads every chunk of one call over clips of ``frames`` mel frames
    to: the call's longest chunk. Pass it (per clip) to :func:`prepare_audio_batch` to reproduce a
    given reference call, e.g. one request's clips as ``get_audio_features`` sees them."""
    return min(spec.chunk_frames, max(frames))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AudioBatch:
    """Device inputs of one encoder call of ``C`` chunks; every shape is fixed by ``C``.

    features: ``[C, mel, 2 * n_window]`` chunked log-mel frames, zero beyond each chunk.
    chunk_pads: ``[C]`` frames the reference pads each chunk to (0 for padding chunks).
    windows: ``[token_slots(C)]`` attention window of each token slot (numbered across the
        call; -1 for a slot without a token).
    rows: ``[C * chunk_tokens]`` slot of each output row (clip after clip), then slot 0 for the
        padding rows.
    """

    features: jax.Array
    chunk_pads: jax.Array
    windows: jax.Array
    rows: jax.Array

    @classmethod
    def shapes(cls, spec: AudioEncoderSpec, chunks: int) -> AudioBatch:
        """The ``jax.ShapeDtypeStruct`` of each field for a call of ``chunks`` chunks (to compile
        a program without building its inputs)."""
        leaf = jax.ShapeDtypeStruct
        return cls(
            features=leaf((chunks, spec.num_mel_bins, spec.chunk_frames), jnp.float32),
            chunk_pads=leaf((chunks,), jnp.int32),
            windows=leaf((spec.token_slots(chunks),), jnp.int32),
            rows=leaf((chunks * spec.chunk_tokens,), jnp.int32),
        )


def prepare_audio_batch(
    features: Sequence[np.ndarray],
    spec: AudioEncoderSpec,
    *,
    min_chunks: int = 1,
    pad_frames: Sequence[int] | None = None,
) -> tuple[AudioBatch, RowSplit]:
    """Chunk ``features`` (each ``[mel, frames]``) into one bucketed batch (host, numpy).

    The chunk count is padded to a power of two (at least ``min_chunks``). ``pad_frames[i]`` is
    the length the reference pads clip ``i``'s chunks to (:func:`reference_chunk_pad` of the
    clips of its reference call); by default all of ``features`` form that call. The output has
    ``chunks * chunk_tokens`` rows, split per clip by the returned :class:`RowSplit`.
    """
    frames_per_chunk, slots = spec.chunk_frames, spec.chunk_tokens
    if pad_frames is None:
        pad_frames = [reference_chunk_pad([f.shape[-1] for f in features], spec)] * len(features)
    pieces: list[np.ndarray] = []
    pads: list[int] = []
    windows: list[tuple[int, np.ndarray]] = []  # (chunk, window of each of its tokens)
    rows: list[np.ndarray] = []
    out_lens: list[int] = []
    num_windows = 0
    for i, (feat, pad) in enumerate(zip(features, pad_frames, strict=True)):
        check_audio_features(i, feat, spec.num_mel_bins)
        if not min(feat.shape[1], frames_per_chunk) <= pad <= frames_per_chunk:
            raise ValueError(
                f"audio {i}: its chunks cannot be padded to {pad} frames (its longest chunk has "
                f"{min(feat.shape[1], frames_per_chunk)}, a chunk at most {frames_per_chunk})"
            )
        first_chunk = len(pieces)
        for j, start in enumerate(range(0, feat.shape[1], frames_per_chunk)):
            piece = feat[:, start : start + frames_per_chunk]
            tokens = conv_stack_length(piece.shape[1])
            windows.append((len(pieces), np.full(tokens, num_windows + j // spec.window_chunks)))
            pieces.append(piece)
            pads.append(pad)
        num_windows += -(-(len(pieces) - first_chunk) // spec.window_chunks)
        out_len = audio_output_rows(feat.shape[1], spec)
        rows.append(first_chunk * slots + np.arange(out_len))
        out_lens.append(out_len)
    num_chunks = bucket_size(len(pieces), min_chunks)
    chunks = np.zeros((num_chunks, spec.num_mel_bins, frames_per_chunk), np.float32)
    chunk_pads = np.zeros((num_chunks,), np.int32)
    window_ids = np.full((spec.token_slots(num_chunks),), -1, np.int32)
    for c, piece in enumerate(pieces):
        chunks[c, :, : piece.shape[1]] = piece
        chunk_pads[c] = pads[c]
    for c, ids in windows:
        window_ids[c * slots : c * slots + len(ids)] = ids
    row_slots = np.zeros((num_chunks * slots,), np.int32)
    if rows:
        flat = np.concatenate(rows)
        row_slots[: len(flat)] = flat
    return AudioBatch(chunks, chunk_pads, window_ids, row_slots), RowSplit.from_lengths(out_lens)


class AudioEncoder(nnx.Module):
    """``Qwen3OmniMoeAudioEncoder``: mel chunks -> thinker-width audio embeddings."""

    def __init__(self, spec: AudioEncoderSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        d, h = spec.d_model, spec.downsample_hidden_size
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        conv: dict[str, Any] = dict(kernel_size=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), **kw)
        self.spec = spec
        self.conv2d1 = nnx.Conv(1, h, **conv)
        self.conv2d2 = nnx.Conv(h, h, **conv)
        self.conv2d3 = nnx.Conv(h, h, **conv)
        self.conv_out = nnx.Linear(spec.conv_features, d, use_bias=False, **kw)
        self.layers = nnx.List(
            [AudioEncoderLayer(spec, key_bias=True, dtype=dtype, rngs=rngs) for _ in range(spec.num_layers)]
        )
        self.ln_post = torch_layer_norm(d, dtype, rngs)
        self.proj1 = nnx.Linear(d, d, **kw)
        self.proj2 = nnx.Linear(d, spec.output_dim, **kw)

    def __call__(self, batch: AudioBatch) -> jax.Array:
        """``[C * chunk_tokens, output_dim]`` embeddings; see :class:`RowSplit` for the rows."""
        spec = self.spec
        chunks = batch.features.shape[0]
        x = batch.features.astype(self.conv2d1.kernel.dtype)[..., None]  # [C, mel, time, 1]
        pads = batch.chunk_pads
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = jax.nn.gelu(conv(x), approximate=False)
            # what the reference's shorter padding would not have: zero, as the next conv's padding
            pads = downsampled(pads)
            x = x * (jnp.arange(x.shape[2]) < pads[:, None])[:, None, :, None].astype(x.dtype)
        c, f, t, h = x.shape
        x = self.conv_out(x.transpose(0, 2, 3, 1).reshape(c, t, h * f))  # channels-major, as torch
        x = x + jnp.asarray(sinusoid_positions(t, spec.d_model), x.dtype)
        x = x.reshape(c * t, spec.d_model)
        x = jnp.pad(x, ((0, batch.windows.shape[0] - c * t), (0, 0)))
        attend = functools.partial(banded_attention, segment=batch.windows, tile=spec.window_tile(chunks))
        for layer in self.layers:
            x = layer(x, attend)
        x = self.ln_post(x[batch.rows])
        return self.proj2(jax.nn.gelu(self.proj1(x), approximate=False))


AUDIO_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"conv2d([123])\.weight", r"conv2d\1.kernel", conv2d_kernel),
    ParamRule(r"conv2d([123])\.bias", r"conv2d\1.bias"),
    ParamRule(r"conv_out\.weight", "conv_out.kernel", linear_kernel),
    *encoder_layer_rules(key_bias=True),
    ParamRule(r"proj([12])\.weight", r"proj\1.kernel", linear_kernel),
    ParamRule(r"proj([12])\.bias", r"proj\1.bias"),
)
"""``Qwen3OmniMoeAudioEncoder.state_dict()`` names -> :class:`AudioEncoder` paths."""
