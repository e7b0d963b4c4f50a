"""The JAX vision encoder equals transformers' ``Qwen3OmniMoeVisionEncoder`` (merged rows and every
deepstack feature) on ragged batches of images and videos."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from parity import CountedJit, random_patches, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2_5_omni import vision_encoder as qwen2_5_vision
from omni_jax.models.qwen2_5_omni.audio_encoder import RowSplit
from omni_jax.models.qwen2_5_omni.vision_encoder import plan_vision_calls, vision_token_buckets
from omni_jax.models.qwen3_omni.vision_encoder import (
    VISION_IGNORE,
    VISION_RULES,
    VisionEncoder,
    VisionEncoderSpec,
    prepare_vision_batch,
)
from omni_jax.testing import randomize_weights

TOLERANCE = 1e-5

Features = list[np.ndarray]
"""An encoder's outputs for some items: the merged rows, then each deepstack feature's rows."""


def _reference_model(**changes: Any) -> Qwen3OmniMoeVisionEncoder:
    torch.manual_seed(0)
    sizes: dict[str, Any] = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=40,
        num_position_embeddings=25,  # a 5x5 grid, resampled up and down to the frames
        deepstack_visual_indexes=[0, 2],
    )
    cfg = Qwen3OmniMoeVisionEncoderConfig(**{**sizes, **changes})
    cfg._attn_implementation = "eager"
    model = Qwen3OmniMoeVisionEncoder(cfg).eval()
    randomize_weights(model, 1.0)
    return model


def _ours_of(reference: Qwen3OmniMoeVisionEncoder) -> tuple[VisionEncoderSpec, nnx.GraphDef, nnx.State]:
    spec = VisionEncoderSpec.from_hf(reference.config)
    model = build_model(
        lambda: VisionEncoder(spec, rngs=nnx.Rngs(0)),
        torch_state_items(reference),
        VISION_RULES,
        ignore=VISION_IGNORE,
    )
    graphdef, state = nnx.split(model)
    return spec, graphdef, state


@pytest.fixture(scope="module")
def reference() -> Qwen3OmniMoeVisionEncoder:
    return _reference_model()


@pytest.fixture(scope="module")
def encoder(reference: Qwen3OmniMoeVisionEncoder) -> tuple[VisionEncoderSpec, nnx.GraphDef, nnx.State]:
    return _ours_of(reference)


def _reference_forward(
    model: Qwen3OmniMoeVisionEncoder, patches: list[np.ndarray], grids: list[tuple[int, int, int]]
) -> Features:
    """The call ``get_image_features`` / ``get_video_features`` make: ``visual(pixels, grid_thw=...)``."""
    with torch.no_grad():
        out = model(torch.from_numpy(np.concatenate(patches)), grid_thw=torch.tensor(grids))
    return [out.pooler_output.numpy(), *(f.numpy() for f in out.deepstack_features)]


def _ours(encoded: tuple[jax.Array, tuple[jax.Array, ...]]) -> Features:
    rows, deepstack = encoded
    return [np.asarray(rows), *(np.asarray(f) for f in deepstack)]


def _per_item(features: Features, split: RowSplit) -> list[Features]:
    """Each item's rows of every output, item by item."""
    return [list(item) for item in zip(*(split.split(f) for f in features), strict=True)]


def _err(got: Features, want: Features) -> float:
    assert len(got) == len(want) == 3  # the merged rows and two deepstack features
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
    return max(rel_err(g, w) for g, w in zip(got, want, strict=True))


