"""The host's share of an AR decode step, by phase, at several batch sizes, with no device work.

Why: when the device step is short (small models, a GPU), the step is as slow as the host's
Python that schedules it, lays out its inputs and applies its results; on an H200 the AR
suite's `small` steps took 2.4 to 4.2 ms against 0.4 ms of weight matmuls (RESULTS.md). This
times each phase alone, on the same engine objects a step uses, with no program run, so a
change to the host path shows here however noisy the device side is: ``schedule``
(:meth:`Scheduler.schedule`), ``pack`` (the forward's inputs, ``ARRunner._pack``), ``sampling``
(the sampler's rows, ``ARRunner._sampling``) and ``update`` (:meth:`Scheduler.commit` and
:meth:`Scheduler.update` on a step's drawn tokens). Requests decode greedily after prompts of
``--prompt`` tokens on the tiny Qwen2 checkpoint; medians over ``--repeats`` steps.
Usage: ``python -m benchmarks.host_step [--rows 1,32,256] [--prompt 100] [--penalty 1.05] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.models import resolve_model
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.cli_errors import plain_text
from omni_jax.engine.kv_cache import pages_needed
from omni_jax.engine.scheduler import ARRequest, Scheduler
from omni_jax.engine.step import StepResult

PHASES = ("schedule", "pack", "sampling", "update")
PROMPT_STEPS_MARGIN = 32
"""Tokens a request may draw while the others' prompts are still being computed (before the
timed steps), so that none ends during them."""


def drawn(rows: int, token: int = 5) -> StepResult:
    """A step's results as the device would give them back: one finite token per row."""
    return StepResult(np.full(rows, token), np.ones(rows, bool), None, None, None, None)


def decode_phases(
    pipe: OmniJaxPipeline, rows: int, prompt: int, repeats: int, penalty: float = 1.0
) -> dict[str, float]:
    """Median seconds of each phase of a step of ``rows`` decoding requests; ``penalty`` other
    than 1: a repetition penalty (every talker step's, by default), whose ids the penalties
    read from the runner's id table on the device, not from the sampler's rows."""
    engine = pipe.stages[0].engine
    scheduler: Scheduler = engine.scheduler
    runner = engine.runner
    params = SamplingParams(
        temperature=0,
        repetition_penalty=penalty,
        max_tokens=repeats + PROMPT_STEPS_MARGIN,
        ignore_eos=True,
    )
    for k in range(rows):
        scheduler.add(ARRequest(f"host-{rows}-{k}", k, list(range(10, 10 + prompt)), params, seed=k))
    while scheduler.waiting or any(r.num_computed < prompt for r in scheduler.running):
        step = scheduler.schedule()
        scheduler.commit(step)
        scheduler.update(step, drawn(len(step)))
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = scheduler.schedule()
        t1 = time.perf_counter()
        if len(step) != rows:
            raise RuntimeError(f"a step of {len(step)} rows, not {rows}: the requests did not all decode")
        step_rows = [row for _, row in step]
        n = runner.rows_bucket(rows)
        p = runner.pages_bucket(max(pages_needed(r.end, runner.geometry.page_size) for r in step_rows))
        sources = list(range(rows))
        t2 = time.perf_counter()
        runner._pack(step_rows, n, p, sources)
        t3 = time.perf_counter()
        runner._sampling(step_rows, runner.sequences(n))
        t4 = time.perf_counter()
        scheduler.commit(step)
        scheduler.update(step, drawn(rows))
        t5 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t3 - t2, t4 - t3, t5 - t4), strict=True):
            samples[phase].append(seconds)
    for req in list(scheduler.running):
        scheduler.abort(req.request_id)
    return {phase: statistics.median(v) for phase, v in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_step", description=plain_text(__doc__))
    parser.add_argument("--rows", default="1,32,256", help="decoding requests a step, comma-separated")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens of each request")
    parser.add_argument("--repeats", type=int, default=50, help="steps timed per batch size")
    parser.add_argument(
        "--penalty",
        type=float,
        default=1.0,
        help="repetition penalty of every request (the talker's 1.05)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/omni_jax_bench"))
    parser.add_argument("--json", type=Path, help="write the medians (seconds) here")
    args = parser.parse_args(argv)
    sizes = sorted({int(x) for x in args.rows.split(",")})
    path = resolve_model("tiny", args.cache_dir, "qwen2")
    max_len = -(-(args.prompt + args.repeats + PROMPT_STEPS_MARGIN + 1) // 64) * 64
    pipe = OmniJaxPipeline.from_pretrained(path, max_num_seqs=sizes[-1], max_model_len=max(max_len, 256))
    print(
        f"host phases of one decode step, ms (median of {args.repeats}; prompts of {args.prompt} tokens; "
        f"repetition penalty {args.penalty})"
    )
    print(f"{'rows':>6} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'total':>9}")
    result = {}
    for rows in sizes:
        phases = decode_phases(pipe, rows, args.prompt, args.repeats, args.penalty)
        result[str(rows)] = phases
        cells = " ".join(f"{phases[p] * 1e3:9.3f}" for p in PHASES)
        print(f"{rows:>6} {cells} {sum(phases.values()) * 1e3:9.3f}")
    if args.json:
        record = {"suite": "host_step", "prompt": args.prompt, "penalty": args.penalty, "s": result}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
