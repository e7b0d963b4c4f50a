"""Qwen2.5-Omni thinker audio encoder (Whisper-style) as NNX modules.

The reference packs a ragged batch of audios into chunks of ``2 * n_window`` mel frames and
loops over chunks for attention. Here the chunk is the batch axis: the host cuts every audio
into fixed ``[2 * n_window, mel]`` chunks (zero-padded, padded up to a bucketed chunk count),
so each layer is one dense ``[chunks, n_window]`` attention with a key mask and a jitted call
sees the same shapes for every batch in a bucket. The stride-2 pooling that follows the
layers pairs tokens per audio, possibly across chunks, so its gather indices come from the
host too.

The chunk count is the call's only free dimension, a power of two up to the largest that one
clip needs (:func:`audio_chunk_buckets`); clips admitted together are cut into calls of those
sizes by :func:`plan_audio_calls`, ``prepare_audio_batch`` builds each call's
:class:`AudioBatch`, ``AudioEncoder(batch)`` returns ``[num_chunks * n_window // 2, output_dim]``
rows and :class:`RowSplit` says which rows are whose.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.param_map import ParamRule, conv1d_kernel, linear_kernel
from omni_jax.models.qwen2_5_omni.encoder_calls import CallPlan, plan_calls, size_ladder

AUDIO_IGNORE: tuple[str, ...] = (r"audio_bos_eos_token\.weight",)
"""HF tensors the encoder does not use (the thinker never reads ``audio_bos_eos_token``)."""


def bucket_size(n: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)``: few shapes, so few compilations."""
    return 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Host-side map from a batched encoder output back to requests.

    Request ``i`` owns rows ``offsets[i] : offsets[i] + lengths[i]``; rows after the last
    request are padding.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> RowSplit:
        lengths = tuple(int(n) for n in lengths)
        return cls(tuple(itertools.accumulate(lengths, initial=0))[:-1], lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def split(self, out: Any) -> list[Any]:
        """Each request's rows of ``out`` (numpy or jax array), in request order."""
        return [out[o : o + n] for o, n in zip(self.offsets, self.lengths, strict=True)]


Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""An encoder layer's attention over ``q, k, v [..., heads, D]``: which keys each query sees is
the caller's (chunks here, windows in Qwen3-Omni's encoder)."""


class AudioLayerSpec(Protocol):
    """What :class:`AudioEncoderLayer` reads of a spec (this family's and Qwen3-Omni's)."""

    @property
    def d_model(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...


class ChunkedAudioSpec(Protocol):
    """What the call planning reads of a spec: the mel frames of a chunk."""

    @property
    def chunk_frames(self) -> int: ...


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Softmax attention inside each chunk of ``[chunks, L, heads, D]`` over its first ``lengths`` keys.

    Chunks stand for the reference's ``cu_seqlens`` segments, left-aligned so that a length
    is the whole mask; no chunk sees another. All-padding chunks attend to their first slot, so
    they stay finite (never NaN); no real row reads them.
    """
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)


def whisper_fields(cfg: Any) -> dict[str, Any]:
    """The spec fields of a Whisper-style audio encoder config (this family's and Qwen3-Omni's),
    its activation checked (exact GELU only)."""
    if cfg.activation_function != "gelu":
        raise ValueError(f"audio encoder supports activation 'gelu', not {cfg.activation_function!r}")
    return dict(
        num_mel_bins=cfg.num_mel_bins,
        d_model=cfg.d_model,
        num_layers=cfg.encoder_layers,
        num_heads=cfg.encoder_attention_heads,
        ffn_dim=cfg.encoder_ffn_dim,
        n_window=cfg.n_window,
        output_dim=cfg.output_dim,
    )


