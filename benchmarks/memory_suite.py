"""Memory suite: peak resident memory of conversion and loading against the streaming bound.

Conversion (``omni_jax.weights.convert``) and loading (``OmniJaxPipeline.from_pretrained``, of
the converted dir and of the HF dir) each run in a fresh Python process, so each peak is that
operation's alone: the child's peak resident set (its own ``VmHWM``, which it reports as it
exits) covers the interpreter, the imports, the weights and every transient copy. ``wait4``'s
``ru_maxrss`` would not do: Linux carries it across ``exec`` from the process that forked the
child, so a child of a large process (pytest after many tests) reports the parent's size. The
bound the loader promises is ``BOUND_RATIO`` x the checkpoint's tensor bytes +
``BOUND_FIXED_BYTES``; the fixed part is what the interpreter, jax, transformers and torch cost
before any weight is read, which a child that only imports them (``imports``) measures beside
the others.

The checkpoint: ``--model PATH`` (any Qwen2 HF dir), or one this module generates with random
weights (``python -m benchmarks.memory_suite generate DIR --size 1.5b``): a ``Qwen2ForCausalLM``
in bfloat16, written shard by shard as safetensors with ``model.safetensors.index.json``, each
tensor generated and written in row blocks, so generating it never holds the model either.
Tensor names and shapes come from transformers (the model instantiated on torch's ``meta``
device, which allocates nothing), so the checkpoint is exactly what ``save_pretrained`` writes.

Loading builds the smallest engine around the weights (one sequence of ``LOAD_MAX_MODEL_LEN``
tokens), so the KV cache is negligible next to them and the figure is the weights' path.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

GB = 10**9
BOUND_RATIO = 1.25
BOUND_FIXED_BYTES = 3 * GB // 2
LOAD_MAX_MODEL_LEN = 256

SIZES: dict[str, dict[str, Any]] = {
    # Qwen2.5-1.5B's shapes: 1.54B parameters, tied embeddings.
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    # The memory test's checkpoint: 230M parameters, its largest tensor (the embedding) a
    # smaller share of the total than the 1.5B's.
    "230m": dict(
        vocab_size=16384,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # Weights of no account (0.3 MB): what an operation costs besides them.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}
"""Generated checkpoint shapes (``Qwen2Config`` fields) by name."""

SHARDS = 4
"""Safetensors shards of a generated checkpoint (real hub checkpoints of this size ship several)."""

BLOCK_ELEMENTS = 1 << 24
"""Elements generated and written at once (a 64 MB float32 block)."""


def qwen2_config(size: str) -> Any:
    from transformers import Qwen2Config

    if size not in SIZES:
        raise SystemExit(f"--size {size}: one of {', '.join(SIZES)}")
    return Qwen2Config(**SIZES[size], rms_norm_eps=1e-6, dtype="bfloat16", architectures=["Qwen2ForCausalLM"])


def tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor ``save_pretrained`` would write for ``config``, in its
    order (the tied ``lm_head.weight`` left out, as it does)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = getattr(config, "tie_word_embeddings", False)
    return [
        (name, tuple(t.shape))
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    ]


def _split(shapes: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of about equal bytes (never empty)."""
    sizes = [int(np.prod(s)) for _, s in shapes]
    target = sum(sizes) / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for item, n in zip(shapes, sizes, strict=True):
        if groups[-1] and filled >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(item)
        filled += n
    return groups


