"""The one small interface the pipeline drives every stage through, AR or generation.

The engine core (:mod:`omni_jax.engine_core`) only validates, submits, steps, aborts and asks
whether work is left; how a stage batches (continuous batching over a paged KV cache, or one
padded solve) stays inside the stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from omni_jax.engine.sampling import ParamError, SamplingParams
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.config import StageConfig

S = TypeVar("S")

StageParams = SamplingParams | Token2WavParams
"""One stage's params for one request: an AR stage's :class:`SamplingParams`, a code2wav stage's
:class:`Token2WavParams` (:attr:`Stage.params_type` says which)."""


@dataclasses.dataclass
class StageInput(Generic[S]):
    """What a stage consumes for one request: token ids and the user's prompt dict (speaker,
    multimodal data); ``upstream`` is the previous stage's result when a stage fed it.

    ``state``: the stage's own record of the request, of the type its frontend declares
    (what :meth:`Stage.prepare` derived from the prompt, e.g. encoder inputs and rotary
    positions, or what :meth:`Stage.accept` derived from the previous stage's result).
    ``capture_hidden``: keep the request's hidden states for the next stage, set by the
    pipeline when the next stage reads them (:attr:`Stage.reads_hidden`) and the request goes on
    to it. ``stream_hidden``: also report them as they are computed (:attr:`StageStep.new_rows`),
    set when that stage takes the request fed (:class:`FedStage`).
    """

    token_ids: list[int]
    prompt: dict[str, Any]
    upstream: StageResult | None = None
    state: S | None = None
    capture_hidden: bool = False
    stream_hidden: bool = False


@dataclasses.dataclass(frozen=True)
class PromptMedia:
    """The layout of a prompt's media without their features: the ``(t, h, w)`` patch grid of
    each image and video, each video's seconds per temporal grid step, each audio clip's mel
    frames, and whether videos' audio is interleaved with their frames. What a later stage needs
    to give the prompt the rotary positions the first stage gave it."""

    image_grid_thw: tuple[tuple[int, int, int], ...] = ()
    video_grid_thw: tuple[tuple[int, int, int], ...] = ()
    video_second_per_grid: tuple[float, ...] = ()
    audio_seqlens: tuple[int, ...] = ()
    use_audio_in_video: bool = False


@dataclasses.dataclass(frozen=True)
class HiddenHandoff:
    """One request as an AR stage hands it to a next stage that reads its hidden states
    (the thinker to the talker): kept only for requests that go on to such a stage.

    ``hidden_states`` / ``embeds`` (``[N, D]``) are the hidden state (the final one, or the
    layer the next stage asked for: :attr:`~omni_jax.stages.ar.ARStage.capture_layer`) and input
    embedding of each of the ``N = len(prompt_ids) + len(reply_ids) - 1`` computed tokens: the
    prompt's, then the reply's but the last (never computed). ``media``: the layout of the
    prompt's media.

    While the stage still runs the request, a part of it (:attr:`StageStep.new_rows`): the rows
    of computed tokens ``[start, start + len(hidden_states))`` and the reply drawn so far. A
    request whose rows were reported so (:attr:`StageInput.stream_hidden`) ends with a part too:
    the rows its last step computed, with its whole reply; the stage released the earlier rows,
    which the next stage took as they came.
    """

    prompt_ids: list[int]
    reply_ids: list[int]
    hidden_states: np.ndarray
    embeds: np.ndarray
    media: PromptMedia = PromptMedia()
    start: int = 0

    @property
    def end(self) -> int:
        """One past the last computed token whose rows it holds."""
        return self.start + len(self.hidden_states)

    def since(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``(hidden, embeds)`` of computed tokens ``row`` on; ``ValueError`` when rows before
        them are missing (a part that starts after ``row``)."""
        if row < self.start:
            raise ValueError(
                f"the thinker's rows from token {row} were never handed on (these start at {self.start})"
            )
        return self.hidden_states[row - self.start :], self.embeds[row - self.start :]


@dataclasses.dataclass
class StageResult:
    """One request finished by one stage; ``error`` is set when it failed at run time.
    ``handoff``: what the next stage reads beyond the tokens, when it reads hidden states."""

    request_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict[str, Any]
    logprobs: list[dict[int, float]] | None = None
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    error: str | None = None
    handoff: HiddenHandoff | None = None


@dataclasses.dataclass(frozen=True)
class StageStep:
    """What one :meth:`Stage.step` did: the requests it finished, and the tokens each of its
    requests gained in it (``new_tokens``: request id -> token ids, finished requests' last ones
    included; empty for a stage that makes no tokens one by one). A request's new tokens over
    all its steps are its result's ``token_ids``, in order. ``new_audio``, of a stage that makes
    audio: request id -> the samples it made in this step (a chunk of a streamed request, or a
    whole waveform); over all steps they are its result's ``audio``, in order. ``new_rows``, of
    an AR stage, for each request that streams its hidden states (:attr:`StageInput.stream_hidden`)
    and computed tokens in this step: the part of its :class:`HiddenHandoff` they added (not of
    the requests it finished: their results carry the whole). ``new_logprobs``, of an AR stage,
    for each request that asked for log-probabilities (``SamplingParams.logprobs``) and gained
    tokens: one entry per new token, as its result's ``logprobs`` holds them. ``idle``: the step did nothing,
    neither dispatched nor read anything (what it has is on the device, unfinished, and it was
    not asked to block, or it waits for another stage's tokens); the engine core then blocks its
    next step rather than ask again at once."""

    finished: list[StageResult]
    new_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    new_audio: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    new_rows: dict[str, HiddenHandoff] = dataclasses.field(default_factory=dict)
    new_logprobs: dict[str, list[dict[int, float]]] = dataclasses.field(default_factory=dict)
    idle: bool = False


@dataclasses.dataclass(frozen=True)
class StageLoad:
    """What a stage holds now: requests ``running`` (in its batch: an AR stage's scheduled
    sequences) and ``waiting`` (queued for a place in it), and for a stage with a paged KV cache
    its ``free_pages`` of ``num_pages``. ``capacity``: the most requests its batch runs at once
    (an AR stage's ``max_num_seqs``; ``None`` for a stage that solves its queue in turn).
    Read by serving (queue bounds, metrics)."""

    running: int
    waiting: int
    free_pages: int | None = None
    num_pages: int | None = None
    capacity: int | None = None


class Stage(Protocol):
    """One part of a model's pipeline (a thinker, a talker, a code2wav): it takes requests with
    their params, advances them when stepped, and hands each finished one on as a
    :class:`StageResult` that the next stage may accept. What the pipeline and the engine core
    call on every stage, AR or generation, and nothing more: how a stage batches and what it
    holds stay inside it.

    A protocol rather than a base class: the stages share no implementation through it (AR
    stages and code2wav stages are built on different engines), so a stage satisfies it by its
    methods alone, and the callers depend on this interface, not on any stage's class.

    ``params_type`` is the params class a request must give this stage (checked by
    :func:`check_params`), and ``defaults`` the params a request that gives it none gets
    (:meth:`StageConfig.default_params <omni_jax.stages.config.StageConfig.default_params>`);
    ``accepts_text``: whether, as the first stage, it takes a text prompt (else token ids only).
    """

    config: StageConfig
    params_type: type[StageParams]
    defaults: StageParams
    accepts_text: bool

    def prepare(self, index: int, request: StageInput) -> StageInput:
        """The user's prompt as this (first) stage consumes it: multimodal data processed and
        its placeholders expanded, where the stage takes any. Host work only; raises
        ``ValueError`` naming request ``index`` on input in the wrong form."""

    sample_rate: int | None
    """Of the audio the stage produces (``None`` for token stages)."""
    reads_hidden: bool
    """Whether this stage reads the previous stage's hidden states (its result's
    :class:`HiddenHandoff`), not only its tokens: the pipeline reads it at build time and makes
    the previous stage capture them."""
    outputs_hidden: bool
    """Whether this stage's outputs carry each request's hidden states
    (``StageOutput.hidden_states``): an AR stage whose YAML asks for them
    (``engine.output_hidden_states: true``); it then captures them for every request."""

    def validate(
        self,
        index: int,
        request: StageInput | None,
        params: StageParams,
        prompt: dict[str, Any] | None = None,
    ) -> None:
        """Raise ``ValueError`` naming request ``index``; ``request`` is None when an earlier stage
        will produce it (then only ``params`` and the user's ``prompt`` can be checked). ``params``
        is what the user gave this stage, not yet checked: one of another stage's type is refused
        (:func:`check_params`)."""

    def connect(self, upstream: Stage) -> None:
        """Called once at build time with the stage that feeds this one; ``ValueError`` when it
        cannot feed this one."""

    def accept(self, index: int, upstream: StageResult, prompt: dict[str, Any]) -> StageInput | None:
        """The previous stage's result as this stage's input (vLLM-omni's stage input
        processor); ``None`` when there is nothing for this stage to do (the request then ends
        with empty output). ``ValueError`` when the result cannot feed this stage: the pipeline
        ends only that request, with the message."""

    def submit(self, request_id: str, request: StageInput, params: StageParams) -> None: ...

    def step(self, block: bool = True) -> StageStep:
        """Advance every request the stage holds by one step (one AR step, or one solve).
        ``block=False`` (the engine core's, while another stage has work): nothing need be
        waited for; the stage may leave a solve or step in flight, stay :meth:`has_work`, and
        report its results in a later step (``StageStep.idle`` when it did nothing)."""

    def abort(self, request_id: str) -> bool:
        """Drop the request from the stage at once, whatever it was doing, and free what it held
        (an AR stage's KV pages); False when the stage does not hold it."""

    def has_work(self) -> bool: ...

    def load(self) -> StageLoad:
        """The requests it holds now, and its free KV pages where it has a cache."""

    def warmup(self) -> int:
        """Compile ahead of traffic; returns how many programs were compiled."""


@runtime_checkable
class FedStage(Stage, Protocol):
    """A stage that can take a request while the previous stage still makes its tokens
    (streamed input: code2wav voicing the talker's codes chunk by chunk, the talker speaking the
    thinker's reply as it is written).

    For a request whose params it :meth:`streams`, the engine core calls :meth:`open` when the
    previous stage takes the request, then :meth:`feed` after each of that stage's steps with
    the request's new tokens (and, to a stage that :attr:`~Stage.reads_hidden`, the part of its
    hidden states they added), and a last time with its result when it finishes, instead of
    :meth:`Stage.accept` and :meth:`Stage.submit` on the finished result. A fed stage may finish
    the request before the stage feeding it does."""

    def streams(self, params: StageParams) -> bool:
        """Whether a request with ``params`` (validated) is fed to this stage as it is made."""

    def open(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: StageParams,
        capture_hidden: bool = False,
        stream_hidden: bool = False,
    ) -> None:
        """Take the request, before any of its tokens; its params and prompt were validated.
        ``capture_hidden``, ``stream_hidden``: what the request's :class:`StageInput` carries
        when the stage submits it, as the engine core sets them for a stage it submits to (a
        stage that captures no hidden states ignores them)."""

    def feed(
        self,
        index: int,
        request_id: str,
        tokens: list[int],
        upstream: StageResult | None,
        rows: HiddenHandoff | None = None,
    ) -> bool:
        """The request's new tokens from the previous stage (``rows``: the hidden states its
        step added, to a stage that reads them); ``upstream``: its result when these were its
        last. Returns False when the request ended with nothing for this stage to do (it is then
        dropped, as :meth:`Stage.accept` returning ``None``). ``ValueError`` naming request
        ``index`` when the tokens cannot feed this stage."""


def text_stage(stages: Sequence[Stage]) -> int | None:
    """The index of the stage that writes the reply's text (``final_output: text``); ``None``
    when none of ``stages`` does (a code2wav-only graph)."""
    return next((i for i, s in enumerate(stages) if s.config.final_output == "text"), None)


def text_only(prompt: dict[str, Any]) -> bool:
    """Whether ``prompt`` asks for no audio (``modalities`` without ``"audio"``): the request
    then ends with the stage that writes its text, and no later stage runs for it."""
    wanted = prompt.get("modalities")
    return wanted is not None and "audio" not in wanted


SHORTEST_VOICED = 2
"""The fewest reply tokens a talker voices (both families' ``generate``): a shorter reply ends
the request with the text stage, with no audio."""


def require_state(state: S | None, stage: str) -> S:
    """A request's stage state, which its frontend's ``prepare`` or ``accept`` made; a request
    without one never went through them (a bug, not bad input)."""
    if state is None:
        raise RuntimeError(f"a {stage} request has no state: its frontend's prepare or accept makes it")
    return state


def check_params(stage: Stage, index: int, params: StageParams, *args: int) -> None:
    """Type, then values (``params.validate(*args)``), naming the request and the stage."""
    if not isinstance(params, stage.params_type):
        raise ValueError(
            f"request {index}: stage {stage.config.name!r} needs {stage.params_type.__name__}, "
            f"got {type(params).__name__}"
        )
    where = f"request {index}: stage {stage.config.name!r}"
    try:
        params.validate(*args)
    except ParamError as e:
        raise ParamError(f"{where}: {e}", e.field) from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def no_multimodal(stage: Stage, index: int, request: StageInput) -> StageInput:
    """:meth:`Stage.prepare` of a stage that takes no multimodal data."""
    media = request.prompt.get("multi_modal_data")
    if media:
        kinds = " or ".join(sorted(map(str, media))) if isinstance(media, dict) else "media"
        raise ValueError(
            f"request {index}: this model takes no {kinds}: its stage {stage.config.name!r} reads no "
            "multi_modal_data"
        )
    return request


def check_ids(index: int, ids: list[int], vocab_size: int, kind: str = "token") -> None:
    """A prompt's ids are there and inside ``[0, vocab_size)``; ``kind`` names them (token, codec)."""
    if not ids:
        raise ValueError(f"request {index}: empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {index}: {kind} id {bad[0]} outside the vocabulary [0, {vocab_size})")
