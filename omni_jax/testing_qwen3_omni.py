"""A tiny, deterministic, random-weight Qwen3-Omni checkpoint (``Qwen3OmniMoeForConditionalGeneration``).

The Qwen3-Omni counterpart of :func:`omni_jax.testing.build_tiny_qwen2_5_omni`: every sub-model
shrunk (thinker: audio encoder, vision encoder with DeepStack, MoE text decoder; talker: MoE
decoder and multi-codebook code predictor; code2wav), saved as the hub ships it (sharded
safetensors, ``generation_config.json``, tokenizer with chat template, ``preprocessor_config.json``),
with weights drawn so that transformers' ``generate(..., return_audio=True)`` runs end to end and
says something: routing spread over the experts, replies that end, a talker that stops when the
text it speaks has ended, a waveform that follows the codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_jax.models.hf_config import own_fields_unflagged
from omni_jax.testing import (
    build_tokenizer,
    keep_channel,
    randomize_weights,
    save_checkpoint,
    write_omni_processor_files,
)

QWEN3_OMNI_NAMED_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
"""The placeholders and modality brackets ``Qwen3OmniMoeProcessor`` reads off the tokenizer
(Qwen3-Omni's own spellings; Qwen2.5-Omni's are :data:`omni_jax.testing.OMNI_NAMED_TOKENS`)."""

QWEN3_OMNI_TTS_TOKENS = {
    "tts_pad_token_id": "<tts_pad>",
    "tts_bos_token_id": "<tts_text_bos>",
    "tts_eos_token_id": "<tts_text_eod>",
}
"""Thinker-vocabulary tokens whose embeddings the talker's text stream uses (pad, start, end)."""

ROLE_TOKENS = ("system", "user", "assistant")
"""Role names that must be single tokens: ``generate`` finds the user turns by the token after
``<|im_start|>`` (``user_token_id``), the assistant turn by ``<|im_start|>`` + ``assistant_token_id``,
and takes ``<|im_start|>assistant\\n`` as exactly three tokens. Added as ordinary (not special)
tokens, as they are ordinary words in the real vocabulary."""

QWEN3_OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen3-Omni's chat layout: no default system turn, one placeholder per media item between its
modality's start and end tokens, which the processor expands."""

CODEBOOK_SIZE = 32
"""Codes per codebook: the talker's first-codebook ids, the code predictor's vocabulary and
code2wav's ``codebook_size`` (2048 in Qwen3-Omni-30B-A3B)."""

NUM_CODE_GROUPS = 4
"""Codebooks per codec frame: the talker predicts the first, the code predictor the others (16
in the released model)."""

TALKER_VOCAB = CODEBOOK_SIZE + 1024
"""``generate`` suppresses the talker's last 1024 ids but codec EOS, so the vocabulary is the
codebook plus exactly 1024 specials, as in the release (2048 + 1024)."""

QWEN3_OMNI_CODEC = dict(
    codec_pad_id=CODEBOOK_SIZE + 100,
    codec_bos_id=CODEBOOK_SIZE + 101,
    codec_eos_token_id=CODEBOOK_SIZE + 102,
    codec_nothink_id=CODEBOOK_SIZE + 107,
    codec_think_bos_id=CODEBOOK_SIZE + 108,
    codec_think_eos_id=CODEBOOK_SIZE + 109,
)
"""The talker's codec specials, at the release's offsets past the codebook (2148 to 2157)."""

QWEN3_OMNI_SPEAKERS = {
    "chelsie": CODEBOOK_SIZE + 253,
    "ethan": CODEBOOK_SIZE + 254,
    "aiden": CODEBOOK_SIZE + 255,
}
"""``talker_config.speaker_id``: ``generate(speaker=name)`` looks ``name.lower()`` up here and puts that
codec id in the talker's prompt (the release's 2301 to 2303); ``"Ethan"`` is its default."""

QWEN3_OMNI_IMAGE_SETTINGS = dict(
    patch_size=16,
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 16384,
    image_mean=[0.5] * 3,
    image_std=[0.5] * 3,
)
"""``Qwen2VLImageProcessor`` settings for the 16-pixel patches of Qwen3-Omni's vision encoder
(32-pixel merged tokens, at least 2 x 2 of them), normalised to [-1, 1]."""


