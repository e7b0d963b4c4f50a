"""Images in: what a user's image file becomes, and how an image with transparency becomes RGB.

Files (a prompt's path, the CLI's ``--image``, the server's image URLs) are read as transformers'
``load_image`` reads them: turned upright by their EXIF orientation (a phone photo's rotation
lives there), then RGB with any alpha dropped. Images given in memory (a PIL image, an array)
become RGB as transformers' image processors make them since 5.21, and as vLLM does: any
transparency composited onto white (5.17 to 5.20 dropped the alpha instead). Also here: the
refusal of one image of a prompt (:class:`ImageItemError`, naming which), and the most pixels a
header may claim for PIL to open it (:func:`pil_pixel_bound`).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps


class ImageItemError(ValueError):
    """A prompt's image its processor refuses (an aspect ratio its resize does not take):
    ``item`` is its place among the prompt's images (``multi_modal_data["image"]``, in the
    order a chat prompt's content holds them) and ``problem`` what is wrong, so that a caller
    can name the input it came from (the server's 400 names its content part)."""

    def __init__(self, index: int, item: int, problem: str):
        super().__init__(f"request {index}: image {item}: {problem}")
        self.item = item
        self.problem = problem


def read_image(source: str | Path | BinaryIO) -> Image.Image:
    """An image file as RGB, upright. PIL's errors pass through (``OSError`` and
    ``UnidentifiedImageError`` for what it cannot read, ``DecompressionBombError`` for a header
    of too many pixels) for the caller to name the input."""
    with Image.open(source) as img:
        return upright_rgb(img)


def pil_pixel_bound() -> int | None:
    """The most pixels an image file's header may claim for ``Image.open`` to open it: twice
    PIL's ``Image.MAX_IMAGE_PIXELS`` (past it PIL raises ``DecompressionBombError`` from the
    header, before any pixel is decoded, and says so in its own words); ``None`` when PIL's
    check is off. Read when asked, as PIL reads it: a program may set its own limit."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * limit


def upright_rgb(img: Image.Image) -> Image.Image:
    """An opened image decoded as RGB, upright by its EXIF orientation (alpha dropped)."""
    return ImageOps.exif_transpose(img).convert("RGB")


def composite_rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB, transparency (an alpha band, or a palette's transparent colour)
    composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def composite_rgb_array(rgba: np.ndarray) -> np.ndarray:
    """An ``[H, W, 4]`` array as ``[H, W, 3]`` of its dtype, composited onto white: 255 for
    integer pixels (rounded back to integers), 1.0 for float ones, which must lie in [0, 1]
    (``ValueError`` otherwise: the alpha's scale would be a guess)."""
    integer = np.issubdtype(rgba.dtype, np.integer)
    if not integer and (rgba.min() < 0.0 or rgba.max() > 1.0):
        raise ValueError(
            f"float RGBA pixels must lie in [0, 1], got [{rgba.min():g}, {rgba.max():g}] "
            "(or give integers in [0, 255])"
        )
    white = 255 if integer else 1.0
    alpha = rgba[..., 3:4] / white
    blended = alpha * rgba[..., :3] + (1 - alpha) * white
    return (np.round(blended) if integer else blended).astype(rgba.dtype)
