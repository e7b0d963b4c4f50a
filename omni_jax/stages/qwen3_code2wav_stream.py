"""Streamed Qwen3-Omni code2wav: requests decoded chunk by chunk as their code frames arrive.

Qwen3-Omni's code2wav is causal end to end (sliding-window transformer, causal ConvNet), so a
chunk needs no look-ahead: its new frames are decoded after up to ``left_context`` earlier ones
and only the new frames' samples are kept, as transformers' ``chunked_decode`` does, with one
difference: a chunk also keeps the samples its predecessor fell short by at its end
(:func:`~omni_jax.models.qwen3_omni.code2wav.decode_chunk`'s ``join``), which ``chunked_decode``
skips, a gap at every join that a listener hears (its length: benchmarks/RESULTS.md, "Qwen3-Omni
streamed audio without gaps"), so here the chunks join without one and add up to the whole
decode's length. The first
chunk is smaller (``first_chunk``), so a request's first audio comes after a frame or a few
rather than a whole chunk: streaming from the first frame is what the model was built for. The
chunks after it double from twice its frames while they are below ``chunk`` (the ramp,
:attr:`StreamPlan.ramp`), so that a talker twice as fast as real time keeps playback fed: a
one-frame first chunk followed at once by 25 frames left a listener waiting for the second on a
GPU (benchmarks/RESULTS.md, seventh GPU session). Later chunks may double up
to ``max_chunk``, so the context decoded again becomes a small share of the work
(:mod:`omni_jax.chunk_growth`). The ramp's chunks, with what context precedes them, fit the
window of a whole context before a ``chunk``: they add solves, not programs.

:class:`FrameDecoder` holds each streamed request's frames and progress and runs the ready
chunks of up to ``max_batch`` requests in one call of
:func:`~omni_jax.models.qwen3_omni.code2wav.code2wav_chunk_compiled`, whatever their kinds
(first, middle, last), through :class:`~omni_jax.stages.chunk_loop.StreamedDecoder`'s loop.
Shapes are closed: a solve's windows pad to the smallest of :attr:`StreamPlan.windows` that
holds them: the first chunk's frames when it holds only first chunks (a one-frame first chunk
then decodes one frame, not a whole chunk after its context), else a whole context before a
chunk of each size, and the rows to a count of
:class:`~omni_jax.engine.generation_runner.SolveBuckets`, so :meth:`FrameDecoder.warmup`
compiles one program per (row count, window) and nothing compiles after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.chunk_growth import doubling, grown_size
from omni_jax.engine.compilation import ProgramCall
from omni_jax.engine.generation_runner import PaddedBatch
from omni_jax.models.qwen3_omni.code2wav import ChunkWindow
from omni_jax.parallel.rules import fetch
from omni_jax.stages.chunk_loop import StreamedDecoder, StreamState

ChunkSolve = Callable[..., tuple[jax.Array, jax.Array]]
"""``solve(graph, state, codes [B, Q, W], context [B], frames [B], *, join) -> (new samples [B, S],
their count [B])``: ``code2wav_chunk_compiled``'s signature (streamed chunks pass ``join=True``)."""


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Where a streamed request is cut: a first chunk of ``first_chunk`` new frames, the
    :attr:`ramp` up to ``chunk``, then chunks of ``chunk`` doubling up to ``max_chunk``
    (``None``: ``chunk`` throughout, vLLM-omni's schedule after its first chunk;
    :func:`~omni_jax.chunk_growth.doubling` says why they grow), each decoded after up to
    ``left_context`` earlier frames (the last chunk holds what is left)."""

    chunk: int
    first_chunk: int
    left_context: int
    max_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.chunk < 1 or not 1 <= self.first_chunk <= self.chunk or self.left_context < 0:
            raise ValueError(
                f"need chunk >= 1, 1 <= first_chunk <= chunk and left_context >= 0, got chunk={self.chunk}, "
                f"first_chunk={self.first_chunk}, left_context={self.left_context}"
            )
        if self.largest_chunk < self.chunk:
            raise ValueError(f"max_chunk={self.max_chunk} must be at least chunk={self.chunk}")

    @property
    def largest_chunk(self) -> int:
        """The most new frames a chunk decodes: ``max_chunk``, or ``chunk``."""
        return self.chunk if self.max_chunk is None else self.max_chunk

    @property
    def growing(self) -> list[int]:
        """The new frames of chunks ``1, 2, ...`` while they are smaller than the largest (empty
        when chunks do not grow)."""
        return doubling(self.chunk, self.largest_chunk)

    @property
    def ramp(self) -> list[int]:
        """The new frames of chunks ``1, 2, ...`` between the first and ``chunk``: twice the
        first, doubling while below ``chunk`` (empty when the first is half of it or more). No
        chunk then asks for more than twice the frames voiced before it, so a talker twice as
        fast as real time keeps playback fed from the first frame on."""
        return doubling(2 * self.first_chunk, self.chunk)

    def chunk_size(self, index: int) -> int:
        """The new frames of chunk ``index`` when it is not the last."""
        ramp = self.ramp
        if 1 <= index <= len(ramp):
            return ramp[index - 1]
        return grown_size(max(0, index - len(ramp)), self.first_chunk, self.chunk, self.largest_chunk)

    @property
    def window_frames(self) -> int:
        """The widest window: a largest chunk after a whole context."""
        return self.left_context + self.largest_chunk

    @property
    def windows(self) -> list[int]:
        """The windows a solve pads to, shortest first: the first chunk's (no context) and a
        whole context before a chunk of each size, so a solve of small chunks need not pay for
        the largest window."""
        later = (self.left_context + size for size in [*self.growing, self.largest_chunk])
        return sorted({self.first_chunk, *later})

    def with_chunk(self, chunk: int) -> StreamPlan:
        """This plan with every chunk after the first and its ramp of ``chunk`` frames (none grow;
        the first no longer than them): a request's own ``chunk_codes``, which its caller keeps within
        :attr:`largest_chunk` (the windows must hold it)."""
        return dataclasses.replace(
            self, chunk=chunk, first_chunk=min(self.first_chunk, chunk), max_chunk=None
        )

    def window(self, index: int, start: int, available: int, finished: bool) -> ChunkWindow | None:
        """Chunk ``index``, starting at frame ``start``, when ``available`` frames are there (all
        of the request's when ``finished``); ``None`` while it is not complete."""
        end = start + self.chunk_size(index)
        if available < end:
            if not finished or available <= start:
                return None
            end = available
        return ChunkWindow(start, min(self.left_context, start), end)


@dataclasses.dataclass
class FrameStream(StreamState):
    """A streamed request's state: its plan, the codes received so far (frame-major; a trailing
    partial frame waits for the rest), whether they are all, and the frames already voiced."""

    plan: StreamPlan
    num_quantizers: int
    voiced: int = 0

    @property
    def frames(self) -> int:
        """Whole frames received."""
        return len(self.codes) // self.num_quantizers

    def next_window(self) -> ChunkWindow | None:
        """The chunk to decode next, when it is ready."""
        return self.plan.window(self.done, self.voiced, self.frames, self.finished)

    def drained(self) -> bool:
        """Finished, and every frame voiced by an earlier chunk: nothing left to decode."""
        return self.finished and self.voiced == self.frames

    def window_codes(self, w: ChunkWindow) -> np.ndarray:
        """``[num_quantizers, w.frames]``: the window's codes, context first."""
        q = self.num_quantizers
        flat = np.asarray(self.codes[(w.start - w.context) * q : w.end * q], np.int32)
        return flat.reshape(w.frames, q).T


@dataclasses.dataclass
class FrameBatch(PaddedBatch):
    """One chunk solve's inputs, padded (host arrays), in ``code2wav_chunk_compiled``'s order."""

    codes: np.ndarray
    context: np.ndarray
    frames: np.ndarray


class FrameSolved(NamedTuple):
    """One chunk solve's host results: ``wave [B, samples]`` and each row's ``kept`` samples."""

    wave: np.ndarray
    kept: np.ndarray


class FrameDecoder(StreamedDecoder[FrameStream, ChunkWindow, FrameBatch, FrameSolved]):
    """Streamed requests: :meth:`add`, :meth:`extend` with codes as they come, :meth:`step`.

    ``solve`` is ``code2wav_chunk_compiled`` (or a stand-in with its signature); ``plan`` the
    stage's constants, whose chunk is the longest a request may ask for; ``sample_rate`` the
    waveform's; ``mesh`` as for the
    :class:`~omni_jax.engine.generation_runner.GenerationRunner` (rows split over ``data``).
    """

    unit = "frame"

    def __init__(
        self,
        solve: ChunkSolve,
        model: nnx.Module,
        plan: StreamPlan,
        *,
        num_quantizers: int,
        sample_rate: int,
        max_batch: int = 8,
        mesh: Mesh | None = None,
    ):
        super().__init__(model, windows=plan.windows, max_batch=max_batch, mesh=mesh, sample_rate=sample_rate)
        self.solve = solve
        self.plan = plan
        self.num_quantizers = num_quantizers

    def plan_for(self, chunk: int | None) -> StreamPlan:
        """The plan of a request asking for ``chunk`` new frames per chunk (``None``: the
        stage's); its first chunk is the stage's, or the request's chunk when smaller.
        ``ValueError`` when ``chunk`` exceeds the stage's largest (its windows would not fit)."""
        if chunk is None:
            return self.plan
        if chunk > self.plan.largest_chunk:
            raise ValueError(
                f"chunk_codes={chunk} exceeds the stage's largest chunk of {self.plan.largest_chunk} frames"
            )
        return self.plan.with_chunk(chunk)

    def add(self, request_id: str, chunk: int | None = None) -> FrameStream:
        """Start a streamed request (no codes yet) with :meth:`plan_for` ``(chunk)``."""
        return self._start(FrameStream(request_id, self.plan_for(chunk), self.num_quantizers))

    def check_codes(self, request: FrameStream, codes: Sequence[int], finished: bool) -> None:
        """The last codes (frame-major) must end on a whole frame."""
        total = len(request.codes) + len(codes)
        if finished and total % self.num_quantizers:
            raise ValueError(
                f"{total} codec ids are not whole frames of {self.num_quantizers} codes "
                "(frame-major: each frame's codes consecutive)"
            )

    def next_window(self, request: FrameStream) -> ChunkWindow | None:
        return request.next_window()

    def drained(self, request: FrameStream) -> bool:
        return request.drained()

    def short_of(self, request: FrameStream) -> int | None:
        if request.finished:
            return None
        end = request.voiced + request.plan.chunk_size(request.done)
        return max(0, end - request.frames) or None

    def width(self, chunk: ChunkWindow) -> int:
        """Frames the chunk decodes, its context included (a first chunk has none)."""
        return chunk.frames

    def program(self, batch: FrameBatch) -> ProgramCall:
        return ProgramCall(self.solve, (self.graph, self.state, *batch.arrays(self.mesh)), {"join": True})

    def fetched(self, outputs: tuple[jax.Array, jax.Array]) -> FrameSolved:
        wave, kept = outputs
        return FrameSolved(fetch(wave), fetch(kept))

    def emitted(self, solved: FrameSolved, row: int, chunk: ChunkWindow) -> np.ndarray:
        return solved.wave[row, : solved.kept[row]]

    def advance(self, request: FrameStream, chunk: ChunkWindow, solved: FrameSolved, row: int) -> bool:
        """The chunk's frames are voiced; the request is done when it finished and nothing is left."""
        request.voiced = chunk.end
        return request.drained()

    def pad(self, ready: Sequence[tuple[FrameStream, ChunkWindow]], rows: int, window: int) -> FrameBatch:
        """``ready`` windows in the first rows of a ``rows``-row solve, right-padded to ``window``
        frames (every stage is causal, so padding changes no kept sample), each joining its
        request's previous chunk without a gap; a row with no chunk has no frames and keeps
        nothing."""
        batch = FrameBatch(
            codes=np.zeros((rows, self.num_quantizers, window), np.int32),
            context=np.zeros(rows, np.int32),
            frames=np.zeros(rows, np.int32),
        )
        for i, (stream, w) in enumerate(ready):
            batch.codes[i, :, : w.frames] = stream.window_codes(w)
            batch.context[i] = w.context
            batch.frames[i] = w.frames
        return batch
