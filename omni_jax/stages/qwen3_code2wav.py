"""Qwen3-Omni's code2wav stage: codec frames -> 24 kHz waveform, whole or streamed, batched.

Qwen3-Omni's talker makes one codec frame per step: ``num_quantizers`` codes, its first codebook
and the code predictor's others. A request's codes are those frames flattened frame-major (frame
``t``'s codes consecutive), as prompt ids when the stage is first and as the talker's tokens when
it feeds the stage. The model (:class:`~omni_jax.models.qwen3_omni.code2wav.Code2Wav`) is a
causal ConvNet with no noise and no voice: the speaker was chosen by the talker.

Offline requests (the default) are decoded whole by the engine's
:class:`~omni_jax.engine.generation_runner.GenerationRunner` over a closed set of ``(rows,
frames)`` shapes, one ``code2wav_compiled`` program each. A request with
``Token2WavParams(stream=True)`` is decoded chunk by chunk
(:class:`~omni_jax.stages.qwen3_code2wav_stream.FrameDecoder`); after the talker the stage is a
:class:`~omni_jax.stages.base.FedStage`, taking the talker's frames as they are made, so its first
audio comes a frame or a few after the talker's first frame. The books of both paths, the step
and aborts are :class:`~omni_jax.stages.code2wav_common.Code2WavStageBase`'s, shared with
Qwen2.5-Omni's stage.

The params are the public :class:`~omni_jax.stages.code2wav_params.Token2WavParams`, so callers
and the server treat both families alike: ``stream`` and ``chunk_codes`` (here counted in code
frames) apply; the flow-matching fields (``num_steps``, ``guidance_scale``,
``sway_coefficient``, ``seed``, ``initial_noise``) are Qwen2.5-Omni's DiT's and are ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from omni_jax.engine.buckets import ladder
from omni_jax.engine.generation_runner import GenerationResult, GenerationRunner, PaddedBatch
from omni_jax.models.qwen3_omni.code2wav import Code2Wav, code2wav_chunk_compiled, code2wav_compiled
from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec
from omni_jax.stages.base import HiddenHandoff, StageInput, StageParams, StageResult, check_ids
from omni_jax.stages.code2wav_common import Code2WavStageBase, stream_setting
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.config import StageConfig
from omni_jax.stages.qwen3_code2wav_stream import FrameDecoder, StreamPlan

SAMPLE_RATE = 24_000
"""Qwen3-Omni's code2wav output rate (not recorded in the checkpoint's config)."""

ENGINE_OPTIONS = ("max_batch", "max_frames", "stream")
"""The stage YAML's ``engine`` keys this stage reads (:func:`solve_limits`, :func:`stream_plan`)."""

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_FRAMES = 300
"""New frames of one offline decode when the stage YAML sets no ``max_frames``: 24 s at the
released model's 12.5 frames per second, transformers' ``generate``'s chunk (``chunked_decode``'s
``chunk_size``), so an offline request's audio is ``generate``'s. A longer request is decoded in
pieces of this many new frames (:data:`OFFLINE_CONTEXT`). A whole decode's temporaries grow with
its frames (:func:`solve_bytes`: about 7.5 GB for 8 such requests of the released model)."""

OFFLINE_CONTEXT = 25
"""Frames of left context before each offline piece after the first: ``generate`` decodes a reply
longer than its chunk with ``chunked_decode(codes, chunk_size=300, left_context_size=25)``, each
piece's window its new frames after up to 25 of the previous ones, whose samples it drops. The
pieces are independent decodes, so they are rows of the offline solves (batched with any other
request); their windows, up to ``max_frames`` plus this, are the longest offline bucket."""

MIN_FRAMES = 16
"""The shortest padded frame count: shorter requests are a small share of a solve's work, and
every size below it would be programs of its own."""

