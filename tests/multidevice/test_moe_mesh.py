"""The sparse MoE block and the Qwen3-Omni text decoder on a 2x4 mesh equal one device.

With ``model=4`` dividing the experts, each device holds whole experts and runs them on its
``data`` share of the rows (``shard_map``, one all-reduce over ``model``); with a number of
experts ``model`` does not divide, each expert is split by width and XLA partitions the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parity import SPLIT_ROUNDING, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

from omni_jax.full_forward import full_forward
from omni_jax.models.moe import MOE_SWITCH, MoESpec, SparseMoeBlock, expert_partition_rules
from omni_jax.models.qwen3_omni.text_decoder import (
    Qwen3OmniTextLM,
    Qwen3OmniTextSpec,
    text_lm_partition_rules,
)
from omni_jax.parallel import make_mesh
from omni_jax.parallel.rules import ShardRule, layout

MESH = {"data": 2, "model": 4}


def shard(module: nnx.Module, rules: tuple[ShardRule, ...], mesh: jax.sharding.Mesh) -> nnx.Module:
    """``module`` with every parameter laid out on ``mesh`` as ``rules`` say."""
    graphdef, state = nnx.split(module)
    place = layout(rules, mesh)
    flat = [
        (path, v.replace(jax.device_put(v.get_value(), place(path, v.shape))))
        for path, v in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def run(block: SparseMoeBlock, x: np.ndarray, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    graphdef, state = nnx.split(block)
    step = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    if mesh is None:
        return np.asarray(step(state, jnp.asarray(x)))
    with jax.set_mesh(mesh):
        return np.asarray(step(state, jax.device_put(x, NamedSharding(mesh, P()))))


@pytest.mark.parametrize("path", ["grouped", "dense", "assigned", "gathered"])
@pytest.mark.parametrize(
    ("experts", "shared", "rows"),
    [(8, 0, 48), (8, 0, 7), (8, 40, 48), (6, 0, 48)],
    ids=["experts_split", "rows_not_split", "shared_expert", "width_split"],
)
def test_moe_block_on_2x4_mesh_equals_one_device(
    experts: int, shared: int, rows: int, path: str, monkeypatch
) -> None:
    monkeypatch.setenv(MOE_SWITCH, path)
    spec = MoESpec(32, 24, experts, 3, norm_topk_prob=True, shared_expert_size=shared)
    block = SparseMoeBlock(spec, rngs=nnx.Rngs(0))
    block.gate.kernel.set_value(block.gate.kernel.get_value() * 3.0)  # routing decided by the signal
    x = np.random.default_rng(1).standard_normal((rows, 32)).astype(np.float32)
    want = run(block, x)
    assert len(set(np.asarray(jax.lax.top_k(block.gate(jnp.asarray(x)), 3)[1]).ravel())) == experts

    mesh = make_mesh(MESH)
    split = shard(block, expert_partition_rules("", spec, MESH["model"]), mesh)
    gate = split.experts.gate_proj.get_value()
    per_device = (experts // 4, 32, 24) if experts % 4 == 0 else (experts, 32, 24 // 4)
    assert {s.data.shape for s in gate.addressable_shards} == {per_device}
    with jax.set_mesh(mesh):
        traced = str(jax.make_jaxpr(lambda v: split(v))(jnp.asarray(x)))
    assert ("shard_map" in traced) == (experts % 4 == 0)
    assert rel_err(run(split, x, mesh), want) < SPLIT_ROUNDING


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pair by pair is a CPU's choice")
@pytest.mark.parametrize(
    ("experts", "path"), [(16, "assigned"), (10, "dense")], ids=["experts_split", "width_split"]
)
def test_rows_split_over_data_choose_by_each_devices_pairs(experts: int, path: str, monkeypatch) -> None:
    """Unset ``OMNI_JAX_MOE``, 2 rows laid out over ``data``: with 16 experts split 4 a device,
    each device routes its 1 row's 3 pairs over its 4 experts and runs them pair by pair inside
    its ``shard_map`` (one device alone runs its 6 pairs pair by pair too); with 10 experts
    split by width, XLA partitions the step, which would gather every ``data`` share's
    pairs into each device's loop, so it runs dense. Both equal one device."""
    monkeypatch.delenv(MOE_SWITCH, raising=False)
    spec = MoESpec(32, 24, experts, 3, norm_topk_prob=True)
    block = SparseMoeBlock(spec, rngs=nnx.Rngs(0))
    block.gate.kernel.set_value(block.gate.kernel.get_value() * 3.0)
    x = np.random.default_rng(2).standard_normal((2, 32)).astype(np.float32)
    want = run(block, x)
    assert "scan[" in str(jax.make_jaxpr(lambda v: block(v))(jnp.asarray(x)))

    mesh = make_mesh(MESH)
    split = shard(block, expert_partition_rules("", spec, MESH["model"]), mesh)
    graphdef, state = nnx.split(split)
    step = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    with jax.set_mesh(mesh):
        rows = jax.device_put(x, NamedSharding(mesh, P("data")))
        traced = str(jax.make_jaxpr(lambda v: split(v))(rows))
        got = np.asarray(step(state, rows))
    assert ("scan[" in traced) == (path == "assigned")
    assert rel_err(got, want) < SPLIT_ROUNDING


def test_text_decoder_on_2x4_mesh_equals_one_device() -> None:
    """The whole decoder (attention by heads, dense layer by width, experts whole per device,
    head by vocabulary) over a prompt: the same logits as one device."""
    cfg = Qwen3OmniMoeTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    )
    spec = Qwen3OmniTextSpec.from_hf(cfg)
    model = Qwen3OmniTextLM(spec, rngs=nnx.Rngs(2))
    ids = np.random.RandomState(3).randint(0, 128, size=19).tolist()
    want, _ = full_forward(model, ids, page_size=4)

    mesh = make_mesh(MESH)
    split = shard(model, text_lm_partition_rules(spec, MESH["model"]), mesh)
    experts = split.model.layers[0].mlp.experts.down_proj.get_value()
    assert {s.data.shape for s in experts.addressable_shards} == {(2, 24, 64)}
    with jax.set_mesh(mesh):
        got, _ = full_forward(split, ids, page_size=4)
    assert rel_err(got, want) < SPLIT_ROUNDING