@dataclasses.dataclass(frozen=True)
class AudioEncoderSpec:
    """The fields of ``Qwen2_5OmniAudioEncoderConfig`` the encoder needs, hashable for jit."""

    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    n_window: int
    output_dim: int

    @classmethod
    def from_hf(cls, cfg: Any) -> AudioEncoderSpec:
        return cls(**whisper_fields(cfg))

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AudioBatch:
    """Device inputs of one encoder call; every shape is fixed by the chunk bucket.

    features: ``[C, 2 * n_window, mel]`` chunked log-mel frames, zero beyond each chunk.
    chunk_lens: ``[C]`` real frames per chunk (0 for padding chunks).
    pool_pairs: ``[C * n_window // 2, 2]`` flat token indices (``chunk * n_window + t``)
        averaged into each output row; padding rows point at token 0.
    """

    features: jax.Array
    chunk_lens: jax.Array
    pool_pairs: jax.Array

    @classmethod
    def shapes(cls, spec: AudioEncoderSpec, chunks: int) -> AudioBatch:
        """The ``jax.ShapeDtypeStruct`` of each field for a call of ``chunks`` chunks (to compile
        a program without building its inputs)."""
        leaf = jax.ShapeDtypeStruct
        return cls(
            features=leaf((chunks, spec.chunk_frames, spec.num_mel_bins), jnp.float32),
            chunk_lens=leaf((chunks,), jnp.int32),
            pool_pairs=leaf((chunks * spec.n_window // 2, 2), jnp.int32),
        )


def audio_chunks(frames: int, spec: ChunkedAudioSpec) -> int:
    """Chunks of ``2 * n_window`` mel frames a clip of ``frames`` frames takes."""
    return -(-frames // spec.chunk_frames)


def audio_chunk_buckets(largest_clip: int, spec: ChunkedAudioSpec) -> tuple[int, ...]:
    """The call sizes (chunks) of the audio encoder: powers of two up to the first that holds a
    clip of ``largest_clip`` mel frames."""
    return size_ladder(1, audio_chunks(largest_clip, spec))


def plan_audio_calls(frames: Sequence[int], spec: ChunkedAudioSpec, buckets: Sequence[int]) -> list[CallPlan]:
    """Cut clips of ``frames`` mel frames (in order, each whole) into calls of ``buckets`` chunk
    counts at the least padded chunks, one more call costing as much as the smallest bucket (the
    encoder's work is linear in the chunk count: attention stays inside a chunk). A clip larger
    than the largest bucket raises ``ValueError``; callers refuse such clips at validation."""
    chunks = [audio_chunks(n, spec) for n in frames]
    return plan_calls(chunks, buckets, lambda size: size + buckets[0])


def check_audio_features(i: int, feat: np.ndarray, num_mel_bins: int) -> None:
    """Refuse audio ``i``'s features unless they are ``[num_mel_bins, frames >= 1]``."""
    if feat.ndim != 2 or feat.shape[0] != num_mel_bins or feat.shape[1] < 1:
        raise ValueError(f"audio {i}: expected features [{num_mel_bins}, frames >= 1], got {feat.shape}")


def audio_output_lengths(frames: int) -> tuple[int, int]:
    """``(tokens after the conv front end, output rows)`` for an audio of ``frames`` mel frames."""
    after_cnn = (frames - 1) // 2 + 1
    return after_cnn, (after_cnn - 2) // 2 + 1


def prepare_audio_batch(
    features: Sequence[np.ndarray], spec: AudioEncoderSpec, *, min_chunks: int = 1
) -> tuple[AudioBatch, RowSplit]:
    """Chunk ``features`` (each ``[mel, frames]``) into one bucketed batch (host, numpy).

    The chunk count is padded to a power of two (at least ``min_chunks``); the output has
    ``chunks * n_window // 2`` rows, split per request by the returned :class:`RowSplit`.
    """
    n, frames_per_chunk = spec.n_window, spec.chunk_frames
    pieces: list[np.ndarray] = []
    pairs: list[np.ndarray] = []
    out_lens: list[int] = []
    for i, feat in enumerate(features):
        check_audio_features(i, feat, spec.num_mel_bins)
        first_chunk = len(pieces)
        pieces += [feat[:, s : s + frames_per_chunk].T for s in range(0, feat.shape[1], frames_per_chunk)]
        _, out_len = audio_output_lengths(feat.shape[1])
        local = np.arange(2 * out_len).reshape(out_len, 2)
        pairs.append(first_chunk * n + local)
        out_lens.append(out_len)
    num_chunks = bucket_size(len(pieces), min_chunks)
    chunks = np.zeros((num_chunks, frames_per_chunk, spec.num_mel_bins), np.float32)
    chunk_lens = np.zeros((num_chunks,), np.int32)
    for c, piece in enumerate(pieces):
        chunks[c, : len(piece)] = piece
        chunk_lens[c] = len(piece)
    pool_pairs = np.zeros((num_chunks * n // 2, 2), np.int32)
    if pairs:
        flat = np.concatenate(pairs)
        pool_pairs[: len(flat)] = flat
    return AudioBatch(chunks, chunk_lens, pool_pairs), RowSplit.from_lengths(out_lens)


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's fixed ``[length, channels]`` table (sin half, then cos half), in float32 as HF."""
    increment = np.float32(np.log(max_timescale) / (channels // 2 - 1))
    inv_timescales = np.exp(-increment * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)


class AudioAttention(nnx.Module):
    """Whisper self-attention; ``key_bias``: whether ``k_proj`` has a bias (Qwen3-Omni's does)."""

    def __init__(self, spec: AudioLayerSpec, *, key_bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.d_model
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.num_heads = spec.num_heads
        self.q_proj = nnx.Linear(d, d, **kw)
        self.k_proj = nnx.Linear(d, d, use_bias=key_bias, **kw)
        self.v_proj = nnx.Linear(d, d, **kw)
        self.out_proj = nnx.Linear(d, d, **kw)

    def __call__(self, x: jax.Array, attend: Attend) -> jax.Array:
        d = x.shape[-1]
        heads = (*x.shape[:-1], self.num_heads, d // self.num_heads)
        q = self.q_proj(x).reshape(heads)
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        return self.out_proj(attend(q, k, v).reshape(x.shape))


def torch_layer_norm(dim: int, dtype: jnp.dtype, rngs: nnx.Rngs, eps: float = 1e-5) -> nnx.LayerNorm:
    """torch ``nn.LayerNorm`` numerics: its epsilon (default 1e-5) and the two-pass variance."""
    return nnx.LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class AudioEncoderLayer(nnx.Module):
    """Pre-norm Whisper encoder layer with exact (erf) GELU."""

    def __init__(self, spec: AudioLayerSpec, *, key_bias: bool = False, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.d_model
        self.self_attn = AudioAttention(spec, key_bias=key_bias, dtype=dtype, rngs=rngs)
        self.self_attn_layer_norm = torch_layer_norm(d, dtype, rngs)
        self.fc1 = nnx.Linear(d, spec.ffn_dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(spec.ffn_dim, d, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.final_layer_norm = torch_layer_norm(d, dtype, rngs)

    def __call__(self, x: jax.Array, attend: Attend) -> jax.Array:
        x = x + self.self_attn(self.self_attn_layer_norm(x), attend)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.final_layer_norm(x)), approximate=False))


class AudioEncoder(nnx.Module):
    """``Qwen2_5OmniAudioEncoder``: mel chunks -> thinker-width audio embeddings."""

    def __init__(self, spec: AudioEncoderSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        d = spec.d_model
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.spec = spec
        self.conv1 = nnx.Conv(spec.num_mel_bins, d, (3,), padding=((1, 1),), **kw)
        self.conv2 = nnx.Conv(d, d, (3,), strides=(2,), padding=((1, 1),), **kw)
        self.layers = nnx.List(
            [AudioEncoderLayer(spec, dtype=dtype, rngs=rngs) for _ in range(spec.num_layers)]
        )
        self.ln_post = torch_layer_norm(d, dtype, rngs)
        self.proj = nnx.Linear(d, spec.output_dim, **kw)

    def __call__(self, batch: AudioBatch) -> jax.Array:
        """``[C * n_window // 2, output_dim]`` embeddings; see :class:`RowSplit` for the rows."""
        spec = self.spec
        n = spec.n_window
        x = batch.features.astype(self.conv1.kernel.dtype)
        frame_valid = jnp.arange(spec.chunk_frames) < batch.chunk_lens[:, None]
        x = jax.nn.gelu(self.conv1(x), approximate=False) * frame_valid[..., None].astype(x.dtype)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        x = x + jnp.asarray(sinusoid_positions(n, spec.d_model), x.dtype)
        attend = functools.partial(chunk_attention, lengths=(batch.chunk_lens - 1) // 2 + 1)
        for layer in self.layers:
            x = layer(x, attend)
        flat = x.reshape(-1, spec.d_model)
        pooled = (flat[batch.pool_pairs[:, 0]] + flat[batch.pool_pairs[:, 1]]) / 2
        return self.proj(self.ln_post(pooled))


def encoder_layer_rules(*, key_bias: bool) -> tuple[ParamRule, ...]:
    """HF names -> paths of the :class:`AudioEncoderLayer` stack (``layers.*``) and ``ln_post``,
    which this family's encoder and Qwen3-Omni's share; ``key_bias``: whether ``k_proj`` has one."""
    biased = "q|k|v|out" if key_bias else "q|v|out"
    return (
        ParamRule(
            r"layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.weight",
            r"layers.\1.self_attn.\2_proj.kernel",
            linear_kernel,
        ),
        ParamRule(rf"layers\.(\d+)\.self_attn\.({biased})_proj\.bias", r"layers.\1.self_attn.\2_proj.bias"),
        ParamRule(r"layers\.(\d+)\.(fc[12])\.weight", r"layers.\1.\2.kernel", linear_kernel),
        ParamRule(r"layers\.(\d+)\.(fc[12])\.bias", r"layers.\1.\2.bias"),
        ParamRule(r"layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.weight", r"layers.\1.\2.scale"),
        ParamRule(r"layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.bias", r"layers.\1.\2.bias"),
        ParamRule(r"ln_post\.weight", "ln_post.scale"),
        ParamRule(r"ln_post\.bias", "ln_post.bias"),
    )


AUDIO_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"conv([12])\.weight", r"conv\1.kernel", conv1d_kernel),
    ParamRule(r"conv([12])\.bias", r"conv\1.bias"),
    *encoder_layer_rules(key_bias=False),
    ParamRule(r"proj\.weight", "proj.kernel", linear_kernel),
    ParamRule(r"proj\.bias", "proj.bias"),
)
"""``Qwen2_5OmniAudioEncoder.state_dict()`` names -> :class:`AudioEncoder` paths."""
