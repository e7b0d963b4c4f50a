"""Checkpoint formats: HF dirs (converted in memory) and our converted Orbax dirs.

A converted dir holds ``omni_jax.json`` (a manifest: architecture, dtype, stages, every
parameter's shape), ``params/<stage>/`` (one Orbax OCDBT checkpoint per stage, so a
pipeline that builds one stage reads one stage) and the HF side files (config, tokenizer,
processor, generation config) copied verbatim, except those the architecture rewrites
torch-free (Qwen2.5-Omni's ``spk_dict.pt`` becomes ``speakers.safetensors`` + ``speakers.json``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from omni_jax.models.loading import abstract_params, merge_params
from omni_jax.models.param_map import (
    FlaxPath,
    ParamMismatchError,
    fill_params,
    format_path,
    map_name,
    parse_path,
)
from omni_jax.models.registry import Architecture, ModelPart, architecture_of
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import Layout, layout, put
from omni_jax.safetensors_io import checkpoint_files, count_tensors, iter_checkpoint

MANIFEST = "omni_jax.json"
FORMAT_VERSION = 1
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def load_hf_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def is_converted(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).exists()


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    manifest = json.loads((Path(model_dir) / MANIFEST).read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{model_dir}: converted with format {manifest.get('format')}, expected {FORMAT_VERSION}"
        )
    return manifest


def checkpoint_dtype(hf_config: Any) -> str:
    """The dtype the checkpoint declares (``dtype`` / ``torch_dtype``), float32 if none."""
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    return str(d).removeprefix("torch.")


def _part_tensors(
    model_dir: Path, arch: Architecture, part: ModelPart, cfg: Any, progress: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors of ``part``; those of other parts (served or not yet, or that another part drops)
    are skipped, strays are errors."""
    rules = part.rules(cfg)
    others = [r for p in arch.parts if p is not part for r in p.rules(cfg)]
    dropped = [re.compile(x) for p in arch.parts if p is not part for x in p.ignore(cfg)]
    total = count_tensors(checkpoint_files(model_dir))
    bar = tqdm(total=total, desc=f"loading {part.stage}", unit="tensor", disable=not progress)
    with bar:
        for name, array in iter_checkpoint(model_dir):
            bar.update(1)
            if map_name(rules, name) is None and (
                arch.is_unserved_tensor(name)
                or map_name(others, name) is not None
                or any(d.fullmatch(name) for d in dropped)
            ):
                continue
            yield name, array


def load_part(
    model_dir: str | Path,
    stage: str,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    progress: bool = False,
) -> tuple[nnx.Module, Any]:
    """Build the ``stage`` model from an HF dir or a converted dir; returns ``(model, hf_config)``.

    The model is built abstractly and each tensor placed as it is read, so the full model
    never exists twice. With ``mesh``, every tensor goes straight into its shards under the
    part's partition rules (HF tensors one by one as converted, Orbax restored directly
    into the target layout), so no device ever holds more than its share.
    """
    model_dir = Path(model_dir)
    cfg = load_hf_config(model_dir)
    arch = architecture_of(cfg)
    part = arch.part(stage)
    sharding = None if mesh is None else layout(part.shard_rules(cfg, axis_size(mesh, "model")), mesh)
    if is_converted(model_dir):
        manifest = read_manifest(model_dir)
        if stage not in manifest["stages"]:
            raise ValueError(
                f"{model_dir}: converted without stage {stage!r} (it has {manifest['stages']}); "
                "convert the HF checkpoint again"
            )
        dtype = part.dtype or dtype or manifest["dtype"]
        graphdef, abstract = abstract_params(part.make(cfg, dtype))
        values = _restore_stage(model_dir, stage, abstract, manifest, dtype, sharding)
    else:
        dtype = part.dtype or dtype or checkpoint_dtype(cfg)
        place = None if sharding is None else lambda path, x: put(x, sharding(path, x.shape))
        graphdef, abstract, values = _read_hf_part(model_dir, arch, part, cfg, dtype, progress, place)
    return merge_params(graphdef, abstract, values), cfg


