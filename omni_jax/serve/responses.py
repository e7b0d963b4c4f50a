"""OpenAI's response JSON: chat completions, completions, their stream chunks, audio, errors.

Audio goes out as OpenAI's ``audio`` object (``id``, base64 ``data``, ``transcript``,
``expires_at``) in the format asked: ``"wav"``, a whole WAV file (in a stream, each chunk is a
WAV file of its own, playable alone), ``"pcm16"``, raw little-endian 16-bit samples at the
stage's rate (24 kHz for Qwen2.5-Omni), which concatenate, or, for a reply served whole,
``"mp3"``, ``"flac"`` (the WAV's 16-bit samples, losslessly), ``"opus"`` (Ogg) or ``"aac"``
(ADTS), encoded with FFmpeg (:func:`~omni_jax.media_files.encode_audio`).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from omni_jax.audio_io import pcm16, wav_bytes
from omni_jax.media_files import encode_audio
from omni_jax.serve.protocol import AudioFormat

AUDIO_EXPIRY_S = 3600
"""``expires_at`` is an hour after the request: until then a later request may refer to the
reply by its audio's id (:mod:`omni_jax.serve.transcripts`, which keeps what it said, not the
audio)."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_json(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "error"),
            "param": param,
            "code": status,
        }
    }


def audio_data(samples: np.ndarray, rate: int, fmt: AudioFormat) -> str:
    """Base64 of ``samples`` at ``rate`` Hz in ``fmt`` (see the module docstring)."""
    if fmt == "wav":
        raw = wav_bytes(samples, rate)
    elif fmt == "pcm16":
        raw = pcm16(samples).astype("<i2").tobytes()
    else:
        raw = encode_audio(samples, rate, fmt)
    return base64.b64encode(raw).decode("ascii")


def audio_json(audio_id: str, expires_at: int, transcript: str, data: str | None = None) -> dict[str, Any]:
    """OpenAI's ``audio`` object. A stream carries the transcript in its text chunks, without
    ``data``, and the samples in chunks of their own, with an empty transcript; one reply's
    chunks share one ``expires_at``."""
    return {
        "id": audio_id,
        **({} if data is None else {"data": data}),
        "transcript": transcript,
        "expires_at": expires_at,
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str,
    audio: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if audio is not None:
        message["audio"] = audio
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_completion(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of choice ``index``; ``delta=None``: the usage chunk (no
    choices)."""
    choices = (
        []
        if delta is None
        else [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
    )
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion(
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` (also each of its stream's chunks, which OpenAI names the same)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()
