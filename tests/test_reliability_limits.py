"""Limits refused at start-up (issue 9.5): a KV cache or batch the device cannot hold is refused
when the pipeline is built, with needed and available bytes, never an out-of-memory error mid-run.

On this CPU machine devices report no memory statistics, so the host's ``MemAvailable`` is
what is available; accelerator statistics are exercised with a stand-in device. Where a test
needs a small device it lowers what the host reports (``host_available_bytes``), so the
numbers are the code's own and nothing large is allocated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import pytest
import yaml

from omni_jax import OmniJaxPipeline
from omni_jax.architectures import architecture_of
from omni_jax.engine import memory
from omni_jax.engine.memory import ARMemory, available_bytes, memory_pools
from omni_jax.parallel.mesh import mesh_shape
from omni_jax.parallel.placement import StagePlacement, stage_meshes
from omni_jax.preflight import cache_shares, check_memory_before_loading, stage_needs
from omni_jax.stages.config import SHIPPED_DIR, load_pipeline_config
from omni_jax.weights import load_hf_config

BYTES = r"\d+\.\d\d GiB \((\d+) bytes\)"


def numbers(message: str) -> tuple[int, int]:
    """``(needed, available)`` bytes from a refusal."""
    m = re.search(rf"needs {BYTES}.* has {BYTES} available", message)
    assert m, message
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize(
    "kwargs,item",
    [
        ({"num_pages": 10**9}, r"KV cache \(1000000000 pages of 16 tokens, 8192 bytes each\)"),
        ({"max_num_seqs": 10**7}, r"largest step's temporaries \(estimate\)"),
        (
            {"max_num_seqs": 2**16, "max_num_batched_tokens": 2**26},
            r"largest step's temporaries \(estimate\)",
        ),
    ],
)
def test_absurd_cache_or_batch_refused_with_the_numbers(qwen2_dir, kwargs, item) -> None:
    """Refused by ``from_pretrained``'s check before loading (the stage's own check after
    loading gives the same numbers; ``test_default_cache_sized_to_what_is_left`` reaches it)."""
    with pytest.raises(ValueError, match=r"the pipeline needs ") as e:
        OmniJaxPipeline.from_pretrained(qwen2_dir, **kwargs)
    message = str(e.value)
    needed, available = numbers(message)
    assert needed > available
    assert "host memory (MemAvailable)" in message and re.search(item, message)
    assert "lower num_pages, max_model_len, max_num_seqs or max_num_batched_tokens" in message


def test_budget_past_what_the_sequences_hold_is_not_refused(qwen2_dir) -> None:
    """A token budget no step can fill (2**26 tokens for 4 sequences of 512) sizes the largest
    step at what the sequences hold, 2048 rows: not refused for a step that cannot happen."""
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=4, max_model_len=512, max_num_batched_tokens=2**26, num_pages=128
    )
    assert pipe.stages[0].engine.runner.most_rows == 2048


def test_default_cache_sized_to_what_is_left(qwen2_dir, monkeypatch) -> None:
    """Without ``num_pages`` the cache is what fits (90% of what is left, next to the largest
    step), at most ``max_num_seqs`` full sequences; below one sequence the build is refused."""
    kw: dict[str, Any] = dict(max_num_seqs=8, max_model_len=256, page_size=16, max_num_batched_tokens=64)
    full = OmniJaxPipeline.from_pretrained(qwen2_dir, **kw)
    assert full.stages[0].engine.runner.cache_cfg.num_pages == 8 * 256 // 16
    plan = plan_of(full, kw)
    # room for the step and 64 pages: 63 and the null page (the cache holds one page more)
    small = int((plan.step_bytes + 64 * plan.cache.page_bytes) / 0.9) + 1
    monkeypatch.setattr(memory, "host_available_bytes", lambda: small)
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, **kw)
    fit = plan.pages_that_fit(small)
    assert fit == 63
    assert pipe.stages[0].engine.runner.cache_cfg.num_pages == fit
    monkeypatch.setattr(memory, "host_available_bytes", lambda: plan.step_bytes)
    # Not even one sequence fits next to the step: refused before loading, the cache counted
    # at one sequence (the least a default cache may be).
    with pytest.raises(ValueError, match=r"the pipeline needs .*KV cache \(16 pages of 16 tokens"):
        OmniJaxPipeline.from_pretrained(qwen2_dir, **kw)


def plan_of(pipe: OmniJaxPipeline, kw: dict[str, Any]) -> ARMemory:
    """The memory plan of ``pipe``'s stage, as it was built with ``kw``."""
    from flax import nnx

    from omni_jax.stages.ar import CachePlan

    runner = pipe.stages[0].engine.runner
    return CachePlan.of(nnx.merge(runner.graphdef, runner.state), None, **kw).memory


