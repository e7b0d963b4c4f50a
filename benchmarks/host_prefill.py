"""The host's share of an omni model's prompt step: laying out its inputs, with no device work.

Why: a prompt step of a thinker or talker carries up to ``max_num_batched_tokens`` tokens, and
the host lays out each one's model inputs (its stage's ``StepInputs.pack``: a thinker's encoder
rows, a talker's thinker rows) besides the step's cache layout. On a GPU a 7B prompt step of a
few thousand tokens takes tens of milliseconds, so host work that goes a Python call a token is
of the same order. This times ``ARRunner._pack`` (both parts) on a real prompt step of each
stage, the step the scheduler gives for the requests queued: ``thinker``, Qwen2.5-Omni's
thinker on chat prompts with an image each (their encoder rows encoded once, before the timing,
as ``prepare`` does); ``talker`` and ``qwen3_talker``, the talkers on prompts of ``--prompt``
tokens (their stage records built directly: ``pack`` reads only them). Medians over
``--repeats`` packs of the same step.
Usage: ``python -m benchmarks.host_prefill [--requests 4] [--prompt 448] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.e2e_suite import picture
from benchmarks.models import QWEN3_OMNI, resolve_model
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.ar_engine import AREngine
from omni_jax.engine.kv_cache import pages_needed
from omni_jax.stages.base import StageInput
from omni_jax.stages.qwen3_talker import TalkerRequest as Qwen3TalkerRequest
from omni_jax.stages.rows import GrowingRows
from omni_jax.stages.talker import TalkerRequest

IMAGE_SIDE = 448
"""The thinker prompts' image side in pixels: 256 placeholder tokens each at the tiny
checkpoints' 14-pixel patches merged 2 x 2."""
MAX_MODEL_LEN = 512
"""The tiny checkpoints' ``max_position_embeddings``."""


def pack_seconds(
    engine: AREngine, requests: Sequence[tuple[list[int], Any]], repeats: int
) -> tuple[float, int]:
    """Median seconds of ``ARRunner._pack`` on the prompt step the scheduler gives for
    ``requests`` (prompt ids, stage record), and that step's tokens. The requests stay queued
    (each stage's engine serves one case)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    for i, (ids, state) in enumerate(requests):
        engine.add_request(f"prefill-{i}", ids, params, state)
    step = engine.scheduler.schedule()
    rows = [row for _, row in step]
    if engine.inputs.prepare(rows):
        raise RuntimeError("a request's encoders failed")
    runner = engine.runner
    tokens = sum(len(r.token_ids) for r in rows)
    n = runner.rows_bucket(tokens)
    p = runner.pages_bucket(max(pages_needed(r.end, runner.geometry.page_size) for r in rows))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner._pack(rows, n, p)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), tokens


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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_prefill", description=__doc__)
    parser.add_argument("--requests", type=int, default=4, help="prompts in the step")
    parser.add_argument(
        "--prompt", type=int, default=448, help="tokens of each talker prompt (below 512 - 8)"
    )
    parser.add_argument("--repeats", type=int, default=30, help="packs timed per stage")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/omni_jax_bench"))
    parser.add_argument("--json", type=Path, help="write the medians (seconds) here")
    args = parser.parse_args(argv)
    budget = max(args.requests * args.prompt, 2048)
    omni = OmniJaxPipeline.from_pretrained(
        resolve_model("tiny", args.cache_dir, "qwen2_5_omni"),
        stages=["thinker", "talker"],
        max_num_seqs=args.requests,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
    )
    qwen3 = OmniJaxPipeline.from_pretrained(
        resolve_model("tiny", args.cache_dir, QWEN3_OMNI),
        stages=["thinker", "talker"],
        max_num_seqs=args.requests,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
    )
    cases: dict[str, tuple[AREngine, Callable[[], list[tuple[list[int], Any]]]]] = {
        "thinker": (omni.stages[0].engine, lambda: thinker_requests(omni, args.requests)),
        "talker": (omni.stages[1].engine, lambda: talker_requests(omni, args.requests, args.prompt)),
        "qwen3_talker": (
            qwen3.stages[1].engine,
            lambda: qwen3_talker_requests(qwen3, args.requests, args.prompt),
        ),
    }
    print(
        f"host layout of one prompt step (ARRunner._pack), median of {args.repeats}; {args.requests} requests"
    )
    print(f"{'stage':>13} {'tokens':>7} {'ms':>9} {'us/token':>9}")
    result = {}
    for name, (engine, requests) in cases.items():
        seconds, tokens = pack_seconds(engine, requests(), args.repeats)
        result[name] = {"s": seconds, "tokens": tokens}
        print(f"{name:>13} {tokens:>7} {seconds * 1e3:9.3f} {seconds / tokens * 1e6:9.2f}")
    if args.json:
        record = {"suite": "host_prefill", "requests": args.requests, "prompt": args.prompt, "s": result}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
