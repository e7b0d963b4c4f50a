"""Flax Qwen3-Omni thinker vs transformers ``Qwen3OmniMoeThinkerForConditionalGeneration``, float32.

Ours is loaded from the checkpoint the reference writes (on-disk names, per-expert tensors
stacked on load), so the parameter map is checked too. Each prompt's media go through our audio
and vision encoders; the prompt is prefilled in chunks that cut through its placeholders,
through scattered cache pages, with M-RoPE positions from our ``get_rope_index`` and the
encoder and DeepStack rows merged as a step merges them; then greedy decode steps. The
reference runs its own prefill (encoders, merge, DeepStack, ``get_rope_index``) and decode
steps on its cache: every position's logits and the greedy tokens must agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import (
    chunk_metadata,
    compiled,
    embed_step,
    qwen3_video_audio_layout,
    random_tokens,
    randomize_moe_layers,
    rel_err,
)
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration as HFThinker,
)

from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.models.loading import build_model
from omni_jax.models.moe import stack_expert_arrays
from omni_jax.models.qwen2_5_omni.rope_index import positions_for
from omni_jax.models.qwen2_5_omni.thinker import PromptMerge
from omni_jax.models.qwen3_omni.audio_encoder import prepare_audio_batch
from omni_jax.models.qwen3_omni.rope_index import audio_token_count, get_rope_index
from omni_jax.models.qwen3_omni.thinker import (
    THINKER_RULES,
    THINKER_RULES_IN_OMNI,
    Thinker,
    ThinkerMerge,
    ThinkerSpec,
    thinker_ignore,
)
from omni_jax.models.qwen3_omni.vision_encoder import prepare_vision_batch
from omni_jax.safetensors_io import iter_checkpoint
from omni_jax.testing import randomize_weights
from omni_jax.testing_qwen3_omni import THINKER_PARTS, thinker_part

RTOL = 1e-5  # float32, same math as the reference
VOCAB, D, MEL = 160, 64, 16
AUDIO, IMAGE, VIDEO, A_START, A_END, V_START, V_END = range(150, 157)
PAGE, PAGES = 4, np.random.RandomState(5).permutation(40).astype(np.int32)
DECODE_STEPS = 4
PROMPT_CHUNK = 9  # prefill chunk: cuts through every kind of placeholder run below


def tiny_thinker_config() -> Qwen3OmniMoeThinkerConfig:
    """Three decoder layers (the middle one dense), 8 experts top-2, DeepStack from vision
    layers 0 and 2; audio windows of two 100-frame chunks; 13 positions a second."""
    cfg = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(
            num_mel_bins=MEL,
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            output_dim=D,
            downsample_hidden_size=8,
            n_window=50,
            n_window_infer=200,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            in_channels=3,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=D,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 2],
        ),
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]},
        ),
        audio_token_id=AUDIO,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_start_token_id=A_START,
        vision_start_token_id=V_START,
        position_id_per_seconds=13,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._experts_implementation = "eager"
    return cfg


def randomize(hf: HFThinker) -> None:
    """Weights ~ 1/sqrt(fan_in) everywhere (the experts' fan-in is their last axis), router
    logits of order 3 so routing is decided by the signal, a peaky head so greedy choices are."""
    for name in THINKER_PARTS:
        randomize_weights(thinker_part(hf, name), 1.0)
    randomize_weights(hf.lm_head, 4.0)
    randomize_moe_layers(thinker_part(hf, "language_model").layers)


Pair = tuple[HFThinker, Thinker, Path]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = HFThinker(tiny_thinker_config()).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp("qwen3_omni_thinker")
    hf.save_pretrained(path)
    spec = ThinkerSpec.from_hf(hf.config)
    assert spec.text.sparse_layers == (True, False, True) and spec.deepstack_layers == 2
    ours = build_model(
        lambda: Thinker(spec, rngs=nnx.Rngs(0)),
        stack_expert_arrays(iter_checkpoint(path)),
        THINKER_RULES,
        ignore=thinker_ignore(spec),
    )
    return hf, ours, path


# -- prompts ---------------------------------------------------------------------------------


def text(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, AUDIO)


def vision_tokens(grid: tuple[int, int, int]) -> int:
    return int(np.prod(grid)) // 4


def audio_span(frames: int) -> list[int]:
    return [A_START] + [AUDIO] * audio_token_count(frames, 50) + [A_END]


def image_span(grid: tuple[int, int, int]) -> list[int]:
    return [V_START] + [IMAGE] * vision_tokens(grid) + [V_END]


def video_span(grid: tuple[int, int, int]) -> list[int]:
    return [V_START] + [VIDEO] * vision_tokens(grid) + [V_END]


def video_with_audio_span(grid: tuple[int, int, int], seconds: float, frames: int) -> list[int]:
    """The processor's own interleaving (:func:`parity.qwen3_video_audio_layout`) in vision brackets."""
    chars = {"B": V_START, "E": V_END, "s": A_START, "e": A_END, "v": VIDEO, "a": AUDIO}
    return [chars[c] for c in qwen3_video_audio_layout(grid, seconds, audio_token_count(frames, 50))]


class Prompt:
    """A prompt's ids and media: mel features per clip, patches and grids per image and video."""

    def __init__(
        self,
        ids: list[int],
        seed: int,
        audio_frames: Sequence[int] = (),
        image_grids: Sequence[tuple[int, int, int]] = (),
        video_grids: Sequence[tuple[int, int, int]] = (),
        seconds: float = 1.0,
        use_audio_in_video: bool = False,
    ):
        rng = np.random.default_rng(seed)
        patch_dim = 3 * 2 * 2 * 2
        self.ids = ids
        self.audio = [rng.standard_normal((MEL, n)).astype(np.float32) for n in audio_frames]
        self.images = [
            rng.standard_normal((int(np.prod(g)), patch_dim)).astype(np.float32) for g in image_grids
        ]
        self.videos = [
            rng.standard_normal((int(np.prod(g)), patch_dim)).astype(np.float32) for g in video_grids
        ]
        self.image_grids, self.video_grids = list(image_grids), list(video_grids)
        self.seconds = [seconds] * len(video_grids)
        self.use_audio_in_video = use_audio_in_video

    def reference_inputs(self) -> dict[str, object]:
        """The media as the reference's forward takes them."""
        kw: dict[str, object] = {}
        if self.audio:
            frames = [a.shape[1] for a in self.audio]
            features = np.zeros((len(frames), MEL, max(frames)), np.float32)
            mask = np.zeros((len(frames), max(frames)), np.int64)
            for i, a in enumerate(self.audio):
                features[i, :, : a.shape[1]], mask[i, : a.shape[1]] = a, 1
            kw.update(
                input_features=torch.from_numpy(features), feature_attention_mask=torch.from_numpy(mask)
            )
        if self.images:
            kw.update(
                pixel_values=torch.from_numpy(np.concatenate(self.images)),
                image_grid_thw=torch.tensor(self.image_grids),
            )
        if self.videos:
            kw.update(
                pixel_values_videos=torch.from_numpy(np.concatenate(self.videos)),
                video_grid_thw=torch.tensor(self.video_grids),
                video_second_per_grid=torch.tensor(self.seconds),
                use_audio_in_video=self.use_audio_in_video,
            )
        return kw


PROMPTS = {
    "text": lambda: Prompt(text(13, 1), 0),
    "text_image": lambda: Prompt(
        text(4, 2) + image_span((1, 6, 8)) + text(3, 3) + image_span((1, 4, 4)) + text(5, 4),
        1,
        image_grids=[(1, 6, 8), (1, 4, 4)],
    ),
    "text_audio": lambda: Prompt(
        # clips under one chunk: the reference pads both to the longer one (61 frames)
        text(3, 5) + audio_span(61) + text(2, 6) + audio_span(37) + text(4, 7),
        2,
        audio_frames=[61, 37],
    ),
    "text_video": lambda: Prompt(text(5, 8) + video_span((4, 4, 6)) + text(4, 9), 3, video_grids=[(4, 4, 6)]),
    "audio_in_video": lambda: Prompt(
        # 230 frames: 3 audio chunks in 2 attention windows, 30 tokens around 3 frames' 12
        text(3, 10) + video_with_audio_span((3, 4, 4), 1.0, 230) + text(4, 11),
        4,
        audio_frames=[230],
        video_grids=[(3, 4, 4)],
        use_audio_in_video=True,
    ),
    "video_image_audio": lambda: Prompt(
        # both visual kinds: the DeepStack rows follow the visual positions jointly
        text(2, 12)
        + video_span((2, 2, 4))
        + text(2, 13)
        + image_span((1, 4, 2))
        + audio_span(45)
        + text(3, 14),
        5,
        audio_frames=[45],
        image_grids=[(1, 4, 2)],
        video_grids=[(2, 2, 4)],
    ),
}


# -- the two sides ---------------------------------------------------------------------------


CACHE = "cache" if "cache" in inspect.signature(HFThinker.forward).parameters else "past_key_values"
"""The reference's KV-cache argument and output field: ``cache`` in transformers 5.24,
``past_key_values`` in 5.17."""


def reference_greedy(hf: HFThinker, prompt: Prompt) -> tuple[np.ndarray, list[int]]:
    """The reference's prefill (its encoders, merge, DeepStack and positions) and greedy decode
    steps on its cache: ``(logits [P + steps - 1, V], generated tokens)``."""
    ids = prompt.ids
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            use_cache=True,
            **prompt.reference_inputs(),
        )
        logits, cache = [out.logits[0].numpy()], getattr(out, CACHE)
        tokens = [int(np.argmax(logits[-1][-1]))]
        for _ in range(DECODE_STEPS - 1):
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{CACHE: cache})
            logits.append(out.logits[0].numpy())
            cache = getattr(out, CACHE)
            tokens.append(int(np.argmax(logits[-1][-1])))
    return np.concatenate(logits), tokens


