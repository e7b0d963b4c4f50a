"""One stage's parameters as an Orbax (OCDBT) checkpoint, written and read a bounded amount at a time.

Orbax's save takes the whole pytree at once, and its numpy handler deep-copies every array
before writing them all concurrently: given a converted model, that is the model in host
memory two or three times over. Here each leaf of the saved tree is a :class:`DeferredArray`
(shape and dtype known, nothing read yet), and a numpy handler makes each array only when its
turn to be written comes, holding at most :func:`in_flight_budget` bytes at once. What it
writes is what Orbax's numpy handler writes (same ``_METADATA``, same arrays), so
``ocp.StandardCheckpointer`` restores it like any other checkpoint.

Reading places one array at a time, each device's shard read on its own (:func:`restore_stage`).

Arrays are stored in chunks of at most :data:`CHUNK_BYTES`, so a device that holds a shard of
a large array reads (and decompresses) about its shard, not the whole array.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from omni_jax.models.param_map import FlaxPath, format_path
from omni_jax.parallel.rules import put_cast
from omni_jax.safetensors_io import CheckpointError, TensorReader, first_line

MAX_IN_FLIGHT_BYTES = 1 << 30
IN_FLIGHT_SHARE = 8
"""At most ``1 / IN_FLIGHT_SHARE`` of a stage's bytes (and never over ``MAX_IN_FLIGHT_BYTES``)
are read but not yet written, except that the largest array always fits."""

CHUNK_BYTES = 16 << 20
READ_THREADS = 4
"""Arrays are stored in chunks of at most ``CHUNK_BYTES`` and read by at most ``READ_THREADS``
file threads: each thread's malloc arena keeps the largest chunk it has read after freeing it,
so these two bound what reading leaves behind on the host."""


def in_flight_budget(sizes: Iterable[int]) -> int:
    """Bytes a stage's arrays of ``sizes`` bytes may have in flight at once (see :data:`IN_FLIGHT_SHARE`)."""
    sizes = list(sizes)
    return max(max(sizes, default=0), min(sum(sizes) // IN_FLIGHT_SHARE, MAX_IN_FLIGHT_BYTES))


@dataclasses.dataclass
class DeferredArray:
    """A parameter to write: ``read`` gives its values (a view of the source, e.g. a transposed
    memory-mapped tensor) when it is written; they are cast to ``dtype`` then."""

    read: TensorReader
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def materialize(self) -> np.ndarray:
        return np.asarray(self.read(), dtype=self.dtype, order="C")


class _Budget:
    """Bytes held by writes in progress, at most ``limit`` (one array larger than that runs alone)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free = limit
        self._cv: asyncio.Condition | None = None  # made in the loop Orbax writes from

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        nbytes = min(nbytes, self.limit)
        self._cv = self._cv or asyncio.Condition()
        async with self._cv:
            await self._cv.wait_for(lambda: self.free >= nbytes)
            self.free -= nbytes
        try:
            yield
        finally:
            async with self._cv:
                self.free += nbytes
                self._cv.notify_all()


def _handler(budget: int, written: Callable[[], None]) -> Any:
    """Orbax's numpy handler, writing :class:`DeferredArray` leaves each when its turn comes.

    The hook is the handler's ``_open_and_write`` (one leaf's TensorStore write), which Orbax
    does not document: a change there fails every conversion test rather than silently copying.
    """
    import inspect

    import orbax.checkpoint as ocp

    # Orbax 0.12.5 and newer take ``deepcopy_host_arrays``: its copy of each value before the
    # write guards against arrays changed while written, and these are made here, for the write
    # alone, so there is nothing to copy. Older Orbax always deep-copies, which here copies only
    # each DeferredArray's reader, shape and dtype (a function copies by reference), not an array.
    no_copy: dict[str, bool] = {}
    if "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler).parameters:
        no_copy["deepcopy_host_arrays"] = False

    class DeferredHandler(ocp.type_handlers.NumpyHandler):
        def __init__(self) -> None:
            super().__init__(**no_copy)
            self._budget = _Budget(budget)

        async def _open_and_write(self, value: DeferredArray, tspec: dict[str, Any], ts_context: Any) -> None:
            async with self._budget.hold(value.nbytes):
                await super()._open_and_write(value.materialize(), tspec, ts_context)
            written()

    return DeferredHandler()


def _nest(flat: dict[FlaxPath, Any]) -> dict[str, Any]:
    """``{path: leaf}`` as the nested dict Orbax stores (keys as strings)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def write_stage(stage_dir: Path, values: dict[FlaxPath, DeferredArray], progress: bool = False) -> None:
    """Write one stage's parameters to ``stage_dir`` (which must not exist), a bounded number of
    bytes at a time (see the module docstring)."""
    import orbax.checkpoint as ocp

    budget = in_flight_budget(v.nbytes for v in values.values())
    bar = tqdm(total=len(values), desc=f"writing {stage_dir.name}", unit="tensor", disable=not progress)
    with bar:
        registry = ocp.type_handlers.create_type_handler_registry(
            (DeferredArray, _handler(budget, lambda: bar.update(1))),
            (jax.Array, ocp.type_handlers.ArrayHandler()),  # unused; Orbax warns without one
        )
        tree = _nest(values)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
        checkpointer.save(stage_dir.absolute(), args=ocp.args.PyTreeSave(tree, save_args=save_args))


def stored_arrays(stage_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted path: (shape, dtype)}`` of the arrays in one stage's Orbax checkpoint (metadata only)."""
    import orbax.checkpoint as ocp

    if not stage_dir.is_dir():
        raise CheckpointError(f"{stage_dir}: missing; the converted checkpoint is incomplete, convert again")
    try:
        meta = ocp.StandardCheckpointer().metadata(stage_dir.absolute())
        tree = getattr(meta, "item_metadata", meta)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    except Exception as e:  # orbax raises several kinds on a damaged checkpoint
        raise CheckpointError(f"{stage_dir}: unreadable Orbax checkpoint ({first_line(e)})") from e
    out = {}
    for keys, leaf in leaves:
        name = ".".join(str(getattr(k, "key", k)) for k in keys)
        out[name] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return out


class _StoredArray:
    """One array of an Orbax checkpoint as something :func:`put_cast` slices: each slice is read
    (and decompressed) on its own, into a buffer this thread allocates and frees."""

    def __init__(self, store: Any):
        self._store = store
        self.shape = tuple(store.shape)
        self.dtype = np.dtype(store.dtype.numpy_dtype)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        import tensorstore as ts

        region = self._store[index]
        out = np.empty(tuple(region.shape), self.dtype)
        ts.array(out).write(region).result()
        return out


def restore_stage(stage_dir: Path, target: dict[FlaxPath, jax.ShapeDtypeStruct]) -> dict[FlaxPath, jax.Array]:
    """Every array of ``stage_dir`` in ``target``'s dtype and sharding, one at a time, each
    device's shard read on its own and cast on the way (:func:`put_cast`).

    The arrays are opened with Orbax's own TensorStore specs and read here rather than by
    Orbax's restore, which reads every array at once (unless limited) on its own threads and
    places them from there: the buffers it frees stay in those threads' malloc arenas,
    interleaved with the placed arrays, so the host keeps a large part of a second copy.
    """
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    context = ocp.type_handlers.get_ts_context(use_ocdbt=True, file_io_concurrency_limit=READ_THREADS)
    parent = epath.Path(stage_dir.absolute())
    out = {}
    for path, want in target.items():
        name = format_path(path)
        info = ocp.type_handlers.ParamInfo(
            name=name, parent_dir=parent, is_ocdbt_checkpoint=True, ts_context=context
        )
        try:
            store = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True), context=context)
            out[path] = put_cast(_StoredArray(store.result()), want.sharding, want.dtype)
        except ValueError as e:  # tensorstore's errors on missing or damaged data
            raise CheckpointError(f"{stage_dir}: cannot read tensor {name!r} ({first_line(e)})") from e
    return out
