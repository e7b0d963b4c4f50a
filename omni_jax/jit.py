"""Helpers for jitting NNX modules, shared by the models' compiled functions and the engine:
the static graph handle and the matmul precision every traced model computation runs under.

It lives beside ``parallel/`` and ``profiling.py``, below both models and engine: a model's
jitted entry point (e.g. ``token2wav_compiled``) takes its graph as a :class:`StaticGraph`, and
the engine's runners build one to call it, so neither layer may own it without the models
importing the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def exact_matmuls(dtype: Any) -> contextlib.AbstractContextManager[None]:
    """Trace under this so that a ``dtype`` computation's matrix products and convolutions are
    computed in ``dtype``: float32 ones at "highest" precision, others as XLA chooses.

    XLA's default precision computes float32 products in TensorFloat-32 on GPUs (a 10-bit
    mantissa), about 1e-3 away from transformers' float32, where a float32 model must agree to
    about 1e-6; on CPUs it changes nothing. Narrower operands (bfloat16) keep XLA's default:
    their products are already exact in the matrix units, and their programs stay as they were.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def compute_dtype(tree: Any) -> jnp.dtype:
    """The dtype a module's computation runs in: its first floating-point array's (a model's
    parameters share one dtype), float32 when it holds none."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.dtype(leaf.dtype)
    return jnp.dtype(jnp.float32)


class StaticGraph:
    """An NNX graphdef as a jit static argument, hashed once.

    jit hashes its static arguments on every call, and a ``GraphDef`` recomputes its hash over
    the whole module tree each time: host time added to every call, growing with the module.
    Equal graphdefs stay equal here, so runners of the same model still share compiled programs.
    """

    __slots__ = ("_hash", "graphdef")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StaticGraph) and (
            other.graphdef is self.graphdef or other.graphdef == self.graphdef
        )
