"""``omni-jax``: run, serve, convert, plan, demo and bench from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from omni_jax.cli_engine import EngineOptions, add_engine_arguments, gib
from omni_jax.cli_errors import OneLineParser, make_output_folder, output_folder, run_command
from omni_jax.interrupts import Interrupts


def _media_file(flag: str, path: str) -> str:
    """A media file named on the command line, which the processor reads (a video file sampled at
    ``--fps``, else the model's rate; a ``.npy`` array of frames as saved)."""
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path}: no such file")
    return path


def _prompt(pipe: Any, args: argparse.Namespace) -> str | dict[str, Any]:
    """``--prompt`` as the user's turn of a chat (the checkpoint's chat template), with the media
    files, when the pipeline speaks or media are given: a talker voices the reply's assistant
    turn (Qwen3-Omni's needs one), and the template places each item. A text-only pipeline
    completes the text as given. ``--speaker`` picks the voice of a pipeline that speaks."""
    first = pipe.stages[0]
    if not first.accepts_text:
        raise ValueError(f"the {first.config.name!r} stage takes token ids, not --prompt text")
    if args.audio or args.image or args.video or pipe.speaks:
        content = [{"type": "audio", "audio": _media_file("--audio", a)} for a in args.audio]
        content += [{"type": "image", "image": i} for i in args.image]
        content += [{"type": "video", "video": _media_file("--video", v)} for v in args.video]
        content.append({"type": "text", "text": args.prompt})
        kwargs: dict[str, Any] = {"use_audio_in_video": True} if args.use_audio_in_video else {}
        if args.fps is not None:
            kwargs["fps"] = args.fps
        prompt: dict[str, Any] = pipe.chat_prompt([{"role": "user", "content": content}], **kwargs)
    elif args.speaker is None:
        return args.prompt
    else:
        prompt = {"prompt": args.prompt}
    if args.speaker is not None:
        prompt["speaker"] = args.speaker
    return prompt


def _run(args: argparse.Namespace) -> int:
    """``omni-jax run``: a Ctrl-C that JAX's callbacks swallow still ends it, while JAX is
    imported and while the checkpoint loads and the prompt runs (:class:`Interrupts`, entered
    again after ``initialize``: a multi-process run's ``jax.distributed`` puts a SIGTERM handler
    of its own over any there, which only records the signal)."""
    with Interrupts():
        from omni_jax.parallel import initialize

        engine = EngineOptions.from_args(args)
        out_dir = None if args.output_dir is None else output_folder("--output-dir", args.output_dir)
    initialize(args.coordinator_address, args.num_processes, args.process_id)
    with Interrupts() as interrupts:
        return _generate(args, engine, out_dir, interrupts)


