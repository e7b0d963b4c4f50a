"""XLA compilation: the persistent cache for warm starts and a counter that proves "compile once"
(the static handle for a module's graph is :class:`omni_jax.jit.StaticGraph`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import jax
from jax import monitoring

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ENV_CACHE_DIR = "OMNI_JAX_COMPILATION_CACHE"


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


class CompileCounter:
    """Counts traces and backend compilations while active (``with CompileCounter() as c``).

    A jitted function that hits its in-memory cache neither traces nor compiles, so a
    steady state that never recompiles leaves both counts at zero. ``on_count(counter)`` runs
    after each counted event, in the thread that compiles: a trace ends just before its
    program is lowered and compiled, so a progress display can say "compiling" while it is.
    """

    _lock = threading.Lock()
    _active: list[CompileCounter] = []
    _installed = False

    def __init__(self, on_count: Callable[[CompileCounter], None] | None = None) -> None:
        self.traces = 0
        self.compiles = 0
        self.on_count = on_count

    @classmethod
    def _listener(cls, event: str, duration: float, **_: object) -> None:
        del duration
        for c in cls._active:
            if event == _TRACE_EVENT:
                c.traces += 1
            elif event == _COMPILE_EVENT:
                c.compiles += 1
            else:
                continue
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
