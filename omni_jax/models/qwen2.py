"""Qwen2 decoder (``Qwen2ForCausalLM``) as NNX modules over a paged KV cache.

The model is a function of ``(tokens or embeddings, rope positions, cache, metadata)``; it
knows nothing of scheduling. It returns the final (normed) hidden states for every token, so
later stages (the talker) can read them, and computes logits only where asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models.attention import AttentionMetadata, Backend, KVCache, paged_attention, write_kv
from omni_jax.models.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin, rope_inv_freq
from omni_jax.models.param_map import ParamRule, linear_kernel
from omni_jax.parallel.rules import ShardRule, replicated_kv_heads


@dataclasses.dataclass(frozen=True)
class Qwen2Spec:
    """The subset of an HF ``Qwen2Config`` the decoder needs, hashable for jit."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    attention_bias: bool = True

    @classmethod
    def from_hf(cls, cfg: Any) -> Qwen2Spec:
        """From an HF config object (``Qwen2Config`` or a text config shaped like it); a config
        the decoder would run differently from transformers (another activation, a rotary it does
        not compute) is refused here, at load, not at the first step or never."""
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(cfg, "rope_theta", 10000.0),
        }
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' two names of one function
            raise ValueError(f"unsupported decoder activation hidden_act={act!r} (supported: silu)")
        rope_inv_freq(rope, head_dim, cfg.max_position_embeddings)  # refuses a rotary it cannot compute
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=tuple(sorted((k, _freeze(v)) for k, v in dict(rope).items())),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_windows=windows,
        )


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


