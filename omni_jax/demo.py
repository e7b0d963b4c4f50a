"""``omni-jax demo``: build a tiny checkpoint locally, convert it, run it, say where output went.

Until the three-stage Qwen2.5-Omni pipeline lands, the demo runs a tiny Qwen2 LM end to
end through the same path a real checkpoint takes (HF dir -> converter -> pipeline).
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
    (output_dir / "demo.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {dt:.2f}s (random weights: the text is noise)")
    print(f"wrote {output_dir / 'demo.txt'}")
    return 0
