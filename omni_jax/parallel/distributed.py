"""Several processes (hosts) as one: JAX's multi-controller runtime, ``jax.distributed``.

Every process runs the same program on the same prompts: it loads its devices' shards, runs
the same scheduler decisions and reads the same sampled tokens (step outputs are replicated
over each stage's mesh), so the processes stay in lockstep without exchanging anything but
the collectives inside the compiled steps. Only process 0 returns outputs.

The coordinator, process count and this process's id come from arguments or from the
environment: ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, the variable JAX reads
itself), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

import jax
import numpy as np

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join the distributed runtime if asked (arguments or environment); True when multi-process.

    Must run before anything touches a device. Calling it again, or with nothing configured,
    is harmless.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_ADDRESS)
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if coordinator_address is None and num_processes is None and process_id is None:
        return False
    missing = [
        f"{what} ({flag} or {env})"
        for what, flag, env, value in (
            ("the coordinator's address", "--coordinator-address", ENV_ADDRESS, coordinator_address),
            ("the process count", "--num-processes", ENV_NUM_PROCESSES, num_processes),
            ("this process's id", "--process-id", ENV_PROCESS_ID, process_id),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"a multi-process start needs address, process count and id; missing {', '.join(missing)}"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"a multi-process start needs a process count >= 1 and an id in [0, count); "
            f"got count {num_processes}, id {process_id}"
        )
    _check_address(coordinator_address)
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def _check_address(address: str) -> None:
    """``ValueError`` naming the flag and the variable unless ``address`` is ``HOST:PORT`` (a
    bracketed IPv6 host too) with a port in 1 to 65535: JAX's runtime raised an IndexError on
    ``nohostport`` and crashed the process (a segmentation fault) on ``localhost:abc``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} (--coordinator-address or {ENV_ADDRESS}) must be HOST:PORT "
            "with a port from 1 to 65535"
        )


def _env_int(name: str) -> int | None:
    """The integer environment variable ``name`` (``None`` when unset or empty); ``ValueError``
    naming it when it holds something else."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def process_count_asked() -> int:
    """How many processes the runtime has, or the environment asks for before it is joined
    (``JAX_NUM_PROCESSES``; 1 when unset), without joining it."""
    if jax.distributed.is_initialized():
        return jax.process_count()
    asked = _env_int(ENV_NUM_PROCESSES)
    return 1 if asked is None else asked


def is_main_process() -> bool:
    return jax.process_index() == 0


def random_seed() -> int:
    """A fresh 63-bit seed, the same in every process (drawn by process 0 and broadcast).

    A request without a seed still samples identically everywhere, which keeps the
    processes' schedulers in lockstep.
    """
    seed = secrets.randbits(63)
    if jax.process_count() == 1:
        return seed
    from jax.experimental import multihost_utils

    # Two uint32 halves: without x64 a 64-bit value would be truncated on the way.
    halves = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    hi, lo = (int(v) for v in multihost_utils.broadcast_one_to_all(halves))
    return hi << 32 | lo


def request_seed(seed: int | None) -> int:
    """The 64-bit word a request draws from, as vLLM reads its seed: ``None`` and ``-1`` ask for
    a fresh :func:`random_seed`; any other seed is read as torch's ``manual_seed`` reads it (a
    negative one is its two's complement)."""
    return random_seed() if seed is None or seed == -1 else int(seed) & (2**64 - 1)


def _canonical(value: Any) -> bytes:
    """``value`` as bytes that two processes given equal values produce alike: containers by
    their items (a dict's sorted by key), arrays and images by their pixels, dataclasses by their
    fields; an object of another type by its type's name alone (its repr may hold an address)."""
    if value is None or isinstance(value, (bool, int, float, str, Path)):
        return f"{type(value).__name__}:{value!r};".encode()
    if isinstance(value, bytes):
        return b"bytes:" + value + b";"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        return b"{" + b"".join(_canonical(k) + _canonical(v) for k, v in items) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b"".join(_canonical(v) for v in value) + b"]"
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(value)
        return f"array:{array.dtype}{array.shape}:".encode() + array.tobytes() + b";"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return type(value).__name__.encode() + _canonical(fields)
    if hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):  # a PIL image
        return f"image:{value.mode}{value.size}:".encode() + value.tobytes() + b";"
    return f"<{type(value).__name__}>;".encode()


def check_agreement(what: str, value: Any) -> None:
    """With several processes, ``ValueError`` in every one of them when this process's
    ``value`` differs from process 0's (each process fills its own devices' shards from its own
    inputs, so a difference would give wrong outputs or a collective that never completes).
    One gather of a 32-byte digest, the same program every time."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(_canonical(value)).digest(), np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    differ = [p for p in range(len(everyone)) if not np.array_equal(everyone[p], everyone[0])]
    if differ:
        raise ValueError(
            f"process(es) {differ} were given other {what} than process 0: every process must run "
            "the same script with the same arguments and prompts"
        )
