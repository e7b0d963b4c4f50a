"""Quiet, informative output (issue 19.6).

- Loading a Qwen2.5-Omni checkpoint prints none of transformers' "may result in unexpected
  behavior" warnings about the talker's thinker-vocabulary ids (the checkpoint's own, correct
  fields), while such an id outside the thinker's vocabulary is refused by name.
- Loading a Qwen3-Omni checkpoint prints none of transformers' rope warnings about its M-RoPE
  keys (``mrope_section``), which transformers itself writes and its validation does not know.
- Building the tiny Qwen2.5-Omni or Qwen3-Omni checkpoint (``omni_jax.testing``) prints neither,
  whoever calls the builder (the demo, a test, a user).
- ``run()``'s requests bar says when XLA is compiling, and how many programs it compiled.
- ``save_wav`` writes 16-bit PCM that Python's ``wave`` opens; float32 on request.
- Each ``python -m`` helper's ``--help`` (the benchmarks, the converter) names the command a user
  types and shows plain text, not its docstring's reStructuredText markup.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from scipy.io import wavfile

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.outputs import OmniRequestOutput
from omni_jax.safetensors_io import CheckpointError
from omni_jax.weights import load_hf_config

ROOT = Path(__file__).resolve().parents[1]
WARNING = "may result in unexpected behavior"
ROPE_WARNING = "Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section'}"


def stderr_of(code: str) -> str:
    """A fresh process's stderr: transformers warns once per process, so a test process that
    loaded the checkpoint before would see nothing either way."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_transformers_itself_warns(omni_dir) -> None:
    """The warnings this file proves absent exist: a bare ``AutoConfig`` load prints all seven."""
    err = stderr_of(f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(omni_dir)!r})")
    assert err.count(WARNING) == 7, err


@pytest.mark.parametrize(
    "code",
    [
        "from omni_jax import OmniJaxPipeline; OmniJaxPipeline.from_pretrained({d!r}, max_model_len=128)",
        "from omni_jax.models.qwen2_5_omni.processor import OmniProcessor\n"
        "OmniProcessor.from_pretrained({d!r})",
    ],
    ids=["pipeline", "processor"],
)
def test_loading_prints_no_config_warnings(omni_dir, code) -> None:
    err = stderr_of(code.format(d=str(omni_dir)))
    assert WARNING not in err, err


def test_transformers_itself_warns_about_qwen3_omnis_mrope_keys(qwen3_omni_dir) -> None:
    err = stderr_of(
        f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(qwen3_omni_dir)!r})"
    )
    assert ROPE_WARNING in err, err


def test_loading_qwen3_omni_prints_no_rope_warnings(qwen3_omni_dir) -> None:
    err = stderr_of(
        "from omni_jax import OmniJaxPipeline\n"
        f"OmniJaxPipeline.from_pretrained({str(qwen3_omni_dir)!r}, max_model_len=128)"
    )
    assert "rope_parameters" not in err, err


@pytest.mark.parametrize(
    "build",
    [
        "from omni_jax.testing import build_tiny_qwen2_5_omni as build",
        "from omni_jax.testing_qwen3_omni import build_tiny_qwen3_omni as build",
    ],
    ids=["qwen2_5_omni", "qwen3_omni"],
)
def test_building_a_tiny_checkpoint_prints_no_config_warnings(build, tmp_path) -> None:
    """The builders make the release's configs, which transformers warns about (the talker's
    thinker-vocabulary ids, the M-RoPE keys); called directly, not only through the demo, they
    print none of those warnings."""
    err = stderr_of(f"{build}\nbuild({str(tmp_path / 'hf')!r}, seed=0)")
    assert WARNING not in err and "rope_parameters" not in err, err


def test_thinker_id_outside_the_thinker_vocabulary_is_refused(omni_dir, tmp_path) -> None:
    d = tmp_path / "hf"
    shutil.copytree(omni_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    vocab = cfg["thinker_config"]["text_config"]["vocab_size"]
    cfg["talker_config"]["tts_text_start_token_id"] = vocab + 5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=rf"talker_config\.tts_text_start_token_id={vocab + 5} is outside the thinker's vocabulary "
        rf"\[0, {vocab}\)",
    ):
        load_hf_config(d)


