"""Qwen3-Omni's thinker as a pipeline stage, text prompts: ``from_pretrained(dir, stages=["thinker"])``.

The MoE thinker runs on the paged engine with its experts stacked from the checkpoint's
one-tensor-per-expert layout as they are read (the architecture's ``restack``), from the HF dir
and from a converted one, and its greedy replies equal transformers' thinker ``generate`` on the
tiny checkpoint. Media inputs wait for the thinker's frontend and are refused by name, as is the
talker, not served yet.
"""

from __future__ import annotations

import pytest
import torch

from omni_jax import OmniJaxPipeline, SamplingParams

PROMPTS = ["tell me a story", "what is the capital of France?", "count to ten"]


@pytest.fixture(scope="module")
def reference(qwen3_omni_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted(qwen3_omni_dir, tmp_path_factory):
    from omni_jax.weights import convert

    return convert(qwen3_omni_dir, tmp_path_factory.mktemp("qwen3_conv") / "conv", progress=False)


def reference_reply(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = reference.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


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


def test_what_is_not_served_yet_is_refused_by_name(qwen3_omni_dir) -> None:
    with pytest.raises(ValueError, match="stage 'talker' is not served yet"):
        OmniJaxPipeline.from_pretrained(qwen3_omni_dir, stages=["thinker", "talker"])
    pipe = OmniJaxPipeline.from_pretrained(qwen3_omni_dir, stages=["thinker"])
    image = {"prompt": "look", "multi_modal_data": {"image": [[[0, 0, 0]]]}}
    with pytest.raises(ValueError, match="request 0: stage 'thinker' takes no multi_modal_data"):
        pipe.run(image, progress=False)
