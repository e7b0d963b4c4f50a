"""A code2wav runner with no model: its solve returns silence of the right length and records
each call's code lengths, so tests of grouping and bucketing see which shapes the runner asks
for without compiling anything; solves whose outputs a test says are not finished yet, for the
solves a step leaves in flight."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flax import nnx

from omni_jax.engine.generation_runner import GenerationRunner
from omni_jax.engine.solve_cost import SolveCost
from omni_jax.stages.chunk_loop import StreamedDecoder
from omni_jax.stages.code2wav_batch import Code2WavBatch, Code2WavRequest, SolveGeometry, code2wav_runner

REPEATS = 2
"""Mel frames per code, as the tiny DiT's."""


class _NoWeights(nnx.Module):
    pass


def stand_in_code2wav_runner(
    calls: list[list[int]] | None = None,
    *,
    samples_per_frame: int,
    max_codes: int,
    max_batch: int = 8,
    max_solve_codes: int | None = None,
) -> GenerationRunner[Code2WavRequest, Code2WavBatch]:
    """The runner of :func:`~omni_jax.stages.code2wav_batch.code2wav_runner` over a stand-in
    solve: zeros, ``samples_per_frame`` a mel frame; each call's code lengths (padding rows
    included) appended to ``calls`` when given."""

    def solve(graph, state, codes, code_lengths, *rest):  # noqa: ANN001, ANN002, ANN202 - a stand-in
        lengths = np.asarray(code_lengths)
        if calls is not None:
            calls.append(lengths.tolist())
        wave = np.zeros((codes.shape[0], codes.shape[1] * REPEATS * samples_per_frame), np.float32)
        return wave, lengths * REPEATS * samples_per_frame

    geometry = SolveGeometry(repeats=REPEATS, mel_dim=4, speaker_dim=3, max_codes=max_codes)
    return code2wav_runner(
        solve,
        _NoWeights(),
        geometry,
        reference_frames=5,
        max_batch=max_batch,
        max_solve_codes=max_solve_codes,
    )


def rows_nearly_free(cost: SolveCost, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cost``'s fitted overhead of one more solve at its cap, as where a solve's rows cost next
    to nothing (an accelerator): requests, and ready streamed chunks, share one solve whatever
    this CPU's timings, which the fit follows (and which test workers load)."""
    monkeypatch.setattr(cost, "overhead", lambda: cost.cap)


@dataclasses.dataclass
class Clock:
    """A streamed decoder's clock, standing still until the test moves it (``now``)."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def on_an_accelerator(decoder: StreamedDecoder, monkeypatch: pytest.MonkeyPatch, solve_s: float) -> Clock:
    """``decoder`` as on an accelerator whose solves take ``solve_s`` whatever their rows
    (:func:`rows_nearly_free`, and :meth:`SolveCost.seconds
    <omni_jax.engine.solve_cost.SolveCost.seconds>` says so without timed solves), timing its
    listeners by the returned clock: whether a ready chunk waits for others
    (:meth:`StreamedDecoder.gathering`) then depends on the test's steps alone, not on this CPU's
    timings."""
    rows_nearly_free(decoder.cost, monkeypatch)
    monkeypatch.setattr(decoder.cost, "seconds", lambda cells: solve_s)
    clock = Clock()
    monkeypatch.setattr(decoder, "clock", clock)
    return clock


class Gate:
    """Whether the device has finished the solves :class:`Held` behind it (the test says)."""

    open = False


@dataclasses.dataclass
class Held:
    """A solve's output that reports itself unfinished until its gate opens (as
    ``jax.Array.is_ready`` does), read through numpy as the array it holds."""

    value: Any
    gate: Gate

    def is_ready(self) -> bool:
        return self.gate.open

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.value, dtype)


def held(solve: Callable[..., tuple[Any, ...]], gate: Gate) -> Callable[..., tuple[Held, ...]]:
    """``solve`` whose outputs are :class:`Held` behind ``gate``."""
    return lambda *args, **kwargs: tuple(Held(x, gate) for x in solve(*args, **kwargs))
