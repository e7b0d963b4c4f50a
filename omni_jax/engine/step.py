"""The records of one AR step and the one interface through which a stage supplies its inputs.

The scheduler decides a step as :class:`StepRow` s, the runner executes them and returns a
:class:`StepResult`. What is particular to a model (its rotary positions, the extra inputs its
embedding merges, work a request needs before its first step) comes from the stage through
:class:`StepInputs`, which the engine calls; the stage's per-request state ``S`` rides on
each row, typed by the stage and opaque to the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import jax
import numpy as np

from omni_jax.engine.sampling import SamplingParams
from omni_jax.models.attention import AttentionMetadata

PENDING_TOKEN = 0
"""A pending token's place in a row's ``token_ids``: the runner replaces it on the device with
the token the step before drew (:attr:`StepRow.pending_token`)."""

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


@dataclasses.dataclass
class StepRow(Generic[S]):
    """One sequence's share of a step: tokens ``[start, end)`` of its full id list.

    ``capture_hidden``: the request keeps each computed token's hidden state and input
    embedding. ``state``: the stage's record of the request (``None`` for a stage that keeps
    none), for its :class:`StepInputs`. ``pending_token``: the row's last token was drawn by
    the step dispatched before this one and not yet read by the host (``token_ids`` holds
    :data:`PENDING_TOKEN` there): the runner takes it from that step's draw on the device.
    ``id_row``: the request's row of the runner's token-id table (``[max_num_seqs,
    max_model_len]``, on device), which every step writes its tokens to and the penalties read,
    so no step sends a request's ids from the host.
    """

    token_ids: Sequence[int]
    positions: np.ndarray
    pages: Sequence[int]
    start: int
    sample: bool
    params: SamplingParams
    seed: int
    draw_index: int
    id_row: int
    prompt_len: int
    suppress: Sequence[int]
    capture_hidden: bool = False
    state: S | None = None
    pending_token: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass
class StepResult:
    """What one executed step gives back to the host, in its rows' order."""

    tokens: np.ndarray  # [rows]
    finite: np.ndarray  # [rows] bool: the row's logits were all finite
    logprob_ids: np.ndarray | None  # [rows, 1 + MAX_LOGPROBS], when some row asked for logprobs
    logprobs: np.ndarray | None  # [rows, 1 + MAX_LOGPROBS]
    hidden: list[np.ndarray] | None  # per row [its tokens, D] final (normed) hidden states, when captured
    embeds: list[np.ndarray] | None  # per row [its tokens, D] the decoder's input embeddings, when captured


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlatStep:
    """Where a flat step's token rows live in the paged cache, before expansion on device.

    slots: ``[N, 1]`` the cache slot each token row writes (padding: the dropped slot).
    tables: ``[S, P]`` each sequence's page ids (padding: the null page).
    sequence: ``[N]`` which row of ``tables`` each token row reads.
    context: ``[N]`` each token row's causal horizon; query: ``[N]`` 1 for real rows, 0 for padding.
    """

    slots: jax.Array
    tables: jax.Array
    sequence: jax.Array
    context: jax.Array
    query: jax.Array

    def metadata(self, chunk_bytes: int | None = None) -> AttentionMetadata:
        """The attention's per-token-row view: each row's sequence's table, gathered here on
        device so the host sends one table per sequence rather than one per token.
        ``chunk_bytes``: the jnp path's budget per chunk of rows (:class:`AttentionMetadata`)."""
        tables = self.tables[self.sequence]
        return AttentionMetadata(self.slots, tables, self.context, self.query, chunk_bytes)


class StepInputs(Protocol[S_contra]):
    """What a stage supplies to each step of its engine: the model-specific part of a step.

    ``position_shape``: the leading axes of a token's rotary position (``()`` for 1-D RoPE,
    ``(3,)`` for M-RoPE). ``positions`` are those of a request's tokens ``[start, end)``, read
    when the scheduler places a row (after a preemption too).

    ``prepare`` runs once per step before it is packed, for work a row needs that can fail for
    one request alone (e.g. running encoders when a request is admitted); it returns
    ``{row index: message}`` for the rows that failed, which the engine ends with
    ``finish_reason="error"`` and leaves out of the step. It is the one call that may change
    the stage's request records (``state``); it changes nothing the engine owns.

    ``pack`` turns a flat step of ``tokens`` token rows into the pytree passed as ``extra`` to
    ``model.embed(tokens [N, 1], extra)``: ``rows``' tokens lie one a token row, in order, row
    ``i``'s from token row ``firsts[i]`` (the runner's layout), then padding. It reads its rows and
    changes nothing. It runs for every step (also for warm-up, with no rows); its shapes must
    come from a few buckets, and a step whose rows need nothing must get the same shapes every
    time, so decode never recompiles. It takes the scheduler's rows as they are, a prompt
    chunk one row, so its host work may go a row at a time (a slice per row, not per token).

    ``draw_hook``: device work on each step's drawn tokens (:class:`DrawHook`), ``None`` for
    a model that draws its tokens and nothing more.

    ``available`` is how many of a request's tokens have their inputs now (``None``: all of
    them): a request taken while the stage feeding it still runs (started on that stage's first
    tokens) reads inputs that arrive as that stage makes them, so its row of a
    token past them waits (the scheduler leaves it out of the step).
    """

    position_shape: tuple[int, ...]
    draw_hook: DrawHook[S_contra] | None

    def positions(self, state: S_contra | None, start: int, end: int) -> np.ndarray: ...

    def available(self, state: S_contra | None) -> int | None: ...

    def prepare(self, rows: Sequence[StepRow[S_contra]]) -> dict[int, str]: ...

    def pack(self, rows: Sequence[StepRow[S_contra]], firsts: Sequence[int], tokens: int) -> Any: ...


