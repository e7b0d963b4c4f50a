"""Tiny, deterministic, random-weight HF checkpoints for tests, benchmarks and the demo.

Nothing can be downloaded from a model hub here, so checkpoints are made locally: a BPE
tokenizer trained with ``tokenizers`` on a fixed synthetic corpus, and transformers models
built from shrunken configs with a fixed torch seed, saved exactly as the hub would ship
them (``config.json``, safetensors, ``generation_config.json``, tokenizer files). The code
paths that load them are the ones that load real checkpoints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from omni_jax.models.hf_config import own_fields_unflagged

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to in and is was for on that with as by at from it this be are or have not "
    "model audio image video text speech sound token engine batch cache page step layer head "
    "attention decoder encoder sample greedy stream request output input number value time "
    "hello world jax flax xla compile device mesh shard fast slow small large red green blue "
    "one two three four five six seven eight nine ten cat dog bird fish tree river mountain"
).split()

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(3, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ","]))
    return out


def build_tokenizer(
    vocab_size: int = 384,
    seed: int = 0,
    extra_special: list[str] | None = None,
    named_special: dict[str, str] | None = None,
) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Qwen-style chat specials.

    ``named_special`` (attribute -> token, e.g. ``{"audio_token": "<|AUDIO|>"}``) become special
    tokens that the saved tokenizer exposes as ``tokenizer.audio_token`` / ``audio_token_id``,
    which is how multimodal processors find their placeholders.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named_special = dict(named_special or {})
    specials = SPECIAL_TOKENS + list(extra_special or []) + list(named_special.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        **named_special,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2_config(vocab_size: int, **overrides: Any) -> Any:
    """A Qwen2 config small enough for CPU tests; ``overrides`` change any field."""
    from transformers import Qwen2Config

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaky logits: greedy parity is not decided by float noise
        bos_token_id=None,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_tiny_qwen2(
    path: str | Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a random-weight ``Qwen2ForCausalLM`` checkpoint with its tokenizer to ``path``.

    Deterministic in ``seed``. ``max_shard_size`` (e.g. ``"200KB"``) forces sharded
    safetensors with ``model.safetensors.index.json``, as large hub checkpoints have.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(seed=seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = config_overrides.pop("vocab_size", len(tokenizer))
    cfg = tiny_qwen2_config(vocab, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    return save_checkpoint(path, model, tokenizer, **kw)


def save_checkpoint(path: Path, model: Any, tokenizer: Any, **save_kw: Any) -> Path:
    """Save ``model`` (safetensors; ``save_kw`` to ``save_pretrained``, e.g. ``max_shard_size``)
    with a ``generation_config.json`` that stops on ``<|im_end|>`` and pads with the tokenizer's
    pad token, and ``tokenizer`` beside it, as the hub ships a chat checkpoint; returns ``path``."""
    from transformers import GenerationConfig

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path, safe_serialization=True, **save_kw)
    tokenizer.save_pretrained(path)
    return path


def keep_channel(layers: Any, channel: int) -> None:
    """No decoder layer writes residual ``channel``: its rows of every ``o_proj`` and MLP, expert
    and shared-expert ``down_proj`` are zeroed, so the channel keeps what the input put there."""
    for layer in layers:
        layer.self_attn.o_proj.weight[channel] = 0.0
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts.down_proj[:, channel] = 0.0
            if hasattr(mlp, "shared_expert"):
                mlp.shared_expert.down_proj.weight[channel] = 0.0
        else:
            mlp.down_proj.weight[channel] = 0.0


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


OMNI_NAMED_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}
"""The placeholders and modality brackets ``Qwen2_5OmniProcessor`` reads off the tokenizer."""

OMNI_TTS_TOKENS = {
    "tts_text_pad_token_id": "<|tts_pad|>",
    "tts_text_start_token_id": "<|tts_text_bos|>",
    "tts_text_end_token_id": "<|tts_text_eod|>",
}
"""Thinker-vocabulary tokens the talker reads (its text stream's pad, start and end)."""

OMNI_SPEAKERS = ("Chelsie", "Ethan")

OMNI_CODEC = dict(
    tts_codec_pad_token_id=72,
    tts_codec_start_token_id=73,
    tts_codec_end_token_id=74,
    tts_codec_mask_token_id=76,
)
"""Tiny talker codec layout, shaped like the real one (codes below the DiT's ``num_embeds``,
specials above it: 8292/8293/8294/8296 with ``num_embeds`` 8193 in Qwen2.5-Omni-7B)."""

TINY_DIT_CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=16,
    ff_mult=2,
    emb_dim=16,
    block_size=4,
    look_ahead_layers=[1],
    look_backward_layers=[0, 2],
    repeats=2,
    num_embeds=64,
    mel_dim=8,
    enc_emb_dim=12,
    enc_dim=8,
    enc_channels=[16, 16, 16, 32],
    enc_kernel_sizes=[5, 3, 3, 1],
    enc_dilations=[1, 2, 3, 1],
    enc_attention_channels=8,
    enc_res2net_scale=2,
    enc_se_channels=8,
    max_position_embeddings=512,
)
TINY_BIGVGAN_CONFIG = dict(
    mel_dim=8,
    upsample_initial_channel=8,
    resblock_kernel_sizes=[3, 5],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
    upsample_rates=[5, 12],
    upsample_kernel_sizes=[11, 24],
)
"""Shrunken ``Qwen2_5OmniDiTConfig`` / ``Qwen2_5OmniBigVGANConfig`` fields (60 samples per mel frame).
The vocoder upsamples in two stages (kernels twice the rate plus at most one, as the real
model's six: 5, 3, 2, 2, 2, 2) from 8 channels, so its widest stage is 2 channels x 60 samples
a frame: the vocoder is most of a code2wav program, which the tests compile by the dozen (this
one compiles in about a third less time than four stages from 32 channels, the same widest)."""


