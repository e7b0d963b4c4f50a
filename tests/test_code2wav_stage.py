"""The code2wav stage end to end: ``from_pretrained(path, stages=["code2wav"])`` on a tiny Qwen2.5-Omni.

Codes + voice -> waveform against transformers' ``Qwen2_5OmniToken2WavModel`` (called as
``Qwen2_5OmniForConditionalGeneration.generate`` calls it), batching, seeded noise, validation,
and torch-free serving of a converted checkpoint. All requests here fit one code bucket (32) and
the voices pad to one reference length, so the whole file compiles two solve programs (batch 1
and batch 4; unguided requests run the guided program with a zero guidance factor).
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
import torch
from parity import rel_err
from stand_ins import rows_nearly_free

from omni_jax import OmniJaxPipeline, ParamError, Token2WavParams
from omni_jax.models.qwen2_5_omni import speakers
from omni_jax.models.qwen2_5_omni.speakers import load_speakers
from omni_jax.models.qwen2_5_omni.token2wav import token2wav_compiled

REPEATS, MEL, NUM_EMBEDS, MAX_POSITIONS = 2, 8, 64, 512  # the tiny DiT (omni_jax.testing)


def codes(seed: int, n: int) -> list[int]:
    return [int(c) for c in np.random.default_rng(seed).integers(0, NUM_EMBEDS + 1, n)]


def noise(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n * REPEATS, MEL)).astype(np.float32)


@pytest.fixture(scope="module")
def converted_dir(omni_converted_dir):
    return omni_converted_dir


@pytest.fixture(scope="module")
def pipes(omni_dir, converted_dir) -> dict[str, OmniJaxPipeline]:
    return {
        "hf": OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"]),
        "converted": OmniJaxPipeline.from_pretrained(converted_dir, stages=["code2wav"]),
    }


@pytest.fixture(scope="module")
def reference(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()


def reference_wave(model, code_ids: list[int], speaker: str, start: np.ndarray, monkeypatch) -> np.ndarray:
    """``generate``'s step 3 for one request, with the DiT's ``torch.randn`` start replaced."""
    params = model.speaker_map[speaker]
    conditioning = params["cond"].float().expand(1, -1)
    reference_mel = params["ref_mel"].float().expand(1, -1, -1)
    with monkeypatch.context() as m:
        m.setattr(torch, "randn", lambda *a, **k: torch.from_numpy(start[None].copy()))
        with torch.no_grad():
            wave = model.token2wav(
                torch.tensor([code_ids]),
                conditioning=conditioning,
                reference_mel=reference_mel,
                num_steps=10,
                guidance_scale=0.5,
                sway_coefficient=-1.0,
            )
    return wave.reshape(-1).float().numpy()


@pytest.mark.parametrize("which", ["hf", "converted"])
def test_one_request_matches_transformers(pipes, reference, which, monkeypatch) -> None:
    ids, start = codes(1, 11), noise(1, 11)
    want = reference_wave(reference, ids, "Ethan", start, monkeypatch)
    out = pipes[which].run(
        {"prompt_token_ids": ids, "speaker": "Ethan"}, Token2WavParams(initial_noise=start), progress=False
    )[0]
    assert out.audio.dtype == np.float32 and out.audio.shape == want.shape == (11 * REPEATS * 60,)
    assert np.mean(np.abs(want) >= 1.0) < 0.05, "test model saturates the vocoder's clamp"
    err = rel_err(out.audio, want)
    assert err < 1e-5, err
    assert out.token_ids == out.prompt_token_ids == ids
    assert (out.sample_rate, out.finish_reason, out.error) == (24000, "stop", None)
    assert out.stage_outputs["code2wav"].token_ids == ids
    assert out.metrics["code2wav"]["num_samples"] == len(want)


def test_batch_equals_each_request_alone(pipes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Different lengths, voices (one default) and knobs share one solve; none sees its neighbours.

    Solves are made dear (as on a device where a solve's fixed cost dominates) so that the
    three share one; left to this CPU's timings the runner may split them."""
    pipe = pipes["hf"]
    rows_nearly_free(pipe.stages[0].runner.cost, monkeypatch)
    prompts = [
        {"prompt_token_ids": codes(2, 5), "speaker": "Ethan"},
        {"prompt_token_ids": codes(3, 16), "speaker": "Chelsie"},
        {"prompt_token_ids": codes(4, 9)},
    ]
    params = [
        Token2WavParams(num_steps=10, seed=7),
        Token2WavParams(num_steps=4, guidance_scale=0.0, seed=8),
        Token2WavParams(num_steps=6, sway_coefficient=0.0, initial_noise=noise(5, 9)),
    ]
    batch = pipe.run(prompts, params, progress=False)
    # Every row of the one solve is padded to the bucket of its longest request (16 codes).
    padded = pipe.stages[0].runner.buckets.length_for(16)
    assert padded >= 16
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        assert out.metrics["code2wav"]["batch_size"] == 3
        assert out.metrics["code2wav"]["padded_length"] == padded
        # Alone, the unguided request still runs the guided program, its null half weighed zero.
        alone = pipe.run(prompt, p, progress=False)[0]
        assert alone.audio.shape == out.audio.shape == (len(prompt["prompt_token_ids"]) * REPEATS * 60,)
        err = rel_err(out.audio, alone.audio)
        assert err < 1e-5, err
    compiled = token2wav_compiled._cache_size()
    again = pipe.run(prompts[::-1], params[::-1], progress=False)
    for a, b in zip(again[::-1], batch, strict=True):
        assert rel_err(a.audio, b.audio) < 1e-5
    assert token2wav_compiled._cache_size() == compiled, "steady state recompiled"


