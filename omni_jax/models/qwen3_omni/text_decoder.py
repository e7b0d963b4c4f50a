"""Qwen3-Omni thinker's text decoder (``Qwen3OmniMoeThinkerTextModel`` + ``lm_head``) over the paged KV cache.

What differs from Qwen2 (:mod:`omni_jax.models.qwen2`, whose spec, interface, attention and
layer this reuses, and Qwen2.5-Omni's M-RoPE decoder, which this subclasses):

- attention RMS-normalises each query and key head (``q_norm``/``k_norm``, over ``head_dim``)
  before the rotary; ``attention_bias`` covers ``o_proj`` too;
- the MLP of a layer is the sparse MoE block (:mod:`omni_jax.models.moe`) unless the layer is
  in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid, where it is a dense SwiGLU;
- M-RoPE is *interleaved*: frequency pair ``i`` of a head follows the row position when
  ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, the column position when ``i % 3 == 2`` and
  ``i < 3 * mrope_section[2]``, the time position otherwise (Qwen2.5-Omni's is in blocks);
- DeepStack: visual features from the vision encoder's intermediate layers are added to the
  outputs of the first decoder layers at the visual tokens' positions. They are an explicit
  input of the forward (:class:`Deepstack`), not something the decoder finds itself.

The interface is :class:`~omni_jax.models.qwen2.Qwen2ForCausalLM`'s (``embed``, ``logits``,
``kv_cache_shape``, ...), with ``deepstack`` as an extra keyword of ``__call__``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.attention import AttentionMetadata, Backend, KVCache
from omni_jax.models.layers import RMSNorm, SwiGLU
from omni_jax.models.moe import (
    EXPERT_RULES,
    MoESpec,
    SparseMoeBlock,
    expert_forms,
    expert_partition_rules,
    experts_split,
)
from omni_jax.models.param_map import ParamRule, linear_kernel, prefixed
from omni_jax.models.qwen2 import (
    Qwen2Attention,
    Qwen2ForCausalLM,
    Qwen2Layer,
    Qwen2Spec,
    causal_lm_ignore,
    decoder_rules,
    partition_rules,
)
from omni_jax.models.qwen2_5_omni.thinker import ThinkerTextModel
from omni_jax.parallel.rules import ShardRule

DEFAULT_MROPE_SECTION = (24, 20, 20)
"""The reference's fallback when ``rope_parameters`` names no ``mrope_section``."""


@dataclasses.dataclass(frozen=True)
class Qwen3OmniTextSpec(Qwen2Spec):
    """A ``Qwen3OmniMoeTextConfig``: Qwen2's fields plus the MoE's, hashable for jit.

    moe: the sparse block's sizes (shared by every sparse layer).
    sparse_layers: per layer, whether its MLP is the sparse block (else a dense SwiGLU of
        ``intermediate_size``).
    """

    moe: MoESpec | None = None
    sparse_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Any, *, tie_word_embeddings: bool = False) -> Qwen3OmniTextSpec:
        """From the thinker's ``text_config``; the head is tied when the thinker config says so
        (``Qwen3OmniMoeThinkerConfig.tie_word_embeddings``, false for the released models)."""
        base = Qwen2Spec.from_hf(cfg)
        sparse = tuple(
            i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
            for i in range(cfg.num_hidden_layers)
        )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Qwen2Spec)}
        spec = cls(
            **{
                **fields,
                "tie_word_embeddings": tie_word_embeddings,
                "sliding_windows": (None,) * cfg.num_hidden_layers,  # the reference never slides
                "attention_bias": bool(cfg.attention_bias),
            },
            moe=MoESpec.from_hf(cfg) if any(sparse) else None,
            sparse_layers=sparse,
        )
        mrope_axes(spec)
        return spec