def test_run_says_when_xla_compiles(qwen2_dir, capsys) -> None:
    # Engine sizes no other test uses, so this pipeline's programs are compiled here.
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_model_len=40, max_num_seqs=3, max_num_batched_tokens=32
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    pipe.run(["one two three", "four"], params)
    states = capsys.readouterr().err.split("\r")  # each redraw of the bar
    assert any("compiling XLA programs" in s for s in states), states
    assert "2/2" in states[-1] and "compiled=" in states[-1] and "compiling" not in states[-1], states
    for _ in range(3):  # until a run compiles nothing: then the bar must not say it does
        with CompileCounter() as counter:
            pipe.run(["one two three", "four"], params)
        err = capsys.readouterr().err
        if counter.traces == counter.compiles == 0:
            break
    assert counter.traces == counter.compiles == 0
    assert "2/2" in err and "compiling" not in err and "compiled=" not in err, err


AUDIO = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.7, -2.5, 1e-5, 0.25], np.float32)


def output() -> OmniRequestOutput:
    return OmniRequestOutput(request_id="0", prompt_token_ids=[1], audio=AUDIO, sample_rate=24_000)


def test_save_wav_writes_16_bit_pcm_that_wave_opens(tmp_path: Path) -> None:
    path = output().save_wav(tmp_path / "a.wav")
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24_000)
        frames = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    want = np.array([0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 8192], np.int16)  # clipped, rounded
    np.testing.assert_array_equal(frames, want)


def test_save_wav_of_no_audio_says_so(tmp_path: Path) -> None:
    """A text reply, or audio without its rate, is refused naming the request, before any file."""
    for given in (dict(audio=None, sample_rate=None), dict(audio=AUDIO, sample_rate=None)):
        out = OmniRequestOutput(request_id="r7", prompt_token_ids=[1], **given)
        with pytest.raises(ValueError, match="^request r7 has no audio$"):
            out.save_wav(tmp_path / "n.wav")
    assert not (tmp_path / "n.wav").exists()


def test_a_warmup_report_sums_its_stages() -> None:
    from omni_jax.outputs import StageWarmup, WarmupReport

    report = WarmupReport({"a": StageWarmup(5, 3, 2, 1.5), "b": StageWarmup(4, 1, 3, 0.5)})
    assert (report.programs, report.compiles, report.loads, report.seconds) == (9, 4, 5, 2.0)


def test_save_wav_float32_on_request(tmp_path: Path) -> None:
    path = output().save_wav(tmp_path / "f.wav", sample_format="float32")
    rate, samples = wavfile.read(path)
    assert rate == 24_000 and samples.dtype == np.float32
    np.testing.assert_array_equal(samples, AUDIO)  # as they are, unclipped
    with pytest.raises(wave.Error):  # why 16-bit PCM is the default
        wave.open(str(path))
    with pytest.raises(ValueError, match="sample_format must be 'pcm16' or 'float32', got 'int8'"):
        output().save_wav(tmp_path / "x.wav", sample_format="int8")


def test_warmup_bar_names_the_stage_and_counts_compilations(qwen2_dir, capsys) -> None:
    # Engine sizes no other test uses, so this pipeline's programs are compiled here.
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=16
    )
    report = pipe.warmup()
    states = capsys.readouterr().err.split("\r")
    assert report.compiles > 0
    assert any(f"llm: {report.compiles} XLA programs compiled" in s for s in states), states
    assert "1/1" in states[-1]
    pipe.warmup(progress=False)
    assert capsys.readouterr().err == ""


def helper_modules() -> list[str]:
    """The ``python -m`` commands with a parser of their own: the converter and each benchmark
    module that makes one (found in the sources, so that a new one is checked too)."""
    made = re.compile(r"\b(?:ArgumentParser|OneLineParser)\(")
    benchmarks = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if made.search(p.read_text()))
    return ["checkpoints_convert", *(f"benchmarks.{m}" for m in benchmarks)]


HELPS = """
import contextlib, io, json, runpy, sys
helps = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code == 0, (name, e.code)
    helps[name] = shown.getvalue()
print(json.dumps(helps))
"""


def test_helper_helps_name_their_command_in_plain_text() -> None:
    """``--help`` printed ``usage: host_copy.py`` for a command run as ``python -m
    benchmarks.host_copy``, and descriptions taken from docstrings printed their markup as typed
    (``:func:`run_isolated```, double backquotes). Every helper's help, in one fresh process."""
    modules = helper_modules()
    assert {"checkpoints_convert", "benchmarks.run", "benchmarks.host_copy"} <= set(modules)
    done = subprocess.run(
        [sys.executable, "-c", HELPS, *modules], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    helps = json.loads(done.stdout)
    for module in modules:
        assert helps[module].startswith(f"usage: python -m {module} "), helps[module]
        assert "`" not in helps[module], helps[module]
