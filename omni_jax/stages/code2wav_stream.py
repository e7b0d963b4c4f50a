"""Streamed code2wav: requests decoded chunk by chunk as their codes arrive, several per solve.

:class:`ChunkedDecoder` holds each streamed request's progress (codes so far, chunks done, the
vocoder prefix its next chunk needs, its noise) and runs the ready chunks of up to ``max_batch``
requests in one call of :func:`~omni_jax.models.qwen2_5_omni.token2wav_chunk.token2wav_chunk_compiled`,
whatever their kinds. Where a request is cut is the
:class:`~omni_jax.models.qwen2_5_omni.chunk_plan.ChunkPlanner`'s business; the loop (the request
table, batching, the failure rules, warm-up) is :class:`~omni_jax.stages.chunk_loop.StreamedDecoder`'s.

Shapes are closed: a solve pads to the smallest of the planner's windows that holds its chunks
(:attr:`~omni_jax.models.qwen2_5_omni.chunk_plan.ChunkPlanner.windows`: the first chunk's,
``first + future`` frames, and ``past + size + future`` for each size later chunks have), the
vocoder input to ``2 * overlap`` frames and the most a chunk in that window keeps, the voices'
one reference length, and a row count from
:class:`~omni_jax.engine.generation_runner.SolveBuckets`; :meth:`warmup` compiles one program per
(row count, window), after which nothing compiles.

Noise is batch-invariant: a request's rows are those of ``default_rng(seed).standard_normal``,
drawn as its windows reach them, so a chunk's noise is a function of the seed and the chunk's
frames only, and the rows of a whole request are exactly the offline solve's
(:meth:`~omni_jax.stages.code2wav_batch.Code2WavPadder.initial_noise`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.engine.compilation import ProgramCall
from omni_jax.engine.generation_runner import PaddedBatch
from omni_jax.models.qwen2_5_omni.chunk_plan import Chunk, ChunkKind, ChunkPlanner
from omni_jax.parallel.distributed import request_seed
from omni_jax.parallel.rules import fetch
from omni_jax.stages.chunk_loop import StreamedChunk, StreamedDecoder, StreamState
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
class StreamRequest(StreamState):
    """A streamed request's state: its voice and settings, the codes received so far and
    whether they are all, the chunks done, the vocoder prefix of its next chunk."""

    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    params: Token2WavParams
    planner: ChunkPlanner
    seed: int
    noise: NoiseRows
    tail: np.ndarray | None = None

    def next_chunk(self) -> Chunk | None:
        """The chunk to run next, when it is ready."""
        ready = self.planner.ready(len(self.codes), self.finished, self.done)
        return ready[0] if ready else None


ChunkOutput = StreamedChunk[Chunk]
"""A chunk's emitted audio: samples ``[chunk.offset, chunk.offset + len(audio))`` of its
request's waveform (:class:`~omni_jax.stages.chunk_loop.StreamedChunk`; ``chunk`` is always set)."""


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


class ChunkSolved(NamedTuple):
    """One chunk solve's host results: ``wave [B, samples]`` and each row's vocoder ``tail``,
    the prefix of its request's next chunk."""

    wave: np.ndarray
    tail: np.ndarray


