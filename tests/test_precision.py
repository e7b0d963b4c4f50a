"""Every float32 program the pipeline compiles computes its products in float32.

XLA's default matmul precision computes float32 products in TensorFloat-32 on GPUs, about 1e-3
away from transformers' float32 (seen on an H200: Qwen2 prefill logits 3e-3 off, the audio
encoder 3e-4). The engine therefore traces its model programs under
:func:`omni_jax.jit.exact_matmuls`; this holds every program of a full Qwen2.5-Omni request
(audio and vision encoders, thinker, talker, token2wav) to it, on any backend, by reading the
StableHLO JAX emits: each ``dot_general`` and ``convolution`` must ask for HIGHEST precision.
The process default is set to XLA's own ("default") around the run, so the programs must ask
for it themselves (tests/conftest.py raises the default for tests that trace modules directly).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from omni_reference import picture, tone

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams

PRODUCT = re.compile(r"stablehlo\.(dot_general|convolution)\b")


def products(dump: Path) -> dict[str, list[str]]:
    """Each dumped program's product ops (file name -> op lines)."""
    out: dict[str, list[str]] = {}
    for path in sorted(dump.rglob("*.mlir")):
        ops = [line for line in path.read_text().splitlines() if PRODUCT.search(line)]
        if ops:
            out[path.name] = ops
    return out


def not_highest(dump: Path) -> list[str]:
    return [
        f"{name}: {op.strip()[:160]}"
        for name, ops in products(dump).items()
        for op in ops
        if "HIGHEST" not in op
    ]


@pytest.fixture
def dumped(tmp_path):
    """``jax_dump_ir_to`` pointed at a fresh folder under XLA's default precision; restored after."""
    dump = tmp_path / "ir"
    old_to, old_modes = (jax.config.values[k] for k in ("jax_dump_ir_to", "jax_dump_ir_modes"))
    jax.config.update("jax_dump_ir_to", str(dump))
    jax.config.update("jax_dump_ir_modes", "stablehlo")
    try:
        with jax.default_matmul_precision("default"):
            yield dump
    finally:
        jax.config.update("jax_dump_ir_to", old_to)
        jax.config.update("jax_dump_ir_modes", old_modes)


def test_the_check_sees_a_default_precision_product(dumped) -> None:
    x = jnp.ones((4, 4), jnp.float32)
    jax.jit(lambda a: a @ a)(x).block_until_ready()
    assert products(dumped) and not_highest(dumped)


def test_every_float32_program_of_an_omni_request_is_exact(omni_dir, dumped) -> None:
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=2, compilation_cache=False)
    prompt = pipe.chat_prompt(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": picture(56, 84, 2)},
                    {"type": "audio", "audio": tone(1.0, 440, 0)},
                    {"type": "text", "text": "what do you see and hear"},
                ],
            }
        ]
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=8),
        Token2WavParams(num_steps=2),
    ]
    (out,) = pipe.run([prompt], params, progress=False)
    assert out.error is None and out.audio is not None
    programs = products(dumped)
    names = " ".join(programs)
    for part in ("_forward_fn", "encode", "token2wav_compiled"):
        assert part in names, f"no {part} program was dumped: {sorted(programs)}"
    assert not not_highest(dumped)
