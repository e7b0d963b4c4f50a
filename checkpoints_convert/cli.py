"""Command line of the converter, shared by ``python -m checkpoints_convert`` and ``omni-jax convert``."""

from __future__ import annotations

import argparse
import shutil
import sys

from omni_jax.cli_engine import DTYPE_CHOICES
from omni_jax.cli_errors import OneLineParser, run_command

DESCRIPTION = (
    "Convert a Hugging Face checkpoint (config.json with safetensors or .bin weights) into an "
    "omni_jax checkpoint (Orbax), which omni-jax run and OmniJaxPipeline.from_pretrained load "
    "without converting again."
)
"""``--help``'s description: plain text, where the module docstring is markup for a reader of the code."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF checkpoint directory (config.json + safetensors or .bin)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
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
        help="compare the converted model with transformers (needs torch): Qwen2 logits; Qwen2.5-Omni "
        "thinker and talker logits and one code2wav solve. A failed check removes DST",
    )
    p.add_argument(
        "--check-sources",
        action="store_true",
        help="convert nothing: check that SRC's files still have the sha256 recorded in DST's manifest",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Convert (and verify). Faults raise ``ValueError`` naming the file or tensor, which the
    entry point prints as one line with exit code 2; sources that differ from a conversion's
    record (``--check-sources``) print ``error: ...`` and return 1."""
    from omni_jax.weights import check_sources, convert

    if args.check_sources:
        ignored = [
            flag
            for flag, given in (
                ("--dtype", args.dtype),
                ("--overwrite", args.overwrite),
                ("--verify", args.verify),
            )
            if given
        ]
        if ignored:  # they shape a conversion, and --check-sources converts nothing
            raise ValueError(f"--check-sources converts nothing, so {', '.join(ignored)} would do nothing")
        changed = check_sources(args.src, args.dst, progress=not args.quiet)
        if changed:
            which = ", ".join(changed)
            print(
                f"error: {args.src} differs from what {args.dst} was converted from: {which}", file=sys.stderr
            )
            return 1
        print(f"{args.src}: every source file of {args.dst} has its recorded sha256")
        return 0
    if args.verify:
        from checkpoints_convert.verify import check_verifiable, verify

        check_verifiable(args.src)  # refused before any conversion work
    dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.quiet, overwrite=args.overwrite)
    if args.verify:
        try:
            checks = verify(args.src, dst, progress=not args.quiet)
        except BaseException:  # an unverified conversion is not left behind
            shutil.rmtree(dst, ignore_errors=True)
            raise
        for check in checks:
            print(f"verify: {check}")
        failed = [str(c) for c in checks if not c.passed]
        if failed:
            shutil.rmtree(dst)
            raise ValueError(f"verify failed, {dst} removed: {'; '.join(failed)}")
    print(f"converted {args.src} -> {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m checkpoints_convert", description=DESCRIPTION)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_command(run, args)
