"""A talker as long as its thinker must still fit the prompt it builds from the thinker's.

The talker's prompt is a few tokens longer than the thinker's (Qwen2.5-Omni: the pad and BOS;
Qwen3-Omni: the reply's start), so a prompt near the thinker's ``max_model_len`` used to run the
thinker and then end with an error at the hand-on. Such a prompt is now refused at admission.
Each test measures the talker's actual prompt (what the stage is submitted) for a prompt one
token short of the limit, which must run through, and checks that one token more is refused
before any work, naming the length the talker would have needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from omni_jax import OmniJaxPipeline, SamplingParams

LENGTH = 64
"""Every stage's ``max_model_len``: the thinker's and the talker's are equal."""
FILL = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
"""The thinker's params: at least two reply tokens (a shorter reply is not voiced)."""


def talker_prompts(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of each prompt the talker is submitted, as the runs below make them."""
    talker, lengths = pipe.stages[1], []
    submit = talker.submit

    def spy(request_id: str, request: Any, params: Any) -> None:
        lengths.append(len(request.token_ids))
        submit(request_id, request, params)

    monkeypatch.setattr(talker, "submit", spy)
    return lengths


def check_boundary(
    pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch, prompt_of: Callable[[int], list[int]]
) -> None:
    """``prompt_of(k)``: thinker prompt ids whose talker prompt grows by one token per ``k``."""
    lengths = talker_prompts(pipe, monkeypatch)
    (short,) = pipe.run([{"prompt_token_ids": prompt_of(0)}], [FILL, None, None], progress=False)
    assert short.error is None
    extra = LENGTH - 1 - lengths[-1]
    assert extra > 0
    # At the edge the talker has room for one token: unseeded, its sample was the codec EOS in 15
    # of 200 draws (no audio, though nothing was wrong). Its defaults, seeded, with a code first.
    voice = dataclasses.replace(pipe.stages[1].defaults, seed=0, min_tokens=1)
    (edge,) = pipe.run([{"prompt_token_ids": prompt_of(extra)}], [FILL, voice, None], progress=False)
    assert edge.error is None and edge.finish_reason != "error", edge.error
    assert lengths[-1] == LENGTH - 1
    assert edge.audio is not None and edge.audio.size > 0
    with pytest.raises(ValueError, match=rf"request 0: stage 'talker''s prompt would have {LENGTH} tokens"):
        pipe.run([{"prompt_token_ids": prompt_of(extra + 1)}], [FILL, None, None], progress=False)
    assert len(lengths) == 2  # refused before the thinker ran, so before any talker work
    text_only = {"prompt_token_ids": prompt_of(extra + 1), "modalities": ["text"]}
    (text,) = pipe.run([text_only], [FILL, None, None], progress=False)
    assert text.error is None and text.text is not None


def test_qwen2_5_omni_talker_prompt_room(omni_dir, monkeypatch) -> None:
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, max_model_len=LENGTH, max_num_seqs=2)
    base = pipe.tokenizer("hello there")["input_ids"]
    check_boundary(pipe, monkeypatch, lambda k: base + base[:1] * k)
    # A reply that cannot reach two tokens is not voiced: the talker never takes it, so its
    # length is no reason to refuse (the context leaves one token, or max_tokens is 1).
    for length, most in ((LENGTH - 1, 8), (LENGTH - 2, 1)):
        short = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
        ids = base + base[:1] * (length - len(base))
        (out,) = pipe.run([{"prompt_token_ids": ids}], [short, None, None], progress=False)
        assert out.error is None and len(out.token_ids) == 1 and out.audio is not None and out.audio.size == 0


def test_qwen3_omni_talker_prompt_room(qwen3_omni_dir, monkeypatch) -> None:
    """Qwen3-Omni's talker reads the user turns only: the user turn grows."""
    pipe = OmniJaxPipeline.from_pretrained(qwen3_omni_dir, max_model_len=LENGTH, max_num_seqs=2)
    text = pipe.chat_prompt([{"role": "user", "content": "hello"}])["prompt"]
    ids = pipe.tokenizer(text)["input_ids"]
    hello = pipe.tokenizer("hello")["input_ids"]
    at = max(i for i in range(len(ids)) if ids[i : i + len(hello)] == hello)
    check_boundary(pipe, monkeypatch, lambda k: ids[:at] + hello[:1] * k + ids[at:])
