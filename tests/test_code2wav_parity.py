"""Parity of the code2wav stage (DiT flow matching + BigVGAN) with transformers' Qwen2.5-Omni.

Tiny random-weight models from shrunken configs, float32. Relative error is
``max|ours - ref| / max|ref|``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import compiled, rel_err
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniBigVGANConfig,
    Qwen2_5OmniDiTConfig,
    Qwen2_5OmniToken2WavConfig,
)
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniToken2WavModel,
    kaiser_sinc_filter1d,
)

from omni_jax.jit import StaticGraph
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.param_map import conv_transpose1d_kernel
from omni_jax.models.qwen2_5_omni.bigvgan import (
    BIGVGAN_RULES,
    SIN_SWITCH,
    BigVGAN,
    kaiser_sinc_filter,
    sin_form,
)
from omni_jax.models.qwen2_5_omni.dit import DIT_RULES, DiT
from omni_jax.models.qwen2_5_omni.token2wav import (
    MIN_GUIDANCE,
    TOKEN2WAV_IGNORE,
    TOKEN2WAV_RULES,
    Token2Wav,
    sample_mel,
    token2wav_compiled,
)
from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG, randomize_weights

NUM_CODES = 30
DIT_CONFIG = dict(TINY_DIT_CONFIG, num_embeds=NUM_CODES)
BIGVGAN_CONFIG = TINY_BIGVGAN_CONFIG
MEL = DIT_CONFIG["mel_dim"]
SPK = DIT_CONFIG["enc_emb_dim"]  # width of the speaker "cond" vector
HOP = 5 * 3 * 2 * 2


def split(model: nnx.Module) -> tuple[StaticGraph, nnx.State]:
    """``nnx.split`` with the graphdef as :func:`token2wav_compiled` takes it."""
    graphdef, state = nnx.split(model)
    return StaticGraph(graphdef), state


@pytest.fixture(scope="module")
def reference() -> Qwen2_5OmniToken2WavModel:
    torch.manual_seed(0)
    config = Qwen2_5OmniToken2WavConfig(
        dit_config=Qwen2_5OmniDiTConfig(**DIT_CONFIG).to_dict(),
        bigvgan_config=Qwen2_5OmniBigVGANConfig(**BIGVGAN_CONFIG).to_dict(),
    )
    model = Qwen2_5OmniToken2WavModel(config).float().eval()
    randomize_weights(model.code2wav_dit_model, 1.0)
    # Halved so the vocoder's output stays mostly inside its [-1, 1] clamp, which would hide errors.
    randomize_weights(model.code2wav_bigvgan_model, 0.5)
    return model


@pytest.fixture(scope="module")
def ours(reference: Qwen2_5OmniToken2WavModel) -> Token2Wav:
    return build_model(
        lambda: Token2Wav(reference.config, rngs=nnx.Rngs(0)),
        torch_state_items(reference),
        TOKEN2WAV_RULES,
        ignore=TOKEN2WAV_IGNORE,
    )


def make_request(seed: int, num_codes: int, ref_frames: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(
        codes=rng.integers(0, NUM_CODES + 1, num_codes).astype(np.int32),
        speaker=rng.standard_normal(SPK).astype(np.float32),
        ref_mel=(rng.standard_normal((ref_frames, MEL)) - 2).astype(np.float32),
        noise=rng.standard_normal((num_codes * DIT_CONFIG["repeats"], MEL)).astype(np.float32),
    )


def pad_batch(requests: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Right-pad with zeros to the longest request, as a generation runner would (noise: garbage)."""
    num_codes = max(len(r["codes"]) for r in requests)
    ref_frames = max(len(r["ref_mel"]) for r in requests)
    pad = lambda a, n, fill=0.0: np.concatenate([a, np.full((n - len(a), *a.shape[1:]), fill, a.dtype)])
    return dict(
        codes=jnp.asarray(np.stack([pad(r["codes"], num_codes, 7) for r in requests])),
        code_lengths=jnp.asarray([len(r["codes"]) for r in requests], jnp.int32),
        speaker_embedding=jnp.asarray(np.stack([r["speaker"] for r in requests])),
        reference_mel=jnp.asarray(np.stack([pad(r["ref_mel"], ref_frames, 5.0) for r in requests])),
        reference_lengths=jnp.asarray([len(r["ref_mel"]) for r in requests], jnp.int32),
        initial_noise=jnp.asarray(
            np.stack([pad(r["noise"], num_codes * DIT_CONFIG["repeats"], 3.0) for r in requests])
        ),
    )


def test_submodel_rules(reference: Qwen2_5OmniToken2WavModel) -> None:
    """DIT_RULES / BIGVGAN_RULES take exactly the sub-models' own state_dict names."""
    dit = reference.code2wav_dit_model
    build_model(lambda: DiT(dit.config, rngs=nnx.Rngs(0)), torch_state_items(dit), DIT_RULES)
    vocoder = reference.code2wav_bigvgan_model
    build_model(lambda: BigVGAN(vocoder.config, rngs=nnx.Rngs(0)), torch_state_items(vocoder), BIGVGAN_RULES)


