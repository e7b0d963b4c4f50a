"""Qwen2.5-Omni's talker served by the generic AR stage: the thinker's states in, codec tokens out.

This is the reference's ``Qwen2_5OmniForConditionalGeneration.generate`` hand-off, per request
(the reference batches it with left padding and then patches each row's reply stream; one
request at a time needs no patching). For a thinker prompt of ``L`` tokens that generated
``g_0 .. g_{G-1}`` (``h``: final hidden state + input embedding of each computed thinker token,
multimodal placeholders' embeddings zeroed):

- the talker's prompt is ``L`` codec-``mask`` ids, then codec ``pad`` and ``bos``; only the
  repetition penalty reads those ids, since its embeddings are ``h`` of the ``L`` prompt tokens,
  then the speaker's text-BOS embedding (+ codec ``pad``), then ``h(g_0)`` (+ codec ``bos``);
- each generated code ``k`` is embedded as ``codec(code_k) + reply[min(k, G - 1)]``, where
  ``reply`` is ``h(g_1) .. h(g_{G-2})``, then the embeddings of the text EOS and text pad
  tokens (the last repeats once the reply runs out);
- rotary positions are ``get_rope_index`` of the thinker prompt's ids followed by the speaker's
  BOS and ``g_0``, with the prompt's multimodal grids;
- codec ``bos`` is never sampled, and codec ``eos`` or ``pad`` stops.

The thinker's side arrives as its result's :class:`~omni_jax.stages.base.HiddenHandoff`
(prompt and reply ids, ``h`` as hidden states and input embeddings, the prompt's media
layout); the speaker is the user's choice in the prompt. A thinker that generated fewer than
two tokens leaves nothing to voice: the request ends with empty audio (the reference has no
reply stream to start from in that case).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omni_jax.engine.step import StepRow
from omni_jax.models.qwen2_5_omni.rope_index import media_rope_index, positions_for
from omni_jax.models.qwen2_5_omni.speakers import Voices
from omni_jax.models.qwen2_5_omni.talker import Talker, TalkerEmbeds
from omni_jax.stages.base import (
    SHORTEST_VOICED,
    HiddenHandoff,
    PromptMedia,
    Stage,
    StageInput,
    StageResult,
    require_state,
)
from omni_jax.stages.rows import GrowingRows


@dataclasses.dataclass
class TalkerRequest:
    """The talker's state of one request (its :attr:`StageInput.state`, opaque to the engine).

    ``table``: ``[P + G, E]`` the ``P = L + 2`` prompt embeddings, then the ``G`` reply rows;
    token ``p`` reads row ``min(p, P + G - 1)``. ``codec_from``: tokens from ``L`` on also add
    their codec embedding. ``final``: the table is whole; while the thinker still writes the
    reply, it grows (:meth:`TalkerFrontend.grow`) and token ``p`` waits for row ``p``.
    """

    table: GrowingRows
    codec_from: int
    positions: np.ndarray
    rope_delta: int
    final: bool

    def available(self) -> int | None:
        """Tokens whose rows are there (``None``: all, the table is whole)."""
        return None if self.final else len(self.table)


class PromptPositions(Protocol):
    """A talker request's state as its positions read it: the prompt's M-RoPE positions and
    the decode offset; and how many of its tokens have their inputs."""

    positions: np.ndarray
    rope_delta: int

    def available(self) -> int | None: ...


class TalkerPositions:
    """What the talkers' step inputs share (Qwen2.5-Omni's and Qwen3-Omni's): M-RoPE positions
    from the request's prompt positions and decode offset, the tokens whose thinker rows are
    there (all, once the thinker has finished), and nothing to prepare, as every row's inputs
    are on the host once they are there."""

    position_shape = (3,)

    def positions(self, state: PromptPositions | None, start: int, end: int) -> np.ndarray:
        t = require_state(state, "talker")
        return positions_for(t.positions, t.rope_delta, start, end)

    def available(self, state: PromptPositions | None) -> int | None:
        return require_state(state, "talker").available()

    def prepare(self, rows: Sequence[StepRow[Any]]) -> dict[int, str]:
        return {}


class TalkerStepInputs(TalkerPositions):
    """The talker's :class:`~omni_jax.engine.step.StepInputs`: M-RoPE positions, and each
    step's :class:`TalkerEmbeds` packed from its rows' tables (host side)."""

    draw_hook = None  # one codec token a step, nothing more

    def __init__(self, width: int, dtype: np.dtype):
        self.width = width
        self.dtype = dtype

    def pack(
        self, rows: Sequence[StepRow[TalkerRequest]], firsts: Sequence[int], tokens: int
    ) -> TalkerEmbeds:
        """Each token row's input row (past the table's end: its last row, the text pad) and
        whether it adds its codec id's embedding; slices per step row, no call a token."""
        table = np.zeros((tokens, 1, self.width), self.dtype)
        add_codec = np.zeros((tokens, 1), bool)
        for row, first in zip(rows, firsts, strict=True):
            req = require_state(row.state, "talker")
            start, end, rows_held = row.start, row.end, len(req.table)
            base = first - start  # token p lies in token row base + p
            own = min(end, rows_held)  # tokens before it read their own row
            if start < own:
                table[base + start : base + own, 0] = req.table[start:own]
            if own < end:
                table[base + max(start, own) : base + end, 0] = req.table[rows_held - 1]
            add_codec[base + max(start, req.codec_from) : base + end, 0] = True
        return TalkerEmbeds(table, add_codec)


