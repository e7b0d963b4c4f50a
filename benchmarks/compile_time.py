"""``python -m benchmarks.compile_time``: how long one code2wav program takes to compile, whole and
in its two parts, on this backend.

A pipeline's ``warmup()`` compiles one code2wav program per bucket shape; on a GPU each took
about a minute for Qwen2.5-Omni and half of one for Qwen3-Omni (RESULTS.md), which makes start-up
the cost to cut. This lowers and compiles, for one ``rows x codes`` shape (``--family
qwen3_omni``: ``rows x frames``) of a code2wav with ``small``'s widths by default (``--tiny``: the
test checkpoints'), three programs with random weights (``--programs`` picks some by index): the
whole program and its two halves (Qwen2.5-Omni's: the whole solve, ``token2wav_compiled``, the
DiT's ODE loop and then the vocoder; the DiT solve alone; the vocoder alone. Qwen3-Omni's: the
whole decode, ``code2wav_compiled``; the transformer and upsampling alone; the ConvNet decoder
alone), each timed as lowering (tracing and StableHLO, Python) apart from XLA's compilation, every
compilation under the options given with ``--option`` (XLA compiler options, e.g.
``xla_gpu_autotune_level=0``). ``--runs N`` also times the whole program run (best of ``N``; a
solve: 10 grid points, guided), so that a flag or a change made for compile time is seen not to
cost run time. ``--cache-dir DIR`` turns JAX's persistent compilation cache on there: run twice,
the second run's compile seconds are a warm start's. ``--json`` writes the table.

Compare compile seconds across processes only, one program and one set of options each (as
``benchmarks/gpu.sh``'s ``compile`` parts do): on a GPU, XLA keeps its autotuning results (the
convolution algorithms it timed) for the rest of the process, so a program compiled after another
that holds the same convolutions is timed without that work; on an H200 the whole Qwen3-Omni decode
took 22.5 s to compile first and 2.3 s again under another option (RESULTS.md, sixth session).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

from benchmarks.harness import device, persistent_cache, versions, write_json
from benchmarks.models import SMALL_QWEN3_CODE2WAV, SMALL_TOKEN2WAV
from omni_jax.cli_errors import plain_text
from omni_jax.engine.compilation import enable_persistent_cache
from omni_jax.jit import StaticGraph, exact_matmuls
from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, sample_mel, token2wav_compiled
from omni_jax.models.qwen3_omni.code2wav import Code2Wav, code2wav_compiled
from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec
from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG
from omni_jax.testing_qwen3_omni import build_qwen3_omni_tokenizer, tiny_qwen3_omni_config

REFERENCE_FRAMES = 300
"""Reference-mel frames of the solve (a voice's prompt mel; the stage pads every voice's to one
length)."""


def parse_option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--option {text!r}: expected NAME=VALUE")
    return name, value


def timed_compile(lowered: jax.stages.Lowered, options: dict[str, str]) -> tuple[float, jax.stages.Compiled]:
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    return time.perf_counter() - start, compiled


@dataclasses.dataclass(frozen=True)
class Case:
    """One family's code2wav programs for one shape: the model's state, each program's trace as a
    thunk (tracing and lowering are part of what is timed; the first is the whole program, the
    others its parts; ``benchmarks.dilated_conv`` reads the whole one's jaxpr), random inputs of
    the whole program (its arguments after the state, for ``--runs``) and the shape, for the JSON."""

    model: str
    state: nnx.State
    programs: dict[str, Callable[[], jax.stages.Traced]]
    inputs: tuple[jax.Array, ...]
    shape: dict[str, int]


def token2wav_case(tiny: bool, rows: int, codes: int) -> Case:
    """Qwen2.5-Omni's token2wav (``small``: :data:`benchmarks.models.SMALL_TOKEN2WAV`): the whole
    solve (``token2wav_compiled``: the DiT's ODE loop, 10 grid points guided, then the vocoder),
    the DiT solve alone and the vocoder alone."""
    config = Qwen2_5OmniToken2WavConfig(
        **(dict(dit_config=TINY_DIT_CONFIG, bigvgan_config=TINY_BIGVGAN_CONFIG) if tiny else SMALL_TOKEN2WAV)
    )
    model = Token2Wav(config, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    dit = model.dit
    rng = np.random.default_rng(0)
    inputs = (
        jnp.asarray(rng.integers(0, dit.codec_embed.num_embeddings, (rows, codes)), jnp.int32),
        jnp.full(rows, codes, jnp.int32),
        jnp.asarray(rng.standard_normal((rows, config.dit_config.enc_emb_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((rows, REFERENCE_FRAMES, dit.mel_dim)), jnp.float32),
        jnp.full(rows, REFERENCE_FRAMES, jnp.int32),
        jnp.asarray(rng.standard_normal((rows, codes * dit.repeats, dit.mel_dim)), jnp.float32),
        jnp.full(rows, 10, jnp.int32),
        jnp.full(rows, 0.5, jnp.float32),
        jnp.full(rows, -1.0, jnp.float32),
    )
    mel = jnp.zeros((rows, codes * dit.repeats, dit.mel_dim), jnp.float32)

    @jax.jit
    def vocoder(state: nnx.State, mel: jax.Array, frames: jax.Array) -> jax.Array:
        with exact_matmuls(jnp.float32):
            return nnx.merge(graph, state).bigvgan(mel, frames)

    @jax.jit
    def dit_solve(state: nnx.State, *solve_inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        with exact_matmuls(jnp.float32):
            return sample_mel(nnx.merge(graph, state).dit, *solve_inputs, True)

    return Case(
        "qwen2_5_omni " + ("tiny" if tiny else "small"),
        state,
        {
            "whole solve": lambda: token2wav_compiled.trace(StaticGraph(graph), state, *inputs, True),
            "dit solve": lambda: dit_solve.trace(state, *inputs),
            "vocoder": lambda: vocoder.trace(state, mel, jnp.ones(rows, jnp.int32)),
        },
        inputs,
        {"rows": rows, "codes": codes, "reference_frames": REFERENCE_FRAMES},
    )


def qwen3_case(tiny: bool, rows: int, frames: int) -> Case:
    """Qwen3-Omni's code2wav (``small``: the released one, :data:`benchmarks.models.SMALL_QWEN3_CODE2WAV`)
    on ``frames`` code frames a row: the whole decode (``code2wav_compiled``), the transformer
    with the upsampling alone (:meth:`Code2Wav.upsampled`) and the ConvNet decoder alone
    (:meth:`Code2Wav.decode`). On an H200 the whole program compiled in 29 s where each decoder
    block alone took at most 1.6 s (RESULTS.md): which part the difference belongs to is what
    this measures."""
    if tiny:
        config = tiny_qwen3_omni_config(build_qwen3_omni_tokenizer()).code2wav_config
    else:
        config = Qwen3OmniMoeCode2WavConfig(**SMALL_QWEN3_CODE2WAV)
    spec = Code2WavSpec.from_hf(config)
    model = Code2Wav(spec, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, spec.codebook_size, (rows, spec.num_quantizers, frames)), jnp.int32)
    lengths = jnp.full(rows, frames, jnp.int32)
    hidden = jnp.zeros((rows, frames * math.prod(spec.upsampling_ratios), spec.hidden_size), jnp.float32)

    @jax.jit
    def upsampled(state: nnx.State, codes: jax.Array, lengths: jax.Array) -> jax.Array:
        with exact_matmuls(jnp.float32):
            return nnx.merge(graph, state).upsampled(codes, lengths)

    @jax.jit
    def decode(state: nnx.State, x: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        with exact_matmuls(jnp.float32):
            return nnx.merge(graph, state).decode(x, lengths)

    return Case(
        "qwen3_omni " + ("tiny" if tiny else "small"),
        state,
        {
            "whole decode": lambda: code2wav_compiled.trace(StaticGraph(graph), state, codes, lengths),
            "transformer + upsampling": lambda: upsampled.trace(state, codes, lengths),
            "decoder": lambda: decode.trace(state, hidden, lengths),
        },
        (codes, lengths),
        {"rows": rows, "frames": frames},
    )


CASES: dict[str, Callable[[bool, int, int], Case]] = {
    "qwen2_5_omni": token2wav_case,
    "qwen3_omni": qwen3_case,
}


def run_seconds(compiled: jax.stages.Compiled, case: Case, runs: int) -> float:
    """Best of ``runs`` calls of ``compiled`` (the whole program) on the case's random inputs,
    after one untimed call: what a solve of this shape costs to run."""
    jax.block_until_ready(compiled(case.state, *case.inputs))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(case.state, *case.inputs))
        best = min(best, time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.cache_dir:
        enable_persistent_cache(args.cache_dir)
    start = time.perf_counter()
    case = CASES[args.family](args.tiny, args.rows, args.codes)
    init_s = time.perf_counter() - start
    options = dict(args.option)
    names = list(case.programs)
    picked = [names[i] for i in args.programs] if args.programs else names
    rows: list[dict[str, Any]] = []
    solve_s = None
    for name in picked:
        start = time.perf_counter()
        lowered = case.programs[name]().lower()
        lower_s = time.perf_counter() - start
        compile_s, compiled = timed_compile(lowered, options)
        rows.append({"program": name, "lower_s": lower_s, "compile_s": compile_s})
        print(f"{name}  lower_s {lower_s:.1f} s  compile_s {compile_s:.1f} s", flush=True)
        if name == names[0] and args.runs:
            solve_s = run_seconds(compiled, case, args.runs)
            print(f"{name} run, best of {args.runs}: {solve_s:.3f} s", flush=True)
    return {
        "device": device(),
        "versions": versions(),
        "model": case.model,
        "shape": case.shape,
        "persistent_cache": persistent_cache(),  # the one in use, whoever set it
        "init_s": init_s,
        "options": options,
        "rows": rows,
        "solve_s": solve_s,
    }


def add_case_arguments(p: argparse.ArgumentParser, codes: int) -> None:
    """The options that pick a :class:`Case` (``CASES[args.family](args.tiny, args.rows, args.codes)``)."""
    p.add_argument("--family", choices=list(CASES), default="qwen2_5_omni")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--codes", type=int, default=codes, help="codes (qwen3_omni: code frames) a row")
    p.add_argument("--tiny", action="store_true", help="the test checkpoints' code2wav widths")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_time", description=plain_text(__doc__.split("\n\n")[0])
    )
    add_case_arguments(p, codes=32)
    p.add_argument("--runs", type=int, default=0, help="also time the whole program, best of this many")
    p.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        help="NAME=VALUE, repeatable: every compile",
    )
    p.add_argument(
        "--programs",
        type=lambda t: [int(i) for i in t.split(",")],
        default=None,
        help="indices of the programs to compile, e.g. 0 (the whole); default: all",
    )
    p.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache here (default: off)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    write_json(args.json, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
