"""Command line of the converter, shared by ``python -m checkpoints_convert`` and ``omni-jax convert``."""

from __future__ import annotations

import argparse
import sys

from omni_jax.models.param_map import ParamMismatchError
from omni_jax.safetensors_io import CheckpointError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF checkpoint directory (config.json + safetensors or .bin)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="parameter dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is an earlier conversion (or empty), once the new one is complete",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare logits of the converted model with transformers (needs torch)",
    )
    p.add_argument(
        "--check-sources",
        action="store_true",
        help="convert nothing: check that SRC's files still have the sha256 recorded in DST's manifest",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Convert; expected faults print one line naming the file or tensor and return 1."""
    from omni_jax.weights import check_sources, convert

    try:
        if args.check_sources:
            changed = check_sources(args.src, args.dst, progress=not args.quiet)
            if changed:
                which = ", ".join(changed)
                print(
                    f"error: {args.src} differs from what {args.dst} was converted from: {which}",
                    file=sys.stderr,
                )
                return 1
            print(f"{args.src}: every source file of {args.dst} has its recorded sha256")
            return 0
        dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.quiet, overwrite=args.overwrite)
        if args.verify:
            from checkpoints_convert.verify import verify

            print(verify(args.src, dst))
    except (CheckpointError, ParamMismatchError, FileExistsError, FileNotFoundError, ValueError) as e:
        print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
        return 1
    print(f"converted {args.src} -> {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
