"""Ceilings measured on the machine the benchmark runs on, not taken from datasheets."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _best_of(fn, repeats: int = 5) -> float:  # noqa: ANN001
    fn().block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn().block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(num_bytes: int = 1 << 28) -> float:
    """Bytes/s the device streams, the decode-step ceiling: the best of two measurements.

    A plain copy (read + write) and a skinny matmul that reads a large weight once (what a
    decode step does). On CPU, XLA runs elementwise copies on fewer threads than matmuls,
    so the copy alone understates the bandwidth a decode step can reach.
    """
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    copy_bw = 2 * num_bytes / _best_of(lambda: copy(x))
    w = x.reshape(4096, -1)
    v = jnp.ones((8, 4096), jnp.float32)
    gemv = jax.jit(lambda a, b: a @ b)
    gemv_bw = num_bytes / _best_of(lambda: gemv(v, w))
    return max(copy_bw, gemv_bw)


def matmul_flops(n: int = 2048, dtype: jnp.dtype = jnp.float32) -> float:
    """FLOP/s of a large square matmul in ``dtype``, the prefill / DiT ceiling."""
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _best_of(lambda: mm(a, a))
