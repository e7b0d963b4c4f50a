"""One stage's parameters as an Orbax (OCDBT) checkpoint, written and read a bounded amount at a time.

Orbax's save takes the whole pytree at once, and its numpy handler deep-copies every array
before writing them all concurrently: given a converted model, that is the model in host
memory two or three times over. Here each leaf of the saved tree is a :class:`DeferredArray`
(shape and dtype known, nothing read yet), and a numpy handler makes each array only when its
turn to be written comes, holding at most :func:`in_flight_budget` bytes at once. What it
writes is what Orbax's numpy handler writes (same ``_METADATA``, same arrays), so
``ocp.StandardCheckpointer`` restores it like any other checkpoint.

A write is stopped cleanly: Orbax writes from threads of its own, which an exception in the
caller's thread (Ctrl-C) does not stop, so :func:`write_stage` runs the save in a thread of its
own and, when the caller is interrupted, skips the arrays not yet begun and waits for Orbax to
end before it re-raises; a failed array ends the save the same way, then raises. When
:func:`write_stage` returns or raises, nothing writes into its directory any more, so the
caller may remove it.

Reading places one array at a time, each device's shard read on its own (:func:`restore_stage`).

Arrays are stored in chunks of at most :data:`CHUNK_BYTES`, so a device that holds a shard of
a large array reads (and decompresses) about its shard, not the whole array.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from omni_jax.host_copy import contiguous
from omni_jax.models.param_map import FlaxPath, format_path
from omni_jax.parallel.rules import put_cast
from omni_jax.safetensors_io import CheckpointError, TensorReader, first_line

MAX_IN_FLIGHT_BYTES = 1 << 30
IN_FLIGHT_SHARE = 8
"""At most ``1 / IN_FLIGHT_SHARE`` of a stage's bytes (and never over ``MAX_IN_FLIGHT_BYTES``)
are read but not yet written, except that the largest array always fits."""

WAIT_SECONDS = 0.1
"""How often :func:`write_stage`'s waiting thread wakes to run a signal's handler."""

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
        return contiguous(self.read(), self.dtype)


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


class _Stop:
    """Whether the arrays not yet begun are to be skipped, and why: the caller stopped the write
    (:meth:`cancel`) or an array's write failed (:attr:`error`, raised once Orbax has ended).

    Orbax gathers the arrays' writes without stopping the others when one fails, and abandons
    them in flight (TensorStore may still write them after its save has raised); skipping the
    rest instead lets the save end normally, after the writes in flight, with no thread left."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Exception | None = None

    def cancel(self) -> None:
        self._event.set()

    def fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._event.set()

    @property
    def stopped(self) -> bool:
        return self._event.is_set()


def _handler(budget: int, written: Callable[[], None], stop: _Stop) -> Any:
    """Orbax's numpy handler, writing :class:`DeferredArray` leaves each when its turn comes;
    once ``stop`` is set, the arrays not yet begun are skipped (see :class:`_Stop`).

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
                if stop.stopped:
                    return
                try:
                    await super()._open_and_write(value.materialize(), tspec, ts_context)
                except Exception as e:  # kept in ``stop`` and raised by write_stage once Orbax has ended
                    stop.fail(e)
                    return
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
    bytes at a time (see the module docstring).

    Orbax's save runs in a thread of its own while this one waits. An exception raised in this
    thread meanwhile (``KeyboardInterrupt`` from Ctrl-C, or what another signal handler raises)
    stops the save: the arrays not yet begun are skipped, the writes in flight (at most
    :func:`in_flight_budget` bytes) finish and Orbax's threads end, then the exception
    propagates; further interrupts during that wait do not cut it short. An array that fails to
    be read or written ends the save the same way and its exception is raised. Either way no
    thread writes into ``stage_dir`` once this returns or raises.
    """
    stop = _Stop()
    outcome: list[BaseException] = []
    ended = threading.Event()
    held: set[signal.Signals] | None = None

    def save() -> None:
        try:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # as the caller had them
            _save(stage_dir, values, progress, stop)
        except BaseException as e:  # handed to the waiting thread, which raises it
            outcome.append(e)
        finally:
            ended.set()

    # Waited for with an Event, not Thread.join: on Python 3.11 a join that a signal handler
    # interrupts marks the thread as ended while it still runs (CPython bpo-45274's fix). The
    # wait wakes every WAIT_SECONDS: a signal the kernel gave another thread does not interrupt
    # it, and Python runs the handler only when this thread runs again.
    worker = threading.Thread(target=save, name=f"write_stage {stage_dir.name}")
    held = _held_signals()
    try:
        try:
            worker.start()
        finally:
            if held is not None:  # a signal held back is handled here, the thread started
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        while not ended.wait(WAIT_SECONDS):
            pass
    except BaseException:
        stop.cancel()
        if worker.ident is not None:  # started (it is, unless start itself failed)
            _wait_to_the_end(ended)
        raise
    worker.join()
    if stop.error is not None:
        raise stop.error
    if outcome:
        raise outcome[0]


def _held_signals() -> set[signal.Signals] | None:
    """Hold SIGINT and SIGTERM back (in the main thread, where Python runs their handlers) until
    the writing thread has started, so that an interrupt cannot leave it started but unknown
    (an exception inside ``Thread.start``); returns the mask to restore, ``None`` if nothing
    was held."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _wait_to_the_end(ended: threading.Event) -> None:
    """Wait for ``ended``, whatever interrupts arrive meanwhile: the exception that stopped the
    write is already propagating, and its directory must not be removed (or the process end)
    while Orbax still writes into it. The wait is short: the arrays not yet begun are skipped."""
    while not ended.is_set():
        try:
            ended.wait(WAIT_SECONDS)
        except BaseException:  # a further Ctrl-C: the first one propagates after the wait
            continue


def _save(stage_dir: Path, values: dict[FlaxPath, DeferredArray], progress: bool, stop: _Stop) -> None:
    """Orbax's save of ``values`` to ``stage_dir``, each array skipped once ``stop`` is set; it
    returns once Orbax's threads have ended (the caller knows whether it stopped the save)."""
    import orbax.checkpoint as ocp

    budget = in_flight_budget(v.nbytes for v in values.values())
    bar = tqdm(total=len(values), desc=f"writing {stage_dir.name}", unit="tensor", disable=not progress)
    with bar:
        registry = ocp.type_handlers.create_type_handler_registry(
            (DeferredArray, _handler(budget, lambda: bar.update(1), stop)),
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
