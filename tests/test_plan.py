"""Memory planning from ``config.json`` alone (issue 19, point 2): ``plan_memory`` and ``omni-jax plan``.

On the tiny checkpoints the plan is held to what loading allocates: the weights as placed and
the KV cache as built (per device on a mesh: ``tests/multidevice/test_sharded_loading.py``). On
a ``config.json`` with Qwen2.5-Omni-7B's shapes (written here from the public checkpoint's
config, no weights), the weights are held to the parameters transformers instantiates for
those shapes on torch's meta device (nothing allocated), the KV cache to a count by hand, and
the GPU verdicts to those figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest
import yaml
from flax import nnx
from stage_yamls import Whole, edited_stages, shipped_config

from benchmarks.models import SMALL_QWEN3_CODE2WAV, SMALL_QWEN3_THINKER_TEXT
from omni_jax import OmniJaxPipeline
from omni_jax.cli import main as cli_main
from omni_jax.engine.memory import GIB
from omni_jax.models.loading import abstract_model
from omni_jax.parallel.placement import StagePlacement, stage_meshes
from omni_jax.planning import MemoryPlan, device_ranges, plan_memory
from omni_jax.stages.config import load_pipeline_config
from omni_jax.weights import convert, load_part

OMNI_IDS = dict(
    audio_token_index=151646,
    image_token_index=151655,
    video_token_index=151656,
    audio_start_token_id=151647,
    audio_end_token_id=151648,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def qwen2_5_omni_7b_config():  # noqa: ANN201 - a transformers config
    """Qwen2.5-Omni-7B's ``config.json``: the public checkpoint's shapes and token ids; the
    token2wav's are transformers' defaults, which are the 7B's."""
    from transformers import Qwen2_5OmniConfig

    thinker = dict(
        text_config=dict(
            hidden_size=3584,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=32768,
            rope_parameters=MROPE,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        audio_config=dict(
            d_model=1280,
            encoder_layers=32,
            encoder_attention_heads=20,
            encoder_ffn_dim=5120,
            num_mel_bins=128,
            output_dim=3584,
            max_source_positions=1500,
            n_window=100,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            num_heads=16,
            intermediate_size=3420,
            out_hidden_size=3584,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        user_token_id=872,
        **OMNI_IDS,
    )
    talker = dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=8448,
        embedding_size=3584,
        max_position_embeddings=32768,
        rope_parameters=MROPE,
        rms_norm_eps=1e-6,
        tts_text_pad_token_id=151859,
        tts_text_start_token_id=151860,
        tts_text_end_token_id=151861,
        tts_codec_pad_token_id=8292,
        tts_codec_start_token_id=8293,
        tts_codec_end_token_id=8294,
        tts_codec_mask_token_id=8296,
        **OMNI_IDS,
    )
    cfg = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=True)
    cfg.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    return cfg


QWEN3_MROPE = {
    "rope_type": "default",
    "rope_theta": 1000000,
    "mrope_section": [24, 20, 20],
    "interleaved": True,
}
QWEN3_IDS = dict(
    audio_token_id=151675,
    image_token_id=151655,
    video_token_id=151656,
    audio_start_token_id=151669,
    audio_end_token_id=151670,
    vision_start_token_id=151652,
    position_id_per_seconds=13,
    seconds_per_chunk=2,
)


