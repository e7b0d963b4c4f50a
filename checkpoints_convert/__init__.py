"""HF PyTorch checkpoint -> Flax params -> Orbax checkpoint (``python -m checkpoints_convert``).

``convert`` loads on first use, so that ``omni-jax --help`` (whose parser names this package's
flags) does not import JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_jax.weights import convert

__all__ = ["convert", "main"]


def __getattr__(name: str) -> Any:
    """``convert``, from :mod:`omni_jax.weights`, the first time it is asked for."""
    if name != "convert":
        raise AttributeError(f"module 'checkpoints_convert' has no attribute {name!r}")
    from omni_jax.weights import convert

    return convert


def main(argv: list[str] | None = None) -> int:
    from checkpoints_convert.cli import main as _main

    return _main(argv)
