"""Conversion faults (issue 9, point 4) and the converted checkpoint's manifest.

Each broken source is a copy of the tiny Qwen2 checkpoint with one fault. Every fault must be
refused by ``omni_jax.weights.convert`` with a one-line ``ValueError`` naming the file or
tensor, and by the command line with that line on stderr, exit code 2 and no traceback; and
nothing may be left at (or beside) the destination.
"""

from __future__ import annotations

import _thread
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from checkpoints_convert.cli import main as convert_main
from omni_jax.models.param_map import ParamMismatchError
from omni_jax.safetensors_io import CheckpointError, checkpoint_files, count_tensors
from omni_jax.testing import build_tiny_qwen2
from omni_jax.weights import MANIFEST, DestinationExistsError, check_sources, convert, load_part


def leftovers(dst: Path) -> list[Path]:
    """``dst`` itself and any temp/backup sibling a conversion may have made."""
    return sorted(p for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}."))


def refused(src: Path, dst: Path, match: str, **kw) -> ValueError:
    with pytest.raises(ValueError, match=match) as info:
        convert(src, dst, progress=False, **kw)
    assert "\n" not in str(info.value), str(info.value)
    assert leftovers(dst) == []
    return info.value


def copy_of(src: Path, tmp_path: Path, name: str = "src") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def resave(edit: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))

    return fault


