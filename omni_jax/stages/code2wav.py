"""Qwen2.5-Omni's code2wav stage: codec tokens + a voice -> 24 kHz waveform, batched.

The stage owns what is particular to the model (voices, the codec vocabulary, the DiT's length
limit, the sample rate) and how its requests pad into one solve (:mod:`omni_jax.stages.code2wav_batch`);
the engine's :class:`~omni_jax.engine.generation_runner.GenerationRunner` owns the queue, the
grouping by length, the closed set of solve shapes, warm-up and the solve; the books of both
paths, the step and aborts are :class:`~omni_jax.stages.code2wav_common.Code2WavStageBase`'s,
shared with Qwen3-Omni's stage.

A request with ``Token2WavParams(stream=True)`` is decoded chunk by chunk instead
(:class:`~omni_jax.stages.code2wav_stream.ChunkedDecoder`): after the talker it is a
:class:`~omni_jax.stages.base.FedStage`, taking the talker's codes as they are made, so its
first audio comes a chunk after the talker's first codes rather than after its last.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from omni_jax.engine.generation_runner import GenerationRunner, SolveBuckets
from omni_jax.models.qwen2_5_omni.chunk_plan import ChunkPlanner
from omni_jax.models.qwen2_5_omni.speakers import Voices
from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, token2wav_compiled
from omni_jax.models.qwen2_5_omni.token2wav_chunk import token2wav_chunk_compiled
from omni_jax.stages.base import HiddenHandoff, StageInput, StageParams, StageResult, check_ids
from omni_jax.stages.code2wav_batch import (
    Code2WavBatch,
    Code2WavRequest,
    SolveGeometry,
    code2wav_runner,
    code_buckets,
)
from omni_jax.stages.code2wav_common import Code2WavStageBase, stream_setting
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.code2wav_stream import ChunkedDecoder
from omni_jax.stages.config import StageConfig

SAMPLE_RATE = 24_000
"""Qwen2.5-Omni's BigVGAN output rate (not recorded in the checkpoint's config)."""

ENGINE_OPTIONS = ("max_batch", "max_codes", "max_solve_codes", "stream")
"""The stage YAML's ``engine`` keys this stage reads (:func:`solve_limits`, :func:`max_solve_codes`,
:func:`~omni_jax.stages.code2wav_common.streaming_on`)."""

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_CODES = 4096
"""Codes per request when the stage YAML sets no ``max_codes``: the talker's default
``max_tokens`` (transformers' ``talker_max_new_tokens``), 82 s of audio at 50 codes per second.
With ``max_batch`` and :data:`DEFAULT_MAX_SOLVE_CODES` it bounds the largest solve, which the
start-up check must find room for."""

DEFAULT_MAX_SOLVE_CODES = 4096
"""Rows x codes of one solve at most when the stage YAML sets no ``max_solve_codes``: one request
of :data:`DEFAULT_MAX_CODES`, two of 2048 codes, or eight of 512. A solve's DiT and vocoder work
and its temporaries grow with its codes, and 4096 codes (8192 mel frames, twice that with
guidance) already fill a GPU, so larger solves would only add programs and memory (the memory
section of benchmarks/RESULTS.md has what the 8 x 4096 solve took at the 7B's widths). It keeps
the stage, its streamed chunks' programs included, within the 64 programs a stage may warm up at
the released model's sizes, where 8192 went past them (``tests/test_compile_once.py`` counts
them). Longer requests are solved a few at a time instead."""


def voiced_codes(tokens: list[int], upstream: StageResult | None) -> list[int]:
    """The talker's ``tokens`` that are codes to voice: all but a stop token, which ends the
    tokens of a result that finished with ``"stop"`` (the reference cuts at the first codec EOS
    or pad)."""
    if upstream is not None and upstream.finish_reason == "stop" and tokens:
        return list(tokens[:-1])
    return list(tokens)


def solve_limits(sc: StageConfig, model: Token2Wav, max_input: int | None) -> tuple[int, int]:
    """``(max_batch, max_codes)`` of a code2wav stage: its engine options, codes capped by the
    DiT's positions and by ``max_input``, the most tokens its input stage makes per request
    (``None`` when it reads prompts): a talker of ``max_model_len`` 512 never hands on more codes,
    so longer solves would be programs compiled for nothing."""
    dit = model.dit
    max_batch = sc.engine_int("max_batch", DEFAULT_MAX_BATCH)
    positions = dit.max_position_embeddings // dit.repeats
    max_codes = min(sc.engine_int("max_codes", DEFAULT_MAX_CODES), positions, max_input or positions)
    if max_batch < 1 or max_codes < 1:
        raise ValueError(f"stage {sc.name!r}: max_batch={max_batch} and max_codes={max_codes} must be >= 1")
    return max_batch, max_codes


def max_solve_codes(sc: StageConfig) -> int:
    """The stage YAML's ``engine.max_solve_codes`` (default :data:`DEFAULT_MAX_SOLVE_CODES`): the
    most rows x codes of one offline solve (a request alone always runs, whatever its length)."""
    return sc.engine_int("max_solve_codes", DEFAULT_MAX_SOLVE_CODES)


STREAM_KEYS = {
    "chunk_codes": "chunk",
    "first_chunk_codes": "first",
    "past_codes": "past",
    "future_codes": "future",
    "overlap_frames": "overlap",
    "max_chunk_codes": "max_chunk",
}
"""The stage YAML's ``engine.stream`` keys and the :class:`ChunkPlanner` constants they set
(codes for the DiT's chunks and context, mel frames for the vocoder's overlap)."""


def stream_planner(sc: StageConfig, model: Token2Wav) -> ChunkPlanner:
    """The streamed decoding constants: Qwen's, or those of the stage YAML's ``engine.stream``
    (e.g. ``{chunk_codes: 36}``; a request's ``chunk_codes`` may be at most its largest chunk)."""

    # Each key's units to the planner's mel frames: codes are repeats frames each.
    factor = {key: 1 if key == "overlap_frames" else model.dit.repeats for key in STREAM_KEYS}

    def build(given: dict[str, int]) -> ChunkPlanner:
        chosen = {STREAM_KEYS[k]: v * factor[k] for k, v in given.items()}
        planner = ChunkPlanner.for_model(model, **chosen)
        positions = model.dit.max_position_embeddings
        if planner.window_frames > positions:
            raise ValueError(
                f"the longest chunk window, {planner.window_frames} mel frames, exceeds the DiT's "
                f"max_position_embeddings ({positions})"
            )
        return planner

    # The planner's refusals name the first chunk by its property, first_chunk.
    terms = {("first_chunk" if c == "first" else c): (key, factor[key]) for key, c in STREAM_KEYS.items()}
    return stream_setting(sc, STREAM_KEYS, build, terms)


def solve_demand(sc: StageConfig, model: Token2Wav, max_input: int | None) -> dict[str, int]:
    """The largest offline solve's temporaries, for the start-up memory check (an estimate: see
    :func:`omni_jax.models.qwen2_5_omni.token2wav.solve_bytes_per_code`); ``max_input`` as in
    :func:`solve_limits`. The chunk planner is built here too, from the abstract model, so that
    a bad ``engine.stream`` is refused before any weight is read."""
    stream_planner(sc, model)
    max_batch, max_codes = solve_limits(sc, model, max_input)
    buckets = SolveBuckets.build(max_batch, code_buckets(max_codes), max_cells=max_solve_codes(sc))
    rows, codes = buckets.largest()
    what = f"stage {sc.name!r} largest solve ({rows} requests of {codes} codes, estimate)"
    return {what: model.solve_bytes_per_code * rows * codes}


class Code2WavStage(Code2WavStageBase[Code2WavRequest, Code2WavBatch, ChunkedDecoder]):
    """Prompts (when first) are ``{"prompt_token_ids": codes, "speaker": name}``.

    Codes index the DiT's codec embedding: valid ids are ``0 .. num_embeds`` inclusive (the
    table has ``num_embeds + 1`` rows, as in transformers). A request may hold at most the
    engine option ``max_codes`` codes (default :data:`DEFAULT_MAX_CODES`), never more than
    ``max_position_embeddings // repeats``, the reference's limit on mel length; waiting requests
    share a solve of at most ``max_solve_codes`` rows x codes (:func:`max_solve_codes`). A prompt
    without ``"speaker"`` uses :attr:`default_speaker`: the YAML's ``default_speaker`` (a voice
    the checkpoint lacks is refused at load), else the checkpoint's first voice.
    """

    sample_rate = SAMPLE_RATE
    size_key = "num_codes"

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
        super().__init__(config, runner, decoder, defaults)
        self.geometry = geometry
        self.voices = voices
        self.codec_vocab_size = codec_vocab_size

    @property
    def default_speaker(self) -> str:
        return self.voices.default

    @classmethod
    def build(
        cls, sc: StageConfig, model: Token2Wav, path: Path, mesh: Mesh | None, max_input: int | None
    ) -> Code2WavStage:
        """The stage over the loaded ``model`` and ``path``'s voices; offline solves up to
        :func:`solve_limits` codes (``max_input``: the most its input stage makes per request)."""
        voices = Voices.load(path, sc.default_speaker)
        speakers = voices.speakers
        widths = {name: len(s.cond) for name, s in speakers.items()}
        if len(set(widths.values())) != 1:
            raise ValueError(f"{path}: the voices' cond vectors differ in width: {widths}")
        dit = model.dit
        max_batch, max_codes = solve_limits(sc, model, max_input)
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
            max_solve_codes=max_solve_codes(sc),
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
            sample_rate=SAMPLE_RATE,
            max_batch=max_batch,
            mesh=mesh,
        )
        return cls(sc, runner, geometry, voices, codec_vocab_size, defaults, decoder)

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        """The talker's codes up to its stop token; ``None`` when it stopped before any code, so
        there is nothing to voice."""
        codes = voiced_codes(upstream.token_ids, upstream)
        if not codes:
            return None
        return StageInput(codes, prompt, upstream=upstream)

    def open(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: Token2WavParams,
        capture_hidden: bool = False,
        stream_hidden: bool = False,
    ) -> None:
        del capture_hidden, stream_hidden  # codes in, audio out: no hidden states
        speaker = self.voices.pick(0, prompt)
        request = self.decoder.add(request_id, speaker.cond, speaker.ref_mel, dataclasses.replace(params))
        self._opened(request_id, request.codes, {"seed": request.seed})

    def feed(
        self,
        index: int,
        request_id: str,
        tokens: list[int],
        upstream: StageResult | None,
        rows: HiddenHandoff | None = None,
    ) -> bool:
        """The talker's new codes (its stop token cut, :func:`voiced_codes`), each checked against
        the codec vocabulary, then queued for the request's chunks."""
        codes = voiced_codes(tokens, upstream)
        if codes:
            check_ids(index, codes, self.codec_vocab_size, kind="codec")
        streamed = self._streamed[request_id]
        if upstream is not None and not streamed.codes and not codes:
            self.abort(request_id)
            return False
        self.decoder.extend(request_id, codes, finished=upstream is not None)
        return True

    def validate(
        self,
        index: int,
        request: StageInput | None,
        params: StageParams,
        prompt: dict[str, Any] | None = None,
    ) -> None:
        self._check_params(index, params)
        if prompt is not None:
            self.voices.pick(index, prompt)
        if request is None:
            if params.initial_noise is not None:
                self._check_noise_fits_a_request(index, params.initial_noise)
            return
        self.voices.pick(index, request.prompt)
        codes = request.token_ids
        check_ids(index, codes, self.codec_vocab_size, kind="codec")
        geometry = self.geometry
        if len(codes) > geometry.max_codes and not self.streams(params):
            why = "" if self.streaming else "; the stage decodes offline only (engine.stream: false)"
            if params.initial_noise is not None:
                why = "; decoded in chunks, a longer request's noise comes from a seed: drop initial_noise"
            if why:
                raise ValueError(
                    f"request {index}: {len(codes)} codes exceed the limit of {geometry.max_codes} "
                    f"(engine option max_codes of stage {self.config.name!r}, at most the DiT's "
                    f"max_position_embeddings // repeats and its input stage's max_model_len){why}"
                )
        if params.initial_noise is not None:
            want = (len(codes) * geometry.repeats, geometry.mel_dim)
            got = tuple(np.shape(params.initial_noise))
            if got != want:
                raise ValueError(
                    f"request {index}: initial_noise has shape {got}, {len(codes)} codes need {want} "
                    "([len(codes) * repeats, mel_dim])"
                )

    def _check_noise_fits_a_request(self, index: int, noise: np.ndarray) -> None:
        """Refuse an ``initial_noise`` that no codes the input stage may make would fit: not
        ``mel_dim`` wide, or not ``repeats`` mel frames for each of 1 to ``max_codes`` codes (a
        longer request is decoded in chunks, whose noise comes from a seed). Its exact length is
        checked once the codes it is for come; this check runs at admission, before the stages
        before this one work for a request that must fail."""
        g = self.geometry
        frames, width = np.shape(noise)
        if width != g.mel_dim or frames % g.repeats or not 0 < frames <= g.max_codes * g.repeats:
            raise ValueError(
                f"request {index}: initial_noise has shape {(frames, width)}, which no request's codes "
                f"fit: [len(codes) * {g.repeats}, {g.mel_dim}] ([len(codes) * repeats, mel_dim]) for "
                f"1 to {g.max_codes} codes (max_codes)"
            )

    def _chunked(self, params: Token2WavParams, codes: int) -> bool:
        """Whether a request of ``codes`` codes (all there) is decoded chunk by chunk: it asks to
        stream, or it is longer than an offline solve holds (``max_codes``) and streaming is on:
        then it is decoded as a streamed request is (the talker made more codes than
        ``max_codes``, with its ``max_tokens`` raised past it), and its waveform still comes
        whole to ``run()`` and to a reply that does not stream."""
        return self.streams(params) or (self.streaming and codes > self.geometry.max_codes)

    def submit(self, request_id: str, request: StageInput, params: Token2WavParams) -> None:
        """Queue the request for an offline solve, or with ``stream=True`` (or when it is longer
        than an offline solve holds, :meth:`_chunked`) decode its codes (all there) chunk by
        chunk."""
        if self._chunked(params, len(request.token_ids)):
            self.open(request_id, request.prompt, params)
            self.feed(0, request_id, request.token_ids, None)
            self.decoder.extend(request_id, [], finished=True)
            return
        speaker = self.voices.pick(0, request.prompt)
        codes = np.asarray(request.token_ids, np.int32)
        self._queue(
            Code2WavRequest.new(
                request_id, codes, speaker.cond, speaker.ref_mel, dataclasses.replace(params)
            ),
            len(codes),
        )

    def _check_stream(self, params: Token2WavParams) -> None:
        self.decoder.plan(params)

    def _offline_codes(self, request: Code2WavRequest) -> list[int]:
        return request.codes.tolist()

    def _offline_tags(self, request: Code2WavRequest) -> dict[str, int]:
        return {"seed": request.seed}
