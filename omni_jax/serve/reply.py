"""One served request's reply as it is produced: text pieces, audio pieces, then its end.

Both the streaming and the whole-response paths read a request through :func:`reply`, so usage,
finish reasons and the metrics are worked out once (stop strings are the engine's: it cuts the
text and ends the request with ``finish_reason="stop"``). The first event comes with
the request's first update, after admission: a request the stages refuse raises ``ValueError``
(``QueueFullError`` when the queue is full) before it, while the HTTP status can still say so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np

from omni_jax.async_pipeline import AsyncOmniJaxPipeline
from omni_jax.serve.convert import Choice
from omni_jax.serve.metrics import ServeMetrics

log = logging.getLogger("omni_jax.serve")


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclasses.dataclass(frozen=True)
class Piece:
    """New output: reply text and/or audio samples (``sample_rate`` set with ``audio``), and the
    log-probabilities of the new tokens when the request asked (the tokens whose text a stop
    string cut off included, as vLLM reports them)."""

    text: str = ""
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    usage: Usage | None = None
    """The reply's tokens so far (vLLM's ``continuous_usage_stats`` put them in each chunk)."""


@dataclasses.dataclass(frozen=True)
class End:
    """The request ended: ``finish_reason`` is ``"stop"``, ``"length"``, or ``"error"`` with
    ``error`` (a stage failed it: the client gets the message, the server goes on)."""

    finish_reason: str
    usage: Usage
    error: str | None = None
    sample_rate: int | None = None
    """Of the request's audio, when a stage made audio for it (a reply may have zero samples)."""


async def reply(
    pipe: AsyncOmniJaxPipeline,
    request: Choice,
    request_id: str,
    metrics: ServeMetrics,
    arrival: float,
    admitted: asyncio.Event | None = None,
) -> AsyncIterator[Piece | End]:
    """The request's pieces, then one :class:`End`. Closing the iterator early (a client gone)
    aborts the request in the engine and counts it as ended with ``"abort"``, as vLLM's metrics
    do. ``arrival``: ``time.perf_counter()`` when it came; ``admitted``: set when the engine has
    taken it in (:meth:`AsyncOmniJaxPipeline.generate`).

    Prompt tokens count at the request's first update (it was admitted), reply tokens as they
    come, so an aborted request's work is in the counters too; a refused one (``ValueError``
    before any update) counts nowhere here (the app counts it by status)."""
    updates = pipe.generate(
        request.prompt,
        request.sampling_params_list,
        request_id=request_id,
        within_context=request.within_context,
        admitted=admitted,
    )
    first_text = first_audio = True
    prompt_tokens: int | None = None
    tokens = 0
    ended = False
    try:
        async for out in updates:
            if prompt_tokens is None:
                prompt_tokens = len(out.prompt_token_ids)
                metrics.prompt_tokens.inc(prompt_tokens)
            tokens += len(out.token_ids_delta)
            metrics.generation_tokens.inc(len(out.token_ids_delta))
            text = out.text_delta
            if text and first_text:
                metrics.ttft.observe(time.perf_counter() - arrival)
                first_text = False
            audio = out.audio_delta if out.audio_delta is not None and out.audio_delta.size else None
            if audio is not None:
                if first_audio:
                    metrics.ttfa.observe(time.perf_counter() - arrival)
                    first_audio = False
                metrics.audio_seconds.inc(audio.size / out.sample_rate)
            yield Piece(
                text,
                audio,
                out.sample_rate if audio is not None else None,
                out.logprobs_delta,
                Usage(prompt_tokens, tokens),
            )
            if out.finished:
                reason = out.finish_reason or "stop"
                ended = True
                if reason == "error":  # the client gets the message; the operator's log too
                    log.warning("request %s failed: %s", request_id, out.error)
                metrics.requests.labels(reason).inc()
                metrics.e2e.observe(time.perf_counter() - arrival)
                yield End(
                    reason,
                    Usage(prompt_tokens, tokens),
                    out.error if reason == "error" else None,
                    out.sample_rate,
                )
                return
    except (GeneratorExit, asyncio.CancelledError):
        if not ended:  # closed or cancelled by the reader before the end: the client went away
            metrics.requests.labels("abort").inc()
        raise
    finally:
        await updates.aclose()  # before the last update: aborts the request
