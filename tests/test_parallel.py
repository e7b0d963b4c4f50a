"""Mesh specs, partition rules, KV-head replication, stage placement and multi-process start:
everything about sharding that one device can check (``tests/multidevice`` has the rest)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from omni_jax import OmniJaxPipeline
from omni_jax.models.attention import write_kv
from omni_jax.models.param_map import parse_path
from omni_jax.models.qwen2 import Qwen2Spec, partition_rules
from omni_jax.parallel import (
    ShardRule,
    StagePlacement,
    initialize,
    make_mesh,
    mesh_shape,
    parse_mesh,
    replicated_kv_heads,
    stage_meshes,
)
from omni_jax.parallel.placement import stage_layouts
from omni_jax.parallel.rules import partition_spec
from omni_jax.stages.config import load_pipeline_config
from omni_jax.testing import tiny_qwen2_config


def test_mesh_shape_defaults_and_refusals() -> None:
    assert mesh_shape(None) == {"data": 1, "model": 1}
    assert mesh_shape({"model": 4}) == {"data": 1, "model": 4}
    assert parse_mesh("data=2, model=4") == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="unknown axes \\['tensor'\\]"):
        mesh_shape({"tensor": 2})
    with pytest.raises(ValueError, match="'data' must be a positive int, got 0"):
        mesh_shape({"data": 0})
    with pytest.raises(ValueError, match="axis=size pairs"):
        parse_mesh("data:2")
    with pytest.raises(ValueError, match=r"^mesh='data=2,model=2' must be a dict of axis sizes .*got str$"):
        mesh_shape("data=2,model=2")  # type: ignore[arg-type]  # the command line's form, in Python
    assert mesh_shape({"data": 1024, "model": 1024}) == {"data": 1024, "model": 1024}
    with pytest.raises(ValueError, match=r"2097152 devices, more than the 1048576 allowed"):
        mesh_shape({"data": 2048, "model": 1024})
    with pytest.raises(ValueError, match=r"99999999999999999999 devices"):  # was an OverflowError
        parse_mesh("model=99999999999999999999")


def test_one_device_mesh_and_too_many_devices() -> None:
    mesh = make_mesh({"data": 1, "model": 1})
    assert mesh.axis_names == ("data", "model") and mesh.devices.flat[0] == jax.devices()[0]
    with pytest.raises(ValueError, match="needs 2 devices but only 1 exist"):
        make_mesh({"model": 2})


def test_from_pretrained_refuses_a_mesh_larger_than_the_machine(qwen2_dir) -> None:
    with pytest.raises(ValueError, match="stage 'llm': the mesh needs 4 devices but only 1 exist"):
        OmniJaxPipeline.from_pretrained(qwen2_dir, mesh={"data": 2, "model": 2})


@pytest.mark.parametrize(
    "kv,heads,model,stored",
    [(2, 8, 1, 2), (2, 8, 2, 2), (2, 8, 4, 4), (2, 8, 8, 8), (3, 6, 2, 6), (4, 8, 2, 4)],
)
def test_replicated_kv_heads(kv: int, heads: int, model: int, stored: int) -> None:
    """``lcm(kv, model)``: each device's query heads find their KV heads on the same device."""
    assert replicated_kv_heads(kv, heads, model) == stored
    per_device = heads // model
    group = heads // kv
    for dev in range(model):
        qs = range(dev * per_device, (dev + 1) * per_device)
        local = range(dev * stored // model, (dev + 1) * stored // model)  # stored heads on this device
        for q in qs:
            s = q // (heads // stored)  # the stored head grouped attention gives query head q
            assert s in local and s // (stored // kv) == q // group


def test_model_axis_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="mesh model=3 does not divide the 8 attention heads"):
        replicated_kv_heads(2, 8, 3)


def test_qwen2_rules_replicate_kv_projections_past_the_kv_heads() -> None:
    spec = Qwen2Spec.from_hf(tiny_qwen2_config(64, num_attention_heads=8, num_key_value_heads=2))
    mesh = make_mesh()

    def spec_of(rules: tuple[ShardRule, ...], path: str, shape: tuple[int, ...]) -> tuple:
        return tuple(partition_spec(parse_path(path), shape, rules, mesh))

    k = "model.layers.1.self_attn.k_proj.kernel"
    assert spec_of(partition_rules(spec, 2), k, (64, 16)) == (None, "model")
    assert spec_of(partition_rules(spec, 4), k, (64, 16)) == ()
    assert spec_of(partition_rules(spec, 4), "model.layers.0.self_attn.q_proj.kernel", (64, 64)) == (
        None,
        "model",
    )
    assert spec_of(partition_rules(spec, 4), "model.layers.0.mlp.down_proj.kernel", (128, 64)) == (
        "model",
        None,
    )
    assert spec_of(partition_rules(spec, 4), "model.embed_tokens.embedding", (64, 64)) == ("model", None)
    assert spec_of(partition_rules(spec, 4), "model.norm.weight", (64,)) == ()
    with pytest.raises(ValueError, match="does not divide the 8 attention heads"):
        partition_rules(spec, 3)


