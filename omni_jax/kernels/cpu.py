"""C++ kernels for XLA's CPU backend: built on first use with the machine's compiler, cached
per machine, and registered as typed FFI targets (``jax.ffi``).

Why build at run time: the kernels are compiled for the CPU they run on (``-march=native``)
against the FFI headers of the installed jaxlib, the way ``torch.utils.cpp_extension.load``
builds extensions, so a wheel of the package stays pure Python. A build runs once per machine
and jaxlib; ``OMNI_JAX_CPU_KERNELS=0`` turns the kernels off, and without a C++ compiler the
engine warns once and keeps XLA's own (slower) path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jaxlib

ENV_SWITCH = "OMNI_JAX_CPU_KERNELS"
ENV_CACHE_DIR = "OMNI_JAX_KERNEL_CACHE"
PAGED_DECODE_TARGET = "omni_jax_paged_decode_f32"
_SOURCE = Path(__file__).with_name("paged_decode_cpu.cc")
_SYMBOL = "OmniJaxPagedDecodeF32"

log = logging.getLogger(__name__)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    """What the CPU supports, so a cache shared between machines never loads a build made for
    another CPU's instruction set."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor()


def _compile_flags() -> list[str]:
    arch = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    # -ffast-math lets the compiler vectorise the softmax's reductions and exp (glibc's
    # libmvec). It is given when compiling only: linked into a shared library it would also
    # pull in crtfastmath.o, which flushes denormals to zero for the whole process on load.
    return ["-O3", *arch, "-ffast-math", "-std=c++17", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [_SOURCE.read_text(), *_compile_flags(), jaxlib.__version__, version, _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "omni_jax" / "kernels")
    lib = cache / f"paged_decode_cpu-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU paged-attention kernel with %s (once per machine)", compiler)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in (
            [compiler, *_compile_flags(), "-c", str(_SOURCE), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(out)],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"building {_SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr}\n"
                    f"Set {ENV_SWITCH}=0 to run without the CPU kernels."
                )
        os.replace(out, lib)  # atomic: a concurrent build of the same key writes the same file
    return lib


_TARGET_LOCK = threading.Lock()


def paged_decode_target() -> str | None:
    """The registered FFI target of the CPU paged decode kernel, built if needed; ``None``
    when the kernels are off or no C++ compiler is found (with a warning, once). One caller at
    a time: warm-up traces programs on several threads, which all built the kernel at once."""
    with _TARGET_LOCK:
        return _paged_decode_target()


@functools.cache
def _paged_decode_target() -> str | None:
    if os.environ.get(ENV_SWITCH) == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn(
            "no C++ compiler found (set CXX or install g++): CPU decode attention falls back to "
            f"XLA's slower gather path. {ENV_SWITCH}=0 silences this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    handler = getattr(ctypes.CDLL(str(_build(compiler))), _SYMBOL)
    jax.ffi.register_ffi_target(PAGED_DECODE_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return PAGED_DECODE_TARGET
