"""Streaming, torch-free reads of HF checkpoint tensors.

safetensors' numpy backend cannot represent bfloat16, the dtype most real checkpoints ship
in, so the file format (an 8-byte header length, a JSON header, raw little-endian data) is
read here directly into ``np.memmap`` arrays with ``ml_dtypes`` dtypes: zero-copy, one tensor
at a time, never the whole model. Each tensor is mapped on its own (:meth:`StoredTensor.read`),
so the pages a reader touched leave the process's resident set as soon as it drops the array;
one mapping of a whole shard would keep every page read so far resident until the shard ends
(several GB with a real checkpoint's shards). ``pytorch_model*.bin`` checkpoints need torch and
are read through it when it is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint file is unreadable; the message names the file (and tensor)."""


def check_link(path: Path) -> None:
    """``CheckpointError`` when ``path`` is a broken link (a hub cache's snapshot whose blob is
    missing, an interrupted download): read as absent, the file would be skipped without a word,
    or another form of the weights read in its place."""
    if path.is_symlink() and not path.exists():
        target = os.readlink(path)
        raise CheckpointError(f"{path}: a broken link (to {target}); download the checkpoint again")


def first_line(e: BaseException) -> str:
    """A foreign exception's message cut to its first non-empty line (errors here are one line)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(data offset, {name: {dtype, shape, data_offsets}})`` of one safetensors file.

    Every tensor's entry is checked against the file: a truncated file, a header that is not
    the format's JSON, or a tensor whose bytes do not fit its shape raise :class:`CheckpointError`
    naming the file (and tensor), before any tensor is read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors file (header length {n} > file size {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)"
        )
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        _check_entry(path, name, info)
        begin, end = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
        if end - begin != want:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {want}")
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated file, tensor {name!r} ends past the end of the file")
    return data_start, header


def _check_entry(path: Path, name: str, info: object) -> None:
    """One header entry: ``{"dtype": known, "shape": [n >= 0, ...], "data_offsets": [b, e]}``."""

    def ints(x: object) -> bool:
        return isinstance(x, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x
        )

    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header, tensor {name!r} has no entry")
    if info.get("dtype") not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    if not ints(info.get("shape")):
        raise CheckpointError(
            f"{path}: corrupt safetensors header, tensor {name!r} has shape {info.get('shape')!r}"
        )
    offsets = info.get("data_offsets")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(
            f"{path}: corrupt safetensors header, tensor {name!r} has data_offsets {offsets!r}"
        )


TensorReader = Callable[[], np.ndarray]
"""Maps one checkpoint tensor when called: the array reads the file only where it is touched."""


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file (checked by :func:`read_header`)."""

    file: Path
    offset: int  # of the tensor's first byte in the file
    dtype: np.dtype
    shape: tuple[int, ...]

    def read(self) -> np.ndarray:
        """A read-only ``np.memmap`` of this tensor alone (its own mapping, see the module doc)."""
        n = math.prod(self.shape)
        if n == 0:  # an empty mapping is an error; there is nothing to read
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=(n,)).reshape(
            self.shape
        )


