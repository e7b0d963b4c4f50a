"""``omni-jax run`` and ``omni-jax demo`` (Qwen2.5-Omni and Qwen3-Omni) as a user calls them (in
process, through ``main``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from media_samples import gradient_frames, tone, write_audio, write_video
from PIL import Image
from scipy.io import wavfile

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.cli import main


def read_wav(path: Path) -> tuple[int, np.ndarray]:
    rate, data = wavfile.read(path)
    return rate, np.asarray(data)


def test_run_writes_text_and_wav(omni_dir, tmp_path, capsys) -> None:
    image, audio, video, out = tmp_path / "a.png", tmp_path / "a.wav", tmp_path / "v.npy", tmp_path / "out"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(image)
    wavfile.write(audio, 16_000, (0.3 * np.sin(np.arange(16_000) / 8.0)).astype(np.float32))
    np.save(video, np.random.default_rng(1).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8))
    args = [
        "run",
        str(omni_dir),
        "--prompt",
        "what do you see and hear?",
        "--max-tokens",
        "12",
        "--output-dir",
        str(out),
    ]
    # The talker samples (its YAML defaults): --seed makes what it says, and so the test, fixed.
    media = [
        "--image",
        str(image),
        "--audio",
        str(audio),
        "--video",
        str(video),
        "--speaker",
        "Ethan",
        "--seed",
        "0",
    ]
    assert main(args + media) == 0
    (text,) = out.glob("*.txt")
    (wav,) = out.glob("*.wav")
    assert text.stem == wav.stem
    rate, samples = read_wav(wav)
    assert rate == 24_000 and samples.dtype == np.int16 and samples.size > 0  # 16-bit PCM
    assert f"wrote {wav}" in capsys.readouterr().err


def test_run_reads_video_and_audio_files_as_run_reads_them(omni_dir, tmp_path, capsys) -> None:
    """``--video clip.mp4 --use-audio-in-video`` (sampled at the model's rate, its own track heard
    with it) and ``--audio a.mp3``: the text printed is run()'s on the same files."""
    clip = write_video(tmp_path / "clip.mp4", gradient_frames(50, 48, 64), 25, tone(2, 22050, channels=2))
    mp3 = write_audio(tmp_path / "a.mp3", tone(1.5, 44100, hz=330), 44100, "mp3")
    sizes = ["--stages", "thinker", "--max-num-seqs", "1", "--max-model-len", "512", "--max-tokens", "6"]
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=1, max_model_len=512)
    for flags, item, kwargs in (
        (
            ["--video", str(clip), "--use-audio-in-video"],
            {"type": "video", "video": str(clip)},
            {"use_audio_in_video": True},
        ),
        (["--audio", str(mp3), "--fps", "1"], {"type": "audio", "audio": str(mp3)}, {"fps": 1.0}),
    ):
        assert main(["run", str(omni_dir), "--prompt", "what is it?", *sizes, *flags]) == 0
        content = [item, {"type": "text", "text": "what is it?"}]
        prompt = pipe.chat_prompt([{"role": "user", "content": content}], **kwargs)
        (ref,) = pipe.run(prompt, SamplingParams(temperature=0, max_tokens=6), progress=False)
        assert ref.finish_reason in ("stop", "length") and len(ref.prompt_token_ids) > 30
        assert capsys.readouterr().out.strip() == ref.text.strip()


def test_run_speaks_a_plain_prompt_on_qwen3_omni(qwen3_omni_dir, tmp_path, capsys, monkeypatch) -> None:
    """``--prompt`` alone on a pipeline that speaks is the user's chat turn: Qwen3-Omni's talker
    voices the assistant turn the chat template opens (a bare text has none)."""
    out = tmp_path / "out"
    args = ["run", str(qwen3_omni_dir), "--prompt", "hello", "--max-tokens", "6", "--seed", "0"]
    assert main([*args, "--max-num-seqs", "2", "--max-model-len", "256", "--output-dir", str(out)]) == 0
    (wav,) = out.glob("*.wav")
    rate, samples = read_wav(wav)
    assert rate == 24_000 and samples.size > 0
    assert f"wrote {wav}" in capsys.readouterr().err
    # a text-only run into the same folder removes the earlier run's voice, which is not its own
    # (a new process numbers its requests from 0 again, as the reset counter does here)
    monkeypatch.setattr(OmniJaxPipeline, "_ids", itertools.count(int(wav.stem)))
    assert main([*args, "--max-model-len", "256", "--stages", "thinker", "--output-dir", str(out)]) == 0
    assert not wav.exists() and [p.name for p in out.iterdir()] == [f"{wav.stem}.txt"]
    assert f"removed {wav}, an earlier run's: this one made no audio" in capsys.readouterr().err
    # without --output-dir the text is printed, and the audio made is said to be unwritten
    assert main([*args, "--max-num-seqs", "2", "--max-model-len", "256"]) == 0
    err = capsys.readouterr().err
    seconds = samples.size / rate
    assert f"{seconds:.2f} s of audio made and not written: --output-dir DIR writes it as a WAV" in err