Source = tuple[int, np.ndarray, np.ndarray | None]
"""``(placeholder id, its encoder rows [n, D], their DeepStack rows [L, n, D] or None)``."""


def encode(model: Thinker, prompt: Prompt) -> list[Source]:
    """The prompt's encoder rows per kind, from one audio call over its clips (so each chunk is
    padded as the reference's call pads it) and one vision call over its images and videos."""
    spec = model.thinker_spec
    sources: list[Source] = []
    if prompt.audio:
        batch, split = prepare_audio_batch(prompt.audio, spec.audio)
        rows = np.concatenate(split.split(np.asarray(compiled(model, "audio_tower", batch))))
        sources.append((AUDIO, rows, None))
    patches, grids = [*prompt.images, *prompt.videos], [*prompt.image_grids, *prompt.video_grids]
    if patches:
        batch, split = prepare_vision_batch(patches, grids, spec.vision)
        rows, deepstack = compiled(model, "visual", batch)
        per_item = split.split(np.asarray(rows))
        deep_items = split.split(np.stack([np.asarray(f) for f in deepstack], axis=1))  # [n, L, D] each
        n_images = len(prompt.images)
        for token, items in ((IMAGE, slice(0, n_images)), (VIDEO, slice(n_images, None))):
            if per_item[items]:
                deep = np.concatenate(deep_items[items]).transpose(1, 0, 2)
                sources.append((token, np.concatenate(per_item[items]), deep))
    return sources


