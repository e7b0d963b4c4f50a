"""``python -m benchmarks.encoder_buckets [--model tiny|PATH] [--cache-dir D]``: the thinker
encoders' program set, what it takes to compile, and what its padding costs.

Measured on the checkpoint (``tiny``: built locally, :mod:`benchmarks.models`): the encoder
programs ``ThinkerFrontend.warmup()`` compiles (each audio chunk count and vision token count of
its ``EncoderBuckets``) with their compile seconds, then a mix of media encoded after it (images
of several sizes, a video, clips up to 30 s, all in one step; those longer than the stage's
``max_model_len`` left out, as the stage refuses them), whose compilations must be none.

Counted, not measured: the FLOPs each vision ladder (powers of two, and the two sizes a doubling
in use) spends beyond the reference's exact segment cost, at Qwen2.5-Omni-7B's vision sizes
(hidden 1280, 32 layers of which 4 full-attention, MLP 3420, 112-pixel windows of 14-pixel
patches, merge 2), for a 448x448 image, a 1280x720 image, a 16-frame 448x448 video and a set of
common photo sizes, each alone in a step. The reference's cost is its own: every token's
projections and MLP, each window's and each frame's attention scores exactly.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.cli_errors import plain_text

REAL_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    out_hidden_size=3584,
    fullatt_block_indexes=(7, 15, 23, 31),
)
"""Qwen2.5-Omni-7B's vision encoder (its ``config.json``)."""

REAL_MAX_PIXELS = 12845056
"""Qwen2.5-Omni-7B's ``preprocessor_config.json`` ``max_pixels`` (28 * 28 * 16384)."""

PHOTOS = ((224, 224), (336, 336), (512, 512), (640, 480), (800, 600), (1024, 768), (1280, 720))
PHOTOS += ((1920, 1080), (1080, 1920), (2048, 1536), (4032, 3024))
"""(width, height) of the common sizes whose padding is averaged."""


def reference_flops(spec: Any, grids: list[tuple[int, int, int]]) -> int:
    """The reference's cost: per token what :meth:`VisionEncoderSpec.token_flops` counts, then
    each window's (window layers) and each frame's (full-attention layers) scores exactly."""
    from omni_jax.models.qwen2_5_omni.vision_encoder import _frame_windows

    full = len(spec.fullatt_block_indexes)
    tokens = sum(t * h * w for t, h, w in grids)
    windows = sum(t * sum(len(x) ** 2 for x in _frame_windows(h, w, spec)) for t, h, w in grids)
    frames = sum(t * (h * w) ** 2 for t, h, w in grids)
    return tokens * spec.token_flops() + 4 * spec.hidden_size * (
        (spec.depth - full) * windows + full * frames
    )


