"""Audio files in, WAV out: what a user's audio file becomes, and what a waveform becomes as bytes.

One place for both directions, so the CLI's ``--audio`` files, the server's base64 ``input_audio``,
``OmniRequestOutput.save_wav`` and the server's ``audio.data`` decode and encode alike.
``scipy.io.wavfile`` (a dependency of jax) reads and writes WAV; any other audio file (mp3, flac,
ogg, m4a, a video's track) is read through FFmpeg (:mod:`omni_jax.media_files`). Nothing here
knows a model.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

PCM16_SCALE = 32767
"""Full scale of 16-bit PCM: [-1, 1] maps to [-32767, 32767] (symmetric, as libsndfile writes)."""

SampleFormat = Literal["pcm16", "float32"]

WAV_RATES = (1_000, 384_000)
"""The sample rates (Hz) audio is read at, inclusive: every rate audio is recorded at. A WAV's
header (or an array's stated rate) is the sender's word, and resampling costs with the rate's
ratio to the target (a prime rate of millions of Hz took seconds and gigabytes), so another
rate is refused before any is done."""


def read_audio_file(
    source: str | Path | bytes | BinaryIO, rate: int, max_seconds: float | None = None
) -> np.ndarray:
    """An audio file (a path, its bytes or an open binary file) as float32 mono at ``rate`` Hz:
    the file as :func:`decode_audio` reads it, at another rate resampled (:func:`resample`).
    ``ValueError`` as :func:`decode_audio`'s."""
    audio, source_rate = decode_audio(source, max_seconds)
    return resample(audio, source_rate, rate)


def is_wav(head: bytes) -> bool:
    """Whether a file's first 12 bytes are a WAV file's (RIFF, form type WAVE)."""
    return head[:4] == b"RIFF" and head[8:12] == b"WAVE"


def decode_audio(
    source: str | Path | bytes | BinaryIO, max_seconds: float | None = None
) -> tuple[np.ndarray, int]:
    """An audio file as float32 mono at its own rate, and the rate: a WAV file as
    :func:`decode_wav` reads it, any other as :func:`~omni_jax.media_files.decode_audio_file`
    (told apart by the file's first bytes, not its name). ``ValueError`` as theirs."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            head = f.read(12)
    elif isinstance(source, bytes):
        head, source = source[:12], io.BytesIO(source)
    else:
        start = source.tell()
        head = source.read(12)
        source.seek(start)
    if is_wav(head):
        return decode_wav(source, max_seconds)
    from omni_jax.media_files import decode_audio_file

    return decode_audio_file(source, max_seconds)


def decode_wav(source: str | Path | BinaryIO, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """A WAV file (a path or an open binary file) as float32 mono at its own rate, and the rate.

    Integer PCM is scaled to [-1, 1) and channels are averaged. ``ValueError`` for what is not a
    readable WAV, holds no samples, has a rate outside :data:`WAV_RATES` or lasts over
    ``max_seconds`` (both read from the header), its message a predicate (``"holds no
    samples"``) for the caller to put after the input's name.
    """
    import struct

    from scipy.io import wavfile

    try:
        source_rate, data = wavfile.read(source)
    except (ValueError, OSError, EOFError, struct.error) as e:  # truncated or not a WAV at all
        raise ValueError(f"is not a readable WAV file: {e}") from None
    except Exception as e:  # noqa: BLE001 - scipy's parser on bad headers (0 channels: ZeroDivisionError)
        raise ValueError(f"is not a readable WAV file: {type(e).__name__}: {e}") from None
    check_clip(len(data), source_rate, max_seconds)
    if data.dtype == np.uint8:
        audio = (data.astype(np.float32) - 128) / 128
    elif np.issubdtype(data.dtype, np.integer):
        audio = data.astype(np.float32) / float(np.iinfo(data.dtype).max + 1)
    else:
        audio = data.astype(np.float32)
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if audio.size == 0:
        raise ValueError("holds no samples")
    return audio, int(source_rate)


def check_clip(samples: int, source_rate: int, max_seconds: float | None) -> None:
    """``ValueError`` (a predicate, as :func:`decode_wav`'s) for a rate outside :data:`WAV_RATES`
    or a clip over ``max_seconds``: what must be refused before :func:`resample` pays for it."""
    low, high = WAV_RATES
    if not low <= source_rate <= high:
        raise ValueError(f"has a sample rate of {source_rate} Hz; audio is read at {low} to {high} Hz")
    if max_seconds is not None and samples > max_seconds * source_rate:
        raise ValueError(
            f"is {samples / source_rate:.2f} s long ({samples} samples at {source_rate} Hz), "
            f"over the {max_seconds:g} s it may last"
        )


def resample(audio: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """Mono float ``audio`` at ``source_rate`` Hz as float32 at ``rate`` Hz, with
    ``scipy.signal.resample_poly`` (not bit-equal to librosa's resampler, which transformers'
    ``load_audio`` and vLLM use by default); the same array when the rates agree."""
    from scipy.signal import resample_poly

    if source_rate == rate:
        return audio
    g = np.gcd(source_rate, rate)
    return resample_poly(audio, rate // g, source_rate // g).astype(np.float32)


def pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples as 16-bit PCM: clipped to [-1, 1] and rounded."""
    return np.round(np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * PCM16_SCALE).astype(np.int16)


def write_wav(
    target: str | Path | BinaryIO, samples: np.ndarray, rate: int, sample_format: SampleFormat
) -> None:
    """A mono WAV of ``samples`` at ``rate`` Hz: ``"pcm16"`` (16-bit integer PCM, what Python's
    ``wave``, browsers and most players read) or ``"float32"`` (the samples as they are, IEEE
    float WAV, which ``wave`` and some players cannot open)."""
    from scipy.io import wavfile

    if sample_format not in ("pcm16", "float32"):
        raise ValueError(f"sample_format must be 'pcm16' or 'float32', got {sample_format!r}")
    data = pcm16(samples) if sample_format == "pcm16" else np.asarray(samples, np.float32)
    wavfile.write(str(target) if isinstance(target, (str, Path)) else target, rate, data)


def wav_bytes(samples: np.ndarray, rate: int, sample_format: SampleFormat = "pcm16") -> bytes:
    """:func:`write_wav` into memory: a whole WAV file's bytes."""
    buffer = io.BytesIO()
    write_wav(buffer, samples, rate, sample_format)
    return buffer.getvalue()
