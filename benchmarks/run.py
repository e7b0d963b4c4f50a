"""``python -m benchmarks.run --suite {ar,code2wav,e2e,soak,memory,serve,e2e_stream,ar_qwen3,code2wav_qwen3,
e2e_qwen3,e2e_qwen3_stream,all} --model {tiny,small,PATH} [--reference] [--json FILE] [--profile DIR]
[--dtype D] [--mesh data=D,model=M]``
(also ``omni-jax bench ...``); ``--suite e2e --stream``: streamed speech against offline decoding
(:mod:`benchmarks.stream_suite`); ``--suite e2e_qwen3 --stream``: Qwen3-Omni's time to first audio,
streamed, against transformers' time to its audio and our offline decoding
(:mod:`benchmarks.qwen3_stream_suite`).

``tiny`` and ``small`` name a locally built checkpoint per suite (:mod:`benchmarks.models`); the
suite names the model family: ``ar`` runs Qwen2, ``code2wav`` and ``e2e`` Qwen2.5-Omni,
``ar_qwen3`` Qwen3-Omni's thinker, ``code2wav_qwen3`` its code2wav and ``e2e_qwen3`` all of it (a
PATH must be of the suite's ``model_type``: ``--suite ar_qwen3 --model /ckpt/Qwen3-Omni-30B-A3B-Instruct``).
``soak``, ``memory`` (:mod:`benchmarks.memory_suite`) and ``serve`` (:mod:`benchmarks.serve_suite`)
run Qwen2 (``serve`` a Qwen2.5-Omni PATH too); ``e2e_stream`` and ``e2e_qwen3_stream`` are what
``--stream`` runs. ``all`` runs every registered suite but five (``soak``, ``memory``,
``serve``, ``e2e_stream``, ``e2e_qwen3_stream``, asked for by name; with a PATH, those whose
``model_type`` it is), each in a process of its own (:func:`run_isolated`). Each suite
warms up (compile time reported on its own), measures ours and, with ``--reference``, the
transformers / PyTorch reference on the same requests in this process, prints a table and, with
``--json``, writes the result (a list of results for ``all``); the schema is in
:mod:`benchmarks.harness`. ``--profile DIR`` writes a ``jax.profiler`` trace of each suite's
measured window into ``DIR/<suite>``. torch runs on as many threads as XLA (the cores this
process may use). The exit code is 1 when a suite reports a failure (our greedy tokens disagree
with the reference's beyond a checked near-tie, something compiled after ``warmup()``, audio
beyond the parity bound): each is printed on stderr after its table, and the JSON is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.load_generator import parse_rates
from omni_jax.cli_errors import OneLineParser, plain_text
from omni_jax.parallel.mesh import parse_mesh


@dataclasses.dataclass(frozen=True)
class Suite:
    """``module`` has ``run(path, args) -> dict`` and ``table(result) -> str``; ``model_type`` is
    the checkpoint kind it runs (the key of :data:`benchmarks.models.BUILDERS` for tiny / small);
    ``in_all``: whether ``--suite all`` runs it (the soak, memory, serve and streamed suites are
    asked for by name); ``also``: other ``model_type``s it runs from a checkpoint PATH;
    ``builds``: the key of
    :data:`benchmarks.models.BUILDERS` its tiny / small are built by, when not ``model_type``'s
    (a variant of that model_type)."""

    module: str
    model_type: str
    in_all: bool = True
    also: tuple[str, ...] = ()
    builds: str | None = None

    def kind(self, model: str) -> str:
        """The ``model_type`` to resolve ``--model`` as: ``also``'s one when PATH is of it
        (``builds`` for tiny / small when set)."""
        from benchmarks.models import model_type

        if self.builds and model in ("tiny", "small"):
            return self.builds
        if self.also and (Path(model) / "config.json").exists() and model_type(Path(model)) in self.also:
            return model_type(Path(model))
        return self.model_type


SUITES: dict[str, Suite] = {
    "ar": Suite("benchmarks.ar_suite", "qwen2"),
    "code2wav": Suite("benchmarks.code2wav_suite", "qwen2_5_omni"),
    "e2e": Suite("benchmarks.e2e_suite", "qwen2_5_omni"),
    "soak": Suite("benchmarks.soak_suite", "qwen2", in_all=False),
    "memory": Suite("benchmarks.memory_suite", "qwen2", in_all=False),
    "serve": Suite("benchmarks.serve_suite", "qwen2", in_all=False, also=("qwen2_5_omni",)),
    "e2e_stream": Suite(
        "benchmarks.stream_suite", "qwen2_5_omni", in_all=False, builds="qwen2_5_omni_long_replies"
    ),
    "ar_qwen3": Suite("benchmarks.ar_suite", "qwen3_omni_moe"),
    "code2wav_qwen3": Suite("benchmarks.qwen3_code2wav_suite", "qwen3_omni_moe"),
    "e2e_qwen3": Suite("benchmarks.qwen3_e2e_suite", "qwen3_omni_moe"),
    "e2e_qwen3_stream": Suite("benchmarks.qwen3_stream_suite", "qwen3_omni_moe", in_all=False),
}
"""The registered suites, in the order ``--suite all`` runs them; a new one is one line here.
``e2e_stream`` is what ``--suite e2e --stream`` runs (:data:`STREAMED`). ``ar_qwen3``,
``code2wav_qwen3`` and ``e2e_qwen3`` are the AR, code2wav and e2e suites on Qwen3-Omni (its thinker;
its code2wav; the whole pipeline), ``e2e_qwen3_stream`` its time-to-first-audio suite."""

STREAMED = {"e2e": "e2e_stream", "e2e_qwen3": "e2e_qwen3_stream"}
"""The suite ``--suite NAME --stream`` runs, by NAME."""


def parse_batch_sizes(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts or not all(s.isdigit() and int(s) >= 1 for s in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: positive batch sizes, e.g. 1,8")
    return sorted({int(s) for s in parts})


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any checkpoint is built or anything run, the counts no suite can use and a
    ``--json`` that could not be written (a finished run's result would be lost at its end)."""
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (time per output token needs two tokens)")
    for flag, value in (
        ("--num-requests", args.num_requests),
        ("--min-prompt", args.min_prompt),
        ("--min-codes", args.min_codes),
        ("--repeats", args.repeats),
    ):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    for low, high in (("min_prompt", "max_prompt"), ("min_codes", "max_codes")):
        if getattr(args, low) > getattr(args, high):
            p.error(
                f"--{low.replace('_', '-')} {getattr(args, low)} exceeds --{high.replace('_', '-')} "
                f"{getattr(args, high)}"
            )
    if args.json is not None:
        folder = Path(args.json).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            p.error(f"--json {args.json}: cannot write a file in {folder}")


