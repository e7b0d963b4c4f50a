"""The host's share of an omni model's AR step: laying out its inputs, with no device work.

Why: a prompt step of a thinker or talker carries up to ``max_num_batched_tokens`` tokens, and
the host lays out each one's model inputs (its stage's ``StepInputs.pack``: a thinker's encoder
rows, a talker's thinker rows) besides the step's cache layout. A GPU runs a prompt step of a
few thousand tokens quickly enough that host work of a Python call a token is of its order, and
a talker's decode step has hundreds of rows.
This times ``ARRunner._pack`` (both parts) on each stage's steps: ``prompt``, the step the
scheduler gives for ``--requests`` queued requests: Qwen2.5-Omni's thinker on chat prompts with
an image each (their encoder rows encoded once, before the timing, as ``prepare`` does), the
talkers on prompts of ``--prompt`` tokens (their stage records built directly: ``pack`` reads
only them); ``decode``, ``--decode-rows`` rows of the talkers' first reply token, one a request.
Beside it, the rows' rotary positions as the scheduler reads them (``StepInputs.positions`` a
row; a decode row's every step). Medians over ``--repeats`` of the same step.
Usage: ``python -m benchmarks.host_pack [--requests 4] [--prompt 448] [--decode-rows 256] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.e2e_suite import picture
from benchmarks.harness import wall_times
from benchmarks.models import QWEN3_OMNI, resolve_model
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.cli_errors import plain_text
from omni_jax.engine.ar_engine import AREngine
from omni_jax.engine.ar_runner import ARRunner
from omni_jax.engine.kv_cache import pages_needed
from omni_jax.engine.step import PENDING_TOKEN, StepRow
from omni_jax.stages.base import StageInput
from omni_jax.stages.qwen3_talker import TalkerRequest as Qwen3TalkerRequest
from omni_jax.stages.rows import GrowingRows
from omni_jax.stages.talker import TalkerRequest

IMAGE_SIDE = 448
"""The thinker prompts' image side in pixels: 256 placeholder tokens each at the tiny
checkpoints' 14-pixel patches merged 2 x 2."""
MAX_MODEL_LEN = 512
"""The tiny checkpoints' ``max_position_embeddings``."""
DECODE_PROMPT = 16
"""Prompt tokens of the records of the decode steps' rows."""


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``work()`` over ``repeats`` calls."""
    return statistics.median(wall_times(work, repeats))


def timed_pack(runner: ARRunner, rows: Sequence[StepRow], repeats: int) -> float:
    """Median seconds of ``ARRunner._pack`` on a step of ``rows``; a row with a pending token
    reads the draw of the row of its index in the step before (as overlapped decode steps do)."""
    sources = list(range(len(rows)))
    n = runner.rows_bucket(sum(len(r.token_ids) for r in rows))
    p = runner.pages_bucket(max(pages_needed(r.end, runner.geometry.page_size) for r in rows))
    return median_seconds(lambda: runner._pack(rows, n, p, sources), repeats)


def timed_positions(engine: AREngine, rows: Sequence[StepRow], repeats: int) -> float:
    """Median seconds of the rows' rotary positions as the scheduler reads them for a step, a
    :meth:`StepInputs.positions` call a row (its decode rows' every step)."""
    positions = engine.inputs.positions
    return median_seconds(lambda: [positions(r.state, r.start, r.end) for r in rows], repeats)


def prompt_step(engine: AREngine, requests: Sequence[tuple[list[int], Any]]) -> list[StepRow]:
    """The rows of the prompt step the scheduler gives for ``requests`` (prompt ids, stage
    record), prepared (encoders run). The requests stay queued (an engine serves one case)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    for i, (ids, state) in enumerate(requests):
        engine.add_request(f"prefill-{i}", ids, params, state)
    rows = [row for _, row in engine.scheduler.schedule()]
    if engine.inputs.prepare(rows):
        raise RuntimeError("a request's encoders failed")
    return rows


def decode_step(engine: AREngine, requests: Sequence[tuple[list[int], Any]]) -> list[StepRow]:
    """A decode row for each of ``requests``: its first reply token, pending (drawn by the step
    before, whose frame a Qwen3-Omni talker reads on the device), on pages of its own."""
    rows = []
    for k, (ids, state) in enumerate(requests):
        start = len(ids)
        held = pages_needed(start + 1, engine.runner.geometry.page_size)
        rows.append(
            StepRow(
                token_ids=[PENDING_TOKEN],
                positions=engine.inputs.positions(state, start, start + 1),
                pages=list(range(k * held, (k + 1) * held)),
                start=start,
                sample=True,
                params=SamplingParams(temperature=0),
                seed=k,
                draw_index=0,
                id_row=k,
                prompt_len=start,
                suppress=[],
                state=state,
                pending_token=True,
            )
        )
    return rows


def thinker_requests(pipe: OmniJaxPipeline, count: int) -> list[tuple[list[int], Any]]:
    """Chat prompts with an image each, processed by the thinker's frontend as a request is."""
    frontend = pipe.stages[0].frontend
    out = []
    for i in range(count):
        content = [
            {"type": "image", "image": picture(IMAGE_SIDE, IMAGE_SIDE, seed=i)},
            {"type": "text", "text": "what is this"},
        ]
        prompt = pipe.chat_prompt([{"role": "user", "content": content}])
        ids = list(pipe.tokenizer(prompt["prompt"])["input_ids"])
        request = frontend.prepare(i, StageInput(ids, prompt))  # placeholders expanded
        out.append((request.token_ids, request.state))
    return out


def talker_requests(pipe: OmniJaxPipeline, count: int, prompt: int) -> list[tuple[list[int], Any]]:
    """Qwen2.5-Omni talker records of ``prompt`` tokens (a whole table, random rows)."""
    width = pipe.stages[1].frontend.step_inputs.width
    rng = np.random.default_rng(0)
    return [
        (
            [0] * prompt,
            TalkerRequest(
                table=GrowingRows(rng.standard_normal((prompt + 8, width)).astype(np.float32)),
                codec_from=prompt - 2,
                positions=np.tile(np.arange(prompt, dtype=np.int32), (3, 1)),
                rope_delta=0,
                final=True,
            ),
        )
        for _ in range(count)
    ]


def qwen3_talker_requests(pipe: OmniJaxPipeline, count: int, prompt: int) -> list[tuple[list[int], Any]]:
    """Qwen3-Omni talker records of ``prompt`` tokens (whole, random rows)."""
    inputs = pipe.stages[1].frontend.step_inputs
    rng = np.random.default_rng(0)
    return [
        (
            [0] * prompt,
            Qwen3TalkerRequest(
                thinker=rng.standard_normal((prompt, inputs.thinker_width)).astype(np.float32),
                project=rng.integers(0, 2, prompt).astype(np.int32),
                add_codec=rng.integers(0, 2, prompt).astype(bool),
                trailing=GrowingRows(rng.standard_normal((8, inputs.thinker_width)).astype(np.float32)),
                taken=prompt,
                positions=np.tile(np.arange(prompt, dtype=np.int32), (3, 1)),
                rope_delta=0,
                final=True,
            ),
        )
        for _ in range(count)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_pack", description=plain_text(__doc__))
    parser.add_argument("--requests", type=int, default=4, help="prompts in the step")
    parser.add_argument(
        "--prompt", type=int, default=448, help="tokens of each talker prompt (below 512 - 8)"
    )
    parser.add_argument("--decode-rows", type=int, default=256, help="rows of the talkers' decode steps")
    parser.add_argument("--repeats", type=int, default=30, help="packs timed per step")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/omni_jax_bench"))
    parser.add_argument("--json", type=Path, help="write the medians (seconds) here")
    args = parser.parse_args(argv)
    budget = max(args.requests * args.prompt, 2048)
    omni = OmniJaxPipeline.from_pretrained(
        resolve_model("tiny", args.cache_dir, "qwen2_5_omni"),
        stages=["thinker", "talker"],
        max_num_seqs=max(args.requests, args.decode_rows),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
    )
    qwen3 = OmniJaxPipeline.from_pretrained(
        resolve_model("tiny", args.cache_dir, QWEN3_OMNI),
        stages=["thinker", "talker"],
        max_num_seqs=max(args.requests, args.decode_rows),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
    )
    records = {
        "thinker": lambda count, prompt: thinker_requests(omni, count),
        "talker": lambda count, prompt: talker_requests(omni, count, prompt),
        "qwen3_talker": lambda count, prompt: qwen3_talker_requests(qwen3, count, prompt),
    }
    engines = {
        "thinker": omni.stages[0].engine,
        "talker": omni.stages[1].engine,
        "qwen3_talker": qwen3.stages[1].engine,
    }
    print(f"host layout of one step (ARRunner._pack; the rows' positions apart), median of {args.repeats}")
    print(
        f"{'stage':>13} {'step':>7} {'rows':>5} {'tokens':>7} {'ms':>9} {'us/token':>9} {'positions ms':>12}"
    )
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name, engine in engines.items():
        steps = {"prompt": prompt_step(engine, records[name](args.requests, args.prompt))}
        if name != "thinker":  # a thinker's decode rows read no step inputs
            steps["decode"] = decode_step(engine, records[name](args.decode_rows, DECODE_PROMPT))
        for kind, rows in steps.items():
            tokens = sum(len(r.token_ids) for r in rows)
            seconds = timed_pack(engine.runner, rows, args.repeats)
            placed = timed_positions(engine, rows, args.repeats)
            result.setdefault(name, {})[kind] = {
                "s": seconds,
                "positions_s": placed,
                "rows": len(rows),
                "tokens": tokens,
            }
            ms, us = seconds * 1e3, seconds / tokens * 1e6
            print(f"{name:>13} {kind:>7} {len(rows):>5} {tokens:>7} {ms:9.3f} {us:9.2f} {placed * 1e3:12.3f}")
    if args.json:
        record = {
            "suite": "host_pack",
            "requests": args.requests,
            "prompt": args.prompt,
            "decode_rows": args.decode_rows,
            "s": result,
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