def mrope_axes(spec: Qwen2Spec) -> np.ndarray:
    """``[head_dim]`` position axis (0 time, 1 row, 2 column) each rotary channel follows.

    The reference's ``recomposition_frequencies``: frequency ``i`` takes axis 1 at
    ``i = 1, 4, ...`` below ``3 * section[1]``, axis 2 at ``i = 2, 5, ...`` below
    ``3 * section[2]``, axis 0 elsewhere; the second half of the head repeats the first.
    """
    section = tuple(dict(spec.rope_parameters).get("mrope_section", DEFAULT_MROPE_SECTION))
    half = spec.head_dim // 2
    i = np.arange(half)
    axes = np.zeros(half, np.int64)
    if len(section) == 3:
        axes[(i % 3 == 1) & (i < 3 * section[1])] = 1
        axes[(i % 3 == 2) & (i < 3 * section[2])] = 2
    if len(section) != 3 or tuple(np.bincount(axes, minlength=3)) != section:
        raise ValueError(f"mrope_section {section} does not interleave into head_dim / 2 = {half} pairs")
    return np.concatenate([axes, axes])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Deepstack:
    """DeepStack features of a step: ``rows[l]`` is added to decoder layer ``l``'s output.

    rows: ``[L, N, D]`` for the first ``L`` layers (``L`` = the vision encoder's
        ``deepstack_visual_indexes``, at most the decoder's layers); padding rows never read.
    index: ``[B, T]`` int32, the row of ``rows`` each token takes, ``-1`` for none (text,
        audio, padding). A visual token's row is its place among the prompt's image and video
        tokens, counted as for their main embeddings (the reference adds the ``k``-th
        visual position's features to the ``k``-th visual token).
    """

    rows: jax.Array
    index: jax.Array

    def add(self, x: jax.Array, layer: int) -> jax.Array:
        """``x [B, T, D]`` with layer ``layer``'s features added at the visual tokens."""
        rows = jnp.take(self.rows[layer], self.index, axis=0, mode="clip").astype(x.dtype)
        return jnp.where((self.index >= 0)[..., None], x + rows, x)


