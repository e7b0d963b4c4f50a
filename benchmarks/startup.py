"""``python -m benchmarks.startup [--model tiny|small|PATH] [--cache-dir D] [--json FILE]``: what a
server's start costs, and what each bucket set's padding costs.

The whole pipeline of the checkpoint (Qwen2.5-Omni: thinker, talker, code2wav; Qwen2: the LLM)
is built with the engine's default settings and warmed up, three times, each in a fresh process:

- ``cold``: JAX's persistent compilation cache off, so every program is compiled;
- ``cache fill``: the cache on, in an empty directory, which this start fills;
- ``warm start``: the cache on, in that directory: programs are loaded, not compiled.

Each start reports, per stage, the programs its bucket set holds (``WarmupReport.programs``),
the XLA compilations counted while it warmed up, and the seconds; loading the weights is timed
apart.

Counted, not measured (from the built stages' own bucket functions): the padding each bucket set
costs, as the mean and the worst of padded over real size, over every real size up to the
largest (each equally likely): AR token rows of a step (the forward) and sequences (the
sampler), code2wav code lengths and rows. The thinker's encoder ladders are
:mod:`benchmarks.encoder_buckets`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_jax.cli_errors import OneLineParser, plain_text


def padding(size_of: Callable[[int], int], largest: int) -> dict[str, float]:
    """Mean and worst ``size_of(n) / n`` over ``n`` in ``[1, largest]``."""
    ratios = [size_of(n) / n for n in range(1, largest + 1)]
    return {"mean": sum(ratios) / len(ratios), "worst": max(ratios), "largest": largest}


def stage_padding(stage: Any) -> dict[str, dict[str, float]]:
    """The padding figures of one built stage (AR or code2wav)."""
    runner = stage.engine.runner if hasattr(stage, "engine") else stage.runner
    if hasattr(runner, "rows_bucket"):
        return {
            "token rows": padding(runner.rows_bucket, runner.most_rows),
            "sequences": padding(runner.sequences, runner.max_num_seqs),
        }
    b = runner.buckets
    return {"codes": padding(b.length_for, b.lengths[-1]), "rows": padding(b.rows_for, b.rows[-1])}


def _child(model: str, cache: str) -> None:
    """One start in this fresh process; prints its figures as one JSON line."""
    from omni_jax import OmniJaxPipeline

    t0 = time.perf_counter()
    pipe = OmniJaxPipeline.from_pretrained(model, compilation_cache=False if cache == "off" else cache)
    load_s = time.perf_counter() - t0
    report = pipe.warmup(progress=False)
    stages = {
        name: {"programs": s.programs, "compiles": s.compiles, "seconds": s.seconds}
        for name, s in report.stages.items()
    }
    pad = {s.config.name: stage_padding(s) for s in pipe.stages}
    print(json.dumps({"load_s": load_s, "stages": stages, "padding": pad}))


def start(model: Path, cache: str) -> dict[str, Any]:
    """The figures of one start in a fresh process (``cache``: a directory, or ``off``)."""
    cmd = [sys.executable, "-m", "benchmarks.startup", "child", str(model), cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(starts: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'start':<12}{'stage':<10}{'programs':>9}{'compiles':>9}{'warm-up s':>11}{'load s':>8}"]
    for label, fig in starts.items():
        for name, s in fig["stages"].items():
            lines.append(
                f"{label:<12}{name:<10}{s['programs']:>9}{s['compiles']:>9}{s['seconds']:>11.1f}"
                f"{fig['load_s']:>8.1f}"
            )
    lines.append("padding (padded / real size, mean and worst over every real size up to the largest):")
    for name, figs in next(iter(starts.values()))["padding"].items():
        for what, p in figs.items():
            lines.append(
                f"  {name:<9} {what:<11} mean {p['mean']:.3f}  worst {p['worst']:.3f}  (up to {p['largest']})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        _child(argv[1], argv[2])
        return 0
    from benchmarks.models import resolve_model

    p = OneLineParser(
        prog="python -m benchmarks.startup", description=plain_text(__doc__.split("\n\n", 1)[0])
    )
    p.add_argument("--model", default="tiny", help="tiny | small | a checkpoint directory")
    p.add_argument(
        "--kind", default="qwen2_5_omni", help="the model_type of tiny/small (qwen2, qwen2_5_omni)"
    )
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.model in ("tiny", "small"):
        path = resolve_model(args.model, Path(args.cache_dir), args.kind)
    else:
        path = Path(args.model)
    with tempfile.TemporaryDirectory() as xla_cache:
        starts = {
            "cold": start(path, "off"),
            "cache fill": start(path, xla_cache),
            "warm start": start(path, xla_cache),
        }
    print(f"{path} (default engine settings)\n{table(starts)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(path), "starts": starts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