def build_qwen3_omni_tokenizer(seed: int = 0) -> Any:
    """The tiny byte-level BPE tokenizer with Qwen3-Omni's placeholders, TTS tokens, single-token
    role names (:data:`ROLE_TOKENS`) and :data:`QWEN3_OMNI_CHAT_TEMPLATE`."""
    tokenizer = build_tokenizer(
        vocab_size=448,
        seed=seed,
        extra_special=list(QWEN3_OMNI_TTS_TOKENS.values()),
        named_special=QWEN3_OMNI_NAMED_TOKENS,
    )
    tokenizer.add_tokens(list(ROLE_TOKENS))
    tokenizer.chat_template = QWEN3_OMNI_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_omni_config(tokenizer: Any, **overrides: Any) -> Any:
    """A ``Qwen3OmniMoeConfig`` with every sub-model shrunk; token ids point into ``tokenizer``.

    The audio encoder keeps 128 mel bins and ``n_window`` 50 (what ``Qwen3OmniMoeProcessor``
    counts audio tokens with), the vision encoder 16-pixel patches, so the real feature extractor
    and image processor produce inputs it accepts. The thinker's decoder has 3 layers, the middle
    one dense (``mlp_only_layers``), the others 8 experts with top-2 routing, and DeepStack
    features from vision layers 0 and 2; its head is wider than ``hidden / heads`` as in the
    release, and the M-RoPE section interleaves into it. The talker is a 2-layer MoE (4 experts,
    top-2, a shared expert) reading thinker layer 2, with a 2-layer code predictor for the other
    :data:`NUM_CODE_GROUPS` - 1 codebooks; code2wav turns a codec frame into 48 samples.
    Decoders draw weights at ``initializer_range`` 0.2, so logits are peaky and routing is decided
    by the signal. ``overrides`` replace whole sub-configs or top-level fields.
    """
    from transformers import Qwen3OmniMoeConfig

    token = tokenizer.convert_tokens_to_ids
    ids = {k: token(v) for k, v in QWEN3_OMNI_NAMED_TOKENS.items()}
    modality = dict(
        audio_token_id=ids["audio_token"],
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
        vision_start_token_id=ids["vision_bos_token"],
        position_id_per_seconds=13,  # the release's, and what the processor interleaves video by
    )
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
    decoder = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters=mrope,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    thinker = dict(
        text_config=dict(
            decoder,
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
            n_window=50,
            n_window_infer=200,
            downsample_hidden_size=8,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 2],
        ),
        user_token_id=token("user"),
        vision_end_token_id=ids["vision_eos_token"],
        initializer_range=0.2,
        **modality,
    )
    talker = dict(
        text_config=dict(
            decoder,
            vocab_size=TALKER_VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),
        code_predictor_config=dict(
            vocab_size=CODEBOOK_SIZE,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_code_groups=NUM_CODE_GROUPS,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            initializer_range=0.2,
        ),
        num_code_groups=NUM_CODE_GROUPS,
        thinker_hidden_size=64,
        accept_hidden_layer=2,
        speaker_id=dict(QWEN3_OMNI_SPEAKERS),
        spatial_merge_size=2,
        initializer_range=0.2,
        **modality,
        **QWEN3_OMNI_CODEC,
    )
    code2wav = dict(
        codebook_size=CODEBOOK_SIZE,
        num_quantizers=NUM_CODE_GROUPS,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        intermediate_size=48,
        num_hidden_layers=2,
        upsample_rates=[4, 3],
        upsampling_ratios=[2, 2],
        decoder_dim=32,
        max_position_embeddings=1024,
    )
    kw: dict[str, Any] = dict(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=token("<|im_start|>"),
        im_end_token_id=token("<|im_end|>"),
        system_token_id=token("system"),
        user_token_id=token("user"),
        assistant_token_id=token("assistant"),
        **{k: token(v) for k, v in QWEN3_OMNI_TTS_TOKENS.items()},
    )
    kw.update(overrides)
    return Qwen3OmniMoeConfig(**kw)


def thinker_part(thinker: Any, name: str) -> Any:
    """``audio_tower``, ``visual`` or ``language_model`` (the text decoder) of transformers'
    Qwen3-Omni thinker, in either module layout: transformers 5.24 nests all three in
    ``thinker.model``, 5.17 keeps the encoders on the thinker and its ``thinker.model`` is the text
    decoder itself. Checkpoints name them the same in both (``thinker.audio_tower.*``,
    ``thinker.model.layers.*``)."""
    inner = thinker.model
    if hasattr(inner, name):
        return getattr(inner, name)
    return inner if name == "language_model" else getattr(thinker, name)


