"""Qwen3-Omni's talker served by the generic AR stage: thinker states in, codec frames out.

This is the reference's ``Qwen3OmniMoeForConditionalGeneration.generate`` hand-off for one
request. For a thinker prompt of ``L`` tokens that generated ``g_0 .. g_{G-1}`` (``e``: the
thinker's input embedding of each computed token, ``h``: its hidden state of layer
``accept_hidden_layer``, which the thinker captures for the talker, :attr:`ARStage.capture_layer`):

- the talker's prompt is the thinker prompt's *user-turn* tokens (those whose last
  ``<|im_start|>`` is followed by the user role), each ``text_projection(e)``, or
  ``hidden_projection(h)`` at audio, image and video placeholders; then the last assistant turn
  ``a`` (``<|im_start|>assistant``): ``text_projection`` of ``e`` at ``a, a+1, a+2``, of the
  text pad four times, of the text BOS and of ``e`` at ``a+3`` (``g_0`` for the usual
  three-token header), the last six adding the codec embeddings of nothink, think-BOS,
  think-EOS, the speaker, codec pad and codec BOS. System turns are not voiced;
- generated step ``j`` (its token is frame ``j``'s first code) reads the sum of frame ``j``'s
  codebook embeddings plus ``text_projection`` of the next text row: ``e`` at ``a+4+j`` while
  the reply lasts, then the text EOS once, then the text pad for ever;
- each drawn first code's frame is filled by the code predictor in the same step, on device
  (:class:`FrameHook`, the engine's :class:`~omni_jax.engine.step.DrawHook`), from the final
  hidden state that scored the code; the reference runs it at the start of the next step,
  which computes the same frame. A frame whose first code is codec EOS ends the request and is
  not voiced; a request cut by ``max_tokens`` keeps its last frame (the reference, which
  predicts a frame only when it feeds it back, drops it);
- rotary positions are Qwen3-Omni's ``get_rope_index`` of the user-turn thinker ids followed
  by nine text pads, with the prompt's media grids and audio lengths but
  ``use_audio_in_video`` off, as the reference passes it to the talker.

The stage's outputs are the frames' codes, frame-major (each frame's ``num_code_groups`` codes
consecutive), which the Qwen3 code2wav stage takes as they come. Projections run inside the
talker's step (:class:`~omni_jax.models.qwen3_omni.talker.ThinkerRows`), so the host keeps
thinker-width rows and no projection program of its own. A thinker reply of fewer than two
tokens leaves no first text row to voice: the request ends with empty audio (the reference
cannot build its prompt then).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.engine.sampling import seed_words
from omni_jax.engine.step import StepRow
from omni_jax.models.qwen3_omni.code_predictor import FrameSampling
from omni_jax.models.qwen3_omni.rope_index import RopeIndexSpec, media_rope_index
from omni_jax.models.qwen3_omni.talker import (
    PROJECT_HIDDEN,
    PROJECT_NONE,
    PROJECT_TEXT,
    Talker,
    TalkerEmbeds,
    TalkerSpec,
    ThinkerRows,
)
from omni_jax.stages.base import (
    SHORTEST_VOICED,
    HiddenHandoff,
    PromptMedia,
    Stage,
    StageInput,
    StageResult,
    require_state,
    text_only,
)
from omni_jax.stages.rows import GrowingRows
from omni_jax.stages.talker import TalkerPositions
from omni_jax.voices import default_voice, voice_named

PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8
"""The code predictor's truncation whenever the talker samples (``prepare_inputs_for_generation``
passes these; its temperature is its generation config's 1)."""

DEFAULT_SPEAKER = "Ethan"
"""``generate``'s default ``speaker``."""

FRAME_KEY_SALT = 0x5BD1E995
"""Mixed into a request's seed for its frames' code predictor keys, so they differ from the keys
its first codes are drawn with (the engine's sampler: the seed folded with the draw index)."""


ASSISTANT_TURN = "<|im_start|>assistant"
"""How the chat template opens the assistant turn the talker voices (the tokens ``im_start``,
``assistant`` of :class:`PromptTokens`)."""


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    """The thinker-vocabulary ids the hand-off reads (the top-level ``Qwen3OmniMoeConfig``'s)."""

    im_start: int
    user: int
    assistant: int
    tts_bos: int
    tts_eos: int
    tts_pad: int

    @classmethod
    def from_hf(cls, cfg: Any) -> PromptTokens:
        return cls(
            cfg.im_start_token_id,
            cfg.user_token_id,
            cfg.assistant_token_id,
            cfg.tts_bos_token_id,
            cfg.tts_eos_token_id,
            cfg.tts_pad_token_id,
        )


