"""Bad input is refused before any work, naming the request; encoder faults end one request.

Every case here goes to ``run()`` as the second of two prompts next to a good one. It must
raise ``ValueError`` naming request 1 and the problem, no engine step or solve may run (the
stages' step methods are counted), nothing may be left queued, and the same pipeline must
then serve a good prompt. Cases already covered elsewhere are not repeated: prompt ids,
sampling values and wrong array ranks/int audio (``test_run_greedy``, ``test_thinker_stage``),
codec ids outside the vocabulary and ``initial_noise`` of the wrong shape for a code2wav-first
pipeline (``test_code2wav_stage``).

Limits the refusals encode: Qwen2.5-Omni audio longer than the feature extractor's
``n_samples`` (30 s, its ``chunk_length``; its processor cuts it there, Qwen3-Omni's takes it
whole) is refused, with advice that can be followed (a video's one track cannot be split into
audio items); audio whose tokens, counted from its samples, take the prompt to
``max_model_len`` is refused before it is featurised; images, or audio that only the exact
count takes there, are refused by the prompt-length check, which then says what the media
expanded to. A WAV file at another rate
is resampled to 16 kHz (``scipy.signal.resample_poly``), not refused.

The last tests are run-time faults of the thinker's encoders (issue 6): a failure in the one
batched encoder call is retried request by request, so only the culprit ends with
``finish_reason="error"``, and the others get their unconstrained results.
"""

from __future__ import annotations

import base64
import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from omni_reference import frames, picture, tone
from PIL import Image
from stand_ins import rows_nearly_free
from step_counts import count_steps
from test_serve_units import MALFORMED_PNG_EXIF

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.stages import thinker as thinker_module

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
AUDIO = tone(1.0, 440, 0)


