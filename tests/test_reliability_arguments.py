"""``from_pretrained`` refuses bad arguments by name before any work (issue 19.3 and 19.5).

A dtype it does not serve (a typo, an integer type) lists the valid ones; engine sizes that
are not positive integers are refused instead of falling back to a default (``0 or 64``) or
failing deep inside the engine; a stage list given as a bare string is refused instead of read
letter by letter. Every refusal comes before the checkpoint's config is even read.
"""

from __future__ import annotations

import pytest

from omni_jax import OmniJaxPipeline, SamplingParams


@pytest.fixture
def nothing_read(monkeypatch):
    """Fail the test if from_pretrained gets as far as reading the checkpoint."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the arguments were checked")

    monkeypatch.setattr("omni_jax.weights.load_hf_config", refuse)


@pytest.mark.parametrize("dtype", ["bf17", "int8", "float64", "bool", 3])
def test_unserved_dtype_lists_the_valid_ones(qwen2_dir, nothing_read, dtype) -> None:
    with pytest.raises(ValueError, match=r"dtype=.* is not one of float32, bfloat16, float16$"):
        OmniJaxPipeline.from_pretrained(qwen2_dir, dtype=dtype)


SIZES = ["max_num_seqs", "max_model_len", "num_pages", "page_size", "max_num_batched_tokens"]


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "16"])
@pytest.mark.parametrize("name", SIZES)
def test_engine_sizes_must_be_positive_integers(qwen2_dir, nothing_read, name, value) -> None:
    with pytest.raises(ValueError, match=rf"^{name}={value!r} must be a positive integer"):
        OmniJaxPipeline.from_pretrained(qwen2_dir, **{name: value})


@pytest.mark.parametrize("stages", ["llm", [], [1], ("llm", None)])
def test_stage_list_must_be_names(qwen2_dir, nothing_read, stages) -> None:
    with pytest.raises(ValueError, match=r"^stages must be a non-empty list of stage names"):
        OmniJaxPipeline.from_pretrained(qwen2_dir, stages=stages)


def test_dtype_objects_and_defaults_still_load(qwen2_dir) -> None:
    """A JAX dtype is taken by name; ``None`` sizes keep their defaults; valid sizes are used."""
    import jax.numpy as jnp

    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, dtype=jnp.float32, max_model_len=64, page_size=8)
    runner = pipe.stages[0].engine.runner
    assert runner.max_num_seqs == 64  # the default
    assert runner.geometry.page_size == 8 and runner.geometry.max_model_len == 64
    out = pipe.run("hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), progress=False)
    assert len(out[0].token_ids) == 2
