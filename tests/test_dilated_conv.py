"""Dilated convolutions split into phases (:mod:`omni_jax.models.dilated_conv`): the split is the
same convolution, alone and in both code2wav models (their programs under
``OMNI_JAX_DILATED_CONV=phased`` give the default's outputs); the switch reaches only what it may
split; ``benchmarks.dilated_conv`` (a GPU session's check) finds every dilated convolution of both
families' programs and times both forms."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig

from benchmarks import dilated_conv as bench
from omni_jax.jit import exact_matmuls
from omni_jax.models import dilated_conv
from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, token2wav
from omni_jax.models.qwen3_omni.code2wav import Code2Wav
from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec
from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG
from omni_jax.testing_qwen3_omni import build_qwen3_omni_tokenizer, tiny_qwen3_omni_config


@pytest.mark.parametrize(
    ("width", "taps", "padding", "dilation"),
    [
        (37, 5, (8, 8), 2),  # BigVGAN's "same" padding
        (40, 7, (54, 0), 9),  # Qwen3-Omni's causal padding, the input shorter than the kernel's reach
        (23, 3, (1, 6), 5),  # uneven padding
        (30, 3, (0, 0), 4),  # the DiT's VALID
    ],
)
def test_phased_is_the_dilated_convolution(
    width: int, taps: int, padding: tuple[int, int], dilation: int
) -> None:
    """Equal within float32 summation's bound, ``2 n eps sum |x w|`` over each output's ``n``
    products, whatever order either form adds them in (bit-equal on XLA's CPU backend)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, width, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((taps, 3, 4)), jnp.float32)

    def direct(x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(
            x,
            w,
            (1,),
            (padding,),
            rhs_dilation=(dilation,),
            dimension_numbers=dilated_conv.FLAX_1D,
            precision=lax.Precision.HIGHEST,
        )

    phased = dilated_conv.phased_conv(x, w, padding, dilation, lax.Precision.HIGHEST)
    assert phased.shape == direct(x, w).shape
    bound = 2 * taps * 3 * np.finfo(np.float32).eps * np.asarray(direct(jnp.abs(x), jnp.abs(w)))
    assert np.all(np.abs(np.asarray(phased) - np.asarray(direct(x, w))) <= bound)


def test_the_switch_splits_only_ungrouped_dilated_convolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: split on GPUs, as written elsewhere; a named form on any backend; only dilated,
    ungrouped convolutions are split; an unknown form is refused."""
    calls: list[int] = []
    split = dilated_conv.phased_conv
    monkeypatch.setattr(dilated_conv, "phased_conv", lambda *a, **k: calls.append(a[3]) or split(*a, **k))
    x = jnp.ones((1, 20, 4), jnp.float32)

    def conv(dilation: int, groups: int = 1) -> jax.Array:
        layer = nnx.Conv(
            4,
            4,
            3,
            padding=((dilation, dilation),),
            kernel_dilation=dilation,
            feature_group_count=groups,
            conv_general_dilated=dilated_conv.conv_general_dilated,
            rngs=nnx.Rngs(0),
        )
        return layer(x)

    monkeypatch.delenv(dilated_conv.DILATED_SWITCH, raising=False)
    backend = jax.default_backend
    for platform, splits in (("cpu", []), ("tpu", []), ("gpu", [3])):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        calls.clear()
        conv(3)
        assert calls == splits  # the platform's default: phased on GPUs, direct elsewhere
    monkeypatch.setenv(dilated_conv.DILATED_SWITCH, "direct")
    calls.clear()
    conv(3)
    assert calls == []  # named, on a GPU too
    monkeypatch.setattr(jax, "default_backend", backend)
    monkeypatch.setenv(dilated_conv.DILATED_SWITCH, "phased")
    conv(3), conv(1), conv(3, groups=2)
    assert calls == [3]  # undilated and grouped convolutions stay as they are
    monkeypatch.setenv(dilated_conv.DILATED_SWITCH, "strided")
    with pytest.raises(ValueError, match="OMNI_JAX_DILATED_CONV='strided'"):
        conv(3)


def _token2wav_program() -> tuple[Callable[[], Callable[..., tuple[jax.Array, jax.Array]]], tuple]:
    config = Qwen2_5OmniToken2WavConfig(dit_config=TINY_DIT_CONFIG, bigvgan_config=TINY_BIGVGAN_CONFIG)
    graph, state = nnx.split(Token2Wav(config, rngs=nnx.Rngs(0)))
    dit = config.dit_config
    rng = np.random.default_rng(1)
    rows, codes, ref = 2, 16, 40
    inputs = (
        jnp.asarray(rng.integers(0, dit.num_embeds, (rows, codes)), jnp.int32),
        jnp.asarray([codes, codes - 5], jnp.int32),
        jnp.asarray(rng.standard_normal((rows, dit.enc_emb_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((rows, ref, dit.mel_dim)), jnp.float32),
        jnp.asarray([ref, ref - 9], jnp.int32),
        jnp.asarray(rng.standard_normal((rows, codes * dit.repeats, dit.mel_dim)), jnp.float32),
    )

    def program() -> Callable[..., tuple[jax.Array, jax.Array]]:
        return jax.jit(lambda s, *xs: token2wav(nnx.merge(graph, s), *xs))

    return program, (state, *inputs)


def _qwen3_code2wav_program() -> tuple[Callable[[], Callable[..., tuple[jax.Array, jax.Array]]], tuple]:
    spec = Code2WavSpec.from_hf(tiny_qwen3_omni_config(build_qwen3_omni_tokenizer()).code2wav_config)
    graph, state = nnx.split(Code2Wav(spec, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    codes = jnp.asarray(rng.integers(0, spec.codebook_size, (2, spec.num_quantizers, 12)), jnp.int32)

    def program() -> Callable[..., tuple[jax.Array, jax.Array]]:
        return jax.jit(lambda s, c, f: nnx.merge(graph, s)(c, f))

    return program, (state, codes, jnp.asarray([12, 7], jnp.int32))


@pytest.mark.parametrize(
    "build", [_token2wav_program, _qwen3_code2wav_program], ids=["qwen2_5_omni", "qwen3_omni"]
)
def test_code2wav_phased_equals_direct(build: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each form traced into a program of its own (the switch is read when a program is traced)."""
    splits: list[int] = []
    split = dilated_conv.phased_conv
    monkeypatch.setattr(dilated_conv, "phased_conv", lambda *a, **k: splits.append(a[3]) or split(*a, **k))
    program, args = build()
    with exact_matmuls(jnp.float32):
        wave, samples = program()(*args)
        assert splits == []
        monkeypatch.setenv(dilated_conv.DILATED_SWITCH, "phased")
        phased_wave, phased_samples = program()(*args)
    assert splits and min(splits) > 1  # the dilated convolutions were split, only they
    np.testing.assert_array_equal(np.asarray(phased_samples), np.asarray(samples))
    scale = float(jnp.max(jnp.abs(wave)))
    assert scale > 0  # the code2wav parity tests' bound: rounding through the whole program
    assert float(jnp.max(jnp.abs(phased_wave - wave))) <= 1e-5 * scale


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_dilated_conv_times_every_dilated_convolution(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dilated_conv.DILATED_SWITCH, "phased")  # the benchmark reads the default's program
    out = tmp_path / "dilated.json"
    argv = ["--family", family, "--tiny", "--codes", "16", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    if family == "qwen3_omni":  # the residual units' dilations 3 and 9 (1 is undilated), 7 taps
        assert {r["dilation"] for r in rows} == {3, 9} and all(r["taps"] == 7 for r in rows)
    else:  # BigVGAN's 3 and 5 at both kernel sizes, the DiT speaker encoder's 2, 3 and 4
        assert {(r["taps"], r["dilation"]) for r in rows} >= {(3, 3), (3, 5), (5, 3), (5, 5), (3, 2)}
    for r in rows:
        assert r["rel_diff"] <= 1e-6
        assert r["direct_compile_s"] > 0 and r["phased_ms"] > 0 and r["count"] >= 1


def test_padded_kernel_is_the_kernel_with_its_taps_dilated() -> None:
    conv = bench.DilatedConv((1, 30, 4), (7, 4, 6), "float32", ((54, 0),), (9,), dilated_conv.FLAX_1D, None)
    assert bench.padded_kernel("%k = f32[6,4,55]{0,1,2} transpose(...)", conv)
    assert not bench.padded_kernel("%k = f32[7,4,6]{2,1,0} parameter(1)", conv)
