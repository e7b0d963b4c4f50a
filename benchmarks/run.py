"""``python -m benchmarks.run --suite ar --model {tiny,small,PATH} [--reference] [--json F]``."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from omni_jax.parallel.mesh import parse_mesh


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', d)} x{jax.device_count()}"


def table(result: dict[str, Any]) -> str:
    ours, ref = result["ours"], result["reference"]
    rows = [
        ("output tokens/s", f"{ours['tokens_per_s']:.1f}", f"{ref['tokens_per_s']:.1f}" if ref else "-"),
        ("wall s (measured run)", f"{ours['wall_s']:.2f}", f"{ref['wall_s']:.2f}" if ref else "-"),
        (
            "first run s (incl. compile)",
            f"{ours['first_run_s']:.2f}",
            f"{ref['first_run_s']:.2f}" if ref else "-",
        ),
        ("TTFT s (mean)", f"{ours['ttft_s_mean']:.3f}", "-"),
        ("TPOT s (mean)", f"{ours['tpot_s_mean']:.4f}", "-"),
    ]
    for b, s in ours["decode_step_s"].items():
        frac = result["roofline_fraction"][b]
        rows.append((f"decode step s, batch {b}", f"{s * 1e3:.2f} ms ({frac:.0%} of roofline)", "-"))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'omni_jax':>28}  {'reference':>12}"]
    lines += [f"{a:<{w}}  {b:>28}  {c:>12}" for a, b, c in rows]
    if result["ratio"] is not None:
        lines.append(
            f"ratio (ours / reference tokens/s): {result['ratio']:.2f}x; {result['greedy_agreement']}"
        )
    lines.append(
        f"decode floor (weights / measured {result['measured_bandwidth_GBps']:.1f} GB/s): "
        f"{result['decode_floor_s'] * 1e3:.2f} ms"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run")
    p.add_argument("--suite", choices=["ar"], default="ar")
    p.add_argument("--model", default="small", help="tiny | small | a checkpoint directory")
    p.add_argument("--reference", action="store_true", help="also run the PyTorch reference")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--profile", default=None, help="write a jax.profiler trace of the measured run here")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="our engine's mesh, e.g. data=2,model=4 (on CPU emulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (tokens)")
    p.add_argument("--max-prompt", type=int, default=192, help="longest prompt (tokens)")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    args = p.parse_args(argv)

    from benchmarks.ar_suite import run_ar
    from benchmarks.models import resolve_model

    path = resolve_model(args.model, Path(args.cache_dir))
    result = run_ar(path, args)
    result.update(
        device=device(),
        versions=versions(),
        model=args.model,
        command=" ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks.run", *sys.argv[1:]]),
    )
    print(table(result))
    if args.json:
        slim = {k: v for k, v in result.items()}
        for side in ("ours", "reference"):
            if slim.get(side):
                slim[side] = {k: v for k, v in slim[side].items() if k != "token_ids"}
        Path(args.json).write_text(json.dumps(slim, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
