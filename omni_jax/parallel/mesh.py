"""Device meshes: one ``Mesh`` per stage with axes ``("data", "model")``.

``model`` is tensor parallelism (weights and KV heads split across it), ``data`` splits a
step's request rows. A stage either takes the first ``data * model`` devices or an explicit
device list (indices into ``jax.devices()``, the global list across all processes), so stages
can sit on disjoint devices and run concurrently under JAX's async dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "model")
MAX_DEVICES = 1 << 20
"""The most devices a mesh may span: far beyond any machine JAX runs on, so that a mistyped
size is refused at once rather than planned or allocated device by device."""


def mesh_shape(shape: Mapping[str, int] | None) -> dict[str, int]:
    """``{"data": D, "model": M}`` with missing axes set to 1; refuses what is not a mapping (the
    command line's ``"data=2,model=4"`` is :func:`parse_mesh`'s), unknown axes, sizes < 1 and
    meshes of more than :data:`MAX_DEVICES` devices."""
    if shape is not None and not isinstance(shape, Mapping):
        raise ValueError(
            f"mesh={shape!r} must be a dict of axis sizes like {{'data': 2, 'model': 4}}, "
            f"got {type(shape).__name__}"
        )
    shape = dict(shape or {})
    unknown = sorted(set(shape) - set(AXES))
    if unknown:
        raise ValueError(f"mesh {shape}: unknown axes {unknown}; the axes are {list(AXES)}")
    out = {a: shape.get(a, 1) for a in AXES}
    for axis, size in out.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh {shape}: axis {axis!r} must be a positive int, got {size!r}")
    if math.prod(out.values()) > MAX_DEVICES:
        raise ValueError(
            f"mesh {shape}: {math.prod(out.values())} devices, more than the {MAX_DEVICES} allowed"
        )
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` (the command-line form) -> ``{"data": 2, "model": 4}``; an axis
    named twice is refused (which one was meant cannot be known)."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        axis, sep, size = item.partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(f"mesh {text!r}: expected axis=size pairs like 'data=2,model=4'")
        if axis.strip() in out:
            raise ValueError(f"mesh {text!r}: axis {axis.strip()!r} is given twice")
        out[axis.strip()] = int(size)
    return mesh_shape(out)


def select_devices(count: int, devices: Sequence[int | Any] | None = None) -> list[Any]:
    """``count`` devices: the first ones, or exactly ``devices`` (indices into ``jax.devices()``)."""
    available = jax.devices()
    if devices is None:
        if count > len(available):
            raise ValueError(
                f"the mesh needs {count} devices but only {len(available)} exist "
                f"({available[0].platform}); emulate more on CPU with "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N"
            )
        return list(available[:count])
    chosen = []
    for d in devices:
        if isinstance(d, int) and not isinstance(d, bool):
            if not 0 <= d < len(available):
                raise ValueError(f"device index {d} does not exist: there are {len(available)} devices")
            chosen.append(available[d])
        else:
            chosen.append(d)
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"device list {list(devices)} names a device twice")
    if len(chosen) != count:
        raise ValueError(f"the mesh needs {count} devices but the device list has {len(chosen)}")
    return chosen


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[int | Any] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh; ``model`` is the inner (fastest-varying) axis.

    Consecutive devices share ``model``, so tensor-parallel collectives stay among neighbours
    (one host, one NVLink island) and only ``data`` spans hosts.
    """
    s = mesh_shape(shape)
    chosen = select_devices(math.prod(s.values()), devices)
    return Mesh(np.array(chosen, dtype=object).reshape(s["data"], s["model"]), AXES)


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])
