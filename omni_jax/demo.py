"""``omni-jax demo``: a tiny omni model built here, converted, and run end to end.

Nothing can be downloaded, so the demo builds a random-weight checkpoint of the model ``--model``
names (:data:`DEMO_MODELS`: Qwen2.5-Omni, the default, with
:func:`omni_jax.testing.build_tiny_qwen2_5_omni`; Qwen3-Omni with
:func:`omni_jax.testing_qwen3_omni.build_tiny_qwen3_omni`) with its tokenizer, processor files and
voices, cached under ``cache_dir`` keyed by the builder's source so a changed recipe is rebuilt,
converts it with the same converter users run, and sends a text + image + audio chat prompt
through the thinker, the talker and code2wav, next to a text-only prompt in another voice. It
writes each reply's text and waveform and says where. Random weights: the text and the sound
are noise; the path they take is the one a real checkpoint takes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.cli_errors import make_output_folder


def _build_qwen2_5_omni(path: Path) -> None:
    from omni_jax.testing import build_tiny_qwen2_5_omni

    build_tiny_qwen2_5_omni(path, seed=0)


def _build_qwen3_omni(path: Path) -> None:
    from omni_jax.testing_qwen3_omni import build_tiny_qwen3_omni

    build_tiny_qwen3_omni(path, seed=0)


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """A model the demo builds: ``title`` for messages, ``slug`` for its cache directories, the
    modules whose source is its recipe (a change to any of them rebuilds it), its builder, and
    the request sent with the picture and the sound: one that its random thinker, sampled with
    the demo's seed, answers with several tokens, so that the reply is voiced (most requests get
    one or two tokens from one tiny model or the other)."""

    title: str
    slug: str
    recipe_modules: tuple[str, ...]
    build: Callable[[Path], None]
    media_request: str


DEMO_MODELS = {
    "qwen2.5-omni": DemoModel(
        "Qwen2.5-Omni",
        "qwen2_5_omni",
        ("omni_jax.testing",),
        _build_qwen2_5_omni,
        media_request="describe the picture and the sound",
    ),
    "qwen3-omni": DemoModel(
        "Qwen3-Omni",
        "qwen3_omni",
        ("omni_jax.testing", "omni_jax.testing_qwen3_omni"),  # the Qwen3 builder uses testing's helpers
        _build_qwen3_omni,
        media_request="what is this?",
    ),
}
"""``omni-jax demo --model NAME``'s choices; the first is the default."""


def tiny_omni_checkpoint(cache_dir: Path, model: DemoModel = DEMO_MODELS["qwen2.5-omni"]) -> Path:
    """``model``'s converted tiny checkpoint, built and converted once per builder version."""
    from omni_jax.weights import convert

    sources = b"".join(Path(importlib.import_module(m).__file__).read_bytes() for m in model.recipe_modules)
    recipe = hashlib.sha256(sources).hexdigest()[:12]
    hf_dir = cache_dir / f"tiny-{model.slug}-{recipe}-hf"
    converted = cache_dir / f"tiny-{model.slug}-{recipe}-omnijax"
    if not (hf_dir / "config.json").exists():
        print(f"building a tiny random-weight {model.title} checkpoint in {hf_dir}")
        partial = hf_dir.with_name(hf_dir.name + ".partial")  # an interrupted build is never reused
        shutil.rmtree(partial, ignore_errors=True)
        model.build(partial)
        partial.rename(hf_dir)
    if not (converted / "config.json").exists():
        print(f"converting it to {converted}")
        shutil.rmtree(converted, ignore_errors=True)
        convert(hf_dir, converted)
    return converted


def demo_prompts(pipe: Any, media_request: str) -> list[dict[str, Any]]:
    """A one-second tone and a small picture with ``media_request``, and a text-only prompt."""
    seconds = np.arange(16_000) / 16_000
    tone = (0.3 * np.sin(2 * np.pi * 440 * seconds)).astype(np.float32)
    image = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    media = [
        {"type": "audio", "audio": tone},
        {"type": "image", "image": image},
        {"type": "text", "text": media_request},
    ]
    spoken = pipe.chat_prompt([{"role": "user", "content": media}])
    text = pipe.chat_prompt([{"role": "user", "content": "tell me a story about a cat"}])
    return [dict(spoken, speaker="Chelsie"), dict(text, speaker="Ethan")]


def run_demo(cache_dir: Path, output_dir: Path, model: str = "qwen2.5-omni") -> int:
    """Build (once) and run ``model`` (a :data:`DEMO_MODELS` key) on :func:`demo_prompts`, writing
    ``demo_<i>.txt``, ``demo_<i>.wav`` and the report ``demo.txt`` under ``output_dir`` (checked
    by :func:`~omni_jax.cli_errors.output_folder`, and made only once the requests have run, so
    that a failed build leaves no folder behind); 1 when a request failed."""
    from omni_jax import OmniJaxPipeline

    demo_model = DEMO_MODELS[model]
    pipe = OmniJaxPipeline.from_pretrained(tiny_omni_checkpoint(cache_dir, demo_model), max_model_len=512)
    prompts = demo_prompts(pipe, demo_model.media_request)
    # Each stage's YAML defaults (the talker samples), seeded so that every run says the same.
    params = [[dataclasses.replace(s.defaults, seed=i) for i in range(len(prompts))] for s in pipe.stages]
    t0 = time.perf_counter()
    outs = pipe.run(prompts, params)
    dt = time.perf_counter() - t0
    make_output_folder("--output-dir", output_dir)
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
        f"{len(outs)} requests through {demo_model.title}'s thinker, talker and code2wav in {dt:.1f} s, "
        "compiling included"
    )
    lines.append("(random weights: the text and the audio are noise; the path is a real checkpoint's)")
    print("\n".join(lines))
    (output_dir / "demo.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {output_dir / 'demo.txt'}")
    return 1 if failed else 0
