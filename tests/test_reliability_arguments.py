"""``from_pretrained`` refuses bad arguments by name before any work (issue 19.3 and 19.5).

A dtype it does not serve (a typo, an integer type) lists the valid ones; engine sizes that
are not positive integers are refused instead of falling back to a default (``0 or 64``) or
failing deep inside the engine; a stage list given as a bare string is refused instead of read
letter by letter. Every refusal comes before the checkpoint's config is even read.

``run()`` refuses sampling values of the wrong type the same way (the public contract: a
``ValueError`` naming the request and the field before any work): an integer field
(``max_tokens``, ``top_k``, ``seed``, ``num_steps``, ...) takes a Python or numpy int, never a
float or a bool (``max_tokens=2.5`` must not decode three tokens), a real one never a string,
a bool or ``None``, a flag only ``True`` or ``False`` (``ignore_eos="no"`` must not switch it
on), ``stop_token_ids`` only a list or tuple of ints; none of them may end in a bare
``TypeError`` that names no request. Numpy scalars of the right kind are served.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
from step_counts import count_steps

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams


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


@pytest.fixture(scope="module")
def llm(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, max_model_len=64, page_size=8)


@pytest.fixture(scope="module")
def code2wav(omni_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])


def refused_before_work(
    pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch, prompts: list[Any], params: list[Any], match: str
) -> None:
    """``run(prompts, params)`` raises ``ValueError`` matching ``match`` with no stage step run
    and nothing left queued."""
    with monkeypatch.context() as m:
        steps = count_steps(pipe, m)
        with pytest.raises(ValueError, match=match):
            pipe.run(prompts, params, progress=False)
    assert steps == []
    assert not any(stage.has_work() for stage in pipe.stages)


GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

BAD_SAMPLING_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 2.5}, "max_tokens=2.5 must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens=True must be an integer >= 1"),
    ({"max_tokens": "3"}, "max_tokens='3' must be an integer >= 1"),
    ({"min_tokens": 1.5}, "min_tokens=1.5 must be an integer >= 0"),
    ({"min_tokens": None}, "min_tokens=None must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer, -1 or 0 (off) or >= 1"),
    ({"top_k": True}, "top_k=True must be an integer"),
    ({"seed": 1.5}, "seed=1.5 must be an integer from -2**63 to 2**64 - 1"),
    ({"seed": "3"}, "seed='3' must be an integer from -2**63 to 2**64 - 1"),
    ({"seed": False}, "seed=False must be an integer"),
    ({"logprobs": 1.5}, "logprobs=1.5 must be an integer in [0, 20]"),
    ({"logprobs": True}, "logprobs=True must be an integer in [0, 20]"),
    ({"ignore_eos": "no"}, "ignore_eos='no' must be True or False"),
    ({"ignore_eos": 1}, "ignore_eos=1 must be True or False"),
    ({"ignore_eos": None}, "ignore_eos=None must be True or False"),
    ({"temperature": None}, "temperature=None must be a real number >= 0"),
    ({"temperature": "0"}, "temperature='0' must be a real number >= 0"),
    ({"temperature": True}, "temperature=True must be a real number >= 0"),
    ({"temperature": float("inf")}, "temperature=inf must be finite (as a float32) and >= 0"),
    ({"temperature": 10**400}, "temperature=1000"),
    ({"top_p": "1"}, "top_p='1' must be a real number in (0, 1]"),
    ({"min_p": None}, "min_p=None must be a real number in [0, 1]"),
    ({"repetition_penalty": True}, "repetition_penalty=True must be a real number > 0"),
    ({"presence_penalty": None}, "presence_penalty=None must be a real number in [-2, 2]"),
    ({"frequency_penalty": "0"}, "frequency_penalty='0' must be a real number in [-2, 2]"),
    ({"stop_token_ids": 5}, "stop_token_ids=5 must be a list of token ids (ints) or None"),
    ({"stop_token_ids": "12"}, "stop_token_ids='12' must be a list of token ids"),
    ({"stop_token_ids": [3, 2.0]}, "stop_token_ids contains 2.0, which is not a token id (an int)"),
    ({"stop_token_ids": [True]}, "stop_token_ids contains True, which is not a token id"),
]


@pytest.mark.parametrize(
    "fields,message", BAD_SAMPLING_TYPES, ids=[repr(f)[1:-1][:40] for f, _ in BAD_SAMPLING_TYPES]
)
def test_sampling_values_of_the_wrong_type_refused(llm, monkeypatch, fields, message) -> None:
    """As request 0 alone, then as request 1 next to a good one: the index is the bad one's."""
    bad = dataclasses.replace(GREEDY, **fields)  # unchecked until run()
    expected = f"^request 0: stage 'llm': {re.escape(message)}"
    refused_before_work(llm, monkeypatch, ["hello"], bad, expected)
    expected = f"^request 1: stage 'llm': {re.escape(message)}"
    refused_before_work(llm, monkeypatch, ["hello", "the cat"], [GREEDY, bad], expected)


