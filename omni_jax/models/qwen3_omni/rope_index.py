"""3-D M-RoPE position ids of one Qwen3-Omni thinker prompt, on the host in numpy.

Qwen3-Omni positions its prompt as Qwen2.5-Omni does (text and audio by a running index,
vision tokens by time, row and column, each span starting one past the *last* span's maximum),
and decoding continues at ``token index + rope_delta`` on all three axes
(:func:`omni_jax.models.qwen2_5_omni.rope_index.positions_for` computes those). What differs,
reproduced here exactly as transformers' ``get_rope_index`` computes it:

- an audio clip's token count is ``_get_feat_extract_output_lengths`` with the audio encoder's
  ``n_window`` (13 tokens a full chunk of ``2 * n_window`` mel frames);
- spans are found by their start tokens (``<|vision_start|>``, ``<|audio_start|>``), and an
  audio track inside a video (``<|vision_start|><|audio_start|>``) opens and closes with two
  tokens each;
- a video's and its audio track's tokens interleave token by token (a video token goes first
  while its time is at most the next audio token's), not in 2-second chunks;
- time positions are not truncated: the reference computes every position in float32, so a
  video whose seconds per grid step times ``position_id_per_seconds`` is fractional gets
  fractional positions (and a fractional ``rope_delta``). :func:`get_rope_index` then returns
  float32 positions; whenever every position is whole (the released processor's default
  frame rates give whole ones) it returns them as int64, as the AR engine's position arrays are
  integers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_jax.models.qwen2_5_omni import rope_index as qwen2_5_rope_index
from omni_jax.models.qwen2_5_omni.rope_index import (
    checked_positions,
    count_spans,
    media_lists,
    run_positions,
    vision_positions,
)
from omni_jax.models.qwen3_omni.audio_encoder import REFERENCE_CHUNK_TOKENS, conv_stack_length


@dataclasses.dataclass(frozen=True)
class RopeIndexSpec:
    """The token ids and constants of a ``Qwen3OmniMoeThinkerConfig`` the index needs."""

    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: float
    audio_n_window: int

    @classmethod
    def from_hf(cls, cfg: Any) -> RopeIndexSpec:
        """From the thinker config (``vision_start_token_id`` is not one of its declared fields,
        but the released config sets it, and the reference reads it from there)."""
        return cls(
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            audio_token_id=cfg.audio_token_id,
            vision_start_token_id=cfg.vision_start_token_id,
            audio_start_token_id=cfg.audio_start_token_id,
            spatial_merge_size=cfg.vision_config.spatial_merge_size,
            position_id_per_seconds=cfg.position_id_per_seconds,
            audio_n_window=cfg.audio_config.n_window,
        )


def audio_token_count(frames: int, n_window: int) -> int:
    """Tokens of an audio clip of ``frames`` mel frames: the reference's (and its processor's)
    ``_get_feat_extract_output_lengths``, 13 per full chunk of ``2 * n_window`` frames plus the
    three stride-2 convolutions' length of the rest."""
    full, tail = divmod(int(frames), 2 * n_window)
    return full * REFERENCE_CHUNK_TOKENS + conv_stack_length(tail)


_run = functools.partial(run_positions, dtype=np.float32)
"""Qwen2.5-Omni's runs of positions, in float32."""

_vision_positions = functools.partial(vision_positions, dtype=np.float32)
"""Qwen2.5-Omni's vision positions, in float32."""


def _video_t_index(grid_t: int, second_per_grid: float, spec: RopeIndexSpec) -> np.ndarray:
    """Time positions of a video's frames in float32, untruncated, as the reference multiplies them."""
    per_second = np.float32(spec.position_id_per_seconds)
    return np.arange(grid_t).astype(np.float32) * np.float32(second_per_grid) * per_second


def _interleave(video: np.ndarray, audio: np.ndarray) -> list[np.ndarray]:
    """The reference's blocks for a video with its audio track: one token at a time, a video
    token first while its time is at most the next audio token's, then the rest of whichever is
    left as one block (its maximum, over all three axes, places the closing tokens)."""
    vi = ai = 0
    order: list[np.ndarray] = []
    while vi < video.shape[1] and ai < audio.shape[1]:
        if video[0, vi] <= audio[0, ai]:
            order.append(video[:, vi : vi + 1])
            vi += 1
        else:
            order.append(audio[:, ai : ai + 1])
            ai += 1
    if vi < video.shape[1]:
        order.append(video[:, vi:])
    if ai < audio.shape[1]:
        order.append(audio[:, ai:])
    return order


