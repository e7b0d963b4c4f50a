"""The memory plan counts the thinker's largest encoder call (:mod:`omni_jax.stages.encoder_programs`):
against XLA's own count of the stage's program, and in the plan, the start-up check and the
default cache."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from omni_jax.engine import memory
from omni_jax.engine.memory import ProgramBytes

SMALL: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen2_5_omni", "audio"): dict(d_model=128, num_heads=4, ffn_dim=512, output_dim=256, num_layers=4),
    ("qwen2_5_omni", "vision"): dict(
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        depth=8,
        fullatt_block_indexes=(3, 7),
    ),
    ("qwen3_omni", "audio"): dict(
        d_model=128, num_heads=4, ffn_dim=512, downsample_hidden_size=32, output_dim=256, num_layers=4
    ),
    ("qwen3_omni", "vision"): dict(
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        depth=6,
        deepstack_visual_indexes=(1, 3),
    ),
}
"""Each released encoder at small widths, with layers enough that what XLA's CPU scheduler holds
from one layer into the next shows (Qwen3-Omni's vision layers: one attention output each)."""


@pytest.mark.parametrize("model,encoder", list(SMALL))
def test_encoder_call_estimate_against_xla(model: str, encoder: str) -> None:
    """What the plan counts for an encoder call (:func:`call_bytes`, the float32 program for the
    host's CPU) against XLA's count of the whole encoder's program in bfloat16, the released
    checkpoints' dtype (temporaries, inputs and output): at least as large, at most twice. The
    CPU converts bfloat16 weights to float32, which the plan adds
    (:func:`~omni_jax.cpu_schedule.weight_copies`). (In float32 the two are one program, equal
    by construction.)"""
    from benchmarks.encoder_memory import encoder_memory

    size = 64 if encoder == "audio" else 1024
    m = encoder_memory(model, encoder, "bfloat16", size=size, **SMALL[model, encoder])
    assert m.xla <= m.estimate <= 2 * m.xla, m


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU scheduler is what is checked")
def test_a_layer_holds_into_the_next() -> None:
    """Why the plan compiles the whole encoder: under XLA's default CPU scheduler, Qwen3-Omni's
    vision encoder holds a hidden-width row per token more with each layer once its attention
    runs in query tiles (4096 tokens of 8 heads: two tiles), so fewer layers would count short;
    under the depth-first one it holds less than that."""
    from benchmarks.encoder_memory import encoder_memory
    from omni_jax.cpu_schedule import concurrency_scheduler

    widths = dict(hidden_size=512, intermediate_size=1024, num_heads=8, out_hidden_size=256)
    tokens, depths = 4096, (2, 6)
    counts = [
        encoder_memory(
            "qwen3_omni", "vision", "float32", size=tokens, depth=d, deepstack_visual_indexes=(0,), **widths
        ).xla
        for d in depths
    ]
    rows = (depths[1] - depths[0]) * tokens * widths["hidden_size"] * 4
    assert (counts[1] - counts[0] >= rows) == concurrency_scheduler(), counts


def _needs(path: Path) -> dict[str, int]:
    """The thinker's items on a CPU device, as ``from_pretrained`` checks them."""
    from omni_jax.architectures import architecture_of
    from omni_jax.preflight import PlannedMesh, engine_settings, stage_demand, stage_graph
    from omni_jax.weights import load_hf_config

    hf_config = load_hf_config(path)
    arch = architecture_of(hf_config)
    (sc,) = stage_graph(path, arch, hf_config, None, ["thinker"]).stages
    mesh = PlannedMesh({"data": 1, "model": 1}, "cpu")
    sizes = dict.fromkeys(("max_num_seqs", "max_model_len", "page_size", "max_num_batched_tokens"))
    return stage_demand(path, hf_config, arch, sc, mesh, None, {}, **engine_settings(sc, **sizes)).fixed


@pytest.fixture(scope="module")
def omni_copy(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-Omni checkpoint's config and processor files (nothing else is read)."""
    out = tmp_path_factory.mktemp("encoders")
    for f in omni_dir.iterdir():
        if f.suffix == ".json" or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def _encoder_item(items: dict[str, int]) -> tuple[str, int] | None:
    found = [(k, v) for k, v in items.items() if "largest encoder call" in k]
    assert len(found) <= 1, items
    return found[0] if found else None


def test_the_plan_counts_the_largest_encoder_call(omni_copy: Path) -> None:
    """The thinker's items name its largest encoder call with XLA's count beside the step: here
    the vision call (the tiny checkpoint's largest frame takes more than its 30 s of audio)."""
    from omni_jax.models.qwen2_5_omni.processor import MediaParts
    from omni_jax.models.qwen2_5_omni.thinker import ThinkerSpec
    from omni_jax.stages.encoder_programs import call_bytes
    from omni_jax.stages.thinker import EncoderBuckets, ThinkerStepInputs
    from omni_jax.weights import load_hf_config

    items = _needs(omni_copy)
    what, nbytes = _encoder_item(items)
    spec = ThinkerSpec.from_hf(load_hf_config(omni_copy).thinker_config)
    buckets = EncoderBuckets.for_processor(MediaParts.from_pretrained(omni_copy), spec, max_model_len=512)
    assert f"vision, {buckets.vision_tokens[-1]} patches" in what, what
    assert re.search(r"audio", " ".join(items)) is None

    from omni_jax.models.qwen2_5_omni.audio_encoder import AudioBatch, AudioEncoder
    from omni_jax.models.qwen2_5_omni.vision_encoder import VisionBatch, VisionEncoder

    visual = nnx.eval_shape(lambda: VisionEncoder(spec.vision, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    audio = nnx.eval_shape(lambda: AudioEncoder(spec.audio, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    vision_call = call_bytes(
        visual, VisionBatch, buckets.vision_tokens[-1], ThinkerStepInputs.vision_rows, "cpu"
    )
    audio_call = call_bytes(audio, AudioBatch, buckets.audio_chunks[-1], None, "cpu")
    assert vision_call.running > audio_call.running
    assert nbytes == vision_call.running + max(vision_call.output, audio_call.output)


def test_no_encoder_call_without_media(omni_copy: Path, tmp_path: Path) -> None:
    """The largest call of the kinds the stage takes: none without ``preprocessor_config.json``
    (text prompts only) or with every kind off (the stage YAML's ``limit_mm_per_prompt``), the
    audio call with images and videos off."""
    import jax.numpy as jnp
    from flax import nnx

    from omni_jax.models.qwen2_5_omni.thinker import Thinker, ThinkerSpec
    from omni_jax.stages.thinker import MediaLimits, ThinkerFrontend
    from omni_jax.weights import load_hf_config

    spec = ThinkerSpec.from_hf(load_hf_config(omni_copy).thinker_config)
    model = nnx.eval_shape(lambda: Thinker(spec, dtype=jnp.float32, rngs=nnx.Rngs(0)))

    def largest(limits: MediaLimits, path: Path = omni_copy) -> ProgramBytes | None:
        return ThinkerFrontend.encoder_memory(model, path, limits, 512, "cpu")

    assert largest(MediaLimits(audio=0, image=0, video=0)) is None
    assert largest(MediaLimits(image=0, video=0)).what.startswith("audio, ")
    assert largest(MediaLimits()).what.startswith("vision, ")
    text_only = tmp_path / "text_only"
    shutil.copytree(omni_copy, text_only)
    (text_only / "preprocessor_config.json").unlink()
    assert largest(MediaLimits(), text_only) is None
    assert _encoder_item(_needs(text_only)) is None


def test_the_default_cache_leaves_room_for_the_encoder_call() -> None:
    """A cache sized by default takes what the step and the encoder call leave."""
    import jax.numpy as jnp

    from omni_jax.engine.kv_cache import CacheGeometry

    base = memory.ARMemory(
        cache=CacheGeometry(2, 2, 8, jnp.dtype("float32"), 16, 256),
        num_heads=2,
        vocab_size=64,
        max_rows=4,
        max_num_seqs=4,
        max_token_rows=64,
        chunk_bytes=1 << 20,
        activation_width=64,
    )
    call = dataclasses.replace(base, encoder=ProgramBytes("vision, 1024 patches, XLA's count", 10 << 20))
    available = 100 << 20
    assert base.pages_that_fit(available) - call.pages_that_fit(available) == pytest.approx(
        (10 << 20) / base.cache.page_bytes, abs=1
    )
    assert call.demand(8) == {
        **base.demand(8),
        "largest encoder call (vision, 1024 patches, XLA's count)": 10 << 20,
    }


def test_a_default_cache_is_sized_beside_the_encoder_call(
    omni_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_pretrained`` sizes a default cache with room for the step and the largest encoder
    call: 63 pages (and the null page) where the memory left holds both and 64 pages."""
    from omni_jax.pipeline import OmniJaxPipeline
    from omni_jax.stages.ar import CachePlan
    from omni_jax.stages.thinker import MediaLimits, ThinkerFrontend

    kw: dict[str, Any] = dict(max_num_seqs=8, max_model_len=256, page_size=16, max_num_batched_tokens=64)
    full = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], **kw)
    runner = full.stages[0].engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    encoder = ThinkerFrontend.encoder_memory(model, omni_dir, MediaLimits(), 256, "cpu")
    mem = CachePlan.of(model, None, **kw).with_encoder(encoder).memory
    assert encoder is not None and encoder.nbytes > mem.step_bytes
    small = int((mem.beside_cache + 64 * mem.cache.page_bytes) / 0.9) + 1
    monkeypatch.setattr(memory, "host_available_bytes", lambda: small)
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], **kw)
    assert mem.pages_that_fit(small) == 63
    assert pipe.stages[0].engine.runner.cache_cfg.num_pages == 63


def test_the_plan_takes_the_media_limits(omni_copy: Path) -> None:
    """``plan_memory(limit_mm_per_prompt=...)`` (``omni-jax plan --limit-mm-per-prompt``) plans
    the thinker without the calls of the kinds turned off, as ``from_pretrained`` builds it."""
    from omni_jax.planning import plan_memory

    def thinker_step(**kw: Any) -> int:
        (thinker,) = plan_memory(omni_copy, stages=["thinker"], platform="cpu", **kw).stages
        return thinker.step

    items = _needs(omni_copy)
    step = items["stage 'thinker' largest step's temporaries (estimate)"]
    assert thinker_step() == sum(v for k, v in items.items() if "weights" not in k)
    assert thinker_step(limit_mm_per_prompt={"audio": 0, "image": 0, "video": 0}) == step
    assert step < thinker_step(limit_mm_per_prompt={"image": 0, "video": 0}) < thinker_step()
