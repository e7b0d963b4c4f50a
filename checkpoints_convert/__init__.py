"""HF PyTorch checkpoint -> Flax params -> Orbax checkpoint (``python -m checkpoints_convert``)."""

from omni_jax.weights import convert

__all__ = ["convert", "main"]


def main(argv: list[str] | None = None) -> int:
    from checkpoints_convert.cli import main as _main

    return _main(argv)
