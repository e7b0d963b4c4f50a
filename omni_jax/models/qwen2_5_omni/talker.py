"""Qwen2.5-Omni talker: the thinker's M-RoPE Qwen2 decoder over a codec vocabulary.

``Qwen2_5OmniTalkerForConditionalGeneration`` in transformers. Its input at every position is
``thinker_to_talker_proj(codec_embed(token) + thinker row)``: codec tokens are embedded at the
*thinker's* width (``embedding_size``, 3584 in the 7B model, not the talker's 896), summed with
a row derived from the thinker (its final hidden state plus its token embedding, or the
embedding of a text special), and only that sum is projected to the decoder's width. Which row
a position reads, and whether it adds its codec embedding at all, is the stage's business
(:mod:`omni_jax.stages.talker`); the model takes both per step as :class:`TalkerEmbeds`.

The decoder, its paged KV cache and its rotary are the thinker's
(:class:`~omni_jax.models.qwen2_5_omni.thinker.ThinkerTextModel`); the interface is the
engine's AR model (``embed``, ``__call__``, ``logits``, and the Qwen2 LM's sizes: ``kv_cache_shape``,
``num_query_heads``, ``vocab_size``, ``max_positions``, ``activation_width``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models.param_map import ParamRule, linear_kernel, prefixed
from omni_jax.models.qwen2 import (
    DECODER_RULES,
    Qwen2ForCausalLM,
    Qwen2Spec,
    causal_lm_ignore,
    partition_rules,
)
from omni_jax.models.qwen2_5_omni.rope_index import RopeIndexSpec
from omni_jax.models.qwen2_5_omni.thinker import ThinkerTextModel, mrope_section
from omni_jax.parallel.rules import ShardRule


@dataclasses.dataclass(frozen=True)
class TalkerSpec:
    """The parts of a ``Qwen2_5OmniTalkerConfig`` the talker needs, hashable for jit.

    ``text``: the decoder (its ``vocab_size`` is the codec vocabulary). ``embedding_size``: the
    codec embedding's width, which is the thinker's hidden size. ``codec_*``: codec ids
    (``tts_codec_{start,end,pad,mask}_token_id``); ``text_*``: thinker-vocabulary ids whose
    thinker embeddings feed the talker (``tts_text_{start,end,pad}_token_id``).
    ``rope_index``: the talker's positions are ``get_rope_index`` of the thinker prompt, with
    the same placeholder ids and timing as the thinker's.
    """

    text: Qwen2Spec
    embedding_size: int
    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int
    text_bos: int
    text_eos: int
    text_pad: int
    rope_index: RopeIndexSpec

    @classmethod
    def from_hf(cls, cfg: Any) -> TalkerSpec:
        """From the talker config. The codec head is never tied to the codec embedding (their
        widths differ in the released model), whatever ``tie_word_embeddings`` says."""
        text = dataclasses.replace(Qwen2Spec.from_hf(cfg), tie_word_embeddings=False)
        mrope_section(text)
        return cls(
            text=text,
            embedding_size=cfg.embedding_size,
            codec_bos=cfg.tts_codec_start_token_id,
            codec_eos=cfg.tts_codec_end_token_id,
            codec_pad=cfg.tts_codec_pad_token_id,
            codec_mask=cfg.tts_codec_mask_token_id,
            text_bos=cfg.tts_text_start_token_id,
            text_eos=cfg.tts_text_end_token_id,
            text_pad=cfg.tts_text_pad_token_id,
            rope_index=RopeIndexSpec.from_hf(cfg),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TalkerEmbeds:
    """One step's thinker-derived inputs for :meth:`Talker.embed`.

    rows: ``[B, T, E]`` (``E = embedding_size``) the row added at each position before the
        projection: a thinker prompt token's hidden state plus embedding, the speaker's text
        BOS embedding, a reply token's hidden state plus embedding, or the text EOS / pad
        embedding once the reply has run out (zeros at padding positions).
    add_codec: ``[B, T]`` bool, whether the position also adds its token's codec embedding.
        False over the thinker prompt, whose codec-``mask`` ids exist only for the repetition
        penalty (the reference feeds those positions ``inputs_embeds`` alone); True for the
        prompt's last two positions (codec ``pad`` and ``bos``) and every generated code.
    """

    rows: jax.Array
    add_codec: jax.Array


class Talker(Qwen2ForCausalLM):
    """``Qwen2_5OmniTalkerForConditionalGeneration``: codec embedding, projection, M-RoPE decoder, codec head.

    ``__call__`` and the sizes the engine plans with (``kv_cache_shape``, ``activation_width``,
    ...) are the Qwen2 LM's over the thinker's M-RoPE decoder (positions ``[3, B, T]``, or
    ``[B, T]`` for the same on every axis), ``vocab_size`` the codec vocabulary's; ``self.spec``
    is the decoder's :class:`~omni_jax.models.qwen2.Qwen2Spec`, ``self.talker_spec`` the rest.
    """

    def __init__(self, spec: TalkerSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.spec = spec.text
        self.talker_spec = spec
        width, hidden = spec.embedding_size, spec.text.hidden_size
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.thinker_to_talker_proj = nnx.Linear(width, hidden, use_bias=True, **kw)
        self.model = ThinkerTextModel(spec.text, dtype=dtype, embedding_size=width, rngs=rngs)
        self.codec_head = nnx.Linear(hidden, spec.text.vocab_size, use_bias=False, **kw)

    def embed(self, tokens: jax.Array, extra: TalkerEmbeds | None = None) -> jax.Array:
        """Decoder inputs ``[B, T, hidden]`` for codec ``tokens [B, T]``.

        ``proj(where(add_codec, codec_embed(tokens), 0) + rows)``; without ``extra`` (a bare
        codec sequence) ``proj(codec_embed(tokens))``. The sum is in the model's dtype, as the
        reference adds its rows to the codec embedding before projecting.
        """
        codec = self.model.embed_tokens(tokens)
        if extra is not None:
            codec = jnp.where(extra.add_codec[..., None], codec, 0) + extra.rows.astype(codec.dtype)
        return self.thinker_to_talker_proj(codec)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 codec logits for ``hidden [..., hidden]``."""
        return self.codec_head(hidden).astype(jnp.float32)