FRAME_STEPS = 2
"""Padded frame counts per octave (:func:`~omni_jax.engine.buckets.ladder`), as Qwen2.5-Omni's
code buckets: a decode's work is linear in its frames, so two sizes an octave waste at most a
third of a padded solve for twice the programs of powers of two."""

STREAM_KEYS: dict[str, int | None] = {
    "chunk_frames": 25,
    "first_chunk_frames": 1,
    "left_context_frames": 25,
    "max_chunk_frames": None,
}
"""The stage YAML's ``engine.stream`` keys and their defaults, vLLM-omni's for Qwen3-Omni
(``talker2code2wav_async_chunk`` in ``vllm_omni/model_executor/stage_input_processors/qwen3_omni.py``:
``codec_chunk_frames`` 25 new frames per chunk, 2 s at 12.5 frames per second, after
``codec_left_context_frames`` 25; its ``initial_codec_chunk_frames`` makes the first chunk
smaller, 1 frame in the configuration where the talker voices the first frame itself,
``first_frame_decoder.py``): audio from the first frame, as the model is built for. Its chunks do
not grow (``max_chunk_frames`` unset); set, they double up to it, as in the shipped YAML."""


def frame_buckets(max_frames: int) -> tuple[int, ...]:
    """The padded frame counts of offline solves: :data:`FRAME_STEPS` per octave from
    :data:`MIN_FRAMES` up to ``max_frames`` (the last size, on the ladder or not)."""
    return ladder(MIN_FRAMES, max_frames, FRAME_STEPS)


def solve_limits(sc: StageConfig, spec: Code2WavSpec, max_input: int | None) -> tuple[int, int, int]:
    """``(max_batch, max_frames, window)`` of the stage's offline decodes: rows, new frames of a
    piece (the engine option, capped by the transformer's ``max_position_embeddings`` and by
    ``max_input``, the most steps, one frame each, its input talker makes per request; ``None``
    when it reads prompts) and the longest window a solve decodes: ``max_frames`` when no request
    can be longer, else :data:`OFFLINE_CONTEXT` more (``max_frames`` then capped to leave room for
    it in the positions)."""
    positions = spec.max_position_embeddings
    max_batch = sc.engine_int("max_batch", DEFAULT_MAX_BATCH)
    max_frames = min(sc.engine_int("max_frames", DEFAULT_MAX_FRAMES), positions)
    if max_batch < 1 or max_frames < 1:
        raise ValueError(f"stage {sc.name!r}: max_batch={max_batch} and max_frames={max_frames} must be >= 1")
    if max_input is not None and max_input <= max_frames:
        return max_batch, max_input, max_input
    max_frames = min(max_frames, positions - OFFLINE_CONTEXT)
    if max_frames < 1:
        raise ValueError(
            f"stage {sc.name!r}: the transformer's {positions} positions leave no frames after "
            f"{OFFLINE_CONTEXT} of context"
        )
    return max_batch, max_frames, max_frames + OFFLINE_CONTEXT


def stream_plan(sc: StageConfig, positions: int) -> StreamPlan:
    """The streamed decoding constants: :data:`STREAM_KEYS`, or those the stage YAML's
    ``engine.stream`` sets (e.g. ``{chunk_frames: 12}``: chunks grow only when ``max_chunk_frames``
    is set above ``chunk_frames``; a request's ``chunk_codes`` may be at most the largest chunk).
    ``ValueError`` when the widest window exceeds the transformer's ``positions``, as an offline
    request may not."""

    def build(given: dict[str, int]) -> StreamPlan:
        values = {**STREAM_KEYS, **given}
        plan = StreamPlan(
            values["chunk_frames"],
            values["first_chunk_frames"],
            values["left_context_frames"],
            values["max_chunk_frames"],
        )
        if plan.window_frames > positions:
            raise ValueError(
                f"the widest chunk window, {plan.window_frames} frames, exceeds the transformer's "
                f"max_position_embeddings ({positions})"
            )
        return plan

    terms = {key.removesuffix("_frames"): (key, 1) for key in STREAM_KEYS}  # the plan's names, in frames
    return stream_setting(sc, STREAM_KEYS, build, terms)