def test_seeded_noise_reproduces(pipes) -> None:
    pipe, prompt = pipes["converted"], {"prompt_token_ids": codes(6, 7)}
    first, second = (pipe.run(prompt, Token2WavParams(num_steps=3, seed=11), progress=False)[0] for _ in "ab")
    np.testing.assert_array_equal(first.audio, second.audio)
    other = pipe.run(prompt, Token2WavParams(num_steps=3, seed=12), progress=False)[0]
    assert rel_err(other.audio, first.audio) > 0.05, "the waveform should follow the noise, not the biases"
    drawn = pipe.run(prompt, Token2WavParams(num_steps=3), progress=False)[0]
    seed = drawn.metrics["code2wav"]["seed"]
    replay = pipe.run(prompt, Token2WavParams(num_steps=3, seed=seed), progress=False)[0]
    np.testing.assert_array_equal(drawn.audio, replay.audio)
    negative, word = (
        pipe.run(prompt, Token2WavParams(num_steps=3, seed=s), progress=False)[0] for s in (-2, 2**64 - 2)
    )
    np.testing.assert_array_equal(negative.audio, word.audio)  # torch's manual_seed reading of -2
    fresh = [pipe.run(prompt, Token2WavParams(num_steps=3, seed=-1), progress=False)[0] for _ in "ab"]
    assert fresh[0].metrics["code2wav"]["seed"] != fresh[1].metrics["code2wav"]["seed"]  # vLLM's -1: no seed


def test_a_voice_is_found_whatever_its_case(pipes) -> None:
    """``"ETHAN"`` is Ethan (no voice has the name as given), the same waveform as ``"Ethan"``."""
    pipe, params = pipes["converted"], Token2WavParams(num_steps=3, seed=11)
    ethan, shouted, chelsie = (
        pipe.run({"prompt_token_ids": codes(6, 7), "speaker": name}, params, progress=False)[0].audio
        for name in ("Ethan", "ETHAN", "Chelsie")
    )
    np.testing.assert_array_equal(shouted, ethan)
    assert rel_err(chelsie, ethan) > 0.05, "the voices should differ, or the test shows nothing"


