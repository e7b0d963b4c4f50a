"""The composition root: which model classes, parameter maps and stages serve each HF architecture.

It sits above both ``models/`` and ``stages/`` (an AR part names the stage frontend it needs),
so neither of those layers imports it: the pipeline, the planner, the weight loader and the
converter look an architecture up here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from omni_jax.engine.memory import ProgramBytes
from omni_jax.models import qwen2
from omni_jax.models.param_map import ParamRule, prefixed
from omni_jax.models.qwen2_5_omni import speakers
from omni_jax.models.qwen2_5_omni.dit import dit_partition_rules
from omni_jax.models.qwen2_5_omni.talker import (
    TALKER_RULES_IN_OMNI,
    Talker,
    TalkerSpec,
    talker_ignore,
    talker_partition_rules,
)
from omni_jax.models.qwen2_5_omni.thinker import (
    THINKER_RULES_IN_OMNI,
    Thinker,
    ThinkerSpec,
    thinker_ignore,
    thinker_partition_rules,
)
from omni_jax.models.qwen2_5_omni.token2wav import TOKEN2WAV_IGNORE, TOKEN2WAV_RULES, Token2Wav
from omni_jax.models.qwen3_omni import talker as qwen3_talker
from omni_jax.models.qwen3_omni import thinker as qwen3_thinker
from omni_jax.models.qwen3_omni.code2wav import CODE2WAV_IGNORE, CODE2WAV_RULES, Code2Wav
from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec
from omni_jax.parallel.rules import PartitionRules, ShardRule
from omni_jax.safetensors_io import TensorReader
from omni_jax.stages.ar import ARFrontend
from omni_jax.stages.base import Stage
from omni_jax.stages.code2wav import ENGINE_OPTIONS as CODE2WAV_ENGINE_OPTIONS
from omni_jax.stages.code2wav import Code2WavStage, solve_demand
from omni_jax.stages.config import StageConfig
from omni_jax.stages.qwen3_code2wav import ENGINE_OPTIONS as QWEN3_CODE2WAV_ENGINE_OPTIONS
from omni_jax.stages.qwen3_code2wav import Qwen3Code2WavStage
from omni_jax.stages.qwen3_code2wav import solve_demand as qwen3_code2wav_demand
from omni_jax.stages.qwen3_talker import Qwen3TalkerFrontend
from omni_jax.stages.qwen3_thinker import Qwen3ThinkerFrontend
from omni_jax.stages.talker import TalkerFrontend
from omni_jax.stages.thinker import MediaLimits, ThinkerFrontend


@dataclasses.dataclass(frozen=True)
class GenerationStage:
    """How a generation (non-AR) part becomes its stage: ``build(stage_config, model, path,
    mesh, max_input)`` makes the stage from the loaded model (``mesh``: the stage's, ``None`` on
    one device; ``max_input``: the ``max_model_len`` of the AR stage that feeds it, which bounds
    what one request can bring, ``None`` when the stage reads prompts);
    ``demand(stage_config, model, max_input)`` is its largest solve's temporaries
    (``{what: bytes}``, read by the start-up memory check from the abstract model);
    ``engine_options`` the stage YAML's ``engine`` keys it reads (any other is refused)."""

    build: Callable[[StageConfig, Any, Path, Mesh | None, int | None], Stage]
    demand: Callable[[StageConfig, Any, int | None], dict[str, int]]
    engine_options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """One stage's model inside a checkpoint: how to build it and where its tensors go.

    ``make(hf_config, dtype)`` returns a zero-argument constructor (run under
    ``nnx.eval_shape`` so nothing is allocated); ``rules``/``ignore`` see full HF names.
    ``dtype``, when set, is the only dtype the part runs in, whatever the checkpoint or the
    caller asks (transformers always runs Qwen2.5-Omni's token2wav in float32).
    ``partition(hf_config, model_axis_size)`` gives its tensor-parallel :class:`ShardRule` s
    (``None``: every parameter replicated over the stage's mesh).
    ``frontend(hf_config, model, path, stage_config, max_model_len)``, for an AR part that
    needs more than token ids (a multimodal processor, M-RoPE positions, encoder rows merged
    into its embeddings, another stage's hidden states), builds the stage's
    :class:`~omni_jax.stages.ar.ARFrontend` for prompts of at most ``max_model_len`` tokens.
    ``encoder_memory(model, path, stage_config, max_model_len, platform)``, for an AR part whose
    frontend runs encoders, is what their calls hold at most on a device of ``platform``
    (read by the memory plan from the abstract model; ``None``: no encoder calls).
    ``generation``, for a part the stage YAML runs as a generation stage, builds that stage
    (:class:`GenerationStage`).
    """

    stage: str
    make: Callable[[Any, Any], Callable[[], nnx.Module]]
    rules: Callable[[Any], tuple[ParamRule, ...]]
    ignore: Callable[[Any], tuple[str, ...]]
    dtype: str | None = None
    partition: PartitionRules | None = None
    frontend: Callable[[Any, nnx.Module, Path, StageConfig, int], ARFrontend[Any]] | None = None
    encoder_memory: Callable[[nnx.Module, Path, StageConfig, int, str], ProgramBytes | None] | None = None
    generation: GenerationStage | None = None

    def generation_stage(self) -> GenerationStage:
        """How this part runs as a generation stage; ``ValueError`` when it cannot."""
        if self.generation is None:
            raise ValueError(
                f"stage {self.stage!r} is an AR part: the stage YAML cannot make it kind 'generation'"
            )
        return self.generation

    def shard_rules(self, hf_config: Any, model: int) -> tuple[ShardRule, ...]:
        """Rules for a ``model``-way split; ``ValueError`` naming the stage when the part cannot
        be split so (stages share a mesh: the message says whose heads ``model`` does not divide,
        and that a stage YAML can give that stage a mesh of its own)."""
        if self.partition is None:
            return ()
        try:
            return self.partition(hf_config, model)
        except ValueError as e:
            raise ValueError(
                f"stage {self.stage!r}: {e}; a stage YAML (stage_config=, --stage-config) can give "
                "each stage its own mesh and devices"
            ) from None


