"""Thinker -> talker -> code2wav end to end against ``Qwen2_5OmniForConditionalGeneration.generate``.

The reference gets transformers' processor output for the same raw prompts, a greedy thinker
(ending on its EOS), a greedy talker with repetition penalty 1.05, and the same code2wav start
noise as ours (its ``torch.randn`` for the mel is handed our array); its codes are read where
it passes them to token2wav. Ours must give identical text tokens, identical codes and the
same waveform, alone and inside a batch mixing voices and modalities.

The reference runs both prompts as one left-padded batch per voice. transformers 5 drops an
all-ones attention mask inside ``generate``, and the talker adds the codec pad/BOS embeddings
to its last two prompt rows and computes its M-RoPE index only when it gets a mask; so an
unpadded single prompt skips that code (transformers 4, which kept the mask, ran it for every
prompt). A padded batch keeps the mask and runs the model as it was trained, which is what
ours does for every request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from omni_reference import picture, reference_processor, tone

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams

THINKER_TOKENS = 40
TALKER_TOKENS = 24
NUM_STEPS = 4
WAVE_RTOL = 1e-5  # relative L2 error of the waveform, as in the code2wav parity tests


def chat(pipe: OmniJaxPipeline, text: str, *media: dict[str, Any]) -> dict[str, Any]:
    return pipe.chat_prompt([{"role": "user", "content": [*media, {"type": "text", "text": text}]}])


def noise(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def pipe(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(pipe) -> dict[str, dict[str, Any]]:
    return {
        "text": chat(pipe, "tell me a story about a cat"),
        "image_audio": chat(
            pipe,
            "what do you see and hear",
            {"type": "image", "image": picture(56, 84, 2)},
            {"type": "audio", "audio": tone(1.0, 440, 0)},
        ),
    }


def reference(hf: Any, proc: Any, pipe: OmniJaxPipeline, prompts: list[dict[str, Any]], speaker: str):
    """Per prompt ``(thinker new tokens, codes, waveform, mel start noise)`` from one batched
    reference ``generate`` (left padding; see the module docstring)."""
    media: dict[str, list[Any]] = {"images": [], "audio": []}
    for prompt in prompts:
        data = prompt.get("multi_modal_data", {})
        media["images"] += data.get("image", [])
        media["audio"] += data.get("audio", [])
    proc.tokenizer.padding_side = "left"
    inputs = dict(
        proc(
            text=[p["prompt"] for p in prompts],
            **{k: v for k, v in media.items() if v},
            padding=True,
            return_tensors="pt",
        )
    )
    assert (inputs["attention_mask"] == 0).any(), "the batch must be padded (module docstring)"
    # generate hands unprefixed inputs to the talker too, whose forward refuses pixels
    if "pixel_values" in inputs:
        inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
    mel_dim = hf.config.token2wav_config.dit_config.mel_dim
    drawn: list[np.ndarray] = []
    codes: list[list[int]] = []
    randn = torch.randn

    def mel_noise(*shape: Any, **kwargs: Any) -> torch.Tensor:
        size = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        if len(size) != 3 or size[-1] != mel_dim:
            return randn(*shape, **kwargs)
        drawn.append(noise(size[1:], seed=len(drawn)))
        return torch.from_numpy(drawn[-1][None].copy())

    forward = hf.token2wav.forward

    def record(code: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        codes.append(code[0].tolist())
        return forward(code, *args, **kwargs)

    eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    talker = hf.talker
    torch.randn, hf.token2wav.forward = mel_noise, record
    try:
        with torch.no_grad():
            seq, waves = hf.generate(
                **inputs,
                speaker=speaker,
                thinker_max_new_tokens=THINKER_TOKENS,
                thinker_do_sample=False,
                thinker_eos_token_id=eos,
                thinker_pad_token_id=pipe.tokenizer.pad_token_id,
                talker_max_new_tokens=TALKER_TOKENS,
                talker_do_sample=False,
                talker_repetition_penalty=1.05,
                talker_eos_token_id=[talker.codec_pad_token, talker.codec_eos_token],
                token2wav_num_steps=NUM_STEPS,
            )
    finally:
        torch.randn, hf.token2wav.forward = randn, forward
    out = []
    new = seq[:, inputs["input_ids"].shape[1] :].tolist()
    for row, code, wave, start in zip(new, codes, waves, drawn, strict=True):
        tokens = row[: row.index(eos) + 1] if eos in row else row
        out.append((tokens, code, wave.numpy(), start))
    return out


@pytest.fixture(scope="module")
def expected(hf, omni_dir, pipe, cases) -> dict[tuple[str, str], tuple[Any, ...]]:
    proc = reference_processor(omni_dir)
    names = list(cases)
    out = {}
    for speaker in ("Chelsie", "Ethan"):
        rows = reference(hf, proc, pipe, [cases[c] for c in names], speaker)
        out.update({(c, speaker): row for c, row in zip(names, rows, strict=True)})
    return out


def params(start: np.ndarray | None) -> list[Any]:
    return [
        SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS),
        SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS),
        Token2WavParams(num_steps=NUM_STEPS, initial_noise=start),
    ]


def norm_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative error in the L2 norm (not :func:`parity.rel_err`'s largest difference): the
    waveform's :data:`WAVE_RTOL` is stated in it."""
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