def padding_table() -> list[str]:
    """The FLOPs each vision ladder adds over the reference, per case, at Qwen2.5-Omni-7B sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from omni_jax.models.qwen2_5_omni.encoder_calls import size_ladder
    from omni_jax.models.qwen2_5_omni.processor import VIDEO_SIZE
    from omni_jax.models.qwen2_5_omni.vision_encoder import VisionEncoderSpec, plan_vision_calls

    spec = VisionEncoderSpec(**REAL_VISION)
    largest = max(REAL_MAX_PIXELS, VIDEO_SIZE["longest_edge"]) // spec.patch_size**2

    def image(w: int, h: int) -> list[tuple[int, int, int]]:
        rh, rw = smart_resize(h, w, 28, 56 * 56, REAL_MAX_PIXELS)
        return [(1, rh // 14, rw // 14)]

    vh, vw = smart_resize(448, 448, 28, VIDEO_SIZE["shortest_edge"], VIDEO_SIZE["longest_edge"])
    cases = {
        "448x448 image": image(448, 448),
        "1280x720 image": image(1280, 720),
        "16-frame 448x448 video": [(8, vh // 14, vw // 14)],
    }
    lines = []
    for per_octave in (1, 2):
        ladder = size_ladder(spec.band_tile, largest, per_octave)
        lines.append(
            f"ladder {per_octave} size(s) a doubling: {len(ladder)} programs, {ladder[0]}..{ladder[-1]}"
        )

        def extra(
            grids: list[tuple[int, int, int]], ladder: tuple[int, ...] = ladder
        ) -> tuple[float, list[int]]:
            calls = plan_vision_calls(grids, spec, ladder)
            ours = sum(spec.call_flops(c.tokens) for c in calls)
            return ours / reference_flops(spec, grids) - 1, [c.tokens for c in calls]

        for name, grids in cases.items():
            ref = reference_flops(spec, grids)
            share, sizes = extra(grids)
            lines.append(
                f"  {name}: {sum(t * h * w for t, h, w in grids)} patches in calls of {sizes}: reference "
                f"{ref / 1e12:.3f} TFLOP, ours +{100 * share:.1f}%"
            )
        photos = [extra(image(w, h))[0] for w, h in PHOTOS]
        lines.append(
            "  photos alone: "
            + ", ".join(f"{w}x{h} +{100 * e:.0f}%" for (w, h), e in zip(PHOTOS, photos, strict=True))
            + f"; mean +{100 * np.mean(photos):.0f}%"
        )
    return lines


def measured(path: Path) -> list[str]:
    """Compile every encoder program of the checkpoint's thinker, then encode a mixed step."""
    from omni_jax import OmniJaxPipeline
    from omni_jax.engine.compilation import CompileCounter
    from omni_jax.stages.base import StageInput

    pipe = OmniJaxPipeline.from_pretrained(path, stages=["thinker"], max_num_seqs=4)
    frontend = pipe.stages[0].frontend
    buckets = frontend.step_inputs.buckets
    lines = [f"buckets: audio chunks {buckets.audio_chunks}, vision tokens {buckets.vision_tokens}"]
    with CompileCounter() as warm:
        start = time.perf_counter()
        total = frontend.warmup()
        seconds = time.perf_counter() - start
    lines.append(
        f"warmup(): {total} programs ({len(buckets.audio_chunks)} audio, "
        f"{len(buckets.vision_tokens)} vision), {warm.compiles} compilations in {seconds:.1f} s"
    )

    rng = np.random.default_rng(0)

    def item(kind: str, value: Any) -> dict[str, Any]:
        return {"type": kind, kind: value}

    def picture(h: int, w: int) -> np.ndarray:
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

    def tone(seconds: float) -> np.ndarray:
        return (0.3 * np.sin(np.arange(int(seconds * 16_000)) * 2 * np.pi * 330 / 16_000)).astype(np.float32)

    media = [
        [item("image", picture(28, 28))],
        [item("image", picture(300, 90)), item("image", picture(90, 500))],
        [item("image", picture(720, 1280))],
        [item("video", rng.integers(0, 256, (16, 448, 448, 3), dtype=np.uint8))],
        [item("audio", tone(0.7))],
        [item("audio", tone(12.0))],
        [item("audio", tone(29.9))],
    ]
    requests, refused = [], []
    for i, items in enumerate(media):
        prompt = pipe.chat_prompt([{"role": "user", "content": [*items, {"type": "text", "text": "x"}]}])
        ids = list(pipe.tokenizer(prompt["prompt"])["input_ids"])
        try:
            prepared = frontend.prepare(i, StageInput(ids, prompt))
        except ValueError as e:  # refused before its frames are resized: no context holds them
            refused.append(f"request {i} ({str(e).removeprefix(f'request {i}: ')})")
            continue
        if len(prepared.token_ids) < pipe.stages[0].max_model_len:
            requests.append(prepared.state)
        else:  # the stage refuses it at validation; its frames may exceed the vision calls
            refused.append(f"request {i} ({len(prepared.token_ids)} tokens)")
    if refused:
        lines.append(
            f"longer than max_model_len {pipe.stages[0].max_model_len}, not encoded: {', '.join(refused)}"
        )
    with CompileCounter() as counter:
        start = time.perf_counter()
        frontend.step_inputs.encode(requests)
        elapsed = time.perf_counter() - start
    lines.append(
        f"a step of {len(requests)} media requests encoded in {elapsed:.2f} s: "
        f"{counter.traces} traces, {counter.compiles} compilations"
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.encoder_buckets", description=plain_text(__doc__.split("\n\n")[0])
    )
    p.add_argument("--model", default="tiny", help="tiny, or a Qwen2.5-Omni checkpoint directory")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    args = p.parse_args()
    os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")  # compile seconds are real only uncached
    from benchmarks.models import resolve_model

    path = resolve_model(args.model, Path(args.cache_dir), "qwen2_5_omni")
    print(f"== measured on {args.model}")
    print("\n".join(measured(path)))
    print("== padding at Qwen2.5-Omni-7B vision sizes (counted)")
    print("\n".join(padding_table()))


if __name__ == "__main__":
    main()
