"""Streamed code2wav: requests decoded chunk by chunk as their codes arrive, several per solve.

:class:`ChunkedDecoder` holds each streamed request's progress (codes so far, chunks done, the
vocoder prefix its next chunk needs, its noise) and runs the ready chunks of up to ``max_batch``
requests in one call of :func:`~omni_jax.models.qwen2_5_omni.token2wav_chunk.token2wav_chunk_compiled`,
whatever their kinds. Where a request is cut is the
:class:`~omni_jax.models.qwen2_5_omni.chunk_plan.ChunkPlanner`'s business.

Shapes are closed: every solve pads to the planner's window (``past + chunk + future`` frames)
and vocoder input (``2 * overlap + chunk + future`` frames), the voices' one reference length,
and a row count from :class:`~omni_jax.engine.generation_runner.SolveBuckets`; :meth:`warmup`
compiles one program per row count, after which nothing compiles.

Noise is batch-invariant: a request's rows are those of ``default_rng(seed).standard_normal``,
drawn as its windows reach them, so a chunk's noise is a function of the seed and the chunk's
frames only, and the rows of a whole request are exactly the offline solve's
(:meth:`~omni_jax.stages.code2wav_batch.Code2WavPadder.initial_noise`).
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
from omni_jax.models.qwen2_5_omni.chunk_plan import Chunk, ChunkKind, ChunkPlanner
from omni_jax.parallel.distributed import random_seed
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import fetch
from omni_jax.stages.code2wav_params import Token2WavParams

ChunkSolve = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
"""``solve(graph, state, *ChunkBatch arrays, keep_frames=...) -> (waveform, valid samples, tail)``:
``token2wav_chunk_compiled``'s signature."""


