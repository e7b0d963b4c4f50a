"""Qwen2.5-Omni code2wav: codec tokens -> mel (DiT flow matching, RK4, CFG) -> waveform (BigVGAN).

The whole solve is one XLA program: the RK4 steps run in a ``lax.fori_loop``, one stage (one DiT
call) an iteration, whose trip count is a traced value, so changing ``num_steps`` does not
recompile. Every per-request knob
(``num_steps``, ``guidance_scale``, ``sway_coefficient``) may differ across the batch; each
request follows its own time grid and stops updating after its own last step, so its result is
the one it gets alone.

The reference is transformers' ``Qwen2_5OmniToken2WavModel.forward`` (``DiTModel.sample`` with
``RungeKutta4ODESolver``, then the BigVGAN vocoder).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.jit import StaticGraph, compute_dtype, exact_matmuls
from omni_jax.models.param_map import ParamRule, prefixed
from omni_jax.models.qwen2_5_omni.bigvgan import BIGVGAN_IGNORE, BIGVGAN_RULES, BigVGAN
from omni_jax.models.qwen2_5_omni.dit import DIT_IGNORE, DIT_RULES, DiT

ArrayLike = jax.Array | float | int

MIN_GUIDANCE = 1e-5
"""The reference skips classifier-free guidance for a ``guidance_scale`` below this (negative
ones included) and runs the conditional pass alone; so does :func:`sample_mel`."""


class Token2Wav(nnx.Module):
    """The DiT and the vocoder of ``Qwen2_5OmniToken2WavModel`` (config: its ``Token2WavConfig``)."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        self.dit = DiT(config.dit_config, rngs=rngs)
        self.bigvgan = BigVGAN(config.bigvgan_config, rngs=rngs)
        self.solve_bytes_per_code = solve_bytes_per_code(config)


