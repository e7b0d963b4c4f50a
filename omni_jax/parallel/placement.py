"""Per-stage device placement: each stage gets its own mesh, checked before anything loads.

A stage's layout comes from its YAML entry (``mesh`` and/or ``devices``) or, failing that,
from ``from_pretrained(mesh=...)``, which is the default for every stage. Stages with explicit
device lists must not share a device unless the pipeline YAML says ``allow_shared_devices:
true``: two stages on one device serialize, which is rarely what a placement meant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh

from omni_jax.parallel.mesh import make_mesh, mesh_shape


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """What one stage asks for: ``mesh`` axes and/or ``devices`` (indices into ``jax.devices()``)."""

    name: str
    mesh: Mapping[str, int] | None = None
    devices: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where a stage goes, in indices only: what a mesh is built from, or a plan reads."""

    shape: dict[str, int]  # {"data": D, "model": M}
    devices: tuple[int, ...] | None  # indices into jax.devices(); None: the first D * M

    @property
    def indices(self) -> tuple[int, ...]:
        """The device indices the stage lands on (the first ``data * model`` when none are listed)."""
        return (
            self.devices
            if self.devices is not None
            else tuple(range(self.shape["data"] * self.shape["model"]))
        )


def stage_layouts(
    stages: Sequence[StagePlacement],
    default: Mapping[str, int] | None = None,
    allow_shared_devices: bool = False,
) -> dict[str, StageLayout]:
    """Each stage's layout, or ``ValueError`` naming the stage whose layout is impossible.

    The one rule for how stages get meshes: a stage's ``mesh`` (over its ``devices`` if listed,
    else the first devices), else its ``devices`` all over ``model``, else ``default``; a stage's
    explicit device list shares no device with another stage placed by the YAML (its list, or
    the first devices its own mesh takes) unless ``allow_shared_devices``. It needs no devices, so
    :func:`omni_jax.planning.plan_memory` lays out machines this process is not on with it, and
    :func:`stage_meshes` builds the meshes of this one from it.
    """
    layouts: dict[str, StageLayout] = {}
    owner: dict[int, tuple[str, bool]] = {}  # device -> (a YAML-placed stage on it, listed it)
    for st in stages:
        if st.mesh is not None:
            wanted = st.mesh
        elif st.devices is not None:
            wanted = {"model": len(st.devices)}
        else:
            wanted = default
        try:
            shape = mesh_shape(wanted)
        except ValueError as e:
            raise ValueError(f"stage {st.name!r}: {e}") from None
        devices = None if st.devices is None else tuple(st.devices)
        size = shape["data"] * shape["model"]
        if devices is not None and len(devices) != size:
            raise ValueError(
                f"stage {st.name!r}: the mesh needs {size} devices but the device list has {len(devices)}"
            )
        layout = layouts[st.name] = StageLayout(shape, devices)
        if allow_shared_devices or (st.mesh is None and devices is None):
            continue  # on the default placement, every such stage shares its devices by design
        for d in layout.indices:
            other, listed = owner.setdefault(d, (st.name, devices is not None))
            if other != st.name and (listed or devices is not None):
                raise ValueError(
                    f"stages {other!r} and {st.name!r} both take device {d} (a stage with its own "
                    "mesh and no devices takes the first ones); give them disjoint devices or set "
                    "allow_shared_devices: true in the pipeline YAML"
                )
    return layouts


def stage_meshes(
    stages: Sequence[StagePlacement],
    default: Mapping[str, int] | None = None,
    allow_shared_devices: bool = False,
) -> dict[str, Mesh]:
    """One mesh per stage, laid out by :func:`stage_layouts`, or ``ValueError`` naming the stage
    whose layout is impossible on this machine."""
    meshes: dict[str, Mesh] = {}
    for name, layout in stage_layouts(stages, default, allow_shared_devices).items():
        try:
            mesh = make_mesh(layout.shape, layout.devices)
        except ValueError as e:
            raise ValueError(f"stage {name!r}: {e}") from None
        _check_spans_processes(name, mesh)
        meshes[name] = mesh
    return meshes


def _check_spans_processes(name: str, mesh: Mesh) -> None:
    """With several processes, a stage must own a device in each: every process reads the
    stage's (replicated) outputs to drive its own copy of the scheduler."""
    if jax.process_count() == 1:
        return
    have = {d.process_index for d in mesh.devices.flat}
    lacking = sorted(set(range(jax.process_count())) - have)
    if lacking:
        raise ValueError(
            f"stage {name!r}: its mesh has no device of process(es) {lacking}; with several processes "
            "every stage needs at least one device in each"
        )


def sharded_or_none(mesh: Mesh) -> Mesh | None:
    """``None`` for a mesh that is just the default device of a lone process.

    The engine's unsharded path is then the same computation without per-step placement
    work; everything else (another device, several devices or processes) runs on the mesh.
    """
    if mesh.size == 1 and jax.process_count() == 1 and mesh.devices.flat[0] == jax.devices()[0]:
        return None
    return mesh
