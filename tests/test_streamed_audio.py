"""Streamed speech through the pipeline: code2wav decodes the talker's codes chunk by chunk.

``Token2WavParams(stream=True)`` on the tiny Qwen2.5-Omni, against the chunked reference built from
transformers' own token2wav modules (:func:`omni_reference.chunked_reference`), at the streaming
sizes of ``tests/test_code2wav_stream.py`` (chunk 6 codes, past 4, future 2, overlap 4 frames),
set through the stage YAML's ``engine.stream``. The code2wav stage alone (codes in), then the
whole pipeline, where the talker's codes are fed to code2wav as they are made: the first audio
comes while the talker still speaks, an abort or bad codes end the request in both stages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from omni_reference import chunked_reference
from parity import rel_err
from stage_yamls import Whole, edited_stages
from stand_ins import Gate, held

from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, OmniRequestOutput, SamplingParams, Token2WavParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.models.qwen2_5_omni.token2wav_chunk import token2wav_chunk_compiled

REPEATS, MEL, NUM_EMBEDS = 2, 8, 64  # the tiny DiT (omni_jax.testing)
STREAM = {"chunk_codes": 6, "past_codes": 4, "future_codes": 2, "overlap_frames": 4}
THINKER = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def codes(seed: int, n: int) -> list[int]:
    return [int(c) for c in np.random.default_rng(seed).integers(0, NUM_EMBEDS + 1, n)]


def seed_noise(seed: int, n: int) -> np.ndarray:
    """The noise a streamed request of ``n`` codes draws from its seed (the offline draw)."""
    return np.random.default_rng(seed).standard_normal((n * REPEATS, MEL), dtype=np.float32)


def code2wav_yaml(directory: Path, engine: dict[str, object], **sampling: object) -> Path:
    """The architecture's stage YAML, written under ``directory``, with the code2wav stage's
    ``engine`` replaced and its ``default_sampling`` keys set as given."""
    code2wav = {"engine": Whole(engine), "default_sampling": sampling}
    return edited_stages(directory / "stages.yaml", "qwen2_5_omni", code2wav=code2wav)


@pytest.fixture(scope="module")
def stream_yaml(tmp_path_factory) -> Path:
    """The architecture's stage YAML at the test's streaming sizes, with small offline solves."""
    engine = {"max_batch": 4, "max_codes": 32, "stream": STREAM}
    return code2wav_yaml(tmp_path_factory.mktemp("stream_yaml"), engine)


@pytest.fixture(scope="module")
def voicer(omni_dir, stream_yaml) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"], stage_config=stream_yaml)


@pytest.fixture(scope="module")
def pipe(omni_dir, stream_yaml) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stage_config=stream_yaml, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()


def expected(reference, pipe: OmniJaxPipeline, code_ids: list[int], speaker: str, params: Token2WavParams):
    """The chunked reference's whole waveform for one streamed request, at the stage's sizes
    (with the request's ``chunk_codes`` when it sets one)."""
    voice = reference.speaker_map[speaker]
    stage = pipe.stages[-1]
    sizes = stage.decoder.plan(params)
    pieces = chunked_reference(
        reference.token2wav,
        np.asarray(code_ids),
        voice["cond"].float().numpy().reshape(-1),
        voice["ref_mel"].float().numpy().reshape(-1, MEL),
        seed_noise(params.seed, len(code_ids)),
        params.num_steps,
        params.guidance_scale,
        params.sway_coefficient,
        sizes,
    )
    return np.concatenate(pieces), len(pieces)


def spoken(pipe: OmniJaxPipeline, text: str, speaker: str) -> dict:
    return dict(pipe.chat_prompt([{"role": "user", "content": text}]), speaker=speaker)


# --- the code2wav stage alone ------------------------------------------------------------------


def test_stage_streams_like_the_chunked_reference(voicer, reference) -> None:
    """Four requests of different lengths and voices streamed in one run (their chunks batched),
    one of them with a smaller ``chunk_codes``: each equals the reference alone."""
    cases = [
        (5, "Chelsie", Token2WavParams(stream=True, seed=1, num_steps=3)),
        (9, "Ethan", Token2WavParams(stream=True, seed=2, num_steps=4, guidance_scale=1.5)),
        (23, "Chelsie", Token2WavParams(stream=True, seed=3, num_steps=3, sway_coefficient=-0.5)),
        (40, "Ethan", Token2WavParams(stream=True, seed=4, num_steps=2, chunk_codes=4)),
    ]
    prompts = [{"prompt_token_ids": codes(n, n), "speaker": s} for n, s, _ in cases]
    outs = voicer.run(prompts, [p for _, _, p in cases], progress=False)
    for out, (n, speaker, params) in zip(outs, cases, strict=True):
        want, chunks = expected(reference, voicer, codes(n, n), speaker, params)
        assert out.finish_reason == "stop" and out.sample_rate == 24_000
        assert out.audio.shape == want.shape
        err = rel_err(out.audio, want)
        assert err < 1e-5, (n, err)
        metrics = out.metrics["code2wav"]
        assert metrics["chunks"] == chunks and metrics["num_codes"] == n and metrics["seed"] == params.seed
    assert [out.metrics["code2wav"]["chunks"] for out in outs] == [1, 2, 4, 10]


def test_one_chunk_streamed_equals_offline(voicer) -> None:
    """A request one chunk covers (``chunk + future`` codes at most) is the offline solve."""
    prompt = {"prompt_token_ids": codes(7, 8), "speaker": "Ethan"}
    offline, streamed = (
        voicer.run(prompt, Token2WavParams(stream=stream, seed=5, num_steps=3), progress=False)[0]
        for stream in (False, True)
    )
    assert streamed.metrics["code2wav"]["chunks"] == 1
    err = rel_err(streamed.audio, offline.audio)
    assert err < 1e-5, err


def test_a_chunk_that_lands_streams_before_the_next_solve(voicer) -> None:
    """A chunk left in flight lands in the next step, which may wait (nothing else has work):
    that step returns its audio at once and leaves the next chunk's solve in flight, rather than
    hold the landed audio back for another solve. Every chunk comes in an update of its own, and
    the deltas add up to the whole waveform."""
    stage = voicer.stages[0]
    prompt = {"prompt_token_ids": codes(23, 23), "speaker": "Chelsie"}
    (admission,) = voicer.intake.admit(
        [prompt], [Token2WavParams(stream=True, seed=3, num_steps=3)], ["twice"]
    )
    voicer.core.add(admission, stream=True)
    assert stage.step(block=False).new_audio == {} and stage.decoder.in_flight is not None
    (first,) = voicer.core.step()
    assert first.audio_delta is not None and stage.decoder.in_flight is not None
    updates = [first]
    while voicer.core.has_work():
        updates += voicer.core.step()
    pieces = [u.audio_delta for u in updates if u.audio_delta is not None]
    last = updates[-1]
    assert last.finished and last.metrics["code2wav"]["chunks"] == 4 and len(pieces) == 4
    np.testing.assert_array_equal(np.concatenate(pieces), last.audio)


def test_a_request_longer_than_an_offline_solve_is_decoded_in_chunks(voicer, omni_dir, tmp_path) -> None:
    """``max_codes`` bounds the offline solve (32 here): a longer offline request (a talker whose
    ``max_tokens`` was raised past it) is decoded in chunks as the same request streamed is, its
    waveform whole, instead of failing after all its upstream work; a streamed request's windows
    are fixed, so it has no limit. Refused still: with ``initial_noise`` (chunks draw theirs from
    the seed), and by a stage that decodes offline only, which takes exactly ``max_codes``."""
    prompt = {"prompt_token_ids": codes(3, 33)}
    (offline,) = voicer.run(prompt, Token2WavParams(num_steps=2, seed=4), progress=False)
    (streamed,) = voicer.run(prompt, Token2WavParams(stream=True, num_steps=2, seed=4), progress=False)
    hop = voicer.stages[0].decoder.planner.hop
    assert offline.finish_reason == streamed.finish_reason == "stop"
    assert streamed.audio.size == 33 * REPEATS * hop and offline.metrics["code2wav"]["chunks"] > 1
    np.testing.assert_array_equal(offline.audio, streamed.audio)
    noise = Token2WavParams(num_steps=2, initial_noise=np.zeros((66, 8), np.float32))
    with pytest.raises(ValueError, match="request 0: 33 codes exceed the limit of 32 .*drop initial_noise"):
        voicer.run(prompt, noise, progress=False)
    offline_only = small_code2wav(omni_dir, tmp_path, False)
    with pytest.raises(ValueError, match="request 0: 9 codes exceed the limit of 8 .*offline only"):
        offline_only.run({"prompt_token_ids": codes(3, 9)}, progress=False)
    (longest,) = offline_only.run(
        {"prompt_token_ids": codes(3, 8)}, Token2WavParams(num_steps=2), progress=False
    )
    assert longest.finish_reason == "stop" and longest.audio.size == 8 * REPEATS * hop


def small_code2wav(
    omni_dir: Path, tmp_path: Path, engine_stream: object, **sampling: object
) -> OmniJaxPipeline:
    """The code2wav stage alone, its solves small (one request of at most 8 codes: the row
    counts are ``tests/test_code2wav_compile_once.py``'s to cover), its ``engine.stream``
    (``engine_stream``) and ``default_sampling`` keys set as given."""
    engine = {"max_batch": 1, "max_codes": 8, "stream": engine_stream}
    path = code2wav_yaml(tmp_path, engine, **sampling)
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"], stage_config=path)


def test_nothing_compiles_after_the_stage_warmup(omni_dir, tmp_path) -> None:
    """The stage's warm-up compiles the chunk program of each window (the first chunk's and the
    others') beside the offline ones; streamed and offline requests then compile nothing."""
    small = small_code2wav(omni_dir, tmp_path, STREAM)
    stage = small.stages[0]
    token2wav_chunk_compiled.clear_cache()
    report = small.warmup(progress=False)
    offline = len(stage.runner.buckets.shapes())
    assert report.programs == offline + len(stage.decoder.buckets.shapes()) == offline + 2
    prompts = [{"prompt_token_ids": codes(n, n)} for n in (3, 8, 20, 31)]
    params = [
        Token2WavParams(stream=True, seed=1, num_steps=2),
        Token2WavParams(seed=2, num_steps=3),
        Token2WavParams(stream=True, seed=3, chunk_codes=4),
        Token2WavParams(stream=True, seed=4, guidance_scale=0.0),
    ]
    with CompileCounter() as counted:
        outs = small.run(prompts, params, progress=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 4
    assert (counted.traces, counted.compiles) == (0, 0)


def test_a_stage_with_streaming_off_warms_and_decodes_offline_only(omni_dir, tmp_path) -> None:
    """``engine.stream: false``: warm-up compiles the offline solves and no chunk program, and a
    request asking to stream is decoded whole, as the same request offline (a server's streamed
    reply then sends its text as it comes and its audio in one piece), compiling nothing."""
    offline_only = small_code2wav(omni_dir, tmp_path, False)
    stage = offline_only.stages[0]
    assert not stage.streaming and not stage.streams(Token2WavParams(stream=True))
    token2wav_chunk_compiled.clear_cache()
    assert offline_only.warmup(progress=False).programs == len(stage.runner.buckets.shapes())
    assert token2wav_chunk_compiled._cache_size() == 0
    prompt = [{"prompt_token_ids": codes(8, 8)}]
    with CompileCounter() as counted:
        (asked,) = offline_only.run(prompt, Token2WavParams(stream=True, seed=1, num_steps=2), progress=False)
        (whole,) = offline_only.run(prompt, Token2WavParams(seed=1, num_steps=2), progress=False)
    assert (counted.traces, counted.compiles) == (0, 0) and token2wav_chunk_compiled._cache_size() == 0
    assert asked.finish_reason == whole.finish_reason == "stop"
    np.testing.assert_array_equal(asked.audio, whole.audio)
    assert len(asked.audio) == 8 * REPEATS * 60


@pytest.mark.parametrize(
    "engine_stream,sampling,match",
    [
        ("off", {}, "stage 'code2wav': engine.stream must be a mapping of streaming constants or false"),
        (
            False,
            {"stream": True},
            "stage 'code2wav': default_sampling.stream is true but engine.stream is false",
        ),
    ],
)
def test_streaming_settings_are_checked(omni_dir, tmp_path, engine_stream, sampling, match) -> None:
    with pytest.raises(ValueError, match=match):
        small_code2wav(omni_dir, tmp_path, engine_stream, **sampling)


# --- the pipeline: the talker's codes fed to code2wav as they come --------------------------------


def story_params(codes: int, seed: int, num_steps: int) -> list:
    """Per-stage params of a streamed story: the thinker's 4 tokens, exactly ``codes`` codes."""
    return [
        THINKER,
        SamplingParams(temperature=0.0, max_tokens=codes, ignore_eos=True),
        Token2WavParams(stream=True, seed=seed, num_steps=num_steps),
    ]


def tell_story(pipe: OmniJaxPipeline, request_id: str, params: list) -> dict:
    """Add a streamed "tell me a story" in Ethan's voice to the core (its 30 first codes are all
    in the codec's range), to be stepped by the test; returns the prompt."""
    prompt = spoken(pipe, "tell me a story", "Ethan")
    (admission,) = pipe.intake.admit([prompt], params, [request_id])
    pipe.core.add(admission, stream=True)
    return prompt


def test_first_audio_comes_while_the_talker_speaks(pipe, reference) -> None:
    """Driven step by step: the first audio update comes while the talker still holds the
    request; the pieces add up to the whole waveform, which is the chunked reference's for the
    talker's codes, and ``run()`` with the same params makes the same audio."""
    talker = pipe.stages[1]
    params = story_params(30, seed=9, num_steps=3)
    prompt = tell_story(pipe, "streamed", params)
    updates: list[OmniRequestOutput] = []
    talking_at_first_audio = None
    while pipe.core.has_work():
        for update in pipe.core.step():
            updates.append(update)
            if update.audio_delta is not None and talking_at_first_audio is None:
                talking_at_first_audio = talker.load().running
    assert talking_at_first_audio == 1
    last = updates[-1]
    assert last.finished and last.finish_reason == "length"
    pieces = [u.audio_delta for u in updates if u.audio_delta is not None]
    assert all(u.sample_rate == 24_000 for u in updates if u.audio_delta is not None)
    talker_codes = last.stage_outputs["talker"].token_ids
    assert len(talker_codes) == 30  # ignore_eos: no stop token to cut
    want, chunks = expected(reference, pipe, talker_codes, "Ethan", params[2])
    assert len(pieces) == chunks == last.metrics["code2wav"]["chunks"] == 5
    np.testing.assert_array_equal(np.concatenate(pieces), last.audio)
    err = rel_err(last.audio, want)
    assert err < 1e-5, err
    (again,) = pipe.run(prompt, params, progress=False)
    assert again.stage_outputs["talker"].token_ids == talker_codes
    np.testing.assert_array_equal(again.audio, last.audio)


def test_a_reply_longer_than_an_offline_solve_is_voiced(pipe) -> None:
    """A talker made to speak past code2wav's offline limit (36 codes against ``max_codes`` 32),
    its audio not streamed: the reply is voiced in chunks, as the same request streamed with the
    same seed is (it used to fail after all its work: "36 codes exceed the limit of 32")."""
    prompt = spoken(pipe, "tell me a story", "Ethan")
    streamed = story_params(36, seed=5, num_steps=2)
    offline = [*streamed[:2], Token2WavParams(seed=5, num_steps=2)]
    (whole,) = pipe.run(prompt, offline, progress=False)
    (chunked,) = pipe.run(prompt, streamed, progress=False)
    assert whole.error is None and len(whole.stage_outputs["talker"].token_ids) == 36
    assert whole.metrics["code2wav"]["chunks"] > 1
    np.testing.assert_array_equal(whole.audio, chunked.audio)


def test_the_talker_speaks_while_a_chunk_solve_is_in_flight(pipe, reference, monkeypatch) -> None:
    """The engine core does not wait for a chunk solve the device has not finished (held here)
    while the talker has work: the talker keeps making codes step after step and no audio comes;
    once the device has it, a step lands it, and the audio is the chunked reference's."""
    talker, decoder = pipe.stages[1], pipe.stages[2].decoder
    gate = Gate()
    monkeypatch.setattr(decoder, "solve", held(decoder.solve, gate))
    # The talker's device answers at once: it always has a step to read, so no step of the core
    # finds every stage idle (and blocks, landing the held solve).
    monkeypatch.setattr(talker.engine.runner, "done", lambda dispatched: True)
    params = story_params(30, seed=9, num_steps=3)
    tell_story(pipe, "held", params)
    updates: list[OmniRequestOutput] = []
    while decoder.in_flight is None:
        updates += pipe.core.step()
    (speaking,) = talker.engine.scheduler.running
    spoken_then = len(speaking.output_ids)
    for _ in range(3):
        updates += pipe.core.step()
    assert len(speaking.output_ids) >= spoken_then + 3 and decoder.in_flight is not None
    assert all(u.audio_delta is None for u in updates)
    gate.open = True
    while pipe.core.has_work():
        updates += pipe.core.step()
    last = updates[-1]
    assert last.finished and last.finish_reason == "length"
    want, chunks = expected(reference, pipe, last.stage_outputs["talker"].token_ids, "Ethan", params[2])
    pieces = [u.audio_delta for u in updates if u.audio_delta is not None]
    assert len(pieces) == chunks
    err = rel_err(np.concatenate(pieces), want)
    assert err < 1e-5, err


def test_the_talker_speaks_while_the_thinkers_step_is_unfinished(pipe, monkeypatch) -> None:
    """The engine core does not wait for a thinker step the device has not finished (held here)
    while the talker has work: the talker keeps voicing one request step after step while the
    thinker's step for another stays unread; once the device has it, both requests end with the
    tokens and codes of runs that never held anything, and their audio (solved in other chunk
    batches) within float32 rounding of theirs."""
    thinker, talker = pipe.stages[0], pipe.stages[1]
    gate = Gate()
    monkeypatch.setattr(thinker.engine.runner, "done", lambda dispatched: gate.open)
    # The talker's device answers at once: it always has a step to read (as above).
    monkeypatch.setattr(talker.engine.runner, "done", lambda dispatched: True)
    first, second = story_params(30, seed=9, num_steps=3), story_params(12, seed=10, num_steps=3)
    gate.open = True
    tell_story(pipe, "voiced", first)
    updates: list[OmniRequestOutput] = []
    while not talker.engine.scheduler.running or thinker.engine.has_work():
        updates += pipe.core.step()
    gate.open = False
    tell_story(pipe, "unread", second)
    (speaking,) = talker.engine.scheduler.running
    for _ in range(2):  # the held request's prompt step is dispatched, and a decode step behind it
        updates += pipe.core.step()
    (held_back,) = thinker.engine.scheduler.running
    spoken_then = len(speaking.output_ids)
    for _ in range(3):
        updates += pipe.core.step()
    assert len(speaking.output_ids) >= spoken_then + 3
    assert held_back.output_ids == [] and len(thinker.engine._unread) == 2
    gate.open = True
    while pipe.core.has_work():
        updates += pipe.core.step()
    ended = {u.request_id: u for u in updates if u.finished}
    for request_id, params in (("voiced", first), ("unread", second)):
        (alone,) = pipe.run(spoken(pipe, "tell me a story", "Ethan"), params, progress=False)
        assert ended[request_id].finish_reason == "length", ended[request_id].error
        assert ended[request_id].token_ids == alone.token_ids
        assert ended[request_id].stage_outputs["talker"].token_ids == alone.stage_outputs["talker"].token_ids
        err = rel_err(ended[request_id].audio, alone.audio)  # other chunk batches: float32 rounding
        assert err < 1e-5, (request_id, err)


def test_generate_streams_audio_chunks(pipe) -> None:
    """``generate()``: the audio comes in several updates, after the text; they add up to the
    whole waveform of the last one, which ``run()`` also gives."""
    params = [
        THINKER,
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        Token2WavParams(stream=True, seed=4, num_steps=2),
    ]
    prompt = spoken(pipe, "tell me a story", "Ethan")
    (ref,) = pipe.run(prompt, params, progress=False)
    assert ref.finish_reason == "length", ref.error

    async def collect() -> list[OmniRequestOutput]:
        async with AsyncOmniJaxPipeline(pipe) as served:
            return [out async for out in served.generate(prompt, params)]

    updates = asyncio.run(asyncio.wait_for(collect(), 300))
    pieces = [u.audio_delta for u in updates if u.audio_delta is not None]
    assert len(pieces) == ref.metrics["code2wav"]["chunks"] == 3
    first_audio = next(i for i, u in enumerate(updates) if u.audio_delta is not None)
    assert "".join(u.text_delta for u in updates[:first_audio]) == ref.text
    np.testing.assert_array_equal(np.concatenate(pieces), ref.audio)
    np.testing.assert_array_equal(updates[-1].audio, ref.audio)


def test_abort_mid_stream_frees_both_stages(pipe) -> None:
    """An abort after the first audio drops the request from the talker (its KV pages back) and
    from code2wav (no chunk of it left); its output holds the audio delivered before it."""
    talker, code2wav = pipe.stages[1], pipe.stages[2]
    tell_story(pipe, "aborted", story_params(200, seed=1, num_steps=2))
    played: list[np.ndarray] = []
    while not played:
        played += [u.audio_delta for u in pipe.core.step() if u.audio_delta is not None]
    assert talker.load().running == 1 and code2wav.load().running == 1
    out = pipe.core.abort("aborted")
    assert out is not None and out.finish_reason == "abort" and out.finished
    np.testing.assert_array_equal(out.audio, np.concatenate(played))
    assert out.sample_rate == code2wav.sample_rate and out.audio_delta is None
    pages = talker.engine.scheduler.allocator
    assert pages.num_free == pages.num_pages
    assert (code2wav.load().running, code2wav.load().waiting) == (0, 0)
    assert not pipe.core.has_work()


def test_codes_the_voice_cannot_take_end_only_that_request(pipe, monkeypatch) -> None:
    """Codes outside code2wav's vocabulary, fed mid-stream, end that request with the stage's
    message (and free the talker); the request beside it finishes."""
    monkeypatch.setattr(pipe.stages[2], "codec_vocab_size", 0)
    params = [
        THINKER,
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        Token2WavParams(stream=True, seed=1, num_steps=2),
    ]
    prompts = [spoken(pipe, "hello there", "Ethan"), dict(spoken(pipe, "hi", "Ethan"), modalities=["text"])]
    bad, good = pipe.run(prompts, params, progress=False)
    assert bad.finish_reason == "error"
    assert bad.error.startswith("stage 'code2wav': request 0: codec id ")
    assert "outside the vocabulary [0, 0)" in bad.error
    assert good.finish_reason == "length" and good.audio is None
    pages = pipe.stages[1].engine.scheduler.allocator
    assert pages.num_free == pages.num_pages and not pipe.core.has_work()


def test_a_failed_chunk_ends_the_request_in_the_talker_too(pipe, monkeypatch) -> None:
    """code2wav fails a streamed request's chunk while the talker still speaks it: the request
    ends with the stage's message, the talker drops it (its pages back) and the request beside
    it, text only, finishes."""
    decoder = pipe.stages[2].decoder
    monkeypatch.setattr(
        decoder, "solve", lambda *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("boom"))
    )
    params = [
        THINKER,
        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
        Token2WavParams(stream=True, seed=1, num_steps=2),
    ]
    prompts = [
        spoken(pipe, "tell me a story", "Ethan"),
        dict(spoken(pipe, "hi", "Ethan"), modalities=["text"]),
    ]
    bad, good = pipe.run(prompts, params, progress=False)
    assert bad.finish_reason == "error" and bad.error == "stage 'code2wav': solve failed: boom"
    assert "talker" not in bad.stage_outputs  # the talker never finished it: it was dropped
    assert good.finish_reason == "length"
    pages = pipe.stages[1].engine.scheduler.allocator
    assert pages.num_free == pages.num_pages and not pipe.core.has_work()
