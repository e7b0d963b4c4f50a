"""Stages on explicit, disjoint device subsets of the eight devices."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from parity import SPLIT_ROUNDING, rel_err
from stage_yamls import edited_stages
from stand_ins import rows_nearly_free

from omni_jax import OmniJaxPipeline, OmniRequestOutput, Token2WavParams
from omni_jax.engine.compilation import CompileCounter

from .conftest import PIPE_KW, greedy


def stage_yaml(tmp_path: Path, architecture: str, stages: list[dict], **top: object) -> Path:
    f = tmp_path / "stages.yaml"
    f.write_text(yaml.safe_dump({"architecture": architecture, **top, "stages": stages}))
    return f


def devices_of(tree: object) -> set:
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def test_llm_stage_on_devices_4_to_7(gqa_dir, gqa_prompts, reference, tmp_path) -> None:
    cfg = stage_yaml(
        tmp_path,
        "Qwen2ForCausalLM",
        [
            {
                "name": "llm",
                "kind": "ar",
                "input": "prompt",
                "final_output": "text",
                "mesh": {"data": 2, "model": 2},
                "devices": [4, 5, 6, 7],
            }
        ],
    )
    placed = OmniJaxPipeline.from_pretrained(gqa_dir, stage_config=cfg, **PIPE_KW)
    runner = placed.stages[0].engine.runner
    want = set(jax.devices()[4:])
    assert devices_of(nnx.to_pure_dict(runner.state)) == want
    assert devices_of(runner.kv_cache) == want
    assert dict(runner.mesh.shape) == {"data": 2, "model": 2}
    assert greedy(placed, gqa_prompts) == reference


def code2wav_on(
    omni_dir: Path,
    tmp_path: Path,
    devices: list[int],
    mesh: dict[str, int],
    stream: dict[str, int] | None = None,
    **engine: int,
) -> OmniJaxPipeline:
    """The shipped Qwen2.5-Omni code2wav stage alone on ``devices`` as ``mesh``, its ``engine``
    keys (and ``engine.stream`` keys) set over the shipped ones."""
    code2wav = {"devices": devices, "mesh": mesh, "engine": {**engine, "stream": stream or {}}}
    cfg = edited_stages(tmp_path / "omni.yaml", "qwen2_5_omni", code2wav=code2wav)
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"], stage_config=cfg)


SPLIT_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 2, 7, 3][: 3 + i]} for i in range(3)]
SPLIT_PARAMS = Token2WavParams(num_steps=3, seed=0)


def run_in_one_solve(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch) -> list[OmniRequestOutput]:
    """:data:`SPLIT_PROMPTS` through ``pipe``'s code2wav stage in one solve (three rows padded to
    four on every mesh), whichever rows its mesh allows: one program a mesh to compile, where the
    unfitted cost split the three as one and two (two programs) on meshes without ``data``."""
    rows_nearly_free(pipe.stages[0].runner.cost, monkeypatch)
    return pipe.run(SPLIT_PROMPTS, SPLIT_PARAMS, progress=False)


@pytest.fixture(scope="module")
def code2wav_alone(omni_dir: Path) -> list[OmniRequestOutput]:
    """The waveforms of :data:`SPLIT_PROMPTS` from the stage on one device, for every mesh."""
    alone = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_in_one_solve(alone, monkeypatch)


@pytest.mark.parametrize(
    "devices,mesh",
    [([6, 7], {"data": 2}), ([6, 7], {"model": 2}), ([4, 5, 6, 7], {"data": 2, "model": 2})],
)
def test_code2wav_split_over_its_mesh(
    omni_dir, code2wav_alone, tmp_path, devices, mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage's weights live only on its devices. A solve's rows are split over ``data``
    (each device solves its own requests, rows padded to a multiple of it) and the DiT's
    blocks over ``model`` (q/k/v/ff-in/modulation columns, out/ff-out rows); every request's
    waveform is the one it gets on one device."""
    from omni_jax.stages.code2wav_batch import Code2WavRequest

    placed = code2wav_on(omni_dir, tmp_path, devices, mesh)
    runner = placed.stages[0].runner
    assert devices_of(nnx.to_pure_dict(runner.state)) == {jax.devices()[i] for i in devices}
    model = mesh.get("model", 1)
    block = runner.state["dit"]["transformer_blocks"][0]
    assert block["attn"]["to_q"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert block["ff"]["ff_out"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("model", None)
    shard = block["attn"]["to_q"]["kernel"].addressable_shards[0].data.shape
    assert shard[1] * model == block["attn"]["to_q"]["kernel"].shape[1]
    geometry = placed.stages[0].geometry
    request = Code2WavRequest.new(
        "r",
        np.array([1, 2, 3]),
        np.zeros(geometry.speaker_dim, np.float32),
        np.zeros((2, geometry.mel_dim), np.float32),
        SPLIT_PARAMS,
    )
    batch = runner.pad([request])
    assert batch.codes.shape[0] == mesh.get("data", 1)  # one request: a row per data shard
    arrays = batch.arrays(runner.mesh)
    assert all(a.sharding.spec == jax.sharding.PartitionSpec("data") for a in arrays)
    assert all(a.sharding.device_set == {jax.devices()[i] for i in devices} for a in arrays)
    got = run_in_one_solve(placed, monkeypatch)
    for g, w in zip(got, code2wav_alone, strict=True):
        assert g.metrics["code2wav"]["batch_size"] == w.metrics["code2wav"]["batch_size"] == 3
        assert g.error is None and g.audio.shape == w.audio.shape
        assert rel_err(g.audio, w.audio) < SPLIT_ROUNDING


STREAM_PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 30 + 1 for j in range(n)]} for i, n in enumerate((50, 9, 83))
]
STREAM_PARAMS = Token2WavParams(num_steps=3, seed=0, stream=True)
FIXED_CHUNKS = {"max_chunk_codes": 36}


