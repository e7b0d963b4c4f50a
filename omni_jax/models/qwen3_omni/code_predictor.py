"""Qwen3-Omni's code predictor: the remaining codebooks of a codec frame, one compiled loop per frame.

transformers' ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration``. The talker
predicts a frame's first codebook; this small dense decoder (the thinker's attention with q/k
norm, plain 1-D RoPE, SwiGLU MLPs) predicts the other ``G - 1`` one after another from a fresh
two-token prompt: the talker's final hidden state at the frame's step, then the talker's codec
embedding of the first code. Codebook ``k >= 1`` is read by ``lm_head[k - 1]``; its code is fed
back through ``codec_embedding[k - 1]``. The reference runs this as ``generate`` once per frame;
here the whole frame is one program (:func:`predict_frame`): the two-token prefill, then a
``lax.fori_loop`` over the codebooks on a ``[kv_heads, B, G, head_dim]`` KV buffer per layer
(the paged layout with one ``G``-slot page per row, so the decoder's paged attention,
:class:`~omni_jax.models.qwen2.Qwen2Attention`, serves it unchanged). It also returns what the
talker reads next: the sum of the frame's ``G`` codebook embeddings (the talker's for the first
code, ``codec_embedding[k - 1]`` for code ``k``).

The per-codebook heads and embeddings are stacked into one parameter each (``[G - 1, D, V]``,
``[G - 1, V, D]``) so the loop indexes them by its counter; :func:`stack_codebook_readers`
stacks a checkpoint's per-codebook tensors lazily, as :func:`~omni_jax.models.moe.stack_expert_readers`
does the experts'.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.jit import StaticGraph, compute_dtype, exact_matmuls
from omni_jax.models.attention import AttentionMetadata, KVCache
from omni_jax.models.layers import RMSNorm, rope_cos_sin, rope_inv_freq
from omni_jax.models.moe import collect_numbered, expert_kernel, stacked_groups
from omni_jax.models.param_map import ParamRule, prefixed
from omni_jax.models.qwen2 import Qwen2Spec
from omni_jax.models.qwen3_omni.text_decoder import TEXT_DECODER_RULES, Qwen3OmniLayer, Qwen3OmniTextSpec
from omni_jax.safetensors_io import TensorReader


@dataclasses.dataclass(frozen=True)
class CodePredictorSpec:
    """A ``Qwen3OmniMoeTalkerCodePredictorConfig``, hashable for jit.

    text: the dense decoder (every layer a SwiGLU; ``vocab_size`` is one codebook's size).
    num_code_groups: codebooks per frame ``G``, the talker's first included.
    """

    text: Qwen3OmniTextSpec
    num_code_groups: int

    @classmethod
    def from_hf(cls, cfg: Any) -> CodePredictorSpec:
        """From the talker's ``code_predictor_config``. Its layers never slide within a frame
        (``G`` tokens), so a sliding window of at least ``G`` is the same as none; a shorter one
        is refused."""
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported code predictor activation {cfg.hidden_act!r} (supported: silu)")
        if cfg.num_code_groups < 2:
            raise ValueError(f"num_code_groups {cfg.num_code_groups}: the code predictor needs at least 2")
        base = Qwen2Spec.from_hf(cfg)
        short = [w for w in base.sliding_windows if w is not None and w < cfg.num_code_groups]
        if short:
            raise ValueError(
                f"sliding window {short[0]} is shorter than a frame's {cfg.num_code_groups} codes"
            )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Qwen2Spec)}
        text = Qwen3OmniTextSpec(
            **{
                **fields,
                "sliding_windows": (None,) * base.num_layers,
                "attention_bias": bool(cfg.attention_bias),
            },
            moe=None,
            sparse_layers=(False,) * base.num_layers,
        )
        return cls(text=text, num_code_groups=cfg.num_code_groups)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrameSampling:
    """How each of ``B`` rows draws its codes, ``[B]`` unless noted.

    temperature: 0 for greedy (argmax); else logits are divided by it.
    top_k: keep the ``top_k`` largest logits (ties with the last kept stay); ``< 1`` for all.
    top_p: then keep the smallest prefix of them, by descending probability, whose mass
        reaches ``top_p`` (at least one); 1 keeps all.
    keys: ``[B, 2]`` uint32 raw threefry key of each row for this frame; codebook ``k`` draws
        with ``fold_in(key, k)``. Give each frame of a request a key of its own.

    The reference samples its code predictor with ``top_k=50, top_p=0.8`` at temperature 1
    whenever the talker samples, and greedily when the talker is greedy.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


def sample_codes(logits: jax.Array, sampling: FrameSampling, codebook: jax.Array | int) -> jax.Array:
    """``[B]`` int32 codes from float32 ``logits [B, V]``: temperature, top-k, top-p as
    transformers' warpers, then a Gumbel-max draw per sampled row; greedy rows take the argmax."""
    v = logits.shape[-1]
    temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    x = logits / temp[:, None]
    sorted_x = -jnp.sort(-x, axis=-1)
    k = jnp.where(sampling.top_k < 1, v, jnp.minimum(sampling.top_k, v))
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(jnp.where(sorted_x >= kth, sorted_x, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    n_keep = jnp.maximum(jnp.sum(mass_before < sampling.top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_x, (n_keep - 1)[:, None], axis=-1)
    kept = jnp.where((x >= kth) & (x >= pth), x, -jnp.inf)

    def gumbel(key: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key, impl="threefry2x32"), codebook)
        return jax.random.gumbel(key, (v,), jnp.float32)

    drawn = jnp.argmax(kept + jax.vmap(gumbel)(sampling.keys), axis=-1)
    return jnp.where(sampling.temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class CodePredictorModel(nnx.Module):
    """``Qwen3OmniMoeTalkerCodePredictorModel``: decoder layers, final norm, and the stacked
    ``codec_embedding`` ``[G - 1, V, D]`` (row ``k - 1`` embeds codebook ``k``)."""

    def __init__(self, spec: CodePredictorSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        text = spec.text
        self.spec = spec
        self.dtype = dtype
        self.layers = nnx.List(
            [Qwen3OmniLayer(text, i, dtype=dtype, rngs=rngs) for i in range(text.num_layers)]
        )
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps, dtype=dtype, rngs=rngs)
        shape = (spec.num_code_groups - 1, text.vocab_size, text.hidden_size)
        self.codec_embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), shape, dtype))

    def __call__(
        self, embeds: jax.Array, positions: jax.Array, kv_cache: KVCache, md: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        """Final normed hidden states ``[B, T, D]`` of ``embeds`` at 1-D ``positions [B, T]``."""
        text = self.spec.text
        inv_freq, scaling = rope_inv_freq(
            dict(text.rope_parameters), text.head_dim, text.max_position_embeddings
        )
        cos, sin = rope_cos_sin(positions, inv_freq, scaling, self.dtype)
        x = embeds
        new_cache: KVCache = []
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            x, cache = layer(x, cos, sin, cache, md, "jnp")
            new_cache.append(cache)
        return self.norm(x), new_cache


class CodePredictor(nnx.Module):
    """``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration``: the decoder and the
    stacked ``lm_head`` ``[G - 1, D, V]`` (row ``k - 1`` scores codebook ``k``)."""

    def __init__(self, spec: CodePredictorSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        text = spec.text
        self.spec = spec
        self.model = CodePredictorModel(spec, dtype=dtype, rngs=rngs)
        shape = (spec.num_code_groups - 1, text.hidden_size, text.vocab_size)
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=(0,))
        self.lm_head = nnx.Param(init(rngs.params(), shape, dtype))

    def frame(
        self,
        talker_embedding: jax.Array,
        hidden: jax.Array,
        first: jax.Array,
        sampling: FrameSampling | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """One frame for each of ``B`` rows: ``(codes [B, G] int32, embedding sum [B, D])``.

        talker_embedding: the talker's codec embedding table ``[V_talker, D]``.
        hidden: ``[B, D]`` the talker's final (normed) hidden state at the step that scored
            ``first``.
        first: ``[B]`` the frame's first-codebook codes (column 0 of ``codes``).
        sampling: per-row draws; ``None`` for greedy on every row (a program without the sort).

        The sum is ``talker_embedding[first] + sum_k codec_embedding[k - 1][codes[:, k]]``, added
        in codebook order: the reference's next talker input before its text row.
        """
        spec, text = self.spec, self.spec.text
        g, b = spec.num_code_groups, hidden.shape[0]
        dtype = self.model.dtype
        table = self.model.codec_embedding[...]
        heads = self.lm_head[...]
        rows = jnp.arange(b, dtype=jnp.int32)
        empty = jnp.zeros((text.num_kv_heads, b, g, text.head_dim), dtype)
        cache: KVCache = [(empty, empty) for _ in range(text.num_layers)]

        def forward(x: jax.Array, start: jax.Array | int, cache: KVCache) -> tuple[jax.Array, KVCache]:
            """The last hidden state of ``x [B, T, D]`` placed at ``start ..``: row ``b``'s page is ``b``."""
            t = x.shape[1]
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
            md = AttentionMetadata(
                slot_mapping=rows[:, None] * g + positions,
                block_tables=rows[:, None],
                context_lens=jnp.full((b,), start + t, jnp.int32),
                query_lens=jnp.full((b,), t, jnp.int32),
            )
            out, cache = self.model(x, positions, cache, md)
            return out[:, -1], cache

        def draw(h: jax.Array, codebook: jax.Array | int) -> jax.Array:
            """Codebook ``codebook``'s code from the hidden state that predicts it."""
            logits = (h @ heads[codebook - 1]).astype(jnp.float32)
            if sampling is None:
                return jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return sample_codes(logits, sampling, codebook)

        first_embed = jnp.take(talker_embedding, first, axis=0).astype(dtype)
        h, cache = forward(jnp.stack([hidden.astype(dtype), first_embed], axis=1), 0, cache)
        code = draw(h, 1)
        codes = jnp.zeros((b, g), jnp.int32).at[:, 0].set(first).at[:, 1].set(code)
        total = first_embed + table[0, code]

        def body(k: jax.Array, carry: tuple[jax.Array, jax.Array, KVCache]) -> tuple[Any, ...]:
            """Feed code ``k`` (at position ``k + 1``), draw code ``k + 1``."""
            codes, total, cache = carry
            x = table[k - 1, codes[:, k]]
            h, cache = forward(x[:, None], k + 1, cache)
            code = draw(h, k + 1)
            return codes.at[:, k + 1].set(code), total + table[k, code], cache

        codes, total, _ = jax.lax.fori_loop(1, g - 1, body, (codes, total, cache))
        return codes, total


@functools.partial(jax.jit, static_argnums=0)
def predict_frame(
    graph: StaticGraph,
    state: nnx.State,
    talker_embedding: jax.Array,
    hidden: jax.Array,
    first: jax.Array,
    sampling: FrameSampling | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:meth:`CodePredictor.frame` as one program over ``nnx.split(code_predictor)`` (the
    graphdef in a :class:`StaticGraph`). Compiles once per row count and per ``sampling``
    being ``None`` or not; the sampling values are traced."""
    with exact_matmuls(compute_dtype(state)):
        return nnx.merge(graph.graphdef, state).frame(talker_embedding, hidden, first, sampling)


_PER_CODEBOOK = re.compile(r"((?:.*\.)?code_predictor\.(?:lm_head|model\.codec_embedding))\.(\d+)\.weight")


def stack_codebook_readers(
    tensors: Iterable[tuple[str, TensorReader]],
) -> Iterator[tuple[str, TensorReader]]:
    """The tensors of a checkpoint with the code predictor's per-codebook ones stacked.

    ``<p>code_predictor.lm_head.{k}.weight`` and ``<p>code_predictor.model.codec_embedding.{k}.weight``
    (``[V, D]`` each) become ``<p>code_predictor.lm_head`` and ``<p>code_predictor.model.codec_embedding``
    ``[G - 1, V, D]`` (:class:`~omni_jax.models.moe.StackedExperts`, read lazily), given once the
    stream ends; other tensors pass through as they come. A missing or repeated codebook raises
    :class:`~omni_jax.models.param_map.ParamMismatchError`."""
    groups: dict[str, dict[int, TensorReader]] = {}
    for name, read in tensors:
        hit = _PER_CODEBOOK.fullmatch(name)
        if hit is None:
            yield name, read
        else:
            collect_numbered(groups, hit[1], int(hit[2]), name, read)
    yield from stacked_groups(groups, "codebooks")


CODE_PREDICTOR_RULES: tuple[ParamRule, ...] = (
    *prefixed("model.", "model", TEXT_DECODER_RULES),
    ParamRule(r"model\.codec_embedding", "model.codec_embedding"),
    ParamRule(r"lm_head", "lm_head", expert_kernel),
)
"""Names under ``code_predictor.`` (codebook tensors stacked by :func:`stack_codebook_readers`)
-> :class:`CodePredictor` paths."""