def randomize_weights(module: Any, scale: float, vector_std: float = 0.3) -> None:
    """Weights ~ scale / sqrt(fan_in), vectors (biases, norms, activations) ~ ``vector_std``.

    Far from HF's near-zero init, so a parity test compares signals rather than noise, yet
    activations stay bounded. Uses torch's global RNG.
    """
    import torch

    with torch.no_grad():
        for p in module.parameters():
            std = scale * p[0].numel() ** -0.5 if p.ndim > 1 else vector_std
            p.copy_(torch.randn(p.shape) * std)


OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-Omni's chat layout: a default system turn, and one placeholder per media item
between its modality's start and end tokens (content items ``{"type": "audio" | "image" |
"video" | "text", ...}``), which the processor expands."""


def write_omni_processor_files(
    path: str | Path, processor_class: str = "Qwen2_5OmniProcessor", **image_settings: Any
) -> None:
    """``preprocessor_config.json`` as the hub ships it for Qwen2.5-Omni: one file holding the
    ``WhisperFeatureExtractor`` and ``Qwen2VLImageProcessor`` settings (each class reads its own
    keys), with a 30 s audio window instead of the hub's 300 s to keep tests fast.

    Qwen3-Omni ships the same file for its own ``processor_class``, with ``image_settings``
    (``Qwen2VLImageProcessor`` arguments: its 16-pixel patches, pixel bounds and normalisation)
    replacing Qwen2.5-Omni's."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    audio = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, chunk_length=30, return_attention_mask=True
    )
    image = Qwen2VLImageProcessorPil(
        **{"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384, **image_settings}
    )
    merged = {**audio.to_dict(), **image.to_dict(), "processor_class": processor_class}
    merged.pop("mel_filters", None)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True))


def tiny_qwen2_5_omni_config(tokenizer: Any, **overrides: Any) -> Any:
    """A ``Qwen2_5OmniConfig`` with every sub-model shrunk; token ids point into ``tokenizer``.

    The thinker's audio encoder keeps 128 mel bins and the vision encoder a 14-pixel patch, so
    the real feature extractor and image processor produce inputs it accepts.
    """
    from transformers import Qwen2_5OmniConfig

    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in OMNI_NAMED_TOKENS.items()}
    tts = {k: tokenizer.convert_tokens_to_ids(v) for k, v in OMNI_TTS_TOKENS.items()}
    modality = dict(
        audio_token_index=ids["audio_token"],
        image_token_index=ids["image_token"],
        video_token_index=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    decoder = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=rope,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # peaky logits: greedy parity is not decided by float noise
    )
    thinker = dict(
        text_config=dict(decoder, vocab_size=len(tokenizer), tie_word_embeddings=False),
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
            max_source_positions=1500,
            n_window=100,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=112,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        user_token_id=tokenizer("user")["input_ids"][0],
        initializer_range=0.2,
        vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"],
        **modality,
    )
    talker = dict(
        decoder,
        vocab_size=80,
        embedding_size=64,
        head_dim=16,
        vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"],
        **modality,
        **tts,
        **OMNI_CODEC,
    )
    token2wav = dict(dit_config=dict(TINY_DIT_CONFIG), bigvgan_config=dict(TINY_BIGVGAN_CONFIG))
    kw: dict[str, Any] = dict(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )
    kw.update(overrides)
    return Qwen2_5OmniConfig(**kw)


