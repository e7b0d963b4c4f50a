"""The JAX audio encoder equals transformers' ``Qwen2_5OmniAudioEncoder`` on a ragged batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from parity import CountedJit, rel_err
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2_5_omni.audio_encoder import (
    AUDIO_IGNORE,
    AUDIO_RULES,
    AudioEncoder,
    AudioEncoderSpec,
    audio_chunk_buckets,
    plan_audio_calls,
    prepare_audio_batch,
)


def _reference(n_window: int) -> Qwen2_5OmniAudioEncoder:
    torch.manual_seed(0)
    cfg = Qwen2_5OmniAudioEncoderConfig(
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        d_model=32,
        n_window=n_window,
        output_dim=24,
        max_source_positions=64,
    )
    cfg._attn_implementation = "eager"
    return Qwen2_5OmniAudioEncoder(cfg).eval()


def _reference_forward(model: Qwen2_5OmniAudioEncoder, feats: list[np.ndarray]) -> np.ndarray:
    """The call ``Qwen2_5OmniThinkerModel.get_audio_features`` makes: audios concatenated."""
    lens = torch.tensor([f.shape[1] for f in feats])
    after_cnn, _ = model._get_feat_extract_output_lengths(lens)
    flat = torch.from_numpy(np.concatenate(feats, axis=1))
    with torch.no_grad():
        out = model(flat, feature_lens=lens, aftercnn_lens=after_cnn)
    return out.last_hidden_state.numpy()


@pytest.mark.parametrize("n_window", [4, 3])
def test_audio_encoder_matches_reference_batched(n_window: int) -> None:
    ref = _reference(n_window)
    spec = AudioEncoderSpec.from_hf(ref.config)
    model = build_model(
        lambda: AudioEncoder(spec, rngs=nnx.Rngs(0)), torch_state_items(ref), AUDIO_RULES, ignore=AUDIO_IGNORE
    )
    graphdef, state = nnx.split(model)
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(0)
    chunk = 2 * n_window
    # longer than two chunks with a tail, shorter than a chunk, exactly two chunks
    lengths = [2 * chunk + 5, chunk - 2, 2 * chunk]
    feats = [rng.standard_normal((16, n)).astype(np.float32) for n in lengths]

    batch, rows = prepare_audio_batch(feats, spec)
    out = np.asarray(encode(state, batch))
    per_request = rows.split(out)

    want = _reference_forward(ref, feats)
    assert rows.total == want.shape[0]
    np.testing.assert_array_equal(rows.lengths, [_reference_forward(ref, [f]).shape[0] for f in feats])
    err = rel_err(np.concatenate(per_request), want)
    print(f"n_window={n_window}: batched rel err {err:.2e}")
    assert err < 1e-5, err
    for f, got in zip(feats, per_request, strict=True):
        alone = _reference_forward(ref, [f])
        assert rel_err(got, alone) < 1e-5
        single, single_rows = prepare_audio_batch([f], spec, min_chunks=batch.chunk_lens.shape[0])
        assert rel_err(single_rows.split(np.asarray(encode(state, single)))[0], alone) < 1e-5

    # a different batch in the same chunk bucket reuses the compiled function
    other = [rng.standard_normal((16, n)).astype(np.float32) for n in (chunk + 1, 3 * chunk - 1)]
    batch2, rows2 = prepare_audio_batch(other, spec, min_chunks=batch.chunk_lens.shape[0])
    out2 = rows2.split(np.asarray(encode(state, batch2)))
    for f, got in zip(other, out2, strict=True):
        assert rel_err(got, _reference_forward(ref, [f])) < 1e-5
    assert encode.traces == 1


def test_clips_cut_into_calls_match_reference() -> None:
    """Clips admitted together are cut into calls of at most the largest chunk bucket; each
    call's rows, split per clip, equal the reference's for the clip alone."""
    ref = _reference(4)
    spec = AudioEncoderSpec.from_hf(ref.config)
    model = build_model(
        lambda: AudioEncoder(spec, rngs=nnx.Rngs(0)), torch_state_items(ref), AUDIO_RULES, ignore=AUDIO_IGNORE
    )
    graphdef, state = nnx.split(model)
    encode = CountedJit(graphdef)
    rng = np.random.default_rng(1)
    chunk = spec.chunk_frames
    lengths = [3 * chunk + 1, 5, chunk, 4 * chunk, 2 * chunk - 1]  # 4, 1, 1, 4, 2 chunks
    feats = [rng.standard_normal((16, n)).astype(np.float32) for n in lengths]
    buckets = audio_chunk_buckets(4 * chunk, spec)
    assert buckets == (1, 2, 4)
    calls = plan_audio_calls(lengths, spec, buckets)
    assert [(c.start, c.stop, c.size) for c in calls] == [(0, 1, 4), (1, 3, 2), (3, 4, 4), (4, 5, 2)]
    got = []
    for call in calls:
        batch, rows = prepare_audio_batch(feats[call.start : call.stop], spec, min_chunks=call.size)
        assert batch.chunk_lens.shape == (call.size,)
        got += rows.split(np.asarray(encode(state, batch)))
    for f, rows in zip(feats, got, strict=True):
        assert rel_err(rows, _reference_forward(ref, [f])) < 1e-5