class ChunkedDecoder(StreamedDecoder[StreamRequest, Chunk, ChunkBatch, ChunkSolved]):
    """Streamed requests: :meth:`add`, :meth:`extend` with codes as they come, :meth:`step`.

    ``solve`` is ``token2wav_chunk_compiled`` (or a stand-in with its signature); ``planner`` the
    stage's constants, whose largest chunk is the longest a request may ask for (``chunk_codes``);
    ``speaker_dim`` the voices' vector width, ``reference_frames`` their longest reference mel
    (every one pads to it); ``sample_rate`` the waveform's; ``mesh`` as for the
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
        sample_rate: int,
        max_batch: int = 8,
        mesh: Mesh | None = None,
    ):
        windows = [frames // planner.repeats for frames in planner.windows]
        super().__init__(model, windows=windows, max_batch=max_batch, mesh=mesh, sample_rate=sample_rate)
        self.solve = solve
        self.planner = planner
        self.mel_dim = mel_dim
        self.speaker_dim = speaker_dim
        self.reference_frames = reference_frames

    def add(
        self,
        request_id: str,
        speaker_embedding: np.ndarray,
        reference_mel: np.ndarray,
        params: Token2WavParams,
    ) -> StreamRequest:
        """Start a streamed request (no codes yet). ``ValueError`` when its ``chunk_codes`` does
        not suit the model or exceeds the stage's largest chunk, or its reference mel is too long."""
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
        seed = request_seed(params.seed)
        return self._start(
            StreamRequest(
                request_id,
                np.asarray(speaker_embedding, np.float32),
                np.asarray(reference_mel, np.float32),
                params,
                planner,
                seed,
                NoiseRows.of(seed, self.mel_dim),
            )
        )

    def plan(self, params: Token2WavParams) -> ChunkPlanner:
        """The planner of a request with ``params``: the stage's, or with ``chunk_codes`` every
        chunk after the first that many codes (:meth:`ChunkPlanner.with_chunk`: none grow, the
        first no longer). ``ValueError`` when ``chunk_codes`` exceeds the stage's largest chunk
        or breaks the algorithm (not a multiple of the DiT block in codes, shorter than two
        overlaps)."""
        planner = self.planner
        if params.chunk_codes is None:
            return planner
        if params.chunk_codes * planner.repeats > planner.largest_chunk:
            raise ValueError(
                f"chunk_codes={params.chunk_codes} exceeds the stage's largest chunk of "
                f"{planner.largest_chunk // planner.repeats} codes"
            )
        try:
            return planner.with_chunk(params.chunk_codes * planner.repeats)
        except ValueError:
            raise ValueError(
                f"chunk_codes={params.chunk_codes} must be {planner.chunk_codes_rule()}"
            ) from None

    def next_window(self, request: StreamRequest) -> Chunk | None:
        return request.next_chunk()

    def short_of(self, request: StreamRequest) -> int | None:
        if request.finished:
            return None
        return max(0, request.planner.codes_ready(request.done) - len(request.codes)) or None

    def width(self, chunk: Chunk) -> int:
        """Codes in the chunk's DiT window (its ends are whole codes)."""
        return chunk.window // self.planner.repeats

    def program(self, batch: ChunkBatch) -> ProgramCall:
        """The solve vocodes at most what a chunk padded to the batch's window keeps
        (:meth:`ChunkPlanner.keep_bound`): a small chunk's window is shorter than the most the
        largest chunk keeps."""
        keep_frames = self.planner.keep_bound(batch.codes.shape[1] * self.planner.repeats)
        args = (self.graph, self.state, *batch.arrays(self.mesh))
        return ProgramCall(self.solve, args, {"keep_frames": keep_frames})

    def fetched(self, outputs: tuple[jax.Array, jax.Array, jax.Array]) -> ChunkSolved:
        wave, _, tail = outputs
        return ChunkSolved(fetch(wave), fetch(tail))

    def emitted(self, solved: ChunkSolved, row: int, chunk: Chunk) -> np.ndarray:
        return solved.wave[row, chunk.emit_lo : chunk.emit_hi]

    def advance(self, request: StreamRequest, chunk: Chunk, solved: ChunkSolved, row: int) -> bool:
        """The chunk's vocoder tail becomes the next one's prefix; a little or final chunk is the
        request's last."""
        request.tail = solved.tail[row].copy()
        return chunk.kind in (ChunkKind.LITTLE, ChunkKind.FINAL)

    def pad(self, ready: Sequence[tuple[StreamRequest, Chunk]], rows: int, window: int) -> ChunkBatch:
        """``ready`` chunks in the first rows of a ``rows``-row solve whose windows pad to
        ``window`` codes; a row with no chunk solves one code with one grid point and vocodes one
        frame, so nothing is empty or NaN."""
        p, mel = self.planner, self.mel_dim
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