SideFileConverter = Callable[[Path, Path], None]
"""``(source file, destination dir)``: rewrites a checkpoint side file in a torch-free form."""


@dataclasses.dataclass(frozen=True)
class StageFile:
    """A file beside the weights that some stages cannot serve without.

    ``present(model_dir)`` knows both the hub's form and what conversion writes for it;
    ``what`` (what the file holds) and ``without`` (what a checkpoint lacking it still serves)
    are for the messages.
    """

    name: str
    what: str
    without: str
    stages: tuple[str, ...]
    present: Callable[[Path], bool]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """``unserved``: ``(stage, HF name prefix)`` of parts not ported yet. Their tensors are skipped
    by name (never silently: every other tensor must belong to a served part), and asking for
    their stage is an error that says so. ``side_files``: ``(file name, converter)`` pairs run by
    the converter instead of copying the file. ``stage_files``: files some stages need (a
    checkpoint without them serves only the other stages). ``restack``: a rewrite of the
    checkpoint's ``(name, reader)`` stream before its names are matched to any part's rules
    (Qwen3-Omni's checkpoints store one tensor per MoE expert and per code-predictor codebook;
    its parts take them stacked, :func:`~omni_jax.models.qwen3_omni.talker.stack_talker_readers`).
    ``voiced``: the stages a config with ``enable_audio_output: false`` does not have (transformers
    then builds the thinker alone; Qwen3-Omni's Thinking and Captioner checkpoints ship no talker
    or code2wav weights)."""

    name: str
    stage_yaml: str
    parts: tuple[ModelPart, ...]
    unserved: tuple[tuple[str, str], ...] = ()
    side_files: tuple[tuple[str, SideFileConverter], ...] = ()
    stage_files: tuple[StageFile, ...] = ()
    restack: Callable[[Iterable[tuple[str, TensorReader]]], Iterator[tuple[str, TensorReader]]] | None = None
    voiced: tuple[str, ...] = ()

    def config_stages(self, hf_config: Any) -> list[str]:
        """The stages ``hf_config`` describes: every part's, less the :attr:`voiced` ones when
        its ``enable_audio_output`` is false."""
        mute = getattr(hf_config, "enable_audio_output", True) is False
        return [p.stage for p in self.parts if not (mute and p.stage in self.voiced)]

    def part(self, stage: str) -> ModelPart:
        for p in self.parts:
            if p.stage == stage:
                return p
        served = [p.stage for p in self.parts]
        for name, prefix in self.unserved:
            if name == stage:
                raise ValueError(
                    f"{self.name}: stage {stage!r} is not served yet (its {prefix}* tensors are skipped); "
                    f"served stages: {served}"
                )
        raise ValueError(f"{self.name} has no stage {stage!r} (stages: {served})")

    def is_unserved_tensor(self, hf_name: str) -> bool:
        return any(hf_name.startswith(prefix) for _, prefix in self.unserved)

    def missing_files(self, model_dir: Path, stages: Iterable[str]) -> str | None:
        """What ``model_dir`` lacks for ``stages``, as one line naming the file and the stages it
        can still serve; ``None`` when nothing is missing."""
        wanted = list(stages)
        missing = [f for f in self.stage_files if set(f.stages) & set(wanted) and not f.present(model_dir)]
        if not missing:
            return None
        blocked = {s for f in missing for s in f.stages}
        served = [p.stage for p in self.parts if p.stage not in blocked]
        files = "; ".join(f"no {f.name} ({f.what}): {f.without}" for f in missing)
        stopped = [s for s in wanted if s in blocked]
        return f"{model_dir}: {files}; stages {stopped} cannot run: load it with stages={served}"

    def warn_missing_files(self, src: Path, stages: list[str]) -> None:
        """At conversion of ``stages``: a source without a stage file converts, with a warning
        saying what the result serves."""
        message = self.missing_files(src, stages)
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=3)