def get_rope_index(
    spec: RopeIndexSpec,
    input_ids: Sequence[int],
    *,
    image_grid_thw: Sequence[Sequence[int]] | None = None,
    video_grid_thw: Sequence[Sequence[int]] | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
    audio_seqlens: Sequence[int] | None = None,
    use_audio_in_video: bool = False,
) -> tuple[np.ndarray, int | float]:
    """``(positions [3, T], rope_delta)`` for one prompt, as the reference computes them.

    ``image_grid_thw``/``video_grid_thw`` are the (t, h, w) patch grids of the prompt's images
    and videos in order, ``second_per_grid_ts`` each video's seconds per temporal grid step,
    ``audio_seqlens`` each audio's mel frame count (``feature_attention_mask.sum(-1)``; with
    ``use_audio_in_video`` the videos' tracks, in video order). Positions are int64 and the
    delta an int when every position is whole, else float32 and a float (module docstring).
    Position ``p`` of generated token ``i`` (0-based in the whole sequence) is ``i + rope_delta``.
    """
    ids = [int(t) for t in input_ids]
    if not image_grid_thw and not video_grid_thw:
        return run_positions(len(ids), 0), 0
    images, videos, seconds, audios = media_lists(
        image_grid_thw, video_grid_thw, second_per_grid_ts, audio_seqlens
    )
    merge = spec.spatial_merge_size
    vision_start, audio_start = spec.vision_start_token_id, spec.audio_start_token_id
    remain_images, remain_videos, remain_audios, spans = count_spans(spec, ids, use_audio_in_video)
    has_vision = spec.image_token_id in ids or spec.video_token_id in ids
    has_audio = spec.audio_token_id in ids

    blocks: list[np.ndarray] = []

    def next_start() -> np.float32:
        return np.float32(blocks[-1].max() + 1) if blocks else np.float32(0)

    st = image_idx = video_idx = audio_idx = 0
    for _ in range(spans):
        st_idx = next_start()
        far = len(ids) + 1
        ed_vision = ids.index(vision_start, st) if has_vision and (remain_videos or remain_images) else far
        ed_audio = ids.index(audio_start, st) if has_audio and remain_audios else far
        first = min(ed_vision, ed_audio)
        text_len = first - st
        if text_len:
            blocks.append(_run(text_len, st_idx))
            st_idx += np.float32(text_len)
        audio_in_video = first == ed_vision and ed_vision + 1 == ed_audio
        bracket = 2 if audio_in_video else 1
        blocks.append(_run(bracket, st_idx))
        st_idx += np.float32(bracket)
        if first == ed_audio:
            audio_len = audio_token_count(audios[audio_idx], spec.audio_n_window)
            blocks.append(_run(audio_len, st_idx))
            st += text_len + bracket + audio_len + bracket
            audio_idx, remain_audios = audio_idx + 1, remain_audios - 1
        elif ids[ed_vision + 1] == spec.image_token_id:
            t, h, w = images[image_idx]
            t_index = np.arange(t).astype(np.float32) * np.float32(spec.position_id_per_seconds)
            blocks.append(_vision_positions(st_idx, t_index, h, w, merge))
            st += text_len + bracket + t * h * w // merge**2 + bracket
            image_idx, remain_images = image_idx + 1, remain_images - 1
        elif ids[ed_vision + 1] == spec.video_token_id:
            t, h, w = videos[video_idx]
            t_index = _video_t_index(t, seconds[video_idx], spec)
            blocks.append(_vision_positions(st_idx, t_index, h, w, merge))
            st += text_len + bracket + t * h * w // merge**2 + bracket
            video_idx, remain_videos = video_idx + 1, remain_videos - 1
        elif audio_in_video:
            audio_len = audio_token_count(audios[audio_idx], spec.audio_n_window)
            t, h, w = videos[video_idx]
            t_index = _video_t_index(t, seconds[video_idx], spec)
            video_pos = _vision_positions(st_idx, t_index, h, w, merge)
            blocks += _interleave(video_pos, _run(audio_len, st_idx))
            st += text_len + bracket + audio_len + t * h * w // merge**2 + bracket
            audio_idx, video_idx = audio_idx + 1, video_idx + 1
            remain_audios, remain_videos = remain_audios - 1, remain_videos - 1
        blocks.append(_run(bracket, next_start()))
    if st < len(ids):
        blocks.append(_run(len(ids) - st, next_start()))
    positions = checked_positions(blocks, len(ids))
    delta = positions.max() + np.float32(1) - np.float32(len(ids))
    if np.array_equal(positions, np.round(positions)):
        return positions.astype(np.int64), int(delta)
    return positions, float(delta)


def media_rope_index(spec: RopeIndexSpec, token_ids: list[int], media: Any) -> tuple[np.ndarray, int | float]:
    """:func:`get_rope_index` of ``token_ids`` with the grids and audio lengths of ``media``, a
    processed prompt (:class:`~omni_jax.models.qwen2_5_omni.processor.OmniInputs`), as Qwen2.5-Omni's
    reads them."""
    return qwen2_5_rope_index.media_rope_index(spec, token_ids, media, get_rope_index)
