"""Checkpoint formats: HF dirs (converted in memory) and our converted Orbax dirs.

A converted dir holds ``omni_jax.json`` (a manifest: architecture, dtype, stages, every
parameter's shape), ``params/<stage>/`` (one Orbax OCDBT checkpoint per stage, so a
pipeline that builds one stage reads one stage; written and read a bounded amount at a time,
:mod:`omni_jax.orbax_io`) and the HF side files (config, tokenizer,
processor, generation config) copied verbatim, except those the architecture rewrites
torch-free (Qwen2.5-Omni's ``spk_dict.pt`` becomes ``speakers.safetensors`` + ``speakers.json``).

The manifest also records every parameter's dtype and the sha256 of each source file read
(provenance: loading never re-reads the sources; ``python -m checkpoints_convert
--check-sources SRC DST`` compares them). Loading a converted dir checks the stored arrays
against the manifest and the manifest against the model the config describes. Expected
faults (unreadable or inconsistent files, a destination that exists) raise
:class:`~omni_jax.safetensors_io.CheckpointError` or
:class:`~omni_jax.models.param_map.ParamMismatchError`, both ``ValueError`` s whose one-line
message names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from omni_jax.architectures import Architecture, ModelPart, architecture_of
from omni_jax.interrupts import Interrupts
from omni_jax.models.hf_config import ConfigRefusedError, read_config
from omni_jax.models.loading import abstract_params, merge_params, split_params
from omni_jax.models.param_map import (
    FlaxPath,
    MissingParamsError,
    ParamMismatchError,
    fill_params,
    format_path,
    map_name,
    parse_path,
)
from omni_jax.orbax_io import DeferredArray, restore_stage, stored_arrays, write_stage
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import Layout, layout, put_cast
from omni_jax.safetensors_io import (
    SHARD_INDEXES,
    CheckpointError,
    TensorReader,
    check_link,
    checkpoint_files,
    count_tensors,
    first_line,
    stored_dtype,
    tensor_readers,
    unlisted_shards,
    weights_source,
)

MANIFEST = "omni_jax.json"
FORMAT_VERSION = 1
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
DTYPES = ("float32", "bfloat16", "float16")
HASH_CHUNK = 8 << 20


class DestinationExistsError(CheckpointError, FileExistsError):
    """The conversion's destination exists (and may not, or cannot, be replaced)."""