def _qwen2_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = qwen2.Qwen2Spec.from_hf(cfg)
    return lambda: qwen2.Qwen2ForCausalLM(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _token2wav_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    return lambda: Token2Wav(cfg.token2wav_config, rngs=nnx.Rngs(0))


def _thinker_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = ThinkerSpec.from_hf(cfg.thinker_config)
    return lambda: Thinker(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _talker_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = TalkerSpec.from_hf(cfg.talker_config)
    return lambda: Talker(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _thinker_frontend(
    cfg: Any, model: nnx.Module, path: Path, stage_config: StageConfig, max_model_len: int
) -> ARFrontend[Any]:
    limits = MediaLimits.from_engine(stage_config.name, stage_config.engine)
    return ThinkerFrontend.build(model, path, limits, max_model_len)


def _encoder_memory(
    frontend: type[ThinkerFrontend],
) -> Callable[[nnx.Module, Path, StageConfig, int, str], ProgramBytes | None]:
    """A thinker part's ``encoder_memory``: ``frontend``'s, with the stage YAML's media limits."""

    def memory(
        model: nnx.Module, path: Path, stage_config: StageConfig, max_model_len: int, platform: str
    ) -> ProgramBytes | None:
        limits = MediaLimits.from_engine(stage_config.name, stage_config.engine)
        return frontend.encoder_memory(model, path, limits, max_model_len, platform)

    return memory


def _talker_frontend(
    cfg: Any, model: nnx.Module, path: Path, stage_config: StageConfig, max_model_len: int
) -> ARFrontend[Any]:
    return TalkerFrontend.build(model, path, stage_config.default_speaker)


_QWEN2_5_OMNI = Architecture(
    name="Qwen2_5OmniForConditionalGeneration",
    stage_yaml="qwen2_5_omni.yaml",
    parts=(
        ModelPart(
            stage="thinker",
            make=_thinker_make,
            rules=lambda cfg: THINKER_RULES_IN_OMNI,
            ignore=lambda cfg: thinker_ignore(ThinkerSpec.from_hf(cfg.thinker_config), prefix="thinker."),
            frontend=_thinker_frontend,
            encoder_memory=_encoder_memory(ThinkerFrontend),
            partition=lambda cfg, model: thinker_partition_rules(
                ThinkerSpec.from_hf(cfg.thinker_config), model
            ),
        ),
        ModelPart(
            stage="talker",
            make=_talker_make,
            rules=lambda cfg: TALKER_RULES_IN_OMNI,
            ignore=lambda cfg: talker_ignore(TalkerSpec.from_hf(cfg.talker_config), prefix="talker."),
            partition=lambda cfg, model: talker_partition_rules(TalkerSpec.from_hf(cfg.talker_config), model),
            frontend=_talker_frontend,
        ),
        ModelPart(
            stage="code2wav",
            make=_token2wav_make,
            rules=lambda cfg: prefixed("token2wav.", "", TOKEN2WAV_RULES),
            ignore=lambda cfg: tuple(r"token2wav\." + p for p in TOKEN2WAV_IGNORE),
            partition=lambda cfg, model: dit_partition_rules(cfg.token2wav_config.dit_config, model),
            dtype="float32",
            generation=GenerationStage(
                build=Code2WavStage.build, demand=solve_demand, engine_options=CODE2WAV_ENGINE_OPTIONS
            ),
        ),
    ),
    side_files=((speakers.TORCH_FILE, speakers.convert_speakers),),
    voiced=("talker", "code2wav"),
    stage_files=(
        StageFile(
            name=speakers.TORCH_FILE,
            what="the voices the talker and code2wav speak with",
            without="the checkpoint serves text only",
            stages=("talker", "code2wav"),
            present=speakers.has_voices,
        ),
    ),
)


def _qwen3_code2wav_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = Code2WavSpec.from_hf(cfg.code2wav_config)
    groups = cfg.talker_config.num_code_groups
    if spec.num_quantizers != groups:  # each frame's codes would be read as other frames'
        raise ValueError(
            f"code2wav_config.num_quantizers={spec.num_quantizers}, but the talker makes {groups} codes a "
            "frame (talker_config.num_code_groups)"
        )
    return lambda: Code2Wav(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _qwen3_thinker_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = qwen3_thinker.ThinkerSpec.from_hf(cfg.thinker_config)
    return lambda: qwen3_thinker.Thinker(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _qwen3_thinker_frontend(
    cfg: Any, model: nnx.Module, path: Path, stage_config: StageConfig, max_model_len: int
) -> ARFrontend[Any]:
    limits = MediaLimits.from_engine(stage_config.name, stage_config.engine)
    return Qwen3ThinkerFrontend.build(model, path, limits, max_model_len)


def _qwen3_talker_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = qwen3_talker.TalkerSpec.from_hf(cfg.talker_config)
    return lambda: qwen3_talker.Talker(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _qwen3_talker_frontend(
    cfg: Any, model: nnx.Module, path: Path, stage_config: StageConfig, max_model_len: int
) -> ARFrontend[Any]:
    return Qwen3TalkerFrontend.build(model, path, cfg, stage_config.default_speaker)


_QWEN3_OMNI = Architecture(
    name="Qwen3OmniMoeForConditionalGeneration",
    stage_yaml="qwen3_omni.yaml",
    parts=(
        ModelPart(
            stage="thinker",
            make=_qwen3_thinker_make,
            rules=lambda cfg: qwen3_thinker.THINKER_RULES_IN_OMNI,
            ignore=lambda cfg: qwen3_thinker.thinker_ignore(
                qwen3_thinker.ThinkerSpec.from_hf(cfg.thinker_config), prefix="thinker."
            ),
            partition=lambda cfg, model: qwen3_thinker.thinker_partition_rules(
                qwen3_thinker.ThinkerSpec.from_hf(cfg.thinker_config), model
            ),
            frontend=_qwen3_thinker_frontend,
            encoder_memory=_encoder_memory(Qwen3ThinkerFrontend),
        ),
        ModelPart(
            stage="talker",
            make=_qwen3_talker_make,
            rules=lambda cfg: prefixed("talker.", "", qwen3_talker.TALKER_RULES),
            ignore=lambda cfg: qwen3_talker.talker_ignore(
                qwen3_talker.TalkerSpec.from_hf(cfg.talker_config), prefix="talker."
            ),
            partition=lambda cfg, model: qwen3_talker.talker_partition_rules(
                qwen3_talker.TalkerSpec.from_hf(cfg.talker_config), model
            ),
            frontend=_qwen3_talker_frontend,
        ),
        ModelPart(
            stage="code2wav",
            make=_qwen3_code2wav_make,
            rules=lambda cfg: prefixed("code2wav.", "", CODE2WAV_RULES),
            ignore=lambda cfg: tuple(r"code2wav\." + p for p in CODE2WAV_IGNORE),
            generation=GenerationStage(
                build=Qwen3Code2WavStage.build,
                demand=qwen3_code2wav_demand,
                engine_options=QWEN3_CODE2WAV_ENGINE_OPTIONS,
            ),
        ),
    ),
    restack=qwen3_talker.stack_talker_readers,
    voiced=("talker", "code2wav"),
)

ARCHITECTURES: dict[str, Architecture] = {
    "Qwen2ForCausalLM": Architecture(
        name="Qwen2ForCausalLM",
        stage_yaml="qwen2.yaml",
        parts=(
            ModelPart(
                stage="llm",
                make=_qwen2_make,
                rules=lambda cfg: qwen2.CAUSAL_LM_RULES,
                ignore=lambda cfg: qwen2.causal_lm_ignore(qwen2.Qwen2Spec.from_hf(cfg)),
                partition=lambda cfg, model: qwen2.partition_rules(qwen2.Qwen2Spec.from_hf(cfg), model),
            ),
        ),
    ),
    _QWEN2_5_OMNI.name: _QWEN2_5_OMNI,
    # The name early hub releases of Qwen2.5-Omni carry in config.json.
    "Qwen2_5OmniModel": _QWEN2_5_OMNI,
    _QWEN3_OMNI.name: _QWEN3_OMNI,
}


def architecture_names(arch: Architecture) -> list[str]:
    """The HF ``architectures`` names :data:`ARCHITECTURES` serves ``arch`` under (its aliases)."""
    return [name for name, served in ARCHITECTURES.items() if served is arch]


def architecture_of(hf_config: Any) -> Architecture:
    """The :class:`Architecture` serving ``hf_config``: the first of its ``architectures`` names
    that :data:`ARCHITECTURES` holds; for a config that names none, the one its ``model_type``
    maps to in transformers' auto classes (:func:`auto_architectures`, as ``AutoModel`` loads
    it). ``ValueError`` naming them and the supported ones otherwise, so an unserved checkpoint
    is refused before anything is built from it."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    for n in names or auto_architectures(model_type):
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]
    found = repr(names) if names else f"(none named; model_type {model_type!r})"
    raise ValueError(f"unsupported architecture {found}; supported: {sorted(ARCHITECTURES)}")


def auto_architectures(model_type: str | None) -> list[str]:
    """The names of :data:`ARCHITECTURES` that transformers' auto classes map ``model_type`` to
    (``"qwen2"``: ``Qwen2ForCausalLM``)."""
    from transformers.models.auto import modeling_auto

    mapped: set[str] = set()
    for key, table in vars(modeling_auto).items():
        if key.endswith("_MAPPING_NAMES") and isinstance(table, dict) and model_type in table:
            value = table[model_type]
            mapped.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(mapped & set(ARCHITECTURES))
