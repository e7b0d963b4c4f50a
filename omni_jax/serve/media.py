"""Media in a chat request: data URLs (base64) and, where allowed, local files, as prompt items.

The server fetches nothing over the network: an image or video is a ``data:`` URL, or a
``file://`` URL under the folder ``--allowed-local-media-path`` names (refused without it, and
for any path that resolves outside it); audio is a base64 audio file (``input_audio``: WAV, mp3,
...). Each decoder returns what :meth:`OmniJaxPipeline.chat_prompt` takes (a PIL image, a WAV
file's ``(samples, sample_rate)``, a ``.npy`` file's frame array, another audio or video file's
bytes, which the processor decodes within its limits, a video sampled at the prompt's rate)
or raises :class:`~omni_jax.serve.protocol.FieldError` naming the content part, so a bad item
is a 400 naming it before any work. A request's images together may decode to at most
``--max-image-pixels`` (:class:`MediaReader`), checked from each file's header before it is
decoded: a compressed image of a few kilobytes can hold gigabytes of pixels.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image, UnidentifiedImageError

from omni_jax.audio_io import decode_wav, is_wav
from omni_jax.image_io import pil_pixel_bound, upright_rgb
from omni_jax.media_files import check_audio_file
from omni_jax.serve import DEFAULT_MAX_IMAGE_PIXELS
from omni_jax.serve.protocol import FieldError
from omni_jax.video_io import NPY_MAGIC, read_frames


def _base64(where: str, data: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FieldError(where, f"not valid base64 ({e})") from None
    if not raw:
        raise FieldError(where, "empty")
    return raw


def _url_bytes(where: str, url: str, allowed: Path | None) -> bytes:
    """The bytes a data URL holds, or a file URL's file under ``allowed``."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise FieldError(where, "a data URL must be 'data:<type>;base64,<data>'")
        return _base64(where, payload)
    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise FieldError(
            where,
            "only data: URLs (and file: URLs under --allowed-local-media-path) are read; "
            "the server fetches nothing over the network",
        )
    if allowed is None:
        raise FieldError(where, "file: URLs are refused unless the server names --allowed-local-media-path")
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(allowed):
        raise FieldError(where, f"{path} is outside the allowed media folder {allowed}")
    if not path.is_file():
        raise FieldError(where, f"no such file {path}")
    return path.read_bytes()


def _past_room(where: str, pixels: str, room: int) -> FieldError:
    """The refusal of an image of ``pixels`` (its size, as the message says it) where ``room``
    pixels are left of the request's ``--max-image-pixels``."""
    return FieldError(
        where,
        f"an image of {pixels} pixels takes the request's images past the {room} pixels left of the "
        "server's limit (--max-image-pixels)",
    )


def image(where: str, url: str, allowed: Path | None, room: int | None = None) -> Image.Image:
    """A PIL image, RGB, from an image URL: its file read as a prompt's image path is
    (:func:`~omni_jax.image_io.read_image`: upright by its EXIF orientation, alpha dropped).
    ``room``: the most pixels it may have, checked before it is decoded. A header past PIL's own
    bound (:func:`~omni_jax.image_io.pil_pixel_bound`), which PIL refuses to open, is refused as
    past ``room`` too where that bound is within it: the limit the client can act on is the
    server's."""
    raw = _url_bytes(where, url, allowed)
    try:
        opened = Image.open(io.BytesIO(raw))
    except UnidentifiedImageError:
        raise FieldError(where, "not a readable image (no image format recognised)") from None
    except Image.DecompressionBombError as e:
        bound = pil_pixel_bound()
        if room is not None and bound is not None and bound >= room:
            raise _past_room(where, f"more than {bound}", room) from None
        raise FieldError(where, f"not a readable image ({e})") from None
    except (OSError, ValueError) as e:
        raise FieldError(where, f"not a readable image ({e})") from None
    except Exception as e:  # noqa: BLE001 - PIL's parsers raise what they like on bad bytes
        raise FieldError(where, f"not a readable image ({type(e).__name__}: {e})") from None
    with opened:
        width, height = opened.size
        if room is not None and width * height > room:
            raise _past_room(where, f"{width}x{height}", room)
        try:
            return upright_rgb(opened)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise FieldError(where, f"not a readable image ({e})") from None
        except Exception as e:  # noqa: BLE001 - as above (a bad EXIF block: SyntaxError)
            raise FieldError(where, f"not a readable image ({type(e).__name__}: {e})") from None


def audio(where: str, data: str) -> tuple[np.ndarray, int] | bytes:
    """The audio file an ``input_audio`` carries, as ``multi_modal_data`` takes it (see
    :func:`_audio`)."""
    return _audio(where, _base64(where, data))


def audio_file(where: str, url: str, allowed: Path | None) -> tuple[np.ndarray, int] | bytes:
    """The audio file an ``audio_url`` points at (a data URL, or an allowed file URL), as
    :func:`audio`'s."""
    return _audio(where, _url_bytes(where, url, allowed))


def _audio(where: str, raw: bytes) -> tuple[np.ndarray, int] | bytes:
    """A WAV file decoded here, ``(samples, sample_rate)`` (the stage resamples it as it would the
    file), so that one that cannot be read is refused naming its field; any other file's bytes,
    its header checked here (:func:`~omni_jax.media_files.check_audio_file`) and its samples
    decoded by the stage, which stops at the longest clip it takes: a few megabytes of mp3 can
    hold hours, gigabytes of samples, where a WAV's samples are its bytes."""
    try:
        if is_wav(raw[:12]):
            return decode_wav(io.BytesIO(raw))
        check_audio_file(raw)
    except ValueError as e:
        raise FieldError(where, f"the audio file {e}") from None
    return raw


@dataclasses.dataclass
class MediaReader:
    """One request's media, read by the server's rules: file URLs under ``allowed`` only, and
    its images together at most ``max_image_pixels`` (``None``: no limit); ``pixels`` counts
    those read so far, and ``image_parts`` names the content part of each, in the order read
    (the prompt's order of images: what a refusal of one at admission names)."""

    allowed: Path | None = None
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    pixels: int = 0
    image_parts: list[str] = dataclasses.field(default_factory=list)

    def image(self, where: str, url: str) -> Image.Image:
        room = None if self.max_image_pixels is None else self.max_image_pixels - self.pixels
        img = image(where, url, self.allowed, room)
        self.pixels += img.width * img.height
        self.image_parts.append(where)
        return img

    def audio(self, where: str, data: str) -> tuple[np.ndarray, int] | bytes:
        return audio(where, data)

    def audio_file(self, where: str, url: str) -> tuple[np.ndarray, int] | bytes:
        return audio_file(where, url, self.allowed)

    def video(self, where: str, url: str) -> np.ndarray | bytes:
        return video(where, url, self.allowed)


def video(where: str, url: str, allowed: Path | None) -> np.ndarray | bytes:
    """Frames ``[frames, H, W, 3]`` from a URL of a ``.npy`` array; any other file's bytes, which
    the processor decodes and samples at the prompt's frame rate (``mm_processor_kwargs.fps``,
    else the model's), naming the video in what it refuses."""
    raw = _url_bytes(where, url, allowed)
    if not raw.startswith(NPY_MAGIC):
        return raw
    try:
        return read_frames(raw)
    except ValueError as e:
        raise FieldError(where, str(e)) from None