def _read_hf_part(
    model_dir: Path,
    arch: Architecture,
    part: ModelPart,
    cfg: Any,
    dtype: str,
    progress: bool,
    place: Callable[[FlaxPath, np.ndarray], object] | None = None,
) -> tuple[nnx.GraphDef, dict[FlaxPath, nnx.Variable], dict[FlaxPath, object]]:
    """Stream ``part``'s tensors from an HF dir into its parameters (checked by name and shape)."""
    graphdef, abstract = abstract_params(part.make(cfg, dtype))
    values = fill_params(
        abstract,
        _part_tensors(model_dir, arch, part, cfg, progress),
        part.rules(cfg),
        dtype=jnp.dtype(dtype),
        ignore=part.ignore(cfg),
        place=place,
    )
    return graphdef, abstract, values


def _nest(flat: dict[FlaxPath, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def _restore_stage(
    model_dir: Path,
    stage: str,
    abstract: dict[FlaxPath, nnx.Variable],
    manifest: dict[str, Any],
    dtype: str,
    sharding: Layout | None,
) -> dict[FlaxPath, object]:
    """Read ``stage``'s Orbax checkpoint, each array straight into ``sharding`` when given."""
    import orbax.checkpoint as ocp

    shapes = {parse_path(k): tuple(v) for k, v in manifest["shapes"][stage].items()}
    for path, var in abstract.items():
        if path not in shapes:
            raise ParamMismatchError(f"{model_dir}: converted checkpoint lacks {format_path(path)!r}")
        if shapes[path] != tuple(var.shape):
            raise ParamMismatchError(
                f"{model_dir}: {format_path(path)!r} is {shapes[path]} in the checkpoint, the model needs "
                f"{tuple(var.shape)}"
            )
    target = _nest(
        {
            p: jax.ShapeDtypeStruct(v.shape, jnp.dtype(dtype), sharding=sharding and sharding(p, v.shape))
            for p, v in abstract.items()
        }
    )
    restored = ocp.StandardCheckpointer().restore((model_dir / "params" / stage).absolute(), target)
    out = {}
    for path in abstract:
        node: Any = restored
        for key in path:
            node = node[str(key)]
        out[path] = node
    return out


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, progress: bool = True) -> Path:
    """HF checkpoint dir -> converted dir, written to a temp dir and renamed at the end."""
    import orbax.checkpoint as ocp

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"destination {dst} already exists; remove it or pick another path")
    cfg = load_hf_config(src)
    arch = architecture_of(cfg)
    dtype = dtype or checkpoint_dtype(cfg)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        shapes: dict[str, dict[str, list[int]]] = {}
        for part in arch.parts:
            _, _, values = _read_hf_part(src, arch, part, cfg, part.dtype or dtype, progress)
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save((tmp / "params" / part.stage).absolute(), _nest(values))
            checkpointer.wait_until_finished()
            shapes[part.stage] = {format_path(p): list(np.shape(v)) for p, v in values.items()}
            del values
        converters = dict(arch.side_files)
        for f in _side_files(src, converters):
            if f.name in converters:
                converters[f.name](f, tmp)
            else:
                shutil.copy2(f, tmp / f.name)
        manifest = {
            "format": FORMAT_VERSION,
            "architecture": arch.name,
            "dtype": dtype,
            "stages": [p.stage for p in arch.parts],
            "unserved": [stage for stage, _ in arch.unserved],
            "shapes": shapes,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _side_files(src: Path, converted: Iterable[str]) -> Iterable[Path]:
    """Config, tokenizer and processor files, and those the architecture converts (speakers)."""
    converted = set(converted)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in WEIGHT_FILES:
            continue
        if f.suffix in SIDE_FILE_SUFFIXES or f.name in converted:
            yield f