def rewrite_header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Edit the JSON header of ``model.safetensors`` and keep the data as it is."""

    def fault(d: Path) -> None:
        raw = (d / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        edit(header)
        new = json.dumps(header).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    return fault


def truncate(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: keep(len(data))])

    return fault


def corrupt_json(d: Path) -> None:
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[8:12] = b"{{{{"
    (d / "model.safetensors").write_bytes(bytes(raw))


def header_length(d: Path) -> None:
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def drop(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def bad_bin(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not a torch zip archive")


def shape_in_header(header: dict) -> None:
    header["model.norm.weight"]["shape"] = [65]


# (id, fault, exact substring of the one-line message; "{src}" is the broken checkpoint's dir)
FAULTS = [
    ("truncated-data", truncate(lambda n: n // 2), "{src}/model.safetensors: truncated file, tensor "),
    (
        "truncated-header",
        truncate(lambda n: 40),
        "{src}/model.safetensors: truncated or corrupt safetensors file (header length",
    ),
    (
        "truncated-to-nothing",
        truncate(lambda n: 3),
        "{src}/model.safetensors: truncated safetensors file (no header)",
    ),
    ("header-not-json", corrupt_json, "{src}/model.safetensors: corrupt safetensors header ("),
    (
        "header-length",
        header_length,
        "{src}/model.safetensors: truncated or corrupt safetensors file (header length",
    ),
    (
        "header-not-an-object",
        rewrite_header(lambda h: (h.clear(), h.update({"a": [1, 2]}))),
        "{src}/model.safetensors: corrupt safetensors header, tensor 'a' has no entry",
    ),
    (
        "header-bytes-vs-shape",
        rewrite_header(shape_in_header),
        "{src}/model.safetensors: tensor 'model.norm.weight' has 256 bytes, its shape needs 260",
    ),
    (
        "missing-tensor",
        resave(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "{src}/model.safetensors: checkpoint is missing parameters: model.layers.1.mlp.up_proj.kernel",
    ),
    (
        "wrong-shape",
        resave(lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)})),
        "{src}/model.safetensors: tensor 'model.norm.weight' has shape (7,)",
    ),
    (
        "extra-tensor",
        resave(lambda t: t.update({"model.extra.weight": np.ones(3, np.float32)})),
        "{src}/model.safetensors: unexpected tensor 'model.extra.weight'",
    ),
    (
        "config-hidden-size",
        edit_config(hidden_size=128),
        "but 'lm_head.kernel' needs (128, 384); does {src}/config.json match the weights?",
    ),
    (
        "config-more-layers",
        edit_config(num_hidden_layers=3, layer_types=["full_attention"] * 3),
        "{src}/model.safetensors: checkpoint is missing parameters: model.layers.2.",
    ),
    (
        "unknown-architecture",
        edit_config(architectures=["LlamaForCausalLM"]),
        "{src}/config.json: unsupported architecture ['LlamaForCausalLM']",
    ),
    (
        "unknown-model-type",
        edit_config(model_type="nonesuch"),
        "{src}/config.json: cannot read the model config (The checkpoint you are trying to load has model",
    ),
    (
        "config-refused-by-transformers",
        edit_config(num_hidden_layers=3),
        "{src}/config.json: transformers refuses this config: `num_hidden_layers` (3) must be equal to "
        "the number of `layer_types` (2)",
    ),
    (
        "config-field-of-the-wrong-type",
        edit_config(num_hidden_layers="two"),
        "{src}/config.json: transformers refuses this config: Field 'num_hidden_layers' expected int, "
        "got str",
    ),
    (
        "config-sets-a-read-only-property",
        edit_config(use_return_dict=True),
        "{src}/config.json: transformers refuses this config: property 'use_return_dict' of 'Qwen2Config' "
        "object has no setter",
    ),
    (
        "config-not-json",
        lambda d: (d / "config.json").write_text("{not json"),
        "{src}/config.json: cannot read the model config (Expecting property name",
    ),
    ("no-config", drop("config.json"), "{src}: no config.json"),
    (
        "no-weights",
        drop("model.safetensors"),
        "{src}: no model.safetensors, pytorch_model.bin or shard index found",
    ),
    ("no-source", shutil.rmtree, "{src}: no such checkpoint directory"),
    ("torch-bin-garbage", bad_bin, "{src}/pytorch_model.bin: unreadable PyTorch checkpoint ("),
]


def literal(s: str) -> str:
    return re.escape(s)


@pytest.mark.parametrize("fault,message", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_fault_is_refused_naming_the_file_or_tensor(qwen2_dir, tmp_path, fault, message) -> None:
    src = copy_of(qwen2_dir, tmp_path)
    fault(src)
    error = refused(src, tmp_path / "dst", literal(message.format(src=src)))
    assert isinstance(error, (CheckpointError, ParamMismatchError))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("sharded") / "hf", seed=1, max_shard_size="60KB")


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def test_sharded_faults_name_the_shard_or_the_index(sharded_dir, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    src = copy_of(sharded_dir, tmp_path)
    index = src / "model.safetensors.index.json"
    second = shards(src)[1]
    # A shard that is short: the shard is named.
    good = second.read_bytes()
    second.write_bytes(good[: len(good) - 10])
    refused(src, tmp_path / "a", literal(f"{second}: truncated file, tensor "))
    # A mis-shaped tensor in the second shard: that shard is named.
    second.write_bytes(good)
    tensors = load_file(str(second))
    name = sorted(tensors)[0]
    tensors[name] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(second), metadata={"format": "pt"})
    refused(src, tmp_path / "b", literal(f"{second}: tensor {name!r} has shape (3, 3)"))
    # A tensor missing from every shard: the index is named (where the checkpoint is listed).
    del tensors[name]
    save_file(tensors, str(second), metadata={"format": "pt"})
    refused(src, tmp_path / "c", literal(f"{index}: checkpoint is missing parameters: "))
    # The index lists a shard that is gone, or is not JSON.
    second.unlink()
    refused(src, tmp_path / "d", literal(f"{index}: lists shard(s) that do not exist: {second}"))
    index.write_text("{")
    refused(src, tmp_path / "e", literal(f"{index}: corrupt shard index (JSONDecodeError"))
    # An index that leaves a shard out (one from an earlier save): the shard is named.
    src = copy_of(sharded_dir, tmp_path, "unlisted")
    index = src / "model.safetensors.index.json"
    kept = json.loads(index.read_text())
    second = shards(src)[1]
    kept["weight_map"] = {k: f for k, f in kept["weight_map"].items() if f != second.name}
    index.write_text(json.dumps(kept))
    (src / "training_args.bin").write_bytes(b"not a shard")  # files a fine-tune ships beside: not named
    (src / "adapter_model.safetensors").write_bytes(b"not a shard")
    refused(
        src,
        tmp_path / "f",
        rf"{re.escape(str(index))}: checkpoint is missing parameters: .*; the index does not list "
        rf"{re.escape(second.name)} in {re.escape(str(src))}: is it out of date\?$",
    )
    index.write_text((sharded_dir / index.name).read_text())  # every shard listed again
    config = json.loads((src / "config.json").read_text())
    deeper = {"num_hidden_layers": config["num_hidden_layers"] + 1}  # a layer no shard holds
    if "layer_types" in config:
        deeper["layer_types"] = [*config["layer_types"], "full_attention"]
    (src / "config.json").write_text(json.dumps({**config, **deeper}))
    refused(
        src, tmp_path / "g", r"checkpoint is missing parameters: .*; does .*config\.json match the weights\?$"
    )


@pytest.fixture(scope="module")
def converted(qwen2_dir, tmp_path_factory) -> Path:
    return convert(qwen2_dir, tmp_path_factory.mktemp("conv") / "conv", progress=False)


def test_existing_destination_is_refused_and_left_alone(qwen2_dir, tmp_path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep")
    with pytest.raises(DestinationExistsError, match=literal(f"destination {dst} already exists")) as info:
        convert(qwen2_dir, dst, progress=False)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileExistsError)
    # --overwrite replaces only an earlier conversion (or an empty dir), never other data.
    with pytest.raises(DestinationExistsError, match="exists and is not a converted checkpoint"):
        convert(qwen2_dir, dst, progress=False, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["mine.txt"]
    assert leftovers(dst) == [dst]
    file_dst = tmp_path / "file"
    file_dst.write_text("x")
    with pytest.raises(DestinationExistsError, match="exists and is not a converted checkpoint"):
        convert(qwen2_dir, file_dst, progress=False, overwrite=True)
    assert file_dst.read_text() == "x"


def test_overwrite_replaces_an_earlier_conversion_only_when_the_new_one_is_complete(
    qwen2_dir, converted, tmp_path
) -> None:
    dst = copy_of(converted, tmp_path, "dst")
    before = json.loads((dst / MANIFEST).read_text())
    # A failing conversion with overwrite=True leaves the old conversion as it was.
    src = copy_of(qwen2_dir, tmp_path)
    resave(lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}))(src)
    with pytest.raises(ParamMismatchError, match=r"tensor 'model\.norm\.weight' has shape \(7,\)"):
        convert(src, dst, progress=False, overwrite=True)
    assert json.loads((dst / MANIFEST).read_text()) == before
    assert leftovers(dst) == [dst]
    # A good one replaces it (bfloat16 now), with nothing left beside.
    convert(qwen2_dir, dst, dtype="bfloat16", progress=False, overwrite=True)
    after = json.loads((dst / MANIFEST).read_text())
    assert after["dtype"] == "bfloat16" and set(after["dtypes"]["llm"].values()) == {"bfloat16"}
    assert leftovers(dst) == [dst]
    load_part(dst, "llm")
    # Never over the source itself.
    with pytest.raises(DestinationExistsError, match="holds the source"):
        convert(dst, dst, progress=False, overwrite=True)


def test_an_interrupted_conversion_leaves_nothing(qwen2_dir, tmp_path, monkeypatch) -> None:
    """Ctrl-C after the parameters were written (while copying side files): the temp dir goes."""
    import omni_jax.weights as weights

    def interrupt(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(weights.shutil, "copy2", interrupt)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        convert(qwen2_dir, dst, progress=False)
    assert leftovers(dst) == []


ORBAX_THREADS = ("write_stage", "np_type_handler", "write_metadata_after_commits")


def orbax_threads() -> list[str]:
    """Names of the threads that write a stage (write_stage's own and Orbax's) still running."""
    return [t.name for t in threading.enumerate() if t.name.startswith(ORBAX_THREADS)]


def test_ctrl_c_while_orbax_writes_stops_the_writes_before_the_temp_dir_goes(
    qwen2_dir, tmp_path, monkeypatch, default_sigint
) -> None:
    """Ctrl-C while the first stage's arrays are being written (from Orbax's threads): the arrays
    not yet begun are skipped, the one in flight finishes, Orbax's threads end, and only then is
    the temp dir removed; the KeyboardInterrupt propagates and the SIGINT handler is restored."""
    import omni_jax.orbax_io as orbax_io
    import omni_jax.weights as weights

    events: list[tuple[str, float, list[str]]] = []
    cancelled = threading.Event()
    cancel = orbax_io._Stop.cancel

    def cancelling(self: orbax_io._Stop) -> None:
        cancelled.set()
        cancel(self)

    materialize = orbax_io.DeferredArray.materialize

    def interrupted(self: orbax_io.DeferredArray) -> np.ndarray:
        if not cancelled.is_set() and not events:
            events.append(("interrupted", time.monotonic(), []))
            _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread
            cancelled.wait(60)
            time.sleep(0.2)  # this array still being read after the main thread stopped the save
        events.append(("written", time.monotonic(), []))
        return materialize(self)

    remove_tree = weights._remove_tree

    def removing(path: Path) -> None:
        events.append(("removed", time.monotonic(), orbax_threads()))
        remove_tree(path)

    monkeypatch.setattr(orbax_io._Stop, "cancel", cancelling)
    monkeypatch.setattr(orbax_io.DeferredArray, "materialize", interrupted)
    monkeypatch.setattr(weights, "_remove_tree", removing)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        convert(qwen2_dir, dst, progress=False)
    assert leftovers(dst) == []
    assert cancelled.is_set()
    kinds = [kind for kind, _, _ in events]
    assert kinds[0] == "interrupted" and kinds[-1] == "removed" and kinds.count("removed") == 1, kinds
    written = kinds.count("written")
    assert 1 <= written < count_tensors(checkpoint_files(qwen2_dir))  # the rest were skipped
    removed_at, alive = events[-1][1], events[-1][2]
    assert all(at < removed_at for kind, at, _ in events[:-1])
    assert alive == [] and orbax_threads() == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_array_write_ends_orbax_before_its_error_propagates(
    qwen2_dir, tmp_path, monkeypatch
) -> None:
    """An array that cannot be read (or written) stops the rest of the stage; its error is raised
    once Orbax's threads have ended, and the temp dir goes."""
    import omni_jax.orbax_io as orbax_io

    calls = []
    materialize = orbax_io.DeferredArray.materialize

    def failing(self: orbax_io.DeferredArray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return materialize(self)

    monkeypatch.setattr(orbax_io.DeferredArray, "materialize", failing)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="No space left on device"):
        convert(qwen2_dir, dst, progress=False)
    assert leftovers(dst) == [] and orbax_threads() == []