@dataclasses.dataclass
class TalkerRequest:
    """The talker's state of one request (its :attr:`StageInput.state`, opaque to the engine).

    thinker: ``[P, D_thinker]`` the prompt's thinker rows; project: ``[P]`` which projection
        reads each (:data:`~omni_jax.models.qwen3_omni.talker.PROJECT_TEXT` or ``_HIDDEN``).
    add_codec: ``[P]`` whether the prompt position adds its codec id's embedding.
    trailing: ``[R, D_thinker]`` the text rows generated steps read (then the text pad).
    taken: the thinker's computed tokens whose rows it holds (the prompt's and ``trailing``'s).
    positions, rope_delta: the prompt's M-RoPE positions and the decode offset.
    final: ``trailing`` is whole (it ends with the text EOS); while the thinker still writes
        the reply it grows (:meth:`Qwen3TalkerFrontend.grow`), and a step waits for its row.
    frames, sums: per drawn first code, its frame's codes ``[G]`` and codebook-embedding sum
        ``[D]`` (what the next step reads), filled by :class:`FrameHook`.
    """

    thinker: np.ndarray
    project: np.ndarray
    add_codec: np.ndarray
    trailing: GrowingRows
    taken: int
    positions: np.ndarray
    rope_delta: int
    final: bool
    frames: list[np.ndarray] = dataclasses.field(default_factory=list)
    sums: list[np.ndarray] = dataclasses.field(default_factory=list)

    def available(self) -> int | None:
        """Tokens whose rows are there (``None``: all, ``trailing`` is whole)."""
        return None if self.final else len(self.project) + len(self.trailing)


class TalkerStepInputs(TalkerPositions):
    """The talker's :class:`~omni_jax.engine.step.StepInputs`: M-RoPE positions, each step's
    :class:`TalkerEmbeds` packed from its rows' states (host side), and the code predictor as
    the draw hook."""

    def __init__(self, spec: TalkerSpec, dtype: np.dtype):
        """``pad_row``, the thinker's embedding of the text pad, is set when the stage meets the
        thinker (:meth:`Qwen3TalkerFrontend.connect`)."""
        self.width = spec.text.hidden_size
        self.thinker_width = spec.thinker_hidden_size
        self.dtype = dtype
        self.pad_row = np.zeros((self.thinker_width,), dtype)
        self.draw_hook = FrameHook(spec, dtype)

    def pack(
        self, rows: Sequence[StepRow[TalkerRequest]], firsts: Sequence[int], tokens: int
    ) -> TalkerEmbeds:
        """Each token row's thinker row and projection, and its codec input: a prompt token's
        from the request's prompt tables; a reply token's, its frame's codebook-embedding sum
        (once the host has it; before, :class:`FrameHook` feeds it on the device) and the text
        row it reads (past the reply's text: the pad). The prompt's a slice per step row (a
        prompt chunk is most of a prompt step's tokens), the reply's a token at a time (one a
        decode row)."""
        sums = np.zeros((tokens, 1, self.width), self.dtype)
        add_codec = np.zeros((tokens, 1), bool)
        thinker = np.zeros((tokens, 1, self.thinker_width), self.dtype)
        project = np.full((tokens, 1), PROJECT_NONE, np.int32)
        for row, first in zip(rows, firsts, strict=True):
            req = require_state(row.state, "talker")
            start, end, prompt = row.start, row.end, len(req.project)
            base = first - start  # token p lies in token row base + p
            if start < prompt:
                b = min(end, prompt)
                thinker[base + start : base + b, 0] = req.thinker[start:b]
                project[base + start : base + b, 0] = req.project[start:b]
                add_codec[base + start : base + b, 0] = req.add_codec[start:b]
            for j in range(max(start, prompt) - prompt, end - prompt):  # reply token j = p - prompt
                t = base + prompt + j
                if j < len(req.sums):  # else its frame is still on the device (FrameHook.feed)
                    sums[t, 0] = req.sums[j]
                thinker[t, 0] = req.trailing[j] if j < len(req.trailing) else self.pad_row
                project[t, 0] = PROJECT_TEXT
        return TalkerEmbeds(sums, add_codec, ThinkerRows(thinker, project))