def meshes_for(path: Any, stages: list[str] | None = None) -> tuple[Any, Any, Any]:
    hf_config = load_hf_config(path)
    config = load_pipeline_config(architecture_of(hf_config).stage_yaml).select(stages)
    placements = [StagePlacement(sc.name, sc.mesh, sc.devices) for sc in config.stages]
    return hf_config, config.stages, stage_meshes(placements, mesh_shape(None), config.allow_shared_devices)


ENGINE = dict(dtype=None, max_num_seqs=64, max_model_len=None, page_size=16, max_num_batched_tokens=2048)


def check(path: Any, hf_config: Any, stages: Any, meshes: Any, num_pages: int | None) -> None:
    check_memory_before_loading(stage_needs(path, hf_config, stages, meshes, **ENGINE), num_pages)


def test_checked_before_loading_over_every_stage(omni_dir, monkeypatch) -> None:
    """From ``config.json`` alone (abstract models, nothing read or allocated): every stage's
    weights and each AR stage's cache and step, added up for the memory they share."""
    from omni_jax import weights

    def no_loading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("weights were read")

    monkeypatch.setattr(weights, "load_part", no_loading)
    monkeypatch.setattr(weights, "tensor_readers", no_loading)
    hf_config, stages, meshes = meshes_for(omni_dir)
    check(omni_dir, hf_config, stages, meshes, None)  # fits
    with pytest.raises(ValueError, match="the pipeline needs ") as e:
        check(omni_dir, hf_config, stages, meshes, 10**8)
    message = str(e.value)
    needed, available = numbers(message)
    assert needed > available
    for item in (
        "stage 'thinker' weights",
        "stage 'talker' weights",
        "stage 'code2wav' weights",
        "stage 'thinker' KV cache (100000000 pages",
        "stage 'talker' KV cache (100000000 pages",
        "stage 'talker' largest step's temporaries (estimate)",
    ):
        assert item in message
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 20)  # 1 MiB: not even the weights
    with pytest.raises(ValueError, match=r"the pipeline needs .* has 0\.00 GiB \(1048576 bytes\) available"):
        check(omni_dir, hf_config, stages, meshes, None)


class FakeAccelerator:
    """What ``available_bytes`` reads of a GPU: its memory statistics."""

    device_kind = "Fake GPU"

    def __init__(self, id: int, limit: int, in_use: int):  # noqa: A002 - jax.Device's name
        self.id = id
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self) -> dict[str, int]:
        return self.stats

    def __str__(self) -> str:
        return f"fake:{self.id}"


def test_accelerators_count_their_own_memory_cpus_the_hosts() -> None:
    import jax

    gpu0, gpu1 = FakeAccelerator(0, 80 << 30, 20 << 30), FakeAccelerator(1, 80 << 30, 79 << 30)
    assert available_bytes(gpu0) == (60 << 30, "device fake:0 (Fake GPU)")  # type: ignore[arg-type]
    assert [n for _, n in memory_pools([gpu0, gpu1])] == [1, 1]  # type: ignore[list-item]
    cpus = jax.devices("cpu")
    assert available_bytes(cpus[0])[1] == "host memory (MemAvailable)"
    assert [n for _, n in memory_pools(cpus)] == [len(cpus)]  # one host pool for all of them
    with pytest.raises(
        ValueError, match=r"x needs 2\.00 GiB .* but device fake:1 \(Fake GPU\) has 1\.00 GiB"
    ):
        memory.refuse_unless_fits("x", {"a": 1 << 30, "b": 1 << 30}, [gpu0, gpu1])  # type: ignore[list-item]


