"""The Qwen2.5-Omni thinker on a mesh: multimodal greedy outputs equal the single-device run.

The tiny thinker has 4 query and 2 KV heads, so ``model=4`` stores each KV head twice; the
decoder is split by its Qwen2 rules while the audio and vision towers stay replicated.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from omni_jax import OmniJaxPipeline, SamplingParams


def messages(*items: dict) -> list[dict]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": "the cat and the dog"}]}]


@pytest.fixture(scope="module")
def prompts_and_reference(omni_dir) -> tuple[list[dict], list[list[int]]]:
    single = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=4)
    rng = np.random.default_rng(0)
    audio = (0.3 * np.sin(np.arange(16_000) * 2 * np.pi * 440 / 16_000)).astype(np.float32)
    image = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    prompts = [
        single.chat_prompt(messages()),
        single.chat_prompt(messages({"type": "audio", "audio": audio})),
        single.chat_prompt(messages({"type": "image", "image": image})),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return prompts, [o.token_ids for o in single.run(prompts, params, progress=False)]


def test_thinker_on_a_2x4_mesh_equals_one_device(omni_dir, prompts_and_reference) -> None:
    prompts, reference = prompts_and_reference
    pipe = OmniJaxPipeline.from_pretrained(
        omni_dir, stages=["thinker"], max_num_seqs=4, mesh={"data": 2, "model": 4}
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in pipe.run(prompts, params, progress=False)] == reference
    runner = pipe.stages[0].engine.runner
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(runner.state)}
    q = flat["model.layers.0.self_attn.q_proj.kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 4)}
    towers = [v for k, v in flat.items() if k.startswith(("audio_tower.", "visual."))]
    assert towers and all(v.sharding.is_fully_replicated for v in towers)
    k_cache = runner.kv_cache[0][0]
    assert k_cache.shape[0] == 4 and {s.data.shape[0] for s in k_cache.addressable_shards} == {1}
    assert len(k_cache.sharding.device_set) == jax.device_count()
