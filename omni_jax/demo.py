"""``omni-jax demo``: build tiny checkpoints locally, convert them, run them, say where output went.

Until the three-stage Qwen2.5-Omni pipeline lands, the demo runs a tiny Qwen2 LM end to end
through the same path a real checkpoint takes (HF dir -> converter -> pipeline), then a tiny
Qwen2.5-Omni thinker on a multimodal chat prompt (a tone, an image and a short video, made
here) through the checkpoint's own processor files.
"""

from __future__ import annotations

import time
from pathlib import Path

PROMPTS = ["hello world the model", "one two three four", "the cat and the dog"]


def run_demo(cache_dir: Path, output_dir: Path) -> int:
    from omni_jax import OmniJaxPipeline, SamplingParams
    from omni_jax.testing import build_tiny_qwen2
    from omni_jax.weights import convert

    hf_dir, converted = cache_dir / "tiny-qwen2-hf", cache_dir / "tiny-qwen2-omnijax"
    if not (hf_dir / "config.json").exists():
        print(f"building a tiny random-weight Qwen2 checkpoint in {hf_dir}")
        build_tiny_qwen2(hf_dir, seed=0)
    if not converted.exists():
        convert(hf_dir, converted)
    pipe = OmniJaxPipeline.from_pretrained(converted)
    t0 = time.perf_counter()
    outs = pipe.run(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_tokens=24))
    dt = time.perf_counter() - t0
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        lines.append(f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
    print("\n".join(lines))
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {dt:.2f}s (random weights: the text is noise)")
    lines += run_thinker_demo(cache_dir)
    (output_dir / "demo.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {output_dir / 'demo.txt'}")
    return 0


def run_thinker_demo(cache_dir: Path) -> list[str]:
    """A tiny Qwen2.5-Omni thinker on an audio, an image and a video prompt; returns report lines."""
    import numpy as np

    from omni_jax import OmniJaxPipeline, SamplingParams
    from omni_jax.testing import build_tiny_qwen2_5_omni

    omni_dir = cache_dir / "tiny-qwen2_5_omni-hf"
    if not (omni_dir / "preprocessor_config.json").exists():
        print(f"building a tiny random-weight Qwen2.5-Omni checkpoint in {omni_dir}")
        build_tiny_qwen2_5_omni(omni_dir, seed=0)
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_model_len=512)
    rng = np.random.default_rng(0)
    seconds = np.arange(16_000) / 16_000
    items = {
        "audio": {"type": "audio", "audio": (0.3 * np.sin(2 * np.pi * 440 * seconds)).astype(np.float32)},
        "image": {"type": "image", "image": rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)},
        "video": {"type": "video", "video": rng.integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)},
    }
    prompts = [
        pipe.chat_prompt(
            [{"role": "user", "content": [item, {"type": "text", "text": f"describe the {kind}"}]}]
        )
        for kind, item in items.items()
    ]
    t0 = time.perf_counter()
    outs = pipe.run(prompts, SamplingParams(temperature=0.0, max_tokens=16), progress=False)
    dt = time.perf_counter() - t0
    lines = []
    for kind, out in zip(items, outs, strict=True):
        lines.append(
            f"thinker, {kind} prompt ({len(out.prompt_token_ids)} tokens after expansion) -> {out.text!r} "
            f"({len(out.token_ids)} tokens, {out.finish_reason})"
        )
    print("\n".join(lines))
    print(f"thinker: {len(outs)} multimodal requests in {dt:.2f}s, compilation included")
    return lines
