"""Streamed Qwen3-Omni code2wav: requests decoded chunk by chunk as their code frames arrive.

Qwen3-Omni's code2wav is causal end to end (sliding-window transformer, causal ConvNet), so a
chunk needs no look-ahead: its new frames are decoded after up to ``left_context`` earlier ones
and only the new frames' samples are kept, as transformers' ``chunked_decode`` does. The first
chunk is smaller (``first_chunk``), so a request's first audio comes after a frame or a few
rather than a whole chunk: streaming from the first frame is what the model was built for.

:class:`FrameDecoder` holds each streamed request's frames and progress and runs the ready
chunks of up to ``max_batch`` requests in one call of
:func:`~omni_jax.models.qwen3_omni.code2wav.code2wav_chunk_compiled`, whatever their kinds
(first, middle, last). Shapes are closed: every window pads to ``left_context + chunk`` frames
and the rows to a count of :class:`~omni_jax.engine.generation_runner.SolveBuckets`, so
:meth:`FrameDecoder.warmup` compiles one program per row count and nothing compiles after.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.engine.generation_runner import PaddedBatch, SolveBuckets
from omni_jax.jit import StaticGraph
from omni_jax.models.qwen3_omni.code2wav import ChunkWindow
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import fetch

ChunkSolve = Callable[..., tuple[jax.Array, jax.Array]]
"""``solve(graph, state, codes [B, Q, W], context [B], frames [B]) -> (new samples [B, S], their
count [B])``: ``code2wav_chunk_compiled``'s signature."""


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Where a streamed request is cut: chunks of ``chunk`` new frames, the first of
    ``first_chunk``, each decoded after up to ``left_context`` earlier frames (the last chunk
    holds what is left)."""

    chunk: int
    first_chunk: int
    left_context: int

    def __post_init__(self) -> None:
        if self.chunk < 1 or not 1 <= self.first_chunk <= self.chunk or self.left_context < 0:
            raise ValueError(
                f"need chunk >= 1, 1 <= first_chunk <= chunk and left_context >= 0, got chunk={self.chunk}, "
                f"first_chunk={self.first_chunk}, left_context={self.left_context}"
            )

    @property
    def window_frames(self) -> int:
        """The widest window: a whole chunk after a whole context; every solve pads to it."""
        return self.left_context + self.chunk

    def window(self, start: int, available: int, finished: bool) -> ChunkWindow | None:
        """The chunk starting at frame ``start`` when ``available`` frames are there (all of the
        request's when ``finished``); ``None`` while it is not complete."""
        end = start + (self.first_chunk if start == 0 else self.chunk)
        if available < end:
            if not finished or available <= start:
                return None
            end = available
        return ChunkWindow(start, min(self.left_context, start), end)


@dataclasses.dataclass
class FrameStream:
    """A streamed request's state: its plan, the codes received so far (frame-major; a trailing
    partial frame waits for the rest), whether they are all, and the frames already voiced."""

    request_id: str
    plan: StreamPlan
    num_quantizers: int
    codes: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    voiced: int = 0

    @property
    def frames(self) -> int:
        """Whole frames received."""
        return len(self.codes) // self.num_quantizers

    def next_window(self) -> ChunkWindow | None:
        """The chunk to decode next, when it is ready."""
        return self.plan.window(self.voiced, self.frames, self.finished)

    def drained(self) -> bool:
        """Finished, and every frame voiced by an earlier chunk: nothing left to decode."""
        return self.finished and self.voiced == self.frames

    def window_codes(self, w: ChunkWindow) -> np.ndarray:
        """``[num_quantizers, w.frames]``: the window's codes, context first."""
        q = self.num_quantizers
        flat = np.asarray(self.codes[(w.start - w.context) * q : w.end * q], np.int32)
        return flat.reshape(w.frames, q).T


@dataclasses.dataclass
class FrameChunk:
    """A chunk's new audio (empty for a request that finished with every frame already voiced);
    ``last`` when the request has no more. ``error``: the chunk's solve failed (``audio`` is
    empty and the request is forgotten). The solve's seconds and requests: ``solve_s``,
    ``batch_size``."""

    request_id: str
    audio: np.ndarray
    last: bool
    solve_s: float = 0.0
    batch_size: int = 0
    error: str | None = None


@dataclasses.dataclass
class FrameBatch(PaddedBatch):
    """One chunk solve's inputs, padded (host arrays), in ``code2wav_chunk_compiled``'s order."""

    codes: np.ndarray
    context: np.ndarray
    frames: np.ndarray


class FrameDecoder:
    """Streamed requests: :meth:`add`, :meth:`extend` with codes as they come, :meth:`step`.

    ``solve`` is ``code2wav_chunk_compiled`` (or a stand-in with its signature); ``plan`` the
    stage's constants, whose chunk is the longest a request may ask for; ``mesh`` as for the
    :class:`~omni_jax.engine.generation_runner.GenerationRunner` (rows split over ``data``).
    """

    def __init__(
        self,
        solve: ChunkSolve,
        model: nnx.Module,
        plan: StreamPlan,
        *,
        num_quantizers: int,
        max_batch: int = 8,
        mesh: Mesh | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.solve = solve
        graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph(graphdef)
        self.plan = plan
        self.num_quantizers = num_quantizers
        self.max_batch = max_batch
        self.mesh = mesh
        self.buckets = SolveBuckets.build(max_batch, (plan.window_frames,), axis_size(mesh, "data"))
        self._requests: dict[str, FrameStream] = {}

    def plan_for(self, chunk: int | None) -> StreamPlan:
        """The plan of a request asking for ``chunk`` new frames per chunk (``None``: the
        stage's); its first chunk is the stage's, or the request's chunk when smaller.
        ``ValueError`` when ``chunk`` exceeds the stage's (its windows would not fit)."""
        if chunk is None:
            return self.plan
        if chunk > self.plan.chunk:
            raise ValueError(f"chunk_codes={chunk} exceeds the stage's chunk of {self.plan.chunk} frames")
        return dataclasses.replace(self.plan, chunk=chunk, first_chunk=min(self.plan.first_chunk, chunk))

    def add(self, request_id: str, chunk: int | None = None) -> FrameStream:
        """Start a streamed request (no codes yet) with :meth:`plan_for` ``(chunk)``."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already streaming")
        stream = FrameStream(request_id, self.plan_for(chunk), self.num_quantizers)
        self._requests[request_id] = stream
        return stream

    @property
    def num_streaming(self) -> int:
        """Requests added and not yet done: waiting for frames or with a chunk ready."""
        return len(self._requests)

    def extend(self, request_id: str, codes: Sequence[int], finished: bool = False) -> None:
        """Append ``codes`` (frame-major) to the request's; ``finished``: they were its last, so
        they must end on a whole frame."""
        stream = self._requests[request_id]
        if stream.finished:
            raise ValueError(f"request {request_id!r} has already finished")
        total = len(stream.codes) + len(codes)
        if finished and total % self.num_quantizers:
            raise ValueError(
                f"{total} codec ids are not whole frames of {self.num_quantizers} codes "
                "(frame-major: each frame's codes consecutive)"
            )
        if finished and not total:
            raise ValueError(f"request {request_id!r} finished without a frame to voice")
        stream.codes.extend(int(c) for c in codes)
        stream.finished = finished

    def remove(self, request_id: str) -> bool:
        """Forget a request (aborted); ``False`` when it is not streaming."""
        return self._requests.pop(request_id, None) is not None

    def ready(self) -> list[tuple[FrameStream, ChunkWindow]]:
        """Each request's next chunk when ready, oldest request first."""
        pairs = ((s, s.next_window()) for s in self._requests.values())
        return [(s, w) for s, w in pairs if w is not None]

    def has_work(self) -> bool:
        return any(s.drained() or s.next_window() is not None for s in self._requests.values())

    def step(self) -> list[FrameChunk]:
        """Requests that finished with nothing left to decode end (empty audio); then one
        solve: the next chunk of each of the oldest ``max_batch`` requests with one ready."""
        outputs = []
        for stream in [s for s in self._requests.values() if s.drained()]:
            del self._requests[stream.request_id]
            outputs.append(FrameChunk(stream.request_id, np.zeros(0, np.float32), True))
        ready = self.ready()[: self.max_batch]
        return outputs + (self.run(ready) if ready else [])

    def run(self, ready: Sequence[tuple[FrameStream, ChunkWindow]]) -> list[FrameChunk]:
        """One padded solve of ``ready`` chunks, each request advanced by its chunk.

        As in :meth:`~omni_jax.engine.generation_runner.GenerationRunner.run`, a device failure
        is retried one request at a time and a row with non-finite audio fails alone: a failed
        request gets an ``error`` chunk and is forgotten, the others go on.
        """
        batch = self.pad(ready, self.buckets.rows_for(len(ready)))
        t0 = time.perf_counter()
        try:
            wave, kept = self.solve(self.graph, self.state, *batch.arrays(self.mesh))
            wave, kept = fetch(wave), fetch(kept)
        except jax.errors.JaxRuntimeError as e:
            if len(ready) > 1:
                return [out for pair in ready for out in self.run([pair])]
            return [self._fail(ready[0][0], f"solve failed: {e}", time.perf_counter() - t0, 1)]
        dt = time.perf_counter() - t0
        outputs = []
        for i, (stream, w) in enumerate(ready):
            audio = wave[i, : kept[i]]
            if not np.isfinite(audio).all():
                bad = int((~np.isfinite(audio)).sum())
                error = f"non-finite waveform ({bad} of {audio.size} samples)"
                outputs.append(self._fail(stream, error, dt, len(ready)))
                continue
            stream.voiced = w.end
            last = stream.drained()
            if last:
                del self._requests[stream.request_id]
            outputs.append(FrameChunk(stream.request_id, audio.copy(), last, dt, len(ready)))
        return outputs

    def _fail(self, stream: FrameStream, error: str, solve_s: float, rows: int) -> FrameChunk:
        del self._requests[stream.request_id]
        return FrameChunk(stream.request_id, np.zeros(0, np.float32), True, solve_s, rows, error)

    def pad(self, ready: Sequence[tuple[FrameStream, ChunkWindow]], rows: int) -> FrameBatch:
        """``ready`` windows in the first rows of a ``rows``-row solve, right-padded to the plan's
        window (every stage is causal, so padding changes no kept sample); a row with no chunk
        has no frames and keeps nothing."""
        batch = FrameBatch(
            codes=np.zeros((rows, self.num_quantizers, self.plan.window_frames), np.int32),
            context=np.zeros(rows, np.int32),
            frames=np.zeros(rows, np.int32),
        )
        for i, (stream, w) in enumerate(ready):
            batch.codes[i, :, : w.frames] = stream.window_codes(w)
            batch.context[i] = w.context
            batch.frames[i] = w.frames
        return batch

    def warmup(self) -> int:
        """Compile the program of every row count; returns how many."""
        for rows in self.buckets.rows:
            out, _ = self.solve(self.graph, self.state, *self.pad([], rows).arrays(self.mesh))
            jax.block_until_ready(out)
        return len(self.buckets.rows)
