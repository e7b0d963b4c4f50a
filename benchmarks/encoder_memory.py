"""The memory plan's encoder call against XLA's own count of the whole encoder's program.

The plan counts a thinker's largest encoder call from the whole encoder's program compiled for
the host's CPU in float32 (:func:`omni_jax.stages.encoder_programs.call_bytes`). This compiles
the stage's own program of the whole encoder (:class:`~omni_jax.stages.encoder_programs.EncoderPrograms`,
every layer, in the dtype asked) from shapes at the released checkpoints' widths, and prints
XLA's count of what it holds while it runs (temporaries, inputs and output) beside the plan's.
``tests/test_encoder_memory.py`` holds the plan to XLA's count with it at small widths.

    python -m benchmarks.encoder_memory --model qwen2_5_omni --encoder audio --dtype bfloat16 --layers 32

XLA's CPU scheduler decides part of the answer in bfloat16 (:mod:`omni_jax.cpu_schedule`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.encoder_buckets import REAL_VISION
from omni_jax.cli_errors import plain_text
from omni_jax.cpu_schedule import concurrency_scheduler
from omni_jax.models.qwen2_5_omni import audio_encoder as audio25
from omni_jax.models.qwen2_5_omni import vision_encoder as vision25
from omni_jax.models.qwen3_omni import audio_encoder as audio3
from omni_jax.models.qwen3_omni import vision_encoder as vision3
from omni_jax.stages.encoder_programs import EncoderPrograms, call_bytes, tree_bytes
from omni_jax.stages.qwen3_thinker import Qwen3ThinkerStepInputs
from omni_jax.stages.thinker import SMALLEST_VISION_CALL, ThinkerStepInputs

RELEASED: dict[tuple[str, str], Any] = {
    ("qwen2_5_omni", "audio"): audio25.AudioEncoderSpec(
        num_mel_bins=128,
        d_model=1280,
        num_layers=32,
        num_heads=20,
        ffn_dim=5120,
        n_window=100,
        output_dim=3584,
    ),
    ("qwen2_5_omni", "vision"): vision25.VisionEncoderSpec(**REAL_VISION),
    ("qwen3_omni", "audio"): audio3.AudioEncoderSpec(
        num_mel_bins=128,
        d_model=1280,
        num_layers=32,
        num_heads=20,
        ffn_dim=5120,
        n_window=50,
        n_window_infer=800,
        downsample_hidden_size=480,
        output_dim=2048,
    ),
    ("qwen3_omni", "vision"): vision3.VisionEncoderSpec(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(8, 16, 24),
        approximate_gelu=True,
    ),
}
"""The encoders of Qwen2.5-Omni-7B and Qwen3-Omni-30B-A3B as released (their ``config.json``)."""

EXTRACTOR_FRAMES = 30000
"""Mel frames of the released feature extractors' window (``chunk_length`` 300 s at 100 frames
a second)."""
LARGEST_FRAME = 16384
"""Patches of the largest frame a stage of the default ``max_model_len`` (4096) admits."""

ENCODERS: dict[tuple[str, str], tuple[type[nnx.Module], Any, Any]] = {
    ("qwen2_5_omni", "audio"): (audio25.AudioEncoder, audio25.AudioBatch, None),
    ("qwen2_5_omni", "vision"): (vision25.VisionEncoder, vision25.VisionBatch, ThinkerStepInputs.vision_rows),
    ("qwen3_omni", "audio"): (audio3.AudioEncoder, audio3.AudioBatch, None),
    ("qwen3_omni", "vision"): (
        vision3.VisionEncoder,
        vision3.VisionBatch,
        Qwen3ThinkerStepInputs.vision_rows,
    ),
}


@dataclasses.dataclass(frozen=True)
class CallMemory:
    size: int  # the call's chunks (audio) or patches (vision)
    estimate: int  # call_bytes(...).running, as the stage plans it
    xla: int  # XLA's temporaries, inputs and output of the whole encoder's program

    @property
    def ratio(self) -> float:
        return self.estimate / self.xla


def largest_call(model: str, encoder: str, spec: Any) -> int:
    """The largest call a stage makes with the released processors' bounds."""
    if encoder == "audio":
        return audio25.audio_chunk_buckets(EXTRACTOR_FRAMES, spec)[-1]
    return vision25.vision_token_buckets(spec, LARGEST_FRAME, SMALLEST_VISION_CALL)[-1]


def encoder_memory(
    model: str, encoder: str, dtype: str, layers: int | None = None, size: int | None = None, **widths: Any
) -> CallMemory:
    """Plan and compile a call of ``size`` (default :func:`largest_call`) of ``model``'s
    ``encoder`` as released, with ``layers`` layers (default all; a vision encoder's
    full-attention layers and DeepStack taps kept inside them) and ``widths`` replaced, in
    ``dtype`` on this process's default device."""
    cls, batch, output = ENCODERS[model, encoder]
    spec = dataclasses.replace(RELEASED[model, encoder], **widths)
    if layers is not None:
        spec = with_layers(spec, layers)
    size = size or largest_call(model, encoder, spec)
    module = nnx.eval_shape(lambda: cls(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    shapes = batch.shapes(spec, size)
    compiled = EncoderPrograms(graphdef, output).compile(state, shapes)
    analysis = compiled.memory_analysis()
    xla = analysis.temp_size_in_bytes + tree_bytes(shapes) + analysis.output_size_in_bytes
    estimate = call_bytes(module, batch, size, output, jax.default_backend()).running
    return CallMemory(size, estimate, xla)


def with_layers(spec: Any, layers: int) -> Any:
    """``spec`` with ``layers`` layers, its layer indexes (full attention, DeepStack) that fall
    past them dropped."""
    if hasattr(spec, "num_layers"):
        return dataclasses.replace(spec, num_layers=layers)
    if hasattr(spec, "fullatt_block_indexes"):
        full = tuple(i for i in spec.fullatt_block_indexes if i < layers) or (layers - 1,)
        return dataclasses.replace(spec, depth=layers, fullatt_block_indexes=full)
    taps = tuple(i for i in spec.deepstack_visual_indexes if i < layers) or (layers - 1,)
    return dataclasses.replace(spec, depth=layers, deepstack_visual_indexes=taps)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.encoder_memory", description=plain_text(__doc__.split("\n\n")[0])
    )
    parser.add_argument("--model", choices=("qwen2_5_omni", "qwen3_omni"), default="qwen2_5_omni")
    parser.add_argument("--encoder", choices=("audio", "vision"), default="audio")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="default: the released encoder's")
    args = parser.parse_args()
    m = encoder_memory(args.model, args.encoder, args.dtype, args.layers)
    mib = 1 << 20
    scheduler = ""
    if jax.default_backend() == "cpu":
        scheduler = f", XLA's {'concurrency' if concurrency_scheduler() else 'depth-first'} scheduler"
    unit = "chunks" if args.encoder == "audio" else "patches"
    print(
        f"{args.model} {args.encoder} encoder, {args.layers or 'all'} layers, {args.dtype}, {m.size} {unit}, "
        f"{jax.default_backend()}{scheduler}: estimate {m.estimate / mib:.0f} MiB, "
        f"XLA {m.xla / mib:.0f} MiB, ratio {m.ratio:.2f}"
    )


if __name__ == "__main__":
    main()
