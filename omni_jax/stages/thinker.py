"""Qwen2.5-Omni's thinker served by the generic AR stage: what is particular to it lives here.

The AR engine knows nothing of audio or images. This frontend gives it three things:

- ``prepare``: a prompt's ``multi_modal_data`` through :class:`OmniProcessor` (features and
  placeholder expansion) and its M-RoPE positions (:func:`get_rope_index`), before any work;
- ``positions``: each step's ``[3, n]`` positions from the prompt's and ``rope_delta``
  (:func:`positions_for`), right after a preemption too;
- ``step_inputs``: per step, the encoder rows its prompt chunks need, packed as a
  :class:`PromptMerge` for :meth:`Thinker.embed`.

Encoders run once per request when it is first scheduled (all requests scheduled in that step
in one audio and one vision call), and their rows are kept on the host until the request's
prefill is done. A request preempted after that is encoded again when it is recomputed,
so rows are never held for requests that are only decoding (and decode steps run no encoder).
When an encoder call fails (a device error, input the feature path cannot take), the
requests of that call are encoded one at a time to find the culprit: only it ends, with
``finish_reason="error"``, and the others run on (:meth:`ThinkerStepInputs.prepare`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from omni_jax.engine.ar_runner import StepRow
from omni_jax.engine.buckets import bucket
from omni_jax.engine.scheduler import ARRequest
from omni_jax.models.qwen2_5_omni.audio_encoder import prepare_audio_batch
from omni_jax.models.qwen2_5_omni.processor import OmniInputs, OmniProcessor
from omni_jax.models.qwen2_5_omni.rope_index import media_rope_index, positions_for
from omni_jax.models.qwen2_5_omni.thinker import PromptMerge, Thinker
from omni_jax.models.qwen2_5_omni.vision_encoder import prepare_vision_batch
from omni_jax.stages.base import StageInput, StageResult

MIN_MERGE_ROWS = 16
"""Smallest row bucket of a step's :class:`PromptMerge` (the shape every text or decode step has)."""

WARMUP_AUDIO_CHUNKS = 16
"""Audio encoder programs :meth:`ThinkerFrontend.warmup` compiles: chunk counts 1, 2, 4, 8, 16,
i.e. any one clip up to 30 s (the feature extractor's limit, 100-frame chunks of the real
model), or clips that a step admits together totalling that."""

WARMUP_IMAGE_SIZES = ((448, 448), (224, 224))
"""Images (height, width in pixels) whose vision encoder programs :meth:`ThinkerFrontend.warmup`
compiles, each alone in an encoder call (the processor's resize decides the patch grid)."""

PROCESSOR_KWARGS = ("use_audio_in_video", "fps")
"""Keys a prompt's ``mm_processor_kwargs`` may hold (vLLM's name for per-prompt processor options)."""