def test_conv_transpose_kernel_matches_torch() -> None:
    """``conv_transpose1d_kernel`` (with its flip) + ``nnx.ConvTranspose`` equals torch's op."""
    torch.manual_seed(1)
    for cin, cout, k, s in [(4, 3, 11, 5), (3, 2, 4, 2), (2, 5, 7, 3)]:
        p = (k - s) // 2
        ref = torch.nn.ConvTranspose1d(cin, cout, k, s, padding=p)
        x = torch.randn(2, cin, 9)
        want = ref(x).detach().numpy().transpose(0, 2, 1)
        conv = nnx.ConvTranspose(cin, cout, k, s, padding=[(k - 1 - p, k - 1 - p)], rngs=nnx.Rngs(0))
        conv.kernel[...] = jnp.asarray(conv_transpose1d_kernel(ref.weight.detach().numpy()))
        conv.bias[...] = jnp.asarray(ref.bias.detach().numpy())
        got = conv(jnp.asarray(x.numpy().transpose(0, 2, 1)))
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-6


def test_kaiser_filter_matches_reference() -> None:
    for args in [(0.25, 0.3, 12), (0.1, 0.2, 13)]:
        want = kaiser_sinc_filter1d(*args).numpy().ravel()
        # One float32 ulp: the reference evaluates the Kaiser window's Bessel I0 in float32.
        np.testing.assert_allclose(kaiser_sinc_filter(*args), want, rtol=0, atol=1.2e-7)


def test_dit_forward(reference: Qwen2_5OmniToken2WavModel, ours: Token2Wav) -> None:
    """One CFG forward: conditional and null halves in one batch, as ``sample`` calls it."""
    torch.manual_seed(2)
    batch, num_codes, ref_frames = 2, 7, 19
    frames = num_codes * DIT_CONFIG["repeats"]
    x, ref_mel, spk = (
        torch.randn(batch, frames, MEL),
        torch.randn(batch, ref_frames, MEL),
        torch.randn(batch, SPK),
    )
    codes = torch.randint(0, NUM_CODES + 1, (batch, num_codes))
    with torch.no_grad():
        want = reference.code2wav_dit_model(
            hidden_states=x,
            condition_vector=ref_mel,
            speaker_embedding=spk[:, None].repeat(1, frames, 1),
            quantized_code=codes,
            time_step=torch.tensor(0.37),
            apply_cfg=True,
        ).numpy()
    j = lambda t: jnp.asarray(t.numpy())
    pair = lambda a: jnp.concatenate([a, jnp.zeros_like(a)])
    conditioning = compiled(
        ours.dit,
        "conditioning",
        pair(j(codes)),
        pair(j(ref_mel)),
        jnp.full((2 * batch,), ref_frames),
        pair(j(spk)),
    )
    got = compiled(
        ours.dit,
        "__call__",
        jnp.concatenate([j(x), j(x)]),
        conditioning,
        jnp.full((2 * batch,), 0.37),
        jnp.full((2 * batch,), frames),
    )
    err = rel_err(got, want)
    assert err < 1e-5, err


@pytest.mark.parametrize("sin", ["series", "native"])
def test_bigvgan(
    reference: Qwen2_5OmniToken2WavModel, ours: Token2Wav, monkeypatch: pytest.MonkeyPatch, sin: str
) -> None:
    """The vocoder against transformers' in both forms of SnakeBeta's ``sin^2`` (the series this
    CPU runs, ``jnp.sin`` a GPU runs), each traced into a program of its own (the form is read
    when the program is traced)."""
    monkeypatch.setenv(SIN_SWITCH, sin)
    assert sin_form() == sin
    torch.manual_seed(3)
    mel = torch.randn(2, MEL, 13) - 2
    with torch.no_grad():
        want = reference.code2wav_bigvgan_model(mel).numpy()
    vocode = nnx.jit(lambda vocoder, x: vocoder(x))
    got, lengths = vocode(ours.bigvgan, jnp.asarray(mel.numpy().transpose(0, 2, 1)))
    assert got.shape == want.shape == (2, 13 * HOP)
    assert list(np.asarray(lengths)) == [13 * HOP] * 2
    assert np.mean(np.abs(want) >= 1.0) < 0.05, "test model saturates the clamp"
    err = rel_err(got, want)
    assert err < 1e-5, err


def test_sin_form_is_the_series_on_cpu_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIN_SWITCH, raising=False)
    assert sin_form() == "series"  # this test bench is a CPU
    monkeypatch.setenv(SIN_SWITCH, "fast")
    with pytest.raises(ValueError, match="OMNI_JAX_SNAKE_SIN='fast': expected series, native or auto"):
        sin_form()


