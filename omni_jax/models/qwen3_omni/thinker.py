"""Qwen3-Omni thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): the MoE text decoder with
its LM head, the audio encoder and the vision encoder, as one model.

The decoder is :class:`~omni_jax.models.qwen3_omni.text_decoder.Qwen3OmniTextLM` on the paged
KV cache, positioned by 3-D M-RoPE (:func:`~omni_jax.models.qwen3_omni.rope_index.get_rope_index`
computes a prompt's positions). The towers are called on their own, on host-packed batches, as
in Qwen2.5-Omni (:mod:`omni_jax.models.qwen2_5_omni.thinker`); their rows come back to a step in
a :class:`ThinkerMerge`:

- :meth:`Thinker.embed` puts the audio, image and video rows in place of their placeholder
  tokens' embeddings, the reference's ``masked_scatter`` in prompt order
  (:func:`~omni_jax.models.qwen2_5_omni.thinker.merge_placeholders`, Qwen2.5-Omni's);
- :meth:`Thinker.deepstack` gives the DeepStack features the decoder adds to its first layers'
  outputs at the image and video tokens (the reference's ``visual_pos_masks`` and
  ``deepstack_visual_embeds``): the ``k``-th image (video) placeholder of a prompt takes the
  deepstack rows of the ``k``-th image (video) row, which is the reference's joint order of
  the visual positions, since it fills image positions with image rows and video positions
  with video rows, each in order.

A step's forward is therefore ``embeds = thinker.embed(tokens, merge)``, then
``thinker(embeds, positions, kv_cache, md, backend, deepstack=thinker.deepstack(tokens, merge))``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models.param_map import ParamRule, prefixed
from omni_jax.models.qwen2 import causal_lm_ignore
from omni_jax.models.qwen2_5_omni.thinker import PlaceholderIds, PromptMerge, merge_prompt, placeholder_index
from omni_jax.models.qwen3_omni.audio_encoder import AUDIO_IGNORE, AUDIO_RULES, AudioEncoder, AudioEncoderSpec
from omni_jax.models.qwen3_omni.rope_index import RopeIndexSpec
from omni_jax.models.qwen3_omni.text_decoder import (
    TEXT_LM_RULES,
    Deepstack,
    Qwen3OmniTextLM,
    Qwen3OmniTextSpec,
    text_lm_partition_rules,
)
from omni_jax.models.qwen3_omni.vision_encoder import (
    VISION_IGNORE,
    VISION_RULES,
    VisionEncoder,
    VisionEncoderSpec,
)
from omni_jax.parallel.rules import ShardRule


@dataclasses.dataclass(frozen=True)
class ThinkerSpec(PlaceholderIds):
    """The parts of a ``Qwen3OmniMoeThinkerConfig`` the thinker needs, hashable for jit."""

    text: Qwen3OmniTextSpec
    audio: AudioEncoderSpec
    vision: VisionEncoderSpec
    rope_index: RopeIndexSpec

    @classmethod
    def from_hf(cls, cfg: Any) -> ThinkerSpec:
        """From the thinker config (``Qwen3OmniMoeConfig.thinker_config``); the head is tied when
        its ``tie_word_embeddings`` says so, as transformers ties it. Encoders whose rows do not
        have the decoder's width, or more DeepStack layers than decoder layers, are refused."""
        text = Qwen3OmniTextSpec.from_hf(
            cfg.text_config, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False))
        )
        spec = cls(
            text=text,
            audio=AudioEncoderSpec.from_hf(cfg.audio_config),
            vision=VisionEncoderSpec.from_hf(cfg.vision_config),
            rope_index=RopeIndexSpec.from_hf(cfg),
        )
        widths = {
            "audio output_dim": spec.audio.output_dim,
            "vision out_hidden_size": spec.vision.out_hidden_size,
        }
        for name, width in widths.items():
            if width != text.hidden_size:
                raise ValueError(f"{name} {width} must equal the text hidden_size {text.hidden_size}")
        if spec.deepstack_layers > text.num_layers:
            raise ValueError(
                f"{spec.deepstack_layers} deepstack_visual_indexes for {text.num_layers} decoder layers"
            )
        return spec

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers that take DeepStack features (one per vision deepstack index)."""
        return len(self.vision.deepstack_visual_indexes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ThinkerMerge:
    """A step's encoder rows for :meth:`Thinker.embed` and :meth:`Thinker.deepstack`.

    prompt: the encoder rows merged at the placeholders, laid out as Qwen2.5-Omni's
        (:class:`~omni_jax.models.qwen2_5_omni.thinker.PromptMerge`: ``rows [N, D]`` grouped by
        step row then kind, ``first_row [K, B]``, ``limit [B]``, the ``K`` placeholder ids).
    deepstack: ``[L, N, D]`` the DeepStack features of ``prompt.rows``, row for row: row ``r``
        of layer ``l`` is vision merger ``l``'s output for the image or video row ``r`` (rows of
        other kinds, e.g. audio, are never read; zeros will do).
    """

    prompt: PromptMerge
    deepstack: jax.Array


class Thinker(Qwen3OmniTextLM):
    """``Qwen3OmniMoeThinkerForConditionalGeneration``: the MoE decoder and LM head (``model``,
    ``lm_head``), the audio encoder (``audio_tower``) and the vision encoder (``visual``).

    ``__call__``, ``logits`` and the sizes the engine plans with are the text LM's, so
    ``self.spec`` is the text spec; ``thinker_spec`` is the whole one. The towers are called
    separately on host-packed batches and their rows come back in a :class:`ThinkerMerge`.
    """

    def __init__(self, spec: ThinkerSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        super().__init__(spec.text, dtype=dtype, rngs=rngs)
        self.thinker_spec = spec
        self.audio_tower = AudioEncoder(spec.audio, dtype=dtype, rngs=rngs)
        self.visual = VisionEncoder(spec.vision, dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array, extra: ThinkerMerge | None = None) -> jax.Array:
        """Token embeddings ``[B, T, D]`` with this step's encoder rows at their placeholders."""
        embeds = super().embed(tokens)
        return embeds if extra is None else merge_prompt(embeds, tokens, extra.prompt)

    def deepstack(self, tokens: jax.Array, extra: ThinkerMerge | None) -> Deepstack | None:
        """The step's DeepStack input for ``__call__``: each image and video placeholder among the
        prompt tokens takes the deepstack rows of the row :meth:`embed` merges there."""
        if extra is None:
            return None
        merge = extra.prompt
        visual = (self.thinker_spec.image_token_id, self.thinker_spec.video_token_id)
        index = jnp.full(tokens.shape, -1, jnp.int32)
        for k, token in enumerate(merge.token_ids):
            if token in visual:
                rows = placeholder_index(tokens, merge.first_row[k], token, merge.limit)
                index = jnp.where(rows >= 0, rows, index)
        return Deepstack(extra.deepstack, index)

    def layer_inputs(self, tokens: jax.Array, extra: ThinkerMerge | None) -> Deepstack | None:
        """The engine's hook for what the layers read beyond the embeddings: :meth:`deepstack`."""
        return self.deepstack(tokens, extra)


