"""Qwen3-Omni thinker inputs: Qwen2.5-Omni's processor (:mod:`omni_jax.models.qwen2_5_omni.processor`)
with what ``Qwen3OmniMoeProcessor`` does differently.

- An audio clip expands to ``_get_feat_extract_output_lengths(frames, n_window=50)`` tokens (13
  a 100-frame chunk; :func:`~omni_jax.models.qwen3_omni.rope_index.audio_token_count`).
- The feature extractor pads the prompt's clips to the longest of them, not to its whole
  window (``padding=True``, ``truncation=False``), which changes the last frames of the
  longest clip (its STFT reflects at its end instead of reading zeros); and a clip longer than
  the window (``chunk_length``) is featurised whole, not refused: only ``max_model_len`` bounds
  it.
- A video with its audio track interleaves the two token by token: a video token goes first
  while its frame's time (``t * seconds_per_grid * 13``) is at most the next audio token's
  index; Qwen2.5-Omni's interleaves 2-second chunks at 25 positions a second.
- Frames are taken to be sampled at 1 fps when no ``fps`` is given (Qwen2.5-Omni: 2), so a
  grid step of ``temporal_patch_size`` frames lasts 2 s, and the video pixel bounds are those
  of 32-pixel merge blocks (``128 * 32 * 32`` to ``768 * 32 * 32``).

Everything else (checks, images, the placeholder order, :class:`OmniInputs`) is Qwen2.5-Omni's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.models.qwen2_5_omni.processor import (
    SAMPLE_RATE,
    OmniProcessor,
    PixelBackend,
    TorchvisionVideoProcessor,
    VideoProcessor,
)
from omni_jax.models.qwen3_omni.rope_index import audio_token_count

AUDIO_N_WINDOW = 50
"""The audio window the processor counts tokens with (``Qwen3OmniMoeProcessor.n_window``)."""

POSITION_ID_PER_SECONDS = 13.0
"""Time positions a second that audio-in-video interleaving compares frames and audio tokens
by (``Qwen3OmniMoeProcessor.position_id_per_seconds``)."""

DEFAULT_VIDEO_FPS = 1.0
"""Frames per second a video is taken to be sampled at when none is given (the composite's default)."""

VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
"""Pixel bounds the composite passes to its video processor on every call
(``Qwen3OmniMoeProcessor.videos_kwargs``)."""


class Qwen3TorchvisionVideoProcessor(TorchvisionVideoProcessor):
    """transformers' ``Qwen2VLVideoProcessor`` called with Qwen3-Omni's :data:`VIDEO_SIZE`."""

    size = VIDEO_SIZE


class Qwen3OmniProcessor(OmniProcessor):
    """``Qwen3OmniMoeProcessor``'s job from the checkpoint's own files (module docstring)."""

    default_fps = DEFAULT_VIDEO_FPS

    @classmethod
    def from_pretrained(
        cls, path: str | Path, tokenizer: Any = None, pixels: PixelBackend | None = None
    ) -> Qwen3OmniProcessor:
        """Qwen2.5-Omni's parts from ``path``, the video processor's bounds made Qwen3-Omni's."""
        processor = super().from_pretrained(path, tokenizer, pixels)
        video = processor.video_processor
        if isinstance(video, VideoProcessor):
            bounds = dict(min_pixels=VIDEO_SIZE["shortest_edge"], max_pixels=VIDEO_SIZE["longest_edge"])
            processor.video_processor = dataclasses.replace(video, **bounds)
        else:
            processor.video_processor = Qwen3TorchvisionVideoProcessor(video.processor)
        return processor

    @property
    def max_audio_samples(self) -> None:
        """None: a clip of any length is featurised whole, as ``Qwen3OmniMoeProcessor`` does
        (``truncation=False``); what bounds it is the prompt's ``max_model_len``, and its encoder
        takes it across several calls (:func:`~omni_jax.models.qwen3_omni.audio_encoder.window_pieces`)."""
        return None

    def audio_features(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``[mel, frames]`` per audio, the extractor called as the composite calls it (padded to
        the longest clip, nothing truncated), cut to the frames its attention mask keeps.

        The extractor's STFT reflects half a window at each edge, which needs more samples than
        that: ``ValueError`` when even the longest clip is shorter (the reference raises torch's
        padding error, the request could not run there either)."""
        longest, half_window = max(len(a) for a in audios), self.feature_extractor.n_fft // 2
        if longest <= half_window:
            raise ValueError(
                f"audio is {longest} samples long ({longest / SAMPLE_RATE * 1000:g} ms at {SAMPLE_RATE} Hz); "
                f"the feature extractor needs more than {half_window} samples in the longest clip"
            )
        out = self.feature_extractor(
            list(audios),
            sampling_rate=SAMPLE_RATE,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="np",
        )
        frames = out["attention_mask"].sum(-1)
        return [np.asarray(f[:, :n], np.float32) for f, n in zip(out["input_features"], frames, strict=True)]

    def interleaved(self, grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int) -> list[int]:
        """A video's placeholder with its audio track: ``audio_bos``, the video and audio tokens
        merged by time (a video token first on a tie), ``audio_eos`` (the reference's
        ``replace_video_with_audio_token``, in its float64 arithmetic)."""
        video_time = self.video_token_times(grid, second_per_grid, POSITION_ID_PER_SECONDS)
        times = np.concatenate([video_time, np.arange(audio_tokens)])
        is_audio = np.concatenate([np.zeros(video_time.size, bool), np.ones(audio_tokens, bool)])
        order = np.lexsort((is_audio, times))
        tokens = np.where(is_audio[order], self.audio_id, self.video_id)
        return [self.audio_bos_id, *tokens.tolist(), self.audio_eos_id]

    def audio_tokens(self, frames: int) -> int:
        """Placeholder tokens of an audio clip: Qwen3-Omni's count (13 a 100-frame chunk)."""
        return audio_token_count(frames, AUDIO_N_WINDOW)