def test_a_swallowed_ctrl_c_still_stops_the_conversion(
    qwen2_dir, tmp_path, monkeypatch, default_sigint
) -> None:
    """Python ignores an exception raised in a garbage-collection callback or ``__del__``
    ("Exception ignored in ..."), where a Ctrl-C's KeyboardInterrupt may land: the conversion
    raises it again at its next step rather than carry on."""
    import omni_jax.weights as weights

    hash_files = weights.hash_files

    def swallowing(*args, **kw):
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.1)
        except KeyboardInterrupt:
            pass  # what Python does to an exception raised in a gc callback
        return hash_files(*args, **kw)

    monkeypatch.setattr(weights, "hash_files", swallowing)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        convert(qwen2_dir, dst, progress=False)
    assert leftovers(dst) == []


INTERRUPT_SCRIPT = """
import os, signal, sys, time
import omni_jax.orbax_io as orbax_io
from omni_jax.weights import convert

# As in a terminal: a test runner's worker may ignore SIGINT, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

materialize = orbax_io.DeferredArray.materialize
sent = []

def interrupted(self):
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
        time.sleep(0.5)
    return materialize(self)

orbax_io.DeferredArray.materialize = interrupted
if sys.argv[4:] == ["cli"]:
    from checkpoints_convert.cli import main

    sys.exit(main([sys.argv[1], sys.argv[2], "--quiet"]))
convert(sys.argv[1], sys.argv[2], progress=False)
print("converted")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signalled_conversion_leaves_nothing_and_ends_by_its_signal(qwen2_dir, tmp_path, sig) -> None:
    """A real SIGINT (Ctrl-C) or SIGTERM while Orbax writes, in a process of its own: nothing is
    left beside DST, no abort ("terminate called", Orbax scheduling on a shut-down executor), and
    the process ends by the signal (SIGINT through KeyboardInterrupt's usual handling)."""
    dst = tmp_path / "dst"
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT, str(qwen2_dir), str(dst), sig],
        capture_output=True,
        text=True,
        timeout=300,
    )
    number = getattr(signal, sig)
    assert done.returncode == -number, done.stderr
    assert "converted" not in done.stdout
    for crash in ("terminate called", "FATAL", "cannot schedule new futures"):
        assert crash not in done.stderr, done.stderr
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in done.stderr, done.stderr
    assert leftovers(dst) == []


