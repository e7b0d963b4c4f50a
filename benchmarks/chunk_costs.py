"""``python -m benchmarks.chunk_costs [--model tiny|small|PATH] [--codes 500] [--max-batch 4]``:
what streamed decoding costs the device against offline decoding, solve by solve.

The ``e2e --stream`` suite (:mod:`benchmarks.stream_suite`) measures streamed speech end to end,
where a chunk solve's time hides in the other stages' steps (they wait behind it on the device).
This times the solves alone, on the suite's checkpoint and code2wav sizes (``--max-batch``
requests of ``--codes`` codes, the shipped stage YAML's chunks): every chunk program, each
``(rows, window)`` of the decoder's closed set, at ``--num-steps`` grid points; and the offline
solve of one request and of ``--max-batch``. Then, per request of ``--codes`` codes, the
device time of its chunks (each chunk's window padded as the decoder pads it, its rows all that
window's) against its offline solve, at one row and at ``--max-batch``: the share of device
time streamed decoding adds, which is what bounds the streamed throughput where the device is
the bottleneck (a compute-bound CPU), and what the per-solve cost is where it is not.

Every time is the least of ``--repeats`` calls after ``warmup()`` (nothing compiles in them).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from benchmarks.roofline import best_of
from omni_jax import OmniJaxPipeline, Token2WavParams
from omni_jax.cli_errors import plain_text


def chunk_table(pipe: OmniJaxPipeline, num_steps: int, repeats: int) -> dict[tuple[int, int], float]:
    """Seconds of each chunk program ``(rows, window codes)``, every row solving ``num_steps``
    grid points (the padded batch's placeholder rows, given the steps real rows ask for)."""
    decoder = pipe.stages[-1].decoder
    seconds = {}
    for rows, window in decoder.buckets.shapes():
        batch = decoder.pad([], rows, window)
        batch.num_steps[:] = num_steps
        seconds[(rows, window)] = best_of(lambda b=batch: decoder.decode(b), repeats)
    return seconds


def offline_seconds(pipe: OmniJaxPipeline, codes: int, rows: int, num_steps: int, repeats: int) -> float:
    """Seconds of ``run()`` decoding ``rows`` requests of ``codes`` codes offline, one solve."""
    vocab = pipe.stages[-1].codec_vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab - 1, codes).tolist()} for _ in range(rows)]
    params = [Token2WavParams(num_steps=num_steps, seed=i) for i in range(rows)]
    return best_of(lambda: pipe.run(prompts, params, progress=False), repeats)


def report(pipe: OmniJaxPipeline, codes: int, max_batch: int, num_steps: int, repeats: int) -> list[str]:
    decoder = pipe.stages[-1].decoder
    chunks = decoder.planner.split(codes)
    windows = [decoder.buckets.length_for(decoder.width(c)) for c in chunks]
    table = chunk_table(pipe, num_steps, repeats)
    lines = ["rows  window (codes)  ms      us per code-row"]
    for (rows, window), s in sorted(table.items()):
        lines.append(f"{rows:4d}  {window:14d}  {s * 1e3:6.1f}  {s * 1e6 / (rows * window):6.1f}")
    repeats_per_code = decoder.planner.repeats
    kept = [c.keep_len // repeats_per_code for c in chunks]
    lines.append(f"a request of {codes} codes: chunks of {kept} codes, solved in windows of {windows} codes")
    for rows in sorted({1, decoder.buckets.rows_for(max_batch)}):
        streamed = sum(table[(rows, w)] for w in windows) / rows
        offline = offline_seconds(pipe, codes, rows, num_steps, repeats) / rows
        lines.append(
            f"  {rows} row(s) a solve: streamed {streamed * 1e3:.1f} ms a request in {len(chunks)} solves, "
            f"offline {offline * 1e3:.1f} ms in one: streamed / offline {streamed / offline:.2f}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.chunk_costs", description=plain_text(__doc__.split("\n\n")[0])
    )
    p.add_argument("--model", default="tiny", help="tiny, small, or a Qwen2.5-Omni checkpoint directory")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    p.add_argument("--codes", type=int, default=500, help="codes a request (500: 10 s of speech)")
    p.add_argument(
        "--max-batch", type=int, default=4, help="code2wav's max_batch (the suite's: its concurrency)"
    )
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")
    from benchmarks.harness import set_threads, sized_code2wav_config
    from benchmarks.models import resolve_model

    set_threads()
    kind = "qwen2_5_omni_long_replies" if args.model in ("tiny", "small") else "qwen2_5_omni"
    path = resolve_model(args.model, Path(args.cache_dir), kind)
    config = sized_code2wav_config(Path(args.cache_dir), args.max_batch, args.codes)
    pipe = OmniJaxPipeline.from_pretrained(path, stages=["code2wav"], stage_config=config)
    pipe.warmup()
    print(f"== {args.model}: code2wav solves, {args.num_steps} grid points, least of {args.repeats}")
    print("\n".join(report(pipe, args.codes, args.max_batch, args.num_steps, args.repeats)))


if __name__ == "__main__":
    main()
