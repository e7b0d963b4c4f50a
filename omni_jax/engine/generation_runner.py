"""The non-autoregressive execution path: codec tokens -> waveform in one jitted solve per batch.

There is no KV cache, no logits and no sampler here: a request is its whole input, so a batch is
padded once to one of a closed set of shapes (:class:`SolveBuckets`), solved by that shape's
compiled program, and split back into per-request waveforms trimmed to their valid samples.
:meth:`GenerationRunner.warmup` compiles every program of the set, after which nothing compiles,
whatever the traffic. Requests waiting together are split into solves by length
(:meth:`GenerationRunner.groups`), weighing the padding a shared solve pays in full against what
one more solve costs on this device (:class:`SolveCost`, fitted to the runner's own timings); the
fit only chooses among the set's shapes, never makes one. Each step runs one solve, the oldest
request's, so results come back as soon as their own solve ends and later arrivals can still
join the others.

Every solve runs classifier-free guidance (the conditional and the null input in one doubled
batch). A request whose ``guidance_scale`` is below the model's threshold gets a zero guidance
factor, so its result is its conditional velocity alone, the reference's unguided path (equal to
a program without the null half up to float32 rounding, not bitwise: the doubled batch's matmuls
may round differently). A solve of only such requests pays the null half's DiT work for nothing;
they are the exception (the default scale guides), and one program per shape instead of two
halves what warm-up compiles.

On a stage mesh, a solve's rows are split over ``data`` (rows padded to a multiple of it), each
device solving its own requests with the replicated weights: rows never interact, so XLA
partitions the whole program by rows.

Randomness is batch-invariant: a request's initial noise comes from its own seed and its own
length only (never from the bucket or its neighbours), so the same request with the same seed
gives the same waveform alone or in any batch.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.engine.buckets import bucket, ladder, padded_split, round_up
from omni_jax.engine.generation_params import Token2WavParams
from omni_jax.engine.solve_cost import SolveCost
from omni_jax.jit import StaticGraph
from omni_jax.parallel.distributed import random_seed
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import fetch, put
from omni_jax.profiling import scope

Solve = Callable[..., tuple[jax.Array, jax.Array]]
"""``solve(graph, state, codes, code_lengths, speaker_embedding, reference_mel, reference_lengths,
initial_noise, num_steps, guidance_scale, sway_coefficient) -> (wave [B, S], valid samples [B])``,
e.g. ``token2wav_compiled``; ``graph`` is the model's :class:`StaticGraph`; every array is batched
and the knobs are ``[B]``. It compiles once per input shape (a jitted function), so that calling
it on padding compiles the program a real batch of that shape runs."""

MIN_CODES = 32
"""The shortest padded code length: shorter requests are a small share of a solve's work, and
every size below it would be programs of its own."""

CODE_STEPS = 2
"""Padded code lengths per octave (:func:`~omni_jax.engine.buckets.ladder`): ``2^k`` and
``3 * 2^(k-1)``. A solve's work (the DiT's block attention and the vocoder are linear in
frames) grows with its padded length, so padding is paid on every solve, and programs only at
warm-up. Two sizes an octave waste at most half a request's length (at most a third of the
padded solve), against at most all of it for powers of two; four sizes would halve that again
for twice the programs, while a solve of several requests already pads all but its longest."""


@dataclasses.dataclass
class GenerationRequest:
    """One request's whole input: ``codes [T]``, ``speaker_embedding [D]``, ``reference_mel [R, M]``."""

    request_id: str
    codes: np.ndarray
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    params: Token2WavParams


@dataclasses.dataclass
class GenerationResult:
    """``waveform`` (float32, trimmed) or ``error``; ``seed`` is the one the noise came from."""

    request: GenerationRequest
    waveform: np.ndarray | None
    error: str | None
    seed: int | None
    batch_size: int
    solve_s: float


@dataclasses.dataclass(frozen=True)
class SolveGeometry:
    """What padding needs to know of the model: mel frames per code, mel width, speaker vector
    width, longest input."""

    repeats: int
    mel_dim: int
    speaker_dim: int
    max_codes: int


@dataclasses.dataclass
class PaddedBatch:
    """One solve's inputs, batched and padded (host arrays), and each request's noise seed."""

    codes: np.ndarray
    code_lengths: np.ndarray
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    reference_lengths: np.ndarray
    initial_noise: np.ndarray
    num_steps: np.ndarray
    guidance_scale: np.ndarray
    sway_coefficient: np.ndarray
    seeds: list[int | None]

    def arrays(self, mesh: Mesh | None = None) -> tuple[jax.Array, ...]:
        """The device arrays in :data:`Solve`'s argument order (after graphdef and state); on
        ``mesh``, rows (axis 0 of each) split over ``data``."""
        fields = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), np.ndarray)]
        if mesh is None:
            # device_put transfers alone; jnp.asarray compiles a copy program per shape and dtype.
            return tuple(jax.device_put(getattr(self, name)) for name in fields)
        rows = NamedSharding(mesh, P("data"))
        return tuple(put(getattr(self, name), rows) for name in fields)


