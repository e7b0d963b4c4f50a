"""Qwen3-Omni end to end: thinker -> talker (with its code predictor) -> code2wav, against
transformers' ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)``.

Our pipeline runs the requests batched (a text prompt, one with an audio clip and an image, one
in another voice, a video with its audio track interleaved); the reference runs each alone,
greedy (thinker and talker; its code predictor follows the talker's ``do_sample``) with its
default talker repetition penalty. Per request the
thinker's reply, every codebook of every codec frame and the waveform are compared: the frames
are what the reference hands ``code2wav.chunked_decode`` (spied), the talker's M-RoPE positions,
user-turn selection, projections (text and, at the media placeholders, the thinker's layer
``accept_hidden_layer``), text stream and the code predictor's in-step frames are all on that
path. The tiny checkpoint's talker stops one frame after the text ends
(:func:`~omni_jax.testing_qwen3_omni.speak_until_text_ends`) and its greedy choices are decided
by the signal, so equal codes are a sharp check.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omni_reference import StandInVideoProcessor, frames, picture, reference_inputs, spoken, tone
from parity import rel_err
from stage_yamls import edited_stages

from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, OmniRequestOutput, SamplingParams, Token2WavParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.testing import reference_omni_processor
from omni_jax.testing_qwen3_omni import NUM_CODE_GROUPS, give_talker_audio_config

THINKER_TOKENS, TALKER_TOKENS = 24, 60
THINKER = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS)
TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS)
WAVE_RTOL = 1e-5  # float32 code2wav, whole (ours) against chunked_decode (one 300-frame chunk)


def chat(*items: dict[str, Any], text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


@dataclasses.dataclass(frozen=True)
class Case:
    """A request: its chat, voice, and whether its video's audio track is interleaved (the
    track then is the prompt's audio)."""

    messages: list[dict[str, Any]]
    voice: str
    audio_in_video: bool = False


CASES: dict[str, Case] = {
    "text": Case(chat(text="tell me about the sea."), "Ethan"),
    "audio_image": Case(
        chat(
            {"type": "audio", "audio": tone(1.3, 440, 0)},
            {"type": "image", "image": picture(64, 96, 1)},
            text="what is this?",
        ),
        "Ethan",
    ),
    "other_voice": Case(chat(text="count to ten!"), "Chelsie"),
    # The reference runs its talker's positions with use_audio_in_video off whatever the thinker
    # used; the frames are equal only if ours does the same.
    "audio_in_video": Case(
        chat({"type": "video", "video": frames(4, 28, 42, 4)}, text="what happens?"), "Ethan", True
    ),
}
TRACK = tone(2.5, 220, 2)