def user(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": "the cat"}]}]


@pytest.fixture(scope="module")
def pipe(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=4)


def with_media(pipe: OmniJaxPipeline, kind: str, item: Any, **kwargs: Any) -> dict[str, Any]:
    """A chat prompt with one ``kind`` placeholder and ``item`` as its data (unchecked)."""
    placeholder = {"audio": AUDIO, "image": picture(28, 28, 0), "video": frames(2, 28, 28, 0)}[kind]
    prompt = pipe.chat_prompt(user({"type": kind, kind: placeholder}), **kwargs)
    prompt["multi_modal_data"] = {kind: item}
    return prompt


def refused(
    pipe: OmniJaxPipeline,
    monkeypatch: pytest.MonkeyPatch,
    prompt: Any,
    match: str,
    good: Any = "hello",
    params: Any = GREEDY,
) -> None:
    """``prompt`` as request 1 is refused with ``match`` before any step; the pipeline then
    serves ``good`` (and nothing of the refused run is left behind)."""
    with monkeypatch.context() as m:
        steps = count_steps(pipe, m)
        with pytest.raises(ValueError, match="request 1: " + match):
            pipe.run([good, prompt], params, progress=False)
        assert steps == []
    for stage in pipe.stages:
        assert not stage.has_work() and not stage._submitted
    (out,) = pipe.run(good, params[0] if isinstance(params, list) else params, progress=False)
    assert out.error is None and out.finish_reason in ("stop", "length")


def _nan_audio() -> np.ndarray:
    audio = AUDIO.copy()
    audio[100] = np.nan
    return audio


THINKER_CASES: dict[str, tuple[str, Callable[[], Any], str, dict[str, Any]]] = {
    # name: (placeholder kind, data, message, mm_processor_kwargs)
    "complex audio": ("audio", lambda: AUDIO.astype(np.complex64), r"audio must be a 1-D float array", {}),
    "0-d audio": ("audio", lambda: np.array(0.5, np.float32), r"audio must be a 1-D float array", {}),
    "empty audio": ("audio", lambda: np.zeros(0, np.float32), r"audio is empty", {}),
    "nan audio": ("audio", _nan_audio, r"audio contains 1 non-finite value\(s\) \(NaN or inf\)", {}),
    "inf audio": ("audio", lambda: np.full(800, np.inf, np.float32), r"audio contains 800 non-finite", {}),
    "float64 audio past float32": (
        "audio",
        lambda: np.full(1600, 1e300),
        r"audio holds values past float32's range \(largest magnitude 1e\+300\)",
        {},
    ),
    "31 s audio": (
        "audio",
        lambda: np.zeros(31 * 16_000, np.float32),
        r"audio is 31.00 s long \(496000 samples at 16000 Hz\); clips are taken up to the feature "
        r"extractor's window of 30 s \(480000 samples, its chunk_length\), refused past it rather than cut: "
        r"split it into several audio items of at most 30 s$",
        {},
    ),
    "25 s audio past max_model_len": (
        "audio",
        lambda: tone(25.0, 440, 1),
        r"prompt has at least \d+ tokens \(its audio clips expanded from their samples\), max_model_len is",
        {},
    ),
    "zero-size image": ("image", lambda: np.zeros((0, 5, 3), np.uint8), r"image has an empty dimension", {}),
    "zero-size grey image": (
        "image",
        lambda: np.zeros((7, 0), np.uint8),
        r"image has an empty dimension",
        {},
    ),
    "zero-size PIL image": ("image", lambda: Image.new("RGB", (0, 4)), r"image has an empty dimension", {}),
    "nan image": (
        "image",
        lambda: np.full((28, 28, 3), np.nan, np.float32),
        r"image contains 2352 non-finite",
        {},
    ),
    "complex image": (
        "image",
        lambda: np.zeros((28, 28, 3), np.complex64),
        r"image pixels must be integers or real floats, got dtype complex64",
        {},
    ),
    "bool image": (
        "image",
        lambda: np.zeros((28, 28, 3), bool),
        r"image pixels must be .* got dtype bool",
        {},
    ),
    "image past max_model_len": (
        "image",
        lambda: picture(700, 700, 1),
        r"prompt has \d+ tokens \(its media placeholders expanded to 625 image tokens\)",
        {},
    ),
    "unreadable image file": ("image", lambda: __file__, r"image file .* cannot be read", {}),
    "image file whose EXIF PIL cannot parse": (
        "image",
        lambda: written(base64.b64decode(MALFORMED_PNG_EXIF), ".png"),
        r"image file .* cannot be read: SyntaxError: ",
        {},
    ),
    "video without frames": (
        "video",
        lambda: np.zeros((0, 28, 28, 3), np.uint8),
        r"video has an empty dimension",
        {},
    ),
    "nan video": ("video", lambda: np.full((2, 28, 28, 3), np.nan, np.float32), r"video contains", {}),
    "float64 video past float32": (
        "video",
        lambda: np.full((2, 28, 28, 3), -1e300),
        r"video holds values past float32's range",
        {},
    ),
    "fps a bool": (
        "video",
        lambda: frames(2, 28, 28, 1),
        r"fps must be a positive finite number, got True",
        {"fps": True},
    ),
    "fps infinite": (
        "video",
        lambda: frames(2, 28, 28, 1),
        r"fps must be a positive finite number, got inf",
        {"fps": float("inf")},
    ),
    "use_audio_in_video a string": (
        "video",
        lambda: frames(2, 28, 28, 1),
        r"use_audio_in_video must be true or false, got 'yes'",
        {"use_audio_in_video": "yes"},
    ),
    "complex video": (
        "video",
        lambda: np.zeros((2, 28, 28, 3), np.complex64),
        r"video pixels must be integers or real floats",
        {},
    ),
}


@pytest.mark.parametrize(
    "prompt,match",
    [
        (
            {"prompt": "hello", "speaker": "Ethan"},
            r"'speaker' names a voice, and the built stages \['thinker'\]",
        ),
        ({"prompt": "hello", "prompt_token_ids": [1, 2]}, r"give 'prompt' or 'prompt_token_ids', not both$"),
    ],
    ids=["voice for a text pipeline", "text and ids"],
)
def test_prompt_keys_that_cannot_both_hold_are_refused(pipe, monkeypatch, prompt, match) -> None:
    """A voice asked of a pipeline that only writes text, or a prompt given twice, is a mistake
    to say, not something to pick a side of silently."""
    refused(pipe, monkeypatch, prompt, match)


def written(data: bytes, suffix: str) -> str:
    """A file of ``data`` in the system's temporary folder (the cases are built without a
    fixture), its path."""
    with tempfile.NamedTemporaryFile(suffix=suffix, delete=False) as f:
        f.write(data)
    return f.name


@pytest.mark.parametrize("case", list(THINKER_CASES))
def test_bad_media_refused_before_work(pipe, monkeypatch, case) -> None:
    kind, make, match, kwargs = THINKER_CASES[case]
    refused(pipe, monkeypatch, with_media(pipe, kind, make(), **kwargs), match)


def test_bad_audio_track_of_a_video_refused(pipe, monkeypatch) -> None:
    prompt = with_media(pipe, "video", frames(2, 28, 28, 1), use_audio_in_video=True)
    prompt["multi_modal_data"]["audio"] = [_nan_audio()]
    refused(pipe, monkeypatch, prompt, r"audio contains 1 non-finite")


def test_long_audio_track_of_a_video_refused(pipe, monkeypatch) -> None:
    """A video's 31 s track is refused with advice that can be followed: with
    ``use_audio_in_video`` a video has one track, which cannot be split into audio items."""
    prompt = with_media(pipe, "video", frames(2, 28, 28, 1), use_audio_in_video=True)
    prompt["multi_modal_data"]["audio"] = [np.zeros(31 * 16_000, np.float32)]
    refused(
        pipe,
        monkeypatch,
        prompt,
        r"audio is 31.00 s long .*: with use_audio_in_video a video has exactly one audio track, so split "
        r"the video into videos of at most 30 s$",
    )


@pytest.mark.parametrize("tracks", [0, 2])
def test_each_video_has_one_audio_track(pipe, monkeypatch, tracks: int) -> None:
    """With ``use_audio_in_video`` the audio entries are the videos' tracks, one each: a second
    track would be dropped, or paired with no video, without a word."""
    prompt = with_media(pipe, "video", frames(2, 28, 28, 1), use_audio_in_video=True)
    prompt["multi_modal_data"]["audio"] = [np.full(16_000, 0.01, np.float32)] * tracks
    refused(
        pipe,
        monkeypatch,
        prompt,
        rf"use_audio_in_video needs one audio track per video: 1 videos, {tracks} audios",
    )


def test_an_audio_track_too_short_for_a_token_is_refused_by_name(pipe, monkeypatch) -> None:
    """A video's audio track of too few samples for one audio token leaves its video no audio
    span: refused naming the track (it was numpy's "zero-size array to reduction operation")."""
    prompt = with_media(pipe, "video", frames(2, 28, 28, 1), use_audio_in_video=True)
    prompt["multi_modal_data"]["audio"] = [np.full(100, 0.01, np.float32)]
    refused(
        pipe,
        monkeypatch,
        prompt,
        r"video 0's audio track of 100 samples \(at 16000 Hz\) is too short for one",
    )


class NoResizing:
    """A video processor that answers :meth:`least_tokens` and refuses to resize any frame."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.temporal_patch_size = processor.temporal_patch_size

    def least_tokens(self, frames: int) -> int:
        return self.processor.least_tokens(frames)

    def __call__(self, video: np.ndarray) -> Any:
        raise AssertionError(f"{len(video)} frames were resized")


def test_a_video_no_context_holds_is_refused_before_its_frames_are(pipe, monkeypatch) -> None:
    """A video whose frames, each pair at least ``min_pixels``, expand past ``max_model_len`` is
    refused from its frame count (800 frames of 32x32 took 21 s and 3 GB to be refused for their
    length); so are media over ``limit_mm_per_prompt``: neither resizes a frame."""
    frontend = pipe.stages[0].frontend
    monkeypatch.setattr(frontend.processor, "video_processor", NoResizing(frontend.processor.video_processor))
    frames_over = 2 * (pipe.stages[0].max_model_len // 128 + 1)  # 128 tokens a pair at the least
    prompt = with_media(pipe, "video", frames(frames_over, 28, 28, 1))
    least = (frames_over // 2) * 128
    refused(
        pipe, monkeypatch, prompt, rf"prompt has at least {least + len(prompt_ids(pipe, prompt)) - 1} tokens"
    )
    # Without a video the stage's own check refuses an over-long prompt, with its exact length.
    refused(pipe, monkeypatch, {"prompt": "hello " * 600}, r"prompt has \d+ tokens, max_model_len is")
    monkeypatch.setattr(frontend, "limits", thinker_module.MediaLimits(video=0))
    refused(
        pipe,
        monkeypatch,
        with_media(pipe, "video", frames(2, 28, 28, 1)),
        r"1 video item\(s\), more than the 0",
    )


def prompt_ids(pipe: OmniJaxPipeline, prompt: dict[str, Any]) -> list[int]:
    """The prompt's token ids before its placeholders are expanded."""
    return pipe.tokenizer(prompt["prompt"])["input_ids"]


def test_numpy_numbers_are_an_fps(pipe) -> None:
    """``fps`` as numpy gives it (``np.float32(2)``) is the same rate as ``2.0``."""
    prompts = [with_media(pipe, "video", frames(2, 28, 28, 1), fps=fps) for fps in (2.0, np.float32(2))]
    (a, b) = pipe.intake.admit(prompts, GREEDY, ["np-fps-a", "np-fps-b"])
    assert a.input.token_ids == b.input.token_ids
    np.testing.assert_array_equal(a.input.state.positions, b.input.state.positions)


def test_max_tokens_within_context_counts_the_expanded_prompt(pipe) -> None:
    """``within_context`` (the server's rule for an explicit ``max_tokens``) fits the prompt with
    its media placeholders expanded and ``max_tokens`` into ``max_model_len``; without it the same
    request is admitted (generation stops at the context's end)."""
    prompt = with_media(pipe, "audio", tone(5.0, 440, 1))
    (admitted,) = pipe.intake.admit([prompt], GREEDY, ["a"])
    n, room = len(admitted.input.token_ids), pipe.stages[0].max_model_len - len(admitted.input.token_ids)
    assert n > 125  # 5 s of audio: 125 audio tokens besides the text
    fits = dataclasses.replace(GREEDY, max_tokens=room)
    (admitted,) = pipe.intake.admit([prompt], fits, ["b"], within_context=True)
    assert admitted.stage_params[0].max_tokens == room
    over = dataclasses.replace(GREEDY, max_tokens=room + 1)
    with pytest.raises(ValueError, match=rf"request 0: .*too large: {room + 1}\..* has {n} input tokens"):
        pipe.intake.admit([prompt], over, ["c"], within_context=True)
    pipe.intake.admit([prompt], over, ["d"])
    assert not pipe.stages[0].has_work()


def test_bad_wav_files_refused(pipe, monkeypatch, tmp_path) -> None:
    from scipy.io import wavfile

    empty = tmp_path / "empty.wav"
    wavfile.write(empty, 16_000, np.zeros(0, np.int16))
    refused(
        pipe, monkeypatch, with_media(pipe, "audio", str(empty)), r"audio file .*empty.wav' holds no samples"
    )
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk")
    refused(
        pipe,
        monkeypatch,
        with_media(pipe, "audio", str(broken)),
        r"audio file .*broken.wav' is not a readable",
    )
    long = tmp_path / "long.wav"
    wavfile.write(long, 8_000, np.zeros(31 * 8_000, np.int16))  # 31 s at 8 kHz
    refused(  # from the header, before resampling
        pipe,
        monkeypatch,
        with_media(pipe, "audio", str(long)),
        r"audio file .*long.wav' is 31.00 s long \(248000 samples at 8000 Hz\), over the 30 s it may last",
    )


@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_wav_at_another_rate_is_resampled(pipe, tmp_path, rate) -> None:
    """Read at its own rate and resampled to 16 kHz: the same duration, so the same expanded
    prompt as the 16 kHz array (a file misread as 16 kHz would expand to another length)."""
    from scipy.io import wavfile

    seconds = 1.5
    t = np.arange(int(rate * seconds)) / rate
    path = tmp_path / f"tone_{rate}.wav"
    wavfile.write(path, rate, np.round(0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16))
    t16 = np.arange(int(16_000 * seconds)) / 16_000
    at_16k = (0.3 * np.sin(2 * np.pi * 440 * t16)).astype(np.float32)
    (from_file,) = pipe.run(with_media(pipe, "audio", str(path)), GREEDY, progress=False)
    (from_array,) = pipe.run(with_media(pipe, "audio", at_16k), GREEDY, progress=False)
    assert from_file.error is None and from_file.prompt_token_ids == from_array.prompt_token_ids


def test_wrong_mm_containers_refused(pipe, monkeypatch) -> None:
    prompt = with_media(pipe, "audio", AUDIO)
    refused(pipe, monkeypatch, dict(prompt, multi_modal_data=[AUDIO]), r"multi_modal_data must be a dict")
    refused(pipe, monkeypatch, dict(prompt, multi_modal_data={"audio": [None]}), r"audio must be a 1-D float")
    refused(pipe, monkeypatch, dict(prompt, multi_modal_data={"audio": [[AUDIO]]}), r"audio must be")


# -- the full pipeline and code2wav first -----------------------------------------------------


@pytest.fixture(scope="module")
def full(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=2)


FULL_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=4),
    Token2WavParams(num_steps=2, seed=0),
]