def test_vision_encoder_matches_reference_batched(reference, encoder) -> None:
    """Two images of different grids and a video in one call equal the reference's call over
    them, and each item alone; another batch of the same call size compiles nothing."""
    spec, graphdef, state = encoder
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(0)
    # an image larger than the 5x5 position grid, one smaller, a 2-frame video
    grids = [(1, 6, 8), (1, 4, 2), (2, 4, 6)]
    patches = [random_patches(rng, g, spec.patch_dim) for g in grids]

    batch, split = prepare_vision_batch(patches, grids, spec)
    assert batch.patches.shape[0] == 128
    got = _ours(encode(state, batch))
    err = _err([f[: split.total] for f in got], _reference_forward(reference, patches, grids))
    print(f"batched rel err {err:.2e}")
    assert err < TOLERANCE, err
    for p, g, item in zip(patches, grids, _per_item(got, split), strict=True):
        alone = _reference_forward(reference, [p], [g])
        assert _err(item, alone) < TOLERANCE
        single, single_split = prepare_vision_batch([p], [g], spec, tokens=128)
        assert _err(_per_item(_ours(encode(state, single)), single_split)[0], alone) < TOLERANCE

    grids2 = [(1, 8, 8), (3, 2, 4), (1, 6, 6)]
    patches2 = [random_patches(rng, g, spec.patch_dim) for g in grids2]
    batch2, split2 = prepare_vision_batch(patches2, grids2, spec)
    assert jax.tree.map(np.shape, batch2) == jax.tree.map(np.shape, batch)
    for p, g, item in zip(patches2, grids2, _per_item(_ours(encode(state, batch2)), split2), strict=True):
        assert _err(item, _reference_forward(reference, [p], [g])) < TOLERANCE
    assert encode.traces == 1


def test_calls_cut_by_the_plan_match_reference(reference, encoder, monkeypatch) -> None:
    """Items cut into calls by the shared planner (a video's frames over several calls, frames of
    different items sharing a call, padded calls), with every layer's attention in several query
    tiles: each item's rows equal the reference's for it alone."""
    spec, graphdef, state = encoder
    monkeypatch.setattr(qwen2_5_vision, "SCORE_ELEMENTS", 16 * 64 * spec.num_heads)  # 16-query tiles
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(1)
    grids = [(3, 6, 10), (1, 2, 2), (1, 10, 4), (2, 4, 4)]
    patches = [random_patches(rng, g, spec.patch_dim) for g in grids]
    buckets = vision_token_buckets(spec, 60)
    assert buckets == (64,)
    calls = plan_vision_calls(grids, spec, buckets)
    assert any(len(c.pieces) > 1 for c in calls)
    assert sum(1 for c in calls for p in c.pieces if p.item == 0) == 3  # the video is cut
    outputs: list[list[Features]] = [[] for _ in grids]
    for call in calls:
        frames = [h * w for _, h, w in (grids[p.item] for p in call.pieces)]
        pieces = [
            patches[p.item][p.first * n : (p.first + p.frames) * n]
            for p, n in zip(call.pieces, frames, strict=True)
        ]
        piece_grids = [(p.frames, *grids[p.item][1:]) for p in call.pieces]
        batch, split = prepare_vision_batch(pieces, piece_grids, spec, tokens=call.tokens)
        for p, item in zip(call.pieces, _per_item(_ours(encode(state, batch)), split), strict=True):
            outputs[p.item].append(item)
    for p, g, parts in zip(patches, grids, outputs, strict=True):
        got = [np.concatenate(f) for f in zip(*parts, strict=True)]
        err = _err(got, _reference_forward(reference, [p], [g]))
        print(f"grid {g}: rel err {err:.2e}")
        assert err < TOLERANCE, (g, err)


def test_a_merge_of_three_matches_reference() -> None:
    """``spatial_merge_size=3`` merges units of 9 tokens: the calls hold whole units (they were
    powers of two, and the first call failed: "a call of 256 tokens cannot hold 234")."""
    ref = _reference_model(spatial_merge_size=3)
    spec, graphdef, state = _ours_of(ref)
    grids = [(1, 6, 9), (2, 3, 6)]
    patches = [random_patches(np.random.default_rng(2), g, spec.patch_dim) for g in grids]
    batch, split = prepare_vision_batch(patches, grids, spec)
    got = _ours(CountedJit(graphdef)(state, batch))
    assert _err([f[: split.total] for f in got], _reference_forward(ref, patches, grids)) < TOLERANCE