@dataclasses.dataclass(frozen=True)
class SolveBuckets:
    """The closed set of solve shapes: every batch pads to one ``(rows, codes)`` pair of it, and
    :meth:`GenerationRunner.warmup` compiles each pair's program.

    rows: a solve's request rows, powers of two up to ``max_batch`` (which caps the last), each
    rounded up to a multiple of the mesh's ``data`` axis (every shard the same rows).
    codes: padded code lengths, :data:`CODE_STEPS` per octave from :data:`MIN_CODES` up to the
    stage's ``max_codes`` (the last size, on the ladder or not).
    reference_frames: the one padded reference-mel length. A request's reference mel is its
    voice's, fixed per voice; the speaker encoder reads it once per solve (not per ODE step),
    so padding every voice to the longest costs little, and a length per voice would multiply
    the programs by the voices.
    """

    rows: tuple[int, ...]
    codes: tuple[int, ...]
    reference_frames: int

    @classmethod
    def build(cls, max_batch: int, max_codes: int, reference_frames: int, data: int = 1) -> SolveBuckets:
        rows = {round_up(bucket(n, 1, max_batch), data) for n in range(1, max_batch + 1)}
        return cls(tuple(sorted(rows)), ladder(MIN_CODES, max_codes, CODE_STEPS), reference_frames)

    def shapes(self) -> list[tuple[int, int]]:
        """Every ``(rows, codes)`` of a solve: one compiled program each."""
        return [(rows, codes) for rows in self.rows for codes in self.codes]

    def rows_for(self, requests: int) -> int:
        """Rows of a solve of ``requests`` requests."""
        return _smallest(self.rows, requests, "requests")

    def codes_for(self, num_codes: int) -> int:
        """Padded code length of a solve whose longest request has ``num_codes`` codes."""
        return _smallest(self.codes, num_codes, "codes")


def _smallest(sizes: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} {what} exceed the largest solve bucket ({sizes[-1]})")
    return sizes[i]


