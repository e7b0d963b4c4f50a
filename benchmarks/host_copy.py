"""Checkpoint views copied into C order: :mod:`omni_jax.host_copy`'s tiles against numpy's own copy.

Why: loading an HF checkpoint transposes every linear weight on the host (torch's ``[out, in]``
to Flax's ``[in, out]``), and numpy's copy of a transposed view reads its source a whole row
apart for each element it writes; that copy was most of ``load_part``'s time. Times, for the
weight shapes of Qwen2.5-Omni-7B's thinker and Qwen3-Omni-30B-A3B's experts (bfloat16, and
cast to float32 as a float32 load does), the best of ``--repeats`` copies each way after an
untimed one (:func:`benchmarks.roofline.best_of`), checks they agree bit for bit, and prints GB/s
of the source's bytes.

Usage: ``python -m benchmarks.host_copy [--repeats 3] [--json FILE]``. End to end, a whole load
is ``benchmarks.memory_suite``'s (its walls; its peaks show the copies hold no more memory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks.roofline import best_of
from omni_jax.cli_errors import plain_text
from omni_jax.host_copy import contiguous

SHAPES = {
    "q/o proj 3584 x 3584": (3584, 3584),
    "k/v proj 512 x 3584": (512, 3584),
    "gate/up 18944 x 3584": (18944, 3584),
    "down 3584 x 18944": (3584, 18944),
    "expert gate/up 768 x 2048": (768, 2048),
    "expert down 2048 x 768": (2048, 768),
}
"""Stored ``[out, in]`` shapes: Qwen2.5-Omni-7B's thinker layers, Qwen3-Omni-30B-A3B's experts."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_copy", description=plain_text(__doc__.split("\n\n")[0])
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print(f"{'weight (stored [out, in])':28} {'to':9} {'numpy GB/s':>11} {'tiles GB/s':>11} {'speed-up':>9}")
    for name, shape in SHAPES.items():
        stored = np.random.default_rng(0).standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
        view = stored.T
        for target in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
            want = np.asarray(view, dtype=target, order="C")
            got = contiguous(view, target)
            numpy_s = best_of(lambda v=view, t=target: np.asarray(v, dtype=t, order="C"), args.repeats)
            tiles_s = best_of(lambda v=view, t=target: contiguous(v, t), args.repeats)
            if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                raise SystemExit(f"{name} to {target}: the tiled copy differs from numpy's")
            row = dict(weight=name, to=str(target), numpy_s=numpy_s, tiles_s=tiles_s, bytes=stored.nbytes)
            rows.append(row)
            print(
                f"{name:28} {str(target):9} {stored.nbytes / numpy_s / 1e9:11.2f} "
                f"{stored.nbytes / tiles_s / 1e9:11.2f} {numpy_s / tiles_s:8.2f}x"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
