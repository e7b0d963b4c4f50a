"""The start-up memory preflight: refuse, before any weight is read, what the devices cannot hold.

Each stage's weights (from its abstract model, ``nnx.eval_shape``: nothing is allocated or read),
an AR stage's KV cache and largest step (:class:`~omni_jax.stages.ar.CachePlan`) and a generation
stage's largest solve (:attr:`~omni_jax.architectures.GenerationStage.demand`) are added up per memory
pool (each accelerator, or the host for CPU devices) over the devices each stage is placed on,
and compared with what the pool has left. Without ``num_pages`` the cache is sized later to what
is left (at least one sequence), so only one sequence's pages count here. Weights are counted
as each device holds them under the part's partition rules (split dimensions divided,
replicated parameters whole); :meth:`CachePlan.num_pages` checks again, exactly, once the
weights are placed.

The same per-device figures, for a mesh this process need not have (:class:`PlannedMesh`), are
the memory plan's (:mod:`omni_jax.planning`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from omni_jax.architectures import Architecture, architecture_names, architecture_of
from omni_jax.engine.memory import available_bytes, format_bytes, memory_pools, pool_key
from omni_jax.models.loading import abstract_model
from omni_jax.parallel.mesh import AXES, axis_size
from omni_jax.parallel.rules import ShardRule, shard_size
from omni_jax.stages.ar import CachePlan, CacheShare, check_engine_options, local_devices
from omni_jax.stages.config import PipelineConfig, StageConfig, load_pipeline_config
from omni_jax.stages.thinker import MediaLimits

ENGINE_DEFAULTS = {"max_num_seqs": 64, "page_size": 16, "max_num_batched_tokens": 2048}
"""The AR engine's sizes when ``from_pretrained`` is given none (``max_model_len``: the model's
``max_position_embeddings``, at most 4096, see :meth:`CachePlan.of`)."""


def engine_settings(sc: StageConfig, **sizes: int | None) -> dict[str, int | None]:
    """Stage ``sc``'s :meth:`CachePlan.of` settings from ``from_pretrained``'s: a size given
    applies to every AR stage; one not given (``None``) takes the stage YAML's ``engine`` value
    (:data:`~omni_jax.stages.ar.STAGE_SIZES`: a thinker and a talker may differ, as in vLLM-omni's
    per-stage ``engine_args``), else its :data:`ENGINE_DEFAULTS` value; ``max_model_len`` set by
    neither stays ``None`` (the model's)."""
    settings: dict[str, int | None] = {}
    for key, given in sizes.items():
        if given is None and key in sc.engine:
            given = sc.engine_int(key, 1)
        settings[key] = ENGINE_DEFAULTS.get(key) if given is None else given
    return settings


def stage_graph(
    path: Path, arch: Architecture, hf_config: Any, stage_config: str | Path | None, stages: list[str] | None
) -> PipelineConfig:
    """The stage graph ``from_pretrained`` and ``plan`` build: ``stage_config`` (else the
    architecture's YAML), held to the checkpoint's architecture, cut to ``stages`` (``None``: those
    the config describes, :meth:`Architecture.config_stages`). Asking for a stage the config does
    not describe is a ``ValueError`` before anything loads (it failed on the missing weights, after
    the thinker had loaded)."""
    config = load_pipeline_config(stage_config or arch.stage_yaml)
    config.check_architecture(architecture_names(arch), path)
    described = arch.config_stages(hf_config)
    runnable = [sc.name for sc in config.stages if sc.name in described]
    if stages is None and len(described) < len(arch.parts):
        stages = runnable or [sc.name for sc in config.stages]  # a YAML of audio stages alone: refused
    absent = [name for name in stages or [] if name in arch.voiced and name not in described]
    if absent:
        way_out = (
            f"load it with stages={runnable}"
            if runnable
            else f"the stage config lists none of {described}: give one that does ({arch.stage_yaml} does)"
        )
        raise ValueError(
            f"{path / 'config.json'}: enable_audio_output is false (a checkpoint that does not speak, "
            f"as Qwen3-Omni's Thinking and Captioner): stages {absent} cannot run; {way_out}"
        )
    return config.select(stages)


def part_dtype(path: Path, hf_config: Any, part_dtype: str | None, dtype: str | None) -> str:
    """The dtype :func:`omni_jax.weights.load_part` will load a part in."""
    from omni_jax.weights import checkpoint_dtype, is_converted, read_manifest

    if part_dtype or dtype:
        return part_dtype or dtype  # type: ignore[return-value]
    return read_manifest(path)["dtype"] if is_converted(path) else checkpoint_dtype(hf_config, path)


@dataclasses.dataclass(frozen=True)
class PlannedDevice:
    """A device of a :class:`PlannedMesh`: only its platform is known."""

    platform: str


class PlannedMesh:
    """A stage's mesh planned for devices this process need not have (a plan for GPUs, made on a
    laptop): its axis sizes and platform, which is all the memory estimates read of a mesh
    (``shape`` as ``Mesh.shape``; ``devices``, as ``Mesh.devices``, stand-ins of that platform)."""

    def __init__(self, shape: dict[str, int], platform: str):
        self.shape = {a: shape[a] for a in AXES}
        self.devices = np.array(
            [PlannedDevice(platform)] * math.prod(self.shape.values()), dtype=object
        ).reshape(tuple(self.shape.values()))


def device_weight_bytes(model: nnx.Module, rules: tuple[ShardRule, ...], mesh: Mesh | PlannedMesh) -> int:
    """Bytes of ``model``'s parameters one device of ``mesh`` holds under ``rules``: each split
    dimension divided by its axis size, replicated parameters whole (every device holds the same)."""
    return sum(
        shard_size(path, tuple(var.shape), rules, mesh) * np.dtype(var.dtype).itemsize
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )


@dataclasses.dataclass(frozen=True)
class StageDemand:
    """One stage's memory per device of a mesh, from its abstract ``model`` (nothing read or
    allocated): ``fixed`` (weights, and the largest step's temporaries or the largest solve),
    and for an AR stage its cache ``plan``."""

    model: nnx.Module
    fixed: dict[str, int]
    plan: CachePlan | None


@dataclasses.dataclass(frozen=True)
class StageNeeds(StageDemand):
    """Stage ``name``'s :class:`StageDemand` on its mesh, and the memory ``pools`` its devices
    allocate from. The pipeline loads the weights into that same ``model``
    (:func:`~omni_jax.weights.load_part`) and builds the stage with that ``plan``: what is
    loaded and built is what was checked."""

    name: str
    pools: list[tuple[jax.Device, int]]

    def demand(self, num_pages: int | None) -> dict[str, int]:
        """Everything per device, a default cache (``num_pages`` None) counted at one sequence."""
        if self.plan is None:
            return self.fixed
        pages = self.plan.geometry.pages_per_seq if num_pages is None else num_pages
        kv, kv_bytes = self.plan.memory.kv_item(pages)
        return self.fixed | {f"stage {self.name!r} {kv}": kv_bytes}

    def wanted_cache(self) -> int:
        """Bytes per device of the cache a default build would like (``max_num_seqs`` sequences);
        0 for a stage without one."""
        if self.plan is None:
            return 0
        return self.plan.memory.kv_bytes(self.plan.geometry.pages_per_seq * self.plan.max_num_seqs)


def check_stage_engines(arch: Architecture, stages: Sequence[StageConfig]) -> None:
    """Each stage's YAML ``engine`` keys, before anything is read or planned: ``ValueError``
    naming the stage for a key it does not read (a typo would be a silent default) or a value
    it refuses (an AR stage's ``early_start``, a thinker's media limits)."""
    for sc in stages:
        if sc.kind == "ar":
            check_engine_options(sc)
            MediaLimits.from_engine(sc.name, sc.engine)
        else:
            sc.check_engine_keys(arch.part(sc.name).generation_stage().engine_options)


def stage_demand(
    path: Path,
    hf_config: Any,
    arch: Architecture,
    sc: StageConfig,
    mesh: Mesh | PlannedMesh,
    dtype: str | None,
    lengths: dict[str, int],
    **engine: Any,
) -> StageDemand:
    """One stage's memory per device of ``mesh`` from its abstract model, built in ``dtype``
    (the one :func:`~omni_jax.weights.load_part` loads it in). ``engine``:
    :meth:`CachePlan.of`'s settings; ``lengths``: the ``max_model_len`` of each AR stage built
    before it (a generation stage's solves are bounded by its input stage's)."""
    part = arch.part(sc.name)
    rules = part.shard_rules(hf_config, axis_size(mesh, "model"))  # refuses a split before tracing
    model = abstract_model(part.make(hf_config, part_dtype(path, hf_config, part.dtype, dtype)))
    fixed = {f"stage {sc.name!r} weights": device_weight_bytes(model, rules, mesh)}
    plan = None
    if sc.kind == "ar":
        # Refuses bad sizes before the encoders are counted.
        plan = CachePlan.of(model, mesh, rules=rules, **engine)
        if part.encoder_memory is not None:
            platform = mesh.devices.flat[0].platform
            plan = plan.with_encoder(
                part.encoder_memory(model, path, sc, plan.geometry.max_model_len, platform)
            )
        fixed |= {f"stage {sc.name!r} {what}": n for what, n in plan.memory.programs().items()}
    else:
        fixed |= part.generation_stage().demand(sc, model, lengths.get(sc.input))
    return StageDemand(model, fixed, plan)


def stage_needs(
    path: str | Path,
    hf_config: Any,
    stages: list[StageConfig],
    meshes: dict[str, Mesh],
    *,
    dtype: str | None,
    **engine: Any,
) -> list[StageNeeds]:
    """:class:`StageNeeds` of every stage, in build order; reads only ``config.json``. ``engine``:
    ``from_pretrained``'s sizes (``max_num_seqs``, ``max_model_len``, ``page_size``,
    ``max_num_batched_tokens``; ``None``: the stage YAML's or the default, :func:`engine_settings`),
    as the AR stages will be built with them."""
    path = Path(path)
    arch = architecture_of(hf_config)
    needs: list[StageNeeds] = []
    lengths: dict[str, int] = {}
    for sc in stages:
        mesh = meshes[sc.name]
        demand = stage_demand(
            path, hf_config, arch, sc, mesh, dtype, lengths, **engine_settings(sc, **engine)
        )
        if demand.plan is not None:
            lengths[sc.name] = demand.plan.geometry.max_model_len
        pools = memory_pools(local_devices(mesh))
        needs.append(StageNeeds(demand.model, demand.fixed, demand.plan, sc.name, pools))
    return needs


def check_fed_lengths(stages: Sequence[StageConfig], lengths: dict[str, int]) -> None:
    """``ValueError`` when an AR stage fed by an AR stage holds a shorter sequence than it (a
    stage YAML may size them apart): a prompt the first admits would fail at the hand-on, after
    its work, where it must be refused before any."""
    for sc in stages:
        fed, own = lengths.get(sc.input), lengths.get(sc.name)
        if fed is not None and own is not None and own < fed:
            raise ValueError(
                f"stage {sc.name!r}: max_model_len={own} is shorter than that of {sc.input!r}, which feeds "
                f"it ({fed}): a prompt {sc.input!r} admits could not be handed on; give {sc.name!r} at "
                f"least {fed}"
            )


def check_memory_before_loading(needs: list[StageNeeds], num_pages: int | None) -> None:
    """``ValueError`` naming the pool, the needed and the available bytes, item by item, when the
    stages' weights, KV caches and largest steps cannot fit, or when ``num_pages`` cannot hold
    one sequence of an AR stage."""
    pools: dict[object, tuple[jax.Device, dict[str, int]]] = {}
    for stage in needs:
        if stage.plan is not None and num_pages is not None:
            stage.plan.check_pages(num_pages, stage.name)
        for device, count in stage.pools:
            _, pool = pools.setdefault(pool_key(device), (device, {}))
            for k, v in stage.demand(num_pages).items():
                pool[k] = pool.get(k, 0) + v * count
    for device, needed in pools.values():
        available, where = available_bytes(device)
        total = sum(needed.values())
        if total > available:
            listed = "; ".join(f"{k}: {format_bytes(v)}" for k, v in needed.items())
            raise ValueError(
                f"the pipeline needs {format_bytes(total)} but {where} has {format_bytes(available)} "
                f"available [{listed}]; lower num_pages, max_model_len, max_num_seqs or "
                "max_num_batched_tokens (code2wav: the stage's max_batch, max_codes or max_solve_codes), "
                "use a smaller dtype, or spread the stages over more devices"
            )


def cache_shares(needs: list[StageNeeds]) -> dict[str, CacheShare]:
    """What each AR stage's default cache must leave to the stages built after it.

    A default cache takes what is left when its stage is built. Built first, the thinker would
    take the memory a later talker or code2wav on the same device needs for its weights. So a
    stage reserves, on each memory pool, what later stages there need at the least (weights,
    largest step or solve, one sequence of cache), and takes of the rest the share its wanted
    cache (``max_num_seqs`` sequences) has among the AR stages not yet built on that pool.
    """
    shares = {}
    for i, stage in enumerate(needs):
        if stage.plan is None:
            continue
        reserved: dict[object, int] = {}
        fraction = 1.0
        for device, count in stage.pools:
            key = pool_key(device)
            later = [(s, c) for s in needs[i + 1 :] for d, c in s.pools if pool_key(d) == key]
            reserved[key] = sum(sum(s.demand(None).values()) * c for s, c in later)
            mine = stage.wanted_cache() * count
            fraction = min(fraction, mine / (mine + sum(s.wanted_cache() * c for s, c in later)))
        shares[stage.name] = CacheShare(reserved, fraction)
    return shares
