"""``AsyncOmniJaxPipeline`` over thinker -> talker -> code2wav on the tiny Qwen2.5-Omni checkpoint.

One ``OmniJaxPipeline`` gives the references with ``run``, then serves the same prompts wrapped in
an ``AsyncOmniJaxPipeline`` (the two drive the same engine core); ``tests/test_omni_pipeline.py``
holds ``run`` to transformers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, OmniRequestOutput, SamplingParams, Token2WavParams
from omni_jax.engine.ar_runner import ARRunner

THINKER_TOKENS = 6
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=10),
    Token2WavParams(num_steps=2, seed=0),
]


@pytest.fixture(scope="module")
def pipe(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=4)


def chat(pipe: OmniJaxPipeline, text: str, **extra: Any) -> dict[str, Any]:
    return dict(pipe.chat_prompt([{"role": "user", "content": text}]), **extra)


async def collect(pipe: AsyncOmniJaxPipeline, prompt: Any, params: Any) -> list[OmniRequestOutput]:
    return [out async for out in pipe.generate(prompt, params)]


def test_generate_equals_run_text_then_audio(pipe) -> None:
    spoken = chat(pipe, "tell me a story about a cat", speaker="Ethan")
    written = chat(pipe, "what is the time", modalities=["text"])
    refs = pipe.run([spoken, written], PARAMS, progress=False)

    async def both() -> list[list[OmniRequestOutput]]:
        async with AsyncOmniJaxPipeline(pipe) as served:
            return await asyncio.gather(collect(served, spoken, PARAMS), collect(served, written, PARAMS))

    for updates, ref in zip(asyncio.run(asyncio.wait_for(both(), 300)), refs, strict=True):
        *before, last = updates
        assert last.finished and not any(u.finished for u in before)
        assert last.token_ids == ref.token_ids and last.text == ref.text and last.finish_reason == "length"
        assert [t for u in updates for t in u.token_ids_delta] == last.token_ids
        assert "".join(u.text_delta for u in updates) == last.text
        # A token a step read: two when a step was left unread (the device not done) and read
        # with the next.
        assert 1 < sum(1 for u in updates if u.token_ids_delta) <= THINKER_TOKENS
        assert last.stage_outputs.keys() == ref.stage_outputs.keys()
        if ref.audio is None:
            assert all(u.audio_delta is None for u in updates)
            continue
        # the text streams first; the waveform comes whole with the last update, the run()'s one
        assert all(u.audio_delta is None and u.token_ids_delta for u in before)
        assert last.stage_outputs["talker"].token_ids == ref.stage_outputs["talker"].token_ids
        np.testing.assert_array_equal(last.audio_delta, ref.audio)
        np.testing.assert_array_equal(last.audio, ref.audio)


def test_abort_in_the_talker_frees_its_pages(pipe) -> None:
    """Once the thinker's last token is out the request is in the talker (told to go on for 500
    codes): the abort ends it there with its text kept, and the talker's pages are back."""
    talker = pipe.stages[1].engine.scheduler.allocator
    params = [PARAMS[0], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True), PARAMS[2]]
    prompt = chat(pipe, "tell me a story about a cat")

    async def scenario() -> list[OmniRequestOutput]:
        async with AsyncOmniJaxPipeline(pipe) as served:
            gen = served.generate(prompt, params, request_id="talking")
            # Updates until the thinker's tokens are out: a step read late brings two at once.
            text: list[OmniRequestOutput] = []
            while sum(len(u.token_ids_delta) for u in text) < THINKER_TOKENS:
                text.append(await anext(gen))
            while talker.num_free == talker.num_pages:  # until the talker has its prompt
                await asyncio.sleep(0.01)
            await served.abort("talking")
            assert talker.num_free == talker.num_pages
            return text + [out async for out in gen]

    *text, last = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert last.finished and last.finish_reason == "abort" and last.audio is None
    assert last.token_ids == [t for u in text for t in u.token_ids_delta]
    assert len(last.token_ids) == THINKER_TOKENS and last.stage_outputs.keys() == {"thinker"}
    assert not any(s.has_work() for s in pipe.stages)


def test_a_failed_step_keeps_what_it_finished_and_fails_the_rest(pipe, monkeypatch) -> None:
    """The thinker ends one request in the step whose talker step raises: that request keeps its
    result, the one in the talker ends with the error and its pages are back."""
    core, talker = pipe.core, pipe.stages[1]
    thinker = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 2)]
    prompts = [chat(pipe, "what is the time", modalities=["text"]), chat(pipe, "tell me a story")]
    for admission in pipe.intake.admit(prompts, [thinker, PARAMS[1], PARAMS[2]], ["written", "spoken"]):
        core.add(admission, stream=True)
    # The devices answer at once, so every step is read by the next call, never left unread.
    monkeypatch.setattr(ARRunner, "done", lambda self, dispatched: True)
    # The thinker's steps overlap (each read during the next call): "spoken" leaves the thinker
    # when its second step is read, in the third call; "written" ends when its fourth is, in the
    # fifth call, the one whose talker step raises.
    for _ in range(4):
        core.step()

    def fault(block: bool = True) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(talker, "step", fault)
    with pytest.raises(RuntimeError, match="injected fault"):
        core.step()
    ended = {u.request_id: u for u in core.fail("engine step failed: injected fault")}
    written, spoken = ended["written"], ended["spoken"]
    assert written.finished and (written.finish_reason, written.error) == ("length", None)
    assert len(written.token_ids) == 4 and written.token_ids_delta == written.token_ids[-1:]
    assert spoken.finished and spoken.finish_reason == "error" and "injected fault" in spoken.error
    assert len(spoken.token_ids) == 2 and spoken.audio is None
    allocator = talker.engine.scheduler.allocator
    assert allocator.num_free == allocator.num_pages and not core.has_work()
