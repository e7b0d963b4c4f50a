"""A stage YAML's mistakes are refused when it is read, before any weight is, naming the file,
the stage and the key: a bad ``default_sampling`` value would otherwise pass loading and warm-up
and then refuse every request as if its client had erred; a setting of the wrong container
type would be a raw ``TypeError``; a boolean or number of the wrong type would be coerced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_jax import SamplingParams
from omni_jax.stages.config import SHIPPED_DIR, StageConfig, load_pipeline_config


def shipped() -> dict[str, Any]:
    return yaml.safe_load((SHIPPED_DIR / "qwen2_5_omni.yaml").read_text())


def edited(path: Path, edit) -> Path:
    raw = shipped()
    edit(raw)
    path.write_text(yaml.safe_dump(raw))
    return path


def stage(raw: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in raw["stages"] if s["name"] == name)


CASES = {
    "a default the params refuse": (
        lambda r: stage(r, "talker")["default_sampling"].update(temperature="hot"),
        r"stage 'talker': default_sampling: temperature='hot' must be a real number",
    ),
    "a default out of range": (
        lambda r: stage(r, "thinker")["default_sampling"].update(max_tokens=0),
        r"stage 'thinker': default_sampling: max_tokens=0 must be >= 1",
    ),
    "a code2wav default out of range": (
        lambda r: stage(r, "code2wav")["default_sampling"].update(num_steps=0),
        r"stage 'code2wav': default_sampling: num_steps=0 must be an integer from 1",
    ),
    "a default of another stage kind": (
        lambda r: stage(r, "code2wav")["default_sampling"].update(temperature=0.5),
        r"stage 'code2wav': unknown default_sampling keys \['temperature'\]",
    ),
    "default_sampling a list": (
        lambda r: stage(r, "thinker").update(default_sampling=[1]),
        r"stage 'thinker': default_sampling must be a mapping, got \[1\]",
    ),
    "engine a list": (
        lambda r: stage(r, "talker").update(engine=["early_start"]),
        r"stage 'talker': engine must be a mapping, got \['early_start'\]",
    ),
    "devices a number": (
        lambda r: stage(r, "talker").update(devices=0),
        r"stage 'talker': devices must be a non-empty list of device indices, got 0",
    ),
    "devices empty": (
        lambda r: stage(r, "talker").update(devices=[]),
        r"stage 'talker': devices must be a non-empty list of device indices, got \[\]",
    ),
    "final_output unknown": (
        lambda r: stage(r, "thinker").update(final_output="speech"),
        r"stage 'thinker': final_output must be 'text' or 'audio', not 'speech'",
    ),
    "needs_input a string": (
        lambda r: stage(r, "talker").update(needs_input="no"),
        r"stage 'talker': needs_input must be true or false, got 'no'",
    ),
    "default_speaker a number": (
        lambda r: stage(r, "code2wav").update(default_speaker=5),
        r"stage 'code2wav': default_speaker must be a voice's name, got 5",
    ),
    "a name not a string": (
        lambda r: stage(r, "talker").update(name=123),
        r"a stage's name must be a non-empty string, got 123",
    ),
    "no stages": (lambda r: r.update(stages=[]), r"'stages' lists no stage$"),
    "allow_shared_devices a string": (
        lambda r: r.update(allow_shared_devices="false"),
        r"allow_shared_devices must be true or false, got 'false'",
    ),
    "an unknown top-level key": (
        lambda r: r.update(allow_shared_device=True),
        r"unknown keys \['allow_shared_device'\] \(known: architecture, stages, allow_shared_devices\)",
    ),
}


@pytest.mark.parametrize("edit,match", list(CASES.values()), ids=list(CASES))
def test_a_mistake_is_refused_when_the_yaml_is_read(tmp_path, edit, match) -> None:
    path = edited(tmp_path / "stages.yaml", edit)
    with pytest.raises(ValueError, match=r"stages.yaml: " + match):
        load_pipeline_config(path)


def test_the_shipped_yamls_pass() -> None:
    for path in sorted(SHIPPED_DIR.glob("*.yaml")):
        assert load_pipeline_config(path).stages


@pytest.mark.parametrize("value", ["8", 2.7, True, 0, -1])
def test_an_engine_number_is_a_positive_integer_not_coerced(value) -> None:
    sc = StageConfig("code2wav", "generation", "talker", engine={"max_batch": value})
    with pytest.raises(
        ValueError, match=rf"stage 'code2wav': engine.max_batch={value!r} must be a positive integer"
    ):
        sc.engine_int("max_batch", 8)
    assert StageConfig("code2wav", "generation", "talker").engine_int("max_batch", 8) == 8


def test_a_checkpoints_generation_defaults_are_checked_too() -> None:
    """``generation_config.json``'s sampling fields join the YAML's at build: checked alike."""
    sc = StageConfig("llm", "ar", "prompt", default_sampling={"temperature": 0.0})
    with pytest.raises(
        ValueError, match=r"stage 'llm': default_sampling with generation_config.json's: top_p=0.0 must be"
    ):
        sc.default_params(SamplingParams, {"top_p": 0.0})


def test_an_ar_stage_sizes_its_own_engine(omni_dir, tmp_path) -> None:
    """A stage YAML's ``engine`` may size each AR stage (vLLM-omni's per-stage ``engine_args``):
    a thinker and a talker of different ``max_model_len`` and ``max_num_seqs``;
    ``from_pretrained``'s argument, when given, sizes every AR stage instead; a size that is not a
    positive integer is refused naming the stage, before any weight is read."""
    from omni_jax import OmniJaxPipeline
    from omni_jax.planning import plan_memory

    def sizes(r: dict[str, Any]) -> None:
        stage(r, "thinker")["engine"] = {"max_model_len": 256, "max_num_seqs": 4}
        stage(r, "talker")["engine"].update(max_model_len=512, max_num_seqs=2, max_num_batched_tokens=128)

    path = edited(tmp_path / "sized.yaml", sizes)
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker", "talker"], stage_config=path)
    thinker, talker = pipe.stages
    assert (thinker.max_model_len, thinker.load().capacity) == (256, 4)
    assert (talker.max_model_len, talker.load().capacity) == (512, 2)
    assert talker.engine.scheduler.cfg.max_num_batched_tokens == 128
    pipe = OmniJaxPipeline.from_pretrained(
        omni_dir, stages=["thinker", "talker"], stage_config=path, max_model_len=384, max_num_seqs=3
    )
    assert [(s.max_model_len, s.load().capacity) for s in pipe.stages] == [(384, 3), (384, 3)]
    short = edited(tmp_path / "short.yaml", lambda r: stage(r, "talker")["engine"].update(max_model_len=128))
    match = (
        r"stage 'talker': max_model_len=128 is shorter than that of 'thinker', which feeds it \(512\): a "
        r"prompt 'thinker' admits could not be handed on; give 'talker' at least 512"
    )
    for build in (OmniJaxPipeline.from_pretrained, plan_memory):
        with pytest.raises(ValueError, match=match):
            build(omni_dir, stage_config=short)
    bad = edited(tmp_path / "bad.yaml", lambda r: stage(r, "talker")["engine"].update(max_num_seqs="8"))
    with pytest.raises(
        ValueError, match=r"stage 'talker': engine.max_num_seqs='8' must be a positive integer"
    ):
        OmniJaxPipeline.from_pretrained(omni_dir, stage_config=bad)


def test_a_yaml_of_another_architecture_is_refused(qwen2_dir, tmp_path) -> None:
    """A stage YAML names the architecture it is written for, and a checkpoint of another one is
    refused: Qwen2's graph relabelled as Qwen2.5-Omni's would otherwise load a Qwen2 checkpoint
    under that model's settings, the stage names being the same."""
    from omni_jax import OmniJaxPipeline
    from omni_jax.planning import plan_memory

    raw = yaml.safe_load((SHIPPED_DIR / "qwen2.yaml").read_text())
    raw["architecture"] = "Qwen2_5OmniForConditionalGeneration"
    path = tmp_path / "relabelled.yaml"
    path.write_text(yaml.safe_dump(raw))
    match = (
        r"the stage config is for Qwen2_5OmniForConditionalGeneration, but .* is a Qwen2ForCausalLM "
        r"checkpoint: start from that architecture's YAML in "
    )
    with pytest.raises(ValueError, match=match):
        OmniJaxPipeline.from_pretrained(qwen2_dir, stage_config=path)
    with pytest.raises(ValueError, match=match):
        plan_memory(qwen2_dir, stage_config=path)


