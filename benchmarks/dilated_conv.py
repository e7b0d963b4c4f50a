"""``python -m benchmarks.dilated_conv``: every dilated convolution of a code2wav program, as
written and split into phases, compile and run time side by side on this backend.

A GPU session's XLA dump of Qwen3-Omni's code2wav showed the residual units' dilated kernels
padded with zeros before cuDNN (7 taps at dilation 9 became 55: 7.9x the multiply-adds of the
taps; RESULTS.md, fifth GPU session), and code2wav's first compiles are what a GPU start-up waits
for. A 1-D convolution of dilation ``d`` is also ``d`` undilated ones: split the padded input
into its ``d`` phases (every ``d``-th sample), convolve each with the kernel's ``k`` taps as they
are, interleave the outputs (:mod:`omni_jax.models.dilated_conv`, the models' form on GPUs, or
under ``OMNI_JAX_DILATED_CONV=phased``). The same products and sums, so float32 results agree to
rounding; what the split costs is two transposes. Which form a backend runs faster, and compiles
faster, is measured here: what each platform's default rests on.

The convolutions are read from the whole program's jaxpr (``benchmarks.compile_time``'s cases:
Qwen2.5-Omni's token2wav solve or Qwen3-Omni's code2wav decode, ``small``'s widths by default,
``--tiny`` the test checkpoints', ``--rows`` x ``--codes``), each distinct one (shapes and
parameters) with a dilation above 1 timed alone: compiled as written and phase-split,
each compile timed (the first of its shape in this process: XLA keeps a GPU's autotuning results
for the process, and the two forms share no convolution shape), then each run best of
``--repeats``, and the largest difference between the two outputs relative to the largest
output. ``padded kernel`` says whether the compiled direct form holds an array of the kernel's
shape with its taps dilated (the zero-padded kernel the GPU dump showed). ``count`` is how often
the convolution stands in the program's text (a loop body's once). ``--json`` writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.compile_time import CASES, add_case_arguments
from benchmarks.harness import device, versions, wall_times, write_json
from omni_jax.cli_errors import plain_text
from omni_jax.models.dilated_conv import DILATED_SWITCH, FLAX_1D, phased_conv


@dataclasses.dataclass(frozen=True)
class DilatedConv:
    """One convolution of the program: its operands' shapes and dtype and ``lax.conv_general_dilated``'s
    parameters as the jaxpr holds them (hashable: equal convolutions are timed once)."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dtype: str
    padding: tuple[tuple[int, int], ...]
    rhs_dilation: tuple[int, ...]
    dimension_numbers: lax.ConvDimensionNumbers
    precision: Any

    @property
    def dilation(self) -> int:
        return self.rhs_dilation[0]

    @property
    def taps(self) -> int:
        return self.rhs_shape[self.dimension_numbers.rhs_spec[2]]

    @property
    def dilated_taps(self) -> int:
        return 1 + (self.taps - 1) * self.dilation

    def direct(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """The convolution as written (the models' form off GPUs)."""
        return lax.conv_general_dilated(
            x,
            w,
            (1,),
            self.padding,
            rhs_dilation=self.rhs_dilation,
            dimension_numbers=self.dimension_numbers,
            precision=self.precision,
        )

    def phased(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """The same convolution as ``OMNI_JAX_DILATED_CONV=phased`` computes it."""
        return phased_conv(x, w, self.padding[0], self.dilation, self.precision)


def _subjaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs a parameter of an equation holds (a loop's body, a cond's branches, a call's)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _subjaxprs(v)


def dilated_convs(jaxpr: Any) -> Iterator[DilatedConv]:
    """Every 1-D convolution of ``jaxpr`` (nested ones included) in ``nnx.Conv``'s layout with a
    dilation above 1, stride 1, no input dilation and no feature groups: the ones
    ``OMNI_JAX_DILATED_CONV=phased`` splits."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from dilated_convs(sub)
        if eqn.primitive is not lax.conv_general_dilated_p:
            continue
        p = eqn.params
        if (
            len(p["rhs_dilation"]) == 1
            and p["rhs_dilation"][0] > 1
            and tuple(p["window_strides"]) == (1,)
            and tuple(p["lhs_dilation"]) == (1,)
            and p["feature_group_count"] == 1
            and p["batch_group_count"] == 1
            and p["dimension_numbers"] == FLAX_1D
        ):
            lhs, rhs = (v.aval for v in eqn.invars)
            yield DilatedConv(
                tuple(lhs.shape),
                tuple(rhs.shape),
                str(lhs.dtype),
                tuple(tuple(pair) for pair in p["padding"]),
                tuple(p["rhs_dilation"]),
                p["dimension_numbers"],
                p["precision"],
            )


@contextlib.contextmanager
def direct_form() -> Iterator[None]:
    """Trace under the direct form, whatever the platform or the environment asks, so that the
    program's dilated convolutions are there to find."""
    asked = os.environ.get(DILATED_SWITCH)
    os.environ[DILATED_SWITCH] = "direct"
    try:
        yield
    finally:
        if asked is None:
            del os.environ[DILATED_SWITCH]
        else:
            os.environ[DILATED_SWITCH] = asked


def padded_kernel(hlo: str, conv: DilatedConv) -> bool:
    """Whether the compiled program holds an array shaped as the kernel with its taps dilated."""
    want = sorted(
        conv.dilated_taps if i == conv.dimension_numbers.rhs_spec[2] else s
        for i, s in enumerate(conv.rhs_shape)
    )
    return any(
        sorted(int(t) for t in dims.split(",")) == want for dims in re.findall(r"\[(\d+(?:,\d+)*)\]", hlo)
    )


def time_form(fn: Callable[..., jax.Array], x: jax.Array, w: jax.Array, repeats: int) -> dict[str, Any]:
    """One form compiled (timed) and run best of ``repeats``; its output and compiled text kept."""
    lowered = jax.jit(fn).lower(x, w)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(x, w))
    run_ms = 1e3 * min(wall_times(lambda: jax.block_until_ready(compiled(x, w)), repeats))
    return {"compile_s": compile_s, "run_ms": run_ms, "out": out, "hlo": compiled.as_text()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    case = CASES[args.family](args.tiny, args.rows, args.codes)
    program = next(iter(case.programs))
    with direct_form():
        found = list(dilated_convs(case.programs[program]().jaxpr.jaxpr))
    counts = {conv: found.count(conv) for conv in dict.fromkeys(found)}
    print(f"{case.model}, {program} {case.shape}: {len(found)} dilated convolutions, {len(counts)} distinct")
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for conv, count in counts.items():
        x = jnp.asarray(rng.standard_normal(conv.lhs_shape), conv.dtype)
        fan_in = np.prod(conv.rhs_shape) / conv.rhs_shape[conv.dimension_numbers.rhs_spec[0]]
        w = jnp.asarray(rng.standard_normal(conv.rhs_shape) / np.sqrt(fan_in), conv.dtype)
        direct = time_form(conv.direct, x, w, args.repeats)
        phased = time_form(conv.phased, x, w, args.repeats)
        scale = float(jnp.max(jnp.abs(direct["out"])))
        row = {
            "input": list(conv.lhs_shape),
            "kernel": list(conv.rhs_shape),
            "taps": conv.taps,
            "dilation": conv.dilation,
            "dilated_taps": conv.dilated_taps,
            "count": count,
            "direct_compile_s": direct["compile_s"],
            "phased_compile_s": phased["compile_s"],
            "direct_ms": direct["run_ms"],
            "phased_ms": phased["run_ms"],
            "rel_diff": float(jnp.max(jnp.abs(direct["out"] - phased["out"]))) / scale,
            "padded_kernel": padded_kernel(direct["hlo"], conv),
        }
        rows.append(row)
        print(
            f"input {row['input']} kernel {row['kernel']} dilation {conv.dilation} ({conv.taps} -> "
            f"{conv.dilated_taps} taps) x{count}: compile {row['direct_compile_s']:.2f} / "
            f"{row['phased_compile_s']:.2f} s, run {row['direct_ms']:.3f} / {row['phased_ms']:.3f} ms "
            f"(direct / phased), rel diff {row['rel_diff']:.1e}, padded kernel {row['padded_kernel']}",
            flush=True,
        )
    totals = {
        key: sum(r[key] * (r["count"] if key.endswith("_ms") else 1) for r in rows)
        for key in ("direct_compile_s", "phased_compile_s", "direct_ms", "phased_ms")
    }
    print(
        f"all: compile {totals['direct_compile_s']:.2f} / {totals['phased_compile_s']:.2f} s, run (x count) "
        f"{totals['direct_ms']:.3f} / {totals['phased_ms']:.3f} ms (direct / phased)"
    )
    return {
        "device": device(),
        "versions": versions(),
        "model": case.model,
        "shape": case.shape,
        "rows": rows,
        "totals": totals,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dilated_conv", description=plain_text(__doc__.split("\n\n")[0])
    )
    add_case_arguments(p, codes=125)
    p.add_argument("--repeats", type=int, default=5, help="runs of each form, the best kept")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    write_json(args.json, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
