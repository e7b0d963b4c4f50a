"""``omni-jax``: run, convert, demo and bench from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _prompt(pipe: Any, args: argparse.Namespace) -> str | dict[str, Any]:
    """The prompt text alone, or with ``--audio``/``--image`` files a chat prompt that holds them."""
    if not (args.audio or args.image):
        return args.prompt
    content = [{"type": "audio", "audio": a} for a in args.audio]
    content += [{"type": "image", "image": i} for i in args.image]
    content.append({"type": "text", "text": args.prompt})
    return pipe.chat_prompt([{"role": "user", "content": content}])


def _run(args: argparse.Namespace) -> int:
    from omni_jax import OmniJaxPipeline, SamplingParams
    from omni_jax.parallel import initialize

    initialize(args.coordinator_address, args.num_processes, args.process_id)
    pipe = OmniJaxPipeline.from_pretrained(args.model, stages=args.stages, dtype=args.dtype, mesh=args.mesh)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    outs = pipe.run([_prompt(pipe, args)], params if len(pipe.stages) == 1 else None, progress=False)
    if not outs:  # not process 0 of a multi-process run: it printed nothing and wrote nothing
        return 0
    out = outs[0]
    print(out.text if out.text is not None else out.token_ids)
    if args.output_dir:
        d = Path(args.output_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{out.request_id}.txt").write_text(out.text or " ".join(map(str, out.token_ids)))
        print(f"wrote {d / (out.request_id + '.txt')}", file=sys.stderr)
    return 0 if out.finish_reason != "error" else 1


def _demo(args: argparse.Namespace) -> int:
    from omni_jax.demo import run_demo

    return run_demo(Path(args.cache_dir), Path(args.output_dir))


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.run import main as bench_main

    return bench_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    from checkpoints_convert import cli as convert_cli
    from omni_jax.parallel.mesh import parse_mesh

    p = argparse.ArgumentParser(prog="omni-jax")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate for one prompt")
    r.add_argument("model")
    r.add_argument("--prompt", required=True)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--dtype", default=None)
    r.add_argument("--output-dir", default=None)
    r.add_argument("--stages", type=lambda s: s.split(","), default=None, help="e.g. thinker")
    r.add_argument("--audio", action="append", default=[], help="a .wav file (repeatable)")
    r.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    r.add_argument("--mesh", type=parse_mesh, default=None, help="every stage's mesh, e.g. data=2,model=4")
    r.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    r.add_argument("--num-processes", type=int, default=None)
    r.add_argument("--process-id", type=int, default=None)
    r.set_defaults(fn=_run)
    c = sub.add_parser("convert", help="HF checkpoint -> Orbax checkpoint")
    convert_cli.add_arguments(c)
    c.set_defaults(fn=convert_cli.run)
    d = sub.add_parser("demo", help="build a tiny model locally and run it end to end")
    d.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "demo"))
    d.add_argument("--output-dir", default="omni_jax_demo_output")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="benchmarks (see python -m benchmarks.run --help)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