def parse_ref_batches(text: str) -> list[int | str]:
    sizes: list[int | str] = []
    for s in text.split(","):
        s = s.strip()
        if s == "all" or (s.isdigit() and int(s) >= 1):
            sizes.append(s if s == "all" else int(s))
        elif s:
            raise argparse.ArgumentTypeError(f"{text!r}: positive batch sizes or 'all', e.g. 8,16,all")
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r}: positive batch sizes or 'all', e.g. 8,16,all")
    return sizes


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive client counts, e.g. 1,4,16")
    return levels


def parse_stream_sizes(text: str) -> dict[str, int]:
    """``KEY=N,...``: code2wav ``engine.stream`` keys of either family (its stage refuses the
    other's)."""
    from omni_jax.stages.code2wav import STREAM_KEYS
    from omni_jax.stages.qwen3_code2wav import STREAM_KEYS as QWEN3_KEYS

    keys = sorted({*STREAM_KEYS, *QWEN3_KEYS})
    sizes: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key not in keys or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: KEY=N items, KEY one of {keys}")
        sizes[key] = int(value)
    return sizes


def parser(prog: str = "python -m benchmarks.run") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=plain_text(__doc__.split("\n\n", 1)[1]))
    p.add_argument(
        "--suite",
        choices=[*SUITES, "all"],
        default="ar",
        help="the suite to run (default ar); all: every suite but soak, memory, serve and the streamed ones",
    )
    p.add_argument("--model", default="small", help="tiny | small | a checkpoint directory")
    p.add_argument("--reference", action="store_true", help="also run the PyTorch reference")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument(
        "--profile", default=None, help="write a jax.profiler trace of the measured window to DIR/<suite>"
    )
    p.add_argument(
        "--profile-python",
        action="store_true",
        help="with --profile: also trace every Python call (slows the host; figures then not comparable)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="ours and the reference's dtype (default: ours the checkpoint's, the reference float32)",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="our engine's mesh, e.g. data=2,model=4 (on CPU emulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "omni_jax" / "bench"),
        help="where tiny and small checkpoints are built and kept",
    )
    ar = p.add_argument_group("ar suite (--num-requests, --max-tokens and our engine's sizes: e2e too)")
    ar.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (default: the suite's, 32 for ar, 16 for e2e)",
    )
    ar.add_argument("--max-tokens", type=int, default=64, help="new (e2e: thinker) tokens per request (>= 2)")
    ar.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (tokens)")
    ar.add_argument("--max-prompt", type=int, default=192, help="longest prompt (tokens)")
    ar.add_argument(
        "--ref-batches",
        type=parse_ref_batches,
        default=parse_ref_batches("8,16,32,64,all"),
        help="transformers generate batch sizes, prompts sorted by length (default 8,16,32,64,all)",
    )
    ar.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="our engine's concurrent sequences (ar: default 32; e2e: default the stage YAML's)",
    )
    ar.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="our engine's max_model_len (ar: the workload's longest, at least 512; e2e: the checkpoint's)",
    )
    ar.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="our engine's tokens per step (default 2048)"
    )
    ar.add_argument(
        "--sequential-steps",
        action="store_true",
        help="ar: read each of our steps before scheduling the next (AREngine overlap off), to "
        "measure what overlapping them saves; e2e suites: each stage's step read before the next "
        "stage steps (EngineCore.overlap off), so that a stage's seconds are its own device time",
    )
    c2w = p.add_argument_group(
        "code2wav suites (--num-steps, --guidance-scale: Qwen2.5-Omni's only; --repeats: e2e too)"
    )
    c2w.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        default=[1, 8],
        help="measured batch sizes; the largest is the number of requests (default 1,8)",
    )
    c2w.add_argument(
        "--min-codes",
        type=int,
        default=50,
        help="shortest request (codes, 50 per second; code2wav_qwen3: codec frames, 12.5 per second)",
    )
    c2w.add_argument(
        "--max-codes", type=int, default=200, help="longest request (codes; code2wav_qwen3: frames)"
    )
    c2w.add_argument("--num-steps", type=int, default=10, help="ODE grid points (RK4 steps + 1)")
    c2w.add_argument("--guidance-scale", type=float, default=0.5, help="CFG scale")
    c2w.add_argument("--repeats", type=int, default=2, help="measured rounds (the best is kept)")
    e2e = p.add_argument_group("e2e suite")
    e2e.add_argument(
        "--talker-max-tokens", type=int, default=128, help="codec tokens per request at most (50 per second)"
    )
    e2e.add_argument(
        "--talker-min-tokens",
        type=int,
        default=0,
        help="codec tokens (e2e_qwen3: frames) per request at least, on both sides: random-weight "
        "talkers stop after a few, far shorter than real replies",
    )
    e2e.add_argument(
        "--late-talker",
        action="store_true",
        help="e2e suites: start the talker when the thinker ends (engine.early_start false), not on its "
        "first tokens",
    )
    e2e.add_argument(
        "--audio-seconds", type=float, default=None, help="every audio request's clip (default 0.5 to 1.5 s)"
    )
    e2e.add_argument(
        "--image-size", type=int, default=None, help="each image request's square side (default 56 to 112 px)"
    )
    stream = p.add_argument_group(
        "e2e / e2e_qwen3 --stream (--max-tokens: text tokens; --num-steps, --guidance-scale, --repeats: "
        "as e2e)"
    )
    stream.add_argument(
        "--stream",
        action="store_true",
        help="with --suite e2e or e2e_qwen3: streamed speech against offline decoding",
    )
    stream.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default=[1, 4, 16],
        help="closed-loop clients (default 1,4,16)",
    )
    stream.add_argument("--codes", type=int, default=500, help="talker codes per request, exactly (50 per s)")
    stream.add_argument(
        "--frames", type=int, default=125, help="e2e_qwen3: codec frames per request, exactly (12.5 per s)"
    )
    stream.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends")
    stream.add_argument(
        "--stream-sizes",
        type=parse_stream_sizes,
        default={},
        help="code2wav engine.stream keys to set, e.g. chunk_codes=6,past_codes=4 or max_chunk_frames=25 "
        "(default: shipped)",
    )
    stream.add_argument(
        "--code2wav-device",
        type=int,
        default=None,
        help="code2wav alone on this device (an index into jax.devices()), the other stages on device 0, "
        "so the talker and code2wav run at once (a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)",
    )
    soak = p.add_argument_group("soak suite (--num-requests: 5000 by default)")
    soak.add_argument("--soak-rounds", type=int, default=3, help="rounds under the tight page budget")
    soak.add_argument(
        "--soak-pages", type=int, default=None, help="the tight budget (default: 1.25 full-length sequences)"
    )
    soak.add_argument(
        "--soak-reference",
        type=int,
        default=200,
        help="--reference runs the first N, same caps, in transformers and again in ours for the ratio",
    )
    serve = p.add_argument_group("serve suite (--num-requests: 32 by default; prompts, --max-tokens as ar)")
    serve.add_argument("--rates", type=parse_rates, default=None, help="req/s (default: searched)")
    serve.add_argument(
        "--rate-multiples", type=parse_rates, default=[1.0, 2.0, 5.0, 10.0], help="ours at searched rate x M"
    )
    return p


