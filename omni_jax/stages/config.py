"""Stage graph configs: which stages an architecture has and how each is run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

_HERE = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class StageConfig:
    name: str
    kind: str  # "ar" | "generation"
    input: str
    final_output: str | None = None
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    architecture: str
    stages: tuple[StageConfig, ...]

    def select(self, names: list[str] | None) -> PipelineConfig:
        if names is None:
            return self
        known = [s.name for s in self.stages]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; {self.architecture} has {known}")
        return dataclasses.replace(self, stages=tuple(s for s in self.stages if s.name in names))


def load_pipeline_config(yaml_name_or_path: str | Path) -> PipelineConfig:
    """A shipped YAML by file name, or a user's own YAML by path."""
    path = Path(yaml_name_or_path)
    if not path.exists():
        path = _HERE / str(yaml_name_or_path)
    raw = yaml.safe_load(path.read_text())
    stages = []
    for s in raw["stages"]:
        known = {f.name for f in dataclasses.fields(StageConfig)}
        extra = set(s) - known
        if extra:
            raise ValueError(f"{path}: stage {s.get('name')!r} has unknown keys {sorted(extra)}")
        stages.append(StageConfig(**s))
    return PipelineConfig(architecture=raw["architecture"], stages=tuple(stages))