def test_numpy_scalars_and_ints_for_reals_are_served(llm) -> None:
    """Numpy scalars of the right kind, and ints for real fields, are valid and used as given."""
    params = SamplingParams(
        temperature=np.float32(0),
        top_p=1,
        top_k=np.int32(5),
        repetition_penalty=1,
        seed=np.uint32(3),
        max_tokens=np.int64(3),
        min_tokens=np.int16(1),
        stop_token_ids=(np.int64(7),),
        ignore_eos=np.bool_(True),
        logprobs=np.int8(2),
    )
    params.validate(vocab_size=100)
    (out,) = llm.run("hello", params, progress=False)
    assert out.error is None and len(out.token_ids) == 3
    assert SamplingParams(max_tokens=None, seed=None, logprobs=None, stop_token_ids=None).validate() is None


@pytest.mark.parametrize("top_k", [2**40, 0])
def test_a_top_k_beyond_int32_or_zero_keeps_every_token(llm, top_k: int) -> None:
    """A ``top_k`` larger than any vocabulary (beyond the int32 row it is packed into), or 0
    (vLLM's off), is served as no cut: the same tokens as ``top_k=-1`` with the same seed."""
    wide, off = (SamplingParams(temperature=1.0, top_k=k, seed=7, max_tokens=4) for k in (top_k, -1))
    (a,) = llm.run("hello", wide, progress=False)
    (b,) = llm.run("hello", off, progress=False)
    assert a.error is None and list(a.token_ids) == list(b.token_ids)


TWO = {"prompt_token_ids": [1, 2]}
GOOD_SOLVE = Token2WavParams(num_steps=2)

BAD_TOKEN2WAV_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"num_steps": 2.5}, "num_steps=2.5 must be an integer from 1 to 2**31 - 1"),
    ({"num_steps": True}, "num_steps=True must be an integer from 1 to 2**31 - 1"),
    ({"num_steps": None}, "num_steps=None must be an integer from 1 to 2**31 - 1"),
    ({"num_steps": 2**31}, "num_steps=2147483648 must be an integer from 1 to 2**31 - 1"),
    ({"guidance_scale": None}, "guidance_scale=None must be a finite real number"),
    ({"guidance_scale": "0.5"}, "guidance_scale='0.5' must be a finite real number"),
    ({"guidance_scale": 10**400}, "guidance_scale=1000"),
    ({"sway_coefficient": True}, "sway_coefficient=True must be a finite real number"),
    ({"sway_coefficient": float("-inf")}, "sway_coefficient=-inf must be finite (as a float32)"),
    ({"guidance_scale": 1e39}, "guidance_scale=1e+39 must be finite (as a float32)"),
    ({"seed": 2.5}, "seed=2.5 must be an integer from -2**63 to 2**64 - 1"),
    ({"seed": "3"}, "seed='3' must be an integer from -2**63 to 2**64 - 1"),
    ({"seed": True}, "seed=True must be an integer"),
    ({"stream": "no"}, "stream='no' must be True or False"),
    ({"stream": 1}, "stream=1 must be True or False"),
    ({"stream": True, "chunk_codes": True}, "chunk_codes=True must be an integer >= 1"),
    ({"stream": True, "chunk_codes": 12.0}, "chunk_codes=12.0 must be an integer >= 1"),
]


@pytest.mark.parametrize(
    "fields,message", BAD_TOKEN2WAV_TYPES, ids=[repr(f)[1:-1][:40] for f, _ in BAD_TOKEN2WAV_TYPES]
)
def test_token2wav_values_of_the_wrong_type_refused(code2wav, monkeypatch, fields, message) -> None:
    bad = dataclasses.replace(GOOD_SOLVE, **fields)
    expected = f"^request 1: stage 'code2wav': {re.escape(message)}"
    refused_before_work(code2wav, monkeypatch, [TWO, TWO], [GOOD_SOLVE, bad], expected)


def test_token2wav_numpy_scalars_are_valid() -> None:
    """Numpy scalars of the right kind pass (the stage packs them into numpy rows anyway)."""
    Token2WavParams(
        num_steps=np.int64(2),
        guidance_scale=np.float32(0.5),
        sway_coefficient=-1,
        seed=np.uint64(5),
        stream=np.bool_(True),
        chunk_codes=np.int32(12),
    ).validate()
