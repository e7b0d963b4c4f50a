"""An OpenAI request as the pipeline's prompt and per-stage params (:class:`ServeRequest`).

The request's sampling fields go to the stage that writes the reply text (the first one with
text output); the other stages keep their YAML defaults, seeded by ``seed`` when one is given, so
a seeded request says (and speaks) the same every time, as ``omni-jax run --seed`` does.
``modalities`` defaults to ``["text", "audio"]`` when the request has an ``audio`` object and to
``["text"]`` otherwise (OpenAI's convention); ``audio.voice`` is the prompt's ``speaker``. A
streamed reply's audio is decoded in chunks as the talker speaks (``Token2WavParams(stream=True)``),
so its first audio comes before the talker has finished. What
the stages refuse (an unknown voice, a prompt too long, a bad value) is refused by admission with
the stages' own messages; what only the server can tell is refused here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omni_jax import Token2WavParams
from omni_jax.intake import StageParams
from omni_jax.pipeline import OmniJaxPipeline
from omni_jax.serve import media
from omni_jax.serve.protocol import (
    STREAMED_AUDIO_FORMATS,
    AudioFormat,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    Message,
    ProcessorKwargs,
)

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
)
"""The request fields that are :class:`~omni_jax.SamplingParams` fields of the same name."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request (one of its ``choices``): ``prompt`` and
    ``sampling_params_list`` as :meth:`AsyncOmniJaxPipeline.generate` takes them."""

    prompt: dict[str, Any]
    sampling_params_list: list[StageParams] | StageParams
    within_context: bool = False
    """The request gave ``max_tokens``: it must fit in the context after the prompt (a 400
    otherwise, as vLLM's server answers; without one, the reply stops at the context's end)."""


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """What one HTTP request asks of the pipeline: its prompts (a completion may give several),
    ``n`` replies to each, the stages' params (the text stage's with the request's stop
    strings, which the engine cuts the text at), the audio format asked for (``None``: no
    audio), and how many of the most likely tokens the reply shows beside each token's
    log-probability (``None``: no log-probabilities)."""

    prompts: list[dict[str, Any]]
    sampling_params_list: list[StageParams] | StageParams
    audio_format: AudioFormat | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    """``include_usage``: a last chunk holds the usage; ``continuous_usage``: every chunk holds
    its choice's tokens so far too (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
    logprobs: int | None = None
    within_context: bool = False
    """As :attr:`Choice.within_context`."""
    n: int = 1
    prompt_field: str = "messages"
    """The request field the prompt came from (``messages``, or a completion's ``prompt``): what
    a refusal of the prompt (too long, media a model takes no) names as its ``param``, as
    OpenAI's context-length errors do."""
    listed: bool = False
    """The prompts came as a list (a completion's ``prompt`` of several): a refusal of one names
    it by its place, ``prompt.2``, as a schema error names a list's item."""
    image_parts: tuple[str, ...] = ()
    """The content part each of the prompt's images came from, in the prompt's order of images:
    what a refusal of one (:class:`~omni_jax.image_io.ImageItemError`) names."""
    max_tokens_field: str = "max_tokens"
    """The field the reply's length came from (``max_completion_tokens`` when a chat request
    gave it): what a refusal of that length names."""

    @property
    def replies(self) -> int:
        """How many engine requests it makes: ``n`` per prompt."""
        return len(self.prompts) * self.n

    def prompt_param(self, choice: int) -> str:
        """What a refusal of choice ``choice``'s prompt names: :attr:`prompt_field`, with the
        prompt's place in the list when :attr:`listed` (:meth:`choices` holds each prompt's
        ``n`` together)."""
        return f"{self.prompt_field}.{choice // self.n}" if self.listed else self.prompt_field

    def choices(self) -> list[Choice]:
        """The engine requests, in OpenAI's order of ``choices`` (each prompt's ``n`` together).
        Reply ``j`` of a prompt draws with each seeded stage's seed plus ``j``, as vLLM seeds
        its ``n`` samples: they differ, and a seeded request still repeats itself."""
        return [
            Choice(prompt, _seeded(self.sampling_params_list, j), self.within_context)
            for prompt in self.prompts
            for j in range(self.n)
        ]


