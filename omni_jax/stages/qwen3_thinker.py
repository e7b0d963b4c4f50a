"""Qwen3-Omni's thinker served by the generic AR stage: Qwen2.5-Omni's thinker frontend
(:mod:`omni_jax.stages.thinker`) with Qwen3-Omni's pieces.

Everything the engine sees is Qwen2.5-Omni's: the prompt is processed and positioned before
any work (:class:`Qwen3OmniProcessor`, Qwen3-Omni's :func:`media_rope_index`), encoders run
when a request is first scheduled (a failed call is retried one request at a time, so only the
culprit ends), every encoder call has a size from :class:`EncoderBuckets`, compiled by
``warmup``, and a step's encoder rows are packed one a step token row. What differs:

- the vision encoder gives the DeepStack features beside its rows; its program returns them
  side by side, ``[rows, (1 + L) * D]`` (:meth:`Qwen3ThinkerStepInputs.vision_rows`), and the
  step's pack (:meth:`Qwen3ThinkerStepInputs.pack`) splits them into the :class:`ThinkerMerge`
  that :meth:`Thinker.embed` and :meth:`Thinker.layer_inputs` read (audio rows fill only the
  first ``D`` columns: DeepStack never reads an audio row);
- a clip may be longer than the extractor's window (the processor featurises it whole, only
  ``max_model_len`` bounds it): it is encoded in pieces of whole attention windows, each at
  most the largest audio call (:func:`window_pieces`), whose rows are the whole clip's, so the
  audio calls stay those of the window, whatever ``max_model_len``;
- the reference pads every audio chunk of one ``get_audio_features`` call, one request's clips,
  to that call's longest chunk, and the padding is not masked between its convolutions, so each
  clip is encoded with its request's pad (:func:`reference_chunk_pad`), whatever other clips
  share the call;
- prompts whose video time positions are fractional (seconds per grid step times
  ``position_id_per_seconds`` not whole, e.g. ``fps=3``) are refused with a ``ValueError``: the
  engine's positions are integers and the reference's float positions would be rounded. The
  default 1 fps (26 positions a grid step) and 2 fps give whole ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.engine.step import StepRow
from omni_jax.models.qwen2_5_omni.audio_encoder import RowSplit
from omni_jax.models.qwen2_5_omni.processor import OmniInputs
from omni_jax.models.qwen3_omni.audio_encoder import (
    AudioBatch,
    prepare_audio_batch,
    reference_chunk_pad,
    window_pieces,
)
from omni_jax.models.qwen3_omni.processor import VIDEO_SIZE, Qwen3OmniProcessor
from omni_jax.models.qwen3_omni.rope_index import media_rope_index
from omni_jax.models.qwen3_omni.thinker import Thinker, ThinkerMerge
from omni_jax.models.qwen3_omni.vision_encoder import VisionBatch, prepare_vision_batch
from omni_jax.stages.thinker import EncoderBuckets, ThinkerFrontend, ThinkerRequest, ThinkerStepInputs


class Qwen3ThinkerStepInputs(ThinkerStepInputs):
    """Qwen2.5-Omni's thinker step inputs with Qwen3-Omni's encoders, whose vision rows carry
    their DeepStack features (module docstring)."""

    audio_batch_class = AudioBatch
    vision_batch_class = VisionBatch

    def __init__(self, model: Thinker, buckets: EncoderBuckets):
        super().__init__(model, buckets)  # Qwen3-Omni's thinker: the parts Qwen2.5-Omni's reads
        self.layers = model.thinker_spec.deepstack_layers
        self.row_width = (1 + self.layers) * self.width

    @staticmethod
    def vision_rows(out: tuple[jax.Array, tuple[jax.Array, ...]]) -> jax.Array:
        """``[rows, (1 + L) * D]``: each merged row, then its DeepStack features layer by layer."""
        rows, deepstack = out
        return jnp.concatenate([rows, *deepstack], axis=-1)

    def audio_pieces(self, frames: int) -> list[tuple[int, int]]:
        """Whole attention windows, as many as the largest audio call holds, a piece (module
        docstring)."""
        return window_pieces(frames, self.spec.audio, self.buckets.audio_chunks[-1])

    def audio_batch(
        self, clips: Sequence[tuple[ThinkerRequest, np.ndarray]], chunks: int
    ) -> tuple[AudioBatch, RowSplit]:
        """One audio encoder call, each clip's (or piece's) chunks padded as its request's
        reference call pads them (its request's whole clips together)."""
        spec = self.spec.audio
        pads = [reference_chunk_pad([f.shape[1] for f in r.inputs.audio_features], spec) for r, _ in clips]
        return prepare_audio_batch([f for _, f in clips], spec, min_chunks=chunks, pad_frames=pads)

    def vision_batch(
        self, patches: list[np.ndarray], grids: list[tuple[int, int, int]], tokens: int
    ) -> tuple[VisionBatch, RowSplit]:
        """One vision encoder call of Qwen3-Omni's layout (no windows, learned position taps)."""
        return prepare_vision_batch(patches, grids, self.spec.vision, tokens=tokens)

    def pack(
        self, rows: Sequence[StepRow[ThinkerRequest]], firsts: Sequence[int], tokens: int
    ) -> ThinkerMerge:
        """Qwen2.5-Omni's pack, its rows split into the merged rows and ``[L, N, D]`` DeepStack
        features."""
        merge = super().pack(rows, firsts, tokens)
        n, d = merge.rows.shape[0], self.width
        deepstack = np.ascontiguousarray(merge.rows[:, d:].reshape(n, self.layers, d).transpose(1, 0, 2))
        return ThinkerMerge(dataclasses.replace(merge, rows=merge.rows[:, :d]), deepstack)


class Qwen3ThinkerFrontend(ThinkerFrontend):
    """The Qwen3-Omni thinker's :class:`~omni_jax.stages.ar.ARFrontend` (module docstring)."""

    processor_class = Qwen3OmniProcessor
    step_inputs_class = Qwen3ThinkerStepInputs
    video_pixels = VIDEO_SIZE["longest_edge"]

    def rope_index(self, inputs: OmniInputs) -> tuple[np.ndarray, int]:
        """Qwen3-Omni's positions, refused when some are fractional (module docstring)."""
        positions, delta = media_rope_index(self.rope_spec, inputs.input_ids, inputs)
        if isinstance(delta, float):
            steps = ", ".join(f"{s:g}" for s in inputs.video_second_per_grid)
            raise ValueError(
                f"its video time positions are fractional ({steps} s a grid step x "
                f"{self.rope_spec.position_id_per_seconds:g} positions a second), which the engine's "
                "integer positions cannot carry: use an fps that makes them whole, e.g. 1 or 2"
            )
        return positions, delta
