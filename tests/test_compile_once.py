"""Compile once, run forever: after warm-up, ragged serving traces and compiles nothing."""

from __future__ import annotations

import numpy as np

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter


def test_long_ragged_workload_after_warmup_never_compiles(qwen2_dir) -> None:
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=4, page_size=8, max_model_len=128, max_num_batched_tokens=64
    )
    with CompileCounter() as warm:
        shapes = pipe.warmup()
    assert shapes > 1 and warm.traces >= shapes
    rs = np.random.RandomState(11)
    prompts = [
        {"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=n)]} for n in rs.randint(1, 90, 40)
    ]
    params = [  # greedy and sampled requests, mixed in the same steps
        SamplingParams(temperature=float(i % 3 == 0), seed=i, top_k=5, max_tokens=int(m), ignore_eos=True)
        for i, m in enumerate(rs.randint(1, 30, 40))
    ]
    with CompileCounter() as steady:
        outs = pipe.run(prompts, params, progress=False)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert (steady.traces, steady.compiles) == (0, 0)


def test_counter_sees_a_new_shape(qwen2_dir) -> None:
    """The counter is not blind: an unseen shape (logprobs) is counted."""
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=2, page_size=8, max_model_len=64)
    pipe.run({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2), progress=False)
    with CompileCounter() as c:
        pipe.run(
            {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2, logprobs=2), False
        )
    assert c.traces > 0
