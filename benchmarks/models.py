"""Benchmark checkpoints: ``tiny`` and ``small`` are built locally per suite, anything else is a path."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG, build_tiny_qwen2, build_tiny_qwen2_5_omni
from omni_jax.testing_qwen3_omni import (
    build_qwen3_omni_tokenizer,
    build_tiny_qwen3_omni,
    tiny_qwen3_omni_config,
)

# ~40M parameters: Qwen2.5-0.5B's head layout at a width and depth this CPU runs in minutes.
SMALL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.02,
)

SMALL_TOKEN2WAV = dict(
    dit_config=dict(num_hidden_layers=4, look_ahead_layers=[2], look_backward_layers=[0, 3]),
    bigvgan_config={},
)
"""Qwen2.5-Omni-7B's token2wav (transformers' config defaults are its layer shapes: DiT width
1024, 16 heads, ECAPA speaker encoder; BigVGAN from 1536 channels through six upsamplings) with
4 DiT layers instead of 22, one looking ahead and two looking back as in the real stack, so the
reference decodes a batch on this CPU in minutes. Thinker and talker stay tiny."""

LONG_REPLY_POSITIONS = 2048
"""``max_position_embeddings`` of the talker's decoder and of the DiT in the checkpoints of the
streamed-speech suite (:mod:`benchmarks.stream_suite`): the tiny builder's 512 hold a talker prompt
and its codes in 512 positions and an offline code2wav request in 256 codes (5 s at Qwen2.5-Omni's
50 codes per second); 2048 holds replies of up to 1024 codes (20 s) offline. Only the positions
change: no weight depends on them (both use rotary positions), so the weights are the seed's."""


def build_long_replies(path: Path, token2wav_config: dict | None = None) -> Path:
    """The ``tiny`` Qwen2.5-Omni (with ``token2wav_config``: ``small``'s) with the talker's and the
    DiT's positions at :data:`LONG_REPLY_POSITIONS`. The DiT's is set through ``token2wav_config``;
    the talker's in ``config.json`` after the build (its sub-config is the builder's own), which
    draws the same weights: a position count shapes no parameter."""
    t2w = token2wav_config or dict(dit_config=TINY_DIT_CONFIG, bigvgan_config=TINY_BIGVGAN_CONFIG)
    dit = dict(t2w.get("dit_config", {}), max_position_embeddings=LONG_REPLY_POSITIONS)
    build_tiny_qwen2_5_omni(path, seed=0, token2wav_config=dict(t2w, dit_config=dit))
    config = json.loads((path / "config.json").read_text())
    config["talker_config"]["max_position_embeddings"] = LONG_REPLY_POSITIONS
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


LONG_REPLIES = "qwen2_5_omni_long_replies"
"""The :data:`BUILDERS` key of :func:`build_long_replies`' checkpoints."""

QWEN3_OMNI = "qwen3_omni_moe"
"""Qwen3-Omni's ``model_type`` (:data:`BUILDERS` key of its tiny and small checkpoints)."""

SMALL_QWEN3_THINKER_TEXT = dict(
    vocab_size=152064,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=768,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    mlp_only_layers=[],
    max_position_embeddings=65536,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [24, 20, 20]},
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    num_hidden_layers=2,
    num_experts=16,
)
"""The ``small`` Qwen3-Omni's thinker decoder: Qwen3-Omni-30B-A3B's (``thinker_config.text_config``
of the released ``config.json``: width 2048, 32 query and 4 KV heads of 128, every layer an MoE
of experts 768 wide with 8 routed a token, M-RoPE sections 24/20/20 at theta 1e6, vocabulary
152064, untied head), cut to 2 layers of 16 experts instead of 48 of 128: a token's work per layer
is the release's, the weights (about 3.3 GB in float32 with the vocabulary's embedding and head)
fit this CPU box. Caveat for the figures: on a CPU, XLA expands our grouped expert matmul into a
masked product over every expert (:mod:`omni_jax.models.moe`), 16 / 8 = 2x the routed work here and
16x at the release's 128 experts, which the ratio shows as it is."""

SMALL_QWEN3_CODE2WAV = dict(
    codebook_size=2048,
    num_quantizers=16,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    sliding_window=72,
    max_position_embeddings=8000,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    layer_scale_initial_scale=0.01,
    decoder_dim=1536,
    upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2],
)
"""The ``small`` Qwen3-Omni's code2wav: Qwen3-Omni-30B-A3B's whole (``code2wav_config`` of the
released ``config.json``, nothing cut: 16 codebooks of 2048 codes, an 8-layer transformer 1024 wide
with a 72-frame window, then a causal ConvNet from 1536 channels upsampling 1920x, 12.5 frames to
24 000 samples a second), random weights."""