@dataclasses.dataclass
class ThinkerRequest:
    """One request's thinker inputs, carried as its ``ARRequest.extra``.

    ``before[token][i]``: placeholders of that kind among the first ``i`` prompt tokens, so a
    chunk ``[start, end)`` needs rows ``before[start] : before[end]`` of that kind.
    ``rows``: encoder rows per placeholder id, in placeholder order, while prefill needs them.
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


def _needs_rows(row: StepRow) -> bool:
    """The row's chunk holds prompt tokens of a request with media whose encoder rows are not
    on the host (first scheduled, or recomputed after a preemption); decode rows never do."""
    req: ThinkerRequest | None = row.extra
    return req is not None and req.has_media and req.rows is None and row.start < row.prompt_len


class ThinkerStepInputs:
    """Runs the encoders at admission and packs each step's :class:`PromptMerge` (host side)."""

    def __init__(self, model: Thinker):
        spec = model.thinker_spec
        self.spec = spec
        self.token_ids = (spec.audio_token_id, spec.image_token_id, spec.video_token_id)
        self.width = spec.text.hidden_size
        self.dtype = np.dtype(model.model.embed_tokens.embedding.dtype)
        audio_def, self._audio_state = nnx.split(model.audio_tower)
        vision_def, self._vision_state = nnx.split(model.visual)
        self._audio = jax.jit(lambda state, batch: nnx.merge(audio_def, state)(batch))
        self._vision = jax.jit(lambda state, batch: nnx.merge(vision_def, state)(batch))

    def encode(self, requests: Sequence[ThinkerRequest]) -> None:
        """Every request's audio in one encoder call and its images and videos in one more."""
        audio = [f for r in requests for f in r.inputs.audio_features]
        audio_rows: list[np.ndarray] = []
        if audio:
            batch, split = prepare_audio_batch(audio, self.spec.audio)
            audio_rows = split.split(np.asarray(self._audio(self._audio_state, batch)))
        patches = [p for r in requests for p in (*r.inputs.image_patches, *r.inputs.video_patches)]
        grids = [g for r in requests for g in (*r.inputs.image_grid_thw, *r.inputs.video_grid_thw)]
        vision_rows: list[np.ndarray] = []
        if patches:
            batch, split = prepare_vision_batch(patches, grids, self.spec.vision)
            vision_rows = split.split(np.asarray(self._vision(self._vision_state, batch)))
        audio_it, vision_it = iter(audio_rows), iter(vision_rows)
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

    def prepare(self, rows: Sequence[StepRow]) -> dict[int, str]:
        """Encode the media of the step's newly scheduled requests, all in one call per encoder;
        returns ``{row index: message}`` for the requests whose encoding failed.

        When the batched call fails, each request is encoded alone, so only the culprit fails
        (its error names the exception); the others keep their rows and run.
        """
        pending = [i for i, r in enumerate(rows) if _needs_rows(r)]
        if not pending:
            return {}
        try:
            self.encode([rows[i].extra for i in pending])
            return {}
        except Exception as e:  # noqa: BLE001 - any fault ends only its request(s)
            if len(pending) == 1:
                return {pending[0]: _encoder_error(e)}
        failed = {}
        for i in pending:
            try:
                self.encode([rows[i].extra])
            except Exception as e:  # noqa: BLE001 - as above
                failed[i] = _encoder_error(e)
        return failed

    def warmup(self, max_audio_chunks: int, vision_grids: Sequence[tuple[int, int, int]]) -> int:
        """Compile the audio encoder for every chunk bucket up to ``max_audio_chunks`` and the
        vision encoder for each of ``vision_grids`` alone; returns how many programs."""
        shapes = set()
        chunks = 1
        while chunks <= max_audio_chunks:
            batch, _ = prepare_audio_batch([], self.spec.audio, min_chunks=chunks)
            jax.block_until_ready(self._audio(self._audio_state, batch))
            shapes.add(("audio", chunks))
            chunks *= 2
        for t, h, w in vision_grids:
            patches = np.zeros((t * h * w, self.spec.vision.patch_dim), np.float32)
            batch, _ = prepare_vision_batch([patches], [(t, h, w)], self.spec.vision)
            key = ("vision", *(np.shape(x) for x in jax.tree.leaves(batch)))
            if key not in shapes:
                jax.block_until_ready(self._vision(self._vision_state, batch))
                shapes.add(key)
        return len(shapes)

    def pack(self, rows: Sequence[StepRow], batch: int, tokens: int) -> PromptMerge:
        """The rows this step's prompt chunks need, grouped by step row then kind, bucketed
        (rows :meth:`prepare` did not encode, e.g. in a direct ``ARRunner.execute``, are encoded
        here, and an encoder failure raises)."""
        pending = {id(r.extra): r.extra for r in rows if _needs_rows(r)}  # a chunk's tokens share one
        if pending:
            self.encode(list(pending.values()))
        first = np.zeros((len(self.token_ids), batch), np.int32)
        limit = np.zeros((batch,), np.int32)
        blocks: list[np.ndarray] = []
        offset = 0
        for i, row in enumerate(rows):
            req: ThinkerRequest | None = row.extra
            if req is None or req.rows is None:
                continue
            end = min(row.end, row.prompt_len)
            limit[i] = max(end - row.start, 0)
            for k, token in enumerate(self.token_ids):
                a, b = int(req.before[token][min(row.start, end)]), int(req.before[token][end])
                first[k, i] = offset
                blocks.append(req.rows[token][a:b])
                offset += b - a
            if row.end >= row.prompt_len:
                req.rows = None  # prefill done: a preempted request is encoded again
        merged = np.zeros((bucket(offset, MIN_MERGE_ROWS), self.width), self.dtype)
        if offset:
            merged[:offset] = np.concatenate(blocks)
        return PromptMerge(merged, first, limit, self.token_ids)


