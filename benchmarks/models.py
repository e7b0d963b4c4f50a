"""Benchmark checkpoints: ``tiny`` and ``small`` are built locally, anything else is a path."""

from __future__ import annotations

from pathlib import Path

from omni_jax.testing import build_tiny_qwen2

# ~40M parameters: Qwen2.5-0.5B's head layout at a width and depth this CPU runs in minutes.
SMALL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.02,
)


def resolve_model(name: str, cache_dir: Path) -> Path:
    if name == "tiny":
        path = cache_dir / "bench-tiny-qwen2"
        if not (path / "config.json").exists():
            build_tiny_qwen2(path, seed=0)
        return path
    if name == "small":
        path = cache_dir / "bench-small-qwen2"
        if not (path / "config.json").exists():
            build_tiny_qwen2(path, seed=0, **SMALL)
        return path
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {name}: not 'tiny', 'small' or a checkpoint directory")
    return path


def count_params(path: Path) -> int:
    from omni_jax.safetensors_io import iter_checkpoint

    return sum(a.size for _, a in iter_checkpoint(path))


def decode_read_params(path: Path) -> int:
    """Parameters one decode step must read: all but an untied input embedding (only gathered)."""
    from omni_jax.safetensors_io import iter_checkpoint

    sizes = {name: a.size for name, a in iter_checkpoint(path)}
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values())