def _blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's values in bfloat16, ``BLOCK_ELEMENTS`` at a time: norm weights 1, the rest
    N(0, 0.02) (the initializer's scale, so the model stays numerically sane)."""
    import ml_dtypes

    total = int(np.prod(shape))
    for start in range(0, total, BLOCK_ELEMENTS):
        n = min(BLOCK_ELEMENTS, total - start)
        if name.endswith("norm.weight"):
            yield np.ones(n, ml_dtypes.bfloat16)
        else:
            block = rng.standard_normal(n, dtype=np.float32)
            block *= 0.02
            yield block.astype(ml_dtypes.bfloat16)


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> int:
    """One safetensors file (header, then each tensor's bytes), written block by block; its tensor bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            for block in _blocks(name, shape, rng):
                block.tofile(f)
    return offset


def generate_checkpoint(path: str | Path, size: str = "1.5b", seed: int = 0, shards: int = SHARDS) -> Path:
    """A random-weight bfloat16 ``Qwen2ForCausalLM`` HF checkpoint of ``SIZES[size]``'s shapes in
    ``shards`` safetensors files with an index, written without ever holding the model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(size)
    groups = _split(tensor_shapes(config), shards)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += _write_shard(path / name, group, rng)
        weight_map.update({tensor: name for tensor, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(path)
    return path


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the checkpoint's tensors (from the safetensors headers)."""
    from omni_jax.safetensors_io import checkpoint_files, read_header

    total = 0
    for f in checkpoint_files(path):
        _, header = read_header(f)
        total += sum(e - b for b, e in (info["data_offsets"] for info in header.values()))
    return total


# -- measured children -----------------------------------------------------------------------


def _own_peak_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of ``/proc/self/status``, the high-water mark
    of the memory map ``exec`` gave it (nothing of the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def _child(argv: list[str]) -> None:
    """Run in a fresh process: ``PEAK_FILE imports`` (the interpreter, jax, torch, transformers,
    orbax and omni_jax, nothing done) | ``PEAK_FILE convert SRC DST [DTYPE]`` |
    ``PEAK_FILE load PATH [DTYPE [MESH]]``; the peak resident bytes are written to PEAK_FILE."""
    peak_file, what, rest = Path(argv[0]), argv[1], argv[2:]
    _run_child(what, rest)
    peak_file.write_text(str(_own_peak_bytes()))


def _run_child(what: str, rest: list[str]) -> None:
    import jax

    from omni_jax import OmniJaxPipeline
    from omni_jax.parallel.mesh import parse_mesh
    from omni_jax.weights import convert

    if what == "imports":
        import orbax.checkpoint  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        jax.devices()
    elif what == "convert":
        convert(rest[0], rest[1], dtype=rest[2] if len(rest) > 2 else None, progress=False)
    elif what == "load":
        OmniJaxPipeline.from_pretrained(
            rest[0],
            dtype=rest[1] if len(rest) > 1 and rest[1] else None,
            mesh=parse_mesh(rest[2]) if len(rest) > 2 else None,
            max_num_seqs=1,
            max_model_len=LOAD_MAX_MODEL_LEN,
            compilation_cache=False,
        )
    else:
        raise SystemExit(f"unknown child {what!r}")


def peak_rss(args: list[str], env: dict[str, str] | None = None) -> tuple[int, float]:
    """``(peak resident bytes, wall seconds)`` of ``python -m benchmarks.memory_suite child ARGS``,
    the peak as that process alone measured it (:func:`_own_peak_bytes`)."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        peak_file = Path(tmp) / "peak"
        cmd = [sys.executable, "-m", "benchmarks.memory_suite", "child", str(peak_file), *args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
        return int(peak_file.read_text()), wall


def bound(nbytes: int) -> int:
    return int(BOUND_RATIO * nbytes) + BOUND_FIXED_BYTES


OPERATIONS = ("convert", "load_converted", "load_hf")


def measure_operations(
    path: Path, workdir: Path, dtype: str | None = None, mesh: str | None = None
) -> dict[str, tuple[int, float]]:
    """``{operation: (peak RSS bytes, wall s)}`` of :data:`OPERATIONS` on the HF checkpoint
    ``path``, each in a fresh process; the conversion is written under ``workdir``."""
    dst = workdir / f"{path.name}-converted"
    extra = [dtype or "", *([mesh] if mesh else [])]
    return {
        "convert": peak_rss(["convert", str(path), str(dst), *([dtype] if dtype else [])]),
        "load_converted": peak_rss(["load", str(dst), *extra]),
        "load_hf": peak_rss(["load", str(path), *extra]),
    }


def run(path: Path, args: Any) -> dict[str, Any]:
    nbytes = checkpoint_bytes(path)
    mesh = None if args.mesh is None else ",".join(f"{k}={v}" for k, v in args.mesh.items())
    figures: dict[str, Any] = {"checkpoint_bytes": nbytes, "bound_bytes": bound(nbytes)}
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        peaks = {"imports": peak_rss(["imports"]), **measure_operations(path, Path(tmp), args.dtype, mesh)}
    for name, (peak, wall) in peaks.items():
        figures[name] = {"peak_rss_bytes": peak, "wall_s": wall, "within_bound": peak <= bound(nbytes)}
    over = [
        f"{name}: peak RSS {peaks[name][0] / GB:.2f} GB over the bound {bound(nbytes) / GB:.2f} GB"
        for name in OPERATIONS
        if peaks[name][0] > bound(nbytes)
    ]
    return {
        "suite": "memory",
        "ours": figures,
        "reference": None,
        "ratio": None,
        "roofline_fraction": None,
        "ceilings": None,
        "compile": None,
        "mesh": mesh,
        "dtype": args.dtype,
        "failures": over,
    }


def table(result: dict[str, Any]) -> str:
    ours = result["ours"]
    nbytes, limit = ours["checkpoint_bytes"], ours["bound_bytes"]
    lines = [
        f"checkpoint {nbytes / GB:.2f} GB; bound {BOUND_RATIO} x checkpoint + "
        f"{BOUND_FIXED_BYTES / GB:.1f} GB = {limit / GB:.2f} GB",
        "| process | peak RSS | x checkpoint | within bound | wall |",
        "|---|---|---|---|---|",
    ]
    for name in ("imports", *OPERATIONS):
        row = ours[name]
        peak = row["peak_rss_bytes"]
        lines.append(
            f"| {name} | {peak / GB:.2f} GB | {peak / nbytes:.2f} | "
            f"{'yes' if row['within_bound'] else 'NO'} | {row['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["child"]:
        _child(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_suite")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a random-weight bfloat16 Qwen2 sharded checkpoint")
    g.add_argument("dir")
    g.add_argument("--size", default="1.5b", choices=list(SIZES))
    g.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = generate_checkpoint(args.dir, args.size, args.seed)
    print(f"wrote {path} ({checkpoint_bytes(path) / GB:.2f} GB of tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