@pytest.mark.parametrize(
    "change,params,match",
    [
        ({"speaker": "Nobody"}, None, r"unknown speaker 'Nobody'; known speakers: \['Chelsie', 'Ethan'\]"),
        ({"speaker": ["Ethan"]}, None, r"speaker must be a voice name \(str\), got list"),
        ({"modalities": ["video"]}, None, r"modalities must be a non-empty list"),
        ({"modalities": [["text"]]}, None, r"modalities must be a non-empty list"),  # was a TypeError
        ({"modalities": []}, None, r"modalities must be a non-empty list of 'text'/'audio', got \[\]"),
        (
            {"speakr": "Ethan"},
            None,
            r"unknown prompt key\(s\) \['speakr'\]; a prompt dict takes \['prompt', 'prompt_token_ids', ",
        ),
        (
            {},
            [*FULL_PARAMS[:2], Token2WavParams(initial_noise=np.zeros((4, 8, 1), np.float32))],
            r"stage 'code2wav': initial_noise must be a float array",
        ),
        *(  # no codes the talker may make fit it: refused before the thinker and talker work
            (
                {},
                [*FULL_PARAMS[:2], Token2WavParams(initial_noise=np.zeros(shape, np.float32))],
                rf"initial_noise has shape \({shape[0]}, {shape[1]}\), which no request's codes fit: "
                r"\[len\(codes\) \* 2, 8\] \(\[len\(codes\) \* repeats, mel_dim\]\) for 1 to \d+ codes",
            )
            for shape in [(10, 7), (7, 8), (0, 8), (2 * 10**5, 8)]  # width, odd frames, none, too many
        ),
        ({}, [FULL_PARAMS[0], Token2WavParams(), FULL_PARAMS[2]], r"stage 'talker' needs SamplingParams"),
    ],
)
def test_full_pipeline_refuses_before_work(full, monkeypatch, change, params, match) -> None:
    bad = dict(full.chat_prompt(user()), **change)
    per_stage = FULL_PARAMS if params is None else [[a, b] for a, b in zip(FULL_PARAMS, params, strict=True)]
    with monkeypatch.context() as m:
        steps = count_steps(full, m)
        with pytest.raises(ValueError, match="request 1: " + match):
            full.run([full.chat_prompt(user()), bad], per_stage, progress=False)
        assert steps == []
    assert not any(s.has_work() or s._submitted for s in full.stages)


