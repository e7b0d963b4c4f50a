"""Which model classes, parameter maps and stage graph serve each HF architecture."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from omni_jax.models import qwen2
from omni_jax.models.param_map import ParamRule


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """One stage's model inside a checkpoint: how to build it and where its tensors go.

    ``make(hf_config, dtype)`` returns a zero-argument constructor (run under
    ``nnx.eval_shape`` so nothing is allocated); ``rules``/``ignore`` see full HF names.
    """

    stage: str
    make: Callable[[Any, Any], Callable[[], nnx.Module]]
    rules: Callable[[Any], tuple[ParamRule, ...]]
    ignore: Callable[[Any], tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    stage_yaml: str
    parts: tuple[ModelPart, ...]

    def part(self, stage: str) -> ModelPart:
        for p in self.parts:
            if p.stage == stage:
                return p
        raise ValueError(f"{self.name} has no stage {stage!r} (stages: {[p.stage for p in self.parts]})")


def _qwen2_make(cfg: Any, dtype: Any) -> Callable[[], nnx.Module]:
    spec = qwen2.Qwen2Spec.from_hf(cfg)
    return lambda: qwen2.Qwen2ForCausalLM(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


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
            ),
        ),
    ),
}


def architecture_of(hf_config: Any) -> Architecture:
    names = list(getattr(hf_config, "architectures", None) or [])
    for n in names:
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]
    raise ValueError(
        f"unsupported architecture {names or getattr(hf_config, 'model_type', None)!r}; "
        f"supported: {sorted(ARCHITECTURES)}"
    )