def _encoder_error(e: Exception) -> str:
    return f"encoder failed: {type(e).__name__}: {e}"


class ThinkerFrontend:
    """The thinker's :class:`~omni_jax.stages.ar.ARFrontend` (see the module docstring)."""

    position_shape = (3,)
    eos_token_ids = None  # the checkpoint's generation_config.json describes the thinker
    suppress_ids: tuple[int, ...] = ()
    reads_hidden = False

    def __init__(self, processor: OmniProcessor | None, model: Thinker):
        self.processor = processor
        self.rope_spec = model.thinker_spec.rope_index
        self.step_inputs = ThinkerStepInputs(model)

    @classmethod
    def build(cls, model: Thinker, path: Path) -> ThinkerFrontend:
        """With the checkpoint's processor files; without ``preprocessor_config.json`` the stage
        takes text prompts only."""
        has_processor = (Path(path) / "preprocessor_config.json").exists()
        return cls(OmniProcessor.from_pretrained(path) if has_processor else None, model)

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
            inputs = self.processor.process(index, request.token_ids, data, **kwargs)
        try:
            positions, delta = media_rope_index(self.rope_spec, inputs.input_ids, inputs)
        except (ValueError, IndexError) as e:
            message = str(e) or "placeholders do not match the multimodal inputs"
            raise ValueError(f"request {index}: {message}") from None
        ids = np.asarray(inputs.input_ids)
        before = {t: np.concatenate([[0], np.cumsum(ids == t)]) for t in self.step_inputs.token_ids}
        extra = ThinkerRequest(inputs, positions, delta, before)
        return dataclasses.replace(request, token_ids=list(inputs.input_ids), extra=extra)

    def warmup(self) -> int:
        """Compile the encoders ahead of traffic (nothing without a processor: text prompts only):
        audio for :data:`WARMUP_AUDIO_CHUNKS`, vision for :data:`WARMUP_IMAGE_SIZES`. Other image
        sizes, videos, several images in one call and longer audio batches compile on first use,
        and so do the AR step programs for a step's merged encoder rows above the smallest
        bucket (those multiply the prompt-step programs by the merge buckets: not cheap)."""
        if self.processor is None:
            return 0
        grids = self.processor.images([np.zeros((h, w, 3), np.uint8) for h, w in WARMUP_IMAGE_SIZES])[1]
        return self.step_inputs.warmup(WARMUP_AUDIO_CHUNKS, grids)

    def check_prompt(self, index: int, prompt: dict[str, Any]) -> None:
        """Nothing beyond :meth:`prepare`: the thinker is the stage that reads the prompt."""

    def connect(self, upstream: Any) -> None:
        raise ValueError("the thinker reads the user's prompt; no stage can feed it")

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        raise ValueError("the thinker reads the user's prompt; no stage can feed it")

    def positions(self, req: ARRequest, start: int, end: int) -> np.ndarray:
        t: ThinkerRequest = req.extra
        return positions_for(t.positions, t.rope_delta, start, end)