def qwen3_omni_30b_config():  # noqa: ANN201 - a transformers config
    """Qwen3-Omni-30B-A3B-Instruct's ``config.json``: the public checkpoint's shapes and token ids
    (the thinker's decoder is the ``small`` benchmark model's with the release's 48 layers of 128
    experts, code2wav the release's whole, as ``small`` has it)."""
    from transformers import Qwen3OmniMoeConfig

    thinker = dict(
        text_config=dict(SMALL_QWEN3_THINKER_TEXT, num_hidden_layers=48, num_experts=128),
        audio_config=dict(
            d_model=1280,
            encoder_layers=32,
            encoder_attention_heads=20,
            encoder_ffn_dim=5120,
            num_mel_bins=128,
            output_dim=2048,
            max_source_positions=1500,
            n_window=50,
            n_window_infer=800,
            conv_chunksize=500,
            downsample_hidden_size=480,
        ),
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            num_heads=16,
            intermediate_size=4304,
            out_hidden_size=2048,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
            hidden_act="gelu_pytorch_tanh",
        ),
        vision_end_token_id=151653,
        user_token_id=872,
        **QWEN3_IDS,
    )
    talker = dict(
        text_config=dict(
            hidden_size=1024,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=2048,
            moe_intermediate_size=384,
            shared_expert_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=6,
            norm_topk_prob=True,
            vocab_size=3072,
            max_position_embeddings=65536,
            rope_parameters=QWEN3_MROPE,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        code_predictor_config=dict(
            hidden_size=1024,
            num_hidden_layers=5,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=2048,
            num_code_groups=16,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000},
            rms_norm_eps=1e-6,
        ),
        accept_hidden_layer=24,
        num_code_groups=16,
        thinker_hidden_size=2048,
        spatial_merge_size=2,
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_nothink_id=2155,
        codec_pad_id=2148,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        speaker_id={"aiden": 2303, "chelsie": 2301, "ethan": 2302},
        **QWEN3_IDS,
    )
    cfg = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=SMALL_QWEN3_CODE2WAV,
        enable_audio_output=True,
        im_start_token_id=151644,
        im_end_token_id=151645,
        system_token_id=8948,
        user_token_id=872,
        assistant_token_id=77091,
        tts_bos_token_id=151672,
        tts_eos_token_id=151673,
        tts_pad_token_id=151671,
    )
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    return cfg


@pytest.fixture(scope="module")
def omni_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("omni7b")
    qwen2_5_omni_7b_config().save_pretrained(path)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    return path


