"""Small audio and video files for tests, encoded with PyAV (FFmpeg), as a user's files would be."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tone(seconds: float, rate: int, hz: float = 440.0, channels: int = 1) -> np.ndarray:
    """A sine of ``hz`` at ``rate`` Hz, ``[channels, samples]`` float32 (the channels differ in level)."""
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * hz * t)
    return np.stack([wave * (1 - 0.25 * c) for c in range(channels)]).astype(np.float32)


def gradient_frames(count: int, height: int, width: int) -> np.ndarray:
    """``[count, H, W, 3]`` uint8 frames, each a smooth gradient of its own brightness, neighbours'
    far apart (codecs keep smooth images close, so a decoded frame can be told from the others)."""
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    out = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        level = 30 + 190 * (i * 17 % count) / max(count - 1, 1)
        out[i, ..., 0] = np.clip(level + 20 * x, 0, 255)
        out[i, ..., 1] = np.clip(level + 20 * y, 0, 255)
        out[i, ..., 2] = np.clip(level - 20 * x * y, 0, 255)
    return out


def _mux_audio(container, stream, samples: np.ndarray, rate: int) -> None:
    import av

    layout = "mono" if samples.shape[0] == 1 else "stereo"
    step = 1024
    for k in range(0, samples.shape[1], step):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples[:, k : k + step]), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = k
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def write_audio(path: Path, samples: np.ndarray, rate: int, codec: str) -> Path:
    """``samples`` ``[channels, n]`` as an audio file of ``codec`` (``"mp3"``, ``"flac"``,
    ``"libopus"``, ``"aac"``); the container from ``path``'s suffix."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono" if samples.shape[0] == 1 else "stereo"
        if codec == "flac":
            stream.format = "s16"
        _mux_audio(container, stream, samples, rate)
    return path


def write_video(
    path: Path,
    frames: np.ndarray,
    fps: int,
    audio: np.ndarray | None = None,
    rate: int = 22050,
    codec: str = "mpeg4",
) -> Path:
    """Frames ``[n, H, W, 3]`` uint8 at ``fps`` as a video file of ``codec`` (container from the
    suffix: ``.mp4``, ``.webm`` with ``"libvpx"``, ``.mkv``, ``.ts`` with ``"mpeg2video"``), with
    ``audio`` ``[channels, n]`` at ``rate`` as its AAC (Opus in WebM) track when given."""
    import av

    with av.open(str(path), mode="w") as container:
        video = container.add_stream(codec, rate=fps)
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv420p"
        video.options = {"qscale": "2"} if codec == "mpeg4" else {}
        sound = None
        if audio is not None:
            sound = container.add_stream("libopus" if path.suffix == ".webm" else "aac", rate=rate)
            sound.layout = "mono" if audio.shape[0] == 1 else "stereo"
        for frame in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if sound is not None:
            _mux_audio(container, sound, audio, rate)
    return path