def test_ctrl_c_stops_the_convert_command_in_one_line(qwen2_dir, tmp_path) -> None:
    """``python -m checkpoints_convert`` (and ``omni-jax convert``) cut short by Ctrl-C: one line,
    the shell's exit code for SIGINT, nothing left beside DST."""
    dst = tmp_path / "dst"
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT, str(qwen2_dir), str(dst), "SIGINT", "cli"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr) == (130, "interrupted\n")
    assert leftovers(dst) == []


def dead_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_temp_dirs_of_killed_conversions_are_removed_before_converting(qwen2_dir, tmp_path) -> None:
    """A conversion killed outright (SIGKILL) leaves its temp dir; the next conversion to the
    same DST removes those whose process no longer runs, and nothing else."""
    dst = tmp_path / "dst"
    stale = tmp_path / f".dst.tmp-{dead_pid()}-0123abcd"
    (stale / "params" / "llm.orbax-checkpoint-tmp").mkdir(parents=True)
    (stale / "params" / "llm.orbax-checkpoint-tmp" / "data").write_bytes(b"half written")
    running = tmp_path / f".dst.tmp-{os.getpid()}-89abcdef"  # a conversion under way
    running.mkdir()
    old = tmp_path / f".dst.old-{dead_pid()}-456789ab"  # may hold the earlier conversion
    old.mkdir()
    other = tmp_path / f".other.tmp-{dead_pid()}-cdef0123"  # another destination's
    other.mkdir()
    unlike = tmp_path / ".dst.tmp-notapid"
    unlike.mkdir()
    convert(qwen2_dir, dst, progress=False)
    assert (dst / MANIFEST).exists()
    assert leftovers(dst) == sorted([dst, running, old, unlike])
    assert other.is_dir()