def load_hf_config(model_dir: str | Path) -> Any:
    """``config.json`` through transformers; a missing, unreadable or unknown config, or one
    transformers' validation refuses, raises :class:`CheckpointError` naming the file."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        what = "a file, not a checkpoint directory" if model_dir.exists() else "no such checkpoint directory"
        raise CheckpointError(f"{model_dir}: {what}")
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (not a Hugging Face or converted checkpoint)")
    try:
        if not isinstance(json.loads(path.read_text()), dict):
            raise ValueError("not a JSON object")
        return read_config(model_dir)
    except ConfigRefusedError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot read the model config ({first_line(e)})") from e


def architecture(model_dir: str | Path, hf_config: Any) -> Architecture:
    """The served :class:`Architecture` of ``hf_config``; an unknown one names ``config.json``."""
    try:
        return architecture_of(hf_config)
    except ValueError as e:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'}: {e}") from e


def is_converted(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a ``checkpoints_convert`` output (it has the :data:`MANIFEST`), so
    it is restored from Orbax rather than read from HF safetensors."""
    return (Path(model_dir) / MANIFEST).exists()


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    """A converted dir's :data:`MANIFEST`, checked before anything relies on it: of this
    :data:`FORMAT_VERSION` and with its architecture, dtype, stages and shapes.
    ``CheckpointError`` naming the file when it is unreadable, of another format or incomplete."""
    path = Path(model_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({first_line(e)})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{path}: converted with format {found}, expected {FORMAT_VERSION}")
    for key in ("architecture", "dtype", "stages", "shapes"):
        if key not in manifest:
            raise CheckpointError(f"{path}: corrupt manifest, no {key!r}")
    return manifest


def checkpoint_dtype(hf_config: Any, model_dir: Path) -> str:
    """The dtype the checkpoint declares (``dtype`` / ``torch_dtype``); without one, that of its
    weights (:func:`~omni_jax.safetensors_io.stored_dtype`, as transformers' default
    ``dtype="auto"``: a bfloat16 checkpoint is not loaded at twice its size); float32 when
    neither is known (a plan from ``config.json`` alone)."""
    d = (
        getattr(hf_config, "dtype", None)
        or getattr(hf_config, "torch_dtype", None)
        or stored_dtype(model_dir)
    )
    return str(d or "float32").removeprefix("torch.")


class _Cursor:
    """Which file the tensor being read comes from, so a mismatch can name it."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.file: Path | None = None

    def where(self, model_dir: Path) -> Path:
        """The current file; after the last tensor, the checkpoint's (single file or index)."""
        if self.file is not None:
            return self.file
        if len(self.files) == 1:
            return self.files[0]
        return weights_source(model_dir) or model_dir


def _part_tensors(
    arch: Architecture, part: ModelPart, cfg: Any, progress: bool, cursor: _Cursor
) -> Iterator[tuple[str, TensorReader]]:
    """Readers of ``part``'s tensors; those of other parts (served or not yet, or that another
    part drops) are skipped, strays are errors. ``cursor`` follows the file being read."""
    rules = part.rules(cfg)
    others = [r for p in arch.parts if p is not part for r in p.rules(cfg)]
    dropped = [re.compile(x) for p in arch.parts if p is not part for x in p.ignore(cfg)]
    total = count_tensors(cursor.files)
    bar = tqdm(total=total, desc=f"loading {part.stage}", unit="tensor", disable=not progress)

    def stored() -> Iterator[tuple[str, TensorReader]]:
        with bar:
            for f in cursor.files:
                cursor.file = f
                for name, read in tensor_readers(f):
                    bar.update(1)
                    yield name, read
            cursor.file = None

    tensors = stored() if arch.restack is None else arch.restack(stored())
    for name, read in tensors:
        if map_name(rules, name) is None and (
            arch.is_unserved_tensor(name)
            or map_name(others, name) is not None
            or any(d.fullmatch(name) for d in dropped)
        ):
            continue
        yield name, read


def load_part(
    model_dir: str | Path,
    stage: str,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    progress: bool = False,
    template: nnx.Module | None = None,
) -> tuple[nnx.Module, Any]:
    """Build the ``stage`` model from an HF dir or a converted dir; returns ``(model, hf_config)``.

    The model is built abstractly and each tensor placed on its devices as it is read, cast
    on the way, so the host holds a bounded number of tensors at a time and the model never
    exists twice. With ``mesh``, every tensor goes straight into its shards under the part's
    partition rules (an HF tensor sliced per device from its memory map, Orbax restored
    directly into the target layout), so no device ever holds more than its share.
    ``template``: the part's abstract model in the dtype it loads in, when the caller has built
    it (``from_pretrained``'s memory check has: a large model takes seconds to trace), filled
    rather than built again; it is not changed.
    """
    model_dir = Path(model_dir)
    cfg = load_hf_config(model_dir)
    arch = architecture(model_dir, cfg)
    part = arch.part(stage)
    sharding = None if mesh is None else layout(part.shard_rules(cfg, axis_size(mesh, "model")), mesh)
    if is_converted(model_dir):
        manifest = read_manifest(model_dir)
        if manifest["architecture"] != arch.name:
            raise CheckpointError(
                f"{model_dir / MANIFEST}: converted from a {manifest['architecture']} checkpoint but "
                f"config.json describes {arch.name}"
            )
        if stage not in manifest["stages"]:
            raise ValueError(
                f"{model_dir}: converted without stage {stage!r} (it has {manifest['stages']}); "
                "convert the HF checkpoint again"
            )
        dtype = part.dtype or dtype or manifest["dtype"]
        graphdef, abstract = _params_of(template, part, cfg, dtype)
        values = _restore_stage(model_dir, stage, abstract, manifest, dtype, sharding)
    else:
        dtype = part.dtype or dtype or checkpoint_dtype(cfg, model_dir)

        def place(path: FlaxPath, read: TensorReader) -> jax.Array:
            x = read()
            return put_cast(x, None if sharding is None else sharding(path, x.shape), jnp.dtype(dtype))

        graphdef, abstract = _params_of(template, part, cfg, dtype)
        values = _read_hf_part(model_dir, arch, part, cfg, abstract, progress, place)
    return merge_params(graphdef, abstract, values), cfg


def _params_of(
    template: nnx.Module | None, part: ModelPart, cfg: Any, dtype: str
) -> tuple[nnx.GraphDef, dict[FlaxPath, nnx.Variable]]:
    """``part``'s abstract parameters in ``dtype``: ``template``'s, else a model traced now."""
    return split_params(template) if template is not None else abstract_params(part.make(cfg, dtype))


def _read_hf_part(
    model_dir: Path,
    arch: Architecture,
    part: ModelPart,
    cfg: Any,
    abstract: dict[FlaxPath, nnx.Variable],
    progress: bool,
    place: Callable[[FlaxPath, TensorReader], Any],
) -> dict[FlaxPath, Any]:
    """Stream ``part``'s tensors from an HF dir into its ``abstract`` parameters (checked by
    name and shape), each given to ``place`` (see :func:`~omni_jax.models.param_map.fill_params`).

    A mismatch names the file it was found in and points at ``config.json``, which is what
    the expected shapes come from.
    """
    cursor = _Cursor(checkpoint_files(model_dir))
    try:
        values = fill_params(
            abstract,
            _part_tensors(arch, part, cfg, progress, cursor),
            part.rules(cfg),
            place,
            ignore=part.ignore(cfg),
        )
    except ParamMismatchError as e:
        unlisted = unlisted_shards(model_dir) if isinstance(e, MissingParamsError) else []
        if unlisted:
            hint = f"; the index does not list {', '.join(unlisted)} in {model_dir}: is it out of date?"
        elif "a second time" in str(e):
            hint = ""
        else:
            hint = f"; does {model_dir / 'config.json'} match the weights?"
        raise ParamMismatchError(f"{cursor.where(model_dir)}: {e}{hint}") from e
    return values


def _restore_stage(
    model_dir: Path,
    stage: str,
    abstract: dict[FlaxPath, nnx.Variable],
    manifest: dict[str, Any],
    dtype: str,
    sharding: Layout | None,
) -> dict[FlaxPath, object]:
    """Read ``stage``'s Orbax checkpoint, each array straight into ``sharding`` (the default
    device without one), one array at a time (:func:`restore_stage`).

    First the stored arrays are held to the manifest (names, shapes, dtypes: a damaged or
    mixed-up converted dir), then the manifest to the model ``config.json`` describes. Both
    read only metadata; the arrays are read once, by the restore.
    """
    stage_dir = model_dir / "params" / stage
    recorded = manifest["shapes"].get(stage)
    if recorded is None:
        raise CheckpointError(f"{model_dir / MANIFEST}: corrupt manifest, no shapes of {stage!r}")
    dtypes = manifest.get("dtypes", {}).get(stage, {})  # absent in manifests written before dtypes
    _check_stored(stage_dir, stored_arrays(stage_dir), recorded, dtypes)
    shapes = {parse_path(k): tuple(v) for k, v in recorded.items()}
    for path, var in abstract.items():
        if path not in shapes:
            raise ParamMismatchError(
                f"{model_dir / MANIFEST}: converted checkpoint lacks {format_path(path)!r}, which the "
                f"model config.json describes needs; convert again"
            )
        if shapes[path] != tuple(var.shape):
            raise ParamMismatchError(
                f"{model_dir / MANIFEST}: {format_path(path)!r} is {shapes[path]} in the checkpoint, the "
                f"model config.json describes needs {tuple(var.shape)}"
            )
    extra = sorted(format_path(p) for p in shapes.keys() - abstract.keys())
    if extra:
        raise ParamMismatchError(
            f"{model_dir / MANIFEST}: tensor {extra[0]!r} of the checkpoint has no place in the model "
            "config.json describes"
        )
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        p: jax.ShapeDtypeStruct(
            v.shape, jnp.dtype(dtype), sharding=default if sharding is None else sharding(p, v.shape)
        )
        for p, v in abstract.items()
    }
    return restore_stage(stage_dir, target)


