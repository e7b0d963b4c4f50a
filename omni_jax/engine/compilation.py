"""XLA compilation: the persistent cache for warm starts, programs compiled side by side at
warm-up, and a counter that proves "compile once" (the static handle for a module's graph is
:class:`omni_jax.jit.StaticGraph`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import jax
from jax import monitoring
from jax.sharding import Mesh

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"  # a persistent-cache hit's, recorded
# in the loading thread just before its _COMPILE_EVENT: JAX times compiling or loading a program as
# one backend compilation
ENV_CACHE_DIR = "OMNI_JAX_COMPILATION_CACHE"
MAX_COMPILE_THREADS = 8
"""Most programs :func:`compile_ahead` compiles at once: each compilation holds its own
working memory on the host (a large program's, at real widths, a gigabyte or so)."""


def enable_persistent_cache(path: str | Path | None | bool = None) -> Path | None:
    """Point JAX's persistent compilation cache at ``path`` (default ``~/.cache/omni_jax/xla``).

    ``False`` (or ``OMNI_JAX_COMPILATION_CACHE=0``) leaves it off. A second process with the
    same programs then loads executables instead of compiling them.
    """
    env = os.environ.get(ENV_CACHE_DIR)
    if path is False or (path is None and env == "0"):
        return None
    if path is None or path is True:
        path = env or Path.home() / ".cache" / "omni_jax" / "xla"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class Compilable(Protocol):
    """A program that can be compiled without running it: what :func:`compile_ahead` takes."""

    def compile(self) -> object: ...


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One call of a jitted function, kept so that its program can be compiled ahead of the call
    (:func:`compile_ahead`) and then the call made (it then finds the program compiled)."""

    fn: Any  # a jax.jit-wrapped function (its ``lower`` and its call)
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Mesh | None = None  # traced and run under ``jax.set_mesh`` (kernels that read it)

    def _context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def __call__(self) -> Any:
        with self._context():
            return self.fn(*self.args, **self.kwargs)

    def compile(self) -> None:
        with self._context():
            self.fn.lower(*self.args, **self.kwargs).compile()


def compile_threads(programs: int) -> int:
    """Threads for ``programs`` compilations: one per core this process may use, at most
    :data:`MAX_COMPILE_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(programs, cores, MAX_COMPILE_THREADS))


def compile_ahead(calls: Sequence[Compilable]) -> None:
    """Compile the programs of ``calls`` side by side, running none of them.

    Each thread traces and lowers one call (Python, one at a time under the GIL) and hands it to
    XLA, whose compilation releases the GIL: XLA's work is most of a large program's compile
    time, so compilations overlapping is what keeps a warm-up of dozens of such programs short
    (measured: ``benchmarks/RESULTS.md``). A program compiled ahead is the one the later call runs:
    jit's trace, lowering and compilation caches are shared by ``lower(...).compile()`` and the
    call, so the call compiles nothing. Running the programs is left to the caller, one at a
    time, so warm-up never holds more than one program's working memory on the device.

    A failed compilation or an interrupt (Ctrl-C during a server's warm-up) cancels the programs
    not yet started and returns once the running ones end: XLA cannot stop a compilation, but
    dozens of queued long ones must not keep the process alive.
    """
    if not calls:
        return
    pool = ThreadPoolExecutor(compile_threads(len(calls)), thread_name_prefix="compile")
    try:
        for done in [pool.submit(call.compile) for call in calls]:
            done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class CompileCounter:
    """Counts traces, backend compilations and persistent-cache loads while active
    (``with CompileCounter() as c``).

    A jitted function that hits its in-memory cache neither traces nor compiles, so a
    steady state that never recompiles leaves all counts at zero. A program found in JAX's
    persistent compilation cache is traced and lowered, then loaded instead of compiled: it
    counts in ``loads``, not ``compiles``, and :attr:`programs` counts both (what a warm-up
    built, wherever the executables came from). ``trace_s``, ``compile_s`` and ``load_s`` sum
    the seconds JAX recorded for each (what a benchmark reports as compile time apart).
    ``on_count(counter)`` runs after each counted event, in the thread that compiles: a trace
    ends just before its program is lowered and compiled, so a progress display can say
    "compiling" while it is.
    """

    _lock = threading.Lock()
    _active: list[CompileCounter] = []
    _installed = False
    _loading = threading.local()  # ``hit``: this thread's next backend compilation is a cache load

    def __init__(self, on_count: Callable[[CompileCounter], None] | None = None) -> None:
        self.traces = 0
        self.compiles = 0
        self.loads = 0
        self.trace_s = 0.0
        self.compile_s = 0.0
        self.load_s = 0.0
        self.on_count = on_count

    @property
    def programs(self) -> int:
        """Executables built while active: compiled, or loaded from the persistent cache."""
        return self.compiles + self.loads

    @classmethod
    def _listener(cls, event: str, duration: float, **_: object) -> None:
        """Counts under the lock: :func:`compile_ahead` compiles on several threads at once."""
        if event == _LOAD_EVENT:
            cls._loading.hit = True
            return
        if event not in (_TRACE_EVENT, _COMPILE_EVENT):
            return
        loaded = event == _COMPILE_EVENT and getattr(cls._loading, "hit", False)
        if loaded:
            cls._loading.hit = False
        with cls._lock:
            active = list(cls._active)
            for c in active:
                if event == _TRACE_EVENT:
                    c.traces += 1
                    c.trace_s += duration
                elif loaded:
                    c.loads += 1
                    c.load_s += duration
                else:
                    c.compiles += 1
                    c.compile_s += duration
        for c in active:
            if c.on_count is not None:
                c.on_count(c)

    def __enter__(self) -> CompileCounter:
        with self._lock:
            if not CompileCounter._installed:
                monitoring.register_event_duration_secs_listener(CompileCounter._listener)
                CompileCounter._installed = True
            CompileCounter._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            CompileCounter._active.remove(self)