def solve_bytes(spec: Code2WavSpec, rows: int, frames: int) -> int:
    """Estimated temporaries of one decode of ``rows`` x ``frames`` (float32), for the start-up
    memory check.

    Per frame: the transformer's hidden buffers, MLP intermediate and window of scores; the
    upsampling ConvNeXt blocks (hidden width, 4x in their MLP) at each rate; then the decoder's
    widest stage (channels x samples per frame), held a few times over through its residual
    units' activations and sums. Per pair of frames: the attention's scores and probabilities,
    which ``jax.nn.dot_product_attention`` materializes whole (masked to the window, not cut to
    it). Against XLA's own accounting (``compiled.memory_analysis().temp_size_in_bytes``, CPU) it
    is 1.1x to 2.3x, from the tiny test model to the released model's config.
    """
    d = spec.hidden_size
    per_frame = 8 * d + 2 * spec.intermediate_size + spec.num_heads * (spec.sliding_window or 1)
    upsample, rate = 0, 1
    for r in spec.upsampling_ratios:
        rate *= r
        upsample = max(upsample, 6 * d * rate)
    widest = spec.decoder_dim * rate
    for i, r in enumerate(spec.upsample_rates):
        rate *= r
        widest = max(widest, spec.decoder_dim // 2 ** (i + 1) * rate)
    per_frame += upsample + 4 * widest + 2 * spec.num_heads * frames
    return 4 * rows * frames * per_frame


def solve_demand(sc: StageConfig, model: Code2Wav, max_input: int | None) -> dict[str, int]:
    """The largest solve's temporaries (:func:`solve_bytes`, an estimate): ``max_batch`` rows of
    the longer of :func:`solve_limits`' offline window and the streamed one."""
    max_batch, _, window = solve_limits(sc, model.spec, max_input)
    frames = max(window, stream_plan(sc, model.spec.max_position_embeddings).window_frames)
    what = f"stage {sc.name!r} largest solve ({max_batch} requests of {frames} frames, estimate)"
    return {what: solve_bytes(model.spec, max_batch, frames)}


@dataclasses.dataclass(frozen=True)
class FramesRequest:
    """One offline decode: ``codes [num_quantizers, frames]``, a whole request or piece ``piece``
    of ``pieces`` of a longer one (:data:`OFFLINE_CONTEXT`), whose first ``context`` frames are
    the previous piece's (their samples are dropped)."""

    request_id: str
    codes: np.ndarray
    context: int = 0
    piece: int = 0
    pieces: int = 1


@dataclasses.dataclass
class _Split:
    """A request decoded in pieces: the whole of it, and the results of its pieces landed so far
    (by piece)."""

    whole: FramesRequest
    landed: dict[int, GenerationResult[FramesRequest]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FramesBatch(PaddedBatch):
    """One offline solve's inputs (host arrays), in ``code2wav_compiled``'s order."""

    codes: np.ndarray
    frames: np.ndarray


@dataclasses.dataclass(frozen=True)
class FramesPadder:
    """The :class:`~omni_jax.engine.generation_runner.BatchPadder` of Qwen3-Omni's code2wav: a
    request's length is its frames; rows are right-padded (every stage of the model is causal,
    so padding changes no valid sample)."""

    num_quantizers: int
    output = "waveform"

    def length(self, request: FramesRequest) -> int:
        return int(request.codes.shape[1])

    def pad(self, requests: Sequence[FramesRequest], rows: int, length: int) -> FramesBatch:
        """``requests`` in the first rows of a ``rows`` x ``length`` solve; a row with no request
        decodes one frame of code 0, so no row is empty."""
        batch = FramesBatch(
            codes=np.zeros((rows, self.num_quantizers, length), np.int32),
            frames=np.ones(rows, np.int32),
        )
        for i, r in enumerate(requests):
            batch.codes[i, :, : r.codes.shape[1]] = r.codes
            batch.frames[i] = r.codes.shape[1]
        return batch


class Qwen3Code2WavStage(Code2WavStageBase[FramesRequest, FramesBatch, FrameDecoder]):
    """Prompts (when first) are ``{"prompt_token_ids": codes}``: frames flattened frame-major,
    each code in ``[0, codebook_size)``, a whole number of frames, any number of them. An
    offline request longer than the engine option ``max_frames`` (default
    :data:`DEFAULT_MAX_FRAMES`) is decoded in pieces as ``generate`` decodes it
    (:data:`OFFLINE_CONTEXT`), its audio whole once its last piece has landed; a streamed one
    chunk by chunk. A prompt with a ``"speaker"`` is refused: the voice is in the codes (the
    talker chose it), and a silently ignored voice would be a surprise.

    Fed by a talker (:meth:`feed`), the tokens are the same frame-major codes, the talker's stop
    token already cut (that is the talker wiring's business): a step's tokens may end inside a
    frame (the rest follows), the last ones must end on a whole frame.
    """

    sample_rate = SAMPLE_RATE
    size_key = "num_frames"

    def __init__(
        self,
        config: StageConfig,
        runner: GenerationRunner[FramesRequest, FramesBatch],
        decoder: FrameDecoder,
        spec: Code2WavSpec,
        max_frames: int,
        defaults: Token2WavParams,
    ):
        super().__init__(config, runner, decoder, defaults)
        self.spec = spec
        self.max_frames = max_frames
        self._splits: dict[str, _Split] = {}

    @classmethod
    def build(
        cls, sc: StageConfig, model: Code2Wav, path: Path, mesh: Mesh | None, max_input: int | None
    ) -> Qwen3Code2WavStage:
        """The stage over the loaded ``model`` (``path`` holds nothing more it needs); offline
        decodes of up to :func:`solve_limits`' window (``max_input``: its talker's most frames per
        request)."""
        spec = model.spec
        max_batch, max_frames, window = solve_limits(sc, spec, max_input)
        runner = GenerationRunner(
            code2wav_compiled,
            model,
            FramesPadder(spec.num_quantizers),
            lengths=frame_buckets(window),
            max_batch=max_batch,
            mesh=mesh,
            name=sc.name,
        )
        decoder = FrameDecoder(
            code2wav_chunk_compiled,
            model,
            stream_plan(sc, spec.max_position_embeddings),
            num_quantizers=spec.num_quantizers,
            sample_rate=SAMPLE_RATE,
            max_batch=max_batch,
            mesh=mesh,
        )
        return cls(sc, runner, decoder, spec, max_frames, sc.default_params(Token2WavParams))

    def prepare(self, index: int, request: StageInput) -> StageInput:
        """A prompt given to this stage first: no media, and no speaker (the voice is in the codes;
        a full pipeline's speaker is the talker's, and its prompt reaches this stage by
        :meth:`accept`)."""
        if request.prompt.get("speaker") is not None:
            raise ValueError(
                f"request {index}: this code2wav takes no speaker: the voice is in the codes, chosen by "
                "the talker that wrote them"
            )
        return super().prepare(index, request)

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        """The talker's frames (its stop token cut by the talker wiring); ``None`` when it made
        none, so there is nothing to voice."""
        if not upstream.token_ids:
            return None
        return StageInput(list(upstream.token_ids), prompt, upstream=upstream)

    def open(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: Token2WavParams,
        capture_hidden: bool = False,
        stream_hidden: bool = False,
    ) -> None:
        del capture_hidden, stream_hidden  # codes in, audio out: no hidden states
        self._opened(request_id, self.decoder.add(request_id, params.chunk_codes).codes)

    def feed(
        self,
        index: int,
        request_id: str,
        tokens: list[int],
        upstream: StageResult | None,
        rows: HiddenHandoff | None = None,
    ) -> bool:
        """The talker's new codes (frame-major, no stop token), each checked against the
        codebook, then queued for the request's chunks; ``upstream`` set: they were its last."""
        if tokens:
            check_ids(index, tokens, self.spec.codebook_size, kind="codec")
        if upstream is not None and not self._streamed[request_id].codes and not tokens:
            self.abort(request_id)
            return False
        try:
            self.decoder.extend(request_id, tokens, finished=upstream is not None)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        return True

    def validate(
        self,
        index: int,
        request: StageInput | None,
        params: StageParams,
        prompt: dict[str, Any] | None = None,
    ) -> None:
        self._check_params(index, params)
        if request is None:
            return
        codes = request.token_ids
        check_ids(index, codes, self.spec.codebook_size, kind="codec")
        q = self.spec.num_quantizers
        if len(codes) % q:
            raise ValueError(
                f"request {index}: {len(codes)} codec ids are not whole frames of {q} codes "
                "(frame-major: each frame's codes consecutive)"
            )

    def submit(self, request_id: str, request: StageInput, params: Token2WavParams) -> None:
        """Queue the request for an offline solve (in pieces when it is longer than
        :attr:`max_frames`), or with ``stream=True`` decode its frames (all there) chunk by
        chunk."""
        if self.streams(params):
            self.open(request_id, request.prompt, params)
            self.decoder.extend(request_id, request.token_ids, finished=True)
            return
        frames = len(request.token_ids) // self.spec.num_quantizers
        codes = np.asarray(request.token_ids, np.int32).reshape(frames, self.spec.num_quantizers).T
        whole = FramesRequest(request_id, np.ascontiguousarray(codes))
        if frames <= self.max_frames:
            self._queue(whole, frames)
            return
        starts = range(0, frames, self.max_frames)
        self._splits[request_id] = _Split(whole)
        for piece, start in enumerate(starts):
            context = min(OFFLINE_CONTEXT, start)
            window = whole.codes[:, start - context : start + self.max_frames]
            self._queue(FramesRequest(request_id, window, context, piece, len(starts)), frames)

    def _joined(self, result: GenerationResult[FramesRequest]) -> GenerationResult[FramesRequest] | None:
        """A whole request's result; a piece's is held until its request's last piece has landed,
        then they make the request's: the pieces' samples after their context, in order (the first
        error, if any), the largest solve any was in and the seconds of the solves they were in
        (each solve's results carry its seconds: pieces that shared a solve count it once)."""
        request = result.request
        if request.pieces == 1:
            return result
        split = self._splits[request.request_id]
        split.landed[request.piece] = result
        if len(split.landed) < request.pieces:
            return None
        del self._splits[request.request_id]
        parts = [split.landed[k] for k in range(request.pieces)]
        error = next((p.error for p in parts if p.error is not None), None)
        hop = self.spec.total_upsample
        wave = None
        if error is None:
            wave = np.concatenate(
                [p.output[p.request.context * hop :] for p in parts if p.output is not None]
            )
        return GenerationResult(
            split.whole,
            wave,
            error,
            max(p.batch_size for p in parts),
            sum({p.solve_s for p in parts}),
            sum(p.padded_length for p in parts),
        )

    def abort(self, request_id: str) -> bool:
        """The base's abort, and the pieces landed so far of a request decoded in pieces."""
        self._splits.pop(request_id, None)
        return super().abort(request_id)

    def _check_stream(self, params: Token2WavParams) -> None:
        self.decoder.plan_for(params.chunk_codes)

    def _size(self, codes: list[int]) -> int:
        return len(codes) // self.spec.num_quantizers

    def _offline_codes(self, request: FramesRequest) -> list[int]:
        return request.codes.T.reshape(-1).tolist()
