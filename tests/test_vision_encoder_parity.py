"""The JAX vision encoder equals transformers' ``Qwen2_5OmniVisionEncoder`` on an image + video batch."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from flax import nnx
from parity import CountedJit, random_patches, rel_err
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2_5_omni import vision_encoder
from omni_jax.models.qwen2_5_omni.vision_encoder import (
    VISION_RULES,
    VisionEncoder,
    VisionEncoderSpec,
    plan_vision_calls,
    prepare_vision_batch,
    vision_token_buckets,
)


def _reference(**changes: Any) -> Qwen2_5OmniVisionEncoder:
    torch.manual_seed(0)
    sizes: dict[str, Any] = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        window_size=8,  # windows of 2x2 merged units = 16 tokens
        out_hidden_size=40,
        fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5OmniVisionEncoderConfig(**{**sizes, **changes})
    cfg._attn_implementation = "eager"
    return Qwen2_5OmniVisionEncoder(cfg).eval()


def _reference_forward(
    model: Qwen2_5OmniVisionEncoder, patches: list[np.ndarray], grids: list[tuple[int, int, int]]
) -> np.ndarray:
    """The call ``get_image_features`` / ``get_video_features`` make: ``visual(pixels, grid_thw=...)``."""
    with torch.no_grad():
        out = model(torch.from_numpy(np.concatenate(patches)), grid_thw=torch.tensor(grids))
    return out.pooler_output.numpy()


def test_vision_encoder_matches_reference_batched() -> None:
    ref = _reference()
    spec = VisionEncoderSpec.from_hf(ref.config)
    model = build_model(lambda: VisionEncoder(spec, rngs=nnx.Rngs(0)), torch_state_items(ref), VISION_RULES)
    graphdef, state = nnx.split(model)
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(0)
    # an image whose merged grid (3x4) is cut by the 2x2 windows, and a 2-frame video (2x3)
    grids = [(1, 6, 8), (2, 4, 6)]
    patches = [random_patches(rng, g, spec.patch_dim) for g in grids]

    batch, rows = prepare_vision_batch(patches, grids, spec)
    per_request = rows.split(np.asarray(encode(state, batch)))

    want = _reference_forward(ref, patches, grids)
    err = rel_err(np.concatenate(per_request), want)
    print(f"batched rel err {err:.2e}")
    assert err < 1e-5, err
    for p, g, got in zip(patches, grids, per_request, strict=True):
        alone = _reference_forward(ref, [p], [g])
        assert got.shape == alone.shape
        assert rel_err(got, alone) < 1e-5
        single, single_rows = prepare_vision_batch([p], [g], spec)
        assert rel_err(single_rows.split(np.asarray(encode(state, single)))[0], alone) < 1e-5
    traces_before = encode.traces

    # a different batch with the same bucket sizes reuses the compiled function
    grids2 = [(1, 8, 8), (2, 4, 4)]
    patches2 = [random_patches(rng, g, spec.patch_dim) for g in grids2]
    batch2, rows2 = prepare_vision_batch(patches2, grids2, spec)
    assert jax.tree.map(np.shape, batch2) == jax.tree.map(np.shape, batch)
    out2 = rows2.split(np.asarray(encode(state, batch2)))
    for p, g, got in zip(patches2, grids2, out2, strict=True):
        assert rel_err(got, _reference_forward(ref, [p], [g])) < 1e-5
    assert encode.traces == traces_before


def test_calls_cut_by_the_plan_match_reference(monkeypatch) -> None:
    """Items cut into calls of a small ladder (a video's frames over several calls, frames
    sharing a call with other items' frames, padding past a partly filled band tile), with
    the full-attention layer in several query tiles: each item's rows equal the reference's
    for it alone."""
    ref = _reference()
    spec = VisionEncoderSpec.from_hf(ref.config)
    model = build_model(lambda: VisionEncoder(spec, rngs=nnx.Rngs(0)), torch_state_items(ref), VISION_RULES)
    graphdef, state = nnx.split(model)
    monkeypatch.setattr(vision_encoder, "SCORE_ELEMENTS", 2 * 16 * spec.num_heads)  # 1 or 2 queries a tile
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(1)
    # a 3-frame video of 6x10 (windows cut at the right edge), a 2x2 image (one unit), a
    # 10x4 image, a 2-frame 4x4 video
    grids = [(3, 6, 10), (1, 2, 2), (1, 10, 4), (2, 4, 4)]
    patches = [random_patches(rng, g, spec.patch_dim) for g in grids]
    buckets = vision_token_buckets(spec, 64)
    assert buckets == (16, 32, 48, 64)
    calls = plan_vision_calls(grids, spec, buckets)
    assert any(len(c.pieces) > 1 for c in calls) and len({p.item for c in calls for p in c.pieces}) == 4
    assert sum(1 for c in calls for p in c.pieces if p.item == 0) > 1  # the video is cut
    assert 48 in {c.tokens for c in calls}  # a call of three band tiles
    rows: list[list[np.ndarray]] = [[] for _ in grids]
    for call in calls:
        pieces = [
            patches[p.item][p.first * g[1] * g[2] : (p.first + p.frames) * g[1] * g[2]]
            for p, g in ((p, grids[p.item]) for p in call.pieces)
        ]
        piece_grids = [(p.frames, *grids[p.item][1:]) for p in call.pieces]
        batch, split = prepare_vision_batch(pieces, piece_grids, spec, tokens=call.tokens)
        assert batch.patches.shape[0] == call.tokens
        for p, got in zip(call.pieces, split.split(np.asarray(encode(state, batch))), strict=True):
            rows[p.item].append(got)
    for p, g, got in zip(patches, grids, rows, strict=True):
        err = rel_err(np.concatenate(got), _reference_forward(ref, [p], [g]))
        print(f"grid {g}: rel err {err:.2e}")
        assert err < 1e-5, (g, err)


def test_a_merge_of_three_matches_reference() -> None:
    """``spatial_merge_size=3`` merges units of 9 tokens: the window layers' tile holds whole
    units (a power of two of tokens did not, and the first call failed with a reshape error)."""
    ref = _reference(spatial_merge_size=3, window_size=12)  # windows of 2x2 merged units = 36 tokens
    spec = VisionEncoderSpec.from_hf(ref.config)
    model = build_model(lambda: VisionEncoder(spec, rngs=nnx.Rngs(0)), torch_state_items(ref), VISION_RULES)
    graphdef, state = nnx.split(model)
    grids = [(1, 6, 9), (2, 3, 6)]
    patches = [random_patches(np.random.default_rng(2), g, spec.patch_dim) for g in grids]
    batch, rows = prepare_vision_batch(patches, grids, spec)
    got = np.concatenate(rows.split(np.asarray(CountedJit(graphdef)(state, batch))))
    assert rel_err(got, _reference_forward(ref, patches, grids)) < 1e-5
