"""Flax Qwen3-Omni thinker text decoder vs transformers' ``Qwen3OmniMoeThinkerTextModel`` + ``lm_head``.

Float32 throughout. Ours is loaded from the checkpoint the reference thinker writes
(per-expert tensors on disk, stacked by ``stack_expert_arrays``), so the parameter map is
checked too. Prompts of different lengths share padded steps through scattered cache pages: a
prefill in two chunks (one row starts decoding in the second), then decode steps; DeepStack
features and 3-D M-RoPE positions go in as the reference takes them.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import PagedSteps, compiled, randomize_moe_layers, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTextConfig,
    Qwen3OmniMoeThinkerConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration as HFThinker,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerTextModel,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from omni_jax.full_forward import full_forward
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.moe import MOE_SWITCH, stack_expert_arrays
from omni_jax.models.qwen3_omni.text_decoder import (
    TEXT_LM_RULES,
    Deepstack,
    Qwen3OmniTextLM,
    Qwen3OmniTextSpec,
    mrope_axes,
    text_lm_ignore,
)
from omni_jax.safetensors_io import iter_checkpoint
from omni_jax.testing import randomize_weights
from omni_jax.testing_qwen3_omni import thinker_part

RTOL = 1e-5  # float32, same math as the reference (the MoE sums its k experts in another order)
VOCAB, D, LAYERS, PAGE = 128, 64, 4, 4


def text_config(**overrides: object) -> dict:
    """Four layers, GQA, a head wider than ``hidden / heads``, MoE everywhere but layer 1."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]},
    )
    return {**cfg, **overrides}


def tiny_thinker_config() -> Qwen3OmniMoeThinkerConfig:
    cfg = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(
            num_mel_bins=16,
            d_model=32,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            output_dim=D,
            downsample_hidden_size=8,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=D,
            deepstack_visual_indexes=[0, 1],
            num_position_embeddings=16,
        ),
        text_config=text_config(),
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def randomize_text_model(text_model: torch.nn.Module, lm_head: torch.nn.Module) -> None:
    """Weights ~ 1/sqrt(fan_in) (the experts' fan-in is their last axis), router logits of
    order 3 so routing is decided by the signal, and a peaky head so greedy choices are too."""
    randomize_weights(text_model, 1.0)
    randomize_weights(lm_head, 4.0)
    randomize_moe_layers(text_model.layers)


Pair = tuple[HFThinker, Qwen3OmniTextLM]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = HFThinker(tiny_thinker_config()).eval()
    randomize_text_model(thinker_part(hf, "language_model"), hf.lm_head)
    path = tmp_path_factory.mktemp("qwen3_omni_thinker")
    hf.save_pretrained(path)
    spec = Qwen3OmniTextSpec.from_hf(hf.config.text_config, tie_word_embeddings=hf.config.tie_word_embeddings)
    assert spec.sparse_layers == (True, False, True, True)
    ours = build_model(
        lambda: Qwen3OmniTextLM(spec, rngs=nnx.Rngs(0)),
        stack_expert_arrays(iter_checkpoint(Path(path))),
        TEXT_LM_RULES,
        ignore=text_lm_ignore(spec),
    )
    return hf, ours


