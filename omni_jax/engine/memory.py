"""Device memory limits: what a stage will allocate, what the device has left, refusing at start-up.

A KV cache or a step that cannot fit must be refused when the pipeline is built, with the
numbers, not found by an out-of-memory error in the middle of a run. What an AR stage holds
besides its weights is known before anything is allocated (:class:`ARMemory`): the paged
cache (its :class:`~omni_jax.engine.kv_cache.CacheGeometry`'s pages) and the temporaries of
its largest step, estimated from the jnp attention path: steps are flat (every token a row of
its own, :mod:`omni_jax.engine.ar_runner`), and that path gathers each row's K and V pages and
scores them in chunks of rows (one layer at a time), plus each token row's activations (as
wide as the model says, ``activation_width``), the step's float32 logits, and what the
penalties read: the id table the runner keeps between steps (``max_num_seqs x max_model_len``
ids, on every device) and a penalised step's rows of it with their token counts. On CPUs,
what XLA's scheduler holds beside (:mod:`omni_jax.cpu_schedule`): bfloat16 weights' float32
copies, rows per layer, and float32 copies of a bfloat16 cache's gathered K and V. Beside the
step, the largest program the stage's frontend runs between steps (a thinker's encoder call,
:class:`ProgramBytes`, counted by the stage: :mod:`omni_jax.stages.encoder_programs`).

What a device has left: ``bytes_limit - bytes_in_use`` from ``memory_stats()`` on accelerators;
CPU devices report no statistics and allocate from host memory, so they count against the
host's ``MemAvailable`` (``/proc/meminfo``), all of a process's CPU devices together.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from omni_jax.engine.kv_cache import CacheGeometry

GIB = 1 << 30


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB ({n} bytes)"


def host_available_bytes() -> int:
    """Host memory a new allocation can take: ``MemAvailable`` (Linux), else free pages."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _stats(device: jax.Device) -> dict[str, int]:
    try:
        stats = device.memory_stats() or {}
    except (jax.errors.JaxRuntimeError, NotImplementedError):  # a backend without statistics
        return {}
    return stats if stats.get("bytes_limit") and stats.get("bytes_in_use") is not None else {}


def available_bytes(device: jax.Device) -> tuple[int, str]:
    """``(bytes, what they are)`` a new allocation on ``device`` can take."""
    stats = _stats(device)
    if stats:
        return int(stats["bytes_limit"] - stats["bytes_in_use"]), f"device {device} ({device.device_kind})"
    return host_available_bytes(), "host memory (MemAvailable)"


def pool_key(device: jax.Device) -> object:
    """Which memory ``device`` allocates from: its own (an accelerator's id), else ``"host"``."""
    return device.id if _stats(device) else "host"


def memory_pools(devices: Sequence[jax.Device]) -> list[tuple[jax.Device, int]]:
    """``devices`` grouped by the memory they allocate from: ``(one of them, how many)``; each
    accelerator is its own pool, every device without statistics (CPU) shares the host's."""
    pools: dict[object, list[jax.Device]] = {}
    for d in devices:
        pools.setdefault(pool_key(d), []).append(d)
    return [(ds[0], len(ds)) for ds in pools.values()]


STEP_ITEM = "largest step's temporaries (estimate)"


