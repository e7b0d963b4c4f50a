"""What ``OmniJaxPipeline.run`` returns for each prompt, and what
``AsyncOmniJaxPipeline.generate`` yields as a request advances (the public contract)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.audio_io import SampleFormat, write_wav


@dataclasses.dataclass
class StageOutput:
    """One stage's result for one request.

    ``hidden_states``: where the stage's YAML asks (an AR stage's ``engine.output_hidden_states:
    true``), ``[N, D]``, the hidden state of each of the ``N = len(prompt) + len(reply) - 1``
    computed tokens (the prompt's, then the reply's but the last, never computed): transformers'
    ``last_hidden_state`` (normed), or the layer the next stage reads when it reads another
    (Qwen3-Omni's talker: the thinker's ``accept_hidden_layer``). ``None`` elsewhere, and for a
    request the stage failed."""

    token_ids: list[int]
    finish_reason: str | None = None
    hidden_states: np.ndarray | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class OmniRequestOutput:
    """One request's output.

    ``OmniJaxPipeline.run`` returns it whole, once the request is done (``finished``).
    ``AsyncOmniJaxPipeline.generate`` yields it as updates: each one carries what is new since
    the previous one in the ``*_delta`` fields (``text_delta`` and ``token_ids_delta``: the text
    stage's new tokens and the text they complete; ``logprobs_delta``: those tokens'
    log-probabilities, when the text stage's ``SamplingParams.logprobs`` asks for them;
    ``audio_delta``: new samples, chunk by chunk when the request's code2wav streams
    (``Token2WavParams(stream=True)``), else the whole waveform when the audio stage finishes).
    Only the last update (``finished``, with its ``finish_reason``) fills the other fields, with
    the whole output as ``run`` returns it; the deltas of all updates add up to its
    ``token_ids``, ``logprobs``, ``text`` and ``audio``. Except when a stage fails it
    (``finish_reason="error"`` with the stage's message): its last update is what ``run`` gives
    a failed request, without the tokens it streamed before the fault. An abort, or a fault
    outside the stages, keeps what was streamed.

    ``text``: the text of ``token_ids`` (the text stage's), cut at a stop string; as in vLLM,
    without the text of a last token that stopped the stage (a stop id or EOS) unless
    ``SamplingParams.include_stop_str_in_output``.

    ``logprobs`` (vLLM's form): one dict per output token, token id -> log-probability under
    the model's log-softmax: the sampled token first, then the ``SamplingParams.logprobs`` most
    likely tokens (one entry fewer when the sampled token is among them).
    """

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
    text_delta: str = ""
    token_ids_delta: list[int] = dataclasses.field(default_factory=list)
    logprobs_delta: list[dict[int, float]] = dataclasses.field(default_factory=list)
    audio_delta: np.ndarray | None = None
    finished: bool = False

    def save_wav(self, path: str | Path, sample_format: SampleFormat = "pcm16") -> Path:
        """Write :attr:`audio` as a mono WAV at :attr:`sample_rate`; returns the path.

        ``"pcm16"`` (the default): 16-bit integer PCM, what Python's ``wave``, browsers and
        most players read; samples are clipped to [-1, 1] and rounded. ``"float32"``: the
        samples as they are (IEEE float WAV, which ``wave`` and some players cannot open).
        """
        if self.audio is None or self.sample_rate is None:
            raise ValueError(f"request {self.request_id} has no audio")
        write_wav(path, self.audio, self.sample_rate, sample_format)
        return Path(path)


@dataclasses.dataclass(frozen=True)
class StageWarmup:
    """One stage's part of :meth:`OmniJaxPipeline.warmup`.

    programs: the programs its bucket set holds, every one compiled (or loaded from the
    persistent compilation cache) by the warm-up; compiles: the XLA compilations counted
    meanwhile (fewer than ``programs`` when the cache held some); loads: the executables loaded
    from that cache instead; seconds: its wall time.
    """

    programs: int
    compiles: int
    loads: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What :meth:`OmniJaxPipeline.warmup` compiled, per stage in pipeline order."""

    stages: dict[str, StageWarmup]

    @property
    def programs(self) -> int:
        return sum(s.programs for s in self.stages.values())

    @property
    def compiles(self) -> int:
        return sum(s.compiles for s in self.stages.values())

    @property
    def loads(self) -> int:
        return sum(s.loads for s in self.stages.values())

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages.values())
