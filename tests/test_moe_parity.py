"""Flax sparse MoE block vs transformers' Qwen3-Omni thinker and talker blocks, float32.

Weights are drawn far from HF's init so routing is decided by the signal: every expert is
chosen by some token, tokens disagree on their experts, and the top-k margins are far above
float32 noise (a flipped choice would show as an error of order 1, not 1e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import randomize_moe_block, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.moe import (
    EXPERT_RULES,
    FORMULATIONS,
    MOE_FORMS,
    MOE_SWITCH,
    MoESpec,
    SparseMoeBlock,
    expert_forms,
    expert_path,
    route,
    stack_expert_arrays,
)
from omni_jax.models.param_map import ParamMismatchError
from omni_jax.testing import randomize_weights

RTOL = 1e-6  # float32; only the order of the k weighted sums differs from the reference
D, EXPERTS, TOP_K, MOE_I = 48, 8, 3, 40


def thinker_config(norm_topk_prob: bool) -> Qwen3OmniMoeTextConfig:
    cfg = Qwen3OmniMoeTextConfig(
        hidden_size=D,
        moe_intermediate_size=MOE_I,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    cfg._experts_implementation = "eager"  # the reference's loop over experts
    return cfg


def talker_config() -> Qwen3OmniMoeTalkerTextConfig:
    cfg = Qwen3OmniMoeTalkerTextConfig(
        hidden_size=D,
        moe_intermediate_size=MOE_I,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        shared_expert_intermediate_size=56,
    )
    cfg._experts_implementation = "eager"
    return cfg


def randomize_moe(block: torch.nn.Module, seed: int) -> None:
    """Every weight ~ 1/sqrt(fan_in) (experts too: their fan-in is the last axis, where
    ``randomize_weights`` would take a whole ``[out, in]`` slice), router logits of order 3."""
    torch.manual_seed(seed)
    randomize_weights(block, 1.0)
    randomize_moe_block(block)


Case = tuple[torch.nn.Module, MoESpec]


def make_case(name: str, seed: int = 0) -> Case:
    if name == "talker_shared":
        cfg = talker_config()
        hf, spec = Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg), MoESpec.from_hf(cfg, shared_expert=True)
        assert not spec.norm_topk_prob and spec.shared_expert_size == 56
    else:
        cfg = thinker_config(norm_topk_prob=name == "thinker_norm_topk")
        hf, spec = Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg), MoESpec.from_hf(cfg)
    randomize_moe(hf, seed)
    return hf.eval(), spec


def load(spec: MoESpec, tensors) -> SparseMoeBlock:  # noqa: ANN001 - (name, array) pairs
    return build_model(
        lambda: SparseMoeBlock(spec, rngs=nnx.Rngs(0)), stack_expert_arrays(tensors), EXPERT_RULES
    )


def per_expert_names(hf: torch.nn.Module):  # noqa: ANN201 - (name, array) pairs
    """The block's tensors as checkpoints store them: one ``[out, in]`` tensor per expert and
    projection (what ``save_pretrained`` writes), in a scrambled order."""
    items = []
    for name, array in torch_state_items(hf):
        if name == "experts.gate_up_proj":
            i = array.shape[1] // 2
            for e in range(array.shape[0]):
                items += [
                    (f"experts.{e}.gate_proj.weight", array[e, :i]),
                    (f"experts.{e}.up_proj.weight", array[e, i:]),
                ]
        elif name == "experts.down_proj":
            items += [(f"experts.{e}.down_proj.weight", array[e]) for e in range(array.shape[0])]
        else:
            items.append((name, array))
    order = np.random.RandomState(0).permutation(len(items))
    return [items[i] for i in order]


def reference(hf: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("path", ["grouped", "dense", "assigned", "gathered"])
@pytest.mark.parametrize("name", ["thinker_norm_topk", "thinker_raw_topk", "talker_shared"])
def test_block_matches_transformers(name: str, path: str, monkeypatch) -> None:
    """A ragged-looking ``[B, T, D]`` batch through the block, eager and jitted, from either
    expert layout (transformers' fused in-memory tensors, checkpoints' per-expert ones), with
    the experts as grouped matmuls, as every expert on every row, pair by pair and gathered."""
    monkeypatch.setenv(MOE_SWITCH, path)
    assert expert_forms() == (path,) and expert_path(1, EXPERTS) == expert_path(10**6, EXPERTS) == path
    hf, spec = make_case(name)
    x = np.random.default_rng(1).standard_normal((3, 37, D)).astype(np.float32)
    want = reference(hf, x)

    fused = load(spec, torch_state_items(hf))
    got = fused(jnp.asarray(x))
    assert rel_err(got, want) < RTOL
    graphdef, state = nnx.split(load(spec, per_expert_names(hf)))
    jitted = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, jnp.asarray(x))
    assert rel_err(jitted, want) < RTOL


def test_routing_is_not_trivial() -> None:
    """The parity above is meaningful: every expert gets tokens, tokens' choices differ, and the
    k-th and (k+1)-th probabilities are far apart compared with float32 rounding."""
    hf, spec = make_case("thinker_norm_topk")
    block = load(spec, torch_state_items(hf))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((111, D)).astype(np.float32))
    logits = block.gate(x)
    _, experts = route(logits, spec.top_k, spec.norm_topk_prob, x.dtype)
    chosen = np.asarray(experts)
    assert set(chosen.ravel()) == set(range(EXPERTS))
    assert len({tuple(sorted(row)) for row in chosen}) > 10
    probs = np.sort(np.asarray(jax.nn.softmax(logits, axis=-1)), axis=-1)[:, ::-1]
    assert np.median(probs[:, TOP_K - 1] - probs[:, TOP_K]) > 1e-3


def test_route_matches_the_reference_router() -> None:
    """Weights and experts of :func:`route` are the reference router's, with and without
    renormalisation over the chosen k."""
    for name in ("thinker_norm_topk", "thinker_raw_topk"):
        hf, spec = make_case(name)
        x = np.random.default_rng(2).standard_normal((29, D)).astype(np.float32)
        with torch.no_grad():
            _, ref_weights, ref_experts = hf.gate(torch.from_numpy(x))
        logits = jnp.asarray(x) @ jnp.asarray(hf.gate.weight.detach().numpy().T)
        weights, experts = route(logits, spec.top_k, spec.norm_topk_prob, jnp.float32)
        np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
        assert rel_err(weights, ref_weights.numpy()) < RTOL


@pytest.mark.parametrize(
    ("backend", "forms", "most"),
    [
        ("tpu", ("grouped",), None),
        ("cpu", ("assigned", "dense"), 127),
        ("gpu", ("gathered", "dense"), 16),
        ("other", ("dense",), None),
    ],
)
def test_expert_path_follows_the_switch_the_backend_and_the_pairs(
    backend: str, forms: tuple[str, ...], most: int | None, monkeypatch
) -> None:
    """Unset or ``auto``: grouped on a TPU (its ragged dot is a grouped GEMM); on a CPU (whose
    ragged dot is E times the routed FLOPs) pair by pair when a step routes fewer (row, expert)
    pairs than the experts, dense from as many; on a GPU gathered up to an eighth as many pairs
    as experts, dense above; dense elsewhere; a named path is taken as named at any count on
    any backend; anything else is refused (set but empty is unset)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    for value in (None, "auto", ""):
        if value is None:
            monkeypatch.delenv(MOE_SWITCH, raising=False)
        else:
            monkeypatch.setenv(MOE_SWITCH, value)
        assert expert_forms() == forms
        assert expert_path(1, 128) == forms[0]
        if most is not None:
            assert expert_path(most, 128) == forms[0] and expert_path(most + 1, 128) == "dense"
        assert expert_path(128, 128) == forms[-1]
    for named in MOE_FORMS:
        monkeypatch.setenv(MOE_SWITCH, named)
        assert expert_path(1, 128) == expert_path(10**6, 128) == named
    monkeypatch.setenv(MOE_SWITCH, "sparse")
    refused = "OMNI_JAX_MOE='sparse': expected grouped, dense, assigned, gathered or auto"
    with pytest.raises(ValueError, match=refused):
        expert_path(1, 8)