def test_full_pipeline_usable_after_refusals(full) -> None:
    """After the refusals above (module order), all three stages serve a prompt."""
    (out,) = full.run(dict(full.chat_prompt(user()), speaker="Ethan"), FULL_PARAMS, progress=False)
    assert out.error is None and out.audio is not None
    assert not any(s.has_work() or s._submitted for s in full.stages)


@pytest.fixture(scope="module")
def code2wav(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])


@pytest.mark.parametrize(
    "bad,params,match",
    [
        (
            {"prompt_token_ids": [1, 2, 3]},
            Token2WavParams(initial_noise=np.full((6, 8), np.nan)),
            "stage 'code2wav': initial_noise contains values that are not finite as float32",
        ),
        (
            {"prompt_token_ids": [1, 2, 3]},
            Token2WavParams(initial_noise=np.full((6, 8), 1e39)),
            "stage 'code2wav': initial_noise contains values that are not finite as float32",
        ),
        (
            {"prompt_token_ids": [1, 2, 3]},
            Token2WavParams(initial_noise=np.zeros((6, 8), np.int32)),
            r"stage .code2wav.: initial_noise must be a float array .*, got shape \(6, 8\), dtype int32",
        ),
        (
            {"prompt_token_ids": [1, 2, 3]},
            Token2WavParams(initial_noise=np.zeros((6, 4), np.float32)),
            r"initial_noise has shape \(6, 4\), 3 codes need \(6, 8\)",
        ),
        (
            {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"audio": AUDIO}},
            None,
            "this model takes no audio: its stage .code2wav. reads no multi_modal_data",
        ),
        ({"prompt_token_ids": [1, 2], "speaker": "Nobody"}, None, "unknown speaker 'Nobody'"),
        ({"prompt_token_ids": [1, 2.0]}, None, "prompt_token_ids must be a list of ints"),
        ({"prompt_token_ids": [1, True]}, None, "prompt_token_ids must be a list of ints"),
        (
            {"prompt_token_ids": np.array([[1, 2]])},
            None,
            "prompt_token_ids must be a list of ints or a 1-D integer array",
        ),
        (
            {"prompt_token_ids": np.array([1.0, 2.0])},
            None,
            "prompt_token_ids must be a list of ints or a 1-D integer array",
        ),
    ],
)
def test_code2wav_first_refuses_before_work(code2wav, monkeypatch, bad, params, match) -> None:
    good = {"prompt_token_ids": [4, 5, 6]}
    ok = Token2WavParams(num_steps=2, seed=0)
    refused(code2wav, monkeypatch, bad, match, good=good, params=ok if params is None else [ok, params])


