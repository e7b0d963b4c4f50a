"""Memory planning from ``config.json``: what each device needs for a pipeline's stages.

A plan tells, before any weight is downloaded, whether a checkpoint fits a GPU: per stage and per
device, the bytes of its weights, of its largest step's temporaries (an AR stage) or largest
solve (code2wav), and of its KV cache, for one sequence of ``max_model_len`` tokens and for the
``max_num_seqs`` sequences a default cache would like. The figures are the start-up check's
(:func:`omni_jax.preflight.stage_demand`: abstract models, nothing read or allocated), for
meshes of accelerators this process need not have (:class:`~omni_jax.preflight.PlannedMesh`).
A thinker's encoder calls are sized by ``preprocessor_config.json`` beside it, as the stage
sizes them (without it the stage takes text prompts only and makes none).

Fitting a GPU: JAX takes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of its memory (0.75 unless that is
set). The stages on a device fit when their weights, largest steps and one sequence of cache per
AR stage fit in that, which is what ``from_pretrained`` checks before loading; the default cache
then takes :data:`CACHE_FRACTION` of what the weights leave, less the steps, which is how many
sequences of ``max_model_len`` tokens can be served at once.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omni_jax.architectures import architecture_of
from omni_jax.engine.memory import GIB
from omni_jax.engine_args import check_sizes, check_stage_names, dtype_name
from omni_jax.parallel.mesh import AXES, mesh_shape
from omni_jax.parallel.placement import StagePlacement, stage_layouts
from omni_jax.preflight import (
    ENGINE_DEFAULTS,
    PlannedMesh,
    check_fed_lengths,
    check_stage_engines,
    engine_settings,
    part_dtype,
    stage_demand,
    stage_graph,
)

GPU_SIZES_GIB = (24, 40, 80)
JAX_MEM_FRACTION = 0.75
"""JAX's default share of an accelerator's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
CACHE_FRACTION = 0.9
"""What a default KV cache takes of the memory left to it (``ARMemory.pages_that_fit``)."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's bytes on each of its devices."""

    name: str
    kind: str
    dtype: str
    mesh: dict[str, int]
    devices: tuple[int, ...]  # indices into the devices of the machine the plan is for
    weights: int
    step: int  # largest step's temporaries (AR) or largest solve (generation), estimates
    sequence_kv: int  # one sequence of max_model_len tokens (0: no KV cache)
    full_kv: int  # max_num_seqs such sequences (what a default cache would like)
    max_model_len: int | None = None  # an AR stage's sizes (None: a generation stage)
    max_num_seqs: int | None = None


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Everything the stages placed on one device need there."""

    device: int
    stages: tuple[str, ...]
    weights: int
    steps: int
    sequence_kv: int
    full_kv: int
    max_num_seqs: int

    @property
    def least(self) -> int:
        """Weights, steps and one sequence of cache: what ``from_pretrained`` refuses to go below."""
        return self.weights + self.steps + self.sequence_kv

    def sequences(self, usable: int) -> int:
        """Sequences of ``max_model_len`` a device with ``usable`` bytes serves at once (at most
        ``max_num_seqs``; 0 when it cannot hold the stages at all)."""
        if self.least > usable:
            return 0
        if self.sequence_kv == 0:
            return self.max_num_seqs
        room = CACHE_FRACTION * (usable - self.weights) - self.steps
        return max(1, min(self.max_num_seqs, int(room // self.sequence_kv)))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan of a pipeline (see the module docstring); :meth:`table` prints it."""

    path: Path
    architecture: str
    stages: tuple[StagePlan, ...]
    devices: tuple[DevicePlan, ...]
    max_model_len: int | None  # the longest of the AR stages' (None without one)
    max_num_seqs: int  # the most of the AR stages' (the default without one)
    mem_fraction: float

    def _sizes(self, key: str) -> str:
        """The AR stages' ``key``: one number when they agree, else each with its stage (a
        stage YAML may size each AR stage)."""
        ar = [s for s in self.stages if s.max_model_len is not None]
        values = {getattr(s, key) for s in ar}
        if len(values) <= 1:
            return str(getattr(self, key))
        return ", ".join(f"{getattr(s, key)} ({s.name})" for s in ar)

    @property
    def weights(self) -> int:
        """Every stage's weights over all its devices (the checkpoint as loaded, replicas included)."""
        return sum(s.weights * len(s.devices) for s in self.stages)

    def usable(self, capacity: int) -> int:
        return int(capacity * self.mem_fraction)

    def fits(self, capacity: int) -> bool:
        """Whether every device, of ``capacity`` bytes, holds its stages with one sequence of cache."""
        return all(d.least <= self.usable(capacity) for d in self.devices)

    def sequences(self, capacity: int) -> int:
        """Sequences served at once on devices of ``capacity`` bytes (the fewest of any device)."""
        return min(d.sequences(self.usable(capacity)) for d in self.devices)

    def table(self, gpu_sizes_gib: tuple[float, ...] = GPU_SIZES_GIB) -> str:
        g = size_text
        length = f"max_model_len {self._sizes('max_model_len')}, " if self.max_model_len else ""
        seqs = self._sizes("max_num_seqs")
        lines = [
            f"{self.architecture} ({self.path / 'config.json'}): {length}max_num_seqs {seqs}; "
            f"weights {g(self.weights)} summed over every device (replicas included)",
            "",
            "per stage, on each of its devices"
            + (f" (KV all: {seqs} sequences, a default cache):" if self.max_model_len else ":"),
        ]
        stage_rows = [STAGE_HEADER]
        for s in self.stages:
            mesh = ",".join(f"{a}={s.mesh[a]}" for a in AXES)
            kv = (g(s.sequence_kv), g(s.full_kv)) if s.sequence_kv else ("-", "-")
            stage_rows.append((s.name, device_ranges(s.devices), mesh, s.dtype, g(s.weights), g(s.step), *kv))
        lines += aligned(stage_rows)
        lines += ["", "per device (least: weights, steps and one sequence):"]
        alike: dict[tuple[str, ...], list[int]] = {}  # a row per run of devices that hold the same
        for d in self.devices:
            full = d.weights + d.steps + d.full_kv
            kv = g(d.sequence_kv) if d.sequence_kv else "-"  # a device of generation stages holds no cache
            alike.setdefault(
                (",".join(d.stages), g(d.weights), g(d.steps), kv, g(d.least), g(full)), []
            ).append(d.device)
        rows = sorted((devices, cells) for cells, devices in alike.items())
        lines += aligned([DEVICE_HEADER, *((device_ranges(devices), *cells) for devices, cells in rows)])
        lines += ["", f"GPUs (JAX uses {self.mem_fraction:.0%} of one: XLA_PYTHON_CLIENT_MEM_FRACTION):"]
        width = max(3, *(len(f"{size:g}") for size in gpu_sizes_gib))
        for size in gpu_sizes_gib:
            capacity = int(size * GIB)
            if self.fits(capacity):
                n = self.sequences(capacity)
                what = f"fits, {n} sequence{'s' if n > 1 else ''} at once" if self.max_model_len else "fits"
            else:
                worst = max(self.devices, key=lambda d: d.least)
                has = g(self.usable(capacity))
                what = f"does not fit: device {worst.device} needs {g(worst.least)}, JAX has {has}"
            lines.append(f"  {size:>{width}g} GiB: {what}")
        return "\n".join(lines)


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB / KiB below a tenth of the unit above (tiny test models)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if n >= scale // 10:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


