"""What ``OmniJaxPipeline.run`` returns for each prompt (the public contract)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass
class StageOutput:
    """One stage's result for one request."""

    token_ids: list[int]
    finish_reason: str | None = None
    hidden_states: np.ndarray | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class OmniRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    stage_outputs: dict[str, StageOutput] = dataclasses.field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    logprobs: list[dict[int, float]] | None = None

    def save_wav(self, path: str | Path) -> Path:
        """Write :attr:`audio` as a 32-bit float WAV at :attr:`sample_rate`; returns the path."""
        if self.audio is None or self.sample_rate is None:
            raise ValueError(f"request {self.request_id} has no audio")
        from scipy.io import wavfile  # a dependency of jax

        wavfile.write(str(path), self.sample_rate, np.asarray(self.audio, np.float32))
        return Path(path)