def reference(
    hf: HFThinker,
    embeds: np.ndarray,
    positions: np.ndarray | None = None,
    visual: np.ndarray | None = None,
    deepstack: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, final hidden)`` of ``Qwen3OmniMoeThinkerTextModel`` + ``lm_head`` for
    ``embeds [B, T, D]``, with 3-D ``positions [3, B, T]`` and DeepStack features when given."""
    with torch.no_grad():
        out = thinker_part(hf, "language_model")(
            inputs_embeds=torch.from_numpy(embeds),
            position_ids=None if positions is None else torch.from_numpy(positions),
            visual_pos_masks=None if visual is None else torch.from_numpy(visual),
            deepstack_visual_embeds=None if deepstack is None else [torch.from_numpy(r) for r in deepstack],
        ).last_hidden_state
        return hf.lm_head(out).numpy(), out.numpy()


def token_embeds(hf: HFThinker, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return thinker_part(hf, "language_model").embed_tokens(torch.tensor([ids])).numpy()


def test_ragged_batch_prefill_and_greedy_decode_match_transformers(pair: Pair) -> None:
    """Three prompts (13, 5, 9 tokens) prefilled in two padded chunks, the 5-token one decoding
    in the second; then greedy decode steps. Every position's logits and the greedy tokens
    equal the reference's on each whole sequence."""
    hf, ours = pair
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, VOCAB, size=n).tolist() for n in (13, 5, 9)]
    seqs = [list(p) for p in prompts]
    steps = PagedSteps(ours, batch=3, pages_per_seq=6, page_size=PAGE)
    logits: list[list[np.ndarray]] = [[], [], []]

    def step(chunks: list[list[int]], starts: list[int]) -> None:
        t = max(len(c) for c in chunks)
        ids = np.zeros((3, t), np.int32)
        positions = np.zeros((3, t), np.int32)
        for row, (chunk, start) in enumerate(zip(chunks, starts, strict=True)):
            ids[row, : len(chunk)] = chunk
            positions[row, : len(chunk)] = np.arange(start, start + len(chunk))
        embeds = np.asarray(compiled(ours, "embed", jnp.asarray(ids)))
        got, _ = steps.run(embeds, positions, [len(c) for c in chunks])
        for row, rows in enumerate(got):
            logits[row].append(rows)
            if len(logits_so_far := np.concatenate(logits[row])) >= len(prompts[row]):
                seqs[row].append(int(np.argmax(logits_so_far[-1])))

    step([p[:8] for p in prompts], [0, 0, 0])
    step([prompts[0][8:], seqs[1][5:6], prompts[2][8:]], [8, 5, 8])
    for _ in range(4):
        step([s[-1:] for s in seqs], [len(s) - 1 for s in seqs])

    for row, seq in enumerate(seqs):
        got = np.concatenate(logits[row])
        ref_logits, _ = reference(hf, token_embeds(hf, seq[:-1]))
        assert got.shape == ref_logits[0].shape
        assert rel_err(got, ref_logits[0]) < RTOL
        greedy = np.argmax(ref_logits[0, len(prompts[row]) - 1 :], axis=-1).tolist()
        assert seq[len(prompts[row]) :] == greedy
        margins = np.sort(ref_logits[0, len(prompts[row]) - 1 :], axis=-1)
        assert (margins[:, -1] - margins[:, -2]).min() > 1e-3  # greedy is decided by the signal


def mrope_prompt(start: int, grid: tuple[int, int], text_after: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions [3, T], visual mask [T])``: ``start`` text tokens, an ``h x w`` image whose
    tokens share a time position and spread over rows and columns, then ``text_after`` text
    tokens continuing after the image's largest position."""
    h, w = grid
    text = np.arange(start)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    image = np.stack([np.full(h * w, start), start + rows.ravel(), start + cols.ravel()])
    after = max(h, w) + start + np.arange(text_after)
    positions = np.concatenate([np.stack([text] * 3), image, np.stack([after] * 3)], axis=1)
    visual = np.zeros(positions.shape[1], bool)
    visual[start : start + h * w] = True
    return positions, visual


def test_deepstack_and_3d_mrope_match_transformers(pair: Pair) -> None:
    """Two same-length prompts with images at different places and 3-D positions; DeepStack
    features for the first two layers; ours in chunks that cut through the images, then decode
    steps (text: no features). Logits and hidden states equal the reference's."""
    hf, ours = pair
    rng = np.random.default_rng(3)
    layouts = [mrope_prompt(3, (2, 3), 12), mrope_prompt(7, (3, 2), 8)]  # 21 tokens each
    positions = np.stack([p for p, _ in layouts], axis=1)  # [3, 2, T]
    visual = np.stack([v for _, v in layouts])  # [2, T]
    t, n_visual = positions.shape[-1], int(visual.sum())
    ids = rng.integers(0, VOCAB, size=(2, t))
    embeds = np.concatenate([token_embeds(hf, row.tolist()) for row in ids])
    embeds[visual] = rng.standard_normal((n_visual, D)).astype(np.float32) * 0.3
    features = rng.standard_normal((2, n_visual, D)).astype(np.float32)  # [layers, rows, D]
    ref_logits, ref_hidden = reference(hf, embeds, positions, visual, list(features))
    assert np.abs(ref_hidden - reference(hf, embeds, positions)[1]).max() > 0.1  # the features matter

    # the row of ``features`` each token takes: visual tokens in batch-then-position order, as the reference
    index = np.where(visual, np.cumsum(visual.ravel()).reshape(visual.shape) - 1, -1).astype(np.int32)
    prompt_len = t - 3
    steps = PagedSteps(ours, batch=2, pages_per_seq=6, page_size=PAGE)
    got_logits: list[list[np.ndarray]] = [[], []]
    got_hidden: list[list[np.ndarray]] = [[], []]
    for s, e in [(0, 6), (6, 11), (11, prompt_len)] + [(i, i + 1) for i in range(prompt_len, t)]:
        deepstack = Deepstack(jnp.asarray(features), jnp.asarray(index[:, s:e])) if s < prompt_len else None
        logits, hidden = steps.run(embeds[:, s:e], positions[:, :, s:e], [e - s] * 2, layer_inputs=deepstack)
        for row in range(2):
            got_logits[row].append(logits[row])
            got_hidden[row].append(hidden[row])
    assert rel_err(np.stack([np.concatenate(r) for r in got_logits]), ref_logits) < RTOL
    assert rel_err(np.stack([np.concatenate(r) for r in got_hidden]), ref_hidden) < RTOL


