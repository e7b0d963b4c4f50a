"""Audio and video files that FFmpeg reads (mp3, flac, ogg, m4a, mp4, webm, mkv, ...), through PyAV.

PyAV, FFmpeg's Python binding, is what transformers' ``load_video`` decodes with by default;
WAV files stay with scipy (:mod:`omni_jax.audio_io`), which reads them exactly. A video's frames
are sampled as ``transformers.video_utils.load_video(path, fps=...)`` samples them with that
backend: ``int(frames / rate * fps)`` frames (at least one) of the container's stated frame
count and average rate, at the indices transformers' own ``default_sample_indices_fn`` picks
for that count (called, not rewritten: ``arange(n) * frames // n`` from transformers 5.18, while
5.17 stepped by the whole part of ``frames / n``), decoded in order and made RGB (``rgb24``), so
a file gives the same frames here as there, whichever transformers is installed.

The bytes are the sender's (a server's client, a CLI user's file): what a file would decode to
is checked from its container's header before any frame or sample is decoded (a few kilobytes of
video can claim hours of 4K frames), and again as it decodes, so a header that understates is
stopped at the limit rather than believed.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from omni_jax.audio_io import check_clip

MAX_VIDEO_BYTES = 2 << 30
"""The most bytes one video's decoded RGB frames may take: frames are kept at their own size
(as transformers keeps them) until the processor resizes them, so this bounds the host memory
a file can ask for."""

Source = str | Path | bytes | BinaryIO
"""A media file: its path, its bytes, or an open binary file."""


@dataclasses.dataclass(frozen=True)
class VideoFile:
    """A video file decoded: its sampled frames and, when asked for, its first audio track."""

    frames: np.ndarray
    """``[frames, H, W, 3]`` uint8 RGB."""
    track: np.ndarray | None = None
    """Float32 mono samples of the first audio stream, at :attr:`track_rate` Hz."""
    track_rate: int | None = None


def _errors() -> tuple[type[Exception], ...]:
    """What PyAV raises on data it cannot read: FFmpeg's errors (opening, it also raises
    ``ValueError`` and ``EOFError`` of its own, caught there alone, so that this module's
    ``ValueError`` of a file over its limits is not taken for one)."""
    import av

    return (av.error.FFmpegError,)


def open_options(source: Source) -> dict[str, str]:
    """FFmpeg's options for opening ``source``: no protocol but the file's own. Some containers
    name other files or URLs to read (an HLS playlist its segments), and FFmpeg would open them:
    bytes from a client could make the server fetch a URL or read a local file. A path may name
    local files only (it is the user's own); bytes and open files nothing at all."""
    return {"protocol_whitelist": "file" if isinstance(source, (str, Path)) else "none"}


def _open(source: Source) -> Any:
    import av

    options = open_options(source)
    opened = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        return av.open(str(opened) if isinstance(opened, Path) else opened, mode="r", options=options)
    except (*_errors(), ValueError, EOFError) as e:
        raise ValueError(f"is not a media file FFmpeg can read ({e})") from None


def _seconds(stream: Any) -> float | None:
    """The stream's duration its header states, ``None`` when it states none."""
    if stream.duration is None or stream.time_base is None:
        return None
    return float(stream.duration * stream.time_base)


def _decodable(stream: Any) -> Any:
    """``stream`` when FFmpeg has a decoder for it; else ``ValueError`` (a predicate). A stream
    whose codec FFmpeg does not know (a corrupt header can name any) has no codec context, and
    PyAV then answers its rate, width or height with ``AttributeError``."""
    if stream.codec_context is None:
        article = "an" if stream.type[:1] in ("a", "e", "i", "o", "u") else "a"
        raise ValueError(f"has {article} {stream.type} stream of a codec FFmpeg cannot decode")
    return stream


def _first_audio(container: Any, max_seconds: float | None) -> tuple[Any, int]:
    """The container's first audio stream and its rate; ``ValueError`` (a predicate) when it has
    none, when its rate is outside :data:`~omni_jax.audio_io.WAV_RATES`, or when the duration its
    header states is over ``max_seconds``: what its header alone can tell."""
    if not container.streams.audio:
        raise ValueError("holds no audio stream")
    stream = _decodable(container.streams.audio[0])
    rate = int(stream.rate or 0)
    stated = _seconds(stream)
    check_clip(0 if stated is None else int(stated * rate), rate, max_seconds)
    return stream, rate


def check_audio_file(source: Source) -> None:
    """``ValueError`` (as :func:`decode_audio_file`'s) for a file FFmpeg cannot open, with no
    audio stream, or at a rate outside :data:`~omni_jax.audio_io.WAV_RATES`, from its header
    alone: a file checked here is decoded later by a reader that knows how long it may last."""
    with _open(source) as container:
        _first_audio(container, None)


def decode_audio_file(source: Source, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """The first audio stream of ``source`` as float32 mono at its own rate, and the rate.

    Channels are averaged, as :func:`~omni_jax.audio_io.decode_wav` averages a WAV's.
    ``ValueError`` (a predicate for the caller to put after the input's name, as
    :func:`~omni_jax.audio_io.decode_wav`'s) for what FFmpeg cannot read, a file with no audio
    stream or no samples, a rate outside :data:`~omni_jax.audio_io.WAV_RATES`, or one over
    ``max_seconds``: from the header's duration before decoding, and as it decodes.
    """
    import av

    with _open(source) as container:
        stream, rate = _first_audio(container, max_seconds)
        resampler = av.AudioResampler(format="fltp")  # float planar; layout and rate kept
        parts: list[np.ndarray] = []
        samples = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    planes = out.to_ndarray()
                    parts.append(planes.mean(axis=0, dtype=np.float32))
                    samples += planes.shape[1]
                    check_clip(samples, rate, max_seconds)
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
        except _errors() as e:
            raise ValueError(f"is not a readable audio file ({e})") from None
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    check_clip(audio.size, rate, max_seconds)
    if audio.size == 0:
        raise ValueError("holds no samples")
    return audio.astype(np.float32, copy=False), rate


def _frame_count(container: Any, stream: Any) -> tuple[int, float]:
    """``(frames, frames a second)`` the video stream's header states (frames counted from its
    duration, or else the container's, where the container keeps no count, as WebM and
    Matroska do)."""
    import av

    rate = float(stream.average_rate or 0)
    frames = int(stream.frames or 0)
    seconds = _seconds(stream)
    if seconds is None and container.duration:
        seconds = container.duration / av.time_base
    if not frames and rate and seconds:
        frames = round(seconds * rate)
    if not frames or not rate:
        raise ValueError("states neither its frame count nor its duration and frame rate; re-encode it")
    return frames, rate


def decode_video_file(
    source: Source,
    fps: float,
    max_frames: int,
    *,
    track: bool = False,
    max_track_seconds: float | None = None,
    max_bytes: int = MAX_VIDEO_BYTES,
) -> VideoFile:
    """The frames of ``source``'s first video stream sampled at ``fps`` (see the module
    docstring), and with ``track`` its first audio stream (:func:`decode_audio_file`, at most
    ``max_track_seconds``).

    ``ValueError`` (a predicate, as :func:`decode_audio_file`'s) for what FFmpeg cannot read, a
    file with no video stream (or, with ``track``, no audio stream), one whose sampling would
    give more than ``max_frames`` frames or more than ``max_bytes`` bytes of them (from the
    header, before decoding), or a frame of another size than its header states (which would
    take it past ``max_bytes``; transformers could not stack such frames either).
    """
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    if not 0 < fps < float("inf"):
        raise ValueError(f"cannot be sampled at {fps!r} frames a second")
    if not isinstance(source, (str, Path, bytes)):
        source = source.read()  # opened twice with ``track``: once for the frames, once for the track
    with _open(source) as container:
        if not container.streams.video:
            raise ValueError("holds no video stream")
        stream = _decodable(container.streams.video[0])
        total, rate = _frame_count(container, stream)
        wanted = max(1, int(total / rate * fps))
        seconds = total / rate
        if wanted > total:
            raise ValueError(
                f"has {total} frames ({seconds:.2f} s at {rate:g} a second), fewer than the {wanted} "
                f"sampling it at {fps:g} a second takes"
            )
        indices = default_sample_indices_fn(
            VideoMetadata(total_num_frames=total, fps=rate), num_frames=wanted
        )
        wanted = len(indices)  # 5.17's float step could give one index more than asked
        if wanted > max_frames:
            raise ValueError(
                f"lasts {seconds:.2f} s: sampled at {fps:g} frames a second that is {wanted} frames, "
                f"over the {max_frames} a prompt can hold"
            )
        size = (int(stream.width), int(stream.height))
        frame_bytes = 3 * size[0] * size[1]
        if wanted * frame_bytes > max_bytes:
            raise ValueError(
                f"gives {wanted} frames of {stream.width}x{stream.height} pixels, {wanted * frame_bytes} "
                f"bytes decoded, over the {max_bytes} one video may take: send it smaller or shorter"
            )
        keep = set(indices.tolist())
        frames: list[np.ndarray] = []
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i > indices[-1]:
                    break
                if i not in keep:
                    continue
                if (frame.width, frame.height) != size:  # the header's size is what was bounded
                    raise ValueError(
                        f"has a frame of {frame.width}x{frame.height} pixels where its header states "
                        f"{size[0]}x{size[1]}"
                    )
                frames.append(frame.to_ndarray(format="rgb24"))
        except _errors() as e:
            raise ValueError(f"is not a readable video file ({e})") from None
    if not frames:
        raise ValueError("holds no frame that decodes")
    if not track:
        return VideoFile(np.stack(frames))
    audio, audio_rate = decode_audio_file(source, max_track_seconds)
    return VideoFile(np.stack(frames), audio, audio_rate)


ENCODINGS = {
    "mp3": ("mp3", "libmp3lame", "fltp"),
    "flac": ("flac", "flac", "s16"),
    "opus": ("ogg", "libopus", "flt"),
    "aac": ("adts", "aac", "fltp"),
}
"""OpenAI's compressed audio output formats: ``(container, FFmpeg encoder, sample format)``.
FLAC is fed 16-bit samples (what a WAV reply carries, so it decodes to the same), the lossy
codecs float samples clipped to [-1, 1]."""

EncodedFormat = Literal["mp3", "flac", "opus", "aac"]


def encode_audio(samples: np.ndarray, rate: int, fmt: EncodedFormat) -> bytes:
    """Mono float ``samples`` at ``rate`` Hz as a whole file of ``fmt`` (:data:`ENCODINGS`):
    an mp3, a FLAC, an Ogg Opus or an ADTS AAC stream."""
    import av

    from omni_jax.audio_io import pcm16

    container_format, codec, sample_format = ENCODINGS[fmt]
    if sample_format == "s16":
        data = pcm16(samples)[None]
    else:
        data = np.clip(np.asarray(samples, np.float32), -1.0, 1.0)[None]
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_format, layout="mono")
        frame.sample_rate = rate
        frame.pts = 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()
