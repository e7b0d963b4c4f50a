"""Conversion finishes what it starts (issue 19.4).

``--verify`` checks a Qwen2.5-Omni conversion against transformers (thinker logits, talker
logits, one code2wav solve) or is refused before any work; a failed verify removes the output
it wrote. A Qwen2.5-Omni source without ``spk_dict.pt`` converts with a warning that the result
serves text only, and loading either with an audio stage says so in one ``ValueError``.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from checkpoints_convert import verify as verify_module
from checkpoints_convert.cli import main as convert_main
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.weights import convert


def leftovers(dst: Path) -> list[Path]:
    return sorted(p for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}."))


@pytest.fixture(scope="module")
def voiceless(omni_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("voiceless") / "hf"
    shutil.copytree(omni_dir, d)
    (d / "spk_dict.pt").unlink()
    return d


CHECKS = ("thinker logits over 16 tokens", "talker logits over 16 tokens", "code2wav waveform of 16 codes")


def test_omni_verify_checks_thinker_talker_and_code2wav(omni_dir, tmp_path, capsys) -> None:
    dst = tmp_path / "conv"
    assert convert_main([str(omni_dir), str(dst), "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    for what in CHECKS:
        (line,) = [line for line in out.splitlines() if line.startswith(f"verify: {what}")]
        error = float(re.search(r"max relative error (\S+) \(limit 1e-04\)", line).group(1))
        assert error < 1e-4, line
    assert out.rstrip().endswith(f"converted {omni_dir} -> {dst}")
    assert leftovers(dst) == [dst]


def test_failed_verify_removes_its_output(omni_dir, tmp_path, capsys, monkeypatch) -> None:
    """Every weight the verifier loads is 1% off, as a broken conversion's would be: each of the
    three checks must catch it, and the conversion must go."""
    real = verify_module.load_part

    def off_by_one_percent(*args, **kwargs):
        model, cfg = real(*args, **kwargs)
        nnx.update(model, jax.tree.map(lambda x: x * 1.01, nnx.state(model, nnx.Param)))
        return model, cfg

    monkeypatch.setattr(verify_module, "load_part", off_by_one_percent)
    dst = tmp_path / "conv"
    assert convert_main([str(omni_dir), str(dst), "--verify", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: verify failed, {dst} removed: "), err
    assert all(what in err for what in CHECKS), err
    assert leftovers(dst) == []


def test_verify_refused_before_any_work(voiceless, omni_dir, tmp_path, capsys, monkeypatch) -> None:
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted before --verify was known to be possible")

    monkeypatch.setattr("omni_jax.weights.convert", no_conversion)
    dst = tmp_path / "conv"
    assert convert_main([str(voiceless), str(dst), "--verify", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"error: --verify: {voiceless} has no spk_dict.pt (transformers' model loads its voices); "
        "convert without --verify\n"
    )
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    assert convert_main([str(omni_dir), str(dst), "--verify", "--quiet"]) == 2
    assert capsys.readouterr().err == "error: --verify needs torch (pip install 'omni-jax[torch]')\n"
    assert leftovers(dst) == []


NO_VOICES = (
    r"no spk_dict.pt \(the voices the talker and code2wav speak with\): the checkpoint serves text only; "
    r"stages \[{}\] cannot run: load it with stages=\['thinker'\]"
)


def test_voiceless_source_converts_with_a_warning(voiceless, tmp_path, capsys) -> None:
    with pytest.warns(UserWarning, match=NO_VOICES.format("'talker', 'code2wav'")):
        convert(voiceless, tmp_path / "api", progress=False)
    assert convert_main([str(voiceless), str(tmp_path / "cli"), "--quiet"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(f"warning: {voiceless}: " + NO_VOICES.format(".*"), err[0]), err


@pytest.mark.parametrize("converted", [False, True], ids=["hf", "converted"])
def test_voiceless_checkpoint_serves_text_only(voiceless, tmp_path, converted) -> None:
    path = voiceless
    if converted:
        with pytest.warns(UserWarning):
            path = convert(voiceless, tmp_path / "conv", progress=False)
    for stages, blocked in [(None, "'talker', 'code2wav'"), (["code2wav"], "'code2wav'")]:
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {NO_VOICES.format(blocked)}$"):
            OmniJaxPipeline.from_pretrained(path, stages=stages, max_model_len=128)
    pipe = OmniJaxPipeline.from_pretrained(path, stages=["thinker"], max_model_len=128)
    out = pipe.run("hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), progress=False)
    assert len(out[0].token_ids) == 2