def _seeded(params: list[StageParams] | StageParams, offset: int) -> list[StageParams] | StageParams:
    """``params`` with every seed but none and ``-1`` (vLLM's no seed) moved on by ``offset``,
    as the 64-bit word it draws from (so ``-2`` moved on by one is not ``-1``, and the largest
    seed wraps to 0)."""
    if isinstance(params, list):
        return [_seeded(p, offset) for p in params]  # type: ignore[misc]
    if offset == 0 or params.seed is None or params.seed == -1:
        return params
    return dataclasses.replace(params, seed=(params.seed + offset) & (2**64 - 1))


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value or ())
    if any(not s for s in stops):
        raise FieldError("stop", "stop strings must not be empty")
    return stops


def _stage_params(
    pipeline: OmniJaxPipeline, request: ChatCompletionRequest | CompletionRequest, logprobs: int | None
) -> Any:
    """One params object per built stage (one alone for a one-stage pipeline)."""
    text_stage = pipeline.text_stage
    if text_stage is None:
        raise ValueError(
            f"this server's stages {[s.config.name for s in pipeline.stages]} write no text: "
            "it serves no chat or completion requests"
        )
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None}
    max_tokens = _max_tokens(request)
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    stop = _stop(request.stop)
    if stop:
        given["stop"] = list(stop)
    if logprobs is not None:
        given["logprobs"] = logprobs
    params = []
    for i, stage in enumerate(pipeline.stages):
        p = dataclasses.replace(stage.defaults)
        if i == text_stage:
            p = dataclasses.replace(p, **given)
        elif request.seed is not None:
            p = dataclasses.replace(p, seed=request.seed)
        if request.stream and isinstance(p, Token2WavParams):
            p = dataclasses.replace(p, stream=True)  # audio streamed as it is decoded
        params.append(p)
    return params[0] if len(params) == 1 else params


