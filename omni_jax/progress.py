"""Progress bars: ``OmniJaxPipeline.run``'s requests (requests done, output tokens per second,
and a note while XLA compiles) and ``OmniJaxPipeline.warmup``'s stages (XLA compilations so far).

A run's first requests of each shape wait on XLA compilations, which can take far longer than
the steps themselves, with nothing else moving on screen; the bar says so while it happens and
how many programs were compiled, counted by the engine's
:class:`~omni_jax.engine.compilation.CompileCounter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Self

from tqdm.auto import tqdm

from omni_jax.engine.compilation import CompileCounter


def loaded(counter: CompileCounter) -> str:
    """``", N loaded from the cache"`` when JAX's persistent cache gave programs instead of XLA
    compiling them (a warm start compiles few or none: the bar must not look stuck), else ``""``."""
    return f", {counter.loads} loaded from the cache" if counter.loads else ""


class _CountingBar:
    """A tqdm bar with a :class:`CompileCounter` active while it is open (none when disabled)."""

    def __init__(self, bar: tqdm, on_count: Callable[[CompileCounter], None], enabled: bool):
        self._bar = bar
        self._counter = CompileCounter(on_count=on_count) if enabled else None

    def __enter__(self) -> Self:
        self._bar.__enter__()
        if self._counter is not None:
            self._counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._counter is not None:
            self._counter.__exit__(*exc)
        self._bar.__exit__(*exc)


class RequestsBar(_CountingBar):
    """``with RequestsBar(n, enabled) as bar``: :meth:`request_done` per finished request,
    :meth:`step_done` after every stage step (the end of any compilation it waited on)."""

    def __init__(self, total: int, enabled: bool):
        bar = tqdm(total=total, desc="requests", unit="req", disable=not enabled)
        super().__init__(bar, self._compiling, enabled)
        self._t0 = time.perf_counter()
        self._tokens = 0
        self._noting = False

    def _compiling(self, counter: CompileCounter) -> None:
        """A trace just ended (its program is being compiled) or a compilation just did."""
        self._noting = True
        self._bar.set_postfix_str(f"compiling XLA programs ({counter.compiles} compiled{loaded(counter)})")

    def _show_rate(self) -> None:
        """Output tokens per second once a request has finished, and the programs compiled."""
        parts = []
        if self._bar.n:
            parts.append(f"tok_s={self._tokens / max(time.perf_counter() - self._t0, 1e-9):.1f}")
        if self._counter is not None and self._counter.compiles:
            parts.append(f"compiled={self._counter.compiles}")
        if self._counter is not None and self._counter.loads:
            parts.append(f"loaded={self._counter.loads}")
        self._bar.set_postfix_str(", ".join(parts))

    def step_done(self) -> None:
        if self._noting:
            self._noting = False
            self._show_rate()

    def request_done(self, tokens: int) -> None:
        """One more request finished; ``tokens``: AR tokens generated so far."""
        self._tokens = tokens
        self._bar.update(1)
        self._show_rate()


class WarmupBar(_CountingBar):
    """``with WarmupBar(stage names, enabled) as bar``: :meth:`stage_done` after each stage's
    warm-up; the bar names the stage compiling and counts XLA compilations as they finish (a
    large stage's warm-up is minutes of compiling on a GPU, with nothing else on screen)."""

    def __init__(self, names: list[str], enabled: bool):
        self._names = names
        bar = tqdm(total=len(names), desc="warm-up", unit="stage", disable=not enabled)
        super().__init__(bar, self._show, enabled)
        if self._counter is not None:
            self._show(self._counter)

    def _show(self, counter: CompileCounter) -> None:
        stage = self._names[min(self._bar.n, len(self._names) - 1)] if self._names else ""
        self._bar.set_postfix_str(f"{stage}: {counter.compiles} XLA programs compiled{loaded(counter)}")

    def stage_done(self) -> None:
        self._bar.update(1)
        if self._counter is not None:
            self._show(self._counter)
