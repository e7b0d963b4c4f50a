"""Qwen2.5-Omni's thinker served by the generic AR stage: what is particular to it lives here.

The AR engine knows nothing of audio or images. This frontend gives it:

- ``prepare``: a prompt's ``multi_modal_data`` through :class:`OmniProcessor` (features and
  placeholder expansion) and its M-RoPE positions (:func:`get_rope_index`), before any work,
  kept as the request's :class:`ThinkerRequest`; media an encoder cannot take in one call is
  refused there (:class:`EncoderBuckets`);
- ``step_inputs`` (:class:`ThinkerStepInputs`, the engine's
  :class:`~omni_jax.engine.step.StepInputs`): each step's ``[3, n]`` positions from the
  prompt's and ``rope_delta`` (:func:`positions_for`), right after a preemption too; the
  encoders, run before a step for the requests it admits; and the encoder rows its prompt
  chunks need, packed as a :class:`PromptMerge` for :meth:`Thinker.embed`, with one row a
  step token row, so it adds no shape of its own to the AR step programs;
- ``media``: the layout of the prompt's media (:class:`~omni_jax.stages.base.PromptMedia`),
  which the talker reads to index its own prompt.

Encoders run once per request when it is first scheduled (all requests scheduled in that step
together, cut into as few encoder calls as their cost model picks), and their rows are kept on
the host, in the request's :class:`ThinkerRequest`, until its first step past the prompt. A
request preempted after that is encoded again when it is recomputed, so rows are not held for
requests that are decoding (and decode steps run no encoder). When an encoder call fails (a
device error, input the feature path cannot take), the requests of that step are encoded one
at a time to find the culprit: only it ends, with ``finish_reason="error"``, and the others run
on (:meth:`ThinkerStepInputs.prepare`).

Every encoder call has a size from a fixed set (:class:`EncoderBuckets`): the audio encoder's
chunk counts, powers of two up to what the feature extractor's window (``chunk_length``) needs,
a longer clip (Qwen3-Omni's processor takes one) being encoded in pieces across calls
(:meth:`ThinkerStepInputs.audio_pieces`), so that the largest call's memory does not grow with
``max_model_len``; the vision encoder's token counts, the band tile times 1, 2, 3, 4, 6, 8, 12,
... (two sizes a doubling, so that past the smallest sizes a call is at most a third padding) up
to what the largest image or video frame the processor emits needs, or a frame of
``max_model_len`` tokens where that is less (no admissible prompt holds a larger one).
:meth:`ThinkerFrontend.warmup` compiles all of them, so no request mix compiles an encoder after
it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from omni_jax.engine.compilation import compile_ahead, compile_threads
from omni_jax.engine.memory import ProgramBytes
from omni_jax.engine.step import StepRow, all_available
from omni_jax.models.qwen2_5_omni.audio_encoder import (
    AudioBatch,
    RowSplit,
    audio_chunk_buckets,
    audio_chunks,
    plan_audio_calls,
    prepare_audio_batch,
)
from omni_jax.models.qwen2_5_omni.processor import VIDEO_SIZE, MediaParts, OmniInputs, OmniProcessor
from omni_jax.models.qwen2_5_omni.rope_index import media_rope_index, positions_for
from omni_jax.models.qwen2_5_omni.thinker import PromptMerge, Thinker, ThinkerSpec
from omni_jax.models.qwen2_5_omni.vision_encoder import (
    VisionBatch,
    VisionCall,
    plan_vision_calls,
    prepare_vision_batch,
    vision_token_buckets,
)
from omni_jax.stages.base import PromptMedia, Stage, StageInput, StageResult, require_state
from omni_jax.stages.encoder_programs import CallBytes, EncoderPrograms, call_bytes

T = TypeVar("T")

PROCESSOR_KWARGS = ("use_audio_in_video", "fps")
"""Keys a prompt's ``mm_processor_kwargs`` may hold (vLLM's name for per-prompt processor options)."""


SMALLEST_VISION_CALL = 256
"""Tokens (patches) of the smallest vision call :meth:`EncoderBuckets.for_processor` makes: a
224x224 image. Images smaller than that, which a processor's ``min_pixels`` allows but video
frames never are, pad to it. The sizes below it (64, 128 and 192 at Qwen2.5-Omni's band tile)
would be programs of their own for the cheapest calls, whose padding costs little."""


@dataclasses.dataclass(frozen=True)
class EncoderBuckets:
    """The call sizes the thinker's encoders are compiled for, ascending.

    audio_chunks: chunks (``2 * n_window`` mel frames each) of an audio encoder call.
    vision_tokens: patches of a vision encoder call (see :func:`vision_token_buckets`).
    The largest of each is the most one clip, image or video frame may need.
    """

    audio_chunks: tuple[int, ...] = ()
    vision_tokens: tuple[int, ...] = ()

    @classmethod
    def for_processor(
        cls,
        processor: OmniProcessor | MediaParts,
        spec: ThinkerSpec,
        video_pixels: int = VIDEO_SIZE["longest_edge"],
        max_model_len: int | None = None,
    ) -> EncoderBuckets:
        """Sized to the processor's own bounds: the feature extractor's window (its
        ``chunk_length``; a longer clip, which Qwen3-Omni's processor takes, is encoded in pieces
        of at most the largest call, :meth:`ThinkerStepInputs.audio_pieces`, so no audio call
        grows with ``max_model_len``), and the most pixels its image processor or the video path
        (``video_pixels``: the family's bound) resizes a frame to, so that any frame it accepts
        fits one call; vision calls from :data:`SMALLEST_VISION_CALL` tokens.

        ``max_model_len``: the longest prompt the stage admits. A frame of more patches than
        that many prompt tokens merge from is refused with its prompt anyway, so the vision
        calls stop at the size that holds such a frame: the largest vision programs, the
        slowest to compile, are not built for frames no request can bring (Qwen2.5-Omni-7B at
        the default 4096: calls up to 16384 patches, not the processor's 65536)."""
        vision = spec.vision
        largest_frame = max(int(processor.image_processor.size["longest_edge"]), video_pixels) // (
            vision.patch_size * vision.patch_size
        )
        if max_model_len is not None:
            largest_frame = min(largest_frame, max_model_len * vision.spatial_merge_size**2)
        return cls(
            audio_chunks=audio_chunk_buckets(int(processor.feature_extractor.nb_max_frames), spec.audio),
            vision_tokens=vision_token_buckets(vision, largest_frame, SMALLEST_VISION_CALL),
        )

    def check(
        self,
        index: int,
        inputs: OmniInputs,
        spec: ThinkerSpec,
        audio_pieces: Callable[[int], Sequence[tuple[int, int]]],
    ) -> None:
        """``ValueError`` naming request ``index``, the item and the limit when a piece of a clip
        (``audio_pieces`` of its mel frames: :meth:`ThinkerStepInputs.audio_pieces`) or a frame
        needs more than the largest call."""
        if inputs.audio_features:
            most = self.audio_chunks[-1]
            frames = spec.audio.chunk_frames
            for i, n in enumerate(inputs.audio_seqlens):
                if max(audio_chunks(b - a, spec.audio) for a, b in audio_pieces(n)) > most:
                    raise ValueError(
                        f"request {index}: audio {i} has {n} mel frames, more than the audio encoder's "
                        f"largest call takes ({most} chunks of {frames} frames = {most * frames} frames)"
                    )
        for kind, grids in (("image", inputs.image_grid_thw), ("video", inputs.video_grid_thw)):
            for i, (_, h, w) in enumerate(grids):
                if h * w > self.vision_tokens[-1]:
                    raise ValueError(
                        f"request {index}: {kind} {i} is {h}x{w} = {h * w} patches a frame, more than the "
                        f"vision encoder's largest call takes ({self.vision_tokens[-1]} patches)"
                    )


MEDIA_KINDS = ("audio", "image", "video")
"""The media a prompt's ``multi_modal_data`` may hold, in :class:`MediaLimits`' names."""


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """The most items of each kind of media one prompt may hold: vLLM's ``limit_mm_per_prompt``,
    from the thinker stage YAML's ``engine.limit_mm_per_prompt`` (e.g. ``{image: 0, video: 0}``);
    a kind not named has no limit. A kind limited to 0 is off, and its encoder's programs are
    not compiled at warm-up (the vision encoder's when images and videos are both off): a
    deployment that takes no such media does not pay their start-up, which on a GPU host is
    seconds a program. A prompt past a limit is refused at validation, naming it."""

    audio: int | None = None
    image: int | None = None
    video: int | None = None

    @classmethod
    def from_engine(cls, stage: str, engine: dict[str, Any]) -> MediaLimits:
        """The limits of a stage YAML's ``engine`` (none when it has no ``limit_mm_per_prompt``);
        ``ValueError`` naming the stage for a kind it does not know or a count that is not a
        non-negative integer."""
        given = engine.get("limit_mm_per_prompt") or {}
        if not isinstance(given, dict):
            raise ValueError(f"stage {stage!r}: engine.limit_mm_per_prompt must be a mapping, got {given!r}")
        unknown = sorted(set(given) - set(MEDIA_KINDS))
        if unknown:
            raise ValueError(
                f"stage {stage!r}: engine.limit_mm_per_prompt has unknown kinds {unknown} "
                f"(known: {list(MEDIA_KINDS)})"
            )
        for kind, n in given.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(
                    f"stage {stage!r}: engine.limit_mm_per_prompt.{kind}={n!r} must be a non-negative integer"
                )
        return cls(**given)

    def buckets(self, buckets: EncoderBuckets) -> EncoderBuckets:
        """``buckets`` less the encoder calls of the kinds that are off."""
        return EncoderBuckets(
            audio_chunks=() if self.audio == 0 else buckets.audio_chunks,
            vision_tokens=() if self.image == 0 and self.video == 0 else buckets.vision_tokens,
        )

    def check(self, index: int, counts: dict[str, int]) -> None:
        """``ValueError`` naming request ``index`` when its prompt holds more of a kind than
        allowed (``counts``: the items of each kind; a video's audio track counts as audio)."""
        for kind in MEDIA_KINDS:
            limit, n = getattr(self, kind), counts.get(kind, 0)
            if limit is not None and n > limit:
                raise ValueError(
                    f"request {index}: {n} {kind} item(s), more than the {limit} a prompt may hold here "
                    "(the thinker stage's engine.limit_mm_per_prompt)"
                )


@dataclasses.dataclass
class ThinkerRequest:
    """The thinker's state of one request (its :attr:`StageInput.state`, opaque to the engine).

    ``before[token][i]``: placeholders of that kind among the first ``i`` prompt tokens, so a
    chunk ``[start, end)`` needs rows ``before[start] : before[end]`` of that kind.
    ``rows``: encoder rows per placeholder id, in placeholder order, while prompt chunks need
    them (set and dropped by :meth:`ThinkerStepInputs.prepare`).
    """

    inputs: OmniInputs
    positions: np.ndarray
    rope_delta: int
    before: dict[int, np.ndarray]
    rows: dict[int, np.ndarray] | None = None

    @property
    def has_media(self) -> bool:
        return self.inputs.has_media

    @property
    def media_summary(self) -> str:
        """What the prompt's media expanded to, for messages (``""`` without media)."""
        counts = [int(b[-1]) for b in self.before.values()]  # keyed audio, image, video ids
        parts = [f"{n} {kind}" for kind, n in zip(("audio", "image", "video"), counts, strict=True) if n]
        return f"its media placeholders expanded to {', '.join(parts)} tokens" if parts else ""


def _needs_rows(row: StepRow[ThinkerRequest]) -> bool:
    """The row's chunk holds prompt tokens of a request with media whose encoder rows are not
    on the host (first scheduled, or recomputed after a preemption); decode rows never do."""
    req = row.state
    return req is not None and req.has_media and req.rows is None and row.start < row.prompt_len


class ThinkerStepInputs:
    """The thinker's :class:`~omni_jax.engine.step.StepInputs`: M-RoPE positions, the encoders
    at admission, and each step's :class:`PromptMerge` (host side).

    What another family's encoders change is in :attr:`audio_batch_class`,
    :attr:`vision_batch_class` (their call inputs' shapes), :meth:`audio_batch`,
    :meth:`vision_batch` (a call's inputs), :meth:`vision_rows` and :attr:`row_width` (the
    width of a merged row, here the decoder's)."""

    position_shape = (3,)
    draw_hook = None  # the thinker draws its tokens and nothing more
    audio_batch_class: Any = AudioBatch
    vision_batch_class: Any = VisionBatch

    def __init__(self, model: Thinker, buckets: EncoderBuckets):
        spec = model.thinker_spec
        self.spec = spec
        self.buckets = buckets
        self.token_ids = (spec.audio_token_id, spec.image_token_id, spec.video_token_id)
        self.width = spec.text.hidden_size
        self.row_width = self.width
        self.dtype = np.dtype(model.model.embed_tokens.embedding.dtype)
        self._audio_tower, self._visual = model.audio_tower, model.visual
        audio_def, self._audio_state = nnx.split(model.audio_tower)
        vision_def, self._vision_state = nnx.split(model.visual)
        self._audio = EncoderPrograms(audio_def)
        self._vision = EncoderPrograms(vision_def, self.vision_rows)

    @staticmethod
    def vision_rows(out: Any) -> jax.Array:
        """The vision encoder's output as the rows a step merges (traced into its programs):
        here the output itself."""
        return out

    def largest_call(self, platform: str) -> ProgramBytes | None:
        """What the encoder calls hold at most on a device of ``platform``
        (:func:`~omni_jax.stages.encoder_programs.call_bytes`): the largest call of
        :attr:`buckets` (an audio call of the most chunks or a vision call of the most tokens)
        running, beside the largest output of the call before it, which is being read
        (:func:`_one_ahead`); ``None`` without encoder calls. The two encoders' programs are
        compiled side by side: each is the whole encoder."""
        calls: dict[str, Callable[[], CallBytes]] = {}
        if self.buckets.audio_chunks:
            n = self.buckets.audio_chunks[-1]
            calls[f"audio, {n} chunks"] = functools.partial(
                call_bytes, self._audio_tower, self.audio_batch_class, n, None, platform
            )
        if self.buckets.vision_tokens:
            n = self.buckets.vision_tokens[-1]
            calls[f"vision, {n} patches"] = functools.partial(
                call_bytes, self._visual, self.vision_batch_class, n, self.vision_rows, platform
            )
        if not calls:
            return None
        with ThreadPoolExecutor(compile_threads(len(calls)), thread_name_prefix="compile") as pool:
            counted = dict(zip(calls, pool.map(lambda count: count(), calls.values()), strict=True))
        what, largest = max(counted.items(), key=lambda c: c[1].running)
        read = max(c.output for c in counted.values())
        return ProgramBytes(f"{what}, XLA's count", largest.running + read)

    def audio_pieces(self, frames: int) -> list[tuple[int, int]]:
        """The ``(start, stop)`` mel frames of the pieces a clip of ``frames`` frames is encoded
        in, each an item of :func:`plan_audio_calls`, whose rows, in order, are the clip's: here
        the clip whole (Qwen2.5-Omni's processor takes no clip past the extractor's window, which
        the largest call holds)."""
        return [(0, frames)]

    def audio_batch(
        self, clips: Sequence[tuple[ThinkerRequest, np.ndarray]], chunks: int
    ) -> tuple[Any, RowSplit]:
        """One audio encoder call of ``chunks`` chunks over ``clips`` (each with its request; a
        clip may be a piece of one: :meth:`audio_pieces`)."""
        return prepare_audio_batch([f for _, f in clips], self.spec.audio, min_chunks=chunks)

    def vision_batch(
        self, patches: list[np.ndarray], grids: list[tuple[int, int, int]], tokens: int
    ) -> tuple[Any, RowSplit]:
        """One vision encoder call of ``tokens`` tokens over ``patches`` of ``grids``."""
        return prepare_vision_batch(patches, grids, self.spec.vision, tokens=tokens)

    def encode(self, requests: Sequence[ThinkerRequest]) -> None:
        """Every request's audio, then its images and videos, in the calls each encoder's plan
        cuts them into (:func:`plan_audio_calls`, :func:`plan_vision_calls`)."""
        audio_rows = self._encode_audio([(r, f) for r in requests for f in r.inputs.audio_features])
        patches = [p for r in requests for p in (*r.inputs.image_patches, *r.inputs.video_patches)]
        grids = [g for r in requests for g in (*r.inputs.image_grid_thw, *r.inputs.video_grid_thw)]
        audio_it, vision_it = iter(audio_rows), iter(self._encode_vision(patches, grids))
        empty = np.zeros((0, self.width), self.dtype)

        def take(it: Any, n: int) -> np.ndarray:
            pieces = [next(it) for _ in range(n)]
            return np.concatenate(pieces) if pieces else empty

        audio_id, image_id, video_id = self.token_ids
        for r in requests:
            r.rows = {
                audio_id: take(audio_it, len(r.inputs.audio_features)),
                image_id: take(vision_it, len(r.inputs.image_patches)),
                video_id: take(vision_it, len(r.inputs.video_patches)),
            }

    def _encode_audio(self, clips: list[tuple[ThinkerRequest, np.ndarray]]) -> list[np.ndarray]:
        """Each clip's rows (a long clip's pieces may come from several calls)."""
        if not clips:
            return []
        spec, buckets = self.spec.audio, self.buckets.audio_chunks
        pieces = [(c, a, b) for c, (_, f) in enumerate(clips) for a, b in self.audio_pieces(f.shape[1])]

        def dispatch() -> Iterator[tuple[tuple[list[int], RowSplit], jax.Array]]:
            for call in plan_audio_calls([b - a for _, a, b in pieces], spec, buckets):
                items = pieces[call.start : call.stop]
                batch, split = self.audio_batch(
                    [(clips[c][0], clips[c][1][:, a:b]) for c, a, b in items], call.size
                )
                yield ([c for c, _, _ in items], split), self._audio(self._audio_state, batch)

        rows: list[list[np.ndarray]] = [[] for _ in clips]
        for (owners, split), out in _one_ahead(dispatch()):
            for c, piece_rows in zip(owners, split.split(out), strict=True):
                rows[c].append(piece_rows)
        return [np.concatenate(r) for r in rows]

    def _encode_vision(
        self, patches: list[np.ndarray], grids: list[tuple[int, int, int]]
    ) -> list[np.ndarray]:
        """Each image's or video's rows (a video's frames may come from several calls)."""
        if not patches:
            return []

        def dispatch() -> Iterator[tuple[tuple[VisionCall, RowSplit], jax.Array]]:
            for call in plan_vision_calls(grids, self.spec.vision, self.buckets.vision_tokens):
                pieces, piece_grids = [], []
                for p in call.pieces:
                    _, h, w = grids[p.item]
                    pieces.append(patches[p.item][p.first * h * w : (p.first + p.frames) * h * w])
                    piece_grids.append((p.frames, h, w))
                batch, split = self.vision_batch(pieces, piece_grids, call.tokens)
                yield (call, split), self._vision(self._vision_state, batch)

        rows: list[list[np.ndarray]] = [[] for _ in patches]
        for (call, split), out in _one_ahead(dispatch()):
            for p, piece_rows in zip(call.pieces, split.split(out), strict=True):
                rows[p.item].append(piece_rows)
        return [np.concatenate(r) for r in rows]

    def positions(self, state: ThinkerRequest | None, start: int, end: int) -> np.ndarray:
        t = require_state(state, "thinker")
        return positions_for(t.positions, t.rope_delta, start, end)

    def available(self, state: ThinkerRequest | None) -> None:
        """All: the prompt is whole when the request is submitted."""
        return all_available(state)

    def prepare(self, rows: Sequence[StepRow[ThinkerRequest]]) -> dict[int, str]:
        """The step's requests' encoder rows: those of requests now past their prompt are
        dropped (only prompt chunks read them), then the media of the requests whose prompt
        chunks need rows (newly scheduled, or recomputed after a preemption) are encoded
        together; returns ``{row index: message}`` for the requests whose encoding failed.

        When the joint encoding fails, each request is encoded alone, so only the culprit fails
        (its error names the exception); the others keep their rows and run.
        """
        for r in rows:
            if r.state is not None and r.start >= r.prompt_len:
                r.state.rows = None
        pending = [i for i, r in enumerate(rows) if _needs_rows(r)]
        if not pending:
            return {}
        try:
            self.encode([require_state(rows[i].state, "thinker") for i in pending])
            return {}
        except Exception as e:  # noqa: BLE001 - any fault ends only its request(s)
            if len(pending) == 1:
                return {pending[0]: _encoder_error(e)}
        failed = {}
        for i in pending:
            try:
                self.encode([require_state(rows[i].state, "thinker")])
            except Exception as e:  # noqa: BLE001 - as above
                failed[i] = _encoder_error(e)
        return failed

    def warmup(self) -> int:
        """Compile every program of :attr:`buckets` (from shapes: nothing runs), side by side
        (:func:`compile_ahead`: an encoder program at real widths is slow to compile, and compiled
        one at a time they would add up to a long start-up); returns how many encoder programs
        there are."""
        compile_ahead(
            [
                *(
                    self._audio.ahead(self._audio_state, self.audio_batch_class.shapes(self.spec.audio, n))
                    for n in self.buckets.audio_chunks
                ),
                *(
                    self._vision.ahead(
                        self._vision_state, self.vision_batch_class.shapes(self.spec.vision, n)
                    )
                    for n in self.buckets.vision_tokens
                ),
            ]
        )
        return len(self._audio) + len(self._vision)

    def pack(
        self, rows: Sequence[StepRow[ThinkerRequest]], firsts: Sequence[int], tokens: int
    ) -> PromptMerge:
        """The encoder rows this step's prompt chunks need, grouped by step row then kind, in
        ``tokens`` rows (a step never merges more than it has tokens), so that the merge has no
        shape of its own beyond the step's. A token row's ``first_row`` of a kind is where its
        placeholder's encoder row lies, should it be one (a flat step's token row holds one
        token). Reads the rows :meth:`prepare` encoded; changes nothing; a slice per step row
        and kind, not a call per token."""
        first = np.zeros((len(self.token_ids), tokens), np.int32)
        limit = np.zeros((tokens,), np.int32)
        merged = np.zeros((tokens, self.row_width), self.dtype)
        offset = 0
        for row, here in zip(rows, firsts, strict=True):
            req = row.state
            if req is None or not req.has_media or row.start >= row.prompt_len:
                continue
            if req.rows is None:
                raise RuntimeError("a prompt chunk with media has no encoder rows: prepare runs before pack")
            end = min(row.end, row.prompt_len)
            limit[here : here + end - row.start] = 1
            for k, token in enumerate(self.token_ids):
                before = req.before[token]
                a, b = int(before[row.start]), int(before[end])
                first[k, here : here + end - row.start] = before[row.start : end] + (offset - a)
                kind_rows = req.rows[token][a:b]  # narrower than row_width: the first columns
                merged[offset : offset + b - a, : kind_rows.shape[1]] = kind_rows
                offset += b - a
        return PromptMerge(merged, first, limit, self.token_ids)


def _one_ahead(dispatched: Iterator[tuple[T, jax.Array]]) -> Iterator[tuple[T, np.ndarray]]:
    """The results of encoder calls in order, each read once the next call is dispatched: the
    host packs a call while the device runs the one before, and no more than two calls' buffers
    are alive at once, however many calls a step makes. Each result's copy to the host starts
    as it is dispatched, so its read waits for the call, not for the transfer after it."""
    previous: tuple[T, jax.Array] | None = None
    for current in dispatched:
        current[1].copy_to_host_async()
        if previous is not None:
            yield previous[0], np.asarray(previous[1])
        previous = current
    if previous is not None:
        yield previous[0], np.asarray(previous[1])


def _encoder_error(e: Exception) -> str:
    return f"encoder failed: {type(e).__name__}: {e}"


class ThinkerFrontend:
    """The thinker's :class:`~omni_jax.stages.ar.ARFrontend` (see the module docstring).

    Another family's thinker sets :attr:`processor_class`, :attr:`step_inputs_class`,
    :attr:`video_pixels` (its video path's most pixels a frame) and :meth:`rope_index`."""

    eos_token_ids = None  # the checkpoint's generation_config.json describes the thinker
    suppress_ids: tuple[int, ...] = ()
    reads_hidden = False
    processor_class: type[OmniProcessor] = OmniProcessor
    step_inputs_class: type[ThinkerStepInputs] = ThinkerStepInputs
    video_pixels: int = VIDEO_SIZE["longest_edge"]

    def __init__(
        self,
        processor: OmniProcessor | None,
        model: Thinker,
        buckets: EncoderBuckets | None = None,
        limits: MediaLimits = MediaLimits(),
        max_model_len: int | None = None,
    ):
        """``buckets``: the encoders' call sizes; default :meth:`EncoderBuckets.for_processor`
        for prompts of at most ``max_model_len`` tokens (none without a processor: text prompts
        only), less the kinds ``limits`` turns off."""
        self.processor = processor
        self.spec = model.thinker_spec
        self.rope_spec = self.spec.rope_index
        self.limits = limits
        self.max_model_len = max_model_len
        if buckets is None:
            buckets = (
                EncoderBuckets()
                if processor is None
                else EncoderBuckets.for_processor(processor, self.spec, self.video_pixels, max_model_len)
            )
        self.step_inputs = self.step_inputs_class(model, limits.buckets(buckets))

    @classmethod
    def build(
        cls, model: Thinker, path: Path, limits: MediaLimits = MediaLimits(), max_model_len: int | None = None
    ) -> ThinkerFrontend:
        """With the checkpoint's processor files; without ``preprocessor_config.json`` the stage
        takes text prompts only."""
        has_processor = (Path(path) / "preprocessor_config.json").exists()
        processor = cls.processor_class.from_pretrained(path) if has_processor else None
        return cls(processor, model, limits=limits, max_model_len=max_model_len)

    @classmethod
    def encoder_memory(
        cls, model: Thinker, path: Path, limits: MediaLimits, max_model_len: int, platform: str
    ) -> ProgramBytes | None:
        """What the encoder calls of a stage :meth:`build` would make hold at most on a device of
        ``platform`` (:meth:`ThinkerStepInputs.largest_call`), for the memory plan: ``model`` may
        be abstract, and of the checkpoint only ``preprocessor_config.json`` is read (none
        there: text prompts only, no encoder calls)."""
        if not (Path(path) / "preprocessor_config.json").exists():
            return None
        parts = MediaParts.from_pretrained(path)
        buckets = EncoderBuckets.for_processor(parts, model.thinker_spec, cls.video_pixels, max_model_len)
        return cls.step_inputs_class(model, limits.buckets(buckets)).largest_call(platform)

    def prepare(self, index: int, request: StageInput) -> StageInput:
        prompt = request.prompt
        kwargs = prompt.get("mm_processor_kwargs") or {}
        if not isinstance(kwargs, dict) or set(kwargs) - set(PROCESSOR_KWARGS):
            raise ValueError(
                f"request {index}: mm_processor_kwargs must be a dict with keys among {PROCESSOR_KWARGS}, "
                f"got {kwargs!r}"
            )
        data = prompt.get("multi_modal_data")
        if self.processor is None:
            if data:
                raise ValueError(f"request {index}: this checkpoint has no preprocessor_config.json")
            inputs = OmniInputs(input_ids=list(request.token_ids))
        else:
            admit = functools.partial(self._admit, index)
            inputs = self.processor.process(
                index, request.token_ids, data, admit=admit, max_tokens=self.max_model_len, **kwargs
            )
            # A prompt past max_model_len is refused by the stage's validation, naming its
            # length: the limit such a prompt's frames exceed (the vision calls stop there).
            if self.max_model_len is None or len(inputs.input_ids) < self.max_model_len:
                self.step_inputs.buckets.check(index, inputs, self.spec, self.step_inputs.audio_pieces)
        try:
            positions, delta = self.rope_index(inputs)
        except (ValueError, IndexError) as e:
            message = str(e) or "placeholders do not match the multimodal inputs"
            raise ValueError(f"request {index}: {message}") from None
        ids = np.asarray(inputs.input_ids)
        before = {t: np.concatenate([[0], np.cumsum(ids == t)]) for t in self.step_inputs.token_ids}
        state = ThinkerRequest(inputs, positions, delta, before)
        return dataclasses.replace(request, token_ids=list(inputs.input_ids), state=state)

    def _admit(self, index: int, counts: dict[str, int], least_tokens: int) -> None:
        """Refuse request ``index`` before its media are featurised: more items of a kind than
        :class:`MediaLimits` allow, or a prompt whose clips and videos at their fewest tokens
        take it to ``max_model_len`` (hundreds of frames cost seconds and gigabytes to resize,
        and Qwen3-Omni featurises a clip of any length, before either was refused for its
        length)."""
        self.limits.check(index, counts)
        # Without clips or videos the stage's own check, which has the exact length, refuses it.
        counted = [
            what
            for kind, what in (
                ("audio", "its audio clips expanded from their samples"),
                ("video", "its videos' frames expanded at their smallest size"),
            )
            if counts[kind]
        ]
        if counted and self.max_model_len is not None and least_tokens >= self.max_model_len:
            raise ValueError(
                f"request {index}: prompt has at least {least_tokens} tokens ({', '.join(counted)}), "
                f"max_model_len is {self.max_model_len} (at least one token must be generated)"
            )

    def rope_index(self, inputs: OmniInputs) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions and ``rope_delta`` (``ValueError`` when its placeholders
        and media disagree)."""
        return media_rope_index(self.rope_spec, inputs.input_ids, inputs)

    def warmup(self) -> int:
        """Compile every encoder program ahead of traffic, from shapes (nothing runs); returns
        how many there are (none without a processor: text prompts only). Those are one audio
        program per chunk count of :attr:`EncoderBuckets.audio_chunks` (1, 2, 4, ... up to the
        feature extractor's window; a longer clip is encoded in pieces of those calls) and one
        vision program per token count of :attr:`EncoderBuckets.vision_tokens` (the vision
        encoder's band tile times 1, 2, 3, 4, 6, 8, ... up to the largest frame the processor
        emits): every call :meth:`ThinkerStepInputs.encode` can make, whatever the images, videos
        and clips a step admits."""
        return self.step_inputs.warmup()

    def check_prompt(self, index: int, prompt: dict[str, Any]) -> None:
        """Nothing beyond :meth:`prepare`: the thinker is the stage that reads the prompt."""

    def connect(self, upstream: Stage) -> None:
        raise ValueError("the thinker reads the user's prompt; no stage can feed it")

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        raise ValueError("the thinker reads the user's prompt; no stage can feed it")

    def describe(self, state: ThinkerRequest | None) -> str:
        """What the prompt's media expanded to (:attr:`ThinkerRequest.media_summary`)."""
        return "" if state is None else state.media_summary

    def fed_length(self, prompt_ids: list[int], reply_room: int) -> None:
        """None: the thinker reads the user's prompt."""
        return None

    def media(self, state: ThinkerRequest | None) -> PromptMedia:
        """The layout of the prompt's media, for the talker's rotary positions."""
        inputs = require_state(state, "thinker").inputs
        return PromptMedia(
            image_grid_thw=tuple((int(t), int(h), int(w)) for t, h, w in inputs.image_grid_thw),
            video_grid_thw=tuple((int(t), int(h), int(w)) for t, h, w in inputs.video_grid_thw),
            video_second_per_grid=tuple(inputs.video_second_per_grid),
            audio_seqlens=tuple(inputs.audio_seqlens),
            use_audio_in_video=inputs.use_audio_in_video,
        )
