"""Reference-side helpers shared by the Qwen2.5-Omni end-to-end tests: media, the processor, and
streamed code2wav (:func:`chunked_reference`).

transformers' composite ``Qwen2_5OmniProcessor`` prepares the reference's inputs from the same
raw arrays our pipeline gets. With torchvision installed it is ``AutoProcessor``'s own; without
(these CPU machines: its video processor needs torchvision), :func:`pil_reference_processor`
assembles it from the PIL parts, our numpy frame path standing in for the video processor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from omni_jax.models.qwen2_5_omni.chunk_plan import ChunkPlanner
from omni_jax.models.qwen2_5_omni.processor import VideoProcessor
from omni_jax.testing import reference_omni_processor


def tone(seconds: float, freq: float, seed: int) -> np.ndarray:
    t = np.arange(int(16_000 * seconds)) / 16_000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * noise).astype(np.float32)


def picture(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


class StandInVideoProcessor:
    """Where the composite calls ``Qwen2VLVideoProcessor`` (torchvision): our numpy frame path."""

    valid_kwargs = None

    def __init__(self, ours: VideoProcessor):
        self.ours = ours
        self.merge_size = ours.merge_size
        self.temporal_patch_size = ours.temporal_patch_size
        self.calls: list[dict[str, Any]] = []

    def __call__(self, videos: list[np.ndarray], **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        out = [self.ours(v) for v in videos]
        return {
            "pixel_values_videos": np.concatenate([p for p, _ in out]),
            "video_grid_thw": np.array([g for _, g in out]),
        }


def pil_reference_processor(omni_dir: Path) -> Any:
    """The composite processor on the PIL image processor, with our numpy frame path standing in
    for its video processor: the reference for ``OmniProcessor(pixels="pil")``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return reference_omni_processor(
        omni_dir,
        StandInVideoProcessor(VideoProcessor.from_pretrained(omni_dir)),
        Qwen2VLImageProcessorPil.from_pretrained(omni_dir),
    )


def reference_processor(omni_dir: Path) -> Any:
    """The composite processor whose pixels our default backend reproduces: ``AutoProcessor``
    where torchvision is installed, else :func:`pil_reference_processor`."""
    from transformers.utils import is_torchvision_available

    return (
        reference_omni_processor(omni_dir)
        if is_torchvision_available()
        else pil_reference_processor(omni_dir)
    )


def reference_inputs(proc: Any, prompt: dict[str, Any]) -> Any:
    """The composite processor on one of our prompt dicts (same text, same raw arrays)."""
    data = prompt.get("multi_modal_data", {})
    kwargs = dict(prompt.get("mm_processor_kwargs", {}))
    call: dict[str, Any] = {"return_tensors": "pt"}
    if "fps" in kwargs:
        call["videos_kwargs"] = {"fps": kwargs["fps"]}
    if kwargs.get("use_audio_in_video"):
        call.update(use_audio_in_video=True, audio_from_video_indices=list(range(len(data["video"]))))
    return proc(
        text=prompt["prompt"],
        audio=data.get("audio"),
        images=data.get("image"),
        videos=data.get("video"),
        **call,
    )


def chunked_reference(
    t2w: Any,
    codes: np.ndarray,
    speaker: np.ndarray,
    ref_mel: np.ndarray,
    noise: np.ndarray,
    num_steps: int,
    guidance_scale: float,
    sway_coefficient: float,
    sizes: ChunkPlanner,
) -> list[np.ndarray]:
    """Qwen's streaming loop (vLLM fork ``process_chunk`` / ``process_chunk_for_50hz``) on
    transformers' ``Qwen2_5OmniToken2WavModel`` ``t2w``: its DiT's ``sample`` on each chunk's
    window, ``torch.randn`` replaced by the window's rows of ``noise`` (``[codes * repeats, mel]``),
    then its BigVGAN with the previous chunk's last ``2 * overlap`` kept frames before the kept
    ones. Returns the emitted pieces, in order. Only ``sizes``' chunk, first chunk, largest chunk,
    past, future and overlap are read (never its windows): the loop is written out here, with the
    first chunk ``first`` frames long (Qwen's loop: ``first == chunk``) and the others ``chunk``,
    doubling up to ``largest`` (Qwen's loop: ``largest == chunk``)."""
    chunk, past, future, overlap = sizes.chunk, sizes.past, sizes.future, sizes.overlap
    first, largest = sizes.first_chunk, sizes.largest_chunk
    repeats = t2w.config.dit_config.repeats
    hop = math.prod(t2w.config.bigvgan_config.upsample_rates)
    codes_t = torch.from_numpy(np.asarray(codes, np.int64))[None]
    cond, ref = torch.from_numpy(speaker)[None], torch.from_numpy(ref_mel)[None]
    n = repeats * codes_t.shape[1]
    out, prev, begin, p, final = [], None, 0, 0, False  # begin: the chunk's first kept frame
    while not final:
        size = first if p == 0 else min(chunk * 2 ** (p - 1), largest)
        final = n <= begin + size + future
        start = 0 if p == 0 else max(begin - past, 0)
        end = n if final else begin + size + future
        window = torch.from_numpy(noise[start:end][None].copy())
        with mock.patch.object(torch, "randn", lambda *a, window=window, **k: window), torch.no_grad():
            mel = t2w.code2wav_dit_model.sample(
                cond,
                ref,
                codes_t[:, start // repeats : end // repeats],
                num_steps,
                guidance_scale,
                sway_coefficient,
            )
            lo = begin - start
            keep = mel[..., lo:] if final else mel[..., lo : lo + size]  # [1, mel, K]
            voc_in = keep if p == 0 else torch.cat([prev[..., -2 * overlap :], keep], -1)
            wav = t2w.code2wav_bigvgan_model(voc_in).numpy()
        out.append(wav[(0 if p == 0 else overlap * hop) : (len(wav) if final else len(wav) - overlap * hop)])
        prev, begin, p = keep, begin + size, p + 1
    return out


def spoken(model: Any, inputs: Any, **generate: Any) -> tuple[Any, Any, Any]:
    """``(reply ids [R], codec frames [groups, frames], waveform [S])`` of transformers'
    ``Qwen3OmniMoeForConditionalGeneration.generate(**inputs, return_audio=True, **generate)``
    for one request; the frames are what ``generate`` hands ``code2wav.chunked_decode`` (spied)."""
    handed: list[torch.Tensor] = []
    decode = model.code2wav.chunked_decode

    def spy(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        handed.append(codes)
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = spy
    try:
        with torch.no_grad():
            ids, wav = model.generate(**inputs, return_audio=True, **generate)
    finally:
        del model.code2wav.chunked_decode
    return ids[0, inputs["input_ids"].shape[1] :], handed[0][0], wav.reshape(-1)
