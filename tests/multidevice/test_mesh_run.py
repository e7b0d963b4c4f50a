"""Greedy ``run()`` on every mesh shape equals the single-device run, with the weights and the
KV cache really split (checked on the arrays' shardings and per-device shard shapes)."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from parity import SPLIT_ROUNDING, check_bfloat16_greedy, rel_err

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.parallel import make_mesh
from omni_jax.weights import convert, load_part

from .conftest import PIPE_KW, greedy

MESHES = [(1, 1), (1, 2), (2, 2), (2, 4), (1, 8)]


@pytest.fixture(scope="module")
def pipes(single_device: OmniJaxPipeline) -> dict[tuple[int, int], OmniJaxPipeline]:
    """Built on first use, shared by the tests of one mesh shape."""
    return {(1, 1): single_device}


def pipe_for(pipes: dict, path: Path, d: int, m: int) -> OmniJaxPipeline:
    if (d, m) not in pipes:
        pipes[d, m] = OmniJaxPipeline.from_pretrained(path, mesh={"data": d, "model": m}, **PIPE_KW)
    return pipes[d, m]


def params_of(pipe: OmniJaxPipeline) -> dict[str, jax.Array]:
    state = pipe.stages[0].engine.runner.state
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def shard_shape(x: jax.Array) -> tuple[int, ...]:
    shapes = {s.data.shape for s in x.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


@pytest.mark.parametrize("d,m", MESHES)
def test_greedy_equals_single_device(gqa_dir, gqa_prompts, reference, pipes, d, m) -> None:
    assert greedy(pipe_for(pipes, gqa_dir, d, m), gqa_prompts) == reference


@pytest.mark.parametrize("d,m", MESHES)
def test_weights_split_over_model(gqa_dir, pipes, d, m) -> None:
    """Column-parallel q (and k/v while ``model`` divides the 2 KV heads), row-parallel o/down,
    vocab-parallel embedding and head; norms replicated; on exactly the first ``d * m`` devices."""
    p = params_of(pipe_for(pipes, gqa_dir, d, m))
    layer = "model.layers.1."
    want = {
        "model.embed_tokens.embedding": (512 // m, 64),
        "lm_head.kernel": (64, 512 // m),
        layer + "self_attn.q_proj.kernel": (64, 64 // m),
        layer + "self_attn.q_proj.bias": (64 // m,),
        layer + "self_attn.k_proj.kernel": (64, 16 // m if m <= 2 else 16),
        layer + "self_attn.v_proj.bias": (16 // m if m <= 2 else 16,),
        layer + "self_attn.o_proj.kernel": (64 // m, 64),
        layer + "mlp.gate_proj.kernel": (64, 128 // m),
        layer + "mlp.down_proj.kernel": (128 // m, 64),
        layer + "input_layernorm.weight": (64,),
    }
    assert {k: shard_shape(p[k]) for k in want} == want
    devices = {dev for x in p.values() for dev in x.sharding.device_set}
    assert devices == set(jax.devices()[: d * m])


@pytest.mark.parametrize("d,m", MESHES)
def test_kv_cache_split_on_heads_replicated_past_kv_heads(gqa_dir, pipes, d, m) -> None:
    """2 KV heads: stored ``lcm(2, m)`` times so each of the ``m`` devices holds its own head(s)."""
    runner = pipe_for(pipes, gqa_dir, d, m).stages[0].engine.runner
    heads = math.lcm(2, m)
    for k, v in runner.kv_cache:
        for x in (k, v):
            assert x.shape[0] == heads
            assert shard_shape(x) == (heads // m, *x.shape[1:])
            assert len(x.sharding.device_set) == d * m
    assert runner.rows_bucket(1) % d == 0


def test_sharded_steady_state_never_recompiles(gqa_dir, gqa_prompts, reference, pipes) -> None:
    pipe = pipe_for(pipes, gqa_dir, 2, 4)
    greedy(pipe, gqa_prompts)
    with CompileCounter() as c:
        assert greedy(pipe, gqa_prompts) == reference
    assert (c.traces, c.compiles) == (0, 0)


def test_sharded_warmup_leaves_nothing_to_compile(gqa_dir, gqa_prompts) -> None:
    """``warmup()`` on a 2 x 4 mesh compiles the programs that greedy, sampled, penalised and
    log-prob steps then run with their rows split over ``data``: nothing compiles after it."""
    pipe = OmniJaxPipeline.from_pretrained(
        gqa_dir, mesh={"data": 2, "model": 4}, max_num_seqs=4, page_size=8, max_model_len=64
    )
    report = pipe.warmup(progress=False)
    assert report.programs == report.stages["llm"].programs > 0
    params = [
        SamplingParams(temperature=0.0, max_tokens=4),
        SamplingParams(temperature=0.7, seed=1, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0.7, seed=2, max_tokens=4, repetition_penalty=1.2),
    ]
    with CompileCounter() as c:
        outs = pipe.run(gqa_prompts[:3], params, progress=False)
    assert all(o.error is None for o in outs)
    assert (c.traces, c.compiles) == (0, 0)


def test_converted_checkpoint_restores_into_shards(gqa_dir, pipes, tmp_path) -> None:
    """Orbax restores each array straight into its target sharding, equal to the HF-loaded one."""
    dst = convert(gqa_dir, tmp_path / "converted", progress=False)
    model, _ = load_part(dst, "llm", mesh=make_mesh({"data": 2, "model": 4}))
    restored = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    loaded = params_of(pipe_for(pipes, gqa_dir, 2, 4))
    assert restored.keys() == loaded.keys()
    for name, x in restored.items():
        assert x.sharding.is_equivalent_to(loaded[name].sharding, x.ndim), name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(loaded[name]))


def test_model_axis_must_divide_heads(gqa_dir) -> None:
    with pytest.raises(ValueError, match="mesh model=3 does not divide the 8 attention heads"):
        OmniJaxPipeline.from_pretrained(gqa_dir, mesh={"model": 3}, **PIPE_KW)


def test_more_devices_than_exist(gqa_dir) -> None:
    with pytest.raises(ValueError, match="needs 16 devices but only 8 exist"):
        OmniJaxPipeline.from_pretrained(gqa_dir, mesh={"data": 2, "model": 8}, **PIPE_KW)


def test_hidden_states_come_back_whole(gqa_dir, pipes) -> None:
    """Step outputs are replicated: hidden states of data-split rows reach the host in order."""
    runner = pipe_for(pipes, gqa_dir, 2, 4).stages[0].engine.runner
    single = pipe_for(pipes, gqa_dir, 1, 1).stages[0].engine.runner
    rows = _prompt_rows(runner, [[5, 6, 7], [8, 9, 10, 11, 12]])
    try:
        runner.capture_hidden = single.capture_hidden = True  # as when a later stage reads them
        got = runner.fetch(runner.dispatch(rows))
        want = single.fetch(single.dispatch(_prompt_rows(single, [[5, 6, 7], [8, 9, 10, 11, 12]])))
    finally:
        runner.capture_hidden = single.capture_hidden = False
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert [h.shape[0] for h in got.hidden] == [3, 5]  # each row's tokens, no padding
    assert [h.shape for h in got.hidden] == [h.shape for h in want.hidden]
    for g, w in zip(got.hidden, want.hidden, strict=True):
        assert rel_err(g, w) <= SPLIT_ROUNDING


def _prompt_rows(runner, prompts: list[list[int]]) -> list:  # noqa: ANN001
    """One prefill row per prompt, each on its own cache page."""
    from omni_jax.engine.step import StepRow

    return [
        StepRow(
            token_ids=p,
            positions=np.arange(len(p)),
            pages=[i],
            start=0,
            sample=True,
            params=SamplingParams(temperature=0.0),
            seed=0,
            draw_index=0,
            id_row=i,
            prompt_len=len(p),
            suppress=[],
            capture_hidden=True,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("d,m", [(1, 4), (2, 2)])
def test_bfloat16_split_equals_transformers_in_bfloat16(gqa_dir, d, m) -> None:
    """The model split in bfloat16 (weights cast as they are loaded into their shards, partial
    sums all-reduced over ``model``) is held to transformers' bfloat16 ``generate`` on the same
    weights as one device is in ``tests/test_bf16_parity.py``: equal tokens except at checked
    near-ties, log-probabilities within the bfloat16 logit bound."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gqa_dir, dtype=torch.bfloat16).eval()
    pipe = OmniJaxPipeline.from_pretrained(
        gqa_dir, dtype="bfloat16", mesh={"data": d, "model": m}, max_model_len=160, max_num_seqs=8
    )
    rs = np.random.RandomState(11)
    batch = [rs.randint(3, 500, size=int(rs.randint(4, 120))).tolist() for _ in range(8)]
    check_bfloat16_greedy(pipe, hf, batch, 16)
