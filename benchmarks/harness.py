"""What every suite shares: the result schema, compile accounting, the profiled window, versions.

A suite is a module with ``run(path, args) -> dict`` and ``table(result) -> str`` (see
:data:`benchmarks.run.SUITES`). ``run`` returns the suite-specific fields plus those in
:data:`SUITE_FIELDS`; :func:`benchmarks.run.main` adds :data:`HARNESS_FIELDS` and checks the lot
with :func:`check_result` before printing and writing JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax import monitoring

from omni_jax.profiling import scope

SUITE_FIELDS = ("suite", "ours", "reference", "ratio", "roofline_fraction", "ceilings", "compile")
"""``ours`` / ``reference``: measured figures, steady state (the reference is None without
``--reference``); ``ratio``: ours over reference on the suite's headline throughput, higher is
better (a number, or one per batch size; None without ``--reference``); ``roofline_fraction``:
the measured time's share of the ceiling-bound floor (None where no roofline applies);
``ceilings``: what the harness measured on this machine for that floor (``memory_bandwidth_GBps``,
``matmul_GFLOPs``); ``compile``: ``{"ours": ..., "reference": ...}`` from :func:`compile_entry`,
first run (compilation and warm-up) against the steady run, kept out of every other figure."""

HARNESS_FIELDS = ("model", "device", "versions", "command", "date_utc", "profile", "persistent_cache")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', d)} x{jax.device_count()}"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def persistent_cache() -> str | None:
    """JAX's persistent compilation cache directory, None when off (then compile times are real)."""
    return jax.config.jax_compilation_cache_dir or None


class CompileStats:
    """XLA work done while active: programs compiled, compile and jaxpr-trace seconds, cache hits.

    ``with CompileStats() as c: first_run()``. With JAX's persistent cache on, a hit is counted
    in ``persistent_cache_hits`` and its load time in ``xla_compile_s``.
    """

    _lock = threading.Lock()
    _active: list[CompileStats] = []
    _installed = False

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_s = 0.0
        self.trace_s = 0.0
        self.cache_hits = 0

    @classmethod
    def _on_duration(cls, event: str, duration: float, **_: object) -> None:
        for c in cls._active:
            if event == "/jax/core/compile/backend_compile_duration":
                c.compiles += 1
                c.compile_s += duration
            elif event == "/jax/core/compile/jaxpr_trace_duration":
                c.trace_s += duration

    @classmethod
    def _on_event(cls, event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            for c in cls._active:
                c.cache_hits += 1

    def __enter__(self) -> CompileStats:
        with self._lock:
            if not CompileStats._installed:
                monitoring.register_event_duration_secs_listener(CompileStats._on_duration)
                monitoring.register_event_listener(CompileStats._on_event)
                CompileStats._installed = True
            CompileStats._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            CompileStats._active.remove(self)


def compile_entry(first_run_s: float, steady_run_s: float, stats: CompileStats | None = None) -> dict:
    """One side's compile figures: its first run against its best steady run of the same work."""
    out: dict[str, Any] = {
        "first_run_s": first_run_s,
        "steady_run_s": steady_run_s,
        "compile_and_warmup_s": first_run_s - steady_run_s,
    }
    if stats is not None:
        out.update(
            xla_compiles=stats.compiles,
            xla_compile_s=stats.compile_s,
            jaxpr_trace_s=stats.trace_s,
            persistent_cache_hits=stats.cache_hits,
        )
    return out


@contextlib.contextmanager
def measured_window(
    profile_dir: str | None, name: str, python_tracer: bool = False, **metadata: object
) -> Iterator[None]:
    """The measured phase of a suite: a named span, and a ``jax.profiler`` trace into
    ``profile_dir`` (``plugins/profile/<run>/*.xplane.pb`` and ``*.trace.json.gz``) when one is
    given. The trace holds the device activity and the host spans (:mod:`omni_jax.profiling`);
    ``python_tracer`` adds every Python call, which shows where host time goes but slows the
    host several-fold, so the figures of such a window are not comparable."""
    if profile_dir:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = int(python_tracer)
        jax.profiler.start_trace(profile_dir, profiler_options=options)
    try:
        with scope(f"bench/{name}", **metadata):
            yield
    finally:
        if profile_dir:
            jax.profiler.stop_trace()


def _numbers(x: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, float(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


def check_result(result: dict[str, Any]) -> None:
    """Raise if a field of the schema is missing or a number is NaN / infinite."""
    missing = [k for k in (*SUITE_FIELDS, *HARNESS_FIELDS) if k not in result]
    if missing:
        raise ValueError(f"suite {result.get('suite')!r}: result lacks {missing}")
    bad = [p for p, v in _numbers(result, "result") if not math.isfinite(v)]
    if bad:
        raise ValueError(f"suite {result['suite']!r}: non-finite figures at {bad}")