def test_each_stage_traced_once(omni_dir, monkeypatch) -> None:
    """``from_pretrained`` traces each stage's abstract model once: the memory check's model is
    the one its weights are loaded into (tracing a 7B model's stages takes seconds), and the
    stage is built with the plan that check made."""
    from omni_jax.models import loading

    traced: list[object] = []
    trace = loading.abstract_model

    def counted(ctor):  # noqa: ANN001, ANN202
        traced.append(ctor)
        return trace(ctor)

    monkeypatch.setattr(loading, "abstract_model", counted)
    monkeypatch.setattr("omni_jax.preflight.abstract_model", counted)
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=2, max_model_len=256)
    assert len(traced) == len(pipe.stages) == 3


def test_from_pretrained_refuses_before_reading_weights(omni_dir, monkeypatch, tmp_path) -> None:
    """``from_pretrained`` runs the check above first: an impossible cache is refused with the
    numbers and no weight file is opened."""
    from omni_jax import pipeline

    def no_loading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("weights were read")

    monkeypatch.setattr(pipeline, "load_part", no_loading)
    with pytest.raises(ValueError, match=r"the pipeline needs .*stage 'talker' KV cache \(100000000 pages"):
        OmniJaxPipeline.from_pretrained(omni_dir, num_pages=10**8)
    # Streamed decoding constants code2wav refuses: here too.
    bad_stream = tmp_path / "stages.yaml"
    stages = yaml.safe_load((SHIPPED_DIR / "qwen2_5_omni.yaml").read_text())
    stages["stages"][2]["engine"]["stream"] = {"max_chunk_codes": 12}
    bad_stream.write_text(yaml.safe_dump(stages))
    with pytest.raises(ValueError, match=r"stage 'code2wav': engine.stream: max_chunk=24 must be at least"):
        OmniJaxPipeline.from_pretrained(omni_dir, stage_config=bad_stream)
    # Too few pages for one sequence: refused here too, not after the weights have loaded.
    with pytest.raises(
        ValueError,
        match=r"stage 'thinker': num_pages=3 x page_size=16 cannot hold one sequence of max_model_len=256 "
        r"\(16 pages\); raise num_pages or lower max_model_len",
    ):
        OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], num_pages=3, max_model_len=256)


def test_code2wav_largest_solve_refused_with_the_numbers(omni_dir) -> None:
    """A code2wav batch the memory cannot hold (``max_batch`` x ``max_codes`` from the stage's
    engine options, within ``max_solve_codes``) is refused before loading, its largest solve
    listed; the default ``max_solve_codes`` keeps the same ``max_batch`` within memory."""
    hf_config, stages, meshes = meshes_for(omni_dir, ["code2wav"])
    check(omni_dir, hf_config, stages, meshes, None)  # fits
    uncapped = {"max_solve_codes": 10**9}
    huge = [dataclasses.replace(stages[0], engine={"max_batch": 10**6, "max_codes": 200, **uncapped})]
    with pytest.raises(ValueError, match="the pipeline needs ") as e:
        check(omni_dir, hf_config, huge, meshes, None)
    needed, available = numbers(str(e.value))
    assert needed > available
    assert "stage 'code2wav' largest solve (1000000 requests of 200 codes, estimate)" in str(e.value)
    assert "max_batch, max_codes or max_solve_codes" in str(e.value)
    check(
        omni_dir,
        hf_config,
        [dataclasses.replace(stages[0], engine={"max_batch": 10**6, "max_codes": 200})],
        meshes,
        None,
    )
    capped = [dataclasses.replace(stages[0], engine={"max_batch": 10**6, "max_codes": 10**9, **uncapped})]
    with pytest.raises(ValueError, match=r"1000000 requests of 256 codes"):  # the DiT's positions cap it
        check(omni_dir, hf_config, capped, meshes, None)