# -- run-time faults of the thinker's encoders --------------------------------------------------


ENCODER_BATCH = {
    "short": 0.5,
    "culprit": 1.3,
    "long": 2.0,
}


def encoder_prompts(pipe: OmniJaxPipeline) -> list[dict[str, Any]]:
    audio = [
        pipe.chat_prompt(user({"type": "audio", "audio": tone(s, 300 + 100 * i, i)}))
        for i, s in enumerate(ENCODER_BATCH.values())
    ]
    image = pipe.chat_prompt(user({"type": "image", "image": picture(56, 84, 2)}))
    return [audio[0], audio[1], image, audio[2], pipe.chat_prompt(user())]  # max_num_seqs 4: one step


@pytest.mark.parametrize("fault", [jax.errors.JaxRuntimeError, ValueError])
def test_encoder_fault_ends_only_that_request(pipe, monkeypatch, fault) -> None:
    """The audio encoder fails for the culprit's audio (as a device error, or as the feature
    path refusing it at run time): the batched call fails, each request is encoded alone,
    and only the culprit ends, with the fault's message; the others equal a clean run."""
    prompts = encoder_prompts(pipe)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    clean = pipe.run(prompts, params, progress=False)
    processor = pipe.stages[0].frontend.processor
    culprit_frames = processor.audio_features([prompts[1]["multi_modal_data"]["audio"][0]])[0].shape[1]
    prepare = thinker_module.prepare_audio_batch
    calls: list[int] = []

    def flaky(features, spec, **kw):  # noqa: ANN001, ANN003, ANN202 - prepare_audio_batch's
        calls.append(len(features))
        if any(f.shape[1] == culprit_frames for f in features):
            raise fault("injected encoder fault")
        return prepare(features, spec, **kw)

    monkeypatch.setattr(thinker_module, "prepare_audio_batch", flaky)
    outs = pipe.run(prompts, params, progress=False)
    bad = outs[1]
    assert (bad.finish_reason, bad.token_ids) == ("error", [])
    assert bad.error == f"stage 'thinker': encoder failed: {fault.__name__}: injected encoder fault"
    for i in (0, 2, 3, 4):
        assert (outs[i].error, outs[i].token_ids) == (None, clean[i].token_ids)
    assert calls == [3, 1, 1, 1]  # the batch, then each request with audio alone
    scheduler = pipe.stages[0].engine.scheduler
    assert not scheduler.has_work() and scheduler.allocator.num_free == scheduler.allocator.num_pages


