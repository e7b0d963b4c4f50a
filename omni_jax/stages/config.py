"""Stage graph configs: which stages an architecture has and how each is run."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeVar

import yaml

from omni_jax.engine.sampling import SamplingParams, is_int
from omni_jax.parallel.mesh import mesh_shape
from omni_jax.stages.code2wav_params import Token2WavParams

SHIPPED_DIR = Path(__file__).parent
"""Where the shipped stage YAMLs (one per architecture) live."""
P = TypeVar("P")


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One stage of the graph.

    ``kind``: ``"ar"`` (scheduler + KV cache + sampler) or ``"generation"`` (one batched solve).
    ``input``: ``"prompt"`` or the name of the stage that feeds it (when that stage is not built,
    the user's prompt feeds it instead). ``final_output``: ``"text"`` or ``"audio"``.
    ``default_sampling``: fields of the stage's params (``SamplingParams`` / ``Token2WavParams``)
    used when ``run()`` gets none. ``default_speaker``: the voice when a prompt names none.
    ``engine``: engine settings (``max_batch``, ``max_codes``, ``max_solve_codes``, ``stream``
    for a generation stage; for an AR stage ``early_start`` when it reads the previous one's
    hidden states, ``output_hidden_states``, a thinker's ``limit_mm_per_prompt``, and its own
    sizes, :data:`~omni_jax.stages.ar.STAGE_SIZES`).
    ``mesh``: ``{"data": D, "model": M}`` for this stage (default: ``from_pretrained(mesh=...)``).
    ``devices``: indices into ``jax.devices()`` the stage runs on (default: the first ``D * M``);
    without ``mesh`` they are all split over ``model``.
    ``needs_input``: the stage cannot read a user's prompt (the talker reads the thinker's
    hidden states), so it is never built without its ``input`` stage.
    """

    name: str
    kind: str
    input: str
    final_output: str | None = None
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    default_speaker: str | None = None
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: dict[str, int] | None = None
    devices: list[int] | None = None
    needs_input: bool = False

    def __post_init__(self) -> None:
        """Every setting's type and value, naming the stage and the key: checked when the YAML is
        read, before any weight is, so that a deployment's mistake is not found by its first
        request (a bad default would refuse every request as if its client had erred)."""
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a stage's name must be a non-empty string, got {self.name!r}")
        if self.kind not in ("ar", "generation"):
            raise ValueError(f"stage {self.name!r}: kind must be 'ar' or 'generation', not {self.kind!r}")
        if not isinstance(self.input, str):
            raise ValueError(
                f"stage {self.name!r}: input must be 'prompt' or a stage's name, got {self.input!r}"
            )
        if self.final_output not in (None, "text", "audio"):
            raise ValueError(
                f"stage {self.name!r}: final_output must be 'text' or 'audio', not {self.final_output!r}"
            )
        for key in ("default_sampling", "engine"):
            if not isinstance(getattr(self, key), dict):
                raise ValueError(f"stage {self.name!r}: {key} must be a mapping, got {getattr(self, key)!r}")
        if self.default_speaker is not None and not isinstance(self.default_speaker, str):
            raise ValueError(
                f"stage {self.name!r}: default_speaker must be a voice's name, got {self.default_speaker!r}"
            )
        if not isinstance(self.needs_input, bool):
            raise ValueError(
                f"stage {self.name!r}: needs_input must be true or false, got {self.needs_input!r}"
            )
        if self.mesh is not None:
            try:
                mesh_shape(self.mesh)
            except ValueError as e:
                raise ValueError(f"stage {self.name!r}: {e}") from None
        if self.devices is not None and not (
            isinstance(self.devices, list)
            and self.devices
            and all(is_int(d) and d >= 0 for d in self.devices)
        ):
            raise ValueError(
                f"stage {self.name!r}: devices must be a non-empty list of device indices, "
                f"got {self.devices!r}"
            )
        self.default_params(SamplingParams if self.kind == "ar" else Token2WavParams)

    def engine_int(self, key: str, default: int) -> int:
        """The ``engine`` setting ``key`` (``default`` when absent), a positive integer;
        ``ValueError`` naming the stage and the key for anything else (``"8"``, ``2.7`` or
        ``true`` are not read as numbers)."""
        value = self.engine.get(key, default)
        if not is_int(value) or value < 1:
            raise ValueError(f"stage {self.name!r}: engine.{key}={value!r} must be a positive integer")
        return value

    def check_engine_keys(self, known: tuple[str, ...]) -> None:
        """``ValueError`` naming the stage and every ``engine`` key outside ``known`` (the keys
        the stage reads): a typo would otherwise be a silent default."""
        unknown = sorted(set(self.engine) - set(known))
        if unknown:
            raise ValueError(f"stage {self.name!r}: unknown engine keys {unknown} (known: {list(known)})")

    def default_params(self, params_type: type[P], overrides: dict[str, Any] | None = None) -> P:
        """``params_type(**default_sampling, **overrides)``, checked: ``ValueError`` naming the
        stage for an unknown key or a value the params refuse."""
        values = {**self.default_sampling, **(overrides or {})}
        unknown = set(values) - {f.name for f in dataclasses.fields(params_type)}  # type: ignore[arg-type]
        if unknown:
            raise ValueError(
                f"stage {self.name!r}: unknown default_sampling keys {sorted(unknown)} "
                f"(a {self.kind!r} stage takes {params_type.__name__}'s fields)"
            )
        params = params_type(**values)
        try:
            params.validate()  # type: ignore[attr-defined]
        except ValueError as e:
            where = "default_sampling" if not overrides else "default_sampling with generation_config.json's"
            raise ValueError(f"stage {self.name!r}: {where}: {e}") from None
        return params


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``allow_shared_devices``: stages whose ``devices`` lists overlap are refused unless set."""

    architecture: str
    stages: tuple[StageConfig, ...]
    allow_shared_devices: bool = False

    def check_architecture(self, names: Collection[str], checkpoint: Path) -> None:
        """``ValueError`` when the config is written for another architecture than
        ``checkpoint``'s, served under ``names`` (an architecture's aliases: early hub releases
        of Qwen2.5-Omni name it ``Qwen2_5OmniModel``): its stages, defaults and engine settings
        are another model's, and stage names they share would load without complaint."""
        if self.architecture not in names:
            raise ValueError(
                f"the stage config is for {self.architecture}, but {checkpoint} is a "
                f"{' / '.join(sorted(names))} checkpoint: start from that architecture's YAML in "
                f"{SHIPPED_DIR}"
            )

    def select(self, names: list[str] | None) -> PipelineConfig:
        """The stages ``names`` lists (``None``: all the config has), as a graph that runs: the
        first takes the prompt, each later one reads the one before it (stage i is fed stage
        i - 1's results); ``ValueError`` naming the stage otherwise."""
        known = [s.name for s in self.stages]
        unknown = [n for n in names or [] if n not in known]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; {self.architecture} has {known}")
        chosen = tuple(s for s in self.stages if names is None or s.name in names)
        built = f"stages={names} does not build" if names is not None else "the stage config does not list"
        if chosen and chosen[0].needs_input:
            raise ValueError(
                f"stage {chosen[0].name!r} reads {chosen[0].input!r}'s output and cannot take a prompt; "
                f"build it together with {chosen[0].input!r}"
            )
        for before, s in zip(chosen, chosen[1:], strict=False):  # only the first reads the prompt
            if s.input not in [c.name for c in chosen]:
                raise ValueError(f"stage {s.name!r} reads {s.input!r}'s output, which {built}")
            if s.input != before.name:
                raise ValueError(
                    f"stage {s.name!r} reads {s.input!r}'s output but comes after {before.name!r}: "
                    "each stage reads the one listed before it"
                )
        return dataclasses.replace(self, stages=chosen)

    def with_media_limits(self, limits: dict[str, int]) -> PipelineConfig:
        """The config with ``limits`` as the ``engine.limit_mm_per_prompt`` of each AR stage that
        reads the user's prompt (the thinker; a text model's stage has no media to limit), in
        place of its YAML's."""
        return dataclasses.replace(
            self,
            stages=tuple(
                dataclasses.replace(s, engine={**s.engine, "limit_mm_per_prompt": limits})
                if s.kind == "ar" and s.input == "prompt"
                else s
                for s in self.stages
            ),
        )