def _generate(
    args: argparse.Namespace, engine: EngineOptions, out_dir: Path | None, interrupts: Interrupts
) -> int:
    """Load the pipeline, run the prompt, print (and write) the reply; ``interrupts`` is checked
    between the steps where a swallowed Ctrl-C would otherwise let the run go on."""
    from omni_jax import OmniJaxPipeline, SamplingParams

    # Bars for a person watching (loading a real checkpoint takes minutes); none in a log or a
    # pipe, where a mistake stays the one line it is.
    shown = sys.stderr.isatty()
    pipe = OmniJaxPipeline.from_pretrained(args.model, progress=shown, **engine.pipeline_kwargs())
    interrupts.check()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    # The flags set the first (text) stage's sampling; later stages keep their YAML defaults,
    # seeded by --seed too so that a seeded run says the same every time.
    later = [
        None if args.seed is None else dataclasses.replace(s.defaults, seed=args.seed)
        for s in pipe.stages[1:]
    ]
    per_stage = params if len(pipe.stages) == 1 else [params, *later]
    outs = pipe.run([_prompt(pipe, args)], per_stage, progress=shown)
    interrupts.check()
    if not outs:  # not process 0 of a multi-process run: it printed nothing and wrote nothing
        return 0
    out = outs[0]
    if out.error is not None:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.text if out.text is not None else out.token_ids)
    if out_dir is None and out.audio is not None:
        seconds = len(out.audio) / out.sample_rate
        print(
            f"{seconds:.2f} s of audio made and not written: --output-dir DIR writes it as a WAV",
            file=sys.stderr,
        )
    if out_dir is not None:
        make_output_folder("--output-dir", out_dir)
        (out_dir / f"{out.request_id}.txt").write_text(out.text or " ".join(map(str, out.token_ids)))
        print(f"wrote {out_dir / (out.request_id + '.txt')}", file=sys.stderr)
        wav = out_dir / f"{out.request_id}.wav"
        if out.audio is not None:
            out.save_wav(wav)
            print(
                f"wrote {wav} ({len(out.audio) / out.sample_rate:.2f} s at {out.sample_rate} Hz)",
                file=sys.stderr,
            )
        elif wav.exists():  # an earlier run's voice beside this run's text would read as its own
            wav.unlink()
            print(f"removed {wav}, an earlier run's: this one made no audio", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Print the memory plan of ``from_pretrained(MODEL, ...)`` from its ``config.json`` alone."""
    from omni_jax.planning import GPU_SIZES_GIB, plan_memory

    plan = plan_memory(args.model, **EngineOptions.from_args(args).plan_kwargs())
    print(plan.table(tuple(sorted({*GPU_SIZES_GIB, *args.gpu_memory}))))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from omni_jax.demo import run_demo

    return run_demo(Path(args.cache_dir), output_folder("--output-dir", args.output_dir), args.model)


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.run import main as bench_main

    return bench_main(args.rest, prog="omni-jax bench")


def main(argv: list[str] | None = None) -> int:
    """The ``omni-jax`` console script; a user's mistake is one line on stderr and exit code 2
    (:mod:`omni_jax.cli_errors`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    lead = 0  # ``omni-jax --debug bench ...`` as ``omni-jax bench ... --debug``
    while argv[lead : lead + 1] == ["--debug"]:
        lead += 1
    if argv[lead : lead + 1] == ["bench"]:  # the rest is benchmarks.run's (REMAINDER rejects leading options)
        rest = [a for a in argv[lead + 1 :] if a != "--debug"]
        return run_command(_bench, argparse.Namespace(rest=rest, debug=len(rest) < len(argv) - 1))
    from checkpoints_convert import cli as convert_cli
    from omni_jax.demo import DEMO_MODELS
    from omni_jax.serve import cli as serve_cli

    p = OneLineParser(prog="omni-jax")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate for one prompt")
    r.add_argument("model", help="an HF checkpoint dir or a checkpoints_convert dir")
    r.add_argument(
        "--prompt",
        required=True,
        help="the text: the user's turn of a chat when the pipeline speaks or media are given, "
        "else completed as given",
    )
    r.add_argument("--max-tokens", type=int, default=64, help="of the text (first) stage")
    r.add_argument("--temperature", type=float, default=0.0, help="of the text (first) stage")
    r.add_argument("--seed", type=int, default=None, help="seeds every stage's sampling (reproducible runs)")
    r.add_argument("--output-dir", default=None, help="write <request_id>.txt (and .wav when it speaks)")
    r.add_argument(
        "--audio", action="append", default=[], help="an audio file: WAV, mp3, flac, ... (repeatable)"
    )
    r.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    r.add_argument(
        "--video",
        action="append",
        default=[],
        help="a video file (mp4, webm, ...) or frames as .npy (repeatable)",
    )
    r.add_argument(
        "--use-audio-in-video", action="store_true", help="each video file's own audio track is heard with it"
    )
    r.add_argument(
        "--fps",
        type=float,
        default=None,
        help="frames a second video files are sampled at (default: the model's)",
    )
    r.add_argument(
        "--speaker",
        default=None,
        help="the voice (Qwen2.5-Omni: Chelsie, Ethan; Qwen3-Omni: Aiden, Chelsie, Ethan; any case)",
    )
    add_engine_arguments(r)
    r.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    r.add_argument(
        "--num-processes", type=int, default=None, help="how many processes run it (multi-process)"
    )
    r.add_argument("--process-id", type=int, default=None, help="this process's index, 0 on the coordinator")
    r.set_defaults(fn=_run)
    c = sub.add_parser(
        "convert", help="HF checkpoint -> Orbax checkpoint", description=convert_cli.DESCRIPTION
    )
    convert_cli.add_arguments(c)
    c.set_defaults(fn=convert_cli.run)
    pl = sub.add_parser(
        "plan", help="per-device bytes of weights, KV cache and largest step (from the configs, no weights)"
    )
    pl.add_argument(
        "model",
        help="a checkpoint directory: its config.json, preprocessor_config.json (the thinker's encoder "
        "calls) and, without a config dtype, a weight file's header are read; no weights",
    )
    pl.add_argument(
        "--gpu-memory",
        type=gib,
        action="append",
        default=[],
        help="also judge GPUs of this many GiB besides 24, 40 and 80, e.g. 141 (repeatable)",
    )
    add_engine_arguments(pl, planning=True)
    pl.set_defaults(fn=_plan)
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat completions with text and speech, completions)"
    )
    serve_cli.add_arguments(s)
    s.set_defaults(fn=serve_cli.run)
    d = sub.add_parser("demo", help="build a tiny model locally and run it end to end")
    d.add_argument("--model", choices=list(DEMO_MODELS), default="qwen2.5-omni", help="which tiny model")
    d.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "omni_jax" / "demo"),
        help="where the built checkpoint is kept, rebuilt only when its recipe changes",
    )
    d.add_argument(
        "--output-dir",
        default="omni_jax_demo_output",
        help="write each reply's text and WAV and the report here",
    )
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="benchmarks (see python -m benchmarks.run --help)")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="benchmarks.run's arguments")
    b.set_defaults(fn=_bench)
    args, unknown = p.parse_known_args(argv)
    if unknown:  # said by the subcommand, whose --help lists what it takes
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