@pytest.mark.parametrize("guidance", [0.5, -0.5])
def test_token2wav_matches_reference(
    reference: Qwen2_5OmniToken2WavModel, ours: Token2Wav, monkeypatch: pytest.MonkeyPatch, guidance: float
) -> None:
    """Whole code -> mel -> waveform against ``Qwen2_5OmniToken2WavModel.forward`` with our noise.

    Below ``MIN_GUIDANCE`` (a negative scale here) the reference runs its unguided path.
    """
    req = make_request(4, num_codes=9, ref_frames=17)
    batch = pad_batch([req])
    # The reference draws its start with torch.randn; hand it our noise instead.
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.from_numpy(req["noise"][None].copy()))
    args = dict(num_steps=4, guidance_scale=guidance, sway_coefficient=-1.0)
    with torch.no_grad():
        mel_want = reference.code2wav_dit_model.sample(
            torch.from_numpy(req["speaker"][None]),
            torch.from_numpy(req["ref_mel"][None]),
            torch.from_numpy(req["codes"][None]).long(),
            **args,
        ).numpy()
        wave_want = reference(
            torch.from_numpy(req["codes"][None]).long(),
            torch.from_numpy(req["speaker"][None]),
            torch.from_numpy(req["ref_mel"][None]),
            **args,
        ).numpy()
    mel, _ = nnx.jit(lambda dit, b: sample_mel(dit, **b, **args))(ours.dit, batch)
    mel_err = rel_err(np.asarray(mel).transpose(0, 2, 1), mel_want)
    graph, state = split(ours)
    wave, lengths = token2wav_compiled(graph, state, **batch, **{k: jnp.asarray(v) for k, v in args.items()})
    wave_err = rel_err(wave[0], wave_want)
    assert int(lengths[0]) == wave_want.shape[-1] == 9 * 2 * HOP
    assert mel_err < 1e-5, mel_err
    assert wave_err < 1e-5, wave_err


def test_batched_equals_unbatched(ours: Token2Wav) -> None:
    """Different code lengths, reference lengths and step settings share one padded batch.

    Request 2 takes a single grid point (no step): it must come back as its vocoded noise.
    """
    requests = [make_request(10, 5, 19), make_request(11, 12, 11), make_request(12, 9, 15)]
    steps = dict(num_steps=[3, 5, 1], guidance_scale=[0.5, 0.0, 1.5], sway_coefficient=[-1.0, 0.0, -0.5])
    graph, state = split(ours)
    run = lambda batch, **kw: token2wav_compiled(
        graph, state, **batch, **{k: jnp.asarray(v) for k, v in kw.items()}
    )
    waves, lengths = run(pad_batch(requests), **steps)
    for i, req in enumerate(requests):
        alone, alone_len = run(pad_batch([req]), **{k: v[i : i + 1] for k, v in steps.items()})
        n = int(alone_len[0])
        assert int(lengths[i]) == n == len(req["codes"]) * 2 * HOP
        err = rel_err(waves[i, :n], np.asarray(alone[0]))
        assert err < 1e-5, (i, err)
        assert not np.any(np.asarray(waves[i, n:])), "padding must be silent"


def test_unguided_program_equals_guidance_zero(ours: Token2Wav) -> None:
    """``guided=False`` drops the null half; it equals the CFG program at scales below the threshold."""
    graph, state = split(ours)
    batch = pad_batch([make_request(30, 6, 9), make_request(31, 4, 12)])
    knobs = dict(num_steps=jnp.asarray([3, 4]), sway_coefficient=jnp.asarray([-1.0, 0.0]))
    scales = jnp.asarray([0.0, MIN_GUIDANCE / 2])
    both, lengths = token2wav_compiled(graph, state, **batch, guidance_scale=scales, **knobs)
    alone, _ = token2wav_compiled(graph, state, **batch, guidance_scale=scales, **knobs, guided=False)
    for i in range(2):
        n = int(lengths[i])
        err = rel_err(alone[i, :n], np.asarray(both[i, :n]))
        assert err < 1e-5, (i, err)


def test_solve_is_one_program(ours: Token2Wav) -> None:
    """The RK4 steps are a while loop in one program; changing num_steps does not recompile."""
    graph, state = split(ours)
    batch = pad_batch([make_request(20, 4, 9)])
    knobs = lambda n: dict(
        num_steps=jnp.asarray([n]), guidance_scale=jnp.asarray([0.5]), sway_coefficient=jnp.asarray([-1.0])
    )
    jaxpr = jax.make_jaxpr(token2wav_compiled.__wrapped__, static_argnums=0)(
        graph, state, **batch, **knobs(4)
    )
    assert "while[" in str(jaxpr)
    before = token2wav_compiled._cache_size()
    first, _ = token2wav_compiled(graph, state, **batch, **knobs(3))
    second, _ = token2wav_compiled(graph, state, **batch, **knobs(6))
    assert token2wav_compiled._cache_size() == before + 1
    assert not np.allclose(first, second)
