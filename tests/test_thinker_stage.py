"""The thinker stage end to end: ``from_pretrained(path, stages=["thinker"])`` on multimodal prompts.

The reference is transformers: ``Qwen2_5OmniProcessor.__call__`` (its own code, run with the
parts it would load; without torchvision its video processor is stood in for by our numpy frame
path, called with the arguments the composite passes) and the full model's
``thinker.generate(do_sample=False)`` on that processor's output. Our pipeline gets the raw
arrays and does its own processing, so ids, features, positions, encoders and the engine
(chunked prefill, batching, preemption) are all on the path being compared.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from omni_reference import (
    frames,
    picture,
    pil_reference_processor,
    reference_inputs,
    reference_processor,
    tone,
)

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.models.qwen2_5_omni.processor import (
    VIDEO_SIZE,
    OmniProcessor,
    TorchvisionVideoProcessor,
    VideoProcessor,
)
from omni_jax.models.qwen2_5_omni.thinker import PromptMerge

MAX_TOKENS = 6
FPS = 1.0  # two seconds per temporal patch: the audio-in-video layout spans two 2-second chunks


AUDIO, TRACK = tone(1.0, 440, 0), tone(2.5, 220, 1)
IMAGE_A, IMAGE_B = picture(56, 84, 2), picture(120, 90, 3)
VIDEO = frames(4, 28, 42, 4)


def user(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": "the cat and the dog"}]}]


CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "text": (user(), {}),
    "audio": (user({"type": "audio", "audio": AUDIO}), {}),
    "image": (user({"type": "image", "image": IMAGE_A}), {}),
    "two_images": (user({"type": "image", "image": IMAGE_A}, {"type": "image", "image": IMAGE_B}), {}),
    "video": (user({"type": "video", "video": VIDEO}), {"fps": FPS}),
    "video_with_audio": (user({"type": "video", "video": VIDEO}), {"fps": FPS, "use_audio_in_video": True}),
}


def our_prompt(pipe: OmniJaxPipeline, case: str) -> dict[str, Any]:
    messages, kwargs = CASES[case]
    prompt = pipe.chat_prompt(messages, **kwargs)
    if kwargs.get("use_audio_in_video"):
        prompt["multi_modal_data"]["audio"] = [TRACK]
    return prompt


@pytest.fixture(scope="module")
def ref_processor(omni_dir):
    return reference_processor(omni_dir)


@pytest.fixture(scope="module")
def pipe(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=8)


@pytest.fixture(scope="module")
def hf_thinker(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32)
    return model.thinker.eval()


@pytest.fixture(scope="module")
def expected(pipe, ref_processor, hf_thinker) -> dict[str, tuple[list[int], list[int]]]:
    """Per case: (the reference's expanded prompt ids, its greedy new tokens)."""
    eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = {}
    for case in CASES:
        prompt = our_prompt(pipe, case)
        inputs = reference_inputs(ref_processor, prompt)
        use_audio_in_video = bool(prompt.get("mm_processor_kwargs", {}).get("use_audio_in_video"))
        with torch.no_grad():
            seq = hf_thinker.generate(
                **inputs,
                use_audio_in_video=use_audio_in_video,
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=eos,
                pad_token_id=pipe.tokenizer.pad_token_id,
            )
        ids = inputs["input_ids"][0].tolist()
        out[case] = (ids, seq[0, len(ids) :].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(pipe, expected, case) -> None:
    (out,) = pipe.run(our_prompt(pipe, case), GREEDY, progress=False)
    want_ids, want_tokens = expected[case]
    assert out.prompt_token_ids == want_ids
    assert out.token_ids == want_tokens, out.error
    assert out.text == pipe.tokenizer.decode(want_tokens, skip_special_tokens=True)


def test_mixed_batch_matches_transformers(pipe, expected) -> None:
    """Every kind in one ``run()``: requests share steps, encoder calls and chunked prefills."""
    order = ["video_with_audio", "two_images", "text", "audio", "video", "image"]
    outs = pipe.run([our_prompt(pipe, c) for c in order], GREEDY, progress=False)
    assert [o.token_ids for o in outs] == [expected[c][1] for c in order]
    assert [o.prompt_token_ids for o in outs] == [expected[c][0] for c in order]
    with CompileCounter() as again:  # encoder and merge inputs come in buckets: nothing new to compile
        repeat = pipe.run([our_prompt(pipe, c) for c in order], GREEDY, progress=False)
    assert [o.token_ids for o in repeat] == [o.token_ids for o in outs]
    assert (again.traces, again.compiles) == (0, 0)


def test_preemption_and_converted_dir(omni_converted_dir, expected) -> None:
    """A converted checkpoint with too few KV pages for the batch: requests are preempted and
    recomputed (encoders re-run, positions from ``rope_delta`` again) yet match the reference.

    Prompts are prefilled in chunks of 128 tokens: the scheduler admits a request only into
    pages no running one needs next, so a whole-prompt prefill never preempts here; an older
    request's next chunk does."""
    pipe = OmniJaxPipeline.from_pretrained(
        omni_converted_dir, stages=["thinker"], num_pages=128, page_size=4, max_num_batched_tokens=128
    )
    order = ["video", "video_with_audio", "image", "audio"]
    outs = pipe.run([our_prompt(pipe, c) for c in order], GREEDY, progress=False)
    assert [o.token_ids for o in outs] == [expected[c][1] for c in order]
    assert sum(o.metrics["thinker"]["num_preemptions"] for o in outs) > 0


def assert_same_inputs(pipe: OmniJaxPipeline, ours: OmniProcessor, proc: Any, case: str) -> None:
    """``ours``' ids, audio features, image and video patches, grids and video timing for
    ``case`` against ``proc`` (a composite processor) on the same prompt, all exactly: ``ours``
    resamples pixels with the backend ``proc`` was built on."""
    prompt = our_prompt(pipe, case)
    ids = pipe.tokenizer(prompt["prompt"])["input_ids"]
    got = ours.process(0, ids, prompt.get("multi_modal_data"), **prompt.get("mm_processor_kwargs", {}))
    ref = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in reference_inputs(proc, prompt).items()}
    assert got.input_ids == ref["input_ids"][0].tolist(), case
    if "input_features" in ref:
        frames = ref["feature_attention_mask"].sum(-1)
        assert got.audio_seqlens == frames.tolist()
        for f, r, n in zip(got.audio_features, ref["input_features"], frames, strict=True):
            np.testing.assert_array_equal(f, r[:, :n])
    if "pixel_values" in ref:
        np.testing.assert_array_equal(np.concatenate(got.image_patches), ref["pixel_values"])
        assert got.image_grid_thw == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    if "video_grid_thw" in ref:
        assert got.video_grid_thw == [tuple(g) for g in ref["video_grid_thw"].tolist()], case
        assert got.video_second_per_grid == ref["video_second_per_grid"].tolist()
        np.testing.assert_array_equal(np.concatenate(got.video_patches), ref["pixel_values_videos"])


def test_processor_matches_reference_part_by_part(pipe, omni_dir) -> None:
    """On the PIL backend, features, grids and expanded ids equal those of the composite
    processor assembled from the PIL parts, for every case."""
    ours = OmniProcessor.from_pretrained(omni_dir, pixels="pil")
    reference = pil_reference_processor(omni_dir)
    for case in CASES:
        assert_same_inputs(pipe, ours, reference, case)
    size = {"shortest_edge": VIDEO_SIZE["shortest_edge"], "longest_edge": VIDEO_SIZE["longest_edge"]}
    assert reference.video_processor.calls
    assert all(call["size"] == size for call in reference.video_processor.calls)


def test_audio_features_equal_the_30_second_paddings(omni_dir) -> None:
    """Our audio features pad a call only one FFT window past its longest clip, yet equal bit
    for bit the extractor's frames as the composite calls it (every clip padded to 30 s): clips
    short and long in one call, one of whole hops (padded to its own length alone, its last
    frame would read its samples reflected), one of silence (its floor is the maximum), one of
    exactly 30 s."""
    ours = OmniProcessor.from_pretrained(omni_dir, pixels="pil")
    extractor = ours.feature_extractor
    rng = np.random.default_rng(3)
    calls = [
        [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (160, 36_817, 4_000)],
        [rng.standard_normal(32_000).astype(np.float32) * 0.1],  # whole hops: its last window ends past it
        [np.zeros(8_000, np.float32)],
        [rng.standard_normal(extractor.n_samples).astype(np.float32) * 0.1],
    ]
    for clips in calls:
        want = extractor(
            clips, sampling_rate=16_000, return_attention_mask=True, padding="max_length", return_tensors="np"
        )
        got = ours.audio_features(clips)
        for features, full, mask in zip(got, want["input_features"], want["attention_mask"], strict=True):
            np.testing.assert_array_equal(features, full[:, : int(mask.sum())])


def test_composite_processor_where_torchvision_is_installed(omni_dir, pipe) -> None:
    """transformers' own ``Qwen2_5OmniProcessor`` (``AutoProcessor``, with its torchvision image
    and video processors) against the pipeline's default, torchvision, backend on every case,
    videos included. torchvision has no CPU wheel for these machines, so CI skips this (the
    part-by-part test above covers the PIL backend); the GPU image has torchvision."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        pytest.skip(
            "needs torchvision, which has no CPU wheel here: without it transformers cannot build "
            "the composite processor at all (the PIL backend is checked part by part above)"
        )
    from transformers import AutoProcessor

    ours: OmniProcessor = pipe.stages[0].frontend.processor
    assert isinstance(ours.video_processor, TorchvisionVideoProcessor)
    composite = AutoProcessor.from_pretrained(omni_dir)
    for case in CASES:
        assert_same_inputs(pipe, ours, composite, case)


def test_video_frames_match_the_image_processor(pipe) -> None:
    """Two equal frames make one temporal patch; the slow image processor (PIL bicubic too)
    repeats an image over the temporal patch, so with the same size bounds both paths must
    agree. Only the order of rescale and normalise differs (the video path fuses them, as
    the reference's does), which costs float32 rounding, hence ``atol``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vp = VideoProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    ip = Qwen2VLImageProcessorPil(min_pixels=vp.min_pixels, max_pixels=vp.max_pixels)
    for h, w in ((50, 70), (300, 200)):
        frame = picture(h, w, h)
        patches, grid = vp(np.stack([frame, frame]))
        ref = ip(frame, return_tensors="np")
        assert grid == tuple(ref["image_grid_thw"][0])
        np.testing.assert_allclose(patches, ref["pixel_values"], rtol=0, atol=2e-6)
        odd, odd_grid = vp(np.stack([frame, frame, frame]))  # the last frame repeats to fill a patch
        assert odd_grid == (2, *grid[1:])
        np.testing.assert_array_equal(odd[: len(patches)], patches)
        np.testing.assert_array_equal(odd[len(patches) :], patches)


def bad(pipe: OmniJaxPipeline, prompt: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pipe.run(["hello", prompt], GREEDY, progress=False)


def test_wrong_inputs_name_the_request(pipe, tmp_path) -> None:
    good = our_prompt(pipe, "audio")
    text = good["prompt"]
    bad(
        pipe, dict(good, multi_modal_data={"audio": np.zeros((2, 100), np.float32)}), r"request 1: audio must"
    )
    bad(pipe, dict(good, multi_modal_data={"audio": np.zeros(100, np.int16)}), r"request 1: audio must")
    bad(
        pipe,
        dict(good, multi_modal_data={"audio": str(tmp_path / "x.mp3")}),
        r"request 1: .*x\.mp3' does not exist",
    )
    (tmp_path / "notes.txt").write_text("not audio")
    bad(
        pipe,
        dict(good, multi_modal_data={"audio": str(tmp_path / "notes.txt")}),
        r"request 1: audio file '.*notes\.txt' is not a media file FFmpeg can read",
    )
    bad(pipe, dict(good, multi_modal_data={"audio": [AUDIO, AUDIO]}), r"request 1: 1 audio placeholder")
    bad(pipe, dict(good, multi_modal_data={"speech": AUDIO}), r"request 1: .*unknown keys \['speech'\]")
    bad(pipe, {"prompt": text}, r"request 1: 1 audio placeholder\(s\) in the prompt but 0")
    img = our_prompt(pipe, "image")
    bad(pipe, dict(img, multi_modal_data={"image": np.zeros((4, 5, 6, 3))}), r"request 1: image must")
    bad(pipe, dict(img, multi_modal_data={"image": str(tmp_path / "missing.png")}), "does not exist")
    vid = our_prompt(pipe, "video")
    bad(pipe, dict(vid, multi_modal_data={"video": VIDEO[0]}), r"request 1: video must be a frame array")
    with_audio = our_prompt(pipe, "video_with_audio")
    bad(pipe, dict(with_audio, multi_modal_data={"video": VIDEO}), r"request 1: use_audio_in_video needs one")
    bad(pipe, dict(vid, mm_processor_kwargs={"fps": -1}), r"request 1: fps must be")
    bad(pipe, dict(vid, mm_processor_kwargs={"size": 3}), r"request 1: mm_processor_kwargs")
    bare = {"prompt": "look <|IMAGE|>", "multi_modal_data": {"image": IMAGE_A}}
    bad(pipe, bare, r"request 1: placeholder <\|IMAGE\|> at position \d+ must follow <\|vision_bos\|>")
    bad(pipe, dict(good, modalities=["audio"]), r"request 1: modalities \['audio'\] not produced")
    (out,) = pipe.run(good, GREEDY, progress=False)  # still usable
    assert out.finish_reason in ("stop", "length")


def test_wav_files_are_read(pipe, tmp_path, expected) -> None:
    """A .wav path (16-bit PCM here, given as ``omni-jax run --audio`` gives it) is read with
    scipy; at 16 kHz it is the same audio up to the 16-bit quantisation, which greedy tokens
    do not see."""
    from scipy.io import wavfile

    from omni_jax.cli import _prompt

    path = tmp_path / "a.wav"
    wavfile.write(path, 16_000, np.round(AUDIO * 32767).astype(np.int16))
    args = argparse.Namespace(
        prompt="the cat and the dog",
        audio=[str(path)],
        image=[],
        video=[],
        speaker=None,
        use_audio_in_video=False,
        fps=None,
    )
    prompt = _prompt(pipe, args)
    assert prompt["prompt"] == our_prompt(pipe, "audio")["prompt"]
    (out,) = pipe.run(prompt, GREEDY, progress=False)
    assert out.token_ids == expected["audio"][1]


def test_modalities_text_and_talker_without_thinker(omni_dir, pipe) -> None:
    (out,) = pipe.run(dict(our_prompt(pipe, "text"), modalities=["text"]), GREEDY, progress=False)
    assert out.finish_reason in ("stop", "length") and out.text is not None
    with pytest.raises(ValueError, match="stage 'talker' reads 'thinker'.s output and cannot take a prompt"):
        OmniJaxPipeline.from_pretrained(omni_dir, stages=["talker", "code2wav"])


def test_text_model_refuses_multimodal_data(qwen2_dir) -> None:
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=2)
    with pytest.raises(
        ValueError, match="request 0: this model takes no audio: its stage 'llm' reads no multi_modal_data"
    ):
        pipe.run({"prompt": "hi", "multi_modal_data": {"audio": AUDIO}}, progress=False)


def test_generated_placeholder_ids_keep_their_embeddings(pipe) -> None:
    """Only prompt tokens are merged: a recomputed chunk may end in generated tokens that happen
    to carry a placeholder id, and those keep their embeddings as in the reference's decode."""
    runner = pipe.stages[0].engine.runner
    thinker = nnx.merge(runner.graphdef, runner.state)
    spec = thinker.thinker_spec
    image_id = spec.image_token_id
    tokens = jnp.array([[image_id, 7, image_id, image_id]])
    rows = np.arange(2 * spec.text.hidden_size, dtype=np.float32).reshape(2, -1)
    ids = (spec.audio_token_id, image_id, spec.video_token_id)
    merge = PromptMerge(jnp.asarray(rows), jnp.zeros((3, 1), jnp.int32), jnp.array([3]), ids)
    got = np.asarray(thinker.embed(tokens, merge))[0]
    plain = np.asarray(thinker.embed(tokens))[0]
    np.testing.assert_array_equal(got[[0, 2]], rows)
    np.testing.assert_array_equal(got[[1, 3]], plain[[1, 3]])


def test_encoders_run_once_per_admission_not_per_decode_step(pipe, monkeypatch) -> None:
    """A request's media is encoded when it is scheduled; its decode steps run no encoder
    (they did: every decode row of a media request re-ran its encoders)."""
    step_inputs = pipe.stages[0].frontend.step_inputs
    encode = step_inputs.encode
    calls: list[int] = []

    def counted(requests):  # noqa: ANN001, ANN202 - ThinkerStepInputs.encode's
        calls.append(len(requests))
        return encode(requests)

    monkeypatch.setattr(step_inputs, "encode", counted)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = pipe.run([our_prompt(pipe, "audio"), our_prompt(pipe, "image")], params, progress=False)
    assert [len(o.token_ids) for o in outs] == [MAX_TOKENS, MAX_TOKENS]
    assert calls == [2]