STAGE_HEADER = ("stage", "devices", "mesh", "dtype", "weights", "largest step", "KV 1 seq", "KV all")
DEVICE_HEADER = ("devices", "stages", "weights", "steps", "KV 1 seq", "least", "with KV all")


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` of cells as lines, each column as wide as its widest cell (device lists and
    stage names grow with the layout) and two spaces between columns."""
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    return ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in rows]


def device_ranges(devices: tuple[int, ...] | list[int]) -> str:
    """Device indices as runs: ``0-7``, ``0-3,6``."""
    runs: list[list[int]] = []
    for d in sorted(devices):
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plan_memory(
    path: str | Path,
    stages: list[str] | None = None,
    dtype: str | None = None,
    mesh: dict[str, int] | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    page_size: int | None = None,
    *,
    max_num_batched_tokens: int | None = None,
    stage_config: str | Path | None = None,
    limit_mm_per_prompt: dict[str, int] | None = None,
    platform: str = "gpu",
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``from_pretrained(path, ...)`` with the same arguments, from
    ``path/config.json`` (and ``preprocessor_config.json``: the module docstring), for devices of
    ``platform`` (the step estimates depend on it).

    Raises ``ValueError`` for what ``from_pretrained`` would refuse before loading (an unknown
    stage, a mesh the model cannot be split by, overlapping device lists, ``max_model_len`` over
    the model's).
    """
    from omni_jax.weights import load_hf_config

    dtype = dtype_name(dtype)
    check_stage_names(stages)
    check_sizes(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    path = Path(path)
    hf_config = load_hf_config(path)
    arch = architecture_of(hf_config)
    config = stage_graph(path, arch, hf_config, stage_config, stages)
    if limit_mm_per_prompt is not None:
        config = config.with_media_limits(limit_mm_per_prompt)
    check_stage_engines(arch, config.stages)
    engine = dict(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    layouts = stage_layouts(
        [StagePlacement(sc.name, sc.mesh, sc.devices) for sc in config.stages],
        mesh_shape(mesh),
        config.allow_shared_devices,
    )
    plans: list[StagePlan] = []
    lengths: dict[str, int] = {}
    for sc in config.stages:
        shape, devices = layouts[sc.name].shape, layouts[sc.name].indices
        mesh = PlannedMesh(shape, platform)
        demand = stage_demand(
            path, hf_config, arch, sc, mesh, dtype, lengths, **engine_settings(sc, **engine)
        )
        fixed, cache = demand.fixed, demand.plan
        weights = fixed.pop(f"stage {sc.name!r} weights")
        sequence_kv = full_kv = 0
        sizes: tuple[int | None, int | None] = (None, None)
        if cache is not None:
            lengths[sc.name] = cache.geometry.max_model_len
            sequence_kv = cache.memory.kv_bytes(cache.geometry.pages_per_seq)
            full_kv = cache.memory.kv_bytes(cache.geometry.pages_per_seq * cache.max_num_seqs)
            sizes = (cache.geometry.max_model_len, cache.max_num_seqs)
        stage_dtype = part_dtype(path, hf_config, arch.part(sc.name).dtype, dtype)
        plans.append(
            StagePlan(
                sc.name,
                sc.kind,
                stage_dtype,
                shape,
                devices,
                weights,
                sum(fixed.values()),
                sequence_kv,
                full_kv,
                *sizes,
            )
        )
    check_fed_lengths(config.stages, lengths)
    seqs = [s.max_num_seqs for s in plans if s.max_num_seqs is not None]
    most_seqs = max(seqs) if seqs else max_num_seqs or ENGINE_DEFAULTS["max_num_seqs"]
    return MemoryPlan(
        path=path,
        architecture=arch.name,
        stages=tuple(plans),
        devices=_per_device(plans, most_seqs),
        max_model_len=max(lengths.values()) if lengths else None,
        max_num_seqs=most_seqs,
        mem_fraction=jax_mem_fraction(),
    )


def jax_mem_fraction() -> float:
    """The share of an accelerator's memory JAX takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, else
    :data:`JAX_MEM_FRACTION`); ``ValueError`` naming the variable unless it is a number in (0, 1]."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if raw is None:
        return JAX_MEM_FRACTION
    try:
        fraction = float(raw)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} must be a number in (0, 1]")
    return fraction


def _per_device(plans: list[StagePlan], max_num_seqs: int) -> tuple[DevicePlan, ...]:
    """Each device's stages added up; its sequences capped by the fewest ``max_num_seqs`` of the
    AR stages there (a request needs a place in each), ``max_num_seqs`` on a device without one."""
    out = []
    placed = [(s, set(s.devices)) for s in plans]
    for device in sorted(set().union(*(on for _, on in placed))):
        here = [s for s, on in placed if device in on]
        capped = [s.max_num_seqs for s in here if s.max_num_seqs is not None]
        out.append(
            DevicePlan(
                device=device,
                stages=tuple(s.name for s in here),
                weights=sum(s.weights for s in here),
                steps=sum(s.step for s in here),
                sequence_kv=sum(s.sequence_kv for s in here),
                full_kv=sum(s.full_kv for s in here),
                max_num_seqs=min(capped) if capped else max_num_seqs,
            )
        )
    return tuple(out)