@pytest.fixture(scope="module")
def stage_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's stage YAML with code2wav's solves capped at 2 requests and offline pieces of
    64 frames (these replies are under 30, but one test's is longer), so its warm-up compiles 20
    code2wav programs (12 offline, up to 64 + 25 frames; 8 streamed) instead of the default's 56."""
    path = tmp_path_factory.mktemp("qwen3_stages") / "stages.yaml"
    return edited_stages(path, "qwen3_omni", code2wav={"engine": {"max_batch": 2, "max_frames": 64}})


def build(path: Path, stage_config: Path) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(
        path, max_num_seqs=4, max_num_batched_tokens=128, stage_config=stage_config
    )


@pytest.fixture(scope="module")
def pipe(qwen3_omni_dir, stage_config) -> OmniJaxPipeline:
    return build(qwen3_omni_dir, stage_config)


@pytest.fixture(scope="module")
def reference(qwen3_omni_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_dir, dtype=torch.float32)
    return give_talker_audio_config(model.eval())


def prompts(pipe: OmniJaxPipeline) -> list[dict[str, Any]]:
    out = []
    for case in CASES.values():
        prompt = pipe.chat_prompt(case.messages, use_audio_in_video=case.audio_in_video)
        if case.audio_in_video:
            prompt["multi_modal_data"]["audio"] = [TRACK]
        out.append({**prompt, "speaker": case.voice})
    return out


def speak(
    model: Any, inputs: Any, speaker: str, audio_in_video: bool = False
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """``(reply ids, frames [frames, groups], waveform)`` of greedy ``generate(return_audio=True)``."""
    reply, frames, wav = spoken(
        model,
        inputs,
        use_audio_in_video=audio_in_video,
        speaker=speaker,
        thinker_eos_token_id=model.config.im_end_token_id,
        thinker_max_new_tokens=THINKER_TOKENS,
        thinker_do_sample=False,
        talker_do_sample=False,
        talker_max_new_tokens=TALKER_TOKENS,
    )
    return reply.tolist(), frames.T.numpy(), wav.numpy()


@pytest.fixture(scope="module")
def expected(pipe, reference, qwen3_omni_dir) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    from transformers import Qwen3OmniMoeProcessor
    from transformers.utils import is_torchvision_available

    ours = pipe.stages[0].frontend.processor
    stand_in = None if is_torchvision_available() else StandInVideoProcessor(ours.video_processor)
    processor = reference_omni_processor(qwen3_omni_dir, stand_in, processor_class=Qwen3OmniMoeProcessor)
    return [
        speak(reference, reference_inputs(processor, p), p["speaker"], case.audio_in_video)
        for p, case in zip(prompts(pipe), CASES.values(), strict=True)
    ]


def test_greedy_speech_equals_transformers_generate(pipe, expected) -> None:
    """Four requests batched through all three stages: each one's reply, frames (every codebook)
    and waveform equal the reference's ``generate`` of it alone."""
    outs = pipe.run(prompts(pipe), [THINKER, TALKER, None], progress=False)
    for case, out, (reply, want, wav) in zip(CASES, outs, expected, strict=True):
        assert out.error is None, (case, out.error)
        assert out.stage_outputs["thinker"].token_ids == reply, case
        codes = np.asarray(out.stage_outputs["talker"].token_ids).reshape(-1, NUM_CODE_GROUPS)
        assert len(codes) == len(reply) - 1 >= 2, case  # one frame per reply token read
        np.testing.assert_array_equal(codes, want, err_msg=case)
        assert out.stage_outputs["talker"].finish_reason == "stop"
        assert out.audio.shape == wav.shape and rel_err(out.audio, wav) < WAVE_RTOL, case
    assert not np.array_equal(*(np.asarray(o.stage_outputs["talker"].token_ids[:8]) for o in outs[::2]))


def test_a_reply_longer_than_an_offline_piece_is_voiced(pipe, reference) -> None:
    """A spoken reply of more frames than code2wav's offline piece (64 here) ends with its whole
    audio, decoded as ``generate`` decodes a long reply: ``chunked_decode`` of the talker's frames
    in pieces of 64 after 25 of context (it used to fail after all its work: "frames exceed the
    limit"). Nothing of it is left in any stage."""
    prompt = dict(pipe.chat_prompt([{"role": "user", "content": "tell me a story"}]), speaker="Ethan")
    thinker = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    talker = SamplingParams(temperature=0.0, max_tokens=400)
    (out,) = pipe.run([prompt], [thinker, talker, Token2WavParams()], progress=False)
    codes = np.asarray(out.stage_outputs["talker"].token_ids).reshape(-1, NUM_CODE_GROUPS)
    assert out.error is None and len(codes) > 64, len(codes)
    with torch.no_grad():
        want = reference.code2wav.chunked_decode(torch.from_numpy(codes.T[None].copy()), 64, 25)[0, 0].numpy()
    assert out.audio.shape == want.shape
    err = rel_err(out.audio, want)
    assert err < 1e-5, err
    assert not any(stage.has_work() for stage in pipe.stages)


def test_converted_checkpoint_speaks_the_same(pipe, qwen3_omni_dir, stage_config, tmp_path) -> None:
    """A converted directory (experts and codebooks stacked on the way, every stage kept)
    speaks bit-identically to the HF one."""
    from omni_jax.weights import convert

    converted = convert(qwen3_omni_dir, tmp_path / "conv", progress=False)
    served = build(converted, stage_config)
    request = prompts(pipe)[1]
    ours, theirs = (p.run(request, [THINKER, TALKER, None], progress=False)[0] for p in (served, pipe))
    assert ours.stage_outputs["talker"].token_ids == theirs.stage_outputs["talker"].token_ids
    np.testing.assert_array_equal(ours.audio, theirs.audio)


def test_sampled_frames_are_batch_invariant(pipe) -> None:
    """A sampled talker (and so a sampled code predictor) draws the same frames for a request
    whatever shares its steps, and different frames for another seed."""
    requests = prompts(pipe)

    def talker(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=50, max_tokens=TALKER_TOKENS, seed=seed)

    batched = pipe.run(requests, [THINKER, [talker(seed) for seed in range(1, 5)], None], progress=False)
    (alone,) = pipe.run(requests[0], [THINKER, talker(1), None], progress=False)
    (other,) = pipe.run(requests[0], [THINKER, talker(4), None], progress=False)
    codes = [o.stage_outputs["talker"].token_ids for o in (batched[0], alone, other)]
    assert codes[0] == codes[1] and codes[0] != codes[2]
    np.testing.assert_array_equal(batched[0].audio, alone.audio)


def test_overlapped_talker_steps_draw_the_same_frames(pipe, monkeypatch) -> None:
    """The talker's steps overlapped (each scheduled before the one before is read; a pending
    first code's frame sum, the code predictor's, read on the device through
    ``FrameHook.feed``) draw the frames of steps read one at a time, sampled and greedy."""
    engine = pipe.stages[1].engine
    requests = prompts(pipe)
    talker = [
        SamplingParams(temperature=0.9, top_k=50, max_tokens=TALKER_TOKENS, seed=7),
        SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS),
    ] * 2
    runs, pending = [], []
    dispatch = engine.runner.dispatch

    def counted(rows, sources=()):  # noqa: ANN001, ANN202
        pending[-1] += sum(r.pending_token for r in rows)
        return dispatch(rows, sources)

    monkeypatch.setattr(engine.runner, "dispatch", counted)
    for overlap in (False, True):
        monkeypatch.setattr(engine, "overlap", overlap)
        pending.append(0)
        runs.append(pipe.run(requests, [THINKER, talker, None], progress=False))
    assert pending[0] == 0 and pending[1] > 20
    for one_at_a_time, overlapped in zip(*runs, strict=True):
        want, got = (o.stage_outputs["talker"] for o in (one_at_a_time, overlapped))
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        np.testing.assert_array_equal(overlapped.audio, one_at_a_time.audio)


def test_streamed_audio_adds_up_and_nothing_compiles_after_warmup(pipe) -> None:
    """After ``warmup()``, greedy and sampled requests, offline and streamed, compile nothing;
    the streamed request's audio arrives in pieces that add up to its whole, as long as the
    offline one (a chunked decode whose chunks join without the gap ``chunked_decode`` leaves)."""
    pipe.warmup(progress=False)
    request = prompts(pipe)[1]
    with CompileCounter() as counter:
        (offline,) = pipe.run(request, [THINKER, TALKER, None], progress=False)
        sampled = pipe.run(
            prompts(pipe), [THINKER, SamplingParams(temperature=0.9, seed=5), None], progress=False
        )
        pieces = list(_stream(pipe, request, [THINKER, TALKER, Token2WavParams(stream=True)]))
    assert (counter.traces, counter.compiles) == (0, 0)
    assert all(o.error is None for o in sampled)
    deltas = [p.audio_delta for p in pieces if p.audio_delta is not None]
    assert len(deltas) >= 2
    np.testing.assert_array_equal(np.concatenate(deltas), pieces[-1].audio)
    assert pieces[-1].finished and offline.error is None
    assert len(pieces[-1].audio) == len(offline.audio)


def _stream(pipe: OmniJaxPipeline, prompt: dict[str, Any], params: list[Any]) -> list[OmniRequestOutput]:
    """The request's updates from ``AsyncOmniJaxPipeline.generate()`` over ``pipe``."""

    async def collect() -> list[OmniRequestOutput]:
        async with AsyncOmniJaxPipeline(pipe) as served:
            return [out async for out in served.generate(prompt, params)]

    return asyncio.run(asyncio.wait_for(collect(), 300))


def test_a_prompt_without_an_assistant_turn_is_refused_before_work(pipe) -> None:
    """The talker voices the prompt's assistant turn: a bare prompt that asks for speech is
    refused at admission (not after the thinker has run), as text or as ids; asked for text
    alone, it is served."""
    ids = pipe.tokenizer("hello there")["input_ids"]
    for bare in ({"prompt": "hello there"}, {"prompt_token_ids": ids}):
        with pytest.raises(
            ValueError, match=r"request 1: the talker voices the prompt's last assistant turn"
        ):
            pipe.run([prompts(pipe)[0], bare], [THINKER, None, None], progress=False)
        assert not any(s.has_work() for s in pipe.stages)
    (text_only,) = pipe.run(
        {"prompt": "hello there", "modalities": ["text"]}, [THINKER, None, None], progress=False
    )
    assert text_only.error is None and text_only.audio is None and len(text_only.token_ids) > 0
