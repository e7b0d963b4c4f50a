"""Checkpoint conversion: HF dir -> Orbax dir, loading both, the CLI and its errors (bfloat16
conversion: tests/test_bf16_parity.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from test_checkpoint_forms import assert_same_params

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.cli import main as cli_main
from omni_jax.testing import build_tiny_qwen2
from omni_jax.weights import MANIFEST, convert, load_part


def params_of(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def sharded_tied_dir(tmp_path_factory):
    """Tied embeddings (no lm_head tensor) and several safetensors shards with an index."""
    return build_tiny_qwen2(
        tmp_path_factory.mktemp("sharded") / "hf", seed=3, max_shard_size="60KB", tie_word_embeddings=True
    )


def test_sharded_checkpoint_has_an_index(sharded_tied_dir) -> None:
    index = json.loads((sharded_tied_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]


@pytest.mark.parametrize("which", ["qwen2_dir", "sharded_tied_dir"])
def test_converted_dir_loads_the_same_params_as_hf_dir(which, request, tmp_path) -> None:
    src = request.getfixturevalue(which)
    dst = convert(src, tmp_path / "conv", progress=False)
    for f in ("config.json", "generation_config.json", "tokenizer.json", MANIFEST):
        assert (dst / f).exists(), f
    assert not list(dst.glob("*.safetensors"))
    from_hf, _ = load_part(src, "llm")
    from_conv, _ = load_part(dst, "llm")
    assert_same_params(params_of(from_hf), params_of(from_conv))


def test_pipeline_on_converted_and_hf_dirs_agree(qwen2_dir, tmp_path) -> None:
    dst = convert(qwen2_dir, tmp_path / "conv", progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = OmniJaxPipeline.from_pretrained(qwen2_dir, max_model_len=64).run(
        "one two three", params, progress=False
    )
    b = OmniJaxPipeline.from_pretrained(dst, max_model_len=64).run("one two three", params, progress=False)
    assert a[0].token_ids == b[0].token_ids and a[0].text == b[0].text


def test_cli_converts_verifies_and_refuses_existing_destination(qwen2_dir, tmp_path) -> None:
    dst = tmp_path / "cli"
    cmd = [sys.executable, "-m", "checkpoints_convert", str(qwen2_dir), str(dst), "--verify", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "verify: logits over 16 tokens: max relative error" in done.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("error: destination")
    assert "Traceback" not in again.stderr


def test_both_commands_convert_as_the_api_does(qwen2_dir, tmp_path) -> None:
    """The contract's two command lines: ``omni-jax convert SRC DST`` writes the checkpoint's own
    weights; ``python -m checkpoints_convert SRC DST --dtype bfloat16`` each one cast to bfloat16."""
    assert cli_main(["convert", str(qwen2_dir), str(tmp_path / "f32"), "--quiet"]) == 0
    f32 = params_of(load_part(qwen2_dir, "llm")[0])
    assert_same_params(params_of(load_part(tmp_path / "f32", "llm")[0]), f32)
    cmd = [sys.executable, "-m", "checkpoints_convert", str(qwen2_dir), str(tmp_path / "bf16")]
    done = subprocess.run(
        [*cmd, "--dtype", "bfloat16", "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "bf16" / MANIFEST).read_text())["dtype"] == "bfloat16"
    bf16 = params_of(load_part(tmp_path / "bf16", "llm")[0])
    assert {v.dtype for v in bf16.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert_same_params(bf16, {k: v.astype(ml_dtypes.bfloat16) for k, v in f32.items()})


def test_missing_and_misshaped_tensors_are_named(qwen2_dir, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(qwen2_dir / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((qwen2_dir / "config.json").read_text())
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing parameters: model\.layers\.1\.mlp\.up_proj\.kernel"):
        convert(broken, tmp_path / "out1", progress=False)
    assert not (tmp_path / "out1").exists() and not list(tmp_path.glob(".out1*"))
    misshaped = dict(tensors)
    misshaped["model.norm.weight"] = np.ones(7, np.float32)
    save_file(misshaped, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' has shape \(7,\)"):
        convert(broken, tmp_path / "out2", progress=False)


def test_truncated_safetensors_is_named(qwen2_dir, tmp_path) -> None:
    broken = tmp_path / "trunc"
    broken.mkdir()
    (broken / "config.json").write_text((qwen2_dir / "config.json").read_text())
    data = (qwen2_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: truncated file"):
        convert(broken, tmp_path / "out", progress=False)