def test_run_refuses_bad_input_in_one_line(omni_dir, tmp_path, capsys) -> None:
    args = ["run", str(omni_dir), "--prompt", "hi", "--speaker", "Nobody"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: request 0: unknown speaker 'Nobody'; known speakers: ['Chelsie', 'Ethan']"
    assert main(["run", str(omni_dir), "--prompt", "hi", "--video", str(tmp_path / "clip.mp4")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --video {tmp_path / 'clip.mp4'}: no such file"
    (tmp_path / "notes.npy").write_text("not frames")
    assert main(["run", str(omni_dir), "--prompt", "hi", "--video", str(tmp_path / "notes.npy")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: request 0: video 0 (file ")
    assert err.endswith("notes.npy') not a .npy array of frames (no .npy header)")


def test_demo_runs_end_to_end_and_reuses_its_build(tmp_path, capsys) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    assert main(["demo", "--cache-dir", str(cache), "--output-dir", str(out)]) == 0
    first = capsys.readouterr().out
    assert "building a tiny random-weight Qwen2.5-Omni checkpoint" in first
    report = (out / "demo.txt").read_text()
    assert "request 0 (text+audio+image, voice Chelsie)" in report and "error" not in report
    for i in (0, 1):
        rate, samples = read_wav(out / f"demo_{i}.wav")
        assert rate == 24_000 and samples.size > 0 and np.isfinite(samples).all()
        assert (out / f"demo_{i}.txt").exists()
    assert main(["demo", "--cache-dir", str(cache), "--output-dir", str(out)]) == 0
    assert "building" not in capsys.readouterr().out


def test_demo_runs_qwen3_omni_end_to_end(tmp_path, capsys) -> None:
    """``--model qwen3-omni`` builds, converts and voices the tiny Qwen3-Omni as the default
    demo does the tiny Qwen2.5-Omni (the build cache it shares is tested above)."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    assert main(["demo", "--model", "qwen3-omni", "--cache-dir", str(cache), "--output-dir", str(out)]) == 0
    assert "building a tiny random-weight Qwen3-Omni checkpoint" in capsys.readouterr().out
    report = (out / "demo.txt").read_text()
    assert "request 0 (text+audio+image, voice Chelsie)" in report and "error" not in report
    assert "request 1 (text, voice Ethan)" in report and "Qwen3-Omni's thinker, talker and code2wav" in report
    for i in (0, 1):
        rate, samples = read_wav(out / f"demo_{i}.wav")
        assert rate == 24_000 and samples.size > 0
        assert (out / f"demo_{i}.txt").read_text().strip()


def test_demo_refuses_an_unknown_model_in_one_line(tmp_path, capsys) -> None:
    """argparse's refusal: the console script exits 2 with one line naming the choices."""
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--model", "qwen4-omni", "--cache-dir", str(tmp_path / "cache")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "error: omni-jax demo: argument --model: invalid choice: 'qwen4-omni' "
        "(choose from 'qwen2.5-omni', 'qwen3-omni') (see omni-jax demo --help)\n"
    )
    assert not (tmp_path / "cache").exists()


ENGINE_FLAGS = [
    "--stages",
    "thinker",
    "--dtype",
    "bfloat16",
    "--mesh",
    "data=1,model=1",
    "--max-num-seqs",
    "3",
    "--max-model-len",
    "96",
    "--page-size",
    "8",
    "--max-num-batched-tokens",
    "32",
    "--stage-config",
    "stages.yaml",
    "--limit-mm-per-prompt",
    '{"video": 0}',
]
ENGINE_KWARGS = {
    "stages": ["thinker"],
    "dtype": "bfloat16",
    "mesh": {"data": 1, "model": 1},
    "max_num_seqs": 3,
    "max_model_len": 96,
    "page_size": 8,
    "max_num_batched_tokens": 32,
    "stage_config": "stages.yaml",
    "limit_mm_per_prompt": {"video": 0},
}
BUILD_FLAGS = ["--num-pages", "40", "--attention-backend", "jnp"]
BUILD_KWARGS = {"num_pages": 40, "attention_backend": "jnp"}


class _Built(Exception):
    """Raised by a stand-in ``from_pretrained`` once it has recorded its arguments."""


@pytest.mark.parametrize("command", ["run", "serve", "plan"])
def test_engine_flags_reach_the_pipeline(command, monkeypatch, capsys) -> None:
    """``run``, ``serve`` and ``plan`` take the same engine flags and hand them on unchanged
    (``plan`` those that decide memory), so one checkpoint is sized alike by all three."""
    import omni_jax.async_pipeline
    import omni_jax.pipeline
    import omni_jax.planning

    seen: dict = {}

    def record(path, **kwargs):
        seen.update(kwargs, path=str(path))
        raise ValueError("recorded")

    targets = {
        "run": (omni_jax.pipeline.OmniJaxPipeline, "from_pretrained"),
        "serve": (omni_jax.async_pipeline.AsyncOmniJaxPipeline, "from_pretrained"),
        "plan": (omni_jax.planning, "plan_memory"),
    }
    owner, name = targets[command]
    monkeypatch.setattr(owner, name, record)
    extra = {"run": ["--prompt", "hi"], "serve": ["--port", "0"], "plan": []}[command]
    build = [] if command == "plan" else BUILD_FLAGS
    assert main([command, "ckpt", *extra, *ENGINE_FLAGS, *build]) == 2
    assert capsys.readouterr().err == "error: recorded\n"
    want = {**ENGINE_KWARGS, **({} if command == "plan" else BUILD_KWARGS), "path": "ckpt"}
    assert {k: v for k, v in seen.items() if k in want} == want
    if command == "plan":
        assert not set(BUILD_KWARGS) & set(seen)


def test_dtype_flag_offers_the_dtypes_loading_serves() -> None:
    """``--dtype``'s choices are declared apart from the loader's (``--help`` imports no JAX):
    they must stay the same list."""
    from omni_jax.cli_engine import DTYPE_CHOICES
    from omni_jax.weights import DTYPES

    assert DTYPE_CHOICES == DTYPES


def test_attention_backend_flag_offers_the_backends_attention_takes() -> None:
    """``--attention-backend``'s choices are declared apart from attention's ``Backend`` (``--help``
    imports no JAX): they must stay the same list."""
    import typing

    from omni_jax.cli_engine import ATTENTION_BACKENDS
    from omni_jax.models.attention import Backend

    assert ATTENTION_BACKENDS == typing.get_args(Backend)
