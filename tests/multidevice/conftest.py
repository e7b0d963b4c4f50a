"""Collected only in a process started with eight emulated CPU devices.

The device count is fixed when JAX's backend starts, so these tests cannot share a process with
the rest of the suite (which must see its normal single device). ``tests/test_multidevice.py``
runs this directory in a subprocess with ``XLA_FLAGS`` set; a plain ``pytest tests`` run skips
collecting it here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from omni_jax import OmniJaxPipeline, SamplingParams

DEVICES = 8
XLA_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

PIPE_KW = dict(max_num_seqs=8, page_size=8, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

if XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 every tested mesh can split: 8 query heads, 2 KV heads (so ``model`` of 4
    and 8 replicate KV heads), a vocabulary of 512 (split 8 ways)."""
    from omni_jax.testing import build_tiny_qwen2

    return build_tiny_qwen2(
        tmp_path_factory.mktemp("gqa") / "hf",
        seed=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
    )


@pytest.fixture(scope="session")
def gqa_prompts() -> list[dict[str, list[int]]]:
    """One batch: few step shapes, so few compiles per mesh (the scheduler is mesh-agnostic)."""
    rs = np.random.RandomState(5)
    return [{"prompt_token_ids": [int(t) for t in rs.randint(3, 500, size=n)]} for n in (5, 14, 3, 9, 11)]


@pytest.fixture(scope="session")
def single_device(gqa_dir: Path) -> OmniJaxPipeline:
    """The explicit one-device mesh, which runs the default (unsharded) path."""
    return OmniJaxPipeline.from_pretrained(gqa_dir, mesh={"data": 1, "model": 1}, **PIPE_KW)


@pytest.fixture(scope="session")
def reference(single_device: OmniJaxPipeline, gqa_prompts: list[dict]) -> list[list[int]]:
    return greedy(single_device, gqa_prompts)


def greedy(pipe: OmniJaxPipeline, prompts: list[dict]) -> list[list[int]]:
    return [o.token_ids for o in pipe.run(prompts, GREEDY, progress=False)]
