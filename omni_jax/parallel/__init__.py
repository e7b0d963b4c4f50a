"""Meshes, partition rules, per-stage placement and multi-process start (docs/ARCHITECTURE.md)."""

from omni_jax.parallel.distributed import initialize, is_main_process
from omni_jax.parallel.mesh import AXES, make_mesh, mesh_shape, parse_mesh
from omni_jax.parallel.placement import StagePlacement, stage_meshes
from omni_jax.parallel.rules import ShardRule, layout, put, replicated_kv_heads

__all__ = [
    "AXES",
    "ShardRule",
    "StagePlacement",
    "initialize",
    "is_main_process",
    "layout",
    "make_mesh",
    "mesh_shape",
    "parse_mesh",
    "put",
    "replicated_kv_heads",
    "stage_meshes",
]
