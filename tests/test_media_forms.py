"""``multi_modal_data`` in the forms vLLM (and transformers) take, read as vLLM reads them.

An audio clip may come as ``(array, sample_rate)`` (vLLM's own form), resampled as a WAV file
at that rate is, or as a list of numbers; a video as a list of frames (PIL images or
``[H, W, C]`` arrays), as vLLM and transformers' video processors take it. Each form must give
exactly the features of the array form the parity tests already hold to transformers, through
the same processor; what cannot be read is refused naming the request. ``chat_prompt`` refuses
content items its chat template would drop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from omni_reference import frames, tone
from PIL import Image

from omni_jax import OmniJaxPipeline
from omni_jax.audio_io import resample
from omni_jax.models.qwen2_5_omni.processor import OmniInputs, OmniProcessor


@pytest.fixture(scope="module")
def pipe(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=1)


@pytest.fixture(scope="module")
def processor(pipe) -> OmniProcessor:
    return pipe.stages[0].frontend.processor


def placeholders(processor: OmniProcessor, kind: str, count: int) -> list[int]:
    """Prompt ids holding ``count`` placeholders of ``kind``, each after its start token."""
    start = processor.audio_bos_id if kind == "audio" else processor.vision_bos_id
    token = {"audio": processor.audio_id, "video": processor.video_id}[kind]
    text = processor.tokenizer.encode("the cat")
    return [*text, *([start, token] * count), *text]


def process(processor: OmniProcessor, kind: str, value: Any, count: int = 1) -> OmniInputs:
    return processor.process(1, placeholders(processor, kind, count), {kind: value})


def assert_same(a: OmniInputs, b: OmniInputs) -> None:
    assert a.input_ids == b.input_ids
    for x, y in zip(a.audio_features, b.audio_features, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.video_patches, b.video_patches, strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.video_grid_thw == b.video_grid_thw


@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_audio_with_its_rate_is_resampled_as_a_wav_file_is(processor, tmp_path, rate) -> None:
    from scipy.io import wavfile

    clip = np.resize(tone(1.5, 440, 3), int(rate * 1.5))  # 1.5 s at ``rate``
    path = tmp_path / "clip.wav"
    wavfile.write(path, rate, clip)
    rated = process(processor, "audio", (clip, rate))
    assert_same(rated, process(processor, "audio", str(path)))
    assert_same(rated, process(processor, "audio", resample(clip, rate, 16_000)))
    assert rated.audio_seqlens != process(processor, "audio", clip).audio_seqlens  # not read as 16 kHz


def test_audio_forms_equal_the_array(processor) -> None:
    a, b = tone(1.0, 440, 0), tone(0.5, 300, 1)
    assert_same(process(processor, "audio", (a, 16_000)), process(processor, "audio", a))
    assert_same(process(processor, "audio", (a, 16_000.0)), process(processor, "audio", a))
    assert_same(process(processor, "audio", a.tolist()), process(processor, "audio", a))
    two = process(processor, "audio", [(a, 16_000), (b.tolist(), 16_000)], count=2)
    assert_same(two, process(processor, "audio", [a, b], count=2))


@pytest.mark.parametrize(
    "value,match",
    [
        ((tone(1.0, 440, 0), 100), r"audio has a sample rate of 100 Hz; audio is read at 1000 to 384000 Hz"),
        ((tone(1.0, 440, 0), 8_000.5), r"audio sample rate must be a whole number of Hz, got 8000.5"),
        ((tone(1.0, 440, 0), float("inf")), r"audio sample rate must be a whole number of Hz, got inf"),
        ((np.zeros(31 * 8_000, np.float32), 8_000), r"audio is 31.00 s long \(248000 samples at 8000 Hz\)"),
        (
            (np.zeros(100, np.int16), 8_000),
            r"audio must be a 1-D float array .* got ndarray of shape \(100,\)",
        ),
        (("clip.wav", 8_000), r"audio must be a 1-D float array"),
        ((tone(1.0, 440, 0), 16_000, 1), r"audio must be a 1-D float array"),
    ],
    ids=[
        "rate too low",
        "fractional rate",
        "infinite rate",
        "31 s at 8 kHz",
        "int16 with a rate",
        "path with a rate",
        "3-tuple",
    ],
)
def test_bad_rated_audio_refused(processor, value, match) -> None:
    with pytest.raises(ValueError, match="^request 1: " + match):
        process(processor, "audio", value)


def test_video_as_frames_equals_the_array(processor) -> None:
    """A list of PIL images is one video (vLLM); a list of arrays is a list of videos there, so
    frames as arrays make a video as one item of the list (as a ``chat_prompt`` item puts it)."""
    video = frames(4, 56, 84, 0)
    whole = process(processor, "video", video)
    assert_same(process(processor, "video", [Image.fromarray(f) for f in video]), whole)
    assert_same(process(processor, "video", [list(video)]), whole)
    assert_same(process(processor, "video", [tuple(video)]), whole)
    rgba = np.concatenate([video, np.full((4, 56, 84, 1), 255, np.uint8)], axis=-1)
    assert_same(process(processor, "video", [Image.fromarray(f, "RGBA") for f in rgba]), whole)
    other = frames(2, 28, 28, 1)
    two = process(processor, "video", [list(video), [Image.fromarray(f) for f in other]], count=2)
    assert_same(two, process(processor, "video", [video, other], count=2))


@pytest.mark.parametrize(
    "value,match",
    [
        (
            [[frames(1, 56, 84, 0)[0], frames(1, 28, 28, 0)[0]]],
            r"video frames must share one shape and dtype",
        ),
        (
            [[np.zeros((56, 56, 2), np.uint8)] * 2],
            r"a video frame must be .* got ndarray of shape \(56, 56, 2\)",
        ),
        ([np.zeros((2, 56, 56), np.uint8)], r"video must be .* got ndarray of shape \(2, 56, 56\)"),
        ([np.zeros((56, 56, 3), np.uint8)], r"video must be .* got ndarray of shape \(56, 56, 3\)"),
    ],
    ids=["frames of two shapes", "two-channel frames", "frames without channels", "one frame, not a video"],
)
def test_bad_videos_refused_as_given(processor, value, match) -> None:
    with pytest.raises(ValueError, match=r"^request 1: " + match):
        process(processor, "video", value)


@pytest.mark.parametrize(
    "item,match",
    [
        (
            {"type": "file", "file": "a.pdf"},
            r"'type' is one of \['text', 'audio', 'image', 'video'\], got \{'type': 'file'",
        ),
        ("just text", r"a content item must be a dict .* got 'just text'"),
        ({"type": "image"}, r"a content item of type 'image' needs its data under the key 'image'"),
    ],
    ids=["unknown type", "not a dict", "no data"],
)
def test_chat_prompt_refuses_content_it_would_drop(pipe, item, match) -> None:
    """The chat template writes nothing for a content item of another type, so its data would
    vanish from the request unseen: ``chat_prompt`` refuses it instead."""
    with pytest.raises(ValueError, match=match):
        pipe.chat_prompt([{"role": "user", "content": [item, {"type": "text", "text": "hi"}]}])
