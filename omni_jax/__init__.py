"""omni_jax: a JAX/Flax inference engine for multi-stage omni models."""

from omni_jax.async_pipeline import AsyncOmniJaxPipeline, QueueFullError
from omni_jax.engine.sampling import ParamError, SamplingParams
from omni_jax.outputs import OmniRequestOutput, StageOutput
from omni_jax.pipeline import OmniJaxPipeline
from omni_jax.stages.code2wav_params import Token2WavParams

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