def test_interleaved_mrope_layout() -> None:
    """The channel-to-axis map is the reference's ``recomposition_frequencies`` (Qwen3-Omni's
    released section, 64 frequency pairs), and sections that do not interleave are refused."""
    spec = Qwen3OmniTextSpec.from_hf(
        Qwen3OmniMoeTextConfig(**text_config(head_dim=128, rope_parameters={"rope_theta": 1e6}))
    )
    axes = mrope_axes(spec)[:64]
    want = np.zeros(64, np.int64)
    want[1:60:3], want[2:60:3] = 1, 2  # section (24, 20, 20): rows at 1, 4, .., 58, columns at 2, .., 59
    np.testing.assert_array_equal(axes, want)
    bad = Qwen3OmniMoeTextConfig(
        **text_config(rope_parameters={"rope_theta": 1e4, "mrope_section": [2, 7, 7]})
    )
    with pytest.raises(ValueError, match="does not interleave"):
        Qwen3OmniTextSpec.from_hf(bad)


def test_in_memory_names_attention_bias_and_sparse_step() -> None:
    """transformers' in-memory names (fused experts) fill the same model, here with attention
    biases (``o_proj``'s too) and a sparse step of 2 with an MLP-only layer: only layer 1 is
    sparse, as the reference decides."""
    cfg = Qwen3OmniMoeTextConfig(
        **text_config(attention_bias=True, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(1)
    text_model = Qwen3OmniMoeThinkerTextModel(cfg).eval()
    head = torch.nn.Linear(D, VOCAB, bias=False)
    randomize_text_model(text_model, head)
    spec = Qwen3OmniTextSpec.from_hf(cfg)
    sparse = tuple(
        isinstance(layer.mlp, Qwen3OmniMoeThinkerTextSparseMoeBlock) for layer in text_model.layers
    )
    assert spec.sparse_layers == sparse == (False, True, False, False)
    tensors = [("model." + n, a) for n, a in torch_state_items(text_model)]
    tensors.append(("lm_head.weight", head.weight.detach().numpy()))
    ours = build_model(
        lambda: Qwen3OmniTextLM(spec, rngs=nnx.Rngs(0)),
        stack_expert_arrays(tensors),
        TEXT_LM_RULES,
        ignore=text_lm_ignore(spec),
    )
    ids = np.random.RandomState(4).randint(0, VOCAB, size=17).tolist()
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor([ids])).last_hidden_state
        ref_logits = head(hidden)[0].numpy()
    logits, _ = full_forward(ours, ids, page_size=PAGE)
    assert rel_err(logits, ref_logits) < RTOL


@pytest.mark.parametrize("model", [1, 2, 4, 3])
def test_activation_width_counts_the_experts_that_run(model: int, monkeypatch) -> None:
    """A sparse row holds, per expert that runs it, its input row, gate and up outputs and their
    product and output row: the k chosen as grouped matmuls or pair by pair (gathered: with
    each one's copy of its expert), every expert on the device when a step may run them dense,
    as it does unset off TPUs (whole experts per device where the mesh splits them, 8 % 3 != 0
    splits their width), beside the router logits and three residual-width rows."""
    spec = Qwen3OmniTextSpec.from_hf(Qwen3OmniMoeTextConfig(**text_config()))
    lm = Qwen3OmniTextLM(spec, rngs=nnx.Rngs(0))
    inner, experts, top_k = 40, 8, 3
    here, width = (experts // model, 3 * inner) if model in (2, 4) else (experts, 3 * inner // model)
    for path in ("grouped", "assigned"):
        monkeypatch.setenv(MOE_SWITCH, path)
        assert lm.activation_width(model) == experts + top_k * (width + 2 * D) + 3 * D
    monkeypatch.setenv(MOE_SWITCH, "gathered")
    assert lm.activation_width(model) == experts + top_k * (width + 2 * D + D * width) + 3 * D
    for path in ("dense", "auto") if jax.default_backend() != "tpu" else ("dense",):
        monkeypatch.setenv(MOE_SWITCH, path)
        assert lm.activation_width(model) == experts + here * (width + 2 * D) + 3 * D
