"""Command line of the converter, shared by ``python -m checkpoints_convert`` and ``omni-jax convert``."""

from __future__ import annotations

import argparse
import sys

from omni_jax.models.param_map import ParamMismatchError
from omni_jax.safetensors_io import CheckpointError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF checkpoint directory (config.json + safetensors or .bin)")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="parameter dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare logits of the converted model with transformers (needs torch)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Convert; expected faults print one line naming the file or tensor and return 1."""
    from omni_jax.weights import convert

    try:
        dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.quiet)
        if args.verify:
            from checkpoints_convert.verify import verify

            print(verify(args.src, dst))
    except (CheckpointError, ParamMismatchError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"converted {args.src} -> {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
