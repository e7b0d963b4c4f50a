"""omni_jax: a JAX/Flax inference engine for multi-stage omni models.

The exports load on first use (PEP 562): ``import omni_jax.cli`` for ``omni-jax --help`` or a
command-line mistake does not import JAX, which takes seconds."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_jax.async_pipeline import AsyncOmniJaxPipeline, QueueFullError
    from omni_jax.engine.sampling import ParamError, SamplingParams
    from omni_jax.outputs import OmniRequestOutput, StageOutput
    from omni_jax.pipeline import OmniJaxPipeline
    from omni_jax.stages.code2wav_params import Token2WavParams

_EXPORTS = {
    "AsyncOmniJaxPipeline": "omni_jax.async_pipeline",
    "OmniJaxPipeline": "omni_jax.pipeline",
    "OmniRequestOutput": "omni_jax.outputs",
    "ParamError": "omni_jax.engine.sampling",
    "QueueFullError": "omni_jax.async_pipeline",
    "SamplingParams": "omni_jax.engine.sampling",
    "StageOutput": "omni_jax.outputs",
    "Token2WavParams": "omni_jax.stages.code2wav_params",
}
__all__ = [
    "AsyncOmniJaxPipeline",
    "OmniJaxPipeline",
    "OmniRequestOutput",
    "ParamError",
    "QueueFullError",
    "SamplingParams",
    "StageOutput",
    "Token2WavParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """An export, imported from its module the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'omni_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
