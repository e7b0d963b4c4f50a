"""Every user mistake on the command line is one line on stderr and exit code 2 (issue 19.3).

Each case calls ``omni-jax`` as a user would (``main`` in process, and a few in a fresh
process, where nothing else of the test session can write to stderr): a missing or broken
checkpoint, a dtype typo, an impossible mesh or stage list, missing media files, an unknown
speaker, a checkpoint without voices, conversion and benchmark mistakes. ``--debug`` shows the
traceback instead, and an error that is not the user's (a bug) keeps its traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from omni_jax import OmniJaxPipeline
from omni_jax.cli import main
from omni_jax.models.qwen2 import Qwen2ForCausalLM
from omni_jax.weights import convert


@pytest.fixture(scope="module")
def qwen2_converted(qwen2_dir, tmp_path_factory) -> Path:
    return convert(qwen2_dir, tmp_path_factory.mktemp("cli_errors") / "conv", progress=False)


@pytest.fixture(scope="module")
def broken(qwen2_converted, tmp_path_factory) -> Path:
    """A converted checkpoint whose stage params are gone (an interrupted copy)."""
    d = tmp_path_factory.mktemp("cli_broken") / "conv"
    shutil.copytree(qwen2_converted, d)
    shutil.rmtree(d / "params" / "llm")
    return d


@pytest.fixture(scope="module")
def voiceless(omni_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli_voiceless") / "hf"
    shutil.copytree(omni_dir, d)
    (d / "spk_dict.pt").unlink()
    return d


def exit_code(argv: list[str]) -> int:
    """What the console script exits with: ``main``'s return value, or argparse's exit."""
    try:
        return main(argv)
    except SystemExit as e:
        assert isinstance(e.code, int)
        return e.code


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# (argv after the program name with {q} a converted Qwen2, {o} the HF Qwen2.5-Omni, {b} a broken
# conversion, {v} an Omni without voices, {t} a temp dir; a regex the one line must match)
CASES = {
    "missing checkpoint": (["run", "{t}/nope", "--prompt", "hi"], r"nope: no such checkpoint directory$"),
    "checkpoint without config": (
        ["run", "{t}", "--prompt", "hi"],
        r": not a checkpoint directory \(no config",
    ),
    "broken conversion": (["run", "{b}", "--prompt", "hi"], r"params/llm: missing; the converted checkpoint"),
    "dtype typo": (
        ["run", "{q}", "--prompt", "hi", "--dtype", "bf17"],
        r"argument --dtype: invalid choice: 'bf17' \(choose from 'float32', 'bfloat16', 'float16'\)",
    ),
    "unserved dtype": (["run", "{q}", "--prompt", "hi", "--dtype", "int8"], r"invalid choice: 'int8'"),
    "engine size": (
        ["run", "{q}", "--prompt", "hi", "--max-num-seqs", "0"],
        r"omni-jax run: argument --max-num-seqs: must be a positive integer, got 0",
    ),
    "context over the model's": (
        ["run", "{q}", "--prompt", "hi", "--max-model-len", "100000"],
        r"max_model_len=100000 exceeds the model's max_position_embeddings=512$",
    ),
    "plan stage config": (
        ["plan", "{q}", "--stage-config", "{t}/none.yaml"],
        r"stage config .*none.yaml: no such file$",
    ),
    "stage config a directory": (
        ["plan", "{q}", "--stage-config", "{t}"],
        r"stage config .*: cannot be read as a YAML file \(IsADirectoryError\)$",
    ),
    "stage config not YAML": (
        ["run", "{q}", "--prompt", "hi", "--stage-config", "{t}/broken.yaml"],
        r"broken.yaml: not valid YAML \(while parsing a flow node",
    ),
    "stage config not a graph": (
        ["run", "{q}", "--prompt", "hi", "--stage-config", "{t}/flat.yaml"],
        r"flat.yaml: a stage config is a mapping with 'architecture' and a list of 'stages'$",
    ),
    "output folder is a file": (
        ["run", "{q}", "--prompt", "hi", "--output-dir", "{t}/file"],
        r"--output-dir .*file: cannot be made a folder \(File exists\)$",
    ),
    "pallas on a CPU": (
        ["run", "{q}", "--prompt", "hi", "--attention-backend", "pallas"],
        r"attention_backend='pallas' compiles its kernel for a GPU or TPU; on CPU use 'cpu', 'jnp' or",
    ),
    "check-sources with conversion flags": (
        ["convert", "{t}/src", "{t}/dst", "--check-sources", "--overwrite", "--dtype", "bfloat16"],
        r"--check-sources converts nothing, so --dtype, --overwrite would do nothing$",
    ),
    "config size not positive": (
        ["plan", "{t}/bad_size"],
        r"bad_size/config.json: cannot read the model config \(hidden_size=-4 must be a positive integer\)$",
    ),
    "output folder empty": (
        ["run", "{q}", "--prompt", "hi", "--output-dir", ""],
        r"--output-dir: an empty path names no folder$",
    ),
    "demo output folder is a file": (
        ["demo", "--cache-dir", "{t}/cache", "--output-dir", "{t}/file"],
        r"--output-dir .*file: cannot be made a folder \(File exists\)$",
    ),
    "text to a code2wav stage": (
        ["run", "{o}", "--prompt", "hi", "--stages", "code2wav"],
        r"the 'code2wav' stage takes token ids, not --prompt text$",
    ),
    "attention backend": (
        ["run", "{q}", "--prompt", "hi", "--attention-backend", "flash"],
        r"omni-jax run: argument --attention-backend: invalid choice: 'flash' \(choose from .*auto.*jnp.*"
        r"pallas.*pallas_interpret.*cpu.*\)",
    ),
    "stage twice": (
        ["run", "{o}", "--prompt", "hi", "--stages", "thinker,thinker"],
        r"stages lists \['thinker'\] more than once \(each stage is built once\)",
    ),
    "serve empty api key": (
        ["serve", "{q}", "--api-key", ""],
        r"omni-jax serve: argument --api-key: must not be empty \(omit --api-key to serve without a key\)",
    ),
    "serve mm-processor-kwargs": (
        ["serve", "{q}", "--mm-processor-kwargs", '{{"fps": 0}}'],
        r"omni-jax serve: argument --mm-processor-kwargs: must be a JSON object such as .*: "
        r"fps: Input should be greater than 0",
    ),
    "serve port": (
        ["serve", "{q}", "--port", "99999"],
        r"omni-jax serve: argument --port: must be a TCP port \(0 to 65535\), got 99999",
    ),
    "config.json alone": (  # no weights is said before the missing voices file
        ["run", "{t}/config_only", "--prompt", "hi"],
        r"config_only: no model.safetensors, pytorch_model.bin or shard index found$",
    ),
    "unknown flag of a subcommand": (
        ["convert", "{t}/src", "{t}/dst", "--bogus"],
        r"^error: omni-jax convert: unrecognized arguments: --bogus \(see omni-jax convert --help\)$",
    ),
    "too many devices": (["run", "{q}", "--prompt", "hi", "--mesh", "data=64"], r"the mesh needs 64 devices"),
    "mesh syntax": (["run", "{q}", "--prompt", "hi", "--mesh", "bogus"], r"mesh 'bogus': expected axis=size"),
    "mesh axis twice": (
        ["plan", "{q}", "--mesh", "model=2,model=4"],
        r"mesh 'model=2,model=4': axis 'model' is given twice",
    ),
    "stage without its input": (
        ["run", "{o}", "--prompt", "hi", "--stages", "talker"],
        r"stage 'talker' reads 'thinker''s output and cannot take a prompt",
    ),
    "unknown stage": (
        ["run", "{o}", "--prompt", "hi", "--stages", "thinker,nope"],
        r"unknown stage\(s\) \['nope'\]",
    ),
    "missing video": (
        ["run", "{o}", "--stages", "thinker", "--prompt", "hi", "--video", "{t}/clip.npy"],
        r"--video .*clip.npy: no such file",
    ),
    "missing audio": (
        ["run", "{o}", "--stages", "thinker", "--prompt", "hi", "--audio", "{t}/a.wav"],
        r"--audio .*a.wav: no such file",
    ),
    "missing image": (
        ["run", "{o}", "--stages", "thinker", "--prompt", "hi", "--image", "{t}/a.png"],
        r"request 0: image file '.*a.png' does not exist",
    ),
    "unknown speaker": (["run", "{o}", "--prompt", "hi", "--speaker", "Nobody"], r"unknown speaker 'Nobody'"),
    "no voices": (
        ["run", "{v}", "--prompt", "hi"],
        r"no spk_dict.pt .*serves text only; stages \['talker', 'code2wav'\] cannot run: "
        r"load it with stages=\['thinker'\]",
    ),
    "missing argument": (["run", "{q}"], r"omni-jax run: the following arguments are required: --prompt"),
    "convert missing source": (["convert", "{t}/nope", "{t}/out"], r"nope: no such checkpoint directory"),
    "plan of a file": (["plan", "{t}/file"], r"file: a file, not a checkpoint directory$"),
    "convert dtype typo": (
        ["convert", "{q}", "{t}/out", "--dtype", "bf17"],
        r"argument --dtype: invalid choice: 'bf17' \(choose from 'float32', 'bfloat16', 'float16'\)",
    ),
    "demo cache under a file": (["demo", "--cache-dir", "{t}/file/cache"], r"Not a directory"),
    "bench model": (
        ["bench", "--suite", "ar", "--model", "{t}/nope"],
        r"--model .*nope: not 'tiny', 'small'",
    ),
    "bench flag": (
        ["bench", "--suite", "ar", "--max-tokens", "x"],
        r"omni-jax bench: argument --max-tokens: invalid int value: 'x'",
    ),
}


@pytest.mark.parametrize("argv,pattern", list(CASES.values()), ids=list(CASES))
def test_mistake_is_one_line_and_exit_2(
    argv, pattern, qwen2_converted, omni_dir, broken, voiceless, tmp_path, capsys
) -> None:
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "broken.yaml").write_text("stages: [\n")
    (tmp_path / "flat.yaml").write_text("stages: 5\n")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((omni_dir / "config.json").read_text())
    (tmp_path / "bad_size").mkdir()
    config = json.loads((qwen2_converted / "config.json").read_text())
    (tmp_path / "bad_size" / "config.json").write_text(json.dumps({**config, "hidden_size": -4}))
    paths = dict(q=qwen2_converted, o=omni_dir, b=broken, v=voiceless, t=tmp_path)
    assert exit_code([a.format(**paths) for a in argv]) == 2
    line = one_error_line(capsys)
    assert re.search(pattern, line), line
    assert not (tmp_path / "out").exists()


# (argv as in CASES, each a refusal that comes after the output folder is checked)
REFUSED_WITH_AN_OUTPUT_FOLDER = {
    "missing checkpoint": ["run", "{t}/nope", "--prompt", "hi", "--output-dir", "{t}/out/deeper"],
    "context over the model's": [
        "run",
        "{q}",
        "--prompt",
        "hi",
        "--max-model-len",
        "100000",
        "--output-dir",
        "{t}/out",
    ],
    "unknown speaker": ["run", "{o}", "--prompt", "hi", "--speaker", "Nobody", "--output-dir", "{t}/out"],
    "missing audio": [
        "run",
        "{o}",
        "--stages",
        "thinker",
        "--prompt",
        "hi",
        "--audio",
        "{t}/a.wav",
        "--output-dir",
        "{t}/out",
    ],
}


@pytest.mark.parametrize(
    "argv", list(REFUSED_WITH_AN_OUTPUT_FOLDER.values()), ids=list(REFUSED_WITH_AN_OUTPUT_FOLDER)
)
def test_a_refused_request_makes_no_output_folder(argv, qwen2_converted, omni_dir, tmp_path, capsys) -> None:
    """``--output-dir`` is checked before any work but made only when something is written into
    it: a refusal (exit 2, its one line) leaves no folder behind, nor its parents."""
    paths = dict(q=qwen2_converted, o=omni_dir, t=tmp_path)
    assert exit_code([a.format(**paths) for a in argv]) == 2
    one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_a_refused_demo_makes_no_default_output_folder(tmp_path, monkeypatch, capsys) -> None:
    """The demo's default ``--output-dir`` (``omni_jax_demo_output`` in the working folder) is
    not made by a demo that is refused (here its cache folder cannot be made)."""
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    assert exit_code(["demo", "--cache-dir", str(tmp_path / "file" / "cache")]) == 2
    assert "Not a directory" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_output_folder_under_a_file_is_refused_before_the_run(
    qwen2_converted, tmp_path, monkeypatch, capsys
) -> None:
    """The check finds what ``mkdir`` would, before the checkpoint is read: a file above the
    folder is said in one line (exit 2) and nothing is loaded."""
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(OmniJaxPipeline, "from_pretrained", lambda *a, **k: pytest.fail("it loaded"))
    argv = ["run", str(qwen2_converted), "--prompt", "hi", "--output-dir", str(tmp_path / "file" / "out")]
    assert exit_code(argv) == 2
    line = one_error_line(capsys)
    assert (
        line == f"error: --output-dir {tmp_path / 'file' / 'out'}: cannot be made a folder (Not a directory)"
    )


def test_a_request_that_fails_at_run_time_exits_1_naming_it(
    qwen2_converted, tmp_path, monkeypatch, capsys
) -> None:
    """A fault inside the run (every embedding NaN: the stage ends the request with
    ``finish_reason="error"``) is not a usage mistake: its message on stderr, exit code 1, no
    reply printed and nothing written."""
    embed = Qwen2ForCausalLM.embed

    def nan_embed(self, tokens, extra=None):  # noqa: ANN001, ANN202 - the patched method's signature
        return embed(self, tokens, extra) * jnp.nan

    monkeypatch.setattr(Qwen2ForCausalLM, "embed", nan_embed)
    out = tmp_path / "out"
    argv = ["run", str(qwen2_converted), "--prompt", "hi", "--max-tokens", "4", "--output-dir", str(out)]
    assert exit_code(argv) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: stage 'llm': non-finite logits at output token 0\n"
    assert captured.out == "" and not out.exists()


def test_serve_refuses_a_port_in_use_before_loading(tmp_path, capsys) -> None:
    """The address is taken before the checkpoint is read: a port in use is the one line, at
    once (here the checkpoint does not even exist), not a failure after minutes of loading."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert exit_code(["serve", str(tmp_path / "nothing"), "--port", str(port)]) == 2
    line = one_error_line(capsys)
    assert line == f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"


