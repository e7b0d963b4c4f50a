"""Qwen3-Omni talker: an MoE decoder over the first codebook of a multi-codebook codec.

transformers' ``Qwen3OmniMoeTalkerForConditionalGeneration``. The decoder is the thinker's
(:class:`~omni_jax.models.qwen3_omni.text_decoder.Qwen3OmniTextModel`: q/k-normed attention,
interleaved M-RoPE, the paged KV cache), except that every layer's MLP is the sparse block
*with* a gated shared expert (``Qwen3OmniMoeTalkerDecoderLayer`` replaces whatever
``mlp_only_layers`` and ``decoder_sparse_step`` chose). Its embedding is the codec embedding
(``model.codec_embedding``) and its head ``codec_head`` scores the first codebook; the other
codebooks of a frame come from the :class:`~omni_jax.models.qwen3_omni.code_predictor.CodePredictor`
(``self.code_predictor``), run once per frame after the first code is drawn.

The talker never sees thinker states raw: ``text_projection`` maps thinker token embeddings
and ``hidden_projection`` thinker hidden states (of layer ``accept_hidden_layer``) from the
thinker's width to the talker's, each a two-layer SiLU MLP with biases
(``Qwen3OmniMoeTalkerResizeMLP``). Which rows a request's positions read is the stage's
business (see ``Qwen3OmniMoeForConditionalGeneration.generate``); the model takes them per
step as :class:`TalkerEmbeds`, already at the talker's width.

The interface is the engine's AR model (``embed``, ``__call__``, ``logits`` and the Qwen2
LM's sizes); ``self.spec`` is the decoder's spec, ``self.talker_spec`` the rest.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omni_jax.models.moe import MoESpec, stack_expert_readers
from omni_jax.models.param_map import ParamRule, linear_kernel, prefixed
from omni_jax.models.qwen3_omni.code_predictor import (
    CODE_PREDICTOR_RULES,
    CodePredictor,
    CodePredictorSpec,
    FrameSampling,
    stack_codebook_readers,
)
from omni_jax.models.qwen3_omni.text_decoder import (
    TEXT_DECODER_RULES,
    Qwen3OmniTextLM,
    Qwen3OmniTextModel,
    Qwen3OmniTextSpec,
    text_lm_partition_rules,
)
from omni_jax.parallel.rules import ShardRule
from omni_jax.safetensors_io import TensorReader

SUPPRESSED_TAIL = 1024
"""``generate`` never lets the talker draw its vocabulary's last 1024 ids (the codec specials
and unused ids), codec EOS excepted."""

SUPPRESSED_LOGIT = float(jnp.finfo(jnp.float32).min)
"""The logit :meth:`Talker.logits` gives a suppressed id: finite (the engine ends a row whose
logits are not), and no draw, greedy or sampled, ever picks it over a real one."""


@dataclasses.dataclass(frozen=True)
class TalkerSpec:
    """The parts of a ``Qwen3OmniMoeTalkerConfig`` the talker needs, hashable for jit.

    text: the decoder (``vocab_size`` is the talker's codec vocabulary; every layer sparse,
        with the shared expert). code_predictor: the remaining codebooks' model.
    thinker_hidden_size: the width the projections read. projection_size: their inner width
        (the talker text config's ``intermediate_size``).
    num_code_groups: codebooks per frame, the first included.
    accept_hidden_layer: index into the thinker's hidden states (0 = its input embeddings)
        whose rows ``hidden_projection`` reads at multimodal positions.
    codec_*: the talker's codec ids: ``eos`` ends the speech; ``pad``, ``bos``, ``nothink``,
        ``think_bos``, ``think_eos`` and the speaker ids (``speakers``: lower-case name -> id)
        are the assistant prompt's codec rows.
    """

    text: Qwen3OmniTextSpec
    code_predictor: CodePredictorSpec
    thinker_hidden_size: int
    projection_size: int
    num_code_groups: int
    accept_hidden_layer: int
    codec_eos: int
    codec_pad: int
    codec_bos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    speakers: tuple[tuple[str, int], ...]

    @classmethod
    def from_hf(cls, cfg: Any) -> TalkerSpec:
        """From a ``Qwen3OmniMoeTalkerConfig``. The codec head is tied to the codec embedding
        when the talker config says so (false for the released model)."""
        text_cfg = cfg.text_config
        base = Qwen3OmniTextSpec.from_hf(text_cfg, tie_word_embeddings=bool(cfg.tie_word_embeddings))
        text = dataclasses.replace(
            base,
            moe=MoESpec.from_hf(text_cfg, shared_expert=True),
            sparse_layers=(True,) * base.num_layers,
        )
        predictor = CodePredictorSpec.from_hf(cfg.code_predictor_config)
        if predictor.num_code_groups != cfg.num_code_groups:
            raise ValueError(
                f"num_code_groups: talker {cfg.num_code_groups}, code predictor {predictor.num_code_groups}"
            )
        if predictor.text.hidden_size != text.hidden_size:
            raise ValueError(
                f"code predictor width {predictor.text.hidden_size} != talker width {text.hidden_size}"
            )
        if text_cfg.hidden_act != "silu":
            raise ValueError(f"unsupported talker activation {text_cfg.hidden_act!r} (supported: silu)")
        return cls(
            text=text,
            code_predictor=predictor,
            thinker_hidden_size=cfg.thinker_hidden_size,
            projection_size=text_cfg.intermediate_size,
            num_code_groups=cfg.num_code_groups,
            accept_hidden_layer=cfg.accept_hidden_layer,
            codec_eos=cfg.codec_eos_token_id,
            codec_pad=cfg.codec_pad_id,
            codec_bos=cfg.codec_bos_id,
            codec_nothink=cfg.codec_nothink_id,
            codec_think_bos=cfg.codec_think_bos_id,
            codec_think_eos=cfg.codec_think_eos_id,
            speakers=tuple(sorted((cfg.speaker_id or {}).items())),
        )

    def suppressed_from(self) -> int:
        """The first id ``generate`` suppresses (:data:`SUPPRESSED_TAIL`); EOS is still drawn."""
        return max(self.text.vocab_size - SUPPRESSED_TAIL, 0)


PROJECT_NONE, PROJECT_TEXT, PROJECT_HIDDEN = 0, 1, 2
""":attr:`ThinkerRows.project` values: no thinker row at the position, ``text_projection`` of a
thinker token embedding, ``hidden_projection`` of a thinker hidden state."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ThinkerRows:
    """Thinker rows at the thinker's width that a step projects to the talker's
    (:meth:`Talker.embed`), so the stage never runs a projection program of its own.

    rows: ``[B, T, D_thinker]``; project: ``[B, T]`` int32, which projection reads the row
        (:data:`PROJECT_NONE`, :data:`PROJECT_TEXT`, :data:`PROJECT_HIDDEN`).
    """

    rows: jax.Array
    project: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TalkerEmbeds:
    """One step's inputs besides the codec tokens, for :meth:`Talker.embed`.

    rows: ``[B, T, D]`` at the talker's width, added at every position: a projected thinker
        row (prompt), a projected text row plus a frame's codebook-embedding sum (a generated
        step), zeros at padding.
    add_codec: ``[B, T]`` bool, whether the position also adds its token's codec embedding
        (the assistant prompt's codec special ids); False where ``rows`` is the whole input.
    thinker: thinker-width rows projected and added as well (the engine's steps), or ``None``
        when ``rows`` holds them projected already.
    """

    rows: jax.Array
    add_codec: jax.Array
    thinker: ThinkerRows | None = None


class ResizeMLP(nnx.Module):
    """``Qwen3OmniMoeTalkerResizeMLP``: ``fc2(silu(fc1(x)))`` with biases, thinker -> talker width."""

    def __init__(self, width: int, inner: int, out: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(use_bias=True, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.linear_fc1 = nnx.Linear(width, inner, **kw)
        self.linear_fc2 = nnx.Linear(inner, out, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(jax.nn.silu(self.linear_fc1(x)))


class Talker(Qwen3OmniTextLM):
    """``Qwen3OmniMoeTalkerForConditionalGeneration``: projections, MoE decoder, codec head,
    and the code predictor (``self.code_predictor``, run by
    :func:`~omni_jax.models.qwen3_omni.code_predictor.predict_frame` over its own split).

    ``__call__`` (no DeepStack: the talker takes none), ``kv_cache_shape``,
    ``num_query_heads``, ``max_positions`` are the decoder's; ``vocab_size`` is the codec
    vocabulary's. A step's last hidden row is what the code predictor reads.
    """

    def __init__(self, spec: TalkerSpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        text = spec.text
        self.spec = text
        self.talker_spec = spec
        self.model = Qwen3OmniTextModel(text, dtype=dtype, rngs=rngs)
        sizes = (spec.thinker_hidden_size, spec.projection_size, text.hidden_size)
        self.text_projection = ResizeMLP(*sizes, dtype=dtype, rngs=rngs)
        self.hidden_projection = ResizeMLP(*sizes, dtype=dtype, rngs=rngs)
        if not text.tie_word_embeddings:
            self.codec_head = nnx.Linear(
                text.hidden_size, text.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
            )
        self.code_predictor = CodePredictor(spec.code_predictor, dtype=dtype, rngs=rngs)

    def embed(self, tokens: jax.Array, extra: TalkerEmbeds | None = None) -> jax.Array:
        """Decoder inputs ``[B, T, D]`` for codec ``tokens [B, T]``:
        ``where(add_codec, codec_embedding(tokens), 0) + rows``, plus the projected
        ``thinker`` rows when given (each row through both projections, the one it names kept:
        two small MLPs per token beside the decoder's layers); without ``extra``, the codec
        embeddings alone."""
        codec = self.model.embed_tokens(tokens)
        if extra is None:
            return codec
        out = jnp.where(extra.add_codec[..., None], codec, 0) + extra.rows.astype(codec.dtype)
        if extra.thinker is None:
            return out
        thinker = extra.thinker.rows.astype(codec.dtype)
        project = extra.thinker.project[..., None]
        text, hidden = self.text_projection(thinker), self.hidden_projection(thinker)
        return out + jnp.where(project == PROJECT_TEXT, text, jnp.where(project == PROJECT_HIDDEN, hidden, 0))

    def frame(
        self, hidden: jax.Array, first: jax.Array, sampling: FrameSampling | None
    ) -> tuple[jax.Array, jax.Array]:
        """The codec frame of each of ``B`` drawn first codes ``first [B]`` from the final
        hidden state that scored it ``hidden [B, D]``: ``(codes [B, G], embedding sum [B, D])``
        (:meth:`~omni_jax.models.qwen3_omni.code_predictor.CodePredictor.frame`, reading this
        talker's codec embedding)."""
        table = self.model.embed_tokens.embedding[...]
        return self.code_predictor.frame(table, hidden, first, sampling)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 first-codebook logits for ``hidden [..., D]``, the ids ``generate`` never
        draws (:meth:`TalkerSpec.suppressed_from` on, EOS excepted) at :data:`SUPPRESSED_LOGIT`."""
        spec = self.talker_spec
        if self.spec.tie_word_embeddings:
            out = self.model.embed_tokens.attend(hidden).astype(jnp.float32)
        else:
            out = self.codec_head(hidden).astype(jnp.float32)
        ids = jnp.arange(self.spec.vocab_size)
        suppressed = (ids >= spec.suppressed_from()) & (ids != spec.codec_eos)
        return jnp.where(suppressed, SUPPRESSED_LOGIT, out)

    def activation_width(self, model: int) -> int:
        """The sparse block's width (:meth:`Qwen3OmniTextLM.activation_width`) plus its shared
        expert's gate and up outputs and their product and gate logit, which it holds beside the
        routed experts'."""
        shared = self.spec.moe.shared_expert_size if self.spec.moe is not None else 0
        return super().activation_width(model) + 3 * shared // model + 1


def stack_talker_readers(tensors: Iterable[tuple[str, TensorReader]]) -> Iterator[tuple[str, TensorReader]]:
    """A talker checkpoint's tensors as :data:`TALKER_RULES` names them: each layer's experts
    stacked (:func:`~omni_jax.models.moe.stack_expert_readers`, per-expert or fused), and the
    code predictor's per-codebook heads and embeddings
    (:func:`~omni_jax.models.qwen3_omni.code_predictor.stack_codebook_readers`)."""
    return stack_codebook_readers(stack_expert_readers(tensors))


TALKER_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"model\.codec_embedding\.weight", "model.embed_tokens.embedding"),
    *prefixed("model.", "model", TEXT_DECODER_RULES),
    *(
        ParamRule(
            rf"{p}_projection\.linear_fc([12])\.weight", rf"{p}_projection.linear_fc\1.kernel", linear_kernel
        )
        for p in ("text", "hidden")
    ),
    *(
        ParamRule(rf"{p}_projection\.linear_fc([12])\.bias", rf"{p}_projection.linear_fc\1.bias")
        for p in ("text", "hidden")
    ),
    ParamRule(r"codec_head\.weight", "codec_head.kernel", linear_kernel),
    *prefixed("code_predictor.", "code_predictor", CODE_PREDICTOR_RULES),
)
"""Checkpoint names of ``Qwen3OmniMoeTalkerForConditionalGeneration`` (after
:func:`stack_talker_readers`) -> :class:`Talker` paths. Inside a full
``Qwen3OmniMoeForConditionalGeneration`` checkpoint they carry a ``talker.`` prefix
(``prefixed("talker.", "", TALKER_RULES)``)."""


def talker_ignore(spec: TalkerSpec, prefix: str = "") -> tuple[str, ...]:
    """Checkpoint names the talker drops: rotary buffers, and the codec head when tied.
    ``prefix``: ``"talker."`` inside a full Omni checkpoint."""
    p = re.escape(prefix)
    ignore = [p + r".*rotary_emb\.inv_freq"]
    if spec.text.tie_word_embeddings:
        ignore.append(p + r"codec_head\.weight")
    return tuple(ignore)


def talker_partition_rules(spec: TalkerSpec, model: int) -> tuple[ShardRule, ...]:
    """The decoder as the thinker's text decoder (attention by heads, experts whole per device
    or by width, codec embedding by vocabulary: :func:`text_lm_partition_rules`), the codec head
    by vocabulary; ``ValueError`` when ``model`` does not divide the attention heads.

    The projections and the code predictor stay whole on every device: the projections run
    once per prompt row, and the code predictor is small (five layers in the release) and runs
    a sequential loop of single-token steps per frame, where a split would add collectives to
    every codebook's step.
    """
    return (*text_lm_partition_rules(spec.text, model), ShardRule(r"codec_head\.kernel", (None, "model")))