def suites_for(name: str, model: str) -> list[str]:
    if name != "all":
        return [name]
    from benchmarks.models import BUILDERS, model_type

    if model in ("tiny", "small"):
        return [s for s, suite in SUITES.items() if suite.in_all and model in BUILDERS[suite.model_type]]
    kind = model_type(Path(model))
    matching = [s for s, suite in SUITES.items() if suite.in_all and suite.model_type == kind]
    if not matching:
        raise SystemExit(f"--model {model}: no suite runs model_type {kind!r}")
    return matching


def run_isolated(names: list[str], argv: list[str], command: str, json_path: str | None) -> int:
    """Run each suite of ``names`` in a process of its own, one after the other: ``argv`` with
    ``--suite NAME --json FILE`` appended (argparse keeps an option's last value). Each child's
    table streams through; the results are gathered into ``json_path`` (a list, ``command`` the
    one given here). A suite whose process dies is a failure; the suites after it still run.

    Why: XLA keeps a process's programs loaded while jit's caches hold them, and each XLA CPU
    executable maps memory regions of its own. One process running every suite at ``small``
    failed in the third suite's warm-up, about 180 programs in: LLVM "Cannot allocate memory"
    with most of the RAM free (the signature of the kernel's ``vm.max_map_count``, which one
    pipeline's warm-up once reached), then a segmentation fault that lost the rest of the run.
    A process per suite also starts each suite with fresh torch and XLA thread pools, as a user
    running one suite gets them."""
    import subprocess
    import tempfile

    import benchmarks

    env = dict(os.environ)
    root = str(Path(benchmarks.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    results: list[dict[str, Any]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="omni_jax_bench_") as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            child = [sys.executable, "-m", "benchmarks.run", *argv, "--suite", name, "--json", str(out)]
            code = subprocess.run(child, env=env, check=False).returncode
            if out.exists():
                result = json.loads(out.read_text())
                result["command"] = command
            else:
                result = {"suite": name, "command": command, "failures": []}
            if code != 0 and not result["failures"]:
                unwritten = "" if out.exists() else " before writing a result"
                result["failures"].append(f"its process exited with status {code}{unwritten}")
                print(f"FAILED {name}: {result['failures'][-1]}", file=sys.stderr, flush=True)
            failed = failed or bool(result["failures"])
            results.append(result)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(prog)
    args = p.parse_args(argv)
    check_arguments(p, args)
    # Compile times are only real with JAX's persistent cache off; OMNI_JAX_COMPILATION_CACHE=DIR
    # turns it on (the JSON records which).
    os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")
    from benchmarks.models import resolve_model

    if args.stream and args.suite not in (*STREAMED, *STREAMED.values()):
        raise SystemExit("--stream goes with --suite e2e or e2e_qwen3")
    suite_name = STREAMED.get(args.suite, args.suite) if args.stream else args.suite
    command = " ".join(shlex.quote(a) for a in [*prog.split(), *argv])
    harness.set_threads()
    names = suites_for(suite_name, args.model)
    if len(names) > 1:
        return run_isolated(names, argv, command, args.json)
    (name,) = names
    suite = SUITES[name]
    module = importlib.import_module(suite.module)
    args.profile = str(Path(args.profile) / name) if args.profile else None
    if args.num_requests is None:
        args.num_requests = getattr(module, "DEFAULT_NUM_REQUESTS", 32)
    path = resolve_model(args.model, Path(args.cache_dir), suite.kind(args.model))
    result: dict[str, Any] = module.run(path, args)
    result.update(
        model=args.model,
        device=harness.device(),
        versions=harness.versions(),
        command=command,
        date_utc=harness.now_utc(),
        profile=args.profile,
        persistent_cache=harness.persistent_cache(),
        environment=harness.environment(),
    )
    result.setdefault("failures", [])
    harness.check_result(result)
    print(module.table(result), harness.describe(result), sep="\n", flush=True)
    for failure in result["failures"]:
        print(f"FAILED {name}: {failure}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    from omni_jax.cli_errors import run_command

    sys.exit(run_command(lambda args: main(args.rest), argparse.Namespace(rest=sys.argv[1:], debug=False)))
