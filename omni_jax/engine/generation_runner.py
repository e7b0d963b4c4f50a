"""The non-autoregressive execution path: codec tokens -> waveform in one jitted solve per batch.

There is no KV cache, no logits and no sampler here: a request is its whole input, so a batch is
padded once (batch size, code length and reference-mel length each to a power-of-two bucket, so
steady-state serving never recompiles), solved by one compiled program, and split back into
per-request waveforms trimmed to their valid samples.

Randomness is batch-invariant: a request's initial noise comes from its own seed and its own
length only (never from the bucket or its neighbours), so the same request with the same seed
gives the same waveform alone or in any batch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.engine.buckets import bucket
from omni_jax.engine.generation_params import Token2WavParams
from omni_jax.parallel.distributed import random_seed

Solve = Callable[..., tuple[jax.Array, jax.Array]]
"""``solve(graphdef, state, codes, code_lengths, speaker_embedding, reference_mel, reference_lengths,
initial_noise, num_steps, guidance_scale, sway_coefficient) -> (wave [B, S], valid samples [B])``,
e.g. ``token2wav_compiled``; every array is batched and the knobs are ``[B]``."""


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
    """What padding needs to know of the model: mel frames per code, mel width, longest input."""

    repeats: int
    mel_dim: int
    max_codes: int


class GenerationRunner:
    """FIFO batches of at most ``max_batch`` requests through one compiled ``solve``."""

    def __init__(
        self,
        solve: Solve,
        model: nnx.Module,
        geometry: SolveGeometry,
        *,
        max_batch: int = 8,
        min_codes: int = 16,
        min_reference: int = 16,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.solve = solve
        self.graphdef, self.state = nnx.split(model)
        self.geometry = geometry
        self.max_batch = max_batch
        self.min_codes = min(min_codes, geometry.max_codes)
        self.min_reference = min_reference
        self._waiting: collections.deque[GenerationRequest] = collections.deque()

    def add(self, request: GenerationRequest) -> None:
        self._waiting.append(request)

    def has_work(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[GenerationResult]:
        """Solve the oldest ``max_batch`` waiting requests; all of them finish in this step."""
        batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
        return self.run(batch) if batch else []

    def initial_noise(self, request: GenerationRequest) -> tuple[np.ndarray, int | None]:
        """``(noise [len(codes) * repeats, mel_dim] float32, seed)``; the seed is None when given."""
        p = request.params
        if p.initial_noise is not None:
            return np.asarray(p.initial_noise, np.float32), None
        seed = p.seed if p.seed is not None else random_seed()
        shape = (len(request.codes) * self.geometry.repeats, self.geometry.mel_dim)
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), seed

    def run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One padded solve for ``requests``.

        A device failure is retried one request at a time, so only the failing ones end with its
        message (``error``) and the rest of the batch completes.
        """
        if not 1 <= len(requests) <= self.max_batch:
            raise ValueError(f"a batch holds 1 to {self.max_batch} requests, got {len(requests)}")
        g = self.geometry
        rows = bucket(len(requests), 1, self.max_batch)
        codes_len = bucket(max(len(r.codes) for r in requests), self.min_codes, g.max_codes)
        ref_len = bucket(max(len(r.reference_mel) for r in requests), self.min_reference)
        speaker_dim = requests[0].speaker_embedding.shape[-1]
        codes = np.zeros((rows, codes_len), np.int32)
        # Padding rows get one code and one reference frame: no empty reductions, no NaNs.
        code_lengths = np.ones(rows, np.int32)
        speakers = np.zeros((rows, speaker_dim), np.float32)
        reference = np.zeros((rows, ref_len, g.mel_dim), np.float32)
        reference_lengths = np.ones(rows, np.int32)
        noise = np.zeros((rows, codes_len * g.repeats, g.mel_dim), np.float32)
        num_steps = np.ones(rows, np.int32)
        guidance = np.zeros(rows, np.float32)
        sway = np.zeros(rows, np.float32)
        seeds = []
        for i, r in enumerate(requests):
            n, m = len(r.codes), len(r.reference_mel)
            codes[i, :n] = r.codes
            code_lengths[i] = n
            speakers[i] = r.speaker_embedding
            reference[i, :m] = r.reference_mel
            reference_lengths[i] = m
            start, seed = self.initial_noise(r)
            noise[i, : len(start)] = start
            seeds.append(seed)
            num_steps[i] = r.params.num_steps
            guidance[i] = r.params.guidance_scale
            sway[i] = r.params.sway_coefficient
        t0 = time.perf_counter()
        try:
            wave, valid = self.solve(
                self.graphdef,
                self.state,
                *(
                    jnp.asarray(a)
                    for a in (codes, code_lengths, speakers, reference, reference_lengths, noise)
                ),
                *(jnp.asarray(a) for a in (num_steps, guidance, sway)),
            )
            wave, valid = np.asarray(wave), np.asarray(valid)
        except jax.errors.JaxRuntimeError as e:
            if len(requests) > 1:  # find the culprit: the others still complete
                return [result for r in requests for result in self.run([r])]
            return [
                GenerationResult(
                    requests[0], None, f"solve failed: {e}", seeds[0], 1, time.perf_counter() - t0
                )
            ]
        dt = time.perf_counter() - t0
        return [
            GenerationResult(r, wave[i, : valid[i]].copy(), None, seeds[i], len(requests), dt)
            for i, r in enumerate(requests)
        ]
