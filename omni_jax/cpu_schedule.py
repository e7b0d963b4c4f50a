"""What XLA's CPU scheduler holds through an AR step beyond what the step itself computes.

XLA's CPU compiler orders a program's operations breadth-first by default, so that independent
operations can run at once (``--xla_cpu_enable_concurrency_optimized_scheduler``, on unless
``XLA_FLAGS`` turns it off when the backend starts): it starts each operation as soon as its
inputs are ready. In a decoder step that is at the top of the program for what reads only the
weights: the CPU multiplies bfloat16 in float32, and every layer's weights are converted at
once and held together (about 27 GiB at 7B, beside 14 GiB of weights), and the jnp attention's
chunked output and its reordering, two query-wide float32 rows per token row, are kept for
every layer, as is a float32 copy of a bfloat16 cache's gathered K and V
(:func:`gather_copies`). Its depth-first scheduler (the flag set to ``false``) converts each
weight just before its product and frees it after: a step then holds the largest weight's copy
alone. That scheduler also makes the vocoders' many independent convolutions slower on CPU
(code2wav about a fifth slower in ``benchmarks.run --suite code2wav`` on 2 cores,
``benchmarks/RESULTS.md``), so it is not imposed: the memory plan
(:class:`~omni_jax.engine.memory.ARMemory`) counts what the scheduler in effect holds. Which one
is in effect is asked of XLA itself (:func:`concurrency_scheduler`): it reads the flag once,
when its CPU backend starts, from ``XLA_FLAGS`` alone (a per-program compile option does not
change the schedule), so the variable as it is now may not be what XLA took. Accelerators
convert nothing and keep no per-layer rows, and add nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
PROBE_LAYERS, PROBE_WIDTH = 8, 512
"""The probe: a chain of this many bfloat16 ``PROBE_WIDTH``-square products."""


@functools.cache
def concurrency_scheduler() -> bool:
    """Whether this process's XLA CPU compiler schedules for concurrency: a chain of
    :data:`PROBE_LAYERS` bfloat16 products compiled for the CPU holds every weight's float32
    copy at once under that scheduler, one or two under the depth-first one. Without a CPU
    backend in this process (``JAX_PLATFORMS=cuda``), XLA's default (true) is assumed."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return True
    on_cpu = jax.sharding.SingleDeviceSharding(cpu)
    weight = jax.ShapeDtypeStruct((PROBE_WIDTH, PROBE_WIDTH), jnp.bfloat16, sharding=on_cpu)
    x = jax.ShapeDtypeStruct((1, PROBE_WIDTH), jnp.bfloat16, sharding=on_cpu)

    def chain(x: jax.Array, weights: list[jax.Array]) -> jax.Array:
        for w in weights:
            x = jnp.tanh(x @ w)
        return x

    compiled = jax.jit(chain).lower(x, [weight] * PROBE_LAYERS).compile()
    copy = 4 * PROBE_WIDTH * PROBE_WIDTH
    return compiled.memory_analysis().temp_size_in_bytes > PROBE_LAYERS // 2 * copy


def weight_copies(weights: list[int], itemsize: int) -> int:
    """The float32 copies a CPU program holds of its ``weights`` (the elements of each parameter
    one device holds: a device of a mesh converts its own shards) when they are narrower
    (``itemsize`` under 4): all at once, or the largest alone with the depth-first scheduler."""
    if itemsize >= 4:
        return 0
    return 4 * (sum(weights) if concurrency_scheduler() else max(weights))


def gather_copies(layers: int, itemsize: int) -> int:
    """How many float32 copies of one attention chunk's gathered K and V a CPU step of ``layers``
    layers holds when the cache's ``itemsize`` is under 4 (the CPU computes the scores of a
    bfloat16 cache in float32): one a layer with the default scheduler (XLA's count of a 1.5B
    bfloat16 decoder grows by up to one row's float32 K and V a layer), one with the depth-first
    scheduler."""
    if itemsize >= 4:
        return 0
    return layers if concurrency_scheduler() else 1


def cpu_step_bytes(weights: list[int], itemsize: int, layers: int, token_rows: int, query_width: int) -> int:
    """What an AR step on CPU holds beyond its own temporaries, given one device's ``weights``
    and their ``itemsize`` (:func:`weight_copies`), its ``layers``, the step's ``token_rows``
    and one device's ``query_width`` (heads times head size): the weights' float32 copies, and
    with the default scheduler two float32 query-wide rows per token row and layer."""
    rows = 2 * layers * token_rows * query_width * 4 if concurrency_scheduler() else 0
    return weight_copies(weights, itemsize) + rows
