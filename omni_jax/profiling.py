"""Named host-side spans for ``jax.profiler`` traces (``benchmarks.run --profile DIR``).

A span marks a phase of the serving loop on the host timeline of a trace (Perfetto, TensorBoard,
XProf), so the time between device programs is attributed to a phase: scheduling, padding,
dispatch, waiting for a result, splitting outputs. Names are ``"<component>/<phase>"``, e.g.
``"code2wav/pad"``, ``"code2wav/solve"``, ``"scheduler/schedule"``, ``"ar/prefill"``,
``"ar/decode"``. Device-side names come from ``jax.named_scope`` inside the jitted model code
(``dit_solve``, ``vocoder``); a span is for host code around a program, not inside one.

When no trace is being recorded a span costs well under a microsecond and its metadata is never
formatted, so it can stay in the hot loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import jax

__all__ = ["scope", "step", "tracing"]


def scope(name: str, **metadata: object) -> AbstractContextManager[object]:
    """A span named ``name`` on the host timeline, e.g. ``with scope("ar/decode", rows=8): ...``.

    ``metadata`` (numbers or short strings) is attached to the event and shown by the viewers.
    """
    return jax.profiler.TraceAnnotation(name, **metadata)


def step(name: str, step_num: int, **metadata: object) -> AbstractContextManager[object]:
    """A span that marks one engine step (``"<name> <step_num>"``); XProf's step analysis uses these."""
    return jax.profiler.StepTraceAnnotation(name, step_num=step_num, **metadata)


def tracing() -> bool:
    """Whether a trace is being recorded now (to skip building costly metadata otherwise)."""
    return bool(jax.profiler.TraceAnnotation.is_enabled())