def _check_stored(
    stage_dir: Path,
    stored: dict[str, tuple[tuple[int, ...], str]],
    shapes: dict[str, list[int]],
    dtypes: dict[str, str],
) -> None:
    """``ParamMismatchError`` unless the arrays ``stage_dir`` stores are those the manifest
    records for it (``shapes`` and ``dtypes`` by name; a tensor without a dtype is not checked)."""
    for name, shape in shapes.items():
        if name not in stored:
            raise ParamMismatchError(f"{stage_dir}: tensor {name!r} listed in {MANIFEST} is not stored")
        got_shape, got_dtype = stored[name]
        if got_shape != tuple(shape):
            raise ParamMismatchError(
                f"{stage_dir}: tensor {name!r} is stored with shape {got_shape}, "
                f"{MANIFEST} records {tuple(shape)}"
            )
        if name in dtypes and got_dtype != dtypes[name]:
            raise ParamMismatchError(
                f"{stage_dir}: tensor {name!r} is stored as {got_dtype}, {MANIFEST} records {dtypes[name]}"
            )
    extra = sorted(stored.keys() - shapes.keys())
    if extra:
        raise ParamMismatchError(f"{stage_dir}: stored tensor {extra[0]!r} is not listed in {MANIFEST}")


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """HF checkpoint dir -> converted dir, written to a temp dir beside ``dst`` and renamed at the end.

    Each stage's tensors are checked (names, shapes) from the headers before any of it is
    written, then written to Orbax a bounded number at a time, each read from its memory map
    and cast on the way (:func:`~omni_jax.orbax_io.write_stage`): the model is never held
    whole in host memory. Every input is checked before anything is written (config,
    architecture, every weight file's header); a fault raises a ``ValueError`` (:class:`CheckpointError`,
    :class:`ParamMismatchError`, :class:`DestinationExistsError`) naming the file or tensor,
    and nothing is left at ``dst``. An existing ``dst`` is refused unless ``overwrite``, and
    even then only an earlier conversion (or an empty dir) is replaced, once the new one is
    complete.

    Interrupted (``KeyboardInterrupt``, any exception), it stops Orbax's writes (those in flight
    finish), removes the temp dir and re-raises. Called in the main thread, it also turns a
    SIGTERM whose disposition is the default (which would end the process at once, the temp
    dir left behind) into the same cleanup, after which the process ends by SIGTERM as it
    would have (:class:`~omni_jax.interrupts.Interrupts`). Temp dirs beside ``dst`` of earlier
    conversions whose process no longer runs (killed by SIGKILL) are removed first
    (:func:`_remove_stale_temporaries`).
    """
    with Interrupts() as interrupts:
        return _convert(Path(src), Path(dst), dtype, progress, overwrite, interrupts)