VLLM_OMNI_FORMAT = (
    "a vLLM-omni stage config (stage_args), not omni_jax's: an omni_jax stage YAML has "
    "'architecture' (engine_args.model_arch) and 'stages', each with 'name' (engine_args.model_stage), "
    "'kind' (ar, or generation for code2wav), 'input' (the stage engine_input_source names, or prompt), "
    "'final_output' (final_output_type), 'default_sampling' (default_sampling_params), 'devices' "
    "(runtime.devices, as a list) and 'engine' (engine_args' max_num_seqs, max_model_len and "
    f"max_num_batched_tokens); start from the architecture's YAML in {SHIPPED_DIR}"
)
"""The refusal of a vLLM-omni YAML: what each of its settings is called here."""


def load_pipeline_config(yaml_name_or_path: str | Path) -> PipelineConfig:
    """A shipped YAML by file name, or a user's own YAML by path; ``ValueError`` naming the file
    for one that is missing, is not YAML, or is not a stage graph (a user's typo is one line,
    not a traceback)."""
    path = Path(yaml_name_or_path)
    if not path.exists():
        shipped = SHIPPED_DIR / path.name
        if str(path) != path.name or not shipped.is_file():
            raise ValueError(f"stage config {yaml_name_or_path}: no such file")
        path = shipped
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not text
        raise ValueError(
            f"stage config {path}: cannot be read as a YAML file ({e.__class__.__name__})"
        ) from None
    if isinstance(raw, dict) and "stage_args" in raw:
        raise ValueError(f"{path}: {VLLM_OMNI_FORMAT}")
    if not isinstance(raw, dict) or not isinstance(raw.get("stages"), list) or "architecture" not in raw:
        raise ValueError(f"{path}: a stage config is a mapping with 'architecture' and a list of 'stages'")
    extra = sorted(set(raw) - {"architecture", "stages", "allow_shared_devices"})
    if extra:
        raise ValueError(f"{path}: unknown keys {extra} (known: architecture, stages, allow_shared_devices)")
    if not raw["stages"]:
        raise ValueError(f"{path}: 'stages' lists no stage")
    shared = raw.get("allow_shared_devices", False)
    if not isinstance(shared, bool):
        raise ValueError(f"{path}: allow_shared_devices must be true or false, got {shared!r}")
    known = {f.name for f in dataclasses.fields(StageConfig)}
    required = {
        f.name
        for f in dataclasses.fields(StageConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    stages = []
    for i, s in enumerate(raw["stages"]):
        if not isinstance(s, dict):
            raise ValueError(f"{path}: stage {i} is not a mapping of its settings")
        extra, missing = set(s) - known, required - set(s)
        if extra:
            raise ValueError(f"{path}: stage {s.get('name')!r} has unknown keys {sorted(extra)}")
        if missing:
            raise ValueError(f"{path}: stage {s.get('name', i)!r} needs the keys {sorted(missing)}")
        try:
            stages.append(StageConfig(**s))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return PipelineConfig(architecture=raw["architecture"], stages=tuple(stages), allow_shared_devices=shared)
