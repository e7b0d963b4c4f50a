"""Checkpoints in the forms real ones come in, read as transformers reads them.

A hub repo may hold a stale shard index beside its single file, or safetensors beside older
``.bin`` shards; an older tool writes ``.bin`` files in torch's pre-zip format, a config
without a dtype, or the chat template only in ``chat_template.json``; a hub cache's snapshot
links to blobs an interrupted download never fetched; a destination's path may hold
characters Orbax's writer reads as a glob pattern. Each is a copy of the tiny Qwen2 (or
Qwen2.5-Omni) checkpoint in that form.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file
from stage_yamls import shipped_config

from checkpoints_convert.cli import main as convert_main
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.architectures import architecture_of, auto_architectures
from omni_jax.planning import plan_memory
from omni_jax.safetensors_io import CheckpointError
from omni_jax.testing import build_tiny_qwen2, build_tiny_qwen2_5_omni
from omni_jax.testing_qwen3_omni import build_tiny_qwen3_omni
from omni_jax.weights import MANIFEST, checkpoint_dtype, convert, load_hf_config, load_part


def params_of(model_dir: Path) -> dict:
    model, _ = load_part(model_dir, "llm")
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def copy_of(src: Path, tmp_path: Path, name: str = "src") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def zeroed(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in state.items()}


def test_a_single_file_is_read_before_a_stale_index_and_safetensors_before_bin(qwen2_dir, tmp_path) -> None:
    """transformers' order: ``model.safetensors``, its index, ``pytorch_model.bin``, its index.
    The stale files hold zeros, so reading them would change every weight."""
    want = params_of(qwen2_dir)
    state = load_file(qwen2_dir / "model.safetensors")
    stale_index = copy_of(qwen2_dir, tmp_path, "stale_index")
    save_file(zeroed(state), stale_index / "old-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {k: "old-00001-of-00001.safetensors" for k in state}}
    (stale_index / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_params(params_of(stale_index), want)

    beside_bin = copy_of(qwen2_dir, tmp_path, "beside_bin")
    torch.save({k: torch.zeros(v.shape) for k, v in state.items()}, beside_bin / "pytorch_model-1.bin")
    index = {"metadata": {}, "weight_map": {k: "pytorch_model-1.bin" for k in state}}
    (beside_bin / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert_same_params(params_of(beside_bin), want)
    dst = convert(beside_bin, tmp_path / "conv", progress=False)
    sources = json.loads((dst / MANIFEST).read_text())["sources"]
    assert "model.safetensors" in sources and not {
        "pytorch_model-1.bin",
        "pytorch_model.bin.index.json",
    } & set(sources)


def test_a_pre_zip_torch_file_loads(qwen2_dir, tmp_path) -> None:
    """``torch.save(..., _use_new_zipfile_serialization=False)`` files cannot be memory-mapped;
    they are read whole, as transformers reads them."""
    src = copy_of(qwen2_dir, tmp_path)
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    torch.save(tensors, src / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert_same_params(params_of(src), params_of(qwen2_dir))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("bf16") / "hf", seed=2, dtype="bfloat16")


def test_without_a_config_dtype_the_weights_dtype_is_taken(bf16_dir, tmp_path) -> None:
    """transformers' ``dtype="auto"``: a bfloat16 checkpoint whose config names no dtype loads
    in bfloat16 (it was float32, twice the memory), and converts to bfloat16."""
    src = copy_of(bf16_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg.pop("dtype", None) or cfg.pop("torch_dtype")
    cfg.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_dtype(load_hf_config(src), src) == "bfloat16"
    assert {str(v.dtype) for v in params_of(src).values()} == {"bfloat16"}
    dst = convert(src, tmp_path / "conv", progress=False)
    assert json.loads((dst / MANIFEST).read_text())["dtype"] == "bfloat16"
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(src / "config.json", only_config)
    assert checkpoint_dtype(load_hf_config(only_config), only_config) == "float32"  # nothing else to go by
    # a plan before the download: the hub's index is there, its shards not yet
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (only_config / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_dtype(load_hf_config(only_config), only_config) == "float32"
    assert {s.dtype for s in plan_memory(only_config).stages} == {"float32"}
    (only_config / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    assert checkpoint_dtype(load_hf_config(only_config), only_config) == "float32"  # was an IndexError


def test_a_chat_template_in_chat_template_json_is_used(omni_dir, tmp_path) -> None:
    """Hub repos written for the processor ship the template in ``chat_template.json`` alone."""
    want = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_model_len=128)
    messages = [{"role": "user", "content": "hello"}]
    src = copy_of(omni_dir, tmp_path)
    template = want.tokenizer.chat_template
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    pipe = OmniJaxPipeline.from_pretrained(src, stages=["thinker"], max_model_len=128)
    assert pipe.chat_prompt(messages) == want.chat_prompt(messages)
    (src / "chat_template.json").write_text(json.dumps({"template": template}))
    with pytest.raises(ValueError, match=r"chat_template\.json: no chat template \(KeyError"):
        OmniJaxPipeline.from_pretrained(src, stages=["thinker"], max_model_len=128)


def test_the_processors_template_wins_over_the_tokenizers(omni_dir, tmp_path) -> None:
    """A repo with a processor may ship a template for the tokenizer and another in
    ``chat_template.json``: prompts use the one transformers' processor resolves (and vLLM
    uses), not the tokenizer's."""
    from transformers.processing_utils import ProcessorMixin

    src = copy_of(omni_dir, tmp_path)
    processor_template = "PROCESSOR {% for m in messages %}{{ m['content'] }}{% endfor %}"
    (src / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    assert ProcessorMixin.get_processor_dict(str(src))[0]["chat_template"] == processor_template
    pipe = OmniJaxPipeline.from_pretrained(src, stages=["thinker"], max_model_len=128)
    assert pipe.chat_prompt([{"role": "user", "content": "hello"}]) == {"prompt": "PROCESSOR hello"}


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors"])
def test_a_broken_link_in_a_hub_snapshot_is_named(qwen2_dir, tmp_path, name) -> None:
    """A snapshot's file links to a blob that was never downloaded: the conversion and a direct
    load name it. A tokenizer so linked used to be left out without a word, and weights so linked
    read as absent ("no model.safetensors ... found", or another form of the weights read)."""
    src = copy_of(qwen2_dir, tmp_path)
    (src / name).unlink()
    (src / name).symlink_to("../../blobs/0123abcd")
    dst = tmp_path / "conv"
    broken = re.escape(
        f"{src}/{name}: a broken link (to ../../blobs/0123abcd); download the checkpoint again"
    )
    with pytest.raises(CheckpointError, match=broken):
        convert(src, dst, progress=False)
    assert not dst.exists() and not list(tmp_path.glob(".conv.*"))
    if name.endswith(".safetensors"):
        with pytest.raises(CheckpointError, match=broken):
            OmniJaxPipeline.from_pretrained(src, max_model_len=64)


@pytest.mark.parametrize("name", ["a[1]", "a\\b"])
def test_a_destination_orbax_would_glob_is_refused(qwen2_dir, tmp_path, name) -> None:
    """Orbax's writer globs its directory's path: under ``a[1]`` or ``a\\b`` it skipped its merge
    step and the conversion reported success, then failed to load."""
    with pytest.raises(ValueError, match=r"Orbax reads the path as a glob pattern"):
        convert(qwen2_dir, tmp_path / name / "conv", progress=False)
    assert not (tmp_path / name).exists()


def test_a_stage_orbax_did_not_write_whole_fails_the_conversion(qwen2_dir, tmp_path, monkeypatch) -> None:
    """Without the path check, the written stage is read back and found incomplete: the
    conversion fails and leaves nothing (the check behind the path check)."""
    import omni_jax.weights as weights

    monkeypatch.setattr(weights, "GLOB_MAGIC", re.compile(r"(?!)"))
    dst = tmp_path / "a[1]" / "conv"
    with pytest.raises(
        CheckpointError, match=re.escape(f"converting to {dst}: stage 'llm' was not written whole")
    ):
        convert(qwen2_dir, dst, progress=False)
    assert not dst.exists() and not list(dst.parent.glob(".conv.*"))


def test_a_config_naming_no_architecture_is_served_by_its_model_type(qwen2_dir, tmp_path) -> None:
    """As transformers' ``AutoModel`` loads it: ``model_type`` picks the architecture (it was
    refused as "unsupported architecture 'qwen2'")."""
    src = copy_of(qwen2_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["architectures"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_same_params(params_of(src), params_of(qwen2_dir))
    assert architecture_of(load_hf_config(src)).name == "Qwen2ForCausalLM"
    assert auto_architectures("qwen2_5_omni") == ["Qwen2_5OmniForConditionalGeneration"]
    assert auto_architectures("qwen3_omni_moe") == ["Qwen3OmniMoeForConditionalGeneration"]
    llama = load_hf_config(src).to_dict() | {"model_type": "llama"}
    with pytest.raises(
        ValueError, match=r"unsupported architecture \(none named; model_type 'llama'\); supported"
    ):
        architecture_of(type("Config", (), llama))


def mute_copy(src: Path, tmp_path: Path, kept: str) -> Path:
    """``src`` as a checkpoint that does not speak, as Qwen3-Omni's Thinking and Captioner ship:
    ``enable_audio_output: false`` and only the tensors named ``kept*`` (the thinker's)."""
    out = tmp_path / "mute"
    out.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("model"):
            shutil.copy2(f, out / f.name)
    thinker = {k: v for shard in sorted(src.glob("model*.safetensors")) for k, v in load_file(shard).items()}
    save_file({k: v for k, v in thinker.items() if k.startswith(kept)}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "enable_audio_output": False}))
    return out


def test_a_checkpoint_that_does_not_speak_serves_its_thinker(qwen3_omni_dir, tmp_path) -> None:
    """``enable_audio_output: false`` (transformers then builds the thinker alone): by default
    the thinker alone is built, planned and converted, and gives the full checkpoint's thinker's
    tokens; asking for the talker is refused before anything loads (it failed on the missing
    talker weights, after the whole thinker had loaded)."""
    src = mute_copy(qwen3_omni_dir, tmp_path, "thinker.")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    pipe = OmniJaxPipeline.from_pretrained(src, max_model_len=128)
    assert [s.config.name for s in pipe.stages] == ["thinker"]
    (mine,) = pipe.run("hello there", params, progress=False)
    full = OmniJaxPipeline.from_pretrained(qwen3_omni_dir, stages=["thinker"], max_model_len=128)
    (want,) = full.run("hello there", params, progress=False)
    assert mine.token_ids == want.token_ids and mine.audio is None
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{src}/config.json: enable_audio_output is false (a checkpoint that does not speak, as "
            "Qwen3-Omni's Thinking and Captioner): stages ['talker'] cannot run; load it with "
            "stages=['thinker']"
        ),
    ):
        OmniJaxPipeline.from_pretrained(src, stages=["thinker", "talker"], max_model_len=128)
    voice_only = shipped_config("qwen3_omni")  # a stage YAML of code2wav alone: nothing is left
    voice_only["stages"] = [stage for stage in voice_only["stages"] if stage["name"] == "code2wav"]
    (tmp_path / "code2wav.yaml").write_text(yaml.safe_dump(voice_only))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "stages ['code2wav'] cannot run; the stage config lists none of ['thinker']: give one"
        ),
    ):
        OmniJaxPipeline.from_pretrained(src, stage_config=tmp_path / "code2wav.yaml")
    assert [s.name for s in plan_memory(src).stages] == ["thinker"]
    dst = convert(src, tmp_path / "conv", progress=False)
    assert json.loads((dst / MANIFEST).read_text())["stages"] == ["thinker"]
    assert [s.config.name for s in OmniJaxPipeline.from_pretrained(dst, max_model_len=128).stages] == [
        "thinker"
    ]