class DrawHook(Protocol[S_contra]):
    """A model's work on each step's drawn tokens, on device, before the host reads them: e.g. a
    talker-like stage that draws a codec frame's first code, whose second model fills the
    frame's other codebooks from the hidden state that scored it, in the same step (a reference
    may run that at the start of the next one; the frame is the same).

    ``run(model, hidden, tokens, inputs)`` is traced into one program per sequence bucket and
    ``inputs`` structure (``model``: the merged AR model; ``hidden [S, D]``: the final hidden
    state that scored each sequence's token; ``tokens [S]``: the drawn ones); it returns a
    pytree of ``[S, ...]`` arrays. ``pack(rows, sequences)`` gives ``inputs`` for a step's
    sampling rows padded to ``sequences`` (e.g. per-row draw keys; its structure may take a
    few forms, e.g. greedy or sampled, and ``warmup_inputs`` lists one of each for warm-up).
    ``record(rows, tokens, outputs)`` hands the host the results (``outputs`` fetched, cut to
    the rows) to keep in the rows' states; it is the step's last call, before the scheduler
    appends the tokens, and the one besides :meth:`StepInputs.prepare` that may change a
    request's state. ``outputs(state, ids, start)`` is what the request's stage outputs for its
    drawn ``ids[start:]`` (``ids``: all it drew; e.g. each frame's codes, frame-major).

    What the next step's input reads of a drawn token besides the token (the frame's codebook
    embeddings, summed) is its *feedback*: ``feedback(outputs)`` picks it out of ``run``'s
    outputs, ``[S, *feedback_shape]`` of ``feedback_dtype``, traced; the runner keeps the last
    step's in a fixed ``[max_rows, ...]`` buffer, so that a row whose token is still pending
    (:attr:`StepRow.pending_token`: its step scheduled before the one that drew it was read)
    gets it on the device: ``feed(extra, feedback, pending)``, traced in the forward, returns
    the packed step inputs ``extra`` with each token row where ``pending [N]`` is set reading
    its ``feedback [N, ...]`` row (which :meth:`StepInputs.pack` left empty there, not having
    it yet).
    """

    feedback_shape: tuple[int, ...]
    feedback_dtype: Any

    def run(self, model: Any, hidden: jax.Array, tokens: jax.Array, inputs: Any) -> Any: ...

    def pack(self, rows: Sequence[StepRow[S_contra]], sequences: int) -> Any: ...

    def warmup_inputs(self, sequences: int) -> list[Any]: ...

    def record(self, rows: Sequence[StepRow[S_contra]], tokens: np.ndarray, outputs: Any) -> None: ...

    def outputs(self, state: S_contra | None, ids: Sequence[int], start: int) -> list[int]: ...

    def feedback(self, outputs: Any) -> jax.Array: ...

    def feed(self, extra: Any, feedback: jax.Array, pending: jax.Array) -> Any: ...


def text_positions(state: object, start: int, end: int) -> np.ndarray:
    """1-D RoPE: a token's position is its index in the sequence."""
    del state
    return np.arange(start, end, dtype=np.int32)


def all_available(state: object) -> None:
    """Every token's inputs are there (:meth:`StepInputs.available` of a stage whose requests
    have all their inputs when they are submitted)."""
    del state


class TokenInputs:
    """The step inputs of a model that embeds its token ids alone, with 1-D rotary positions."""

    position_shape: tuple[int, ...] = ()
    draw_hook: None = None

    def positions(self, state: object, start: int, end: int) -> np.ndarray:
        return text_positions(state, start, end)

    def available(self, state: object) -> None:
        return all_available(state)

    def prepare(self, rows: Sequence[StepRow[Any]]) -> dict[int, str]:
        return {}

    def pack(self, rows: Sequence[StepRow[Any]], firsts: Sequence[int], tokens: int) -> None:
        return None