def test_debug_shows_the_traceback(qwen2_converted) -> None:
    too_long = "max_model_len=100000 exceeds the model's max_position_embeddings"
    with pytest.raises(ValueError, match=too_long):
        main(["run", str(qwen2_converted), "--prompt", "hi", "--max-model-len", "100000", "--debug"])
    with pytest.raises(ValueError, match=too_long):
        main(["--debug", "run", str(qwen2_converted), "--prompt", "hi", "--max-model-len", "100000"])


def test_a_bug_keeps_its_traceback(qwen2_converted, monkeypatch) -> None:
    def broken_loader(*args, **kwargs):
        raise KeyError("a bug, not the user's mistake")

    monkeypatch.setattr(OmniJaxPipeline, "from_pretrained", broken_loader)
    with pytest.raises(KeyError, match="a bug"):
        main(["run", str(qwen2_converted), "--prompt", "hi"])


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_jax.cli", *argv], capture_output=True, text=True, timeout=600, env=env
    )


def test_a_reader_gone_from_stdout_ends_the_command_in_silence(qwen2_dir) -> None:
    """``omni-jax plan ... | head -1``: the reader closed the pipe, which is not the user's
    mistake. It was ``error: [Errno 32] Broken pipe`` and exit 2 (when the plan outran the
    pipe's buffer); now nothing on stderr and 141, a shell's code for a program SIGPIPE ended.
    The reader is closed before the command starts, so its first write finds the pipe broken;
    stdout is buffered, as in a shell without ``PYTHONUNBUFFERED`` (the output then reaches the
    pipe when it is flushed, which at the interpreter's exit was exit code 120)."""
    read, write = os.pipe()
    os.close(read)
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "omni_jax.cli", "plan", str(qwen2_dir)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=buffered,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_fresh_process_prints_exactly_one_line(omni_dir, tmp_path) -> None:
    """Nothing else reaches stderr either: no traceback, no transformers config warnings."""
    done = cli("run", str(omni_dir), "--prompt", "hi", "--speaker", "Nobody")
    assert done.returncode == 2
    assert done.stderr == "error: request 0: unknown speaker 'Nobody'; known speakers: ['Chelsie', 'Ethan']\n"
    done = cli("run", str(tmp_path / "nope"), "--prompt", "hi", "--debug")
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.rstrip().endswith("nope: no such checkpoint directory")


