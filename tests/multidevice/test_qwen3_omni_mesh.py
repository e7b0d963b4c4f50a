"""The whole Qwen3-Omni graph on meshes (issue 23): thinker -> talker -> code2wav, experts split.

The tiny Qwen3-Omni's three stages are placed on disjoint devices of the eight: the thinker on
a ``data=1, model=2`` mesh (its 8 experts 4 per device, attention by heads), the talker on a
``data=2, model=2`` one (its 4 experts 2 per device, its code predictor, the draw hook's
program, whole on every device; step rows split over ``data``), code2wav on ``data=2`` (solve
rows split). The same requests, batched, give the one-device pipeline's replies, every codebook
of every frame and waveforms: the thinker's layer ``accept_hidden_layer`` captured on its mesh
(read at the media request's placeholders) and the talker's in-step frames are on that path.
A sampled talker (and so a sampled code predictor) draws the same frames on both, and on the
meshes in either order of the batch: its keys are per request and frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest
from flax import nnx
from omni_reference import picture, tone
from parity import SPLIT_ROUNDING, rel_err
from stage_yamls import edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.testing_qwen3_omni import NUM_CODE_GROUPS

THINKER = SamplingParams(temperature=0.0, max_tokens=16)
TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=128)
"""Two sequences a step: every step of a stage samples the same sequence rows (2, also a multiple
of ``data``), so each stage compiles few programs."""
LAYOUT = {
    "thinker": ({"data": 1, "model": 2}, [0, 1]),
    "talker": ({"data": 2, "model": 2}, [2, 3, 4, 5]),
    "code2wav": ({"data": 2}, [6, 7]),
}


def chat(*items: dict[str, Any], text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


MESSAGES = [
    (chat(text="tell me about the sea."), "Ethan"),
    (
        chat(
            {"type": "audio", "audio": tone(1.3, 440, 0)},
            {"type": "image", "image": picture(64, 96, 1)},
            text="what is this?",
        ),
        "Chelsie",
    ),
]


@pytest.fixture(scope="module")
def single(qwen3_omni_dir: Path) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen3_omni_dir, **ENGINE)


@pytest.fixture(scope="module")
def placed(qwen3_omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> OmniJaxPipeline:
    """The shipped stage YAML with each stage on its own devices and mesh (:data:`LAYOUT`)."""
    layout = {name: {"mesh": mesh, "devices": devices} for name, (mesh, devices) in LAYOUT.items()}
    path = edited_stages(tmp_path_factory.mktemp("qwen3_mesh") / "stages.yaml", "qwen3_omni", **layout)
    return OmniJaxPipeline.from_pretrained(qwen3_omni_dir, stage_config=path, **ENGINE)


def prompts(pipe: OmniJaxPipeline) -> list[dict[str, Any]]:
    return [{**pipe.chat_prompt(messages), "speaker": voice} for messages, voice in MESSAGES]


def shard_shapes(runner: Any, part: str) -> dict[str, set[tuple[int, ...]]]:
    """Each parameter under ``part`` (a top-level module of the stage's model): the shapes of
    its shards."""
    return {
        ".".join(map(str, path)): {s.data.shape for s in var.get_value().addressable_shards}
        for path, var in nnx.to_flat_state(nnx.state(nnx.merge(runner.graphdef, runner.state), nnx.Param))
        if path[0] == part
    }


def test_stages_hold_their_devices_and_split_their_experts(placed: OmniJaxPipeline) -> None:
    """Each stage's weights and cache live on its devices only; the thinker holds 4 of its 8
    experts per device, the talker 2 of its 4, and the code predictor whole."""
    for stage in placed.stages:
        runner = stage.engine.runner if stage.config.name != "code2wav" else stage.runner
        mesh, devices = LAYOUT[stage.config.name]
        held = {d for x in jax.tree.leaves(runner.state) for d in x.sharding.device_set}
        assert held == {jax.devices()[i] for i in devices}, stage.config.name
        assert dict(runner.mesh.shape) == {"data": 1, "model": 1, **mesh}
    thinker, talker = (s.engine.runner for s in placed.stages[:2])
    experts = {k: v for k, v in shard_shapes(thinker, "model").items() if "experts" in k}
    assert len(experts) == 6 and all(len(s) == 1 and next(iter(s))[0] == 4 for s in experts.values())
    experts = {k: v for k, v in shard_shapes(talker, "model").items() if "experts" in k}
    assert len(experts) == 6 and all(len(s) == 1 and next(iter(s))[0] == 2 for s in experts.values())
    predictor = nnx.state(nnx.merge(talker.graphdef, talker.state).code_predictor, nnx.Param)
    assert all(v.get_value().sharding.is_fully_replicated for _, v in nnx.to_flat_state(predictor))
    accept = placed.stages[1].frontend.spec.accept_hidden_layer
    assert thinker.capture_hidden and thinker.capture_layer == accept


def test_greedy_speech_equals_one_device(single: OmniJaxPipeline, placed: OmniJaxPipeline) -> None:
    """Three requests batched through the placed stages: each one's reply and frames (every
    codebook) are the one-device pipeline's, its waveform equal up to a split's rounding
    (code2wav's rows split over ``data``; measured: bit-equal for these two, 6e-7 for three
    requests, whose solve pads to four rows)."""
    params = [THINKER, TALKER, None]
    want = single.run(prompts(single), params, progress=False)
    got = placed.run(prompts(placed), params, progress=False)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert g.stage_outputs["thinker"].token_ids == w.stage_outputs["thinker"].token_ids
        codes = g.stage_outputs["talker"].token_ids
        assert len(codes) >= 2 * NUM_CODE_GROUPS and codes == w.stage_outputs["talker"].token_ids
        assert g.audio.shape == w.audio.shape and rel_err(g.audio, w.audio) < SPLIT_ROUNDING


def test_streamed_speech_equals_one_device(single: OmniJaxPipeline, placed: OmniJaxPipeline) -> None:
    """Speech decoded in chunks as the talker speaks, both requests' chunks in shared solves
    whose rows split over ``data``: each waveform, chunk by chunk, is the one-device pipeline's."""
    params = [THINKER, TALKER, Token2WavParams(stream=True)]
    want = single.run(prompts(single), params, progress=False)
    got = placed.run(prompts(placed), params, progress=False)
    assert max(w.metrics["code2wav"]["chunks"] for w in want) > 1
    for g, w in zip(got, want, strict=True):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert g.stage_outputs["talker"].token_ids == w.stage_outputs["talker"].token_ids
        assert g.metrics["code2wav"]["chunks"] == w.metrics["code2wav"]["chunks"]
        assert g.audio.shape == w.audio.shape and rel_err(g.audio, w.audio) < SPLIT_ROUNDING


def test_sampled_frames_equal_one_device_in_either_order(
    single: OmniJaxPipeline, placed: OmniJaxPipeline
) -> None:
    """A sampled talker draws the same frames for a request on the meshes as on one device,
    and on the meshes in either order of the batch (each request then on the other ``data``
    shard): its first codes' and its code predictor's keys are its own."""

    def talker(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=50, max_tokens=40, seed=seed)

    def frames(pipe: OmniJaxPipeline, order: list[int]) -> list[list[int]]:
        batch = [prompts(pipe)[i] for i in order]
        outs = pipe.run(batch, [THINKER, [talker(i + 1) for i in order], None], progress=False)
        assert all(o.error is None for o in outs)
        by_request = dict(zip(order, (o.stage_outputs["talker"].token_ids for o in outs), strict=True))
        return [by_request[i] for i in sorted(order)]

    want = frames(single, [0, 1])
    assert frames(placed, [0, 1]) == want and frames(placed, [1, 0]) == want
    assert want[0][:8] != want[1][:8]
