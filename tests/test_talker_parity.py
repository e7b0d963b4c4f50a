"""Flax talker vs transformers ``Qwen2_5OmniTalkerForConditionalGeneration``, float32.

Two references: a standalone talker whose widths all differ (codec embedding 64, decoder 48,
attention 4 x 16), loaded by the talker's own parameter map, and the talker inside the tiny
Qwen2.5-Omni checkpoint, loaded as a served part (HF dir and converted dir) and run through
the reference's own prefill (codec ``pad``/``bos`` added to the last two thinker rows, M-RoPE
positions from ``get_rope_index``) and decode (codec embedding plus one reply row per step).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import chunk_metadata, compiled, embed_step, rel_err
from transformers import Qwen2_5OmniForConditionalGeneration
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniTalkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniTalkerForConditionalGeneration as HFTalker,
)

from omni_jax.architectures import architecture_of
from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.full_forward import full_forward
from omni_jax.models.loading import abstract_params, build_model
from omni_jax.models.param_map import format_path
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index, positions_for
from omni_jax.models.qwen2_5_omni.talker import (
    TALKER_RULES,
    Talker,
    TalkerEmbeds,
    TalkerSpec,
    talker_ignore,
    talker_partition_rules,
)
from omni_jax.parallel.rules import partition_spec
from omni_jax.safetensors_io import iter_checkpoint
from omni_jax.weights import load_hf_config, load_part, read_manifest

RTOL = 1e-5  # float32, same math as the reference
EMBED = 64


def standalone_config() -> Qwen2_5OmniTalkerConfig:
    cfg = Qwen2_5OmniTalkerConfig(
        vocab_size=80,
        embedding_size=EMBED,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        initializer_range=0.2,
        tts_codec_pad_token_id=72,
        tts_codec_start_token_id=73,
        tts_codec_end_token_id=74,
        tts_codec_mask_token_id=76,
    )
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTalker, Talker]:
    torch.manual_seed(0)
    hf = HFTalker(standalone_config()).eval()
    path = tmp_path_factory.mktemp("talker")
    hf.save_pretrained(path)
    spec = TalkerSpec.from_hf(hf.config)
    ours = build_model(
        lambda: Talker(spec, rngs=nnx.Rngs(0)),
        iter_checkpoint(path),
        TALKER_RULES,
        ignore=talker_ignore(spec),
    )
    return hf, ours


def image_prompt(spec: TalkerSpec, text: list[int], grid: tuple[int, int, int]) -> list[int]:
    """Thinker ids with one image of ``grid`` patches between text, as the talker's positions see them."""
    r = spec.rope_index
    n_image = int(np.prod(grid)) // r.spatial_merge_size**2
    return text[:3] + [r.vision_start_token_id] + [r.image_token_id] * n_image + [0] + text[3:]


def test_spec_reads_the_talker_config(standalone) -> None:
    _, ours = standalone
    spec = ours.talker_spec
    text = spec.text
    assert (spec.embedding_size, text.hidden_size, text.num_heads * text.head_dim) == (64, 48, 64)
    assert (spec.codec_pad, spec.codec_bos, spec.codec_eos, spec.codec_mask) == (72, 73, 74, 76)
    assert (spec.text_bos, spec.text_eos, spec.text_pad) == (151860, 151861, 151859)
    assert spec.rope_index.spatial_merge_size == 2 and spec.rope_index.image_token_id == 151655
    assert not text.tie_word_embeddings and ours.kv_cache_shape() == (2, 2, 16)


def test_decoder_matches_transformers_with_3d_positions(standalone) -> None:
    """Thinker rows only (no codec embedding), through the paged cache in one shot."""
    hf, ours = standalone
    spec = ours.talker_spec
    prompt = image_prompt(spec, list(range(1, 8)), (1, 4, 6))
    positions, delta = get_rope_index(spec.rope_index, prompt, image_grid_thw=[(1, 4, 6)])
    assert delta != 0 and not np.array_equal(positions[0], positions[1])
    rows = np.random.default_rng(0).standard_normal((1, len(prompt), EMBED)).astype(np.float32)
    with torch.no_grad():
        x = torch.from_numpy(rows)
        out = hf.model(
            inputs_embeds=hf.thinker_to_talker_proj(x), position_ids=torch.from_numpy(positions)[:, None]
        )
        ref_hidden = out.last_hidden_state[0].numpy()
        ref_logits = hf.codec_head(out.last_hidden_state).float()[0].numpy()

    tokens = jnp.full((1, len(prompt)), spec.codec_mask, jnp.int32)
    embeds = compiled(ours, "embed", tokens, TalkerEmbeds(jnp.asarray(rows), jnp.zeros(tokens.shape, bool)))
    logits, hidden = full_forward(
        ours, [spec.codec_mask] * len(prompt), 8, positions=positions, embeds=embeds[0]
    )
    assert logits.dtype == np.float32
    assert rel_err(hidden, ref_hidden) < RTOL
    assert rel_err(logits, ref_logits) < RTOL