def test_encoder_fault_alone_and_then_recovered(pipe, monkeypatch) -> None:
    """A lone request whose encoder fails ends alone; the next run (fault gone) is served."""
    prompt = pipe.chat_prompt(user({"type": "audio", "audio": AUDIO}))
    step_inputs = pipe.stages[0].frontend.step_inputs

    def broken(state, batch):  # noqa: ANN001, ANN202 - the jitted tower's signature
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected")

    with monkeypatch.context() as m:
        m.setattr(step_inputs, "_audio", broken)
        (out,) = pipe.run(prompt, GREEDY, progress=False)
    assert out.finish_reason == "error" and "RESOURCE_EXHAUSTED: injected" in out.error
    (again,) = pipe.run(prompt, GREEDY, progress=False)
    assert again.error is None and len(again.token_ids) == 3


def test_numpy_token_ids_taken_as_ints(code2wav, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-D integer array or a list of numpy ints is the same prompt as the list of ints.

    The three share one solve (solves made dear), where equal inputs give equal bits; solves
    of other row counts may round differently."""
    rows_nearly_free(code2wav.stages[0].runner.cost, monkeypatch)
    params = Token2WavParams(num_steps=2, seed=0)
    ids = [4, 5, 6, 7]
    outs = code2wav.run(
        [
            {"prompt_token_ids": ids},
            {"prompt_token_ids": np.array(ids, np.int64)},
            {"prompt_token_ids": list(np.array(ids, np.int32))},
        ],
        params,
        progress=False,
    )
    assert all(o.prompt_token_ids == ids and type(o.prompt_token_ids[0]) is int for o in outs)
    np.testing.assert_array_equal(outs[1].audio, outs[0].audio)
    np.testing.assert_array_equal(outs[2].audio, outs[0].audio)
