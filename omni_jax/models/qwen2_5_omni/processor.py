"""Qwen2.5-Omni thinker inputs: raw audio, images and videos -> encoder features + expanded ids.

transformers' composite ``Qwen2_5OmniProcessor`` cannot be built without torchvision (its video
processor needs it), so this composes the parts, each with transformers' own class from the
checkpoint dir: ``WhisperFeatureExtractor`` (log-mel audio), the image processor and the
tokenizer. What the composite adds on top is written here, following its code: the call
arguments it passes to each part, the placeholder expansion (one ``<|AUDIO|>`` / ``<|IMAGE|>`` /
``<|VIDEO|>`` becomes one token per encoder output row; with ``use_audio_in_video`` a video's
placeholder becomes its frames' and its audio track's tokens interleaved in 2-second chunks).

Pixels follow the backend transformers itself would pick. With torchvision installed (what
``AutoProcessor`` then builds): its torchvision image processor and ``Qwen2VLVideoProcessor``.
Without: ``Qwen2VLImageProcessorPil`` and :class:`VideoProcessor`, a numpy port of the video
processor on PIL's bicubic filter. The two resamplers round differently (a uint8 level or two
on some pixels), so matching transformers exactly means resampling the way it would in the
same environment.

Expansion works on token ids rather than text: the placeholders are special tokens, so the
tokenizer splits text at them and expanding before or after tokenizing gives the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from omni_jax.audio_io import check_clip, read_audio_file, resample
from omni_jax.image_io import ImageItemError, composite_rgb, composite_rgb_array, read_image
from omni_jax.media_files import VideoFile, decode_video_file
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths
from omni_jax.models.qwen2_5_omni.rope_index import chunk_bounds
from omni_jax.models.tokenizer import load_tokenizer, no_tokenizer
from omni_jax.video_io import NPY_MAGIC, read_frames

SAMPLE_RATE = 16_000
"""The feature extractor's (and so every audio input's) sampling rate."""

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest magnitude a media value may have: what float32, the encoders' dtype, holds."""

DEFAULT_VIDEO_FPS = 2.0
"""Frames per second a video's frames are assumed to be sampled at, as the reference assumes
when none is given (it is not saved in the official checkpoint)."""

VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
"""Pixel bounds the composite processor passes to its video processor on every call
(``Qwen2_5OmniProcessor.videos_kwargs``), whatever the checkpoint's own config says."""

MAX_VIDEO_FILE_FRAMES = 768
"""The most frames a video file is sampled to when the caller names no context (``max_tokens``):
Qwen's own ``qwen-omni-utils`` caps a video at as many (its ``FPS_MAX_FRAMES``)."""

SECONDS_PER_CHUNK = 2.0
POSITION_ID_PER_SECONDS = 25
"""Audio-in-video interleaving constants (``Qwen2_5OmniProcessor`` class defaults)."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def least_video_tokens(frames: int, temporal_patch: int, min_pixels: int, patch: int, merge: int) -> int:
    """The fewest placeholder tokens a video of ``frames`` frames expands to, from its frame count
    alone: every frame pair (``temporal_patch``) is resized to at least ``min_pixels``, each
    ``(patch * merge)**2`` of them one token. Known before any frame is resized, so that a video
    no prompt could hold is refused without paying for its frames."""
    return -(-frames // temporal_patch) * -(-min_pixels // (patch * merge) ** 2)


@dataclasses.dataclass(frozen=True)
class VideoProcessor:
    """``Qwen2VLVideoProcessor`` for frame arrays, in numpy (frames are used as given, no sampling).

    Per video: every frame resized to one :func:`smart_resize` size with PIL's bicubic filter
    (the PIL backend's resampling; see the module docstring for torchvision's), rescale and
    normalise fused as the reference does (``(x - mean / scale) / (std / scale)`` in float32),
    the last frame repeated up to a multiple of ``temporal_patch_size``, then patches in the
    reference's order (merge blocks, then channel, time, rows, columns).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    min_pixels: int = VIDEO_SIZE["shortest_edge"]
    max_pixels: int = VIDEO_SIZE["longest_edge"]

    def least_tokens(self, frames: int) -> int:
        """:func:`least_video_tokens` of a video of ``frames`` frames."""
        return least_video_tokens(
            frames, self.temporal_patch_size, self.min_pixels, self.patch_size, self.merge_size
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VideoProcessor:
        """Patch geometry and normalisation from the checkpoint (``video_preprocessor_config.json``,
        else ``preprocessor_config.json``, as ``AutoVideoProcessor`` reads them); the size bounds are
        the composite processor's :data:`VIDEO_SIZE`, which override the file on every call."""
        path = Path(path)
        cfg: dict[str, Any] = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (path / name).exists():
                cfg = json.loads((path / name).read_text())
                break
        if cfg.get("do_resize", True) is False or cfg.get("do_normalize", True) is False:
            raise ValueError(f"{path}: video processing without resize/normalize is not supported")
        if cfg.get("do_rescale", True) is False:
            raise ValueError(f"{path}: video processing without rescale is not supported")
        fields = {f.name for f in dataclasses.fields(cls)} - {"min_pixels", "max_pixels"}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in fields}
        return cls(**kw)

    def resize_target(self, height: int, width: int) -> tuple[int, int]:
        """The reference's own ``smart_resize`` (sides multiples of patch * merge, area in bounds)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def __call__(self, video: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``(patches [t*h*w, C*T*P*P] float32, grid (t, h, w))`` for frames ``[T, H, W, C]``."""
        from PIL import Image

        frames, height, width, channels = video.shape
        new_h, new_w = self.resize_target(height, width)
        resized = np.empty((frames, channels, new_h, new_w), np.float32)
        for i, frame in enumerate(video):
            if frame.dtype == np.uint8:
                img = Image.fromarray(frame if channels == 3 else frame[..., 0])
                out = np.asarray(img.resize((new_w, new_h), resample=Image.BICUBIC), np.float32)
                resized[i] = out.reshape(new_h, new_w, channels).transpose(2, 0, 1)
            else:
                for c in range(channels):
                    img = Image.fromarray(np.ascontiguousarray(frame[..., c], np.float32), mode="F")
                    resized[i, c] = np.asarray(img.resize((new_w, new_h), resample=Image.BICUBIC))
        scale = np.float32(1.0 / self.rescale_factor)
        mean = np.asarray(self.image_mean, np.float32) * scale
        std = np.asarray(self.image_std, np.float32) * scale
        normed = (resized - mean[:, None, None]) / std[:, None, None]
        if pad := -frames % self.temporal_patch_size:
            normed = np.concatenate([normed, np.repeat(normed[-1:], pad, axis=0)])
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        gt, gh, gw = normed.shape[0] // tp, new_h // p, new_w // p
        x = normed.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(gt * gh * gw, channels * tp * p * p)), (gt, gh, gw)