class AttentionSpec(Protocol):
    """What :class:`GQAProjections` reads of a spec (Qwen2's, Qwen3-Omni's code2wav's)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...


class GQAProjections(nnx.Module):
    """The ``q/k/v/o_proj`` of grouped-query attention (``attention_bias`` on q, k, v; ``o_bias``
    on o) and, with ``qk_norm``, the per-head RMSNorms ``q_norm``/``k_norm`` of Qwen3's
    attention; what attends is the subclass's."""

    def __init__(
        self, spec: AttentionSpec, *, o_bias: bool, qk_norm: bool = False, dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        d, h, kvh, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d, h * hd, use_bias=spec.attention_bias, **kw)
        self.k_proj = nnx.Linear(d, kvh * hd, use_bias=spec.attention_bias, **kw)
        self.v_proj = nnx.Linear(d, kvh * hd, use_bias=spec.attention_bias, **kw)
        self.o_proj = nnx.Linear(h * hd, d, use_bias=o_bias, **kw)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q [B, T, heads, head_dim]``, ``k, v [B, T, kv_heads, head_dim]`` of ``x [B, T, D]``
        (q and k normalised with ``qk_norm``), before any rotary."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class Qwen2Attention(GQAProjections):
    """GQA with the rotary on the paged cache; ``o_bias``, ``qk_norm``: see :class:`GQAProjections`
    (Qwen2 has neither, Qwen3-Omni's decoders both)."""

    def __init__(
        self,
        spec: Qwen2Spec,
        layer: int,
        *,
        o_bias: bool = False,
        qk_norm: bool = False,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        super().__init__(spec, o_bias=o_bias, qk_norm=qk_norm, dtype=dtype, rngs=rngs)
        self.sliding_window = spec.sliding_windows[layer]

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        md: AttentionMetadata,
        backend: Backend,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages, v_pages = write_kv(*cache, k, v, md.slot_mapping)
        out = paged_attention(
            q,
            k_pages,
            v_pages,
            md,
            scale=self.head_dim**-0.5,
            sliding_window=self.sliding_window,
            backend=backend,
        )
        return self.o_proj(out.reshape(b, t, -1)), (k_pages, v_pages)


class Qwen2Layer(nnx.Module):
    def __init__(self, spec: Qwen2Spec, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = Qwen2Attention(spec, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, cache, md, backend):  # noqa: ANN001 - same as Qwen2Attention
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, cache, md, backend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen2Model(nnx.Module):
    """Embedding, decoder layers, final norm: ``Qwen2Model`` in transformers.

    ``embedding_size``: the token embedding's width when it is not the decoder's (the
    Qwen2.5-Omni talker embeds codec tokens at the thinker's width and projects the sum with
    the thinker's states down itself); the caller then maps embeddings to ``hidden_size``.
    ``layer_class``: the decoder layer, built as ``layer_class(spec, i, dtype=, rngs=)``
    (subclasses with other layers set it).
    """

    layer_class: type[nnx.Module] = Qwen2Layer

    def __init__(
        self,
        spec: Qwen2Spec,
        *,
        dtype: jnp.dtype = jnp.float32,
        embedding_size: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.spec = spec
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            spec.vocab_size, embedding_size or spec.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [self.layer_class(spec, i, dtype=dtype, rngs=rngs) for i in range(spec.num_layers)]
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype, rngs=rngs)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos/sin for 1-D ``positions [B, T]``; multimodal models override this for M-RoPE.

        The frequencies are a trace-time numpy constant, not a variable, so they never
        appear among the parameters a checkpoint must fill.
        """
        spec = self.spec
        inv_freq, scaling = rope_inv_freq(
            dict(spec.rope_parameters), spec.head_dim, spec.max_position_embeddings
        )
        return rope_cos_sin(positions, inv_freq, scaling, self.dtype)

    def __call__(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        after_layer: Callable[[jax.Array, int], jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Final normed hidden states ``[B, T, D]`` and the updated cache. ``after_layer(x, i)``,
        when given, maps layer ``i``'s output before the next layer reads it (Qwen3-Omni's
        DeepStack)."""
        hidden, cache, _ = self.forward(embeds, positions, kv_cache, md, backend, after_layer)
        return hidden, cache

    def forward(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        after_layer: Callable[[jax.Array, int], jax.Array] | None = None,
        tap: int | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """:meth:`__call__`, and transformers' ``hidden_states[tap]`` (``None`` without ``tap``):
        the input embeddings for 0, layer ``tap - 1``'s output for ``0 < tap < layers`` (as
        transformers' output recorder reads it, before ``after_layer``), the final normed
        states for ``layers`` (transformers ties the last entry to them). A later stage may read
        a middle layer (Qwen3-Omni's talker reads ``accept_hidden_layer``)."""
        layers = len(self.layers)
        if tap is not None and not 0 <= tap <= layers:
            raise ValueError(f"hidden state {tap} of a {layers}-layer decoder (0 to {layers})")
        cos, sin = self.rope(positions)
        x = embeds
        tapped = embeds if tap == 0 else None
        new_cache: KVCache = []
        for i, (layer, cache) in enumerate(zip(self.layers, kv_cache, strict=True)):
            x, cache = layer(x, cos, sin, cache, md, backend)
            if i + 1 == tap:
                tapped = x
            if after_layer is not None:
                x = after_layer(x, i)
            new_cache.append(cache)
        out = self.norm(x)
        return out, new_cache, (out if tap == layers else tapped)


class Qwen2ForCausalLM(nnx.Module):
    """Decoder plus LM head (tied to the embedding when the config says so); ``model_class``:
    the decoder (subclasses with another one set it)."""

    model_class: type[Qwen2Model] = Qwen2Model

    def __init__(self, spec: Qwen2Spec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.spec = spec
        self.model = self.model_class(spec, dtype=dtype, rngs=rngs)
        if not spec.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                spec.hidden_size, spec.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
            )

    def embed(self, tokens: jax.Array, extra: None = None) -> jax.Array:
        """Token embeddings; ``extra`` is the engine's per-step hook for multimodal subclasses
        (:meth:`omni_jax.models.qwen2_5_omni.thinker.Thinker.embed`), always None for a text LM."""
        if extra is not None:
            raise ValueError("a text-only model merges no extra inputs into its embeddings")
        return self.model.embed_tokens(tokens)

    def layer_inputs(self, tokens: jax.Array, extra: Any) -> Any:
        """What the layers read of the engine's step inputs beyond the embeddings: nothing (the
        engine's hook for Qwen3-Omni's DeepStack, :meth:`omni_jax.engine.ar_runner.ARModel.layer_inputs`)."""
        return None

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` the engine sizes the paged cache with."""
        return self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim

    def num_query_heads(self) -> int:
        """Attention heads of a query (a multiple of the KV heads)."""
        return self.spec.num_heads

    def vocab_size(self) -> int:
        """Width of :meth:`logits`."""
        return self.spec.vocab_size

    def max_positions(self) -> int:
        """The longest sequence the rotary positions are made for (``max_position_embeddings``)."""
        return self.spec.max_position_embeddings

    def activation_width(self, model: int) -> int:
        """Float32 values one token row of a step holds at once on one device, when a ``model``
        mesh axis of that size splits the layers (the engine's memory estimate): the SwiGLU's
        gate and up outputs and their product (XLA keeps all three: the down projection's dot
        reads the product as a buffer of its own), split over ``model``, beside three vectors of
        the residual stream's width, whole on every device."""
        return 3 * self.spec.intermediate_size // model + 3 * self.spec.hidden_size

    def __call__(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        layer_inputs: Any = None,
    ) -> tuple[jax.Array, KVCache]:
        """Final normed hidden states and the updated cache. ``layer_inputs``: what
        :meth:`layer_inputs` gives the engine."""
        hidden, cache, _ = self.forward(embeds, positions, kv_cache, md, backend, layer_inputs)
        return hidden, cache

    def forward(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend = "auto",
        layer_inputs: None = None,
        tap: int | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """:meth:`__call__`, and the decoder's ``hidden_states[tap]`` (:meth:`Qwen2Model.forward`)
        for a later stage that reads a layer's states (the engine's step;
        ``layer_inputs`` is ``None``, which no Qwen2 layer reads)."""
        return self.model.forward(embeds, positions, kv_cache, md, backend, tap=tap)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits for ``hidden [..., D]`` (only the rows a sampler needs)."""
        if self.spec.tie_word_embeddings:
            out = self.model.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)


def decoder_rules(*, o_bias: bool = False) -> tuple[ParamRule, ...]:
    """HF decoder names (no prefix) -> ``Qwen2Model`` paths; ``o_bias``: ``o_proj`` has a bias
    beside q/k/v's (Qwen3-Omni's decoders, whose own rules add the q/k norms and experts)."""
    biased = "qkvo" if o_bias else "qkv"
    return (
        ParamRule(r"embed_tokens\.weight", "embed_tokens.embedding"),
        ParamRule(r"norm\.weight", "norm.weight"),
        ParamRule(
            r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"
        ),
        ParamRule(
            r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight",
            r"layers.\1.self_attn.\2_proj.kernel",
            linear_kernel,
        ),
        ParamRule(rf"layers\.(\d+)\.self_attn\.([{biased}])_proj\.bias", r"layers.\1.self_attn.\2_proj.bias"),
        ParamRule(
            r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.kernel", linear_kernel
        ),
    )


DECODER_RULES: tuple[ParamRule, ...] = decoder_rules()
"""HF ``Qwen2Model`` names (no prefix) -> ``Qwen2Model`` paths."""

CAUSAL_LM_RULES: tuple[ParamRule, ...] = (
    *(ParamRule(r"model\." + r.hf, "model." + r.flax, r.transform) for r in DECODER_RULES),
    ParamRule(r"lm_head\.weight", "lm_head.kernel", linear_kernel),
)


def causal_lm_ignore(spec: Qwen2Spec) -> tuple[str, ...]:
    """HF names a converter may drop: ``lm_head`` when tied, rotary buffers."""
    ignore = [r".*rotary_emb\.inv_freq"]
    if spec.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    return tuple(ignore)


def partition_rules(spec: Qwen2Spec, model: int) -> tuple[ShardRule, ...]:
    """Tensor-parallel layout of ``Qwen2ForCausalLM`` (and decoders sharing its paths) over ``model``.

    Megatron-style: q/k/v/gate/up split their output columns (whole heads per device), o/down
    split their input rows so each layer needs one all-reduce after attention and one after
    the MLP; the embedding and LM head split the vocabulary. When ``model`` does not divide the
    KV heads, k/v stay whole on every device and the cache stores replicated heads instead
    (:func:`omni_jax.parallel.rules.replicated_kv_heads`). Norms are replicated.
    """
    stored_kv_heads = replicated_kv_heads(spec.num_kv_heads, spec.num_heads, model)  # checks the heads
    col, row = (None, "model"), ("model", None)
    kv = "kqv" if stored_kv_heads == spec.num_kv_heads else "q"
    layer = r"model\.layers\.\d+\."
    return (
        ShardRule(r"model\.embed_tokens\.embedding", row),
        ShardRule(layer + rf"self_attn\.[{kv}]_proj\.kernel", col),
        ShardRule(layer + rf"self_attn\.[{kv}]_proj\.bias", ("model",)),
        ShardRule(layer + r"self_attn\.o_proj\.kernel", row),
        ShardRule(layer + r"mlp\.(gate|up)_proj\.kernel", col),
        ShardRule(layer + r"mlp\.down_proj\.kernel", row),
        ShardRule(r"lm_head\.kernel", col),
    )
