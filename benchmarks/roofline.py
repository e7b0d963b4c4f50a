"""Ceilings measured on the machine the benchmark runs on, never taken from datasheets.

Each is the best of a few timed runs of one large jitted program (after a compile-and-warm-up
run), measured once per process and shared by the suites. Sizes grow on accelerators so that
launch overhead does not hide the peak.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _on_accelerator() -> bool:
    return jax.devices()[0].platform != "cpu"


def best_of(fn: Callable[[], Any], repeats: int = 5) -> float:
    """The least seconds of ``repeats`` timed calls of ``fn``, after one untimed call that
    compiles and warms it up; each call is waited for to its device arrays' end (results already
    on the host are returned as they are)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def memory_bandwidth(num_bytes: int | None = None) -> float:
    """Bytes/s the device streams, the decode-step ceiling: the best of two measurements.

    A plain copy (read + write) and a skinny matmul that reads a large weight once (what a
    decode step does). On CPU, XLA runs elementwise copies on fewer threads than matmuls,
    so the copy alone understates the bandwidth a decode step can reach. ``num_bytes``
    defaults to 256 MiB on CPU and 2 GiB on an accelerator (well past any cache).
    """
    num_bytes = num_bytes or (1 << 31 if _on_accelerator() else 1 << 28)
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    copy_bw = 2 * num_bytes / best_of(lambda: copy(x))
    w = x.reshape(4096, -1)
    v = jnp.ones((8, 4096), jnp.float32)
    gemv = jax.jit(lambda a, b: a @ b)
    gemv_bw = num_bytes / best_of(lambda: gemv(v, w))
    return max(copy_bw, gemv_bw)


@functools.cache
def matmul_flops(n: int | None = None, dtype: str = "float32") -> float:
    """FLOP/s of a large square matmul in ``dtype``, the prefill / DiT ceiling.

    ``n`` defaults to 2048 on CPU and 8192 on an accelerator; the matmul runs at JAX's default
    precision, the one the models use.
    """
    n = n or (8192 if _on_accelerator() else 2048)
    a = jnp.ones((n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / best_of(lambda: mm(a, a))


@functools.cache
def decoder_matmuls_s(shapes: tuple[tuple[int, int], ...], rows: int, dtype: str = "float32") -> float:
    """Seconds of one jitted chain of matmuls of ``rows`` rows through weights of ``shapes``
    (``(in, out)`` each, in order, each input the previous output's first ``in`` columns padded
    or cut): what XLA's own matmuls take for a decode step's weight products, nothing else.

    The matmul ceiling (:func:`matmul_flops`) is a large square product; a decode step multiplies
    a few rows, where a device's matmul runs far below it. The step's time against this chain
    separates the engine's overhead (attention, sampling, dispatch) from the matmul's own speed
    at that shape."""
    key = jax.random.PRNGKey(0)
    weights = [jax.random.normal(key, s, jnp.dtype(dtype)) * 0.02 for s in shapes]

    def chain(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        for w in ws:
            width = w.shape[0]
            x = x[:, :width] if x.shape[1] >= width else jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
            x = x @ w
        return x

    x = jnp.ones((rows, shapes[0][0]), jnp.dtype(dtype))
    run = jax.jit(chain)
    return best_of(lambda: run(x, weights))