class FrameHook:
    """The code predictor as the talker's :class:`~omni_jax.engine.step.DrawHook`: each drawn
    first code's frame, greedy when the request's talker is, else sampled with the reference's
    truncation (:data:`PREDICTOR_TOP_K`, :data:`PREDICTOR_TOP_P`) from a key of its own per frame
    (the request's seed, salted, and the frame's index: batch-invariant)."""

    def __init__(self, spec: TalkerSpec, dtype: np.dtype):
        self.spec = spec
        self.feedback_shape = (spec.text.hidden_size,)
        self.feedback_dtype = dtype

    def run(self, model: Talker, hidden: jax.Array, tokens: jax.Array, inputs: FrameSampling | None) -> Any:
        return model.frame(hidden, tokens, inputs)

    def feedback(self, outputs: tuple[jax.Array, jax.Array]) -> jax.Array:
        """Each frame's codebook-embedding sum ``[S, D]``: the next step's codec input."""
        return outputs[1].astype(self.feedback_dtype)

    def feed(self, extra: TalkerEmbeds, feedback: jax.Array, pending: jax.Array) -> TalkerEmbeds:
        """A pending first code's step reads its frame's sum from the device (``feedback [N, D]``)
        where the host packed none (:meth:`TalkerStepInputs.pack`)."""
        rows = jnp.where(pending[:, None, None], feedback[:, None, :], extra.rows)
        return dataclasses.replace(extra, rows=rows)

    def pack(self, rows: Sequence[StepRow[TalkerRequest]], sequences: int) -> FrameSampling | None:
        """``None`` (the greedy program) when no row samples, else every row's draw."""
        if all(r.params.greedy for r in rows):
            return None
        sampling = self._padded(sequences)
        for i, r in enumerate(rows):
            if not r.params.greedy:
                sampling.temperature[i] = 1.0
                hi, lo = seed_words(r.seed ^ FRAME_KEY_SALT)
                sampling.keys[i] = hi, (lo + r.draw_index * 0x9E3779B9) & 0xFFFFFFFF
        return sampling

    def warmup_inputs(self, sequences: int) -> list[FrameSampling | None]:
        return [None, self._padded(sequences)]

    @staticmethod
    def _padded(sequences: int) -> FrameSampling:
        """Greedy rows of the reference's truncation, to be filled per sampling row."""
        return FrameSampling(
            temperature=np.zeros((sequences,), np.float32),
            top_k=np.full((sequences,), PREDICTOR_TOP_K, np.int32),
            top_p=np.full((sequences,), PREDICTOR_TOP_P, np.float32),
            keys=np.zeros((sequences, 2), np.uint32),
        )

    def record(self, rows: Sequence[StepRow[TalkerRequest]], tokens: np.ndarray, outputs: Any) -> None:
        """Keep each sampling row's frame and sum as its request's ``draw_index``-th."""
        codes, sums = outputs
        for i, r in enumerate(rows):
            if not r.sample:
                continue
            req = require_state(r.state, "talker")
            del req.frames[r.draw_index :], req.sums[r.draw_index :]
            req.frames.append(codes[i])
            req.sums.append(sums[i])

    def outputs(self, state: TalkerRequest | None, ids: Sequence[int], start: int) -> list[int]:
        """The frames' codes of drawn ``ids[start:]``, frame-major, codec EOS's frame left out."""
        req = require_state(state, "talker")
        eos = self.spec.codec_eos
        return [int(c) for j in range(start, len(ids)) if ids[j] != eos for c in req.frames[j]]


