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


def stage_meshes(
    stages: Sequence[StagePlacement],
    default: Mapping[str, int] | None = None,
    allow_shared_devices: bool = False,
) -> dict[str, Mesh]:
    """One mesh per stage, or ``ValueError`` naming the stage whose layout is impossible.

    A stage with ``devices`` but no ``mesh`` splits them all over ``model``.
    """
    meshes: dict[str, Mesh] = {}
    owner: dict[object, str] = {}
    for st in stages:
        if st.mesh is not None:
            shape = st.mesh
        elif st.devices is not None:
            shape = {"data": 1, "model": len(st.devices)}
        else:
            shape = default
        try:
            mesh = make_mesh(mesh_shape(shape), st.devices)
        except ValueError as e:
            raise ValueError(f"stage {st.name!r}: {e}") from None
        if st.devices is not None and not allow_shared_devices:
            for d in mesh.devices.flat:
                if d in owner:
                    raise ValueError(
                        f"stages {owner[d]!r} and {st.name!r} both list device {d.id}; give them disjoint "
                        "devices or set allow_shared_devices: true in the pipeline YAML"
                    )
                owner[d] = st.name
        _check_spans_processes(st.name, mesh)
        meshes[st.name] = mesh
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
