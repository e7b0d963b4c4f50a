"""Flax thinker vs transformers ``Qwen2_5OmniThinkerForConditionalGeneration``, float32.

Ours is loaded from the checkpoint the reference writes (on-disk names), so the parameter map
is checked too. Text and multimodal prompts go through the paged cache in chunks and single
decode steps with M-RoPE positions from our ``get_rope_index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import chunk_metadata, compiled, embed_step, rel_err
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniThinkerForConditionalGeneration as HFThinker,
)

from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.full_forward import full_forward
from omni_jax.models.loading import build_model
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths, prepare_audio_batch
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index, positions_for
from omni_jax.models.qwen2_5_omni.thinker import (
    THINKER_RULES,
    THINKER_RULES_IN_OMNI,
    PromptMerge,
    Thinker,
    ThinkerSpec,
    thinker_ignore,
)
from omni_jax.models.qwen2_5_omni.vision_encoder import prepare_vision_batch
from omni_jax.safetensors_io import iter_checkpoint

RTOL = 1e-5  # float32, same math as the reference
VOCAB = 128
AUDIO, IMAGE, VIDEO, A_START, A_END, V_START, V_END = range(120, 127)
MEL = 16


def tiny_thinker_config() -> Qwen2_5OmniThinkerConfig:
    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=dict(
            num_mel_bins=MEL,
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            n_window=8,
            output_dim=64,
            max_source_positions=64,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=8,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        audio_token_index=AUDIO,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        audio_start_token_id=A_START,
        audio_end_token_id=A_END,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )
    cfg._attn_implementation = "eager"
    return cfg


Pair = tuple[HFThinker, Thinker, Path]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = HFThinker(tiny_thinker_config()).eval()
    path = tmp_path_factory.mktemp("thinker")
    hf.save_pretrained(path)
    spec = ThinkerSpec.from_hf(hf.config)
    ours = build_model(
        lambda: Thinker(spec, rngs=nnx.Rngs(0)),
        iter_checkpoint(path),
        THINKER_RULES,
        ignore=thinker_ignore(spec),
    )
    return hf, ours, path


Source = tuple[int, np.ndarray, int]
"""``(placeholder id, encoder rows, the request's row offset in them)``."""


def prompt_merge(
    ids: list[int], start: int, end: int, prompt_len: int, sources: Sequence[Source], width: int
) -> PromptMerge | None:
    """The encoder rows of ``ids[start:end]`` packed for :meth:`Thinker.embed` as the thinker
    stage packs a step (here one step row of ``end - start`` tokens): per placeholder kind, the
    rows of the chunk's placeholders, which follow those that earlier chunks took."""
    if not sources:
        return None
    stop = max(min(end, prompt_len), start)
    merged = np.zeros((end - start, width), np.float32)
    first, offset = [], 0
    for token, rows, row_offset in sources:
        done, n = row_offset + ids[:start].count(token), ids[start:stop].count(token)
        first.append([offset])
        merged[offset : offset + n] = rows[done : done + n]
        offset += n
    return PromptMerge(
        jnp.asarray(merged),
        jnp.asarray(first, jnp.int32),
        jnp.array([stop - start], jnp.int32),
        tuple(token for token, _, _ in sources),
    )


def run_chunks(
    model: Thinker,
    ids: list[int],
    positions: np.ndarray,
    chunks: list[tuple[int, int]],
    sources: Sequence[Source] = (),
    prompt_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and hidden states of ``ids`` run as ``chunks`` through scattered cache pages, the
    encoder rows of ``sources`` merged at the placeholders of the first ``prompt_len`` tokens."""
    spec = model.spec
    page_size, pages = 4, np.array([9, 2, 7, 0, 5, 11, 3, 1, 8, 6, 4, 10, 12, 13, 14, 15], np.int32)
    assert len(ids) <= page_size * len(pages)
    cache = init_kv_cache(spec.num_layers, spec.num_kv_heads, 16, page_size, spec.head_dim, jnp.float32)
    logits, hidden = [], []
    prompt_len = len(ids) if prompt_len is None else prompt_len
    for s, e in chunks:
        md = chunk_metadata(pages, page_size, s, e)
        tokens = jnp.asarray(ids[s:e])[None]
        merge = prompt_merge(ids, s, e, prompt_len, sources, spec.hidden_size)
        step_logits, h, cache = embed_step(
            model, tokens, merge, jnp.asarray(positions[:, s:e])[:, None], cache, md
        )
        logits.append(np.asarray(step_logits)[0])
        hidden.append(np.asarray(h)[0])
    return np.concatenate(logits), np.concatenate(hidden)


def decode_chunks(prefill: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    return prefill + [(i, i + 1) for i in range(prefill[-1][1], total)]


def test_text_prefill_and_decode_match_transformers(pair: Pair) -> None:
    hf, ours, _ = pair
    ids = np.random.RandomState(1).randint(0, 100, size=23).tolist()
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            output_hidden_states=True,
        )
    ref_logits, ref_hidden = ref.logits[0].numpy(), ref.hidden_states[-1][0].numpy()

    prompt = ids[:13]
    positions, delta = get_rope_index(ours.thinker_spec.rope_index, prompt)
    positions = positions_for(positions, delta, 0, len(ids))
    logits, hidden = run_chunks(ours, ids, positions, decode_chunks([(0, 13)], len(ids)))
    assert rel_err(logits, ref_logits) < RTOL
    assert rel_err(hidden, ref_hidden) < RTOL
    one_shot, _ = full_forward(ours, ids, page_size=8, positions=positions)
    assert rel_err(one_shot, ref_logits) < RTOL


def test_audio_image_prompt_matches_transformers(pair: Pair) -> None:
    """Audio (3 encoder chunks) and an image merged at their placeholders, then decode.

    The prefill is cut inside the audio placeholders, so the second chunk must continue
    from the right encoder row; decoding continues at ``index + rope_delta``.
    """
    hf, ours, _ = pair
    spec = ours.thinker_spec
    rng = np.random.default_rng(0)
    frames, padded = 37, 40
    grid = (1, 4, 6)
    features = rng.standard_normal((MEL, padded)).astype(np.float32)
    pixels = rng.standard_normal((int(np.prod(grid)), spec.vision.patch_dim)).astype(np.float32)
    text = np.random.RandomState(2).randint(0, 100, size=12).tolist()
    n_audio, n_image = audio_output_lengths(frames)[1], int(np.prod(grid)) // spec.vision.merge_unit
    prompt = (
        text[:3]
        + [A_START]
        + [AUDIO] * n_audio
        + [A_END]
        + text[3:5]
        + [V_START]
        + [IMAGE] * n_image
        + [V_END]
        + text[5:7]
    )
    ids = prompt + text[7:]

    mask = np.zeros((1, padded), np.int64)
    mask[0, :frames] = 1
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            input_features=torch.from_numpy(features[None]),
            feature_attention_mask=torch.from_numpy(mask),
            pixel_values=torch.from_numpy(pixels),
            image_grid_thw=torch.tensor([grid]),
            output_hidden_states=True,
        )
    ref_logits, ref_hidden = ref.logits[0].numpy(), ref.hidden_states[-1][0].numpy()

    audio_batch, audio_split = prepare_audio_batch([features[:, :frames]], spec.audio)
    vision_batch, vision_split = prepare_vision_batch([pixels], [grid], spec.vision)
    sources = [
        (AUDIO, np.asarray(compiled(ours, "audio_tower", audio_batch)), audio_split.offsets[0]),
        (IMAGE, np.asarray(compiled(ours, "visual", vision_batch)), vision_split.offsets[0]),
    ]
    positions, delta = get_rope_index(spec.rope_index, prompt, image_grid_thw=[grid], audio_seqlens=[frames])
    assert delta != 0
    positions = positions_for(positions, delta, 0, len(ids))

    cut = 3 + 1 + n_audio // 2
    logits, hidden = run_chunks(
        ours, ids, positions, decode_chunks([(0, cut), (cut, len(prompt))], len(ids)), sources, len(prompt)
    )
    assert rel_err(logits, ref_logits) < RTOL
    assert rel_err(hidden, ref_hidden) < RTOL

    merge = prompt_merge(ids, 0, len(ids), len(prompt), sources, spec.text.hidden_size)
    embeds = compiled(ours, "embed", jnp.asarray(ids)[None], merge)[0]
    one_shot, _ = full_forward(ours, ids, page_size=8, positions=positions, embeds=embeds)
    assert rel_err(one_shot, ref_logits) < RTOL


def test_rules_inside_full_omni_checkpoint(pair: Pair) -> None:
    """The same tensors under the ``thinker.`` prefix of a full Omni checkpoint fill the same model."""
    _, ours, path = pair
    spec = ours.thinker_spec
    prefixed = ((f"thinker.{name}", array) for name, array in iter_checkpoint(path))
    again = build_model(
        lambda: Thinker(spec, rngs=nnx.Rngs(1)),
        prefixed,
        THINKER_RULES_IN_OMNI,
        ignore=thinker_ignore(spec, prefix="thinker."),
    )
    want = dict(nnx.to_flat_state(nnx.state(ours)))
    got = dict(nnx.to_flat_state(nnx.state(again)))
    assert want.keys() == got.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(value[...]))