@dataclasses.dataclass
class OmniInputs:
    """One prompt, processed: expanded ids and what each encoder reads, in placeholder order.

    ``audio_features[i]`` is ``[mel, frames]`` (only the real frames of the padded log-mel);
    with ``use_audio_in_video`` the audios are the videos' tracks, ``audio_features[i]``
    belonging to video ``i``.
    """

    input_ids: list[int]
    audio_features: list[np.ndarray] = dataclasses.field(default_factory=list)
    image_patches: list[np.ndarray] = dataclasses.field(default_factory=list)
    image_grid_thw: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    video_patches: list[np.ndarray] = dataclasses.field(default_factory=list)
    video_grid_thw: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    video_second_per_grid: list[float] = dataclasses.field(default_factory=list)
    use_audio_in_video: bool = False

    @property
    def audio_seqlens(self) -> list[int]:
        return [f.shape[1] for f in self.audio_features]

    @property
    def has_media(self) -> bool:
        return bool(self.audio_features or self.image_patches or self.video_patches)


def _fail(index: int, message: str) -> ValueError:
    return ValueError(f"request {index}: {message}")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def read_audio(index: int, path: str | Path, max_seconds: float | None = None) -> np.ndarray:
    """An audio file (WAV, or any FFmpeg reads) as float32 mono at 16 kHz
    (:func:`omni_jax.audio_io.read_audio_file`)."""
    path = Path(path)
    if not path.is_file():
        raise _fail(index, f"audio file {str(path)!r} does not exist")
    try:
        return read_audio_file(path, SAMPLE_RATE, max_seconds)
    except ValueError as e:
        raise _fail(index, f"audio file {str(path)!r} {e}") from None


def _describe(item: Any) -> str:
    shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
    return type(item).__name__ + ("" if shape is None else f" of shape {shape}, dtype {dtype}")


