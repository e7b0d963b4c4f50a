"""Qwen3-Omni's thinker as a pipeline stage: ``from_pretrained(dir, stages=["thinker"])``.

The MoE thinker runs on the paged engine with its experts stacked from the checkpoint's
one-tensor-per-expert layout as they are read (the architecture's ``restack``), from the HF dir
and from a converted one, and its greedy replies equal transformers' thinker ``generate`` on the
tiny checkpoint, for text prompts and, through its frontend (:mod:`omni_jax.stages.qwen3_thinker`),
prompts with an image, two audio clips, a video, a video with its audio track, and all of them
in one batch with text-only prompts.

The reference's inputs come from transformers' ``Qwen3OmniMoeProcessor.__call__`` (its own code,
assembled from the checkpoint's parts; without torchvision our numpy frame path stands in for
its video processor, as in the Qwen2.5-Omni tests) on the same raw arrays our pipeline gets, so
ids, features, positions, encoders, the DeepStack rows and the engine are all on the path
compared.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.io.wavfile
import torch
from omni_reference import StandInVideoProcessor, frames, picture, reference_inputs, tone
from parity import rel_err
from stage_yamls import Whole, edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.stages.base import StageInput
from omni_jax.testing import reference_omni_processor

PROMPTS = ["tell me a story", "what is the capital of France?", "count to ten"]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
RTOL = 1e-5  # float32, same math as the reference: the thinker parity tests' tolerance

CLIP_A, CLIP_B = tone(0.61, 440, 0), tone(0.37, 330, 1)  # under one chunk: padded to the longer
TRACK = tone(2.5, 220, 2)  # 250 mel frames: three chunks in two attention windows
IMAGE = picture(64, 96, 3)
VIDEO = frames(4, 28, 42, 4)  # two grid steps of 2 s at the default 1 fps


def user(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": "the cat and the dog"}]}]


CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "text": (user(), {}),
    "image": (user({"type": "image", "image": IMAGE}), {}),
    "two_audios": (user({"type": "audio", "audio": CLIP_A}, {"type": "audio", "audio": CLIP_B}), {}),
    "video": (user({"type": "video", "video": VIDEO}), {}),
    "audio_in_video": (user({"type": "video", "video": VIDEO}), {"use_audio_in_video": True}),
}


def our_prompt(pipe: OmniJaxPipeline, case: str) -> dict[str, Any]:
    messages, kwargs = CASES[case]
    prompt = pipe.chat_prompt(messages, **kwargs)
    if kwargs.get("use_audio_in_video"):
        prompt["multi_modal_data"]["audio"] = [TRACK]
    return prompt


@pytest.fixture(scope="module")
def reference(qwen3_omni_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted(qwen3_omni_dir, tmp_path_factory):
    from omni_jax.weights import convert

    return convert(qwen3_omni_dir, tmp_path_factory.mktemp("qwen3_conv") / "conv", progress=False)


@pytest.fixture(scope="module")
def pipe(qwen3_omni_dir) -> OmniJaxPipeline:
    """Warmed up: every program the stage can run (encoder buckets included) is compiled.
    Prompts are prefilled in chunks of at most 128 tokens, which cut through placeholder runs."""
    pipe = OmniJaxPipeline.from_pretrained(
        qwen3_omni_dir, stages=["thinker"], max_num_seqs=8, max_num_batched_tokens=128
    )
    pipe.warmup(progress=False)
    return pipe


def reference_reply(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = reference.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def reference_processor(pipe, qwen3_omni_dir) -> Any:
    """transformers' ``Qwen3OmniMoeProcessor`` from the checkpoint's parts (module docstring)."""
    from transformers import Qwen3OmniMoeProcessor
    from transformers.utils import is_torchvision_available

    ours = pipe.stages[0].frontend.processor
    stand_in = None if is_torchvision_available() else StandInVideoProcessor(ours.video_processor)
    return reference_omni_processor(qwen3_omni_dir, stand_in, processor_class=Qwen3OmniMoeProcessor)


@pytest.fixture(scope="module")
def expected(pipe, reference, reference_processor) -> dict[str, tuple[list[int], list[int]]]:
    """Per case: (the reference processor's expanded prompt ids, the reference's greedy reply)."""
    out = {}
    for case in CASES:
        prompt = our_prompt(pipe, case)
        inputs = reference_inputs(reference_processor, prompt)
        use_audio_in_video = bool(prompt.get("mm_processor_kwargs", {}).get("use_audio_in_video"))
        with torch.no_grad():
            seq = reference.thinker.generate(
                **inputs, use_audio_in_video=use_audio_in_video, do_sample=False, max_new_tokens=MAX_TOKENS
            )
        ids = inputs["input_ids"][0].tolist()
        out[case] = (ids, seq[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("source", ["hf", "converted"])
def test_greedy_replies_equal_transformers(qwen3_omni_dir, converted, reference, source) -> None:
    pipe = OmniJaxPipeline.from_pretrained(
        qwen3_omni_dir if source == "hf" else converted, stages=["thinker"]
    )
    prompts = [pipe.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = pipe.run(prompts, SamplingParams(temperature=0.0, max_tokens=12), progress=False)
    for out in outs:
        want = reference_reply(reference, out.prompt_token_ids, 12)
        assert out.token_ids == want, (out.prompt_token_ids, out.token_ids, want)
        assert out.finish_reason == ("stop" if len(want) < 12 else "length")
    assert len({tuple(o.token_ids) for o in outs}) == len(PROMPTS)  # the replies differ


@pytest.mark.parametrize("case", [c for c in CASES if c != "text"])
def test_media_replies_equal_transformers(pipe, expected, case) -> None:
    (out,) = pipe.run(our_prompt(pipe, case), GREEDY, progress=False)
    want_ids, want_tokens = expected[case]
    assert out.prompt_token_ids == want_ids
    assert out.token_ids == want_tokens, out.error


def test_mixed_batch_equals_transformers_and_compiles_nothing_after_warmup(pipe, expected) -> None:
    """Every kind and text-only prompts in one ``run()``: requests share steps and encoder calls
    (clips of different requests in one audio call, each padded as its own request's reference
    call pads it), and after ``warmup()`` (the fixture's) nothing traces or compiles."""
    order = ["audio_in_video", "text", "two_audios", "image", "video", "text"]
    with CompileCounter() as counter:
        outs = pipe.run([our_prompt(pipe, c) for c in order], GREEDY, progress=False)
    assert [o.token_ids for o in outs] == [expected[c][1] for c in order]
    assert [o.prompt_token_ids for o in outs] == [expected[c][0] for c in order]
    assert (counter.traces, counter.compiles) == (0, 0)
    assert len({tuple(o.token_ids) for o in outs}) > 2  # the media matter


@pytest.mark.parametrize("in_video", [False, True], ids=["clip", "video_track"])
def test_audio_past_the_extractor_window_equals_transformers(
    pipe, reference, reference_processor, in_video: bool
) -> None:
    """45 s of audio, past the tiny feature extractor's 30 s window (its ``chunk_length``), as a
    clip or as a video's track (``use_audio_in_video``), which ``Qwen3OmniMoeProcessor``
    featurises whole (``truncation=False``): our prompt ids (585 audio tokens) and features
    equal its, and the thinker's 20 top log-probabilities (its logits, log-softmaxed) at each
    greedy step and its reply (past the end-of-turn token: ``generate`` does not stop at it
    here) equal transformers' thinker on its inputs, after
    ``warmup()`` with nothing traced or compiled. The audio calls stay those of the window (up
    to 32 chunks): the clip's 45 chunks are encoded in pieces of 32 and 13, cut at the edges of
    its attention windows (two chunks each here)."""
    step_inputs = pipe.stages[0].frontend.step_inputs
    assert step_inputs.buckets.audio_chunks == (1, 2, 4, 8, 16, 32)
    assert step_inputs.audio_pieces(4500) == [(0, 3200), (3200, 4500)]
    clip = (np.random.default_rng(6).standard_normal(45 * 16_000) * 0.1).astype(np.float32)
    if in_video:
        prompt = pipe.chat_prompt(user({"type": "video", "video": VIDEO}), use_audio_in_video=True)
        prompt["multi_modal_data"]["audio"] = [clip]
    else:
        prompt = pipe.chat_prompt(user({"type": "audio", "audio": clip}))
    inputs = reference_inputs(reference_processor, prompt)
    want_ids = inputs["input_ids"][0].tolist()
    processor = pipe.stages[0].frontend.processor
    ids = pipe.tokenizer(prompt["prompt"])["input_ids"]
    ours = processor.process(0, ids, prompt["multi_modal_data"], use_audio_in_video=in_video)
    assert ours.input_ids == want_ids and want_ids.count(processor.audio_id) == 585
    (features,) = ours.audio_features
    frames = int(inputs["feature_attention_mask"][0].sum())
    np.testing.assert_array_equal(features, inputs["input_features"][0, :, :frames].numpy())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=20, ignore_eos=True)
    with CompileCounter() as counter:
        (out,) = pipe.run(prompt, params, progress=False)
    assert (counter.traces, counter.compiles) == (0, 0)
    with torch.no_grad():
        seq = reference.thinker.generate(
            **inputs,
            use_audio_in_video=in_video,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert out.prompt_token_ids == want_ids, out.error
    assert out.token_ids == seq.sequences[0, len(want_ids) :].tolist()
    got, want = [], []
    for ours_step, logits in zip(out.logprobs, seq.logits, strict=True):
        reference_step = torch.log_softmax(logits[0], -1).numpy()
        got += list(ours_step.values())
        want += [reference_step[t] for t in ours_step]
    assert rel_err(np.array(got), np.array(want)) < RTOL, (got, want)


def test_audio_past_max_model_len_is_refused_before_it_is_featurised(pipe, monkeypatch) -> None:
    """Audio that cannot fit a prompt of ``max_model_len`` (1024) is refused naming the request
    before its features are computed, and the pipeline runs on: a clip whose own tokens fill it
    (80 s: 8000 mel frames, 1040 tokens; the longest that stays under is 1259679 samples, 1023
    tokens) as it is read, at 44.1 kHz before it is resampled (a WAV from its header, before it
    is decoded);
    a clip that fits alone but not beside the prompt's other tokens (78 s: 1014) from its
    samples, before it is featurised."""
    assert pipe.stages[0].max_model_len == 1024
    processor = pipe.stages[0].frontend.processor
    assert processor.least_audio_tokens(80 * 16_000) == 1040
    assert processor.longest_clip(1024) == 1259679
    assert processor.least_audio_tokens(1259679) == 1023 and processor.least_audio_tokens(1259680) == 1024

    def never(*args):  # noqa: ANN002, ANN202 - audio_features's and resample's
        raise AssertionError("the clip was featurised or resampled")

    monkeypatch.setattr(processor, "audio_features", never)
    monkeypatch.setattr("omni_jax.models.qwen2_5_omni.processor.resample", never)
    over = r"over the 78.7299 s it may last \(its audio tokens alone would fill max_model_len 1024\)$"
    clip = np.full(80 * 16_000, 0.01, np.float32)
    bad(
        pipe,
        pipe.chat_prompt(user({"type": "audio", "audio": clip})),
        r"^request 1: audio is 80.00 s long.* " + over,
    )
    rated = (np.zeros(80 * 44_100, np.float32), 44_100)
    bad(
        pipe,
        pipe.chat_prompt(user({"type": "audio", "audio": rated})),
        r"^request 1: audio is 80.00 s long \(3528000 samples at 44100 Hz\), over the 78.7299 s it may last$",
    )
    wav = io.BytesIO()
    scipy.io.wavfile.write(wav, 44_100, np.zeros(80 * 44_100, np.int16))
    bad(
        pipe,
        pipe.chat_prompt(user({"type": "audio", "audio": wav.getvalue()})),
        r"^request 1: audio \(file bytes\) is 80.00 s long \(3528000 samples at 44100 Hz\), "
        r"over the 78.7299 s",
    )
    bad(
        pipe,
        pipe.chat_prompt(user({"type": "audio", "audio": clip[: 78 * 16_000]})),
        r"^request 1: prompt has at least 10\d\d tokens \(its audio clips expanded from their samples\), "
        r"max_model_len is 1024 \(at least one token must be generated\)$",
    )
    monkeypatch.undo()
    (out,) = pipe.run(our_prompt(pipe, "two_audios"), GREEDY, progress=False)
    assert out.error is None


def test_encoder_fault_ends_only_its_request(pipe, expected, monkeypatch) -> None:
    """The vision encoder fails for one request's image: the joint call fails, each request is
    encoded alone, and only that request ends, with the fault's message."""
    frontend = pipe.stages[0].frontend
    culprit = pipe.chat_prompt(user({"type": "image", "image": picture(128, 128, 5)}))
    ids = pipe.tokenizer(culprit["prompt"])["input_ids"]
    (grid,) = frontend.processor.process(1, ids, culprit["multi_modal_data"]).image_grid_thw
    assert grid != frontend.processor.process(0, ids, {"image": [IMAGE]}).image_grid_thw[0]
    vision_batch = frontend.step_inputs.vision_batch

    def flaky(patches, grids, tokens):  # noqa: ANN001, ANN202 - ThinkerStepInputs.vision_batch's
        if tuple(grid) in [tuple(g) for g in grids]:
            raise ValueError("injected encoder fault")
        return vision_batch(patches, grids, tokens)

    monkeypatch.setattr(frontend.step_inputs, "vision_batch", flaky)
    others = ["image", "two_audios", "text"]
    outs = pipe.run([culprit, *(our_prompt(pipe, c) for c in others)], GREEDY, progress=False)
    assert (outs[0].finish_reason, outs[0].token_ids) == ("error", [])
    assert outs[0].error == "stage 'thinker': encoder failed: ValueError: injected encoder fault"
    assert [o.token_ids for o in outs[1:]] == [expected[c][1] for c in others]


def bad(pipe: OmniJaxPipeline, prompt: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pipe.run(["hello", prompt], GREEDY, progress=False)


def test_bad_media_are_refused_naming_the_request(pipe) -> None:
    clips = our_prompt(pipe, "two_audios")
    bad(pipe, dict(clips, multi_modal_data={"audio": [CLIP_A]}), r"request 1: 2 audio placeholder")
    bad(pipe, dict(clips, multi_modal_data={"audio": [np.zeros((2, 100)), CLIP_B]}), r"request 1: audio must")
    image = our_prompt(pipe, "image")
    bad(pipe, dict(image, multi_modal_data={"image": [np.zeros((4, 5, 6, 3))]}), r"request 1: image must")
    video = our_prompt(pipe, "video")
    bad(
        pipe,
        dict(video, mm_processor_kwargs={"fps": 3}),
        r"request 1: its video time positions are fractional",
    )
    with_audio = our_prompt(pipe, "audio_in_video")
    bad(
        pipe,
        dict(with_audio, multi_modal_data={"video": [VIDEO]}),
        r"request 1: use_audio_in_video needs one",
    )
    (out,) = pipe.run(image, GREEDY, progress=False)  # still usable
    assert out.finish_reason in ("stop", "length")


def test_clips_too_short_for_the_stft_are_refused(pipe) -> None:
    """The feature extractor's STFT reflects 200 samples at each edge: a request whose longest
    clip is no longer is refused naming it (the reference fails in torch's padding, and the
    server answered 500); one such clip beside a longer one is padded to it, as the reference
    does, and runs."""
    clips = our_prompt(pipe, "two_audios")
    short = np.full(200, 0.1, np.float32)
    bad(
        pipe,
        dict(clips, multi_modal_data={"audio": [short, short[:1]]}),
        r"^request 1: audio is 200 samples long \(12.5 ms at 16000 Hz\); the feature extractor needs "
        r"more than 200 samples in the longest clip$",
    )
    outs = pipe.run([dict(clips, multi_modal_data={"audio": [short[:1], CLIP_B]})], GREEDY, progress=False)
    assert outs[0].error is None and outs[0].finish_reason in ("stop", "length")
    least = np.append(short, 0.1)  # 201 samples: the shortest a request's longest clip may be
    (one,) = pipe.run(dict(clips, multi_modal_data={"audio": [least, least]}), GREEDY, progress=False)
    assert one.error is None


def test_clips_are_padded_as_their_own_requests_reference_call(pipe) -> None:
    """The reference pads every chunk of one request's clips to that request's longest chunk,
    unmasked between its convolutions: a request's audio rows are the same whether its clips
    share an encoder call with another request's longer clip or are encoded alone."""
    frontend = pipe.stages[0].frontend
    requests = []
    for i, case in enumerate(["audio_in_video", "two_audios"]):
        prompt = our_prompt(pipe, case)
        ids = pipe.tokenizer(prompt["prompt"])["input_ids"]
        requests.append(frontend.prepare(i, StageInput(ids, prompt)).state)
    audio_id = frontend.step_inputs.token_ids[0]
    frontend.step_inputs.encode(requests)
    together = requests[1].rows[audio_id]
    frontend.step_inputs.encode(requests[1:])
    np.testing.assert_allclose(together, requests[1].rows[audio_id], rtol=1e-5, atol=1e-5)


def test_media_limits_apply_to_qwen3_omni(qwen3_omni_dir, tmp_path: Path) -> None:
    """``engine.limit_mm_per_prompt`` in Qwen3-Omni's stage YAML: images and videos off leave
    the vision encoder's programs out of warm-up (audio's stay), and an image is refused."""
    limits = {"engine": {"limit_mm_per_prompt": Whole(image=0, video=0)}}
    path = edited_stages(tmp_path / "limited.yaml", "qwen3_omni", thinker=limits)
    pipe = OmniJaxPipeline.from_pretrained(
        qwen3_omni_dir, stages=["thinker"], max_num_seqs=4, stage_config=path
    )
    buckets = pipe.stages[0].frontend.step_inputs.buckets
    assert buckets.vision_tokens == () and buckets.audio_chunks
    assert pipe.stages[0].frontend.warmup() == len(buckets.audio_chunks)
    with pytest.raises(ValueError, match=r"request 0: 1 image item\(s\), more than the 0"):
        pipe.run([pipe.chat_prompt(user({"type": "image", "image": picture(56, 56, 1)}))], None, False)