def check(out: Any, want: tuple[Any, ...], eos: int) -> None:
    tokens, codes, wave, _ = want
    assert tokens[-1] == eos, "the reference thinker must end on its EOS for this test to mean much"
    assert out.error is None and out.finish_reason == "stop"
    assert out.token_ids == tokens
    talker = out.stage_outputs["talker"]
    assert talker.token_ids[: len(codes)] == codes
    assert out.stage_outputs["code2wav"].token_ids == codes
    assert out.sample_rate == 24_000 and out.audio.dtype == np.float32
    assert out.audio.shape == wave.shape
    assert norm_rel_err(out.audio, wave) < WAVE_RTOL


def test_the_stage_graph_sets_who_captures_hidden_states(pipe) -> None:
    """The pipeline sets the flag at build time from the stage graph: the talker reads hidden
    states, so the thinker (and its runner's forward) captures them; nothing reads the talker's."""
    thinker, talker = pipe.stages[0], pipe.stages[1]
    assert talker.reads_hidden and not thinker.reads_hidden
    assert thinker.capture_hidden and thinker.engine.runner.capture_hidden
    assert not talker.capture_hidden


@pytest.mark.parametrize("case", ["text", "image_audio"])
def test_matches_transformers_generate(pipe, cases, expected, case) -> None:
    eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = expected[(case, "Ethan")]
    (out,) = pipe.run(dict(cases[case], speaker="Ethan"), params(want[3]), progress=False)
    check(out, want, eos)
    assert out.text == pipe.tokenizer.decode(want[0], skip_special_tokens=True)


def test_batch_of_voices_and_modalities(pipe, cases, expected) -> None:
    """Each request in a mixed batch gets what it gets alone; a text-only one skips the audio stages."""
    eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    keys = [("image_audio", "Chelsie"), ("text", "Ethan"), ("text", "Chelsie"), ("image_audio", "Ethan")]
    prompts = [dict(cases[c], speaker=s) for c, s in keys]
    prompts.insert(2, dict(cases["text"], modalities=["text"]))
    per_stage: list[list[Any]] = [[], [], []]
    for k in [*keys[:2], None, *keys[2:]]:
        for i, p in enumerate(params(None if k is None else expected[k][3])):
            per_stage[i].append(p)
    outs = pipe.run(prompts, per_stage, progress=False)
    for out, k in zip([*outs[:2], *outs[3:]], keys, strict=True):
        check(out, expected[k], eos)
    text_only = outs[2]
    assert text_only.token_ids == expected[("text", "Chelsie")][0]
    assert text_only.audio is None and set(text_only.stage_outputs) == {"thinker"}