def test_embed_adds_codec_only_where_asked(standalone) -> None:
    hf, ours = standalone
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 80, (2, 9))
    rows = rng.standard_normal((2, 9, EMBED)).astype(np.float32)
    add = rng.random((2, 9)) < 0.5
    with torch.no_grad():
        codec = hf.model.embed_tokens(torch.from_numpy(tokens))
        want = hf.thinker_to_talker_proj(codec * torch.from_numpy(add)[..., None] + torch.from_numpy(rows))
        bare = hf.thinker_to_talker_proj(codec)
    got = ours.embed(jnp.asarray(tokens, jnp.int32), TalkerEmbeds(jnp.asarray(rows), jnp.asarray(add)))
    assert rel_err(np.asarray(got), want.numpy()) < RTOL
    assert rel_err(np.asarray(ours.embed(jnp.asarray(tokens, jnp.int32))), bare.numpy()) < RTOL


@pytest.fixture(scope="module")
def omni_talker(omni_dir) -> HFTalker:
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(
        omni_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.talker.eval()


def run_chunks(
    model: Talker, ids: list[int], table: np.ndarray, codec_from: int, positions, chunks
) -> np.ndarray:
    """Logits of ``ids`` run as ``chunks`` through scattered cache pages; token ``p`` reads row
    ``min(p, len(table) - 1)`` and adds its codec embedding from ``codec_from`` on."""
    spec = model.spec
    page_size, pages = 4, np.array([9, 2, 7, 0, 5, 11, 3, 1, 8, 6, 4, 10], np.int32)
    assert len(ids) <= page_size * len(pages)
    cache = init_kv_cache(spec.num_layers, spec.num_kv_heads, 12, page_size, spec.head_dim, jnp.float32)
    out = []
    for s, e in chunks:
        idx = np.arange(s, e)
        md = chunk_metadata(pages, page_size, s, e)
        extra = TalkerEmbeds(
            jnp.asarray(table[np.minimum(idx, len(table) - 1)])[None], jnp.asarray(idx >= codec_from)[None]
        )
        logits, _, cache = embed_step(
            model, jnp.asarray(ids[s:e])[None], extra, jnp.asarray(positions[:, s:e])[:, None], cache, md
        )
        out.append(np.asarray(logits)[0])
    return np.concatenate(out)


def test_prefill_and_greedy_decode_match_the_reference_forward(omni_dir, omni_talker) -> None:
    """The reference's own talker prefill (it computes the positions and adds codec pad/bos)
    and decode steps with its cache, against chunked prefill and single decode steps here."""
    hf = omni_talker
    ours, _ = load_part(omni_dir, "talker")
    spec = ours.talker_spec
    rng = np.random.default_rng(2)
    grid = (1, 4, 6)
    text_ids = image_prompt(spec, rng.integers(20, 300, 6).tolist(), grid) + [spec.text_bos, 301]
    n, length, steps = len(text_ids) - 2, len(text_ids), 6
    codec_ids = [spec.codec_mask] * n + [spec.codec_pad, spec.codec_bos]
    thinker_rows = rng.standard_normal((length, EMBED)).astype(np.float32)
    reply = rng.standard_normal((3, EMBED)).astype(np.float32)  # runs out before the last steps

    hf.rope_deltas = None
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor([codec_ids]),
            input_text_ids=torch.tensor([text_ids]),
            image_grid_thw=torch.tensor([grid]),
            inputs_embeds=torch.from_numpy(thinker_rows[None]).clone(),
            attention_mask=torch.ones(1, length, dtype=torch.long),
            thinker_reply_part=torch.from_numpy(reply[None]),
            use_cache=True,
        )
        ref_logits, generated = [out.logits[0].numpy()], []
        for k in range(steps):
            last = out.logits[0, -1].clone()
            last[spec.codec_bos] = -torch.inf  # generate's suppress_tokens
            generated.append(int(last.argmax()))
            out = hf(
                input_ids=torch.tensor([[generated[-1]]]),
                attention_mask=torch.ones(1, length + k + 1, dtype=torch.long),
                past_key_values=out.past_key_values,
                thinker_reply_part=out.thinker_reply_part,
                use_cache=True,
            )
            ref_logits.append(out.logits[0].numpy())
    ref_logits = np.concatenate(ref_logits)
    assert all(c < 64 for c in generated)  # the tiny talker speaks only codes the DiT embeds

    prompt_positions, delta = get_rope_index(spec.rope_index, text_ids, image_grid_thw=[grid])
    assert delta != 0
    ids = codec_ids + generated
    positions = positions_for(prompt_positions, delta, 0, len(ids))
    table = np.concatenate([thinker_rows, reply])
    cut = n // 2
    chunks = [(0, cut), (cut, length)] + [(i, i + 1) for i in range(length, len(ids))]
    logits = run_chunks(ours, ids, table, n, positions, chunks)
    assert rel_err(logits[: len(ref_logits)], ref_logits) < RTOL
    suppressed = logits.copy()
    suppressed[:, spec.codec_bos] = -np.inf
    assert suppressed[length - 1 : length - 1 + steps].argmax(-1).tolist() == generated

    add = np.arange(length) >= n
    extra = TalkerEmbeds(jnp.asarray(thinker_rows)[None], jnp.asarray(add)[None])
    embeds = compiled(ours, "embed", jnp.asarray(codec_ids)[None], extra)
    one_shot, _ = full_forward(ours, codec_ids, 8, positions=prompt_positions, embeds=embeds[0])
    assert rel_err(one_shot, ref_logits[:length]) < RTOL