THINKER_PARTS = ("audio_tower", "visual", "language_model")
"""The thinker's modules under ``thinker.model`` in transformers 5.24, in their registration order
(so drawing their weights one part after the other draws what one pass over ``thinker.model``
does)."""


def init_talker_moe(talker: Any) -> None:
    """Draw the talker's expert and router weights, which transformers leaves undrawn.

    ``Qwen3OmniMoeTalkerTextExperts`` are ``torch.empty`` (whatever memory held) and the router
    is zeros, so every token would pick the same experts; here both are normal with the talker
    decoder's ``initializer_range``, as transformers draws the thinker's. Uses torch's global RNG.
    """
    import torch

    std = talker.config.text_config.initializer_range
    with torch.no_grad():
        for layer in talker.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
                p.copy_(torch.randn(p.shape) * std)


# How end_replies_at_punctuation and speak_until_text_ends wire their flags (see there).
SENTENCE_END = (".", "!", "?")
REPLY_END_CHANNEL = 1
SENTENCE_END_BOOST = 2.0
THINKER_EOS_WEIGHT = 100.0
TEXT_END_THINKER_CHANNEL = 0
TEXT_END_UNIT = 0
TEXT_END_TALKER_CHANNEL = 0
TEXT_END_GAIN = 4.0
TALKER_EOS_WEIGHT = 50.0


def end_replies_at_punctuation(model: Any, tokenizer: Any) -> None:
    """Make the random-weight thinker end its reply right after its first :data:`SENTENCE_END`
    token, as a trained one ends a one-sentence answer.

    Greedy replies of random weights either never reach ``<|im_end|>`` or emit it first, which
    transformers cannot speak (``generate(return_audio=True)`` needs two reply tokens; Qwen2.5-Omni's
    :data:`~omni_jax.testing.THINKER_EOS_SCALE` gives both here). Instead thinker embedding channel
    :data:`REPLY_END_CHANNEL` is 1 for the sentence-end tokens and 0 for every other token, no layer
    writes it (:func:`keep_channel`), and the LM head reads it for ``<|im_end|>`` only, with
    :data:`THINKER_EOS_WEIGHT`: the EOS logit is exactly 0 (below the best token's) except after a
    sentence end, where it wins by a wide margin (about 19 to 5), so float noise cannot flip it.
    The sentence-end head rows are scaled by :data:`SENTENCE_END_BOOST` so greedy replies reach one
    within 2 to 20 tokens for most prompts (10 of 12 at seed 0). Deterministic (no random draws).
    """
    import torch

    f = REPLY_END_CHANNEL
    thinker = model.thinker
    ends = [tokenizer.convert_tokens_to_ids(t) for t in SENTENCE_END]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        embed = thinker.get_input_embeddings().weight
        embed[:, f] = 0.0
        embed[ends, f] = 1.0
        text = thinker_part(thinker, "language_model")
        keep_channel(text.layers, f)
        text.norm.weight[f] = 1.0
        head = thinker.lm_head.weight
        head[:, f] = 0.0
        head[ends] *= SENTENCE_END_BOOST
        head[eos] = 0.0
        head[eos, f] = THINKER_EOS_WEIGHT


def speak_until_text_ends(model: Any) -> None:
    """Make the random-weight talker speak one codec frame per reply token, then stop, as a
    trained one stops after the text it reads has ended.

    ``generate`` adds the talker's text stream to its input at every step: the projected thinker
    embedding of the next reply token, then of ``<tts_text_eod>``, then of ``<tts_pad>`` for ever.
    Random weights never pick codec EOS (greedy decoding runs to ``talker_max_new_tokens``), so
    the weights get a flag for "the text has ended": thinker embedding channel
    :data:`TEXT_END_THINKER_CHANNEL` is zero but for those two tokens; one hidden unit of the
    talker's ``text_projection`` reads it alone and writes it alone to talker channel
    :data:`TEXT_END_TALKER_CHANNEL`, which no codec embedding feeds and no layer writes
    (:func:`keep_channel`), and the codec head reads it for EOS only. EOS's logit is therefore
    exactly 0 while text is being read (below the best code's) and large once ``<tts_text_eod>`` is
    read. The reply's last token (its ``<|im_end|>``) is never embedded by the thinker, so a reply
    of ``n`` tokens gives ``n - 1`` codec frames. The decision never rests on close logits, so a
    port that follows the reference's text stream reproduces it. Deterministic (no random draws).
    """
    import torch

    c, u, e = TEXT_END_THINKER_CHANNEL, TEXT_END_UNIT, TEXT_END_TALKER_CHANNEL
    talker = model.talker
    tts = [model.config.tts_pad_token_id, model.config.tts_eos_token_id]
    with torch.no_grad():
        embed = model.thinker.get_input_embeddings().weight
        embed[:, c] = 0.0
        embed[tts, c] = 1.0
        fc1, fc2 = talker.text_projection.linear_fc1, talker.text_projection.linear_fc2
        fc1.weight[u] = 0.0
        fc1.weight[u, c] = TEXT_END_GAIN
        fc1.bias[u] = 0.0
        fc2.weight[:, u] = 0.0
        fc2.weight[e] = 0.0
        fc2.weight[e, u] = 1.0
        fc2.bias[e] = 0.0
        talker.model.codec_embedding.weight[:, e] = 0.0
        for table in talker.code_predictor.model.codec_embedding:
            table.weight[:, e] = 0.0
        keep_channel(talker.model.layers, e)
        talker.model.norm.weight[e] = 1.0
        head = talker.codec_head.weight
        head[:, e] = 0.0
        eos = talker.config.codec_eos_token_id
        head[eos] = 0.0
        head[eos, e] = TALKER_EOS_WEIGHT