def test_a_vllm_omni_stage_config_is_refused_with_the_mapping(tmp_path) -> None:
    """A vLLM-omni user's own stage YAML (``stage_args``) is refused saying where each of its
    settings goes here, not as a YAML with unknown keys."""
    path = tmp_path / "vllm_omni.yaml"
    stage = {"stage_id": 0, "engine_args": {"model_stage": "thinker", "max_model_len": 8192}}
    path.write_text(yaml.safe_dump({"stage_args": [stage]}))
    with pytest.raises(
        ValueError,
        match=r"vllm_omni.yaml: a vLLM-omni stage config \(stage_args\), not omni_jax's: .*'name' "
        r"\(engine_args.model_stage\).*'engine' \(engine_args' max_num_seqs, max_model_len",
    ):
        load_pipeline_config(path)


def test_a_yaml_may_name_an_alias_of_its_architecture(omni_dir, tmp_path) -> None:
    """Early hub releases of Qwen2.5-Omni name it ``Qwen2_5OmniModel`` in config.json: the shipped
    YAML serves such a checkpoint, and a YAML naming the alias serves the current name's."""
    from omni_jax.planning import plan_memory

    early = tmp_path / "early"
    early.mkdir()
    config = json.loads((omni_dir / "config.json").read_text())
    (early / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2_5OmniModel"]}))
    assert [s.name for s in plan_memory(early).stages] == ["thinker", "talker", "code2wav"]
    aliased = edited(tmp_path / "aliased.yaml", lambda r: r.update(architecture="Qwen2_5OmniModel"))
    assert len(plan_memory(omni_dir, stage_config=aliased).stages) == 3


def test_a_qwen3_talkers_default_voice_must_be_the_checkpoints(qwen3_omni_dir, tmp_path) -> None:
    """Qwen3-Omni's voices are the config's speaker ids: a misspelt YAML ``default_speaker`` is
    refused naming them, and one in another case is the checkpoint's voice."""
    from stage_yamls import edited_stages

    from omni_jax import OmniJaxPipeline

    def load(voice: str) -> OmniJaxPipeline:
        path = edited_stages(tmp_path / f"{voice}.yaml", "qwen3_omni", talker={"default_speaker": voice})
        return OmniJaxPipeline.from_pretrained(
            qwen3_omni_dir, stages=["thinker", "talker"], stage_config=path
        )

    with pytest.raises(ValueError, match=r"default_speaker 'Ethen' is not one of the checkpoint's voices \["):
        load("Ethen")
    assert load("ETHAN").stages[1].frontend.default_speaker == "ethan"
