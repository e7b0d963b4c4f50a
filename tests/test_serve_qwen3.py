"""``omni-jax serve`` on a Qwen3-Omni checkpoint (thinker -> talker -> code2wav) with no change to
the server, which sees only :class:`~omni_jax.AsyncOmniJaxPipeline`: the voice is the prompt's
``speaker`` (Qwen3-Omni's voices are its config's ``speaker_id``, not a ``spk_dict.pt``), and the
talker's own check refuses an unknown one at admission.

One server for the module, as a subprocess on 127.0.0.1: the tiny Qwen3-Omni checkpoint of
``conftest.qwen3_omni_dir`` with ``--no-warmup`` and small sizes, driven by the official ``openai``
client, each reply held to ``OmniJaxPipeline.run`` in this process on the same prompt with the
params the server builds (``test_serve.stage_params``): the thinker greedy under the request's
fields, the talker sampling with its YAML defaults seeded by the request's ``seed``. The server
and the reference compile the programs they need at the same time (``test_serve.alongside``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_serve import Served, Server, alongside, check_error, decode_audio, omni_ref, serve, size_args

from omni_jax import OmniJaxPipeline
from omni_jax.audio_io import pcm16

NAME = "tiny-qwen3-omni"
SIZES = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)
STORY = [{"role": "user", "content": "tell me a story about a cat"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3(request, qwen3_omni_dir, tmp_path_factory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "qwen3_omni.log"
    server = Server(NAME, qwen3_omni_dir, log, "--no-warmup", *size_args(SIZES))
    yield from serve(request, server, lambda: OmniJaxPipeline.from_pretrained(qwen3_omni_dir, **SIZES))


def speak(voice: str, fmt: str, seed: int) -> dict[str, Any]:
    """A greedy chat request for text and audio in ``voice``, as ``fmt``."""
    return dict(
        model=NAME,
        messages=STORY,
        temperature=0,
        max_tokens=MAX_TOKENS,
        seed=seed,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": fmt},
    )


def test_text_and_audio_equal_run(qwen3) -> None:
    """The reply's text, transcript and waveform (WAV) are ``run()``'s."""
    client = qwen3.server.client()
    r, ref = alongside(
        lambda: client.chat.completions.create(**speak("Chelsie", "wav", seed=3)),
        lambda: omni_ref(qwen3, STORY, "Chelsie", seed=3, max_tokens=MAX_TOKENS),
    )
    want = pcm16(ref.audio)
    assert want.size > 0
    message = r.choices[0].message
    assert message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert message.audio.transcript == ref.text
    np.testing.assert_array_equal(decode_audio(message.audio.data, "wav"), want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.token_ids),
    )


def test_streamed_audio_adds_up_to_the_streamed_pipeline(qwen3) -> None:
    """Streamed, the audio comes as ``delta.audio`` pieces (PCM16), one per code2wav chunk, that
    add up to ``run()``'s with ``Token2WavParams(stream=True)``: a chunked decode of the same
    frames, as long as the offline waveform (each chunk keeps the samples its predecessor fell
    short by, which transformers' ``chunked_decode`` skips)."""
    client = qwen3.server.client()
    chunks, streamed = alongside(
        lambda: list(client.chat.completions.create(stream=True, **speak("Ethan", "pcm16", seed=5))),
        lambda: omni_ref(qwen3, STORY, "Ethan", seed=5, max_tokens=MAX_TOKENS, stream=True),
    )
    offline = omni_ref(qwen3, STORY, "Ethan", seed=5, max_tokens=MAX_TOKENS)
    assert streamed.stage_outputs["talker"].token_ids == offline.stage_outputs["talker"].token_ids
    assert 0 < len(streamed.audio) == len(offline.audio)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == streamed.text == offline.text
    pieces = [decode_audio(d.audio.data, "pcm16") for d in deltas if d.audio is not None and d.audio.data]
    assert len(pieces) == streamed.metrics["code2wav"]["chunks"] > 1
    np.testing.assert_array_equal(np.concatenate(pieces), pcm16(streamed.audio))
    assert chunks[-1].choices[0].finish_reason == streamed.finish_reason


def test_an_unknown_voice_is_refused_by_name(qwen3) -> None:
    """A 400 naming the voice and Qwen3-Omni's voices (the config's ``speaker_id``, lower case)."""
    with qwen3.server.http() as http:
        r = http.post("/v1/chat/completions", json=speak("Nobody", "wav", seed=1))
    error = check_error(r, 400, "invalid_request_error", "unknown speaker 'Nobody'")
    assert "['aiden', 'chelsie', 'ethan']" in error["message"] and error["param"] == "audio.voice"