@pytest.fixture(scope="module")
def streamed_alone(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[OmniRequestOutput]:
    """:data:`STREAM_PROMPTS` decoded in chunks by the stage on one device, ready chunks sharing
    a solve (:func:`rows_nearly_free`, as on every mesh: three programs to compile where the
    unfitted cost's solves made four)."""
    alone = code2wav_on(omni_dir, tmp_path_factory.mktemp("alone"), [0], {}, FIXED_CHUNKS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        rows_nearly_free(alone.stages[0].decoder.cost, monkeypatch)
        return alone.run(STREAM_PROMPTS, STREAM_PARAMS, progress=False)


@pytest.mark.parametrize("devices,mesh", [([6, 7], {"data": 2}), ([4, 5, 6, 7], {"data": 2, "model": 2})])
def test_streamed_chunks_split_over_its_mesh(
    omni_dir, streamed_alone, tmp_path, devices, mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk solves of several requests at once, their rows split over ``data`` and the DiT over
    ``model``: every request's streamed waveform (a first chunk, then chunks with past and
    future context, one shorter than a chunk) is the one it gets on one device."""
    placed = code2wav_on(omni_dir, tmp_path, devices, mesh, FIXED_CHUNKS)
    assert devices_of(nnx.to_pure_dict(placed.stages[0].runner.state)) == {jax.devices()[i] for i in devices}
    rows_nearly_free(placed.stages[0].decoder.cost, monkeypatch)
    got = placed.run(STREAM_PROMPTS, STREAM_PARAMS, progress=False)
    chunks = [o.metrics["code2wav"]["chunks"] for o in streamed_alone]
    assert chunks[1] == 1 and chunks[0] > 1 and chunks[2] > 2, chunks
    for g, w in zip(got, streamed_alone, strict=True):
        assert g.error is None and g.audio.shape == w.audio.shape
        assert g.metrics["code2wav"]["chunks"] == w.metrics["code2wav"]["chunks"]
        assert rel_err(g.audio, w.audio) < SPLIT_ROUNDING


def test_code2wav_warmup_covers_its_mesh(omni_dir, tmp_path) -> None:
    """Warm-up compiles each solve as a real batch is placed (rows split over ``data``): after
    it, batches of any size, offline or streamed, compile nothing. One offline length and fixed
    stream chunks keep the programs few (the single-device tests cover every length and chunk
    size; what the mesh adds is the placement of rows)."""
    fixed_chunks = {"max_chunk_codes": 36}
    placed = code2wav_on(omni_dir, tmp_path, [6, 7], {"data": 2}, fixed_chunks, max_batch=4, max_codes=32)
    buckets = placed.stages[0].runner.buckets
    assert (buckets.rows, buckets.lengths) == ((2, 4), (32,))
    # two offline solves, and the streamed chunk programs of each row count (2 and 4) and
    # window (the first chunk's, 36 codes, and the fixed chunks', 72)
    assert placed.stages[0].decoder.buckets.rows == (2, 4)
    assert placed.stages[0].decoder.buckets.lengths == (36, 72)
    assert placed.stages[0].warmup() == 2 + 2 * 2
    offline = ([1], [32, 3], [20, 31, 12], [5, 6, 7, 8, 9])
    streamed = ([48, 3], [5, 6, 7, 8, 300])  # streamed requests have no max_codes
    for stream, mixes in ((False, offline), (True, streamed)):
        params = Token2WavParams(num_steps=2, seed=0, stream=stream)
        for lengths in mixes:
            with CompileCounter() as counted:
                outs = placed.run([{"prompt_token_ids": [1] * n} for n in lengths], params, progress=False)
            assert all(o.error is None for o in outs)
            assert (counted.traces, counted.compiles) == (0, 0), (stream, lengths)


def test_overlapping_stage_devices_refused(omni_dir, tmp_path) -> None:
    stages = [
        {"name": "thinker", "kind": "ar", "input": "prompt", "devices": [0, 1, 2, 3]},
        {"name": "code2wav", "kind": "generation", "input": "thinker", "devices": [3, 4]},
    ]
    cfg = stage_yaml(tmp_path, "Qwen2_5OmniForConditionalGeneration", stages)
    with pytest.raises(ValueError, match="stages 'thinker' and 'code2wav' both take device 3"):
        OmniJaxPipeline.from_pretrained(omni_dir, stage_config=cfg)


def test_shared_devices_allowed_when_the_yaml_says_so(gqa_dir, tmp_path) -> None:
    from omni_jax.parallel import StagePlacement, stage_meshes

    stages = [StagePlacement("a", devices=[0, 1]), StagePlacement("b", devices=[1, 2])]
    with pytest.raises(ValueError, match="both take device 1"):
        stage_meshes(stages)
    meshes = stage_meshes(stages, allow_shared_devices=True)
    assert [d.id for d in meshes["b"].devices.flat] == [1, 2]
    assert dict(meshes["a"].shape) == {"data": 1, "model": 2}


def test_device_index_out_of_range(gqa_dir, tmp_path) -> None:
    cfg = stage_yaml(
        tmp_path, "Qwen2ForCausalLM", [{"name": "llm", "kind": "ar", "input": "prompt", "devices": [7, 8]}]
    )
    with pytest.raises(ValueError, match="stage 'llm': device index 8 does not exist: there are 8 devices"):
        OmniJaxPipeline.from_pretrained(gqa_dir, stage_config=cfg, **PIPE_KW)