class Qwen3OmniLayer(Qwen2Layer):
    """``Qwen3OmniMoeThinkerTextDecoderLayer``: Qwen2's pre-norm layer with q/k-normed attention
    (``o_proj`` biased as the q/k/v projections) and the sparse or dense MLP."""

    def __init__(self, spec: Qwen3OmniTextSpec, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Qwen2Attention(
            spec, layer, o_bias=spec.attention_bias, qk_norm=True, dtype=dtype, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
        if spec.sparse_layers[layer]:
            self.mlp: SparseMoeBlock | SwiGLU = SparseMoeBlock(spec.moe, dtype=dtype, rngs=rngs)
        else:
            self.mlp = SwiGLU(d, spec.intermediate_size, dtype=dtype, rngs=rngs)


class Qwen3OmniTextModel(ThinkerTextModel):
    """Embedding, decoder layers, final norm: ``Qwen3OmniMoeThinkerTextModel``. Qwen2.5-Omni's
    M-RoPE decoder with :class:`Qwen3OmniLayer` layers, the rotary channels interleaved over
    the axes (:func:`mrope_axes`), and :class:`Deepstack` features added after the first layers."""

    layer_class = Qwen3OmniLayer

    def rope_axes(self) -> np.ndarray:
        return mrope_axes(self.spec)

    def __call__(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        deepstack: Deepstack | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Final normed hidden states ``[B, T, D]`` and the updated cache."""
        hidden, cache, _ = self.forward_deepstack(embeds, positions, kv_cache, md, backend, deepstack)
        return hidden, cache

    def forward_deepstack(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        deepstack: Deepstack | None = None,
        tap: int | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """:meth:`__call__`, and ``hidden_states[tap]`` (:meth:`Qwen2Model.forward`: a layer's
        output is read before its DeepStack features are added, as transformers records it)."""
        if deepstack is None:
            return self.forward(embeds, positions, kv_cache, md, backend, tap=tap)
        if deepstack.rows.shape[0] > self.spec.num_layers:
            raise ValueError(f"{deepstack.rows.shape[0]} DeepStack layers for {self.spec.num_layers} layers")

        def add(x: jax.Array, layer: int) -> jax.Array:
            return deepstack.add(x, layer) if layer < deepstack.rows.shape[0] else x

        return self.forward(embeds, positions, kv_cache, md, backend, add, tap)


class Qwen3OmniTextLM(Qwen2ForCausalLM):
    """The thinker's text decoder and LM head (``model`` and ``lm_head`` of
    ``Qwen3OmniMoeThinkerForConditionalGeneration``), with the AR engine's model interface.

    ``embed``, ``logits``, the constructor and the cache/vocabulary sizes are the Qwen2 LM's
    (the decoder is :class:`Qwen3OmniTextModel`), ``__call__`` takes :class:`Deepstack` features, and
    :meth:`activation_width` counts the experts' rows.
    """

    model_class = Qwen3OmniTextModel

    def activation_width(self, model: int) -> int:
        """Float32 values one token row of a step holds at once on one device, when a ``model``
        mesh axis of that size splits the MLPs' intermediate width: the widest MLP (a dense
        layer's gate and up outputs and their product, as :meth:`Qwen2ForCausalLM.activation_width`;
        a sparse layer's router logits and, for each expert that runs the row, its input row,
        gate and up outputs and their product and output row: the ``k`` chosen ones as grouped
        matmuls or pair by pair, every expert on this device where a step may run them dense,
        :func:`~omni_jax.models.moe.expert_forms`; whole experts where the mesh splits them by
        expert, a ``model``-th of each where it splits their width; gathered, each pair's copy of
        its expert too) beside three residual-width vectors. The plan sizes the largest step, so
        where the rows decide, the dense count stands; it covers the pair loop's copy of one
        expert (``3 * D * I`` values a step, not a row) from 7 rows on at Qwen3-Omni's widths on
        one device (from 93 where expert parallelism over 8 devices leaves each 16 experts), and
        ``OMNI_JAX_MOE=assigned`` (for measuring) leaves it out, as ``OMNI_JAX_MOE=grouped`` off
        a TPU leaves out XLA's expansion of the ragged dot over every expert."""
        spec = self.spec
        widths = [3 * spec.intermediate_size // model] if not all(spec.sparse_layers) else []
        if spec.moe is not None:
            moe, forms = spec.moe, expert_forms()
            split = experts_split(moe.num_experts, model)
            inner = 3 * moe.intermediate_size // (1 if split else model)
            if "dense" in forms:
                experts = moe.num_experts // model if split else moe.num_experts
            else:
                experts = moe.top_k
            copies = moe.top_k * moe.hidden_size * inner if "gathered" in forms else 0
            widths.append(moe.num_experts + experts * (inner + 2 * moe.hidden_size) + copies)
        return max(widths) + 3 * spec.hidden_size

    def forward(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        layer_inputs: Deepstack | None = None,
        tap: int | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """The engine's step: ``layer_inputs`` are the step's DeepStack features (``None``:
        none), ``tap`` a hidden state to return beside the final ones
        (:meth:`Qwen3OmniTextModel.forward_deepstack`)."""
        return self.model.forward_deepstack(embeds, positions, kv_cache, md, backend, layer_inputs, tap)


TEXT_DECODER_RULES: tuple[ParamRule, ...] = (
    *decoder_rules(o_bias=True),
    ParamRule(r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.self_attn.\2_norm.weight"),
    *(
        ParamRule(r"layers\.(\d+)\.mlp\." + r.hf, r"layers.\1.mlp." + r.flax, r.transform)
        for r in EXPERT_RULES
    ),
)
"""HF ``Qwen3OmniMoeThinkerTextModel`` names (no prefix) -> :class:`Qwen3OmniTextModel` paths,
the experts' stacked by :func:`omni_jax.models.moe.stack_expert_readers` first."""

TEXT_LM_RULES: tuple[ParamRule, ...] = (
    *prefixed("model.", "model", TEXT_DECODER_RULES),
    ParamRule(r"lm_head\.weight", "lm_head.kernel", linear_kernel),
)
"""Checkpoint names of ``Qwen3OmniMoeThinkerForConditionalGeneration``'s decoder and head
(``model.*``, ``lm_head.*``; transformers calls the decoder ``model.language_model`` in
memory) -> :class:`Qwen3OmniTextLM` paths. Inside a full ``Qwen3OmniMoeForConditionalGeneration``
checkpoint the same names carry a ``thinker.`` prefix (``prefixed("thinker.", "", ...)``)."""


def text_lm_ignore(spec: Qwen3OmniTextSpec, prefix: str = "") -> tuple[str, ...]:
    """Thinker checkpoint names the text LM drops: the audio and vision towers (other modules'),
    rotary buffers, and a tied head. ``prefix``: ``"thinker."`` inside a full Omni checkpoint."""
    own = (r"audio_tower\..*", r"visual\..*", *causal_lm_ignore(spec))
    return tuple(re.escape(prefix) + p for p in own)


def text_lm_partition_rules(spec: Qwen3OmniTextSpec, model: int) -> tuple[ShardRule, ...]:
    """Tensor-parallel layout of :class:`Qwen3OmniTextLM` over ``model``: Qwen2's (attention by
    heads, dense MLPs by intermediate width, embedding and head by vocabulary; ``o_proj``'s
    bias, when the config has one, whole: it is added after the all-reduce), and the sparse
    blocks' experts split whole over ``model`` when it divides their number, else by width
    (:func:`omni_jax.models.moe.expert_partition_rules`). Routers and the q/k norms (one
    head's width) are whole on every device.
    """
    rules = partition_rules(spec, model)
    if spec.moe is None:
        return rules
    return (*rules, *expert_partition_rules(r"model\.layers\.\d+\.mlp\.", spec.moe, model))