def build_small_qwen3_omni(path: Path) -> Path:
    """The ``small`` Qwen3-Omni: the tiny builder's checkpoint
    (:func:`omni_jax.testing_qwen3_omni.build_tiny_qwen3_omni`: its tokenizer, voices and weight
    shaping) with the released model's thinker decoder widths (:data:`SMALL_QWEN3_THINKER_TEXT`,
    layers and experts cut) and its whole code2wav (:data:`SMALL_QWEN3_CODE2WAV`), in float32.

    What stays tiny: the audio and vision encoders, the talker and its code predictor (the AR and
    code2wav suites run text prompts through the thinker and codec frames through code2wav);
    only their output widths follow the thinker's 2048, the talker's positions its 65536 (the
    pipeline refuses a talker that holds a shorter sequence than the thinker feeding it, as the
    release's two do not), and the code predictor fills code2wav's 16 codebooks a frame (codes
    from its tiny codebook, a subset of code2wav's 2048), so the checkpoint is one model that the
    e2e suites run whole. The tokenizer is the tiny one (451 ids): ids past it have no text, as in
    the ``small`` Qwen2's."""
    tiny = tiny_qwen3_omni_config(build_qwen3_omni_tokenizer(seed=0))
    width = SMALL_QWEN3_THINKER_TEXT["hidden_size"]
    thinker = tiny.thinker_config.to_dict()
    thinker["text_config"].update(SMALL_QWEN3_THINKER_TEXT)
    thinker["audio_config"]["output_dim"] = width
    thinker["vision_config"]["out_hidden_size"] = width
    thinker["initializer_range"] = SMALL_QWEN3_THINKER_TEXT["initializer_range"]
    groups = SMALL_QWEN3_CODE2WAV["num_quantizers"]
    talker = dict(tiny.talker_config.to_dict(), thinker_hidden_size=width, num_code_groups=groups)
    talker["text_config"]["max_position_embeddings"] = SMALL_QWEN3_THINKER_TEXT["max_position_embeddings"]
    talker["code_predictor_config"]["num_code_groups"] = groups
    return build_tiny_qwen3_omni(
        path,
        seed=0,
        max_shard_size="2GB",
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=SMALL_QWEN3_CODE2WAV,
    )


BUILDERS: dict[str, dict[str, tuple[str, Callable[[Path], Path]]]] = {
    "qwen2": {
        "tiny": ("bench-tiny-qwen2", lambda p: build_tiny_qwen2(p, seed=0)),
        "small": ("bench-small-qwen2", lambda p: build_tiny_qwen2(p, seed=0, **SMALL)),
    },
    "qwen2_5_omni": {
        "tiny": ("bench-tiny-qwen2_5_omni", lambda p: build_tiny_qwen2_5_omni(p, seed=0)),
        "small": (
            "bench-small-qwen2_5_omni",
            lambda p: build_tiny_qwen2_5_omni(p, seed=0, token2wav_config=SMALL_TOKEN2WAV),
        ),
    },
    LONG_REPLIES: {  # model_type qwen2_5_omni (benchmarks.run.Suite.builds)
        "tiny": ("bench-tiny-long-qwen2_5_omni", build_long_replies),
        "small": ("bench-small-long-qwen2_5_omni", lambda p: build_long_replies(p, SMALL_TOKEN2WAV)),
    },
    QWEN3_OMNI: {
        "tiny": ("bench-tiny-qwen3_omni", lambda p: build_tiny_qwen3_omni(p, seed=0)),
        "small": ("bench-small-qwen3_omni", build_small_qwen3_omni),
    },
}
"""``BUILDERS[key][name]``: the locally built checkpoints, by the ``model_type`` a suite runs (or
the key a suite names in ``benchmarks.run.Suite.builds``: a variant of that model_type)."""


