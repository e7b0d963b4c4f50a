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


def build_tokenizer(vocab_size: int = 384, seed: int = 0, extra_special: list[str] | None = None) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Qwen-style chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + list(extra_special or [])
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
    from transformers import GenerationConfig, Qwen2ForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(seed=seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = config_overrides.pop("vocab_size", len(tokenizer))
    cfg = tiny_qwen2_config(vocab, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    tokenizer.save_pretrained(path)
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())
