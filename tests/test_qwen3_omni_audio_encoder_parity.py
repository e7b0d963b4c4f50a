"""The JAX audio encoder equals transformers' ``Qwen3OmniMoeAudioEncoder`` on ragged batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from parity import CountedJit, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_chunk_buckets, plan_audio_calls
from omni_jax.models.qwen3_omni.audio_encoder import (
    AUDIO_IGNORE,
    AUDIO_RULES,
    AudioEncoder,
    AudioEncoderSpec,
    audio_output_rows,
    prepare_audio_batch,
    reference_chunk_pad,
    window_pieces,
)
from omni_jax.testing import randomize_weights

MEL = 16
CHUNK = 100
"""Frames of a chunk: n_window must be 50 (transformers counts 13 tokens a chunk)."""

TOLERANCE = 1e-5


def _config(**overrides: int) -> Qwen3OmniMoeAudioEncoderConfig:
    fields = dict(
        num_mel_bins=MEL,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        d_model=32,
        n_window=CHUNK // 2,
        n_window_infer=2 * CHUNK,  # windows of two chunks
        output_dim=24,
        max_source_positions=64,
        downsample_hidden_size=8,
    )
    cfg = Qwen3OmniMoeAudioEncoderConfig(**{**fields, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module")
def reference() -> Qwen3OmniMoeAudioEncoder:
    torch.manual_seed(0)
    model = Qwen3OmniMoeAudioEncoder(_config()).eval()
    randomize_weights(model, 1.0)
    return model


@pytest.fixture(scope="module")
def encoder(reference: Qwen3OmniMoeAudioEncoder) -> tuple[AudioEncoderSpec, nnx.GraphDef, nnx.State]:
    spec = AudioEncoderSpec.from_hf(reference.config)
    model = build_model(
        lambda: AudioEncoder(spec, rngs=nnx.Rngs(0)),
        torch_state_items(reference),
        AUDIO_RULES,
        ignore=AUDIO_IGNORE,
    )
    graphdef, state = nnx.split(model)
    return spec, graphdef, state


def _reference_forward(model: Qwen3OmniMoeAudioEncoder, feats: list[np.ndarray]) -> np.ndarray:
    """The call ``Qwen3OmniMoeThinkerModel.get_audio_features`` makes: audios concatenated."""
    lens = torch.tensor([f.shape[1] for f in feats])
    with torch.no_grad():
        out = model(torch.from_numpy(np.concatenate(feats, axis=1)), feature_lens=lens)
    return out.last_hidden_state.numpy()


def _features(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [rng.standard_normal((MEL, n)).astype(np.float32) for n in lengths]


def test_audio_encoder_matches_reference_batched(reference, encoder) -> None:
    """One call over clips of five chunks (three windows, a tail), a chunk and a tail, exactly
    two chunks, and less than a chunk equals the reference's call over them, and each clip's
    rows, given its own padding, equal the reference's for it alone, in this call and alone."""
    spec, graphdef, state = encoder
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(0)
    lengths = [5 * CHUNK + 37, CHUNK + 30, 2 * CHUNK, 60]
    feats = _features(rng, lengths)

    batch, rows = prepare_audio_batch(feats, spec)
    assert batch.features.shape[0] == 16  # 10 chunks in the power-of-two bucket
    per_clip = rows.split(np.asarray(encode(state, batch)))
    want = _reference_forward(reference, feats)
    assert rows.total == want.shape[0]
    err = rel_err(np.concatenate(per_clip), want)
    print(f"batched rel err {err:.2e} (max |ref| {np.abs(want).max():.2f})")
    assert err < TOLERANCE, err

    alone = [_reference_forward(reference, [f]) for f in feats]
    assert list(rows.lengths) == [len(a) for a in alone] == [audio_output_rows(n, spec) for n in lengths]
    pads = [reference_chunk_pad([n], spec) for n in lengths]
    mixed, mixed_rows = prepare_audio_batch(feats, spec, pad_frames=pads)
    for f, pad, got, ref in zip(
        feats, pads, mixed_rows.split(np.asarray(encode(state, mixed))), alone, strict=True
    ):
        assert rel_err(got, ref) < TOLERANCE
        single, single_rows = prepare_audio_batch([f], spec, min_chunks=16, pad_frames=[pad])
        assert rel_err(single_rows.split(np.asarray(encode(state, single)))[0], ref) < TOLERANCE
    assert encode.traces == 1