@dataclasses.dataclass(frozen=True)
class ProgramBytes:
    """A program an AR stage's frontend runs on its devices between steps (an encoder call),
    and the bytes it holds there while it runs: ``what`` names it in a refusal."""

    what: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ARMemory:
    """One AR stage's allocations besides its weights, per device (heads split over ``model``,
    rows over ``data``); see the module docstring for what the step estimate counts."""

    cache: CacheGeometry  # one device's part of the stage's cache (CacheGeometry.shard)
    num_heads: int  # query heads on one device
    vocab_size: int
    max_rows: int  # sequences (logits rows) of the largest step on one device
    max_num_seqs: int  # rows of the runner's token-id table (every device holds all)
    max_token_rows: int  # token rows of the largest step on one device
    chunk_bytes: int  # what the jnp path gathers and scores at once (attention.chunk_bytes)
    activation_width: int  # float32 values a token row holds at once on one device (see step_bytes)
    cpu_bytes: int = 0  # what XLA's CPU scheduler holds beside the step (cpu_schedule.cpu_step_bytes)
    gather_copies: int = 0  # float32 copies of a chunk's gathered K/V on CPU (cpu_schedule.gather_copies)
    encoder: ProgramBytes | None = None  # the frontend's largest encoder call (see beside_cache)

    def kv_bytes(self, num_pages: int) -> int:
        """The cache with ``num_pages`` pages (plus the never-written null page)."""
        return (num_pages + 1) * self.cache.page_bytes

    @property
    def step_bytes(self) -> int:
        """The largest step's temporaries: one chunk of token rows' gathered K/V and float32
        scores (the jnp path, one layer at a time), every token row's activations, the step's
        float32 logits, and for the penalties the id table (int32) with a penalised step's rows
        of it and their counts (float32) and seen flags; and :attr:`cpu_bytes`, with
        :attr:`gather_copies` float32 copies of a chunk's gathered K and V."""
        context = self.cache.table_tokens
        per_row = context * self.cache.token_bytes + self.num_heads * context * 4
        rows = min(self.max_token_rows, max(1, self.chunk_bytes // per_row))
        float32_gather = rows * context * self.cache.token_bytes * 4 // jnp.dtype(self.cache.dtype).itemsize
        activations = self.max_token_rows * self.activation_width * 4
        length = self.cache.max_model_len
        penalties = self.max_num_seqs * length * 4 + self.max_rows * (length * 4 + self.vocab_size * 5)
        logits = self.max_rows * self.vocab_size * 4
        copies = self.gather_copies * float32_gather
        return rows * per_row + activations + logits + penalties + self.cpu_bytes + copies

    def kv_item(self, num_pages: int) -> tuple[str, int]:
        """The cache as one line of a refusal: ``(what, bytes)``."""
        c = self.cache
        return (
            f"KV cache ({num_pages} pages of {c.page_size} tokens, {c.page_bytes} bytes each)",
            self.kv_bytes(num_pages),
        )

    def programs(self) -> dict[str, int]:
        """What the stage's programs hold beside its weights and cache, item by item: the
        largest step, and the frontend's largest :attr:`encoder` call. Both at once: with
        steps overlapping (:class:`~omni_jax.engine.ar_engine.AREngine`), the step dispatched
        last is still in flight while the next step's encoder calls run."""
        items = {STEP_ITEM: self.step_bytes}
        if self.encoder is not None:
            items[f"largest encoder call ({self.encoder.what})"] = self.encoder.nbytes
        return items

    @property
    def beside_cache(self) -> int:
        """:meth:`programs`, added up."""
        return sum(self.programs().values())

    def demand(self, num_pages: int) -> dict[str, int]:
        kv, kv_bytes = self.kv_item(num_pages)
        return {kv: kv_bytes, **self.programs()}

    def pages_that_fit(self, available: int, memory_fraction: float = 0.9, share: float = 1.0) -> int:
        """Pages a cache can have within ``memory_fraction`` of ``available`` bytes next to the
        stage's programs, taking ``share`` of the room they leave (other stages' caches take the
        rest)."""
        return int((available * memory_fraction - self.beside_cache) * share // self.cache.page_bytes) - 1


def refuse_unless_fits(
    what: str, per_device: dict[str, int], devices: Sequence[jax.Device], hint: str = ""
) -> None:
    """``ValueError`` with the numbers when ``per_device`` bytes (on each of ``devices``) exceed
    what their memory has left."""
    for device, count in memory_pools(devices):
        available, where = available_bytes(device)
        needed = {k: v * count for k, v in per_device.items()}
        total = sum(needed.values())
        if total > available:
            items = "; ".join(f"{k}: {format_bytes(v)}" for k, v in needed.items())
            times = f" ({count} devices)" if count > 1 else ""
            raise ValueError(
                f"{what} needs {format_bytes(total)}{times} but {where} has {format_bytes(available)} "
                f"available [{items}]{'; ' + hint if hint else ''}"
            )
