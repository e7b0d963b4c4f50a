"""Qwen2.5-Omni thinker: the Qwen2 decoder with 3-D M-RoPE, plus its audio and vision towers.

The decoder is ``qwen2.py``'s, run on the same paged KV cache; only the rotary differs. Each
frequency pair of a head is rotated by one of three position axes (time, row, column), as
``mrope_section`` assigns them, so positions come in as ``[3, B, T]``
(:func:`~omni_jax.models.qwen2_5_omni.rope_index.get_rope_index` computes a prompt's). The
interface is :class:`~omni_jax.models.qwen2.Qwen2ForCausalLM`'s, so the AR engine runs the
thinker unchanged; for multimodal prompts :meth:`Thinker.embed` takes the step's encoder rows
(a :class:`PromptMerge`) and puts them in place of the placeholder tokens' embeddings
(:func:`merge_placeholders`) before the decoder call.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.param_map import ParamRule, prefixed
from omni_jax.models.qwen2 import (
    CAUSAL_LM_RULES,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen2Spec,
    causal_lm_ignore,
    partition_rules,
)
from omni_jax.models.qwen2_5_omni.audio_encoder import (
    AUDIO_IGNORE,
    AUDIO_RULES,
    AudioEncoder,
    AudioEncoderSpec,
)
from omni_jax.models.qwen2_5_omni.rope_index import RopeIndexSpec
from omni_jax.models.qwen2_5_omni.vision_encoder import VISION_RULES, VisionEncoder, VisionEncoderSpec
from omni_jax.parallel.rules import ShardRule

DEFAULT_MROPE_SECTION = (16, 24, 24)
"""The reference's fallback when ``rope_parameters`` names no ``mrope_section``."""


def mrope_section(spec: Qwen2Spec) -> tuple[int, ...]:
    """Frequency pairs per position axis (cycling time, row, column), checked against the head."""
    section = tuple(dict(spec.rope_parameters).get("mrope_section", DEFAULT_MROPE_SECTION))
    if sum(section) != spec.head_dim // 2:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {spec.head_dim // 2}")
    return section


class PlaceholderIds:
    """The placeholder token ids of a thinker spec, read from its ``rope_index`` (a mixin of this
    family's and Qwen3-Omni's :class:`ThinkerSpec`)."""

    rope_index: Any  # the dataclass's field

    @property
    def audio_token_id(self) -> int:
        return self.rope_index.audio_token_id

    @property
    def image_token_id(self) -> int:
        return self.rope_index.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.rope_index.video_token_id


@dataclasses.dataclass(frozen=True)
class ThinkerSpec(PlaceholderIds):
    """The parts of a ``Qwen2_5OmniThinkerConfig`` the thinker needs, hashable for jit."""

    text: Qwen2Spec
    audio: AudioEncoderSpec
    vision: VisionEncoderSpec
    rope_index: RopeIndexSpec

    @classmethod
    def from_hf(cls, cfg: Any) -> ThinkerSpec:
        """From the thinker config; tying follows its top-level flag, as transformers ties the head."""
        text = Qwen2Spec.from_hf(cfg.text_config)
        text = dataclasses.replace(text, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))
        mrope_section(text)
        return cls(
            text=text,
            audio=AudioEncoderSpec.from_hf(cfg.audio_config),
            vision=VisionEncoderSpec.from_hf(cfg.vision_config),
            rope_index=RopeIndexSpec.from_hf(cfg),
        )


class ThinkerTextModel(Qwen2Model):
    """``Qwen2_5OmniThinkerTextModel``: the Qwen2 decoder with multimodal rotary positions."""

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos/sin ``[B, T, head_dim]`` for ``positions [3, B, T]`` (or ``[B, T]``, the same on every axis).

        Each axis's cos/sin come from the plain rotary; channel ``c`` then takes the axis
        :meth:`rope_axes` assigns it, which is the reference's split-and-recompose.
        """
        if positions.ndim == 2:
            positions = jnp.broadcast_to(positions, (3, *positions.shape))
        cos, sin = super().rope(positions)
        axis = self.rope_axes()
        dim = np.arange(axis.size)
        return jnp.moveaxis(cos[axis, :, :, dim], 0, -1), jnp.moveaxis(sin[axis, :, :, dim], 0, -1)

    def rope_axes(self) -> np.ndarray:
        """``[head_dim]`` position axis (0 time, 1 row, 2 column) each rotary channel follows:
        ``mrope_section``'s blocks, the second half of the head repeating the first."""
        section = mrope_section(self.spec)
        half = np.repeat(np.arange(len(section)) % 3, section)
        return np.concatenate([half, half])