def _check_finite(index: int, kind: str, array: np.ndarray) -> None:
    """Finite values, within float32's range: the encoders read media in float32, where a float64
    ``1e300`` becomes ``inf`` (non-finite logits at run time, where it is refused here)."""
    if not np.issubdtype(array.dtype, np.floating):
        return
    if not np.isfinite(array).all():
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise _fail(index, f"{kind} contains {bad} non-finite value(s) (NaN or inf)")
    if array.dtype.itemsize <= 4:  # float32 and narrower hold nothing past float32's range
        return
    largest = float(np.abs(array).max())
    if largest > FLOAT32_MAX:
        raise _fail(index, f"{kind} holds values past float32's range (largest magnitude {largest:.3g})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_rated(value: Any) -> bool:
    """vLLM's ``(clip, sample_rate)`` form of one clip."""
    return isinstance(value, tuple) and len(value) == 2 and _is_number(value[1])


def _is_numbers(value: Any) -> bool:
    """A clip given as a list of numbers."""
    return isinstance(value, list) and bool(value) and all(_is_number(x) for x in value)


def _audio_items(value: Any) -> list[Any]:
    """A ``multi_modal_data["audio"]`` value as its clips, read as vLLM reads it: a
    ``(clip, sample_rate)`` tuple, or a list of numbers, is one clip; otherwise a list or tuple
    holds clips, and anything else is one clip."""
    return [value] if _is_rated(value) or _is_numbers(value) else _as_list(value)


def _audio_item(
    index: int, item: Any, max_samples: int | None, track: bool, fills: str | None = None
) -> np.ndarray:
    """A 1-D real float array at 16 kHz (or a list of numbers; or a ``(clip, sample_rate)``
    tuple, resampled as an audio file is; or an audio file's path or bytes: WAV, mp3, flac, ...), not empty,
    finite, at most ``max_samples`` long. ``track``: the clip is a video's one audio track
    (``use_audio_in_video``), so a longer one is refused with advice to split the video, not
    the clip. ``fills``: ``max_samples`` is not the extractor's window but the longest clip
    whose own tokens stay under this context (what it names): a file past it is refused from
    its header (over the seconds it may last) before it is decoded or resampled. Integer arrays
    are refused: their scale (PCM, or values already in [-1, 1]) would be a guess, and
    transformers' feature extractor takes them unscaled."""
    max_seconds = None if max_samples is None else max_samples / SAMPLE_RATE
    rate = SAMPLE_RATE
    if _is_rated(item):
        item, rate = item
        if not (np.isfinite(rate) and rate == int(rate)):
            raise _fail(index, f"audio sample rate must be a whole number of Hz, got {rate!r}")
        rate = int(rate)
    if _is_numbers(item):
        item = np.asarray(item, np.float32)
    if isinstance(item, (str, Path)) and rate == SAMPLE_RATE:
        audio = read_audio(index, item, max_seconds)
    elif isinstance(item, bytes) and rate == SAMPLE_RATE:
        try:
            audio = read_audio_file(item, SAMPLE_RATE, max_seconds)
        except ValueError as e:
            raise _fail(index, f"audio (file bytes) {e}") from None
    elif isinstance(item, np.ndarray) and item.ndim == 1 and np.issubdtype(item.dtype, np.floating):
        audio = item
    else:
        raise _fail(
            index,
            f"audio must be a 1-D float array at {SAMPLE_RATE} Hz (or a (array, sample_rate) tuple), "
            f"an audio file's path or bytes, got {_describe(item)}",
        )
    if audio.size == 0:
        raise _fail(index, "audio is empty")
    _check_finite(index, "audio", audio)
    if rate != SAMPLE_RATE:
        try:
            check_clip(audio.size, rate, max_seconds)
        except ValueError as e:
            raise _fail(index, f"audio {e}") from None
        audio = resample(audio.astype(np.float32, copy=False), rate, SAMPLE_RATE)
    if max_samples is not None and audio.size > max_samples:
        if fills is not None:
            raise _fail(
                index,
                f"audio is {audio.size / SAMPLE_RATE:.2f} s long ({audio.size} samples at {SAMPLE_RATE} Hz), "
                f"over the {max_samples / SAMPLE_RATE:g} s it may last (its audio tokens alone would fill "
                f"{fills})",
            )
        most = f"{max_samples / SAMPLE_RATE:g} s"
        shorten = (
            f"with use_audio_in_video a video has exactly one audio track, so split the video into videos "
            f"of at most {most}"
            if track
            else f"split it into several audio items of at most {most}"
        )
        raise _fail(
            index,
            f"audio is {audio.size / SAMPLE_RATE:.2f} s long ({audio.size} samples at {SAMPLE_RATE} Hz); "
            f"clips are taken up to the feature extractor's window of {most} ({max_samples} samples, its "
            f"chunk_length), refused past it rather than cut: {shorten}",
        )
    return audio.astype(np.float32, copy=False)


def _pixel_array(index: int, kind: str, item: np.ndarray) -> None:
    """Integer or real float pixels (PIL's and the image processor's), every dimension non-empty, finite."""
    if item.dtype == bool or not (
        np.issubdtype(item.dtype, np.integer) or np.issubdtype(item.dtype, np.floating)
    ):
        raise _fail(index, f"{kind} pixels must be integers or real floats, got dtype {item.dtype}")
    if min(item.shape) < 1:
        raise _fail(index, f"{kind} has an empty dimension: shape {item.shape}")
    _check_finite(index, kind, item)


IMAGE_CHANNELS = (1, 3, 4)
"""Channels an image array may have: grey, RGB, RGBA."""


def _rgb_array(index: int, item: np.ndarray) -> np.ndarray:
    """An image array as ``[H, W, 3]``, channels as transformers' image processor makes them:
    grey repeated, alpha composited onto white (:func:`~omni_jax.image_io.composite_rgb_array`).
    ``[H, W, C]`` wins over ``[C, H, W]`` whenever the last axis is a channel count, so a tiny
    ``(1, 1, 3)`` picture is one RGB pixel (transformers' own guess reads it channels-first)."""
    if item.ndim == 2:
        item = item[..., None]
    elif item.shape[-1] not in IMAGE_CHANNELS:
        item = item.transpose(1, 2, 0)
    if item.shape[-1] == 1:
        return np.repeat(item, 3, axis=-1)
    if item.shape[-1] == 4:
        try:
            return composite_rgb_array(item)
        except ValueError as e:
            raise _fail(index, f"image: {e}") from None
    return item


def _image_shaped(item: Any) -> bool:
    """An ``[H, W, C]`` or ``[C, H, W]`` array with C in :data:`IMAGE_CHANNELS`."""
    return (
        isinstance(item, np.ndarray)
        and item.ndim == 3
        and (item.shape[-1] in IMAGE_CHANNELS or item.shape[0] in IMAGE_CHANNELS)
    )


def _image_item(index: int, item: Any) -> Any:
    """A PIL image (RGB) or an ``[H, W, 3]`` array (:func:`_rgb_array`), checked; a path is
    read as transformers' ``load_image`` reads it (:mod:`omni_jax.image_io`)."""
    from PIL import Image

    if isinstance(item, (str, Path)):
        if not Path(item).exists():
            raise _fail(index, f"image file {str(item)!r} does not exist")
        try:
            return read_image(item)
        except (OSError, Image.DecompressionBombError) as e:  # not an image PIL can read, or a bomb
            raise _fail(index, f"image file {str(item)!r} cannot be read: {e}") from None
        except Exception as e:  # noqa: BLE001 - PIL's parsers raise what they like on bad bytes
            raise _fail(index, f"image file {str(item)!r} cannot be read: {type(e).__name__}: {e}") from None
    if isinstance(item, Image.Image):
        if min(item.size) < 1:
            raise _fail(index, f"image has an empty dimension: size {item.size}")
        return composite_rgb(item)
    if not (isinstance(item, np.ndarray) and (item.ndim == 2 or _image_shaped(item))):
        raise _fail(
            index,
            "image must be a PIL image, an array [H, W], [H, W, C] or [C, H, W] with C in (1, 3, 4), "
            f"or a path; got {_describe(item)}",
        )
    _pixel_array(index, "image", item)
    return _rgb_array(index, item)


def _is_frame(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def _video_items(value: Any) -> list[Any]:
    """A ``multi_modal_data["video"]`` value as its videos, read as vLLM reads it: a list of PIL
    images is one video; otherwise a list or tuple holds videos (each an array, or a list of
    frames), and anything else is one video."""
    from PIL import Image

    pil = isinstance(value, (list, tuple)) and bool(value) and all(isinstance(f, Image.Image) for f in value)
    return [value] if pil else _as_list(value)


ITEMS: dict[str, Callable[[Any], list[Any]]] = {
    "audio": _audio_items,
    "image": _as_list,
    "video": _video_items,
}
"""How each ``multi_modal_data`` value splits into its items."""


def _is_file(value: Any) -> bool:
    """A video given as a file: its path, or its bytes."""
    return isinstance(value, (str, Path, bytes))


def _video_file(
    index: int,
    v: int,
    item: str | Path | bytes,
    fps: float,
    most: int,
    track: bool,
    track_seconds: float | None,
) -> VideoFile:
    """Video ``v`` of request ``index`` read from its file: a ``.npy`` array of frames
    (:func:`~omni_jax.video_io.read_frames`), any other video sampled at ``fps``
    (:func:`~omni_jax.media_files.decode_video_file`, at most ``most`` frames; with ``track``
    also its audio track, at most ``track_seconds`` long)."""
    name = "bytes" if isinstance(item, bytes) else f"file {str(item)!r}"
    if not isinstance(item, bytes):
        if not Path(item).is_file():
            raise _fail(index, f"video {v}: {name} does not exist")
        with open(item, "rb") as f:
            npy = f.read(len(NPY_MAGIC)) == NPY_MAGIC or Path(item).suffix.lower() == ".npy"
    else:
        npy = item.startswith(NPY_MAGIC)
    try:
        if npy:
            return VideoFile(read_frames(item if isinstance(item, bytes) else Path(item).read_bytes()))
        return decode_video_file(item, fps, most, track=track, max_track_seconds=track_seconds)
    except ValueError as e:
        raise _fail(index, f"video {v} ({name}) {e}") from None


def _stacked_frames(index: int, frames: Sequence[Any]) -> np.ndarray:
    """A video given frame by frame as one ``[frames, H, W, 3]`` array: PIL frames as RGB
    (:func:`~omni_jax.image_io.composite_rgb`), array frames as images are (:func:`_rgb_array`)."""
    from PIL import Image

    rgb = []
    for frame in frames:
        if isinstance(frame, Image.Image):
            rgb.append(np.asarray(composite_rgb(frame)))
        elif _image_shaped(frame):
            _pixel_array(index, "video frame", frame)
            rgb.append(_rgb_array(index, frame))
        else:
            raise _fail(
                index,
                f"a video frame must be a PIL image or an array [H, W, C] or [C, H, W] with C in "
                f"{IMAGE_CHANNELS}, got {_describe(frame)}",
            )
    shapes = sorted({f.shape for f in rgb})
    if len(shapes) > 1 or len({f.dtype for f in rgb}) > 1:
        raise _fail(index, f"video frames must share one shape and dtype, got shapes {shapes}")
    return np.stack(rgb)


def _video_item(index: int, item: Any) -> np.ndarray:
    if isinstance(item, (list, tuple)) and item and all(_is_frame(f) for f in item):
        item = _stacked_frames(index, item)
    ok = isinstance(item, np.ndarray) and item.ndim == 4 and (item.shape[-1] == 3 or item.shape[1] == 3)
    if not ok:
        raise _fail(
            index,
            "video must be a frame array [frames, H, W, 3] or [frames, 3, H, W], or a list of frames "
            f"(PIL images or [H, W, C] arrays), or a video file's path or bytes; got {_describe(item)}",
        )
    _pixel_array(index, "video", item)
    if item.shape[-1] != 3:
        item = item.transpose(0, 2, 3, 1)
    return item


class TorchvisionVideoProcessor:
    """transformers' own ``Qwen2VLVideoProcessor`` (torchvision), called as the composite calls
    it (with :attr:`size`), behind :class:`VideoProcessor`'s interface."""

    size: dict[str, int] = VIDEO_SIZE
    """The pixel bounds the composite passes on every call."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.temporal_patch_size: int = processor.temporal_patch_size
        self.merge_size: int = processor.merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TorchvisionVideoProcessor:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return cls(Qwen2VLVideoProcessor.from_pretrained(str(path), local_files_only=True))

    def __call__(self, video: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        out = self.processor([video], size=dict(self.size), return_tensors="np")
        (grid,) = out["video_grid_thw"]
        return np.asarray(out["pixel_values_videos"], np.float32), (int(grid[0]), int(grid[1]), int(grid[2]))

    def least_tokens(self, frames: int) -> int:
        """:func:`least_video_tokens` of a video of ``frames`` frames."""
        p = self.processor
        return least_video_tokens(
            frames, p.temporal_patch_size, self.size["shortest_edge"], p.patch_size, p.merge_size
        )


PixelBackend = Literal["torchvision", "pil"]


def default_pixel_backend() -> PixelBackend:
    """The backend transformers' ``AutoProcessor`` would build its image and video parts on."""
    from transformers.utils import is_torchvision_available

    return "torchvision" if is_torchvision_available() else "pil"


@dataclasses.dataclass(frozen=True)
class MediaParts:
    """A checkpoint's feature extractor, image and video processors (``preprocessor_config.json``,
    transformers' own classes): a processor without its tokenizer, which is all that sizes the
    encoders' calls (the memory plan reads them before anything else is loaded)."""

    feature_extractor: Any
    image_processor: Any
    video_processor: VideoProcessor | TorchvisionVideoProcessor

    @classmethod
    def from_pretrained(cls, path: str | Path, pixels: PixelBackend | None = None) -> MediaParts:
        """Each part with transformers' own class from ``path``; image and video pixels on
        ``pixels`` (default: :func:`default_pixel_backend`)."""
        from transformers import WhisperFeatureExtractor

        path = Path(path)
        pixels = pixels or default_pixel_backend()
        video: VideoProcessor | TorchvisionVideoProcessor
        if pixels == "torchvision":
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

            image_cls: Any = Qwen2VLImageProcessor
            video = TorchvisionVideoProcessor.from_pretrained(path)
        elif pixels == "pil":
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            image_cls, video = Qwen2VLImageProcessorPil, VideoProcessor.from_pretrained(path)
        else:
            raise ValueError(f"pixels must be 'torchvision' or 'pil', got {pixels!r}")
        if not (path / "preprocessor_config.json").exists():
            raise ValueError(f"{path}: no preprocessor_config.json (the audio and image processors)")
        return cls(
            WhisperFeatureExtractor.from_pretrained(str(path), local_files_only=True),
            image_cls.from_pretrained(str(path), local_files_only=True),
            video,
        )


class OmniProcessor:
    """The composite processor's job, from the checkpoint's own files (see the module docstring)."""

    default_fps: float = DEFAULT_VIDEO_FPS
    """Frames per second a video is taken to be sampled at when :meth:`process` is given none."""

    def __init__(
        self,
        tokenizer: Any,
        feature_extractor: Any,
        image_processor: Any,
        video_processor: VideoProcessor | TorchvisionVideoProcessor,
    ):
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.image_processor = image_processor
        self.video_processor = video_processor
        ids = {
            name: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{name}_token"))
            for name in ("audio", "image", "video", "audio_bos", "audio_eos", "vision_bos", "vision_eos")
        }
        self.audio_id, self.image_id, self.video_id = ids["audio"], ids["image"], ids["video"]
        self.audio_bos_id, self.audio_eos_id = ids["audio_bos"], ids["audio_eos"]
        self.vision_bos_id = ids["vision_bos"]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, tokenizer: Any = None, pixels: PixelBackend | None = None
    ) -> OmniProcessor:
        """Each part with transformers' own class from ``path`` (:meth:`MediaParts.from_pretrained`),
        and its tokenizer (``tokenizer``, else the checkpoint's)."""
        path = Path(path)
        parts = MediaParts.from_pretrained(path, pixels)
        if tokenizer is None:
            tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"{no_tokenizer(path)}; its processor (preprocessor_config.json) needs one")
        missing = [
            n for n in ("audio_token", "image_token", "video_token") if not getattr(tokenizer, n, None)
        ]
        if missing:
            raise ValueError(f"{path}: the tokenizer does not name the multimodal placeholders {missing}")
        return cls(tokenizer, parts.feature_extractor, parts.image_processor, parts.video_processor)

    # -- the parts ----------------------------------------------------------------------
    def audio_features(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``[mel, frames]`` per audio: the frames the extractor gives when called as the composite
        calls it (each clip padded with zeros to its ``chunk_length``, 30 s), cut to the frames its
        attention mask keeps.

        The zeros go only one FFT window past the longest clip: every frame that reads a clip's
        samples then reads the same samples as in the 30 s padding (none reaches the reflected
        edge), and every other frame reads zeros in both, so each clip's frames and spectrogram
        maximum (what the log-mel floor is taken from) are the same; a clip of a second is not
        transformed as thirty."""
        fe = self.feature_extractor
        longest = max(len(a) for a in audios)
        length = min(fe.n_samples, -(-(longest + fe.n_fft) // fe.hop_length) * fe.hop_length)
        out = fe(
            list(audios),
            sampling_rate=SAMPLE_RATE,
            return_attention_mask=True,
            padding="max_length",
            max_length=length,
            return_tensors="np",
        )
        frames = out["attention_mask"].sum(-1)
        return [np.asarray(f[:, :n], np.float32) for f, n in zip(out["input_features"], frames, strict=True)]

    def images(self, images: Sequence[Any]) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        """Per image ``(patches [h*w, patch_dim], grid (1, h, w))`` from the image processor, for
        RGB PIL images and ``[H, W, 3]`` arrays (what :meth:`process` checks them into): the
        layout is given, never guessed from the shape.

        A PIL image goes in as its ``[H, W, 3]`` array (the same pixels): transformers 5.17's
        torchvision backend makes a PIL image channels-first itself and then still applies the
        ``channels_last`` it is given, scrambling it; both backends read arrays as told."""
        arrays = [np.array(image) if not isinstance(image, np.ndarray) else image for image in images]
        out = self.image_processor(arrays, return_tensors="np", input_data_format="channels_last")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        bounds = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        pixels = np.asarray(out["pixel_values"], np.float32)
        return [pixels[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)], grids

    def check_image_size(self, index: int, item: int, image: Any) -> None:
        """Refuse request ``index``'s image ``item`` (an RGB PIL image or ``[H, W, 3]`` array, as
        :meth:`process` checks them into) if the image processor's resize refuses its size (an
        aspect ratio past 200:1), from its size alone, by the processor's own rule
        (``get_number_of_image_patches``, which vLLM sizes placeholders with): :meth:`images`
        featurises a prompt's images in one call, whose refusal does not say which image it is
        about (:class:`~omni_jax.image_io.ImageItemError` does)."""
        width, height = (image.shape[1], image.shape[0]) if isinstance(image, np.ndarray) else image.size
        try:
            self.image_processor.get_number_of_image_patches(height, width, {})
        except ValueError as e:
            raise ImageItemError(index, item, str(e)) from None

    def video_tokens(self, grid: tuple[int, int, int]) -> int:
        return int(np.prod(grid)) // self.video_processor.merge_size**2

    def audio_tokens(self, frames: int) -> int:
        """Placeholder tokens of an audio clip of ``frames`` mel frames (the encoder's output rows)."""
        return audio_output_lengths(frames)[1]

    def video_token_times(
        self, grid: tuple[int, int, int], second_per_grid: float, per_second: float
    ) -> np.ndarray:
        """The time position of each of a video's tokens: its frame's start in seconds times
        ``per_second`` (float64, as the reference's ``replace_video_with_audio_token``)."""
        t, h, w = grid
        m = self.video_processor.merge_size
        return np.repeat(np.arange(t), (h // m) * (w // m)) * second_per_grid * per_second

    def interleaved(self, grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int) -> list[int]:
        """A video's placeholder with its audio track: ``audio_bos``, then per 2-second chunk the
        chunk's video tokens and audio tokens, then ``audio_eos`` (the reference's
        ``replace_video_with_audio_token``; chunks by each token's time position)."""
        video_time = self.video_token_times(grid, second_per_grid, POSITION_ID_PER_SECONDS)
        per_chunk = int(POSITION_ID_PER_SECONDS * SECONDS_PER_CHUNK)
        video_chunks = chunk_bounds(video_time, per_chunk, 0)
        audio_chunks = chunk_bounds(np.arange(audio_tokens), per_chunk, 0)
        ids = [self.audio_bos_id]
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                ids += [self.video_id] * (video_chunks[j][1] - video_chunks[j][0])
            if j < len(audio_chunks):
                ids += [self.audio_id] * (audio_chunks[j][1] - audio_chunks[j][0])
        return ids + [self.audio_eos_id]

    # -- one prompt ---------------------------------------------------------------------
    def process(
        self,
        index: int,
        token_ids: Sequence[int],
        multi_modal_data: dict[str, Any] | None,
        *,
        use_audio_in_video: bool = False,
        fps: float | None = None,
        admit: Callable[[dict[str, int], int], None] | None = None,
        max_tokens: int | None = None,
    ) -> OmniInputs:
        """Check, featurise and expand one prompt; ``ValueError`` naming request ``index`` on bad input.

        ``token_ids`` hold one placeholder token per item (as the chat template writes them),
        each after its modality's start token. ``fps`` is the rate the video frames were
        sampled at (default :attr:`default_fps`). With ``use_audio_in_video``, ``audio`` holds
        one track per video (in video order) and the prompt has no audio placeholders of its own.
        ``admit``, when given, is called with the items of each kind (``audio``, its videos'
        tracks included, ``image``, ``video``) and the fewest tokens the prompt can expand to
        (its clips' :meth:`least_audio_tokens`, its videos' :meth:`VideoProcessor.least_tokens`,
        its images none) once they are checked and before any is featurised, so that a
        caller's per-prompt limits and context refuse a prompt before its media cost time and
        memory (a clip of an hour is refused from its length, not after its features).
        ``max_tokens``: the longest prompt the caller takes (its ``max_model_len``); where the
        family takes clips past the extractor's window, a clip whose own tokens would fill it is
        refused as it is read (:meth:`longest_clip`), a file's from its header.
        """
        if not isinstance(use_audio_in_video, (bool, np.bool_)):  # "no" would be true
            raise _fail(index, f"use_audio_in_video must be true or false, got {use_audio_in_video!r}")
        if fps is not None and not (_is_number(fps) and 0 < fps < math.inf):
            raise _fail(index, f"fps must be a positive finite number, got {fps!r}")
        multi_modal_data = self._read_video_files(
            index, multi_modal_data, fps or self.default_fps, use_audio_in_video, max_tokens, admit
        )
        data = self._check_forms(index, multi_modal_data, use_audio_in_video, max_tokens)
        ids = [int(t) for t in token_ids]
        audios, images, videos = data.get("audio", []), data.get("image", []), data.get("video", [])
        self._check_counts(index, ids, len(audios), len(images), len(videos), use_audio_in_video)
        if admit is not None:
            placeholders = sum(ids.count(t) for t in (self.audio_id, self.image_id, self.video_id))
            least = (
                len(ids)
                - placeholders
                + sum(self.least_audio_tokens(len(a)) for a in audios)
                + sum(self.video_processor.least_tokens(len(v)) for v in videos)
            )
            admit({"audio": len(audios), "image": len(images), "video": len(videos)}, least)
        for item, image in enumerate(images):
            self.check_image_size(index, item, image)
        out = OmniInputs(input_ids=[], use_audio_in_video=use_audio_in_video and bool(videos))
        try:
            if audios:
                out.audio_features = self.audio_features(audios)
            if images:
                out.image_patches, out.image_grid_thw = self.images(images)
            for video in videos:
                patches, grid = self.video_processor(video)
                out.video_patches.append(patches)
                out.video_grid_thw.append(grid)
        except ValueError as e:  # e.g. an aspect ratio the resize refuses, a clip too short to transform
            raise _fail(index, str(e)) from None
        if out.use_audio_in_video:  # a track of no token would leave its video's audio span empty
            for v, (track, frames) in enumerate(zip(audios, out.audio_seqlens, strict=True)):
                if self.audio_tokens(frames) == 0:
                    raise _fail(
                        index,
                        f"video {v}'s audio track of {len(track)} samples (at {SAMPLE_RATE} Hz) is too "
                        "short for one audio token",
                    )
        seconds = self.video_processor.temporal_patch_size / (fps or self.default_fps)
        out.video_second_per_grid = [seconds] * len(videos)
        out.input_ids = self._expand(ids, out)
        return out

    @property
    def max_audio_samples(self) -> int | None:
        """The longest clip :meth:`process` takes, in samples at :data:`SAMPLE_RATE` (None: any
        length). Qwen2.5-Omni's is the feature extractor's ``n_samples`` (its ``chunk_length``;
        300 s as released): transformers' processor cuts a longer clip to it, which is refused here rather
        than done silently."""
        return self.feature_extractor.n_samples

    def least_audio_tokens(self, samples: int) -> int:
        """The fewest placeholder tokens a clip of ``samples`` samples (at :data:`SAMPLE_RATE`)
        expands to, known before it is featurised: the extractor gives it at least ``samples //
        hop_length`` frames, and :meth:`audio_tokens` never falls as frames grow."""
        return self.audio_tokens(samples // self.feature_extractor.hop_length)

    def longest_clip(self, tokens: int) -> int:
        """The most samples a clip may have whose :meth:`least_audio_tokens` stay under
        ``tokens``: a longer clip fills a prompt of that many tokens alone."""
        frames = 1
        while self.audio_tokens(frames) < tokens:  # an upper end: the count grows with the frames
            frames *= 2
        low, high = 0, frames  # audio_tokens(high) >= tokens; find the last frame count under it
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.audio_tokens(mid) < tokens else (low, mid)
        return (low + 1) * self.feature_extractor.hop_length - 1

    def _check_forms(
        self, index: int, mm: Any, use_audio_in_video: bool, max_tokens: int | None
    ) -> dict[str, list[Any]]:
        """``mm``'s items checked and read. A family that takes clips past the extractor's
        window (:attr:`max_audio_samples` None) bounds them by ``max_tokens`` instead
        (:meth:`longest_clip`), so that a long file is refused from its header, not after it is
        decoded and resampled."""
        if mm is None:
            return {}
        if not isinstance(mm, dict):
            raise _fail(index, f"multi_modal_data must be a dict, got {type(mm).__name__}")
        max_samples, fills = self._longest_audio(max_tokens)
        tracks = use_audio_in_video and mm.get("video") is not None and bool(_video_items(mm["video"]))
        checks = {
            "audio": lambda i, item: _audio_item(i, item, max_samples, tracks, fills),
            "image": _image_item,
            "video": _video_item,
        }
        unknown = set(mm) - set(checks)
        if unknown:
            raise _fail(index, f"multi_modal_data has unknown keys {sorted(unknown)} (known: {list(checks)})")
        return {k: [checks[k](index, item) for item in ITEMS[k](v)] for k, v in mm.items() if v is not None}

    def _longest_audio(self, max_tokens: int | None) -> tuple[int | None, str | None]:
        """``(samples, what bounds them)``: the longest clip a prompt takes (``None``: any), and
        ``None`` where that is the extractor's window, else the context ``max_tokens`` it would fill."""
        if self.max_audio_samples is None and max_tokens is not None:
            return self.longest_clip(max_tokens), f"max_model_len {max_tokens}"
        return self.max_audio_samples, None

    def _read_video_files(
        self,
        index: int,
        mm: Any,
        fps: float,
        use_audio_in_video: bool,
        max_tokens: int | None,
        admit: Callable[[dict[str, int], int], None] | None,
    ) -> Any:
        """``mm`` with each video given as a file read (:func:`_video_file`): sampled at ``fps``,
        at most the frames whose fewest tokens fit ``max_tokens`` (else
        :data:`MAX_VIDEO_FILE_FRAMES`). With ``use_audio_in_video`` and no audio of the prompt's
        own, each file's own audio track is its video's (every video must then be a file that has
        one); given audio is used as given. ``admit`` (:meth:`process`'s) is first called with the
        items' counts, so that a prompt over the caller's limits is refused before any file is
        decoded."""
        if not isinstance(mm, dict) or mm.get("video") is None:
            return mm
        videos = _video_items(mm["video"])
        if not any(_is_file(v) for v in videos):
            return mm
        tracks = use_audio_in_video and mm.get("audio") is None
        if admit is not None:
            given = {k: 0 if mm.get(k) is None else len(split(mm[k])) for k, split in ITEMS.items()}
            admit({**given, "audio": len(videos) if tracks else given["audio"]}, 0)
        vp = self.video_processor
        most = (
            MAX_VIDEO_FILE_FRAMES
            if max_tokens is None
            else vp.temporal_patch_size * (max_tokens // vp.least_tokens(1))
        )
        samples, _ = self._longest_audio(max_tokens)
        track_seconds = None if samples is None else samples / SAMPLE_RATE
        read: list[Any] = []
        audio: list[tuple[np.ndarray, int]] = []
        for v, item in enumerate(videos):
            if not _is_file(item):
                if tracks:
                    raise _fail(
                        index,
                        f"use_audio_in_video without audio takes each video's track from its file, and "
                        f"video {v} is frames: give multi_modal_data['audio'] one track per video",
                    )
                read.append(item)
                continue
            clip = _video_file(index, v, item, fps, most, tracks, track_seconds)
            if tracks and clip.track is None:
                raise _fail(index, f"video {v} is a .npy array of frames, with no audio track to use")
            read.append(clip.frames)
            if clip.track is not None:
                audio.append((clip.track, clip.track_rate))
        out = {**mm, "video": read}
        if tracks:
            out["audio"] = audio
        return out

    def _check_counts(
        self, index: int, ids: list[int], audios: int, images: int, videos: int, use_audio_in_video: bool
    ) -> None:
        placeholders = {
            "audio": ids.count(self.audio_id),
            "image": ids.count(self.image_id),
            "video": ids.count(self.video_id),
        }
        given = {"audio": audios, "image": images, "video": videos}
        if use_audio_in_video and videos:
            if placeholders["audio"]:
                raise _fail(
                    index,
                    "with use_audio_in_video the audio entries are the videos' tracks; the prompt must not "
                    "hold audio placeholders of its own",
                )
            if audios != videos:
                raise _fail(
                    index,
                    f"use_audio_in_video needs one audio track per video: {videos} videos, {audios} audios",
                )
            given["audio"] = 0
        for kind, n in given.items():
            if placeholders[kind] != n:
                raise _fail(
                    index,
                    f"{placeholders[kind]} {kind} placeholder(s) in the prompt but {n} {kind} input(s) in "
                    "multi_modal_data (build prompts with chat_prompt(): one placeholder per item)",
                )
        vision = self.vision_bos_id
        starts = {self.audio_id: self.audio_bos_id, self.image_id: vision, self.video_id: vision}
        for i, t in enumerate(ids):
            if t in starts and (i == 0 or ids[i - 1] != starts[t]):
                token = self.tokenizer.convert_ids_to_tokens(t)
                start = self.tokenizer.convert_ids_to_tokens(starts[t])
                raise _fail(index, f"placeholder {token} at position {i} must follow {start}")

    def _expand(self, ids: list[int], inputs: OmniInputs) -> list[int]:
        """Each placeholder replaced by its item's tokens (:meth:`audio_tokens` a clip)."""
        audio_tokens = [self.audio_tokens(n) for n in inputs.audio_seqlens]
        merge_unit = self.image_processor.merge_size**2
        image_tokens = iter(int(np.prod(g)) // merge_unit for g in inputs.image_grid_thw)
        videos = iter(range(len(inputs.video_grid_thw)))
        audios = iter(audio_tokens)
        out: list[int] = []
        for t in ids:
            if t == self.audio_id:
                out += [self.audio_id] * next(audios)
            elif t == self.image_id:
                out += [self.image_id] * next(image_tokens)
            elif t == self.video_id:
                v = next(videos)
                grid = inputs.video_grid_thw[v]
                if inputs.use_audio_in_video:
                    out += self.interleaved(grid, inputs.video_second_per_grid[v], audio_tokens[v])
                else:
                    out += [self.video_id] * self.video_tokens(grid)
            else:
                out.append(t)
        return out