@pytest.mark.parametrize("path", MOE_FORMS)
def test_another_devices_experts_add_nothing_and_no_rows_run(path: str) -> None:
    """Every formulation, on a stack of 5 of the 8 experts (as one device's under expert
    parallelism): a pair whose id is outside ``[0, 5)``, above or below (the id another device
    holds, shifted by this device's first), adds nothing; each row's output is the weighted sum
    of its pairs here, computed expert by expert in numpy; and a step of no rows gives none."""
    hf, spec = make_case("thinker_norm_topk")
    block = load(spec, torch_state_items(hf))
    gate, up, down = (
        np.asarray(p[...])[:5]
        for p in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj)
    )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, D)).astype(np.float32)
    experts = rng.integers(-4, 9, size=(6, TOP_K)).astype(np.int32)
    experts[0] = [-1, 5, 7]  # none of this row's experts are here
    experts[1] = [0, 1, 4]  # all are
    weights = rng.random((6, TOP_K)).astype(np.float32)
    want = np.zeros_like(x)
    for n, j in np.ndindex(*experts.shape):
        e = experts[n, j]
        if 0 <= e < 5:
            h = x[n] @ gate[e]
            want[n] += weights[n, j] * ((h / (1 + np.exp(-h))) * (x[n] @ up[e])) @ down[e]
    got = np.asarray(FORMULATIONS[path](x, experts, weights, gate, up, down))
    assert not got[0].any()
    assert rel_err(got, want) < RTOL
    empty = FORMULATIONS[path](x[:0], experts[:0], weights[:0], gate, up, down)
    assert empty.shape == (0, D)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pair by pair is a CPU's choice")
@pytest.mark.parametrize(("rows", "path"), [(2, "assigned"), (3, "dense")])
def test_a_step_runs_pair_by_pair_below_as_many_pairs_as_experts(rows: int, path: str, monkeypatch) -> None:
    """Unset ``OMNI_JAX_MOE`` on a CPU: 2 rows route 6 pairs over 8 experts and run pair
    by pair (a loop whose body reads one expert: a ``scan`` in the trace), 3 rows route 9 and
    run dense (no loop); both equal transformers."""
    monkeypatch.delenv(MOE_SWITCH, raising=False)
    assert expert_path(rows * TOP_K, EXPERTS) == path
    hf, spec = make_case("thinker_norm_topk")
    block = load(spec, torch_state_items(hf))
    x = np.random.default_rng(3).standard_normal((1, rows, D)).astype(np.float32)
    traced = str(jax.make_jaxpr(lambda v: block(v))(jnp.asarray(x)))
    assert ("scan[" in traced) == (path == "assigned")
    graphdef, state = nnx.split(block)
    got = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, jnp.asarray(x))
    assert rel_err(got, reference(hf, x)) < RTOL


def test_missing_expert_is_refused() -> None:
    hf, spec = make_case("thinker_raw_topk")
    tensors = [(n, a) for n, a in per_expert_names(hf) if n != "experts.5.up_proj.weight"]
    with pytest.raises(ParamMismatchError, match=r"'experts.up_proj': the checkpoint lacks experts \[5\]"):
        load(spec, tensors)