def test_code2wav_solve_estimate_follows_the_talker(omni_dir) -> None:
    """Fed by a talker of ``max_model_len`` 64, code2wav's largest solve is of 64 codes (what the
    talker can hand on), in the start-up check as in the built stage; alone, the DiT's 256."""
    hf_config, stages, meshes = meshes_for(omni_dir)
    fed = stage_needs(omni_dir, hf_config, stages, meshes, **{**ENGINE, "max_model_len": 64})
    alone = stage_needs(omni_dir, hf_config, stages[-1:], meshes, **{**ENGINE, "max_model_len": 64})
    assert "stage 'code2wav' largest solve (8 requests of 64 codes, estimate)" in fed[-1].fixed
    assert "stage 'code2wav' largest solve (8 requests of 256 codes, estimate)" in alone[-1].fixed


@pytest.mark.parametrize(
    "widths,rows,codes", [("tiny", 1, 256), ("tiny", 4, 64), ("tiny", 8, 128), ("7b", 1, 64)]
)
def test_solve_estimate_against_xla(omni_dir, widths, rows, codes) -> None:
    """The per-code estimate the check multiplies, against XLA's own count of the compiled
    solve's temporaries, for the tiny checkpoint and at Qwen2.5-Omni-7B's widths (transformers'
    default ``Qwen2_5OmniToken2WavConfig``; traced from shapes, no weights): at least as large,
    at most 3x."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from transformers import Qwen2_5OmniToken2WavConfig

    from omni_jax.jit import StaticGraph
    from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, token2wav_compiled

    if widths == "tiny":
        config = load_hf_config(omni_dir).token2wav_config
    else:
        config = Qwen2_5OmniToken2WavConfig()
        assert (
            config.bigvgan_config.upsample_initial_channel == 1536 and config.dit_config.hidden_size == 1024
        )
    model = nnx.eval_shape(lambda: Token2Wav(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    dit = config.dit_config
    i32, f32 = jnp.int32, jnp.float32
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (
            ((rows, codes), i32),
            ((rows,), i32),
            ((rows, dit.enc_emb_dim), f32),
            ((rows, 64, dit.mel_dim), f32),
            ((rows,), i32),
            ((rows, codes * dit.repeats, dit.mel_dim), f32),
            ((rows,), i32),
            ((rows,), f32),
            ((rows,), f32),
        )
    ]
    compiled = token2wav_compiled.lower(StaticGraph(graphdef), state, *args, True).compile()
    xla = compiled.memory_analysis().temp_size_in_bytes
    estimate = model.solve_bytes_per_code * rows * codes
    assert xla <= estimate <= 3 * xla, (estimate, xla)


@pytest.mark.parametrize(
    "dtype,budget,backend",
    [("float32", 2048, "jnp"), ("float32", 2048, "auto"), ("bfloat16", 2048, "jnp"), ("bfloat16", 16, "jnp")],
)
def test_ar_step_estimate_against_xla(dtype: str, budget: int, backend: str) -> None:
    """The AR plan's largest step (:attr:`ARMemory.step_bytes`, as the stage plans it) against
    XLA's own count of that step's temporaries, at Qwen2-7B's widths (three layers, traced from
    shapes, no weights): at least as large, at most twice. A prompt step of 2048 token rows and
    a decode step of 16, float32 on the jnp path and the CPU kernel, and bfloat16, whose
    products XLA's CPU compiler computes in float32 (every layer's weight copies at once, with
    its default scheduler: :mod:`omni_jax.cpu_schedule`;
    :func:`test_ar_step_estimate_under_the_depth_first_scheduler` runs the other)."""
    from benchmarks.step_memory import step_memory

    m = step_memory(dtype, layers=3, budget=budget, backend=backend)
    assert m.xla <= m.estimate <= 2 * m.xla + (64 << 20), m


QWEN2_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
"""Qwen2-1.5B's widths: its head is its embedding, whose float32 copy XLA does make."""


def test_ar_step_estimate_against_xla_at_long_context_with_a_tied_head() -> None:
    """A bfloat16 decode step of Qwen2-1.5B's widths at 4096 tokens of context (eight layers, one
    sequence): XLA's CPU scheduler keeps a float32 copy of a row's gathered K and V for every
    layer (7.8 MiB a layer here), which the estimate once left out; with a tied head no
    embedding copy the estimate counts and XLA skips makes up for it (28 layers: 211 MiB short)."""
    from benchmarks.step_memory import step_memory

    m = step_memory("bfloat16", layers=8, budget=16, max_num_seqs=1, widths=QWEN2_1_5B)
    assert m.xla <= m.estimate <= 2 * m.xla + (64 << 20), m


