"""The engine core: requests through the stage graph, one step at a time.

``OmniJaxPipeline.run`` and ``AsyncOmniJaxPipeline`` both drive the stages through it, so there
is one loop: :meth:`EngineCore.add` queues an admitted request (:mod:`omni_jax.intake`) on the
first stage, :meth:`EngineCore.step` advances every stage with work once, and a request a stage
finishes moves on to the next stage at once, so different requests are in different stages at
the same time and a request added between steps joins the running batch at the next one.
:meth:`EngineCore.abort` takes a request out of whichever stage holds it.

A stage that takes streamed input (a :class:`~omni_jax.stages.base.FedStage`: the talker, which
starts on the thinker's first tokens, and code2wav for a request with
``Token2WavParams(stream=True)``) holds the request at the same time as the stage before it: it
is opened when that stage takes the request and fed its new tokens (and hidden states) after
every step, so the stages work on the request together, a chain of them at once. A fed stage
may finish the request before the stage feeding it (the talker's last code before the
thinker's last token): the request ends when no stage holds it.

Each step returns typed per-request updates (:class:`~omni_jax.outputs.OmniRequestOutput`): for
a streamed request the text stage's new tokens and text as they come and the audio as it is
made, and for every request that ended its whole output, ``finished``. The core holds no thread
and no clock: its caller decides when to step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from omni_jax.engine.sampling import SamplingParams
from omni_jax.intake import Admission
from omni_jax.outputs import OmniRequestOutput, StageOutput
from omni_jax.profiling import scope
from omni_jax.stages.base import (
    FedStage,
    HiddenHandoff,
    Stage,
    StageInput,
    StageLoad,
    StageResult,
    text_only,
    text_stage,
)
from omni_jax.stop_text import StopText
from omni_jax.text_stream import TextStream


@dataclasses.dataclass
class _Flight:
    """A request on its way through the stage graph: the stages holding it (``holders``, in
    order: the one it was submitted to, then those fed as the stage before each makes its
    tokens), those that took it (``taken``), its output so far, and when streamed, the text
    stage's tokens delivered so far (and their log-probabilities, when it asked for them), and
    the audio delivered so far (``audio``, at ``sample_rate``: an aborted request's output holds
    what was played). ``rows``: per stage whose outputs carry hidden states, those it handed on to the next
    stage as they were computed (its result then holds only the rest). ``text_params``: the
    text stage's params of the request, which say what of its reply the text holds."""

    admission: Admission
    output: OmniRequestOutput
    holders: list[int] = dataclasses.field(default_factory=list)
    taken: set[int] = dataclasses.field(default_factory=set)
    stream: bool = False
    reply: list[int] = dataclasses.field(default_factory=list)
    reply_logprobs: list[dict[int, float]] | None = None
    text: TextStream | None = None
    stop: StopText | None = None
    rows: dict[int, list[np.ndarray]] = dataclasses.field(default_factory=dict)
    text_params: SamplingParams | None = None
    audio: list[np.ndarray] = dataclasses.field(default_factory=list)
    sample_rate: int | None = None

    @property
    def watched(self) -> bool:
        """Whether the core follows its reply token by token: to stream it, or to cut it at a
        stop string."""
        return self.stream or self.stop is not None

    @property
    def min_tokens(self) -> int:
        """How many of the reply's first tokens no stop string may end in (vLLM's detokenizer
        looks for one only once the reply is longer)."""
        return 0 if self.text_params is None else self.text_params.min_tokens

    def shown(self, ids: list[int], reason: str | None) -> list[int]:
        """The tokens of the reply ``ids`` whose text the reply's text holds: all but a last one
        that stopped the text stage (``reason`` ``"stop"``: a stop id or EOS, which may be an
        ordinary token with text of its own), unless the request asked for stop text
        (``include_stop_str_in_output``). vLLM's detokenizer leaves that token out so; its id
        stays in ``token_ids``."""
        keep = self.text_params is not None and self.text_params.include_stop_str_in_output
        return ids[:-1] if reason == "stop" and not keep and ids else ids

    @property
    def stage(self) -> int:
        """The first stage holding it; past the last one it took when none does (a step that
        raised between a stage finishing it and the next taking it, which :meth:`EngineCore.fail`
        then ends)."""
        return self.holders[0] if self.holders else max(self.taken, default=0) + 1

    def hold(self, stage: int) -> None:
        self.holders = sorted({*self.holders, stage})
        self.taken.add(stage)

    def fed(self, stage: int) -> bool:
        """Whether ``stage`` holds it fed: after another stage that still holds it."""
        return stage in self.holders and stage != self.holders[0]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The core between two steps: requests in the stage graph, each stage's load (by stage
    name, in stage order) and the AR tokens generated so far. What serving reports and bounds
    its queue by."""

    requests: int
    stages: dict[str, StageLoad]
    generated_tokens: int

    @property
    def first(self) -> StageLoad:
        """The first stage's load: where new requests queue."""
        return next(iter(self.stages.values()))