@dataclasses.dataclass
class NoiseRows:
    """One request's initial noise, rows ``[first, first + len(rows))`` of the sequence
    ``default_rng(seed).standard_normal((n, mel_dim), float32)`` gives for any ``n``.

    Rows are drawn as windows reach them (numpy's draw is prefix-stable: drawing ``a`` rows and
    then ``b`` gives the rows of one draw of ``a + b``) and dropped once behind every later
    window (window starts never decrease)."""

    generator: np.random.Generator
    rows: np.ndarray
    first: int = 0

    @classmethod
    def of(cls, seed: int, mel_dim: int) -> NoiseRows:
        return cls(np.random.default_rng(seed), np.zeros((0, mel_dim), np.float32))

    def window(self, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)`` ``[end - start, mel_dim]``; rows before ``start`` are dropped."""
        if start < self.first:
            raise ValueError(f"noise rows from {start} were dropped (kept from {self.first})")
        have = self.first + len(self.rows)
        if end > have:
            more = self.generator.standard_normal((end - have, self.rows.shape[1]), dtype=np.float32)
            self.rows = np.concatenate([self.rows, more])
        self.rows, self.first = self.rows[start - self.first :], start
        return self.rows[: end - start]


@dataclasses.dataclass
class StreamRequest:
    """A streamed request's state: its voice and settings, the codes received so far and
    whether they are all, the chunks done, the vocoder prefix of its next chunk."""

    request_id: str
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    params: Token2WavParams
    planner: ChunkPlanner
    seed: int
    noise: NoiseRows
    codes: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    done: int = 0
    tail: np.ndarray | None = None

    def next_chunk(self) -> Chunk | None:
        """The chunk to run next, when it is ready."""
        ready = self.planner.ready(len(self.codes), self.finished, self.done)
        return ready[0] if ready else None


@dataclasses.dataclass
class ChunkOutput:
    """A chunk's emitted audio (samples ``[chunk.offset, chunk.offset + len(audio))`` of its
    request's waveform); ``last`` when the request has no more. ``error``: the chunk's solve
    failed (``audio`` is then empty and the request is forgotten: it has no more). The solve's
    seconds and requests: ``solve_s``, ``batch_size``."""

    request_id: str
    chunk: Chunk
    audio: np.ndarray
    last: bool
    solve_s: float = 0.0
    batch_size: int = 1
    error: str | None = None


@dataclasses.dataclass
class ChunkBatch(PaddedBatch):
    """One chunk solve's inputs, padded (host arrays), in ``token2wav_chunk_compiled``'s order."""

    codes: np.ndarray
    code_lengths: np.ndarray
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    reference_lengths: np.ndarray
    initial_noise: np.ndarray
    prev_tail: np.ndarray
    prefix_len: np.ndarray
    keep_lo: np.ndarray
    keep_len: np.ndarray
    num_steps: np.ndarray
    guidance_scale: np.ndarray
    sway_coefficient: np.ndarray


class ChunkedDecoder:
    """Streamed requests: :meth:`add`, :meth:`extend` with codes as they come, :meth:`step`.

    ``solve`` is ``token2wav_chunk_compiled`` (or a stand-in with its signature); ``planner`` the
    stage's constants, whose chunk is the longest a request may ask for (``chunk_codes``);
    ``speaker_dim`` the voices' vector width, ``reference_frames`` their longest reference mel
    (every one pads to it); ``mesh`` as for the
    :class:`~omni_jax.engine.generation_runner.GenerationRunner`.
    """

    def __init__(
        self,
        solve: ChunkSolve,
        model: nnx.Module,
        planner: ChunkPlanner,
        *,
        mel_dim: int,
        speaker_dim: int,
        reference_frames: int,
        max_batch: int = 8,
        mesh: Mesh | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.solve = solve
        graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph(graphdef)
        self.planner = planner
        self.mel_dim = mel_dim
        self.speaker_dim = speaker_dim
        self.reference_frames = reference_frames
        self.max_batch = max_batch
        self.mesh = mesh
        self.window_codes = planner.window_frames // planner.repeats
        self.buckets = SolveBuckets.build(max_batch, (self.window_codes,), axis_size(mesh, "data"))
        self._requests: dict[str, StreamRequest] = {}

    def add(
        self,
        request_id: str,
        speaker_embedding: np.ndarray,
        reference_mel: np.ndarray,
        params: Token2WavParams,
    ) -> StreamRequest:
        """Start a streamed request (no codes yet). ``ValueError`` when its ``chunk_codes`` does
        not suit the model or exceeds the stage's chunk, or its reference mel is too long."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already streaming")
        if len(reference_mel) > self.reference_frames:
            raise ValueError(
                f"request {request_id!r}: reference mel of {len(reference_mel)} frames, more than "
                f"the {self.reference_frames} a solve holds"
            )
        if params.initial_noise is not None:
            raise ValueError(f"request {request_id!r}: a streamed request draws its noise from a seed")
        try:
            planner = self.plan(params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        seed = params.seed if params.seed is not None else random_seed()
        request = StreamRequest(
            request_id,
            np.asarray(speaker_embedding, np.float32),
            np.asarray(reference_mel, np.float32),
            params,
            planner,
            seed,
            NoiseRows.of(seed, self.mel_dim),
        )
        self._requests[request_id] = request
        return request

    def plan(self, params: Token2WavParams) -> ChunkPlanner:
        """The planner of a request with ``params``: the stage's, its chunk ``chunk_codes`` when
        given. ``ValueError`` when ``chunk_codes`` exceeds the stage's chunk or breaks the
        algorithm (not a multiple of the DiT block in codes, shorter than two overlaps)."""
        planner = self.planner
        if params.chunk_codes is None:
            return planner
        frames = params.chunk_codes * planner.repeats
        if frames > planner.chunk:
            raise ValueError(
                f"chunk_codes={params.chunk_codes} exceeds the stage's chunk of "
                f"{planner.chunk // planner.repeats} codes"
            )
        try:
            return dataclasses.replace(planner, chunk=frames)
        except ValueError as e:
            raise ValueError(f"chunk_codes={params.chunk_codes}: {e}") from None

    @property
    def num_streaming(self) -> int:
        """Requests added and not yet done: waiting for codes or with a chunk ready."""
        return len(self._requests)

    def extend(self, request_id: str, codes: Sequence[int], finished: bool = False) -> None:
        """Append ``codes`` to the request's; ``finished``: they were its last."""
        request = self._requests[request_id]
        if request.finished:
            raise ValueError(f"request {request_id!r} has already finished")
        if finished and not request.codes and len(codes) == 0:
            raise ValueError(f"request {request_id!r} finished without a code to voice")
        request.codes.extend(int(c) for c in codes)
        request.finished = finished

    def remove(self, request_id: str) -> bool:
        """Forget a request (aborted); ``False`` when it is not streaming."""
        return self._requests.pop(request_id, None) is not None

    def ready(self) -> list[tuple[StreamRequest, Chunk]]:
        """Each request's next chunk when ready, oldest request first."""
        pairs = ((r, r.next_chunk()) for r in self._requests.values())
        return [(r, c) for r, c in pairs if c is not None]

    def has_work(self) -> bool:
        return bool(self.ready())

    def step(self) -> list[ChunkOutput]:
        """One solve: the next chunk of each of the oldest ``max_batch`` requests that have one
        ready; a finished request is forgotten after its last chunk."""
        ready = self.ready()[: self.max_batch]
        return self.run(ready) if ready else []

    def run(self, ready: Sequence[tuple[StreamRequest, Chunk]]) -> list[ChunkOutput]:
        """One padded solve of ``ready`` chunks, each request advanced by its chunk.

        As in :meth:`~omni_jax.engine.generation_runner.GenerationRunner.run`, a device failure
        is retried one request at a time and a row with non-finite audio fails alone: a failed
        request gets an ``error`` output and is forgotten, the others go on.
        """
        batch = self.pad(ready, self.buckets.rows_for(len(ready)))
        t0 = time.perf_counter()
        try:
            wave, _, tail = self.solve(
                self.graph, self.state, *batch.arrays(self.mesh), keep_frames=self.planner.keep_frames
            )
            wave, tail = fetch(wave), fetch(tail)
        except jax.errors.JaxRuntimeError as e:
            if len(ready) > 1:
                return [out for pair in ready for out in self.run([pair])]
            return [self._fail(*ready[0], f"solve failed: {e}", time.perf_counter() - t0, 1)]
        dt = time.perf_counter() - t0
        outputs = []
        for i, (request, chunk) in enumerate(ready):
            audio = wave[i, chunk.emit_lo : chunk.emit_hi]
            if not np.isfinite(audio).all():
                bad = int((~np.isfinite(audio)).sum())
                outputs.append(
                    self._fail(
                        request, chunk, f"non-finite waveform ({bad} of {audio.size} samples)", dt, len(ready)
                    )
                )
                continue
            request.done += 1
            request.tail = tail[i].copy()
            last = chunk.kind in (ChunkKind.LITTLE, ChunkKind.FINAL)
            if last:
                del self._requests[request.request_id]
            outputs.append(ChunkOutput(request.request_id, chunk, audio.copy(), last, dt, len(ready)))
        return outputs

    def _fail(
        self, request: StreamRequest, chunk: Chunk, error: str, solve_s: float, rows: int
    ) -> ChunkOutput:
        del self._requests[request.request_id]
        empty = np.zeros(0, np.float32)
        return ChunkOutput(request.request_id, chunk, empty, True, solve_s, rows, error)

    def pad(self, ready: Sequence[tuple[StreamRequest, Chunk]], rows: int) -> ChunkBatch:
        """``ready`` chunks in the first rows of a ``rows``-row solve; a row with no chunk solves
        one code with one grid point and vocodes one frame, so nothing is empty or NaN."""
        p, mel = self.planner, self.mel_dim
        window = self.window_codes
        batch = ChunkBatch(
            codes=np.zeros((rows, window), np.int32),
            code_lengths=np.ones(rows, np.int32),
            speaker_embedding=np.zeros((rows, self.speaker_dim), np.float32),
            reference_mel=np.zeros((rows, self.reference_frames, mel), np.float32),
            reference_lengths=np.ones(rows, np.int32),
            initial_noise=np.zeros((rows, window * p.repeats, mel), np.float32),
            prev_tail=np.zeros((rows, 2 * p.overlap, mel), np.float32),
            prefix_len=np.zeros(rows, np.int32),
            keep_lo=np.zeros(rows, np.int32),
            keep_len=np.ones(rows, np.int32),
            num_steps=np.ones(rows, np.int32),
            guidance_scale=np.zeros(rows, np.float32),
            sway_coefficient=np.zeros(rows, np.float32),
        )
        for i, (r, c) in enumerate(ready):
            codes = r.codes[c.start // p.repeats : c.end // p.repeats]
            batch.codes[i, : len(codes)] = codes
            batch.code_lengths[i] = len(codes)
            batch.speaker_embedding[i] = r.speaker_embedding
            batch.reference_mel[i, : len(r.reference_mel)] = r.reference_mel
            batch.reference_lengths[i] = len(r.reference_mel)
            batch.initial_noise[i, : c.window] = r.noise.window(c.start, c.end)
            if c.prefix_len:
                batch.prev_tail[i] = r.tail
            batch.prefix_len[i] = c.prefix_len
            batch.keep_lo[i] = c.keep_lo
            batch.keep_len[i] = c.keep_len
            batch.num_steps[i] = r.params.num_steps
            batch.guidance_scale[i] = r.params.guidance_scale
            batch.sway_coefficient[i] = r.params.sway_coefficient
        return batch

    def warmup(self) -> int:
        """Compile the program of every row count; returns how many."""
        for rows in self.buckets.rows:
            out, _, _ = self.solve(
                self.graph,
                self.state,
                *self.pad([], rows).arrays(self.mesh),
                keep_frames=self.planner.keep_frames,
            )
            jax.block_until_ready(out)
        return len(self.buckets.rows)