class Thinker(Qwen2ForCausalLM):
    """``Qwen2_5OmniThinkerForConditionalGeneration``: M-RoPE decoder, LM head, audio and vision towers.

    ``embed``, ``__call__``, ``logits`` and the sizes the engine plans with (``kv_cache_shape``,
    ``activation_width``, ...) are the Qwen2 LM's (so ``self.spec`` is the text spec they
    read); the constructor is its own because the decoder is the M-RoPE one. The towers are
    called separately (their batches are packed on the host) and their rows merged with
    :func:`merge_placeholders`.
    """

    def __init__(self, spec: ThinkerSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.spec = spec.text
        self.thinker_spec = spec
        self.model = ThinkerTextModel(spec.text, dtype=dtype, rngs=rngs)
        if not spec.text.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                spec.text.hidden_size,
                spec.text.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )
        self.audio_tower = AudioEncoder(spec.audio, dtype=dtype, rngs=rngs)
        self.visual = VisionEncoder(spec.vision, dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array, extra: PromptMerge | None = None) -> jax.Array:
        """Token embeddings with this step's encoder rows merged at their placeholders."""
        embeds = super().embed(tokens)
        return embeds if extra is None else merge_prompt(embeds, tokens, extra)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaceholderRows:
    """Encoder rows that replace one kind of placeholder token in a step.

    rows: ``[N, D]`` encoder rows (padding rows are never read).
    first_row: ``[B]`` row of ``rows`` that step row ``b``'s first placeholder of this kind
        takes (:class:`PromptMerge` says where each step row's rows start).
    token_id: the placeholder token (audio, image or video id of the config).
    """

    rows: jax.Array
    first_row: jax.Array
    token_id: int = dataclasses.field(metadata=dict(static=True))


def merge_placeholders(
    embeds: jax.Array,
    tokens: jax.Array,
    sources: Sequence[PlaceholderRows],
    limit: jax.Array | None = None,
) -> jax.Array:
    """``embeds [B, T, D]`` with the ``k``-th placeholder of each kind in a row replaced by its rows.

    The reference's ``masked_scatter`` in prompt order, as a gather: a placeholder's row is
    its row's ``first_row`` plus the placeholders of its kind before it in this step, so
    shapes stay static and chunked prefills continue where the last chunk stopped.
    ``limit [B]``: only a row's first ``limit`` tokens are prompt tokens that may be
    placeholders; a generated token with a placeholder's id keeps its embedding, as in the
    reference, whose decode steps merge nothing (it matters when a preempted request
    recomputes its prompt and output together).
    """
    for src in sources:
        index = placeholder_index(tokens, src.first_row, src.token_id, limit)
        rows = jnp.take(src.rows, index, axis=0, mode="clip").astype(embeds.dtype)
        embeds = jnp.where((index >= 0)[..., None], rows, embeds)
    return embeds


def placeholder_index(
    tokens: jax.Array, first_row: jax.Array, token_id: int, limit: jax.Array | None = None
) -> jax.Array:
    """``[B, T]`` row each placeholder ``token_id`` (among a step row's first ``limit`` tokens,
    all without ``limit``) takes: ``first_row[b]`` (``>= 0``) plus the earlier such placeholders
    of its row in the step; ``-1`` elsewhere (the gather index of :func:`merge_placeholders`)."""
    mask = tokens == token_id
    if limit is not None:
        mask &= jnp.arange(tokens.shape[1]) < limit[:, None]
    index = first_row[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
    return jnp.where(mask, index, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptMerge:
    """A step's encoder rows for :meth:`Thinker.embed`: one array shared by every kind.

    rows: ``[N, D]`` the rows this step's prompt chunks need, grouped by step row, then kind.
    first_row: ``[K, B]`` where step row ``b``'s rows of kind ``k`` start in ``rows``.
    limit: ``[B]`` prompt tokens in each step row (see :func:`merge_placeholders`).
    token_ids: the ``K`` placeholder ids (audio, image, video).
    """

    rows: jax.Array
    first_row: jax.Array
    limit: jax.Array
    token_ids: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def merge_prompt(embeds: jax.Array, tokens: jax.Array, merge: PromptMerge) -> jax.Array:
    """``embeds [B, T, D]`` with ``merge``'s rows at the step's placeholders, every kind
    (:func:`merge_placeholders`)."""
    sources = [PlaceholderRows(merge.rows, merge.first_row[k], t) for k, t in enumerate(merge.token_ids)]
    return merge_placeholders(embeds, tokens, sources, merge.limit)


THINKER_RULES: tuple[ParamRule, ...] = (
    *CAUSAL_LM_RULES,
    *prefixed("audio_tower.", "audio_tower", AUDIO_RULES),
    *prefixed("visual.", "visual", VISION_RULES),
)
"""Checkpoint names of ``Qwen2_5OmniThinkerForConditionalGeneration`` -> :class:`Thinker` paths.

These are the names on disk (``model.layers.*``, ``lm_head.*``, ``audio_tower.*``,
``visual.*``), which transformers renames to ``model.language_model.*`` etc. when loading.
"""

THINKER_RULES_IN_OMNI: tuple[ParamRule, ...] = prefixed("thinker.", "", THINKER_RULES)
"""The same tensors inside a full ``Qwen2_5OmniForConditionalGeneration`` checkpoint."""


def thinker_ignore(spec: ThinkerSpec, prefix: str = "") -> tuple[str, ...]:
    """Checkpoint names the thinker drops (rotary buffers, a tied head, the unused audio bos/eos)."""
    own = (*causal_lm_ignore(spec.text), *(r"audio_tower\." + p for p in AUDIO_IGNORE))
    return tuple(re.escape(prefix) + p for p in own)


def thinker_partition_rules(spec: ThinkerSpec, model: int) -> tuple[ShardRule, ...]:
    """The text decoder and LM head split like Qwen2's (their paths are the same).

    The audio and vision towers match no rule, so they are replicated: they run once per
    prompt on a host-packed batch, and splitting them would add collectives for little
    memory next to the decoder.
    """
    return partition_rules(spec.text, model)
