"""The tiny Qwen3-Omni checkpoint of ``omni_jax.testing_qwen3_omni`` runs in transformers end to end.

Built once per module in a temporary directory; transformers loads it with every weight
accounted for, its processor expands a text + audio + image chat, and
``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` (greedy thinker) answers with
text that ends and speech in distinct voices. About 11 s on two shared CPU cores (15 s with the
interpreter start), 5 s of it imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omni_reference import spoken
from PIL import Image
from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor
from transformers.utils import is_torchvision_available

from omni_jax.testing import reference_omni_processor
from omni_jax.testing_qwen3_omni import (
    CODEBOOK_SIZE,
    NUM_CODE_GROUPS,
    QWEN3_OMNI_SPEAKERS,
    build_tiny_qwen3_omni,
    give_talker_audio_config,
    thinker_part,
)

CHAT = [
    {
        "role": "user",
        "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "what is this"}],
    }
]
AUDIO_SECONDS = 2.5  # 250 mel frames: three of the encoder's 100-frame chunks, two attention windows
IMAGE_SIZE = (64, 96)  # 2 x 3 merged tokens of 32 pixels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni") / "hf", seed=0)


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> tuple[Qwen3OmniMoeForConditionalGeneration, dict[str, Any]]:
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, output_loading_info=True
    )
    return give_talker_audio_config(model.eval()), info


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Qwen3OmniMoeProcessor:
    """``Qwen3OmniMoeProcessor.from_pretrained`` where torchvision is installed (its video
    processor needs it); without, the same class assembled from the checkpoint's own parts."""
    if is_torchvision_available():
        return Qwen3OmniMoeProcessor.from_pretrained(checkpoint)
    return reference_omni_processor(checkpoint, processor_class=Qwen3OmniMoeProcessor)


@pytest.fixture(scope="module")
def inputs(processor: Qwen3OmniMoeProcessor) -> Any:
    rng = np.random.default_rng(0)
    audio = 0.1 * rng.standard_normal(int(16000 * AUDIO_SECONDS)).astype(np.float32)
    image = Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8))
    text = processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], audio=[audio], images=[image], return_tensors="pt")


def speak(
    model: Qwen3OmniMoeForConditionalGeneration, inputs: Any, speaker: str, greedy: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reply ids, codec frames [groups, frames], waveform)`` of ``generate(return_audio=True)``;
    the frames are what the model hands code2wav."""
    return spoken(
        model,
        inputs,
        speaker=speaker,
        thinker_eos_token_id=model.config.im_end_token_id,  # its default is the release's id
        thinker_max_new_tokens=40,
        talker_do_sample=not greedy,
        talker_max_new_tokens=100,
    )


def test_loads_sharded_with_every_weight(checkpoint: Path, loaded: tuple[Any, dict[str, Any]]) -> None:
    _, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    shards = set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) >= 2
    assert {p.name for p in checkpoint.glob("*.safetensors")} == shards


def test_processor_expands_audio_and_image(inputs: Any, loaded: tuple[Any, dict[str, Any]]) -> None:
    cfg = loaded[0].config.thinker_config
    ids = inputs["input_ids"][0]
    grid = inputs["image_grid_thw"][0].tolist()
    assert grid == [1, IMAGE_SIZE[0] // 16, IMAGE_SIZE[1] // 16]
    assert int((ids == cfg.image_token_id).sum()) == grid[1] * grid[2] // 4
    # 250 frames: two full 100-frame chunks (13 tokens each) and a 50-frame tail (7 tokens).
    assert int((ids == cfg.audio_token_id).sum()) == 2 * 13 + 7
    assert inputs["input_features"].shape[1] == cfg.audio_config.num_mel_bins


def test_generate_speaks_in_distinct_voices(loaded: tuple[Any, dict[str, Any]], inputs: Any) -> None:
    """Greedy text that ends on ``<|im_end|>``; one codec frame per reply token before it, codes in
    the codebook and varied; a waveform per voice inside [-1, 1]; the voices differ."""
    model = loaded[0]
    spoken = {name: speak(model, inputs, name) for name in ("Ethan", "Chelsie")}
    (reply, frames, wav), (other_reply, other_frames, other_wav) = spoken.values()
    assert torch.equal(reply, other_reply)  # the voice is the talker's alone
    assert 2 <= len(reply) and reply[-1] == model.config.im_end_token_id
    for codes, w in ((frames, wav), (other_frames, other_wav)):
        assert codes.shape == (NUM_CODE_GROUPS, len(reply) - 1)
        assert 0 <= int(codes.min()) and int(codes.max()) < CODEBOOK_SIZE
        assert len(codes[0].unique()) > 1
        assert w.numel() > 0 and bool(torch.isfinite(w).all()) and float(w.abs().max()) < 1.0
        assert float(w.std()) > 0.01
    assert not torch.equal(frames, other_frames)
    assert {"chelsie", "ethan"} <= set(QWEN3_OMNI_SPEAKERS) == set(model.config.talker_config.speaker_id)


def test_sampled_speech_is_deterministic_under_a_seed(
    loaded: tuple[Any, dict[str, Any]], inputs: Any
) -> None:
    """transformers' default talker (top-k 50 sampling) gives the same codes and waveform again
    under the same torch seed."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(speak(loaded[0], inputs, "Ethan", greedy=False))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_moe_routing_is_spread(loaded: tuple[Any, dict[str, Any]], inputs: Any) -> None:
    """Every sparse layer of the thinker (over the prompt) and of the talker (over its steps)
    sends tokens to most of its experts, not to a fixed top-k; the thinker's dense layer has no router."""
    model = loaded[0]
    chosen: dict[str, set[int]] = {}

    def record(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            chosen.setdefault(name, set()).update(output[2].flatten().tolist())

        return hook

    routers = {
        f"{part}.{i}": layer.mlp.gate
        for part, layers in (
            ("thinker", thinker_part(model.thinker, "language_model").layers),
            ("talker", model.talker.model.layers),
        )
        for i, layer in enumerate(layers)
        if hasattr(layer.mlp, "experts")
    }
    assert sorted(routers) == ["talker.0", "talker.1", "thinker.0", "thinker.2"]
    handles = [router.register_forward_hook(record(name)) for name, router in routers.items()]
    try:
        speak(model, inputs, "Ethan")
    finally:
        for handle in handles:
            handle.remove()
    for name, router in routers.items():
        assert len(chosen[name]) > router.num_experts // 2, (name, chosen[name])
