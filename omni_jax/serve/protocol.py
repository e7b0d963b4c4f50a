"""The OpenAI request schema the server reads (pydantic), and how a refusal reads.

Requests are parsed into these records before anything else happens, so a field of the wrong type
or value is a 400 naming it (:func:`invalid_request_message`). Types are strict, as OpenAI's API
holds them: ``"8"`` is not a number nor ``true`` an integer (an integer is a number). Fields
OpenAI defines that the server does not serve (``tools``, ``echo``, ...) and unknown fields
are refused by name rather than ignored, as OpenAI's own API does; ``response_format`` is taken
when it asks for plain text (SDKs send ``{"type": "text"}`` by default) and refused otherwise.
Log-probabilities are served, with up to :data:`MAX_TOP_LOGPROBS` most likely tokens beside
each, and so are the sampling fields vLLM adds (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``). OpenAI's
bookkeeping fields are taken and change nothing: ``user``, ``metadata``, ``service_tier`` (one
tier is served), ``store: false`` (nothing is stored: ``true`` is refused).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on ``top_logprobs`` (vLLM's ``max_logprobs`` default, which it also holds a
completion's ``logprobs`` to): beyond it a request is refused by the schema, naming the field;
the engine's own bound (``SamplingParams.logprobs``) is the same."""


MAX_N = 128
"""OpenAI's bound on ``n``, the replies a request asks for (each an engine request)."""


class FieldError(ValueError):
    """What the server cannot serve in one field of a request: a 400 whose ``param`` names it."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Strict):
    data: str = Field(description="base64 of an audio file (told apart by its bytes)")
    format: Literal["wav", "mp3"]


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(_Strict):
    url: str = Field(description="a data URL (or an allowed file URL) of an audio file: WAV, mp3, flac, ...")


class AudioURLPart(_Strict):
    """vLLM's audio part: a URL where ``input_audio`` carries the base64 alone."""

    type: Literal["audio_url"]
    audio_url: AudioURL


class VideoURL(_Strict):
    url: str = Field(
        description="a data URL (or an allowed file URL) of a video file (mp4, webm, ...) or a .npy array "
        "[frames, H, W, 3]"
    )


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[
    TextPart | ImagePart | AudioPart | AudioURLPart | VideoPart, Field(discriminator="type")
]


class AssistantAudio(_Strict):
    """An earlier spoken reply, by its audio's id (OpenAI's multi-turn audio): it stands for
    what that reply said (:class:`~omni_jax.serve.transcripts.Transcripts`)."""

    id: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = Field(
        None,
        description="null or absent only in an assistant message (an earlier turn that said nothing, "
        "or one whose audio is given)",
    )
    name: str | None = None
    audio: AssistantAudio | None = None

    @model_validator(mode="after")
    def _content_given(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs content", {"role": self.role})
        return self

    @field_validator("audio")
    @classmethod
    def _assistant_audio(cls, audio: AssistantAudio | None, info: ValidationInfo) -> AssistantAudio | None:
        if audio is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError(
                "assistant_only", "only an assistant message has audio (an earlier spoken reply)", {}
            )
        return audio


AudioFormat = Literal["wav", "pcm16", "mp3", "flac", "opus", "aac"]
"""OpenAI's audio output formats; a streamed reply's chunks are ``wav`` or ``pcm16``."""

STREAMED_AUDIO_FORMATS = ("wav", "pcm16")


class AudioOutput(_Strict):
    voice: str
    format: AudioFormat = "wav"


class TextFormat(_Strict):
    """``response_format`` as many SDKs send it by default: plain text, what every reply is (no
    guided decoding: ``json_object`` and ``json_schema`` are refused)."""

    type: Literal["text"]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk carries its choice's tokens so far."""
    include_obfuscation: bool = True
    """OpenAI's: pads each chunk with random characters against length side channels, which a
    client may turn off to save bytes. This server never pads, so either value is served."""


class _Sampling(_Strict):
    """The sampling fields both endpoints take; ``None``: the stage's default (its YAML).
    ``model`` may be left out, as vLLM's server allows: the served model."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, description="no reply is stored: a request asking to store is refused")
    service_tier: str | None = Field(None, description="one tier is served, whatever is asked")

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: object, info: ValidationInfo) -> object:
        """OpenAI types ``n`` and ``stream`` as nullable, null meaning the default (vLLM's
        ``Optional[int] = 1``, ``Optional[bool] = False``): clients that send every field send
        them as null."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store: bool | None) -> bool | None:
        """``false`` only, a strict bool: pydantic's ``Literal[False]`` took ``0`` and ``0.0``
        (equal to ``False`` in Python), strict mode or not."""
        if store:
            raise PydanticCustomError("literal_error", "Input should be False", {})
        return store


class ProcessorKwargs(_Strict):
    """vLLM's ``mm_processor_kwargs`` of a chat request: how its media are read."""

    use_audio_in_video: bool = False
    fps: float | None = Field(None, gt=0, allow_inf_nan=False)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    mm_processor_kwargs: ProcessorKwargs | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)
    audio: AudioOutput | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: TextFormat | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` written with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    mm_processor_kwargs: ProcessorKwargs | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("missing", "give 'prompt' or 'messages', one of them", {})
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


UNION_MEMBER = re.compile(r"\[|^(str|int|float|bool|bytes|none)$")
"""A location part that names a union's member (``str``, ``list[int]``, ``tagged-union[...]``),
which pydantic puts in an error's location: not a field of the request."""


def _tag(loc: tuple[int | str, ...], i: int) -> bool:
    """Whether ``loc[i]`` is the tag pydantic names a list item of a tagged union by (after the
    item's index: ``content.<list[tagged-union[...]]>.0.input_audio.input_audio.format``)."""
    return i >= 2 and isinstance(loc[i - 1], int) and "tagged-union[" in str(loc[i - 2])


def _path(loc: tuple[int | str, ...]) -> str | None:
    kept = [
        p for i, p in enumerate(loc) if isinstance(p, int) or not (UNION_MEMBER.search(p) or _tag(loc, i))
    ]
    return ".".join(str(p) for p in kept) or None


def invalid_request_message(error: ValidationError) -> tuple[str, str | None]:
    """The problem pydantic found as ``(message, param)``: the field's dotted path and what is
    wrong with it, e.g. ``("messages.0.role: Input should be 'system', ...", "messages.0.role")``.
    A field that takes several types (``content``, ``prompt``) fails once per type: the deepest
    location is where the problem is, and a value no type takes gets every type's complaint; an
    unknown field is named only when nothing else is wrong."""
    errors = error.errors()
    # A field the schema does not know is the lesser complaint: a message of a role not served
    # (``tool``) also has its role's own fields (``tool_call_id``), and the role is the problem.
    errors = [e for e in errors if e["type"] != "extra_forbidden"] or errors
    param = max((_path(e["loc"]) for e in errors), key=lambda p: len(p or ""))
    first = next(e for e in errors if _path(e["loc"]) == param)
    if first["type"] == "extra_forbidden":
        return f"unsupported field {param!r}", param
    if first["type"] in ("json_invalid", "model_type") and param is None:
        return f"the body is not a JSON object: {first['msg']}", None
    complaints = list(dict.fromkeys(e["msg"] for e in errors if _path(e["loc"]) == param))
    text = "; or ".join(complaints)
    return (f"{param}: {text}" if param else text), param