def _convert(
    src: Path, dst: Path, dtype: str | None, progress: bool, overwrite: bool, interrupts: Interrupts
) -> Path:
    """:func:`convert`, with ``interrupts`` to check between steps and to defer during cleanup."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    _check_destination(src, dst, overwrite)
    cfg = load_hf_config(src)
    if is_converted(src):
        raise CheckpointError(
            f"{src}: already converted (it has {MANIFEST}); pass the Hugging Face checkpoint"
        )
    arch = architecture(src, cfg)
    dtype = dtype or checkpoint_dtype(cfg, src)
    if dtype not in DTYPES:
        raise CheckpointError(f"{src / 'config.json'}: unsupported dtype {dtype!r} (convert with --dtype)")
    weights = checkpoint_files(src)
    count_tensors(weights)  # reads (checks) every safetensors header before any work
    converters = dict(arch.side_files)
    side = list(_side_files(src, converters))
    parts = [p for p in arch.parts if p.stage in arch.config_stages(cfg)]
    arch.warn_missing_files(src, [p.stage for p in parts])
    index = [f for f in [weights_source(src)] if f is not None and f.name in SHARD_INDEXES]
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dst)
    interrupts.check()
    tmp = _sibling(dst, "tmp")
    try:
        tmp.mkdir()
        sources = hash_files(src, sorted(set(weights + index + side)), progress)
        shapes: dict[str, dict[str, list[int]]] = {}
        dtypes: dict[str, dict[str, str]] = {}
        for part in parts:
            interrupts.check()
            part_dtype = part.dtype or dtype
            _, abstract = abstract_params(part.make(cfg, part_dtype))
            values = _read_hf_part(src, arch, part, cfg, abstract, False, _deferred(part_dtype))
            write_stage(tmp / "params" / part.stage, values, progress)
            shapes[part.stage] = {format_path(p): list(v.shape) for p, v in values.items()}
            dtypes[part.stage] = {format_path(p): str(v.dtype) for p, v in values.items()}
            _check_written(dst, tmp / "params" / part.stage, shapes[part.stage], dtypes[part.stage])
        for f in side:
            if f.name in converters:
                try:
                    converters[f.name](f, tmp)
                except Exception as e:
                    raise CheckpointError(f"{f}: cannot convert ({first_line(e)})") from e
            else:
                shutil.copy2(f, tmp / f.name)
        manifest = {
            "format": FORMAT_VERSION,
            "architecture": arch.name,
            "dtype": dtype,
            "stages": [p.stage for p in parts],
            "unserved": [stage for stage, _ in arch.unserved],
            "shapes": shapes,
            "dtypes": dtypes,
            "sources": sources,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        interrupts.check()
        old = _replace(tmp, dst, overwrite)
    except BaseException:
        # write_stage has returned or raised, so nothing writes into tmp any more.
        with interrupts.deferred():
            _remove_tree(tmp)
        raise
    if old is not None:  # a Ctrl-C now would leave part of the replaced conversion behind
        with interrupts.deferred():
            shutil.rmtree(old, ignore_errors=True)
    return dst


def _remove_tree(path: Path) -> None:
    """Remove ``path`` (a temp dir of ours), warning of what could not be removed: called while
    another exception propagates, which an ``OSError`` here must not replace."""
    failures: list[str] = []

    def failed(name: str, error: BaseException) -> None:
        if not isinstance(error, FileNotFoundError):  # gone already
            failures.append(f"{name} ({first_line(error)})")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda function, name, error: failed(name, error))
    else:
        shutil.rmtree(path, onerror=lambda function, name, info: failed(name, info[1]))
    if failures:
        warnings.warn(f"could not remove the temporary {path}: {failures[0]}", stacklevel=3)


def _remove_stale_temporaries(dst: Path) -> None:
    """Remove the temp dirs beside ``dst`` (``.DST.tmp-PID-*``) of conversions whose process no
    longer runs: one killed outright (SIGKILL, out of memory) had no chance to clean up. A dir
    whose PID runs is kept (another conversion to ``dst`` under way, or a PID reused since).
    PIDs are this host's: a conversion to the same ``dst`` from another host or PID namespace
    (a shared filesystem) would look dead. ``.DST.old-*`` dirs are never touched: a kill during
    ``--overwrite``'s two renames leaves the earlier conversion there."""
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
    for path in dst.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_dir() or _pid_runs(int(match.group(1))):
            continue
        _remove_tree(path)