def test_manifest_records_architecture_dtype_tensors_and_source_hashes(qwen2_dir, converted) -> None:
    manifest = json.loads((converted / MANIFEST).read_text())
    assert manifest["architecture"] == "Qwen2ForCausalLM" and manifest["dtype"] == "float32"
    model, _ = load_part(converted, "llm")
    from flax import nnx

    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert manifest["shapes"]["llm"] == {k: list(v.shape) for k, v in params.items()}
    assert manifest["dtypes"]["llm"] == {k: str(v.dtype) for k, v in params.items()}
    sources = manifest["sources"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(sources)
    for name, rec in sources.items():
        data = (qwen2_dir / name).read_bytes()
        assert rec == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, name


def test_check_sources_names_a_changed_source(qwen2_dir, converted, tmp_path, capsys) -> None:
    assert check_sources(qwen2_dir, converted) == []
    src = copy_of(qwen2_dir, tmp_path)
    (src / "generation_config.json").write_text("{}")
    (src / "tokenizer.json").unlink()
    assert check_sources(src, converted) == ["generation_config.json", "tokenizer.json (missing)"]
    assert convert_main([str(src), str(converted), "--check-sources", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {src} differs from what {converted} was converted from: "
        "generation_config.json, tokenizer.json (missing)"
    ]
    assert convert_main([str(qwen2_dir), str(converted), "--check-sources", "--quiet"]) == 0


def tamper_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        m = json.loads((d / MANIFEST).read_text())
        edit(m)
        (d / MANIFEST).write_text(json.dumps(m))

    return fault


def drop_stored(name: str) -> Callable[[Path], None]:
    """Rewrite ``params/llm`` without one array (a damaged or mixed-up converted dir)."""

    def fault(d: Path) -> None:
        import orbax.checkpoint as ocp

        stage = (d / "params" / "llm").absolute()
        tree = ocp.StandardCheckpointer().restore(stage)
        node = tree
        *parents, leaf = name.split(".")
        for k in parents:
            node = node[k]
        del node[leaf]
        shutil.rmtree(stage)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(stage, tree)
        checkpointer.wait_until_finished()

    return fault


LOAD_FAULTS = [
    (
        "stored-shape",
        tamper_manifest(lambda m: m["shapes"]["llm"].update({"model.norm.weight": [7]})),
        "{d}/params/llm: tensor 'model.norm.weight' is stored with shape (64,), omni_jax.json records (7,)",
    ),
    (
        "stored-dtype",
        tamper_manifest(lambda m: m["dtypes"]["llm"].update({"model.norm.weight": "bfloat16"})),
        "{d}/params/llm: tensor 'model.norm.weight' is stored as float32, omni_jax.json records bfloat16",
    ),
    (
        "not-in-manifest",
        tamper_manifest(lambda m: m["shapes"]["llm"].pop("model.norm.weight")),
        "{d}/params/llm: stored tensor 'model.norm.weight' is not listed in omni_jax.json",
    ),
    (
        "not-stored",
        drop_stored("model.norm.weight"),
        "{d}/params/llm: tensor 'model.norm.weight' listed in omni_jax.json is not stored",
    ),
    (
        "stage-dir-gone",
        lambda d: shutil.rmtree(d / "params" / "llm"),
        "{d}/params/llm: missing; the converted checkpoint is incomplete",
    ),
    ("manifest-not-json", lambda d: (d / MANIFEST).write_text("{"), "{d}/omni_jax.json: unreadable manifest"),
    (
        "config-differs",
        edit_config(hidden_size=128),
        "{d}/omni_jax.json: 'lm_head.kernel' is (64, 384) in the checkpoint, the model config.json "
        "describes needs (128, 384)",
    ),
    (
        "architecture-differs",
        tamper_manifest(lambda m: m.update(architecture="Qwen2_5OmniForConditionalGeneration")),
        "{d}/omni_jax.json: converted from a Qwen2_5OmniForConditionalGeneration checkpoint but config.json "
        "describes Qwen2ForCausalLM",
    ),
]


@pytest.mark.parametrize("fault,message", [f[1:] for f in LOAD_FAULTS], ids=[f[0] for f in LOAD_FAULTS])
def test_loading_checks_the_manifest(converted, tmp_path, fault, message) -> None:
    d = copy_of(converted, tmp_path, "conv")
    fault(d)
    with pytest.raises(ValueError, match=literal(message.format(d=d))) as info:
        load_part(d, "llm")
    assert "\n" not in str(info.value)


def test_cli_prints_one_line_and_exits_2(qwen2_dir, tmp_path, capsys) -> None:
    src = copy_of(qwen2_dir, tmp_path)
    truncate(lambda n: n - 100)(src)
    dst = tmp_path / "dst"
    assert convert_main([str(src), str(dst), "--quiet"]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1, out.err
    assert out.err.startswith(f"error: {src}/model.safetensors: truncated file, tensor ")
    assert out.err.endswith(" ends past the end of the file\n")
    assert out.out == "" and leftovers(dst) == []
    # --overwrite reaches convert() from both command lines.
    dst.mkdir()
    assert convert_main([str(qwen2_dir), str(dst), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith(f"error: destination {dst} already exists")
    assert convert_main([str(qwen2_dir), str(dst), "--quiet", "--overwrite"]) == 0
    assert (dst / MANIFEST).exists() and leftovers(dst) == [dst]


@pytest.mark.parametrize("command", [["-m", "checkpoints_convert"], ["-m", "omni_jax.cli", "convert"]])
def test_command_lines_show_no_traceback(qwen2_dir, tmp_path, command) -> None:
    src = copy_of(qwen2_dir, tmp_path)
    edit_config(architectures=["LlamaForCausalLM"])(src)
    dst = tmp_path / "dst"
    done = subprocess.run(
        [sys.executable, *command, str(src), str(dst), "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"error: {src}/config.json: unsupported architecture ['LlamaForCausalLM']; ")
    assert not dst.exists()


def test_a_config_transformers_refuses_is_one_line_everywhere(qwen2_dir, tmp_path, capsys) -> None:
    """A ``config.json`` that transformers' own validation refuses (here ``num_hidden_layers``
    one more than ``layer_types`` lists) is one ``ValueError`` naming the file from ``plan_memory``
    and ``from_pretrained``, and one line with exit code 2 from ``convert``, ``plan`` and ``run``."""
    from omni_jax import OmniJaxPipeline
    from omni_jax.cli import main
    from omni_jax.planning import plan_memory

    src = copy_of(qwen2_dir, tmp_path)
    edit_config(num_hidden_layers=3)(src)
    message = (
        f"{src}/config.json: transformers refuses this config: `num_hidden_layers` (3) must be equal to "
        "the number of `layer_types` (2)"
    )
    for load in (plan_memory, OmniJaxPipeline.from_pretrained):
        with pytest.raises(CheckpointError, match=literal(message)) as info:
            load(src)
        assert "\n" not in str(info.value)
    dst = tmp_path / "dst"
    for argv in (
        ["convert", str(src), str(dst), "--quiet"],
        ["plan", str(src)],
        ["run", str(src), "--prompt", "x"],
    ):
        assert main(argv) == 2, argv
        out = capsys.readouterr()
        assert len(out.err.splitlines()) == 1 and out.err.startswith(f"error: {message}"), out.err
    assert leftovers(dst) == []
