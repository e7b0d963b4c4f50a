"""3-D M-RoPE position ids of one Qwen2.5-Omni thinker prompt, on the host in numpy.

The thinker rotates text tokens by their running index but vision tokens by (time, row,
column) and audio tokens by time, so a prompt's positions depend on its placeholder layout
and the grids of its images and videos. This reproduces the reference
``get_rope_index`` exactly, quirks included (each span starts one past the *last* span's
maximum, not the running maximum; audio-in-video chunks advance one chunk per token), so
the positions the engine feeds equal the ones transformers computes. Decoding continues at
``token index + rope_delta`` on all three axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths


@dataclasses.dataclass(frozen=True)
class RopeIndexSpec:
    """The token ids and timing constants of a ``Qwen2_5OmniThinkerConfig`` the index needs."""

    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: int
    seconds_per_chunk: float

    @classmethod
    def from_hf(cls, cfg: Any) -> RopeIndexSpec:
        """From a thinker config, or a talker config (it has the same ids and constants, but
        ``spatial_merge_size`` at the top level as it has no vision tower)."""
        vision = getattr(cfg, "vision_config", None)
        merge = cfg.spatial_merge_size if vision is None else vision.spatial_merge_size
        return cls(
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            audio_token_id=cfg.audio_token_id,
            vision_start_token_id=cfg.vision_start_token_id,
            audio_start_token_id=cfg.audio_start_token_id,
            spatial_merge_size=merge,
            position_id_per_seconds=cfg.position_id_per_seconds,
            seconds_per_chunk=cfg.seconds_per_chunk,
        )

    @property
    def tokens_per_chunk(self) -> int:
        return int(self.position_id_per_seconds * self.seconds_per_chunk)


def run_positions(length: int, start: Any, dtype: type = np.int64) -> np.ndarray:
    """``[3, length]`` positions ``start, start + 1, ...`` on every axis (text, audio, bos/eos),
    in ``dtype`` (Qwen3-Omni's are float32). A new array: a decode row's positions are made
    every step, and repeating a row costs a fraction of broadcasting and copying it."""
    return (np.arange(length, dtype=dtype) + start)[None].repeat(3, axis=0)


def vision_positions(
    start: Any, t_index: np.ndarray, grid_h: int, grid_w: int, merge: int, dtype: type = np.int64
) -> np.ndarray:
    """``[3, t * h * w]`` (time, row, column) of merged vision tokens, frame-major as the encoder
    emits them, each axis plus ``start`` (the reference's ``get_llm_pos_ids_for_vision``), in
    ``dtype``."""
    h, w = grid_h // merge, grid_w // merge
    t_pos = np.repeat(t_index.astype(dtype), h * w)
    h_pos = np.tile(np.repeat(np.arange(h, dtype=dtype), w), len(t_index))
    w_pos = np.tile(np.arange(w, dtype=dtype), len(t_index) * h)
    return np.stack([t_pos, h_pos, w_pos]) + start


def checked_positions(blocks: Sequence[np.ndarray], tokens: int) -> np.ndarray:
    """``[3, tokens]``: the position ``blocks`` one after another, refused unless they cover the
    prompt's ``tokens`` exactly (its placeholders and multimodal inputs disagree)."""
    positions = np.concatenate(blocks, axis=1)
    if positions.shape[1] != tokens:
        raise ValueError(
            f"placeholders do not match the multimodal inputs: {positions.shape[1]} positions "
            f"for {tokens} tokens"
        )
    return positions


def _video_t_index(grid_t: int, second_per_grid: float, spec: RopeIndexSpec) -> np.ndarray:
    """Temporal positions of a video's frames, truncated from float32 arithmetic as the reference."""
    seconds = np.arange(grid_t).astype(np.float32) * np.float32(second_per_grid)
    return (seconds * np.float32(spec.position_id_per_seconds)).astype(np.int64)


def chunk_bounds(first_axis: np.ndarray, tokens_per_chunk: int, origin: int) -> list[tuple[int, int]]:
    """``(start, end)`` runs of ``first_axis`` by time chunk; a new chunk opens at most once per token."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(first_axis):
        if value - origin >= chunk * tokens_per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(first_axis)))
    return bounds


def media_lists(
    image_grid_thw: Sequence[Sequence[int]] | None,
    video_grid_thw: Sequence[Sequence[int]] | None,
    second_per_grid_ts: Sequence[float] | None,
    audio_seqlens: Sequence[int] | None,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[float], list[int]]:
    """:func:`get_rope_index`'s media arguments as lists (grids as int tuples; None: empty)."""
    images = [tuple(int(v) for v in g) for g in image_grid_thw or ()]
    videos = [tuple(int(v) for v in g) for g in video_grid_thw or ()]
    return images, videos, list(second_per_grid_ts or ()), list(audio_seqlens or ())


def count_spans(spec: Any, ids: list[int], use_audio_in_video: bool) -> tuple[int, int, int, int]:
    """``(images, videos, audios, spans)`` of a prompt as the reference counts them: images and
    videos by the token after each vision start (a video with its audio track by its audio
    start there), audios by their start tokens, and the spans its loop walks (a video's track
    is no span of its own). ``spec``: this family's :class:`RopeIndexSpec` or Qwen3-Omni's."""
    after_vision_start = [ids[i + 1] for i, t in enumerate(ids[:-1]) if t == spec.vision_start_token_id]
    images = after_vision_start.count(spec.image_token_id)
    video_marker = spec.audio_start_token_id if use_audio_in_video else spec.video_token_id
    videos = after_vision_start.count(video_marker)
    audios = ids.count(spec.audio_start_token_id)
    return images, videos, audios, images + audios + (0 if use_audio_in_video else videos)


def get_rope_index(
    spec: RopeIndexSpec,
    input_ids: Sequence[int],
    *,
    image_grid_thw: Sequence[Sequence[int]] | None = None,
    video_grid_thw: Sequence[Sequence[int]] | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
    audio_seqlens: Sequence[int] | None = None,
    use_audio_in_video: bool = False,
) -> tuple[np.ndarray, int]:
    """``(positions [3, T] int64, rope_delta)`` for one prompt, as the reference computes them.

    ``image_grid_thw``/``video_grid_thw`` are the (t, h, w) patch grids of the prompt's images
    and videos in order, ``second_per_grid_ts`` each video's seconds per temporal grid step,
    ``audio_seqlens`` each audio's mel frame count (``feature_attention_mask.sum(-1)``).
    Position ``p`` of generated token ``i`` (0-based in the whole sequence) is ``i + rope_delta``.
    """
    ids = [int(t) for t in input_ids]
    if not image_grid_thw and not video_grid_thw:
        return run_positions(len(ids), 0), 0
    images, videos, seconds, audios = media_lists(
        image_grid_thw, video_grid_thw, second_per_grid_ts, audio_seqlens
    )
    merge = spec.spatial_merge_size
    remain_images, remain_videos, remain_audios, spans = count_spans(spec, ids, use_audio_in_video)

    blocks: list[np.ndarray] = []

    def next_start() -> int:
        return int(blocks[-1].max()) + 1 if blocks else 0

    def add_text(length: int) -> None:
        if length != 0:
            blocks.append(run_positions(length, next_start()))

    def find(token: int, remain: int, st: int) -> int:
        return ids.index(token, st) if remain > 0 and token in ids else len(ids) + 1

    st = image_idx = video_idx = audio_idx = 0
    for _ in range(spans):
        ed_image = find(spec.image_token_id, remain_images, st)
        ed_video = find(spec.video_token_id, remain_videos, st)
        ed_audio = find(spec.audio_token_id, remain_audios, st)
        first = min(ed_image, ed_video, ed_audio)
        if first == ed_audio:
            text_len = first - st - 1
            add_text(text_len)
            blocks.append(run_positions(1, next_start()))
            audio_len = audio_output_lengths(int(audios[audio_idx]))[1]
            blocks.append(run_positions(audio_len, next_start()))
            blocks.append(run_positions(1, next_start()))
            st += text_len + 1 + audio_len + 1
            audio_idx, remain_audios = audio_idx + 1, remain_audios - 1
        elif first == ed_image:
            text_len = first - st - 1
            add_text(text_len)
            blocks.append(run_positions(1, next_start()))
            t, h, w = images[image_idx]
            t_index = np.arange(t, dtype=np.int64) * spec.position_id_per_seconds
            blocks.append(vision_positions(next_start(), t_index, h, w, merge))
            blocks.append(run_positions(1, next_start()))
            st += text_len + 1 + t * h * w // merge**2 + 1
            image_idx, remain_images = image_idx + 1, remain_images - 1
        elif not use_audio_in_video:
            text_len = first - st - 1
            add_text(text_len)
            blocks.append(run_positions(1, next_start()))
            t, h, w = videos[video_idx]
            t_index = _video_t_index(t, seconds[video_idx], spec)
            blocks.append(vision_positions(next_start(), t_index, h, w, merge))
            blocks.append(run_positions(1, next_start()))
            st += text_len + 1 + t * h * w // merge**2 + 1
            video_idx, remain_videos = video_idx + 1, remain_videos - 1
        else:
            text_len = first - st - 2
            add_text(text_len)
            bos = run_positions(1, next_start())
            blocks += [bos, bos]
            origin = next_start()
            audio_len = audio_output_lengths(int(audios[audio_idx]))[1]
            audio_pos = run_positions(audio_len, origin)
            t, h, w = videos[video_idx]
            video_pos = vision_positions(origin, _video_t_index(t, seconds[video_idx], spec), h, w, merge)
            video_chunks = chunk_bounds(video_pos[0], spec.tokens_per_chunk, origin)
            audio_chunks = chunk_bounds(audio_pos[0], spec.tokens_per_chunk, origin)
            for j in range(max(len(video_chunks), len(audio_chunks))):
                if j < len(video_chunks):
                    blocks.append(video_pos[:, slice(*video_chunks[j])])
                if j < len(audio_chunks):
                    blocks.append(audio_pos[:, slice(*audio_chunks[j])])
            eos = run_positions(1, next_start())
            blocks += [eos, eos]
            st += text_len + 2 + audio_len + t * h * w // merge**2 + 2
            audio_idx, video_idx = audio_idx + 1, video_idx + 1
            remain_audios, remain_videos = remain_audios - 1, remain_videos - 1
    if st < len(ids):
        blocks.append(run_positions(len(ids) - st, next_start()))
    positions = checked_positions(blocks, len(ids))
    return positions, int(positions.max()) + 1 - len(ids)


def positions_for(prompt_positions: np.ndarray, rope_delta: int, start: int, end: int) -> np.ndarray:
    """``[3, end - start]`` positions of tokens ``[start, end)`` of a sequence with this prompt.

    Prompt tokens keep their M-RoPE positions; generated ones (also when a preempted request
    is recomputed) sit at ``index + rope_delta`` on every axis, as in the reference decode.
    """
    p = prompt_positions.shape[1]
    if start >= p:  # generated tokens alone (every decode row): nothing to join
        return run_positions(end - start, start + rope_delta)
    generated = run_positions(max(end - p, 0), p + rope_delta)
    return np.concatenate([prompt_positions[:, start : min(end, p)], generated], axis=1)


def media_rope_index(
    spec: Any, token_ids: list[int], media: Any, rope_index: Callable[..., Any] | None = None
) -> Any:
    """:func:`get_rope_index` (or ``rope_index``, another family's with its keywords, e.g.
    Qwen3-Omni's) of ``token_ids`` with the grids and audio lengths of ``media``, a processed
    prompt (:class:`~omni_jax.models.qwen2_5_omni.processor.OmniInputs`): the thinker indexes
    its prompt so, the talker its prompt followed by its own two tokens."""
    return (rope_index or get_rope_index)(
        spec,
        token_ids,
        image_grid_thw=media.image_grid_thw,
        video_grid_thw=media.video_grid_thw,
        second_per_grid_ts=media.video_second_per_grid,
        audio_seqlens=media.audio_seqlens,
        use_audio_in_video=media.use_audio_in_video,
    )
