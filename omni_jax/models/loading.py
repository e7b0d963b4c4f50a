"""Build NNX models from named tensors without materialising random weights first.

The model is created abstractly (``nnx.eval_shape``), so its constructor allocates nothing;
each parameter is then set from the checkpoint, straight onto its device (or into its shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx

from omni_jax.models.param_map import FlaxPath, ParamRule, fill_params
from omni_jax.parallel.rules import put_cast
from omni_jax.safetensors_io import TensorReader


def abstract_params(ctor: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, dict[FlaxPath, nnx.Variable]]:
    """``(graphdef, {path: abstract variable})`` for the model ``ctor`` builds."""
    graphdef, state = nnx.split(nnx.eval_shape(ctor))
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
