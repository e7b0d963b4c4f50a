"""What both code2wav stages (Qwen2.5-Omni's, Qwen3-Omni's) do alike around their models.

Each stage decodes a request offline, whole, in a
:class:`~omni_jax.engine.generation_runner.GenerationRunner` solve, or streamed, chunk by chunk,
in a :class:`~omni_jax.stages.chunk_loop.StreamedDecoder`. :class:`Code2WavStageBase` keeps the
books of both paths (when a request came, its first audio, its pieces, its solves' seconds), runs
a step (the chunk solve, then the offline solve), aborts, reports load and warms up; a family's
stage adds its voices or frames, its checks and what its results count (codes or frames).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np

from omni_jax.engine.generation_runner import GenerationResult, GenerationRunner, PaddedBatch
from omni_jax.engine.sampling import ParamError, is_int
from omni_jax.stages.base import (
    StageInput,
    StageLoad,
    StageParams,
    StageResult,
    StageStep,
    check_params,
    no_multimodal,
)
from omni_jax.stages.chunk_loop import StreamedChunk, StreamedDecoder
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.config import StageConfig


class OfflineRequest(Protocol):
    """What the stage reads of an offline request: its id."""

    @property
    def request_id(self) -> str: ...


Q = TypeVar("Q", bound=OfflineRequest)
"""An offline request (the runner's)."""
B = TypeVar("B", bound=PaddedBatch)
"""An offline solve's padded inputs."""
D = TypeVar("D", bound=StreamedDecoder)
"""The stage's streamed decoder."""
W = TypeVar("W")
T = TypeVar("T")


def streaming_on(sc: StageConfig) -> bool:
    """Whether the stage decodes requests with ``stream=True`` in chunks: unless the stage YAML's
    ``engine.stream`` is ``false``, which makes an offline-only stage (its warm-up compiles no
    chunk program, and it decodes every request whole: a streamed reply's audio comes in one
    piece at its end, its text still streamed). ``ValueError`` naming the stage when
    ``engine.stream`` is neither ``false`` nor a mapping of constants, or when the stage's own
    default asks to stream with streaming off."""
    given = sc.engine.get("stream")
    if given is False:
        if sc.default_sampling.get("stream"):
            raise ValueError(
                f"stage {sc.name!r}: default_sampling.stream is true but engine.stream is false "
                "(streamed decoding off)"
            )
        return False
    if given is not None and not isinstance(given, dict):
        raise ValueError(
            f"stage {sc.name!r}: engine.stream must be a mapping of streaming constants or false, "
            f"got {given!r}"
        )
    return True


def stream_setting(
    sc: StageConfig,
    keys: Collection[str],
    build: Callable[[dict[str, int]], T],
    terms: Mapping[str, tuple[str, int]],
) -> T:
    """The stage YAML's ``engine.stream`` (each value an int) made into the stage's streamed
    decoding constants by ``build`` (the family's own when it is ``false``: the decoder is built,
    and never used); ``ValueError`` naming the stage for a key not in ``keys`` or constants
    ``build`` refuses. ``terms``: for each constant ``build``'s refusals name, the YAML key it
    comes from and the factor from the key's units to its own, so that a refusal also says
    which keys to change."""
    given = dict(sc.engine.get("stream") or {}) if streaming_on(sc) else {}
    unknown = set(given) - set(keys)
    if unknown:
        raise ValueError(
            f"stage {sc.name!r}: unknown engine.stream keys {sorted(unknown)} (known: {sorted(keys)})"
        )
    bad = next((k for k, v in given.items() if not is_int(v)), None)
    if bad is not None:
        raise ValueError(f"stage {sc.name!r}: engine.stream.{bad}={given[bad]!r} must be an integer")
    values = dict(given)
    try:
        return build(values)
    except ValueError as e:
        raise ValueError(f"stage {sc.name!r}: engine.stream: {e}{_legend(str(e), terms)}") from None


def _legend(problem: str, terms: Mapping[str, tuple[str, int]]) -> str:
    """The YAML keys of the constants ``problem`` names (``chunk=72``), in parentheses; empty
    when it names none."""
    named = [
        f"{name} is {key}" if factor == 1 else f"{name} is {key} x {factor}"
        for name, (key, factor) in terms.items()
        if re.search(rf"\b{name}=", problem)
    ]
    return f" ({', '.join(named)})" if named else ""


@dataclasses.dataclass
class Streamed:
    """A streamed request's progress in the stage: when it was opened, its codes (the decoder's
    list, which grows as they come), metrics fixed when it was opened (``tags``: a seed), its
    first audio, the audio emitted so far and the seconds of the solves it was in."""

    opened: float
    codes: list[int]
    tags: dict[str, int] = dataclasses.field(default_factory=dict)
    pieces: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_audio_s: float | None = None
    solve_s: float = 0.0


class Code2WavStageBase(Generic[Q, B, D]):
    """The bookkeeping of a code2wav stage over an offline ``runner`` and a streamed
    ``decoder``. A subclass sets :attr:`sample_rate` and :attr:`size_key` (the metric that counts
    a request's codes: ``num_codes``, ``num_frames``), and supplies :meth:`_size` and
    :meth:`_offline_codes` (with :meth:`_offline_tags` where its results carry more)."""

    params_type = Token2WavParams
    accepts_text = False
    reads_hidden = False
    outputs_hidden = False
    sample_rate: int
    size_key: str

    def __init__(
        self,
        config: StageConfig,
        runner: GenerationRunner[Q, B],
        decoder: D,
        defaults: Token2WavParams,
    ):
        self.config = config
        self.runner = runner
        self.decoder = decoder
        self.defaults = defaults
        self.streaming = streaming_on(config)
        self._submitted: dict[str, tuple[float, int]] = {}
        self._streamed: dict[str, Streamed] = {}

    def _size(self, codes: list[int]) -> int:
        """What :attr:`size_key` counts of a streamed request's ``codes``."""
        return len(codes)

    def _offline_codes(self, request: Q) -> list[int]:
        """An offline request's codes, as its result's ``token_ids``."""
        raise NotImplementedError

    def _offline_tags(self, request: Q) -> dict[str, int]:
        """An offline result's metrics beyond the common ones."""
        return {}

    def _check_stream(self, params: Token2WavParams) -> None:
        """``ValueError`` when the decoder cannot cut a streamed request with ``params``."""
        raise NotImplementedError

    def _check_params(self, index: int, params: StageParams) -> None:
        """:func:`~omni_jax.stages.base.check_params`, then whether a streamed request can be cut
        (a :class:`ParamError` naming ``chunk_codes``, the one field the cut depends on)."""
        check_params(self, index, params)
        checked = cast(Token2WavParams, params)  # check_params refused any other type
        if self.streams(checked):
            try:
                self._check_stream(checked)
            except ValueError as e:
                raise ParamError(f"request {index}: stage {self.config.name!r}: {e}", "chunk_codes") from None

    def prepare(self, index: int, request: StageInput) -> StageInput:
        return no_multimodal(self, index, request)

    def connect(self, upstream: Any) -> None:
        """Reads only the upstream's tokens: nothing to take from it at build time."""

    def streams(self, params: Token2WavParams) -> bool:
        """Whether the request is decoded in chunks: it asks to stream, and streaming is on."""
        return params.stream and self.streaming

    def _opened(self, request_id: str, codes: list[int], tags: dict[str, int] | None = None) -> None:
        """Record a streamed request the decoder took (``codes``: its list of them)."""
        self._streamed[request_id] = Streamed(time.perf_counter(), codes, dict(tags or {}))

    def _queue(self, request: Q, size: int) -> None:
        """Queue an offline request of ``size`` (codes or frames) for a solve (or a piece of one:
        ``size`` is the whole request's, see :meth:`_joined`)."""
        self._submitted.setdefault(request.request_id, (time.perf_counter(), size))
        self.runner.add(request)

    def _joined(self, result: GenerationResult[Q]) -> GenerationResult[Q] | None:
        """The result of the request whose solve ``result`` landed from: ``result`` itself, for a
        stage that solves each request whole; ``None`` while a request decoded in pieces still
        has pieces to land."""
        return result

    def abort(self, request_id: str) -> bool:
        """Drop the request from the solve queue or the decoder, or its row from the solve in
        flight (nothing of it is read when the solve lands)."""
        if self._streamed.pop(request_id, None) is not None:
            return self.decoder.remove(request_id)
        if self._submitted.pop(request_id, None) is None:
            return False
        self.runner.remove(lambda r: r.request_id == request_id)
        return True

    def has_work(self) -> bool:
        return self.runner.has_work() or self.decoder.has_work()

    def load(self) -> StageLoad:
        """Streamed requests run (they are decoded as their codes come), and so do offline ones
        in the solve in flight; the other offline ones wait for a solve. A request decoded in
        pieces counts once (:attr:`_submitted` holds each offline request once, to its end):
        running while any piece of it is in the solve in flight. It runs every engine step, so it
        reads the solve in flight (at most ``max_batch`` rows), not the queue."""
        solving = len({r.request_id for r in self.runner.solving})
        return StageLoad(running=self.decoder.num_streaming + solving, waiting=len(self._submitted) - solving)

    def warmup(self) -> int:
        """Compile every program: the offline solves' (the runner's shapes) and, unless streaming
        is off, the streamed ones' (one per rows bucket and window). Returns how many. After it no
        request mix the stage accepts compiles."""
        return self.runner.warmup() + (self.decoder.warmup() if self.streaming else 0)

    def step(self, block: bool = True) -> StageStep:
        """One chunk solve of the streamed requests with a chunk ready, then one offline solve;
        a streamed request's audio comes chunk by chunk, an offline one's whole. Without
        ``block`` each solve is left in flight and lands in a later step, once the device has
        finished it (:meth:`StreamedDecoder.step <omni_jax.stages.chunk_loop.StreamedDecoder.step>`,
        :meth:`GenerationRunner.step <omni_jax.engine.generation_runner.GenerationRunner.step>`)."""
        results: list[StageResult] = []
        audio: dict[str, np.ndarray] = {}
        flights = (self.decoder.in_flight, self.runner.in_flight)
        if self.decoder.has_work():
            for chunk in self.decoder.step(block):  # at most one chunk of a request a step
                if chunk.error is None and len(chunk.audio):
                    audio[chunk.request_id] = chunk.audio
                finished = self._chunk_done(chunk)
                if finished is not None:
                    results.append(finished)
        if self.runner.has_work():
            results += self._solve(audio, block)
        # Nothing landed, ended or was dispatched: the same solves (or none) are in flight.
        now = (self.decoder.in_flight, self.runner.in_flight)
        idle = not results and not audio and all(a is b for a, b in zip(flights, now, strict=True))
        return StageStep(results, new_audio=audio, idle=idle)

    def _chunk_done(self, chunk: StreamedChunk[W]) -> StageResult | None:
        """Record a streamed chunk; the request's result when it was its last."""
        streamed = self._streamed[chunk.request_id]
        now = time.perf_counter()
        streamed.solve_s += chunk.solve_s
        if streamed.first_audio_s is None and chunk.error is None and len(chunk.audio):
            streamed.first_audio_s = now - streamed.opened
        streamed.pieces.append(chunk.audio)
        if not chunk.last:
            return None
        del self._streamed[chunk.request_id]
        wave = np.concatenate(streamed.pieces)
        metrics = {
            "wall_s": now - streamed.opened,
            "first_audio_s": streamed.first_audio_s,
            "solve_s": streamed.solve_s,
            "chunks": sum(1 for p in streamed.pieces if len(p)),
            self.size_key: self._size(streamed.codes),
            "num_samples": len(wave),
            **streamed.tags,
        }
        return self._result(chunk.request_id, list(streamed.codes), metrics, wave, chunk.error)

    def _solve(self, audio: dict[str, np.ndarray], block: bool) -> list[StageResult]:
        """The offline solve that landed this step (:meth:`GenerationRunner.step
        <omni_jax.engine.generation_runner.GenerationRunner.step>`): its requests finish
        together, with their whole waveforms."""
        results = []
        for piece in self.runner.step(block):
            r = self._joined(piece)
            if r is None:
                continue
            request_id = r.request.request_id
            started, size = self._submitted.pop(request_id)
            metrics = {
                "wall_s": time.perf_counter() - started,
                "solve_s": r.solve_s,
                "batch_size": r.batch_size,
                self.size_key: size,
                "padded_length": r.padded_length,
                "num_samples": 0 if r.output is None else len(r.output),
                **self._offline_tags(r.request),
            }
            if r.error is None and r.output is not None:
                audio[request_id] = r.output
            results.append(
                self._result(request_id, self._offline_codes(r.request), metrics, r.output, r.error)
            )
        return results

    def _result(
        self,
        request_id: str,
        codes: list[int],
        metrics: dict[str, Any],
        wave: np.ndarray | None,
        error: str | None,
    ) -> StageResult:
        """A finished request: its waveform, or its error."""
        if error is not None:
            return StageResult(request_id, codes, "error", metrics, error=error)
        return StageResult(request_id, codes, "stop", metrics, audio=wave, sample_rate=self.sample_rate)