def test_a_qwen2_5_omni_that_does_not_speak_verifies_its_thinker(omni_dir, tmp_path, capsys) -> None:
    """``--verify`` of a Qwen2.5-Omni with ``enable_audio_output: false``: transformers' model has
    no talker (it was an AttributeError), so the thinker's logits are the one check."""
    src = mute_copy(omni_dir, tmp_path, "thinker.")
    dst = tmp_path / "conv"
    assert convert_main([str(src), str(dst), "--verify", "--quiet"]) == 0
    checks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify: ")]
    assert len(checks) == 1 and checks[0].startswith("verify: thinker logits over 16 tokens"), checks
    assert json.loads((dst / MANIFEST).read_text())["stages"] == ["thinker"]


BUILDERS = {
    "qwen2_dir": build_tiny_qwen2,
    "omni_dir": build_tiny_qwen2_5_omni,
    "qwen3_omni_dir": build_tiny_qwen3_omni,
}


@pytest.mark.parametrize("fixture", list(BUILDERS))
def test_the_tiny_builders_are_deterministic_in_their_seed(fixture, request, tmp_path) -> None:
    """The contract's ``omni_jax.testing``: a seed gives the same checkpoint, file for file and byte
    for byte (the session's fixture is seed 0, built earlier in another directory), and another
    seed other weights."""
    built = request.getfixturevalue(fixture)
    again = BUILDERS[fixture](tmp_path / "again", seed=0)
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (built / f).read_bytes() == (again / f).read_bytes(), f
    other = BUILDERS[fixture](tmp_path / "other", seed=1)
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert weights and all((built / f).read_bytes() != (other / f).read_bytes() for f in weights)
