"""bfloat16 parity: our engine on a bf16-converted checkpoint against transformers run in bf16 on
the same weights.

Conversion casts each float32 tensor to bf16 (round to nearest even, as torch's ``.to`` does), so
both sides hold the same weights; each then rounds every activation to bf16 (unit roundoff
``u = 2**-8``) at its own places. Their logits on the same prompt are held to
``agreement.LOGIT_RTOL["bfloat16"]`` (16 u) of the largest logit: the scale at which transformers'
own bf16 logits move from float32 arithmetic on those weights, which the test also measures, so
the bound is checked to be the size of bf16 rounding rather than assumed. Greedy tokens through
the pipeline equal transformers ``generate``'s in bf16 except at near-ties checked on the
reference's own scores (:mod:`benchmarks.agreement`): bf16 logits are coarse enough that exact ties
happen, and then the two sides may take either token.
"""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from parity import check_bfloat16_greedy, rel_err

from benchmarks import agreement
from omni_jax import OmniJaxPipeline
from omni_jax.full_forward import full_forward
from omni_jax.weights import MANIFEST, convert, load_part

BF16_ROUNDOFF = 2.0**-8
LOGIT_RTOL = agreement.LOGIT_RTOL["bfloat16"]
NEW_TOKENS = 16


def params_of(model) -> dict:  # noqa: ANN001
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def bf16_dir(qwen2_dir, tmp_path_factory):
    return convert(qwen2_dir, tmp_path_factory.mktemp("bf16") / "conv", dtype="bfloat16", progress=False)


@pytest.fixture(scope="module")
def hf_bf16(qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def hf_exact(qwen2_dir):
    """transformers in float32 arithmetic on the bf16-rounded weights: what both bf16 runs
    approximate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(3, vocab, size=int(rs.randint(4, 120))).tolist() for _ in range(n)]


def test_conversion_casts_each_tensor_to_bfloat16(qwen2_dir, bf16_dir) -> None:
    assert json.loads((bf16_dir / MANIFEST).read_text())["dtype"] == "bfloat16"
    model, _ = load_part(bf16_dir, "llm")
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        np.dtype(ml_dtypes.bfloat16)
    }
    f32 = params_of(load_part(qwen2_dir, "llm")[0])
    for k, v in params_of(model).items():
        np.testing.assert_array_equal(v, f32[k].astype(ml_dtypes.bfloat16))


def test_logits_match_transformers_in_bfloat16(bf16_dir, hf_bf16, hf_exact) -> None:
    ours_model, _ = load_part(bf16_dir, "llm")
    for ids in prompts(hf_bf16.config.vocab_size, 6, seed=0):
        ours, _ = full_forward(ours_model, ids, page_size=8)
        with torch.no_grad():
            ref = hf_bf16(torch.tensor([ids])).logits[0].float().numpy()
            exact = hf_exact(torch.tensor([ids])).logits[0].numpy()
        err = rel_err(ours, ref)
        assert err < LOGIT_RTOL, (len(ids), err / BF16_ROUNDOFF)
        # Both runs are bf16 runs: each is at least one unit of roundoff from float32 arithmetic
        # (a float32 path would sit within float32 noise of it), and transformers' own distance
        # from it is on the bound's scale, not far below it.
        assert rel_err(ours, exact) > BF16_ROUNDOFF
        assert LOGIT_RTOL / 8 < rel_err(ref, exact) < LOGIT_RTOL * 2


def test_greedy_tokens_match_transformers_in_bfloat16(bf16_dir, hf_bf16) -> None:
    """Equal to generate's tokens except at checked near-ties, with its log-probabilities to
    the logit bound (:func:`parity.check_bfloat16_greedy`)."""
    batch = prompts(hf_bf16.config.vocab_size, 8, seed=1)
    pipe = OmniJaxPipeline.from_pretrained(bf16_dir, max_model_len=160, max_num_seqs=8)
    check_bfloat16_greedy(pipe, hf_bf16, batch, NEW_TOKENS)