@pytest.mark.parametrize("budget", [16, 256])
def test_moe_step_estimate_bounds_xla(budget: int) -> None:
    """Qwen3-Omni-30B-A3B's thinker decoder (its released widths and 128 experts, two layers) in
    bfloat16, a decode step (pair by pair on CPU) and a 256-row one (dense): the estimate at
    least XLA's count. Not within twice it: on CPU the plan counts float32 copies of every
    expert, which these forms never make at once, and the dense form's rows for every expert
    (5.3x and 5.5x XLA's count: ``benchmarks/RESULTS.md``); the GPU's count is
    ``benchmarks/gpu.sh``'s to measure."""
    from benchmarks.step_memory import step_memory

    m = step_memory("bfloat16", layers=2, budget=budget, decoder="qwen3-omni")
    assert m.xla <= m.estimate, m


def test_ar_step_estimate_under_the_depth_first_scheduler() -> None:
    """With ``XLA_FLAGS`` turning the concurrency scheduler off when the backend starts
    (another process: ``python -m benchmarks.step_memory``), a bfloat16 step converts one weight
    at a time (XLA's count is the head's float32 copy, 2.03 GiB, and the step's few rows, where
    the default holds every layer's: 3.8 GiB at two layers), the plan sees that scheduler, and
    its estimate still bounds XLA's count within twice."""
    import os
    import subprocess
    import sys

    from omni_jax.cpu_schedule import FLAG

    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --{FLAG}=false"}
    command = ["--dtype", "bfloat16", "--layers", "2", "--budget", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_memory", *command], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"depth-first scheduler: estimate (\d+) MiB, XLA (\d+) MiB", done.stdout)
    assert found, done.stdout
    estimate, xla = int(found[1]), int(found[2])
    assert xla < 2200 and xla <= estimate <= 2 * xla + 64, (estimate, xla)


def test_default_caches_leave_room_for_later_stages(omni_dir, monkeypatch) -> None:
    """Sharing one memory, the thinker's default cache (built first) leaves the talker and
    code2wav what they need at the least, and splits the rest with the talker's cache by what
    each would like (``max_num_seqs`` sequences); the talker leaves code2wav its share."""
    hf_config, stages, meshes = meshes_for(omni_dir)
    needs = stage_needs(omni_dir, hf_config, stages, meshes, **ENGINE)
    thinker, talker, code2wav = needs
    shares = cache_shares(needs)
    assert set(shares) == {"thinker", "talker"}
    least = lambda s: sum(s.demand(None).values())  # noqa: E731
    assert shares["thinker"].reserved == {"host": least(talker) + least(code2wav)}
    assert shares["talker"].reserved == {"host": least(code2wav)}
    want = thinker.wanted_cache(), talker.wanted_cache()
    assert shares["thinker"].fraction == pytest.approx(want[0] / sum(want))
    assert shares["talker"].fraction == 1.0

    # Enough for about 1000 thinker pages in its half of what the reservation, the step and the
    # encoder call leave.
    mem = thinker.plan.memory
    room = mem.beside_cache + 2 * 1000 * mem.cache.page_bytes
    available = shares["thinker"].reserved["host"] + int(room / 0.9)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: available)
    (device,) = jax.devices()
    pages = thinker.plan.num_pages(None, [device], "thinker", shares["thinker"])
    alone = thinker.plan.num_pages(None, [device], "thinker")  # as if nothing came after it
    assert thinker.plan.geometry.pages_per_seq < pages < alone
    assert abs(pages - 1000) <= 2
    left = available - shares["thinker"].reserved["host"]
    assert pages == thinker.plan.memory.pages_that_fit(left, share=shares["thinker"].fraction)
    # What the thinker takes, with what it reserves, fits: the later stages can still load.
    taken = thinker.plan.memory.kv_bytes(pages) + sum(thinker.fixed.values())
    assert taken + shares["thinker"].reserved["host"] <= available