def test_short_clips_keep_the_reference_padding(reference, encoder) -> None:
    """Clips all shorter than a chunk: the reference pads them to the longest, and its last tokens
    show it; the default padding reproduces the call, a per-clip one each clip alone."""
    spec, graphdef, state = encoder
    encode = CountedJit(graphdef)
    feats = _features(np.random.default_rng(1), [60, 37])
    batch, rows = prepare_audio_batch(feats, spec)
    assert list(batch.chunk_pads[:2]) == [60, 60]
    want = _reference_forward(reference, feats)
    err = rel_err(np.concatenate(rows.split(np.asarray(encode(state, batch)))), want)
    print(f"short clips rel err {err:.2e}")
    assert err < TOLERANCE, err

    short, short_rows = prepare_audio_batch(feats[1:], spec, pad_frames=[37])
    got = short_rows.split(np.asarray(encode(state, short)))[0]
    alone = _reference_forward(reference, feats[1:])
    assert rel_err(got, alone) < TOLERANCE
    assert rel_err(got, want[len(rows.split(want)[0]) :]) > 100 * TOLERANCE  # the padding matters


def test_clips_cut_into_calls_match_reference(reference, encoder) -> None:
    """Clips cut into calls by the shared planner: each clip's rows equal the reference's for it
    alone."""
    spec, graphdef, state = encoder
    encode = CountedJit(graphdef)
    lengths = [3 * CHUNK + 1, 5, CHUNK, 4 * CHUNK, 2 * CHUNK - 1]  # 4, 1, 1, 4, 2 chunks
    feats = _features(np.random.default_rng(2), lengths)
    buckets = audio_chunk_buckets(4 * CHUNK, spec)
    assert buckets == (1, 2, 4)
    calls = plan_audio_calls(lengths, spec, buckets)
    assert [(c.start, c.stop, c.size) for c in calls] == [(0, 1, 4), (1, 3, 2), (3, 4, 4), (4, 5, 2)]
    got = []
    for call in calls:
        clips = feats[call.start : call.stop]
        pads = [reference_chunk_pad([f.shape[1]], spec) for f in clips]
        batch, rows = prepare_audio_batch(clips, spec, min_chunks=call.size, pad_frames=pads)
        assert batch.features.shape[0] == call.size
        got += rows.split(np.asarray(encode(state, batch)))
    for f, rows in zip(feats, got, strict=True):
        err = rel_err(rows, _reference_forward(reference, [f]))
        print(f"{f.shape[1]} frames: rel err {err:.2e}")
        assert err < TOLERANCE, (f.shape, err)


def test_a_clip_longer_than_the_largest_call_is_encoded_in_pieces(reference, encoder) -> None:
    """A clip of nine chunks and a tail, past calls of at most four chunks (windows of two), cut
    at window edges into pieces of four, four and one and a tail chunks, each encoded as a clip
    of its own with the clip's chunk pad, in the calls the planner cuts them into beside a short
    clip of the same reference call: the pieces' rows, in order, equal the reference's rows of
    the whole clip in that call. A cut inside a window (three chunks) does not."""
    spec, graphdef, state = encoder
    encode = CountedJit(graphdef)
    lengths = [9 * CHUNK + 37, 60]
    feats = _features(np.random.default_rng(3), lengths)
    buckets = (1, 2, 4)
    pieces = [window_pieces(n, spec, buckets[-1]) for n in lengths]
    assert pieces == [[(0, 4 * CHUNK), (4 * CHUNK, 8 * CHUNK), (8 * CHUNK, lengths[0])], [(0, 60)]]
    items = [(c, a, b) for c, cut in enumerate(pieces) for a, b in cut]
    pad = reference_chunk_pad(lengths, spec)  # the reference call's longest chunk: a whole one
    rows: list[list[np.ndarray]] = [[], []]
    for call in plan_audio_calls([b - a for _, a, b in items], spec, buckets):
        part = items[call.start : call.stop]
        batch, split = prepare_audio_batch(
            [feats[c][:, a:b] for c, a, b in part], spec, min_chunks=call.size, pad_frames=[pad] * len(part)
        )
        assert batch.features.shape[0] == call.size <= buckets[-1]
        for (c, _, _), got in zip(part, split.split(np.asarray(encode(state, batch))), strict=True):
            rows[c].append(got)
    want = _reference_forward(reference, feats)
    got = np.concatenate([np.concatenate(r) for r in rows])
    assert got.shape == want.shape == (sum(audio_output_rows(n, spec) for n in lengths), 24)
    err = rel_err(got, want)
    print(f"pieces rel err {err:.2e}")
    assert err < TOLERANCE, err

    inside = [feats[0][:, : 3 * CHUNK], feats[0][:, 3 * CHUNK :]]  # a window cut in two
    batch, split = prepare_audio_batch(inside, spec, min_chunks=16, pad_frames=[pad, pad])
    cut = np.concatenate(split.split(np.asarray(encode(state, batch))))
    assert rel_err(cut, want[: cut.shape[0]]) > 100 * TOLERANCE


def test_spec_refuses_what_the_reference_miscounts() -> None:
    with pytest.raises(ValueError, match="transformers counts 13"):
        AudioEncoderSpec.from_hf(_config(n_window=4))
    with pytest.raises(ValueError, match="at least a chunk"):
        AudioEncoderSpec.from_hf(_config(n_window_infer=CHUNK - 1))
