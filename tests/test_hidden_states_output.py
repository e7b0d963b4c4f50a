"""``StageOutput.hidden_states``: an AR stage whose YAML asks (``engine.output_hidden_states``)
returns each request's final hidden states, equal to transformers' ``last_hidden_state`` over
the prompt and the reply but its last token (the computed tokens), whether or not a next stage
took them as they were computed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from stage_yamls import edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams

RTOL = 1e-4  # float32, the same math: the parity bound of every model test


def asking(family: str, stage: str, tmp_path: Path, value: object = True) -> Path:
    """The shipped stage YAML ``family`` with ``stage``'s ``engine.output_hidden_states`` set."""
    return edited_stages(
        tmp_path / f"{family}.yaml", family, **{stage: {"engine": {"output_hidden_states": value}}}
    )


def reference_states(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_qwen2_outputs_hidden_states_where_asked(qwen2_dir, hf_qwen2, tmp_path):
    prompts = [{"prompt_token_ids": [5, 9, 23, 7]}, {"prompt_token_ids": list(range(3, 30))}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=2, stage_config=asking("qwen2", "llm", tmp_path)
    )
    for out in pipe.run(prompts, params, progress=False):
        computed = out.prompt_token_ids + out.token_ids[:-1]
        hidden = out.stage_outputs["llm"].hidden_states
        assert hidden.shape == (len(computed), hf_qwen2.config.hidden_size)
        assert rel_err(hidden, reference_states(hf_qwen2.model, computed)) < RTOL

    plain = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=2)
    (out,) = plain.run(prompts[:1], params, progress=False)
    assert out.stage_outputs["llm"].hidden_states is None


def test_output_hidden_states_must_be_a_bool(qwen2_dir, tmp_path):
    with pytest.raises(
        ValueError, match=r"stage 'llm': engine.output_hidden_states='yes' must be true or false"
    ):
        OmniJaxPipeline.from_pretrained(qwen2_dir, stage_config=asking("qwen2", "llm", tmp_path, "yes"))


def test_thinker_states_whole_while_the_talker_takes_them_as_computed(omni_dir, tmp_path):
    """The talker starts early (the shipped YAML), so the thinker hands its rows on step by step
    and its result holds only the last ones: the output must still hold every row."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    pipe = OmniJaxPipeline.from_pretrained(
        omni_dir, max_num_seqs=2, stage_config=asking("qwen2_5_omni", "thinker", tmp_path)
    )
    assert pipe.stages[1].streams(pipe.stages[1].defaults)
    thinker = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    talker = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [pipe.chat_prompt([{"role": "user", "content": "tell me a story"}]), "hello there"]
    outs = pipe.run(prompts, [thinker, talker, Token2WavParams(num_steps=2)], progress=False)
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    for out in outs:
        assert out.finish_reason == "length" and len(out.audio) > 0
        assert list(out.stage_outputs) == ["thinker", "talker", "code2wav"]  # stage order
        computed = out.prompt_token_ids + out.token_ids[:-1]
        hidden = out.stage_outputs["thinker"].hidden_states
        assert hidden.shape == (len(computed), hf.config.thinker_config.text_config.hidden_size)
        assert rel_err(hidden, reference_states(hf.thinker.model, computed)) < RTOL
        assert out.stage_outputs["talker"].hidden_states is None


def test_talker_states_whether_it_starts_early_or_late(omni_dir, tmp_path):
    """Started early (the shipped ``early_start``), the talker takes the request fed and submits it
    itself once the thinker's first rows are there: its outputs must hold its hidden states as they
    do when it takes the thinker's finished result, whether or not code2wav takes its codes as it
    makes them (then it hands its rows on step by step)."""
    thinker = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    talker = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    width = json.loads((Path(omni_dir) / "config.json").read_text())["talker_config"]["hidden_size"]
    states = {}
    for early in (True, False):
        config = edited_stages(
            tmp_path / f"early_{early}.yaml",
            "qwen2_5_omni",
            talker={"engine": {"output_hidden_states": True, "early_start": early}},
        )
        pipe = OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=1, stage_config=config)
        assert pipe.stages[1].streams(talker) is early
        for stream in (False, True) if early else (False,):
            params = [thinker, talker, Token2WavParams(num_steps=2, stream=stream)]
            (out,) = pipe.run(["hello there"], params, progress=False)
            hidden = out.stage_outputs["talker"].hidden_states
            metrics = out.metrics["talker"]
            computed = metrics["num_prompt_tokens"] + metrics["num_output_tokens"] - 1
            assert hidden is not None and hidden.shape == (computed, width)
            states[early, stream] = hidden
    np.testing.assert_array_equal(states[True, False], states[False, False])
    np.testing.assert_array_equal(states[True, True], states[False, False])
