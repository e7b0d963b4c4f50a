"""What one more solve costs, read off the solves a runner has already timed.

A generation runner's solve takes about ``a + b * padded rows x length`` seconds. How requests
should be split into solves depends on ``a / b``: where a solve is compute-bound ``a`` is near
nothing, so requests of different lengths are best solved apart (padding is paid in full);
where a solve of eight short requests costs little more than one, ``a`` is most of a solve and
they are best solved together. Rather than a constant tuned for one device, the runner fits
``a`` and ``b`` to its own timings and splits by the ratio.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SAMPLES = 64
"""Shapes kept for the fit (the most recently timed)."""

MIN_OVERHEAD = 1.0
"""A solve is never free: at least one cell (a row's length unit), so that splits which pad the
same go to fewer solves."""


class Fit(NamedTuple):
    """The timed solves (each shape's padded ``cells`` and fastest ``seconds``) and the line
    through them, ``(slope, intercept)``; ``None`` until two sizes were timed."""

    cells: np.ndarray
    seconds: np.ndarray
    line: tuple[float, float] | None


class SolveCost:
    """A running least-squares fit of solve seconds against padded rows x length (cells).

    Only a shape's second and later solves count: without warm-up its first one includes
    compiling. A shape's fastest time stands for it (timings on a shared host are only ever too
    slow).
    """

    def __init__(self, cap: float):
        """``cap``: the largest overhead to report, in cells (a whole batch of the longest
        requests: past it every split is one solve anyway)."""
        self.cap = cap
        self._compiled: set[tuple[int, ...]] = set()
        self._best: dict[tuple[int, ...], tuple[int, float]] = {}
        self._fitted: Fit | None = None  # of _best as it is; None: refit when next read

    def record(self, shape: tuple[int, ...], cells: int, seconds: float) -> None:
        """One solve of program ``shape`` over ``cells`` padded rows x length took ``seconds``."""
        if shape not in self._compiled:
            self._compiled.add(shape)
            return
        best = self._best.pop(shape, (cells, seconds))
        self._best[shape] = (cells, min(best[1], seconds))  # re-inserted: the most recent last
        while len(self._best) > SAMPLES:
            self._best.pop(next(iter(self._best)))
        self._fitted = None

    def _fit(self) -> Fit:
        """The fit of the solves timed so far, made once per new timing (every step of a
        streamed decoder reads it)."""
        if self._fitted is None:
            cells = np.array([n for n, _ in self._best.values()], np.float64)
            seconds = np.array([t for _, t in self._best.values()], np.float64)
            line = None
            if len(np.unique(cells)) >= 2:
                slope, intercept = np.polyfit(cells, seconds, 1)
                line = (float(slope), float(intercept))
            self._fitted = Fit(cells, seconds, line)
        return self._fitted

    def overhead(self) -> float:
        """``a / b``: one more solve's cost in padded cells, at least :data:`MIN_OVERHEAD`
        (all it is until two sizes were timed: solves then follow the length buckets, as padding
        costs in full); :attr:`cap` when a larger solve was not measurably slower."""
        line = self._fit().line
        if line is None:
            return MIN_OVERHEAD
        slope, intercept = line
        if slope <= 0:
            return self.cap
        return float(min(max(intercept / slope, MIN_OVERHEAD), self.cap))

    def seconds(self, cells: float) -> float | None:
        """What a solve of ``cells`` padded cells is expected to take, erring long: the fitted line
        once two sizes were timed (never under the fastest solve timed, never over the slowest
        when a larger solve was not measurably slower), one size's time scaled up by the cells
        past it (never down: how much of it is fixed is unknown); ``None`` before a solve was
        timed. A streamed chunk waits for others only while its audio still to play covers
        this, so a guess that runs long only ends a wait sooner."""
        fit = self._fit()
        if not len(fit.seconds):
            return None
        if fit.line is None:
            return float(fit.seconds.max() * max(1.0, cells / fit.cells.max()))
        slope, intercept = fit.line
        if slope <= 0:
            return float(fit.seconds.max())
        return float(max(intercept + slope * cells, fit.seconds.min()))