class EngineCore:
    """Steps a built stage graph (``stages``, first to last) for the requests added to it."""

    def __init__(self, stages: Sequence[Stage], tokenizer: Any):
        self.stages = list(stages)
        self.tokenizer = tokenizer
        self.text_stage = text_stage(self.stages)
        self.generated_tokens = 0
        """AR tokens of the stage results so far: every AR stage's drawn tokens (the talker's
        codes too; one a frame for a talker that draws frames, whose outputs are the frames' codes)."""
        self._flights: dict[str, _Flight] = {}
        self._updates: dict[str, OmniRequestOutput] = {}  # this step's, by request
        self.overlap = jax.process_count() == 1
        """Whether a stage may leave a step or solve in flight while the others step. Off, every
        step blocks: as it must when several processes step the graph in the same order (no
        stage may choose by the device's timing whether to wait for it), and as a benchmark sets
        it to see each stage's own device time in its step (``--sequential-steps``)."""
        self._stalled = False
        """The last step did nothing in any stage (each waited for its device or for another
        stage): the next one blocks, so the loop waits for a device instead of spinning."""

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.stages)

    def stats(self) -> EngineStats:
        return EngineStats(
            requests=len(self._flights),
            stages={s.config.name: s.load() for s in self.stages},
            generated_tokens=self.generated_tokens,
        )

    @property
    def request_ids(self) -> list[str]:
        """The requests in the stage graph, oldest first."""
        return list(self._flights)

    def add(self, admission: Admission, stream: bool = False) -> OmniRequestOutput:
        """Queue an admitted request on the first stage; returns its output record, which the core
        fills as stages finish it. ``stream``: report its new text tokens and audio every step
        (:meth:`step`). ``ValueError`` when a request of that id is in the graph."""
        request_id = admission.request_id
        if request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        out = OmniRequestOutput(request_id=request_id, prompt_token_ids=admission.input.token_ids)
        flight = _Flight(admission, out, stream=stream)
        params = None if self.text_stage is None else admission.stage_params[self.text_stage]
        if isinstance(params, SamplingParams):
            flight.text_params = params
            if params.stop_strings:  # intake checked the tokenizer
                flight.stop = StopText(params.stop_strings, params.include_stop_str_in_output)
        if flight.watched and self.tokenizer is not None:
            flight.text = TextStream(self.tokenizer)
        self._submit(flight, 0, admission.input)
        self._flights[request_id] = flight
        return out

    def step(self) -> list[OmniRequestOutput]:
        """Step every stage that has work once, in stage order, and hand each request a stage
        finished on to the next stage. Returns this step's updates: one per streamed request
        with new text tokens or audio (only its deltas), and each request that ended (its whole
        output, ``finished``, with the step's deltas).

        A stage steps with ``block=False`` while another stage had work when this step began:
        it may leave a solve or step in flight and report it in a later step, so the other
        stages' steps are dispatched meanwhile (on another device, they run at the same time)
        instead of waiting behind it. With nothing else to do, without :attr:`overlap` (several
        processes in lockstep), or after a step in which every stage was idle
        (``StageStep.idle``), it blocks."""
        busy = [stage.has_work() for stage in self.stages]  # once a step: a has_work may walk its requests
        wait, self._stalled = not self.overlap or self._stalled, any(busy)
        for si, stage in enumerate(self.stages):
            if not stage.has_work():
                continue
            others = any(b for sj, b in enumerate(busy) if sj != si)
            with scope(f"stage/{stage.config.name}"):
                done = stage.step(block=wait or not others)
            self._stalled = self._stalled and done.idle
            finished = {result.request_id: result.finish_reason for result in done.finished}
            if si == self.text_stage:
                for request_id, ids in done.new_tokens.items():
                    self._stream_tokens(
                        self._flights[request_id],
                        ids,
                        done.new_logprobs.get(request_id),
                        finished.get(request_id),
                    )
            if done.new_rows and stage.outputs_hidden:
                self._keep_rows(si, done.new_rows)
            fed = dict.fromkeys([*done.new_tokens, *done.new_rows])  # in order: every process feeds alike
            for request_id in (r for r in fed if r not in finished):
                flight = self._flights.get(request_id)
                if flight is not None and flight.fed(si + 1):
                    self._feed(
                        flight, si + 1, done.new_tokens.get(request_id, []), done.new_rows.get(request_id)
                    )
            for request_id, samples in done.new_audio.items():
                if request_id in self._flights:
                    self._stream_audio(self._flights[request_id], samples, stage.sample_rate)
            for result in done.finished:
                flight = self._flights.get(result.request_id)
                if flight is None:  # ended this step, by a stage after this one
                    continue
                self._stage_done(flight, si, result)
                if stage.config.kind == "ar":
                    self.generated_tokens += int(result.metrics["num_output_tokens"])
                flight.holders.remove(si)
                if not self._hand_on(flight, si, result, done.new_tokens.get(result.request_id, [])):
                    self._updates[result.request_id] = self._end(flight)
        updates, self._updates = list(self._updates.values()), {}
        return updates

    def abort(self, request_id: str, error: str | None = None) -> OmniRequestOutput | None:
        """Take the request out of the stage that holds it, which frees what it held at once
        (an AR stage's KV pages); returns its output, ``finished`` with ``finish_reason``
        ``"abort"`` (``"error"`` with ``error`` when a fault ends it), holding what was streamed
        of its text and audio. ``None`` when no such request is in the graph."""
        flight = self._flights.get(request_id)
        if flight is None:
            return None
        out = flight.output
        out.finish_reason, out.error = ("abort", None) if error is None else ("error", error)
        if flight.stream and self.text_stage is not None and flight.stage <= self.text_stage:
            out.token_ids = list(flight.reply)
            if flight.reply_logprobs is not None:
                out.logprobs = list(flight.reply_logprobs)
            if flight.text is not None:
                out.text = self.tokenizer.decode(flight.reply, skip_special_tokens=True)
                self._finish_text(flight, out, len(flight.reply))
        if flight.audio:
            out.audio, out.sample_rate = np.concatenate(flight.audio), flight.sample_rate
        return self._end(flight)

    def fail(self, error: str) -> list[OmniRequestOutput]:
        """After a step that raised: the updates it had gathered (requests it ended before the
        fault included), then every request in flight ended with ``finish_reason="error"``."""
        ended = [self.abort(request_id, error) for request_id in self.request_ids]
        updates, self._updates = list(self._updates.values()), {}
        return updates + [out for out in ended if out is not None]

    # -- one request ------------------------------------------------------------------
    def _update(self, flight: _Flight) -> OmniRequestOutput:
        """The update carrying a streamed request's deltas this step, made on first use."""
        out = flight.output
        update = self._updates.get(out.request_id)
        if update is None:
            update = self._updates[out.request_id] = OmniRequestOutput(out.request_id, out.prompt_token_ids)
        return update

    def _stream_tokens(
        self,
        flight: _Flight,
        ids: list[int],
        logprobs: list[dict[int, float]] | None,
        reason: str | None,
    ) -> None:
        """The text stage's new tokens of a watched request: its deltas when streamed, and its
        end when they complete a stop string. ``reason``: the stage's ``finish_reason`` when
        these tokens ended the request there (a stop token's text is then left out:
        :meth:`_Flight.shown`), else ``None``."""
        if not flight.watched:
            return
        start = len(flight.reply)
        flight.reply += ids
        if logprobs is not None:
            if flight.reply_logprobs is None:
                flight.reply_logprobs = []
            flight.reply_logprobs += logprobs
        text = self._new_text(flight, start, flight.shown(flight.reply, reason))
        if flight.stream:
            update = self._update(flight)
            update.token_ids_delta += ids
            if logprobs is not None:
                update.logprobs_delta += logprobs
            update.text_delta += text
        if flight.stop is not None and flight.stop.hit:
            self._updates[flight.output.request_id] = self._stopped(flight)

    @staticmethod
    def _new_text(flight: _Flight, start: int, shown: list[int]) -> str:
        """The text that the tokens ``shown[start:]`` (the reply's shown tokens so far, past
        ``start`` read before) complete, as far as it may be sent: through :class:`StopText`,
        which searches for stop strings only the text of tokens past ``min_tokens`` (those up
        to it are fed unchecked, as vLLM moves its stop check past them)."""
        if flight.text is None:
            return ""
        if flight.stop is None:
            return flight.text.update(shown)
        unchecked = min(max(start, flight.min_tokens), len(shown))  # the tokens before it: under min_tokens
        text = ""
        if unchecked > start:
            text = flight.stop.feed(flight.text.update(shown[:unchecked]), check=False)
        if len(shown) > unchecked:
            text += flight.stop.feed(flight.text.update(shown))
        return text

    def _stopped(self, flight: _Flight) -> OmniRequestOutput:
        """A stop string cut the text stage's reply: the request ends there (its stages drop it,
        freeing its KV pages), its text cut as :class:`StopText` cut it, its tokens those
        generated up to it (as vLLM reports them), ``finish_reason="stop"``."""
        assert flight.stop is not None and self.text_stage is not None
        out = flight.output
        out.token_ids, out.text, out.finish_reason = list(flight.reply), flight.stop.kept, "stop"
        logprobs = None if flight.reply_logprobs is None else list(flight.reply_logprobs)
        out.logprobs = logprobs
        name = self.stages[self.text_stage].config.name
        out.stage_outputs[name] = StageOutput(
            token_ids=list(flight.reply), finish_reason="stop", logprobs=logprobs
        )
        return self._end(flight)

    def _finish_text(self, flight: _Flight, out: OmniRequestOutput, shown: int) -> None:
        """The reply's text is whole (``out.text``, the text of its first ``shown`` tokens): what
        the stream had not sent yet, cut at a stop string (``out.text`` then ends there too; none
        counts while ``shown`` is at most ``min_tokens``), goes in the last update."""
        if flight.text is None or out.text is None:
            return
        rest = flight.text.finish(out.text)
        if flight.stop is not None:
            rest = flight.stop.feed(rest, check=shown > flight.min_tokens)
            if flight.stop.hit:
                out.text = flight.stop.kept
            else:
                rest += flight.stop.flush()
        if flight.stream:
            self._update(flight).text_delta += rest

    def _stream_audio(self, flight: _Flight, samples: np.ndarray, sample_rate: int | None) -> None:
        if not flight.stream:
            return
        flight.audio.append(samples)
        flight.sample_rate = sample_rate
        update = self._update(flight)
        previous = update.audio_delta
        update.audio_delta = samples if previous is None else np.concatenate([previous, samples])
        update.sample_rate = sample_rate

    def _feed(self, flight: _Flight, si: int, ids: list[int], rows: HiddenHandoff | None) -> None:
        """Hand fed stage ``si`` the request's new tokens (and hidden states); when it cannot
        take them, the request ends with its message (``finish_reason="error"``) and every stage
        drops it."""
        stage = cast(FedStage, self.stages[si])
        admission = flight.admission
        try:
            more = stage.feed(admission.index, admission.request_id, ids, None, rows)
        except ValueError as e:
            self._updates[admission.request_id] = self.abort(
                admission.request_id, f"stage {stage.config.name!r}: {e}"
            )
            return
        if not more:  # ended with nothing to do before the stage feeding it did (not by now)
            raise RuntimeError(f"stage {stage.config.name!r} dropped a request before its input ended")

    def _end(self, flight: _Flight) -> OmniRequestOutput:
        """The request is done: its last update, the whole output with the deltas this step
        gathered for it (``stage_outputs`` in stage order, whichever finished first: a fed
        stage can end before the one feeding it reports). The stages still holding it (it
        failed, was aborted, or one of them ended it) drop it."""
        out = flight.output
        done = out.stage_outputs
        out.stage_outputs = {s.config.name: done[s.config.name] for s in self.stages if s.config.name in done}
        for si in flight.holders:
            self.stages[si].abort(out.request_id)
        flight.holders = []
        del self._flights[out.request_id]
        update = self._updates.pop(out.request_id, None)
        if update is not None:
            out.text_delta, out.token_ids_delta = update.text_delta, update.token_ids_delta
            out.logprobs_delta = update.logprobs_delta
            out.audio_delta = update.audio_delta
        out.finished = True
        return out

    def _hand_on(self, flight: _Flight, si: int, result: StageResult, last_ids: list[int]) -> bool:
        """Hand a request stage ``si`` finished on to the next stage: feed it ``last_ids``, the
        tokens of the step that finished it, with the result when it holds the request fed, else
        submit it there (unless it took it already: a fed stage that finished first). False when
        the request is done: no stage holds it, or it failed.

        The next stage's input processor may find nothing to do (the request ends with empty
        output, e.g. no audio when the talker stopped before its first code) or input it
        cannot take (the request alone ends with ``finish_reason="error"``).
        """
        nxt = si + 1
        if result.error is not None:
            return False
        if nxt == len(self.stages) or self._done_after(flight, si):
            return bool(flight.holders)
        if nxt in flight.taken and nxt not in flight.holders:  # it took the request fed, and finished first
            return bool(flight.holders)
        stage = self.stages[nxt]
        admission = flight.admission
        try:
            if nxt in flight.holders:
                request = None
                more = cast(FedStage, stage).feed(admission.index, result.request_id, last_ids, result)
            else:
                request = stage.accept(admission.index, result, admission.prompt)
                if request is not None:
                    stage.validate(admission.index, request, admission.stage_params[nxt])
                more = request is not None
        except ValueError as e:
            flight.output.finish_reason, flight.output.error = "error", f"stage {stage.config.name!r}: {e}"
            return False
        if not more:  # done, once a stage before that still holds it (the thinker) is
            self._end_empty(flight, nxt)
            return bool(flight.holders)
        if request is not None:
            self._submit(flight, nxt, request)
        return True

    def _submit(self, flight: _Flight, si: int, request: StageInput) -> None:
        """Submit the request to stage ``si``, and open it on each next stage that takes it fed
        (:class:`~omni_jax.stages.base.FedStage`) with the request's params, in a chain: the talker
        fed by the thinker, code2wav by the talker. Each stage captures (and streams) the
        request's hidden states as :meth:`_capture_hidden` says, whether submitted here or, fed,
        once it submits the request itself."""
        admission = flight.admission
        fed = self._fed_chain(flight, si)
        request.capture_hidden = self._capture_hidden(flight, si)
        request.stream_hidden = request.capture_hidden and bool(fed)
        self.stages[si].submit(admission.request_id, request, admission.stage_params[si])
        flight.hold(si)
        for nxt in fed:
            capture = self._capture_hidden(flight, nxt)  # as for a stage submitted to here
            cast(FedStage, self.stages[nxt]).open(
                admission.request_id,
                admission.prompt,
                admission.stage_params[nxt],
                capture_hidden=capture,
                stream_hidden=capture and nxt + 1 in fed,
            )
            flight.hold(nxt)

    def _fed_chain(self, flight: _Flight, si: int) -> list[int]:
        """The stages after ``si`` that take the request fed, each by the one before it."""
        chain = []
        for nxt in range(si + 1, len(self.stages)):
            stage = self.stages[nxt]
            params = flight.admission.stage_params[nxt]
            if self._done_after(flight, nxt - 1) or not (
                isinstance(stage, FedStage) and stage.streams(params)
            ):
                break
            chain.append(nxt)
        return chain

    def _keep_rows(self, si: int, parts: dict[str, HiddenHandoff]) -> None:
        """Stage ``si``'s hidden states handed on this step, kept for its outputs."""
        for request_id, part in parts.items():
            if request_id in self._flights:
                self._flights[request_id].rows.setdefault(si, []).append(part.hidden_states)

    def _capture_hidden(self, flight: _Flight, si: int) -> bool:
        """Whether stage ``si`` captures the request's hidden states: its outputs carry them,
        or the next stage reads them and the request goes on to it."""
        return self.stages[si].outputs_hidden or (
            si + 1 < len(self.stages)
            and self.stages[si + 1].reads_hidden
            and not self._done_after(flight, si)
        )

    def _end_empty(self, flight: _Flight, si: int) -> None:
        """Stages ``si`` on had nothing to do: their outputs are empty (audio of zero samples),
        and those holding the request drop it (stage ``si`` fed, it may have dropped it already;
        one after it was opened fed and would wait for input that never comes)."""
        for held in [h for h in flight.holders if h >= si]:
            self.stages[held].abort(flight.output.request_id)
            flight.holders.remove(held)
        out = flight.output
        for stage in self.stages[si:]:
            out.stage_outputs[stage.config.name] = StageOutput(token_ids=[], finish_reason="stop")
            if stage.config.final_output == "audio":
                out.audio = np.zeros((0,), np.float32)
                out.sample_rate = stage.sample_rate

    def _done_after(self, flight: _Flight, stage_index: int) -> bool:
        """``modalities=["text"]``: the request ends with the stage that produces its text."""
        produces_text = self.stages[stage_index].config.final_output == "text"
        return text_only(flight.admission.prompt) and produces_text

    def _stage_done(self, flight: _Flight, stage_index: int, result: StageResult) -> None:
        stage = self.stages[stage_index]
        out = flight.output
        hidden = None
        if stage.outputs_hidden and result.handoff is not None:
            hidden = np.concatenate([*flight.rows.pop(stage_index, []), result.handoff.hidden_states])
        out.stage_outputs[stage.config.name] = StageOutput(
            token_ids=list(result.token_ids),
            finish_reason=result.finish_reason,
            hidden_states=hidden,
            logprobs=result.logprobs or None,
        )
        out.metrics[stage.config.name] = result.metrics
        if result.error is not None:
            out.finish_reason, out.error = "error", f"stage {stage.config.name!r}: {result.error}"
            return
        if stage.config.final_output == "text":
            out.token_ids = list(result.token_ids)
            out.finish_reason = result.finish_reason
            out.logprobs = result.logprobs
            shown = flight.shown(result.token_ids, result.finish_reason)
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(shown, skip_special_tokens=True)
            self._finish_text(flight, out, len(shown))
            if flight.stop is not None and flight.stop.hit:  # completed by the tokens that ended it
                out.finish_reason = out.stage_outputs[stage.config.name].finish_reason = "stop"
        elif stage.config.final_output == "audio":
            out.audio, out.sample_rate = result.audio, result.sample_rate
            if self.text_stage is None:
                # Without a text stage the request's tokens are the codes it was voiced from.
                out.token_ids, out.finish_reason = list(result.token_ids), result.finish_reason
                if flight.stream:
                    self._update(flight).token_ids_delta = list(result.token_ids)
