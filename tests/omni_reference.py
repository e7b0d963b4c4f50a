"""Reference-side helpers shared by the Qwen2.5-Omni end-to-end tests: media and the processor.

transformers' composite ``Qwen2_5OmniProcessor`` prepares the reference's inputs from the same
raw arrays our pipeline gets. With torchvision installed it is ``AutoProcessor``'s own; without
(these CPU machines: its video processor needs torchvision), :func:`pil_reference_processor`
assembles it from the PIL parts, our numpy frame path standing in for the video processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

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
