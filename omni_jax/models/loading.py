"""Build NNX models from named tensors without materialising random weights first.

The model is created abstractly (:func:`abstract_model`), so its constructor allocates nothing;
each parameter is then set from the checkpoint, straight onto its device (or into its shards).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np
from flax import nnx
from jax._src.interpreters import partial_eval

from omni_jax.models.param_map import FlaxPath, ParamRule, fill_params
from omni_jax.parallel.rules import put_cast
from omni_jax.safetensors_io import TensorReader

_ORIGIN_PATCH = threading.RLock()
"""Held while :func:`_no_tracer_origin_messages` has jax's method replaced: two threads building
models at once take turns, so neither restores the other's replacement as the original (one
thread may nest: the inner restores the outer's replacement, the outer the original)."""


@contextlib.contextmanager
def _no_tracer_origin_messages() -> Iterator[None]:
    """Tracers' error messages without their origin while the block traces.

    flax NNX's ``Variable.set_value`` probes ``getattr(value, "sharding", None)`` on every
    assignment, and under a trace that raises an ``AttributeError`` whose message walks every
    equation traced so far (jax's ``_origin_msg``; jax-ml/jax#40041 removes the walk): building
    a model abstractly, one random-number counter update per parameter, is then quadratic in its
    parameters (most of Qwen2.5-Omni-7B's memory plan went there: ``benchmarks/RESULTS.md``,
    Memory). The message is
    discarded by ``getattr``; only its origin part is skipped, and only here (another thread
    tracing meanwhile gets its messages without origin too).
    """
    tracer = partial_eval.DynamicJaxprTracer
    with _ORIGIN_PATCH:
        original = tracer.__dict__.get("_origin_msg")
        if original is None:  # a jax without the walk
            yield
            return
        tracer._origin_msg = lambda self: ""  # type: ignore[method-assign]
        try:
            yield
        finally:
            tracer._origin_msg = original  # type: ignore[method-assign]


def abstract_model(ctor: Callable[[], nnx.Module]) -> nnx.Module:
    """``nnx.eval_shape(ctor)``: the model ``ctor`` builds, every array abstract (nothing
    allocated), traced in time linear in its parameters (:func:`_no_tracer_origin_messages`)."""
    with _no_tracer_origin_messages():
        return nnx.eval_shape(ctor)


def abstract_params(ctor: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, dict[FlaxPath, nnx.Variable]]:
    """``(graphdef, {path: abstract variable})`` for the model ``ctor`` builds."""
    return split_params(abstract_model(ctor))


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, dict[FlaxPath, nnx.Variable]]:
    """``(graphdef, {path: variable})`` of ``model`` (abstract or not; it is not changed)."""
    graphdef, state = nnx.split(model)
    return graphdef, dict(nnx.to_flat_state(state))


def merge_params(
    graphdef: nnx.GraphDef, abstract: dict[FlaxPath, nnx.Variable], values: dict[FlaxPath, object]
) -> nnx.Module:
    """Inverse of :func:`abstract_params` once every path has a concrete value."""
    flat = {p: v.replace(jax.numpy.asarray(values[p])) for p, v in abstract.items()}
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build_model(
    ctor: Callable[[], nnx.Module],
    tensors: Iterable[tuple[str, np.ndarray]],
    rules: Iterable[ParamRule],
    dtype: np.dtype | None = None,
    ignore: Iterable[str] = (),
) -> nnx.Module:
    """Model from ``ctor`` with every parameter taken from ``tensors`` (HF names) via ``rules``,
    on the default device, in ``dtype`` (default: each tensor's own)."""

    def place(path: FlaxPath, read: TensorReader) -> jax.Array:
        x = read()
        return put_cast(x, None, x.dtype if dtype is None else dtype)

    graphdef, abstract = abstract_params(ctor)
    readers = ((name, lambda array=array: array) for name, array in tensors)
    values = fill_params(abstract, readers, rules, place, ignore=ignore)
    return merge_params(graphdef, abstract, values)


def torch_state_items(module: object) -> Iterable[tuple[str, np.ndarray]]:
    """``(name, float32 numpy)`` pairs of a torch module's ``state_dict`` (reference tests)."""
    for name, t in module.state_dict().items():  # type: ignore[attr-defined]
        yield name, t.detach().float().cpu().numpy()
