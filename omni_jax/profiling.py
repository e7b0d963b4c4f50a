"""Named host-side spans for ``jax.profiler`` traces (``benchmarks.run --profile DIR``).

A span marks a phase of the serving loop on the host timeline of a trace (Perfetto, TensorBoard,
XProf), so the time between device programs is attributed to a phase: scheduling, padding,
dispatch, waiting for a result, splitting outputs. Names are ``"<component>/<phase>"``:

- ``stage/<stage>``: one stage's turn in the pipeline's loop (:mod:`omni_jax.pipeline`);
- ``<stage>/schedule``, ``<stage>/prefill`` or ``<stage>/decode`` (a step's dispatch; a step
  with any prompt row is a prefill), ``<stage>/update`` (reading a step's results, waiting for
  the device, and applying them): an AR stage's engine step (``thinker/decode``, ...);
- ``<stage>/warmup``, ``<stage>/pad``, ``<stage>/solve``, ``<stage>/split``: a generation
  stage's runner (``code2wav/solve``, ...; ``solve`` is the dispatch alone: reading its
  results, which waits for the device, comes before ``split``, in a later step when the solve
  was left in flight);
- ``bench/<name>``: a benchmark's measured region (``benchmarks/``).

Device-side names come from ``jax.named_scope`` inside the jitted model code (``dit_solve``,
``vocoder``); a span is for host code around a program, not inside one.

When no trace is being recorded a span does no more than check that, and its metadata is
never formatted, so it can stay in the hot loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import jax

__all__ = ["scope"]


def scope(name: str, **metadata: object) -> AbstractContextManager[object]:
    """A span named ``name`` on the host timeline, e.g. ``with scope("thinker/decode", rows=8): ...``.

    ``metadata`` (numbers or short strings) is attached to the event and shown by the viewers.
    """
    return jax.profiler.TraceAnnotation(name, **metadata)
