"""``SamplingParams`` (vLLM's names and semantics) and the batched, jitted sampler.

Every parameter is per request inside one batch: the host packs them into
:class:`SamplingTensors` rows and one compiled function applies penalties, temperature,
min-p, top-k and top-p and draws. Randomness is batch-invariant: a row's key is its own seed
folded with the index of the token being drawn, never a key shared across the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20
"""The most top log-probabilities a request may ask for (vLLM's ``max_logprobs`` default):
every step that returns any computes this many, so one program serves every request."""

SeedT = TypeVar("SeedT", int, np.ndarray)

SUPPRESS_WIDTH = 16
"""Token ids one row may have suppressed in one step (its stop ids under ``min_tokens``, a
stage's never-sampled ids): a fixed width, so suppression never makes a new program."""


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: a Python or numpy int, never a bool (``True`` is an int to
    Python, but never a count or a seed a caller meant) nor a float (``2.5`` tokens is no count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number: a Python or numpy int or float, never a bool, a string
    or ``None`` (each of which Python would compare or format without complaint, or fail on with a
    ``TypeError`` that names no request)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def is_bool(value: object) -> bool:
    """Whether ``value`` is ``True`` or ``False`` (a numpy bool too): a truthy string such as
    ``"no"`` must not silently switch a flag on."""
    return isinstance(value, (bool, np.bool_))


FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_finite(value: object) -> bool:
    """Whether a real ``value`` is finite as a float32: the stages pack these values into float32
    rows, where a larger one (``1e39``, or an int too large for a float) is infinite and the
    request's arithmetic turns to NaN at run time instead of being refused at admission."""
    try:
        return abs(float(value)) <= FLOAT32_MAX  # type: ignore[arg-type]  # NaN compares False
    except OverflowError:
        return False


class ParamError(ValueError):
    """A params field with a wrong value; ``field`` names it (the server's 400 names it as its
    ``param``: the request fields of the same names)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


FieldType = tuple[str, Callable[[object], bool], bool, str]
"""``(name, type check, None allowed, what the field must be)`` for :func:`check_field_types`."""


def check_field_types(params: object, fields: Sequence[FieldType]) -> None:
    """Raise ``ValueError`` naming the first field of ``params`` whose value has the wrong type.

    Run before the range checks, so that those compare numbers only: a wrong type gets the same
    ``name=value must be ...`` message as a value out of range (the caller adds the request
    index), never a ``TypeError`` from a comparison or a value accepted because it compares."""
    for name, check, nullable, what in fields:
        value = getattr(params, name)
        if value is None and nullable:
            continue
        if not check(value):
            raise ParamError(f"{name}={value!r} must be {what}{' or None' if nullable else ''}", name)


TOP_K_ALL = 2**31 - 1
"""The largest ``top_k`` a row's int32 column holds: a request's larger ``top_k`` keeps every
token, as this one does (no vocabulary is that large), so it is packed as this."""

SEED_RANGE = "from -2**63 to 2**64 - 1"
"""The seeds a request may give, as the messages say it: torch's ``manual_seed`` range, each read
as a 64-bit word, and ``-1`` as no seed, as vLLM reads it
(:func:`~omni_jax.parallel.distributed.request_seed`)."""


MAX_STOP_CHARS = 65536
"""The most characters a request's ``stop`` strings may hold together (OpenAI allows 4 stop
strings, vLLM any). Their number costs a step nothing (:class:`~omni_jax.stop_text.StopText`
looks the text ending in each new character up by length), but stop strings of many distinct
lengths do: each new character of a reply is looked up once per length of those ending in it,
and their setup grows with their size; crafted so (lengths 2, 3, 4, ... all ending in the
character the reply repeats), megabytes of them would slow every request in the batch."""


def seed_in_range(seed: int | None) -> bool:
    """Whether ``seed`` is ``None`` or in :data:`SEED_RANGE`."""
    return seed is None or -(2**63) <= seed < 2**64


MIN_TEMPERATURE = 1e-2
"""The lowest temperature a sampled row draws at; a request's lower one (above 0) is raised to
it, as vLLM raises it. Logits divided by 1e-9 reach 1e10, and XLA's softmax of those comes out
NaN, which truncation then drops whole, so every draw fell to token 0."""


def drawn_temperature(temperature: float) -> float:
    """The temperature a row draws at: 0 (greedy) as given, any other at least
    :data:`MIN_TEMPERATURE`."""
    return max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0


_SAMPLING_TYPES: tuple[FieldType, ...] = (
    ("temperature", is_real, False, "a real number >= 0"),
    ("top_p", is_real, False, "a real number in (0, 1]"),
    ("top_k", is_int, False, "an integer, -1 or 0 (off) or >= 1"),
    ("min_p", is_real, False, "a real number in [0, 1]"),
    ("repetition_penalty", is_real, False, "a real number > 0"),
    ("presence_penalty", is_real, False, "a real number in [-2, 2]"),
    ("frequency_penalty", is_real, False, "a real number in [-2, 2]"),
    ("seed", is_int, True, f"an integer {SEED_RANGE}"),
    ("max_tokens", is_int, True, "an integer >= 1"),
    ("min_tokens", is_int, False, "an integer >= 0"),
    ("ignore_eos", is_bool, False, "True or False"),
    ("logprobs", is_int, True, f"an integer in [0, {MAX_LOGPROBS}]"),
    ("include_stop_str_in_output", is_bool, False, "True or False"),
)
"""Each :class:`SamplingParams` field's type (``stop_token_ids`` and ``stop`` are checked on
their own)."""


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How one AR stage decodes one request (field names and meaning follow vLLM).

    Slotted: assigning a field it does not have (a misspelling, or vLLM's ``n`` or
    ``prompt_logprobs``, which are not served) raises ``AttributeError`` instead of being
    silently ignored."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 (vLLM's): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (a str is one stop string). The engine core cuts the text stage's
        reply at the first one (:class:`~omni_jax.stop_text.StopText`); no sampler reads them."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type, else the first out of
        range (``stop_token_ids`` outside ``[0, vocab_size)`` too); types come first so that the
        range checks only ever compare numbers."""
        check_field_types(self, _SAMPLING_TYPES)
        stops = self.stop_token_ids
        if stops is not None and not isinstance(stops, (list, tuple)):
            raise ParamError(
                f"stop_token_ids={stops!r} must be a list of token ids (ints) or None", "stop_token_ids"
            )
        for t in stops or []:
            if not is_int(t):
                raise ParamError(
                    f"stop_token_ids contains {t!r}, which is not a token id (an int)", "stop_token_ids"
                )
        strings = self.stop
        if not (
            strings is None
            or isinstance(strings, str)
            or (isinstance(strings, (list, tuple)) and all(isinstance(x, str) for x in strings))
        ):
            raise ParamError(f"stop={strings!r} must be a str, a list of str or None", "stop")
        if any(not x for x in self.stop_strings):
            raise ParamError("stop strings must not be empty", "stop")
        chars = sum(map(len, self.stop_strings))
        if chars > MAX_STOP_CHARS:
            raise ParamError(
                f"stop strings hold {chars} characters together, at most {MAX_STOP_CHARS}", "stop"
            )
        checks = [
            (
                "temperature",
                is_finite(self.temperature) and self.temperature >= 0,
                "must be finite (as a float32) and >= 0",
            ),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 or 0 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "repetition_penalty",
                is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be finite (as a float32) and > 0",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"must not exceed max_tokens={self.max_tokens!r}",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("seed", seed_in_range(self.seed), f"must be an integer {SEED_RANGE}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ParamError(f"{name}={getattr(self, name)!r} {why}", name)
        for t in stops or []:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ParamError(
                    f"stop_token_ids contains {t!r}, outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a penalty reads the request's ids (the sampler's history form)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling inputs of one step, ``[B]`` unless noted.

    history: ``[B, L]`` prompt + output token ids (padded with ``-1``) for the penalties; the
    AR runner reads them from its id table on the device (:func:`pack_sampling` leaves one
    ``-1`` column, for the forms without penalties).
    prompt_lens: how many leading ``history`` entries are prompt (penalties differ).
    seeds: ``[B, 2]`` uint32 raw threefry keys made from each request's seed.
    draw_index: which output token of its request each row draws (folded into its key).
    suppress: ``[B, S]`` token ids to forbid this step (EOS under ``min_tokens``; ``-1`` pad).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    history: jax.Array
    prompt_lens: jax.Array
    seeds: jax.Array
    draw_index: jax.Array
    suppress: jax.Array


def _penalise(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    b, v = logits.shape
    hist = st.history
    valid = hist >= 0
    idx = jnp.where(valid, hist, v)  # out of range -> dropped by the scatters
    is_output = jnp.arange(hist.shape[1])[None, :] >= st.prompt_lens[:, None]
    rows = jnp.arange(b)[:, None]
    seen = jnp.zeros((b, v), bool).at[rows, idx].set(True, mode="drop")
    counts = (
        jnp.zeros((b, v), jnp.float32).at[rows, idx].add((valid & is_output).astype(jnp.float32), mode="drop")
    )
    rep = st.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - st.frequency_penalty[:, None] * counts
    return logits - st.presence_penalty[:, None] * (counts > 0)


def _truncate(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Apply min-p, top-k and top-p to temperature-scaled logits (``-inf`` outside)."""
    v = logits.shape[-1]
    neg = jnp.finfo(jnp.float32).min
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= st.min_p[:, None] * probs.max(axis=-1, keepdims=True)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(st.top_k < 1, v, jnp.minimum(st.top_k, v))
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    keep &= logits >= kth  # ties with the k-th value stay, as in transformers
    sorted_probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, neg), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    n_keep = jnp.maximum(jnp.sum(mass_before < st.top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    keep &= logits >= pth
    return jnp.where(keep, logits, -jnp.inf)


def _adjusted(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Penalties and suppression: what changes a greedy row's choice (truncation never does)."""
    b, v = logits.shape
    needs_penalty = jnp.any(
        (st.repetition_penalty != 1) | (st.presence_penalty != 0) | (st.frequency_penalty != 0)
    )
    x = jax.lax.cond(needs_penalty, _penalise, lambda lg, _: lg, logits, st)
    suppressed = jnp.where(st.suppress >= 0, st.suppress, v)  # -1 padding -> out of range, dropped
    return x.at[jnp.arange(b)[:, None], suppressed].set(-jnp.inf, mode="drop")


def processed_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The distribution a sampled row draws from: penalties, suppression, temperature, truncation.

    Same order as transformers' ``generate`` (repetition penalty, temperature, top-k, top-p,
    min-p); min-p compares probabilities with the row's largest, which truncation keeps, so
    applying it as one more mask is the same as applying it last.
    """
    temp = jnp.where(st.temperature > 0, st.temperature, 1.0)
    return _truncate(_adjusted(logits, st) / temp[:, None], st)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first of tied maxima) as a max and a masked min.

    XLA on CPU runs ``argmax`` as one reduction over (value, index) pairs that does not
    vectorise, where these two plain reductions do, and it runs on every step. A row holding
    NaN matches nowhere and gets the last id (its non-finite logits end the request anyway).
    """
    v = x.shape[-1]
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1), v - 1)


def _draw(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Gumbel-max over the processed logits for sampled rows, argmax for greedy rows."""
    x = processed_logits(logits, st)
    v = x.shape[-1]

    def noise(seed: jax.Array, index: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), index)
        return jax.random.gumbel(key, (v,), jnp.float32)

    gumbel = jax.vmap(noise)(st.seeds, st.draw_index)
    return first_argmax(jnp.where(st.temperature[:, None] > 0, x + gumbel, x))


def draw_tokens(logits: jax.Array, st: SamplingTensors, *, greedy: bool) -> jax.Array:
    """One token per row of float32 ``logits [B, V]``: ``[B]`` int32.

    ``greedy`` (static: every row has temperature 0) takes the argmax after penalties and
    suppression and never sorts the vocabulary: truncation only drops tokens below the
    largest, so it cannot change a greedy choice. It is a program of its own, not a
    ``lax.cond`` on the rows: on XLA's CPU backend the mere presence of the sampling branch
    (sort, noise) slowed the greedy path it skipped. The sampling program serves
    greedy rows exactly too (their processed logits keep every maximum and get no noise), so a
    step mixing both, or any step with penalties, runs it.
    """
    if greedy:
        return first_argmax(_adjusted(logits, st)).astype(jnp.int32)
    return _draw(logits, st).astype(jnp.int32)


def top_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ids [B, 1 + K], logprobs [B, 1 + K])`` with ``K =`` :data:`MAX_LOGPROBS`: column 0 is
    the drawn token, then the top ``K`` of the model's raw distribution (vLLM's default); the
    host keeps each request's first ``1 + logprobs`` columns."""
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(raw_logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    token_lp = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)
    ids = jnp.concatenate([tokens[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return ids, jnp.concatenate([token_lp, top_lp], axis=-1)


def seed_words(seed: SeedT) -> tuple[SeedT, SeedT]:
    """A 64-bit seed as the two uint32 words of a raw threefry key (an int, or a uint64 array of
    seeds: every row's at once)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def pack_sampling(
    params: Sequence[SamplingParams],
    prompt_lens: Sequence[int],
    seeds: Sequence[int],
    draw_index: Sequence[int],
    suppress: Sequence[Sequence[int]],
    batch: int,
) -> SamplingTensors:
    """Host-side numpy rows for :func:`draw_tokens`, padded to ``batch`` rows (bucketed);
    suppression :data:`SUPPRESS_WIDTH` wide."""
    n = len(params)

    def col(values: list[float], dtype: type, pad: float) -> np.ndarray:
        return np.asarray(values + [pad] * (batch - n), dtype)

    supp = np.full((batch, SUPPRESS_WIDTH), -1, np.int32)
    for i, s in enumerate(suppress):
        if len(s) > SUPPRESS_WIDTH:
            raise ValueError(f"{len(s)} token ids to suppress in one row, at most {SUPPRESS_WIDTH}")
        if s:
            supp[i, : len(s)] = s
    seed_rows = np.zeros((batch, 2), np.uint32)
    seed_rows[:n, 0], seed_rows[:n, 1] = seed_words(np.fromiter(seeds, np.uint64, n))
    return SamplingTensors(
        temperature=col([drawn_temperature(p.temperature) for p in params], np.float32, 0.0),
        top_k=col([min(p.top_k, TOP_K_ALL) for p in params], np.int32, -1),
        top_p=col([p.top_p for p in params], np.float32, 1.0),
        min_p=col([p.min_p for p in params], np.float32, 0.0),
        repetition_penalty=col([p.repetition_penalty for p in params], np.float32, 1.0),
        presence_penalty=col([p.presence_penalty for p in params], np.float32, 0.0),
        frequency_penalty=col([p.frequency_penalty for p in params], np.float32, 0.0),
        history=np.full((batch, 1), -1, np.int32),
        prompt_lens=col(list(prompt_lens), np.int32, 0),
        seeds=seed_rows,
        draw_index=col(list(draw_index), np.int32, 0),
        suppress=supp,
    )
