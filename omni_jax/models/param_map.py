"""Declarative maps from Hugging Face tensor names to Flax NNX parameter paths.

Each model module declares a tuple of :class:`ParamRule` next to its code, so the mapping
lives with the layer it describes and the converter stays model-agnostic: it streams HF
tensors, asks the rules where each one goes and how to reshape it, and checks that every
parameter of the model was filled exactly once with the right shape.

A rule's transform returns a view where it can (a transpose, a reshape, a flip), never a
copy: applied to a memory-mapped tensor it reads nothing, so shapes are checked for free and
the one copy of each tensor is made where it is placed, in its final dtype and layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from omni_jax.safetensors_io import TensorReader

Transform = Callable[[np.ndarray], np.ndarray]
FlaxPath = tuple[str | int, ...]


def identity(x: np.ndarray) -> np.ndarray:
    return x


def linear_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``Linear.weight`` is ``[out, in]``; ``nnx.Linear.kernel`` is ``[in, out]``."""
    return x.T


def conv1d_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``Conv1d.weight`` ``[out, in/groups, k]`` -> ``nnx.Conv`` ``[k, in/groups, out]``."""
    return np.transpose(x, (2, 1, 0))


def conv_transpose1d_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``ConvTranspose1d.weight`` ``[in, out, k]`` -> ``nnx.ConvTranspose`` ``[k, in, out]``.

    The kernel is flipped along ``k`` because ``nnx.ConvTranspose`` (``lax.conv_transpose``
    without ``transpose_kernel``) correlates where torch convolves.
    """
    return np.transpose(x, (2, 0, 1))[::-1]


def conv2d_kernel(x: np.ndarray) -> np.ndarray:
    """torch ``Conv2d.weight`` ``[out, in, kh, kw]`` -> ``nnx.Conv`` ``[kh, kw, in, out]``."""
    return np.transpose(x, (2, 3, 1, 0))


@dataclass(frozen=True)
class ParamRule:
    """One HF-name pattern and where its tensor goes.

    ``hf`` is a regular expression that must match the whole HF name; ``flax`` is a dotted
    path template that may use the pattern's groups (``\\1``). Path components made only of
    digits become ``int`` keys, which is how NNX names list elements.
    """

    hf: str
    flax: str
    transform: Transform = identity
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.hf))

    def match(self, hf_name: str) -> FlaxPath | None:
        m = self._compiled.fullmatch(hf_name)
        if m is None:
            return None
        return parse_path(m.expand(self.flax))


def parse_path(dotted: str) -> FlaxPath:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def format_path(path: FlaxPath) -> str:
    return ".".join(str(p) for p in path)


def map_name(rules: Iterable[ParamRule], hf_name: str) -> tuple[FlaxPath, Transform] | None:
    """Where ``hf_name`` goes under ``rules``; ``None`` means the tensor is not ours."""
    for rule in rules:
        path = rule.match(hf_name)
        if path is not None:
            return path, rule.transform
    return None


def prefixed(prefix_hf: str, prefix_flax: str, rules: Iterable[ParamRule]) -> tuple[ParamRule, ...]:
    """Re-root a sub-model's rules, e.g. the thinker's text model under ``thinker.model.``."""
    out = []
    for r in rules:
        flax = f"{prefix_flax}.{r.flax}" if prefix_flax else r.flax
        out.append(ParamRule(re.escape(prefix_hf) + r.hf, flax, r.transform))
    return tuple(out)


class ParamMismatchError(ValueError):
    """A checkpoint does not fit the model: the message names the offending tensor."""


class MissingParamsError(ParamMismatchError):
    """A checkpoint has no tensor for some parameters (a config describing more layers or experts
    than the weights hold, or a shard its index does not list)."""


Placed = TypeVar("Placed")


def fill_params(
    abstract_state: dict[FlaxPath, object],
    tensors: Iterable[tuple[str, TensorReader]],
    rules: Iterable[ParamRule],
    place: Callable[[FlaxPath, TensorReader], Placed],
    ignore: Iterable[str] = (),
) -> dict[FlaxPath, Placed]:
    """Put each HF tensor where ``rules`` say, checking names and shapes as it goes.

    ``abstract_state`` maps every parameter path of the model to something with ``.shape``
    (``jax.ShapeDtypeStruct`` from ``nnx.eval_shape``). ``tensors`` is consumed lazily, each
    ``(HF name, reader)``; the reader maps the tensor (:data:`TensorReader`), and the shape
    check reads nothing of it. ``place(path, reader)`` gets a reader of the transformed tensor
    (a view of the mapped bytes) and returns the parameter's final form: a device array made
    now, or a deferred write that calls the reader later. Nothing here holds a tensor after
    ``place`` returns, so a streaming reader never holds two copies. ``ignore`` lists regexes
    of HF names that are legitimately dropped (buffers, sub-models not being built).
    Raises :class:`ParamMismatchError` naming the tensor on an unknown, duplicate,
    mis-shaped or missing tensor.
    """
    rules = tuple(rules)
    ignored = [re.compile(p) for p in ignore]
    out: dict[FlaxPath, Placed] = {}
    for name, read in tensors:
        if any(p.fullmatch(name) for p in ignored):
            continue
        hit = map_name(rules, name)
        if hit is None:
            raise ParamMismatchError(f"unexpected tensor {name!r}: no parameter of the model takes it")
        path, transform = hit
        if path not in abstract_state:
            raise ParamMismatchError(
                f"tensor {name!r} maps to {format_path(path)!r}, which the model does not have"
            )
        if path in out:
            raise ParamMismatchError(f"tensor {name!r} fills {format_path(path)!r} a second time")
        source = read()
        got, shape = tuple(source.shape), tuple(transform(source).shape)
        del source
        want = tuple(abstract_state[path].shape)
        if shape != want:
            raise ParamMismatchError(
                f"tensor {name!r} has shape {got} -> {shape} but {format_path(path)!r} needs {want}"
            )
        out[path] = place(path, lambda read=read, transform=transform: transform(read()))
    missing = [format_path(p) for p in abstract_state if p not in out]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MissingParamsError(f"checkpoint is missing parameters: {shown}")
    return out