def solve_bytes_per_code(config: Any) -> int:
    """Estimated temporaries of one solve per request row and code, float32 (``Token2WavConfig``).

    A solve's memory grows linearly in rows x codes (block attention keeps the DiT linear in
    frames), so the start-up check multiplies this by its largest batch. Per mel frame: the
    DiT's live activations for the conditional and unconditional rows (hidden-width buffers and
    the feed-forward's intermediate, each block's window of keys, values and scores), the RK4
    state, then the vocoder's widest stage (channels x samples per frame, held twelve times over
    through its anti-aliased activations, their two phases, and the resblock sum: XLA's plan at
    Qwen2.5-Omni-7B's widths holds about ten, which eight undercounted). Against XLA's own
    accounting (``compiled.memory_analysis().temp_size_in_bytes``) the tests hold it to within
    1x-3x, at the test checkpoint's widths and at the 7B's.
    """
    dit, voc = config.dit_config, config.bigvgan_config
    window = 3 * dit.block_size  # look-backward, own and look-ahead blocks at most
    heads = dit.num_attention_heads
    dit_frame = (
        2
        * (  # conditional and unconditional rows
            (8 + 2 * dit.ff_mult) * dit.hidden_size
            + heads * window * (1 + 2 * dit.head_dim // dit.block_size)
        )
        + 8 * dit.mel_dim
    )
    widest, samples = voc.upsample_initial_channel, 1
    for i, rate in enumerate(voc.upsample_rates):
        samples *= rate
        widest = max(widest, voc.upsample_initial_channel // 2 ** (i + 1) * samples)
    vocoder_frame = 12 * widest
    return 4 * dit.repeats * (dit_frame + vocoder_frame)


TOKEN2WAV_RULES: tuple[ParamRule, ...] = prefixed("code2wav_dit_model.", "dit", DIT_RULES) + prefixed(
    "code2wav_bigvgan_model.", "bigvgan", BIGVGAN_RULES
)
"""HF names relative to ``Qwen2_5OmniToken2WavModel`` (prefix ``token2wav.`` in the full checkpoint)."""

TOKEN2WAV_IGNORE: tuple[str, ...] = tuple(r"code2wav_dit_model\." + p for p in DIT_IGNORE) + tuple(
    r"code2wav_bigvgan_model\." + p for p in BIGVGAN_IGNORE
)


def time_point(index: jax.Array, num_steps: jax.Array, sway: jax.Array) -> jax.Array:
    """Point ``index`` of ``linspace(0, 1, num_steps)`` bent by sway, per request (float32).

    Uses torch's symmetric linspace formula (its scalar CPU and CUDA kernels; the vectorised CPU
    path can differ by one ulp for ``num_steps >= 10``), then the reference's sway:
    ``t + sway * (cos(pi / 2 * t) - 1 + t)``.
    """
    # max(.., 1): a one-point grid has no steps; keep its (unused) times finite.
    step = jnp.float32(1.0) / jnp.maximum(num_steps - 1, 1).astype(jnp.float32)
    from_start = step * index.astype(jnp.float32)
    from_end = 1.0 - step * (num_steps - 1 - index).astype(jnp.float32)
    t = jnp.where(index < num_steps // 2, from_start, from_end)
    return t + sway * (jnp.cos(math.pi / 2 * t) - 1 + t)


def _per_request(value: ArrayLike, batch: int, dtype: jnp.dtype) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def sample_mel(
    dit: DiT,
    codes: jax.Array,
    code_lengths: jax.Array,
    speaker_embedding: jax.Array,
    reference_mel: jax.Array,
    reference_lengths: jax.Array | None,
    initial_noise: jax.Array,
    num_steps: ArrayLike = 10,
    guidance_scale: ArrayLike = 0.5,
    sway_coefficient: ArrayLike = -1.0,
    guided: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Solve the flow ODE from ``initial_noise`` to a mel: ``(mel [B, F, mel_dim], frames [B])``.

    ``codes [B, T]`` int32, valid up to ``code_lengths [B]``; ``F = T * repeats`` and a request
    has ``code_lengths * repeats`` valid frames (the rest of its mel is zero).
    ``speaker_embedding [B, enc_emb_dim]`` and ``reference_mel [B, R, mel_dim]`` (valid up to
    ``reference_lengths [B]``, default ``R``) are the speaker's ``cond`` and ``ref_mel``.
    ``initial_noise [B, F, mel_dim]``. The step parameters are scalars or ``[B]``.

    Classifier-free guidance runs the conditional and the null input (codes 0, zero speaker
    vector, zero reference mel) in one ``2B`` batch, as the reference's ``apply_cfg`` path; a
    request whose ``guidance_scale`` is below :data:`MIN_GUIDANCE` gets the conditional
    velocity alone, the reference's unguided path. ``guided=False`` (static) promises that
    every request is such a one and drops the null half from the program: half the DiT work.
    """
    batch = codes.shape[0]
    dtype = initial_noise.dtype
    frames = code_lengths.astype(jnp.int32) * dit.repeats
    if reference_lengths is None:
        reference_lengths = jnp.full((batch,), reference_mel.shape[1], jnp.int32)
    num_steps = _per_request(num_steps, batch, jnp.int32)
    guidance = _per_request(guidance_scale, batch, dtype)
    guidance = jnp.where(guidance < MIN_GUIDANCE, 0.0, guidance)[:, None, None]
    sway = _per_request(sway_coefficient, batch, dtype)

    # Rows [0, B) are the conditional input; with guidance, rows [B, 2B) the null one.
    pair = (lambda a: jnp.concatenate([a, jnp.zeros_like(a)], axis=0)) if guided else (lambda a: a)
    twice = (lambda a: jnp.concatenate([a, a], axis=0)) if guided else (lambda a: a)
    conditioning = dit.conditioning(
        pair(codes), pair(reference_mel), twice(reference_lengths), pair(speaker_embedding)
    )
    frames2 = twice(frames)

    def velocity(t: jax.Array, x: jax.Array) -> jax.Array:
        out = dit(twice(x), conditioning, twice(t), frames2)
        if not guided:
            return out
        conditional, null = out[:batch], out[batch:]
        return conditional + (conditional - null) * guidance

    third, two_thirds = 1 / 3, 2 / 3

    def rk4_stage(s: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """Stage ``s % 4`` of the 3/8-rule RK4 step from grid point ``s // 4`` to the next, in
        the reference's op order: one velocity (one DiT call) per iteration, so the program holds
        the DiT once, not four times (XLA's compile time grows with the program, and on a GPU a
        code2wav program's DiT solve was most of it). The stage's input and time are chosen
        among the four formulas, each computed as the reference computes it."""
        x, k1, k2, k3 = carry
        i, stage = s // 4, s % 4
        t0 = time_point(i, num_steps, sway)
        t1 = time_point(i + 1, num_steps, sway)
        dt_t = t1 - t0
        dt = dt_t[:, None, None]
        t_in = jnp.select(
            [stage == 0, stage == 1, stage == 2], [t0, t0 + dt_t * third, t0 + dt_t * two_thirds], t1
        )
        x_in = jnp.select(
            [stage == 0, stage == 1, stage == 2],
            [x, x + dt * k1 * third, x + dt * (k2 - k1 * third)],
            x + dt * (k1 - k2 + k3),
        )
        k = velocity(t_in, x_in)
        x_next = x + (k1 + 3 * (k2 + k3) + k) * dt / 8
        x = jnp.where((stage == 3) & (i < num_steps - 1)[:, None, None], x_next, x)
        return x, jnp.where(stage == 0, k, k1), jnp.where(stage == 1, k, k2), jnp.where(stage == 2, k, k3)

    zeros = jnp.zeros_like(initial_noise)
    start = (initial_noise, zeros, zeros, zeros)
    mel = jax.lax.fori_loop(0, 4 * (jnp.max(num_steps) - 1), rk4_stage, start)[0]
    valid = jnp.arange(mel.shape[1])[None, :, None] < frames[:, None, None]
    return jnp.where(valid, mel, 0.0), frames


def token2wav(
    model: Token2Wav,
    codes: jax.Array,
    code_lengths: jax.Array,
    speaker_embedding: jax.Array,
    reference_mel: jax.Array,
    reference_lengths: jax.Array | None,
    initial_noise: jax.Array,
    num_steps: ArrayLike = 10,
    guidance_scale: ArrayLike = 0.5,
    sway_coefficient: ArrayLike = -1.0,
    guided: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Codes -> ``(waveform [B, S] float32 at 24 kHz, valid samples [B])``; see :func:`sample_mel`.

    ``S = T * repeats * prod(upsample_rates)`` for the usual kernel/stride pairs; samples past a
    request's count are zero.
    """
    with jax.named_scope("dit_solve"):
        mel, frames = sample_mel(
            model.dit,
            codes,
            code_lengths,
            speaker_embedding,
            reference_mel,
            reference_lengths,
            initial_noise,
            num_steps,
            guidance_scale,
            sway_coefficient,
            guided,
        )
    with jax.named_scope("vocoder"):
        return model.bigvgan(mel, frames)


@functools.partial(jax.jit, static_argnums=(0, 11), static_argnames="guided")
def token2wav_compiled(
    graph: StaticGraph,
    state: nnx.State,
    codes: jax.Array,
    code_lengths: jax.Array,
    speaker_embedding: jax.Array,
    reference_mel: jax.Array,
    reference_lengths: jax.Array,
    initial_noise: jax.Array,
    num_steps: jax.Array,
    guidance_scale: jax.Array,
    sway_coefficient: jax.Array,
    guided: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """:func:`token2wav` as one compiled program over ``nnx.split(model)`` (the graphdef wrapped
    in a :class:`StaticGraph`).

    Compiles once per input shape (bucket the batch, code and reference lengths) and ``guided``;
    the step parameters are traced, so new values never recompile.
    """
    with exact_matmuls(compute_dtype(state)):
        return token2wav(
            nnx.merge(graph.graphdef, state),
            codes,
            code_lengths,
            speaker_embedding,
            reference_mel,
            reference_lengths,
            initial_noise,
            num_steps,
            guidance_scale,
            sway_coefficient,
            guided,
        )