class Qwen3TalkerFrontend:
    """The Qwen3-Omni talker's :class:`~omni_jax.stages.ar.ARFrontend` (module docstring)."""

    reads_hidden = True
    suppress_ids: tuple[int, ...] = ()  # the talker's logits suppress its specials themselves

    def __init__(
        self, model: Talker, tokens: PromptTokens, rope: RopeIndexSpec, default_speaker: str | None = None
    ):
        """``default_speaker``: the voice of a prompt that names none (the stage YAML's; ``None``:
        ``generate``'s :data:`DEFAULT_SPEAKER`); ``ValueError`` when the config has no such voice."""
        spec = model.talker_spec
        self.spec = spec
        self.tokens = tokens
        self.rope = rope
        self.eos_token_ids = (spec.codec_eos,)
        self.speakers = dict(spec.speakers)
        self.default_speaker = default_voice(default_speaker or DEFAULT_SPEAKER, self.speakers)
        self.placeholders = np.array([rope.audio_token_id, rope.image_token_id, rope.video_token_id])
        dtype = np.dtype(model.model.embed_tokens.embedding.dtype)
        self.step_inputs = TalkerStepInputs(spec, dtype)
        self.text_embeds: dict[int, np.ndarray] = {}

    @classmethod
    def build(
        cls, model: Talker, path: Path, hf_config: Any, default_speaker: str | None = None
    ) -> Qwen3TalkerFrontend:
        del path  # the voices are codec ids in the config
        tokens, rope = PromptTokens.from_hf(hf_config), RopeIndexSpec.from_hf(hf_config.thinker_config)
        return cls(model, tokens, rope, default_speaker)

    def prepare(self, index: int, request: StageInput) -> StageInput:
        raise ValueError(f"request {index}: the talker reads the thinker's output, not a prompt")

    def warmup(self) -> int:
        """Nothing beyond the AR steps (the code predictor is the draw hook's program)."""
        return 0

    def check_prompt(self, index: int, prompt: dict[str, Any]) -> None:
        """The voice, and, when the reply is to be spoken, an assistant turn to voice (what the
        talker's prompt is built from): a bare prompt is refused before any work, not after the
        thinker has run."""
        self._speaker(index, prompt)
        if text_only(prompt):
            return
        if "prompt_token_ids" in prompt:
            has_turn = len(self._assistant_starts(prompt["prompt_token_ids"])) > 0
        else:
            has_turn = ASSISTANT_TURN in prompt.get("prompt", "")
        if not has_turn:
            raise ValueError(
                f"request {index}: the talker voices the prompt's last assistant turn ({ASSISTANT_TURN}) "
                "and this prompt has none: build it with chat_prompt(), or ask for modalities ['text']"
            )

    def _speaker(self, index: int, prompt: dict[str, Any]) -> int:
        """The codec id of the voice ``prompt["speaker"]`` names (case-insensitive, as
        ``generate`` looks it up: the config's names are lower case; :func:`voice_named`), or of
        the default voice."""
        return self.speakers[voice_named(index, prompt.get("speaker", self.default_speaker), self.speakers)]

    def connect(self, upstream: Stage) -> None:
        """Keep the thinker's embeddings of the text specials (BOS, EOS, pad) and have it
        capture layer ``accept_hidden_layer`` for this stage; ``ValueError`` when ``upstream``
        is not an AR stage of the thinker's width."""
        from omni_jax.stages.ar import ARStage  # the stage module imports frontends' protocol

        if not isinstance(upstream, ARStage):
            raise ValueError(f"the talker reads an AR stage's hidden states, not {upstream.config.name!r}'s")
        t = self.tokens
        ids = [t.tts_bos, t.tts_eos, t.tts_pad]
        rows = np.asarray(upstream.embed_tokens(ids), self.step_inputs.dtype)
        if rows.shape[-1] != self.spec.thinker_hidden_size:
            raise ValueError(
                f"the talker's thinker_hidden_size {self.spec.thinker_hidden_size} differs from the "
                f"thinker's width {rows.shape[-1]}"
            )
        self.text_embeds = dict(zip(ids, rows, strict=True))
        self.step_inputs.pad_row = self.text_embeds[t.tts_pad]
        upstream.capture_layer = self.spec.accept_hidden_layer

    def accept(
        self, index: int, upstream: StageResult, prompt: dict[str, Any]
    ) -> StageInput[TalkerRequest] | None:
        """The thinker's :class:`~omni_jax.stages.base.HiddenHandoff` as the talker's prompt
        (module docstring); ``None`` when the reply is too short to voice."""
        handoff = upstream.handoff
        if handoff is None:
            raise ValueError("the thinker kept no hidden states for this request")
        n, g = len(handoff.prompt_ids), len(handoff.reply_ids)
        if g < SHORTEST_VOICED:
            return None
        computed = n + g - 1
        if len(handoff.hidden_states) != computed or len(handoff.embeds) != computed:
            raise ValueError(
                f"the thinker kept {len(handoff.hidden_states)} hidden states, expected {computed}"
            )
        request = self._request(index, handoff, prompt, True)
        request.upstream = upstream
        return request

    def start(
        self, index: int, part: HiddenHandoff, prompt: dict[str, Any]
    ) -> StageInput[TalkerRequest] | None:
        """The talker's prompt from the thinker's rows so far (``part``, from the first token),
        once its reply has two tokens (a shorter one is not voiced) and the rows of the last
        assistant turn's first four tokens are computed (the prompt reads them); ``None`` before."""
        if len(part.reply_ids) < SHORTEST_VOICED or part.end < self._assistant(part.prompt_ids) + 4:
            return None
        return self._request(index, part, prompt, False)

    def grow(self, state: TalkerRequest, part: HiddenHandoff, final: bool) -> None:
        """Append the input embeddings of the thinker's tokens computed since (``part``) to the
        text rows; ``final``: ``part`` is its result's (every row, or the last step's when it
        streamed them), and the text EOS ends them."""
        _, embeds = part.since(state.taken)
        state.trailing.extend(np.asarray(embeds, self.step_inputs.dtype))
        state.taken += len(embeds)
        if final:
            state.trailing.extend(self.text_embeds[self.tokens.tts_eos][None])
            state.final = True

    def _assistant_starts(self, prompt_ids: list[int]) -> np.ndarray:
        """Where each assistant turn of ``prompt_ids`` starts (its ``<|im_start|>``)."""
        ids, t = np.asarray(prompt_ids), self.tokens
        return np.flatnonzero((ids[:-1] == t.im_start) & (ids[1:] == t.assistant))

    def _assistant(self, prompt_ids: list[int]) -> int:
        """Where the last assistant turn starts (its ``<|im_start|>``); ``ValueError`` when none."""
        starts = self._assistant_starts(prompt_ids)
        if not len(starts):
            raise ValueError(f"the thinker prompt has no assistant turn ({ASSISTANT_TURN}) to voice")
        return int(starts[-1])

    def _request(
        self, index: int, handoff: HiddenHandoff, prompt: dict[str, Any], final: bool
    ) -> StageInput[TalkerRequest]:
        """The request from ``handoff``'s rows (every computed token's from the first, those of
        the last assistant turn's first four tokens among them); ``final``: they are all."""
        t, dtype = self.tokens, self.step_inputs.dtype
        prompt_ids = np.asarray(handoff.prompt_ids)
        a = self._assistant(handoff.prompt_ids)
        user = np.flatnonzero(self._user_mask(prompt_ids))
        media = np.isin(prompt_ids[user], self.placeholders)
        embeds = np.asarray(handoff.embeds, dtype)
        hidden = np.asarray(handoff.hidden_states, dtype)
        user_rows = np.where(media[:, None], hidden[user], embeds[user])
        pad, bos = self.text_embeds[t.tts_pad], self.text_embeds[t.tts_bos]
        assistant = embeds[a : a + 4]
        thinker = np.concatenate([user_rows, assistant[:3], [pad] * 4, [bos], assistant[3:4]])
        project = np.full(len(thinker), PROJECT_TEXT, np.int32)
        project[: len(user)][media] = PROJECT_HIDDEN
        spec = self.spec
        codec = [spec.codec_nothink, spec.codec_think_bos, spec.codec_think_eos, self._speaker(index, prompt)]
        codec += [spec.codec_pad, spec.codec_bos]
        talker_ids = np.full(len(thinker), spec.codec_pad, np.int64)
        talker_ids[-len(codec) :] = codec
        add_codec = np.zeros(len(thinker), bool)
        add_codec[-len(codec) :] = True
        rope_ids = [*prompt_ids[user].tolist(), *[t.tts_pad] * (len(thinker) - len(user))]
        try:
            positions, delta = media_rope_index(
                self.rope, rope_ids, dataclasses.replace(handoff.media, use_audio_in_video=False)
            )
        except (ValueError, IndexError) as e:
            raise ValueError(str(e) or "the thinker prompt's placeholders do not match its media") from None
        if isinstance(delta, float):
            raise ValueError("the talker's positions are fractional (the thinker's video time steps are)")
        trailing = GrowingRows(np.zeros((0, thinker.shape[1]), dtype))
        state = TalkerRequest(thinker, project, add_codec, trailing, a + 4, positions, delta, final=False)
        self.grow(state, handoff, final)
        return StageInput(talker_ids.tolist(), prompt, state=state)

    def _user_mask(self, ids: np.ndarray) -> np.ndarray:
        """Whether each prompt token is in a user turn: the token after its last
        ``<|im_start|>`` (the first token's when none) is the user role, as ``generate`` reads it."""
        pos = np.arange(len(ids))
        last_start = np.maximum.accumulate(np.where(ids == self.tokens.im_start, pos, -1))
        role = ids[np.minimum(np.maximum(last_start, 0) + 1, len(ids) - 1)]
        return role == self.tokens.user

    def describe(self, state: TalkerRequest | None) -> str:
        """Nothing to add: the talker's prompt is the thinker's user turns and the reply's start."""
        return ""

    def fed_length(self, prompt_ids: list[int], reply_room: int) -> int | None:
        """The user turns' tokens, then the reply's start: the assistant turn's first three
        tokens, four pads, the BOS and its fourth token (:meth:`_request`); ``None`` when the
        reply cannot be long enough to voice."""
        if reply_room < SHORTEST_VOICED:
            return None
        return int(self._user_mask(np.asarray(prompt_ids)).sum()) + 3 + 4 + 1 + 1

    def media(self, state: TalkerRequest | None) -> PromptMedia:
        """None: the talker's prompt holds no media of its own."""
        return PromptMedia()
