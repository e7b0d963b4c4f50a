"""Helpers for jitting NNX modules, shared by the models' compiled functions and the engine.

It lives beside ``parallel/`` and ``profiling.py``, below both models and engine: a model's
jitted entry point (e.g. ``token2wav_compiled``) takes its graph as a :class:`StaticGraph`, and
the engine's runners build one to call it, so neither layer may own it without the models
importing the engine.
"""

from __future__ import annotations

from flax import nnx


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
