"""What XLA's CPU scheduler holds through an AR step beyond what the step itself computes.

XLA's CPU compiler orders a program's operations breadth-first by default, so that independent
operations can run at once (``--xla_cpu_enable_concurrency_optimized_scheduler``, on unless
``XLA_FLAGS`` turns it off): it starts each operation as soon as its inputs are ready. In a
decoder step that is at the top of the program for what reads only the weights: the CPU
multiplies bfloat16 in float32, and every layer's weights are converted at once and held
together (the float32 copy of the whole model, about 28 GB at 7B beside its 15 GB of weights),
and the jnp attention's chunked output and its reordering, two query-wide float32 rows per
token row, are kept for every layer. Its depth-first scheduler (the
flag set to ``false``) converts each weight just before its product and frees it after: a step
then holds the largest weight's copy alone. That scheduler also makes the vocoders' many
independent convolutions slower on CPU (code2wav about a fifth slower in
``benchmarks.run --suite code2wav`` on 2 cores, ``benchmarks/RESULTS.md``), so it is not
imposed: the memory plan (:class:`~omni_jax.engine.memory.ARMemory`) counts what the scheduler
in effect holds, and a bfloat16 model on a CPU short of memory can take the flag. XLA reads it
from ``XLA_FLAGS`` alone (a per-program compile option does not change the schedule), when the
backend starts. Accelerators convert nothing and keep no per-layer rows, and add nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def concurrency_scheduler(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether XLA's CPU compiler schedules for concurrency (its default): unless ``XLA_FLAGS``
    sets :data:`FLAG` to false (the last setting wins, as XLA parses them)."""
    value = True
    for flag in environ.get("XLA_FLAGS", "").split():
        name, _, setting = flag.lstrip("-").partition("=")
        if name == FLAG:
            value = setting.lower() not in ("false", "0")
    return value


def cpu_step_bytes(
    weights: list[int],
    itemsize: int,
    layers: int,
    token_rows: int,
    query_width: int,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """What an AR step on CPU holds beyond its own temporaries, given its ``weights`` (each
    parameter's element count), their ``itemsize``, its ``layers``, the step's ``token_rows``
    and one device's ``query_width`` (heads times head size): narrower weights' float32
    copies (all at once, or the largest alone with the depth-first scheduler), and with the
    default scheduler two float32 query-wide rows per token row and layer."""
    concurrent = concurrency_scheduler(environ)
    copies = 0 if itemsize >= 4 else 4 * (sum(weights) if concurrent else max(weights))
    rows = 2 * layers * token_rows * query_width * 4 if concurrent else 0
    return copies + rows
