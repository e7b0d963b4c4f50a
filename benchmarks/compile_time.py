"""``python -m benchmarks.compile_time``: how long one code2wav program takes to compile, whole and
in its two parts, on this backend.

A pipeline's ``warmup()`` compiles one Qwen2.5-Omni token2wav program per bucket shape; on a GPU
each took about a minute (RESULTS.md), which makes start-up the cost to cut. This lowers and
compiles, for one ``rows x codes`` shape of a token2wav with ``small``'s widths by default
(:data:`benchmarks.models.SMALL_TOKEN2WAV`; ``--tiny``: the test checkpoints'), three programs
with random weights: the whole solve (``token2wav_compiled``: the DiT's ODE loop, then the
vocoder), the DiT solve alone and the vocoder alone, each timed as lowering (tracing and
StableHLO, Python) apart from XLA's compilation, and each compiled again under every
``--option`` (an XLA compiler option, e.g. ``xla_gpu_autotune_level=0``) so that a flag's effect is
measured in the same run. ``--runs N`` also times the whole solve run (best of ``N``, 10 grid
points, guided), compiled by default and under each ``--option``, so that a flag or a change made
for compile time is seen not to cost run time. ``--cache-dir DIR`` turns JAX's persistent
compilation cache on there: run twice, the second run's compile seconds are a warm start's.
``--json`` writes the table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig

from benchmarks.harness import device, persistent_cache, versions, write_json
from benchmarks.models import SMALL_TOKEN2WAV
from omni_jax.engine.compilation import enable_persistent_cache
from omni_jax.jit import StaticGraph, exact_matmuls
from omni_jax.models.qwen2_5_omni.token2wav import Token2Wav, sample_mel, token2wav_compiled
from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG

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


def programs(
    model: Token2Wav, speaker_dim: int, rows: int, codes: int
) -> dict[str, Callable[[], jax.stages.Lowered]]:
    """The three programs' lowerings, each a thunk (lowering is part of what is timed);
    ``speaker_dim``: the width of a voice's speaker vector (the DiT's ``enc_emb_dim``)."""
    graph, state = nnx.split(model)
    dit = model.dit
    inputs = (
        jnp.zeros((rows, codes), jnp.int32),
        jnp.ones(rows, jnp.int32),
        jnp.zeros((rows, speaker_dim), jnp.float32),
        jnp.zeros((rows, REFERENCE_FRAMES, dit.mel_dim), jnp.float32),
        jnp.ones(rows, jnp.int32),
        jnp.zeros((rows, codes * dit.repeats, dit.mel_dim), jnp.float32),
        jnp.ones(rows, jnp.int32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros(rows, jnp.float32),
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

    return {
        "whole solve": lambda: token2wav_compiled.lower(StaticGraph(graph), state, *inputs, True),
        "dit solve": lambda: dit_solve.lower(state, *inputs),
        "vocoder": lambda: vocoder.lower(state, mel, jnp.ones(rows, jnp.int32)),
    }


def solve_seconds(
    compiled: jax.stages.Compiled, model: Token2Wav, speaker_dim: int, rows: int, codes: int, runs: int
) -> float:
    """Best of ``runs`` calls of ``compiled`` (the whole solve's program for ``rows x codes``) on
    random codes, speaker and noise, 10 grid points, guidance 0.5, after one untimed call: what a
    solve of this shape costs to run."""
    state = nnx.state(model)
    dit = model.dit
    rng = np.random.default_rng(0)
    inputs = (
        jnp.asarray(rng.integers(0, dit.codec_embed.num_embeddings, (rows, codes)), jnp.int32),
        jnp.full(rows, codes, jnp.int32),
        jnp.asarray(rng.standard_normal((rows, speaker_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((rows, REFERENCE_FRAMES, dit.mel_dim)), jnp.float32),
        jnp.full(rows, REFERENCE_FRAMES, jnp.int32),
        jnp.asarray(rng.standard_normal((rows, codes * dit.repeats, dit.mel_dim)), jnp.float32),
        jnp.full(rows, 10, jnp.int32),
        jnp.full(rows, 0.5, jnp.float32),
        jnp.full(rows, -1.0, jnp.float32),
    )
    jax.block_until_ready(compiled(state, *inputs))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, *inputs))
        best = min(best, time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.cache_dir:
        enable_persistent_cache(args.cache_dir)
    tiny = dict(dit_config=TINY_DIT_CONFIG, bigvgan_config=TINY_BIGVGAN_CONFIG)
    t2w = tiny if args.tiny else SMALL_TOKEN2WAV
    start = time.perf_counter()
    config = Qwen2_5OmniToken2WavConfig(**t2w)
    model = Token2Wav(config, rngs=nnx.Rngs(0))
    init_s = time.perf_counter() - start
    options = dict(args.option)
    rows: list[dict[str, Any]] = []
    whole: dict[str, jax.stages.Compiled] = {}  # the whole solve's programs, by option
    for name, lower in programs(model, config.dit_config.enc_emb_dim, args.rows, args.codes).items():
        start = time.perf_counter()
        lowered = lower()
        lower_s = time.perf_counter() - start
        row: dict[str, Any] = {"program": name, "lower_s": lower_s}
        for key, value in [("", ""), *options.items()]:
            label = f"[{key}={value}]" if key else ""
            row[f"compile_s{label}"], compiled = timed_compile(lowered, {key: value} if key else {})
            if name == "whole solve":
                whole[label] = compiled
        rows.append(row)
        print("  ".join(f"{k} {v:.1f} s" if isinstance(v, float) else v for k, v in row.items()), flush=True)
    solve_s: dict[str, float] = {}
    for label, compiled in whole.items() if args.runs else ():
        solve_s[f"solve_s{label}"] = solve_seconds(
            compiled, model, config.dit_config.enc_emb_dim, args.rows, args.codes, args.runs
        )
        print(
            f"whole solve run{label} (10 grid points, guided), best of {args.runs}: "
            f"{solve_s[f'solve_s{label}']:.3f} s",
            flush=True,
        )
    return {
        "device": device(),
        "versions": versions(),
        "model": "tiny" if args.tiny else "small",
        "shape": {"rows": args.rows, "codes": args.codes, "reference_frames": REFERENCE_FRAMES},
        "persistent_cache": persistent_cache(),  # the one in use, whoever set it
        "init_s": init_s,
        "rows": rows,
        "solve_s": solve_s or None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--codes", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="the test checkpoints' token2wav widths")
    p.add_argument("--runs", type=int, default=0, help="also time the whole solve, best of this many")
    p.add_argument("--option", type=parse_option, action="append", default=[], help="NAME=VALUE, repeatable")
    p.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache here (default: off)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    write_json(args.json, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
