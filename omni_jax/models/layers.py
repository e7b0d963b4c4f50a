"""Shared building blocks: RMSNorm, rotary embeddings, the SwiGLU MLP (decoders and encoders).

Each block reproduces the transformers numerics it replaces (where the reference upcasts to
float32, so do we), because parity with the reference is how correctness is judged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)``, normalised in float32 and cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight[...] * normed


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``: the Qwen2 MLP (no biases) and the vision encoder's (biases)."""

    def __init__(self, dim: int, hidden: int, *, use_bias: bool = False, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(dim, hidden, **kw)
        self.up_proj = nnx.Linear(dim, hidden, **kw)
        self.down_proj = nnx.Linear(hidden, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _yarn_inv_freq(
    base: float, dim: int, params: Mapping[str, Any], max_pos: int
) -> tuple[np.ndarray, float]:
    orig = int(params.get("original_max_position_embeddings") or max_pos)
    factor = float(params["factor"])

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    mscale = params.get("attention_factor")
    if mscale is None:
        both = params.get("mscale") and params.get("mscale_all_dim")
        mscale = (
            get_mscale(factor, params["mscale"]) / get_mscale(factor, params["mscale_all_dim"])
            if both
            else get_mscale(factor)
        )
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), float(mscale)


def _llama3_inv_freq(inv: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    factor = float(params["factor"])
    low_ff, high_ff = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    orig = float(params["original_max_position_embeddings"])
    low_wl, high_wl = orig / low_ff, orig / high_ff
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(
    rope_parameters: Mapping[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim/2], attention_scaling)`` from a config's ``rope_parameters``.

    Mirrors transformers' ``ROPE_INIT_FUNCTIONS`` for the types we serve, computed in numpy
    so the runtime needs no torch. Unknown types are refused rather than silently run as
    default RoPE, which would give wrong answers without an error.
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    base = float(rope_parameters["rope_theta"])
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1:
        raise ValueError(f"unsupported partial_rotary_factor {partial!r} (the rotary turns whole heads)")
    dim = head_dim
    inv = (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return (inv / float(rope_parameters["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv, rope_parameters), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, rope_parameters, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def rope_cos_sin(
    positions: jax.Array, inv_freq: jax.Array, scaling: float, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., head_dim]`` for integer ``positions [...]`` in HF's half-split layout."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in half on the last axis: the rotary's pairing of
    channel ``i`` with ``i + D/2`` (HF's half-split layout)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` by per-token ``cos/sin [B, T, D]``."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin
