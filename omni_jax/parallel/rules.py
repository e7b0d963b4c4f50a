"""Partition rules: which mesh axis splits which dimension of each parameter.

A model declares its rules next to its code as :class:`ShardRule` entries (a regular
expression over the dotted Flax path, one mesh axis or ``None`` per dimension); a parameter no
rule names is replicated. Weights are then put straight into their shards as they are read
(:func:`put_cast`), so the full model never sits on one device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from omni_jax.host_copy import contiguous
from omni_jax.models.param_map import FlaxPath, format_path


@dataclasses.dataclass(frozen=True)
class ShardRule:
    """``pattern`` (full match on the dotted path, e.g. ``model.layers.3.mlp.up_proj.kernel``)
    and ``axes``: the mesh axis each dimension is split over, ``None`` for whole."""

    pattern: str
    axes: tuple[str | None, ...]
    _compiled: re.Pattern[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern))

    def matches(self, dotted: str) -> bool:
        return self._compiled.fullmatch(dotted) is not None


PartitionRules = Callable[[Any, int], tuple[ShardRule, ...]]
"""``(hf_config, model_axis_size) -> rules``: a part's rules may depend on the ``model`` size
(e.g. K/V projections are replicated when ``model`` does not divide the KV heads), and raise
``ValueError`` for a size the model cannot be split by."""


def partition_spec(
    path: FlaxPath, shape: tuple[int, ...], rules: Iterable[ShardRule], mesh: Mesh
) -> PartitionSpec:
    """The first matching rule's spec for ``path``; replicated when none matches.

    A dimension its axis does not divide stays whole (an uneven split is not a layout XLA
    shards), so e.g. a vocabulary of 151,655 rows is replicated rather than refused.
    """
    dotted = format_path(path)
    for rule in rules:
        if not rule.matches(dotted):
            continue
        if len(rule.axes) != len(shape):
            raise ValueError(
                f"partition rule {rule.pattern!r} has {len(rule.axes)} axes, {dotted} has shape {shape}"
            )
        split = zip(rule.axes, shape, strict=True)
        return PartitionSpec(*(a if a is None or dim % mesh.shape[a] == 0 else None for a, dim in split))
    return PartitionSpec()


def shard_size(path: FlaxPath, shape: tuple[int, ...], rules: Iterable[ShardRule], mesh: Mesh) -> int:
    """Elements of the ``shape`` parameter at ``path`` that one device of ``mesh`` holds under
    ``rules``: each split dimension divided by its axis size, a replicated parameter whole."""
    spec = partition_spec(path, shape, rules, mesh)
    return math.prod(shape) // math.prod(mesh.shape[a] for a in spec if a is not None)


Layout = Callable[[FlaxPath, tuple[int, ...]], NamedSharding]
"""``(parameter path, shape) -> sharding``: where a parameter's shards go."""


def layout(rules: Iterable[ShardRule], mesh: Mesh) -> Layout:
    """The :data:`Layout` that ``rules`` give on ``mesh``."""
    rules = tuple(rules)
    return lambda path, shape: NamedSharding(mesh, partition_spec(path, tuple(shape), rules, mesh))


def put(x: Any, sharding: Any) -> Any:
    """Host array(s) -> global arrays laid out by ``sharding`` (a matching pytree, or one for all).

    Each device receives only its shard. With several processes each one holds the same host
    value and fills only the shards of its own devices (``jax.device_put`` cannot address
    another process's devices).
    """
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)

    def one(a: Any, s: jax.sharding.Sharding) -> jax.Array:
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, s, lambda index: a[index])

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a: one(a, sharding), x)
    return jax.tree.map(one, x, sharding)


class HostArray(Protocol):
    """What :func:`put_cast` places: a shape, and numpy slices of it on demand (an ``np.ndarray``,
    a memory-mapped tensor, an array stored in a checkpoint)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray: ...


def put_cast(x: HostArray, sharding: jax.sharding.Sharding | None, dtype: Any) -> jax.Array:
    """A host array, typically a view of a memory-mapped checkpoint tensor, as a global array of
    ``dtype`` laid out by ``sharding`` (``None``: the default device).

    Each device's shard is sliced from ``x`` and cast on the host for that shard alone, once
    per distinct shard (a shard replicated over ``data`` goes to every device holding it), so a
    sharded parameter is never copied whole on the host and no copy of it is made in any other
    dtype. With several processes each one fills only its own devices' shards.
    """
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shards: dict[tuple[Any, ...], np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            shards[key] = contiguous(x[index], dtype)
        return shards[key]

    return jax.make_array_from_callback(tuple(x.shape), sharding, shard, dtype=dtype)


def fetch(x: jax.Array | np.ndarray) -> np.ndarray:
    """A global array's whole value on this host, the inverse of :func:`put`. An array spanning
    other processes' devices is gathered from them (every process must call this together);
    a host array is returned as it is."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def replicated_kv_heads(num_kv_heads: int, num_heads: int, model: int) -> int:
    """KV heads the cache holds so that ``model`` splits it evenly: ``lcm(num_kv_heads, model)``.

    With fewer KV heads than ``model`` (or a count ``model`` does not divide), each KV head is
    stored ``lcm / num_kv_heads`` times, consecutively. Device ``i`` then holds exactly the KV
    heads its query heads read: query head ``j`` reads stored head ``j // (num_heads / lcm)``,
    which is a copy of original head ``j // (num_heads / num_kv_heads)``. Any ``model`` that
    divides ``num_heads`` works, since ``num_heads`` is a multiple of both.
    """
    if num_heads % model:
        raise ValueError(
            f"mesh model={model} does not divide the {num_heads} attention heads{splits(num_heads)}"
        )
    return math.lcm(num_kv_heads, model)


def splits(num_heads: int) -> str:
    """`` (model sizes that do: 1, 2, ...)``: what a refusal of a ``model`` size that does not
    divide ``num_heads`` heads offers instead."""
    return (
        f" (model sizes that do: {', '.join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)})"
    )
