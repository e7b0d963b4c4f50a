"""``omni-jax demo``: a tiny Qwen2.5-Omni built here, converted, and run end to end.

Nothing can be downloaded, so the demo builds a random-weight Qwen2.5-Omni checkpoint with its
tokenizer, processor files and voices (:func:`omni_jax.testing.build_tiny_qwen2_5_omni`), cached
under ``cache_dir`` keyed by the builder's source so a changed recipe is rebuilt, converts it
with the same converter users run, and sends a text + image + audio chat prompt through the
thinker, the talker and code2wav, next to a text-only prompt in another voice. It writes each
reply's text and waveform and says where. Random weights: the text and the sound are noise;
the path they take is the one a real checkpoint takes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np


def tiny_omni_checkpoint(cache_dir: Path) -> Path:
    """The converted tiny checkpoint, built and converted once per builder version."""
    from omni_jax import testing
    from omni_jax.models.hf_config import thinker_ids_unflagged
    from omni_jax.weights import convert

    recipe = hashlib.sha256(Path(testing.__file__).read_bytes()).hexdigest()[:12]
    hf_dir = cache_dir / f"tiny-qwen2_5_omni-{recipe}-hf"
    converted = cache_dir / f"tiny-qwen2_5_omni-{recipe}-omnijax"
    if not (hf_dir / "config.json").exists():
        print(f"building a tiny random-weight Qwen2.5-Omni checkpoint in {hf_dir}")
        partial = hf_dir.with_name(hf_dir.name + ".partial")  # an interrupted build is never reused
        shutil.rmtree(partial, ignore_errors=True)
        with thinker_ids_unflagged():  # the builder makes the config, which transformers checks
            testing.build_tiny_qwen2_5_omni(partial, seed=0)
        partial.rename(hf_dir)
    if not (converted / "config.json").exists():
        print(f"converting it to {converted}")
        shutil.rmtree(converted, ignore_errors=True)
        convert(hf_dir, converted)
    return converted


def demo_prompts(pipe: Any) -> list[dict[str, Any]]:
    """A one-second tone and a small picture with a request, and a text-only prompt (the tiny
    model's random thinker answers both with several tokens, so both are voiced)."""
    seconds = np.arange(16_000) / 16_000
    tone = (0.3 * np.sin(2 * np.pi * 440 * seconds)).astype(np.float32)
    image = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    media = [
        {"type": "audio", "audio": tone},
        {"type": "image", "image": image},
        {"type": "text", "text": "describe the picture and the sound"},
    ]
    spoken = pipe.chat_prompt([{"role": "user", "content": media}])
    text = pipe.chat_prompt([{"role": "user", "content": "tell me a story about a cat"}])
    return [dict(spoken, speaker="Chelsie"), dict(text, speaker="Ethan")]


def run_demo(cache_dir: Path, output_dir: Path) -> int:
    from omni_jax import OmniJaxPipeline

    pipe = OmniJaxPipeline.from_pretrained(tiny_omni_checkpoint(cache_dir), max_model_len=512)
    prompts = demo_prompts(pipe)
    # Each stage's YAML defaults (the talker samples), seeded so that every run says the same.
    params = [[dataclasses.replace(s.defaults, seed=i) for i in range(len(prompts))] for s in pipe.stages]
    t0 = time.perf_counter()
    outs = pipe.run(prompts, params)
    dt = time.perf_counter() - t0
    output_dir.mkdir(parents=True, exist_ok=True)
    lines, failed = [], 0
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        kinds = "+".join(["text", *prompt.get("multi_modal_data", {})])
        if out.error is not None:
            failed += 1
            lines.append(f"request {i} ({kinds}): error: {out.error}")
            continue
        text_file = output_dir / f"demo_{i}.txt"
        text_file.write_text((out.text or "") + "\n")
        wav = out.save_wav(output_dir / f"demo_{i}.wav")
        codes = len(out.stage_outputs["code2wav"].token_ids)
        lines.append(
            f"request {i} ({kinds}, voice {prompt['speaker']}): {len(out.prompt_token_ids)} prompt tokens -> "
            f"{len(out.token_ids)} text tokens ({out.finish_reason}) -> {codes} codec tokens -> "
            f"{len(out.audio) / out.sample_rate:.2f} s of audio; wrote {text_file} and {wav}"
        )
        lines.append(f"  text: {out.text!r}")
    lines.append(
        f"{len(outs)} requests through thinker, talker and code2wav in {dt:.1f} s, compiling included"
    )
    lines.append("(random weights: the text and the audio are noise; the path is a real checkpoint's)")
    print("\n".join(lines))
    (output_dir / "demo.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {output_dir / 'demo.txt'}")
    return 1 if failed else 0