# How speak_like_trained biases the tiny talker's codec head (see there).
TALKER_CONSTANT_CHANNEL = 0
TALKER_UNSPEAKABLE_WEIGHT = -200.0
TALKER_EOS_WEIGHT = 3.0


def speak_like_trained(talker: Any, num_embeds: int) -> None:
    """Make a random-weight HF talker emit only codes the DiT can embed, and stop.

    A trained talker emits codes below the DiT's ``num_embeds`` and then codec EOS (or pad),
    never its other specials. With random weights every id is likely, so the codes would crash
    the DiT's embedding, and greedy decoding may never stop. The codec head has no bias, so
    one is built from a constant residual channel, as trained networks build theirs: channel
    :data:`TALKER_CONSTANT_CHANNEL` of the projected input is its bias alone (its projection
    row is zeroed, its bias 1), no layer writes to it (:func:`keep_channel`) and the final norm
    keeps it positive. The codec head then reads that channel only for the specials: strongly
    negative for ids at or past ``num_embeds`` other than EOS and pad (logits about -20 to -60),
    slightly positive for EOS, so greedy decoding typically stops within a few dozen codes.
    Deterministic (no random draws), so the other sub-models' weights are what the seed gives
    either way.
    """
    import torch

    cfg, d = talker.config, TALKER_CONSTANT_CHANNEL
    eos, pad = cfg.tts_codec_end_token_id, cfg.tts_codec_pad_token_id
    with torch.no_grad():
        talker.thinker_to_talker_proj.weight[d] = 0.0
        talker.thinker_to_talker_proj.bias[d] = 1.0
        keep_channel(talker.model.layers, d)
        talker.model.norm.weight[d] = 1.0
        head = talker.codec_head.weight
        head[:, d] = 0.0
        for i in range(num_embeds, head.shape[0]):
            if i not in (eos, pad):
                head[i] = 0.0
                head[i, d] = TALKER_UNSPEAKABLE_WEIGHT
        head[eos, d] = TALKER_EOS_WEIGHT


THINKER_EOS_SCALE = 3.0
"""With random weights a greedy thinker rarely picks ``<|im_end|>`` (none of six chat prompts did
within 40 tokens at seed 0); with its LM-head row tripled, replies end after 2 to 24 tokens, so
end-to-end tests and the demo see the thinker stop on its EOS as a trained one does."""


