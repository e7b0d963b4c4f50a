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

import os
import secrets

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
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if coordinator_address is None and num_processes is None and process_id is None:
        return False
    missing = [
        name
        for name, value in (
            (ENV_ADDRESS, coordinator_address),
            (ENV_NUM_PROCESSES, num_processes),
            (ENV_PROCESS_ID, process_id),
        )
        if value is None
    ]
    if missing:
        raise ValueError(f"a multi-process start needs address, process count and id; missing {missing}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def process_count_asked() -> int:
    """How many processes the runtime has, or the environment asks for before it is joined
    (``JAX_NUM_PROCESSES``; 1 when unset), without joining it."""
    if jax.distributed.is_initialized():
        return jax.process_count()
    value = os.environ.get(ENV_NUM_PROCESSES)
    return int(value) if value and value.isdigit() else 1


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