def builder_version(kind: str = "") -> str:
    """A digest of what the local checkpoints are built from (the builders in
    :mod:`omni_jax.testing` and the configs here), part of their cache directory's name, so a
    checkpoint built by an older builder (e.g. before the tiny talker learnt to stop) is never
    reused."""
    import omni_jax.testing

    text = inspect.getsource(omni_jax.testing) + repr(SMALL) + repr(SMALL_TOKEN2WAV)
    if kind == LONG_REPLIES:  # the other checkpoints' digests stay as they were
        text += inspect.getsource(build_long_replies) + repr(LONG_REPLY_POSITIONS)
    if kind == QWEN3_OMNI:
        import omni_jax.testing_qwen3_omni

        text += inspect.getsource(omni_jax.testing_qwen3_omni) + inspect.getsource(build_small_qwen3_omni)
        text += repr(SMALL_QWEN3_THINKER_TEXT) + repr(SMALL_QWEN3_CODE2WAV)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text()).get("model_type", "")


def resolve_model(name: str, cache_dir: Path, kind: str = "qwen2") -> Path:
    """The ``kind`` (a ``model_type``) checkpoint: ``tiny`` / ``small`` built once into ``cache_dir``
    (per :func:`builder_version`; builds by other versions are removed), or the checkpoint
    directory ``name``."""
    if name in BUILDERS[kind]:
        dirname, build = BUILDERS[kind][name]
        path = cache_dir / f"{dirname}-{builder_version(kind)}"
        if not (path / "config.json").exists():
            partial = path.with_name(path.name + ".partial")  # an interrupted build is never reused
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(path)
            for stale in [cache_dir / dirname, *cache_dir.glob(f"{dirname}-*")]:
                if stale != path and stale.is_dir() and not stale.name.endswith(".partial"):
                    shutil.rmtree(stale, ignore_errors=True)
        return path
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {name}: not 'tiny', 'small' or a checkpoint directory")
    if model_type(path) != kind:
        raise SystemExit(f"--model {name}: a {model_type(path)!r} checkpoint, this suite runs {kind!r}")
    return path


@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """A decoder's parameters as its decode step reads and multiplies them.

    ``params``: all of them, input embedding included. ``dense``: those every step reads and
    every token multiplies (attention, norms, routers, the LM head; not an untied input embedding,
    which is only gathered). An MoE decoder's experts apart: ``moe_layers`` layers of
    ``num_experts`` experts of ``per_expert`` parameters, ``top_k`` of them routed a token.
    """

    params: int
    dense: int
    per_expert: int = 0
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def experts_read(self, batch: int) -> float:
        """Distinct experts one MoE layer reads for ``batch`` tokens, expected under uniform
        routing: ``E (1 - (1 - k / E) ** batch)`` (k at batch 1, all E as the batch grows)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def read(self, batch: int) -> float:
        """Parameters a decode step of ``batch`` rows reads (the memory-bound floor's)."""
        return self.dense + self.moe_layers * self.per_expert * self.experts_read(batch)

    def active(self) -> int:
        """Parameters each token multiplies (the compute-bound floor's, per row)."""
        return self.dense + self.moe_layers * self.top_k * self.per_expert


def decode_weights(path: Path, prefix: str = "", text_config: Any = None) -> DecodeWeights:
    """The :class:`DecodeWeights` of the decoder whose checkpoint tensors are named ``prefix``
    ``model.*`` and ``lm_head.*`` (``"thinker."`` for Qwen3-Omni's thinker; its encoders are not
    the decoder's), from the tensors' shapes (nothing is read). Expert tensors are those under
    ``mlp.experts.`` (one per expert, or fused); ``text_config`` gives their count and top-k."""
    from omni_jax.safetensors_io import iter_checkpoint

    decoder = (f"{prefix}model.", f"{prefix}lm_head.")
    sizes = {name: a.size for name, a in iter_checkpoint(path) if name.startswith(decoder)}
    params = sum(sizes.values())
    if f"{prefix}lm_head.weight" in sizes:
        sizes.pop(f"{prefix}model.embed_tokens.weight", None)
    expert_layers: dict[str, int] = {}
    for name, size in sizes.items():
        found = re.search(r"\.layers\.(\d+)\.mlp\.experts\.", name)
        if found:
            expert_layers[found[1]] = expert_layers.get(found[1], 0) + size
    dense = sum(sizes.values()) - sum(expert_layers.values())
    if not expert_layers:
        return DecodeWeights(params, dense)
    experts = int(text_config.num_experts)
    (per_layer,) = set(expert_layers.values())  # every MoE layer holds the same experts
    return DecodeWeights(
        params, dense, per_layer // experts, len(expert_layers), experts, int(text_config.num_experts_per_tok)
    )