TALKER_RULES: tuple[ParamRule, ...] = (
    *prefixed("model.", "model", DECODER_RULES),
    ParamRule(r"thinker_to_talker_proj\.weight", "thinker_to_talker_proj.kernel", linear_kernel),
    ParamRule(r"thinker_to_talker_proj\.bias", "thinker_to_talker_proj.bias"),
    ParamRule(r"codec_head\.weight", "codec_head.kernel", linear_kernel),
)
"""Checkpoint names of ``Qwen2_5OmniTalkerForConditionalGeneration`` -> :class:`Talker` paths."""

TALKER_RULES_IN_OMNI: tuple[ParamRule, ...] = prefixed("talker.", "", TALKER_RULES)
"""The same tensors inside a full ``Qwen2_5OmniForConditionalGeneration`` checkpoint."""


def talker_ignore(spec: TalkerSpec, prefix: str = "") -> tuple[str, ...]:
    """Checkpoint names the talker drops (rotary buffers)."""
    return tuple(re.escape(prefix) + p for p in causal_lm_ignore(spec.text))


def talker_partition_rules(spec: TalkerSpec, model: int) -> tuple[ShardRule, ...]:
    """The decoder and codec embedding split like Qwen2's (their paths are the same), the codec
    head by vocabulary (kept whole where ``model`` does not divide it); ``ValueError`` when
    ``model`` does not divide the attention heads.

    ``thinker_to_talker_proj`` is replicated: its output is the decoder's residual stream,
    which every device holds whole, and at ``embedding_size x hidden`` (3584 x 896) it is
    small next to the decoder, so splitting it would only add a gather before the first layer.
    """
    return (*partition_rules(spec.text, model), ShardRule(r"codec_head\.kernel", (None, "model")))