def stored_tensors(path: Path) -> list[tuple[str, StoredTensor]]:
    """``(name, where its bytes are)`` for every tensor of one file, in file order; reads only the header."""
    data_start, header = read_header(path)
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        offset = data_start + info["data_offsets"][0]
        out.append((name, StoredTensor(path, offset, np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"]))))
    return out


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, read-only memmap)`` for every tensor of one file, in file order, each mapped alone."""
    for name, tensor in stored_tensors(path):
        yield name, tensor.read()


def tensor_readers(path: Path) -> Iterator[tuple[str, TensorReader]]:
    """``(name, reader)`` for every tensor of one weight file, in file order: safetensors tensors
    are mapped only when their reader is called; a ``.bin`` file is loaded by torch (memory-mapped)."""
    if path.suffix == ".safetensors":
        for name, tensor in stored_tensors(path):
            yield name, tensor.read
    else:
        for name, array in iter_torch_bin(path):
            yield name, lambda array=array: array


WEIGHT_SOURCES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""Where an HF checkpoint dir's weights are, in transformers' order: the first present is read
(a dir holding a single file and a stale index, or safetensors beside ``.bin`` shards, gives
the weights transformers loads)."""
SHARD_INDEXES = tuple(name for name in WEIGHT_SOURCES if name.endswith(".index.json"))


def weights_source(model_dir: Path) -> Path | None:
    """The first of :data:`WEIGHT_SOURCES` in ``model_dir``: a weight file or a shard index
    (``None``: none, e.g. a dir of ``config.json`` alone); ``CheckpointError`` for a broken link
    met before it."""
    for name in WEIGHT_SOURCES:
        path = model_dir / name
        check_link(path)
        if path.exists():
            return path
    return None


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF checkpoint dir, sharded (with an index) or single
    (:func:`weights_source`)."""
    source = weights_source(model_dir)
    if source is None:
        raise CheckpointError(f"{model_dir}: no model.safetensors, pytorch_model.bin or shard index found")
    files = _listed_files(source)
    for f in files:
        check_link(f)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{source}: lists shard(s) that do not exist: {', '.join(missing)}")
    return files


def _listed_files(source: Path) -> list[Path]:
    """The weight files ``source`` (a :func:`weights_source`) stands for, in name order: itself,
    or the shards its index lists, whether or not they are there."""
    if source.name not in SHARD_INDEXES:
        return [source]
    try:
        weight_map = json.loads(source.read_text())["weight_map"]
        return sorted({source.parent / f for f in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{source}: corrupt shard index ({type(e).__name__}: {first_line(e)})") from e


def unlisted_shards(model_dir: Path) -> list[str]:
    """Names of the shards (``<name>-00003-of-00004.<ext>``) in ``model_dir`` beside a shard
    index that does not list them (an index left from an earlier save): their tensors are never
    read. Other weight files a repo ships (``training_args.bin``, an adapter) are not shards."""
    source = weights_source(model_dir)
    if source is None or source.name not in SHARD_INDEXES:
        return []
    suffix = source.name.removesuffix(".index.json").rsplit(".", 1)[1]
    listed = set(_listed_files(source))
    shard = re.compile(rf".+-\d+-of-\d+\.{suffix}")
    return sorted(
        f.name for f in model_dir.glob(f"*.{suffix}") if f not in listed and shard.fullmatch(f.name)
    )


def stored_dtype(model_dir: Path) -> str | None:
    """The dtype of the first floating-point tensor of the checkpoint's first weight file (in
    name order for safetensors, stored order for ``.bin``), as transformers' ``dtype="auto"``
    reads a checkpoint whose config names none. ``None`` when that file cannot tell without
    being downloaded or without torch, or an index lists no file (``omni-jax plan`` reads
    ``config.json`` alone, perhaps before the weights are there); ``CheckpointError`` for a weight
    file that is a broken link (:func:`weights_source`), a download begun and not finished."""
    source = weights_source(model_dir)
    files = [] if source is None else _listed_files(source)
    if not files or not files[0].exists():
        return None
    first = files[0]
    if first.suffix == ".safetensors":
        header = read_header(first)[1]
        kinds = (header[name]["dtype"] for name in sorted(header))
        return next((str(np.dtype(_DTYPES[k])) for k in kinds if k.startswith(("F", "BF"))), None)
    if importlib.util.find_spec("torch") is None:
        return None
    arrays = (array for _, array in iter_torch_bin(first))
    return next((str(a.dtype) for a in arrays if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16), None)


def count_tensors(files: list[Path]) -> int | None:
    """Tensor count for progress bars (``None`` when only torch could tell)."""
    if any(f.suffix != ".safetensors" for f in files):
        return None
    return sum(len(read_header(f)[1]) for f in files)


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of an HF checkpoint dir, one at a time."""
    for f in checkpoint_files(model_dir):
        if f.suffix == ".safetensors":
            yield from iter_safetensors(f)
        else:
            yield from iter_torch_bin(f)


def iter_torch_bin(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(f"{path}: .bin checkpoints need torch (pip install 'omni-jax[torch]')") from e
    try:  # only zip-format files map; older pickles (``_use_new_zipfile_serialization=False``) load whole
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # torch raises many kinds (RuntimeError, UnpicklingError, EOFError...)
        raise CheckpointError(f"{path}: unreadable PyTorch checkpoint ({first_line(e)})") from e
    for name, t in state.items():
        if t.dtype == torch.bfloat16:
            yield name, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            yield name, t.numpy()
