"""Dilated 1-D convolutions, computed as written or split into undilated phases.

A convolution of dilation ``d`` over ``k`` taps is also ``d`` undilated convolutions: split the
padded input into its ``d`` phases (every ``d``-th sample), convolve each with the ``k`` taps as
they are, and interleave the outputs. The products and sums are the same ones, so the results
agree to rounding (bit-equal on XLA's CPU backend); the split adds two transposes. A GPU dump of
Qwen3-Omni's code2wav showed XLA padding the dilated kernels with zeros before cuDNN (7 taps at
dilation 9 as 55, 7.9x the multiply-adds), which the split avoids. On an H200 the split ran
Qwen3-Omni's whole decode and each of its dilated convolutions several times faster and compiled
no slower (RESULTS.md, seventh GPU session); on a CPU, whose XLA convolves dilated kernels as they
are, it gained nothing measurable. So ``phased`` is GPUs' default, ``direct`` every other backend's;
``OMNI_JAX_DILATED_CONV`` overrides. Qwen2.5-Omni's code2wav keeps the GPUs' default for one
rule over both families: XLA left its dilated kernels unpadded, and the nine of them timed on an
H200 ran as fast split as written (RESULTS.md, eighth GPU session; its whole program not timed).

:func:`conv_general_dilated` is what the code2wav models' dilated ``nnx.Conv`` layers call in
place of ``lax.conv_general_dilated`` (flax's hook for it), so their weights and parameter names
stay ``nnx.Conv``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from omni_jax.models.formulation import formulation

DILATED_SWITCH = "OMNI_JAX_DILATED_CONV"
"""Environment variable naming how dilated convolutions are computed, read when one is traced:
``direct``, ``phased`` or ``auto`` (unset: ``auto``, :func:`dilated_form`'s platform default)."""

DILATED_FORMS = ("direct", "phased")

FLAX_1D = lax.ConvDimensionNumbers(lhs_spec=(0, 2, 1), rhs_spec=(2, 1, 0), out_spec=(0, 2, 1))
"""``nnx.Conv``'s layout of a 1-D convolution: input ``[N, W, C]``, kernel ``[k, I, O]``."""


def phased_conv(
    x: jax.Array,
    kernel: jax.Array,
    padding: tuple[int, int],
    dilation: int,
    precision: Any = None,
    **conv_kwargs: Any,
) -> jax.Array:
    """``x [N, W, C]`` convolved with ``kernel [k, C, O]`` at ``dilation``, zero ``padding``
    ``(left, right)``, stride 1, as ``dilation`` undilated convolutions over the padded input's
    phases: ``[N, W + left + right - (k - 1) * dilation, O]``."""
    n, width, channels = x.shape
    taps, d = kernel.shape[0], dilation
    lo, hi = padding
    out_width = width + lo + hi - (taps - 1) * d
    x = jnp.pad(x, ((0, 0), (lo, hi + (-(width + lo + hi)) % d), (0, 0)))
    phases = x.shape[1] // d
    x = x.reshape(n, phases, d, channels).transpose(0, 2, 1, 3).reshape(n * d, phases, channels)
    y = lax.conv_general_dilated(
        x, kernel, (1,), ((0, 0),), dimension_numbers=FLAX_1D, precision=precision, **conv_kwargs
    )
    y = y.reshape(n, d, phases - taps + 1, -1).transpose(0, 2, 1, 3)
    return y.reshape(n, (phases - taps + 1) * d, -1)[:, :out_width]


def dilated_form() -> str:
    """How dilated convolutions traced now are computed: what ``OMNI_JAX_DILATED_CONV`` names,
    else ``phased`` on GPUs and ``direct`` elsewhere (the module doc says why)."""
    return formulation(
        DILATED_SWITCH, DILATED_FORMS, "phased" if jax.default_backend() == "gpu" else "direct"
    )


def _pair(padding: str | Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """A 1-D convolution's zero padding as ``(left, right)``; ``None`` for other forms."""
    if padding == "VALID":
        return (0, 0)
    if isinstance(padding, str) or len(padding) != 1:
        return None
    lo, hi = padding[0]
    return (lo, hi) if lo >= 0 and hi >= 0 else None


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    precision: Any = None,
    **conv_kwargs: Any,
) -> jax.Array:
    """``lax.conv_general_dilated``, except that where :func:`dilated_form` is ``phased`` a dilated
    1-D convolution in ``nnx.Conv``'s layout, stride 1, ungrouped, is :func:`phased_conv`."""
    pair = _pair(padding)
    if (
        dilated_form() == "phased"
        and rhs_dilation is not None
        and len(rhs_dilation) == 1
        and rhs_dilation[0] > 1
        and tuple(window_strides) == (1,)
        and tuple(lhs_dilation or (1,)) == (1,)
        and feature_group_count == 1
        and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == FLAX_1D
        and pair is not None
    ):
        return phased_conv(lhs, rhs, pair, rhs_dilation[0], precision, **conv_kwargs)
    return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        precision=precision,
        **conv_kwargs,
    )