def param_bytes(model: nnx.Module) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_tiny_qwen2_plan_is_what_loading_allocates(qwen2_dir) -> None:
    engine = dict(max_num_seqs=4, max_model_len=64, page_size=16)
    (stage,) = plan_memory(qwen2_dir, **engine).stages
    model, _ = load_part(qwen2_dir, "llm")
    assert stage.weights == param_bytes(model)
    pages = 4 * 64 // 16  # max_num_seqs full sequences: the cache the plan's "KV all" is
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, num_pages=pages, **engine)
    cache = pipe.stages[0].engine.runner.kv_cache
    assert sum(k.nbytes + v.nbytes for k, v in cache) == stage.full_kv
    one = OmniJaxPipeline.from_pretrained(qwen2_dir, num_pages=64 // 16, **engine)
    assert sum(k.nbytes + v.nbytes for k, v in one.stages[0].engine.runner.kv_cache) == stage.sequence_kv


def test_converted_checkpoint_is_planned_in_its_dtype(qwen2_dir, tmp_path) -> None:
    dst = convert(qwen2_dir, tmp_path / "bf16", dtype="bfloat16", progress=False)
    (f32,) = plan_memory(qwen2_dir).stages
    (bf16,) = plan_memory(dst).stages
    assert (f32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert bf16.weights * 2 == f32.weights == param_bytes(load_part(qwen2_dir, "llm")[0])


def test_tiny_omni_plan_weights_are_the_loaded_stages(omni_dir) -> None:
    plan = plan_memory(omni_dir)
    assert [s.name for s in plan.stages] == ["thinker", "talker", "code2wav"]
    for stage in plan.stages:
        assert stage.weights == param_bytes(load_part(omni_dir, stage.name)[0]), stage.name
    (device,) = plan.devices  # every stage on the one device, added up there
    assert device.weights == sum(s.weights for s in plan.stages)
    assert device.least == sum(s.weights + s.step + s.sequence_kv for s in plan.stages)


def test_stages_sized_apart_are_planned_apart(omni_dir, tmp_path) -> None:
    """A stage YAML sizing the thinker and the talker apart: each stage's cache at its own
    sizes (as :func:`plan_memory` of one stage at those sizes), the header naming each, and a
    device's sequences capped by the fewest ``max_num_seqs`` of its AR stages."""
    path = edited_stages(
        tmp_path / "sized.yaml",
        "qwen2_5_omni",
        thinker={"engine": {"max_model_len": 256, "max_num_seqs": 4}},
        talker={"engine": {"max_model_len": 512, "max_num_seqs": 2}},
    )
    plan = plan_memory(omni_dir, stage_config=path)
    thinker, talker, _ = plan.stages
    assert [(s.max_model_len, s.max_num_seqs) for s in plan.stages] == [(256, 4), (512, 2), (None, None)]
    (alone,) = plan_memory(omni_dir, stages=["thinker"], max_model_len=256, max_num_seqs=4).stages
    assert (thinker.sequence_kv, thinker.full_kv) == (alone.sequence_kv, alone.full_kv)
    talker_alike = plan_memory(omni_dir, max_model_len=512, max_num_seqs=2).stages[1]
    assert (talker.sequence_kv, talker.full_kv) == (talker_alike.sequence_kv, talker_alike.full_kv)
    header = plan.table().splitlines()[0]
    assert "max_model_len 256 (thinker), 512 (talker), max_num_seqs 4 (thinker), 2 (talker);" in header
    assert (plan.max_model_len, plan.max_num_seqs, plan.devices[0].max_num_seqs) == (512, 4, 2)
    assert plan.sequences(80 << 30) == 2


UNUSED = ("audio_tower.audio_bos_eos_token.weight",)
"""The one parameter of transformers' model no stage serves (its forward never reads it either)."""


def hf_parameter_bytes(cfg) -> dict[str, int]:  # noqa: ANN001
    """Bytes per stage of the parameters transformers instantiates for ``cfg`` (on torch's meta
    device: nothing allocated), less :data:`UNUSED`, in the dtype each stage is loaded in (the
    token2wav in float32, as transformers runs it)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(cfg)
    params = dict(model.named_parameters())
    assert sum(1 for name in params if name.endswith(UNUSED)) == len(UNUSED)
    out = {}
    for stage, prefix, itemsize in (
        ("thinker", "thinker.", 2),
        ("talker", "talker.", 2),
        ("code2wav", "token2wav.", 4),
    ):
        out[stage] = itemsize * sum(
            p.numel() for name, p in params.items() if name.startswith(prefix) and not name.endswith(UNUSED)
        )
    return out


def test_abstract_model_skips_the_tracer_origin_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``abstract_model`` is ``nnx.eval_shape`` (same abstract state) without jax walking every
    traced equation at each parameter's random-key update (what made the 7B plan take a minute),
    and leaves jax's tracers as they were."""
    from jax._src.interpreters import partial_eval

    tracer = partial_eval.DynamicJaxprTracer
    walks = []
    walk = tracer.__dict__["_origin_msg"]
    monkeypatch.setattr(tracer, "_origin_msg", lambda self: walks.append(1) or walk(self))
    counting = tracer.__dict__["_origin_msg"]

    def ctor() -> nnx.Module:
        rngs = nnx.Rngs(0)
        return nnx.Sequential(*(nnx.Linear(8, 8, rngs=rngs) for _ in range(3)))

    def shapes(model: nnx.Module) -> list:
        return [(p, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(model))]

    expected = shapes(nnx.eval_shape(ctor))
    assert walks  # jax 0.10-0.11 walk on every probe: the test sees the cost it removes
    walks.clear()
    assert shapes(abstract_model(ctor)) == expected and not walks
    assert tracer.__dict__["_origin_msg"] is counting


@pytest.fixture(scope="module")
def plan_7b(omni_7b) -> MemoryPlan:
    return plan_memory(omni_7b)


def test_qwen2_5_omni_7b_from_config_alone(plan_7b) -> None:
    plan = plan_7b
    expected = hf_parameter_bytes(qwen2_5_omni_7b_config())
    assert {s.name: s.weights for s in plan.stages} == expected
    # The published checkpoint: 22.4 GB (bfloat16, the token2wav in float32).
    assert abs(plan.weights - 22.4e9) < 0.05e9
    thinker, talker, code2wav = plan.stages
    assert (thinker.dtype, talker.dtype, code2wav.dtype) == ("bfloat16", "bfloat16", "float32")
    # One sequence of max_model_len 4096 (the default: min(32768, 4096)) in pages of 16, plus the
    # null page: 2 (K, V) x layers x KV heads x head_dim x 2 bytes per token.
    assert plan.max_model_len == 4096
    assert thinker.sequence_kv == (256 + 1) * 16 * 2 * 28 * 4 * 128 * 2
    assert talker.sequence_kv == (256 + 1) * 16 * 2 * 24 * 4 * 128 * 2
    assert thinker.full_kv == (64 * 256 + 1) * 16 * 2 * 28 * 4 * 128 * 2
    assert code2wav.sequence_kv == 0 and code2wav.step > 0 and thinker.step > 0
    (device,) = plan.devices
    assert device.least == sum(s.weights + s.step + s.sequence_kv for s in plan.stages)
    for gib in (24, 40, 80):
        assert plan.fits(gib * GIB) == (device.least <= int(gib * GIB * plan.mem_fraction))
    assert not plan.fits(24 * GIB) and plan.fits(80 * GIB)
    table = plan.table()
    assert re.search(
        r"^ +24 GiB: does not fit: device 0 needs \d+\.\d\d GiB, JAX has 18\.00 GiB$", table, re.M
    )
    assert re.search(r"^ +80 GiB: fits, \d+ sequences? at once$", table, re.M)


def test_qwen3_omni_30b_a3b_from_config_alone(tmp_path) -> None:
    """Qwen3-Omni-30B-A3B from its ``config.json`` alone: each stage's weights are the parameters
    transformers instantiates for it (35.26 billion, in bfloat16: 65.7 GiB; code2wav's SnakeBeta
    alpha and beta in float32, as every SnakeBeta of ours holds them), the thinker's cache
    is its 48 layers of 4 KV heads, the talker's its 20 of 2 (the code predictor keeps its own
    buffer inside the step), and the whole graph does not fit one 80 GiB GPU at JAX's default
    share (its weights alone exceed it)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    cfg = qwen3_omni_30b_config()
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(cfg)
    expected: dict[str, int] = {}
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 35_259_818_545
    for name, p in params.items():
        stage = name.split(".")[0]
        snake = stage == "code2wav" and name.endswith((".alpha", ".beta"))
        expected[stage] = expected.get(stage, 0) + (4 if snake else 2) * p.numel()
    plan = plan_memory(tmp_path)
    assert {s.name: s.weights for s in plan.stages} == expected
    thinker, talker, code2wav = plan.stages
    assert plan.max_model_len == 4096
    assert thinker.sequence_kv == (256 + 1) * 16 * 2 * 48 * 4 * 128 * 2
    assert talker.sequence_kv == (256 + 1) * 16 * 2 * 20 * 2 * 128 * 2
    assert code2wav.sequence_kv == 0 and min(s.step for s in plan.stages) > 0
    assert plan.weights > 60 * GIB >= 80 * GIB * plan.mem_fraction and not plan.fits(80 * GIB)


def test_plan_table_columns_line_up_on_many_devices(omni_7b) -> None:
    """Each column is as wide as its widest cell: eight devices' list (as a run, ``0-7``) and
    the device table's stage lists keep every later column under its header. Devices that hold
    the same are one row: eight alike are one, and a mesh of thousands is a few lines, not a
    line per device (``--mesh data=100000`` printed 100,015 lines, after minutes)."""
    lines = plan_memory(omni_7b, mesh={"data": 2, "model": 4}, dtype="bfloat16").table().splitlines()
    for title, rows in (("stage", 3), ("devices", 1)):
        at = next(i for i, line in enumerate(lines) if line.startswith(title + " "))
        header, body = lines[at], lines[at + 1 : at + 1 + rows]
        starts = [m.start() for m in re.finditer(r"(?<=  )\S", header)]
        for line in body:
            assert all(line[i - 2 : i] == "  " and line[i] != " " for i in starts), (header, line)
    assert re.search(r"^thinker +0-7 +data=2,model=4 ", "\n".join(lines), re.M)
    assert re.search(r"^0-7 +thinker,talker,code2wav ", "\n".join(lines), re.M)
    wide = plan_memory(omni_7b, mesh={"data": 5000, "model": 4}, dtype="bfloat16").table()
    assert len(wide.splitlines()) == len(lines) and re.search(
        r"^0-19999 +thinker,talker,code2wav ", wide, re.M
    )
    assert device_ranges([0, 1, 2, 3, 6]) == "0-3,6" and device_ranges([5]) == "5"


def test_qwen2_5_omni_7b_on_a_mesh(omni_7b, plan_7b) -> None:
    whole = {s.name: s for s in plan_7b.stages}
    split = plan_memory(omni_7b, stages=["thinker", "talker"], mesh={"model": 4})
    assert [d.device for d in split.devices] == [0, 1, 2, 3]
    for s in split.stages:
        assert s.devices == (0, 1, 2, 3)
        assert s.sequence_kv * 4 == whole[s.name].sequence_kv  # one of the 4 KV heads on each device
        assert whole[s.name].weights / 4 <= s.weights < whole[s.name].weights / 2  # norms, encoders whole
    # the checkpoint as loaded: each device's share counted on every device that holds one
    assert (
        split.weights
        == sum(s.weights * 4 for s in split.stages)
        > sum(whole[s.name].weights for s in split.stages)
    )


def test_a_device_that_holds_its_least_serves_one_sequence() -> None:
    """``least`` (weights, steps, one sequence of cache) is what a device must hold: exactly that
    much fits and serves one sequence (not "fits, 0 sequences", where the cache's share of the
    room is under a sequence), a byte less does not fit."""
    from omni_jax.planning import DevicePlan

    device = DevicePlan(0, ("thinker",), weights=1000, steps=100, sequence_kv=50, full_kv=400, max_num_seqs=8)
    assert device.least == 1150
    assert [device.sequences(n) for n in (1149, 1150, 1000 + 200 + 8 * 500)] == [0, 1, 8]


def omni_stage_yaml(tmp_path: Path, layouts: dict[str, dict]) -> Path:
    """The shipped Qwen2.5-Omni stage YAML with ``layouts`` (``mesh``/``devices`` per stage) added."""
    return edited_stages(tmp_path / f"stages{len(list(tmp_path.iterdir()))}.yaml", "qwen2_5_omni", **layouts)


def test_plan_lays_stages_out_as_loading_does(omni_7b, tmp_path) -> None:
    """A stage's ``devices`` all over ``model``, its own ``mesh`` over its list, the default for
    the rest: one rule (``stage_layouts``) for the plan and for ``stage_meshes``, refusals included."""
    cfg = omni_stage_yaml(
        tmp_path, {"thinker": {"devices": [0, 1, 2, 3]}, "talker": {"mesh": {"model": 2}, "devices": [4, 5]}}
    )
    plan = plan_memory(omni_7b, stage_config=cfg)
    assert {s.name: (s.mesh, s.devices) for s in plan.stages} == {
        "thinker": ({"data": 1, "model": 4}, (0, 1, 2, 3)),
        "talker": ({"data": 1, "model": 2}, (4, 5)),
        "code2wav": ({"data": 1, "model": 1}, (0,)),
    }
    assert [(d.device, d.stages) for d in plan.devices][:2] == [
        (0, ("thinker", "code2wav")),
        (1, ("thinker",)),
    ]
    rows = [line.split()[:2] for line in plan.table().split("per device")[1].splitlines()[2:5]]
    assert rows == [["0", "thinker,code2wav"], ["1-3", "thinker"], ["4-5", "talker"]]
    for layouts, message in (
        (
            {"thinker": {"devices": [0, 1]}, "talker": {"devices": [1, 2]}},
            "stages 'thinker' and 'talker' both take device 1",
        ),
        (
            {"talker": {"mesh": {"model": 2}, "devices": [0, 1, 2]}},
            "stage 'talker': the mesh needs 2 devices but the device list has 3",
        ),
    ):
        cfg = omni_stage_yaml(tmp_path, layouts)
        placements = [StagePlacement(sc.name, sc.mesh, sc.devices) for sc in load_pipeline_config(cfg).stages]
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_memory(omni_7b, stage_config=cfg)
        with pytest.raises(ValueError, match=re.escape(message)):
            stage_meshes(placements)


def test_an_ar_part_cannot_run_as_a_generation_stage(omni_7b, tmp_path) -> None:
    """Which stage class a ``kind: generation`` stage gets is its part's (``GenerationStage``):
    a YAML making the thinker one is refused by name, in the plan as in ``from_pretrained``."""
    cfg = omni_stage_yaml(tmp_path, {"thinker": {"kind": "generation", "default_sampling": Whole()}})
    with pytest.raises(ValueError, match="stage 'thinker' is an AR part: the stage YAML cannot make it"):
        plan_memory(omni_7b, stage_config=cfg)


def test_jax_memory_fraction_is_read(omni_dir, monkeypatch) -> None:
    assert plan_memory(omni_dir).mem_fraction == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    plan = plan_memory(omni_dir)
    assert plan.mem_fraction == 0.95 and plan.usable(80 * GIB) == int(0.95 * 80 * GIB)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1")  # the whole device: the end of the range
    assert plan_memory(omni_dir).usable(80 * GIB) == 80 * GIB
    for bad in ("abc", "1.5", "0", "nan"):  # JAX would not take these either
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", bad)
        with pytest.raises(
            ValueError, match=rf"^XLA_PYTHON_CLIENT_MEM_FRACTION='{bad}' must be a number in \(0, 1\]$"
        ):
            plan_memory(omni_dir)


def test_plan_refuses_what_from_pretrained_would(omni_7b, omni_dir) -> None:
    with pytest.raises(
        ValueError, match="^stage 'thinker': mesh model=3 does not divide the 28 attention heads"
    ):
        plan_memory(omni_7b, mesh={"model": 3})
    # the thinker's 28 heads split 7 ways, the talker's 12 do not: the message says whose, and
    # what would do
    with pytest.raises(
        ValueError,
        match=r"^stage 'talker': mesh model=7 does not divide the 12 attention heads "
        r"\(model sizes that do: 1, 2, 3, 4, 6, 12\); a stage YAML \(stage_config=, --stage-config\) "
        r"can give each stage its own mesh and devices$",
    ):
        plan_memory(omni_7b, mesh={"model": 7})
    with pytest.raises(ValueError, match=r"dtype='bf17' is not one of float32, bfloat16, float16"):
        plan_memory(omni_7b, dtype="bf17")
    with pytest.raises(ValueError, match=r"page_size=0 must be a positive integer"):
        plan_memory(omni_7b, page_size=0)
    with pytest.raises(ValueError, match=r"^page_size=100000 exceeds max_model_len=4096$"):
        plan_memory(omni_7b, page_size=100_000)  # one page a sequence could never fill
    with pytest.raises(
        ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=512"
    ):
        plan_memory(omni_dir, max_model_len=4096)


def test_cli_prints_the_plan(omni_dir, capsys) -> None:
    assert cli_main(["plan", str(omni_dir), "--mesh", "model=2", "--max-model-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "max_model_len 128, max_num_seqs 64" in out
    assert re.search(r"^thinker +0-1 +data=1,model=2 +float32 ", out, re.M)
    assert re.search(r"^code2wav +0-1 ", out, re.M)
    assert re.search(r"^0-1 +thinker,talker,code2wav ", out, re.M)  # the two devices hold the same
    for gib in (24, 40, 80):
        assert re.search(rf"^ +{gib} GiB: fits, 64 sequences at once$", out, re.M)


def test_cli_judges_the_gpu_sizes_asked_for(omni_7b, plan_7b, capsys) -> None:
    """``--gpu-memory`` adds sizes to the three judged (a 141 GiB H200, a card too small), in
    order, each judged as the plan's own ``fits`` and ``sequences`` say."""
    assert cli_main(["plan", str(omni_7b), "--gpu-memory", "141", "--gpu-memory", "20.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    judged = lines[lines.index(next(line for line in lines if line.startswith("GPUs "))) + 1 :]
    assert [line.split(" GiB:")[0].strip() for line in judged] == ["20.5", "24", "40", "80", "141"]
    for line, gib in zip(judged, (20.5, 24, 40, 80, 141), strict=True):
        capacity = int(gib * GIB)
        if plan_7b.fits(capacity):
            assert line.endswith(f"fits, {plan_7b.sequences(capacity)} sequences at once"), line
        else:
            assert ": does not fit: device 0 needs " in line, line
    assert not plan_7b.fits(int(20.5 * GIB)) and plan_7b.fits(141 * GIB)
    with pytest.raises(SystemExit) as refused:
        cli_main(["plan", str(omni_7b), "--gpu-memory", "0"])
    assert refused.value.code == 2
    assert "argument --gpu-memory: must be a number of GiB above 0, got 0" in capsys.readouterr().err


def test_cli_mistakes_are_one_line_and_exit_2(omni_dir, tmp_path, capsys) -> None:
    assert cli_main(["plan", str(omni_dir), "--mesh", "model=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "does not divide" in err
    assert cli_main(["plan", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'nothing'}: no such checkpoint directory\n"


@pytest.mark.parametrize(
    "family,stage,typo,known",
    [
        (
            "qwen2_5_omni",
            "talker",
            "early_strat",
            "['early_start', 'limit_mm_per_prompt', 'output_hidden_states', 'max_num_seqs', "
            "'max_model_len', 'max_num_batched_tokens']",
        ),
        ("qwen2_5_omni", "code2wav", "max_code", "['max_batch', 'max_codes', 'max_solve_codes', 'stream']"),
        ("qwen3_omni", "code2wav", "max_codes", "['max_batch', 'max_frames', 'stream']"),
    ],
)
def test_an_unknown_engine_key_is_refused_by_plan_and_from_pretrained(
    family, stage, typo, known, request, tmp_path
) -> None:
    """A stage YAML ``engine`` key the stage does not read (a typo would be a silent default) is
    refused, naming the stage and what it reads, before anything is planned or loaded: by
    ``plan`` as by ``from_pretrained``, for AR and generation stages alike."""
    path = request.getfixturevalue({"qwen2_5_omni": "omni_dir", "qwen3_omni": "qwen3_omni_dir"}[family])
    config = edited_stages(tmp_path / "typo.yaml", family, **{stage: {"engine": {typo: 1}}})
    match = rf"^stage '{stage}': unknown engine keys \['{typo}'\] \(known: {re.escape(known)}\)$"
    with pytest.raises(ValueError, match=match):
        plan_memory(path, stage_config=config)
    with pytest.raises(ValueError, match=match):
        OmniJaxPipeline.from_pretrained(path, stage_config=config)


@pytest.mark.parametrize(
    "stages,match",
    [
        (
            lambda s: [s["thinker"], s["code2wav"]],
            r"^stage 'code2wav' reads 'talker''s output, which the stage config does not list$",
        ),
        (
            lambda s: [s["thinker"], s["code2wav"], s["talker"]],
            r"^stage 'code2wav' reads 'talker''s output but comes after 'thinker': each stage reads the one",
        ),
    ],
    ids=["a stage missing", "stages out of order"],
)
def test_a_stage_graph_that_cannot_run_is_refused_before_loading(omni_dir, tmp_path, stages, match) -> None:
    """Stage i is fed stage i - 1's results: a YAML whose code2wav reads a talker it does not list
    (its thinker's text would be read as codec ids) or lists after it is refused by ``plan`` and
    ``from_pretrained`` alike."""
    config = shipped_config("qwen2_5_omni")
    config["stages"] = stages({s["name"]: s for s in config["stages"]})
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=match):
        plan_memory(omni_dir, stage_config=path)
    with pytest.raises(ValueError, match=match):
        OmniJaxPipeline.from_pretrained(omni_dir, stage_config=path)


def test_a_plan_without_a_cache_says_none(omni_dir) -> None:
    """A code2wav-only plan has no KV cache: no sequence count in the stage table's title, and
    ``-`` where the device table would show one sequence's cache."""
    table = plan_memory(omni_dir, stages=["code2wav"]).table()
    assert "per stage, on each of its devices:" in table and "KV all:" not in table
    assert re.search(r"^code2wav +0 +data=1,model=1 +float32 +\S+ MiB +\S+ MiB +- +-$", table, re.M)
    assert re.search(r"^0 +code2wav +\S+ MiB +\S+ MiB +- +\S+ MiB +\S+ MiB$", table, re.M)
    assert re.search(r"^ +24 GiB: fits$", table, re.M)