def test_the_yaml_default_voice_must_be_the_checkpoints(omni_dir) -> None:
    """A stage YAML's ``default_speaker`` is matched as a prompt's voice is (any case); one the
    checkpoint lacks is refused naming its voices, where it used to fall back to the first voice
    and serve every prompt without a ``speaker`` in it."""
    voices = load_speakers(omni_dir)
    assert speakers.Voices(voices, "ethan").default == "Ethan"
    assert speakers.Voices(voices).default == "Chelsie"
    with pytest.raises(
        ValueError,
        match=r"default_speaker 'Ethen' is not one of the checkpoint's voices \['Chelsie', 'Ethan'\]",
    ):
        speakers.Voices(voices, "Ethen")


TWO = {"prompt_token_ids": [1, 2]}
BAD_REQUESTS = [
    ({**TWO, "speaker": "Nobody"}, None, r"unknown speaker 'Nobody'; known speakers: \['Chelsie', 'Ethan'\]"),
    ({"prompt_token_ids": [1, NUM_EMBEDS + 1]}, None, r"codec id 65 outside the vocabulary \[0, 65\)"),
    ({"prompt_token_ids": [-1]}, None, "codec id -1 outside"),
    ({"prompt_token_ids": []}, None, "empty prompt"),
    (
        {"prompt_token_ids": [1] * (MAX_POSITIONS // REPEATS + 1)},
        Token2WavParams(initial_noise=noise(0, MAX_POSITIONS // REPEATS + 1)),
        "257 codes exceed the limit of 256 .*decoded in chunks, .*drop initial_noise",
    ),
    (
        {"prompt_token_ids": [1, 2, 3]},
        Token2WavParams(initial_noise=noise(0, 4)),
        r"initial_noise has shape \(8, 8\), 3 codes need \(6, 8\)",
    ),
    (TWO, Token2WavParams(num_steps=0), "stage 'code2wav': num_steps=0"),
    (TWO, Token2WavParams(guidance_scale=float("nan")), "stage 'code2wav': guidance_scale=nan"),
    (TWO, Token2WavParams(seed=-(2**63) - 1), "stage 'code2wav': seed=-9223372036854775809"),
    (TWO, Token2WavParams(chunk_codes=12), "stage 'code2wav': chunk_codes=12 needs stream=True"),
    (TWO, Token2WavParams(stream=True, chunk_codes=0), "stage 'code2wav': chunk_codes=0 must be"),
    (
        TWO,
        Token2WavParams(stream=True, initial_noise=noise(0, 2)),
        "stage 'code2wav': initial_noise cannot be given with stream=True",
    ),
    (
        TWO,
        Token2WavParams(stream=True, chunk_codes=146),
        "stage 'code2wav': chunk_codes=146 exceeds the stage's largest chunk of 144 codes",
    ),
    (
        TWO,
        Token2WavParams(stream=True, chunk_codes=5),
        "stage 'code2wav': chunk_codes=5 must be a multiple of 2 codes \\(whole DiT blocks\\) and at least "
        "20 codes \\(two vocoder overlaps\\)$",
    ),
    (TWO, {"num_steps": 3}, "stage 'code2wav' needs Token2WavParams"),
    ({"prompt": "hello"}, None, "the 'code2wav' stage takes token ids in 'prompt_token_ids'"),
]


@pytest.mark.parametrize("bad,params,match", BAD_REQUESTS)
def test_bad_request_refused_before_work(pipes, bad, params, match) -> None:
    pipe = pipes["hf"]
    good = {"prompt_token_ids": [1, 2, 3]}
    per_prompt = None if params is None else [Token2WavParams(num_steps=2), params]
    with pytest.raises(ValueError, match="request 1: " + match):
        pipe.run([good, bad], per_prompt, progress=False)
    assert not pipe.stages[0].has_work()
    assert pipe.run(good, Token2WavParams(num_steps=2), progress=False)[0].finish_reason == "stop"


BAD_FIELDS = [
    (Token2WavParams(num_steps=0), "num_steps"),
    (Token2WavParams(num_steps="3"), "num_steps"),
    (Token2WavParams(guidance_scale=float("inf")), "guidance_scale"),
    (Token2WavParams(seed=2**64), "seed"),
    (Token2WavParams(initial_noise=np.zeros((4, 8), np.int32)), "initial_noise"),
    (Token2WavParams(stream=True, initial_noise=noise(0, 2)), "initial_noise"),
    (Token2WavParams(chunk_codes=12), "chunk_codes"),
    (Token2WavParams(stream=True, chunk_codes=0), "chunk_codes"),
    (Token2WavParams(stream=True, chunk_codes=146), "chunk_codes"),
    (Token2WavParams(stream=True, chunk_codes=5), "chunk_codes"),
]


@pytest.mark.parametrize("params,field", BAD_FIELDS)
def test_a_bad_value_is_a_param_error_naming_its_field(pipes, params, field) -> None:
    """As ``SamplingParams``' are: what a server answers with a 400 naming the request field."""
    with pytest.raises(ParamError, match="request 0: stage 'code2wav': " + field) as e:
        pipes["hf"].run({"prompt_token_ids": [1, 2]}, params, progress=False)
    assert e.value.field == field


def test_params_list_must_match_prompts(pipes) -> None:
    with pytest.raises(ValueError, match="one Token2WavParams or a list of 2"):
        pipes["hf"].run([{"prompt_token_ids": [1]}] * 2, [Token2WavParams()], progress=False)


def test_run_time_failure_ends_only_that_request(pipes, monkeypatch) -> None:
    """A device error in a batched solve is isolated: the failing request ends with "error"."""
    pipe = pipes["hf"]
    runner = pipe.stages[0].runner
    solve = runner.solve

    def flaky(graph, state, codes, code_lengths, *rest):
        if 13 in np.asarray(code_lengths):
            raise jax.errors.JaxRuntimeError("device fault")
        return solve(graph, state, codes, code_lengths, *rest)

    monkeypatch.setattr(runner, "solve", flaky)
    bad, good = pipe.run(
        [{"prompt_token_ids": codes(8, 13)}, {"prompt_token_ids": codes(9, 5)}],
        Token2WavParams(num_steps=2, seed=0),
        progress=False,
    )
    assert (bad.finish_reason, bad.audio) == ("error", None)
    assert "device fault" in bad.error
    assert (good.finish_reason, good.error, len(good.audio)) == ("stop", None, 5 * REPEATS * 60)


def test_code2wav_needs_the_talker_built_before_it(omni_dir) -> None:
    with pytest.raises(ValueError, match="stage 'code2wav' reads 'talker'"):
        OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker", "code2wav"])


def test_converted_dir_serves_voices_without_torch(omni_dir, converted_dir, monkeypatch) -> None:
    assert not list(converted_dir.rglob("*.pt"))
    want = load_speakers(omni_dir)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", None)  # any `import torch` now raises ImportError
        got = load_speakers(converted_dir)
        with pytest.raises(ValueError, match="reading spk_dict.pt needs torch"):
            load_speakers(omni_dir)
    assert list(got) == list(want) == ["Chelsie", "Ethan"]
    for name in want:
        np.testing.assert_array_equal(got[name].cond, want[name].cond)
        np.testing.assert_array_equal(got[name].ref_mel, want[name].ref_mel)
        assert got[name].bos_token == want[name].bos_token

    def no_torch(path):
        raise AssertionError(f"read {path} through torch")

    # transformers itself imports torch when it is installed, so the pipeline is checked at our seam.
    monkeypatch.setattr(speakers, "_read_torch", no_torch)
    pipe = OmniJaxPipeline.from_pretrained(converted_dir, stages=["code2wav"])
    assert pipe.stages[0].default_speaker == "Chelsie"