THINKER_RULES: tuple[ParamRule, ...] = (
    *TEXT_LM_RULES,
    *prefixed("audio_tower.", "audio_tower", AUDIO_RULES),
    *prefixed("visual.", "visual", VISION_RULES),
)
"""Checkpoint names of ``Qwen3OmniMoeThinkerForConditionalGeneration`` -> :class:`Thinker` paths,
the experts' stacked by :func:`omni_jax.models.moe.stack_expert_readers` first. These are the
names on disk (``model.layers.*``, ``lm_head.*``, ``audio_tower.*``, ``visual.*``), which
transformers renames (``model.language_model.*``, ...) when loading."""

THINKER_RULES_IN_OMNI: tuple[ParamRule, ...] = prefixed("thinker.", "", THINKER_RULES)
"""The same tensors inside a full ``Qwen3OmniMoeForConditionalGeneration`` checkpoint."""


def thinker_ignore(spec: ThinkerSpec, prefix: str = "") -> tuple[str, ...]:
    """Checkpoint names the thinker drops: rotary buffers, a tied head, the encoders' unused
    tensors. ``prefix``: ``"thinker."`` inside a full Omni checkpoint."""
    own = [*causal_lm_ignore(spec.text)]
    own += [r"audio_tower\." + p for p in AUDIO_IGNORE] + [r"visual\." + p for p in VISION_IGNORE]
    return tuple(re.escape(prefix) + p for p in own)


def thinker_partition_rules(spec: ThinkerSpec, model: int) -> tuple[ShardRule, ...]:
    """The text LM's layout over ``model`` (:func:`text_lm_partition_rules`). The towers match
    no rule, so they are replicated: they run once per prompt on a host-packed batch, and
    splitting them would add collectives for little memory next to the decoder's experts."""
    return text_lm_partition_rules(spec.text, model)