def test_converted_dir_loads_the_same_talker(omni_dir, omni_converted_dir) -> None:
    manifest = read_manifest(omni_converted_dir)
    assert "talker" in manifest["stages"] and not manifest["unserved"]
    want = dict(nnx.to_flat_state(nnx.state(load_part(omni_dir, "talker")[0])))
    got = dict(nnx.to_flat_state(nnx.state(load_part(omni_converted_dir, "talker")[0])))
    assert want.keys() == got.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(value[...]))


def test_partition_rules(omni_dir) -> None:
    """Decoder split like Qwen2's, codec embedding and head by vocabulary, projection whole."""
    cfg = load_hf_config(omni_dir)
    spec = TalkerSpec.from_hf(cfg.talker_config)
    _, abstract = abstract_params(lambda: Talker(spec, rngs=nnx.Rngs(0)))
    shapes = {format_path(p): tuple(v.shape) for p, v in abstract.items()}

    def specs(model: int) -> dict[str, tuple]:
        rules = architecture_of(cfg).part("talker").shard_rules(cfg, model)
        assert rules == talker_partition_rules(spec, model)
        mesh = SimpleNamespace(shape={"data": 1, "model": model})  # only mesh.shape is read
        return {p: tuple(partition_spec(tuple(p.split(".")), s, rules, mesh)) for p, s in shapes.items()}

    col, row = (None, "model"), ("model", None)
    two = specs(2)
    layer = "model.layers.1."
    assert two[layer + "self_attn.q_proj.kernel"] == two[layer + "self_attn.k_proj.kernel"] == col
    assert two[layer + "self_attn.v_proj.bias"] == ("model",)
    assert two[layer + "self_attn.o_proj.kernel"] == two[layer + "mlp.down_proj.kernel"] == row
    assert two[layer + "mlp.gate_proj.kernel"] == two[layer + "mlp.up_proj.kernel"] == col
    assert two["model.embed_tokens.embedding"] == row and two["codec_head.kernel"] == col
    assert two["thinker_to_talker_proj.kernel"] == two["thinker_to_talker_proj.bias"] == ()
    assert two["model.norm.weight"] == () and two[layer + "input_layernorm.weight"] == ()
    four = specs(4)  # 2 KV heads: k/v stay whole, the cache replicates them
    assert four[layer + "self_attn.k_proj.kernel"] == () and four[layer + "self_attn.q_proj.kernel"] == col
    assert four["codec_head.kernel"] == col
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        talker_partition_rules(spec, 3)