def _pid_runs(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (``os.kill(pid, 0)``: no signal is sent)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _deferred(dtype: str) -> Callable[[FlaxPath, TensorReader], DeferredArray]:
    """``place`` for conversion: each parameter written later, read and cast to ``dtype`` then."""
    target = np.dtype(jnp.dtype(dtype))
    return lambda path, read: DeferredArray(read, tuple(read().shape), target)


GLOB_MAGIC = re.compile(r"\\|\[[^\]]*\]")
"""What Orbax's writer, which globs its directory's path, does not read literally: a backslash
or a bracketed class (``a[1]``)."""


def _check_written(dst: Path, stage_dir: Path, shapes: dict[str, list[int]], dtypes: dict[str, str]) -> None:
    """``CheckpointError`` unless ``stage_dir`` holds the stage as written: Orbax's save can end
    without error having written part of it (its merge step skipped), a conversion that would
    report success and fail at load."""
    try:
        _check_stored(stage_dir, stored_arrays(stage_dir), shapes, dtypes)
    except (CheckpointError, ParamMismatchError) as e:
        raise CheckpointError(
            f"converting to {dst}: stage {stage_dir.name!r} was not written whole ({e})"
        ) from e


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if GLOB_MAGIC.search(str(dst.absolute())):
        raise ValueError(
            f"destination {dst}: Orbax reads the path as a glob pattern (a backslash or '[...]' is not "
            "taken literally) and would write an incomplete checkpoint; pick a path without them"
        )
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise DestinationExistsError(
            f"destination {dst} already exists; remove it, pick another path or pass --overwrite "
            "(overwrite=True)"
        )
    if not dst.is_dir() or dst.is_symlink() or (any(dst.iterdir()) and not is_converted(dst)):
        raise DestinationExistsError(
            f"destination {dst} exists and is not a converted checkpoint; refusing to replace it"
        )
    s, d = src.resolve(), dst.resolve()
    if s == d or d in s.parents:
        raise DestinationExistsError(f"destination {dst} holds the source {src}; refusing to replace it")


def _replace(tmp: Path, dst: Path, overwrite: bool) -> Path | None:
    """Move the finished ``tmp`` to ``dst``; an old ``dst`` (``overwrite``) is moved aside, and
    its new place returned for the caller to remove (``None`` when there was none)."""
    if not (dst.exists() or dst.is_symlink()):
        tmp.rename(dst)  # fails if a non-empty dst appeared since the check
        return None
    _check_destination(tmp, dst, overwrite)
    old = _sibling(dst, "old")
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    return old


def _sibling(dst: Path, kind: str) -> Path:
    """A hidden unused name beside ``dst`` (same filesystem, so renames are atomic)."""
    return dst.parent / f".{dst.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def hash_files(root: Path, files: list[Path], progress: bool = False) -> dict[str, dict[str, Any]]:
    """``{name relative to root: {"sha256", "bytes"}}``, each file streamed in chunks."""
    total = sum(f.stat().st_size for f in files)
    out: dict[str, dict[str, Any]] = {}
    with tqdm(total=total, desc="hashing sources", unit="B", unit_scale=True, disable=not progress) as bar:
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(HASH_CHUNK):
                    h.update(chunk)
                    bar.update(len(chunk))
            out[f.relative_to(root).as_posix()] = {"sha256": h.hexdigest(), "bytes": f.stat().st_size}
    return out


def check_sources(src: str | Path, dst: str | Path, progress: bool = False) -> list[str]:
    """Source files of ``dst`` (per its manifest) that differ in ``src`` or are missing there
    (empty: ``dst`` was converted from these exact files). Re-hashes ``src``."""
    src, dst = Path(src), Path(dst)
    recorded = read_manifest(dst).get("sources")
    if not recorded:
        raise CheckpointError(f"{dst / MANIFEST}: records no source hashes (converted by an older version)")
    present = [src / name for name in recorded if (src / name).is_file()]
    now = hash_files(src, present, progress)
    return [
        name if name in now else f"{name} (missing)"
        for name, rec in recorded.items()
        if now.get(name, {}).get("sha256") != rec["sha256"]
    ]


def _side_files(src: Path, converted: Iterable[str]) -> Iterable[Path]:
    """Config, tokenizer and processor files, and those the architecture converts (speakers);
    ``CheckpointError`` for one that is a broken link (:func:`check_link`)."""
    converted = set(converted)
    for f in sorted(src.iterdir()):
        if f.name in SHARD_INDEXES or not (f.suffix in SIDE_FILE_SUFFIXES or f.name in converted):
            continue
        check_link(f)
        if f.is_file():
            yield f
