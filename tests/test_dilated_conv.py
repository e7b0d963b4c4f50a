"""``benchmarks.dilated_conv`` (a GPU session's check of code2wav's dilated convolutions) finds
them in both families' programs and times both forms, whose outputs agree: the phase split is the
same convolution."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from benchmarks import dilated_conv


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_dilated_conv_times_every_dilated_convolution(family: str, tmp_path: Path) -> None:
    out = tmp_path / "dilated.json"
    argv = ["--family", family, "--tiny", "--codes", "16", "--repeats", "1", "--json", str(out)]
    assert dilated_conv.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert rows and all(r["dilation"] > 1 for r in rows)
    if family == "qwen3_omni":  # the residual units' dilations 3 and 9 (1 is undilated) in each block
        assert {r["dilation"] for r in rows} == {3, 9} and all(r["taps"] == 7 for r in rows)
    for r in rows:
        assert r["rel_diff"] <= 1e-6
        assert r["direct_compile_s"] > 0 and r["phased_ms"] > 0 and r["count"] >= 1


@pytest.mark.parametrize(
    ("numbers", "lhs_shape", "rhs_shape", "padding", "dilation"),
    [
        (("NWC", "WIO", "NWC"), (2, 37, 3), (5, 3, 4), ((8, 8),), 2),  # flax's layout, "same" padding
        (("NCW", "OIW", "NCW"), (1, 3, 40), (4, 3, 7), ((54, 0),), 9),  # torch's layout, causal
        (("NWC", "WIO", "NCW"), (3, 23, 2), (3, 2, 5), ((1, 6),), 5),  # uneven padding, the output moved
    ],
)
def test_phased_is_the_dilated_convolution(
    numbers: tuple[str, str, str],
    lhs_shape: tuple[int, ...],
    rhs_shape: tuple[int, ...],
    padding: tuple[tuple[int, int], ...],
    dilation: int,
) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
    dims = lax.conv_dimension_numbers(lhs_shape, rhs_shape, numbers)
    conv = dilated_conv.DilatedConv(
        lhs_shape, rhs_shape, "float32", padding, (dilation,), dims, lax.Precision.HIGHEST
    )
    direct, phased = jax.jit(conv.direct)(x, w), jax.jit(conv.phased)(x, w)
    assert phased.shape == direct.shape
    np.testing.assert_allclose(np.asarray(phased), np.asarray(direct), rtol=1e-6, atol=1e-6)
    padded = list(rhs_shape)
    padded[dims.rhs_spec[2]] = conv.dilated_taps
    assert dilated_conv.padded_kernel(f"%k = f32[{','.join(map(str, reversed(padded)))}]{{0,1,2}}", conv)
    assert not dilated_conv.padded_kernel(f"%k = f32[{','.join(map(str, rhs_shape))}]{{2,1,0}}", conv)