@own_fields_unflagged()  # the config it builds is the release's, which transformers warns about
def build_tiny_qwen3_omni(
    path: str | Path, seed: int = 0, max_shard_size: str = "1MB", **config_overrides: Any
) -> Path:
    """Write a random-weight ``Qwen3OmniMoeForConditionalGeneration`` checkpoint to ``path``.

    Sharded safetensors (``max_shard_size``: the default gives 4 shards) with
    ``model.safetensors.index.json``, ``generation_config.json``, the tokenizer of
    :func:`build_qwen3_omni_tokenizer` and ``preprocessor_config.json`` for
    ``Qwen3OmniMoeProcessor``. Voices: :data:`QWEN3_OMNI_SPEAKERS`, in the config as the release
    has them (Qwen3-Omni has no ``spk_dict.pt``). Deterministic in ``seed``. Past transformers'
    init: the audio and vision encoders and code2wav are re-drawn at a scale where their outputs
    follow their inputs (code2wav's ConvNet so that the waveform stays inside its [-1, 1] clamp),
    the talker's experts and routers are drawn (:func:`init_talker_moe`), replies end after
    a sentence (:func:`end_replies_at_punctuation`) and the talker stops when their text ends
    (:func:`speak_until_text_ends`). ``config_overrides`` go to :func:`tiny_qwen3_omni_config`.
    """
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    tokenizer = build_qwen3_omni_tokenizer(seed)
    cfg = tiny_qwen3_omni_config(tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).float().eval()
    randomize_weights(thinker_part(model.thinker, "audio_tower"), 1.0)
    randomize_weights(thinker_part(model.thinker, "visual"), 1.0)
    randomize_weights(model.code2wav, 1.0)
    # The ConvNet decoder amplifies steeply: at 0.7, with small biases, the waveform follows the
    # codes (two code sequences differ by about its own size) and peaks at 0.2 to 0.4 (code2wavs of
    # seeds 0-2), far from the [-1, 1] clamp; at 0.8 some reach it; with larger biases it is
    # mostly a constant offset.
    randomize_weights(model.code2wav.decoder, 0.7, vector_std=0.02)
    init_talker_moe(model.talker)
    end_replies_at_punctuation(model, tokenizer)
    speak_until_text_ends(model)
    save_checkpoint(path, model, tokenizer, max_shard_size=max_shard_size)
    write_omni_processor_files(path, processor_class="Qwen3OmniMoeProcessor", **QWEN3_OMNI_IMAGE_SETTINGS)
    return path


def give_talker_audio_config(model: Any) -> Any:
    """Let transformers' talker count a prompt's audio tokens; returns ``model``.

    ``Qwen3OmniMoeTalkerForConditionalGeneration`` computes its M-RoPE positions with the thinker's
    ``get_rope_index``, which reads ``self.config.audio_config.n_window``, a field the talker's
    config lacks (transformers 5.24): ``generate(return_audio=True)`` raises ``AttributeError``
    for any prompt with audio. The talker is given the thinker's audio config, whose ``n_window``
    the processor counted the audio tokens with. A no-op where the field exists.
    """
    talker_config = model.talker.config
    if not hasattr(talker_config, "audio_config"):
        talker_config.audio_config = model.config.thinker_config.audio_config
    return model
