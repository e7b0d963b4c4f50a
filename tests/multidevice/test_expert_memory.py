"""Expert parallelism in the memory plan (issue 23, item 2): each device counts the experts it holds.

Qwen3-Omni's sparse blocks store their experts stacked, ``[E, ...]``. A ``model`` axis that
divides ``E`` gives each device ``E / model`` whole experts, any other splits every expert by
width (:func:`omni_jax.models.moe.expert_partition_rules`). The plan (:func:`plan_memory`, from
``config.json`` alone) and the start-up check (:func:`check_memory_before_loading`) count a
stage's weights per device from its abstract model under the same rules
(:func:`device_weight_bytes`); here both are held to the bytes each device of an emulated
``data=2`` mesh holds once the weights are placed, for ``model`` of 1, 2 and 4. The thinker is
loaded from the tiny checkpoint (as HF float32 and converted to bfloat16). The talker is not a
served stage yet, so it is placed by its own partition rules (decoder as the thinker's, code
predictor and projections whole on every device), and once more with six experts, which
``model=4`` splits by width.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from omni_jax.architectures import architecture_of
from omni_jax.engine import memory
from omni_jax.engine.memory import format_bytes
from omni_jax.models.qwen3_omni.talker import Talker, TalkerSpec, talker_partition_rules
from omni_jax.parallel import make_mesh
from omni_jax.parallel.rules import ShardRule, layout
from omni_jax.planning import plan_memory, size_text
from omni_jax.preflight import (
    PlannedMesh,
    check_memory_before_loading,
    device_weight_bytes,
    stage_needs,
)
from omni_jax.stages.config import load_pipeline_config
from omni_jax.weights import convert, load_hf_config, load_part

MODELS = (1, 2, 4)
WHOLE = ("code_predictor", "text_projection", "hidden_projection")
"""The talker's modules every device holds whole (``talker_partition_rules``)."""


@pytest.fixture(scope="module")
def qwen3_omni_bf16(qwen3_omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Omni converted to bfloat16 (its experts restored straight into their shards)."""
    return convert(qwen3_omni_dir, tmp_path_factory.mktemp("qwen3_bf16") / "conv", "bfloat16", progress=False)


def held_bytes(model: nnx.Module) -> dict[jax.Device, int]:
    """Bytes of ``model``'s parameters on each device: the sizes of its arrays' shards there."""
    held: dict[jax.Device, int] = {}
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for shard in var.get_value().addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def expert_shards(model: nnx.Module) -> dict[str, tuple[tuple[int, ...], set[tuple[int, ...]]]]:
    """Each stacked expert parameter's ``(shape, shapes of its shards)`` (one shard shape when
    every device holds the same share)."""
    return {
        ".".join(map(str, path)): (
            tuple(var.shape),
            {s.data.shape for s in var.get_value().addressable_shards},
        )
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if "experts" in path
    }


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("source", ["qwen3_omni_dir", "qwen3_omni_bf16"])
def test_thinker_plan_and_refusal_count_the_experts_each_device_holds(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, source: str, model: int
) -> None:
    """The plan's per-device weights, its table's cell and the start-up refusal's weights item
    are what loading puts on each device: ``8 / model`` whole experts of each stack."""
    path = request.getfixturevalue(source)
    shape = {"data": 2, "model": model}
    mesh = make_mesh(shape)
    loaded, hf_config = load_part(path, "thinker", mesh=mesh)
    plan = plan_memory(path, stages=["thinker"], mesh=shape)
    (planned,) = plan.stages

    held = held_bytes(loaded)
    assert len(held) == 2 * model
    assert set(held.values()) == {planned.weights}, (held, planned.weights)
    experts = hf_config.thinker_config.text_config.num_experts
    stacks = expert_shards(loaded)
    assert len(stacks) == 6  # gate, up and down of the two sparse layers (layer 1 is dense)
    for name, (full, shards) in stacks.items():
        assert shards == {(experts // model, *full[1:])}, name

    (row,) = [line for line in plan.table().splitlines() if line.startswith("thinker ")]
    assert size_text(planned.weights) in row, row

    # The emulated devices are CPU ones: they share the host's memory, so a refusal adds up
    # every device's share of the weights.
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 0)
    stages = load_pipeline_config(architecture_of(hf_config).stage_yaml).select(["thinker"]).stages
    engine = dict(max_num_seqs=None, max_model_len=None, page_size=None, max_num_batched_tokens=None)
    needs = stage_needs(path, hf_config, stages, {"thinker": mesh}, dtype=None, **engine)
    with pytest.raises(ValueError, match="the pipeline needs") as refused:
        check_memory_before_loading(needs, None)
    assert f"stage 'thinker' weights: {format_bytes(planned.weights * 2 * model)}" in str(refused.value)


def place(abstract: nnx.Module, rules: tuple[ShardRule, ...], mesh: jax.sharding.Mesh) -> nnx.Module:
    """``abstract`` (shapes only) with every parameter put on ``mesh`` as ``rules`` lay it out
    (zeros: what a device holds depends on shapes and dtypes, not values)."""
    graphdef, state = nnx.split(abstract)
    where = layout(rules, mesh)
    flat = [
        (path, var.replace(jax.device_put(np.zeros(var.shape, var.dtype), where(path, var.shape))))
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize(
    ("experts", "model", "per_device", "width"),
    [(4, 1, 4, 32), (4, 2, 2, 32), (4, 4, 1, 32), (6, 4, 6, 8)],
    ids=["model1", "model2", "model4", "6_experts_model4_by_width"],
)
def test_talker_weights_counted_as_its_rules_place_them(
    qwen3_omni_dir: Path, experts: int, model: int, per_device: int, width: int
) -> None:
    """``per_device`` experts of ``width`` (of 32) on every device; the figure the plan takes
    (:func:`device_weight_bytes` on the abstract talker) is what each device holds."""
    spec = TalkerSpec.from_hf(load_hf_config(qwen3_omni_dir).talker_config)
    moe = dataclasses.replace(spec.text.moe, num_experts=experts)
    spec = dataclasses.replace(spec, text=dataclasses.replace(spec.text, moe=moe))
    shape = {"data": 2, "model": model}
    rules = talker_partition_rules(spec, model)
    abstract = nnx.eval_shape(lambda: Talker(spec, rngs=nnx.Rngs(0)))
    planned = device_weight_bytes(abstract, rules, PlannedMesh(shape, "cpu"))
    placed = place(abstract, rules, make_mesh(shape))
    held = held_bytes(placed)
    assert len(held) == 2 * model
    assert set(held.values()) == {planned}, (held, planned)
    hidden = spec.text.hidden_size
    stacks = expert_shards(placed)
    assert len(stacks) == 6  # gate, up and down of both layers
    for name, (_, shards) in stacks.items():
        want = (per_device, width, hidden) if name.endswith("down_proj") else (per_device, hidden, width)
        assert shards == {want}, name
    for path, var in nnx.to_flat_state(nnx.state(placed, nnx.Param)):
        if path[0] in WHOLE:
            assert {s.data.shape for s in var.get_value().addressable_shards} == {tuple(var.shape)}, path