def test_fresh_serve_prints_exactly_one_line(qwen2_converted) -> None:
    """The server's logging shows none of JAX's own INFO lines (its backend probing: "Unable to
    initialize backend 'tpu'") above the mistake's one line. JAX probes its backends only when
    ``JAX_PLATFORMS`` (which the tests set) leaves them open, as a user's shell does."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = cli("serve", str(qwen2_converted), "--port", "0", "--mesh", "model=3", env=env)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "the mesh needs 3 devices" in done.stderr, done.stderr


def test_a_ctrl_c_swallowed_while_loading_still_ends_the_run(
    qwen2_converted, monkeypatch, capsys, default_sigint
) -> None:
    """JAX's garbage-collection callback swallows a KeyboardInterrupt raised inside it ("Exception
    ignored in"), so a Ctrl-C while a checkpoint loaded let ``run`` carry on and exit 0. The run
    checks for it after loading: ``interrupted``, exit 130, and nothing generated."""
    loaded = OmniJaxPipeline.from_pretrained.__func__

    def load_and_swallow(cls, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        pipe = loaded(cls, *args, **kwargs)
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what the callback does with it
        monkeypatch.setattr(pipe, "run", lambda *a, **k: pytest.fail("the run went on"))
        return pipe

    monkeypatch.setattr(OmniJaxPipeline, "from_pretrained", classmethod(load_and_swallow))
    assert exit_code(["run", str(qwen2_converted), "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_ctrl_c_swallowed_before_loading_still_ends_the_run(
    qwen2_converted, monkeypatch, capsys, default_sigint
) -> None:
    """The same while JAX is imported, before any checkpoint is read (the run took a Ctrl-C 1-2 s
    after its start, then generated its whole reply and exited 0): ``interrupted``, exit 130,
    and nothing loaded."""
    import omni_jax.cli

    read = omni_jax.cli.EngineOptions.from_args

    def swallow(args: object) -> object:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what JAX's garbage-collection callback does with it
        return read(args)

    monkeypatch.setattr(omni_jax.cli.EngineOptions, "from_args", staticmethod(swallow))
    monkeypatch.setattr(OmniJaxPipeline, "from_pretrained", lambda *a, **k: pytest.fail("the run went on"))
    assert exit_code(["run", str(qwen2_converted), "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_sigterm_ends_a_multi_process_run(qwen2_converted) -> None:
    """``jax.distributed.initialize`` puts a SIGTERM handler of its own (a preemption notifier
    that only records the signal) over any there: a run whose interrupt handling began before
    it ignored a process manager's stop, and finished its reply with exit 0. SIGTERM while the
    checkpoint loads ends the process by SIGTERM. One process alone, so that no other must join."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    code = (
        "import os, signal, sys, time\n"
        "from omni_jax import OmniJaxPipeline\n"
        "from omni_jax.cli import main\n"
        "def load(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    raise SystemExit('SIGTERM was ignored')\n"
        "OmniJaxPipeline.from_pretrained = load\n"
        f"sys.exit(main(['run', {str(qwen2_converted)!r}, '--prompt', 'hi', '--coordinator-address', "
        f"'localhost:{port}', '--num-processes', '1', '--process-id', '0']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])


def test_help_and_the_parser_do_not_import_jax() -> None:
    """``omni-jax --help`` (and every parser mistake) answers without importing JAX, which takes
    seconds: the package's exports and ``checkpoints_convert.convert`` load on first use."""
    code = (
        "import sys\nfrom omni_jax.cli import main\n"
        "for argv in (['--help'], ['run', '--help'], ['convert', '--help'], ['run']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "import omni_jax, checkpoints_convert\n"
        "print(sorted(m for m in ('jax', 'flax', 'transformers') if m in sys.modules))\n"
        "from omni_jax import OmniJaxPipeline\nfrom checkpoints_convert import convert\n"
        "print(OmniJaxPipeline.__module__, convert.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["[]", "omni_jax.pipeline omni_jax.weights"], done.stdout
