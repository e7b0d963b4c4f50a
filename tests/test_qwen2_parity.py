"""Flax Qwen2 vs transformers ``Qwen2ForCausalLM``: logits and final hidden states, float32."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import chunk_metadata, embed_step, rel_err
from transformers import Qwen2ForCausalLM as HFQwen2

from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.full_forward import full_forward
from omni_jax.models.attention import AttentionMetadata
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2 import CAUSAL_LM_RULES, Qwen2ForCausalLM, Qwen2Spec, causal_lm_ignore
from omni_jax.testing import tiny_qwen2_config

RTOL = 1e-5  # float32, same math as the reference

CONFIGS = {
    "gqa_untied": dict(),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa_odd": dict(
        vocab_size=301, hidden_size=48, intermediate_size=100, num_attention_heads=3, num_key_value_heads=1
    ),
    "head_dim_override": dict(head_dim=32, num_hidden_layers=3),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    "rope_yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    ),
    "rope_yarn_mscale": dict(  # DeepSeek's keys: the attention factor is their ratio
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        }
    ),
    "rope_llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "sliding_window": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}


def build_pair(name: str, seed: int = 0):
    overrides = dict(CONFIGS[name])
    vocab = overrides.pop("vocab_size", 256)
    cfg = tiny_qwen2_config(vocab, **overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = HFQwen2(cfg).eval()
    spec = Qwen2Spec.from_hf(cfg)
    ours = build_model(
        lambda: Qwen2ForCausalLM(spec, rngs=nnx.Rngs(0)),
        torch_state_items(hf),
        CAUSAL_LM_RULES,
        ignore=causal_lm_ignore(spec),
    )
    return hf, ours, spec


def reference(hf, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        out = hf(torch.tensor(ids)[None], output_hidden_states=True)
    return out.logits[0].numpy(), out.hidden_states[-1][0].numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_matches_transformers(name: str) -> None:
    hf, ours, spec = build_pair(name)
    ids = np.random.RandomState(1).randint(0, spec.vocab_size, size=45)
    ref_logits, ref_hidden = reference(hf, ids)
    logits, hidden = full_forward(ours, ids, page_size=8)
    assert rel_err(logits, ref_logits) < RTOL
    assert rel_err(hidden, ref_hidden) < RTOL


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied", "mqa_odd", "sliding_window"])
def test_chunked_prefill_and_decode_through_scattered_pages(name: str) -> None:
    """Prefill 11 tokens, a 6-token chunk, then decode one by one across page boundaries.

    The sequence's pages are deliberately out of order in the pool, so a wrong block-table
    or slot computation cannot go unnoticed.
    """
    hf, ours, spec = build_pair(name)
    ids = np.random.RandomState(2).randint(0, spec.vocab_size, size=30)
    ref_logits, ref_hidden = reference(hf, ids)
    page_size, pages = 4, np.array([5, 2, 9, 0, 7, 3, 1, 8], np.int32)
    cache = init_kv_cache(spec.num_layers, spec.num_kv_heads, 10, page_size, spec.head_dim, jnp.float32)
    chunks = [(0, 11), (11, 17)] + [(i, i + 1) for i in range(17, 30)]
    got_logits, got_hidden = [], []
    for s, e in chunks:
        md = chunk_metadata(pages, page_size, s, e)
        logits, hidden, cache = embed_step(
            ours, jnp.asarray(ids[s:e])[None], None, jnp.arange(s, e)[None], cache, md
        )
        got_logits.append(np.asarray(logits)[0])
        got_hidden.append(np.asarray(hidden)[0])
    assert rel_err(np.concatenate(got_logits), ref_logits) < RTOL
    assert rel_err(np.concatenate(got_hidden), ref_hidden) < RTOL


def test_batched_rows_with_padding_match_single_rows() -> None:
    """Two sequences of different lengths in one padded step equal their own runs."""
    hf, ours, spec = build_pair("gqa_untied")
    rs = np.random.RandomState(3)
    seqs = [rs.randint(0, spec.vocab_size, size=n) for n in (13, 5)]
    page_size, t = 4, 16
    cache = init_kv_cache(spec.num_layers, spec.num_kv_heads, 8, page_size, spec.head_dim, jnp.float32)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    tokens = np.zeros((2, t), np.int32)
    slots = np.full((2, t), 8 * page_size, np.int32)  # out of range: dropped
    positions = np.zeros((2, t), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
        idx = np.arange(len(s))
        slots[b, : len(s)] = tables[b, idx // page_size] * page_size + idx % page_size
        positions[b, : len(s)] = idx
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.array([13, 5]), jnp.array([13, 5]))
    logits, _, _ = embed_step(ours, jnp.asarray(tokens), None, jnp.asarray(positions), cache, md)
    logits = np.asarray(logits)
    for b, s in enumerate(seqs):
        ref_logits, _ = reference(hf, s)
        assert rel_err(logits[b, : len(s)], ref_logits) < RTOL


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5",
        ),
        ({"hidden_act": "gelu"}, "decoder activation hidden_act='gelu' "),
    ],
)
def test_a_config_the_decoder_would_run_differently_is_refused_at_load(change: dict, match: str) -> None:
    """transformers runs these (a dynamic rotary, GELU); the decoder computes neither, so the spec
    refuses them where the model is built: a dynamic rotary loaded and then failed every request,
    GELU ran as SiLU and gave other tokens without an error."""
    cfg = tiny_qwen2_config(64, **change)
    with pytest.raises(ValueError, match=f"unsupported {re.escape(match)}"):
        Qwen2Spec.from_hf(cfg)


def test_swish_is_silu() -> None:
    """transformers runs ``hidden_act: swish`` as SiLU: taken, as ``silu`` is."""
    assert Qwen2Spec.from_hf(tiny_qwen2_config(64, hidden_act="swish")) == Qwen2Spec.from_hf(
        tiny_qwen2_config(64)
    )