class TalkerFrontend:
    """The talker's :class:`~omni_jax.stages.ar.ARFrontend` (see the module docstring)."""

    reads_hidden = True

    def __init__(self, model: Talker, voices: Voices):
        spec = model.talker_spec
        self.spec = spec
        self.voices = voices
        self.eos_token_ids = (spec.codec_pad, spec.codec_eos)  # generate's talker_eos_token_id
        self.suppress_ids = (spec.codec_bos,)
        self.placeholders = np.array(
            [spec.rope_index.audio_token_id, spec.rope_index.image_token_id, spec.rope_index.video_token_id]
        )
        dtype = np.dtype(model.model.embed_tokens.embedding.dtype)
        self.step_inputs = TalkerStepInputs(spec.embedding_size, dtype)
        self.text_embeds: dict[int, np.ndarray] = {}

    @classmethod
    def build(cls, model: Talker, path: Path, default_speaker: str | None) -> TalkerFrontend:
        return cls(model, Voices.load(path, default_speaker))

    def prepare(self, index: int, request: StageInput) -> StageInput:
        raise ValueError(f"request {index}: the talker reads the thinker's output, not a prompt")

    def warmup(self) -> int:
        """Nothing beyond the AR steps: the talker has no encoder."""
        return 0

    def check_prompt(self, index: int, prompt: dict[str, Any]) -> None:
        self._bos(index, prompt)

    def _bos(self, index: int, prompt: dict[str, Any]) -> int:
        """The text-stream BOS of the request's voice."""
        speaker = self.voices.pick(index, prompt)
        if speaker.bos_token is None:
            raise ValueError(f"request {index}: speaker {speaker.name!r} has no bos_token for the talker")
        return speaker.bos_token

    def connect(self, upstream: Stage) -> None:
        """Keep the thinker's embeddings of the text tokens the talker reads (every voice's BOS,
        text EOS and pad); ``ValueError`` when ``upstream`` is not an AR stage."""
        from omni_jax.stages.ar import ARStage  # the stage module imports frontends' protocol

        if not isinstance(upstream, ARStage):
            raise ValueError(f"the talker reads an AR stage's hidden states, not {upstream.config.name!r}'s")
        spec = self.spec
        ids = [spec.text_eos, spec.text_pad]
        ids += [s.bos_token for s in self.voices.speakers.values() if s.bos_token is not None]
        rows = np.asarray(upstream.embed_tokens(ids), self.step_inputs.dtype)
        width = rows.shape[-1]
        if width != spec.embedding_size:
            raise ValueError(
                f"the talker's embedding_size {spec.embedding_size} differs from the thinker's width {width}"
            )
        self.text_embeds = dict(zip(ids, rows, strict=True))

    def accept(
        self, index: int, upstream: StageResult, prompt: dict[str, Any]
    ) -> StageInput[TalkerRequest] | None:
        """The thinker's :class:`~omni_jax.stages.base.HiddenHandoff` as the talker's prompt (see
        the module docstring); ``None`` when the reply is too short to voice."""
        handoff = upstream.handoff
        if handoff is None:
            raise ValueError("the thinker kept no hidden states for this request")
        n, g = len(handoff.prompt_ids), len(handoff.reply_ids)
        if g < SHORTEST_VOICED:
            return None
        if len(handoff.hidden_states) != n + g - 1:
            raise ValueError(
                f"the thinker kept {len(handoff.hidden_states)} hidden states, expected {n + g - 1}"
            )
        request = self._request(index, handoff, prompt, final=True)
        request.upstream = upstream
        return request

    def start(
        self, index: int, part: HiddenHandoff, prompt: dict[str, Any]
    ) -> StageInput[TalkerRequest] | None:
        """The talker's prompt from the thinker's rows so far (``part``, from the first token),
        once its reply has two tokens (a shorter one is not voiced) and the first is computed:
        the prompt reads the rows up to it; ``None`` before."""
        if len(part.reply_ids) < SHORTEST_VOICED or part.end < len(part.prompt_ids) + 1:
            return None
        return self._request(index, part, prompt, final=False)

    def grow(self, state: TalkerRequest, part: HiddenHandoff, final: bool) -> None:
        """Append the rows of the thinker's tokens computed since (``part``); ``final``: ``part``
        is its result's (every row, or the last step's when it streamed them), and the text EOS and
        pad rows end the table."""
        spec, dtype = self.spec, self.step_inputs.dtype
        hidden, embeds = part.since(len(state.table) - 1)  # the table holds the BOS beside the rows
        state.table.extend((hidden + np.asarray(embeds, dtype)).astype(dtype))
        if final:
            state.table.extend(np.stack([self.text_embeds[spec.text_eos], self.text_embeds[spec.text_pad]]))
            state.final = True

    def _request(
        self, index: int, handoff: HiddenHandoff, prompt: dict[str, Any], final: bool
    ) -> StageInput[TalkerRequest]:
        """The request from ``handoff``'s rows (every computed token's from the first, the
        reply's first token among them); ``final``: they are all."""
        spec, dtype = self.spec, self.step_inputs.dtype
        prompt_ids, generated = handoff.prompt_ids, handoff.reply_ids
        n = len(prompt_ids)
        embeds = np.array(handoff.embeds[:n], dtype)
        embeds[np.isin(prompt_ids, self.placeholders)] = 0  # the reference voices no media rows
        bos = self._bos(index, prompt)
        try:
            positions, delta = media_rope_index(
                spec.rope_index, [*prompt_ids, bos, generated[0]], handoff.media
            )
        except (ValueError, IndexError) as e:
            raise ValueError(str(e) or "the thinker prompt's placeholders do not match its media") from None
        rows = np.concatenate(
            [(handoff.hidden_states[:n] + embeds).astype(dtype), self.text_embeds[bos][None]]
        )
        state = TalkerRequest(GrowingRows(rows), n, positions, delta, final=False)
        self.grow(state, handoff, final)
        ids = [spec.codec_mask] * n + [spec.codec_pad, spec.codec_bos]
        return StageInput(ids, prompt, state=state)

    def describe(self, state: TalkerRequest | None) -> str:
        """Nothing to add: the talker's prompt is codec ids, one per thinker prompt token."""
        return ""

    def fed_length(self, prompt_ids: list[int], reply_room: int) -> int | None:
        """One codec id per thinker prompt token, then the pad and BOS (:meth:`_request`);
        ``None`` when the reply cannot be long enough to voice."""
        return None if reply_room < SHORTEST_VOICED else len(prompt_ids) + 2

    def media(self, state: TalkerRequest | None) -> PromptMedia:
        """None: the talker's prompt holds no media of its own."""
        return PromptMedia()