def test_a_dimension_the_axis_does_not_divide_stays_whole() -> None:
    """Only ``mesh.shape`` is read, so a stand-in mesh can be two-way on one device."""
    two_way = SimpleNamespace(shape={"data": 1, "model": 2})
    rule = (ShardRule(r"w", ("model", None)),)
    assert tuple(partition_spec(("w",), (5, 3), rule, two_way)) == (None, None)
    assert tuple(partition_spec(("w",), (6, 3), rule, two_way)) == ("model", None)
    with pytest.raises(ValueError, match="has 2 axes, w has shape \\(6,\\)"):
        partition_spec(("w",), (6,), rule, two_way)


def test_write_kv_fills_replicated_heads() -> None:
    """A cache with twice the model's KV heads stores each head twice, in a row."""
    pages = jnp.zeros((4, 2, 2, 3))
    k = jnp.arange(2 * 3, dtype=jnp.float32).reshape(1, 1, 2, 3)
    new_k, _ = write_kv(pages, pages, k, k, jnp.array([[1]]))
    np.testing.assert_array_equal(np.asarray(new_k)[:, 0, 1], np.repeat(np.asarray(k)[0, 0], 2, axis=0))


def test_stage_meshes_default_and_overlap() -> None:
    meshes = stage_meshes([StagePlacement("a"), StagePlacement("b", devices=[0])])
    assert dict(meshes["a"].shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="stages 'a' and 'b' both take device 0"):
        stage_meshes([StagePlacement("a", devices=[0]), StagePlacement("b", devices=[0])])
    assert (
        len(stage_meshes([StagePlacement("a", devices=[0]), StagePlacement("b", devices=[0])], None, True))
        == 2
    )
    with pytest.raises(ValueError, match="stage 'a': device list \\[0, 0\\] names a device twice"):
        stage_meshes([StagePlacement("a", mesh={"model": 2}, devices=[0, 0])])


def test_a_listed_device_under_another_stages_own_mesh_is_refused() -> None:
    """A stage with its own mesh and no device list takes the first devices: another stage that
    lists one of them shares it as surely as two lists would. Stages on the default placement,
    or two with meshes alone, share the first devices by design."""
    with pytest.raises(ValueError, match="stages 'thinker' and 'talker' both take device 1 \\(a stage"):
        stage_layouts(
            [StagePlacement("thinker", mesh={"model": 2}), StagePlacement("talker", devices=[1, 4])]
        )
    with pytest.raises(ValueError, match="stages 'talker' and 'thinker' both take device 0"):
        stage_layouts([StagePlacement("talker", devices=[0]), StagePlacement("thinker", mesh={"data": 2})])
    assert (
        len(stage_layouts([StagePlacement("a", mesh={"model": 2}), StagePlacement("b", mesh={"model": 2})]))
        == 2
    )
    assert len(stage_layouts([StagePlacement("a"), StagePlacement("b", devices=[0, 1])], {"model": 2})) == 2


def test_stage_yaml_mesh_and_devices(tmp_path) -> None:
    raw = {
        "architecture": "Qwen2ForCausalLM",
        "allow_shared_devices": True,
        "stages": [{"name": "llm", "kind": "ar", "input": "prompt", "mesh": {"model": 2}, "devices": [0, 1]}],
    }
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline_config(f)
    assert cfg.allow_shared_devices and cfg.stages[0].mesh == {"model": 2} and cfg.stages[0].devices == [0, 1]
    raw["stages"][0]["mesh"] = {"tp": 2}
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="stage 'llm': mesh \\{'tp': 2\\}: unknown axes"):
        load_pipeline_config(f)


def test_distributed_start_needs_all_three_settings(monkeypatch) -> None:
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert initialize() is False  # nothing configured: one process, nothing to join
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    with pytest.raises(
        ValueError,
        match="missing the process count \\(--num-processes or JAX_NUM_PROCESSES\\), this process's id "
        "\\(--process-id or JAX_PROCESS_ID\\)$",
    ):
        initialize()


@pytest.mark.parametrize(
    "env,match",
    [
        ({"JAX_NUM_PROCESSES": "x"}, "JAX_NUM_PROCESSES='x' must be an integer"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "two"}, "JAX_PROCESS_ID='two' must be an integer"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "an id in \\[0, count\\); got count 2, id 2"),
        ({"JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"}, "a process count >= 1"),
        (
            {"JAX_COORDINATOR_ADDRESS": "nohostport", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"},
            r"coordinator address 'nohostport' \(--coordinator-address or JAX_COORDINATOR_ADDRESS\) must be "
            "HOST:PORT with a port from 1 to 65535",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "localhost:abc", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"},
            r"coordinator address 'localhost:abc' ",
        ),
    ],
)
def test_distributed_settings_are_checked_by_name(monkeypatch, env, match) -> None:
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    for var in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        initialize()
