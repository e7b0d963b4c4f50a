"""How code2wav requests fill one padded solve, for the engine's generic
:class:`~omni_jax.engine.generation_runner.GenerationRunner`.

A request is its codes, its voice (speaker vector and reference mel) and its solver settings; a
solve's inputs are those of its rows padded to one ``(rows, codes)`` bucket, plus the ODE's
initial noise and the per-row knobs, in the argument order of
:func:`~omni_jax.models.qwen2_5_omni.token2wav.token2wav_compiled`.

Every solve runs classifier-free guidance (the conditional and the null input in one doubled
batch). A request whose ``guidance_scale`` is below the model's threshold gets a zero guidance
factor, so its result is its conditional velocity alone, the reference's unguided path (equal to
a program without the null half up to float32 rounding, not bitwise: the doubled batch's matmuls
may round differently). A solve of only such requests pays the null half's DiT work for nothing;
they are the exception (the default scale guides), and one program per shape instead of two
halves what warm-up compiles.

Randomness is batch-invariant: a request's initial noise comes from its own seed and its own
length only (never from the bucket or its neighbours), so the same request with the same seed
gives the same waveform alone or in any batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.engine.buckets import ladder
from omni_jax.engine.generation_runner import GenerationRunner, PaddedBatch, Solve
from omni_jax.parallel.distributed import request_seed
from omni_jax.stages.code2wav_params import Token2WavParams

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


def code_buckets(max_codes: int) -> tuple[int, ...]:
    """The padded code lengths of a stage whose requests hold at most ``max_codes`` codes:
    :data:`CODE_STEPS` per octave from :data:`MIN_CODES` up to ``max_codes`` (the last size, on
    the ladder or not)."""
    return ladder(MIN_CODES, max_codes, CODE_STEPS)


@dataclasses.dataclass(frozen=True)
class SolveGeometry:
    """What padding needs to know of the model: mel frames per code, mel width, speaker vector
    width, longest input."""

    repeats: int
    mel_dim: int
    speaker_dim: int
    max_codes: int


@dataclasses.dataclass
class Code2WavRequest:
    """One request's whole input: ``codes [T]``, ``speaker_embedding [D]``, ``reference_mel [R, M]``.

    ``seed`` is the one its initial noise comes from (``None`` when ``params.initial_noise``
    gives the noise): :meth:`new` draws one when the params set none, once, so a retried solve
    starts from the same noise."""

    request_id: str
    codes: np.ndarray
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    params: Token2WavParams
    seed: int | None

    @classmethod
    def new(
        cls,
        request_id: str,
        codes: np.ndarray,
        speaker_embedding: np.ndarray,
        reference_mel: np.ndarray,
        params: Token2WavParams,
    ) -> Code2WavRequest:
        seed = None
        if params.initial_noise is None:
            seed = request_seed(params.seed)
        return cls(request_id, codes, speaker_embedding, reference_mel, params, seed)


@dataclasses.dataclass
class Code2WavBatch(PaddedBatch):
    """One solve's inputs, batched and padded (host arrays), in ``token2wav_compiled``'s order."""

    codes: np.ndarray
    code_lengths: np.ndarray
    speaker_embedding: np.ndarray
    reference_mel: np.ndarray
    reference_lengths: np.ndarray
    initial_noise: np.ndarray
    num_steps: np.ndarray
    guidance_scale: np.ndarray
    sway_coefficient: np.ndarray


@dataclasses.dataclass(frozen=True)
class Code2WavPadder:
    """The :class:`~omni_jax.engine.generation_runner.BatchPadder` of code2wav: a request's
    length is its codes.

    ``reference_frames``: the one padded reference-mel length. A request's reference mel is its
    voice's, fixed per voice; the speaker encoder reads it once per solve (not per ODE step), so
    padding every voice to the longest costs little, and a length per voice would multiply the
    programs by the voices.
    """

    geometry: SolveGeometry
    reference_frames: int
    output = "waveform"

    def length(self, request: Code2WavRequest) -> int:
        return len(request.codes)

    def initial_noise(self, request: Code2WavRequest) -> np.ndarray:
        """``[len(codes) * repeats, mel_dim]`` float32: the given noise, or drawn from the seed."""
        p = request.params
        if p.initial_noise is not None:
            return np.asarray(p.initial_noise, np.float32)
        shape = (len(request.codes) * self.geometry.repeats, self.geometry.mel_dim)
        return np.random.default_rng(request.seed).standard_normal(shape, dtype=np.float32)

    def pad(self, requests: Sequence[Code2WavRequest], rows: int, codes: int) -> Code2WavBatch:
        """``requests`` in the first rows of a ``rows`` x ``codes`` solve. A row with no request
        has one code, one reference frame and one grid point (no ODE step), so no reduction is
        empty and nothing is NaN."""
        most = self.reference_frames
        for r in requests:
            if len(r.reference_mel) > most:
                raise ValueError(
                    f"request {r.request_id!r}: reference mel of {len(r.reference_mel)} frames, "
                    f"more than the {most} a solve holds"
                )
        g = self.geometry
        batch = Code2WavBatch(
            codes=np.zeros((rows, codes), np.int32),
            code_lengths=np.ones(rows, np.int32),
            speaker_embedding=np.zeros((rows, g.speaker_dim), np.float32),
            reference_mel=np.zeros((rows, most, g.mel_dim), np.float32),
            reference_lengths=np.ones(rows, np.int32),
            initial_noise=np.zeros((rows, codes * g.repeats, g.mel_dim), np.float32),
            num_steps=np.ones(rows, np.int32),
            guidance_scale=np.zeros(rows, np.float32),
            sway_coefficient=np.zeros(rows, np.float32),
        )
        for i, r in enumerate(requests):
            n, m = len(r.codes), len(r.reference_mel)
            batch.codes[i, :n] = r.codes
            batch.code_lengths[i] = n
            batch.speaker_embedding[i] = r.speaker_embedding
            batch.reference_mel[i, :m] = r.reference_mel
            batch.reference_lengths[i] = m
            start = self.initial_noise(r)
            batch.initial_noise[i, : len(start)] = start
            batch.num_steps[i] = r.params.num_steps
            batch.guidance_scale[i] = r.params.guidance_scale
            batch.sway_coefficient[i] = r.params.sway_coefficient
        return batch


def code2wav_runner(
    solve: Solve,
    model: nnx.Module,
    geometry: SolveGeometry,
    *,
    reference_frames: int,
    max_batch: int = 8,
    max_solve_codes: int | None = None,
    mesh: Mesh | None = None,
    name: str = "code2wav",
) -> GenerationRunner[Code2WavRequest, Code2WavBatch]:
    """The engine's runner for code2wav: ``solve`` (``token2wav_compiled``) over buckets of up to
    ``max_batch`` rows by :func:`code_buckets` of ``geometry.max_codes``, at most
    ``max_solve_codes`` rows x codes a solve; ``reference_frames``: the longest reference mel a
    request may bring (every one pads to it)."""
    padder = Code2WavPadder(geometry, reference_frames)
    return GenerationRunner(
        solve,
        model,
        padder,
        lengths=code_buckets(geometry.max_codes),
        max_batch=max_batch,
        max_cells=max_solve_codes,
        mesh=mesh,
        name=name,
    )
