"""Parity of Qwen3-Omni's code2wav (sliding-window transformer + causal ConvNet) with transformers.

A tiny random-weight ``Qwen3OmniMoeCode2Wav``, float32, eager attention. Its sliding window (5) is
shorter than the code lengths, so the window's mask is exercised (full causal attention instead
is off by 0.11), and it has grouped KV heads.
Relative error is ``max|ours - ref| / max|ref|``.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omni_jax.jit import StaticGraph
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.param_map import ParamMismatchError
from omni_jax.models.qwen2_5_omni.bigvgan import SIN_SWITCH, sin_form
from omni_jax.models.qwen3_omni.code2wav import (
    CODE2WAV_IGNORE,
    CODE2WAV_RULES,
    Code2Wav,
    Code2WavSpec,
    chunk_windows,
    chunked_decode,
    code2wav_chunk_compiled,
    code2wav_compiled,
)
from omni_jax.testing import randomize_weights

CONFIG = dict(
    codebook_size=16,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=5,
    intermediate_size=48,
    num_hidden_layers=2,
    num_quantizers=3,
    upsample_rates=(3, 2),
    upsampling_ratios=(2, 2),
    decoder_dim=16,
    max_position_embeddings=256,
)
HOP = 3 * 2 * 2 * 2
SHORTFALL = 3 * 2 + 2  # each decoder block's transposed conv loses `rate` samples at its rate
CHUNK, LEFT = 5, 3
WINDOW = CHUNK + LEFT


@pytest.fixture(scope="module")
def reference() -> Qwen3OmniMoeCode2Wav:
    torch.manual_seed(0)
    config = Qwen3OmniMoeCode2WavConfig(**CONFIG)
    config._attn_implementation = "eager"
    model = Qwen3OmniMoeCode2Wav(config).float().eval()
    randomize_weights(model, 1.0)
    # The ConvNet decoder at scale 1 saturates the output clamp (80% of samples at +-1), which
    # would hide errors; at 0.6 no sample reaches it (checked in test_decode_matches_forward).
    randomize_weights(model.decoder, 0.6)
    return model


@pytest.fixture(scope="module")
def ours(reference: Qwen3OmniMoeCode2Wav) -> tuple[StaticGraph, nnx.State]:
    spec = Code2WavSpec.from_hf(reference.config)
    model = build_model(
        lambda: Code2Wav(spec, rngs=nnx.Rngs(0)),
        torch_state_items(reference),
        CODE2WAV_RULES,
        ignore=CODE2WAV_IGNORE,
    )
    graphdef, state = nnx.split(model)
    return StaticGraph(graphdef), state


def random_codes(seed: int, rows: int, frames: int) -> np.ndarray:
    return (
        np.random.default_rng(seed).integers(0, CONFIG["codebook_size"], (rows, 3, frames)).astype(np.int32)
    )


def forward(reference: Qwen3OmniMoeCode2Wav, codes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.from_numpy(codes).long())[:, 0].numpy()


def test_every_tensor_is_mapped(reference: Qwen3OmniMoeCode2Wav) -> None:
    """The rules take every tensor of the state dict and fill every parameter (``build_model``
    refuses a stray tensor or an unfilled parameter, as the two edits below show)."""
    spec = Code2WavSpec.from_hf(reference.config)
    items = list(torch_state_items(reference))
    assert spec.total_upsample == HOP == int(reference.total_upsample)
    assert spec.sample_shortfall == SHORTFALL
    ctor = lambda: Code2Wav(spec, rngs=nnx.Rngs(0))
    model = build_model(ctor, items, CODE2WAV_RULES)
    assert len(nnx.to_flat_state(nnx.state(model, nnx.Param))) == len(items)
    stray = ("pre_transformer.embed_tokens.weight", np.zeros((4, 32), np.float32))
    with pytest.raises(ParamMismatchError, match="unexpected tensor 'pre_transformer.embed_tokens.weight'"):
        build_model(ctor, items + [stray], CODE2WAV_RULES)
    with pytest.raises(ParamMismatchError, match="'decoder.9.alpha', which the model does not have"):
        build_model(ctor, items + [("decoder.9.alpha", np.zeros(4, np.float32))], CODE2WAV_RULES)
    with pytest.raises(ParamMismatchError, match="missing parameters: upsample.1.1.gamma"):
        build_model(ctor, [(n, a) for n, a in items if n != "upsample.1.1.gamma"], CODE2WAV_RULES)


@pytest.fixture
def sin_form_of(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    """SnakeBeta's ``sin^2`` traced in the form the fixture's parameter names, in programs of its
    own (the whole decode's jit cache emptied before and after)."""
    monkeypatch.setenv(SIN_SWITCH, request.param)
    code2wav_compiled.clear_cache()
    yield request.param
    code2wav_compiled.clear_cache()


@pytest.mark.parametrize("sin_form_of", ["series", "native"], indirect=True)
def test_decode_matches_forward(
    reference: Qwen3OmniMoeCode2Wav, ours: tuple[StaticGraph, nnx.State], sin_form_of: str
) -> None:
    """Whole decode of a ragged batch, in both forms of SnakeBeta's ``sin^2`` (the series a CPU
    runs by default, ``jnp.sin`` an accelerator runs): each row equals
    ``Qwen3OmniMoeCode2Wav.forward`` on that row alone (measured with the series: rel err
    8.0e-7, 6.5e-7); padding (random codes) is silent."""
    assert sin_form() == sin_form_of
    lengths = [17, 11]
    codes = random_codes(1, 2, max(lengths))
    wave, samples = code2wav_compiled(*ours, jnp.asarray(codes), jnp.asarray(lengths, jnp.int32))
    wave = np.asarray(wave)
    for i, n in enumerate(lengths):
        want = forward(reference, codes[i : i + 1, :, :n])[0]
        assert int(samples[i]) == len(want) == n * HOP - SHORTFALL
        assert np.abs(want).max() < 1.0, "test model saturates the clamp"
        err = rel_err(wave[i, : len(want)], want)
        assert err < 1e-5, (i, err)
        assert not np.any(wave[i, len(want) :]), "padding must be silent"


def test_chunked_decode_matches_reference(
    reference: Qwen3OmniMoeCode2Wav, ours: tuple[StaticGraph, nnx.State]
) -> None:
    """``chunked_decode`` over 5 windows (contexts 0, 3, 3, 3, 3; a short last chunk) equals
    transformers' (measured: rel err 6.6e-7); its samples are fewer than a whole decode's, as the
    reference's: each chunk loses the shortfall at its end."""
    codes = random_codes(3, 2, 23)
    assert [(w.context, w.frames) for w in chunk_windows(23, CHUNK, LEFT)] == [
        (0, 5),
        (3, 8),
        (3, 8),
        (3, 8),
        (3, 6),
    ]
    with torch.no_grad():
        want = reference.chunked_decode(torch.from_numpy(codes).long(), CHUNK, LEFT)[:, 0].numpy()
    got = chunked_decode(*ours, codes, CHUNK, LEFT)
    assert got.shape == want.shape == (2, 23 * HOP - 5 * SHORTFALL)
    err = rel_err(got, want)
    assert err < 1e-5, err


@pytest.mark.parametrize("join", [False, True], ids=["as chunked_decode", "joined"])
def test_chunk_rows_are_batch_invariant(
    reference: Qwen3OmniMoeCode2Wav, ours: tuple[StaticGraph, nnx.State], join: bool
) -> None:
    """Rows of different requests and chunk kinds (first, middle, short last, an empty padding
    row) in one call equal each row alone and the reference on the row's unpadded window: right
    padding (random codes here) changes no valid sample. One program serves every mix, trimmed as
    ``chunked_decode`` trims or joined (a row with context also keeps the samples its predecessor
    fell short by). Measured (CPU): rows against the reference at most 7.6e-7, batched against
    alone 2.4e-7 absolute (another row count, other XLA kernels), rows reordered bit-identical."""
    rows = [(0, 5), (3, 8), (3, 4), (2, 6), (0, 0)]  # (context, frames)
    codes = random_codes(4, len(rows), WINDOW)
    context, frames = (jnp.asarray(column, jnp.int32) for column in zip(*rows, strict=True))
    before = code2wav_chunk_compiled._cache_size()
    wave, kept = code2wav_chunk_compiled(*ours, jnp.asarray(codes), context, frames, join=join)
    wave = np.asarray(wave)
    for i, (c, f) in enumerate(rows):
        alone, alone_kept = code2wav_chunk_compiled(
            *ours, jnp.asarray(codes[i : i + 1]), context[i : i + 1], frames[i : i + 1], join=join
        )
        lead = SHORTFALL if join and c else 0
        n = int(kept[i])
        assert n == int(alone_kept[0]) == (max(f - c, 0) * HOP - SHORTFALL + lead if f > c else 0)
        assert not np.any(wave[i, n:]), "samples past a row's count must be zero"
        if f == 0:
            continue
        want = forward(reference, codes[i : i + 1, :, :f])[0][c * HOP - lead :]
        assert n == len(want)
        assert rel_err(wave[i, :n], np.asarray(alone[0, :n])) < 1e-6, i
        err = rel_err(wave[i, :n], want)
        assert err < 1e-5, (i, err)
    swapped, _ = code2wav_chunk_compiled(
        *ours, jnp.asarray(codes[::-1].copy()), context[::-1], frames[::-1], join=join
    )
    assert rel_err(np.asarray(swapped)[::-1], wave) < 1e-6
    assert code2wav_chunk_compiled._cache_size() == before + 2  # the batch of 5, the row alone
