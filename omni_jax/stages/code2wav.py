"""Qwen2.5-Omni's code2wav stage: codec tokens + a voice -> 24 kHz waveform, batched.

The stage owns what is particular to the model (voices, the codec vocabulary, the DiT's length
limit, the sample rate) and how its requests pad into one solve (:mod:`omni_jax.stages.code2wav_batch`);
the engine's :class:`~omni_jax.engine.generation_runner.GenerationRunner` owns the queue, the
grouping by length, the closed set of solve shapes, warm-up and the solve.

A request with ``Token2WavParams(stream=True)`` is decoded chunk by chunk instead
(:class:`~omni_jax.stages.code2wav_stream.ChunkedDecoder`): after the talker it is a
:class:`~omni_jax.stages.base.FedStage`, taking the talker's codes as they are made, so its
first audio comes a chunk after the talker's first codes rather than after its last.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from omni_jax.engine.generation_runner import GenerationRunner
from omni_jax.models.qwen2_5_omni.chunk_plan import ChunkPlanner
from omni_jax.models.qwen2_5_omni.speakers import Voices
from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, token2wav_compiled
from omni_jax.models.qwen2_5_omni.token2wav_chunk import token2wav_chunk_compiled
from omni_jax.stages.base import (
    StageInput,
    StageLoad,
    StageResult,
    StageStep,
    check_ids,
    check_params,
    no_multimodal,
)
from omni_jax.stages.code2wav_batch import Code2WavBatch, Code2WavRequest, SolveGeometry, code2wav_runner
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.code2wav_stream import ChunkedDecoder, ChunkOutput
from omni_jax.stages.config import StageConfig

SAMPLE_RATE = 24_000
"""Qwen2.5-Omni's BigVGAN output rate (not recorded in the checkpoint's config)."""

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_CODES = 4096
"""Codes per request when the stage YAML sets no ``max_codes``: the talker's default
``max_tokens`` (transformers' ``talker_max_new_tokens``), 82 s of audio at 50 codes per second.
With ``max_batch`` it bounds the largest solve, which the start-up check must find room for."""


@dataclasses.dataclass
class _Streamed:
    """A streamed request's progress in the stage: when it was opened, its first audio, its
    codes, the audio emitted so far and the seconds of the solves it was in."""

    opened: float
    seed: int
    codes: list[int] = dataclasses.field(default_factory=list)
    pieces: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_audio_s: float | None = None
    solve_s: float = 0.0


def voiced_codes(tokens: list[int], upstream: StageResult | None) -> list[int]:
    """The talker's ``tokens`` that are codes to voice: all but a stop token, which ends the
    tokens of a result that finished with ``"stop"`` (the reference cuts at the first codec EOS
    or pad)."""
    if upstream is not None and upstream.finish_reason == "stop" and tokens:
        return list(tokens[:-1])
    return list(tokens)


def solve_limits(sc: StageConfig, model: Token2Wav) -> tuple[int, int]:
    """``(max_batch, max_codes)`` of a code2wav stage: its engine options, codes capped by the
    DiT's positions."""
    dit = model.dit
    max_batch = int(sc.engine.get("max_batch", DEFAULT_MAX_BATCH))
    positions = dit.max_position_embeddings // dit.repeats
    max_codes = min(int(sc.engine.get("max_codes", DEFAULT_MAX_CODES)), positions)
    if max_batch < 1 or max_codes < 1:
        raise ValueError(f"stage {sc.name!r}: max_batch={max_batch} and max_codes={max_codes} must be >= 1")
    return max_batch, max_codes


STREAM_KEYS = {
    "chunk_codes": "chunk",
    "past_codes": "past",
    "future_codes": "future",
    "overlap_frames": "overlap",
}
"""The stage YAML's ``engine.stream`` keys and the :class:`ChunkPlanner` constants they set
(codes for the DiT's chunk and context, mel frames for the vocoder's overlap)."""


def stream_planner(sc: StageConfig, model: Token2Wav) -> ChunkPlanner:
    """The streamed decoding constants: Qwen's, or those of the stage YAML's ``engine.stream``
    (e.g. ``{chunk_codes: 36}``; a request's ``chunk_codes`` may only be smaller)."""
    given = dict(sc.engine.get("stream") or {})
    unknown = set(given) - set(STREAM_KEYS)
    if unknown:
        raise ValueError(
            f"stage {sc.name!r}: unknown engine.stream keys {sorted(unknown)} (known: {sorted(STREAM_KEYS)})"
        )
    scale = {"overlap_frames": 1}
    chosen = {STREAM_KEYS[k]: int(v) * scale.get(k, model.dit.repeats) for k, v in given.items()}
    try:
        return ChunkPlanner.for_model(model, **chosen)
    except ValueError as e:
        raise ValueError(f"stage {sc.name!r}: engine.stream: {e}") from None


def solve_demand(sc: StageConfig, model: Token2Wav) -> dict[str, int]:
    """The largest solve's temporaries, for the start-up memory check (an estimate: see
    :func:`omni_jax.models.qwen2_5_omni.token2wav.solve_bytes_per_code`)."""
    max_batch, max_codes = solve_limits(sc, model)
    what = f"stage {sc.name!r} largest solve ({max_batch} requests of {max_codes} codes, estimate)"
    return {what: model.solve_bytes_per_code * max_batch * max_codes}


class Code2WavStage:
    """Prompts (when first) are ``{"prompt_token_ids": codes, "speaker": name}``.

    Codes index the DiT's codec embedding: valid ids are ``0 .. num_embeds`` inclusive (the
    table has ``num_embeds + 1`` rows, as in transformers). A request may hold at most the
    engine option ``max_codes`` codes (default :data:`DEFAULT_MAX_CODES`), never more than
    ``max_position_embeddings // repeats``, the reference's limit on mel length. A prompt
    without ``"speaker"`` uses :attr:`default_speaker`: the YAML's ``default_speaker`` when the
    checkpoint has that voice, else the checkpoint's first voice.
    """

    params_type = Token2WavParams
    accepts_text = False
    reads_hidden = False
    sample_rate = SAMPLE_RATE

    def __init__(
        self,
        config: StageConfig,
        runner: GenerationRunner[Code2WavRequest, Code2WavBatch],
        geometry: SolveGeometry,
        voices: Voices,
        codec_vocab_size: int,
        defaults: Token2WavParams,
        decoder: ChunkedDecoder,
    ):
        self.config = config
        self.runner = runner
        self.decoder = decoder
        self.geometry = geometry
        self.voices = voices
        self.codec_vocab_size = codec_vocab_size
        self.defaults = defaults
        self._submitted: dict[str, tuple[float, int]] = {}
        self._streamed: dict[str, _Streamed] = {}

    @property
    def default_speaker(self) -> str:
        return self.voices.default

    @classmethod
    def build(cls, sc: StageConfig, model: Token2Wav, path: Path, mesh: Mesh | None = None) -> Code2WavStage:
        voices = Voices.load(path, sc.default_speaker)
        speakers = voices.speakers
        widths = {name: len(s.cond) for name, s in speakers.items()}
        if len(set(widths.values())) != 1:
            raise ValueError(f"{path}: the voices' cond vectors differ in width: {widths}")
        dit = model.dit
        max_batch, max_codes = solve_limits(sc, model)
        geometry = SolveGeometry(
            repeats=dit.repeats,
            mel_dim=dit.mel_dim,
            speaker_dim=next(iter(widths.values())),
            max_codes=max_codes,
        )
        # The voices are the only reference mels a request brings: the solves' one length.
        runner = code2wav_runner(
            token2wav_compiled,
            model,
            geometry,
            reference_frames=max(len(s.ref_mel) for s in speakers.values()),
            max_batch=max_batch,
            mesh=mesh,
            name=sc.name,
        )
        codec_vocab_size = int(dit.codec_embed.num_embeddings)
        defaults = sc.default_params(Token2WavParams)
        decoder = ChunkedDecoder(
            token2wav_chunk_compiled,
            model,
            stream_planner(sc, model),
            mel_dim=dit.mel_dim,
            speaker_dim=geometry.speaker_dim,
            reference_frames=max(len(s.ref_mel) for s in speakers.values()),
            max_batch=max_batch,
            mesh=mesh,
        )
        return cls(sc, runner, geometry, voices, codec_vocab_size, defaults, decoder)

    def prepare(self, index: int, request: StageInput) -> StageInput:
        return no_multimodal(self, index, request)

    def connect(self, upstream: Any) -> None:
        """Reads only the upstream's tokens: nothing to take from it at build time."""

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        """The talker's codes up to its stop token; ``None`` when it stopped before any code, so
        there is nothing to voice."""
        codes = voiced_codes(upstream.token_ids, upstream)
        if not codes:
            return None
        return StageInput(codes, prompt, upstream=upstream)

    def streams(self, params: Token2WavParams) -> bool:
        return params.stream

    def open(self, request_id: str, prompt: dict[str, Any], params: Token2WavParams) -> None:
        speaker = self.voices.pick(0, prompt)
        request = self.decoder.add(request_id, speaker.cond, speaker.ref_mel, dataclasses.replace(params))
        self._streamed[request_id] = _Streamed(time.perf_counter(), request.seed)

    def feed(self, index: int, request_id: str, tokens: list[int], upstream: StageResult | None) -> bool:
        """The talker's new codes (its stop token cut, :func:`voiced_codes`), each checked against
        the codec vocabulary, then queued for the request's chunks."""
        codes = voiced_codes(tokens, upstream)
        if codes:
            check_ids(index, codes, self.codec_vocab_size, kind="codec")
        streamed = self._streamed[request_id]
        if upstream is not None and not streamed.codes and not codes:
            self.abort(request_id)
            return False
        streamed.codes += codes
        self.decoder.extend(request_id, codes, finished=upstream is not None)
        return True

    def validate(
        self, index: int, request: StageInput | None, params: Any, prompt: dict[str, Any] | None = None
    ) -> None:
        check_params(self, index, params)
        if params.stream:
            try:
                self.decoder.plan(params)
            except ValueError as e:
                raise ValueError(f"request {index}: stage {self.config.name!r}: {e}") from None
        if prompt is not None:
            self.voices.pick(index, prompt)
        if request is None:
            return
        self.voices.pick(index, request.prompt)
        codes = request.token_ids
        check_ids(index, codes, self.codec_vocab_size, kind="codec")
        geometry = self.geometry
        if len(codes) > geometry.max_codes and not params.stream:
            raise ValueError(
                f"request {index}: {len(codes)} codes exceed the limit of {geometry.max_codes} "
                f"(engine option max_codes of stage {self.config.name!r}, at most the DiT's "
                "max_position_embeddings // repeats)"
            )
        if params.initial_noise is not None:
            want = (len(codes) * geometry.repeats, geometry.mel_dim)
            got = tuple(np.shape(params.initial_noise))
            if got != want:
                raise ValueError(
                    f"request {index}: initial_noise has shape {got}, {len(codes)} codes need {want} "
                    "([len(codes) * repeats, mel_dim])"
                )

    def submit(self, request_id: str, request: StageInput, params: Token2WavParams) -> None:
        """Queue the request for an offline solve, or with ``stream=True`` decode its codes (all
        there) chunk by chunk."""
        if params.stream:
            self.open(request_id, request.prompt, params)
            self.feed(0, request_id, request.token_ids, None)
            self.decoder.extend(request_id, [], finished=True)
            return
        speaker = self.voices.pick(0, request.prompt)
        self._submitted[request_id] = (time.perf_counter(), len(request.token_ids))
        self.runner.add(
            Code2WavRequest.new(
                request_id,
                np.asarray(request.token_ids, np.int32),
                speaker.cond,
                speaker.ref_mel,
                dataclasses.replace(params),
            )
        )

    def abort(self, request_id: str) -> bool:
        """Drop the request from the solve queue (aborts come between steps, so a request is
        never inside a running solve)."""
        if self._streamed.pop(request_id, None) is not None:
            return self.decoder.remove(request_id)
        if self._submitted.pop(request_id, None) is None:
            return False
        self.runner.remove(lambda r: r.request_id == request_id)
        return True

    def has_work(self) -> bool:
        return self.runner.has_work() or self.decoder.has_work()

    def load(self) -> StageLoad:
        """Streamed requests run (they are decoded as their codes come); offline ones wait for a
        solve, which runs inside one step."""
        return StageLoad(running=self.decoder.num_streaming, waiting=self.runner.num_waiting)

    def warmup(self) -> int:
        """Compile every solve program: offline, one per rows bucket up to ``max_batch`` and code
        length up to ``max_codes`` (:func:`~omni_jax.stages.code2wav_batch.code_buckets`);
        streamed, one per rows bucket. Returns how many. After it no request mix compiles."""
        return self.runner.warmup() + self.decoder.warmup()

    def step(self) -> StageStep:
        """One chunk solve of the streamed requests with a chunk ready, then one offline solve;
        a streamed request's audio comes chunk by chunk, an offline one's whole."""
        results: list[StageResult] = []
        audio: dict[str, np.ndarray] = {}
        if self.decoder.has_work():
            for out in self.decoder.step():
                if out.error is None:
                    audio[out.request_id] = out.audio
                finished = self._chunk_done(out)
                if finished is not None:
                    results.append(finished)
        if self.runner.has_work():
            results += self._solve(audio)
        return StageStep(results, new_audio=audio)

    def _chunk_done(self, out: ChunkOutput) -> StageResult | None:
        """Record a streamed chunk; the request's result when it was its last."""
        streamed = self._streamed[out.request_id]
        now = time.perf_counter()
        streamed.solve_s += out.solve_s
        if streamed.first_audio_s is None and out.error is None:
            streamed.first_audio_s = now - streamed.opened
        streamed.pieces.append(out.audio)
        if not out.last:
            return None
        del self._streamed[out.request_id]
        wave = np.concatenate(streamed.pieces)
        metrics = {
            "wall_s": now - streamed.opened,
            "first_audio_s": streamed.first_audio_s,
            "solve_s": streamed.solve_s,
            "chunks": len(streamed.pieces),
            "num_codes": len(streamed.codes),
            "num_samples": len(wave),
            "seed": streamed.seed,
        }
        if out.error is not None:
            return StageResult(out.request_id, streamed.codes, "error", metrics, error=out.error)
        return StageResult(
            out.request_id, streamed.codes, "stop", metrics, audio=wave, sample_rate=self.sample_rate
        )

    def _solve(self, audio: dict[str, np.ndarray]) -> list[StageResult]:
        """One offline solve; its requests finish together, with their whole waveforms."""
        results = []
        for r in self.runner.step():
            started, num_codes = self._submitted.pop(r.request.request_id)
            metrics = {
                "wall_s": time.perf_counter() - started,
                "solve_s": r.solve_s,
                "batch_size": r.batch_size,
                "num_codes": num_codes,
                "num_samples": 0 if r.output is None else len(r.output),
                "seed": r.request.seed,
            }
            codes = r.request.codes.tolist()
            if r.error is not None:
                results.append(StageResult(r.request.request_id, codes, "error", metrics, error=r.error))
            else:
                audio[r.request.request_id] = r.output
                results.append(
                    StageResult(
                        r.request.request_id,
                        codes,
                        "stop",
                        metrics,
                        audio=r.output,
                        sample_rate=self.sample_rate,
                    )
                )
        return results