def thinker_merge(
    ids: list[int], start: int, end: int, prompt_len: int, sources: Sequence[Source], layers: int
) -> ThinkerMerge | None:
    """The encoder and DeepStack rows of ``ids[start:end]`` packed as a step packs one row of
    ``end - start`` tokens: per kind, the rows of the chunk's prompt placeholders, which follow
    those earlier chunks took."""
    if not sources:
        return None
    stop = max(min(end, prompt_len), start)
    rows = np.zeros((end - start, D), np.float32)
    deep = np.zeros((layers, end - start, D), np.float32)
    first, offset = [], 0
    for token, encoded, deepstack in sources:
        done, n = ids[:start].count(token), ids[start:stop].count(token)
        first.append([offset])
        rows[offset : offset + n] = encoded[done : done + n]
        if deepstack is not None:
            deep[:, offset : offset + n] = deepstack[:, done : done + n]
        offset += n
    merge = PromptMerge(
        jnp.asarray(rows),
        jnp.asarray(first, jnp.int32),
        jnp.array([stop - start], jnp.int32),
        tuple(token for token, _, _ in sources),
    )
    return ThinkerMerge(merge, jnp.asarray(deep))


def ours_greedy(model: Thinker, prompt: Prompt) -> tuple[np.ndarray, list[int]]:
    """Our prefill in :data:`PROMPT_CHUNK`-token chunks, then greedy decode steps, all through
    scattered cache pages: ``(logits [P + steps - 1, V], generated tokens)``."""
    spec = model.thinker_spec
    ids = list(prompt.ids)
    prompt_len = len(ids)
    positions, delta = get_rope_index(
        spec.rope_index,
        ids,
        image_grid_thw=prompt.image_grids,
        video_grid_thw=prompt.video_grids,
        second_per_grid_ts=prompt.seconds,
        audio_seqlens=[a.shape[1] for a in prompt.audio],
        use_audio_in_video=prompt.use_audio_in_video,
    )
    sources = encode(model, prompt)
    cache = init_kv_cache(
        spec.text.num_layers, spec.text.num_kv_heads, len(PAGES), PAGE, spec.text.head_dim, jnp.float32
    )
    chunks = [(s, min(s + PROMPT_CHUNK, prompt_len)) for s in range(0, prompt_len, PROMPT_CHUNK)]
    logits: list[np.ndarray] = []
    tokens: list[int] = []
    while len(tokens) < DECODE_STEPS:
        s, e = chunks.pop(0) if chunks else (len(ids) - 1, len(ids))
        merge = thinker_merge(ids, s, e, prompt_len, sources, spec.deepstack_layers)
        step_tokens = jnp.asarray(ids[s:e])[None]
        step_positions = jnp.asarray(positions_for(positions, delta, s, e))[:, None]
        step_logits, _, cache = embed_step(
            model, step_tokens, merge, step_positions, cache, chunk_metadata(PAGES, PAGE, s, e)
        )
        logits.append(np.asarray(step_logits)[0])
        if e >= prompt_len:
            tokens.append(int(np.argmax(logits[-1][-1])))
            ids.append(tokens[-1])
    return np.concatenate(logits), tokens


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_prefill_and_greedy_decode_match_transformers(pair: Pair, name: str) -> None:
    hf, ours, _ = pair
    prompt = PROMPTS[name]()
    ref_logits, ref_tokens = reference_greedy(hf, prompt)
    got_logits, got_tokens = ours_greedy(ours, prompt)
    assert got_logits.shape == ref_logits.shape
    assert rel_err(got_logits, ref_logits) < RTOL
    assert got_tokens == ref_tokens
    top2 = np.sort(ref_logits[len(prompt.ids) - 1 :], axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # greedy is decided by the signal


def test_media_matter(pair: Pair) -> None:
    """Each visual token takes its kind's next DeepStack row, and the encoders' rows and the
    DeepStack features both change the hidden states (so the parity above checks them)."""
    hf, ours, _ = pair
    prompt = PROMPTS["video_image_audio"]()
    sources = encode(ours, prompt)
    ids, n = prompt.ids, len(prompt.ids)
    tokens = jnp.asarray(ids)[None]
    merge = thinker_merge(ids, 0, n, n, sources, ours.thinker_spec.deepstack_layers)
    deepstack = compiled(ours, "deepstack", tokens, merge)
    visual = np.isin(ids, [IMAGE, VIDEO])
    index = np.asarray(deepstack.index)[0]
    np.testing.assert_array_equal(index >= 0, visual)
    # each visual token takes the k-th DeepStack row of its kind, in prompt order
    by_kind = {token: iter(deep.transpose(1, 0, 2)) for token, _, deep in sources if deep is not None}
    want = np.stack([next(by_kind[t]) for t in ids if t in (IMAGE, VIDEO)], axis=1)
    np.testing.assert_array_equal(np.asarray(merge.deepstack)[:, index[visual]], want)
    positions, delta = get_rope_index(
        ours.thinker_spec.rope_index,
        ids,
        image_grid_thw=prompt.image_grids,
        video_grid_thw=prompt.video_grids,
        second_per_grid_ts=prompt.seconds,
        audio_seqlens=[a.shape[1] for a in prompt.audio],
    )
    spec = ours.thinker_spec.text

    def last_hidden(embeds: jnp.ndarray, deep: object) -> np.ndarray:
        cache = init_kv_cache(
            spec.num_layers, spec.num_kv_heads, len(PAGES), PAGE, spec.head_dim, jnp.float32
        )
        md = chunk_metadata(PAGES, PAGE, 0, n)
        hidden, _ = compiled(
            ours, "__call__", embeds, jnp.asarray(positions)[:, None], cache, md, layer_inputs=deep
        )
        return np.asarray(hidden)

    merged = compiled(ours, "embed", tokens, merge)
    full = last_hidden(merged, deepstack)
    assert np.abs(full - last_hidden(merged, None)).max() > 0.1
    assert np.abs(full - last_hidden(compiled(ours, "embed", tokens), deepstack)).max() > 0.1
    assert ours.deepstack(tokens, None) is None


def test_rules_inside_full_omni_checkpoint(pair: Pair) -> None:
    """The same tensors under the ``thinker.`` prefix of a full Omni checkpoint fill the same model."""
    _, ours, path = pair
    spec = ours.thinker_spec
    prefixed = ((f"thinker.{name}", array) for name, array in iter_checkpoint(path))
    again = build_model(
        lambda: Thinker(spec, rngs=nnx.Rngs(1)),
        stack_expert_arrays(prefixed),
        THINKER_RULES_IN_OMNI,
        ignore=thinker_ignore(spec, prefix="thinker."),
    )
    want = dict(nnx.to_flat_state(nnx.state(ours)))
    got = dict(nnx.to_flat_state(nnx.state(again)))
    assert want.keys() == got.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(value[...]))