def _max_tokens(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The request's ``max_completion_tokens`` (chat) or else ``max_tokens``; ``None``: neither."""
    return getattr(request, "max_completion_tokens", None) or request.max_tokens


def _usage(request: ChatCompletionRequest | CompletionRequest) -> dict[str, bool]:
    """:class:`ServeRequest`'s ``include_usage`` and ``continuous_usage``."""
    options = request.stream_options
    include = options is not None and options.include_usage
    return {"include_usage": include, "continuous_usage": include and options.continuous_usage_stats}


def _common(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise FieldError("stream_options", "only allowed with stream: true")


def _content(
    where: str, message: Message, reader: media.MediaReader, said: Callable[[str], str | None]
) -> str | list[dict[str, Any]]:
    """A message's content as :meth:`OmniJaxPipeline.chat_prompt` reads it: text parts alone are
    joined into one string (what text-only chat templates expect). An assistant message without
    content but with an earlier reply's ``audio.id`` says what that reply said (``said``)."""
    if message.content is None and message.audio is not None:
        transcript = said(message.audio.id)
        if transcript is None:
            raise FieldError(
                f"{where}.audio.id",
                f"no spoken reply's audio of id {message.audio.id!r} is kept here "
                "(not this server's, or expired)",
            )
        return transcript
    if message.content is None:  # an assistant turn that said nothing
        return ""
    if isinstance(message.content, str):
        return message.content
    items: list[dict[str, Any]] = []
    for i, part in enumerate(message.content):
        at = f"{where}.content.{i}"
        if part.type == "text":
            items.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            items.append({"type": "image", "image": reader.image(f"{at}.image_url", part.image_url.url)})
        elif part.type == "input_audio":
            items.append(
                {"type": "audio", "audio": reader.audio(f"{at}.input_audio.data", part.input_audio.data)}
            )
        elif part.type == "audio_url":
            items.append({"type": "audio", "audio": reader.audio_file(f"{at}.audio_url", part.audio_url.url)})
        else:
            items.append({"type": "video", "video": reader.video(f"{at}.video_url", part.video_url.url)})
    if all(item["type"] == "text" for item in items):
        return "".join(item["text"] for item in items)
    return items


def chat_messages(
    messages: list[Message], reader: media.MediaReader, said: Callable[[str], str | None]
) -> list[dict[str, Any]]:
    """Request messages as :meth:`OmniJaxPipeline.chat_prompt` takes them (``developer`` is the
    template's ``system``), their media read by ``reader`` (the request's own); ``said`` as
    :func:`chat_request`'s."""
    return [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": _content(f"messages.{i}", m, reader, said),
        }
        for i, m in enumerate(messages)
    ]


def processor_kwargs(server: ProcessorKwargs | None, request: ProcessorKwargs | None) -> dict[str, Any]:
    """``mm_processor_kwargs`` as :meth:`OmniJaxPipeline.chat_prompt` takes them: the server's
    (``--mm-processor-kwargs``, vLLM's flag), each overridden by the request's where it sets it;
    only those set (a text model's prompt then holds none)."""
    return {
        **(server.model_dump(exclude_unset=True) if server is not None else {}),
        **(request.model_dump(exclude_unset=True) if request is not None else {}),
    }


def chat_request(
    pipeline: OmniJaxPipeline,
    request: ChatCompletionRequest,
    reader: media.MediaReader,
    said: Callable[[str], str | None],
    defaults: ProcessorKwargs | None = None,
) -> ServeRequest:
    """``ValueError`` naming the field for what the server cannot serve. ``reader``: the
    request's media reader; ``said``: what an earlier spoken reply said, by its audio's id
    (``None``: not kept); ``defaults``: the server's ``mm_processor_kwargs``."""
    _common(request)
    messages = chat_messages(request.messages, reader, said)
    modalities = request.modalities or (["text", "audio"] if request.audio is not None else ["text"])
    wants_audio = "audio" in modalities
    if wants_audio and not pipeline.speaks:
        raise FieldError(
            "modalities" if request.modalities else "audio",
            f"this server's stages {[s.config.name for s in pipeline.stages]} write text only: "
            "it answers with text, not audio",
        )
    if wants_audio and request.stream and request.audio is not None:
        if request.audio.format not in STREAMED_AUDIO_FORMATS:
            raise FieldError(
                "audio.format",
                f"a streamed reply's audio comes in {list(STREAMED_AUDIO_FORMATS)} chunks (OpenAI streams "
                f"pcm16 alone); {request.audio.format} is served whole, with stream: false",
            )
    if _stop(request.stop) and wants_audio:
        raise FieldError("stop", "stop strings are served for text output only (modalities ['text'])")
    if request.top_logprobs is not None and not request.logprobs:
        raise FieldError("top_logprobs", "asked without logprobs: true")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _stage_params(pipeline, request, logprobs)
    prompt = pipeline.chat_prompt(messages, **processor_kwargs(defaults, request.mm_processor_kwargs))
    if pipeline.speaks or wants_audio:
        prompt["modalities"] = list(modalities)
    if wants_audio and request.audio is not None:
        prompt["speaker"] = request.audio.voice
    return ServeRequest(
        prompts=[prompt],
        sampling_params_list=params,
        audio_format=(request.audio.format if request.audio is not None else "wav") if wants_audio else None,
        stream=request.stream,
        **_usage(request),
        logprobs=logprobs,
        within_context=_max_tokens(request) is not None,
        n=request.n,
        max_tokens_field="max_completion_tokens" if request.max_completion_tokens else "max_tokens",
        image_parts=tuple(reader.image_parts),
    )


def completion_request(pipeline: OmniJaxPipeline, request: CompletionRequest) -> ServeRequest:
    """A completion is text only, whatever stages follow the text stage. ``prompt`` may be a
    list of prompts (texts or token-id lists), each with ``n`` choices of its own, as in
    OpenAI's API."""
    _common(request)
    value = request.prompt
    several = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
    prompts: list[dict[str, Any]] = []
    for one in value if several else [value]:  # type: ignore[union-attr]
        prompt: dict[str, Any] = {"prompt": one} if isinstance(one, str) else {"prompt_token_ids": list(one)}
        if pipeline.speaks:
            prompt["modalities"] = ["text"]
        prompts.append(prompt)
    return ServeRequest(
        prompts=prompts,
        sampling_params_list=_stage_params(pipeline, request, request.logprobs),
        audio_format=None,
        stream=request.stream,
        **_usage(request),
        logprobs=request.logprobs,
        within_context=_max_tokens(request) is not None,
        n=request.n,
        prompt_field="prompt",
        listed=several,
    )
