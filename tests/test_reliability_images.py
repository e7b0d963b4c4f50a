"""Image arrays as documented (issue 19.5): grey ``[H, W]`` arrays are accepted and read as PIL's
``convert("RGB")`` reads them, RGBA drops its alpha, ``[C, H, W]`` is transposed, and an array
whose last axis is a channel count is channels-last however small it is (transformers' own
guess reads a ``(1, 1, 3)`` picture channels-first, with a warning). Each form must give the
patches of the RGB PIL image it stands for.
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


# form -> (the array given, the RGB PIL image it stands for)
FORMS = {
    "grey [H, W]": lambda: (g := pixels((56, 84)), Image.fromarray(g).convert("RGB")),
    "grey [H, W, 1]": lambda: (g := pixels((56, 84, 1)), Image.fromarray(g[..., 0]).convert("RGB")),
    "grey [1, H, W]": lambda: (g := pixels((1, 56, 84)), Image.fromarray(g[0]).convert("RGB")),
    "RGBA [H, W, 4]": lambda: (a := pixels((56, 84, 4)), Image.fromarray(a).convert("RGB")),
    "RGB [3, H, W]": lambda: (c := pixels((3, 56, 84)), Image.fromarray(c.transpose(1, 2, 0))),
    "RGB (1, 1, 3)": lambda: (t := pixels((1, 1, 3)), Image.fromarray(t)),
    "RGB (3, 5, 3)": lambda: (t := pixels((3, 5, 3)), Image.fromarray(t)),
    "RGBA (4, 4, 4)": lambda: (t := pixels((4, 4, 4)), Image.fromarray(t).convert("RGB")),
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
