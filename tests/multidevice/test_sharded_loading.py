"""Loading onto a mesh: each device receives only its shard, and holds what the plan says.

:func:`~omni_jax.parallel.rules.put_cast` asks its source for each distinct shard once, never
for the whole array of a split parameter, so a memory-mapped checkpoint tensor is read (and
cast) shard by shard. What each device then holds is what :func:`omni_jax.planning.plan_memory`
computes from ``config.json`` alone.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.parallel import make_mesh
from omni_jax.parallel.rules import put_cast
from omni_jax.planning import plan_memory
from omni_jax.weights import load_part


class Recording:
    """A host array that records every slice asked of it."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape = array.shape
        self.asked: list[tuple[tuple[int | None, ...], ...]] = []

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        self.asked.append(tuple((s.start, s.stop) for s in index))
        return self.array[index]


@pytest.mark.parametrize(
    "spec,distinct",
    [(P(None, "model"), 4), (P("model", None), 4), (P("data", "model"), 8), (P(), 1)],
)
def test_put_cast_reads_each_shard_once_and_casts_it(spec, distinct) -> None:
    mesh = make_mesh({"data": 2, "model": 4})
    host = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    source = Recording(host.T.T)  # a view, as a rule's transform leaves a mapped tensor
    out = put_cast(source, NamedSharding(mesh, spec), ml_dtypes.bfloat16)
    assert out.dtype == ml_dtypes.bfloat16 and out.sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(out), host.astype(ml_dtypes.bfloat16))
    assert len(source.asked) == len(set(source.asked)) == distinct
    whole = ((0, 8), (0, 16)) if distinct == 1 else None
    for asked in source.asked:  # a split parameter is never asked for whole
        norm = tuple((a or 0, b if b is not None else n) for (a, b), n in zip(asked, host.shape, strict=True))
        assert (norm == whole) if whole else norm != ((0, 8), (0, 16)), asked
    for shard in out.addressable_shards:
        assert shard.data.shape == out.sharding.shard_shape(host.shape)


def device_bytes(model: nnx.Module) -> dict[jax.Device, int]:
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


@pytest.mark.parametrize(
    "which,stage,built",
    [
        ("gqa_dir", "llm", None),
        ("omni_dir", "thinker", None),
        ("omni_dir", "talker", ["thinker", "talker"]),
        ("qwen3_omni_dir", "talker", ["thinker", "talker"]),
    ],
)
def test_each_device_holds_the_planned_weights(request, which, stage, built) -> None:
    path = request.getfixturevalue(which)
    shape = {"data": 2, "model": 4}
    model, _ = load_part(path, stage, mesh=make_mesh(shape))
    planned = {s.name: s for s in plan_memory(path, stages=built or [stage], mesh=shape).stages}[stage]
    held = device_bytes(model)
    assert len(held) == 8
    assert set(held.values()) == {planned.weights}, (held, planned.weights)


@pytest.mark.parametrize(
    "dtype,budget,model", [("bfloat16", 16, 4), ("bfloat16", 2048, 2), ("float32", 2048, 4)]
)
def test_split_step_estimate_against_xla(dtype: str, budget: int, model: int) -> None:
    """One device's share of the largest AR step split over a ``model`` axis: the plan's
    estimate (:meth:`~omni_jax.stages.ar.CachePlan.of` with Qwen2's partition rules) against
    XLA's count of the partitioned program, at Qwen2-7B's widths (two layers, traced from
    shapes): at least as large, at most twice, as on one device
    (``tests/test_reliability_limits.py``). In bfloat16 each device converts only its own shards
    to float32; counted whole on every device, the estimate was 6.1 times XLA's at ``model`` 4."""
    from benchmarks.step_memory import step_memory

    m = step_memory(dtype, layers=2, budget=budget, model_axis=model)
    assert m.xla <= m.estimate <= 2 * m.xla + (64 << 20), m