@own_fields_unflagged()  # the config it builds is the release's, which transformers warns about
def build_tiny_qwen2_5_omni(path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random-weight ``Qwen2_5OmniForConditionalGeneration`` checkpoint to ``path``.

    Alongside the safetensors weights: the tokenizer (with the Omni placeholders, TTS tokens,
    one BOS token per speaker and :data:`OMNI_CHAT_TEMPLATE`), the processor's
    ``preprocessor_config.json``, ``generation_config.json`` and ``spk_dict.pt`` in the hub's
    format: ``{speaker: {"cond": [1, enc_emb_dim], "ref_mel": [1, frames, mel_dim],
    "bos_token": int}}`` with speakers :data:`OMNI_SPEAKERS`. Deterministic in ``seed``.
    The token2wav weights are re-drawn at a scale where the waveform follows the codes, the
    talker is biased to emit only codes the DiT can embed, then EOS (:func:`speak_like_trained`),
    and the thinker's EOS logit row is scaled by :data:`THINKER_EOS_SCALE`.
    ``config_overrides`` replace whole sub-configs of :func:`tiny_qwen2_5_omni_config` (e.g. a
    ``token2wav_config`` with the real model's widths, for benchmarks).
    """
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    path = Path(path)
    speaker_tokens = {name: f"<|spk_{name.lower()}|>" for name in OMNI_SPEAKERS}
    tokenizer = build_tokenizer(
        vocab_size=448,
        seed=seed,
        extra_special=["<|vision_pad|>", *OMNI_TTS_TOKENS.values(), *speaker_tokens.values()],
        named_special=OMNI_NAMED_TOKENS,
    )
    cfg = tiny_qwen2_5_omni_config(tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(cfg).float().eval()
    randomize_weights(model.token2wav.code2wav_dit_model, 1.0)
    # The vocoder sees a compressed (normalised dB) mel: at this scale its output follows the mel
    # rather than its biases, yet stays inside the [-1, 1] clamp.
    randomize_weights(model.token2wav.code2wav_bigvgan_model, 0.7, vector_std=0.02)
    speak_like_trained(model.talker, cfg.token2wav_config.dit_config.num_embeds)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # a greedy reply ends within a few dozen tokens, as a trained one does
        model.thinker.lm_head.weight[eos] *= THINKER_EOS_SCALE
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE
    save_checkpoint(path, model, tokenizer)
    write_omni_processor_files(path)
    dit = cfg.token2wav_config.dit_config
    speakers = {}
    for i, (name, token) in enumerate(speaker_tokens.items()):
        speakers[name] = {
            "cond": torch.randn(1, dit.enc_emb_dim),
            "ref_mel": torch.randn(1, 23 + 14 * i, dit.mel_dim) - 2.0,  # log-mel-like, lengths differ
            "bos_token": tokenizer.convert_tokens_to_ids(token),
        }
    torch.save(speakers, path / "spk_dict.pt")
    return path


class _NoVideoProcessor:
    """The video slot of a reference processor assembled without a video processor: transformers
    5.17's composites read ``video_processor.merge_size`` for every prompt, video or not (5.24's
    only for a prompt with video); a prompt with video is refused."""

    def __init__(self, merge_size: int) -> None:
        self.merge_size = merge_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("this reference processor has no video processor: pass one for prompts with video")


def reference_omni_processor(
    path: str | Path,
    video_processor: Any = None,
    image_processor: Any = None,
    processor_class: type | None = None,
) -> Any:
    """transformers' ``Qwen2_5OmniProcessor`` from a checkpoint's own parts, for references.

    With torchvision installed and no part given, that is ``AutoProcessor``'s own instance.
    Without, its constructor cannot look up the video processor class, so the instance is
    assembled as the constructor would assemble it, with ``video_processor`` in that slot
    (``None``: prompts without video; a stand-in that refuses video sits there) and
    ``image_processor`` (default: ``AutoImageProcessor``'s; without torchvision, the PIL class
    transformers 5.24's picks then, named directly, as 5.17's ``AutoImageProcessor`` refuses to
    load at all without torchvision); ``__call__`` is transformers' code either way. Tests and
    the e2e benchmark prepare the reference's inputs with it. ``processor_class`` (default
    ``Qwen2_5OmniProcessor``) assembles another composite whose constructor sets the same
    attributes: ``Qwen3OmniMoeProcessor``.
    """
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() and video_processor is None and image_processor is None:
        return AutoProcessor.from_pretrained(path)
    processor_class = processor_class or Qwen2_5OmniProcessor
    proc = processor_class.__new__(processor_class)
    tokenizer = AutoTokenizer.from_pretrained(path)
    proc.tokenizer = tokenizer
    proc.feature_extractor = AutoFeatureExtractor.from_pretrained(path)
    if image_processor is None and is_torchvision_available():
        image_processor = AutoImageProcessor.from_pretrained(path)
    elif image_processor is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    proc.image_processor = image_processor
    proc.video_processor = (
        _NoVideoProcessor(image_processor.merge_size) if video_processor is None else video_processor
    )
    proc.chat_template = tokenizer.chat_template
    for name in ("image", "audio", "video"):
        setattr(proc, f"{name}_token", getattr(tokenizer, f"{name}_token"))
        setattr(proc, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
    for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
        setattr(proc, f"{name}_token", getattr(tokenizer, f"{name}_token"))
    return proc