class GenerationRunner:
    """FIFO batches of at most ``max_batch`` requests through one compiled ``solve``."""

    def __init__(
        self,
        solve: Solve,
        model: nnx.Module,
        geometry: SolveGeometry,
        *,
        reference_frames: int,
        max_batch: int = 8,
        mesh: Mesh | None = None,
    ):
        """``reference_frames``: the longest reference mel a request may bring (every one pads
        to it); ``mesh``: the stage's ``("data", "model")`` mesh, the model's weights already
        placed on it (replicated); ``None`` on one device."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.solve = solve
        self.graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph(self.graphdef)
        self.geometry = geometry
        self.max_batch = max_batch
        self.mesh = mesh
        self.data = axis_size(mesh, "data")
        self.buckets = SolveBuckets.build(max_batch, geometry.max_codes, reference_frames, self.data)
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self.cost = SolveCost(cap=float(max_batch * geometry.max_codes))

    def add(self, request: GenerationRequest) -> None:
        self._waiting.append(request)

    def has_work(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[GenerationResult]:
        """One solve: the group (:meth:`groups`) of the oldest waiting request, among the oldest
        ``max_batch``; the rest wait, in their order, for the next step."""
        batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
        group = next(g for g in self.groups(batch) if any(r is batch[0] for r in g))
        chosen = {id(r) for r in group}
        self._waiting.extendleft(reversed([r for r in batch if id(r) not in chosen]))
        return self.run(group)

    def groups(self, requests: list[GenerationRequest]) -> list[list[GenerationRequest]]:
        """``requests`` split into solves, shortest first, each request in one.

        Sorted by length, the requests are cut into contiguous groups that minimise the padded
        code-rows (rows and codes to their :attr:`buckets`) plus :meth:`SolveCost.overhead` per
        solve (:func:`~omni_jax.engine.buckets.padded_split`). With little overhead a group holds
        one code bucket (or splits where its rows would pad to the next bucket); the larger a
        solve's fixed cost, the more lengths share one. Whatever the fit, every group's shape is
        one of the buckets'.
        """
        order = sorted(requests, key=lambda r: len(r.codes))
        codes = [self.buckets.codes_for(len(r.codes)) for r in order]
        return [order[a:b] for a, b in padded_split(codes, self.buckets.rows_for, self.cost.overhead())]

    def initial_noise(self, request: GenerationRequest) -> tuple[np.ndarray, int | None]:
        """``(noise [len(codes) * repeats, mel_dim] float32, seed)``; the seed is None when given."""
        p = request.params
        if p.initial_noise is not None:
            return np.asarray(p.initial_noise, np.float32), None
        seed = p.seed if p.seed is not None else random_seed()
        shape = (len(request.codes) * self.geometry.repeats, self.geometry.mel_dim)
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), seed

    def padding(self, rows: int, codes: int) -> PaddedBatch:
        """A solve of ``rows`` rows and ``codes`` codes with no request in it: every row one code,
        one reference frame and one grid point (no ODE step), so no reduction is empty and
        nothing is NaN."""
        g = self.geometry
        return PaddedBatch(
            codes=np.zeros((rows, codes), np.int32),
            code_lengths=np.ones(rows, np.int32),
            speaker_embedding=np.zeros((rows, g.speaker_dim), np.float32),
            reference_mel=np.zeros((rows, self.buckets.reference_frames, g.mel_dim), np.float32),
            reference_lengths=np.ones(rows, np.int32),
            initial_noise=np.zeros((rows, codes * g.repeats, g.mel_dim), np.float32),
            num_steps=np.ones(rows, np.int32),
            guidance_scale=np.zeros(rows, np.float32),
            sway_coefficient=np.zeros(rows, np.float32),
            seeds=[],
        )

    def pad(self, requests: list[GenerationRequest]) -> PaddedBatch:
        """The solve's inputs for ``requests``, padded to the smallest bucket that holds them."""
        if not 1 <= len(requests) <= self.max_batch:
            raise ValueError(f"a batch holds 1 to {self.max_batch} requests, got {len(requests)}")
        most = self.buckets.reference_frames
        for r in requests:
            if len(r.reference_mel) > most:
                raise ValueError(
                    f"request {r.request_id!r}: reference mel of {len(r.reference_mel)} frames, "
                    f"more than the {most} a solve holds"
                )
        batch = self.padding(
            self.buckets.rows_for(len(requests)), self.buckets.codes_for(max(len(r.codes) for r in requests))
        )
        for i, r in enumerate(requests):
            n, m = len(r.codes), len(r.reference_mel)
            batch.codes[i, :n] = r.codes
            batch.code_lengths[i] = n
            batch.speaker_embedding[i] = r.speaker_embedding
            batch.reference_mel[i, :m] = r.reference_mel
            batch.reference_lengths[i] = m
            start, seed = self.initial_noise(r)
            batch.initial_noise[i, : len(start)] = start
            batch.seeds.append(seed)
            batch.num_steps[i] = r.params.num_steps
            batch.guidance_scale[i] = r.params.guidance_scale
            batch.sway_coefficient[i] = r.params.sway_coefficient
        return batch

    def warmup(self) -> int:
        """Compile the program of every shape of :attr:`buckets`; returns how many there are.

        Each is compiled by solving :meth:`padding` of its shape, placed as a real batch is
        (jit's cache, which later calls hit, holds only programs compiled by calls), and it runs
        no ODE step.
        """
        shapes = self.buckets.shapes()
        for rows, codes in shapes:
            with scope("code2wav/warmup", rows=rows, codes=codes):
                wave, _ = self.solve(self.graph, self.state, *self.padding(rows, codes).arrays(self.mesh))
                jax.block_until_ready(wave)
        return len(shapes)

    def run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One padded solve for ``requests``.

        A device failure is retried one request at a time, so only the failing ones end with its
        message (``error``) and the rest of the batch completes.
        """
        with scope("code2wav/pad", requests=len(requests)):
            batch = self.pad(requests)
        seeds = batch.seeds
        t0 = time.perf_counter()
        try:
            # Inputs to the device, one program (DiT solve then vocoder: device scopes
            # ``dit_solve`` / ``vocoder``), waveforms back to the host.
            with scope("code2wav/solve", rows=batch.codes.shape[0], codes=batch.codes.shape[1]):
                wave, valid = self.solve(self.graph, self.state, *batch.arrays(self.mesh))
                wave, valid = fetch(wave), fetch(valid)
        except jax.errors.JaxRuntimeError as e:
            if len(requests) > 1:  # find the culprit: the others still complete
                return [result for r in requests for result in self.run([r])]
            return [
                GenerationResult(
                    requests[0], None, f"solve failed: {e}", seeds[0], 1, time.perf_counter() - t0
                )
            ]
        dt = time.perf_counter() - t0
        rows, codes = batch.codes.shape
        self.cost.record((rows, codes), rows * codes, dt)
        with scope("code2wav/split", requests=len(requests)):
            results = []
            for i, r in enumerate(requests):
                w = wave[i, : valid[i]]
                if np.isfinite(w).all():
                    results.append(GenerationResult(r, w.copy(), None, seeds[i], len(requests), dt))
                else:  # rows do not mix in the solve: only this request failed
                    error = f"non-finite waveform ({int((~np.isfinite(w)).sum())} of {len(w)} samples)"
                    results.append(GenerationResult(r, None, error, seeds[i], len(requests), dt))
            return results
