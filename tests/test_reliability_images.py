"""Image arrays as documented (issue 19.5): grey ``[H, W]`` arrays are accepted and read as PIL's
``convert("RGB")`` reads them, RGBA is composited onto white (transformers' image processors
since 5.21, vLLM), ``[C, H, W]`` is transposed, and an array whose last axis is a channel count
is channels-last however small it is (transformers' own guess reads a ``(1, 1, 3)`` picture
channels-first, with a warning). Each form must give the patches of the RGB PIL image it stands
for. Image files are read as transformers' ``load_image`` reads them: upright by their EXIF
orientation, alpha dropped.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.models.qwen2_5_omni.processor import OmniProcessor


@pytest.fixture(scope="module")
def processor(omni_dir) -> OmniProcessor:
    return OmniProcessor.from_pretrained(omni_dir)


def pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def on_white(rgba: np.ndarray) -> Image.Image:
    """transformers' composite of integer RGBA pixels onto white (its ``convert_to_rgb``, 5.21 on)."""
    alpha = rgba[..., 3:4] / 255
    return Image.fromarray(np.round(alpha * rgba[..., :3] + (1 - alpha) * 255).astype(np.uint8))


def pil_on_white(rgba: np.ndarray) -> Image.Image:
    """PIL's own composite onto white, which transformers uses for a PIL image."""
    white = Image.new("RGBA", rgba.shape[1::-1], (255, 255, 255, 255))
    return Image.alpha_composite(white, Image.fromarray(rgba, "RGBA")).convert("RGB")


# form -> (the array given, the RGB PIL image it stands for)
FORMS = {
    "grey [H, W]": lambda: (g := pixels((56, 84)), Image.fromarray(g).convert("RGB")),
    "grey [H, W, 1]": lambda: (g := pixels((56, 84, 1)), Image.fromarray(g[..., 0]).convert("RGB")),
    "grey [1, H, W]": lambda: (g := pixels((1, 56, 84)), Image.fromarray(g[0]).convert("RGB")),
    "RGBA [H, W, 4]": lambda: (a := pixels((56, 84, 4)), on_white(a)),
    "RGBA [4, H, W]": lambda: (a := pixels((4, 56, 84)), on_white(a.transpose(1, 2, 0))),
    "RGBA PIL image": lambda: (Image.fromarray(a := pixels((56, 84, 4)), "RGBA"), pil_on_white(a)),
    "RGB [3, H, W]": lambda: (c := pixels((3, 56, 84)), Image.fromarray(c.transpose(1, 2, 0))),
    "RGB (1, 1, 3)": lambda: (t := pixels((1, 1, 3)), Image.fromarray(t)),
    "RGB (3, 5, 3)": lambda: (t := pixels((3, 5, 3)), Image.fromarray(t)),
    "RGBA (4, 4, 4)": lambda: (t := pixels((4, 4, 4)), on_white(t)),
    "grey PIL image": lambda: (Image.fromarray(g := pixels((56, 84))), Image.fromarray(g).convert("RGB")),
}


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("form", list(FORMS))
def test_image_array_reads_as_its_rgb_image(processor, form) -> None:
    given, rgb = FORMS[form]()
    warnings = Collect()
    hf_logger = logging.getLogger("transformers")  # does not propagate to the root logger
    hf_logger.addHandler(warnings)
    try:
        got = processor.process(0, [processor.vision_bos_id, processor.image_id], {"image": given})
    finally:
        hf_logger.removeHandler(warnings)
    want = processor.process(0, [processor.vision_bos_id, processor.image_id], {"image": rgb})
    assert got.image_grid_thw == want.image_grid_thw
    np.testing.assert_array_equal(got.image_patches[0], want.image_patches[0])
    assert got.input_ids == want.input_ids
    assert warnings.messages == []


def test_float_rgba_is_composited_on_white_and_refused_off_its_scale(processor) -> None:
    """Float RGBA in [0, 1] composites onto 1.0 as its integer form does onto 255 (the same
    patches up to the integers' rounding); floats beyond 1 leave the alpha's scale a guess."""
    rgba = pixels((56, 84, 4)).astype(np.float32) / 255
    ids = [processor.vision_bos_id, processor.image_id]
    got = processor.process(0, ids, {"image": rgba}).image_patches[0]
    alpha = rgba[..., 3:4]
    want = processor.process(0, ids, {"image": alpha * rgba[..., :3] + (1 - alpha)}).image_patches[0]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(
        ValueError, match=r"^request 0: image: float RGBA pixels must lie in \[0, 1\], got \[0, 255\]"
    ):
        processor.process(0, ids, {"image": rgba * 255})
    below = rgba.copy()
    below[0, 0, 0] = -0.5
    with pytest.raises(
        ValueError, match=r"^request 0: image: float RGBA pixels must lie in \[0, 1\], got \[-0.5, "
    ):
        processor.process(0, ids, {"image": below})


def test_a_palette_image_with_a_transparent_colour_is_composited_on_white() -> None:
    """A palette image (a GIF, an 8-bit PNG) marks one colour transparent, with no alpha band:
    that colour's pixels become white, as an alpha band's would, not the colour itself."""
    from omni_jax.image_io import composite_rgb

    image = Image.new("P", (3, 2))
    image.putpalette([10, 20, 30, 200, 100, 50] + [0, 0, 0] * 254)
    image.putdata([0, 1, 0, 1, 1, 0])
    image.info["transparency"] = 0
    got = np.asarray(composite_rgb(image))
    white, kept = np.array([255, 255, 255]), np.array([200, 100, 50])
    np.testing.assert_array_equal(got.reshape(6, 3), [white, kept, white, kept, kept, white])


def test_an_image_file_is_read_upright_by_its_exif_orientation(processor, tmp_path) -> None:
    """A phone photo stores its rotation in EXIF (orientation 6: turn 90 degrees clockwise to
    view): the file reads as the turned picture, as transformers' ``load_image`` reads it."""
    stored = pixels((40, 80, 3), seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "photo.png"
    Image.fromarray(stored).save(path, exif=exif)
    ids = [processor.vision_bos_id, processor.image_id]
    got = processor.process(0, ids, {"image": str(path)})
    want = processor.process(0, ids, {"image": np.ascontiguousarray(np.rot90(stored, k=-1))})
    assert (
        got.image_grid_thw
        == want.image_grid_thw
        != processor.process(0, ids, {"image": stored}).image_grid_thw
    )
    np.testing.assert_array_equal(got.image_patches[0], want.image_patches[0])


@pytest.mark.parametrize("shape", [(5, 6, 2), (2, 5, 6), (5, 6, 7, 3), (5,)])
def test_other_shapes_refused_in_one_line(processor, shape) -> None:
    with pytest.raises(ValueError, match=r"^request 0: image must be a PIL image, an array \[H, W\]"):
        processor.process(0, [processor.vision_bos_id, processor.image_id], {"image": pixels(shape)})


def test_grey_image_through_the_thinker(omni_dir) -> None:
    """A grey array runs end to end and answers exactly as its RGB image does."""
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_model_len=256)
    grey = pixels((56, 84), seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = pipe.run(
        [
            pipe.chat_prompt([{"role": "user", "content": [{"type": "image", "image": image}]}])
            for image in (grey, Image.fromarray(grey).convert("RGB"))
        ],
        params,
        progress=False,
    )
    assert outs[0].error is None and len(outs[0].token_ids) == 4
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].token_ids == outs[1].token_ids
